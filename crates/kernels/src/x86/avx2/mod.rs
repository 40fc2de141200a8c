//! AVX2 + FMA + F16C kernels (256-bit). One block of 32 or one K-quant group per register.
//!
//! f16 scales are converted from broadcast words (`vpbroadcastw` + `vcvtph2ps`): converting a
//! scalar with `_mm_cvtsi32_si128` compiles to `vpinsrw` into whatever register is free, often
//! the accumulator, which chains every block's conversion behind the previous block's FMA.

mod float;
mod kquants;
mod legacy;
mod panels;

use std::arch::x86_64::*;

use gguf::GgmlType;

use crate::formats::DotFn;
use crate::panel::PanelFn;

/// The AVX2 dot product for `dtype`, if there is one.
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

/// The AVX2 panel kernel for `dtype`, if there is one.
pub fn panel(dtype: GgmlType) -> Option<PanelFn> {
    use GgmlType as T;
    Some(match dtype {
        T::Q4K => panels::panel_q4_k,
        T::Q6K => panels::panel_q6_k,
        T::Q8_0 => panels::panel_q8_0,
        _ => return None,
    })
}

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// The sum of 8 lanes of i32.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s));
    _mm_cvtsi128_si32(s)
}

/// Sums of the 8 lanes of each of `v[0..N]` (N ≤ 8) in lanes 0..N (wrapping i32, so exact when
/// the sums fit), for tiles that reduce several rows' or tokens' integers at once.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn hsums<const N: usize>(v: &[__m256i; N]) -> __m256i {
    let z = _mm256_setzero_si256();
    let g = |i: usize| if i < N { v[i] } else { z };
    let h01 = _mm256_hadd_epi32(g(0), g(1));
    let h23 = _mm256_hadd_epi32(g(2), g(3));
    let h45 = _mm256_hadd_epi32(g(4), g(5));
    let h67 = _mm256_hadd_epi32(g(6), g(7));
    // [v0..v3 low-half sums | v0..v3 high-half sums], likewise v4..v7.
    let q0 = _mm256_hadd_epi32(h01, h23);
    let q1 = _mm256_hadd_epi32(h45, h67);
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(q0, q1),
        _mm256_permute2x128_si256::<0x31>(q0, q1),
    )
}

/// The first `N` lanes of `v`.
#[inline]
#[target_feature(enable = "avx")]
pub(crate) fn lanes<const N: usize>(v: __m256) -> [f32; N] {
    let mut l = [0f32; 8];
    // SAFETY: 8 floats.
    unsafe { _mm256_storeu_ps(l.as_mut_ptr(), v) };
    std::array::from_fn(|i| l[i])
}

/// The f16 at `p` as f32 (converted from a broadcast, which depends on no other register).
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn f16_scalar(p: *const u8) -> f32 {
    let v = _mm_set1_epi16(unsafe { (p as *const i16).read_unaligned() });
    _mm_cvtss_f32(_mm_cvtph_ps(v))
}

/// The f16 at `p` as f32 in all 8 lanes.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn bcast_f16(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_set1_epi16(unsafe {
        (p as *const i16).read_unaligned()
    }))
}

/// 32 signed bytes times 32 signed bytes, summed in pairs of pairs: 8 lanes of i32. `x` may hold
/// -128 (its magnitude is read as unsigned); `y` must not (its sign is flipped).
#[inline]
#[target_feature(enable = "avx2")]
fn mul_sum_i8_pairs(x: __m256i, y: __m256i, ones: __m256i) -> __m256i {
    let ax = _mm256_sign_epi8(x, x);
    let sy = _mm256_sign_epi8(y, x);
    _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), ones)
}

#[inline]
pub(crate) unsafe fn load256(p: *const u8) -> __m256i {
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

#[inline]
pub(crate) unsafe fn load128(p: *const u8) -> __m128i {
    unsafe { _mm_loadu_si128(p as *const __m128i) }
}
