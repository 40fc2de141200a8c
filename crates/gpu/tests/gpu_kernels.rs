//! The GPU's matrix products against the CPU kernels, format by format, on the same quantized
//! activations. Runs where a CUDA device opens; elsewhere each test prints why it was skipped.

use std::sync::Arc;

use gguf::GgmlType;
use kernels::{Input, Kernels, MatmulJob, Offload, ThreadPool, Weights};

#[path = "../../kernels/tests/common.rs"]
mod kernels_common;

fn device() -> Option<gpu::CudaOffload> {
    match gpu::open(0) {
        Ok(d) => {
            eprintln!("{}", d.info().map(|i| i.to_string()).unwrap_or_default());
            Some(d)
        }
        Err(e) => {
            // Only a missing device skips; a device whose kernels fail to build fails.
            assert!(matches!(e, gpu::GpuError::Unavailable(_)), "{e}");
            eprintln!("skipped (no GPU): {e}");
            None
        }
    }
}

/// Deterministic values in [-1, 1) with a few larger ones, as trained weights have.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let v = (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            if i % 97 == 0 { v * 6.0 } else { v }
        })
        .collect()
}

fn quantized(dtype: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let row_bytes = dtype.row_bytes(cols as u64).expect("whole blocks") as usize;
    let mut out = vec![0u8; rows * row_bytes];
    let Some(quantize) = kernels::format(dtype).and_then(|f| f.quantize) else {
        // The IQ formats come quantized: random quants with sane scales.
        let mut rng = kernels_common::Rng::new(seed);
        return kernels_common::random_row(&mut rng, dtype, rows * cols);
    };
    let src = values(rows * cols, seed);
    for (x, y) in src.chunks_exact(cols).zip(out.chunks_exact_mut(row_bytes)) {
        quantize(x, y);
    }
    out
}

/// Every format the CPU computes with that has a GPU kernel (all but the ternary ones).
fn formats() -> Vec<GgmlType> {
    let f: Vec<GgmlType> = kernels_common::COMPUTE_TYPES
        .into_iter()
        .filter(|&t| gpu::supports(t))
        .collect();
    assert_eq!(f.len(), 23, "{f:?}");
    f
}

fn close(gpu: &[f32], cpu: &[f32], what: &str) {
    let scale = cpu.iter().fold(1f32, |m, v| m.max(v.abs()));
    let d = gpu
        .iter()
        .zip(cpu)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    eprintln!("{what}: max |gpu − cpu| = {d:.2e} (largest |value| {scale:.2})");
    assert!(
        d <= 2e-5 * scale,
        "{what}: GPU and CPU differ by {d} (scale {scale})"
    );
}

#[test]
fn every_format_matches_the_cpu_kernels() {
    let Some(mut dev) = device() else { return };
    let pool = ThreadPool::new(1);
    let cpu = Kernels::default();
    // 1 280 columns: 40 segments, so lanes loop; 37 rows: a partial block of rows (of 4 rows on
    // the dp4a path, of 64 on the tensor cores, which take the K-quants from 16 tokens: 20 is
    // one partial tile of 32 tokens, 33 a full one and one token, 70 two and a partial).
    let (rows, cols) = (37, 1280);
    let mut mats = Vec::new();
    for (i, dtype) in formats().into_iter().enumerate() {
        let bytes = Arc::new(quantized(dtype, rows, cols, i as u64 + 1));
        dev.upload(bytes.clone(), &bytes).expect("upload");
        mats.push((dtype, bytes));
    }
    for n in [1usize, 3, 8, 9, 20, 33, 70] {
        let x = values(n * cols, 100 + n as u64);
        let input = Input::new(&x, n, cols).unwrap();
        for (dtype, bytes) in &mats {
            let w = Weights::new(*dtype, rows, cols, bytes).unwrap();
            assert!(dev.holds(&w), "{dtype}");
            let mut want = vec![0f32; n * rows];
            cpu.matmul(&pool, &w, &input, &mut want).unwrap();
            let act = kernels::format(*dtype).unwrap().act;
            let mut got = vec![0f32; n * rows];
            dev.matmul_batch(&mut [MatmulJob {
                w,
                acts: input.quantized(act, &pool),
                n,
                out: &mut got,
            }])
            .unwrap();
            close(&got, &want, &format!("{dtype}, {n} tokens"));
        }
    }
}

/// One launch for several jobs of different formats, token counts, and row and column slices
/// (a tensor-parallel head split reads a column slice).
#[test]
fn a_batch_of_mixed_jobs_matches_the_cpu() {
    let Some(mut dev) = device() else { return };
    let pool = ThreadPool::new(1);
    let cpu = Kernels::default();
    let (rows, cols) = (64, 1024);
    let q4 = Arc::new(quantized(GgmlType::Q4K, rows, cols, 7));
    let q6 = Arc::new(quantized(GgmlType::Q6K, rows, cols, 8));
    let q8 = Arc::new(quantized(GgmlType::Q8_0, rows, cols, 9));
    for b in [&q4, &q6, &q8] {
        dev.upload(b.clone(), b).unwrap();
    }
    let full4 = Weights::new(GgmlType::Q4K, rows, cols, &q4).unwrap();
    let jobs_w = [
        full4,
        Weights::new(GgmlType::Q6K, rows, cols, &q6)
            .unwrap()
            .rows_slice(5..29),
        Weights::new(GgmlType::Q8_0, rows, cols, &q8)
            .unwrap()
            .cols_slice(256..768)
            .unwrap(),
        full4.cols_slice(512..1024).unwrap(),
    ];
    // The Q6_K row slice (40 tokens) and the Q4_K column slice (17) run on the tensor cores,
    // the other two through dp4a, in the same table.
    let ns = [1usize, 40, 5, 17];
    let xs: Vec<Vec<f32>> = jobs_w
        .iter()
        .zip(ns)
        .enumerate()
        .map(|(i, (w, n))| values(n * w.cols, 50 + i as u64))
        .collect();
    let inputs: Vec<Input> = jobs_w
        .iter()
        .zip(ns)
        .zip(&xs)
        .map(|((w, n), x)| Input::new(x, n, w.cols).unwrap())
        .collect();
    let mut want: Vec<Vec<f32>> = Vec::new();
    for (w, input) in jobs_w.iter().zip(&inputs) {
        assert!(dev.holds(w));
        let mut o = vec![0f32; input.n() * w.rows];
        cpu.matmul(&pool, w, input, &mut o).unwrap();
        want.push(o);
    }
    let mut got: Vec<Vec<f32>> = want.iter().map(|o| vec![0f32; o.len()]).collect();
    let mut jobs: Vec<MatmulJob> = jobs_w
        .iter()
        .zip(&inputs)
        .zip(got.iter_mut())
        .map(|((w, input), out)| MatmulJob {
            w: *w,
            acts: input.quantized(kernels::format(w.dtype).unwrap().act, &pool),
            n: input.n(),
            out,
        })
        .collect();
    dev.matmul_batch(&mut jobs).unwrap();
    drop(jobs);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        close(g, w, &format!("job {i}"));
    }
}

#[test]
fn what_was_not_uploaded_is_not_held() {
    let Some(mut dev) = device() else { return };
    let (rows, cols) = (8, 256);
    let kept = Arc::new(quantized(GgmlType::Q4K, rows, cols, 1));
    let other = quantized(GgmlType::Q4K, rows, cols, 2);
    let tq2 = Arc::new(quantized(GgmlType::Tq2_0, rows, cols, 3));
    dev.upload(kept.clone(), &kept).unwrap();
    dev.upload(tq2.clone(), &tq2).unwrap();
    assert!(dev.holds(&Weights::new(GgmlType::Q4K, rows, cols, &kept).unwrap()));
    assert!(!dev.holds(&Weights::new(GgmlType::Q4K, rows, cols, &other).unwrap()));
    // Uploaded, but no GPU kernel for TQ2_0: the CPU computes it.
    assert!(!dev.holds(&Weights::new(GgmlType::Tq2_0, rows, cols, &tq2).unwrap()));
    assert!(
        dev.upload(kept.clone(), &kept[..100]).is_err(),
        "overlapping upload"
    );
}

/// Whole expert FFNs on the device (gate and up, SiLU·up quantized there, down, each token's
/// weighted sum) against the same steps on the CPU, for each activation form a down projection
/// can read; a token no expert serves gets zeros.
#[test]
fn fused_expert_ffn_matches_the_cpu_steps() {
    let Some(mut dev) = device() else { return };
    let pool = ThreadPool::new(1);
    let cpu = Kernels::default();
    let (d, width) = (512, 768);
    // Few rows: expert 0 serves tokens 0, 2, 3, 5, expert 1 serves 1, 2, 5, token 4 none. Many
    // rows: 80 tokens, expert 0 all but 7, expert 1 the odd ones.
    let few: (usize, Vec<Vec<u32>>) = (6, vec![vec![0, 2, 3, 5], vec![1, 2, 5]]);
    let many: (usize, Vec<Vec<u32>>) = (
        80,
        vec![
            (0..80).filter(|&t| t != 7).collect(),
            (0..80).filter(|t| t % 2 == 1 && *t != 7).collect(),
        ],
    );
    for (n_tokens, served) in [few, many] {
        let weights: Vec<Vec<f32>> = served
            .iter()
            .enumerate()
            .map(|(j, ts)| {
                ts.iter()
                    .map(|&t| 0.25 + 0.5 * ((t as usize + j) % 3) as f32)
                    .collect()
            })
            .collect();
        let silent = (0..n_tokens as u32)
            .find(|t| served.iter().all(|s| !s.contains(t)))
            .unwrap();
        for (i, down_type) in [GgmlType::Q6K, GgmlType::Q4K, GgmlType::Q8_0, GgmlType::F32]
            .into_iter()
            .enumerate()
        {
            let x = values(n_tokens * d, 99 + i as u64);
            let mut want = vec![0f32; n_tokens * d];
            let mut experts = Vec::new();
            for (j, tokens) in served.iter().enumerate() {
                let seed = 10 * (i * 2 + j) as u64;
                let mats = [
                    Arc::new(quantized(GgmlType::Q4K, width, d, seed + 1)),
                    Arc::new(quantized(GgmlType::Q4K, width, d, seed + 2)),
                    Arc::new(quantized(down_type, d, width, seed + 3)),
                ];
                for b in &mats {
                    dev.upload(b.clone(), b).unwrap();
                }
                let rows: Vec<f32> = tokens
                    .iter()
                    .flat_map(|&t| x[t as usize * d..(t as usize + 1) * d].to_vec())
                    .collect();
                experts.push((mats, rows));
            }
            let inputs: Vec<Input> = experts
                .iter()
                .zip(&served)
                .map(|((_, rows), tokens)| Input::new(rows, tokens.len(), d).unwrap())
                .collect();
            let mut jobs = Vec::new();
            for (j, ((mats, _), input)) in experts.iter().zip(&inputs).enumerate() {
                let n = served[j].len();
                let (gw, uw, dw) = (
                    Weights::new(GgmlType::Q4K, width, d, &mats[0]).unwrap(),
                    Weights::new(GgmlType::Q4K, width, d, &mats[1]).unwrap(),
                    Weights::new(down_type, d, width, &mats[2]).unwrap(),
                );
                let mut g = vec![0f32; n * width];
                let mut u = vec![0f32; n * width];
                cpu.matmul(&pool, &gw, input, &mut g).unwrap();
                cpu.matmul(&pool, &uw, input, &mut u).unwrap();
                for (gv, uv) in g.iter_mut().zip(&u) {
                    *gv = *gv / (1.0 + (-*gv).exp()) * uv;
                }
                let hidden = Input::new(&g, n, width).unwrap();
                let mut y = vec![0f32; n * d];
                cpu.matmul(&pool, &dw, &hidden, &mut y).unwrap();
                for (r, (&t, &w)) in served[j].iter().zip(&weights[j]).enumerate() {
                    for (o, v) in want[t as usize * d..(t as usize + 1) * d]
                        .iter_mut()
                        .zip(&y[r * d..(r + 1) * d])
                    {
                        *o += w * v;
                    }
                }
                jobs.push(kernels::ExpertFfnJob {
                    gate: gw,
                    up: uw,
                    down: dw,
                    acts: input.quantized(kernels::ActKind::Q8K, &pool),
                    n,
                    tokens: &served[j],
                    weights: &weights[j],
                });
            }
            let mut got = vec![f32::NAN; n_tokens * d];
            assert!(dev.expert_ffn(&jobs, &mut got).unwrap());
            let silent = silent as usize;
            assert!(
                got[silent * d..(silent + 1) * d].iter().all(|&v| v == 0.0),
                "token {silent} has no expert"
            );
            let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
            // Per token, the largest difference. The SiLU·up rows are quantized on each side
            // from gate/up sums taken in different orders, so a value within rounding of a
            // step boundary can take the neighbouring step: that moves only its token's row.
            // Such rows may be a few; every other row agrees to rounding.
            let per_token: Vec<f32> = got
                .chunks(d)
                .zip(want.chunks(d))
                .map(|(g, w)| {
                    g.iter()
                        .zip(w)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max)
                })
                .collect();
            let diff = per_token.iter().copied().fold(0f32, f32::max);
            let stepped = per_token.iter().filter(|&&e| e > 1e-5 * scale).count();
            eprintln!(
                "expert FFN + sum, down {down_type}: max |gpu − cpu| = {diff:.2e} (scale \
                 {scale:.1}); {stepped} of {n_tokens} tokens beyond 1e-5 of it"
            );
            assert!(
                diff <= 5e-3 * scale && stepped <= 1 + n_tokens / 20,
                "down {down_type}: {diff} (scale {scale}), {stepped} tokens beyond 1e-5"
            );
        }
    }
}
