//! Weight-read bandwidth of matrix × vector per format, next to the machine's plain read
//! bandwidth, and matrix × batch (GEMM) throughput, for `docs/perf.md`. Usage:
//!   cargo run --release -p kernels --example kernel_bench -- [--threads 1,2] [--big-mib 512]
//!       [--types q4_K,q6_K,q8_0,mxfp4] [--isa avx512] [--only matvec|gemm|chunked]
//!       [--shapes 2048x2048,1024x2048] [--tokens 1,8,32,256] [--budget-ms 2000] [--stat median|min]
//!
//! The GEMM table reports GFLOP/s as `2·rows·cols·tokens / time` (activation quantization
//! included, as in a forward pass) and GB/s of weight bytes read once.

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

/// Median seconds of `f` over enough runs to fill ~`budget` (the minimum with `--stat min`,
/// steadier on a loaded machine).
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
    if arg("--stat").as_deref() == Some("min") {
        v[0]
    } else {
        v[v.len() / 2]
    }
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
    let only = arg("--only");
    let budget = Duration::from_millis(
        arg("--budget-ms")
            .map(|s| s.parse().expect("milliseconds"))
            .unwrap_or(2000),
    );
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
    if only.as_deref() != Some("gemm") {
        matvec(&kernels, &threads, &types, big_mib, budget);
    }
    if only.is_none() || only.as_deref() == Some("gemm") {
        gemm(&kernels, &threads, &types, budget);
    }
    if only.is_none() || only.as_deref() == Some("chunked") {
        chunked(&kernels, &threads, &types, big_mib, budget);
    }
}

fn matvec(
    kernels: &Kernels,
    threads: &[usize],
    types: &[GgmlType],
    big_mib: usize,
    budget: Duration,
) {
    for &nt in threads {
        let pool = ThreadPool::new(nt);
        println!(
            "threads {nt}: read bandwidth {:.1} GB/s ({} MiB buffer)",
            read_bandwidth(&pool, big_mib << 20),
            big_mib
        );
    }
    println!("| type | shape | weight MiB | threads | µs/matvec | GB/s |");
    println!("|---|---|---|---|---|---|");
    for &t in types {
        let big_rows = (big_mib << 20) / t.row_bytes(4096).unwrap() as usize;
        for (rows, cols) in [(2048, 2048), (768, 2048), (big_rows, 4096)] {
            let data = random_weights(t, rows, cols);
            let w = Weights::new(t, rows, cols, &data).expect("weights");
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
                .collect();
            let mut out = vec![0f32; rows];
            for &nt in threads {
                let pool = ThreadPool::new(nt);
                let input = Input::new(&x, 1, cols).expect("input");
                let secs = time(budget, || {
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

/// Matrix × `n` tokens for every shape and token count: a fresh [`Input`] per run, so the
/// activation quantization is timed too.
fn gemm(kernels: &Kernels, threads: &[usize], types: &[GgmlType], budget: Duration) {
    let shapes: Vec<(usize, usize)> = arg("--shapes")
        .unwrap_or_else(|| "2048x2048,1024x2048".into())
        .split(',')
        .map(|s| {
            let (r, c) = s.split_once('x').expect("ROWSxCOLS");
            (r.parse().expect("rows"), c.parse().expect("cols"))
        })
        .collect();
    let tokens: Vec<usize> = arg("--tokens")
        .unwrap_or_else(|| "1,8,32,256".into())
        .split(',')
        .map(|s| s.parse().expect("token count"))
        .collect();
    println!();
    println!("| type | shape | tokens | threads | µs | GFLOP/s | weight GB/s |");
    println!("|---|---|---|---|---|---|---|");
    for &t in types {
        for &(rows, cols) in &shapes {
            let data = random_weights(t, rows, cols);
            let w = Weights::new(t, rows, cols, &data).expect("weights");
            for &n in &tokens {
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1 + (i / cols) as f32 * 0.01)
                    .collect();
                let mut out = vec![0f32; n * rows];
                for &nt in threads {
                    let pool = ThreadPool::new(nt);
                    let secs = time(budget, || {
                        let input = Input::new(&x, n, cols).expect("input");
                        kernels.matmul(&pool, &w, &input, &mut out).expect("matmul");
                    });
                    println!(
                        "| {t} | {rows}×{cols} | {n} | {nt} | {:.1} | {:.1} | {:.1} |",
                        secs * 1e6,
                        2.0 * (rows * cols * n) as f64 / secs / 1e9,
                        data.len() as f64 / secs / 1e9
                    );
                }
            }
        }
    }
}

/// `matmul_chunked` (256-column chunks summed in f64: attention output and dense down
/// projections) for one and 32 tokens, on an L2-resident and a `--big-mib` matrix.
fn chunked(
    kernels: &Kernels,
    threads: &[usize],
    types: &[GgmlType],
    big_mib: usize,
    budget: Duration,
) {
    println!();
    println!("| type | shape | tokens | threads | µs | weight GB/s |");
    println!("|---|---|---|---|---|---|");
    for &t in types {
        let chunk = Kernels::reduction_chunk(t, 256).expect("computable");
        let big_rows = (big_mib << 20) / t.row_bytes(2048).unwrap() as usize;
        for (rows, cols, tokens) in [(2048, 2048, [1, 32]), (big_rows, 2048, [1, 0])] {
            let data = random_weights(t, rows, cols);
            let w = Weights::new(t, rows, cols, &data).expect("weights");
            for n in tokens.into_iter().filter(|&n| n > 0) {
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
                    .collect();
                let mut out = vec![0f64; n * rows];
                for &nt in threads {
                    let pool = ThreadPool::new(nt);
                    let secs = time(budget, || {
                        let input = Input::new(&x, n, cols).expect("input");
                        kernels
                            .matmul_chunked(&pool, &w, &input, chunk, &mut out)
                            .expect("chunked matmul");
                    });
                    println!(
                        "| {t} | {rows}×{cols} | {n} | {nt} | {:.1} | {:.1} |",
                        secs * 1e6,
                        data.len() as f64 / secs / 1e9
                    );
                }
            }
        }
    }
}
