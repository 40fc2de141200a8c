//! The generation loop shared by `run`, `chat` and the server: prefill (reusing the cached
//! prefix), sample, detokenize incrementally (multi-byte characters split across tokens come
//! out whole), stop on end-of-generation tokens, stop strings or the token limit.

use std::collections::VecDeque;
use std::time::Instant;

use crate::error::{EngineError, Result};
use crate::sampler::Sampler;
use crate::session::{Engine, Session};
use crate::speculative::{DraftLength, Speculation};
use crate::text::TextStream;
pub use crate::text::Utf8Stream;

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
    /// Speculative decoding: where drafts come from (`None`: one token per step).
    pub speculative: Option<Speculation>,
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
    /// Speculative decoding: tokens drafted, and how many of them the model kept.
    pub drafted_tokens: usize,
    pub accepted_tokens: usize,
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
    let mut text = TextStream::new(opts.stop.clone());
    let mut stopped_by_string = false;
    let mut tokens = Vec::new();
    let n_ctx = engine.info().n_ctx;
    let mut finish = FinishReason::Length;
    // Logits for the next token, and (speculative decoding) the drafted tokens already in the
    // session after it, each with the logits that follow it.
    let mut logits = std::mem::take(&mut session.last_logits);
    let mut drafted: VecDeque<(u32, Vec<f32>)> = VecDeque::new();
    let (mut n_drafted, mut n_accepted) = (0, 0);
    let mut draft_length = DraftLength::new(opts.speculative.as_ref().map_or(1, |s| s.max_draft()));
    // The last draft's length and the accepted count before it, to judge it once it is done.
    let mut last_draft: Option<(usize, usize)> = None;
    while tokens.len() < opts.max_tokens {
        let (tok, kept_draft) = match drafted.pop_front() {
            Some((draft, after)) => {
                let tok = sampler.verify(&mut logits, draft)?;
                if tok == draft {
                    logits = after;
                    n_accepted += 1;
                }
                (tok, tok == draft)
            }
            None => (sampler.sample(&mut logits)?, false),
        };
        sampler.accept(tok);
        tokens.push(tok);
        if !opts.ignore_eos && detok.is_end_of_generation(tok) {
            finish = FinishReason::Stop;
            break;
        }
        let (emit, stopped) = text.push(&detok.token_bytes(tok));
        if !emit.is_empty() && !on_text(&emit) {
            finish = FinishReason::Cancelled;
            break;
        }
        if stopped {
            stopped_by_string = true;
            finish = FinishReason::Stop;
            break;
        }
        if tokens.len() >= opts.max_tokens {
            break;
        }
        if kept_draft {
            continue;
        }
        // `tok` is new to the session: drop the drafts a rejection left behind it, then
        // evaluate it (with a fresh draft when there is one).
        drafted.clear();
        if session.tokens.len() > prompt.len() + tokens.len() - 1 {
            rewind(engine, session, prompt, &tokens[..tokens.len() - 1])?;
        }
        if session.tokens.len() + 1 > n_ctx {
            finish = FinishReason::ContextFull;
            break;
        }
        if let Some((len, accepted_before)) = last_draft.take() {
            draft_length.record(len, n_accepted - accepted_before);
        }
        let draft = match &opts.speculative {
            Some(speculation) => {
                // Room for the draft: the context, and the tokens still wanted after `tok`.
                let room = (n_ctx - session.tokens.len() - 1)
                    .min(opts.max_tokens - tokens.len() - 1)
                    .min(draft_length.get());
                let mut context = Vec::with_capacity(session.tokens.len() + 1);
                context.extend_from_slice(&session.tokens);
                context.push(tok);
                speculation.draft(&context, room)?
            }
            None => Vec::new(),
        };
        if draft.is_empty() {
            engine.append(session, &[tok])?;
            logits = std::mem::take(&mut session.last_logits);
            continue;
        }
        let mut run = Vec::with_capacity(draft.len() + 1);
        run.push(tok);
        run.extend_from_slice(&draft);
        let rows = engine.append_all(session, &run)?;
        session.last_logits.clear();
        logits = rows.row(0).to_vec();
        n_drafted += draft.len();
        last_draft = Some((draft.len(), n_accepted));
        drafted.extend(
            draft
                .iter()
                .enumerate()
                .map(|(i, &d)| (d, rows.row(i + 1).to_vec())),
        );
    }
    // The session holds what a non-speculative run leaves: the prompt and every generated
    // token but the last (whose logits were never needed).
    if session.tokens.len() > prompt.len() + tokens.len().saturating_sub(1) {
        rewind(
            engine,
            session,
            prompt,
            &tokens[..tokens.len().saturating_sub(1)],
        )?;
    }
    // Text held back as a possible stop-string start (or incomplete UTF-8) belongs to the
    // output unless a stop string ended it or the consumer left.
    if !stopped_by_string && finish != FinishReason::Cancelled {
        let rest = text.finish();
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
        drafted_tokens: n_drafted,
        accepted_tokens: n_accepted,
    })
}

/// Cuts the session back to `prompt` followed by `generated` after a rejected draft. Where the
/// sliding-window layers cannot rewind that far, the history is evaluated again.
fn rewind(
    engine: &mut Engine,
    session: &mut Session,
    prompt: &[u32],
    generated: &[u32],
) -> Result<()> {
    let keep = prompt.len() + generated.len();
    match engine.truncate(session, keep) {
        Ok(()) => Ok(()),
        Err(EngineError::CannotRewind { .. }) => {
            let mut history = prompt.to_vec();
            history.extend_from_slice(generated);
            engine.sync(session, &history).map(|_| ())
        }
        Err(e) => Err(e),
    }
}

impl Detokenizer for crate::tokenizer::Tokenizer {
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.token_to_piece(id).to_vec()
    }

    fn is_end_of_generation(&self, id: u32) -> bool {
        self.is_eog(id)
    }
}
