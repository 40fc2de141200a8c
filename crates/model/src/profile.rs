//! Where a forward pass spends its time: wall-clock totals per phase of the layer loop, summed
//! over every forward of this process while enabled (`moeshard bench --profile`). Off by
//! default; then a phase costs one relaxed atomic load. The phases nest nowhere, so their sum is
//! the forward's time less what no phase covers (reported as such by the caller).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use kernels::pool_stats::PoolTotals;

/// The parts of a forward pass that are timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Embed,
    /// Room in the sequences' KV caches for a step's positions (growing buffers).
    KvReserve,
    Norm,
    /// q/k/v (or MLA's query and latent) projections.
    AttnProject,
    /// RoPE, biases and q/k norms of the projected rows, and their KV append.
    AttnPrepare,
    Attention,
    /// Latent attention's queries through each head's `W_kb` (the absorbed form).
    LatentAbsorb,
    /// Latent attention's outputs through each head's `W_vb` (the absorbed form).
    LatentLift,
    AttnOutput,
    Router,
    /// Routing decisions from router logits (softmax/sigmoid, groups, top-k).
    Route,
    /// Gathering each expert's token rows.
    ExpertGather,
    ExpertGateUp,
    /// Biases and the gated activation between gate/up and down.
    ExpertActivation,
    ExpertDown,
    /// Whole expert FFNs on an offload device (a GPU): the time the step waits for them.
    ExpertDevice,
    /// Each token's weighted sum of its experts' outputs.
    ExpertCombine,
    /// Shared experts and dense FFN layers.
    DenseFfn,
    /// Tensor-parallel partial-sum exchange.
    AllReduce,
    Residual,
    /// DeepSeek V4's stream mixes around each block (and the head's collapse).
    HyperMix,
    /// DeepSeek V4's compressors: pooling windows into rows.
    Compress,
    Head,
    /// Whole steps on a device that runs every layer (a GPU holding the whole model).
    Device,
}

impl Phase {
    pub const ALL: [Phase; 24] = [
        Phase::Embed,
        Phase::KvReserve,
        Phase::Norm,
        Phase::AttnProject,
        Phase::AttnPrepare,
        Phase::Attention,
        Phase::LatentAbsorb,
        Phase::LatentLift,
        Phase::AttnOutput,
        Phase::Router,
        Phase::Route,
        Phase::ExpertGather,
        Phase::ExpertGateUp,
        Phase::ExpertActivation,
        Phase::ExpertDown,
        Phase::ExpertDevice,
        Phase::ExpertCombine,
        Phase::DenseFfn,
        Phase::AllReduce,
        Phase::Residual,
        Phase::HyperMix,
        Phase::Compress,
        Phase::Head,
        Phase::Device,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Embed => "embed",
            Phase::KvReserve => "kv cache growth",
            Phase::Norm => "norms",
            Phase::AttnProject => "attn q/k/v projection",
            Phase::AttnPrepare => "attn rope, bias, kv append",
            Phase::Attention => "attention",
            Phase::LatentAbsorb => "latent attn: queries through W_kb",
            Phase::LatentLift => "latent attn: outputs through W_vb",
            Phase::AttnOutput => "attn output projection",
            Phase::Router => "router matmul",
            Phase::Route => "routing (top-k)",
            Phase::ExpertGather => "experts: gather rows",
            Phase::ExpertGateUp => "experts: gate+up",
            Phase::ExpertActivation => "experts: activation",
            Phase::ExpertDown => "experts: down",
            Phase::ExpertDevice => "experts: whole FFNs on the GPU",
            Phase::ExpertCombine => "experts: weighted sum",
            Phase::DenseFfn => "dense/shared ffn",
            Phase::AllReduce => "all-reduce",
            Phase::Residual => "residual adds",
            Phase::HyperMix => "hyper-connection mixes",
            Phase::Compress => "compressors (pooled rows)",
            Phase::Head => "output head",
            Phase::Device => "whole steps on the GPU",
        }
    }
}

const N_PHASES: usize = Phase::ALL.len();

static ENABLED: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; N_PHASES] = [const { AtomicU64::new(0) }; N_PHASES];
static CALLS: [AtomicU64; N_PHASES] = [const { AtomicU64::new(0) }; N_PHASES];
/// The thread pool's counters while each phase ran; guarded by its own lock because a span adds
/// six counters at once, and spans end at most a few thousand times a second. The counters are
/// process-wide, so a phase gets every pool job that ran while it was open: right while one
/// thread drives the forward (a GPU's helper threads use no pool), mixed if several did.
static POOL: Mutex<[PoolTotals; N_PHASES]> = Mutex::new([PoolTotals::ZERO; N_PHASES]);

/// Turns timing on or off for the whole process (the thread pool's job counters with it).
pub fn set_enabled(on: bool) {
    kernels::pool_stats::set_enabled(on);
    ENABLED.store(on, Ordering::Relaxed);
}

/// Zeroes every total.
pub fn reset() {
    for (n, c) in NANOS.iter().zip(&CALLS) {
        n.store(0, Ordering::Relaxed);
        c.store(0, Ordering::Relaxed);
    }
    *POOL.lock().unwrap_or_else(|e| e.into_inner()) = [PoolTotals::ZERO; N_PHASES];
}

/// One phase's totals since the last reset.
#[derive(Clone, Copy, Debug)]
pub struct PhaseTotal {
    pub phase: Phase,
    pub seconds: f64,
    /// Times the phase was entered.
    pub calls: u64,
    /// The thread pool's jobs inside the phase.
    pub pool: PoolTotals,
}

/// Every phase entered since the last reset.
pub fn totals() -> Vec<PhaseTotal> {
    let pool = *POOL.lock().unwrap_or_else(|e| e.into_inner());
    Phase::ALL
        .iter()
        .enumerate()
        .map(|(i, &phase)| PhaseTotal {
            phase,
            seconds: NANOS[i].load(Ordering::Relaxed) as f64 * 1e-9,
            calls: CALLS[i].load(Ordering::Relaxed),
            pool: pool[i],
        })
        .filter(|t| t.calls > 0)
        .collect()
}

/// Times the scope it lives in as `phase` (when enabled).
pub struct Span {
    phase: usize,
    start: Option<(Instant, PoolTotals)>,
}

/// Starts timing `phase` until the returned span drops.
#[inline]
pub fn span(phase: Phase) -> Span {
    Span {
        // `ALL` lists the variants in declaration order, so the discriminant is the index.
        phase: phase as usize,
        start: ENABLED
            .load(Ordering::Relaxed)
            .then(|| (Instant::now(), kernels::pool_stats::totals())),
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some((t0, pool_at_start)) = self.start {
            NANOS[self.phase].fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            CALLS[self.phase].fetch_add(1, Ordering::Relaxed);
            let jobs = kernels::pool_stats::totals().since(&pool_at_start);
            let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
            pool[self.phase] = pool[self.phase].plus(&jobs);
        }
    }
}

/// `f` timed as `phase`.
#[inline]
pub fn timed<T>(phase: Phase, f: impl FnOnce() -> T) -> T {
    let _span = span(phase);
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_lists_the_phases_in_declaration_order() {
        for (i, &p) in Phase::ALL.iter().enumerate() {
            assert_eq!(p as usize, i, "{p:?}");
        }
    }

    #[test]
    fn spans_count_only_while_enabled() {
        // The totals are process-wide; this is the only test in the crate that enables them.
        reset();
        drop(span(Phase::Route));
        assert!(totals().is_empty());
        set_enabled(true);
        timed(Phase::Route, || {
            std::thread::sleep(std::time::Duration::from_millis(2))
        });
        let pool = kernels::ThreadPool::with_backend(3, kernels::PoolBackend::Spin);
        timed(Phase::Router, || {
            pool.for_each_chunk(64, 1, |_| {
                std::thread::sleep(std::time::Duration::from_micros(50))
            })
        });
        set_enabled(false);
        drop(span(Phase::Route));
        let t = totals();
        assert_eq!(t.len(), 2);
        // In declaration order: the router matmul, then routing.
        let (router, route) = (&t[0], &t[1]);
        assert_eq!(route.phase, Phase::Route);
        assert_eq!(route.calls, 1);
        assert!(route.seconds >= 0.002, "{route:?}");
        assert_eq!(route.pool.jobs, 0, "{route:?}");
        // The router span saw the pool's job: every thread that took part was busy inside it
        // for at most the job's wall time, the caller for most of it.
        let jobs = router.pool;
        assert_eq!(router.phase, Phase::Router);
        assert_eq!(jobs.jobs, 1, "{jobs:?}");
        assert!((1..=3).contains(&jobs.participants), "{jobs:?}");
        assert!(jobs.busy_nanos <= jobs.capacity_nanos, "{jobs:?}");
        assert!(jobs.capacity_nanos == 3 * jobs.job_nanos, "{jobs:?}");
        assert!(jobs.busy_nanos >= 50_000, "{jobs:?}");
        // The gap between the first and the last participant finishing lies within the job.
        assert!(jobs.tail_nanos <= jobs.job_nanos, "{jobs:?}");
        reset();
    }
}
