//! Pre-tokenization: splitting a text fragment into words before BPE, with llama.cpp's exact
//! semantics (`unicode_regex_split`).
//!
//! Pieces are tracked as codepoint counts. Each [`SplitRule`] re-splits every current piece;
//! the text between two matches becomes a piece of its own. Regex rules run like llama.cpp's
//! `std::regex` fallback:
//! * a regex using `\p{L}`, `\p{N}`, `\p{P}`, `\p{M}`, `\p{S}` (or `\p{Lu}`…) runs over a
//!   "collapsed" text where each non-ASCII codepoint is replaced by one stand-in per category
//!   (whitespace → U+000B), and each `\p{X}` by that stand-in plus its ASCII members — so
//!   categories come from llama.cpp's flags, not from the regex engine's own tables;
//! * any other regex runs over the text with non-ASCII whitespace replaced by U+000B.

use std::ops::Range;

use fancy_regex::Regex;

use super::TokenizerError;
use super::presets::SplitRule;
use super::unicode::{CodepointClass, Flags};

/// Stand-ins of the collapsed text, one per codepoint class (llama.cpp uses the bytes 0xD0–0xD5).
const COLLAPSED_OTHER: char = '\u{D0}';
const COLLAPSED_WHITESPACE: char = '\u{0B}';

fn collapsed_char(class: CodepointClass) -> char {
    match class {
        CodepointClass::Number => '\u{D1}',
        CodepointClass::Letter => '\u{D2}',
        CodepointClass::Punctuation => '\u{D3}',
        CodepointClass::AccentMark => '\u{D4}',
        CodepointClass::Symbol => '\u{D5}',
        _ => COLLAPSED_OTHER,
    }
}

/// `\p{…}` names llama.cpp collapses, with the class-body that replaces them: the stand-in plus
/// the ASCII members of the category.
const CATEGORY_EXPANSIONS: &[(&str, &str)] = &[
    (r"\p{N}", r"\x{D1}0-9"),
    (r"\p{L}", r"\x{D2}A-Za-z"),
    (r"\p{P}", r"\x{D3}!-#%-*,-/:-;?-@\[-\]_\{\}"),
    (r"\p{M}", r"\x{D4}"),
    (r"\p{S}", r"\x{D5}\$\+<->\^`\|~"),
    (r"\p{Lu}", r"\x{D2}A-Za-z"),
    (r"\p{Ll}", r"\x{D2}A-Za-z"),
    (r"\p{Lt}", r"\x{D2}A-Za-z"),
    (r"\p{Lm}", r"\x{D2}A-Za-z"),
    (r"\p{Lo}", r"\x{D2}A-Za-z"),
];

fn uses_categories(pattern: &str) -> bool {
    CATEGORY_EXPANSIONS
        .iter()
        .any(|(name, _)| pattern.contains(name))
}

/// Rewrites `\p{X}` for the collapsed text (llama.cpp's `regex_expr_collapsed`).
fn collapse_pattern(pattern: &str) -> Result<String, String> {
    if !pattern.is_ascii() {
        return Err("regex mixes unicode categories and non-ASCII characters".to_string());
    }
    let bytes = pattern.as_bytes();
    let mut out = String::with_capacity(pattern.len() * 2);
    let mut inside_class = false;
    let mut i = 0;
    while i < bytes.len() {
        let escaped = i > 0 && bytes[i - 1] == b'\\';
        match bytes[i] {
            b'[' if !escaped => {
                inside_class = true;
                out.push('[');
                i += 1;
                continue;
            }
            b']' if inside_class && !escaped => {
                inside_class = false;
                out.push(']');
                i += 1;
                continue;
            }
            _ => {}
        }
        let rest = &pattern[i..];
        if let Some((name, body)) = CATEGORY_EXPANSIONS
            .iter()
            .find(|(name, _)| rest.starts_with(name))
        {
            if inside_class {
                out.push_str(body);
            } else {
                out.push('[');
                out.push_str(body);
                out.push(']');
            }
            i += name.len();
            continue;
        }
        out.push(char::from(bytes[i]));
        i += 1;
    }
    Ok(out)
}

/// A regex rule, compiled for the text variant it runs on.
#[derive(Debug)]
struct CompiledRegex {
    regex: Regex,
    on_collapsed_text: bool,
}

#[derive(Debug)]
enum CompiledRule {
    Gpt2,
    Llama3 {
        max_digits: usize,
        marks_join_letters: bool,
    },
    Newlines,
    Regex(CompiledRegex),
}

/// A compiled pre-tokenizer: an ordered list of split rules.
#[derive(Debug)]
pub(crate) struct PreTokenizer {
    rules: Vec<CompiledRule>,
}

impl PreTokenizer {
    pub fn new(pre_name: &str, rules: &[SplitRule]) -> Result<PreTokenizer, TokenizerError> {
        let compiled = rules
            .iter()
            .map(|rule| {
                Ok(match *rule {
                    SplitRule::Gpt2 => CompiledRule::Gpt2,
                    SplitRule::Llama3 {
                        max_digits,
                        marks_join_letters,
                    } => CompiledRule::Llama3 {
                        max_digits,
                        marks_join_letters,
                    },
                    SplitRule::Newlines => CompiledRule::Newlines,
                    SplitRule::Regex(pattern) => {
                        CompiledRule::Regex(compile_regex(pre_name, pattern)?)
                    }
                })
            })
            .collect::<Result<Vec<_>, TokenizerError>>()?;
        Ok(PreTokenizer { rules: compiled })
    }

    /// Splits `text` into words; returns their byte ranges, in order, covering all of `text`.
    pub fn split(&self, text: &str) -> Vec<Range<usize>> {
        let mut ctx = SplitContext::new(text);
        let mut pieces = vec![ctx.chars.len()];
        for rule in &self.rules {
            pieces = match rule {
                CompiledRule::Gpt2 => split_gpt2(&ctx.chars, &pieces),
                CompiledRule::Llama3 {
                    max_digits,
                    marks_join_letters,
                } => split_llama3(&ctx.chars, &pieces, *max_digits, *marks_join_letters),
                CompiledRule::Newlines => split_newlines(&ctx.chars, &pieces),
                CompiledRule::Regex(compiled) => ctx.split_regex(compiled, &pieces),
            };
        }
        let mut words = Vec::with_capacity(pieces.len());
        let mut start = 0;
        for len in pieces {
            let end = start + len;
            words.push(ctx.byte_offsets[start]..ctx.byte_offsets[end]);
            start = end;
        }
        words
    }
}

fn compile_regex(pre_name: &str, pattern: &str) -> Result<CompiledRegex, TokenizerError> {
    let invalid = |reason: String| TokenizerError::InvalidPreTokenizerRegex {
        pre: pre_name.to_string(),
        pattern: pattern.to_string(),
        reason,
    };
    let on_collapsed_text = uses_categories(pattern);
    let source = if on_collapsed_text {
        collapse_pattern(pattern).map_err(invalid)?
    } else {
        pattern.to_string()
    };
    let regex = Regex::new(&source).map_err(|e| invalid(e.to_string()))?;
    Ok(CompiledRegex {
        regex,
        on_collapsed_text,
    })
}

/// A text variant the regexes run on, with the byte offset of every codepoint.
struct TextVariant {
    text: String,
    byte_offsets: Vec<usize>,
}

impl TextVariant {
    fn build(chars: &[char], map: impl Fn(char) -> char) -> TextVariant {
        let mut text = String::with_capacity(chars.len());
        let mut byte_offsets = Vec::with_capacity(chars.len() + 1);
        for &c in chars {
            byte_offsets.push(text.len());
            text.push(map(c));
        }
        byte_offsets.push(text.len());
        TextVariant { text, byte_offsets }
    }

    /// Codepoint index of a byte offset that starts a codepoint.
    fn codepoint_at(&self, byte: usize) -> usize {
        self.byte_offsets.partition_point(|&b| b < byte)
    }
}

struct SplitContext {
    chars: Vec<char>,
    byte_offsets: Vec<usize>,
    collapsed: Option<TextVariant>,
    whitespace_folded: Option<TextVariant>,
}

impl SplitContext {
    fn new(text: &str) -> SplitContext {
        let mut chars = Vec::with_capacity(text.len());
        let mut byte_offsets = Vec::with_capacity(text.len() + 1);
        for (offset, c) in text.char_indices() {
            chars.push(c);
            byte_offsets.push(offset);
        }
        byte_offsets.push(text.len());
        SplitContext {
            chars,
            byte_offsets,
            collapsed: None,
            whitespace_folded: None,
        }
    }

    fn split_regex(&mut self, compiled: &CompiledRegex, pieces: &[usize]) -> Vec<usize> {
        let chars = &self.chars;
        let variant = if compiled.on_collapsed_text {
            self.collapsed.get_or_insert_with(|| {
                TextVariant::build(chars, |c| {
                    if c.is_ascii() {
                        c
                    } else if c.is_whitespace() {
                        COLLAPSED_WHITESPACE
                    } else {
                        Flags::of(c).class().map_or(COLLAPSED_OTHER, collapsed_char)
                    }
                })
            })
        } else {
            self.whitespace_folded.get_or_insert_with(|| {
                TextVariant::build(chars, |c| {
                    if !c.is_ascii() && c.is_whitespace() {
                        COLLAPSED_WHITESPACE
                    } else {
                        c
                    }
                })
            })
        };
        split_with_regex(variant, &compiled.regex, pieces)
    }
}

fn split_with_regex(variant: &TextVariant, regex: &Regex, pieces: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(pieces.len());
    let mut piece_start = 0;
    for &len in pieces {
        let piece_end = piece_start + len;
        let base = variant.byte_offsets[piece_start];
        let haystack = &variant.text[base..variant.byte_offsets[piece_end]];
        let mut last = piece_start;
        for found in regex.find_iter(haystack) {
            let Ok(found) = found else {
                // Backtracking limit hit: keep the rest of the piece whole rather than fail.
                tracing::warn!("pre-tokenizer regex gave up on a piece; keeping it unsplit");
                break;
            };
            let start = variant.codepoint_at(base + found.start());
            let end = variant.codepoint_at(base + found.end());
            if start > last {
                out.push(start - last);
            }
            if end > start {
                out.push(end - start);
            }
            last = end;
        }
        if piece_end > last {
            out.push(piece_end - last);
        }
        piece_start = piece_end;
    }
    out
}

/// Cursor over one piece for the hand-written splitters: positions outside the piece read as
/// "out of range" (no codepoint, no flags), like llama.cpp's `_get_cpt` / `_get_flags`.
struct Piece<'a> {
    chars: &'a [char],
    start: usize,
    end: usize,
    out: &'a mut Vec<usize>,
    prev_end: usize,
}

impl Piece<'_> {
    fn char_at(&self, pos: usize) -> Option<char> {
        (self.start..self.end)
            .contains(&pos)
            .then(|| self.chars[pos])
    }

    fn flags_at(&self, pos: usize) -> Flags {
        self.char_at(pos).map_or(Flags::OUT_OF_RANGE, Flags::of)
    }

    /// Ends the current word at `end`; returns its length.
    fn emit(&mut self, end: usize) -> usize {
        let len = end - self.prev_end;
        if len > 0 {
            self.out.push(len);
        }
        self.prev_end = end;
        len
    }

    /// `'s|'t|'re|'ve|'m|'ll|'d` at `pos` (ASCII case-insensitive when asked): its length.
    fn contraction_len(&self, pos: usize, ignore_case: bool) -> Option<usize> {
        if self.char_at(pos) != Some('\'') || pos + 1 >= self.end {
            return None;
        }
        let fold = |c: Option<char>| {
            c.map(|c| {
                if ignore_case {
                    c.to_ascii_lowercase()
                } else {
                    c
                }
            })
        };
        let next = fold(self.char_at(pos + 1));
        if matches!(next, Some('s' | 't' | 'm' | 'd')) {
            return Some(2);
        }
        if pos + 2 < self.end {
            let pair = (next, fold(self.char_at(pos + 2)));
            if matches!(
                pair,
                (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l'))
            ) {
                return Some(3);
            }
        }
        None
    }

    /// `\s+(?!\S)` then `\s+` at `pos`: the new position, or `None` without whitespace.
    fn trailing_whitespace_end(&self, pos: usize, run: usize) -> Option<usize> {
        if run > 1 && self.char_at(pos + run).is_some() {
            Some(pos + run - 1)
        } else if run > 0 {
            Some(pos + run)
        } else {
            None
        }
    }
}

fn for_each_piece(
    chars: &[char],
    pieces: &[usize],
    mut split_piece: impl FnMut(&mut Piece<'_>),
) -> Vec<usize> {
    let mut out = Vec::with_capacity(pieces.len());
    let mut start = 0;
    for &len in pieces {
        let mut piece = Piece {
            chars,
            start,
            end: start + len,
            out: &mut out,
            prev_end: start,
        };
        split_piece(&mut piece);
        start += len;
    }
    out
}

fn is_cr_or_lf(c: Option<char>) -> bool {
    matches!(c, Some('\r' | '\n'))
}

/// GPT-2: `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
fn split_gpt2(chars: &[char], pieces: &[usize]) -> Vec<usize> {
    for_each_piece(chars, pieces, |p| {
        let mut pos = p.start;
        while pos < p.end {
            let c = p.char_at(pos);
            if let Some(len) = p.contraction_len(pos, false) {
                pos += p.emit(pos + len);
                continue;
            }
            let space = usize::from(c == Some(' '));
            let mut flags = p.flags_at(pos + space);
            let is_other =
                |f: Flags| !(f.is_whitespace || f.is_letter() || f.is_number()) && f.is_some();
            let run_while = |pred: &dyn Fn(Flags) -> bool, flags: &mut Flags, pos: &mut usize| {
                *pos += space;
                while pred(*flags) {
                    *pos += 1;
                    *flags = p.flags_at(*pos);
                }
            };
            if flags.is_letter() {
                run_while(&|f: Flags| f.is_letter(), &mut flags, &mut pos);
                p.emit(pos);
                continue;
            }
            if flags.is_number() {
                run_while(&|f: Flags| f.is_number(), &mut flags, &mut pos);
                p.emit(pos);
                continue;
            }
            if is_other(flags) {
                run_while(&is_other, &mut flags, &mut pos);
                p.emit(pos);
                continue;
            }
            let run = (0..)
                .take_while(|&k| p.flags_at(pos + k).is_whitespace)
                .count();
            if let Some(end) = p.trailing_whitespace_end(pos, run) {
                pos = end;
                p.emit(pos);
                continue;
            }
            pos += 1;
            p.emit(pos);
        }
    })
}

/// The llama3 / qwen2 / qwen35 family (see [`SplitRule::Llama3`]).
fn split_llama3(
    chars: &[char],
    pieces: &[usize],
    max_digits: usize,
    marks_join_letters: bool,
) -> Vec<usize> {
    let is_wordish = |f: Flags| f.is_letter() || (marks_join_letters && f.is_accent_mark());
    for_each_piece(chars, pieces, |p| {
        let mut pos = p.start;
        while pos < p.end {
            let c = p.char_at(pos);
            let flags = p.flags_at(pos);
            if let Some(len) = p.contraction_len(pos, true) {
                pos += p.emit(pos + len);
                continue;
            }
            // [^\r\n\p{L}\p{N}]?\p{L}+
            if !(is_cr_or_lf(c) || flags.is_number())
                && (is_wordish(flags) || is_wordish(p.flags_at(pos + 1)))
            {
                pos += 1;
                while is_wordish(p.flags_at(pos)) {
                    pos += 1;
                }
                p.emit(pos);
                continue;
            }
            // \p{N}{1,max_digits}
            if flags.is_number() {
                let mut group_start = pos;
                while p.flags_at(pos).is_number() {
                    pos += 1;
                    if pos - group_start >= max_digits {
                        p.emit(pos);
                        group_start = pos;
                    }
                }
                p.emit(pos);
                continue;
            }
            // ' '?[^\s\p{L}\p{N}]+[\r\n]*  (llama.cpp only requires the codepoint after the
            // optional space to be outside the excluded classes, not to exist)
            let excluded =
                |f: Flags| f.is_whitespace || f.is_letter() || f.is_number() || is_wordish(f);
            let space = usize::from(c == Some(' '));
            let mut next_flags = p.flags_at(pos + space);
            if !excluded(next_flags) {
                pos += space;
                while !excluded(next_flags) && next_flags.is_some() {
                    pos += 1;
                    next_flags = p.flags_at(pos);
                }
                while is_cr_or_lf(p.char_at(pos)) {
                    pos += 1;
                }
                p.emit(pos);
                continue;
            }
            let mut run = 0;
            let mut after_last_newline = None;
            while p.flags_at(pos + run).is_whitespace {
                if is_cr_or_lf(p.char_at(pos + run)) {
                    after_last_newline = Some(pos + run + 1);
                }
                run += 1;
            }
            // \s*[\r\n]+
            if let Some(end) = after_last_newline {
                pos = end;
                p.emit(pos);
                continue;
            }
            if let Some(end) = p.trailing_whitespace_end(pos, run) {
                pos = end;
                p.emit(pos);
                continue;
            }
            pos += 1;
            p.emit(pos);
        }
    })
}

/// `[^\n]+|[\n]+`: runs of non-newlines and runs of newlines.
fn split_newlines(chars: &[char], pieces: &[usize]) -> Vec<usize> {
    for_each_piece(chars, pieces, |p| {
        let mut pos = p.start;
        while pos < p.end {
            let newline_run = chars[pos] == '\n';
            while pos < p.end && (chars[pos] == '\n') == newline_run {
                pos += 1;
            }
            p.emit(pos);
        }
    })
}

#[cfg(test)]
mod tests {
    use super::super::presets::{KNOWN_PRE_NAMES, preset};
    use super::*;

    fn words(pre: &str, text: &str) -> Vec<String> {
        let preset = preset(pre).expect("known pre");
        let pre_tokenizer = PreTokenizer::new(pre, preset.rules).expect("compiles");
        pre_tokenizer
            .split(text)
            .into_iter()
            .map(|r| text[r].to_string())
            .collect()
    }

    #[test]
    fn every_known_preset_compiles() {
        for name in KNOWN_PRE_NAMES {
            let p = preset(name).unwrap_or_else(|| panic!("{name} has no preset"));
            PreTokenizer::new(name, p.rules).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    #[test]
    fn gpt2_splits_like_the_regex() {
        assert_eq!(
            words("gpt-2", "Hello world's  123 !!\n\n x"),
            ["Hello", " world", "'s", " ", " 123", " !!", "\n\n", " x"]
        );
    }

    #[test]
    fn llama3_groups_three_digits_and_newlines() {
        assert_eq!(
            words("llama-bpe", "abc 12345\n\n  Hi"),
            ["abc", " ", "123", "45", "\n\n", " ", " Hi"]
        );
    }

    #[test]
    fn qwen2_splits_single_digits() {
        assert_eq!(words("qwen2", "a 123"), ["a", " ", "1", "2", "3"]);
    }

    #[test]
    fn collapsed_regex_sees_non_ascii_letters() {
        // starcoder: \p{N} first, then GPT-2; "é" must count as a letter.
        assert_eq!(words("starcoder", "café 42"), ["café", " ", "4", "2"]);
    }

    #[test]
    fn collapse_pattern_expands_categories() {
        assert_eq!(
            collapse_pattern(r"[^\s\p{L}]+|\p{N}").as_deref(),
            Ok(r"[^\s\x{D2}A-Za-z]+|[\x{D1}0-9]")
        );
    }
}
