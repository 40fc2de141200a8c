//! Matrix × activations: every thread count and SIMD level gives the same result as a plain loop
//! of scalar dot products, for single tokens, batches, row slices and column slices; and the bits
//! of every value depend only on (weight row, activation row): not on the thread count, the
//! blocking into panels and tiles, or the other tokens of a batch.

mod common;

use common::{COMPUTE_TYPES, Rng, random_row};
use gguf::GgmlType;
use kernels::{Input, Isa, Kernels, MatmulJob, ThreadPool, Weights, format, simd_dot};

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
    a.iter()
        .zip(b)
        .all(|(x, y)| (x - y).abs() <= 1e-4 * (1.0 + y.abs()))
}

#[test]
fn matmul_matches_scalar_loop_for_every_isa_thread_count_and_slice() {
    let mut rng = Rng::new(7);
    for t in [
        GgmlType::Q4K,
        GgmlType::Q6K,
        GgmlType::Q8_0,
        GgmlType::F16,
        GgmlType::Q4_0,
    ] {
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
                    Kernels::with_isa(isa)
                        .unwrap()
                        .matmul(&pool, &w, &Input::new(&x, n, cols).unwrap(), &mut out)
                        .unwrap();
                    assert!(close(&out, &want), "{t} n={n} {isa:?} threads={threads}");
                }
            }
            // Row and column slices behave like matrices of their own.
            let rs = w.rows_slice(5..20);
            let mut out = vec![0f32; n * rs.rows];
            Kernels::default()
                .matmul(
                    &ThreadPool::new(2),
                    &rs,
                    &Input::new(&x, n, cols).unwrap(),
                    &mut out,
                )
                .unwrap();
            assert!(close(&out, &reference(&rs, &x, n)), "{t} rows slice");
            let cs = w.cols_slice(256..768).expect("block-aligned");
            let xs: Vec<f32> = (0..n)
                .flat_map(|i| x[i * cols + 256..i * cols + 768].to_vec())
                .collect();
            let mut out = vec![0f32; n * rows];
            Kernels::default()
                .matmul(
                    &ThreadPool::new(2),
                    &cs,
                    &Input::new(&xs, n, 512).unwrap(),
                    &mut out,
                )
                .unwrap();
            assert!(close(&out, &reference(&cs, &xs, n)), "{t} cols slice");
            // A column slice's rows are exactly the corresponding bytes of the full rows.
            let rb = t.row_bytes(256).unwrap() as usize;
            assert_eq!(
                cs.row(3),
                &w.row(3)[rb..rb + t.row_bytes(512).unwrap() as usize]
            );
        }
        assert!(w.cols_slice(100..300).is_none() || t.block_size() == 1);
    }
}

/// The formats of the MoE targets (and the panel kernels), plus one that has none.
const PANEL_TYPES: [GgmlType; 4] = [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0, GgmlType::Q4_0];

fn run(isa: Isa, threads: usize, w: &Weights, x: &[f32], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n * w.rows];
    Kernels::with_isa(isa)
        .unwrap()
        .matmul(
            &ThreadPool::new(threads),
            w,
            &Input::new(x, n, w.cols).unwrap(),
            &mut out,
        )
        .unwrap();
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Token counts around the tile sizes, row counts that are not multiples of the row tiles, every
/// ISA and 1–3 threads: within tolerance of the scalar loop, and bit-identical across threads.
#[test]
fn panels_match_scalar_and_do_not_depend_on_threads() {
    let mut rng = Rng::new(21);
    for t in PANEL_TYPES {
        for (rows, cols) in [(37, 512), (5, 1024), (130, 256)] {
            let data = matrix(&mut rng, t, rows, cols);
            let w = Weights::new(t, rows, cols, &data).unwrap();
            for n in [1, 2, 3, 5, 8, 17, 64] {
                let x = rng.normals(n * cols);
                let want = reference(&w, &x, n);
                for isa in Isa::supported() {
                    let one = run(isa, 1, &w, &x, n);
                    assert!(close(&one, &want), "{t} {rows}×{cols} n={n} {isa:?}");
                    for threads in [2, 3] {
                        let many = run(isa, threads, &w, &x, n);
                        assert_eq!(
                            bits(&many),
                            bits(&one),
                            "{t} {rows}×{cols} n={n} {isa:?} threads={threads}"
                        );
                    }
                }
            }
        }
    }
}

/// Batched decode of several sessions gives each session the bits it gets alone: every token of
/// a batch equals the same token computed with n = 1, and equals the single-row dot.
#[test]
fn a_token_in_a_batch_gets_the_bits_it_gets_alone() {
    let mut rng = Rng::new(22);
    for t in PANEL_TYPES {
        let (rows, cols) = (45, 768);
        let data = matrix(&mut rng, t, rows, cols);
        let w = Weights::new(t, rows, cols, &data).unwrap();
        let f = format(t).unwrap();
        for n in [2, 3, 8, 17, 64] {
            let x = rng.normals(n * cols);
            for isa in Isa::supported() {
                let batch = run(isa, 2, &w, &x, n);
                let dot = kernels::best_dot(isa, t).unwrap();
                for tok in [0, n / 2, n - 1] {
                    let alone = run(isa, 3, &w, &x[tok * cols..(tok + 1) * cols], 1);
                    assert_eq!(
                        bits(&alone),
                        bits(&batch[tok * rows..(tok + 1) * rows]),
                        "{t} {isa:?} n={n} token {tok}"
                    );
                    let mut a = vec![0u8; f.act.row_bytes(cols)];
                    f.act.quantize_row(&x[tok * cols..(tok + 1) * cols], &mut a);
                    for (r, v) in alone.iter().enumerate() {
                        assert_eq!(
                            dot(cols, w.row(r), &a).to_bits(),
                            v.to_bits(),
                            "{t} {isa:?} row {r}"
                        );
                    }
                }
            }
        }
    }
}

/// `matmul_batch` over several jobs (experts of different sizes and token counts) gives each
/// job the bits of its own `matmul`.
#[test]
fn batched_jobs_equal_separate_matmuls() {
    let mut rng = Rng::new(23);
    let shapes = [
        (GgmlType::Q4K, 64, 512, 3),
        (GgmlType::Q6K, 33, 256, 1),
        (GgmlType::Q4K, 17, 512, 9),
        (GgmlType::Q8_0, 40, 256, 5),
    ];
    let mats: Vec<Vec<u8>> = shapes
        .iter()
        .map(|&(t, r, c, _)| matrix(&mut rng, t, r, c))
        .collect();
    let xs: Vec<Vec<f32>> = shapes
        .iter()
        .map(|&(_, _, c, n)| rng.normals(n * c))
        .collect();
    for isa in Isa::supported() {
        let kernels = Kernels::with_isa(isa).unwrap();
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            let ws: Vec<Weights> = shapes
                .iter()
                .zip(&mats)
                .map(|(&(t, r, c, _), d)| Weights::new(t, r, c, d).unwrap())
                .collect();
            let inputs: Vec<Input> = shapes
                .iter()
                .zip(&xs)
                .map(|(&(_, _, c, n), x)| Input::new(x, n, c).unwrap())
                .collect();
            let mut outs: Vec<Vec<f32>> = shapes
                .iter()
                .map(|&(_, r, _, n)| vec![0f32; r * n])
                .collect();
            let mut jobs: Vec<MatmulJob> = ws
                .iter()
                .zip(&inputs)
                .zip(outs.iter_mut())
                .map(|((w, x), out)| MatmulJob {
                    w: *w,
                    acts: x.quantized(format(w.dtype).unwrap().act, &pool),
                    n: x.n(),
                    out,
                })
                .collect();
            kernels.matmul_batch(&pool, &mut jobs).unwrap();
            for (i, w) in ws.iter().enumerate() {
                let alone = run(isa, 1, w, &xs[i], shapes[i].3);
                assert_eq!(
                    bits(&outs[i]),
                    bits(&alone),
                    "{isa:?} threads={threads} job {i}"
                );
            }
        }
    }
}

/// `matmul_chunked` equals the definition: each chunk's dot (the ISA's single-row dot) in f32,
/// added in f64 in chunk order — bit for bit, for every thread count.
#[test]
fn chunked_matmul_is_the_f64_sum_of_chunk_dots() {
    let mut rng = Rng::new(24);
    for t in PANEL_TYPES {
        let (rows, cols) = (29, 1536);
        let data = matrix(&mut rng, t, rows, cols);
        let w = Weights::new(t, rows, cols, &data).unwrap();
        let f = format(t).unwrap();
        let unit = Kernels::reduction_chunk(t, 1).unwrap();
        // 1024 leaves a shorter last chunk.
        for chunk in [unit, 512, 1024, cols] {
            for n in [1, 3, 8, 17] {
                let x = rng.normals(n * cols);
                for isa in Isa::supported() {
                    let dot = kernels::best_dot(isa, t).unwrap();
                    let mut want = vec![0f64; n * rows];
                    for tok in 0..n {
                        let mut a = vec![0u8; f.act.row_bytes(cols)];
                        f.act.quantize_row(&x[tok * cols..(tok + 1) * cols], &mut a);
                        for r in 0..rows {
                            let mut acc = 0f64;
                            for c0 in (0..cols).step_by(chunk) {
                                let len = chunk.min(cols - c0);
                                let wo = t.row_bytes(c0 as u64).unwrap() as usize;
                                let wl = t.row_bytes(len as u64).unwrap() as usize;
                                let (ao, al) = (f.act.row_bytes(c0), f.act.row_bytes(len));
                                acc += dot(len, &w.row(r)[wo..wo + wl], &a[ao..ao + al]) as f64;
                            }
                            want[tok * rows + r] = acc;
                        }
                    }
                    for threads in [1, 2, 3] {
                        let mut out = vec![0f64; n * rows];
                        Kernels::with_isa(isa)
                            .unwrap()
                            .matmul_chunked(
                                &ThreadPool::new(threads),
                                &w,
                                &Input::new(&x, n, cols).unwrap(),
                                chunk,
                                &mut out,
                            )
                            .unwrap();
                        let got: Vec<u64> = out.iter().map(|v| v.to_bits()).collect();
                        let exp: Vec<u64> = want.iter().map(|v| v.to_bits()).collect();
                        assert_eq!(
                            got, exp,
                            "{t} chunk={chunk} n={n} {isa:?} threads={threads}"
                        );
                    }
                }
            }
        }
    }
}

/// The AVX2 and AVX-512 kernels of the K-quants and Q8_0 produce the same integer lanes and the
/// same float steps, so a mixed cluster (one node without AVX-512) still agrees bit for bit.
#[test]
fn avx2_and_avx512_agree_bitwise() {
    if !Isa::Avx512.is_supported() {
        eprintln!("no AVX-512 here; nothing to compare");
        return;
    }
    let mut rng = Rng::new(25);
    for t in [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0] {
        let (rows, cols) = (19, 1024);
        let data = matrix(&mut rng, t, rows, cols);
        let w = Weights::new(t, rows, cols, &data).unwrap();
        for n in [1, 5, 17] {
            let x = rng.normals(n * cols);
            assert_eq!(
                bits(&run(Isa::Avx2, 2, &w, &x, n)),
                bits(&run(Isa::Avx512, 2, &w, &x, n)),
                "{t} n={n}"
            );
        }
        let f = format(t).unwrap();
        let a: Vec<u8> = {
            let mut a = vec![0u8; f.act.row_bytes(cols)];
            f.act.quantize_row(&rng.normals(cols), &mut a);
            a
        };
        let (d2, d5) = (
            simd_dot(Isa::Avx2, t).unwrap(),
            simd_dot(Isa::Avx512, t).unwrap(),
        );
        for r in 0..rows {
            assert_eq!(
                d2(cols, w.row(r), &a).to_bits(),
                d5(cols, w.row(r), &a).to_bits(),
                "{t} dot row {r}"
            );
        }
    }
}

/// The NEON, dotprod and i8mm levels (the last through its `smmla` panels) give the same bits
/// for every quantized format — those of the scalar reference — so ARM nodes of different
/// generations in one cluster agree.
#[test]
fn neon_levels_agree_bitwise() {
    let levels: Vec<Isa> = [Isa::Neon, Isa::NeonDotprod, Isa::NeonI8mm]
        .into_iter()
        .filter(|i| i.is_supported())
        .collect();
    if levels.is_empty() {
        eprintln!("no NEON here; nothing to compare");
        return;
    }
    let mut rng = Rng::new(26);
    for t in COMPUTE_TYPES {
        if format(t).unwrap().act == kernels::ActKind::F32 {
            continue;
        }
        let (rows, cols) = (7, 512);
        let data = matrix(&mut rng, t, rows, cols);
        let w = Weights::new(t, rows, cols, &data).unwrap();
        for n in [1, 4, 5] {
            let x = rng.normals(n * cols);
            let want = bits(&run(Isa::Scalar, 1, &w, &x, n));
            for &isa in &levels {
                assert_eq!(bits(&run(isa, 2, &w, &x, n)), want, "{isa:?} {t} n={n}");
            }
        }
    }
}
