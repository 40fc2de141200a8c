//! F32, F16 and BF16 weights against f32 activations, 16 lanes at a time.

use std::arch::x86_64::*;

use gguf::GgmlType;

use crate::panel::Panel;
use crate::x86::dot_wrapper;

dot_wrapper!(pub dot_f32 => dot_f32_impl, GgmlType::F32, GgmlType::F32);
dot_wrapper!(pub dot_f16 => dot_f16_impl, GgmlType::F16, GgmlType::F32);
dot_wrapper!(pub dot_bf16 => dot_bf16_impl, GgmlType::Bf16, GgmlType::F32);

macro_rules! float_dot {
    ($n:ident, $a:ident, $load:expr, $tail:expr) => {{
        let a = $a.as_ptr() as *const f32;
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i + 64 <= $n {
            for (j, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_fmadd_ps($load(i + 16 * j), _mm512_loadu_ps(a.add(i + 16 * j)), *acc);
            }
            i += 64;
        }
        while i + 16 <= $n {
            acc[0] = _mm512_fmadd_ps($load(i), _mm512_loadu_ps(a.add(i)), acc[0]);
            i += 16;
        }
        let v = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        let mut sum = _mm512_reduce_add_ps(v);
        while i < $n {
            sum += $tail(i) * a.add(i).read_unaligned();
            i += 1;
        }
        sum
    }};
}

/// `Σ w[i]·a[i]` over `n` f32 weights and f32 activations.
///
/// # Safety
/// `w` holds at least `n` f32 values and `a` at least `n` f32 (any alignment), and the CPU
/// supports AVX-512F/BW/VL/DQ, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn dot_f32_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let wp = w.as_ptr() as *const f32;
    // SAFETY: every load reads elements below `n` (the loops stop there) of `w` and `a`, which
    // hold `n` by the contract above; all loads are unaligned.
    unsafe {
        float_dot!(n, a, |i| _mm512_loadu_ps(wp.add(i)), |i| wp
            .add(i)
            .read_unaligned())
    }
}

/// `Σ w[i]·a[i]` over `n` f16 weights and f32 activations.
///
/// # Safety
/// `w` holds at least `n` f16 values and `a` at least `n` f32 (any alignment), and the CPU
/// supports AVX-512F/BW/VL/DQ, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn dot_f16_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let wp = w.as_ptr() as *const u16;
    // SAFETY: every load reads elements below `n` (the loops stop there) of `w` and `a`, which
    // hold `n` by the contract above; all loads are unaligned.
    unsafe {
        float_dot!(
            n,
            a,
            |i| _mm512_cvtph_ps(_mm256_loadu_si256(wp.add(i) as *const __m256i)),
            |i| half::f16::from_bits(wp.add(i).read_unaligned()).to_f32()
        )
    }
}

/// `Σ w[i]·a[i]` over `n` bf16 weights and f32 activations.
///
/// # Safety
/// `w` holds at least `n` bf16 values and `a` at least `n` f32 (any alignment), and the CPU
/// supports AVX-512F/BW/VL/DQ, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn dot_bf16_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let wp = w.as_ptr() as *const u16;
    // SAFETY: every load reads elements below `n` (the loops stop there) of `w` and `a`, which
    // hold `n` by the contract above; all loads are unaligned.
    unsafe {
        float_dot!(
            n,
            a,
            |i| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(wp.add(i) as *const __m256i)
            ))),
            |i| f32::from_bits((wp.add(i).read_unaligned() as u32) << 16)
        )
    }
}

use crate::x86::float_kinds::{BF16, F16, F32, scalar_w};

/// 16 weights of format `KIND` from element `i` of the row at `w`, as f32 (the dot's loads).
///
/// # Safety
/// Elements `i..i + 16` of the row are readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn load_w<const KIND: u8>(w: *const u8, i: usize) -> __m512 {
    // SAFETY: the caller's contract; the loads are unaligned.
    unsafe {
        match KIND {
            F32 => _mm512_loadu_ps((w as *const f32).add(i)),
            F16 => _mm512_cvtph_ps(_mm256_loadu_si256(
                (w as *const u16).add(i) as *const __m256i
            )),
            _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256((w as *const u16).add(i) as *const __m256i),
            ))),
        }
    }
}

/// One `R` rows × `T` tokens tile of a float panel (weights of format `KIND`): per (row, token)
/// the dot's four 16-lane accumulators over 64-element steps, its 16-element steps into the
/// first, its reduction and its scalar tail, so every value is the single-row dot's bits; each
/// converted weight vector serves `T` tokens and each activation vector `R` rows.
///
/// # Safety
/// As for [`panel_f16`], for rows `r0..r0 + R` and tokens `t0..t0 + T` of the panel.
// The loops index several arrays (rows, tokens, accumulators) with the same variables.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn float_tile<const KIND: u8, const R: usize, const T: usize>(
    p: &Panel,
    r0: usize,
    t0: usize,
) {
    let n = p.k;
    // SAFETY: rows r0..r0 + R and tokens t0..t0 + T are inside the panel (caller), each row
    // `n` weights and each token `n` f32 values; every load below reads elements below `n`.
    unsafe {
        let w: [*const u8; R] = std::array::from_fn(|r| p.w.add((r0 + r) * p.w_stride));
        let a: [*const f32; T] =
            std::array::from_fn(|t| p.a.add((t0 + t) * p.a_stride) as *const f32);
        let mut acc = [[[_mm512_setzero_ps(); 4]; T]; R];
        let mut i = 0;
        while i + 64 <= n {
            for j in 0..4 {
                let av: [__m512; T] =
                    std::array::from_fn(|t| _mm512_loadu_ps(a[t].add(i + 16 * j)));
                for r in 0..R {
                    let wv = load_w::<KIND>(w[r], i + 16 * j);
                    for t in 0..T {
                        acc[r][t][j] = _mm512_fmadd_ps(wv, av[t], acc[r][t][j]);
                    }
                }
            }
            i += 64;
        }
        while i + 16 <= n {
            for r in 0..R {
                let wv = load_w::<KIND>(w[r], i);
                for t in 0..T {
                    acc[r][t][0] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(a[t].add(i)), acc[r][t][0]);
                }
            }
            i += 16;
        }
        for r in 0..R {
            for t in 0..T {
                let c = &acc[r][t];
                let v = _mm512_add_ps(_mm512_add_ps(c[0], c[1]), _mm512_add_ps(c[2], c[3]));
                let mut sum = _mm512_reduce_add_ps(v);
                for ii in i..n {
                    sum += scalar_w::<KIND>(w[r], ii) * a[t].add(ii).read_unaligned();
                }
                *p.out.add((t0 + t) * p.out_stride + r0 + r) = sum;
            }
        }
    }
}

/// A float panel of weights `KIND`, tiles of 2 rows × 3 tokens (edges smaller).
///
/// # Safety
/// The [`PanelFn`] contract, and the CPU supports AVX-512F/BW/VL/DQ, AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn float_panel<const KIND: u8>(p: &Panel) {
    let mut r0 = 0;
    while r0 < p.rows {
        let rr = (p.rows - r0).min(2);
        let mut t0 = 0;
        while t0 < p.n {
            let tt = (p.n - t0).min(3);
            // SAFETY: the tile is inside the panel (rr ≤ rows - r0, tt ≤ n - t0); the contract
            // is the caller's.
            unsafe {
                match (rr, tt) {
                    (2, 3) => float_tile::<KIND, 2, 3>(p, r0, t0),
                    (2, 2) => float_tile::<KIND, 2, 2>(p, r0, t0),
                    (2, _) => float_tile::<KIND, 2, 1>(p, r0, t0),
                    (_, 3) => float_tile::<KIND, 1, 3>(p, r0, t0),
                    (_, 2) => float_tile::<KIND, 1, 2>(p, r0, t0),
                    _ => float_tile::<KIND, 1, 1>(p, r0, t0),
                }
            }
            t0 += tt;
        }
        r0 += rr;
    }
}

/// F16 weights against f32 activations (see [`float_panel`]).
///
/// # Safety
/// The [`PanelFn`] contract, and the CPU supports AVX-512F/BW/VL/DQ, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub unsafe fn panel_f16(p: &Panel) {
    // SAFETY: the caller's contract, which is `float_panel`'s.
    unsafe { float_panel::<F16>(p) }
}

/// BF16 weights against f32 activations (see [`float_panel`]).
///
/// # Safety
/// The [`PanelFn`] contract, and the CPU supports AVX-512F/BW/VL/DQ, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub unsafe fn panel_bf16(p: &Panel) {
    // SAFETY: the caller's contract, which is `float_panel`'s.
    unsafe { float_panel::<BF16>(p) }
}

/// F32 weights against f32 activations (see [`float_panel`]).
///
/// # Safety
/// The [`PanelFn`] contract, and the CPU supports AVX-512F/BW/VL/DQ, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub unsafe fn panel_f32(p: &Panel) {
    // SAFETY: the caller's contract, which is `float_panel`'s.
    unsafe { float_panel::<F32>(p) }
}
