//! A session slot: the session it keeps (the prefix cache) and, while it serves a request, that
//! request's generation state — its own sampler (so a seeded request draws the same tokens
//! whatever else runs), its text stream and its progress through prefill and decode.

use std::time::Instant;

use engine::generate::{Detokenizer, FinishReason};
use engine::speculative::DraftLength;
use engine::{EvalResult, Sampler, Session};

use crate::api::ApiError;
use crate::job::{Event, Job, Outcome, TokenLogprob};
use crate::metrics::Metrics;
use engine::text::TextStream;

pub(crate) struct Active {
    pub job: Job,
    pub sampler: Sampler,
    pub text: TextStream,
    /// Text not sent yet (non-streaming requests get it all at the end: no wake-up of the HTTP
    /// side per token).
    pub unsent: String,
    /// Log-probabilities of the tokens behind `unsent` (when asked for).
    pub unsent_logprobs: Vec<TokenLogprob>,
    /// Choice 0 of an `n > 1` request: the other choices are forked from its session when the
    /// prompt is evaluated.
    pub forks_pending: bool,
    /// Prompt tokens already in the session.
    pub pos: usize,
    pub cached: usize,
    pub generated: usize,
    /// The last sampled token, fed in the next step.
    pub pending: Option<u32>,
    /// Speculative decoding: tokens drafted to follow `pending`, fed with it in the next step
    /// (all their logits wanted) and judged by [`Active::verify_drafts`].
    pub drafts: Vec<u32>,
    /// How many tokens to draft next, from how this request's drafts did so far.
    pub draft_length: DraftLength,
    /// This request's drafted tokens and how many of them it kept.
    pub drafted: usize,
    pub accepted: usize,
    /// A stop string ended the text (what followed it is dropped, not flushed).
    pub stopped_by_string: bool,
    /// Admission order (prefill goes oldest first).
    pub seq: u64,
    pub t_admit: Instant,
    pub t_prefilled: Option<Instant>,
    /// When the last token was sampled (inter-token latency).
    pub t_last_token: Option<Instant>,
}

#[derive(Default)]
pub(crate) struct Slot {
    pub session: Option<Session>,
    pub last_used: u64,
    pub active: Option<Active>,
}

impl Active {
    /// `max_draft`: the most tokens speculative decoding drafts per step (1 without it).
    pub fn new(job: Job, cached: usize, seq: u64, max_draft: usize) -> Active {
        // Cloned, not taken: the job's grammar stays at its start for the siblings of `n > 1`,
        // which are made from this job once its prompt is evaluated.
        let mut sampler =
            Sampler::new(job.params.sampler.clone()).with_grammar(job.params.grammar.clone());
        for &t in &job.prompt {
            sampler.accept(t);
        }
        let text = TextStream::new(job.params.stop.clone());
        let forks_pending = job.choice == 0 && job.params.n > 1;
        Active {
            job,
            sampler,
            text,
            unsent: String::new(),
            unsent_logprobs: Vec::new(),
            forks_pending,
            pos: cached,
            cached,
            generated: 0,
            pending: None,
            drafts: Vec::new(),
            draft_length: DraftLength::new(max_draft),
            drafted: 0,
            accepted: 0,
            stopped_by_string: false,
            seq,
            t_admit: Instant::now(),
            t_prefilled: None,
            t_last_token: None,
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
        self.emit(
            tok,
            &session.last_logits,
            session.tokens.len(),
            detok,
            metrics,
            n_ctx,
        )
    }

    /// Judges the drafts the last step evaluated after the pending token, in order, with the
    /// sampler's acceptance rule (greedy: the argmax, so the text is the non-speculative one):
    /// each kept draft is emitted and the next one judged; the first rejected one is replaced
    /// by the token the sampler chose instead, and after a run kept whole one more token is
    /// sampled from the last row. `rows` are the step's logits for the pending token and the
    /// drafts (row `k`: after the pending token and `k` drafts); `base` is the session's
    /// length before the pending token. Returns how the generation ended (if it did) and the
    /// row the last emitted token came from: the session keeps `base + 1 + row` positions.
    pub fn verify_drafts(
        &mut self,
        rows: &EvalResult,
        base: usize,
        detok: &dyn Detokenizer,
        metrics: &Metrics,
        n_ctx: usize,
    ) -> Result<(Option<FinishReason>, usize), ApiError> {
        let drafts = std::mem::take(&mut self.drafts);
        if rows.n_rows != drafts.len() + 1 {
            return Err(ApiError::internal(format!(
                "verification returned {} rows of logits for {} tokens",
                rows.n_rows,
                drafts.len() + 1
            )));
        }
        self.drafted += drafts.len();
        metrics.drafted_tokens.add(drafts.len() as u64);
        let grammar_error = |e: engine::GrammarError| ApiError::internal(e.to_string());
        for (k, &draft) in drafts.iter().enumerate() {
            let row = rows.row(k);
            let mut logits = row.to_vec();
            let tok = self
                .sampler
                .verify(&mut logits, draft)
                .map_err(grammar_error)?;
            let kept = tok == draft;
            if kept {
                self.accepted += 1;
                metrics.accepted_tokens.inc();
            }
            let finish = self.emit(tok, row, base + 1 + k, detok, metrics, n_ctx)?;
            if finish.is_some() || !kept {
                self.draft_length
                    .record(drafts.len(), k + usize::from(kept));
                return Ok((finish, k));
            }
        }
        self.draft_length.record(drafts.len(), drafts.len());
        let n = drafts.len();
        let row = rows.row(n);
        let mut logits = row.to_vec();
        let tok = self.sampler.sample(&mut logits).map_err(grammar_error)?;
        let finish = self.emit(tok, row, base + 1 + n, detok, metrics, n_ctx)?;
        Ok((finish, n))
    }

    /// Records a chosen token: penalties, counts and latencies, its log-probabilities (from
    /// `logits`, the model's row it was chosen from), its text (streamed at once when the
    /// request streams). The token becomes `pending` unless the generation ends with it; `len`
    /// is the session's length once the positions behind `logits` are in it.
    fn emit(
        &mut self,
        tok: u32,
        logits: &[f32],
        len: usize,
        detok: &dyn Detokenizer,
        metrics: &Metrics,
        n_ctx: usize,
    ) -> Result<Option<FinishReason>, ApiError> {
        self.sampler.accept(tok);
        self.generated += 1;
        metrics.generated_tokens.inc();
        let now = Instant::now();
        let latency = &metrics.latency;
        match self.t_last_token.replace(now) {
            Some(last) => latency.inter_token.observe((now - last).as_secs_f64()),
            None => latency
                .time_to_first_token
                .observe((now - self.job.admitted()).as_secs_f64()),
        }
        if !self.job.params.ignore_eos && detok.is_end_of_generation(tok) {
            return Ok(Some(FinishReason::Stop));
        }
        if let Some(top) = self.job.params.logprobs {
            // From the logits as the model gave them, not the sampler's modified copy.
            let lp = engine::logprobs::token_logprobs(logits, tok, top);
            self.unsent_logprobs.push(TokenLogprob {
                bytes: detok.token_bytes(tok),
                logprob: lp.logprob,
                top: lp
                    .top
                    .into_iter()
                    .map(|(t, l)| (detok.token_bytes(t), l))
                    .collect(),
            });
        }
        let (text, stopped) = self.text.push(&detok.token_bytes(tok));
        self.unsent.push_str(&text);
        if self.job.params.stream && !self.unsent.is_empty() && !self.send_unsent() {
            return Ok(Some(FinishReason::Cancelled));
        }
        if stopped {
            self.stopped_by_string = true;
            return Ok(Some(FinishReason::Stop));
        }
        if self.generated >= self.job.params.max_tokens {
            return Ok(Some(FinishReason::Length));
        }
        if len + 1 > n_ctx {
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
        if !self.unsent.is_empty() || !self.unsent_logprobs.is_empty() {
            self.send_unsent();
        }
        let outcome = Outcome {
            finish,
            prompt_tokens: self.job.prompt.len(),
            cached_tokens: self.cached,
            completion_tokens: self.generated,
            drafted_tokens: self.drafted,
            accepted_tokens: self.accepted,
        };
        let prefilled = self.t_prefilled.unwrap_or(self.t_admit);
        let prompt_secs = prefilled.duration_since(self.t_admit).as_secs_f64();
        let gen_secs = prefilled.elapsed().as_secs_f64();
        let speculation = if self.drafted > 0 {
            format!(
                ", drafted {}, accepted {} ({:.0} %)",
                self.drafted,
                self.accepted,
                100.0 * self.accepted as f64 / self.drafted as f64
            )
        } else {
            String::new()
        };
        tracing::info!(
            "request {} done: prompt {} tokens ({} evaluated in {:.3} s), {} generated in {:.3} s ({:.1} t/s), {:?}{speculation}",
            self.job.id,
            outcome.prompt_tokens,
            outcome.prompt_tokens - outcome.cached_tokens,
            prompt_secs,
            outcome.completion_tokens,
            gen_secs,
            outcome.completion_tokens.saturating_sub(1) as f64 / gen_secs.max(1e-9),
            finish
        );
        if self.job.choice == 0 {
            metrics.requests_ok.inc();
        }
        let _ = self.job.reply.send(Event::Done {
            choice: self.job.choice,
            outcome,
        });
    }

    /// Sends the text and log-probabilities not sent yet; false when the client is gone.
    fn send_unsent(&mut self) -> bool {
        self.job
            .reply
            .send(Event::Text {
                choice: self.job.choice,
                text: std::mem::take(&mut self.unsent),
                logprobs: std::mem::take(&mut self.unsent_logprobs),
            })
            .is_ok()
    }
}
