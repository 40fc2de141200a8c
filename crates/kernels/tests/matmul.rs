//! Matrix × activations: every thread count and SIMD level gives the same result as a plain loop
//! of scalar dot products, for single tokens, batches, row slices and column slices.

mod common;

use common::{Rng, random_row};
use gguf::GgmlType;
use kernels::{Input, Isa, Kernels, ThreadPool, Weights, format};

fn matrix(rng: &mut Rng, t: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    (0..rows).flat_map(|_| random_row(rng, t, cols)).collect()
}

fn reference(w: &Weights, x: &[f32], n: usize) -> Vec<f32> {
    let f = format(w.dtype).unwrap();
    let mut out = vec![0f32; n * w.rows];
    for t in 0..n {
        let mut a = vec![0u8; f.act.row_bytes(w.cols)];
        f.act.quantize_row(&x[t * w.cols..(t + 1) * w.cols], &mut a);
        for r in 0..w.rows {
            out[t * w.rows + r] = (f.dot_scalar)(w.cols, w.row(r), &a);
        }
    }
    out
}

fn close(a: &[f32], b: &[f32]) -> bool {
    a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-4 * (1.0 + y.abs()))
}

#[test]
fn matmul_matches_scalar_loop_for_every_isa_thread_count_and_slice() {
    let mut rng = Rng::new(7);
    for t in [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0, GgmlType::F16, GgmlType::Q4_0] {
        let (rows, cols) = (37, 1024);
        let data = matrix(&mut rng, t, rows, cols);
        let w = Weights::new(t, rows, cols, &data).unwrap();
        for n in [1, 3, 17] {
            let x = rng.normals(n * cols);
            let want = reference(&w, &x, n);
            for isa in Isa::supported() {
                for threads in [1, 2, 3] {
                    let pool = ThreadPool::new(threads);
                    let mut out = vec![0f32; n * rows];
                    Kernels::with_isa(isa).unwrap().matmul(&pool, &w, &Input::new(&x, n, cols).unwrap(), &mut out).unwrap();
                    assert!(close(&out, &want), "{t} n={n} {isa:?} threads={threads}");
                }
            }
            // Row and column slices behave like matrices of their own.
            let rs = w.rows_slice(5..20);
            let mut out = vec![0f32; n * rs.rows];
            Kernels::default().matmul(&ThreadPool::new(2), &rs, &Input::new(&x, n, cols).unwrap(), &mut out).unwrap();
            assert!(close(&out, &reference(&rs, &x, n)), "{t} rows slice");
            let cs = w.cols_slice(256..768).expect("block-aligned");
            let xs: Vec<f32> = (0..n).flat_map(|i| x[i * cols + 256..i * cols + 768].to_vec()).collect();
            let mut out = vec![0f32; n * rows];
            Kernels::default().matmul(&ThreadPool::new(2), &cs, &Input::new(&xs, n, 512).unwrap(), &mut out).unwrap();
            assert!(close(&out, &reference(&cs, &xs, n)), "{t} cols slice");
            // A column slice's rows are exactly the corresponding bytes of the full rows.
            let rb = t.row_bytes(256).unwrap() as usize;
            assert_eq!(cs.row(3), &w.row(3)[rb..rb + t.row_bytes(512).unwrap() as usize]);
        }
        assert!(w.cols_slice(100..300).is_none() || t.block_size() == 1);
    }
}
