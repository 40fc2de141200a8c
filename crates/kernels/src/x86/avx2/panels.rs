//! Panel kernels (see `crate::panel`) for AVX2: Q4_K and Q6_K against Q8_K; Q4_0, Q4_1, Q5_0,
//! Q5_1, Q8_0 and IQ4_NL against Q8_0 (one token per lane, `tokens_panel`); the IQ and TQ
//! panels are in `super::iquants`.
//! The integer work is the single-row kernels' (`vpmaddubsw`, scales applied with `vpmaddwd`),
//! so every value equals `super::kquants` / `super::legacy` bit for bit; a tile shares the weight
//! unpacking and scale shuffles across its tokens and the activation loads across its rows.
//! Sixteen registers keep the tiles small.

// Tiles index several per-row and per-token arrays with the same loop variable.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::kquants::madd_acc;
use crate::blocks::{
    BlockIq4Nl, BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K,
    BlockQ6K, BlockQ8_0, BlockQ8K, QK_K, QK8_0,
};
use crate::formats::iq_grids::KVALUES_IQ4NL;
use bytemuck::Pod;

use super::legacy;
use crate::panel::Panel;
use crate::x86::blocks32::{
    TokenBlock, YSide, chunk_row_lanes_kernels, dwords, few_tokens_row_lanes, pack_tokens,
    put_groups8, store_tokens, take_groups8,
};
use crate::x86::kq256::Q6K_SCALE;
use crate::x86::simd256::{bcast_f16, hsums, lanes, load128_of, load256, load256_of};
use crate::x86::tiles::{dot_tile, panel_kernel, q2k_rows, q3k_rows, q5k_rows};

panel_kernel!(pub panel_q4_k_tiles, "avx2,fma,f16c",
    block = QK_K, batch = q4k_tile(1, [2, 3, 4, 5, 6, 7, 8]), single = q4k_dots(1));
panel_kernel!(pub panel_q2_k, "avx2,fma,f16c",
    block = QK_K, batch = q2k_tile(1, [2, 3, 4]), single = q2k_dots(1), chunks = chunks_q2_k);
panel_kernel!(pub panel_q3_k, "avx2,fma,f16c",
    block = QK_K, batch = q3k_tile(1, [2, 3, 4]), single = q3k_dots(1), chunks = chunks_q3_k);
panel_kernel!(pub panel_q5_k, "avx2,fma,f16c",
    block = QK_K, batch = q5k_tile(1, [2, 3, 4]), single = q5k_dots(1), chunks = chunks_q5_k);
panel_kernel!(pub panel_q6_k_tiles, "avx2,fma,f16c",
    block = QK_K, batch = q6k_tile(1, [2, 3, 4]), single = q6k_dots(1), chunks = chunks_q6_k);

crate::x86::q4k_octets::q4k_octet_tile!(q4k_tile, "avx2,fma,f16c", madd_acc);

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

/// Below this many tokens a 32-element panel runs eight rows a row per lane per token
/// ([`few_tokens_row_lanes`]).
const TOKENS_MIN: usize = 4;

/// How a 32-element format's weight bytes meet `vpmaddubsw`, whose first operand is unsigned.
#[derive(Clone, Copy, PartialEq)]
enum Weights32 {
    /// Unsigned quants below 32 (Q4/Q5), the weight being `u − k` (`k` in the packed start) or
    /// `d·u + m` (Q4_1/Q5_1): pair sums of two groups fit in i16.
    Unsigned,
    /// Signed bytes (Q8_0, IQ4_NL): the magnitude times the activation with the weight's sign.
    Signed,
}

/// The AVX2 form of the AVX-512 `tokens_panel` (see `crate::x86::blocks32`): groups of 8
/// tokens, one per lane, the block integers from `vpmaddubsw` + `vpmaddwd` on the weights'
/// broadcast 4-byte groups.
///
/// # Safety
/// As for [`crate::panel::PanelFn`]; the CPU has the features of this function.
#[inline]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tokens_panel<B: Pod, const MIN: bool>(
    p: &Panel,
    kind: Weights32,
    k: i32,
    values: impl Fn(&B) -> __m256i + Copy,
    d: impl Fn(&B) -> [u8; 2] + Copy,
    m: impl Fn(&B) -> [u8; 2] + Copy,
    dots8: impl Fn(usize, [&[u8]; 8], &[u8], &[YSide]) -> [f32; 8],
) {
    let nb = p.k / QK8_0;
    if p.n < TOKENS_MIN {
        // SAFETY: the panel's contract (above).
        unsafe { few_tokens_row_lanes::<B>(p, dots8) };
        return;
    }
    let mut groups = take_groups8();
    for t0 in (0..p.n).step_by(8) {
        // SAFETY: tokens t0.. below n hold nb Q8_0 blocks (the contract above).
        unsafe { pack_tokens::<8>(p, t0, nb, k, &mut groups) };
        let row = |r: usize| p.w.wrapping_add(r * p.w_stride) as *const B;
        let mut r0 = 0;
        while r0 + 2 <= p.rows {
            // SAFETY: rows r0..r0 + 2 lie inside the panel (nb readable blocks each).
            unsafe {
                let v =
                    tokens_tile::<B, 2, MIN>(&groups, [row(r0), row(r0 + 1)], kind, values, d, m);
                store_tokens(p, r0, t0, &v[0]);
                store_tokens(p, r0 + 1, t0, &v[1]);
            }
            r0 += 2;
        }
        if r0 < p.rows {
            // SAFETY: as above, for row r0 < rows.
            unsafe {
                let [v] = tokens_tile::<B, 1, MIN>(&groups, [row(r0)], kind, values, d, m);
                store_tokens(p, r0, t0, &v);
            }
        }
    }
    put_groups8(groups);
}

/// `R` rows against one packed group of 8 tokens (see [`tokens_panel`]).
///
/// # Safety
/// Each `w[r]` points at `groups.len()` readable blocks `B`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tokens_tile<B: Pod, const R: usize, const MIN: bool>(
    groups: &[TokenBlock<8>],
    w: [*const B; R],
    kind: Weights32,
    values: impl Fn(&B) -> __m256i,
    d: impl Fn(&B) -> [u8; 2],
    m: impl Fn(&B) -> [u8; 2],
) -> [[f32; 8]; R] {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    for (j, tb) in groups.iter().enumerate() {
        let y = |g: usize| load256_of(&tb.y[g]);
        let (start, dy, sydy) = (
            load256_of(&tb.start),
            _mm256_castsi256_ps(load256_of(&tb.dy)),
            _mm256_castsi256_ps(load256_of(&tb.sydy)),
        );
        for r in 0..R {
            // SAFETY: block j < groups.len() of row r is readable (the contract above); blocks
            // are plain bytes of alignment 1.
            let x = unsafe { &*w[r].add(j) };
            let v = values(x);
            let mut s = start;
            if kind == Weights32::Unsigned {
                let u = dwords(v);
                for g in (0..8).step_by(2) {
                    let p0 = _mm256_maddubs_epi16(_mm256_set1_epi32(u[g]), y(g));
                    let p1 = _mm256_maddubs_epi16(_mm256_set1_epi32(u[g + 1]), y(g + 1));
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones));
                }
            } else {
                let (mag, sign) = (dwords(_mm256_sign_epi8(v, v)), dwords(v));
                for g in 0..8 {
                    let sy = _mm256_sign_epi8(y(g), _mm256_set1_epi32(sign[g]));
                    let p = _mm256_maddubs_epi16(_mm256_set1_epi32(mag[g]), sy);
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
                }
            }
            let dxdy = _mm256_mul_ps(bcast_f16(&d(x)), dy);
            let mut t = _mm256_mul_ps(_mm256_cvtepi32_ps(s), dxdy);
            if MIN {
                t = _mm256_add_ps(t, _mm256_mul_ps(bcast_f16(&m(x)), sydy));
            }
            acc[r] = _mm256_add_ps(acc[r], t);
        }
    }
    acc.map(|v| lanes(v))
}

/// Q4_0 × Q8_0 (see [`tokens_panel`]): nibbles, offset 8.
///
/// # Safety
/// As for [`crate::panel::PanelFn`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn panel_q4_0(p: &Panel) {
    let m4 = _mm256_set1_epi8(0x0F);
    let values = |x: &BlockQ4_0| legacy::nibbles(&x.qs, m4);
    let dots8 = |n, w: [&[u8]; 8], a: &[u8], s: &[YSide]| legacy::dots8_q4_0(n, w, a, s);
    // SAFETY: the contract above, which is `tokens_panel`'s.
    unsafe { tokens_panel::<_, false>(p, Weights32::Unsigned, 8, values, |x| x.d, |x| x.d, dots8) }
}

/// Q4_1 × Q8_0 (see [`tokens_panel`]): nibbles, scale and min.
///
/// # Safety
/// As for [`crate::panel::PanelFn`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn panel_q4_1(p: &Panel) {
    let m4 = _mm256_set1_epi8(0x0F);
    let values = |x: &BlockQ4_1| legacy::nibbles(&x.qs, m4);
    let dots8 = |n, w: [&[u8]; 8], a: &[u8], s: &[YSide]| legacy::dots8_q4_1(n, w, a, s);
    // SAFETY: the contract above, which is `tokens_panel`'s.
    unsafe { tokens_panel::<_, true>(p, Weights32::Unsigned, 0, values, |x| x.d, |x| x.m, dots8) }
}

/// Q5_0 × Q8_0 (see [`tokens_panel`]): five-bit quants, offset 16.
///
/// # Safety
/// As for [`crate::panel::PanelFn`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn panel_q5_0(p: &Panel) {
    let m4 = _mm256_set1_epi8(0x0F);
    let fifth = legacy::FifthBits::new();
    let values = |x: &BlockQ5_0| fifth.quants(&x.qh, &x.qs, m4);
    let dots8 = |n, w: [&[u8]; 8], a: &[u8], s: &[YSide]| legacy::dots8_q5_0(n, w, a, s);
    // SAFETY: the contract above, which is `tokens_panel`'s.
    unsafe { tokens_panel::<_, false>(p, Weights32::Unsigned, 16, values, |x| x.d, |x| x.d, dots8) }
}

/// Q5_1 × Q8_0 (see [`tokens_panel`]): five-bit quants, scale and min.
///
/// # Safety
/// As for [`crate::panel::PanelFn`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn panel_q5_1(p: &Panel) {
    let m4 = _mm256_set1_epi8(0x0F);
    let fifth = legacy::FifthBits::new();
    let values = |x: &BlockQ5_1| fifth.quants(&x.qh, &x.qs, m4);
    let dots8 = |n, w: [&[u8]; 8], a: &[u8], s: &[YSide]| legacy::dots8_q5_1(n, w, a, s);
    // SAFETY: the contract above, which is `tokens_panel`'s.
    unsafe { tokens_panel::<_, true>(p, Weights32::Unsigned, 0, values, |x| x.d, |x| x.m, dots8) }
}

/// Q8_0 × Q8_0 (see [`tokens_panel`]): signed bytes.
///
/// # Safety
/// As for [`crate::panel::PanelFn`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn panel_q8_0(p: &Panel) {
    let values = |x: &BlockQ8_0| load256_of(&x.qs);
    let dots8 = |n, w: [&[u8]; 8], a: &[u8], s: &[YSide]| legacy::dots8_q8_0(n, w, a, s);
    // SAFETY: the contract above, which is `tokens_panel`'s.
    unsafe { tokens_panel::<_, false>(p, Weights32::Signed, 0, values, |x| x.d, |x| x.d, dots8) }
}

/// IQ4_NL × Q8_0 (see [`tokens_panel`]): the nibbles mapped through the 16 levels (signed).
///
/// # Safety
/// As for [`crate::panel::PanelFn`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn panel_iq4_nl(p: &Panel) {
    let m4 = _mm256_set1_epi8(0x0F);
    let levels = _mm256_broadcastsi128_si256(load128_of(&KVALUES_IQ4NL));
    let values = |x: &BlockIq4Nl| _mm256_shuffle_epi8(levels, legacy::nibbles(&x.qs, m4));
    let dots8 = |n, w: [&[u8]; 8], a: &[u8], s: &[YSide]| legacy::dots8_iq4_nl(n, w, a, s);
    // SAFETY: the contract above, which is `tokens_panel`'s.
    unsafe { tokens_panel::<_, false>(p, Weights32::Signed, 0, values, |x| x.d, |x| x.d, dots8) }
}

q2k_rows!(q2k_tile, "avx2,fma,f16c", madd_acc);

dot_tile!(
    q2k_dots,
    "avx2,fma,f16c",
    super::kquants::dot_q2_k_impl,
    BlockQ2K,
    BlockQ8K,
    QK_K
);

q5k_rows!(q5k_tile, "avx2,fma,f16c", madd_acc);

dot_tile!(
    q5k_dots,
    "avx2,fma,f16c",
    super::kquants::dot_q5_k_impl,
    BlockQ5K,
    BlockQ8K,
    QK_K
);

q3k_rows!(q3k_tile, "avx2,fma,f16c", madd_acc);

dot_tile!(
    q3k_dots,
    "avx2,fma,f16c",
    super::kquants::dot_q3_k_impl,
    BlockQ3K,
    BlockQ8K,
    QK_K
);

chunk_row_lanes_kernels!("avx2,fma,f16c";
    chunk_rows_q4_0 = legacy::dots8_q4_0,
    chunk_rows_q4_1 = legacy::dots8_q4_1,
    chunk_rows_q5_0 = legacy::dots8_q5_0,
    chunk_rows_q5_1 = legacy::dots8_q5_1,
    chunk_rows_q8_0 = legacy::dots8_q8_0,
    chunk_rows_iq4_nl = legacy::dots8_iq4_nl,
);
