//! AVX-512 (F/BW/VL/DQ + VNNI) kernels (512-bit): two 32-element blocks or groups per register,
//! signed byte products with `vpdpbusd` (the weight's sign moved onto the activation, or the
//! weight kept unsigned and its offset removed through activation sums) and 16-bit products
//! scaled and accumulated with `vpdpwssd`.
//!
//! Zen 4 runs a 512-bit operation as two 256-bit halves, so the gain over AVX2 comes from
//! needing fewer instructions (masks, `vpdpbusd`/`vpdpwssd` fusing two steps, variable 16-bit
//! shifts), not from width. f16 scales are converted from broadcast words; see `super::avx2`
//! for why not from scalars.

mod float;
mod kquants;
mod legacy;

use std::arch::x86_64::*;

use gguf::GgmlType;

use crate::formats::DotFn;

/// The AVX-512 dot product for `dtype`, if there is one.
pub fn dot(dtype: GgmlType) -> Option<DotFn> {
    use GgmlType as T;
    Some(match dtype {
        T::F32 => float::dot_f32,
        T::F16 => float::dot_f16,
        T::Bf16 => float::dot_bf16,
        T::Q4_0 => legacy::dot_q4_0,
        T::Q4_1 => legacy::dot_q4_1,
        T::Q5_0 => legacy::dot_q5_0,
        T::Q5_1 => legacy::dot_q5_1,
        T::Q8_0 => legacy::dot_q8_0,
        T::Mxfp4 => legacy::dot_mxfp4,
        T::Q2K => kquants::dot_q2_k,
        T::Q3K => kquants::dot_q3_k,
        T::Q4K => kquants::dot_q4_k,
        T::Q5K => kquants::dot_q5_k,
        T::Q6K => kquants::dot_q6_k,
        T::Q8K => kquants::dot_q8_k,
        _ => return None,
    })
}

/// The f16 at `p0` as f32 in lanes 0..8 and the one at `p1` in lanes 8..16.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
unsafe fn f16_pair(p0: *const u8, p1: *const u8) -> __m512 {
    let (a, b) = unsafe {
        (
            (p0 as *const i16).read_unaligned(),
            (p1 as *const i16).read_unaligned(),
        )
    };
    _mm512_cvtph_ps(_mm256_set_m128i(_mm_set1_epi16(b), _mm_set1_epi16(a)))
}

/// The f16 at `p` as f32 (converted from a broadcast, which depends on no other register).
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16_scalar(p: *const u8) -> f32 {
    let v = _mm_set1_epi16(unsafe { (p as *const i16).read_unaligned() });
    _mm_cvtss_f32(_mm_cvtph_ps(v))
}

#[inline]
unsafe fn load512(p: *const u8) -> __m512i {
    unsafe { _mm512_loadu_si512(p as *const __m512i) }
}

#[inline]
unsafe fn load256(p: *const u8) -> __m256i {
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

#[inline]
unsafe fn load128(p: *const u8) -> __m128i {
    unsafe { _mm_loadu_si128(p as *const __m128i) }
}

/// `[lo | hi]` from two 32-byte loads.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load2x256(lo: *const u8, hi: *const u8) -> __m512i {
    unsafe { _mm512_inserti64x4::<1>(_mm512_castsi256_si512(load256(lo)), load256(hi)) }
}

/// 32 bytes at `p` in both halves.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn bcast256(p: *const u8) -> __m512i {
    _mm512_broadcast_i64x4(unsafe { load256(p) })
}
