//! K-quants against Q8_K activations: the 256-bit loops of `crate::x86::kq256`, with the
//! sub-block scale applied by `vpmaddwd` and accumulated with `vpaddd`; Q8_K with the sign trick.

use std::arch::x86_64::*;

use gguf::GgmlType;

use super::mul_sum_i8_pairs;
use crate::blocks::*;
use crate::x86::dot_wrapper;
use crate::x86::kq256::{q2k_256, q3k_256, q5k_256, q6k_256};
use crate::x86::simd256::{hsum_ps, load256};

dot_wrapper!(pub dot_q2_k => dot_q2_k_impl, GgmlType::Q2K, GgmlType::Q8K);
dot_wrapper!(pub dot_q3_k => dot_q3_k_impl, GgmlType::Q3K, GgmlType::Q8K);
dot_wrapper!(pub dot_q4_k => dot_q4_k_impl, GgmlType::Q4K, GgmlType::Q8K);
dot_wrapper!(pub dot_q5_k => dot_q5_k_impl, GgmlType::Q5K, GgmlType::Q8K);
dot_wrapper!(pub dot_q6_k => dot_q6_k_impl, GgmlType::Q6K, GgmlType::Q8K);
dot_wrapper!(pub dot_q8_k => dot_q8_k_impl, GgmlType::Q8K, GgmlType::Q8K);

/// `acc + Σ pairs p·scale`, 8 lanes.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn madd_acc(acc: __m256i, p: __m256i, scale: __m256i) -> __m256i {
    _mm256_add_epi32(acc, _mm256_madd_epi16(p, scale))
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q2_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    q2k_256!(n, w, a, madd_acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q3_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    q3k_256!(n, w, a, madd_acc)
}

// Q4_K in the octet arithmetic (`crate::x86::q4k_octets`), as at the AVX-512 level: the same
// bits there and here.
crate::x86::q4k_octets::q4k_octet_kernels!("avx2,fma,f16c", madd_acc);

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q5_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    q5k_256!(n, w, a, madd_acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q6_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    q6k_256!(n, w, a, madd_acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q8_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = n / QK_K;
    let (w, a): (&[BlockQ8K], &[BlockQ8K]) = (bytemuck::cast_slice(w), bytemuck::cast_slice(a));
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    for (x, y) in w[..nb].iter().zip(&a[..nb]) {
        let (xq, yq) = (x.qs.as_ptr() as *const u8, y.qs.as_ptr() as *const u8);
        let mut sum = [_mm256_setzero_si256(); 2];
        for k in 0..8 {
            // Weights may hold -128, activations (from our quantizer) never do.
            // SAFETY: bytes 32k..32k + 32 of the 256 in `x.qs` and in `y.qs` (k < 8).
            let p =
                unsafe { mul_sum_i8_pairs(load256(xq.add(32 * k)), load256(yq.add(32 * k)), ones) };
            sum[k % 2] = _mm256_add_epi32(sum[k % 2], p);
        }
        let d = _mm256_set1_ps(x.d() * y.d());
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_add_epi32(sum[0], sum[1])), acc);
    }
    hsum_ps(acc)
}
