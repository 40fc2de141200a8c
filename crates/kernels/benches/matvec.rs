//! Matrix × vector (decode) and matrix × 32 tokens (a prefill expert batch) per format, one
//! thread, L2-resident weights, through `Kernels::matmul` at the best ISA (activation
//! quantization included); and the dot-product kernels alone per format and ISA (scalar
//! included). Throughput is weight bytes per second:
//!   cargo bench -p kernels --bench matvec [-- FILTER]

#[path = "../tests/common.rs"]
mod common;

use std::time::Duration;

use common::{COMPUTE_TYPES, Rng, random_row};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gguf::GgmlType;
use kernels::{Input, Isa, Kernels, ThreadPool, Weights, format, simd_dot};

const ROWS: usize = 512;
const COLS: usize = 2048;

fn product(c: &mut Criterion, name: &str, n: usize, types: &[GgmlType]) {
    let mut group = c.benchmark_group(name);
    group
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    let mut rng = Rng::new(2);
    let kernels = Kernels::default();
    let pool = ThreadPool::new(1);
    let x = rng.normals(n * COLS);
    for &t in types {
        let data: Vec<u8> = (0..ROWS)
            .flat_map(|_| random_row(&mut rng, t, COLS))
            .collect();
        let w = Weights::new(t, ROWS, COLS, &data).unwrap();
        let mut out = vec![0f32; n * ROWS];
        group.throughput(Throughput::Bytes(data.len() as u64));
        group.bench_function(BenchmarkId::from_parameter(t), |b| {
            b.iter(|| {
                let input = Input::new(&x, n, COLS).unwrap();
                kernels.matmul(&pool, &w, &input, &mut out).unwrap()
            })
        });
    }
    group.finish();
}

fn matvec(c: &mut Criterion) {
    product(c, "matvec", 1, &COMPUTE_TYPES);
}

fn gemm32(c: &mut Criterion) {
    product(c, "gemm32", 32, &COMPUTE_TYPES);
}

/// Every row of the matrix against one activation row with the bare dot kernel of each ISA.
fn dot_per_isa(c: &mut Criterion) {
    let mut group = c.benchmark_group("dot");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    let mut rng = Rng::new(7);
    for t in COMPUTE_TYPES {
        let f = format(t).unwrap();
        let w = random_row(&mut rng, t, ROWS * COLS);
        let row_bytes = w.len() / ROWS;
        let x = rng.normals(COLS);
        let mut a = vec![0u8; f.act.row_bytes(COLS)];
        f.act.quantize_row(&x, &mut a);
        group.throughput(Throughput::Bytes(w.len() as u64));
        for isa in Isa::supported() {
            let Some(dot) = simd_dot(isa, t) else {
                continue;
            };
            group.bench_function(BenchmarkId::new(t.to_string(), isa.name()), |b| {
                b.iter(|| {
                    w.chunks_exact(row_bytes)
                        .map(|r| dot(COLS, r, &a))
                        .sum::<f32>()
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, matvec, gemm32, dot_per_isa);
criterion_main!(benches);
