//! 32-element formats (Q4_0 … Q8_0 and IQ4_NL) against Q8_0 activations: one block per 256-bit
//! register (AVX-512VL), in the shared loop of `crate::x86::blocks32`. Byte products go straight
//! to i32 with `vpdpbusd` (no i16 stage, so nothing can saturate); the fifth bits of Q5 and the
//! signs of Q8_0 and IQ4_NL are applied under byte masks. (MXFP4 runs the AVX2 kernel of
//! `crate::x86::mxfp4` at this level.)
//!
//! Packed nibbles become `[low | high]` per block, the element order of the Q8_0 block, with a
//! 128-bit broadcast and a masked shift. Signed weights get their sign moved onto the activation
//! (Q8_0 activations never hold -128, so the negation is exact); Q4_0's offset is removed as
//! `8·Σy`, Q4_1/Q5_1's min multiplies `Σy`.
//!
//! Two blocks per 512-bit register measured 15–30% slower on Zen 4: assembling the register
//! from two blocks and broadcasting two scales into its halves costs more than the width saves.

use std::arch::x86_64::*;

use gguf::GgmlType;

use crate::blocks::*;
use crate::formats::iq_grids::KVALUES_IQ4NL;
use crate::x86::blocks32::{f16x8, sum_blocks};
use crate::x86::dot_wrapper;
use crate::x86::simd256::{bcast_f16, load128_of, load256_of};

dot_wrapper!(pub dot_q4_0 => dot_q4_0_impl, GgmlType::Q4_0, GgmlType::Q8_0);
dot_wrapper!(pub dot_q4_1 => dot_q4_1_impl, GgmlType::Q4_1, GgmlType::Q8_0);
dot_wrapper!(pub dot_q5_0 => dot_q5_0_impl, GgmlType::Q5_0, GgmlType::Q8_0);
dot_wrapper!(pub dot_q5_1 => dot_q5_1_impl, GgmlType::Q5_1, GgmlType::Q8_0);
dot_wrapper!(pub dot_q8_0 => dot_q8_0_impl, GgmlType::Q8_0, GgmlType::Q8_0);
dot_wrapper!(pub dot_iq4_nl => dot_iq4_nl_impl, GgmlType::Iq4Nl, GgmlType::Q8_0);

/// 16 bytes of packed nibbles as 32 bytes: the low nibbles, then the high nibbles.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn nibbles(qs: &[u8; 16], m4: __m256i) -> __m256i {
    let q = _mm256_broadcastsi128_si256(load128_of(qs));
    // Shift the high 128-bit lane (16-bit lanes 8..16).
    _mm256_and_si256(_mm256_mask_srli_epi16::<4>(q, 0xFF00, q), m4)
}

/// `Σ q·y` (even lanes) and `Σ y` (odd lanes) over one block, for unsigned quants `q`: scaled
/// by `[d·dy, m·dy, ...]` in one FMA.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2")]
fn dot_and_sum(q: __m256i, y: __m256i, k1: __m256i) -> __m256i {
    let qy = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, y);
    let sy = _mm256_dpbusd_epi32(_mm256_setzero_si256(), k1, y);
    _mm256_add_epi32(_mm256_unpacklo_epi32(qy, sy), _mm256_unpackhi_epi32(qy, sy))
}

/// `Σ |x|·(±y)` over one block: `mag` unsigned magnitudes, `neg` the negative lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2")]
fn signed_dot(mag: __m256i, neg: __mmask32, y: __m256i) -> __m256i {
    let zero = _mm256_setzero_si256();
    _mm256_dpbusd_epi32(zero, mag, _mm256_mask_sub_epi8(y, neg, zero, y))
}

/// `[d·dy, m·dy]` repeated, from the adjacent f16 pair `d, m` at `dm` and the f16 `dy`.
///
/// # Safety
/// `dm..dm + 4` is readable: the pair, through a pointer to the whole block (not to `d` alone).
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn scale_and_min(dm: *const u8, dy: &[u8; 2]) -> __m256 {
    // SAFETY: the caller's contract; `read_unaligned` has no alignment requirement.
    let dm = _mm256_cvtph_ps(_mm_set1_epi32(unsafe {
        (dm as *const i32).read_unaligned()
    }));
    _mm256_mul_ps(dm, bcast_f16(dy))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn dot_q4_0_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let m4 = _mm256_set1_epi8(0x0F);
    let k8 = _mm256_set1_epi8(8);
    let zero = _mm256_setzero_si256();
    sum_blocks!(BlockQ4_0, n, w, a,
        scales8: |xs, ys| {
            let d = _mm256_mul_ps(f16x8(xs, |b| b.d), f16x8(ys, |b| b.d));
            (d, d)
        },
        scales1: |x, y| _mm256_mul_ps(bcast_f16(&x.d), bcast_f16(&y.d)),
        body: |x, y| {
            let (q, y) = (nibbles(&x.qs, m4), load256_of(&y.qs));
            _mm256_sub_epi32(_mm256_dpbusd_epi32(zero, q, y), _mm256_dpbusd_epi32(zero, k8, y))
        },
    )
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn dot_q4_1_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let m4 = _mm256_set1_epi8(0x0F);
    let k1 = _mm256_set1_epi8(1);
    sum_blocks!(BlockQ4_1, n, w, a,
        scales8: |xs, ys| {
            let dy = f16x8(ys, |b| b.d);
            (_mm256_mul_ps(f16x8(xs, |b| b.d), dy), _mm256_mul_ps(f16x8(xs, |b| b.m), dy))
        },
        // SAFETY: `d` and `m` are the first 4 bytes of the block `x`, reached through a pointer
        // to the whole block.
        scales1: |x, y| unsafe { scale_and_min(x as *const BlockQ4_1 as *const u8, &y.d) },
        body: |x, y| dot_and_sum(nibbles(&x.qs, m4), load256_of(&y.qs), k1),
    )
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn dot_q5_0_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let m4 = _mm256_set1_epi8(0x0F);
    let k16 = _mm256_set1_epi8(16);
    sum_blocks!(BlockQ5_0, n, w, a,
        scales8: |xs, ys| {
            let d = _mm256_mul_ps(f16x8(xs, |b| b.d), f16x8(ys, |b| b.d));
            (d, d)
        },
        scales1: |x, y| _mm256_mul_ps(bcast_f16(&x.d), bcast_f16(&y.d)),
        body: |x, y| {
            let q = nibbles(&x.qs, m4);
            // A weight is q - 16 where its fifth bit (bit j of qh for element j) is clear:
            // negative, magnitude 16 - q. Where the bit is set it is q.
            let neg = _cvtu32_mask32(!u32::from_le_bytes(x.qh));
            signed_dot(_mm256_mask_sub_epi8(q, neg, k16, q), neg, load256_of(&y.qs))
        },
    )
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn dot_q5_1_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let m4 = _mm256_set1_epi8(0x0F);
    let k1 = _mm256_set1_epi8(1);
    let k16 = _mm256_set1_epi8(16);
    sum_blocks!(BlockQ5_1, n, w, a,
        scales8: |xs, ys| {
            let dy = f16x8(ys, |b| b.d);
            (_mm256_mul_ps(f16x8(xs, |b| b.d), dy), _mm256_mul_ps(f16x8(xs, |b| b.m), dy))
        },
        // SAFETY: `d` and `m` are the first 4 bytes of the block `x`, reached through a pointer
        // to the whole block.
        scales1: |x, y| unsafe { scale_and_min(x as *const BlockQ5_1 as *const u8, &y.d) },
        body: |x, y| {
            let q = nibbles(&x.qs, m4);
            let q = _mm256_mask_add_epi8(q, _cvtu32_mask32(u32::from_le_bytes(x.qh)), q, k16);
            dot_and_sum(q, load256_of(&y.qs), k1)
        },
    )
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn dot_q8_0_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    sum_blocks!(BlockQ8_0, n, w, a,
        scales8: |xs, ys| {
            let d = _mm256_mul_ps(f16x8(xs, |b| b.d), f16x8(ys, |b| b.d));
            (d, d)
        },
        scales1: |x, y| _mm256_mul_ps(bcast_f16(&x.d), bcast_f16(&y.d)),
        body: |x, y| {
            // |x| read as unsigned is exact even for -128.
            let x = load256_of(&x.qs);
            signed_dot(_mm256_abs_epi8(x), _mm256_movepi8_mask(x), load256_of(&y.qs))
        },
    )
}

/// IQ4_NL: Q4_0's nibbles mapped through the 16 levels with one `vpshufb`, then Q8_0's signed
/// product.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn dot_iq4_nl_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let m4 = _mm256_set1_epi8(0x0F);
    let levels = _mm256_broadcastsi128_si256(load128_of(&KVALUES_IQ4NL));
    sum_blocks!(BlockIq4Nl, n, w, a,
        scales8: |xs, ys| {
            let d = _mm256_mul_ps(f16x8(xs, |b| b.d), f16x8(ys, |b| b.d));
            (d, d)
        },
        scales1: |x, y| _mm256_mul_ps(bcast_f16(&x.d), bcast_f16(&y.d)),
        body: |x, y| {
            let v = _mm256_shuffle_epi8(levels, nibbles(&x.qs, m4));
            signed_dot(_mm256_abs_epi8(v), _mm256_movepi8_mask(v), load256_of(&y.qs))
        },
    )
}
