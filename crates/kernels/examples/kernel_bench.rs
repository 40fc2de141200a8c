//! Weight-read bandwidth of matrix × vector per format, next to the machine's plain read
//! bandwidth, for `docs/perf.md`. Usage:
//!   cargo run --release -p kernels --example kernel_bench -- [--threads 1,2] [--big-mib 512]
//!       [--types q4_K,q6_K,q8_0,mxfp4] [--isa avx512]

use std::hint::black_box;
use std::time::{Duration, Instant};

use gguf::GgmlType;
use kernels::{Input, Isa, Kernels, ThreadPool, Weights};

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// Fills `n` bytes of plausible blocks of `t` (random quants, small f16 scales).
fn random_weights(t: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let rb = t.row_bytes(cols as u64).expect("whole blocks") as usize;
    let mut data = vec![0u8; rows * rb];
    let mut s = 0x1234_5678_9abc_def0u64;
    for b in data.iter_mut() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        *b = s as u8;
    }
    // Make every f16 scale field small and finite (random bits could be NaN or inf); MXFP4's
    // exponent must not be huge either.
    let ts = t.type_size();
    let safe = half::f16::from_f32(0.01).to_bits().to_le_bytes();
    for block in data.chunks_exact_mut(ts) {
        for &o in kernels::blocks::f16_scale_fields(t) {
            block[o..o + 2].copy_from_slice(&safe);
        }
        match t {
            GgmlType::Mxfp4 => block[0] = 120,
            GgmlType::Q8K => block[..4].copy_from_slice(&0.01f32.to_le_bytes()),
            _ => {}
        }
    }
    data
}

/// Median seconds of `f` over enough runs to fill ~`budget`.
fn time(budget: Duration, mut f: impl FnMut()) -> f64 {
    f();
    let t0 = Instant::now();
    f();
    let once = t0.elapsed().as_secs_f64().max(1e-7);
    let reps = ((budget.as_secs_f64() / once) as usize).clamp(3, 2000);
    let mut v: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Plain read bandwidth: sum of u64 words of a `bytes`-sized buffer, split over the pool.
fn read_bandwidth(pool: &ThreadPool, bytes: usize) -> f64 {
    let buf: Vec<u64> = (0..bytes / 8).map(|i| i as u64).collect();
    let chunk = buf.len() / (pool.n_threads() * 16);
    let secs = time(Duration::from_secs(2), || {
        pool.for_each_chunk(buf.len(), chunk, |r| {
            let s = &buf[r];
            let mut acc = [0u64; 8];
            for c in s.chunks_exact(8) {
                for i in 0..8 {
                    acc[i] = acc[i].wrapping_add(c[i]);
                }
            }
            black_box(acc);
        });
    });
    bytes as f64 / secs / 1e9
}

fn main() {
    let threads: Vec<usize> = arg("--threads")
        .unwrap_or_else(|| "1,2".into())
        .split(',')
        .map(|s| s.parse().expect("thread count"))
        .collect();
    let big_mib: usize = arg("--big-mib")
        .map(|s| s.parse().expect("MiB"))
        .unwrap_or(512);
    let types: Vec<GgmlType> = arg("--types")
        .unwrap_or_else(|| "q4_K,q6_K,q8_0,mxfp4".into())
        .split(',')
        .map(|s| GgmlType::from_name(s).expect("type name"))
        .collect();
    let isa = arg("--isa")
        .and_then(|s| Isa::from_name(&s))
        .unwrap_or_else(Isa::detect);
    let kernels = Kernels::with_isa(isa).expect("ISA supported");
    println!("isa: {isa:?}");
    for &nt in &threads {
        let pool = ThreadPool::new(nt);
        println!(
            "threads {nt}: read bandwidth {:.1} GB/s ({} MiB buffer)",
            read_bandwidth(&pool, big_mib << 20),
            big_mib
        );
    }
    println!("| type | shape | weight MiB | threads | µs/matvec | GB/s |");
    println!("|---|---|---|---|---|---|");
    for &t in &types {
        let big_rows = (big_mib << 20) / t.row_bytes(4096).unwrap() as usize;
        for (rows, cols) in [(2048, 2048), (768, 2048), (big_rows, 4096)] {
            let data = random_weights(t, rows, cols);
            let w = Weights::new(t, rows, cols, &data).expect("weights");
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
                .collect();
            let mut out = vec![0f32; rows];
            for &nt in &threads {
                let pool = ThreadPool::new(nt);
                let input = Input::new(&x, 1, cols).expect("input");
                let secs = time(Duration::from_secs(2), || {
                    kernels.matmul(&pool, &w, &input, &mut out).expect("matmul");
                });
                println!(
                    "| {t} | {rows}×{cols} | {:.1} | {nt} | {:.1} | {:.1} |",
                    data.len() as f64 / (1 << 20) as f64,
                    secs * 1e6,
                    data.len() as f64 / secs / 1e9
                );
            }
        }
    }
}
