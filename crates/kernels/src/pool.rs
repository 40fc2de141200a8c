//! A thread pool built for per-token work: persistent threads that spin briefly between jobs and
//! then sleep, so the dozens of matmuls of one decode step each cost a few hundred nanoseconds
//! of dispatch instead of a thread wake-up. The calling thread takes part as worker 0.

use std::cell::UnsafeCell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it sleeps. Long enough to cover the serial work between
/// two matmuls of a decode step (norms, router, attention bookkeeping), short enough that an idle
/// server does not burn a core.
const SPIN: Duration = Duration::from_micros(300);

type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// Bumped once per job; workers run the job when they see a new value.
    generation: AtomicUsize,
    /// Workers that have not finished the current job.
    pending: AtomicUsize,
    /// The current job. Written by the caller before `generation` is bumped (release), read by
    /// workers after they observe the bump (acquire).
    job: UnsafeCell<Option<Job>>,
    stop: AtomicBool,
    panicked: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    sleep_lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is only written while no worker reads it (between jobs, guarded by the
// generation/pending protocol), and the pointee is `Sync`.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serializes callers: one job at a time.
    busy: Mutex<()>,
}

impl ThreadPool {
    /// A pool of `n_threads` (including the caller; 0 means the number of available cores).
    pub fn new(n_threads: usize) -> ThreadPool {
        let n = if n_threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        } else {
            n_threads
        };
        let shared = Arc::new(Shared {
            generation: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            stop: AtomicBool::new(false),
            panicked: Mutex::new(None),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
        });
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
        }
    }

    pub fn n_threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(thread_index)` once on every thread of the pool (the caller is thread 0) and
    /// returns when all have finished. A panic in any thread is re-raised here.
    pub fn broadcast<F: Fn(usize) + Sync>(&self, f: F) {
        if self.workers.is_empty() {
            f(0);
            return;
        }
        let _guard = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        let job: &(dyn Fn(usize) + Sync) = &f;
        // SAFETY: erase the lifetime; we do not return before every worker is done with `job`.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(job) };
        unsafe { *self.shared.job.get() = Some(job) };
        self.shared
            .pending
            .store(self.workers.len(), Ordering::Relaxed);
        {
            let _sleepers = self
                .shared
                .sleep_lock
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            self.shared.generation.fetch_add(1, Ordering::Release);
        }
        self.shared.wake.notify_all();
        let mine = catch_unwind(AssertUnwindSafe(|| f(0)));
        while self.shared.pending.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
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
        if n <= chunk || self.workers.is_empty() {
            if n > 0 {
                f(0..n);
            }
            return;
        }
        let next = AtomicUsize::new(0);
        self.broadcast(|_| {
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

fn worker_loop(shared: &Shared, tid: usize) {
    let mut seen = 0usize;
    loop {
        let spin_start = Instant::now();
        let mut spins = 0u32;
        loop {
            let g = shared.generation.load(Ordering::Acquire);
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
                while shared.generation.load(Ordering::Acquire) == seen
                    && !shared.stop.load(Ordering::Relaxed)
                {
                    guard = shared.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
                }
            } else {
                std::hint::spin_loop();
            }
        }
        if shared.stop.load(Ordering::Relaxed) {
            return;
        }
        // SAFETY: the caller published the job before bumping `generation` and keeps it alive
        // until `pending` reaches zero.
        let job = unsafe { (*shared.job.get()).expect("job published before generation bump") };
        let result = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)(tid) }));
        if let Err(p) = result {
            *shared.panicked.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
        }
        shared.pending.fetch_sub(1, Ordering::Release);
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
    fn every_thread_runs_once_per_broadcast() {
        let pool = ThreadPool::new(3);
        let hits: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
        for _ in 0..1000 {
            pool.broadcast(|t| {
                hits[t].fetch_add(1, Ordering::Relaxed);
            });
        }
        for h in &hits {
            assert_eq!(h.load(Ordering::Relaxed), 1000);
        }
    }

    #[test]
    fn chunks_cover_the_range_exactly_once() {
        let pool = ThreadPool::new(2);
        let seen: Vec<AtomicUsize> = (0..1001).map(|_| AtomicUsize::new(0)).collect();
        pool.for_each_chunk(1001, 7, |r| {
            for i in r {
                seen[i].fetch_add(1, Ordering::Relaxed);
            }
        });
        assert!(seen.iter().all(|s| s.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn wakes_after_sleeping() {
        let pool = ThreadPool::new(2);
        std::thread::sleep(Duration::from_millis(5));
        let n = AtomicUsize::new(0);
        pool.broadcast(|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_worker_panic_reaches_the_caller_and_the_pool_survives() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.broadcast(|t| {
                if t == 1 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        pool.broadcast(|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 2);
    }
}
