//! Throughput of the dot-product kernels alone (no matmul, no thread pool): every row of an
//! L2-resident weight matrix against one activation row, per ISA. Ignored by default; run with
//!   cargo test --release -p kernels --test simd_bench -- --ignored --nocapture
//! Optional: `SIMD_BENCH_TYPES=q4_K,q6_K`, `SIMD_BENCH_COLS=2048`, `SIMD_BENCH_ROWS=768`.

mod common;

use std::hint::black_box;
use std::time::Instant;

use common::{COMPUTE_TYPES, Rng, random_row};
use gguf::GgmlType;
use kernels::{Isa, format, simd_dot};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

#[test]
#[ignore]
fn kernel_throughput() {
    let cols = env("SIMD_BENCH_COLS", 2048);
    let rows = env("SIMD_BENCH_ROWS", 768);
    let types: Vec<GgmlType> = match std::env::var("SIMD_BENCH_TYPES") {
        Ok(s) => s
            .split(',')
            .map(|n| GgmlType::from_name(n).expect("type name"))
            .collect(),
        Err(_) => COMPUTE_TYPES.to_vec(),
    };
    let mut rng = Rng::new(7);
    println!("| type | isa | ns/row | GB/s of weights |");
    println!("|---|---|---|---|");
    for t in types {
        let f = format(t).unwrap();
        let w = random_row(&mut rng, t, rows * cols);
        let rb = w.len() / rows;
        let x = rng.normals(cols);
        let mut a = vec![0u8; f.act.row_bytes(cols)];
        f.act.quantize_row(&x, &mut a);
        for isa in Isa::supported() {
            let Some(dot) = simd_dot(isa, t) else {
                continue;
            };
            let pass = || {
                let mut s = 0f32;
                for r in w.chunks_exact(rb) {
                    s += dot(cols, black_box(r), black_box(&a));
                }
                black_box(s);
            };
            pass();
            let once = Instant::now();
            pass();
            let reps = ((0.3 / once.elapsed().as_secs_f64()) as usize).clamp(3, 5000);
            let mut times: Vec<f64> = (0..reps)
                .map(|_| {
                    let t0 = Instant::now();
                    pass();
                    t0.elapsed().as_secs_f64()
                })
                .collect();
            times.sort_by(f64::total_cmp);
            let secs = times[times.len() / 2];
            println!(
                "| {t} | {} | {:.1} | {:.1} |",
                isa.name(),
                secs * 1e9 / rows as f64,
                w.len() as f64 / secs / 1e9
            );
        }
    }
}
