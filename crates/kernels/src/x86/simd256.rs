//! The 256-bit helpers that every x86 kernel set uses: unaligned loads, f16 scales as f32,
//! horizontal sums and lane extraction. They need at most AVX2 + F16C, which both levels that
//! `crate::isa` hands out (`avx2` and `avx512`) include, so the AVX2 and AVX-512 kernels and the
//! loops they share (`kq256`, `blocks32`, `tiles`) take them from here rather than from each
//! other.
//!
//! f16 scales are converted from broadcast words (`vpbroadcastw` + `vcvtph2ps`): converting a
//! scalar with `_mm_cvtsi32_si128` compiles to `vpinsrw` into whatever register is free, often
//! the accumulator, which chains every block's conversion behind the previous block's FMA.
//!
//! Loads come in two forms: `load256_of`/`load128_of` read a whole value of exactly 32 or 16
//! bytes through a reference and are safe; `load256`/`load128` read through a raw pointer, for
//! a register's worth of bytes inside a larger field or block, and leave the bounds to the caller.

use std::arch::x86_64::*;

use bytemuck::Pod;

/// The sum of 8 lanes of f32.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// The sum of 8 lanes of i32.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s));
    _mm_cvtsi128_si32(s)
}

/// Sums of the 8 lanes of each of `v[0..N]` (N ≤ 8) in lanes 0..N (wrapping i32, so exact when
/// the sums fit), for tiles that reduce several rows' or tokens' integers at once.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn hsums<const N: usize>(v: &[__m256i; N]) -> __m256i {
    let z = _mm256_setzero_si256();
    let g = |i: usize| if i < N { v[i] } else { z };
    let h01 = _mm256_hadd_epi32(g(0), g(1));
    let h23 = _mm256_hadd_epi32(g(2), g(3));
    let h45 = _mm256_hadd_epi32(g(4), g(5));
    let h67 = _mm256_hadd_epi32(g(6), g(7));
    // [v0..v3 low-half sums | v0..v3 high-half sums], likewise v4..v7.
    let q0 = _mm256_hadd_epi32(h01, h23);
    let q1 = _mm256_hadd_epi32(h45, h67);
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(q0, q1),
        _mm256_permute2x128_si256::<0x31>(q0, q1),
    )
}

/// The first `N` lanes of `v`.
#[inline]
#[target_feature(enable = "avx")]
pub(crate) fn lanes<const N: usize>(v: __m256) -> [f32; N] {
    let mut l = [0f32; 8];
    // SAFETY: the store writes 8 f32, exactly the array `l`; AVX is enabled for this function.
    unsafe { _mm256_storeu_ps(l.as_mut_ptr(), v) };
    std::array::from_fn(|i| l[i])
}

/// The f16 `h` (little-endian bytes, as stored in the blocks) as f32, converted from a
/// broadcast, which depends on no other register.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn f16_scalar(h: &[u8; 2]) -> f32 {
    let v = _mm_set1_epi16(i16::from_le_bytes(*h));
    _mm_cvtss_f32(_mm_cvtph_ps(v))
}

/// The f16 `h` (little-endian bytes) as f32 in all 8 lanes.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn bcast_f16(h: &[u8; 2]) -> __m256 {
    _mm256_cvtph_ps(_mm_set1_epi16(i16::from_le_bytes(*h)))
}

/// The 32 bytes of `v` (a byte array such as a block's quants, `bsums` or a `vpshufb` control).
#[inline]
#[target_feature(enable = "avx")]
pub(crate) fn load256_of<T: Pod>(v: &T) -> __m256i {
    const { assert!(size_of::<T>() == 32) };
    // SAFETY: `v` is a live reference to 32 initialized bytes (`Pod`: no padding) and the load
    // has no alignment requirement; AVX is enabled for this function.
    unsafe { _mm256_loadu_si256(v as *const T as *const __m256i) }
}

/// The 16 bytes of `v`.
#[inline]
pub(crate) fn load128_of<T: Pod>(v: &T) -> __m128i {
    const { assert!(size_of::<T>() == 16) };
    // SAFETY: `v` is a live reference to 16 initialized bytes (`Pod`: no padding) and the load
    // has no alignment requirement; SSE2 is part of the x86-64 baseline.
    unsafe { _mm_loadu_si128(v as *const T as *const __m128i) }
}

/// 32 bytes from `p` (any alignment).
///
/// # Safety
/// `p..p + 32` is readable and initialized, and the CPU supports AVX (the caller is compiled
/// with it).
#[inline]
pub(crate) unsafe fn load256(p: *const u8) -> __m256i {
    // SAFETY: the caller's contract.
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// 16 bytes from `p` (any alignment).
///
/// # Safety
/// `p..p + 16` is readable and initialized.
#[inline]
pub(crate) unsafe fn load128(p: *const u8) -> __m128i {
    // SAFETY: the caller's contract; SSE2 is part of the x86-64 baseline.
    unsafe { _mm_loadu_si128(p as *const __m128i) }
}
