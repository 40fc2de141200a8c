//! A thread pool built for per-token work: persistent threads that spin briefly between jobs and
//! then sleep, so the dozens of matmuls of one decode step each cost a few hundred nanoseconds
//! of dispatch instead of a thread wake-up. The calling thread takes part.
//!
//! `MOESHARD_POOL=rayon` runs the same jobs on a rayon pool instead, to compare (docs/perf.md:
//! ours decodes 4–18 % faster end to end on this project's machine, rayon prefills olmoe 4–5 %
//! faster; entering rayon from outside its pool costs ~17 µs per job here, ours ~0.25 µs).
//!
//! A job is open to whichever workers arrive while it runs: the caller never waits for a worker
//! that has not started (one descheduled by another process on a busy machine), only for those
//! inside the job. Work is handed out in chunks from a shared counter, so the threads present
//! finish it between them.

use std::cell::UnsafeCell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::pool_stats;

/// How long an idle worker spins before it sleeps. Long enough to cover the serial work between
/// two matmuls of a decode step (norms, router, attention bookkeeping), short enough that an idle
/// server does not burn a core.
const SPIN: Duration = Duration::from_micros(300);

type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// Bumped once per job; workers try to join when they see a new value.
    generation: AtomicUsize,
    /// The current job. Written by the caller while no worker is inside a job; read by workers
    /// only after they joined (`active` incremented while `open`).
    job: UnsafeCell<Option<Job>>,
    /// Whether the current job still accepts workers.
    open: AtomicBool,
    /// Workers inside the current job.
    active: AtomicUsize,
    stop: AtomicBool,
    /// Whether the current job is counted in [`crate::pool_stats`], and when it was published
    /// (both written before `open` is set).
    counting: AtomicBool,
    published_at: AtomicU64,
    /// When the first and the last participant of a counted job finished (nanoseconds on
    /// [`pool_stats`]' clock): the gap is how long the job's threads idled for want of work.
    first_done: AtomicU64,
    last_done: AtomicU64,
    panicked: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    /// Workers waiting on `wake` (changed under `sleep_lock`), so a job needs the lock and a
    /// wake-up call only when somebody sleeps.
    sleepers: AtomicUsize,
}

// SAFETY: the only field that is not `Sync` is `job`. It is written only by `run_open` (callers
// serialized by `busy`) while `open` is false and `active` is zero, and read only by workers
// that incremented `active` and then saw `open` true (all SeqCst), so no read overlaps a write;
// the closure it points to is `Sync`, so several threads may call it at once.
unsafe impl Sync for Shared {}
// SAFETY: the only field that is not `Send` is `job`, a pointer to a `Sync` closure: using it from
// another thread is what `Sync` allows, and the closure outlives every use (see `run_open`).
unsafe impl Send for Shared {}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serializes callers: one job at a time.
    busy: Mutex<()>,
    /// The rayon backend (`Backend::Rayon`), kept to compare against: see docs/perf.md.
    rayon: Option<rayon::ThreadPool>,
}

/// What runs the jobs of a [`ThreadPool`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Our persistent spinning workers (the default: faster decode, see docs/perf.md).
    Spin,
    /// A rayon pool of the same size, for comparison (`MOESHARD_POOL=rayon`).
    Rayon,
}

impl Backend {
    /// `MOESHARD_POOL=rayon` selects rayon; anything else, our pool.
    pub fn from_env() -> Backend {
        match std::env::var("MOESHARD_POOL").as_deref() {
            Ok("rayon") => Backend::Rayon,
            _ => Backend::Spin,
        }
    }
}

impl ThreadPool {
    /// A pool of `n_threads` (including the caller; 0 means the number of available cores),
    /// on the backend `MOESHARD_POOL` names (ours by default).
    pub fn new(n_threads: usize) -> ThreadPool {
        ThreadPool::with_backend(n_threads, Backend::from_env())
    }

    pub fn with_backend(n_threads: usize, backend: Backend) -> ThreadPool {
        let n = if n_threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        } else {
            n_threads
        };
        let shared = Arc::new(Shared {
            generation: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            open: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            counting: AtomicBool::new(false),
            published_at: AtomicU64::new(0),
            first_done: AtomicU64::new(u64::MAX),
            last_done: AtomicU64::new(0),
            panicked: Mutex::new(None),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            sleepers: AtomicUsize::new(0),
        });
        if backend == Backend::Rayon {
            let rp = rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .expect("building a rayon pool");
            return ThreadPool {
                shared,
                workers: Vec::new(),
                busy: Mutex::new(()),
                rayon: Some(rp),
            };
        }
        let workers = (1..n)
            .map(|tid| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("moeshard-worker-{tid}"))
                    .spawn(move || worker_loop(&shared, tid))
                    .expect("spawning a worker thread")
            })
            .collect();
        ThreadPool {
            shared,
            workers,
            busy: Mutex::new(()),
            rayon: None,
        }
    }

    pub fn n_threads(&self) -> usize {
        if let Some(r) = &self.rayon {
            return r.current_num_threads();
        }
        self.workers.len() + 1
    }

    /// Runs `f(thread_index)` on the calling thread (index 0) and on every worker that joins
    /// before the caller's own call returns; returns when all of them are done. `f` must share
    /// its work through something like a counter, since any subset of threads may run it. A
    /// panic in any thread is re-raised here.
    fn run_open<F: Fn(usize) + Sync>(&self, f: F) {
        let _guard = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        let job: &(dyn Fn(usize) + Sync) = &f;
        // SAFETY: erase the lifetime; we do not return before every worker that joined is done
        // with `job`, and no worker joins after `open` is cleared.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(job) };
        // SAFETY: no worker reads `job` now: `open` is false (the previous job cleared it and
        // waited for `active` to reach zero before returning), and callers hold `busy`.
        unsafe { *self.shared.job.get() = Some(job) };
        let counting = pool_stats::enabled();
        let published_at = if counting { pool_stats::now_nanos() } else { 0 };
        self.shared.counting.store(counting, Ordering::Relaxed);
        self.shared
            .published_at
            .store(published_at, Ordering::Relaxed);
        if counting {
            self.shared.first_done.store(u64::MAX, Ordering::Relaxed);
            self.shared.last_done.store(0, Ordering::Relaxed);
        }
        self.shared.open.store(true, Ordering::SeqCst);
        // A worker registers in `sleepers` under the lock before it checks `generation` and
        // waits; with both sides SeqCst, either it sees the new generation or we see it
        // registered, and then taking the lock waits until it is inside `wait`.
        self.shared.generation.fetch_add(1, Ordering::SeqCst);
        if self.shared.sleepers.load(Ordering::SeqCst) > 0 {
            let _sleepers = self
                .shared
                .sleep_lock
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| f(0)));
        let caller_done = if counting { pool_stats::now_nanos() } else { 0 };
        self.shared.open.store(false, Ordering::SeqCst);
        while self.shared.active.load(Ordering::SeqCst) != 0 {
            std::hint::spin_loop();
        }
        if counting {
            pool_stats::add_participant(caller_done.saturating_sub(published_at), 0);
            // Every worker that joined is done (`active` is zero), so both marks are final.
            let first = self
                .shared
                .first_done
                .load(Ordering::Relaxed)
                .min(caller_done);
            let last = self
                .shared
                .last_done
                .load(Ordering::Relaxed)
                .max(caller_done);
            pool_stats::add_job(
                pool_stats::now_nanos().saturating_sub(published_at),
                self.n_threads(),
                last.saturating_sub(first),
            );
        }
        // SAFETY: `open` is false and `active` is zero, so every worker that joined is done, and
        // one that increments `active` from now on sees `open` false and does not read `job`.
        unsafe { *self.shared.job.get() = None };
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if let Some(p) = self
            .shared
            .panicked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            resume_unwind(p);
        }
    }

    /// Splits `0..n` into chunks of `chunk` items handed out dynamically; `f(range)` runs on
    /// whichever thread takes the chunk.
    pub fn for_each_chunk<F: Fn(std::ops::Range<usize>) + Sync>(
        &self,
        n: usize,
        chunk: usize,
        f: F,
    ) {
        let chunk = chunk.max(1);
        if let Some(rp) = &self.rayon {
            use rayon::prelude::*;
            if n <= chunk || rp.current_num_threads() == 1 {
                if n > 0 {
                    f(0..n);
                }
                return;
            }
            rp.install(|| {
                (0..n.div_ceil(chunk))
                    .into_par_iter()
                    .for_each(|i| f(i * chunk..((i + 1) * chunk).min(n)))
            });
            return;
        }
        if n <= chunk || self.workers.is_empty() {
            if n > 0 {
                f(0..n);
            }
            return;
        }
        let next = AtomicUsize::new(0);
        self.run_open(|_| {
            loop {
                let start = next.fetch_add(chunk, Ordering::Relaxed);
                if start >= n {
                    break;
                }
                f(start..(start + chunk).min(n));
            }
        });
    }
}

impl ThreadPool {
    /// `f(first_row, rows)` over `data` cut into rows of `row_len` values, blocks of
    /// `rows_per_task` rows handed out as by [`ThreadPool::for_each_chunk`]: each row is in
    /// exactly one call's slice. For the per-row work between matmuls (norms, RoPE, activations,
    /// sums), which is serial otherwise and at many threads costs as much as the matmuls.
    pub fn for_each_rows_mut<T: Send, F: Fn(usize, &mut [T]) + Sync>(
        &self,
        data: &mut [T],
        row_len: usize,
        rows_per_task: usize,
        f: F,
    ) {
        if row_len == 0 || data.is_empty() {
            return;
        }
        assert!(
            data.len().is_multiple_of(row_len),
            "{} values are not rows of {row_len}",
            data.len()
        );
        let n_rows = data.len() / row_len;
        let base = RowsPtr(data.as_mut_ptr());
        self.for_each_chunk(n_rows, rows_per_task, |rows| {
            // SAFETY: `rows` lies inside 0..n_rows, so the slice is inside `data`, which is
            // borrowed mutably for this whole call; `for_each_chunk` hands each row to exactly
            // one chunk, so no two slices overlap, and it returns only after every call ended.
            let block = unsafe {
                std::slice::from_raw_parts_mut(
                    base.get().add(rows.start * row_len),
                    rows.len() * row_len,
                )
            };
            f(rows.start, block);
        });
    }

    /// `f(i, &mut items[i])` for every item, in parallel, one item per task.
    pub fn for_each_mut<T: Send, F: Fn(usize, &mut T) + Sync>(&self, items: &mut [T], f: F) {
        self.for_each_rows_mut(items, 1, 1, |first, block| {
            for (j, item) in block.iter_mut().enumerate() {
                f(first + j, item);
            }
        });
    }
}

/// The base of a buffer whose disjoint blocks the tasks of one `for_each_rows_mut` write.
struct RowsPtr<T>(*mut T);
// Not derived: a derive would require `T: Copy`, and only the address is copied.
impl<T> Clone for RowsPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for RowsPtr<T> {}
// SAFETY: only the address is shared; each task dereferences its own block (see
// `for_each_rows_mut`), and `T: Send` because those blocks are written from other threads.
unsafe impl<T: Send> Sync for RowsPtr<T> {}
// SAFETY: as for `Sync`.
unsafe impl<T: Send> Send for RowsPtr<T> {}
impl<T> RowsPtr<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

fn worker_loop(shared: &Shared, tid: usize) {
    let mut seen = 0usize;
    loop {
        let spin_start = Instant::now();
        let mut spins = 0u32;
        loop {
            let g = shared.generation.load(Ordering::SeqCst);
            if g != seen {
                seen = g;
                break;
            }
            if shared.stop.load(Ordering::Relaxed) {
                return;
            }
            spins += 1;
            if spins.is_multiple_of(256) && spin_start.elapsed() > SPIN {
                let mut guard = shared.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
                shared.sleepers.fetch_add(1, Ordering::SeqCst);
                while shared.generation.load(Ordering::SeqCst) == seen
                    && !shared.stop.load(Ordering::Relaxed)
                {
                    guard = shared.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
                }
                shared.sleepers.fetch_sub(1, Ordering::SeqCst);
                drop(guard);
            } else {
                std::hint::spin_loop();
            }
        }
        if shared.stop.load(Ordering::Relaxed) {
            return;
        }
        // Join only while the job is open; the caller clears `open` before it waits on
        // `active`, so either it sees us or we see it closed.
        shared.active.fetch_add(1, Ordering::SeqCst);
        if shared.open.load(Ordering::SeqCst) {
            // SAFETY: we incremented `active` before seeing `open` true, so `job` was written
            // before we read it and the caller does not write it again until `active` drops
            // back to zero.
            if let Some(job) = unsafe { *shared.job.get() } {
                // Written before `open` was set, which we saw.
                let counting = shared.counting.load(Ordering::Relaxed);
                let entered = if counting { pool_stats::now_nanos() } else { 0 };
                // SAFETY: the closure lives on the caller's stack until `run_open` returns, which
                // it does only after `active` is zero again, after this call; it is `Sync`.
                let result = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)(tid) }));
                if counting {
                    let published = shared.published_at.load(Ordering::Relaxed);
                    let done = pool_stats::now_nanos();
                    shared.first_done.fetch_min(done, Ordering::Relaxed);
                    shared.last_done.fetch_max(done, Ordering::Relaxed);
                    pool_stats::add_participant(
                        done.saturating_sub(entered),
                        entered.saturating_sub(published),
                    );
                }
                if let Err(p) = result {
                    *shared.panicked.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
                }
            }
            // The job we ran may be newer than the generation we saw.
            seen = shared.generation.load(Ordering::SeqCst);
        }
        shared.active.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        {
            let _g = self
                .shared
                .sleep_lock
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            self.shared.stop.store(true, Ordering::Relaxed);
        }
        self.shared.wake.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_blocks_cover_every_row_once_with_its_index() {
        for threads in [1, 3] {
            let pool = ThreadPool::with_backend(threads, Backend::Spin);
            for (n_rows, per_task) in [(0, 1), (1, 4), (7, 2), (64, 3)] {
                let mut data = vec![0usize; n_rows * 5];
                pool.for_each_rows_mut(&mut data, 5, per_task, |first, block| {
                    assert!(block.len().is_multiple_of(5));
                    for (i, row) in block.chunks_exact_mut(5).enumerate() {
                        row.iter_mut().for_each(|v| *v += first + i + 1);
                    }
                });
                let want: Vec<usize> = (0..n_rows).flat_map(|r| [r + 1; 5]).collect();
                assert_eq!(data, want, "{threads} threads, {n_rows} rows by {per_task}");
            }
            let mut items = vec![0usize; 10];
            pool.for_each_mut(&mut items, |i, v| *v = i * i);
            assert_eq!(items, (0..10).map(|i| i * i).collect::<Vec<_>>());
        }
    }

    #[test]
    fn chunks_cover_the_range_exactly_once() {
        for (threads, backend) in [1, 2, 3]
            .into_iter()
            .flat_map(|t| [(t, Backend::Spin), (t, Backend::Rayon)])
        {
            let pool = ThreadPool::with_backend(threads, backend);
            assert_eq!(pool.n_threads(), threads);
            for _ in 0..200 {
                let seen: Vec<AtomicUsize> = (0..1001).map(|_| AtomicUsize::new(0)).collect();
                pool.for_each_chunk(1001, 7, |r| {
                    for i in r {
                        seen[i].fetch_add(1, Ordering::Relaxed);
                    }
                });
                assert!(seen.iter().all(|s| s.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn workers_take_part_and_wake_after_sleeping() {
        let pool = ThreadPool::with_backend(2, Backend::Spin);
        std::thread::sleep(Duration::from_millis(5));
        let by_worker = AtomicUsize::new(0);
        for _ in 0..50 {
            pool.for_each_chunk(64, 1, |_| {
                if std::thread::current()
                    .name()
                    .is_some_and(|n| n.starts_with("moeshard-worker"))
                {
                    by_worker.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_micros(50));
            });
        }
        assert!(
            by_worker.load(Ordering::Relaxed) > 0,
            "the worker never joined"
        );
    }

    #[test]
    fn a_worker_panic_reaches_the_caller_and_the_pool_survives() {
        let pool = ThreadPool::with_backend(2, Backend::Spin);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.for_each_chunk(100, 1, |r| {
                std::thread::sleep(Duration::from_micros(20));
                if r.start == 50 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        pool.for_each_chunk(10, 1, |_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 10);
    }
}
