//! K-quant sub-block scale unpacking in SSE registers, shared by the AVX2 and AVX-512 kernels.
//!
//! The scalar decoders in `crate::blocks` take about twenty integer operations plus the moves
//! that build a vector from their result; these take seven to ten vector operations and leave
//! the scales where the kernels want them. Both only need AVX2 (`vpsrlvd`), so the AVX-512
//! kernels inline them too.

use std::arch::x86_64::*;

/// The eight 6-bit scales and eight 6-bit mins of a Q4_K/Q5_K block, from the block's first 16
/// bytes `v` (`d`, `dmin`, then the 12 packed bytes): bytes 0..8 are the scales, 8..16 the mins
/// (the order of [`crate::blocks::unpack_scales_mins_k4`]).
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn unpack_k4(v: __m128i) -> __m128i {
    // Dwords of v: [d|dmin, w0, w1, w2]. Scales 0..4 = w0 & 0x3f, mins 0..4 = w1 & 0x3f,
    // scales 4..8 = (w2 & 0x0f) | (w0 >> 6) << 4, mins 4..8 = (w2 >> 4 & 0x0f) | (w1 >> 6) << 4.
    let low = _mm_shuffle_epi32::<0b11_10_11_01>(v); // [w0, w2, w1, w2]
    let low = _mm_and_si128(
        _mm_srlv_epi32(low, _mm_set_epi32(4, 0, 0, 0)),
        _mm_set_epi32(0x0f0f_0f0f, 0x3f3f_3f3f, 0x0f0f_0f0f, 0x3f3f_3f3f),
    );
    // The top two bits of w0 and w1, moved to bits 4..6 of the same byte, in dwords 1 and 3.
    let high = _mm_shuffle_epi32::<0b10_00_01_00>(v); // [_, w0, _, w1]
    let high = _mm_and_si128(
        _mm_srli_epi32::<2>(high),
        _mm_set_epi32(0x3030_3030, 0, 0x3030_3030, 0),
    );
    _mm_or_si128(low, high)
}

/// The sixteen signed scales of a Q3_K block (bias of 32 removed), from the 16 bytes ending at
/// the block's end (`v` bytes 2..14 are the 12 packed scale bytes, 14..16 the `d`).
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn unpack_q3k(v: __m128i) -> __m128i {
    // Raw dwords a0 = bytes 0..4, a1 = 4..8, t = 8..12 of the packed scales. Scales 4i..4i+4
    // take the low nibbles (i = 0, 1) or high nibbles (i = 2, 3) of a0, a1, a0, a1 and bits
    // 2i..2i+2 of each byte of t as their bits 4..6.
    let a = _mm_shuffle_epi8(
        v,
        _mm_setr_epi8(2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5, 6, 7, 8, 9),
    );
    let a = _mm_and_si128(
        _mm_srlv_epi32(a, _mm_set_epi32(4, 4, 0, 0)),
        _mm_set1_epi8(0x0f),
    );
    let t = _mm_shuffle_epi8(
        v,
        _mm_setr_epi8(
            10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13,
        ),
    );
    let t = _mm_and_si128(
        _mm_srlv_epi32(t, _mm_set_epi32(6, 4, 2, 0)),
        _mm_set1_epi8(0x03),
    );
    let s = _mm_or_si128(a, _mm_slli_epi32::<4>(t));
    _mm_sub_epi8(s, _mm_set1_epi8(32))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::{q3k_scales, unpack_scales_mins_k4};

    fn bytes(v: __m128i) -> [u8; 16] {
        // SAFETY: `__m128i` and `[u8; 16]` have the same size, and every bit pattern is a valid
        // value of both.
        unsafe { std::mem::transmute(v) }
    }

    #[test]
    fn simd_scale_unpacking_matches_scalar() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..1000 {
            let mut raw = [0u8; 16];
            for b in raw.iter_mut() {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                *b = s as u8;
            }
            let v = crate::x86::simd256::load128_of(&raw);
            let k4: [u8; 12] = raw[4..16].try_into().unwrap();
            let want: Vec<u8> = unpack_scales_mins_k4(&k4)
                .iter()
                .flat_map(|w| w.to_le_bytes())
                .collect();
            // SAFETY: `unpack_k4` needs AVX2, which this CPU has (checked above).
            assert_eq!(bytes(unsafe { unpack_k4(v) }).to_vec(), want);
            let q3: [u8; 12] = raw[2..14].try_into().unwrap();
            let want: Vec<u8> = q3k_scales(&q3).iter().map(|&x| (x - 32) as u8).collect();
            // SAFETY: `unpack_q3k` needs AVX2, which this CPU has (checked above).
            assert_eq!(bytes(unsafe { unpack_q3k(v) }).to_vec(), want);
        }
    }
}
