//! What the thread pool's jobs cost, for `moeshard bench --profile`: at many threads a phase of
//! decode can be slow because its rows stream slowly, because threads wait for each other (load
//! imbalance, workers that join late), or because the caller works alone between jobs. These
//! process-wide counters tell those apart. Off by default; then a job costs one relaxed load.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

static ENABLED: AtomicBool = AtomicBool::new(false);
static JOBS: AtomicU64 = AtomicU64::new(0);
static JOB_NANOS: AtomicU64 = AtomicU64::new(0);
static CAPACITY_NANOS: AtomicU64 = AtomicU64::new(0);
static BUSY_NANOS: AtomicU64 = AtomicU64::new(0);
static PARTICIPANTS: AtomicU64 = AtomicU64::new(0);
static JOIN_NANOS: AtomicU64 = AtomicU64::new(0);
static TAIL_NANOS: AtomicU64 = AtomicU64::new(0);

/// Counts jobs from now on (or stops counting). The totals are kept; see [`totals`].
pub fn set_enabled(on: bool) {
    if on {
        // Fix the epoch before any job reads it, so no job's timestamps straddle its creation.
        epoch();
    }
    ENABLED.store(on, Ordering::Relaxed);
}

#[inline]
pub(crate) fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Nanoseconds since this process first enabled the counters: a timestamp that fits an atomic.
pub(crate) fn now_nanos() -> u64 {
    epoch().elapsed().as_nanos() as u64
}

/// Sums over every multi-threaded job run while enabled, since the process started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolTotals {
    /// Jobs handed to the pool's threads (work the caller ran alone is not a job).
    pub jobs: u64,
    /// Wall time of those jobs, from publishing the job to the last thread leaving it.
    pub job_nanos: u64,
    /// Each job's wall time times the pool's thread count: what the threads could have done.
    pub capacity_nanos: u64,
    /// Time the threads spent inside the jobs' work, summed over threads.
    pub busy_nanos: u64,
    /// Threads that took part, summed over jobs (the caller included).
    pub participants: u64,
    /// How long after the job was published each worker entered it, summed over workers.
    pub join_nanos: u64,
    /// Summed over jobs: from the first participant running out of work to the last one
    /// finishing. Near one task's time when the work is balanced; much more when a thread was
    /// slow or descheduled while it held a task.
    pub tail_nanos: u64,
}

impl PoolTotals {
    pub const ZERO: PoolTotals = PoolTotals {
        jobs: 0,
        job_nanos: 0,
        capacity_nanos: 0,
        busy_nanos: 0,
        participants: 0,
        join_nanos: 0,
        tail_nanos: 0,
    };

    /// Both totals together.
    pub fn plus(&self, other: &PoolTotals) -> PoolTotals {
        PoolTotals {
            jobs: self.jobs + other.jobs,
            job_nanos: self.job_nanos + other.job_nanos,
            capacity_nanos: self.capacity_nanos + other.capacity_nanos,
            busy_nanos: self.busy_nanos + other.busy_nanos,
            participants: self.participants + other.participants,
            join_nanos: self.join_nanos + other.join_nanos,
            tail_nanos: self.tail_nanos + other.tail_nanos,
        }
    }

    /// What happened between `earlier` and `self` (the counters only grow; saturating in case
    /// they ever do not).
    pub fn since(&self, earlier: &PoolTotals) -> PoolTotals {
        PoolTotals {
            jobs: self.jobs.saturating_sub(earlier.jobs),
            job_nanos: self.job_nanos.saturating_sub(earlier.job_nanos),
            capacity_nanos: self.capacity_nanos.saturating_sub(earlier.capacity_nanos),
            busy_nanos: self.busy_nanos.saturating_sub(earlier.busy_nanos),
            participants: self.participants.saturating_sub(earlier.participants),
            join_nanos: self.join_nanos.saturating_sub(earlier.join_nanos),
            tail_nanos: self.tail_nanos.saturating_sub(earlier.tail_nanos),
        }
    }
}

/// The totals so far (also those counted before the last `set_enabled(false)`).
pub fn totals() -> PoolTotals {
    PoolTotals {
        jobs: JOBS.load(Ordering::Relaxed),
        job_nanos: JOB_NANOS.load(Ordering::Relaxed),
        capacity_nanos: CAPACITY_NANOS.load(Ordering::Relaxed),
        busy_nanos: BUSY_NANOS.load(Ordering::Relaxed),
        participants: PARTICIPANTS.load(Ordering::Relaxed),
        join_nanos: JOIN_NANOS.load(Ordering::Relaxed),
        tail_nanos: TAIL_NANOS.load(Ordering::Relaxed),
    }
}

/// One thread's time inside one job; `joined_after` is how long after publishing it entered.
pub(crate) fn add_participant(busy_nanos: u64, joined_after_nanos: u64) {
    BUSY_NANOS.fetch_add(busy_nanos, Ordering::Relaxed);
    PARTICIPANTS.fetch_add(1, Ordering::Relaxed);
    JOIN_NANOS.fetch_add(joined_after_nanos, Ordering::Relaxed);
}

/// One finished job of a pool of `n_threads`.
pub(crate) fn add_job(job_nanos: u64, n_threads: usize, tail_nanos: u64) {
    JOBS.fetch_add(1, Ordering::Relaxed);
    JOB_NANOS.fetch_add(job_nanos, Ordering::Relaxed);
    CAPACITY_NANOS.fetch_add(job_nanos * n_threads as u64, Ordering::Relaxed);
    TAIL_NANOS.fetch_add(tail_nanos, Ordering::Relaxed);
}
