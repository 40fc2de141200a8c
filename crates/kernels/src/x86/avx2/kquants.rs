//! K-quants against Q8_K activations: one 32-element group per 256-bit register, sub-block
//! scales applied with `madd` in 16-bit lanes, mins folded in through the activation sums.

use std::arch::x86_64::*;

use gguf::GgmlType;

use super::{f16_to_f32, hsum_ps, hsum_ps128, load256};
use crate::blocks::*;
use crate::x86::dot_wrapper;

dot_wrapper!(pub dot_q4_k => dot_q4_k_impl, GgmlType::Q4K, GgmlType::Q8K);
dot_wrapper!(pub dot_q6_k => dot_q6_k_impl, GgmlType::Q6K, GgmlType::Q8K);

/// Shuffle control that broadcasts 16-bit lane `j` of each 128-bit half.
#[inline]
#[target_feature(enable = "avx2")]
fn broadcast_i16_lane(j: i32) -> __m256i {
    _mm256_set1_epi16((((2 * j + 1) << 8) | (2 * j)) as i16)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = n / QK_K;
    let (w, a): (&[BlockQ4K], &[BlockQ8K]) = (bytemuck::cast_slice(w), bytemuck::cast_slice(a));
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm_setzero_ps();
    for (x, y) in w[..nb].iter().zip(&a[..nb]) {
        let d = y.d() * f16_to_f32(x.d);
        let dmin = -y.d() * f16_to_f32(x.dmin);
        let u = unpack_scales_mins_k4(&x.scales);
        let mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32(
            u[3] as i32,
            u[2] as i32,
            u[1] as i32,
            u[0] as i32,
        ));
        let bsums = unsafe { load256(y.bsums.as_ptr()) };
        let pair_sums = _mm_hadd_epi16(
            _mm256_castsi256_si128(bsums),
            _mm256_extracti128_si256::<1>(bsums),
        );
        let prod = _mm_madd_epi16(_mm256_extracti128_si256::<1>(mins_and_scales), pair_sums);
        acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m);

        let sc128 = _mm256_castsi256_si128(mins_and_scales);
        let scales = _mm256_set_m128i(sc128, sc128);
        let mut sumi = _mm256_setzero_si256();
        for g in 0..4 {
            let scale_l = _mm256_shuffle_epi8(scales, broadcast_i16_lane(2 * g as i32));
            let scale_h = _mm256_shuffle_epi8(scales, broadcast_i16_lane(2 * g as i32 + 1));
            let (q4, q8l, q8h) = unsafe {
                (
                    load256(x.qs.as_ptr().add(32 * g)),
                    load256(y.qs.as_ptr().add(64 * g) as *const u8),
                    load256(y.qs.as_ptr().add(64 * g + 32) as *const u8),
                )
            };
            let q4l = _mm256_and_si256(q4, m4);
            let q4h = _mm256_and_si256(_mm256_srli_epi16::<4>(q4), m4);
            let pl = _mm256_madd_epi16(_mm256_maddubs_epi16(q4l, q8l), scale_l);
            let ph = _mm256_madd_epi16(_mm256_maddubs_epi16(q4h, q8h), scale_h);
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_ps(acc) + hsum_ps128(acc_m)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q6_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = n / QK_K;
    let (w, a): (&[BlockQ6K], &[BlockQ8K]) = (bytemuck::cast_slice(w), bytemuck::cast_slice(a));
    let m4 = _mm256_set1_epi8(0x0F);
    let m30 = _mm256_set1_epi8(0x30);
    let mut acc = _mm256_setzero_ps();
    for (x, y) in w[..nb].iter().zip(&a[..nb]) {
        let d = y.d() * f16_to_f32(x.d);
        let scales8 = unsafe { _mm_loadu_si128(x.scales.as_ptr() as *const __m128i) };
        let scales16 = _mm256_cvtepi8_epi16(scales8);
        let bsums = unsafe { load256(y.bsums.as_ptr()) };
        // The quants are stored biased by 32: subtract 32·Σ scale·(sum of the 16 activations).
        let bias = _mm256_slli_epi32::<5>(_mm256_madd_epi16(scales16, bsums));
        let mut sumi = _mm256_setzero_si256();
        for half in 0..2 {
            let (ql0, ql1, qh) = unsafe {
                (
                    load256(x.ql.as_ptr().add(64 * half)),
                    load256(x.ql.as_ptr().add(64 * half + 32)),
                    load256(x.qh.as_ptr().add(32 * half)),
                )
            };
            let q = [
                _mm256_or_si256(
                    _mm256_and_si256(ql0, m4),
                    _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m30),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(ql1, m4),
                    _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m30),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                    _mm256_and_si256(qh, m30),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                    _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m30),
                ),
            ];
            for (k, qk) in q.into_iter().enumerate() {
                let q8 = unsafe { load256(y.qs.as_ptr().add(128 * half + 32 * k) as *const u8) };
                // Lanes 0..8 use scale 8·half + 2k, lanes 8..16 use the next one.
                let s = 8 * half + 2 * k;
                let pair = _mm_set_epi8(
                    s as i8 + 1,
                    s as i8 + 1,
                    s as i8 + 1,
                    s as i8 + 1,
                    s as i8 + 1,
                    s as i8 + 1,
                    s as i8 + 1,
                    s as i8 + 1,
                    s as i8,
                    s as i8,
                    s as i8,
                    s as i8,
                    s as i8,
                    s as i8,
                    s as i8,
                    s as i8,
                );
                let scale = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales8, pair));
                sumi =
                    _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(qk, q8), scale));
            }
        }
        sumi = _mm256_sub_epi32(sumi, bias);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_ps(acc)
}
