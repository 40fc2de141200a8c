//! F32, F16 and BF16 weights against f32 activations.

use std::arch::x86_64::*;

use gguf::GgmlType;

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
