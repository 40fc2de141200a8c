//! Tokenizer built from GGUF metadata, matching llama.cpp's tokenization token for token.
//!
//! * `tokenizer.ggml.model = "gpt2"` (and `"gemma4"`): byte-pair encoding over words found by the
//!   pre-tokenizer that `tokenizer.ggml.pre` names ([`presets`]), with llama.cpp's hand-written
//!   splitters and regex semantics ([`pretokenize`]).
//! * `tokenizer.ggml.model = "llama"`: SentencePiece-style merges by score with byte fallback.
//!
//! Special tokens are split out of the input first (always the user-defined ones, the control
//! ones when `parse_special`), like llama.cpp's `tokenize(text, add_special, parse_special)`.
//!
//! We implement the algorithms here rather than through the `tokenizers` crate because llama.cpp
//! differs from HF tokenizers in details that change token ids (it runs its regex list as
//! successive splits over llama.cpp's own Unicode categories, falls back to byte tokens instead
//! of `<unk>`, and matches special tokens by its own rules); the vocabulary goldens in
//! `tests/tokenizer_goldens.rs` hold us to it.

mod bpe;
mod hash;
mod presets;
mod pretokenize;
mod special;
mod spm;
mod stream;
mod unicode;
mod vocab;

use gguf::Metadata;

pub use stream::StreamDecoder;
pub use vocab::SpecialTokens;

use bpe::{BpeModel, SPACE_MARK};
use special::Fragment;
use unicode::ByteAlphabet;
use vocab::{TokenAttrs, Vocab, VocabDefaults};

/// A token id (index into `tokenizer.ggml.tokens`).
pub type TokenId = u32;

/// GGUF metadata keys read by the tokenizer.
pub mod keys {
    pub const MODEL: &str = "tokenizer.ggml.model";
    pub const PRE: &str = "tokenizer.ggml.pre";
    pub const TOKENS: &str = "tokenizer.ggml.tokens";
    pub const TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
    pub const SCORES: &str = "tokenizer.ggml.scores";
    pub const MERGES: &str = "tokenizer.ggml.merges";
    pub const BOS_ID: &str = "tokenizer.ggml.bos_token_id";
    pub const EOS_ID: &str = "tokenizer.ggml.eos_token_id";
    pub const EOT_ID: &str = "tokenizer.ggml.eot_token_id";
    pub const EOM_ID: &str = "tokenizer.ggml.eom_token_id";
    pub const UNK_ID: &str = "tokenizer.ggml.unknown_token_id";
    pub const SEP_ID: &str = "tokenizer.ggml.seperator_token_id";
    pub const PAD_ID: &str = "tokenizer.ggml.padding_token_id";
    pub const MASK_ID: &str = "tokenizer.ggml.mask_token_id";
    pub const FIM_PRE_ID: &str = "tokenizer.ggml.fim_pre_token_id";
    pub const FIM_SUF_ID: &str = "tokenizer.ggml.fim_suf_token_id";
    pub const FIM_MID_ID: &str = "tokenizer.ggml.fim_mid_token_id";
    pub const FIM_PAD_ID: &str = "tokenizer.ggml.fim_pad_token_id";
    pub const FIM_REP_ID: &str = "tokenizer.ggml.fim_rep_token_id";
    pub const FIM_SEP_ID: &str = "tokenizer.ggml.fim_sep_token_id";
    pub const PREFIX_ID: &str = "tokenizer.ggml.prefix_token_id";
    pub const SUFFIX_ID: &str = "tokenizer.ggml.suffix_token_id";
    pub const MIDDLE_ID: &str = "tokenizer.ggml.middle_token_id";
    pub const ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
    pub const ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
    pub const ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";
    pub const GENERAL_NAME: &str = "general.name";
}

/// Why a tokenizer could not be built from a model's metadata.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("reading tokenizer metadata `{key}`: {source}")]
    Metadata {
        key: &'static str,
        #[source]
        source: gguf::GgufError,
    },
    #[error("tokenizer metadata `{key}` should be {expected}")]
    WrongType {
        key: &'static str,
        expected: &'static str,
    },
    #[error(
        "unsupported tokenizer model `{model}` (tokenizer.ggml.model); supported: gpt2, gemma4, llama"
    )]
    UnsupportedModel { model: String },
    #[error(
        "unknown pre-tokenizer `{pre}` (tokenizer.ggml.pre); known: {}",
        presets::KNOWN_PRE_NAMES.join(", ")
    )]
    UnknownPreTokenizer { pre: String },
    #[error(
        "pre-tokenizer `{pre}` (tokenizer.ggml.pre) needs llama.cpp's custom splitter, not implemented"
    )]
    UnsupportedPreTokenizer { pre: String },
    #[error("pre-tokenizer `{pre}`: regex {pattern:?} does not compile: {reason}")]
    InvalidPreTokenizerRegex {
        pre: String,
        pattern: String,
        reason: String,
    },
    #[error("tokenizer metadata `{key}` has {found} entries, the vocabulary {expected}")]
    LengthMismatch {
        key: &'static str,
        expected: usize,
        found: usize,
    },
    #[error("token text {text:?} appears twice (ids {first} and {second})")]
    DuplicateToken {
        text: String,
        first: TokenId,
        second: TokenId,
    },
    #[error("the vocabulary (tokenizer.ggml.tokens) is empty")]
    EmptyVocabulary,
    #[error("vocabulary or merge list too large ({size} entries)")]
    VocabularyTooLarge { size: usize },
}

enum Model {
    Bpe(Box<BpeModel>),
    Spm,
}

/// Which algorithm a [`Tokenizer`] runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    /// Byte-pair encoding; `pre` is the pre-tokenizer name (`tokenizer.ggml.pre`).
    Bpe { pre: String },
    /// SentencePiece-style (`tokenizer.ggml.model = "llama"`).
    SentencePiece,
}

/// A tokenizer for one model: encode text to token ids, decode ids to text.
pub struct Tokenizer {
    vocab: Vocab,
    model: Model,
    kind: TokenizerKind,
    /// Every token's bytes with specials rendered (llama.cpp `token_to_piece(id, special=true)`),
    /// concatenated; token `i` is `pieces[piece_ends[i-1]..piece_ends[i]]`.
    pieces: Vec<u8>,
    piece_ends: Vec<usize>,
    /// Bytes of the longest piece.
    longest_piece: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind)
            .field("vocab_size", &self.vocab_size())
            .field("special", &self.vocab.special)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.*` metadata.
    pub fn from_metadata(metadata: &Metadata) -> Result<Tokenizer, TokenizerError> {
        let model_name = metadata
            .str(keys::MODEL)
            .map_err(|source| TokenizerError::Metadata {
                key: keys::MODEL,
                source,
            })?;
        let pre_name = metadata
            .get_str(keys::PRE)
            .map_err(|source| TokenizerError::Metadata {
                key: keys::PRE,
                source,
            })?;
        match model_name {
            "gpt2" | "gemma4" => {
                let pre = if model_name == "gemma4" {
                    "gemma4"
                } else {
                    pre_name.unwrap_or_else(|| {
                        tracing::warn!("no tokenizer.ggml.pre; using the `default` pre-tokenizer");
                        "default"
                    })
                };
                Self::bpe(metadata, model_name, pre)
            }
            "llama" => {
                let defaults = VocabDefaults {
                    special: SpecialTokens {
                        bos: Some(1),
                        eos: Some(2),
                        unk: Some(0),
                        ..SpecialTokens::default()
                    },
                    add_bos: true,
                    add_space_prefix: true,
                };
                let vocab = Vocab::load(metadata, defaults, false, false)?;
                Ok(Self::assemble(
                    vocab,
                    Model::Spm,
                    TokenizerKind::SentencePiece,
                ))
            }
            other => Err(TokenizerError::UnsupportedModel {
                model: other.to_string(),
            }),
        }
    }

    fn bpe(metadata: &Metadata, model_name: &str, pre: &str) -> Result<Tokenizer, TokenizerError> {
        let Some(preset) = presets::preset(pre) else {
            return Err(if presets::UNSUPPORTED_PRE_NAMES.contains(&pre) {
                TokenizerError::UnsupportedPreTokenizer {
                    pre: pre.to_string(),
                }
            } else {
                TokenizerError::UnknownPreTokenizer {
                    pre: pre.to_string(),
                }
            });
        };
        // llama.cpp's BPE defaults: BOS = EOS = 11 (GPT-2's), none for gemma4.
        let default_special = if model_name == "gemma4" {
            SpecialTokens::default()
        } else {
            SpecialTokens {
                bos: Some(11),
                eos: Some(11),
                ..SpecialTokens::default()
            }
        };
        let defaults = VocabDefaults {
            special: default_special,
            add_bos: false,
            add_space_prefix: false,
        };
        let mut vocab = Vocab::load(metadata, defaults, preset.add_bos, preset.no_default_bos)?;
        if model_name == "gemma4" {
            vocab.add_bos = true;
        }
        let merges =
            metadata
                .str_array(keys::MERGES)
                .map_err(|source| TokenizerError::Metadata {
                    key: keys::MERGES,
                    source,
                })?;
        let model = BpeModel::new(&vocab, merges, pre, preset)?;
        let kind = TokenizerKind::Bpe {
            pre: pre.to_string(),
        };
        Ok(Self::assemble(vocab, Model::Bpe(Box::new(model)), kind))
    }

    fn assemble(vocab: Vocab, model: Model, kind: TokenizerKind) -> Tokenizer {
        let mut tokenizer = Tokenizer {
            vocab,
            model,
            kind,
            pieces: Vec::new(),
            piece_ends: Vec::new(),
            longest_piece: 0,
        };
        tokenizer.build_pieces();
        tokenizer
    }

    /// Renders every token once (llama.cpp's token-to-piece cache).
    fn build_pieces(&mut self) {
        let alphabet = ByteAlphabet::new();
        let mut pieces = Vec::new();
        let mut ends = Vec::with_capacity(self.vocab.len());
        let (spm_like, byte_level) = match &self.model {
            Model::Spm => (true, false),
            Model::Bpe(bpe) => (bpe.escapes_whitespace(), bpe.byte_encodes()),
        };
        for (text, &attrs) in self.vocab.texts.iter().zip(&self.vocab.attrs) {
            let rendered_verbatim =
                TokenAttrs::UNKNOWN | TokenAttrs::CONTROL | TokenAttrs::USER_DEFINED;
            if attrs.contains_any(rendered_verbatim) {
                pieces.extend_from_slice(text.as_bytes());
            } else if attrs.contains_any(TokenAttrs::NORMAL) {
                if spm_like || !byte_level {
                    pieces.extend_from_slice(text.replace(SPACE_MARK, " ").as_bytes());
                } else {
                    decode_byte_level(&alphabet, text, &mut pieces);
                }
            } else if attrs.contains_any(TokenAttrs::BYTE) {
                pieces.extend(parse_byte_token(text));
            }
            let start = ends.last().copied().unwrap_or(0);
            self.longest_piece = self.longest_piece.max(pieces.len() - start);
            ends.push(pieces.len());
        }
        self.pieces = pieces;
        self.piece_ends = ends;
    }

    /// Token ids for `text`. `add_special` adds BOS/EOS as the metadata asks
    /// (`add_bos_token` / `add_eos_token`); `parse_special` turns control-token texts such as
    /// `<|im_start|>` in `text` into their ids (otherwise they are tokenized as plain text).
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<TokenId> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.vocab.add_bos {
            out.extend(self.vocab.special.bos);
        }
        let fragments = special::partition(text, &self.vocab, parse_special);
        match &self.model {
            Model::Bpe(bpe) => {
                for fragment in fragments {
                    match fragment {
                        Fragment::Text(range) => bpe.encode(&self.vocab, &text[range], &mut out),
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
            Model::Spm => {
                // A space is prefixed to the text at the start and after every special token.
                let mut after_special = true;
                let mut buffer = String::new();
                for fragment in fragments {
                    match fragment {
                        Fragment::Text(range) => {
                            buffer.clear();
                            if self.vocab.add_space_prefix && after_special {
                                buffer.push(' ');
                            }
                            buffer.push_str(&text[range]);
                            let escaped = buffer.replace(' ', SPACE_MARK);
                            spm::encode(&self.vocab, &escaped, &mut out);
                            after_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            after_special = true;
                        }
                    }
                }
            }
        }
        if add_special && self.vocab.add_eos {
            out.extend(self.vocab.special.eos);
        }
        out
    }

    /// The most bytes of text one token can stand for: the longest piece, and at least a whole
    /// UTF-8 character (an unknown one becomes one token). A text of `n` bytes encodes to at
    /// least `n / max_bytes_per_token()` tokens, which bounds a prompt before tokenizing it.
    pub fn max_bytes_per_token(&self) -> usize {
        self.longest_piece.max(4)
    }

    /// The bytes token `id` stands for, control tokens rendered as their text; empty for an
    /// id outside the vocabulary.
    pub fn token_to_piece(&self, id: TokenId) -> &[u8] {
        let index = id as usize;
        let Some(&end) = self.piece_ends.get(index) else {
            return &[];
        };
        let start = index.checked_sub(1).map_or(0, |i| self.piece_ends[i]);
        &self.pieces[start..end]
    }

    /// Text of `ids`, special tokens rendered as their text. Invalid UTF-8 becomes U+FFFD.
    /// With `add_space_prefix` (SentencePiece), the space the encoder prefixed is removed from
    /// the first token.
    pub fn decode(&self, ids: &[TokenId]) -> String {
        self.decode_impl(ids, false)
    }

    /// Like [`decode`](Self::decode), without control and unknown tokens (BOS, EOS, `<|im_end|>`…).
    pub fn decode_skip_special(&self, ids: &[TokenId]) -> String {
        self.decode_impl(ids, true)
    }

    fn decode_impl(&self, ids: &[TokenId], skip_special: bool) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        let mut strip_space = self.vocab.add_space_prefix;
        for &id in ids {
            if skip_special && self.is_control(id) {
                continue;
            }
            let mut piece = self.token_to_piece(id);
            if strip_space && !piece.is_empty() {
                piece = piece.strip_prefix(b" ").unwrap_or(piece);
                strip_space = false;
            }
            bytes.extend_from_slice(piece);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// The id of the token whose text is exactly `text` (as stored in the vocabulary, e.g.
    /// `"<|im_end|>"`, or `"Ġthe"` in a byte-level vocabulary).
    pub fn token_id(&self, text: &str) -> Option<TokenId> {
        self.vocab.id_of(text)
    }

    /// The stored text of token `id`.
    pub fn token_text(&self, id: TokenId) -> Option<&str> {
        self.vocab.texts.get(id as usize).map(String::as_str)
    }

    /// True for control and unknown tokens (BOS, EOS, `<|im_start|>`…): what
    /// [`decode_skip_special`](Self::decode_skip_special) leaves out.
    pub fn is_control(&self, id: TokenId) -> bool {
        self.vocab
            .attrs(id)
            .contains_any(TokenAttrs::CONTROL | TokenAttrs::UNKNOWN)
    }

    /// True if generating `id` ends the turn (EOS, EOT, EOM and control tokens such as
    /// `<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`, `<end_of_turn>`).
    pub fn is_eog(&self, id: TokenId) -> bool {
        self.vocab.eog.binary_search(&id).is_ok()
    }

    /// All end-of-generation ids, ascending.
    pub fn eog_tokens(&self) -> &[TokenId] {
        &self.vocab.eog
    }

    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.vocab.special
    }

    pub fn bos(&self) -> Option<TokenId> {
        self.vocab.special.bos
    }

    pub fn eos(&self) -> Option<TokenId> {
        self.vocab.special.eos
    }

    pub fn eot(&self) -> Option<TokenId> {
        self.vocab.special.eot
    }

    pub fn pad(&self) -> Option<TokenId> {
        self.vocab.special.pad
    }

    /// Whether `encode(.., add_special = true, ..)` starts with BOS.
    pub fn add_bos(&self) -> bool {
        self.vocab.add_bos
    }

    /// Whether `encode(.., add_special = true, ..)` ends with EOS.
    pub fn add_eos(&self) -> bool {
        self.vocab.add_eos
    }

    pub fn kind(&self) -> &TokenizerKind {
        &self.kind
    }
}

/// A byte-level BPE token's bytes (each codepoint of its text is one byte of the alphabet).
fn decode_byte_level(alphabet: &ByteAlphabet, text: &str, out: &mut Vec<u8>) {
    for c in text.chars() {
        match alphabet.byte_of(c) {
            Some(byte) => out.push(byte),
            // Not in the alphabet: llama.cpp writes a marker with the raw codepoint.
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                for byte in c.encode_utf8(&mut [0; 4]).bytes() {
                    out.extend_from_slice(format!("{byte:02x}").as_bytes());
                }
                out.extend_from_slice(text.as_bytes());
                out.push(b']');
            }
        }
    }
}

/// The byte of a `<0xXX>` token.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}
