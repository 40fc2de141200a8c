//! F32, F16 and BF16 weights against f32 activations.

use std::arch::x86_64::*;

use gguf::GgmlType;

use crate::panel::Panel;
use crate::x86::dot_wrapper;
use crate::x86::simd256::hsum_ps;

dot_wrapper!(pub dot_f32 => dot_f32_impl, GgmlType::F32, GgmlType::F32);
dot_wrapper!(pub dot_f16 => dot_f16_impl, GgmlType::F16, GgmlType::F32);
dot_wrapper!(pub dot_bf16 => dot_bf16_impl, GgmlType::Bf16, GgmlType::F32);

/// Shared loop: `load(i)` yields 8 weights starting at element `i` as f32.
macro_rules! float_dot {
    ($n:ident, $w:ident, $a:ident, $load:expr, $tail:expr) => {{
        let a = $a.as_ptr() as *const f32;
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= $n {
            for (j, acc) in acc.iter_mut().enumerate() {
                let wv = $load(i + 8 * j);
                *acc = _mm256_fmadd_ps(wv, _mm256_loadu_ps(a.add(i + 8 * j)), *acc);
            }
            i += 32;
        }
        while i + 8 <= $n {
            acc[0] = _mm256_fmadd_ps($load(i), _mm256_loadu_ps(a.add(i)), acc[0]);
            i += 8;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut sum = hsum_ps(v);
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
/// supports AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f32_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let wp = w.as_ptr() as *const f32;
    // SAFETY: every load reads elements below `n` (the loops stop there) of `w` and `a`, which
    // hold `n` by the contract above; all loads are unaligned.
    unsafe {
        float_dot!(n, w, a, |i| _mm256_loadu_ps(wp.add(i)), |i| wp
            .add(i)
            .read_unaligned())
    }
}

/// `Σ w[i]·a[i]` over `n` f16 weights and f32 activations.
///
/// # Safety
/// `w` holds at least `n` f16 values and `a` at least `n` f32 (any alignment), and the CPU
/// supports AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f16_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let wp = w.as_ptr() as *const u16;
    // SAFETY: every load reads elements below `n` (the loops stop there) of `w` and `a`, which
    // hold `n` by the contract above; all loads are unaligned.
    unsafe {
        float_dot!(
            n,
            w,
            a,
            |i| _mm256_cvtph_ps(_mm_loadu_si128(wp.add(i) as *const __m128i)),
            |i| half::f16::from_bits(wp.add(i).read_unaligned()).to_f32()
        )
    }
}

/// `Σ w[i]·a[i]` over `n` bf16 weights and f32 activations.
///
/// # Safety
/// `w` holds at least `n` bf16 values and `a` at least `n` f32 (any alignment), and the CPU
/// supports AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_bf16_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let wp = w.as_ptr() as *const u16;
    // SAFETY: every load reads elements below `n` (the loops stop there) of `w` and `a`, which
    // hold `n` by the contract above; all loads are unaligned.
    unsafe {
        float_dot!(
            n,
            w,
            a,
            |i| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(wp.add(i) as *const __m128i)
            ))),
            |i| f32::from_bits((wp.add(i).read_unaligned() as u32) << 16)
        )
    }
}

use crate::x86::float_kinds::{BF16, F16, F32, scalar_w};

/// 8 weights of format `KIND` from element `i` of the row at `w`, as f32 (the dot's loads).
///
/// # Safety
/// Elements `i..i + 8` of the row are readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_w<const KIND: u8>(w: *const u8, i: usize) -> __m256 {
    // SAFETY: the caller's contract; the loads are unaligned.
    unsafe {
        match KIND {
            F32 => _mm256_loadu_ps((w as *const f32).add(i)),
            F16 => _mm256_cvtph_ps(_mm_loadu_si128((w as *const u16).add(i) as *const __m128i)),
            _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128((w as *const u16).add(i) as *const __m128i),
            ))),
        }
    }
}

/// One row × `T` tokens of a float panel (weights of format `KIND`): per token the dot's four
/// 8-lane accumulators over 32-element steps, its 8-element steps into the first, its
/// reduction and its scalar tail, so every value is the single-row dot's bits; each converted
/// weight vector serves the `T` tokens (sixteen registers leave room for one row).
///
/// # Safety
/// Row `r` and tokens `t0..t0 + T` lie inside the panel `p` (the [`crate::panel::PanelFn`]
/// contract), each row `p.k` weights of format `KIND` and each token `p.k` f32 values.
// The loops index the tokens' arrays with the same variables.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_tile<const KIND: u8, const T: usize>(p: &Panel, r: usize, t0: usize) {
    let n = p.k;
    // SAFETY: row r and tokens t0..t0 + T are inside the panel (the contract above); every
    // load below reads elements below `n`.
    unsafe {
        let w = p.w.add(r * p.w_stride);
        let a: [*const f32; T] =
            std::array::from_fn(|t| p.a.add((t0 + t) * p.a_stride) as *const f32);
        let mut acc = [[_mm256_setzero_ps(); 4]; T];
        let mut i = 0;
        while i + 32 <= n {
            for j in 0..4 {
                let wv = load_w::<KIND>(w, i + 8 * j);
                for t in 0..T {
                    acc[t][j] =
                        _mm256_fmadd_ps(wv, _mm256_loadu_ps(a[t].add(i + 8 * j)), acc[t][j]);
                }
            }
            i += 32;
        }
        while i + 8 <= n {
            let wv = load_w::<KIND>(w, i);
            for t in 0..T {
                acc[t][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(a[t].add(i)), acc[t][0]);
            }
            i += 8;
        }
        for t in 0..T {
            let c = &acc[t];
            let v = _mm256_add_ps(_mm256_add_ps(c[0], c[1]), _mm256_add_ps(c[2], c[3]));
            let mut sum = hsum_ps(v);
            for ii in i..n {
                sum += scalar_w::<KIND>(w, ii) * a[t].add(ii).read_unaligned();
            }
            *p.out.add((t0 + t) * p.out_stride + r) = sum;
        }
    }
}

/// A float panel of weights `KIND`: each row against tokens two at a time.
///
/// # Safety
/// The [`crate::panel::PanelFn`] contract, and the CPU supports AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_panel<const KIND: u8>(p: &Panel) {
    for r in 0..p.rows {
        let mut t0 = 0;
        while t0 < p.n {
            // SAFETY: row r < rows and tokens t0..t0 + 2 (or + 1) ≤ n lie inside the panel;
            // the contract is the caller's.
            unsafe {
                if p.n - t0 >= 2 {
                    float_tile::<KIND, 2>(p, r, t0);
                    t0 += 2;
                } else {
                    float_tile::<KIND, 1>(p, r, t0);
                    t0 += 1;
                }
            }
        }
    }
}

/// F32 weights against f32 activations (see [`float_panel`]).
///
/// # Safety
/// The [`crate::panel::PanelFn`] contract, and the CPU supports AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn panel_f32(p: &Panel) {
    // SAFETY: the caller's contract, which is `float_panel`'s.
    unsafe { float_panel::<F32>(p) }
}

/// F16 weights against f32 activations (see [`float_panel`]).
///
/// # Safety
/// The [`crate::panel::PanelFn`] contract, and the CPU supports AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn panel_f16(p: &Panel) {
    // SAFETY: the caller's contract, which is `float_panel`'s.
    unsafe { float_panel::<F16>(p) }
}

/// BF16 weights against f32 activations (see [`float_panel`]).
///
/// # Safety
/// The [`crate::panel::PanelFn`] contract, and the CPU supports AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn panel_bf16(p: &Panel) {
    // SAFETY: the caller's contract, which is `float_panel`'s.
    unsafe { float_panel::<BF16>(p) }
}
