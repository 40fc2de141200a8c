//! Round trips through every reference quantizer: quantize → dequantize stays within a per-format
//! error bound, an all-zero row comes back as zeros, and quantizing is deterministic.
//! (Byte identity with ggml is checked separately, in `reference_vectors`.)

mod common;

use common::{COMPUTE_TYPES, IQ_TQ_TYPES, Rng};
use gguf::GgmlType;
use kernels::{Format, format};
use proptest::prelude::*;

/// Every format with a reference quantizer.
fn quantizable() -> Vec<Format> {
    COMPUTE_TYPES
        .iter()
        .filter_map(|&t| format(t))
        .filter(|f| f.quantize.is_some())
        .collect()
}

/// Quantizes `x` into a buffer prefilled with `fill` (a quantizer must not depend on what the
/// destination held), then dequantizes it.
fn round_trip(f: &Format, x: &[f32], fill: u8) -> (Vec<u8>, Vec<f32>) {
    let mut q = vec![fill; f.dtype.row_bytes(x.len() as u64).unwrap() as usize];
    (f.quantize.unwrap())(x, &mut q);
    let mut y = vec![0f32; x.len()];
    (f.dequantize)(&q, &mut y);
    (q, y)
}

/// RMS error of `y` against `x`, relative to the RMS of `x`.
fn relative_rmse(x: &[f32], y: &[f32]) -> f64 {
    let err: f64 = x
        .iter()
        .zip(y)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum();
    let norm: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
    (err / norm).sqrt()
}

/// A test row: roughly normal values times `scale`, plus `n_outliers` values 10–50× larger.
fn make_row(seed: u64, n: usize, scale: f32, n_outliers: usize) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let mut x: Vec<f32> = (0..n).map(|_| rng.normal() * scale).collect();
    for _ in 0..n_outliers {
        let i = (rng.next_u64() % n as u64) as usize;
        let sign = if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
        x[i] = sign * scale * (10.0 + 40.0 * rng.f32());
    }
    x
}

/// Row scales below `10^TINY` put the f16 block scales of Q8_0 and the K-quants (e.g. Q6_K's
/// `d ≈ max|x| / 4096`) into f16's subnormal range, where they lose precision; such rows get
/// their own, looser bounds.
const TINY: f32 = -2.5;

/// Upper bounds on the relative RMSE of a round trip: rows of normal values, the same with a few
/// outliers, and rows of any kind scaled below `10^TINY`.
struct Bound {
    plain: f64,
    outliers: f64,
    tiny: f64,
}

/// Measured worst cases (`measure_round_trip_error`, 40 000 rows a column) with about 30 %
/// margin; the means are in the comments. Outliers raise the error relative to the row's RMS
/// because the blocks holding them get a coarse step; Q2_K's group scales and mins have only
/// four bits, so there a single outlier can wreck the whole super-block.
fn error_bound(t: GgmlType) -> Bound {
    use GgmlType as T;
    let (plain, outliers, tiny) = match t {
        T::F32 => (0.0, 0.0, 0.0),
        T::F16 => (0.0005, 0.0006, 0.0007), // means 0.0002
        T::Bf16 => (0.003, 0.005, 0.005),   // means 0.0017
        T::Q4_0 => (0.14, 0.28, 0.27),      // means 0.085, 0.137, 0.098
        T::Q4_1 => (0.13, 0.26, 0.26),      // means 0.077, 0.109, 0.085
        T::Q5_0 => (0.075, 0.15, 0.15),     // means 0.042, 0.087, 0.053
        T::Q5_1 => (0.062, 0.12, 0.12),     // means 0.037, 0.052, 0.041
        T::Q8_0 => (0.009, 0.02, 0.02),     // means 0.0053, 0.011, 0.0075
        T::Q2K => (0.48, 1.1, 1.1),         // means 0.29, 0.22, 0.28
        T::Q3K => (0.24, 0.34, 0.32),       // means 0.149, 0.129, 0.144
        T::Q4K => (0.115, 0.19, 0.18),      // means 0.071, 0.097, 0.079
        T::Q5K => (0.058, 0.11, 0.14),      // means 0.036, 0.050, 0.042
        T::Q6K => (0.03, 0.06, 0.28),       // means 0.018, 0.032, 0.033
        T::Q8K => (0.014, 0.05, 0.05),      // means 0.0067, 0.027, 0.012
        T::Mxfp4 => (0.19, 0.34, 0.34),     // means 0.115, 0.166, 0.128
        _ => panic!("no error bound for {t}"),
    };
    Bound {
        plain,
        outliers,
        tiny,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn round_trip_error_is_bounded(
        seed in any::<u64>(),
        n_blocks in 1usize..=3,
        log_scale in -4.0f32..3.0,
        n_outliers in prop_oneof![3 => Just(0usize), 1 => 1usize..=6],
    ) {
        // 256 is a multiple of every block size.
        let x = make_row(seed, 256 * n_blocks, 10f32.powf(log_scale), n_outliers);
        for f in quantizable() {
            let (_, y) = round_trip(&f, &x, 0);
            let err = relative_rmse(&x, &y);
            let b = error_bound(f.dtype);
            let bound = if log_scale < TINY {
                b.tiny
            } else if n_outliers > 0 {
                b.outliers
            } else {
                b.plain
            };
            prop_assert!(
                err <= bound,
                "{}: relative RMSE {err:.4} > {bound} (scale 1e{log_scale:.2}, {n_outliers} outliers)",
                f.dtype
            );
        }
    }

    #[test]
    fn quantizing_is_deterministic(seed in any::<u64>(), log_scale in -4.0f32..3.0) {
        let x = make_row(seed, 512, 10f32.powf(log_scale), (seed % 3) as usize);
        for f in quantizable() {
            let (a, _) = round_trip(&f, &x, 0);
            let (b, _) = round_trip(&f, &x, 0xA5);
            prop_assert_eq!(a, b, "{}", f.dtype);
        }
    }
}

#[test]
fn all_zero_row_dequantizes_to_zeros() {
    let x = vec![0f32; 512];
    for f in quantizable() {
        let (_, y) = round_trip(&f, &x, 0xA5);
        assert!(y.iter().all(|&v| v == 0.0), "{}: {:?}", f.dtype, &y[..8]);
    }
}

#[test]
fn every_weight_format_has_a_quantizer() {
    // IQ and TQ weights come already quantized: their quantizers are search procedures over large
    // tables (most needing an importance matrix), not something the engine runs.
    for t in COMPUTE_TYPES
        .into_iter()
        .filter(|t| !IQ_TQ_TYPES.contains(t))
    {
        assert!(format(t).unwrap().quantize.is_some(), "{t}: no quantizer");
    }
}

/// Prints the mean and worst relative RMSE per format over random rows like the property
/// test's, per bound column (run with `--ignored --nocapture`). `error_bound` is set from this.
#[test]
#[ignore]
fn measure_round_trip_error() {
    let n = 40_000;
    let mut rng = Rng::new(42);
    println!("format | plain mean/worst | outliers mean/worst | tiny mean/worst");
    for f in quantizable() {
        let mut line = format!("{:>6}", f.dtype.to_string());
        for (lo, hi, outliers) in [
            (TINY, 3.0, Some(false)),
            (TINY, 3.0, Some(true)),
            (-4.0, TINY, None),
        ] {
            let (mut worst, mut sum) = (0f64, 0f64);
            for _ in 0..n {
                let seed = rng.next_u64();
                let n_blocks = 1 + (rng.next_u64() % 3) as usize;
                let log_scale = lo + (hi - lo) * rng.f32();
                let with = outliers.unwrap_or(rng.next_u64().is_multiple_of(4));
                let n_outliers = if with {
                    1 + (rng.next_u64() % 6) as usize
                } else {
                    0
                };
                let x = make_row(seed, 256 * n_blocks, 10f32.powf(log_scale), n_outliers);
                let (_, y) = round_trip(&f, &x, 0);
                let e = relative_rmse(&x, &y);
                worst = worst.max(e);
                sum += e;
            }
            line += &format!(" | {:.4} / {:.4}", sum / n as f64, worst);
        }
        println!("{line}");
    }
}
