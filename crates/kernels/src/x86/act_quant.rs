//! Activation quantizers (Q8_K and Q8_0 blocks) in AVX2, with the scalar references' bits
//! (`formats::kquants::quantize_q8_k_reference`,
//! `formats::legacy::quantize_q8_0_activations_reference`).
//! Every matmul's input passes through one of them, and in decode they run on one thread between
//! the matmuls, so at many threads their scalar form costs as much as a small matmul.
//!
//! Both take the scale from the largest magnitude, NaNs ignored (`maxps` returns its second
//! operand when the first is NaN), and round with ties to even; what each does with products
//! that are not small integers is reproduced too (see `q8_k_bytes`, `q8_0_ints`).

use std::arch::x86_64::*;

use crate::blocks::{BlockQ8_0, BlockQ8K, f16_to_bytes};

/// The largest |v| of `n8` groups of eight floats at `p`, NaNs ignored (0 if none is larger).
///
/// # Safety
/// `p` points to `8 · n8` readable floats.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn max_magnitude(p: *const f32, n8: usize) -> f32 {
    let sign = _mm256_set1_ps(-0.0);
    let mut m = _mm256_setzero_ps();
    for i in 0..n8 {
        // SAFETY: group i is inside the 8 · n8 floats the caller vouches for.
        let v = unsafe { _mm256_loadu_ps(p.add(8 * i)) };
        // A NaN in the first operand yields the second: NaNs never enter the maximum.
        m = _mm256_max_ps(_mm256_andnot_ps(sign, v), m);
    }
    let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)))
}

/// The first of `8 · n8` floats at `p` whose magnitude is `amax`.
///
/// # Safety
/// `p` points to `8 · n8` readable floats, one of which has the magnitude `amax`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn first_of_magnitude(p: *const f32, n8: usize, amax: f32) -> f32 {
    let sign = _mm256_set1_ps(-0.0);
    let want = _mm256_set1_ps(amax);
    for i in 0..n8 {
        // SAFETY: group i is inside the 8 · n8 floats the caller vouches for.
        let v = unsafe { _mm256_loadu_ps(p.add(8 * i)) };
        let hits = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_andnot_ps(sign, v), want));
        if hits != 0 {
            // SAFETY: as above, an element of group i.
            return unsafe { *p.add(8 * i + hits.trailing_zeros() as usize) };
        }
    }
    amax
}

/// Q8_K's quants of eight floats, as the reference computes them: `nearest_int(scale · v)`
/// (ggml's magic-number rounding, ties to even), capped at 127 and truncated to a byte. For
/// products that are not small integers (an infinite scale, a NaN) the magic number gives the
/// reference's odd bytes, which rounding instructions would not.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn q8_k_bytes(v: __m256, scale: __m256) -> __m256i {
    let t = _mm256_add_ps(_mm256_mul_ps(scale, v), _mm256_set1_ps(12_582_912.0));
    let n = _mm256_sub_epi32(
        _mm256_and_si256(_mm256_castps_si256(t), _mm256_set1_epi32(0x007f_ffff)),
        _mm256_set1_epi32(0x0040_0000),
    );
    _mm256_and_si256(
        _mm256_min_epi32(n, _mm256_set1_epi32(127)),
        _mm256_set1_epi32(0xff),
    )
}

/// Q8_0's quants of eight floats: `round_ties_even(v · scale) as i8`, Rust's saturating cast
/// (NaN → 0, beyond the range → its end).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn q8_0_ints(v: __m256, scale: __m256) -> __m256i {
    let p = _mm256_mul_ps(v, scale);
    let p = _mm256_and_ps(p, _mm256_cmp_ps::<_CMP_ORD_Q>(p, p));
    let p = _mm256_min_ps(
        _mm256_max_ps(p, _mm256_set1_ps(-128.0)),
        _mm256_set1_ps(127.0),
    );
    _mm256_cvtps_epi32(p)
}

/// 32 integers (four vectors of eight, in order) as 32 bytes, in order: in [-128, 127] as
/// signed bytes, or with `UNSIGNED` in [0, 255] as unsigned ones.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn pack32<const UNSIGNED: bool>(a: __m256i, b: __m256i, c: __m256i, d: __m256i) -> __m256i {
    // The packs work per 128-bit lane; the permute puts the four-value groups back in order.
    let ab = _mm256_packs_epi32(a, b);
    let cd = _mm256_packs_epi32(c, d);
    let abcd = if UNSIGNED {
        _mm256_packus_epi16(ab, cd)
    } else {
        _mm256_packs_epi16(ab, cd)
    };
    _mm256_permutevar8x32_epi32(abcd, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// `quantize_q8_k_reference` of whole blocks of 256 values.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn quantize_q8_k(src: &[f32], dst: &mut [u8]) {
    let dst: &mut [BlockQ8K] = bytemuck::cast_slice_mut(dst);
    for (x, y) in src.chunks_exact(256).zip(dst) {
        // SAFETY: `x` holds 256 floats, 32 groups of eight.
        let amax = unsafe { max_magnitude(x.as_ptr(), 32) };
        if amax == 0.0 {
            *y = bytemuck::Zeroable::zeroed();
            continue;
        }
        // The reference keeps the first value of the largest magnitude, with its sign.
        // SAFETY: as for `max_magnitude`; `amax` is the magnitude of one of the values.
        let max = unsafe { first_of_magnitude(x.as_ptr(), 32, amax) };
        let iscale = -127.0 / max;
        let scale = _mm256_set1_ps(iscale);
        for (c, (chunk, out)) in x
            .chunks_exact(32)
            .zip(y.qs.chunks_exact_mut(32))
            .enumerate()
        {
            let q = |i: usize| {
                // SAFETY: `chunk` holds 32 floats; i ≤ 24.
                let v = unsafe { _mm256_loadu_ps(chunk.as_ptr().add(i)) };
                q8_k_bytes(v, scale)
            };
            let (a, b, cc, d) = (q(0), q(8), q(16), q(24));
            // SAFETY: `out` holds 32 bytes.
            unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), pack32::<true>(a, b, cc, d)) };
            // The sums of the two groups of 16, of the bytes read as signed.
            let signed = |v: __m256i| _mm256_srai_epi32::<24>(_mm256_slli_epi32::<24>(v));
            let g0 = _mm256_add_epi32(signed(a), signed(b));
            let g1 = _mm256_add_epi32(signed(cc), signed(d));
            let h = _mm256_hadd_epi32(g0, g1);
            let h = _mm256_hadd_epi32(h, h);
            let h = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
            let (s0, s1) = (_mm_cvtsi128_si32(h), _mm_extract_epi32::<1>(h));
            y.bsums[4 * c..4 * c + 2].copy_from_slice(&(s0 as i16).to_le_bytes());
            y.bsums[4 * c + 2..4 * c + 4].copy_from_slice(&(s1 as i16).to_le_bytes());
        }
        y.d = (1.0 / iscale).to_le_bytes();
    }
}

/// `quantize_q8_0_activations_reference` of whole blocks of 32 values.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn quantize_q8_0(src: &[f32], dst: &mut [u8]) {
    let dst: &mut [BlockQ8_0] = bytemuck::cast_slice_mut(dst);
    for (x, y) in src.chunks_exact(32).zip(dst) {
        // SAFETY: `x` holds 32 floats, four groups of eight.
        let amax = unsafe { max_magnitude(x.as_ptr(), 4) };
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        y.d = f16_to_bytes(d);
        let scale = _mm256_set1_ps(id);
        let q = |i: usize| {
            // SAFETY: `x` holds 32 floats; i ≤ 24.
            let v = unsafe { _mm256_loadu_ps(x.as_ptr().add(i)) };
            q8_0_ints(v, scale)
        };
        let bytes = pack32::<false>(q(0), q(8), q(16), q(24));
        // SAFETY: `qs` holds 32 bytes.
        unsafe { _mm256_storeu_si256(y.qs.as_mut_ptr().cast(), bytes) };
    }
}
