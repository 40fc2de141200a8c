//! Structured output: a grammar (a JSON schema, any JSON object, a Lark grammar or a regex)
//! applied to sampling as a token mask, through `llguidance` (the constrained-decoding library
//! of llama.cpp and vLLM).
//!
//! [`GrammarCompiler`] is built once per model from the model's own tokenizer: every token id
//! gets the bytes it decodes to (byte-level BPE decoded, `<0xAB>` byte tokens as their byte,
//! SentencePiece `▁` as a space), and control tokens (BOS, `<|im_end|>`, …) and every
//! end-of-generation token are marked special, so no grammar text can be spelled with them.
//! It compiles a [`GrammarSpec`] into a [`TokenConstraint`] — one per generation — which the
//! [`Sampler`](crate::Sampler) asks for the allowed tokens before each draw and advances with
//! the drawn token.
//!
//! Sampling runs where the logits arrive, on the node that owns the sessions (the coordinator
//! of a pipeline or a tensor-parallel group), so the mask covers every topology without any
//! worker knowing of it.
//!
//! While the grammar is incomplete, end-of-generation tokens are masked out; once it accepts,
//! they are allowed next to any continuation, and once nothing can follow, only they are. A
//! generation cut by its token limit can therefore end mid-grammar (`finish_reason: "length"`).

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

use crate::tokenizer::Tokenizer;

/// What the output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (OpenAI's `{"type": "json_object"}`).
    JsonObject,
    /// A JSON value valid against this JSON schema.
    JsonSchema(serde_json::Value),
    /// A grammar in llguidance's Lark syntax (`start: ...`; not llama.cpp's GBNF).
    Lark(String),
    /// A regular expression (Rust `regex` syntax) the whole output matches.
    Regex(String),
}

/// Whitespace allowed between JSON tokens, as llama.cpp's JSON grammars allow it: a space, or
/// one or two newlines and an indent of at most 20 spaces or tabs (or nothing). llguidance's
/// default is any amount, and a model caught in a whitespace loop would never finish its
/// document. A schema's own `x-guidance` options replace this.
const JSON_WHITESPACE: &str = r"(?:\x20|\x0A{1,2}[\x20\x09]{0,20})";

/// `schema` with our JSON options unless it brings its own.
fn with_json_options(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(object) = schema.as_object_mut() {
        object
            .entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_pattern": JSON_WHITESPACE}));
    }
    schema
}

impl GrammarSpec {
    fn to_llguidance(&self) -> TopLevelGrammar {
        match self {
            GrammarSpec::JsonObject => TopLevelGrammar::from_json_schema(with_json_options(
                serde_json::json!({"type": "object"}),
            )),
            GrammarSpec::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(with_json_options(schema.clone()))
            }
            GrammarSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
            GrammarSpec::Regex(regex) => TopLevelGrammar::from_regex(regex),
        }
    }

    /// What the grammar is, for error messages.
    fn describe(&self) -> &'static str {
        match self {
            GrammarSpec::JsonObject => "JSON object",
            GrammarSpec::JsonSchema(_) => "JSON schema",
            GrammarSpec::Lark(_) => "Lark grammar",
            GrammarSpec::Regex(_) => "regex",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    /// The schema, grammar or regex does not compile: the request's fault.
    #[error("invalid {what}: {message}")]
    Invalid { what: &'static str, message: String },
    /// The model's vocabulary cannot carry grammars.
    #[error("structured output is not available for this vocabulary: {0}")]
    Vocabulary(String),
    /// The constraint failed during generation (e.g. no token of the vocabulary can continue
    /// the output, or llguidance's limits were exceeded).
    #[error("structured output: {0}")]
    Generation(String),
}

/// Compiles grammars against one model's vocabulary (shared by every request).
#[derive(Clone)]
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field(
                "vocab_size",
                &self.factory.tok_env().tok_trie().vocab_size(),
            )
            .finish()
    }
}

impl GrammarCompiler {
    pub fn new(tokenizer: &Tokenizer) -> Result<GrammarCompiler, GrammarError> {
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(vocabulary_trie(tokenizer)?));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        // llguidance prints to stderr by default; its warnings go to `tracing` instead (compile).
        factory.quiet();
        Ok(GrammarCompiler {
            factory: Arc::new(factory),
        })
    }

    /// The constraint for one generation, or why `spec` does not compile.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<TokenConstraint, GrammarError> {
        let invalid = |message: String| GrammarError::Invalid {
            what: spec.describe(),
            message,
        };
        let parser = self
            .factory
            .create_parser(spec.to_llguidance())
            .map_err(|e| invalid(e.to_string()))?;
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(invalid(e));
        }
        for warning in matcher.grammar_warnings() {
            tracing::debug!("{}: {warning}", spec.describe());
        }
        // A grammar that allows nothing at all (e.g. an unsatisfiable schema) fails here, at
        // compile time, rather than after the prompt has been evaluated.
        matcher.compute_mask().map_err(|e| invalid(e.to_string()))?;
        Ok(TokenConstraint {
            matcher: Box::new(matcher),
            spec: spec.describe(),
        })
    }
}

/// The llguidance view of `tokenizer`'s vocabulary: each id's bytes, specials behind llguidance's
/// 0xFF marker, every end-of-generation token as an EOS.
fn vocabulary_trie(tokenizer: &Tokenizer) -> Result<TokTrie, GrammarError> {
    let eog = tokenizer.eog_tokens();
    let Some(&first_eog) = eog.first() else {
        return Err(GrammarError::Vocabulary(
            "the model has no end-of-generation token to end a completed grammar with".into(),
        ));
    };
    let n_vocab = u32::try_from(tokenizer.vocab_size())
        .map_err(|_| GrammarError::Vocabulary("more than 2^32 tokens".into()))?;
    let words = token_bytes(tokenizer);
    let info = TokRxInfo {
        tok_eos: tokenizer
            .eos()
            .filter(|&e| e < n_vocab)
            .unwrap_or(first_eog),
        tok_bos: tokenizer.bos(),
        tok_pad: tokenizer.pad(),
        tok_end_of_turn: tokenizer.eot(),
        ..TokRxInfo::new(n_vocab, first_eog)
    };
    Ok(TokTrie::from(&info, &words).with_eos_tokens(eog))
}

/// Each token id's bytes as the generated text shows them; control and end-of-generation
/// tokens as `0xFF` + their text (llguidance's special-token convention), so that a grammar
/// never spells text with them; empty pieces stay empty (never allowed).
pub fn token_bytes(tokenizer: &Tokenizer) -> Vec<Vec<u8>> {
    (0..tokenizer.vocab_size() as u32)
        .map(|id| {
            let piece = tokenizer.token_to_piece(id);
            if piece.is_empty() {
                Vec::new()
            } else if tokenizer.is_control(id) || tokenizer.is_eog(id) {
                let mut special = Vec::with_capacity(piece.len() + 1);
                special.push(TokTrie::SPECIAL_TOKEN_MARKER);
                special.extend_from_slice(piece);
                special
            } else {
                piece.to_vec()
            }
        })
        .collect()
}

/// One generation's grammar state.
#[derive(Clone)]
pub struct TokenConstraint {
    /// Boxed: the parser state is large and travels inside every request.
    matcher: Box<Matcher>,
    spec: &'static str,
}

impl std::fmt::Debug for TokenConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenConstraint")
            .field("spec", &self.spec)
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl TokenConstraint {
    /// Sets every logit the grammar does not allow next to −∞ (ids past the vocabulary too).
    /// Once the grammar is complete and nothing can follow, only end-of-generation tokens
    /// remain.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::Generation(e.to_string()))?;
        let n_allowed = allowed.len().min(logits.len());
        let mut any = false;
        for (id, logit) in logits.iter_mut().enumerate() {
            if id < n_allowed && allowed.is_allowed(id as u32) {
                any |= !logit.is_nan();
            } else {
                *logit = f32::NEG_INFINITY;
            }
        }
        if !any {
            return Err(GrammarError::Generation(format!(
                "the {} allows no token of the model's output",
                self.spec
            )));
        }
        Ok(())
    }

    /// Advances the grammar past `token` (drawn from a masked distribution). After the grammar
    /// has ended, the end-of-generation tokens it allows change nothing (`ignore_eos` keeps
    /// drawing them).
    pub fn commit(&mut self, token: u32) -> Result<(), GrammarError> {
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError::Generation(e.to_string()))
    }
}
