//! A session slot: the session it keeps (the prefix cache) and, while it serves a request, that
//! request's generation state — its own sampler (so a seeded request draws the same tokens
//! whatever else runs), its text stream and its progress through prefill and decode.

use std::time::Instant;

use engine::generate::{Detokenizer, FinishReason};
use engine::{Sampler, Session};

use crate::api::ApiError;
use crate::job::{Event, Job, Outcome};
use crate::metrics::Metrics;
use engine::text::TextStream;

pub(crate) struct Active {
    pub job: Job,
    pub sampler: Sampler,
    pub text: TextStream,
    /// Text not sent yet (non-streaming requests get it all at the end: no wake-up of the HTTP
    /// side per token).
    pub unsent: String,
    /// Prompt tokens already in the session.
    pub pos: usize,
    pub cached: usize,
    pub generated: usize,
    /// The last sampled token, fed in the next step.
    pub pending: Option<u32>,
    /// A stop string ended the text (what followed it is dropped, not flushed).
    pub stopped_by_string: bool,
    /// Admission order (prefill goes oldest first).
    pub seq: u64,
    pub t_admit: Instant,
    pub t_prefilled: Option<Instant>,
}

#[derive(Default)]
pub(crate) struct Slot {
    pub session: Option<Session>,
    pub last_used: u64,
    pub active: Option<Active>,
}

impl Active {
    pub fn new(mut job: Job, cached: usize, seq: u64) -> Active {
        let mut sampler =
            Sampler::new(job.params.sampler.clone()).with_grammar(job.params.grammar.take());
        for &t in &job.prompt {
            sampler.accept(t);
        }
        let text = TextStream::new(job.params.stop.clone());
        Active {
            job,
            sampler,
            text,
            unsent: String::new(),
            pos: cached,
            cached,
            generated: 0,
            pending: None,
            stopped_by_string: false,
            seq,
            t_admit: Instant::now(),
            t_prefilled: None,
        }
    }

    pub fn prefilling(&self) -> bool {
        self.pos < self.job.prompt.len()
    }

    /// Samples the next token from the session's last logits and streams its text; the token
    /// becomes `pending` (fed in the next step) unless the generation ends here. Fails when
    /// the request's grammar does (no token of the vocabulary can continue it).
    pub fn sample_next(
        &mut self,
        session: &Session,
        detok: &dyn Detokenizer,
        metrics: &Metrics,
        n_ctx: usize,
    ) -> Result<Option<FinishReason>, ApiError> {
        let mut logits = session.last_logits.clone();
        let tok = self
            .sampler
            .sample(&mut logits)
            .map_err(|e| ApiError::internal(e.to_string()))?;
        self.sampler.accept(tok);
        self.generated += 1;
        metrics.generated_tokens.inc();
        if !self.job.params.ignore_eos && detok.is_end_of_generation(tok) {
            return Ok(Some(FinishReason::Stop));
        }
        let (text, stopped) = self.text.push(&detok.token_bytes(tok));
        self.unsent.push_str(&text);
        if self.job.params.stream
            && !self.unsent.is_empty()
            && self
                .job
                .reply
                .send(Event::Text(std::mem::take(&mut self.unsent)))
                .is_err()
        {
            return Ok(Some(FinishReason::Cancelled));
        }
        if stopped {
            self.stopped_by_string = true;
            return Ok(Some(FinishReason::Stop));
        }
        if self.generated >= self.job.params.max_tokens {
            return Ok(Some(FinishReason::Length));
        }
        if session.tokens.len() + 1 > n_ctx {
            return Ok(Some(FinishReason::ContextFull));
        }
        self.pending = Some(tok);
        Ok(None)
    }

    /// Sends what is left of the text and the outcome.
    pub fn finish(mut self, finish: FinishReason, metrics: &Metrics) {
        if finish == FinishReason::Cancelled {
            metrics.requests_cancelled.inc();
            tracing::info!("request {} cancelled: the client disconnected", self.job.id);
            return;
        }
        if !self.stopped_by_string {
            let rest = self.text.finish();
            self.unsent.push_str(&rest);
        }
        if !self.unsent.is_empty() {
            let _ = self
                .job
                .reply
                .send(Event::Text(std::mem::take(&mut self.unsent)));
        }
        let outcome = Outcome {
            finish,
            prompt_tokens: self.job.prompt.len(),
            cached_tokens: self.cached,
            completion_tokens: self.generated,
        };
        let prefilled = self.t_prefilled.unwrap_or(self.t_admit);
        let prompt_secs = prefilled.duration_since(self.t_admit).as_secs_f64();
        let gen_secs = prefilled.elapsed().as_secs_f64();
        tracing::info!(
            "request {} done: prompt {} tokens ({} evaluated in {:.3} s), {} generated in {:.3} s ({:.1} t/s), {:?}",
            self.job.id,
            outcome.prompt_tokens,
            outcome.prompt_tokens - outcome.cached_tokens,
            prompt_secs,
            outcome.completion_tokens,
            gen_secs,
            outcome.completion_tokens.saturating_sub(1) as f64 / gen_secs.max(1e-9),
            finish
        );
        metrics.requests_ok.inc();
        let _ = self.job.reply.send(Event::Done(outcome));
    }
}
