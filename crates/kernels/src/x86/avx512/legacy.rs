//! 32-element formats against Q8_0 activations: two blocks per 512-bit register, byte products
//! with `vpdpbusd` (no i16 stage, so nothing can saturate).
//!
//! Packed nibbles become `[low | high]` per block, the element order of the Q8_0 block. Signed
//! weights get their sign moved onto the activation (Q8_0 activations never hold -128, so the
//! negation is exact); Q4_0's offset is removed as `8·Σy`, Q4_1/Q5_1's min multiplies `Σy`.
//! Block scales for both blocks are converted with one `vcvtph2ps` per operand.

use std::arch::x86_64::*;

use gguf::GgmlType;

use super::{f16_pair, load128, load2x256};
use crate::blocks::*;
use crate::formats::{legacy, mxfp4};
use crate::x86::{E8M0_HALF, KVALUES_MXFP4_ABS, dot_wrapper};

dot_wrapper!(pub dot_q4_0 => dot_q4_0_impl, GgmlType::Q4_0, GgmlType::Q8_0);
dot_wrapper!(pub dot_q4_1 => dot_q4_1_impl, GgmlType::Q4_1, GgmlType::Q8_0);
dot_wrapper!(pub dot_q5_0 => dot_q5_0_impl, GgmlType::Q5_0, GgmlType::Q8_0);
dot_wrapper!(pub dot_q5_1 => dot_q5_1_impl, GgmlType::Q5_1, GgmlType::Q8_0);
dot_wrapper!(pub dot_q8_0 => dot_q8_0_impl, GgmlType::Q8_0, GgmlType::Q8_0);
dot_wrapper!(pub dot_mxfp4 => dot_mxfp4_impl, GgmlType::Mxfp4, GgmlType::Q8_0);

/// Σ over pairs of blocks of `$body`, which yields `(i32 lanes, f32 scales)` for blocks `$x0`,
/// `$x1` (weights) and `$y0`, `$y1` (activations), lanes 0..8 belonging to the first block. Two
/// accumulators alternate; an odd last block goes to the scalar reference `$scalar`.
macro_rules! sum_block_pairs {
    ($wty:ty, $n:expr, $w:expr, $a:expr, $scalar:path,
     |$x0:ident, $x1:ident, $y0:ident, $y1:ident| $body:expr) => {{
        let nb = $n / 32;
        let w: &[$wty] = &bytemuck::cast_slice($w)[..nb];
        let a: &[BlockQ8_0] = &bytemuck::cast_slice($a)[..nb];
        let mut acc0 = _mm512_setzero_ps();
        let mut acc1 = _mm512_setzero_ps();
        for (xs, ys) in w.chunks_exact(4).zip(a.chunks_exact(4)) {
            let ($x0, $x1, $y0, $y1) = (&xs[0], &xs[1], &ys[0], &ys[1]);
            let (s, d): (__m512i, __m512) = $body;
            acc0 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s), acc0);
            let ($x0, $x1, $y0, $y1) = (&xs[2], &xs[3], &ys[2], &ys[3]);
            let (s, d): (__m512i, __m512) = $body;
            acc1 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s), acc1);
        }
        let mut i = nb - nb % 4;
        if i + 2 <= nb {
            let ($x0, $x1, $y0, $y1) = (&w[i], &w[i + 1], &a[i], &a[i + 1]);
            let (s, d): (__m512i, __m512) = $body;
            acc0 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s), acc0);
            i += 2;
        }
        let mut sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
        if i < nb {
            let (x, y) = (bytemuck::bytes_of(&w[i]), bytemuck::bytes_of(&a[i]));
            sum += $scalar(32, x, y);
        }
        sum
    }};
}

/// The nibbles of two 16-byte blocks as 64 bytes: `[low p0 | high p0 | low p1 | high p1]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
unsafe fn nibbles2(p0: *const u8, p1: *const u8, m4: __m512i) -> __m512i {
    let (a, b) = unsafe {
        (
            _mm256_broadcastsi128_si256(load128(p0)),
            _mm256_broadcastsi128_si256(load128(p1)),
        )
    };
    let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b);
    // Shift 128-bit lanes 1 and 3, i.e. 16-bit lanes 8..16 and 24..32.
    let z = _mm512_mask_srli_epi16::<4>(z, 0xFF00_FF00, z);
    _mm512_and_si512(z, m4)
}

/// The Q8_0 activations of two blocks.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn acts2(y0: &BlockQ8_0, y1: &BlockQ8_0) -> __m512i {
    unsafe { load2x256(y0.qs.as_ptr() as *const u8, y1.qs.as_ptr() as *const u8) }
}

/// The fifth bits of two Q5 blocks as a byte mask in the order of [`nibbles2`].
#[inline]
fn fifth_bits(qh0: &[u8; 4], qh1: &[u8; 4]) -> u64 {
    u32::from_le_bytes(*qh0) as u64 | (u32::from_le_bytes(*qh1) as u64) << 32
}

/// `Σ q·y` (even lanes) and `Σ y` (odd lanes) of unsigned quants, for scales `[d·dy, m·dy]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn dot_and_sum(q: __m512i, y: __m512i, k1: __m512i) -> __m512i {
    let qy = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, y);
    let sy = _mm512_dpbusd_epi32(_mm512_setzero_si512(), k1, y);
    _mm512_add_epi32(
        _mm512_unpacklo_epi32(qy, sy),
        _mm512_unpackhi_epi32(qy, sy),
    )
}

/// `[d·dy, m·dy]` repeated over lanes 0..8 for the first block and 8..16 for the second, from
/// the adjacent f16 pairs `d, m` and the activation scales.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
unsafe fn scale_and_min2(x0: *const u8, x1: *const u8, y0: &BlockQ8_0, y1: &BlockQ8_0) -> __m512 {
    let (a, b) = unsafe {
        (
            (x0 as *const i32).read_unaligned(),
            (x1 as *const i32).read_unaligned(),
        )
    };
    let dm = _mm512_cvtph_ps(_mm256_set_m128i(_mm_set1_epi32(b), _mm_set1_epi32(a)));
    _mm512_mul_ps(dm, unsafe { f16_pair(y0.d.as_ptr(), y1.d.as_ptr()) })
}

/// `dx·dy` of two blocks whose f16 scale is their first field.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
unsafe fn scale2(x0: *const u8, x1: *const u8, y0: &BlockQ8_0, y1: &BlockQ8_0) -> __m512 {
    unsafe { _mm512_mul_ps(f16_pair(x0, x1), f16_pair(y0.d.as_ptr(), y1.d.as_ptr())) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_q4_0_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let m4 = _mm512_set1_epi8(0x0F);
    let k8 = _mm512_set1_epi8(8);
    let zero = _mm512_setzero_si512();
    sum_block_pairs!(BlockQ4_0, n, w, a, legacy::dot_q4_0, |x0, x1, y0, y1| unsafe {
        let q = nibbles2(x0.qs.as_ptr(), x1.qs.as_ptr(), m4);
        let y = acts2(y0, y1);
        let s = _mm512_sub_epi32(
            _mm512_dpbusd_epi32(zero, q, y),
            _mm512_dpbusd_epi32(zero, k8, y),
        );
        (s, scale2(x0.d.as_ptr(), x1.d.as_ptr(), y0, y1))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_q4_1_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let m4 = _mm512_set1_epi8(0x0F);
    let k1 = _mm512_set1_epi8(1);
    sum_block_pairs!(BlockQ4_1, n, w, a, legacy::dot_q4_1, |x0, x1, y0, y1| unsafe {
        let q = nibbles2(x0.qs.as_ptr(), x1.qs.as_ptr(), m4);
        let s = dot_and_sum(q, acts2(y0, y1), k1);
        let (p0, p1) = (x0 as *const BlockQ4_1 as *const u8, x1 as *const BlockQ4_1 as *const u8);
        (s, scale_and_min2(p0, p1, y0, y1))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_q5_0_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let m4 = _mm512_set1_epi8(0x0F);
    let k16 = _mm512_set1_epi8(16);
    let zero = _mm512_setzero_si512();
    sum_block_pairs!(BlockQ5_0, n, w, a, legacy::dot_q5_0, |x0, x1, y0, y1| unsafe {
        let q = nibbles2(x0.qs.as_ptr(), x1.qs.as_ptr(), m4);
        // A weight is q - 16 where its fifth bit is clear (negative: magnitude 16 - q, sign
        // moved onto y) and q where it is set.
        let neg = _cvtu64_mask64(!fifth_bits(&x0.qh, &x1.qh));
        let mag = _mm512_mask_sub_epi8(q, neg, k16, q);
        let y = acts2(y0, y1);
        let y = _mm512_mask_sub_epi8(y, neg, zero, y);
        let s = _mm512_dpbusd_epi32(zero, mag, y);
        (s, scale2(x0.d.as_ptr(), x1.d.as_ptr(), y0, y1))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_q5_1_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let m4 = _mm512_set1_epi8(0x0F);
    let k1 = _mm512_set1_epi8(1);
    let k16 = _mm512_set1_epi8(16);
    sum_block_pairs!(BlockQ5_1, n, w, a, legacy::dot_q5_1, |x0, x1, y0, y1| unsafe {
        let q = nibbles2(x0.qs.as_ptr(), x1.qs.as_ptr(), m4);
        let high = _cvtu64_mask64(fifth_bits(&x0.qh, &x1.qh));
        let q = _mm512_mask_add_epi8(q, high, q, k16);
        let s = dot_and_sum(q, acts2(y0, y1), k1);
        let (p0, p1) = (x0 as *const BlockQ5_1 as *const u8, x1 as *const BlockQ5_1 as *const u8);
        (s, scale_and_min2(p0, p1, y0, y1))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_q8_0_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let zero = _mm512_setzero_si512();
    sum_block_pairs!(BlockQ8_0, n, w, a, legacy::dot_q8_0, |x0, x1, y0, y1| unsafe {
        let x = load2x256(x0.qs.as_ptr() as *const u8, x1.qs.as_ptr() as *const u8);
        // |x| read as unsigned is exact even for -128; the sign moves onto y.
        let neg = _mm512_movepi8_mask(x);
        let y = acts2(y0, y1);
        let y = _mm512_mask_sub_epi8(y, neg, zero, y);
        let s = _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(x), y);
        (s, scale2(x0.d.as_ptr(), x1.d.as_ptr(), y0, y1))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_mxfp4_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let m4 = _mm512_set1_epi8(0x0F);
    let k8 = _mm512_set1_epi8(8);
    let zero = _mm512_setzero_si512();
    // SAFETY (load): the table is 16 bytes.
    let table =
        _mm512_broadcast_i32x4(unsafe { load128(KVALUES_MXFP4_ABS.as_ptr() as *const u8) });
    sum_block_pairs!(BlockMxfp4, n, w, a, mxfp4::dot_mxfp4, |x0, x1, y0, y1| unsafe {
        let nib = nibbles2(x0.qs.as_ptr(), x1.qs.as_ptr(), m4);
        // E2M1 magnitude from the table, sign in nibble bit 3 (moved onto y).
        let mag = _mm512_shuffle_epi8(table, nib);
        let neg = _mm512_test_epi8_mask(nib, k8);
        let y = acts2(y0, y1);
        let y = _mm512_mask_sub_epi8(y, neg, zero, y);
        let s = _mm512_dpbusd_epi32(zero, mag, y);
        let e = _mm512_insertf32x8::<1>(
            _mm512_set1_ps(E8M0_HALF[x0.e as usize]),
            _mm256_set1_ps(E8M0_HALF[x1.e as usize]),
        );
        (s, _mm512_mul_ps(e, f16_pair(y0.d.as_ptr(), y1.d.as_ptr())))
    })
}
