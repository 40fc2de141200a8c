//! Register-tile panel kernels (see `crate::panel`) for AVX-512 VNNI: the K-quants against Q8_K
//! (Q4_K in the reference's arithmetic for the AMX level here; the level's own Q4_K tiles are in
//! `super::q4k_octets`, and batches of 16+ tokens of Q4_K and Q6_K go to `super::row_lanes`);
//! Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL against Q8_0 (one token per lane, `tokens_panel`);
//! the IQ and TQ panels are in `super::iquants`. A tile keeps R × T
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
use crate::blocks::{
    BlockIq4Nl, BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K,
    BlockQ6K, BlockQ8_0, BlockQ8K, QK_K, QK8_0,
};
use crate::formats::iq_grids::KVALUES_IQ4NL;
use bytemuck::Pod;

use super::legacy;
// Q8_0's row lanes at the AVX2 level's arithmetic (`vpmaddubsw` on the magnitudes, signs moved
// onto the activations): one or two instructions fewer per row and block than the masked
// `vpdpbusd` of `legacy::dots8_q8_0`, 5-20 % faster (one thread: 1536x576 39-42 against
// 47-48 us, 8192x8192 2.6-2.9 against 3.0 ms), the same bits.
use crate::panel::Panel;
use crate::x86::avx2::dots8_q8_0 as avx2_dots8_q8_0;
use crate::x86::blocks32::{
    TokenBlock, YSide, chunk_row_lanes_kernels, dwords, few_tokens_row_lanes, pack_tokens,
    put_groups16, store_tokens, take_groups16,
};
use crate::x86::kq256::{K4_MINS, q4k_float_step};
use crate::x86::scales::unpack_k4;
use crate::x86::simd256::{
    bcast_f16, f16_scalar, hsums, lanes, load128, load128_of, load256, load256_of,
};
use crate::x86::tiles::{dot_tile, panel_kernel, q2k_rows, q3k_rows, q5k_rows};

panel_kernel!(pub panel_q4_k_exact, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    block = QK_K, batch = q4k_exact_tile(1, [2, 3, 4, 5, 6, 7, 8]), single = q4k_exact_dots(1));
panel_kernel!(pub panel_q2_k, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    block = QK_K, batch = q2k_tile(1, [2, 3, 4, 5, 6, 7, 8]), single = q2k_dots(1),
    chunk_panel = chunk_panel_q2_k, chunks = chunks_q2_k);
panel_kernel!(pub panel_q3_k, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    block = QK_K, batch = q3k_tile(1, [2, 3, 4, 5, 6, 7, 8]), single = q3k_dots(1),
    chunk_panel = chunk_panel_q3_k, chunks = chunks_q3_k);
panel_kernel!(pub panel_q5_k, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    block = QK_K, batch = q5k_tile(1, [2, 3, 4, 5, 6, 7, 8]), single = q5k_dots(1),
    chunk_panel = chunk_panel_q5_k, chunks = chunks_q5_k);
panel_kernel!(pub panel_q6_k, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    block = QK_K, batch = q6k_tile(1, [2, 3, 4, 5, 6, 7, 8]), single = q6k_dots(1),
    chunk_panel = chunk_panel_q6_k, chunks = chunks_q6_k);

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

/// The integer work of one Q4_K superblock for R rows × T ≤ 8 tokens, shared by the tiles of
/// both arithmetics (the reference's here, the octets' in `super::q4k_octets`): each row's
/// quants and scales unpacked once for the T tokens; per (row, token) the lanes of Σ scale·q·a
/// (`vpdpbusd` pairs, `dpwssd_pair`) and of Σ min·bsum, whose horizontal sums are exact. Tokens
/// past T have zero lanes.
///
/// # Safety
/// Each `xs[r]` points at a readable Q4_K block.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q4k_superblock<const R: usize, const T: usize>(
    xs: &[*const u8; R],
    ys: &[&BlockQ8K; T],
) -> ([[__m256i; 8]; R], [[__m256i; 8]; R]) {
    const { assert!(T <= 8) };
    let m4 = _mm256_set1_epi8(0x0F);
    let zero = _mm256_setzero_si256();
    // Scales (bytes 0..8) and mins (8..16) in both 128-bit lanes.
    let u: [__m256i; R] = std::array::from_fn(|r| {
        // SAFETY: the first 16 of the 144 bytes of block `xs[r]`.
        _mm256_broadcastsi128_si256(unpack_k4(unsafe { load128(xs[r]) }))
    });
    let mut isum = [[zero; 8]; R];
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
    let mut msum = [[zero; 8]; R];
    for r in 0..R {
        let mins = _mm256_shuffle_epi8(u[r], load256_of(&K4_MINS));
        for t in 0..T {
            msum[r][t] = _mm256_madd_epi16(mins, load256_of(&ys[t].bsums));
        }
    }
    (isum, msum)
}

/// Q4_K × Q8_K in the scalar reference's arithmetic (`kq256::SuperblockSums`, the AMX level's
/// dot): each row's weight blocks unpacked once for the T tokens; per superblock the T tokens'
/// integer sums are reduced together and the reference's float step runs with one token per
/// lane.
///
/// # Safety
/// Each `w[r]` points at `nb` readable Q4_K blocks and each `a[t]` at `nb` Q8_K blocks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q4k_exact_tile<const R: usize, const T: usize>(
    nb: usize,
    w: [*const u8; R],
    a: [*const u8; T],
) -> [[f32; T]; R] {
    let w = w.map(|p| p as *const BlockQ4K);
    let a = a.map(|p| p as *const BlockQ8K);
    // One lane per token.
    let mut exact = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        // SAFETY: block b < nb of every row is readable (the contract above), so its start is
        // in bounds.
        let xs: [*const u8; R] = std::array::from_fn(|r| unsafe { w[r].add(b) } as *const u8);
        // SAFETY: block b < nb of every token is readable (the contract above); the blocks have
        // alignment 1 and are plain bytes, so a reference to one is valid.
        let ys: [&BlockQ8K; T] = std::array::from_fn(|t| unsafe { &*a[t].add(b) });
        // SAFETY: the blocks of this superblock (readable, above).
        let (isum, msum) = unsafe { q4k_superblock(&xs, &ys) };
        let dy: [f32; 8] = std::array::from_fn(|t| if t < T { ys[t].d() } else { 0.0 });
        // SAFETY: the load reads the 8 floats of `dy`.
        let dy = unsafe { _mm256_loadu_ps(dy.as_ptr()) };
        for r in 0..R {
            // SAFETY: the first four bytes of block `xs[r]` (readable, above).
            exact[r] =
                unsafe { q4k_float_step(exact[r], dy, xs[r], hsums(&isum[r]), hsums(&msum[r])) };
        }
    }
    exact.map(|v| lanes(v))
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

// Decode: the single-row kernels (see `crate::x86::tiles` for why not multi-row tiles).
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

/// Below this many tokens a 32-element panel runs eight rows a row per lane per token
/// ([`few_tokens_row_lanes`]): a group of 16 token lanes would be mostly padding.
const TOKENS_MIN: usize = 4;

/// The panel of a 32-element format (see `crate::x86::blocks32`) with its weights made unsigned
/// bytes `values(x)` (the weight plus `k`; Q4_1/Q5_1: `MIN`, `k` = 0): groups of 16 tokens are
/// transposed once, then each row's block integers come from eight `vpdpbusd` with the
/// weights' 4-byte groups broadcast, one token per lane, and the reference's float steps run
/// on the 16 tokens at once. Below [`TOKENS_MIN`] tokens, `dots8` (the level's eight-row dot,
/// one row per lane, the same bits) runs per token ([`few_tokens_row_lanes`]).
///
/// # Safety
/// As for [`crate::panel::PanelFn`]: the panel's rows (blocks `B`), tokens (Q8_0) and outputs
/// are in bounds and the outputs alias no input; the CPU has the features of this function.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn tokens_panel<B: Pod, const MIN: bool>(
    p: &Panel,
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
    let mut groups = take_groups16();
    for t0 in (0..p.n).step_by(16) {
        // SAFETY: tokens t0.. below n hold nb Q8_0 blocks (the contract above).
        unsafe { pack_tokens::<16>(p, t0, nb, k, &mut groups) };
        let row = |r: usize| p.w.wrapping_add(r * p.w_stride) as *const B;
        let mut r0 = 0;
        while r0 + 4 <= p.rows {
            // SAFETY: rows r0..r0 + 4 lie inside the panel (nb readable blocks each); the
            // outputs of those rows are the panel's.
            unsafe {
                let v = tokens_tile::<B, 4, MIN>(
                    &groups,
                    std::array::from_fn(|i| row(r0 + i)),
                    values,
                    d,
                    m,
                );
                for (i, v) in v.iter().enumerate() {
                    store_tokens(p, r0 + i, t0, v);
                }
            }
            r0 += 4;
        }
        while r0 < p.rows {
            // SAFETY: as above, for row r0 < rows.
            unsafe {
                let [v] = tokens_tile::<B, 1, MIN>(&groups, [row(r0)], values, d, m);
                store_tokens(p, r0, t0, &v);
            }
            r0 += 1;
        }
    }
    put_groups16(groups);
}

/// `R` rows against one packed group of 16 tokens: per block, each row's integer for every
/// token from eight `vpdpbusd` (two chains per row, so that several are in flight), then
/// `acc += isum·(dx·dy)` (`+ m·(Σy·dy)`) with one token per lane.
///
/// # Safety
/// Each `w[r]` points at `groups.len()` readable blocks `B`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn tokens_tile<B: Pod, const R: usize, const MIN: bool>(
    groups: &[TokenBlock<16>],
    w: [*const B; R],
    values: impl Fn(&B) -> __m256i,
    d: impl Fn(&B) -> [u8; 2],
    m: impl Fn(&B) -> [u8; 2],
) -> [[f32; 16]; R] {
    let zero = _mm512_setzero_si512();
    let mut acc = [_mm512_setzero_ps(); R];
    for (j, tb) in groups.iter().enumerate() {
        // SAFETY: `TokenBlock` is 64-byte aligned and its rows are 64 bytes.
        let y: [__m512i; 8] =
            std::array::from_fn(|g| unsafe { _mm512_load_si512(tb.y[g].as_ptr().cast()) });
        // SAFETY: as above (`start`, `dy` and `sydy` are 64-byte rows at 64-byte offsets).
        let (start, dy, sydy) = unsafe {
            (
                _mm512_load_si512(tb.start.as_ptr().cast()),
                _mm512_load_ps(tb.dy.as_ptr()),
                _mm512_load_ps(tb.sydy.as_ptr()),
            )
        };
        for r in 0..R {
            // SAFETY: block j < groups.len() of row r is readable (the contract above); blocks
            // are plain bytes of alignment 1.
            let x = unsafe { &*w[r].add(j) };
            let u = dwords(values(x));
            let (mut s0, mut s1) = (start, zero);
            for g in (0..8).step_by(2) {
                s0 = _mm512_dpbusd_epi32(s0, _mm512_set1_epi32(u[g]), y[g]);
                s1 = _mm512_dpbusd_epi32(s1, _mm512_set1_epi32(u[g + 1]), y[g + 1]);
            }
            let isum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            let dxdy = _mm512_mul_ps(_mm512_set1_ps(f16_scalar(&d(x))), dy);
            let mut t = _mm512_mul_ps(isum, dxdy);
            if MIN {
                t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_set1_ps(f16_scalar(&m(x))), sydy));
            }
            acc[r] = _mm512_add_ps(acc[r], t);
        }
    }
    acc.map(|v| {
        let mut out = [0f32; 16];
        // SAFETY: the store writes 16 f32, exactly `out`.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), v) };
        out
    })
}

/// 16 bytes of packed nibbles as 32 bytes: the low nibbles, then the high nibbles (the element
/// order of the Q8_0 block).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn nibbles(qs: &[u8; 16]) -> __m256i {
    let q = _mm256_broadcastsi128_si256(load128_of(qs));
    // Shift the high 128-bit lane (16-bit lanes 8..16).
    _mm256_and_si256(
        _mm256_mask_srli_epi16::<4>(q, 0xFF00, q),
        _mm256_set1_epi8(0x0F),
    )
}

/// A Q5 block's quants, 0..32: the nibbles plus 16 where bit j of `qh` is set.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn fifth_bit_quants(qh: &[u8; 4], qs: &[u8; 16]) -> __m256i {
    let q = nibbles(qs);
    let high = _cvtu32_mask32(u32::from_le_bytes(*qh));
    _mm256_mask_add_epi8(q, high, q, _mm256_set1_epi8(16))
}

/// Q4_0 × Q8_0 (see [`tokens_panel`]): nibbles, offset 8.
///
/// # Safety
/// As for [`crate::panel::PanelFn`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub unsafe fn panel_q4_0(p: &Panel) {
    let values = |x: &BlockQ4_0| nibbles(&x.qs);
    let dots8 = |n, w: [&[u8]; 8], a: &[u8], s: &[YSide]| legacy::dots8_q4_0(n, w, a, s);
    // SAFETY: the contract above, which is `tokens_panel`'s.
    unsafe { tokens_panel::<_, false>(p, 8, values, |x| x.d, |x| x.d, dots8) }
}

/// Q4_1 × Q8_0 (see [`tokens_panel`]): nibbles, scale and min.
///
/// # Safety
/// As for [`crate::panel::PanelFn`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub unsafe fn panel_q4_1(p: &Panel) {
    let values = |x: &BlockQ4_1| nibbles(&x.qs);
    let dots8 = |n, w: [&[u8]; 8], a: &[u8], s: &[YSide]| legacy::dots8_q4_1(n, w, a, s);
    // SAFETY: the contract above, which is `tokens_panel`'s.
    unsafe { tokens_panel::<_, true>(p, 0, values, |x| x.d, |x| x.m, dots8) }
}

/// Q5_0 × Q8_0 (see [`tokens_panel`]): five-bit quants, offset 16.
///
/// # Safety
/// As for [`crate::panel::PanelFn`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub unsafe fn panel_q5_0(p: &Panel) {
    let values = |x: &BlockQ5_0| fifth_bit_quants(&x.qh, &x.qs);
    let dots8 = |n, w: [&[u8]; 8], a: &[u8], s: &[YSide]| legacy::dots8_q5_0(n, w, a, s);
    // SAFETY: the contract above, which is `tokens_panel`'s.
    unsafe { tokens_panel::<_, false>(p, 16, values, |x| x.d, |x| x.d, dots8) }
}

/// Q5_1 × Q8_0 (see [`tokens_panel`]): five-bit quants, scale and min.
///
/// # Safety
/// As for [`crate::panel::PanelFn`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub unsafe fn panel_q5_1(p: &Panel) {
    let values = |x: &BlockQ5_1| fifth_bit_quants(&x.qh, &x.qs);
    let dots8 = |n, w: [&[u8]; 8], a: &[u8], s: &[YSide]| legacy::dots8_q5_1(n, w, a, s);
    // SAFETY: the contract above, which is `tokens_panel`'s.
    unsafe { tokens_panel::<_, true>(p, 0, values, |x| x.d, |x| x.m, dots8) }
}

/// Q8_0 × Q8_0 (see [`tokens_panel`]): the signed bytes made unsigned, offset 128.
///
/// # Safety
/// As for [`crate::panel::PanelFn`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub unsafe fn panel_q8_0(p: &Panel) {
    let k80 = _mm256_set1_epi8(0x80u8 as i8);
    let values = |x: &BlockQ8_0| _mm256_xor_si256(load256_of(&x.qs), k80);
    let dots8 = |n, w: [&[u8]; 8], a: &[u8], s: &[YSide]| avx2_dots8_q8_0(n, w, a, s);
    // SAFETY: the contract above, which is `tokens_panel`'s.
    unsafe { tokens_panel::<_, false>(p, 128, values, |x| x.d, |x| x.d, dots8) }
}

/// IQ4_NL × Q8_0 (see [`tokens_panel`]): the nibbles mapped through the 16 levels, made
/// unsigned (offset 128).
///
/// # Safety
/// As for [`crate::panel::PanelFn`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub unsafe fn panel_iq4_nl(p: &Panel) {
    let levels = _mm256_broadcastsi128_si256(load128_of(&KVALUES_IQ4NL));
    let k80 = _mm256_set1_epi8(0x80u8 as i8);
    let values =
        |x: &BlockIq4Nl| _mm256_xor_si256(_mm256_shuffle_epi8(levels, nibbles(&x.qs)), k80);
    let dots8 = |n, w: [&[u8]; 8], a: &[u8], s: &[YSide]| legacy::dots8_iq4_nl(n, w, a, s);
    // SAFETY: the contract above, which is `tokens_panel`'s.
    unsafe { tokens_panel::<_, false>(p, 128, values, |x| x.d, |x| x.d, dots8) }
}

q2k_rows!(
    q2k_tile,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    super::kquants::dpwssd
);

dot_tile!(
    q2k_dots,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    super::kquants::dot_q2_k_impl,
    BlockQ2K,
    BlockQ8K,
    QK_K
);

q5k_rows!(
    q5k_tile,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    super::kquants::dpwssd
);

dot_tile!(
    q5k_dots,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    super::kquants::dot_q5_k_impl,
    BlockQ5K,
    BlockQ8K,
    QK_K
);

q3k_rows!(
    q3k_tile,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    super::kquants::dpwssd
);

dot_tile!(
    q3k_dots,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    super::kquants::dot_q3_k_impl,
    BlockQ3K,
    BlockQ8K,
    QK_K
);

chunk_row_lanes_kernels!("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c";
    chunk_rows_q4_0 = legacy::dots8_q4_0,
    chunk_rows_q4_1 = legacy::dots8_q4_1,
    chunk_rows_q5_0 = legacy::dots8_q5_0,
    chunk_rows_q5_1 = legacy::dots8_q5_1,
    chunk_rows_q8_0 = avx2_dots8_q8_0,
    chunk_rows_iq4_nl = legacy::dots8_iq4_nl,
);
