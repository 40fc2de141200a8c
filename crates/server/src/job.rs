//! What passes between the HTTP handlers and the scheduler thread: a [`Job`] (prompt tokens and
//! generation parameters) with its own reply channel of [`Event`]s, and the handlers' side of
//! the scheduler, [`SchedulerHandle`], which does admission control (queue limit → 503).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;

use engine::SamplerConfig;
use engine::generate::FinishReason;
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
}

/// A request as the scheduler receives it: tokens, not text.
pub struct Job {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub params: GenParams,
    pub reply: UnboundedSender<Event>,
    /// Counts the request as outstanding until the job is dropped (however it ends).
    _ticket: Ticket,
}

/// One outstanding request (admitted or waiting) in [`Metrics::outstanding`].
struct Ticket(Arc<Metrics>);

impl Drop for Ticket {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::AcqRel);
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
}

/// What streams back to a handler.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Text(String),
    Done(Outcome),
    Error(ApiError),
}

pub(crate) enum Command {
    Submit(Job),
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

/// The handlers' side: submission with admission control.
pub struct SchedulerHandle {
    tx: Sender<Command>,
    metrics: Arc<Metrics>,
    /// Slots plus queue: the requests the server holds at most.
    capacity: u64,
    max_queue: usize,
    closed: AtomicBool,
}

impl SchedulerHandle {
    pub(crate) fn new(
        tx: Sender<Command>,
        metrics: Arc<Metrics>,
        cfg: &SchedulerConfig,
    ) -> SchedulerHandle {
        SchedulerHandle {
            tx,
            metrics,
            capacity: (cfg.parallel + cfg.max_queue) as u64,
            max_queue: cfg.max_queue,
            closed: AtomicBool::new(false),
        }
    }

    pub fn submit(
        &self,
        id: u64,
        prompt: Vec<u32>,
        params: GenParams,
    ) -> Result<UnboundedReceiver<Event>, ApiError> {
        self.metrics.requests.inc();
        if self.closed.load(Ordering::Acquire) {
            self.metrics.requests_rejected.inc();
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        // Admission: every slot busy and `max_queue` requests waiting → 503.
        let held = self.metrics.outstanding.fetch_add(1, Ordering::AcqRel);
        let ticket = Ticket(Arc::clone(&self.metrics));
        if held >= self.capacity {
            self.metrics.requests_rejected.inc();
            return Err(ApiError::unavailable(format!(
                "the server is busy: all slots are in use and {} requests are waiting; retry later",
                self.max_queue
            )));
        }
        self.metrics.queued.fetch_add(1, Ordering::AcqRel);
        let (reply, rx) = unbounded_channel();
        if self
            .tx
            .send(Command::Submit(Job {
                id,
                prompt,
                params,
                reply,
                _ticket: ticket,
            }))
            .is_err()
        {
            self.metrics.queued.fetch_sub(1, Ordering::AcqRel);
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
