//! K-quants against Q8_K activations: two 32-element groups per 512-bit register; byte products
//! pair-summed with `vpmaddubsw`, then scaled and accumulated in one `vpdpwssd`.

use std::arch::x86_64::*;

use gguf::GgmlType;

use super::{f16_to_f32, load2x256, load256, load512};
use crate::blocks::*;
use crate::x86::dot_wrapper;

dot_wrapper!(pub dot_q4_k => dot_q4_k_impl, GgmlType::Q4K, GgmlType::Q8K);
dot_wrapper!(pub dot_q6_k => dot_q6_k_impl, GgmlType::Q6K, GgmlType::Q8K);

/// 32 lanes of i16 in four runs of 8 taking source lanes `s, s+1, s+2, s+3`.
const fn quarters(s: i16) -> [i16; 32] {
    let mut out = [0i16; 32];
    let mut i = 0;
    while i < 32 {
        out[i] = s + (i / 8) as i16;
        i += 1;
    }
    out
}

static Q6K_SCALE_IDX: [[i16; 32]; 4] = [quarters(0), quarters(4), quarters(8), quarters(12)];

#[inline]
unsafe fn load_idx(idx: &[i16; 32]) -> __m512i {
    unsafe { _mm512_loadu_si512(idx.as_ptr() as *const __m512i) }
}

/// `vpshufb` controls that broadcast 16-bit scale `a` into the low 256 bits and scale `b` into
/// the high 256 bits of a register whose four 128-bit lanes each hold the eight scales.
const fn shuffle_halves(a: u8, b: u8) -> [u8; 64] {
    let mut out = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        let s = if i < 32 { a } else { b };
        out[i] = 2 * s + (i % 2) as u8;
        i += 1;
    }
    out
}

static Q4K_SCALE_SHUF: [[u8; 64]; 4] = [
    shuffle_halves(0, 2),
    shuffle_halves(1, 3),
    shuffle_halves(4, 6),
    shuffle_halves(5, 7),
];

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_q4_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = n / QK_K;
    let (w, a): (&[BlockQ4K], &[BlockQ8K]) = (bytemuck::cast_slice(w), bytemuck::cast_slice(a));
    let m4 = _mm512_set1_epi8(0x0F);
    let shuf = unsafe { Q4K_SCALE_SHUF.each_ref().map(|s| load512(s.as_ptr())) };
    let mut acc = _mm512_setzero_ps();
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

        let sc = _mm512_broadcast_i32x4(_mm256_castsi256_si128(mins_and_scales));
        let qs = x.qs.as_ptr();
        let q8 = y.qs.as_ptr() as *const u8;
        // Two accumulators so consecutive `vpdpwssd`s do not wait on each other.
        let mut sum_lo = _mm512_setzero_si512();
        let mut sum_hi = _mm512_setzero_si512();
        for half in 0..2 {
            // Bytes 64·half..64·half+64 hold groups 2·half and 2·half+1: low nibbles are
            // sub-blocks (4h, 4h+2), high nibbles (4h+1, 4h+3).
            let q4 = unsafe { load512(qs.add(64 * half)) };
            let lo = _mm512_and_si512(q4, m4);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q4), m4);
            let base = 128 * half;
            let (alo, ahi) = unsafe {
                (
                    load2x256(q8.add(base), q8.add(base + 64)),
                    load2x256(q8.add(base + 32), q8.add(base + 96)),
                )
            };
            let slo = _mm512_shuffle_epi8(sc, shuf[2 * half]);
            let shi = _mm512_shuffle_epi8(sc, shuf[2 * half + 1]);
            sum_lo = _mm512_dpwssd_epi32(sum_lo, _mm512_maddubs_epi16(lo, alo), slo);
            sum_hi = _mm512_dpwssd_epi32(sum_hi, _mm512_maddubs_epi16(hi, ahi), shi);
        }
        let sumi = _mm512_add_epi32(sum_lo, sum_hi);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sumi), acc);
    }
    let m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
    let m = _mm_add_ss(m, _mm_movehdup_ps(m));
    _mm512_reduce_add_ps(acc) + _mm_cvtss_f32(m)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_q6_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = n / QK_K;
    let (w, a): (&[BlockQ6K], &[BlockQ8K]) = (bytemuck::cast_slice(w), bytemuck::cast_slice(a));
    let m4 = _mm512_set1_epi8(0x0F);
    let m30 = _mm512_set1_epi8(0x30);
    // Per 256-bit half: shift the high bits of k0|k1 left by 4|2 and of k2|k3 right by 0|2.
    let shl = _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(2));
    let shr = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(2));
    let idx = unsafe { Q6K_SCALE_IDX.each_ref().map(|i| load_idx(i)) };
    let mut acc = _mm512_setzero_ps();
    for (x, y) in w[..nb].iter().zip(&a[..nb]) {
        let d = y.d() * f16_to_f32(x.d);
        let scales16 =
            _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(x.scales.as_ptr() as *const __m128i) });
        let bsums = unsafe { load256(y.bsums.as_ptr()) };
        // The quants are stored biased by 32: subtract 32·Σ scale·(sum of the 16 activations).
        let bias = _mm256_slli_epi32::<5>(_mm256_madd_epi16(scales16, bsums));
        let sc = _mm512_castsi256_si512(scales16);
        let q8 = y.qs.as_ptr() as *const u8;
        let mut sumi = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_castsi256_si512(bias));
        sumi = _mm512_maskz_mov_epi32(0x00FF, sumi);
        for half in 0..2 {
            let (ql, qh) = unsafe {
                (
                    load512(x.ql.as_ptr().add(64 * half)),
                    load256(x.qh.as_ptr().add(32 * half)),
                )
            };
            let qh = _mm512_broadcast_i64x4(qh);
            let k01 = _mm512_or_si512(
                _mm512_and_si512(ql, m4),
                _mm512_and_si512(_mm512_sllv_epi16(qh, shl), m30),
            );
            let k23 = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4),
                _mm512_and_si512(_mm512_srlv_epi16(qh, shr), m30),
            );
            let (a01, a23) = unsafe {
                (
                    load512(q8.add(128 * half)),
                    load512(q8.add(128 * half + 64)),
                )
            };
            let s01 = _mm512_permutexvar_epi16(idx[2 * half], sc);
            let s23 = _mm512_permutexvar_epi16(idx[2 * half + 1], sc);
            sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(k01, a01), s01);
            sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(k23, a23), s23);
        }
        acc = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sumi), acc);
    }
    _mm512_reduce_add_ps(acc)
}
