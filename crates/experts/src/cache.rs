//! The bounded expert cache behind the streaming source: whole experts in the slots of a
//! [`Slab`], and the three things that use them: a caller's request for a layer's experts (pin,
//! hand over the cached ones, read the rest, hand them over as they arrive), prefetch hints, and
//! the reader threads that fill slots from the model's files. One mutex guards the bookkeeping
//! ([`crate::policy::Policy`], the read queues, the counters); no user code and no I/O run
//! under it. Its owner sizes it and says what it streams ([`CacheConfig`]); everything else
//! goes through [`Cache`]'s methods.

use std::collections::{HashSet, VecDeque};
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kernels::Weights;
use model::experts::ExpertSink;
use model::{ExpertMatrices, Model, ModelError};

use crate::error::{Result, StreamError};
use crate::io::ModelFiles;
use crate::layout::{self, ExpertPlan, n_expert_of};
use crate::policy::{Key, Policy, SlotState, Want};
use crate::profile::Profile;
use crate::slab::Slab;

/// Which experts this process computes (`(layer, expert) -> bool`), for a node of a cluster.
pub type OwnedFn = Arc<dyn Fn(usize, usize) -> bool + Send + Sync>;

/// A read that takes longer than this is reported as an error rather than waited on forever.
const READ_TIMEOUT: Duration = Duration::from_secs(120);

/// Predictions are read only while at least this share of the uncached experts they name turns
/// out to be used: a wasted read costs about what a useful one saves (one expert's disk time),
/// and it also evicts a cached expert.
const MIN_PREFETCH_ACCURACY: f64 = 0.5;

/// Weight of the newest observation in the running prediction accuracy.
const ACCURACY_EWMA: f64 = 0.1;

/// What a [`Cache`] is built from, worked out by its owner.
pub(crate) struct CacheConfig {
    pub(crate) model: Arc<Model>,
    /// The model's fingerprint, which names the routing profile the cache counts into.
    pub(crate) fingerprint: String,
    pub(crate) files: ModelFiles,
    /// One slot per cache entry and per expert of a resident layer.
    pub(crate) slab: Slab,
    /// The bookkeeping of the slab's slots (seeded with any known hotness).
    pub(crate) policy: Policy,
    /// The layers streamed, and those of them that route through experts.
    pub(crate) layers: RangeInclusive<usize>,
    pub(crate) moe_layers: Vec<usize>,
    /// MoE layers whose experts are loaded once as permanent entries ([`Cache::load`]).
    pub(crate) resident: HashSet<usize>,
    pub(crate) owned: Option<OwnedFn>,
    /// The most experts of any MoE layer.
    pub(crate) n_expert: usize,
    /// Slots that come and go (not counting resident layers).
    pub(crate) cache_slots: usize,
}

struct Job {
    key: Key,
    slot: usize,
}

#[derive(Default)]
struct Counters {
    requests: u64,
    hits: u64,
    resident_hits: u64,
    inflight_hits: u64,
    misses: u64,
    prefetch_reads: u64,
    prefetch_used: u64,
    prefetch_skipped: u64,
    reads: u64,
    read_bytes: u64,
    read_errors: u64,
    in_flight: usize,
    busy_since: Option<Instant>,
    busy: Duration,
    wait: Duration,
    /// Resident layers and preload, at start (not in the counters above).
    start_bytes: u64,
    start_time: Duration,
}

struct State {
    policy: Policy,
    demand: VecDeque<Job>,
    prefetch: VecDeque<Job>,
    /// Why the read of each failed slot failed (kept until its waiters have seen it).
    failure: Vec<Option<String>>,
    counts: Profile,
    c: Counters,
    /// Per layer: the uncached experts the last prediction for it named (read or not).
    predicted: Vec<Option<(usize, Vec<usize>)>>,
    /// Running share of predicted uncached experts that were then asked for: for predictions
    /// of a few experts (one token) and of many (a prefill chunk).
    accuracy: [f64; 2],
    calls: u64,
    shutdown: bool,
}

pub(crate) struct Cache {
    model: Arc<Model>,
    files: ModelFiles,
    slab: Slab,
    state: Mutex<State>,
    /// Readers wait here for jobs.
    work: Condvar,
    /// Callers wait here for finished reads and released pins.
    done: Condvar,
    layers: RangeInclusive<usize>,
    moe_layers: Vec<usize>,
    resident: HashSet<usize>,
    owned: Option<OwnedFn>,
    n_expert: usize,
    cache_slots: usize,
    /// Set once the forward path sends prefetch hints itself (then the prefill heuristic
    /// stands down).
    hinted: AtomicBool,
}

fn to_model(e: StreamError) -> ModelError {
    match e {
        StreamError::Model(m) => m,
        other => ModelError::Experts(other.to_string()),
    }
}

impl Cache {
    /// An empty cache; nothing is read until [`Cache::reader`] runs on some threads.
    pub(crate) fn new(cfg: CacheConfig) -> Cache {
        let n_layer = cfg.model.n_layer();
        let n_slots = cfg.policy.n_slots();
        Cache {
            state: Mutex::new(State {
                policy: cfg.policy,
                demand: VecDeque::new(),
                prefetch: VecDeque::new(),
                failure: vec![None; n_slots],
                counts: Profile::new(&cfg.fingerprint, n_layer, cfg.n_expert),
                c: Counters::default(),
                predicted: vec![None; n_layer],
                accuracy: [1.0; 2],
                calls: 0,
                shutdown: false,
            }),
            model: cfg.model,
            files: cfg.files,
            slab: cfg.slab,
            work: Condvar::new(),
            done: Condvar::new(),
            layers: cfg.layers,
            moe_layers: cfg.moe_layers,
            resident: cfg.resident,
            owned: cfg.owned,
            n_expert: cfg.n_expert,
            cache_slots: cfg.cache_slots,
            hinted: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere never leaves the bookkeeping half-updated (no user code runs under
        // the lock), so a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether this process computes `expert` of `layer`.
    pub(crate) fn owns(&self, layer: usize, expert: usize) -> bool {
        self.owned.as_ref().is_none_or(|f| f(layer, expert))
    }

    /// Slots that come and go (not counting resident layers).
    pub(crate) fn cache_slots(&self) -> usize {
        self.cache_slots
    }

    pub(crate) fn slot_bytes(&self) -> usize {
        self.slab.slot_bytes()
    }

    /// Whether reads bypass the page cache.
    pub(crate) fn direct_io(&self) -> bool {
        self.files.direct()
    }

    /// Whether any layer's experts have been asked for.
    pub(crate) fn used(&self) -> bool {
        self.lock().calls > 0
    }

    /// Cached (layer, expert) pairs, any state, in slot order.
    pub(crate) fn cached(&self) -> Vec<(usize, usize)> {
        let st = self.lock();
        st.policy
            .keys()
            .into_iter()
            .map(|k| (k.layer as usize, k.expert as usize))
            .collect()
    }

    /// The routing counts of the calls so far, with their number of steps.
    pub(crate) fn routing(&self) -> Profile {
        let st = self.lock();
        let mut p = st.counts.clone();
        p.steps = if st.calls > 0 {
            st.policy.step() + 1
        } else {
            0
        };
        p
    }

    /// Statistics as `(name, value)` pairs: hits, misses, bytes and time spent reading.
    pub(crate) fn stats(&self) -> Vec<(String, f64)> {
        let st = self.lock();
        let c = &st.c;
        let steps = if st.calls > 0 {
            st.policy.step() + 1
        } else {
            0
        };
        let busy = c.busy + c.busy_since.map_or(Duration::ZERO, |t| t.elapsed());
        let per_step = |x: f64| if steps > 0 { x / steps as f64 } else { 0.0 };
        let streamed = c.hits + c.inflight_hits + c.misses;
        let mib = (1u64 << 20) as f64;
        let v = [
            ("expert_cache_slots", self.cache_slots as f64),
            (
                "expert_cache_gib",
                (self.cache_slots * self.slot_bytes()) as f64 / (1u64 << 30) as f64,
            ),
            ("expert_cache_used_slots", st.policy.n_used() as f64),
            ("expert_direct_io", f64::from(u8::from(self.direct_io()))),
            (
                "expert_start_read_gib",
                c.start_bytes as f64 / (1u64 << 30) as f64,
            ),
            ("expert_start_s", c.start_time.as_secs_f64()),
            ("expert_steps", steps as f64),
            ("expert_requests", c.requests as f64),
            ("expert_resident_hits", c.resident_hits as f64),
            ("expert_hits", c.hits as f64),
            ("expert_inflight_hits", c.inflight_hits as f64),
            ("expert_misses", c.misses as f64),
            (
                "expert_hit_rate",
                if streamed > 0 {
                    c.hits as f64 / streamed as f64
                } else {
                    0.0
                },
            ),
            ("expert_prefetch_reads", c.prefetch_reads as f64),
            ("expert_prefetch_used", c.prefetch_used as f64),
            ("expert_prefetch_skipped", c.prefetch_skipped as f64),
            ("expert_lookahead_accuracy_decode", st.accuracy[0]),
            ("expert_lookahead_accuracy_prefill", st.accuracy[1]),
            ("expert_reads", c.reads as f64),
            ("expert_read_errors", c.read_errors as f64),
            ("expert_read_mib", c.read_bytes as f64 / mib),
            (
                "expert_read_mib_per_step",
                per_step(c.read_bytes as f64 / mib),
            ),
            ("expert_read_busy_s", busy.as_secs_f64()),
            (
                "expert_read_gbps",
                if busy > Duration::ZERO {
                    c.read_bytes as f64 / busy.as_secs_f64() / 1e9
                } else {
                    0.0
                },
            ),
            ("expert_wait_s", c.wait.as_secs_f64()),
            (
                "expert_wait_ms_per_step",
                per_step(c.wait.as_secs_f64() * 1e3),
            ),
        ];
        v.into_iter().map(|(k, x)| (k.to_string(), x)).collect()
    }

    /// Books what was read so far as start-up (`took` long) rather than as serving.
    pub(crate) fn end_start(&self, took: Duration) {
        let mut st = self.lock();
        let c = &mut st.c;
        c.start_bytes = std::mem::take(&mut c.read_bytes);
        c.start_time = took;
        c.reads = 0;
        c.busy = Duration::ZERO;
    }

    /// Stops the reader threads (once each finishes its current read).
    pub(crate) fn shut_down(&self) {
        self.lock().shutdown = true;
        self.work.notify_all();
    }

    /// A hint from the forward path that `experts` of `layer` will soon be asked for.
    pub(crate) fn prefetch(&self, layer: usize, experts: &[usize]) {
        self.hinted.store(true, Ordering::Relaxed);
        let mut st = self.lock();
        self.prefetch_locked(&mut st, layer, experts);
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
    fn prefetch_locked(&self, st: &mut State, layer: usize, experts: &[usize]) {
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
        // SAFETY: the only caller (`with_experts`) passes slots of `ready`, which it pinned while
        // their entries were `Ready`. A pinned entry is never evicted, so nothing writes the slot
        // until the pin is released, which it does only after the returned borrows are dropped.
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
            cache: self,
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
struct Pins<'a> {
    cache: &'a Cache,
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
            let mut st = self.cache.lock();
            for s in self.slots.drain(..) {
                st.policy.unpin(s);
            }
            drop(st);
            self.cache.done.notify_all();
        }
    }
}
