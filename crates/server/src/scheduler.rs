//! The scheduler: the one thread that owns the [`Engine`]. HTTP handlers submit [`Job`]s over
//! a channel ([`crate::job`]), each with its own reply channel of events; handlers never touch
//! the engine.
//!
//! Continuous batching: `--parallel N` slots. Every step is one `Executor::eval` over one
//! decode token for each decoding slot plus at most one prefill chunk (≤ `prefill_chunk`
//! tokens, oldest admission first), so each expert's weights are read once per step for every
//! session that routed to it and a long prompt never stalls the decoders for more than a chunk.
//! Requests wait in a bounded queue for a free slot (the handle refuses with 503 beyond it).
//! Idle slots keep their sessions as the prefix cache ([`crate::prefix_cache`]); sessions leaving
//! memory go to the disk cache ([`crate::disk_cache`]) when there is one.
//!
//! Speculative decoding composes with the batch: a decoding slot with drafts contributes its
//! pending token and the drafts to the step, with the logits of every one of them, and judges
//! the drafts afterwards with its sampler ([`engine::Sampler::verify`], as `moeshard run`
//! does), so the kept ones cost the slot no steps of their own and the other slots' tokens ride
//! in the same forward pass. What a rejection leaves behind is cut off the session.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use engine::generate::Detokenizer;
use engine::{Engine, EvalRequest, EvalResult, Session, Speculation};
use model::LogitsWanted;

use crate::api::ApiError;
use crate::disk_cache::DiskCache;
use crate::job::{Alive, Command, Event, Job, SchedulerConfig, SchedulerHandle};
use crate::metrics::Metrics;
use crate::prefix_cache::{self, IdleSlot};
use crate::slot::{Active, Slot};

pub struct Scheduler {
    engine: Engine,
    detok: Arc<dyn Detokenizer + Send + Sync>,
    rx: Receiver<Command>,
    metrics: Arc<Metrics>,
    cfg: SchedulerConfig,
    disk: Option<DiskCache>,
    slots: Vec<Slot>,
    queue: VecDeque<Job>,
    tick: u64,
    n_ctx: usize,
    last_gauges: Instant,
    last_rates: Instant,
    published_tokens: (u64, u64),
    /// Where drafts come from (speculative decoding), if anywhere.
    speculation: Option<Speculation>,
    /// Tells the handles this scheduler is gone when it is dropped (returned or panicked).
    _alive: Alive,
}

impl Scheduler {
    pub fn new(
        engine: Engine,
        detok: Arc<dyn Detokenizer + Send + Sync>,
        cfg: SchedulerConfig,
        disk: Option<DiskCache>,
        metrics: Arc<Metrics>,
    ) -> (Scheduler, SchedulerHandle) {
        let (tx, rx) = std::sync::mpsc::channel();
        let n_ctx = engine.info().n_ctx;
        metrics.slots.set(cfg.parallel as f64);
        metrics
            .kv_capacity_tokens
            .set((cfg.parallel * n_ctx) as f64);
        let alive = Arc::new(AtomicBool::new(true));
        let handle = SchedulerHandle::new(tx, Arc::clone(&metrics), &cfg, Arc::clone(&alive));
        let slots = (0..cfg.parallel.max(1)).map(|_| Slot::default()).collect();
        let s = Scheduler {
            engine,
            detok,
            rx,
            metrics,
            cfg,
            disk,
            slots,
            queue: VecDeque::new(),
            tick: 1,
            n_ctx,
            last_gauges: Instant::now(),
            last_rates: Instant::now(),
            published_tokens: (0, 0),
            speculation: None,
            _alive: Alive(alive),
        };
        (s, handle)
    }

    /// Drafts tokens for every request with `speculation` (speculative decoding).
    pub fn with_speculation(mut self, speculation: Option<Speculation>) -> Scheduler {
        self.speculation = speculation;
        self
    }

    /// Most tokens drafted per step (1 without speculative decoding).
    fn max_draft(&self) -> usize {
        self.speculation.as_ref().map_or(1, Speculation::max_draft)
    }

    /// Runs until [`SchedulerHandle::shutdown`] (or every handle is gone).
    pub fn run(mut self) {
        self.publish(true);
        loop {
            let busy = self.slots.iter().any(|s| s.active.is_some()) || !self.queue.is_empty();
            let first = if busy {
                None
            } else {
                match self.rx.recv_timeout(Duration::from_millis(500)) {
                    Ok(c) => Some(c),
                    Err(RecvTimeoutError::Timeout) => {
                        self.publish(true);
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            };
            let mut stop = false;
            let mut cmds: Vec<Command> = first.into_iter().collect();
            cmds.extend(self.rx.try_iter());
            for cmd in cmds {
                match cmd {
                    Command::Submit(job) => self.queue.push_back(*job),
                    Command::CancelAll => self.cancel_all("the server is shutting down"),
                    Command::Shutdown => stop = true,
                }
            }
            if stop {
                self.cancel_all("the server is shutting down");
                break;
            }
            self.drop_disconnected();
            self.admit();
            if self.slots.iter().any(|s| s.active.is_some()) {
                self.step();
            }
            self.publish(false);
        }
        self.save_all();
        self.publish(true);
        tracing::info!("scheduler stopped");
    }

    fn fail(&mut self, i: usize, err: ApiError) {
        if let Some(a) = self.slots[i].active.take() {
            tracing::warn!("request {} failed: {}", a.job.id, err.message);
            let _ = a.job.reply.send(Event::Error(err));
            self.metrics.requests_failed.inc();
            self.slots[i].last_used = self.next_tick();
        }
    }

    fn cancel_all(&mut self, why: &str) {
        for job in self.queue.drain(..) {
            self.metrics.queued.fetch_sub(1, Ordering::AcqRel);
            self.metrics.requests_cancelled.inc();
            let _ = job.reply.send(Event::Error(ApiError::unavailable(why)));
        }
        for i in 0..self.slots.len() {
            if let Some(a) = self.slots[i].active.take() {
                tracing::info!("request {} cancelled: {why}", a.job.id);
                self.metrics.requests_cancelled.inc();
                let _ = a.job.reply.send(Event::Error(ApiError::unavailable(why)));
                self.slots[i].last_used = self.next_tick();
            }
        }
    }

    /// Clients that went away: their queued jobs are dropped, their generations stop.
    fn drop_disconnected(&mut self) {
        let before = self.queue.len();
        self.queue.retain(|j| !j.reply.is_closed());
        let dropped = before - self.queue.len();
        if dropped > 0 {
            self.metrics
                .queued
                .fetch_sub(dropped as u64, Ordering::AcqRel);
            self.metrics.requests_cancelled.add(dropped as u64);
        }
        for i in 0..self.slots.len() {
            if self.slots[i]
                .active
                .as_ref()
                .is_some_and(|a| a.job.reply.is_closed())
            {
                let a = self.slots[i].active.take().expect("checked");
                tracing::info!(
                    "request {} cancelled: the client disconnected after {} tokens",
                    a.job.id,
                    a.generated
                );
                self.metrics.requests_cancelled.inc();
                self.slots[i].last_used = self.next_tick();
            }
        }
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn admit(&mut self) {
        while !self.queue.is_empty() {
            let idle: Vec<IdleSlot> = self
                .slots
                .iter()
                .enumerate()
                .filter(|(_, s)| s.active.is_none())
                .map(|(index, s)| IdleSlot {
                    index,
                    tokens: s.session.as_ref().map_or(&[][..], |x| &x.tokens[..]),
                    last_used: s.last_used,
                })
                .collect();
            if idle.is_empty() {
                return;
            }
            let job = self.queue.pop_front().expect("not empty");
            let (i, common) = prefix_cache::choose(&idle, &job.prompt, job.params.cache_prompt);
            self.metrics.queued.fetch_sub(1, Ordering::AcqRel);
            self.start(i, common, job);
        }
    }

    /// Saves a session's full history to the disk cache (if any) before it is cut or dropped.
    fn save_to_disk(&mut self, session: &Session) {
        let Some(disk) = &self.disk else { return };
        if session.tokens.is_empty() || disk.covers(&session.tokens) {
            return;
        }
        match self.engine.snapshot(session) {
            Ok(snap) => {
                if disk.save(snap) {
                    self.metrics.disk_saves.inc();
                }
            }
            Err(e) => tracing::warn!("disk KV cache: snapshot of session {}: {e}", session.id),
        }
    }

    /// Puts `job` into slot `i`, whose session shares `common` tokens with the prompt.
    fn start(&mut self, i: usize, mut common: usize, job: Job) {
        let mut session = match self.slots[i].session.take() {
            Some(s) => s,
            None => self.engine.new_session(),
        };
        let prompt_len = job.prompt.len();
        self.metrics
            .latency
            .queue_wait
            .observe(job.submitted.elapsed().as_secs_f64());
        let mut source = "memory";
        if job.params.cache_prompt
            && common < prompt_len
            && let Some((snap, shared)) = self
                .disk
                .as_ref()
                .and_then(|d| d.lookup(&job.prompt, common))
        {
            self.save_to_disk(&session);
            let old = session.id;
            match self.engine.restore(&snap) {
                Ok(restored) => {
                    self.engine.executor_mut().destroy(old);
                    tracing::info!(
                        "request {}: restored {shared} tokens from the disk KV cache (a saved session of {}; slot {i})",
                        job.id,
                        snap.tokens.len()
                    );
                    self.metrics.disk_restores.inc();
                    self.metrics.disk_restored_tokens.add(shared as u64);
                    session = restored;
                    common = shared;
                    source = "disk";
                }
                Err(e) => {
                    tracing::warn!("disk KV cache: restoring {} tokens: {e}", snap.tokens.len())
                }
            }
        }
        let keep = prefix_cache::keep_len(
            session.tokens.len(),
            !session.last_logits.is_empty(),
            prompt_len,
            common,
        );
        // Sliding-window layers keep only the latest positions and recurrent ones (GLM-5.3
        // Flash) their memory at some positions: the kept prefix ends at the latest reachable.
        let reachable = self.engine.executor().rewind_point(session.id, keep);
        if reachable < keep {
            let from = match reachable {
                0 => "evaluating the prompt afresh".to_string(),
                p => format!("evaluating from position {p}"),
            };
            tracing::info!(
                "request {}: cannot rewind session {} to the {keep} shared positions; {from}",
                job.id,
                session.id
            );
        }
        let keep = reachable;
        if keep < session.tokens.len() {
            self.save_to_disk(&session);
            if let Err(e) = self.engine.executor_mut().truncate(session.id, keep) {
                // A sliding-window cache that dropped what the kept prefix needs is an
                // ordinary cache miss; anything else is worth a warning.
                if matches!(e, engine::EngineError::CannotRewind { .. }) {
                    tracing::info!("request {}: {e}; evaluating the prompt afresh", job.id);
                } else {
                    tracing::warn!("truncating session {}: {e}; starting it afresh", session.id);
                }
                self.engine.executor_mut().destroy(session.id);
                session = self.engine.new_session();
            } else {
                session.tokens.truncate(keep);
                session.last_logits.clear();
            }
        }
        let keep = session.tokens.len();
        tracing::info!(
            "request {}: slot {i}, prompt {prompt_len} tokens, {keep} cached ({}), {} to evaluate",
            job.id,
            if keep > 0 { source } else { "none" },
            prompt_len - keep
        );
        self.metrics.prompt_tokens.add(prompt_len as u64);
        self.metrics.prompt_tokens_cached.add(keep as u64);
        let seq = self.next_tick();
        self.slots[i].session = Some(session);
        self.slots[i].active = Some(Active::new(job, keep, seq, self.max_draft()));
        if keep == prompt_len {
            self.advance(i);
        }
    }

    /// One batched forward: a token for every decoding slot, a chunk for one prefilling slot.
    fn step(&mut self) {
        let prefill = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.active.as_ref().map(|a| (i, a)))
            .filter(|(_, a)| a.prefilling())
            .min_by_key(|(_, a)| a.seq)
            .map(|(i, a)| {
                (
                    i,
                    a.pos,
                    (a.pos + self.cfg.prefill_chunk.max(1)).min(a.job.prompt.len()),
                )
            });
        // Each decoding slot's pending token, followed by its drafts.
        let decode: Vec<(usize, Vec<u32>)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let a = s.active.as_ref()?;
                let mut toks = Vec::with_capacity(1 + a.drafts.len());
                toks.push(a.pending?);
                toks.extend_from_slice(&a.drafts);
                Some((i, toks))
            })
            .collect();
        if prefill.is_none() && decode.is_empty() {
            return;
        }
        let mut plan: Vec<usize> = decode.iter().map(|(i, _)| *i).collect();
        let t0 = Instant::now();
        let result = {
            let slots = &self.slots;
            let sid = |i: usize| {
                slots[i]
                    .session
                    .as_ref()
                    .expect("active slots have sessions")
                    .id
            };
            let mut batch: Vec<EvalRequest> = decode
                .iter()
                .map(|(i, toks)| EvalRequest {
                    session: sid(*i),
                    tokens: toks,
                    logits: if toks.len() > 1 {
                        LogitsWanted::All
                    } else {
                        LogitsWanted::Last
                    },
                })
                .collect();
            if let Some((i, a, b)) = prefill {
                let active = slots[i].active.as_ref().expect("prefilling");
                let last = b == active.job.prompt.len();
                batch.push(EvalRequest {
                    session: sid(i),
                    tokens: &active.job.prompt[a..b],
                    logits: if last {
                        LogitsWanted::Last
                    } else {
                        LogitsWanted::None
                    },
                });
                plan.push(i);
            }
            self.engine.executor_mut().eval(&batch)
        };
        let secs = t0.elapsed().as_secs_f64();
        self.metrics.steps.inc();
        self.metrics.step_seconds.add(secs);
        self.metrics.latency.step.observe(secs);
        self.metrics.batch_size.set(plan.len() as f64);
        if plan.len() as f64 > self.metrics.batch_size_max.get() {
            self.metrics.batch_size_max.set(plan.len() as f64);
        }
        let results = match result {
            Ok(r) if r.len() == plan.len() => r,
            other => {
                let msg = match other {
                    Err(e) => format!("evaluation failed: {e}"),
                    Ok(r) => format!(
                        "the executor returned {} results for {} requests",
                        r.len(),
                        plan.len()
                    ),
                };
                for &i in &plan {
                    self.resync(i);
                    self.fail(i, ApiError::internal(msg.clone()));
                }
                return;
            }
        };
        for (k, (&i, r)) in plan.iter().zip(results).enumerate() {
            let slot = &mut self.slots[i];
            let (Some(session), Some(a)) = (slot.session.as_mut(), slot.active.as_mut()) else {
                continue;
            };
            if k < decode.len() {
                let toks = &decode[k].1;
                let base = session.tokens.len();
                session.tokens.extend_from_slice(toks);
                a.pending = None;
                if toks.len() > 1 {
                    self.verify(i, base, &r);
                    continue;
                }
            } else {
                let (_, from, to) = prefill.expect("the last entry is the prefill");
                session.tokens.extend_from_slice(&a.job.prompt[from..to]);
                a.pos = to;
                self.metrics.prompt_tokens_evaluated.add((to - from) as u64);
            }
            session.last_logits = r.last().map(<[f32]>::to_vec).unwrap_or_default();
            if a.pos == a.job.prompt.len() {
                if a.t_prefilled.is_none() {
                    a.t_prefilled = Some(Instant::now());
                }
                self.advance(i);
            }
        }
    }

    /// After a failed step: makes the session's token list agree with the executor again.
    fn resync(&mut self, i: usize) {
        let Some(s) = self.slots[i].session.as_mut() else {
            return;
        };
        let have = self.engine.executor().session_len(s.id);
        if have < s.tokens.len() {
            s.tokens.truncate(have);
        } else if have > s.tokens.len()
            && self
                .engine
                .executor_mut()
                .truncate(s.id, s.tokens.len())
                .is_err()
        {
            s.tokens.clear();
            self.engine.executor_mut().destroy(s.id);
        }
        s.last_logits.clear();
    }

    /// Samples slot `i`'s next token; finishes its request when the generation ends.
    fn advance(&mut self, i: usize) {
        if self.slots[i]
            .active
            .as_ref()
            .is_some_and(|a| a.forks_pending)
        {
            self.fork_choices(i);
        }
        let tick = self.next_tick();
        let slot = &mut self.slots[i];
        let (Some(session), Some(a)) = (slot.session.as_ref(), slot.active.as_mut()) else {
            return;
        };
        match a.sample_next(session, self.detok.as_ref(), &self.metrics, self.n_ctx) {
            Ok(None) => self.draft(i),
            Ok(Some(finish)) => {
                let a = slot.active.take().expect("active");
                slot.last_used = tick;
                a.finish(finish, &self.metrics);
            }
            Err(e) => self.fail(i, e),
        }
    }

    /// After a step that evaluated slot `i`'s pending token and drafts (`rows`: the logits of
    /// each; `base`: the session's length before them): judges the drafts, cuts the session
    /// back to the positions behind the last emitted token, and drafts again unless the
    /// generation ended.
    fn verify(&mut self, i: usize, base: usize, rows: &EvalResult) {
        let tick = self.next_tick();
        let slot = &mut self.slots[i];
        let (Some(session), Some(a)) = (slot.session.as_mut(), slot.active.as_mut()) else {
            return;
        };
        let id = a.job.id;
        let judged = a.verify_drafts(rows, base, self.detok.as_ref(), &self.metrics, self.n_ctx);
        let rewound = judged.and_then(|(finish, row)| {
            let keep = base + 1 + row;
            if session.tokens.len() > keep {
                match self.engine.executor_mut().truncate(session.id, keep) {
                    Ok(()) => session.tokens.truncate(keep),
                    // Sliding-window layers that already dropped what position `keep` attends
                    // to (a window shorter than the draft): evaluate the kept history again,
                    // as `moeshard run` does. Rare: the cache keeps a window of slack.
                    Err(engine::EngineError::CannotRewind { .. }) => {
                        tracing::debug!(
                            "request {id}: a rejected draft reaches past the sliding window; \
                             evaluating the {keep} kept tokens again"
                        );
                        let history = session.tokens[..keep].to_vec();
                        self.engine
                            .sync(session, &history)
                            .map_err(|e| ApiError::internal(format!("rewinding a draft: {e}")))?;
                    }
                    Err(e) => {
                        return Err(ApiError::internal(format!("rewinding a draft: {e}")));
                    }
                }
            }
            session.last_logits = rows.row(row).to_vec();
            Ok(finish)
        });
        match rewound {
            Ok(None) => self.draft(i),
            Ok(Some(finish)) => {
                let a = slot.active.take().expect("active");
                slot.last_used = tick;
                a.finish(finish, &self.metrics);
            }
            Err(e) => {
                self.resync(i);
                self.fail(i, e);
            }
        }
    }

    /// Drafts the tokens to follow slot `i`'s pending token in the next step (speculative
    /// decoding), as many as the request's recent acceptance suggests and the context and the
    /// token limit leave room for. A drafter that fails costs the request only its drafts.
    fn draft(&mut self, i: usize) {
        let Some(speculation) = &self.speculation else {
            return;
        };
        let slot = &mut self.slots[i];
        let (Some(session), Some(a)) = (slot.session.as_ref(), slot.active.as_mut()) else {
            return;
        };
        let Some(pending) = a.pending else { return };
        // The pending token and its drafts must fit the context, and each kept draft is a
        // generated token (a run kept whole adds one more, sampled after it).
        let room = self
            .n_ctx
            .saturating_sub(session.tokens.len() + 1)
            .min(a.job.params.max_tokens.saturating_sub(a.generated + 1))
            .min(a.draft_length.get());
        if room == 0 {
            return;
        }
        let mut context = Vec::with_capacity(session.tokens.len() + 1);
        context.extend_from_slice(&session.tokens);
        context.push(pending);
        match speculation.draft_in(i, &context, room) {
            Ok(drafts) => a.drafts = drafts,
            Err(e) => tracing::warn!("request {}: drafting failed: {e}", a.job.id),
        }
    }

    /// Starts choices 1..n of slot `i`'s request from its just-evaluated prompt: each in an
    /// idle slot with a fork of the session (empty slots, then the least recently used), or,
    /// when no slot is idle, queued first (it then gets its prompt from the prefix cache).
    fn fork_choices(&mut self, i: usize) {
        let Some(a) = self.slots[i].active.as_mut() else {
            return;
        };
        a.forks_pending = false;
        let siblings: Vec<Job> = (1..a.job.params.n).map(|k| a.job.sibling(k)).collect();
        let mut waiting = Vec::new();
        for job in siblings {
            let idle = self
                .slots
                .iter()
                .enumerate()
                .filter(|(_, s)| s.active.is_none())
                .min_by_key(|(_, s)| (s.session.is_some(), s.last_used))
                .map(|(k, _)| k);
            let Some(k) = idle else {
                waiting.push(job);
                continue;
            };
            let leader = self.slots[i]
                .session
                .as_ref()
                .expect("active slots have sessions");
            let forked = match self.engine.fork(leader) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!("request {}: forking choice {}: {e}", job.id, job.choice);
                    waiting.push(job);
                    continue;
                }
            };
            if let Some(old) = self.slots[k].session.take() {
                self.save_to_disk(&old);
                self.engine.executor_mut().destroy(old.id);
            }
            tracing::info!(
                "request {}: choice {} forked into slot {k} ({} tokens)",
                job.id,
                job.choice,
                forked.tokens.len()
            );
            let cached = forked.tokens.len();
            let seq = self.next_tick();
            self.slots[k].session = Some(forked);
            self.slots[k].active = Some(Active::new(job, cached, seq, self.max_draft()));
            self.advance(k);
        }
        for job in waiting.into_iter().rev() {
            self.metrics.queued.fetch_add(1, Ordering::AcqRel);
            self.queue.push_front(job);
        }
    }

    /// Every slot's session to the disk cache (shutdown).
    fn save_all(&mut self) {
        if self.disk.is_none() {
            return;
        }
        let sessions: Vec<Session> = self
            .slots
            .iter_mut()
            .filter_map(|s| s.session.take())
            .collect();
        for s in &sessions {
            self.save_to_disk(s);
        }
        if let Some(d) = self.disk.as_mut() {
            d.flush();
            tracing::info!(
                "disk KV cache: {} sessions saved at shutdown",
                sessions.len()
            );
        }
    }

    /// Gauges for `/metrics`: at most every 250 ms (executor statistics every second).
    fn publish(&mut self, force: bool) {
        if !force && self.last_gauges.elapsed() < Duration::from_millis(250) {
            return;
        }
        self.last_gauges = Instant::now();
        let m = &self.metrics;
        let active = self.slots.iter().filter(|s| s.active.is_some()).count();
        m.processing.set(active as f64);
        let kv: usize = self
            .slots
            .iter()
            .filter_map(|s| s.session.as_ref())
            .map(|s| s.tokens.len())
            .sum();
        m.kv_tokens.set(kv as f64);
        if let Some(d) = &self.disk {
            let (n, bytes) = d.usage();
            m.disk_entries.set(n as f64);
            m.disk_bytes.set(bytes as f64);
        }
        let dt = self.last_rates.elapsed().as_secs_f64();
        if force || dt >= 1.0 {
            let now = (m.generated_tokens.get(), m.prompt_tokens_evaluated.get());
            m.decode_tps
                .set((now.0 - self.published_tokens.0) as f64 / dt.max(1e-3));
            m.prompt_tps
                .set((now.1 - self.published_tokens.1) as f64 / dt.max(1e-3));
            self.published_tokens = now;
            if let Ok(mut s) = m.executor.lock() {
                *s = self.engine.executor().stats();
            }
            if let Ok(mut c) = m.cluster.lock() {
                *c = self.engine.executor().cluster_view();
            }
            self.last_rates = Instant::now();
        }
    }
}
