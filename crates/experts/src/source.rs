//! [`StreamedExperts`]: the SSD-streaming [`ExpertSource`]. Non-expert weights stay in the
//! model's map; routed experts are read on demand into a bounded cache of whole experts (one
//! slot = gate + up + down of one expert of one layer) by a pool of reader threads, several
//! reads in flight.
//!
//! A call for a layer's experts pins what it asks for, hands the cached ones to the sink at once
//! (the forward path computes them while the rest are read), queues reads for the misses ahead
//! of any prefetch, and hands each batch of finished reads over as it completes, unpinning what
//! the sink is done with so a cache smaller than one layer's selection still works. Prefetch
//! hints (router look-ahead, or the next layer's experts during a prefill chunk) are read at low
//! priority and held until their layer is asked for. Policy: [`crate::policy`].

use std::collections::{HashSet, VecDeque};
use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kernels::Weights;
use model::experts::ExpertSink;
use model::weights::Ffn;
use model::{ExpertMatrices, ExpertSource, Model, ModelError, WeightSelection};

use crate::budget;
use crate::error::{Result, StreamError};
use crate::io::{ModelFiles, ReadHook};
use crate::layout::{self, ExpertPlan};
use crate::policy::{Key, Policy, SlotState, Want};
use crate::profile::Profile;
use crate::slab::Slab;

/// How big the cache is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CacheSize {
    /// What fits in available memory after the resident weights, `reserve_bytes` and a margin.
    #[default]
    Auto,
    Bytes(u64),
    /// A number of expert slots.
    Count(usize),
}

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

#[derive(Clone)]
pub struct StreamingOptions {
    pub cache: CacheSize,
    /// Start with an empty cache.
    pub cold: bool,
    /// Experts to read at start (hottest of `profile`, else spread evenly over the layers);
    /// `None`: fill the cache unless `cold`.
    pub preload: Option<usize>,
    /// Keep the first N MoE layers (of `layers`) fully resident, outside the cache.
    pub resident_layers: usize,
    /// A saved routing profile: preload order and initial hotness.
    pub profile: Option<PathBuf>,
    /// Where to write the routing profile when the source is dropped (merged with `profile`).
    pub save_profile: Option<PathBuf>,
    /// Reader threads (reads in flight).
    pub readers: usize,
    /// Steps over which an expert's hotness halves.
    pub half_life: f64,
    /// Read with O_DIRECT (falls back to buffered reads where refused).
    pub direct_io: bool,
    /// Whether the forward path should run the next layer's router early and prefetch.
    pub lookahead: bool,
    /// The layers this process runs (`None`: all).
    pub layers: Option<RangeInclusive<usize>>,
    /// The experts this process computes (`None`: all).
    pub owned: Option<OwnedFn>,
    /// Memory to leave free besides the resident weights, for [`CacheSize::Auto`] (KV cache,
    /// activations).
    pub reserve_bytes: u64,
    /// Fault injection for tests.
    pub read_hook: Option<ReadHook>,
}

impl Default for StreamingOptions {
    fn default() -> Self {
        StreamingOptions {
            cache: CacheSize::Auto,
            cold: false,
            preload: None,
            resident_layers: 0,
            profile: None,
            save_profile: None,
            readers: 4,
            half_life: 64.0,
            direct_io: true,
            lookahead: true,
            layers: None,
            owned: None,
            reserve_bytes: 0,
            read_hook: None,
        }
    }
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

struct Shared {
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
    lookahead: bool,
    /// Set once the forward path sends prefetch hints itself (then the prefill heuristic
    /// stands down).
    hinted: AtomicBool,
}

/// The SSD-streaming expert source (module doc).
pub struct StreamedExperts {
    shared: Arc<Shared>,
    readers: Vec<JoinHandle<()>>,
    save_profile: Option<PathBuf>,
    loaded_profile: Option<Profile>,
}

fn n_expert_of(model: &Model, layer: usize) -> Option<usize> {
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
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere never leaves the bookkeeping half-updated (no user code runs under
        // the lock), so a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn owns(&self, layer: usize, expert: usize) -> bool {
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

    fn with_experts(
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
    fn load(&self, keys: &[Key], permanent: bool) -> Result<()> {
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

    fn reader(&self) {
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

impl StreamedExperts {
    /// Opens the model's files, sizes and fills the cache, starts the readers.
    pub fn new(model: Arc<Model>, opts: StreamingOptions) -> Result<StreamedExperts> {
        let n_layer = model.n_layer();
        let layers = opts.layers.clone().unwrap_or(0..=n_layer.saturating_sub(1));
        if *layers.end() >= n_layer || layers.start() > layers.end() {
            return Err(StreamError::Config(format!(
                "layers {layers:?} outside the model's {n_layer}"
            )));
        }
        let moe_layers: Vec<usize> = layers
            .clone()
            .filter(|&l| n_expert_of(&model, l).is_some())
            .collect();
        if moe_layers.is_empty() {
            return Err(StreamError::Config(format!(
                "layers {layers:?} have no routed experts to stream"
            )));
        }
        let n_expert = moe_layers
            .iter()
            .filter_map(|&l| n_expert_of(&model, l))
            .max()
            .unwrap_or(0);
        let owns = |l: usize, e: usize| opts.owned.as_ref().is_none_or(|f| f(l, e));
        let owned_keys = |l: usize| {
            (0..n_expert_of(&model, l).unwrap_or(0))
                .filter(move |&e| owns(l, e))
                .map(move |e| Key::new(l, e))
        };
        // Slot size: the largest expert (read plans differ by layer quant mix and alignment).
        let mut slot_bytes = 0usize;
        let mut streamed_bytes = 0u64;
        let mut n_streamed = 0usize;
        let n_resident_layers = opts.resident_layers.min(moe_layers.len());
        let resident: HashSet<usize> = moe_layers[..n_resident_layers].iter().copied().collect();
        let mut resident_keys = Vec::new();
        for &l in &moe_layers {
            for k in owned_keys(l) {
                let p = layout::plan(&model, l, k.expert as usize).expect("MoE layer expert");
                slot_bytes = slot_bytes.max(p.slot_bytes);
                if resident.contains(&l) {
                    resident_keys.push(k);
                } else {
                    streamed_bytes += p.data_bytes;
                    n_streamed += 1;
                }
            }
        }
        if slot_bytes == 0 {
            return Err(StreamError::Config(
                "this process owns no routed experts".into(),
            ));
        }
        let resident_bytes = (resident_keys.len() * slot_bytes) as u64;
        let cache_slots = match opts.cache {
            CacheSize::Count(0) => {
                return Err(StreamError::Config(
                    "the expert cache needs at least one slot".into(),
                ));
            }
            CacheSize::Count(n) => n,
            CacheSize::Bytes(b) => {
                let n = (b / slot_bytes as u64) as usize;
                if n == 0 {
                    return Err(StreamError::Config(format!(
                        "an expert cache of {b} bytes holds no expert (one takes {slot_bytes})"
                    )));
                }
                n
            }
            CacheSize::Auto => {
                let weights: u64 = model
                    .weight_ranges(&WeightSelection {
                        layers: layers.clone(),
                        embeddings: true,
                        head: true,
                        experts: false,
                    })
                    .iter()
                    .map(|r| r.len)
                    .sum();
                let avail = budget::available_memory().unwrap_or(0);
                // Threads, allocator slack, prompt-sized activations and logits.
                let margin = (256 << 20) + avail / 32;
                let free = avail
                    .saturating_sub(weights)
                    .saturating_sub(opts.reserve_bytes)
                    .saturating_sub(resident_bytes)
                    .saturating_sub(margin);
                let n = (free / slot_bytes as u64) as usize;
                let floor = 2 * model.hp.moe.as_ref().map_or(1, |m| m.n_expert_used);
                if n < floor {
                    tracing::warn!(
                        "little memory for the expert cache ({} MiB available, {} MiB of \
                         resident weights): using {floor} slots",
                        avail >> 20,
                        weights >> 20
                    );
                }
                n.max(floor)
            }
        }
        .min(n_streamed.max(1));
        let n_slots = cache_slots + resident_keys.len();
        let slab = Slab::new(n_slots, slot_bytes).ok_or_else(|| {
            StreamError::Config(format!(
                "cannot allocate {n_slots} expert slots of {slot_bytes} bytes"
            ))
        })?;
        let paths: Vec<(PathBuf, u64)> = model
            .files()
            .splits()
            .iter()
            .map(|f| (f.path().to_path_buf(), f.file_len()))
            .collect();
        let files = ModelFiles::open(&paths, opts.direct_io, opts.read_hook.clone())?;
        let fingerprint = model.files().fingerprint().to_string();
        let loaded_profile = opts
            .profile
            .as_ref()
            .map(|p| Profile::load(p, &fingerprint))
            .transpose()?;
        let mut policy = Policy::new(n_slots, n_layer, n_expert, opts.half_life);
        if let Some(p) = &loaded_profile
            && p.n_layer == n_layer
            && p.n_expert == n_expert
            && p.steps > 0
        {
            // Steady-state hotness of an expert routed with probability q per step is about
            // q·H/ln 2; start each there.
            for &l in &moe_layers {
                for k in owned_keys(l) {
                    let q = p.count(l, k.expert as usize) as f64 / p.steps as f64;
                    if q > 0.0 {
                        policy.seed(k, q * opts.half_life / std::f64::consts::LN_2);
                    }
                }
            }
        }
        let shared = Arc::new(Shared {
            model: Arc::clone(&model),
            files,
            slab,
            state: Mutex::new(State {
                policy,
                demand: VecDeque::new(),
                prefetch: VecDeque::new(),
                failure: vec![None; n_slots],
                counts: Profile::new(&fingerprint, n_layer, n_expert),
                c: Counters::default(),
                predicted: vec![None; n_layer],
                accuracy: [1.0; 2],
                calls: 0,
                shutdown: false,
            }),
            work: Condvar::new(),
            done: Condvar::new(),
            layers,
            moe_layers: moe_layers.clone(),
            resident,
            owned: opts.owned.clone(),
            n_expert,
            cache_slots,
            lookahead: opts.lookahead,
            hinted: AtomicBool::new(false),
        });
        let mut me = StreamedExperts {
            shared,
            readers: Vec::new(),
            save_profile: opts.save_profile.clone(),
            loaded_profile,
        };
        // From here on, an early return drops `me`, which stops the readers started so far.
        for i in 0..opts.readers.max(1) {
            let sh = Arc::clone(&me.shared);
            let handle = std::thread::Builder::new()
                .name(format!("expert-read-{i}"))
                .spawn(move || sh.reader())
                .map_err(|e| StreamError::Config(format!("starting reader threads: {e}")))?;
            me.readers.push(handle);
        }
        let t0 = Instant::now();
        me.shared.load(&resident_keys, true)?;
        let n_preload = if opts.cold {
            0
        } else {
            opts.preload.unwrap_or(cache_slots).min(cache_slots)
        };
        let preload = me.preload_order(&moe_layers, n_preload, &owns);
        me.shared.load(&preload, false)?;
        tracing::info!(
            "streaming experts: {} cache slots × {:.2} MiB = {:.2} GiB for {} experts ({:.2} GiB) \
             of {} MoE layers; {} resident layers ({:.2} GiB); {} preloaded in {:.2?}; {} reads",
            cache_slots,
            slot_bytes as f64 / (1 << 20) as f64,
            (cache_slots * slot_bytes) as f64 / (1u64 << 30) as f64,
            n_streamed,
            streamed_bytes as f64 / (1u64 << 30) as f64,
            moe_layers.len(),
            n_resident_layers,
            resident_bytes as f64 / (1u64 << 30) as f64,
            preload.len(),
            t0.elapsed(),
            if me.shared.files.direct() {
                "O_DIRECT"
            } else {
                "buffered"
            },
        );
        Ok(me)
    }

    /// The `n` experts to preload: the hottest of the profile, then an even spread over the
    /// streamed layers.
    fn preload_order(
        &self,
        moe_layers: &[usize],
        n: usize,
        owns: &dyn Fn(usize, usize) -> bool,
    ) -> Vec<Key> {
        let sh = &self.shared;
        let streamed: Vec<usize> = moe_layers
            .iter()
            .copied()
            .filter(|l| !sh.resident.contains(l))
            .collect();
        let mut seen = HashSet::new();
        let mut out = Vec::with_capacity(n);
        let from_profile = self
            .loaded_profile
            .iter()
            .flat_map(|p| p.hottest())
            .filter(|&(l, _)| streamed.contains(&l));
        let even = (0..sh.n_expert).flat_map(|e| streamed.iter().map(move |&l| (l, e)));
        for (l, e) in from_profile.chain(even) {
            if out.len() >= n {
                break;
            }
            if e < n_expert_of(&sh.model, l).unwrap_or(0) && owns(l, e) && seen.insert((l, e)) {
                out.push(Key::new(l, e));
            }
        }
        out
    }

    /// Cache slots (not counting resident layers).
    pub fn cache_slots(&self) -> usize {
        self.shared.cache_slots
    }

    pub fn slot_bytes(&self) -> usize {
        self.shared.slab.slot_bytes()
    }

    /// Whether reads bypass the page cache.
    pub fn direct_io(&self) -> bool {
        self.shared.files.direct()
    }

    /// Cached (layer, expert) pairs, any state, in slot order.
    pub fn cached(&self) -> Vec<(usize, usize)> {
        let st = self.shared.lock();
        st.policy
            .keys()
            .into_iter()
            .map(|k| (k.layer as usize, k.expert as usize))
            .collect()
    }

    /// The routing counts gathered so far (merged with the loaded profile).
    pub fn profile(&self) -> Profile {
        let st = self.shared.lock();
        let mut p = st.counts.clone();
        p.steps = if st.calls > 0 {
            st.policy.step() + 1
        } else {
            0
        };
        if let Some(old) = &self.loaded_profile
            && old.counts.len() == p.counts.len()
        {
            for (a, b) in p.counts.iter_mut().zip(&old.counts) {
                *a += b;
            }
            p.steps += old.steps;
        }
        p
    }

    /// Statistics as `(name, value)` pairs: hits, misses, bytes and time spent reading.
    pub fn stats(&self) -> Vec<(String, f64)> {
        let st = self.shared.lock();
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
            ("expert_cache_slots", self.shared.cache_slots as f64),
            (
                "expert_cache_gib",
                (self.shared.cache_slots * self.slot_bytes()) as f64 / (1u64 << 30) as f64,
            ),
            ("expert_cache_used_slots", st.policy.n_used() as f64),
            ("expert_direct_io", f64::from(u8::from(self.direct_io()))),
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
}

impl ExpertSource for StreamedExperts {
    fn owns(&self, layer: usize, expert: usize) -> bool {
        self.shared.owns(layer, expert)
    }

    fn with_experts(
        &self,
        layer: usize,
        experts: &[usize],
        sink: &mut ExpertSink<'_>,
    ) -> model::Result<()> {
        self.shared.with_experts(layer, experts, sink)
    }

    fn lookahead(&self) -> bool {
        self.shared.lookahead
    }

    fn prefetch(&self, layer: usize, experts: &[usize]) {
        self.shared.hinted.store(true, Ordering::Relaxed);
        let mut st = self.shared.lock();
        self.shared.prefetch_locked(&mut st, layer, experts);
    }
}

impl Drop for StreamedExperts {
    fn drop(&mut self) {
        let used = self.shared.lock().calls > 0;
        if let Some(path) = self.save_profile.as_ref().filter(|_| used) {
            match self.profile().save(path) {
                Ok(()) => tracing::info!("saved the expert routing profile to {}", path.display()),
                Err(e) => tracing::warn!("{e}"),
            }
        }
        self.shared.lock().shutdown = true;
        self.shared.work.notify_all();
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }
}
