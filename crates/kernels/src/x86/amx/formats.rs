//! What each K-quant contributes to the tiles: its two int8 planes of scale·q per 64 elements,
//! its scales, and its float step (the scalar reference's).

use std::arch::x86_64::*;

use crate::blocks::{BlockQ4K, BlockQ6K};
use crate::x86::scales::unpack_k4;

/// A K-quant whose superblocks the tiles can take: each weight times its sub-block scale fits
/// in 13 bits, split as `128·hi + lo` into two int8 planes, so that one tile product per plane
/// over the superblock gives the exact Σ scale·q·a of the format's dot.
pub trait TileFormat {
    type Block: Copy;
    /// Whether the format subtracts `dmin·Σ min·bsum` (Q4_K) or not (Q6_K).
    const MINS: bool;
    /// The (lo, hi) planes of elements 64c..64c + 64 of the superblock, one byte each, given
    /// the block's [`Unpacked`] scales.
    ///
    /// # Safety
    /// The CPU has the `Isa::Avx512` features (as for `step`).
    unsafe fn planes(x: &Self::Block, c: usize, u: &Unpacked) -> (__m512i, __m512i);
    /// The block's scales and scalars.
    ///
    /// # Safety
    /// As for `planes`.
    unsafe fn unpack(x: &Self::Block) -> Unpacked;
    /// The format's float step: `acc` plus this superblock, one token per lane of `isum` /
    /// `msum` and one weight row's `d`, `dmin` in `d`, `dmin` … per lane, `dy` the token's scale.
    ///
    /// # Safety
    /// The CPU has the `Isa::Avx512` features.
    unsafe fn step(
        acc: __m512,
        dy: __m512,
        d: __m512,
        dmin: __m512,
        isum: __m512i,
        msum: __m512i,
    ) -> __m512;
}

/// What packing a superblock needs besides its quants: the sub-block scales (8 for Q4_K, 16 for
/// Q6_K), `d`, `dmin` (0 without mins) and the mins as (min_2p, min_2p+1) 16-bit pairs.
pub struct Unpacked {
    scales: [i16; 16],
    pub d: f32,
    pub dmin: f32,
    pub min_pairs: [i32; 4],
}

/// Q4_K: scale·q = 6-bit scale × 4-bit quant ≤ 945; float step as `formats::kquants::dot_q4_k`:
/// `acc + ((dy·d)·isum − (dy·dmin)·msum)`.
pub enum Q4K {}

impl TileFormat for Q4K {
    type Block = BlockQ4K;
    const MINS: bool = true;

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    unsafe fn planes(x: &BlockQ4K, c: usize, u: &Unpacked) -> (__m512i, __m512i) {
        let (sc_lo, sc_hi) = (u.scales[2 * c], u.scales[2 * c + 1]);
        let m4 = _mm256_set1_epi8(0x0F);
        // SAFETY: bytes 32c..32c + 32 of the 128 in `qs` (c < 4).
        let q = unsafe { _mm256_loadu_si256(x.qs.as_ptr().add(32 * c) as *const __m256i) };
        // Elements 64c..64c + 32 are the low nibbles (sub-block 2c), the next 32 the high ones.
        let first = _mm512_mullo_epi16(
            _mm512_cvtepu8_epi16(_mm256_and_si256(q, m4)),
            _mm512_set1_epi16(sc_lo),
        );
        let second = _mm512_mullo_epi16(
            _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16::<4>(q), m4)),
            _mm512_set1_epi16(sc_hi),
        );
        split_planes(first, second)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack(x: &BlockQ4K) -> Unpacked {
        // SAFETY: the block's first 16 bytes (d, dmin and the 12 packed scale bytes).
        let v = unpack_k4(unsafe { _mm_loadu_si128(x as *const BlockQ4K as *const __m128i) });
        let mut b = [0u8; 16];
        // SAFETY: the store writes the 16 bytes of `b`.
        unsafe { _mm_storeu_si128(b.as_mut_ptr() as *mut __m128i, v) };
        let mins: [i32; 8] = std::array::from_fn(|j| b[8 + j] as i32);
        Unpacked {
            scales: std::array::from_fn(|j| if j < 8 { b[j] as i16 } else { 0 }),
            d: half::f16::from_le_bytes(x.d).to_f32(),
            dmin: half::f16::from_le_bytes(x.dmin).to_f32(),
            min_pairs: std::array::from_fn(|p| mins[2 * p] | (mins[2 * p + 1] << 16)),
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    unsafe fn step(
        acc: __m512,
        dy: __m512,
        d: __m512,
        dmin: __m512,
        isum: __m512i,
        msum: __m512i,
    ) -> __m512 {
        let scaled = _mm512_mul_ps(_mm512_mul_ps(dy, d), _mm512_cvtepi32_ps(isum));
        let mins = _mm512_mul_ps(_mm512_mul_ps(dy, dmin), _mm512_cvtepi32_ps(msum));
        _mm512_add_ps(acc, _mm512_sub_ps(scaled, mins))
    }
}

/// Q6_K: scale·(q − 32) = signed 8-bit scale × 6-bit quant, |·| ≤ 4096; float step as
/// `formats::kquants::dot_q6_k` (and the AVX-512 dot): `acc + (d·dy)·isum`.
pub enum Q6K {}

impl TileFormat for Q6K {
    type Block = BlockQ6K;
    const MINS: bool = false;

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    unsafe fn planes(x: &BlockQ6K, c: usize, u: &Unpacked) -> (__m512i, __m512i) {
        // Chunk c is quarter pair (2(c % 2), 2(c % 2) + 1) of half c / 2; quarter k's 32
        // elements take scales 2k (first 16) and 2k + 1 of the half's eight.
        let (h, k0) = (c / 2, 2 * (c % 2));
        let (first, second) = crate::x86::kq256::q6k_quants(x, c);
        let k32 = _mm512_set1_epi16(32);
        let value = |q: __m256i, k: usize| {
            let q = _mm512_sub_epi16(_mm512_cvtepu8_epi16(q), k32);
            let s = |j: usize| u.scales[8 * h + 2 * k + j];
            let scale = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_set1_epi16(s(0))),
                _mm256_set1_epi16(s(1)),
            );
            _mm512_mullo_epi16(q, scale)
        };
        split_planes(value(first, k0), value(second, k0 + 1))
    }

    unsafe fn unpack(x: &BlockQ6K) -> Unpacked {
        Unpacked {
            scales: x.scales.map(i16::from),
            d: half::f16::from_le_bytes(x.d).to_f32(),
            dmin: 0.0,
            min_pairs: [0; 4],
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    unsafe fn step(
        acc: __m512,
        dy: __m512,
        d: __m512,
        _: __m512,
        isum: __m512i,
        _: __m512i,
    ) -> __m512 {
        _mm512_add_ps(
            acc,
            _mm512_mul_ps(_mm512_mul_ps(d, dy), _mm512_cvtepi32_ps(isum)),
        )
    }
}

/// 64 products (two registers of 32 i16, element order) as the planes `lo = v & 127` and
/// `hi = v >> 7` (arithmetic), 64 bytes each: `v = 128·hi + lo` exactly.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn split_planes(first: __m512i, second: __m512i) -> (__m512i, __m512i) {
    let k127 = _mm512_set1_epi16(127);
    let join = |a: __m512i, b: __m512i| {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm512_cvtepi16_epi8(a)),
            _mm512_cvtepi16_epi8(b),
        )
    };
    (
        join(
            _mm512_and_si512(first, k127),
            _mm512_and_si512(second, k127),
        ),
        join(
            _mm512_srai_epi16::<7>(first),
            _mm512_srai_epi16::<7>(second),
        ),
    )
}
