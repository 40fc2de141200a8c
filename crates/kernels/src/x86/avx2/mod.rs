//! AVX2 + FMA + F16C kernels (256-bit). One block of 32 or one K-quant group per register.

mod float;
mod kquants;
mod legacy;

use std::arch::x86_64::*;

use gguf::GgmlType;

use crate::formats::DotFn;

/// The AVX2 dot product for `dtype`, if there is one.
pub fn dot(dtype: GgmlType) -> Option<DotFn> {
    use GgmlType as T;
    Some(match dtype {
        T::F32 => float::dot_f32,
        T::F16 => float::dot_f16,
        T::Bf16 => float::dot_bf16,
        T::Q8_0 => legacy::dot_q8_0,
        T::Q4K => kquants::dot_q4_k,
        T::Q6K => kquants::dot_q6_k,
        _ => return None,
    })
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    hsum_ps128(s)
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum_ps128(s: __m128) -> f32 {
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn f16_to_f32(b: [u8; 2]) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(
        _mm_cvtsi32_si128(u16::from_le_bytes(b) as i32),
    ))
}

/// 32 signed bytes times 32 signed bytes, summed in pairs of pairs: 8 lanes of i32.
#[inline]
#[target_feature(enable = "avx2")]
fn mul_sum_i8_pairs(x: __m256i, y: __m256i) -> __m256i {
    let ax = _mm256_sign_epi8(x, x);
    let sy = _mm256_sign_epi8(y, x);
    _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
}

#[inline]
unsafe fn load256(p: *const u8) -> __m256i {
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}
