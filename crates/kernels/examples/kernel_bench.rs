//! Weight-read bandwidth of matrix × vector per format, next to the machine's plain read
//! bandwidth, and matrix × batch (GEMM) throughput, for `docs/perf.md`. Usage:
//!   cargo run --release -p kernels --example kernel_bench -- [--threads 1,2] [--big-mib 512]
//!       [--types q4_K,q6_K,q8_0,mxfp4] [--isa avx512] [--only matvec|gemm|chunked|chunked-gemm]
//!       [--shapes 2048x2048,1024x2048] [--tokens 1,8,32,256] [--budget-ms 2000] [--stat median|min]
//!
//! The GEMM table reports GFLOP/s as `2·rows·cols·tokens / time` (activation quantization
//! included, as in a forward pass) and GB/s of weight bytes read once.

use std::hint::black_box;
use std::time::Duration;

use gguf::GgmlType;
use kernels::{Input, Isa, Kernels, ThreadPool, Weights};

mod common;
use common::{arg, budget_arg, random_weights, threads_arg, time};

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
    let budget = budget_arg(2000);
    let threads = threads_arg();
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
    if only.as_deref() == Some("chunked-gemm") {
        chunked_gemm(&kernels, &threads, &types, budget);
    }
}

/// `matmul_chunked` against `matmul` on the same `--shapes` and `--tokens` (GFLOP/s of each):
/// what the f64 sum over 256-column chunks costs a batch (attention output projections).
fn chunked_gemm(kernels: &Kernels, threads: &[usize], types: &[GgmlType], budget: Duration) {
    let (shapes, tokens) = shapes_and_tokens("2048x4096", "32,256");
    println!();
    println!("| type | shape | tokens | threads | matmul GFLOP/s | chunked GFLOP/s |");
    println!("|---|---|---|---|---|---|");
    for &t in types {
        let chunk = arg("--chunk")
            .map(|c| c.parse().expect("chunk columns"))
            .unwrap_or_else(|| Kernels::reduction_chunk(t, 256).expect("computable"));
        for &(rows, cols) in &shapes {
            let data = random_weights(t, rows, cols);
            let w = Weights::new(t, rows, cols, &data).expect("weights");
            for &n in &tokens {
                let x = activations(n, cols);
                let mut out32 = vec![0f32; n * rows];
                let mut out64 = vec![0f64; n * rows];
                for &nt in threads {
                    let pool = ThreadPool::new(nt);
                    let plain = time(budget, || {
                        let input = Input::new(&x, n, cols).expect("input");
                        kernels
                            .matmul(&pool, &w, &input, &mut out32)
                            .expect("matmul");
                    });
                    let summed = time(budget, || {
                        let input = Input::new(&x, n, cols).expect("input");
                        kernels
                            .matmul_chunked(&pool, &w, &input, chunk, &mut out64)
                            .expect("chunked matmul");
                    });
                    let flop = 2.0 * (rows * cols * n) as f64;
                    println!(
                        "| {t} | {rows}×{cols} | {n} | {nt} | {:.1} | {:.1} |",
                        flop / plain / 1e9,
                        flop / summed / 1e9
                    );
                }
            }
        }
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

/// `n` rows of `cols` deterministic activations, each row a little different.
fn activations(n: usize, cols: usize) -> Vec<f32> {
    (0..n * cols)
        .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1 + (i / cols) as f32 * 0.01)
        .collect()
}

/// `--shapes ROWSxCOLS,...` and `--tokens N,...`, or the defaults given.
fn shapes_and_tokens(shapes: &str, tokens: &str) -> (Vec<(usize, usize)>, Vec<usize>) {
    let shapes = arg("--shapes")
        .unwrap_or_else(|| shapes.into())
        .split(',')
        .map(|s| {
            let (r, c) = s.split_once('x').expect("ROWSxCOLS");
            (r.parse().expect("rows"), c.parse().expect("cols"))
        })
        .collect();
    let tokens = arg("--tokens")
        .unwrap_or_else(|| tokens.into())
        .split(',')
        .map(|s| s.parse().expect("token count"))
        .collect();
    (shapes, tokens)
}

/// Matrix × `n` tokens for every shape and token count: a fresh [`Input`] per run, so the
/// activation quantization is timed too.
fn gemm(kernels: &Kernels, threads: &[usize], types: &[GgmlType], budget: Duration) {
    let (shapes, tokens) = shapes_and_tokens("2048x2048,1024x2048", "1,8,32,256");
    println!();
    println!("| type | shape | tokens | threads | µs | GFLOP/s | weight GB/s |");
    println!("|---|---|---|---|---|---|---|");
    for &t in types {
        for &(rows, cols) in &shapes {
            let data = random_weights(t, rows, cols);
            let w = Weights::new(t, rows, cols, &data).expect("weights");
            for &n in &tokens {
                let x = activations(n, cols);
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
