//! The shared state behind a [`crate::StreamedExperts`] and the three things that use it: a
//! caller's request for a layer's experts (pin, hand over the cached ones, read the rest,
//! hand them over as they arrive), prefetch hints, and the reader threads. One mutex guards
//! the bookkeeping ([`crate::policy::Policy`], the read queues, the counters); no user code and
//! no I/O run under it.

use std::collections::{HashSet, VecDeque};
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kernels::Weights;
use model::experts::ExpertSink;
use model::weights::Ffn;
use model::{ExpertMatrices, Model, ModelError};

use crate::error::{Result, StreamError};
use crate::io::ModelFiles;
use crate::layout::{self, ExpertPlan};
use crate::policy::{Key, Policy, SlotState, Want};
use crate::profile::Profile;
use crate::slab::Slab;
use crate::source::OwnedFn;

/// A read that takes longer than this is reported as an error rather than waited on forever.
const READ_TIMEOUT: Duration = Duration::from_secs(120);

/// Predictions are read only while at least this share of the uncached experts they name turns
/// out to be used: a wasted read costs about what a useful one saves (one expert's disk time),
/// and it also evicts a cached expert.
const MIN_PREFETCH_ACCURACY: f64 = 0.5;

/// Weight of the newest observation in the running prediction accuracy.
const ACCURACY_EWMA: f64 = 0.1;

pub(crate) struct Job {
    pub(crate) key: Key,
    pub(crate) slot: usize,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) requests: u64,
    pub(crate) hits: u64,
    pub(crate) resident_hits: u64,
    pub(crate) inflight_hits: u64,
    pub(crate) misses: u64,
    pub(crate) prefetch_reads: u64,
    pub(crate) prefetch_used: u64,
    pub(crate) prefetch_skipped: u64,
    pub(crate) reads: u64,
    pub(crate) read_bytes: u64,
    pub(crate) read_errors: u64,
    pub(crate) in_flight: usize,
    pub(crate) busy_since: Option<Instant>,
    pub(crate) busy: Duration,
    pub(crate) wait: Duration,
    /// Resident layers and preload, at start (not in the counters above).
    pub(crate) start_bytes: u64,
    pub(crate) start_time: Duration,
}

pub(crate) struct State {
    pub(crate) policy: Policy,
    pub(crate) demand: VecDeque<Job>,
    pub(crate) prefetch: VecDeque<Job>,
    /// Why the read of each failed slot failed (kept until its waiters have seen it).
    pub(crate) failure: Vec<Option<String>>,
    pub(crate) counts: Profile,
    pub(crate) c: Counters,
    /// Per layer: the uncached experts the last prediction for it named (read or not).
    pub(crate) predicted: Vec<Option<(usize, Vec<usize>)>>,
    /// Running share of predicted uncached experts that were then asked for: for predictions
    /// of a few experts (one token) and of many (a prefill chunk).
    pub(crate) accuracy: [f64; 2],
    pub(crate) calls: u64,
    pub(crate) shutdown: bool,
}

pub(crate) struct Shared {
    pub(crate) model: Arc<Model>,
    pub(crate) files: ModelFiles,
    pub(crate) slab: Slab,
    pub(crate) state: Mutex<State>,
    /// Readers wait here for jobs.
    pub(crate) work: Condvar,
    /// Callers wait here for finished reads and released pins.
    pub(crate) done: Condvar,
    pub(crate) layers: RangeInclusive<usize>,
    pub(crate) moe_layers: Vec<usize>,
    pub(crate) resident: HashSet<usize>,
    pub(crate) owned: Option<OwnedFn>,
    pub(crate) n_expert: usize,
    pub(crate) cache_slots: usize,
    pub(crate) lookahead: bool,
    /// Set once the forward path sends prefetch hints itself (then the prefill heuristic
    /// stands down).
    pub(crate) hinted: AtomicBool,
}

pub(crate) fn n_expert_of(model: &Model, layer: usize) -> Option<usize> {
    match &model.layer(layer).ffn {
        Ffn::Moe { experts, .. } => Some(experts.gate.n_expert),
        Ffn::Dense { .. } => None,
    }
}

fn to_model(e: StreamError) -> ModelError {
    match e {
        StreamError::Model(m) => m,
        other => ModelError::Experts(other.to_string()),
    }
}

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere never leaves the bookkeeping half-updated (no user code runs under
        // the lock), so a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn owns(&self, layer: usize, expert: usize) -> bool {
        self.owned.as_ref().is_none_or(|f| f(layer, expert))
    }

    fn streams(&self, layer: usize) -> bool {
        self.layers.contains(&layer) && n_expert_of(&self.model, layer).is_some()
    }

    fn plan(&self, k: Key) -> Result<ExpertPlan> {
        layout::plan(&self.model, k.layer as usize, k.expert as usize).ok_or_else(|| {
            StreamError::Config(format!(
                "layer {} has no routed expert {}",
                k.layer, k.expert
            ))
        })
    }

    fn next_moe_layer(&self, layer: usize) -> Option<usize> {
        self.moe_layers.iter().copied().find(|&l| l > layer)
    }

    /// Queues reads for as many of `missing` as slots can be found for, pinned for the caller.
    fn issue(
        &self,
        st: &mut State,
        layer: usize,
        missing: &mut VecDeque<usize>,
        waiting: &mut Vec<(usize, usize)>,
        pins: &mut Pins<'_>,
    ) {
        // Another caller may have started reading some of them since they were found missing.
        missing.retain(|&e| match st.policy.lookup(Key::new(layer, e)) {
            Some((s, state @ (SlotState::Ready | SlotState::Reading))) => {
                st.policy.pin(s);
                pins.slots.push(s);
                waiting.push((e, s));
                if state == SlotState::Reading {
                    Self::promote(st, s);
                }
                false
            }
            Some((_, SlotState::Failed)) | None => true,
        });
        if missing.is_empty() {
            return;
        }
        let slots = st.policy.take_slots(missing.len(), Want::Demand);
        for s in slots {
            let e = missing.pop_front().expect("no more slots than misses");
            let key = Key::new(layer, e);
            st.policy.insert(key, s, false);
            st.policy.pin(s);
            pins.slots.push(s);
            waiting.push((e, s));
            st.demand.push_back(Job { key, slot: s });
        }
        self.work.notify_all();
    }

    /// Reads experts of a coming call at low priority and holds them for `layer`.
    pub(crate) fn prefetch_locked(&self, st: &mut State, layer: usize, experts: &[usize]) {
        if !self.streams(layer) || self.resident.contains(&layer) {
            return;
        }
        let mut todo = Vec::new();
        for &e in experts {
            if e >= self.n_expert || !self.owns(layer, e) {
                continue;
            }
            let k = Key::new(layer, e);
            match st.policy.lookup(k) {
                Some((s, SlotState::Ready | SlotState::Reading)) => st.policy.hold(s, layer),
                Some((_, SlotState::Failed)) => {}
                None => todo.push(k),
            }
        }
        // Judge this prediction when the layer is asked for, whether or not it is read.
        let class = self.prediction_class(experts.len());
        st.predicted[layer] = Some((class, todo.iter().map(|k| k.expert as usize).collect()));
        if st.accuracy[class] < MIN_PREFETCH_ACCURACY {
            st.c.prefetch_skipped += todo.len() as u64;
            return;
        }
        // A prediction never churns more than half the cache.
        let room = (self.cache_slots / 2).saturating_sub(st.prefetch.len());
        todo.truncate(room);
        if todo.is_empty() {
            return;
        }
        // The layer before `layer` is routed but not yet asked for (look-ahead runs between):
        // its cached experts are about to be pinned, so a prediction must not evict them.
        let spare = self.moe_layers.iter().copied().rfind(|&l| l < layer);
        let slots = st
            .policy
            .take_slots_sparing(todo.len(), Want::Prefetch, spare);
        for (key, s) in todo.into_iter().zip(slots) {
            st.policy.insert(key, s, true);
            st.policy.hold(s, layer);
            st.prefetch.push_back(Job { key, slot: s });
            st.c.prefetch_reads += 1;
        }
        self.work.notify_all();
    }

    /// 0 for a prediction of a few experts (a decode step), 1 for many (a prefill chunk).
    fn prediction_class(&self, n_predicted: usize) -> usize {
        usize::from(n_predicted * 4 > self.n_expert)
    }

    /// Scores the last prediction for `layer` against what it asks for.
    fn judge_prediction(&self, st: &mut State, layer: usize, asked: &[usize]) {
        let Some((class, pred)) = st.predicted[layer].take() else {
            return;
        };
        if pred.is_empty() {
            return;
        }
        let used = pred.iter().filter(|e| asked.contains(e)).count();
        let a = &mut st.accuracy[class];
        *a += ACCURACY_EWMA * (used as f64 / pred.len() as f64 - *a);
    }

    /// Moves a queued prefetch read of `slot` to the demand queue.
    fn promote(st: &mut State, slot: usize) {
        if let Some(i) = st.prefetch.iter().position(|j| j.slot == slot) {
            let job = st.prefetch.remove(i).expect("position is in range");
            st.demand.push_back(job);
        }
    }

    fn matrices(
        &self,
        layer: usize,
        expert: usize,
        slot: usize,
    ) -> model::Result<ExpertMatrices<'_>> {
        let plan = self.plan(Key::new(layer, expert)).map_err(to_model)?;
        // SAFETY: the caller holds a pin on `slot` and its entry is `Ready`: nothing writes the
        // slot until the pin is dropped, which happens after the returned borrows end.
        let bytes = unsafe { self.slab.slot(slot) };
        let w = |i: usize| {
            let p = plan.matrices[i];
            Weights::new(
                p.dtype,
                p.rows,
                p.cols,
                &bytes[p.slot_off..p.slot_off + p.len],
            )
        };
        Ok(ExpertMatrices {
            gate: w(0)?,
            up: w(1)?,
            down: w(2)?,
        })
    }

    pub(crate) fn with_experts(
        &self,
        layer: usize,
        experts: &[usize],
        sink: &mut ExpertSink<'_>,
    ) -> model::Result<()> {
        let bad = |m: String| ModelError::Experts(m);
        if !self.streams(layer) {
            return Err(bad(format!("layer {layer} is not streamed by this source")));
        }
        let n_expert = n_expert_of(&self.model, layer).unwrap_or(0);
        let mut pins = Pins {
            shared: self,
            slots: Vec::new(),
        };
        let mut ready: Vec<(usize, usize)> = Vec::new();
        let mut waiting: Vec<(usize, usize)> = Vec::new();
        let mut missing: VecDeque<usize> = VecDeque::new();
        {
            let mut st = self.lock();
            st.calls += 1;
            st.policy.begin_call(layer);
            self.judge_prediction(&mut st, layer, experts);
            let resident = self.resident.contains(&layer);
            for (i, &e) in experts.iter().enumerate() {
                if e >= n_expert || experts[..i].contains(&e) {
                    return Err(bad(format!(
                        "layer {layer}: expert {e} asked for twice or out of range (n_expert {n_expert})"
                    )));
                }
                let k = Key::new(layer, e);
                st.policy.touch(k);
                st.counts.counts[layer * self.n_expert + e] += 1;
                st.c.requests += 1;
                match st.policy.lookup(k) {
                    Some((s, SlotState::Ready)) => {
                        st.policy.pin(s);
                        pins.slots.push(s);
                        ready.push((e, s));
                        if resident {
                            st.c.resident_hits += 1;
                        } else {
                            st.c.hits += 1;
                        }
                        if st.policy.take_prefetched(s) {
                            st.c.prefetch_used += 1;
                        }
                    }
                    Some((s, SlotState::Reading)) => {
                        st.policy.pin(s);
                        pins.slots.push(s);
                        waiting.push((e, s));
                        st.c.inflight_hits += 1;
                        if st.policy.take_prefetched(s) {
                            st.c.prefetch_used += 1;
                        }
                        Self::promote(&mut st, s);
                    }
                    Some((_, SlotState::Failed)) | None => {
                        missing.push_back(e);
                        st.c.misses += 1;
                    }
                }
            }
            self.issue(&mut st, layer, &mut missing, &mut waiting, &mut pins);
            // A prefill chunk uses most of every layer's experts: read the next layer's while
            // this one computes (the forward path's look-ahead, when present, is more precise).
            if experts.len() * 2 >= n_expert
                && !self.hinted.load(Ordering::Relaxed)
                && let Some(next) = self.next_moe_layer(layer)
            {
                let all: Vec<usize> = (0..n_expert).collect();
                self.prefetch_locked(&mut st, next, &all);
            }
        }
        loop {
            if !ready.is_empty() {
                {
                    let batch = ready
                        .iter()
                        .map(|&(e, s)| self.matrices(layer, e, s).map(|m| (e, m)))
                        .collect::<model::Result<Vec<_>>>()?;
                    sink(&batch)?;
                }
                let mut st = self.lock();
                for (_, s) in ready.drain(..) {
                    pins.unpin(&mut st, s);
                }
                self.done.notify_all();
            }
            if waiting.is_empty() && missing.is_empty() {
                return Ok(());
            }
            let mut st = self.lock();
            loop {
                self.issue(&mut st, layer, &mut missing, &mut waiting, &mut pins);
                let mut i = 0;
                while i < waiting.len() {
                    let (_, s) = waiting[i];
                    match st.policy.state(s) {
                        Some(SlotState::Ready) => ready.push(waiting.swap_remove(i)),
                        Some(SlotState::Failed) => {
                            let why = st.failure[s].clone().unwrap_or_default();
                            drop(st);
                            return Err(bad(why));
                        }
                        _ => i += 1,
                    }
                }
                if !ready.is_empty() || (waiting.is_empty() && missing.is_empty()) {
                    break;
                }
                let t0 = Instant::now();
                let (guard, timeout) = self
                    .done
                    .wait_timeout(st, READ_TIMEOUT)
                    .unwrap_or_else(|p| p.into_inner());
                st = guard;
                st.c.wait += t0.elapsed();
                if timeout.timed_out() {
                    drop(st);
                    return Err(bad(format!(
                        "layer {layer}: expert reads did not finish in {READ_TIMEOUT:?}"
                    )));
                }
            }
        }
    }

    /// Reads `keys` now (blocking), optionally as permanent entries.
    pub(crate) fn load(&self, keys: &[Key], permanent: bool) -> Result<()> {
        let mut pending: VecDeque<Key> = keys.iter().copied().collect();
        let mut in_flight: Vec<usize> = Vec::new();
        let mut st = self.lock();
        loop {
            let slots = st.policy.take_slots(pending.len(), Want::Demand);
            for s in slots {
                let key = pending.pop_front().expect("no more slots than keys");
                st.policy.insert(key, s, false);
                st.policy.pin(s);
                in_flight.push(s);
                st.demand.push_back(Job { key, slot: s });
            }
            self.work.notify_all();
            let mut i = 0;
            while i < in_flight.len() {
                let s = in_flight[i];
                match st.policy.state(s) {
                    Some(SlotState::Ready) => {
                        if permanent {
                            st.policy.make_permanent(s);
                        }
                        st.policy.unpin(s);
                        in_flight.swap_remove(i);
                    }
                    Some(SlotState::Failed) => {
                        let why = st.failure[s].clone().unwrap_or_default();
                        for &s in &in_flight {
                            st.policy.unpin(s);
                        }
                        return Err(StreamError::Config(format!("loading experts: {why}")));
                    }
                    _ => i += 1,
                }
            }
            if pending.is_empty() && in_flight.is_empty() {
                return Ok(());
            }
            if in_flight.is_empty() {
                return Err(StreamError::Config(format!(
                    "no room for {} more experts in the cache",
                    pending.len()
                )));
            }
            st = self.done.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    pub(crate) fn reader(&self) {
        loop {
            let job = {
                let mut st = self.lock();
                loop {
                    if st.shutdown {
                        return;
                    }
                    if let Some(j) = st.demand.pop_front().or_else(|| st.prefetch.pop_front()) {
                        if st.c.in_flight == 0 {
                            st.c.busy_since = Some(Instant::now());
                        }
                        st.c.in_flight += 1;
                        break j;
                    }
                    st = self.work.wait(st).unwrap_or_else(|p| p.into_inner());
                }
            };
            let result = self.plan(job.key).and_then(|plan| {
                // SAFETY: this reader was handed the job of the slot's `Reading` entry; no one
                // else touches the slot until it is marked ready or failed below.
                let slot = unsafe { self.slab.slot_mut(job.slot) };
                self.files.read_expert(job.key, &plan, slot)
            });
            let mut st = self.lock();
            st.c.in_flight -= 1;
            if st.c.in_flight == 0
                && let Some(t) = st.c.busy_since.take()
            {
                st.c.busy += t.elapsed();
            }
            match result {
                Ok(bytes) => {
                    st.c.reads += 1;
                    st.c.read_bytes += bytes;
                    st.policy.set_ready(job.slot);
                }
                Err(e) => {
                    st.c.read_errors += 1;
                    if st.policy.pins(job.slot) == 0 {
                        tracing::warn!("prefetch failed: {e}");
                    }
                    st.failure[job.slot] = Some(e.to_string());
                    st.policy.set_failed(job.slot);
                }
            }
            drop(st);
            self.done.notify_all();
        }
    }
}

/// The pins one call holds; dropped ones are released even when the call fails or its sink
/// panics.
pub(crate) struct Pins<'a> {
    shared: &'a Shared,
    slots: Vec<usize>,
}

impl Pins<'_> {
    fn unpin(&mut self, st: &mut State, slot: usize) {
        if let Some(i) = self.slots.iter().position(|&s| s == slot) {
            self.slots.swap_remove(i);
            st.policy.unpin(slot);
        }
    }
}

impl Drop for Pins<'_> {
    fn drop(&mut self) {
        if !self.slots.is_empty() {
            let mut st = self.shared.lock();
            for s in self.slots.drain(..) {
                st.policy.unpin(s);
            }
            drop(st);
            self.shared.done.notify_all();
        }
    }
}
