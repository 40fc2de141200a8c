//! Direct-read bandwidth of a file (O_DIRECT on Linux, F_NOCACHE on macOS), the number SSD streaming is bounded by:
//! `cargo run --release -p experts --example disk_read -- FILE [seq|rand] [block KiB] [threads] [GiB]`
//! Sequential reads walk the file from a random aligned start; random reads pick aligned
//! offsets uniformly. Each thread keeps one read in flight (queue depth = threads).

use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

const ALIGN: usize = 4096;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(path) = args.first() else {
        eprintln!("usage: disk_read FILE [seq|rand] [block KiB] [threads] [GiB]");
        std::process::exit(2);
    };
    let mode = args.get(1).map_or("rand", String::as_str).to_string();
    let block = args
        .get(2)
        .and_then(|s| s.parse::<usize>().ok())
        .unwrap_or(1024)
        .max(1)
        * 1024;
    let threads = args
        .get(3)
        .and_then(|s| s.parse::<usize>().ok())
        .unwrap_or(1);
    let gib = args
        .get(4)
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or(2.0);
    let total = (gib * (1u64 << 30) as f64) as u64;
    let file = Arc::new(
        experts::direct_io::open(std::path::Path::new(path)).unwrap_or_else(|e| {
            eprintln!("{path}: cannot open for direct reads: {e}");
            std::process::exit(1)
        }),
    );
    let len = file.metadata().unwrap().len();
    let n_blocks = (len / block as u64).max(1);
    let done = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (file, done, mode) = (Arc::clone(&file), Arc::clone(&done), mode.clone());
            std::thread::spawn(move || {
                let layout = std::alloc::Layout::from_size_align(block, ALIGN).unwrap();
                // SAFETY: `layout` has a non-zero size (`block` is at least 1 KiB).
                let p = unsafe { std::alloc::alloc_zeroed(layout) };
                if p.is_null() {
                    std::alloc::handle_alloc_error(layout);
                }
                // SAFETY: `p` is a live, zeroed (so initialized) allocation of `block` bytes that
                // only this thread uses, until the `dealloc` below.
                let buf = unsafe { std::slice::from_raw_parts_mut(p, block) };
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (t as u64 + 1);
                let mut rng = || {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x
                };
                let mut seq = rng() % n_blocks;
                while done.load(Ordering::Relaxed) < total {
                    let b = if mode == "seq" {
                        seq = (seq + 1) % n_blocks;
                        seq
                    } else {
                        rng() % n_blocks
                    };
                    let n = file.read_at(buf, b * block as u64).expect("read");
                    done.fetch_add(n as u64, Ordering::Relaxed);
                }
                // SAFETY: allocated above with this layout; `buf`, the only use of it, is not used
                // after this.
                unsafe { std::alloc::dealloc(p, layout) };
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let secs = t0.elapsed().as_secs_f64();
    let bytes = done.load(Ordering::Relaxed) as f64;
    println!(
        "{mode} {} KiB x {threads} threads: {:.2} GiB in {secs:.2} s = {:.3} GB/s",
        block / 1024,
        bytes / (1u64 << 30) as f64,
        bytes / secs / 1e9
    );
}
