//! Splitting input text on special tokens before pre-tokenization (llama.cpp's
//! `tokenizer_st_partition`).
//!
//! Special tokens (control, user-defined, unknown) are tried longest first; every occurrence in a
//! still-raw fragment becomes a token fragment, the text around it stays raw. Without
//! `parse_special`, control and unknown tokens are not matched but user-defined ones still are
//! (as in HF tokenizers). Tokens flagged `LSTRIP`/`RSTRIP` swallow the whitespace before/after.

use std::ops::Range;

use super::TokenId;
use super::vocab::{TokenAttrs, Vocab};

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Fragment {
    /// A byte range of the input, still to be tokenized.
    Text(Range<usize>),
    Token(TokenId),
}

/// C's `isspace` in the "C" locale, which llama.cpp uses for the strip flags.
fn is_c_space(byte: u8) -> bool {
    matches!(byte, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

pub(crate) fn partition(text: &str, vocab: &Vocab, parse_special: bool) -> Vec<Fragment> {
    let mut fragments = Vec::new();
    if text.is_empty() {
        return fragments;
    }
    fragments.push(Fragment::Text(0..text.len()));
    let bytes = text.as_bytes();
    for &id in &vocab.special_by_length {
        let attrs = vocab.attrs(id);
        if !parse_special && attrs.contains_any(TokenAttrs::CONTROL | TokenAttrs::UNKNOWN) {
            continue;
        }
        let needle = vocab.texts[id as usize].as_str();
        if !text.contains(needle) {
            continue;
        }
        let mut next = Vec::with_capacity(fragments.len() + 2);
        for fragment in fragments {
            let Fragment::Text(range) = fragment else {
                next.push(fragment);
                continue;
            };
            let mut start = range.start;
            let end = range.end;
            while let Some(found) = text[start..end].find(needle) {
                let match_start = start + found;
                let mut left_end = match_start;
                if attrs.contains_any(TokenAttrs::LSTRIP) {
                    while left_end > start && is_c_space(bytes[left_end - 1]) {
                        left_end -= 1;
                    }
                }
                if left_end > start {
                    next.push(Fragment::Text(start..left_end));
                }
                next.push(Fragment::Token(id));
                start = match_start + needle.len();
                if attrs.contains_any(TokenAttrs::RSTRIP) {
                    while start < end && is_c_space(bytes[start]) {
                        start += 1;
                    }
                }
            }
            if start < end {
                next.push(Fragment::Text(start..end));
            }
        }
        fragments = next;
    }
    fragments
}
