//! Panel kernels (see `crate::panel`) for AVX-512 VNNI: Q4_K and Q6_K against Q8_K, Q8_0
//! and IQ4_NL against Q8_0 (the IQ and TQ panels are in `super::iquants`). A tile keeps R × T
//! accumulators in registers; weights are unpacked once per tile for its T tokens and each
//! activation load serves its R rows. Every value equals the
//! single-row dot of `super::kquants` / `super::legacy` bit for bit: the integer lanes are the
//! same (exact, whatever instructions produce them) and the float operations are the same, in the
//! same order, per (row, token).
//!
//! Byte products: one `vpdpbusd` per 32 weights gives each 32-bit lane the sum of four products;
//! for the K-quants those sums fit in 16 bits (≤ 4·15·127 for Q4_K, 4·63·127 = 32004 for Q6_K),
//! so two sub-blocks' sums are packed into the two halves of each lane and one `vpdpwssd`
//! applies both scales (`dpwssd_pair`): three multiplies per 64 weights where `vpmaddubsw` +
//! `vpdpwssd` take four. Zen 4 runs every multiply (integer or float) on the same two pipes, so
//! that is what bounds these tiles. Measured on Zen 4 (one thread, 2048×2048 Q4_K, 256 tokens):
//! 85 GFLOP/s for a loop of single-row dots, 139 for the four-multiply tile, 155 for this one;
//! 512-bit forms (two sub-blocks per register) were slower (120): building the registers needs
//! lane-crossing shuffles, which compete with the multiplies.

// Tiles index several per-row and per-token arrays with the same loop variable.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::kquants::dpwssd;
use crate::blocks::{BlockIq4Nl, BlockQ4K, BlockQ6K, BlockQ8_0, BlockQ8K, QK_K, QK8_0};
use crate::formats::iq_grids::KVALUES_IQ4NL;
use crate::x86::blocks32::f16x8;
use crate::x86::kq256::{K4_MINS, q4k_float_step};
use crate::x86::scales::unpack_k4;
use crate::x86::simd256::{
    bcast_f16, hsum_ps, hsums, lanes, load128, load128_of, load256, load256_of,
};
use crate::x86::tiles::{dot_tile, panel_kernel};

panel_kernel!(pub panel_q4_k, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    block = QK_K, batch = q4k_tile(1, [2, 3, 4, 5, 6, 7, 8]), single = q4k_dots(1));
panel_kernel!(pub panel_q4_k_exact, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    block = QK_K, batch = q4k_exact_tile(1, [2, 3, 4, 5, 6, 7, 8]), single = q4k_exact_dots(1));
panel_kernel!(pub panel_q6_k, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    block = QK_K, batch = q6k_tile(1, [2, 3, 4, 5, 6, 7, 8]), single = q6k_dots(1));
panel_kernel!(pub panel_iq4_nl, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    block = QK8_0, batch = iq4_nl_tile(2, [2, 3, 4]), single = iq4_nl_tile(1));
panel_kernel!(pub panel_q8_0, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    block = QK8_0, batch = q8_0_tile(2, [2, 3, 4]), single = q8_0_tile(1));

/// `acc + s_lo·a + s_hi·b` per 32-bit lane, from two `vpdpbusd` results whose lanes fit in i16
/// and the scale pairs `[s_lo, s_hi]` (low word, high word) of each lane: `b`'s low word moves to
/// the high word of the lane and one `vpdpwssd` applies both scales.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn dpwssd_pair(acc: __m256i, a: __m256i, b: __m256i, scales: __m256i) -> __m256i {
    let pair = _mm256_blend_epi16::<0b1010_1010>(a, _mm256_slli_epi32::<16>(b));
    dpwssd(acc, pair, scales)
}

/// `vpshufb` controls over Q4_K's unpacked scales: sub-block 2g's scale in the low word and
/// 2g+1's in the high word of every 32-bit lane.
static K4_SCALE_PAIR: [[u8; 32]; 4] = {
    let mut t = [[0x80u8; 32]; 4];
    let mut g = 0;
    while g < 4 {
        let mut i = 0;
        while i < 32 {
            t[g][i] = (2 * g) as u8;
            t[g][i + 2] = (2 * g + 1) as u8;
            i += 4;
        }
        g += 1;
    }
    t
};

/// Q4_K × Q8_K. Per superblock and (row, token): the lanes of `kq256::q4k_q5k_body` (lane l =
/// Σ_j scale_j · Σ of elements 4l..4l+4 of sub-block j) and its mins lanes, then the two FMAs of
/// `kq256::fma_d_dmin`; the result is `hsum(acc0 + acc1)` as there.
///
/// # Safety
/// Each `w[r]` points at `nb` readable Q4_K blocks and each `a[t]` at `nb` Q8_K blocks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q4k_tile<const R: usize, const T: usize>(
    nb: usize,
    w: [*const u8; R],
    a: [*const u8; T],
) -> [[f32; T]; R] {
    // SAFETY: the caller's contract.
    unsafe { q4k_tile_of::<R, T, false>(nb, w, a) }
}

/// [`q4k_tile`] in the scalar reference's arithmetic (`kq256::SuperblockSums`, the AMX level's
/// Q4_K dot): the same integer work; per superblock the T tokens' integer sums are reduced
/// together and the reference's float step runs with one token per lane.
///
/// # Safety
/// As for [`q4k_tile`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q4k_exact_tile<const R: usize, const T: usize>(
    nb: usize,
    w: [*const u8; R],
    a: [*const u8; T],
) -> [[f32; T]; R] {
    // SAFETY: the caller's contract.
    unsafe { q4k_tile_of::<R, T, true>(nb, w, a) }
}

/// The Q4_K tile in both arithmetics (`EXACT`: the reference's, else `q4k_256`'s lanes).
///
/// # Safety
/// As for [`q4k_tile`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q4k_tile_of<const R: usize, const T: usize, const EXACT: bool>(
    nb: usize,
    w: [*const u8; R],
    a: [*const u8; T],
) -> [[f32; T]; R] {
    let w = w.map(|p| p as *const BlockQ4K);
    let a = a.map(|p| p as *const BlockQ8K);
    let m4 = _mm256_set1_epi8(0x0F);
    let zero = _mm256_setzero_si256();
    let mut acc = [[[_mm256_setzero_ps(); 2]; T]; R];
    // EXACT: one lane per token.
    let mut exact = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        // SAFETY: block b < nb of every row is readable (the contract above), so its start is
        // in bounds.
        let xs: [*const u8; R] = std::array::from_fn(|r| unsafe { w[r].add(b) } as *const u8);
        // SAFETY: block b < nb of every token is readable (the contract above); the blocks have
        // alignment 1 and are plain bytes, so a reference to one is valid.
        let ys: [&BlockQ8K; T] = std::array::from_fn(|t| unsafe { &*a[t].add(b) });
        // Scales (bytes 0..8) and mins (8..16) in both 128-bit lanes.
        let u: [__m256i; R] = std::array::from_fn(|r| {
            // SAFETY: the first 16 of the 144 bytes of block `xs[r]`.
            _mm256_broadcastsi128_si256(unpack_k4(unsafe { load128(xs[r]) }))
        });
        let mut isum = [[zero; T]; R];
        for g in 0..4 {
            let mut lo = [zero; R];
            let mut hi = [zero; R];
            let mut sc = [zero; R];
            for r in 0..R {
                // SAFETY: bytes 16 + 32g.. + 32 of the 144 in block `xs[r]` (its `qs`; g < 4).
                let q = unsafe { load256(xs[r].add(16 + 32 * g)) };
                lo[r] = _mm256_and_si256(q, m4);
                hi[r] = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
                sc[r] = _mm256_shuffle_epi8(u[r], load256_of(&K4_SCALE_PAIR[g]));
            }
            for t in 0..T {
                let q8 = ys[t].qs.as_ptr() as *const u8;
                // SAFETY: bytes 64g..64g + 64 of the 256 in `ys[t].qs` (g < 4).
                let (alo, ahi) = unsafe { (load256(q8.add(64 * g)), load256(q8.add(64 * g + 32))) };
                for r in 0..R {
                    let plo = _mm256_dpbusd_epi32(zero, lo[r], alo);
                    let phi = _mm256_dpbusd_epi32(zero, hi[r], ahi);
                    isum[r][t] = dpwssd_pair(isum[r][t], plo, phi, sc[r]);
                }
            }
        }
        if EXACT {
            let dy: [f32; 8] = std::array::from_fn(|t| if t < T { ys[t].d() } else { 0.0 });
            // SAFETY: the load reads the 8 floats of `dy`.
            let dy = unsafe { _mm256_loadu_ps(dy.as_ptr()) };
            for r in 0..R {
                let mins = _mm256_shuffle_epi8(u[r], load256_of(&K4_MINS));
                let msum: [__m256i; T] =
                    std::array::from_fn(|t| _mm256_madd_epi16(mins, load256_of(&ys[t].bsums)));
                // SAFETY: the first four bytes of block `xs[r]` (readable, above).
                exact[r] =
                    unsafe { q4k_float_step(exact[r], dy, xs[r], hsums(&isum[r]), hsums(&msum)) };
            }
            continue;
        }
        for r in 0..R {
            // [d, dmin] (the block's first four bytes) times dy, as in `fma_d_dmin`.
            // SAFETY: the first 4 bytes of block `xs[r]`; `read_unaligned` has no alignment
            // requirement.
            let dm = _mm_cvtph_ps(_mm_set1_epi32(unsafe {
                (xs[r] as *const i32).read_unaligned()
            }));
            let mins = _mm256_shuffle_epi8(u[r], load256_of(&K4_MINS));
            for t in 0..T {
                let msum = _mm256_madd_epi16(mins, load256_of(&ys[t].bsums));
                let p = _mm_mul_ps(dm, _mm_set1_ps(ys[t].d()));
                acc[r][t][0] = _mm256_fmadd_ps(
                    _mm256_broadcastss_ps(p),
                    _mm256_cvtepi32_ps(isum[r][t]),
                    acc[r][t][0],
                );
                acc[r][t][1] = _mm256_fnmadd_ps(
                    _mm256_broadcastss_ps(_mm_movehdup_ps(p)),
                    _mm256_cvtepi32_ps(msum),
                    acc[r][t][1],
                );
            }
        }
    }
    if EXACT {
        return exact.map(|v| lanes(v));
    }
    acc.map(|row| row.map(|[a0, a1]| hsum_ps(_mm256_add_ps(a0, a1))))
}

/// `vpshufb` controls over eight Q6_K scales (16-bit, broadcast to both 128-bit lanes) for the
/// pair of quant registers (2p, 2p+1) of a half: register k's first 16 elements (lanes 0..4)
/// use scale 2k, its last 16 (lanes 4..8) scale 2k+1; register 2p's scale goes to the low word.
static Q6K_SCALE_PAIR: [[u8; 32]; 2] = {
    let mut t = [[0u8; 32]; 2];
    let mut p = 0;
    while p < 2 {
        let mut lane = 0;
        while lane < 8 {
            let second = (lane / 4) as u8;
            let (s_lo, s_hi) = (4 * p as u8 + second, 4 * p as u8 + 2 + second);
            let i = 4 * lane;
            t[p][i] = 2 * s_lo;
            t[p][i + 1] = 2 * s_lo + 1;
            t[p][i + 2] = 2 * s_hi;
            t[p][i + 3] = 2 * s_hi + 1;
            lane += 1;
        }
        p += 1;
    }
    t
};

/// Q6_K × Q8_K. The single-row dot reduces each superblock to one exact integer
/// `Σ_j scale_j · Σ (q − 32)·a` over its sixteen 16-element sub-blocks and adds
/// `(d·dy)·total` to a scalar; here the integers of T tokens are reduced together
/// (`hsums`) and the float steps run with one token per lane — the same operations per token.
///
/// # Safety
/// Each `w[r]` points at `nb` readable Q6_K blocks and each `a[t]` at `nb` Q8_K blocks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q6k_tile<const R: usize, const T: usize>(
    nb: usize,
    w: [*const u8; R],
    a: [*const u8; T],
) -> [[f32; T]; R] {
    let w = w.map(|p| p as *const BlockQ6K);
    let a = a.map(|p| p as *const BlockQ8K);
    let m4 = _mm256_set1_epi8(0x0F);
    let m30 = _mm256_set1_epi8(0x30);
    let zero = _mm256_setzero_si256();
    // One lane per token.
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        // SAFETY: block b < nb of every row and token is readable (the contract above); the
        // blocks have alignment 1 and are plain bytes, so a reference to one is valid.
        let xs: [&BlockQ6K; R] = std::array::from_fn(|r| unsafe { &*w[r].add(b) });
        // SAFETY: as above.
        let ys: [&BlockQ8K; T] = std::array::from_fn(|t| unsafe { &*a[t].add(b) });
        let scales16: [__m256i; R] =
            std::array::from_fn(|r| _mm256_cvtepi8_epi16(load128_of(&xs[r].scales)));
        let mut isum = [[zero; T]; R];
        for half in 0..2 {
            let mut q = [[zero; 4]; R];
            let mut sc = [[zero; 2]; R];
            for r in 0..R {
                let x = xs[r];
                // SAFETY: bytes 64·half.. + 64 of the 128 in `x.ql` and 32·half.. + 32 of the
                // 64 in `x.qh` (half < 2).
                let (ql0, ql1, qh) = unsafe {
                    (
                        load256(x.ql.as_ptr().add(64 * half)),
                        load256(x.ql.as_ptr().add(64 * half + 32)),
                        load256(x.qh.as_ptr().add(32 * half)),
                    )
                };
                q[r] = [
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
                let s = if half == 0 {
                    _mm256_broadcastsi128_si256(_mm256_castsi256_si128(scales16[r]))
                } else {
                    _mm256_broadcastsi128_si256(_mm256_extracti128_si256::<1>(scales16[r]))
                };
                sc[r] = [0, 1].map(|p| _mm256_shuffle_epi8(s, load256_of(&Q6K_SCALE_PAIR[p])));
            }
            for t in 0..T {
                let q8 = ys[t].qs.as_ptr() as *const u8;
                // SAFETY: bytes 128·half + 32k.. + 32 of the 256 in `ys[t].qs` (half < 2,
                // k < 4).
                let y: [__m256i; 4] =
                    std::array::from_fn(|k| unsafe { load256(q8.add(128 * half + 32 * k)) });
                for r in 0..R {
                    for p in 0..2 {
                        let lo = _mm256_dpbusd_epi32(zero, q[r][2 * p], y[2 * p]);
                        let hi = _mm256_dpbusd_epi32(zero, q[r][2 * p + 1], y[2 * p + 1]);
                        isum[r][t] = dpwssd_pair(isum[r][t], lo, hi, sc[r][p]);
                    }
                }
            }
        }
        let dy: [f32; 8] = std::array::from_fn(|t| if t < T { ys[t].d() } else { 0.0 });
        // SAFETY: the load reads the 8 floats of `dy`.
        let dy = unsafe { _mm256_loadu_ps(dy.as_ptr()) };
        for r in 0..R {
            // The quants are stored biased by 32: subtract 32·Σ scale·(sum of 16 activations).
            let tot: [__m256i; T] = std::array::from_fn(|t| {
                let bias = _mm256_madd_epi16(scales16[r], load256_of(&ys[t].bsums));
                _mm256_sub_epi32(isum[r][t], _mm256_slli_epi32::<5>(bias))
            });
            let tot = _mm256_cvtepi32_ps(hsums(&tot));
            let dd = _mm256_mul_ps(bcast_f16(&xs[r].d), dy);
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(dd, tot));
        }
    }
    acc.map(|v| lanes(v))
}

/// 32-element blocks whose weights are signed bytes once decoded (`values`; f16 scale `d`:
/// Q8_0, IQ4_NL) against Q8_0. The single-row dot (`blocks32::sum_blocks`) gives each block's
/// lanes the sums
/// of four products and adds `fl(dx·dy)·lanes` to `acc[j % 2]` for the blocks of whole batches
/// of eight, to `acc[0]` for the rest, and returns `hsum(acc0 + acc1)`. Here the products come
/// from `vpdpbusd` with the weights made unsigned (`x + 128`, shared by the tile's tokens) and
/// `128·Σy` removed through the accumulator's start value (shared by its rows).
///
/// # Safety
/// Each `w[r]` points at `nb` readable blocks `B` and each `a[t]` at `nb` Q8_0 blocks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn signed_bytes_tile<B, const R: usize, const T: usize>(
    nb: usize,
    w: [*const u8; R],
    a: [*const u8; T],
    values: impl Fn(&B) -> __m256i,
    d: impl Fn(&B) -> [u8; 2] + Copy,
) -> [[f32; T]; R] {
    let w = w.map(|p| p as *const B);
    let a = a.map(|p| p as *const BlockQ8_0);
    let k80 = _mm256_set1_epi8(0x80u8 as i8);
    let zero = _mm256_setzero_si256();
    let mut acc = [[[_mm256_setzero_ps(); 2]; T]; R];
    // SAFETY: `block` and `act` are only called with j < nb (the loops below), and blocks 0..nb
    // of every row and token are readable (the contract above); the blocks have alignment 1 and
    // are plain bytes, so a reference to one is valid.
    let block = |j: usize, r: usize| unsafe { &*w[r].add(j) };
    // SAFETY: as for `block`.
    let act = |j: usize, t: usize| unsafe { &*a[t].add(j) };
    // The lanes of block j for every (row, token).
    let lanes = |j: usize| -> [[__m256i; T]; R] {
        let xu: [__m256i; R] = std::array::from_fn(|r| _mm256_xor_si256(values(block(j, r)), k80));
        let mut out = [[zero; T]; R];
        for t in 0..T {
            let y = load256_of(&act(j, t).qs);
            let start = _mm256_sub_epi32(zero, _mm256_dpbusd_epi32(zero, k80, y));
            for r in 0..R {
                out[r][t] = _mm256_dpbusd_epi32(start, xu[r], y);
            }
        }
        out
    };
    let main = nb - nb % 8;
    for j0 in (0..main).step_by(8) {
        let dx: [__m256; R] = std::array::from_fn(|r| {
            f16x8(
                // SAFETY: blocks j0..j0 + 8 lie below `main` ≤ nb, readable by the contract
                // above and not written while the slice lives.
                unsafe { std::slice::from_raw_parts(w[r].add(j0), 8) },
                d,
            )
        });
        let dy: [__m256; T] = std::array::from_fn(|t| {
            f16x8(
                // SAFETY: as for `dx`.
                unsafe { std::slice::from_raw_parts(a[t].add(j0), 8) },
                |b| b.d,
            )
        });
        let d: [[__m256; T]; R] =
            std::array::from_fn(|r| std::array::from_fn(|t| _mm256_mul_ps(dx[r], dy[t])));
        for jj in 0..8 {
            let s = lanes(j0 + jj);
            let idx = _mm256_set1_epi32(jj as i32);
            for r in 0..R {
                for t in 0..T {
                    let dj = _mm256_permutevar8x32_ps(d[r][t], idx);
                    acc[r][t][jj % 2] =
                        _mm256_fmadd_ps(dj, _mm256_cvtepi32_ps(s[r][t]), acc[r][t][jj % 2]);
                }
            }
        }
    }
    for j in main..nb {
        let s = lanes(j);
        for r in 0..R {
            let dx = bcast_f16(&d(block(j, r)));
            for t in 0..T {
                let dj = _mm256_mul_ps(dx, bcast_f16(&act(j, t).d));
                acc[r][t][0] = _mm256_fmadd_ps(dj, _mm256_cvtepi32_ps(s[r][t]), acc[r][t][0]);
            }
        }
    }
    acc.map(|row| row.map(|[a0, a1]| hsum_ps(_mm256_add_ps(a0, a1))))
}

// Decode: the single-row kernels (see `crate::x86::tiles` for why not multi-row tiles).
dot_tile!(
    q4k_dots,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    super::kquants::dot_q4_k_impl,
    BlockQ4K,
    BlockQ8K,
    QK_K
);
dot_tile!(
    q4k_exact_dots,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    super::kquants::dot_q4_k_exact_impl,
    BlockQ4K,
    BlockQ8K,
    QK_K
);
dot_tile!(
    q6k_dots,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    super::kquants::dot_q6_k_impl,
    BlockQ6K,
    BlockQ8K,
    QK_K
);

/// Q8_0 × Q8_0 (see [`signed_bytes_tile`]).
///
/// # Safety
/// Each `w[r]` and each `a[t]` points at `nb` readable Q8_0 blocks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_tile<const R: usize, const T: usize>(
    nb: usize,
    w: [*const u8; R],
    a: [*const u8; T],
) -> [[f32; T]; R] {
    // SAFETY: the contract above, which is `signed_bytes_tile`'s.
    unsafe { signed_bytes_tile(nb, w, a, |x: &BlockQ8_0| load256_of(&x.qs), |x| x.d) }
}

/// IQ4_NL × Q8_0 (see [`signed_bytes_tile`]): the nibbles mapped through the 16 levels, as in
/// the single-row dot.
///
/// # Safety
/// Each `w[r]` points at `nb` readable IQ4_NL blocks and each `a[t]` at `nb` Q8_0 blocks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn iq4_nl_tile<const R: usize, const T: usize>(
    nb: usize,
    w: [*const u8; R],
    a: [*const u8; T],
) -> [[f32; T]; R] {
    let m4 = _mm256_set1_epi8(0x0F);
    let levels = _mm256_broadcastsi128_si256(load128_of(&KVALUES_IQ4NL));
    let values = |x: &BlockIq4Nl| {
        let q = load128_of(&x.qs);
        let nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), m4);
        _mm256_shuffle_epi8(levels, nib)
    };
    // SAFETY: the contract above, which is `signed_bytes_tile`'s.
    unsafe { signed_bytes_tile(nb, w, a, values, |x| x.d) }
}
