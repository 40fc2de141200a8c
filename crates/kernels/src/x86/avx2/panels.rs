//! Panel kernels (see `crate::panel`) for AVX2: Q4_K and Q6_K against Q8_K, Q8_0 and IQ4_NL
//! against Q8_0 (the IQ and TQ panels are in `super::iquants`).
//! The integer work is the single-row kernels' (`vpmaddubsw`, scales applied with `vpmaddwd`),
//! so every value equals `super::kquants` / `super::legacy` bit for bit; a tile shares the weight
//! unpacking and scale shuffles across its tokens and the activation loads across its rows.
//! Sixteen registers keep the tiles small.

// Tiles index several per-row and per-token arrays with the same loop variable.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::kquants::madd_acc;
use crate::blocks::{BlockIq4Nl, BlockQ4K, BlockQ6K, BlockQ8_0, BlockQ8K, QK_K, QK8_0};
use crate::formats::iq_grids::KVALUES_IQ4NL;
use crate::x86::blocks32::f16x8;
use crate::x86::kq256::Q6K_SCALE;
use crate::x86::simd256::{bcast_f16, hsum_ps, hsums, lanes, load128_of, load256, load256_of};
use crate::x86::tiles::{dot_tile, panel_kernel, q4k_rows};

panel_kernel!(pub panel_q4_k, "avx2,fma,f16c",
    block = QK_K, batch = q4k_tile(1, [2, 3, 4]), single = q4k_dots(1));
panel_kernel!(pub panel_q6_k, "avx2,fma,f16c",
    block = QK_K, batch = q6k_tile(1, [2, 3, 4]), single = q6k_dots(1));
panel_kernel!(pub panel_iq4_nl, "avx2,fma,f16c",
    block = QK8_0, batch = iq4_nl_tile(2, [2]), single = iq4_nl_tile(1));
panel_kernel!(pub panel_q8_0, "avx2,fma,f16c",
    block = QK8_0, batch = q8_0_tile(2, [2]), single = q8_0_tile(1));

q4k_rows!(q4k_tile, "avx2,fma,f16c", madd_acc);

/// Q6_K × Q8_K: `kq256::q6k_256`'s integer work with each row's quants unpacked once for T
/// tokens; each superblock's integers of the T tokens are reduced together (`hsums`) and the
/// float steps (`acc + (d·dy)·total`) run with one token per lane.
///
/// # Safety
/// Each `w[r]` points at `nb` readable Q6_K blocks and each `a[t]` at `nb` Q8_K blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
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
            for r in 0..R {
                let x = xs[r];
                let sc = if half == 0 {
                    _mm256_broadcastsi128_si256(_mm256_castsi256_si128(scales16[r]))
                } else {
                    _mm256_broadcastsi128_si256(_mm256_extracti128_si256::<1>(scales16[r]))
                };
                // SAFETY: bytes 64·half.. + 64 of the 128 in `x.ql` and 32·half.. + 32 of the
                // 64 in `x.qh` (half < 2).
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
                    let scale = _mm256_shuffle_epi8(sc, load256_of(&Q6K_SCALE[k]));
                    for t in 0..T {
                        // SAFETY: bytes 128·half + 32k.. + 32 of the 256 in `ys[t].qs`
                        // (half < 2, k < 4).
                        let y = unsafe {
                            load256((ys[t].qs.as_ptr() as *const u8).add(128 * half + 32 * k))
                        };
                        isum[r][t] = madd_acc(isum[r][t], _mm256_maddubs_epi16(qk, y), scale);
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

dot_tile!(
    q4k_dots,
    "avx2,fma,f16c",
    super::kquants::dot_q4_k_impl,
    BlockQ4K,
    BlockQ8K,
    QK_K
);
dot_tile!(
    q6k_dots,
    "avx2,fma,f16c",
    super::kquants::dot_q6_k_impl,
    BlockQ6K,
    BlockQ8K,
    QK_K
);

/// 32-element blocks whose weights are signed bytes once decoded (`values`; f16 scale `d`)
/// against Q8_0: the single-row dot's lanes (`mul_sum_i8_pairs`: the weight's sign moved onto
/// the activation, `vpmaddubsw` then `vpmaddwd` by ones) and float steps (see the AVX-512
/// `signed_bytes_tile`), with each weight block's magnitudes shared by the tile's tokens.
///
/// # Safety
/// Each `w[r]` points at `nb` readable blocks `B` and each `a[t]` at `nb` Q8_0 blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn signed_bytes_tile<B, const R: usize, const T: usize>(
    nb: usize,
    w: [*const u8; R],
    a: [*const u8; T],
    values: impl Fn(&B) -> __m256i,
    d: impl Fn(&B) -> [u8; 2] + Copy,
) -> [[f32; T]; R] {
    let w = w.map(|p| p as *const B);
    let a = a.map(|p| p as *const BlockQ8_0);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[[_mm256_setzero_ps(); 2]; T]; R];
    // SAFETY: `block` and `act` are only called with j < nb (the loops below), and blocks 0..nb
    // of every row and token are readable (the contract above); the blocks have alignment 1 and
    // are plain bytes, so a reference to one is valid.
    let block = |j: usize, r: usize| unsafe { &*w[r].add(j) };
    // SAFETY: as for `block`.
    let act = |j: usize, t: usize| unsafe { &*a[t].add(j) };
    // The lanes of block j for every (row, token).
    let lanes = |j: usize| -> [[__m256i; T]; R] {
        let x: [__m256i; R] = std::array::from_fn(|r| values(block(j, r)));
        let ax: [__m256i; R] = std::array::from_fn(|r| _mm256_sign_epi8(x[r], x[r]));
        let mut out = [[_mm256_setzero_si256(); T]; R];
        for t in 0..T {
            let y = load256_of(&act(j, t).qs);
            for r in 0..R {
                let sy = _mm256_sign_epi8(y, x[r]);
                out[r][t] = _mm256_madd_epi16(_mm256_maddubs_epi16(ax[r], sy), ones);
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

/// Q8_0 × Q8_0 (see [`signed_bytes_tile`]).
///
/// # Safety
/// Each `w[r]` and each `a[t]` points at `nb` readable Q8_0 blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
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
#[target_feature(enable = "avx2,fma,f16c")]
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
