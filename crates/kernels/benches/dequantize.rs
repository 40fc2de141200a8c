//! Dequantization throughput per format (elements per second), one thread:
//!   cargo bench -p kernels --bench dequantize [-- FILTER]

#[path = "../tests/common.rs"]
mod common;

use std::time::Duration;

use common::{COMPUTE_TYPES, Rng, random_row};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kernels::format;

/// 64 rows of 4096: 256 Ki elements, 0.1–1 MiB of blocks (L2-resident).
const ROWS: usize = 64;
const COLS: usize = 4096;

fn dequantize(c: &mut Criterion) {
    let mut group = c.benchmark_group("dequantize");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    let mut rng = Rng::new(1);
    for t in COMPUTE_TYPES {
        let f = format(t).unwrap();
        let data: Vec<u8> = (0..ROWS)
            .flat_map(|_| random_row(&mut rng, t, COLS))
            .collect();
        let mut out = vec![0f32; ROWS * COLS];
        group.throughput(Throughput::Elements((ROWS * COLS) as u64));
        group.bench_function(BenchmarkId::from_parameter(t), |b| {
            b.iter(|| (f.dequantize)(std::hint::black_box(&data), &mut out))
        });
    }
    group.finish();
}

criterion_group!(benches, dequantize);
criterion_main!(benches);
