//! AVX-512 (F/BW/VL/DQ + VNNI) kernels: signed byte products with `vpdpbusd` (the weight's sign
//! moved onto the activation under a mask, or unsigned quants with the offset removed through
//! activation sums), 16-bit products scaled and accumulated with `vpdpwssd`, byte masks for
//! fifth bits and signs.
//!
//! Zen 4 runs a 512-bit operation as two 256-bit halves, so width itself gains nothing; what
//! gains is needing fewer instructions. Most quantized kernels here therefore work on 256-bit
//! registers with the AVX-512VL forms of VNNI and masks, which measured faster than assembling
//! 512-bit registers from two blocks or groups (see `legacy` and `kquants`); F32/F16/BF16 and
//! Q8_K, which need no assembly, use 512 bits.

mod float;
mod kquants;
mod legacy;
mod panels;

use std::arch::x86_64::*;

use gguf::GgmlType;

use crate::formats::DotFn;
use crate::panel::PanelFn;

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

/// The AVX-512 panel kernel for `dtype`, if there is one.
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
