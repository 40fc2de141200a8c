//! 32-element formats against Q8_0 activations: two blocks per 512-bit register, signed byte
//! products with `vpdpbusd` (the weight's sign moved onto the activation).

use std::arch::x86_64::*;

use gguf::GgmlType;

use super::{f16_to_f32, load2x256};
use crate::blocks::*;
use crate::x86::dot_wrapper;

dot_wrapper!(pub dot_q8_0 => dot_q8_0_impl, GgmlType::Q8_0, GgmlType::Q8_0);

/// Σ x·y over 64 signed bytes, as 16 lanes of i32 (4 products each).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn dot_i8(x: __m512i, y: __m512i) -> __m512i {
    let ax = _mm512_abs_epi8(x);
    let neg = _mm512_movepi8_mask(x);
    let sy = _mm512_mask_sub_epi8(y, neg, _mm512_setzero_si512(), y);
    _mm512_dpbusd_epi32(_mm512_setzero_si512(), ax, sy)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_q8_0_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = n / QK8_0;
    let (w, a): (&[BlockQ8_0], &[BlockQ8_0]) = (bytemuck::cast_slice(w), bytemuck::cast_slice(a));
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i + 2 <= nb {
        let (x0, x1, y0, y1) = (&w[i], &w[i + 1], &a[i], &a[i + 1]);
        let (qx, qy) = unsafe {
            (
                load2x256(x0.qs.as_ptr() as *const u8, x1.qs.as_ptr() as *const u8),
                load2x256(y0.qs.as_ptr() as *const u8, y1.qs.as_ptr() as *const u8),
            )
        };
        let d0 = _mm256_set1_ps(f16_to_f32(x0.d) * f16_to_f32(y0.d));
        let d1 = _mm256_set1_ps(f16_to_f32(x1.d) * f16_to_f32(y1.d));
        let d = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(d0), d1);
        acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(dot_i8(qx, qy)), acc);
        i += 2;
    }
    let mut sum = _mm512_reduce_add_ps(acc);
    if i < nb {
        sum += crate::formats::legacy::dot_q8_0(
            QK8_0,
            bytemuck::cast_slice(&w[i..i + 1]),
            bytemuck::cast_slice(&a[i..i + 1]),
        );
    }
    sum
}
