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
        // Chunk c is quarter-pair (2(c % 2), 2(c % 2) + 1) of half c / 2: element l + 32k of the
        // half takes its low bits from ql[l] (k = 0, 2) or ql[l + 32] (k = 1, 3), low nibble for
        // k < 2, and bits 2k, 2k + 1 of qh[l]; scale 2k + l / 16 of the half's eight.
        let (h, k0) = (c / 2, 2 * (c % 2));
        let m4 = _mm256_set1_epi8(0x0F);
        let m3 = _mm256_set1_epi8(3);
        // SAFETY: bytes 64h..64h + 64 of the 128 in `ql` and 32h..32h + 32 of the 64 in `qh`.
        let (ql0, ql1, qh) = unsafe {
            (
                _mm256_loadu_si256(x.ql.as_ptr().add(64 * h) as *const __m256i),
                _mm256_loadu_si256(x.ql.as_ptr().add(64 * h + 32) as *const __m256i),
                _mm256_loadu_si256(x.qh.as_ptr().add(32 * h) as *const __m256i),
            )
        };
        let (low0, low1) = if k0 == 0 {
            (_mm256_and_si256(ql0, m4), _mm256_and_si256(ql1, m4))
        } else {
            (
                _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
            )
        };
        let (hb0, hb1) = if k0 == 0 {
            (
                _mm256_and_si256(qh, m3),
                _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m3),
            )
        } else {
            (
                _mm256_and_si256(_mm256_srli_epi16::<4>(qh), m3),
                _mm256_and_si256(_mm256_srli_epi16::<6>(qh), m3),
            )
        };
        let k32 = _mm512_set1_epi16(32);
        let value = |low: __m256i, high: __m256i, k: usize| {
            let q = _mm256_or_si256(low, _mm256_slli_epi16::<4>(high));
            let q = _mm512_sub_epi16(_mm512_cvtepu8_epi16(q), k32);
            let s = |j: usize| u.scales[8 * h + 2 * k + j];
            let scale = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_set1_epi16(s(0))),
                _mm256_set1_epi16(s(1)),
            );
            _mm512_mullo_epi16(q, scale)
        };
        split_planes(value(low0, hb0, k0), value(low1, hb1, k0 + 1))
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
