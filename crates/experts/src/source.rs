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

use std::collections::HashSet;
use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use model::experts::ExpertSink;
use model::{ExpertSource, Model, WeightSelection};

use crate::budget::{self, CacheSize};
use crate::cache::{Cache, CacheConfig, OwnedFn};
use crate::error::{Result, StreamError};
use crate::io::{ModelFiles, ReadHook};
use crate::layout::{self, n_expert_of};
use crate::policy::{Key, Policy};
use crate::profile::Profile;
use crate::slab::Slab;

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
    /// Read past the page cache (O_DIRECT, F_NOCACHE; falls back to buffered reads where
    /// refused).
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

/// The SSD-streaming expert source (module doc).
pub struct StreamedExperts {
    cache: Arc<Cache>,
    readers: Vec<JoinHandle<()>>,
    lookahead: bool,
    save_profile: Option<PathBuf>,
    loaded_profile: Option<Profile>,
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
        let streamed: Vec<usize> = moe_layers[n_resident_layers..].to_vec();
        let mut resident_keys = Vec::new();
        for &l in &moe_layers {
            for k in owned_keys(l) {
                let p = layout::plan(&model, l, k.expert as usize).ok_or_else(|| {
                    StreamError::Config(format!(
                        "expert {} of layer {l} is not in {} ({})",
                        k.expert,
                        model.files().splits()[0].path().display(),
                        model
                            .slice()
                            .map_or("no such expert".into(), |s| s.describe())
                    ))
                })?;
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
        let cache = Arc::new(Cache::new(CacheConfig {
            model: Arc::clone(&model),
            fingerprint,
            files,
            slab,
            policy,
            layers,
            moe_layers: moe_layers.clone(),
            resident,
            owned: opts.owned.clone(),
            n_expert,
            cache_slots,
        }));
        let mut me = StreamedExperts {
            cache,
            readers: Vec::new(),
            lookahead: opts.lookahead,
            save_profile: opts.save_profile.clone(),
            loaded_profile,
        };
        // From here on, an early return drops `me`, which stops the readers started so far.
        for i in 0..opts.readers.max(1) {
            let cache = Arc::clone(&me.cache);
            let handle = std::thread::Builder::new()
                .name(format!("expert-read-{i}"))
                .spawn(move || cache.reader())
                .map_err(|e| StreamError::Config(format!("starting reader threads: {e}")))?;
            me.readers.push(handle);
        }
        let t0 = Instant::now();
        me.cache.load(&resident_keys, true)?;
        let n_preload = if opts.cold {
            0
        } else {
            opts.preload.unwrap_or(cache_slots).min(cache_slots)
        };
        let preload = preload_order(
            &model,
            &streamed,
            n_expert,
            me.loaded_profile.as_ref(),
            n_preload,
            &owns,
        );
        me.cache.load(&preload, false)?;
        me.cache.end_start(t0.elapsed());
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
            if me.cache.direct_io() {
                crate::direct_io::MECHANISM
            } else {
                "buffered"
            },
        );
        Ok(me)
    }

    /// Cache slots (not counting resident layers).
    pub fn cache_slots(&self) -> usize {
        self.cache.cache_slots()
    }

    pub fn slot_bytes(&self) -> usize {
        self.cache.slot_bytes()
    }

    /// Whether reads bypass the page cache.
    pub fn direct_io(&self) -> bool {
        self.cache.direct_io()
    }

    /// Cached (layer, expert) pairs, any state, in slot order.
    pub fn cached(&self) -> Vec<(usize, usize)> {
        self.cache.cached()
    }

    /// The routing counts gathered so far (merged with the loaded profile).
    pub fn profile(&self) -> Profile {
        let mut p = self.cache.routing();
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
        self.cache.stats()
    }
}

/// The `n` experts to preload: the hottest of the profile, then an even spread over the
/// `streamed` layers.
fn preload_order(
    model: &Model,
    streamed: &[usize],
    n_expert: usize,
    profile: Option<&Profile>,
    n: usize,
    owns: &dyn Fn(usize, usize) -> bool,
) -> Vec<Key> {
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(n);
    let from_profile = profile
        .into_iter()
        .flat_map(|p| p.hottest())
        .filter(|&(l, _)| streamed.contains(&l));
    let even = (0..n_expert).flat_map(|e| streamed.iter().map(move |&l| (l, e)));
    for (l, e) in from_profile.chain(even) {
        if out.len() >= n {
            break;
        }
        if e < n_expert_of(model, l).unwrap_or(0) && owns(l, e) && seen.insert((l, e)) {
            out.push(Key::new(l, e));
        }
    }
    out
}

impl ExpertSource for StreamedExperts {
    fn owns(&self, layer: usize, expert: usize) -> bool {
        self.cache.owns(layer, expert)
    }

    fn with_experts(
        &self,
        layer: usize,
        experts: &[usize],
        sink: &mut ExpertSink<'_>,
    ) -> model::Result<()> {
        self.cache.with_experts(layer, experts, sink)
    }

    fn lookahead(&self) -> bool {
        self.lookahead
    }

    fn stats(&self) -> Vec<(String, f64)> {
        StreamedExperts::stats(self)
    }

    fn prefetch(&self, layer: usize, experts: &[usize]) {
        self.cache.prefetch(layer, experts);
    }
}

impl Drop for StreamedExperts {
    fn drop(&mut self) {
        let used = self.cache.used();
        if let Some(path) = self.save_profile.as_ref().filter(|_| used) {
            match self.profile().save(path) {
                Ok(()) => tracing::info!("saved the expert routing profile to {}", path.display()),
                Err(e) => tracing::warn!("{e}"),
            }
        }
        self.cache.shut_down();
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }
}
