//! What passes between the HTTP handlers and the scheduler thread: a [`Job`] (prompt tokens and
//! generation parameters) with its own reply channel of [`Event`]s, and the handlers' side of
//! the scheduler, [`SchedulerHandle`], which does admission control (queue limit → 503) before
//! a request costs anything (parsing, the template, the tokenizer) and knows whether the
//! scheduler thread is still alive.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::time::Instant;

use engine::generate::FinishReason;
use engine::{SamplerConfig, TokenConstraint};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use crate::api::ApiError;
use crate::metrics::Metrics;

/// What a request asks of the generation.
#[derive(Clone, Debug)]
pub struct GenParams {
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub sampler: SamplerConfig,
    /// Reuse cached prefixes (memory and disk).
    pub cache_prompt: bool,
    pub ignore_eos: bool,
    /// Stream text as it is produced; otherwise it is sent once at the end (no wake-up of the
    /// HTTP side per token).
    pub stream: bool,
    /// Choices sampled from the one evaluated prompt (`n`); choice `k` samples with seed
    /// `seed + k`.
    pub n: usize,
    /// Report each generated token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    /// Structured output: the grammar the sampler masks with.
    pub grammar: Option<TokenConstraint>,
}

/// A request as the scheduler receives it: tokens, not text. A request for `n` choices is one
/// job for choice 0, which the scheduler forks into the others once the prompt is evaluated.
pub struct Job {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub params: GenParams,
    pub reply: UnboundedSender<Event>,
    /// When it was handed to the scheduler (its queue wait starts here).
    pub submitted: Instant,
    /// Which of the request's `n` choices this job generates.
    pub choice: usize,
    /// Counts the request as outstanding until its last job is dropped (however it ends).
    admission: Arc<Admission>,
}

impl Job {
    /// When the request was admitted, before its body was read: time to first token counts
    /// from here.
    pub fn admitted(&self) -> Instant {
        self.admission.at
    }

    /// The job of choice `choice` of the same request: same prompt and reply channel, its own
    /// derived seed.
    pub fn sibling(&self, choice: usize) -> Job {
        let mut params = self.params.clone();
        params.sampler.seed = params.sampler.seed.wrapping_add(choice as u64);
        Job {
            id: self.id,
            prompt: self.prompt.clone(),
            params,
            reply: self.reply.clone(),
            submitted: self.submitted,
            choice,
            admission: Arc::clone(&self.admission),
        }
    }
}

/// A request's place among those the server holds (being prepared, waiting or running), taken
/// by [`SchedulerHandle::admit`] before the request is parsed or tokenized; counted in
/// [`Metrics::outstanding`] until dropped.
pub struct Admission {
    metrics: Arc<Metrics>,
    at: Instant,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.metrics.outstanding.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Cleared when the scheduler is dropped: its thread returned or unwound from a panic.
pub(crate) struct Alive(pub(crate) Arc<AtomicBool>);

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
        if std::thread::panicking() {
            tracing::error!(
                "the scheduler thread panicked: requests are refused and /health reports 503"
            );
        }
    }
}

/// How a finished request went.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from a cache (not evaluated).
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// Speculative decoding: tokens drafted for this choice, and how many of them it kept.
    pub drafted_tokens: usize,
    pub accepted_tokens: usize,
}

/// A generated token's log-probability (of the model's distribution, before sampling
/// transforms) and the most likely alternatives, as token bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub bytes: Vec<u8>,
    pub logprob: f32,
    pub top: Vec<(Vec<u8>, f32)>,
}

/// What streams back to a handler, per choice.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Text produced, with the log-probabilities of the tokens generated since the last
    /// event when they were asked for.
    Text {
        choice: usize,
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    Done {
        choice: usize,
        outcome: Outcome,
    },
    Error(ApiError),
}

pub(crate) enum Command {
    /// Boxed: a job (parameters, grammar state, reply channel) is large next to the others.
    Submit(Box<Job>),
    CancelAll,
    Shutdown,
}

#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    pub parallel: usize,
    /// Requests that may wait for a slot; more get 503.
    pub max_queue: usize,
    pub prefill_chunk: usize,
}

/// The handlers' side: admission control and submission.
pub struct SchedulerHandle {
    tx: Sender<Command>,
    metrics: Arc<Metrics>,
    /// Slots plus queue: the requests the server holds at most.
    capacity: u64,
    max_queue: usize,
    closed: AtomicBool,
    alive: Arc<AtomicBool>,
}

impl SchedulerHandle {
    pub(crate) fn new(
        tx: Sender<Command>,
        metrics: Arc<Metrics>,
        cfg: &SchedulerConfig,
        alive: Arc<AtomicBool>,
    ) -> SchedulerHandle {
        SchedulerHandle {
            tx,
            metrics,
            capacity: (cfg.parallel + cfg.max_queue) as u64,
            max_queue: cfg.max_queue,
            closed: AtomicBool::new(false),
            alive,
        }
    }

    /// Whether the scheduler thread is still there (it has not returned or panicked).
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Takes a place for a new request, or refuses it (503): shutting down, the scheduler
    /// gone, or every slot busy with `max_queue` requests waiting or being prepared. Called
    /// before the request is parsed or tokenized, so a full server spends nothing on it.
    pub fn admit(&self) -> Result<Admission, ApiError> {
        // A refusal counts as a request (rejected); an admitted request counts when submitted
        // (one refused as invalid in between counts in neither).
        let refuse = |e: ApiError| {
            self.metrics.requests.inc();
            self.metrics.requests_rejected.inc();
            Err(e)
        };
        if self.closed.load(Ordering::Acquire) {
            return refuse(ApiError::unavailable("the server is shutting down"));
        }
        if !self.is_alive() {
            return refuse(ApiError::unavailable("the scheduler has stopped"));
        }
        let held = self.metrics.outstanding.fetch_add(1, Ordering::AcqRel);
        let admission = Admission {
            metrics: Arc::clone(&self.metrics),
            at: Instant::now(),
        };
        if held >= self.capacity {
            return refuse(ApiError::unavailable(format!(
                "the server is busy: all slots are in use and {} requests are waiting; retry later",
                self.max_queue
            )));
        }
        Ok(admission)
    }

    /// Hands an admitted request to the scheduler.
    pub fn submit(
        &self,
        admission: Admission,
        id: u64,
        prompt: Vec<u32>,
        params: GenParams,
    ) -> Result<UnboundedReceiver<Event>, ApiError> {
        self.metrics.requests.inc();
        if self.closed.load(Ordering::Acquire) {
            self.metrics.requests_rejected.inc();
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        self.metrics.queued.fetch_add(1, Ordering::AcqRel);
        let (reply, rx) = unbounded_channel();
        if self
            .tx
            .send(Command::Submit(Box::new(Job {
                id,
                prompt,
                params,
                reply,
                submitted: Instant::now(),
                choice: 0,
                admission: Arc::new(admission),
            })))
            .is_err()
        {
            self.metrics.queued.fetch_sub(1, Ordering::AcqRel);
            self.metrics.requests_rejected.inc();
            return Err(ApiError::unavailable("the scheduler has stopped"));
        }
        Ok(rx)
    }

    /// Refuses new requests from now on.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    /// Ends every queued and running request with a 503 error (shutdown grace expired).
    pub fn cancel_all(&self) {
        let _ = self.tx.send(Command::CancelAll);
    }

    /// Saves the sessions (disk cache) and stops the scheduler thread.
    pub fn shutdown(&self) {
        self.close();
        let _ = self.tx.send(Command::Shutdown);
    }
}
