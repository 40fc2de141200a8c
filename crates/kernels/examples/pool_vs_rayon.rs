//! Our per-token thread pool against rayon on one decode step's worth of matrix × vector
//! products, the workload the pool was built for: many small products in a row, each cut into
//! row chunks, so dispatch cost matters as much as bandwidth. Usage:
//!   cargo run --release -p kernels --example pool_vs_rayon -- [--threads 1,2] [--budget-ms 3000]
//!       [--rows-per-item N]
//!
//! Two shapes (Q4_K weights, activations quantized once per product outside the timing):
//! an OLMoE-like step (16 layers × [4 attention 2048×2048 + 8 experts × (2 of 1024×2048 +
//! 2048×1024)], ≈ 600 MB, memory-bound) and a small-2b-like step (8 layers × [2048×1024,
//! 2 × 512×1024, 1024×2048 + 4 experts × (2 of 512×1024 + 1024×512)], ≈ 24 MB, mostly
//! cache-resident, dispatch-bound). Both executors run the same dot function on the same
//! row chunks.

use gguf::GgmlType;
use kernels::{Input, Kernels, PoolBackend, ThreadPool, Weights, format};
use rayon::prelude::*;

mod common;
use common::{budget_arg, random_weights, threads_arg, time};

/// Rows per work item (both executors): `--rows-per-item N`, else the engine's rule for decode
/// (about eight items per thread, 8–256 rows, a multiple of 4).
fn rows_per_item(rows: usize, n_threads: usize) -> usize {
    match common::arg("--rows-per-item") {
        Some(s) => s.parse().expect("rows per item"),
        None => (rows / (n_threads * 8)).clamp(8, 256).next_multiple_of(4),
    }
}

struct Product {
    rows: usize,
    cols: usize,
    weights: Vec<u8>,
    acts: Vec<u8>,
}

fn product(pool: &ThreadPool, rows: usize, cols: usize) -> Product {
    let t = GgmlType::Q4K;
    let weights = random_weights(t, rows, cols);
    let x: Vec<f32> = (0..cols)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let input = Input::new(&x, 1, cols).expect("input");
    let act = format(t).expect("q4_K format").act;
    let acts = input.quantized(act, pool).to_vec();
    Product {
        rows,
        cols,
        weights,
        acts,
    }
}

/// One step: per layer, the listed (rows, cols) products.
fn step(pool: &ThreadPool, layers: usize, shapes: &[(usize, usize)]) -> Vec<Product> {
    (0..layers)
        .flat_map(|_| shapes.iter().map(|&(r, c)| product(pool, r, c)))
        .collect()
}

/// Output rows shared by the threads of one product; every chunk writes only its own rows.
struct SharedOut(*mut f32);
// SAFETY: each work item writes a disjoint row range of the buffer, and the buffer outlives
// the product (the executors return only after every item finished).
unsafe impl Sync for SharedOut {}

fn run_pool(kernels: &Kernels, pool: &ThreadPool, products: &[Product], out: &mut [f32]) {
    let dot = kernels.dot_fn(GgmlType::Q4K).expect("q4_K dot");
    for p in products {
        let w = Weights::new(GgmlType::Q4K, p.rows, p.cols, &p.weights).expect("weights");
        assert!(
            p.rows <= out.len(),
            "{} output rows for {} values",
            p.rows,
            out.len()
        );
        let shared = SharedOut(out.as_mut_ptr());
        pool.for_each_chunk(p.rows, rows_per_item(p.rows, pool.n_threads()), |range| {
            let shared = &shared;
            for r in range {
                let v = dot(p.cols, w.row(r), &p.acts);
                // SAFETY: see `SharedOut`; `r < p.rows <= out.len()` (asserted above).
                unsafe { *shared.0.add(r) = v };
            }
        });
    }
}

fn run_rayon(kernels: &Kernels, pool: &rayon::ThreadPool, products: &[Product], out: &mut [f32]) {
    let dot = kernels.dot_fn(GgmlType::Q4K).expect("q4_K dot");
    pool.install(|| {
        for p in products {
            let w = Weights::new(GgmlType::Q4K, p.rows, p.cols, &p.weights).expect("weights");
            let chunk = rows_per_item(p.rows, rayon::current_num_threads());
            out[..p.rows]
                .par_chunks_mut(chunk)
                .enumerate()
                .for_each(|(i, o)| {
                    for (j, v) in o.iter_mut().enumerate() {
                        *v = dot(p.cols, w.row(i * chunk + j), &p.acts);
                    }
                });
        }
    });
}

fn main() {
    let budget = budget_arg(3000);
    let threads = threads_arg();
    let kernels = Kernels::default();
    let setup = ThreadPool::new(1);
    let mut olmoe = vec![(2048, 2048); 4];
    for _ in 0..8 {
        olmoe.extend([(1024, 2048), (1024, 2048), (2048, 1024)]);
    }
    let mut small = vec![(2048, 1024), (512, 1024), (512, 1024), (1024, 2048)];
    for _ in 0..4 {
        small.extend([(512, 1024), (512, 1024), (1024, 512)]);
    }
    let workloads = [
        ("olmoe-like step", step(&setup, 16, &olmoe)),
        ("small-2b-like step", step(&setup, 8, &small)),
    ];
    println!(
        "isa: {:?}, rows per work item: {}, median of repeated steps",
        kernels.isa,
        common::arg("--rows-per-item").unwrap_or_else(|| "the engine's rule".into())
    );
    println!(
        "| workload | products | weight MB | threads | ours µs/step | rayon µs/step | rayon ÷ ours |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut out = vec![0f32; 4096];
    for (name, products) in &workloads {
        let mb = products.iter().map(|p| p.weights.len()).sum::<usize>() as f64 / 1e6;
        for &nt in &threads {
            // Each pool exists only while it is measured, so idle threads of the other cannot
            // take cores from it.
            let ours = ThreadPool::with_backend(nt, PoolBackend::Spin);
            let t_ours = time(budget, || run_pool(&kernels, &ours, products, &mut out));
            drop(ours);
            let theirs = rayon::ThreadPoolBuilder::new()
                .num_threads(nt)
                .build()
                .expect("rayon pool");
            let t_rayon = time(budget, || run_rayon(&kernels, &theirs, products, &mut out));
            drop(theirs);
            println!(
                "| {name} | {} | {mb:.0} | {nt} | {:.0} | {:.0} | {:.2} |",
                products.len(),
                t_ours * 1e6,
                t_rayon * 1e6,
                t_rayon / t_ours
            );
        }
    }
}
