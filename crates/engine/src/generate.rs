//! The generation loop shared by `run`, `chat` and the server: prefill (reusing the cached
//! prefix), sample, detokenize incrementally (multi-byte characters split across tokens come
//! out whole), stop on end-of-generation tokens, stop strings or the token limit.

use std::time::Instant;

use crate::error::{EngineError, Result};
use crate::sampler::Sampler;
use crate::session::{Engine, Session};

/// Anything that can turn token ids into bytes and knows which ids end a generation.
pub trait Detokenizer {
    fn token_bytes(&self, id: u32) -> Vec<u8>;
    fn is_end_of_generation(&self, id: u32) -> bool;
}

#[derive(Clone, Debug, Default)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    /// Generation stops before the first occurrence of any of these.
    pub stop: Vec<String>,
    /// Keep going past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The context is full.
    ContextFull,
    /// The consumer asked to stop (client disconnected, Ctrl-C).
    Cancelled,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct GenerateStats {
    pub prompt_tokens: usize,
    /// Prompt tokens actually evaluated (the rest came from the cached prefix).
    pub prompt_evaluated: usize,
    pub prompt_secs: f64,
    pub generated_tokens: usize,
    pub generation_secs: f64,
    pub finish: FinishReason,
    pub tokens: Vec<u32>,
}

impl GenerateStats {
    pub fn prompt_tps(&self) -> f64 {
        self.prompt_evaluated as f64 / self.prompt_secs.max(1e-9)
    }
    pub fn generation_tps(&self) -> f64 {
        // The first generated token's logits came from the prefill; the rest cost one step each.
        self.generated_tokens.saturating_sub(1) as f64 / self.generation_secs.max(1e-9)
    }
}

/// Turns a stream of byte pieces into text, holding back an incomplete UTF-8 sequence.
#[derive(Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(
                        std::str::from_utf8(&self.pending[..valid]).expect("valid prefix"),
                    );
                    match e.error_len() {
                        // Incomplete sequence at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Whatever is left, with invalid bytes replaced.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

/// Holds back text that might be the start of a stop string; finds complete stops.
struct StopMatcher<'a> {
    stops: &'a [String],
    held: String,
}

impl StopMatcher<'_> {
    /// Adds text; returns (text safe to emit, whether a stop string was found).
    fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        if let Some(pos) = self
            .stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            let out = self.held[..pos].to_string();
            self.held.clear();
            return (out, true);
        }
        let keep = self
            .stops
            .iter()
            .map(|s| {
                (1..s.len().min(self.held.len() + 1))
                    .rev()
                    .find(|&k| s.is_char_boundary(k) && self.held.ends_with(&s[..k]))
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Generates after `prompt`: the session's history becomes `prompt` (reusing any cached common
/// prefix) followed by the generated tokens. `on_text` receives text as it is produced and
/// returns false to cancel.
pub fn generate(
    engine: &mut Engine,
    session: &mut Session,
    detok: &dyn Detokenizer,
    sampler: &mut Sampler,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<GenerateStats> {
    if prompt.is_empty() {
        return Err(EngineError::Executor("the prompt is empty".into()));
    }
    let t0 = Instant::now();
    let evaluated = engine.sync(session, prompt)?;
    let prompt_secs = t0.elapsed().as_secs_f64();
    for &t in prompt {
        sampler.accept(t);
    }
    let t1 = Instant::now();
    let mut utf8 = Utf8Stream::default();
    let mut stops = StopMatcher {
        stops: &opts.stop,
        held: String::new(),
    };
    let mut tokens = Vec::new();
    let n_ctx = engine.info().n_ctx;
    let mut finish = FinishReason::Length;
    while tokens.len() < opts.max_tokens {
        let mut logits = std::mem::take(&mut session.last_logits);
        let tok = sampler.sample(&mut logits);
        sampler.accept(tok);
        tokens.push(tok);
        if !opts.ignore_eos && detok.is_end_of_generation(tok) {
            finish = FinishReason::Stop;
            break;
        }
        let text = utf8.push(&detok.token_bytes(tok));
        let (emit, stopped) = stops.push(&text);
        if !emit.is_empty() && !on_text(&emit) {
            finish = FinishReason::Cancelled;
            break;
        }
        if stopped {
            finish = FinishReason::Stop;
            break;
        }
        if tokens.len() >= opts.max_tokens {
            break;
        }
        if session.tokens.len() + 1 > n_ctx {
            finish = FinishReason::ContextFull;
            break;
        }
        engine.append(session, &[tok])?;
    }
    if finish != FinishReason::Stop && finish != FinishReason::Cancelled {
        let (rest, _) = stops.push(&utf8.finish());
        let rest = rest + &stops.flush();
        if !rest.is_empty() {
            on_text(&rest);
        }
    }
    Ok(GenerateStats {
        prompt_tokens: prompt.len(),
        prompt_evaluated: evaluated,
        prompt_secs,
        generated_tokens: tokens.len(),
        generation_secs: t1.elapsed().as_secs_f64(),
        finish,
        tokens,
    })
}

impl Detokenizer for crate::tokenizer::Tokenizer {
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.token_to_piece(id).to_vec()
    }

    fn is_end_of_generation(&self, id: u32) -> bool {
        self.is_eog(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_stream_holds_back_split_characters() {
        let mut s = Utf8Stream::default();
        let bytes = "héllo €".as_bytes();
        let mut out = String::new();
        for b in bytes {
            out.push_str(&s.push(&[*b]));
        }
        assert_eq!(out, "héllo €");
        assert_eq!(s.push(&[0xff, b'a']), "\u{fffd}a");
    }

    #[test]
    fn stop_matcher_holds_prefixes_and_cuts_at_stops() {
        let stops = vec!["\n\nUser:".to_string()];
        let mut m = StopMatcher {
            stops: &stops,
            held: String::new(),
        };
        assert_eq!(m.push("Hello"), ("Hello".to_string(), false));
        assert_eq!(m.push("\n\nUs"), (String::new(), false));
        assert_eq!(m.push("er: hi"), (String::new(), true));
        let mut m = StopMatcher {
            stops: &stops,
            held: String::new(),
        };
        assert_eq!(m.push("a\n"), ("a".to_string(), false));
        assert_eq!(m.push("b"), ("\nb".to_string(), false));
    }
}
