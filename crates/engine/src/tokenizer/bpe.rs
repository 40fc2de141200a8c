//! Byte-pair encoding over pre-tokenized words (`tokenizer.ggml.model = "gpt2"`), as llama.cpp's
//! `llm_tokenizer_bpe_session` does it.
//!
//! Each word starts as one symbol per byte (byte-level alphabet) or per codepoint (SentencePiece-
//! style BPE). The adjacent pair with the lowest merge rank is merged first, ties going to the
//! leftmost pair; merging stops when no adjacent pair has a rank. Symbols are identified by
//! "piece ids": the token id when the text is in the vocabulary, otherwise an id past the
//! vocabulary for a merge result that is not a token, so pair lookups never build strings.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use gguf::StringArray;

use super::hash::FastHashMap;
use super::presets::Preset;
use super::pretokenize::PreTokenizer;
use super::unicode::ByteAlphabet;
use super::vocab::Vocab;
use super::{TokenId, TokenizerError};

/// Piece id of a symbol whose text is neither a token nor part of any merge.
const NO_PIECE: u32 = u32::MAX;

/// SentencePiece's visible space.
pub(crate) const SPACE_MARK: &str = "\u{2581}";

#[derive(Clone, Copy)]
struct Merge {
    rank: u32,
    merged: u32,
}

/// A merge candidate: (rank, left symbol, right symbol, left piece, right piece), lowest rank and
/// then leftmost first.
type MergeQueue = BinaryHeap<Reverse<(u32, usize, usize, u32, u32)>>;

fn pair_key(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

pub(crate) struct BpeModel {
    pre_tokenizer: PreTokenizer,
    preset: Preset,
    /// Runs of newlines found whole in the vocabulary stay one token (llama.cpp's gemma4 fix).
    keep_newline_runs: bool,
    merges: FastHashMap<u64, Merge>,
    /// Merge parts and results that are not tokens, with their piece ids (≥ vocabulary size).
    extra_pieces: FastHashMap<String, u32>,
    alphabet: ByteAlphabet,
    /// Piece id of each byte's alphabet codepoint.
    byte_pieces: [u32; 256],
}

struct Symbol {
    /// Byte range in the word's encoded text.
    start: usize,
    len: usize,
    piece: u32,
    prev: Option<usize>,
    next: Option<usize>,
}

impl BpeModel {
    pub fn new(
        vocab: &Vocab,
        merges: &StringArray,
        pre_name: &str,
        preset: Preset,
    ) -> Result<BpeModel, TokenizerError> {
        let pre_tokenizer = PreTokenizer::new(pre_name, preset.rules)?;
        let mut model = BpeModel {
            pre_tokenizer,
            preset,
            keep_newline_runs: matches!(pre_name, "gemma4" | "granite-embed-multi-311m"),
            merges: FastHashMap::default(),
            extra_pieces: FastHashMap::default(),
            alphabet: ByteAlphabet::new(),
            byte_pieces: [NO_PIECE; 256],
        };
        model.merges.reserve(merges.len());
        for (rank, line) in merges.iter().enumerate() {
            // Split at the first space after the first character (a part may start with one).
            let Some(split) = line
                .char_indices()
                .skip(1)
                .find(|&(_, c)| c == ' ')
                .map(|(i, _)| i)
            else {
                tracing::warn!(rank, line, "merge without a space separator; skipped");
                continue;
            };
            let (left, right) = (&line[..split], &line[split + 1..]);
            let left_piece = model.intern(vocab, left);
            let right_piece = model.intern(vocab, right);
            let merged = model.intern(vocab, &format!("{left}{right}"));
            let rank = u32::try_from(rank)
                .map_err(|_| TokenizerError::VocabularyTooLarge { size: merges.len() })?;
            // The first (lowest-ranked) occurrence of a pair wins.
            model
                .merges
                .entry(pair_key(left_piece, right_piece))
                .or_insert(Merge { rank, merged });
        }
        for byte in 0..=255u8 {
            let c = model.alphabet.char_of(byte);
            model.byte_pieces[usize::from(byte)] =
                model.piece_of(vocab, c.encode_utf8(&mut [0; 4]));
        }
        Ok(model)
    }

    pub fn escapes_whitespace(&self) -> bool {
        self.preset.escape_whitespace
    }

    pub fn byte_encodes(&self) -> bool {
        self.preset.byte_encode
    }

    fn intern(&mut self, vocab: &Vocab, text: &str) -> u32 {
        if let Some(id) = vocab.id_of(text) {
            return id;
        }
        let next = u32::try_from(vocab.len() + self.extra_pieces.len()).unwrap_or(NO_PIECE - 1);
        *self.extra_pieces.entry(text.to_string()).or_insert(next)
    }

    fn piece_of(&self, vocab: &Vocab, text: &str) -> u32 {
        vocab
            .id_of(text)
            .or_else(|| self.extra_pieces.get(text).copied())
            .unwrap_or(NO_PIECE)
    }

    fn rank_of(&self, left: u32, right: u32) -> Option<Merge> {
        if left == NO_PIECE || right == NO_PIECE {
            return None;
        }
        self.merges.get(&pair_key(left, right)).copied()
    }

    /// Encodes one raw-text fragment (no special tokens inside) and appends its tokens.
    pub fn encode(&self, vocab: &Vocab, text: &str, out: &mut Vec<TokenId>) {
        let escaped;
        let text = if self.preset.escape_whitespace {
            escaped = text.replace(' ', SPACE_MARK);
            escaped.as_str()
        } else {
            text
        };
        let mut encoded = String::new();
        let mut symbols = Vec::new();
        let mut queue = BinaryHeap::new();
        for range in self.pre_tokenizer.split(text) {
            let word = &text[range];
            if word.is_empty() {
                continue;
            }
            let encoded_word = if self.preset.byte_encode {
                self.alphabet.encode(word, &mut encoded);
                encoded.as_str()
            } else {
                word
            };
            let whole = vocab.id_of(encoded_word);
            let keep_whole = self.preset.ignore_merges
                || (self.keep_newline_runs && word.bytes().all(|b| b == b'\n'));
            if let Some(id) = whole.filter(|_| keep_whole) {
                out.push(id);
                continue;
            }
            self.encode_word(vocab, word, encoded_word, &mut symbols, &mut queue, out);
        }
    }

    fn encode_word(
        &self,
        vocab: &Vocab,
        word: &str,
        encoded_word: &str,
        symbols: &mut Vec<Symbol>,
        queue: &mut MergeQueue,
        out: &mut Vec<TokenId>,
    ) {
        symbols.clear();
        queue.clear();
        if self.preset.byte_encode {
            // One symbol per byte; its alphabet codepoint is 1 or 2 bytes of the encoded word.
            let mut start = 0;
            for byte in word.bytes() {
                let len = self.alphabet.char_of(byte).len_utf8();
                push_symbol(symbols, start, len, self.byte_pieces[usize::from(byte)]);
                start += len;
            }
        } else {
            for (start, c) in encoded_word.char_indices() {
                let piece = self.piece_of(vocab, c.encode_utf8(&mut [0; 4]));
                push_symbol(symbols, start, c.len_utf8(), piece);
            }
        }
        if let Some(last) = symbols.last_mut() {
            last.next = None;
        }

        let add_pair =
            |symbols: &[Symbol], queue: &mut BinaryHeap<_>, left: usize, right: usize| {
                let (l, r) = (symbols[left].piece, symbols[right].piece);
                if let Some(merge) = self.rank_of(l, r) {
                    queue.push(Reverse((merge.rank, left, right, l, r)));
                }
            };
        for left in 1..symbols.len() {
            add_pair(symbols, queue, left - 1, left);
        }
        while let Some(Reverse((rank, left, right, left_piece, right_piece))) = queue.pop() {
            let (l, r) = (&symbols[left], &symbols[right]);
            // Skip pairs made stale by an earlier merge of either side.
            if l.len == 0 || r.len == 0 || l.piece != left_piece || r.piece != right_piece {
                continue;
            }
            let Some(merge) = self
                .rank_of(left_piece, right_piece)
                .filter(|m| m.rank == rank)
            else {
                continue;
            };
            let right_next = symbols[right].next;
            let right_len = symbols[right].len;
            symbols[left].len += right_len;
            symbols[left].piece = merge.merged;
            symbols[left].next = right_next;
            symbols[right].len = 0;
            if let Some(next) = right_next {
                symbols[next].prev = Some(left);
            }
            if let Some(prev) = symbols[left].prev {
                add_pair(symbols, queue, prev, left);
            }
            if let Some(next) = right_next {
                add_pair(symbols, queue, left, next);
            }
        }

        let mut cursor = (!symbols.is_empty()).then_some(0);
        while let Some(index) = cursor {
            let symbol = &symbols[index];
            cursor = symbol.next;
            if symbol.len == 0 {
                continue;
            }
            if (symbol.piece as usize) < vocab.len() {
                out.push(symbol.piece);
                continue;
            }
            // Not a token: fall back to single-byte tokens, as llama.cpp does.
            let text = &encoded_word[symbol.start..symbol.start + symbol.len];
            for byte in text.bytes() {
                let token = if self.preset.byte_encode {
                    char::from_u32(u32::from(byte))
                        .filter(char::is_ascii)
                        .and_then(|c| vocab.id_of(c.encode_utf8(&mut [0; 4])))
                } else {
                    vocab.id_of(&format!("<0x{byte:02X}>"))
                };
                out.extend(token);
            }
        }
    }
}

fn push_symbol(symbols: &mut Vec<Symbol>, start: usize, len: usize, piece: u32) {
    let index = symbols.len();
    symbols.push(Symbol {
        start,
        len,
        piece,
        prev: index.checked_sub(1),
        next: Some(index + 1),
    });
}
