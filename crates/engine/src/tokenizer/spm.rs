//! SentencePiece-style tokenization (`tokenizer.ggml.model = "llama"`), as llama.cpp's
//! `llm_tokenizer_spm_session` does it.
//!
//! The text (spaces already turned into `▁`) starts as one symbol per codepoint. Repeatedly, the
//! adjacent pair whose concatenation is a token with the highest score is merged (ties: leftmost).
//! A final symbol that is not a token is emitted as byte tokens (`<0xXX>`).

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use super::TokenId;
use super::vocab::Vocab;

struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge: best score first, then leftmost.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Byte length of the merged text, to detect stale candidates.
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Bigram {}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| Reverse(self.left).cmp(&Reverse(other.left)))
    }
}

/// Tokenizes `text` (already escaped) and appends the tokens to `out`.
pub(crate) fn encode(vocab: &Vocab, text: &str, out: &mut Vec<TokenId>) {
    let mut symbols: Vec<Symbol> = text
        .char_indices()
        .enumerate()
        .map(|(index, (start, c))| Symbol {
            start,
            len: c.len_utf8(),
            prev: index.checked_sub(1),
            next: Some(index + 1),
        })
        .collect();
    if let Some(last) = symbols.last_mut() {
        last.next = None;
    }

    let mut queue = BinaryHeap::new();
    let try_add =
        |symbols: &[Symbol], queue: &mut BinaryHeap<Bigram>, left: usize, right: usize| {
            let start = symbols[left].start;
            let end = symbols[right].start + symbols[right].len;
            let Some(id) = vocab.id_of(&text[start..end]) else {
                return;
            };
            queue.push(Bigram {
                score: vocab.scores[id as usize],
                left,
                right,
                size: end - start,
            });
        };
    for right in 1..symbols.len() {
        try_add(&symbols, &mut queue, right - 1, right);
    }

    while let Some(bigram) = queue.pop() {
        let (left, right) = (&symbols[bigram.left], &symbols[bigram.right]);
        if left.len == 0 || right.len == 0 || left.len + right.len != bigram.size {
            continue;
        }
        let right_next = right.next;
        symbols[bigram.left].len += symbols[bigram.right].len;
        symbols[bigram.right].len = 0;
        symbols[bigram.left].next = right_next;
        if let Some(next) = right_next {
            symbols[next].prev = Some(bigram.left);
        }
        if let Some(prev) = symbols[bigram.left].prev {
            try_add(&symbols, &mut queue, prev, bigram.left);
        }
        if let Some(next) = right_next {
            try_add(&symbols, &mut queue, bigram.left, next);
        }
    }

    let mut cursor = (!symbols.is_empty()).then_some(0);
    while let Some(index) = cursor {
        let symbol = &symbols[index];
        cursor = symbol.next;
        let piece = &text[symbol.start..symbol.start + symbol.len];
        if let Some(id) = vocab.id_of(piece) {
            out.push(id);
            continue;
        }
        for byte in piece.bytes() {
            match vocab.byte_token(byte) {
                Some(id) => out.push(id),
                None => out.extend(vocab.special.unk),
            }
        }
    }
}
