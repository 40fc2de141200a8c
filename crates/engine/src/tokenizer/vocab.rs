//! The vocabulary read from GGUF metadata: token texts, scores, token attributes, the special
//! token ids, and the derived tables (end-of-generation set, special tokens by length), following
//! llama.cpp's `llama_vocab::impl::load` step by step.
//!
//! Where llama.cpp walks an unordered map (auto-detecting EOT/EOM/FIM tokens by their text) we
//! walk ids in ascending order, so the first matching id wins deterministically.

use gguf::Metadata;

use super::TokenizerError;
use super::hash::FastHashMap;
use super::{TokenId, keys};

/// Token attributes (llama.cpp `llama_token_attr` bits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct TokenAttrs(u16);

impl TokenAttrs {
    pub const UNKNOWN: TokenAttrs = TokenAttrs(1 << 0);
    pub const UNUSED: TokenAttrs = TokenAttrs(1 << 1);
    pub const NORMAL: TokenAttrs = TokenAttrs(1 << 2);
    pub const CONTROL: TokenAttrs = TokenAttrs(1 << 3);
    pub const USER_DEFINED: TokenAttrs = TokenAttrs(1 << 4);
    pub const BYTE: TokenAttrs = TokenAttrs(1 << 5);
    pub const LSTRIP: TokenAttrs = TokenAttrs(1 << 7);
    pub const RSTRIP: TokenAttrs = TokenAttrs(1 << 8);

    /// From a `tokenizer.ggml.token_type` value (1 normal, 2 unknown, 3 control,
    /// 4 user-defined, 5 unused, 6 byte; anything else: no attribute).
    fn from_token_type(token_type: i32) -> TokenAttrs {
        match token_type {
            1 => Self::NORMAL,
            2 => Self::UNKNOWN,
            3 => Self::CONTROL,
            4 => Self::USER_DEFINED,
            5 => Self::UNUSED,
            6 => Self::BYTE,
            _ => TokenAttrs(0),
        }
    }

    pub fn contains_any(self, other: TokenAttrs) -> bool {
        self.0 & other.0 != 0
    }

    fn set(&mut self, other: TokenAttrs, on: bool) {
        if on {
            self.0 |= other.0;
        } else {
            self.0 &= !other.0;
        }
    }
}

impl std::ops::BitOr for TokenAttrs {
    type Output = TokenAttrs;
    fn bitor(self, rhs: TokenAttrs) -> TokenAttrs {
        TokenAttrs(self.0 | rhs.0)
    }
}

/// The special token ids of a vocabulary (`None` where the model has none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: Option<TokenId>,
    pub eos: Option<TokenId>,
    /// End of turn (`<|eot_id|>`, `<|im_end|>`, …).
    pub eot: Option<TokenId>,
    /// End of message (`<|eom_id|>`).
    pub eom: Option<TokenId>,
    pub unk: Option<TokenId>,
    pub sep: Option<TokenId>,
    pub pad: Option<TokenId>,
    pub mask: Option<TokenId>,
    pub fim_prefix: Option<TokenId>,
    pub fim_suffix: Option<TokenId>,
    pub fim_middle: Option<TokenId>,
    pub fim_pad: Option<TokenId>,
    pub fim_repo: Option<TokenId>,
    pub fim_file_sep: Option<TokenId>,
}

/// Per-kind defaults that load-time steps start from (llama.cpp's constructor defaults).
pub(crate) struct VocabDefaults {
    pub special: SpecialTokens,
    pub add_bos: bool,
    pub add_space_prefix: bool,
}

pub(crate) struct Vocab {
    pub texts: Vec<String>,
    pub ids: FastHashMap<String, TokenId>,
    pub scores: Vec<f32>,
    pub attrs: Vec<TokenAttrs>,
    pub special: SpecialTokens,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
    /// End-of-generation ids, ascending.
    pub eog: Vec<TokenId>,
    /// Control, user-defined and unknown tokens, longest text first: the order in which the
    /// input is split on them before pre-tokenization.
    pub special_by_length: Vec<TokenId>,
}

/// Texts that mark an end-of-turn token when the metadata names none.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PREFIX_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUFFIX_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MIDDLE_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REPO_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_FILE_SEP_TEXTS: &[&str] = &["<|file_sep|>"];

/// Texts of tokens that end generation (llama.cpp's EOG list).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// gpt-oss tokens that must always be rendered, whatever the file says.
const ALWAYS_RENDERED_TEXTS: &[&str] =
    &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// Accessor of one field of [`SpecialTokens`].
type SpecialField = fn(&mut SpecialTokens) -> &mut Option<TokenId>;

fn meta_err(key: &'static str) -> impl FnOnce(gguf::GgufError) -> TokenizerError {
    move |source| TokenizerError::Metadata { key, source }
}

impl Vocab {
    pub fn load(
        metadata: &Metadata,
        defaults: VocabDefaults,
        add_bos_default: bool,
        no_default_bos: bool,
    ) -> Result<Vocab, TokenizerError> {
        let tokens = metadata
            .str_array(keys::TOKENS)
            .map_err(meta_err(keys::TOKENS))?;
        let n_tokens = tokens.len();
        if n_tokens == 0 {
            return Err(TokenizerError::EmptyVocabulary);
        }
        let n_tokens_u32 = u32::try_from(n_tokens)
            .map_err(|_| TokenizerError::VocabularyTooLarge { size: n_tokens })?;

        let scores = read_scores(metadata, n_tokens)?;
        let token_types = match metadata
            .get_i32_array(keys::TOKEN_TYPE)
            .map_err(meta_err(keys::TOKEN_TYPE))?
        {
            Some(types) => {
                check_len(keys::TOKEN_TYPE, n_tokens, types.len())?;
                Some(types)
            }
            None => None,
        };

        let mut texts = Vec::with_capacity(n_tokens);
        let mut ids = FastHashMap::default();
        ids.reserve(n_tokens);
        let mut attrs = Vec::with_capacity(n_tokens);
        for (index, text) in tokens.iter().enumerate() {
            let id = index as TokenId; // index < n_tokens, which fits u32
            let text = if text.is_empty() {
                tracing::warn!(
                    id,
                    "empty token text; naming it [EMPTY_{id}] like llama.cpp"
                );
                format!("[EMPTY_{id}]")
            } else {
                text.to_string()
            };
            if let Some(first) = ids.insert(text.clone(), id) {
                return Err(TokenizerError::DuplicateToken {
                    text,
                    first,
                    second: id,
                });
            }
            texts.push(text);
            attrs.push(match &token_types {
                Some(types) => TokenAttrs::from_token_type(types[index]),
                None => TokenAttrs::NORMAL,
            });
        }

        let mut vocab = Vocab {
            texts,
            ids,
            scores,
            attrs,
            special: defaults.special,
            add_bos: add_bos_default || defaults.add_bos,
            add_eos: false,
            add_space_prefix: defaults.add_space_prefix,
            eog: Vec::new(),
            special_by_length: Vec::new(),
        };
        if no_default_bos {
            vocab.special.bos = None;
        }
        if let Some(flag) = metadata
            .get_bool(keys::ADD_SPACE_PREFIX)
            .map_err(meta_err(keys::ADD_SPACE_PREFIX))?
        {
            vocab.add_space_prefix = flag;
        }
        vocab.read_special_ids(metadata, n_tokens_u32)?;
        if let Some(flag) = metadata
            .get_bool(keys::ADD_BOS)
            .map_err(meta_err(keys::ADD_BOS))?
        {
            vocab.add_bos = flag;
        }
        if let Some(flag) = metadata
            .get_bool(keys::ADD_EOS)
            .map_err(meta_err(keys::ADD_EOS))?
        {
            vocab.add_eos = flag;
        }
        vocab.detect_special_by_text();
        vocab.mark_unused_control_tokens();
        vocab.build_eog_set();
        vocab.build_special_by_length();
        vocab.apply_model_specific_strip_flags(metadata)?;
        Ok(vocab)
    }

    pub fn len(&self) -> usize {
        self.texts.len()
    }

    pub fn attrs(&self, id: TokenId) -> TokenAttrs {
        self.attrs
            .get(id as usize)
            .copied()
            .unwrap_or(TokenAttrs(0))
    }

    pub fn id_of(&self, text: &str) -> Option<TokenId> {
        self.ids.get(text).copied()
    }

    /// SentencePiece byte fallback: `<0xXX>`, else the byte itself as a token.
    pub fn byte_token(&self, byte: u8) -> Option<TokenId> {
        self.id_of(&format!("<0x{byte:02X}>")).or_else(|| {
            char::from_u32(u32::from(byte))
                .filter(char::is_ascii)
                .and_then(|c| self.id_of(c.encode_utf8(&mut [0; 4])))
        })
    }

    fn read_special_ids(
        &mut self,
        metadata: &Metadata,
        n_tokens: u32,
    ) -> Result<(), TokenizerError> {
        let fields: [(&'static str, SpecialField); 17] = [
            (keys::BOS_ID, |s| &mut s.bos),
            (keys::EOS_ID, |s| &mut s.eos),
            (keys::EOT_ID, |s| &mut s.eot),
            (keys::EOM_ID, |s| &mut s.eom),
            (keys::UNK_ID, |s| &mut s.unk),
            (keys::SEP_ID, |s| &mut s.sep),
            (keys::PAD_ID, |s| &mut s.pad),
            (keys::MASK_ID, |s| &mut s.mask),
            (keys::FIM_PRE_ID, |s| &mut s.fim_prefix),
            (keys::FIM_SUF_ID, |s| &mut s.fim_suffix),
            (keys::FIM_MID_ID, |s| &mut s.fim_middle),
            (keys::FIM_PAD_ID, |s| &mut s.fim_pad),
            (keys::FIM_REP_ID, |s| &mut s.fim_repo),
            (keys::FIM_SEP_ID, |s| &mut s.fim_file_sep),
            (keys::PREFIX_ID, |s| &mut s.fim_prefix),
            (keys::SUFFIX_ID, |s| &mut s.fim_suffix),
            (keys::MIDDLE_ID, |s| &mut s.fim_middle),
        ];
        for (key, field) in fields {
            let slot = field(&mut self.special);
            if slot.is_some_and(|id| id >= n_tokens) {
                tracing::warn!(
                    key,
                    "default special token id out of vocabulary range; disabling"
                );
                *slot = None;
            }
            // Negative ids (-1 = none) in the file are ignored like missing keys.
            let Some(value) = metadata.get(key) else {
                continue;
            };
            match value.as_integer().map(u32::try_from) {
                Some(Ok(id)) if id < n_tokens => *slot = Some(id),
                Some(Ok(id)) => tracing::warn!(key, id, "special token id out of range; ignored"),
                Some(Err(_)) => {}
                None => {
                    return Err(TokenizerError::WrongType {
                        key,
                        expected: "integer",
                    });
                }
            }
        }
        Ok(())
    }

    fn find_text(&self, candidates: &[&str]) -> Option<TokenId> {
        (0..self.len())
            .find(|&i| candidates.contains(&self.texts[i].as_str()))
            .map(|i| i as TokenId)
    }

    fn mark_control(&mut self, id: TokenId) {
        let attrs = &mut self.attrs[id as usize];
        if !attrs.contains_any(TokenAttrs::CONTROL) {
            tracing::debug!(
                id,
                "control-looking token was not control-typed; marking it control"
            );
            attrs.set(TokenAttrs::CONTROL, true);
        }
    }

    /// EOT, EOM and FIM tokens named by text when the metadata gives no id.
    fn detect_special_by_text(&mut self) {
        let detections: [(SpecialField, &[&str]); 8] = [
            (|s| &mut s.eot, EOT_TEXTS),
            (|s| &mut s.eom, EOM_TEXTS),
            (|s| &mut s.fim_prefix, FIM_PREFIX_TEXTS),
            (|s| &mut s.fim_suffix, FIM_SUFFIX_TEXTS),
            (|s| &mut s.fim_middle, FIM_MIDDLE_TEXTS),
            (|s| &mut s.fim_pad, FIM_PAD_TEXTS),
            (|s| &mut s.fim_repo, FIM_REPO_TEXTS),
            (|s| &mut s.fim_file_sep, FIM_FILE_SEP_TEXTS),
        ];
        for (field, texts) in detections {
            if field(&mut self.special).is_some() {
                continue;
            }
            if let Some(id) = self.find_text(texts) {
                *field(&mut self.special) = Some(id);
                self.mark_control(id);
            }
        }
    }

    /// Control tokens whose text contains "unused" are unused.
    fn mark_unused_control_tokens(&mut self) {
        for (text, attrs) in self.texts.iter().zip(self.attrs.iter_mut()) {
            if attrs.contains_any(TokenAttrs::CONTROL) && text.contains("unused") {
                attrs.set(TokenAttrs::UNUSED, true);
            }
        }
    }

    fn build_eog_set(&mut self) {
        let mut eog = std::collections::BTreeSet::new();
        let s = self.special;
        eog.extend(
            [s.fim_pad, s.fim_repo, s.fim_file_sep]
                .into_iter()
                .flatten(),
        );
        for id in 0..self.len() as TokenId {
            if EOG_TEXTS.contains(&self.texts[id as usize].as_str()) {
                eog.insert(id);
                self.mark_control(id);
            }
        }
        for id in 0..self.len() {
            if ALWAYS_RENDERED_TEXTS.contains(&self.texts[id].as_str()) {
                self.attrs[id] = TokenAttrs::USER_DEFINED;
            }
        }
        eog.extend([s.eos, s.eot, s.eom].into_iter().flatten());

        // o200k_harmony / solar-open: with <|return|>+<|call|> (or <|calls|>+<|flush|>) present,
        // <|end|> separates messages and must not stop generation.
        let has = |eog: &std::collections::BTreeSet<TokenId>, text: &str| {
            eog.iter().any(|&id| self.texts[id as usize] == text)
        };
        let end_id = eog
            .iter()
            .copied()
            .find(|&id| self.texts[id as usize] == "<|end|>");
        let has_call = has(&eog, "<|call|>") || has(&eog, "<|calls|>");
        if let Some(end_id) = end_id
            && has_call
            && (has(&eog, "<|return|>") || has(&eog, "<|flush|>"))
        {
            eog.remove(&end_id);
            self.attrs[end_id as usize] = TokenAttrs::USER_DEFINED;
        }

        // gemma4 / plamo: "</s>" is an ordinary token there.
        let s_id = eog
            .iter()
            .copied()
            .find(|&id| self.texts[id as usize] == "</s>");
        if let Some(s_id) = s_id
            && (has(&eog, "<|tool_response>") || has(&eog, "<|plamo:eos|>"))
        {
            eog.remove(&s_id);
            self.attrs[s_id as usize] = TokenAttrs::NORMAL;
        }
        self.eog = eog.into_iter().collect();
    }

    fn build_special_by_length(&mut self) {
        let special = TokenAttrs::CONTROL | TokenAttrs::USER_DEFINED | TokenAttrs::UNKNOWN;
        let mut ids: Vec<TokenId> = (0..self.len() as TokenId)
            .filter(|&id| self.attrs[id as usize].contains_any(special))
            .collect();
        // Longest first; ties by id (llama.cpp's order among equal lengths is unspecified).
        ids.sort_by_key(|&id| std::cmp::Reverse(self.texts[id as usize].len()));
        self.special_by_length = ids;
    }

    /// Phi-3 strips whitespace after its special tokens (llama.cpp sets this by model name).
    fn apply_model_specific_strip_flags(
        &mut self,
        metadata: &Metadata,
    ) -> Result<(), TokenizerError> {
        let name = metadata
            .get_str(keys::GENERAL_NAME)
            .map_err(meta_err(keys::GENERAL_NAME))?
            .unwrap_or("")
            .to_lowercase();
        if name.contains("phi-3") || name.contains("phi3") {
            for &id in &self.special_by_length {
                self.attrs[id as usize].set(TokenAttrs::RSTRIP, true);
            }
            let mut set = |text: &str, on: bool| {
                if let Some(&id) = self.ids.get(text) {
                    self.attrs[id as usize].set(TokenAttrs::RSTRIP, on);
                }
            };
            set("</s>", true);
            for text in ["<unk>", "<s>", "<|endoftext|>"] {
                set(text, false);
            }
        }
        Ok(())
    }
}

fn check_len(key: &'static str, expected: usize, found: usize) -> Result<(), TokenizerError> {
    if found < expected {
        return Err(TokenizerError::LengthMismatch {
            key,
            expected,
            found,
        });
    }
    Ok(())
}

/// `tokenizer.ggml.scores` as f32 (stored as f32 or i32; absent: all zero).
fn read_scores(metadata: &Metadata, n_tokens: usize) -> Result<Vec<f32>, TokenizerError> {
    let Some(array) = metadata
        .get_array(keys::SCORES)
        .map_err(meta_err(keys::SCORES))?
    else {
        return Ok(vec![0.0; n_tokens]);
    };
    if let Ok(scores) = metadata.f32_array(keys::SCORES) {
        check_len(keys::SCORES, n_tokens, scores.len())?;
        return Ok(scores[..n_tokens].to_vec());
    }
    check_len(keys::SCORES, n_tokens, array.len())?;
    let ints = metadata
        .i32_array(keys::SCORES)
        .map_err(meta_err(keys::SCORES))?;
    Ok(ints[..n_tokens].iter().map(|&s| s as f32).collect())
}
