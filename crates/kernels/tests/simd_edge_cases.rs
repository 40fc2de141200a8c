//! Edge cases for the SIMD dot products that the random-block harness in `dot_products.rs` does
//! not reach: block counts that leave tails after the unrolled loops (its lengths are all
//! multiples of four legacy blocks), and extreme quants — every packed byte 0x00, 0xFF, 0x80,
//! ... against activations at ±127 — which would expose i16 saturation or a lost sign.

mod common;

use common::{COMPUTE_TYPES, Rng, random_row};
use gguf::GgmlType;
use kernels::blocks::f16_to_bytes;
use kernels::{ActKind, Isa, format, simd_dot};

/// Byte ranges `(start, end)` of a block of `t` that hold scales rather than packed quants
/// (kept from the random row so that the scales stay finite and small).
fn scale_fields(t: GgmlType) -> &'static [(usize, usize)] {
    use GgmlType as T;
    match t {
        T::Q4_0 | T::Q5_0 | T::Q8_0 => &[(0, 2)],
        T::Q4_1 | T::Q5_1 => &[(0, 4)],
        T::Q2K => &[(80, 84)],
        T::Q3K => &[(108, 110)],
        T::Q4K | T::Q5K => &[(0, 4)],
        T::Q6K => &[(208, 210)],
        T::Q8K => &[(0, 4), (260, 292)],
        T::Mxfp4 => &[(0, 1)],
        T::Iq4Nl | T::Iq4Xs | T::Iq2Xxs | T::Iq2Xs | T::Iq2S | T::Iq3Xxs | T::Iq3S | T::Iq1S => {
            &[(0, 2)]
        }
        // Its f16 scale is in the top nibbles of the scale words.
        T::Iq1M => &[(48, 56)],
        T::Tq1_0 => &[(52, 54)],
        T::Tq2_0 => &[(64, 66)],
        _ => &[],
    }
}

/// An activation pattern: quant of element i.
type ActPattern = (&'static str, fn(usize) -> i8);
/// Byte range of a block and the value to fill it with.
type Fill = (std::ops::Range<usize>, u8);

/// A weight row whose every quant byte is `fill`.
fn filled_row(rng: &mut Rng, t: GgmlType, n: usize, fill: u8) -> Vec<u8> {
    let mut row = random_row(rng, t, n);
    let ts = t.type_size();
    for block in row.chunks_exact_mut(ts) {
        let mut keep = vec![false; ts];
        for &(start, end) in scale_fields(t) {
            keep[start..end].iter_mut().for_each(|k| *k = true);
        }
        for (b, k) in block.iter_mut().zip(&keep) {
            if !k {
                *b = fill;
            }
        }
    }
    row
}

/// An activation row of `kind` with quants `q(i)` (|q| ≤ 127) and consistent sums.
fn act_row(kind: ActKind, n: usize, q: impl Fn(usize) -> i8) -> Vec<u8> {
    let mut out = Vec::with_capacity(kind.row_bytes(n));
    match kind {
        ActKind::Q8_0 => {
            for b in 0..n / 32 {
                out.extend_from_slice(&f16_to_bytes(0.01));
                out.extend((0..32).map(|i| q(32 * b + i) as u8));
            }
        }
        ActKind::Q8K => {
            for b in 0..n / 256 {
                out.extend_from_slice(&0.01f32.to_le_bytes());
                let qs: Vec<i8> = (0..256).map(|i| q(256 * b + i)).collect();
                out.extend(qs.iter().map(|&v| v as u8));
                for g in qs.chunks_exact(16) {
                    let s: i16 = g.iter().map(|&v| v as i16).sum();
                    out.extend_from_slice(&s.to_le_bytes());
                }
            }
        }
        ActKind::F32 => out.extend((0..n).flat_map(|i| (q(i) as f32 / 127.0).to_le_bytes())),
    }
    out
}

fn check(isa: Isa, t: GgmlType, n: usize, w: &[u8], a: &[u8], what: &str) {
    let f = format(t).unwrap();
    let simd = simd_dot(isa, t).unwrap();
    let mut w_deq = vec![0f32; n];
    (f.dequantize)(w, &mut w_deq);
    let mut a_deq = vec![0f32; n];
    (format(f.act.ggml_type()).unwrap().dequantize)(a, &mut a_deq);
    let mag: f64 = w_deq
        .iter()
        .zip(&a_deq)
        .map(|(x, y)| (*x as f64 * *y as f64).abs())
        .sum();
    let want = (f.dot_scalar)(n, w, a) as f64;
    let got = simd(n, w, a) as f64;
    let tol = 2e-6 * mag + 1e-6;
    assert!(
        (got - want).abs() <= tol,
        "{isa:?} {t} n={n} {what}: simd {got} vs scalar {want} (tol {tol})"
    );
}

fn simd_isas() -> Vec<Isa> {
    Isa::supported()
        .into_iter()
        .filter(|&i| i != Isa::Scalar)
        .collect()
}

#[test]
fn every_block_count_tail_matches_scalar() {
    let mut rng = Rng::new(3);
    for isa in simd_isas() {
        for t in COMPUTE_TYPES {
            if simd_dot(isa, t).is_none() {
                continue;
            }
            let act = format(t).unwrap().act;
            for blocks in 1..=9 {
                let n = blocks * t.block_size().max(32);
                let w = random_row(&mut rng, t, n);
                let mut x = rng.normals(n);
                x[0] *= 10.0;
                let mut a = vec![0u8; act.row_bytes(n)];
                act.quantize_row(&x, &mut a);
                check(isa, t, n, &w, &a, "random");
            }
        }
    }
}

#[test]
fn extreme_quants_do_not_saturate() {
    let mut rng = Rng::new(4);
    let fills = [0x00, 0xFF, 0x80, 0x7F, 0x55, 0xAA, 0x0F, 0xF0];
    for isa in simd_isas() {
        for t in COMPUTE_TYPES {
            let f = format(t).unwrap();
            if simd_dot(isa, t).is_none() || f.act == ActKind::F32 {
                continue;
            }
            let n = 7 * t.block_size();
            let patterns: [ActPattern; 4] = [
                ("+127", |_| 127),
                ("-127", |_| -127),
                ("alternating", |i| if i % 2 == 0 { 127 } else { -127 }),
                ("pairs", |i| if i % 4 < 2 { 127 } else { -127 }),
            ];
            for fill in fills {
                let w = filled_row(&mut rng, t, n, fill);
                for (name, p) in patterns {
                    let a = act_row(f.act, n, p);
                    check(isa, t, n, &w, &a, &format!("fill {fill:#04x}, acts {name}"));
                }
            }
        }
    }
}

/// Q3_K and Q6_K store quants with an offset (4 and 32). A block whose quants all equal the
/// offset is zero, so its dot product is exactly zero; a kernel that subtracts the offset's
/// contribution in other lanes than the products it cancels, and converts lanes to f32 before
/// reducing them, returns rounding noise of the size of the uncancelled products instead.
#[test]
fn offset_formats_with_zero_weights_give_zero() {
    let mut rng = Rng::new(5);
    let n = 5 * 256;
    // (type, byte range, fill): Q3_K hmask set and low bits 0 is 0; Q6_K 0x0 | 0b10 << 4 is 32.
    let cases: [(GgmlType, [Fill; 2]); 2] = [
        (GgmlType::Q3K, [(0..32, 0xFF), (32..96, 0x00)]),
        (GgmlType::Q6K, [(0..128, 0x00), (128..192, 0xAA)]),
    ];
    for isa in simd_isas() {
        for (t, fills) in &cases {
            let mut w = random_row(&mut rng, *t, n);
            for block in w.chunks_exact_mut(t.type_size()) {
                for (r, v) in fills {
                    block[r.clone()].iter_mut().for_each(|b| *b = *v);
                }
            }
            let a = act_row(ActKind::Q8K, n, |i| if i % 3 == 0 { -127 } else { 127 });
            assert_eq!((format(*t).unwrap().dot_scalar)(n, &w, &a), 0.0);
            // A level without its own dot for this format (AMX has tiles for batches only)
            // decodes with a lower level's, which that level's pass checks.
            let Some(dot) = simd_dot(isa, *t) else {
                continue;
            };
            let got = dot(n, &w, &a);
            assert_eq!(got, 0.0, "{isa:?} {t}");
        }
    }
}
