//! 32-element formats against Q8_0 activations: one block per 256-bit register.

use std::arch::x86_64::*;

use gguf::GgmlType;

use super::{f16_to_f32, hsum_ps, load256, mul_sum_i8_pairs};
use crate::blocks::*;
use crate::x86::dot_wrapper;

dot_wrapper!(pub dot_q8_0 => dot_q8_0_impl, GgmlType::Q8_0, GgmlType::Q8_0);

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q8_0_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = n / QK8_0;
    let (w, a): (&[BlockQ8_0], &[BlockQ8_0]) = (bytemuck::cast_slice(w), bytemuck::cast_slice(a));
    let mut acc = _mm256_setzero_ps();
    for (x, y) in w[..nb].iter().zip(&a[..nb]) {
        let d = _mm256_set1_ps(f16_to_f32(x.d) * f16_to_f32(y.d));
        let (qx, qy) = unsafe {
            (
                load256(x.qs.as_ptr() as *const u8),
                load256(y.qs.as_ptr() as *const u8),
            )
        };
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(mul_sum_i8_pairs(qx, qy)), acc);
    }
    hsum_ps(acc)
}
