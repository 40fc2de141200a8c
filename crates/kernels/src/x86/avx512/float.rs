//! F32, F16 and BF16 weights against f32 activations, 16 lanes at a time.

use std::arch::x86_64::*;

use gguf::GgmlType;

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
