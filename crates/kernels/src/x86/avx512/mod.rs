//! AVX-512 (F/BW/VL/DQ + VNNI) kernels (512-bit): two 32-element groups per register, 16-bit
//! products accumulated with `vpdpwssd` and signed byte products with `vpdpbusd`.

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
        T::Q8_0 => legacy::dot_q8_0,
        T::Q4K => kquants::dot_q4_k,
        T::Q6K => kquants::dot_q6_k,
        _ => return None,
    })
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn f16_to_f32(b: [u8; 2]) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(
        _mm_cvtsi32_si128(u16::from_le_bytes(b) as i32),
    ))
}

#[inline]
unsafe fn load512(p: *const u8) -> __m512i {
    unsafe { _mm512_loadu_si512(p as *const __m512i) }
}

#[inline]
unsafe fn load256(p: *const u8) -> __m256i {
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// `[lo | hi]` from two 32-byte loads.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load2x256(lo: *const u8, hi: *const u8) -> __m512i {
    unsafe { _mm512_inserti64x4::<1>(_mm512_castsi256_si512(load256(lo)), load256(hi)) }
}
