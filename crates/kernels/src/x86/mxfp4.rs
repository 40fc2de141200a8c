//! MXFP4 × Q8_0 (gpt-oss experts): the single-row dot and the panel kernel, one algorithm, so
//! every panel value equals the dot bit for bit, in two levels that give the same bits: AVX2,
//! and AVX-512 VNNI (`vpdpbusd` for the integer steps, 256-bit registers).
//!
//! The old loop spent more instructions on each 17-byte block's two scales than on its 32
//! products (eight scalar gathers per batch for the E8M0 and f16 scales each, a lane permute
//! per block) and moved the weight signs onto the activations with two `vpsignb`. Here:
//! - **Unsigned weights**: the table gives `w + 12` (0..24), so `vpmaddubsw` takes the weights
//!   as they come and the offset is removed as `12·Σy`, a per-token constant of each block.
//! - **Two blocks per register**: blocks j and j+1 share one register of nibbles (low nibbles of
//!   both, then high nibbles of both), so one `vpmaddwd`, one conversion and one FMA serve two
//!   blocks, with the pair's scales `[d_j ×4 | d_j+1 ×4]`.
//! - **Activations prepared once per panel**: each token's Q8_0 row is rearranged into the
//!   pair layout (`[y_j lo | y_j+1 lo]`, `[y_j hi | y_j+1 hi]`), its `12·Σy` pair sums and its f16
//!   scales as f32, in a thread-local buffer that every weight row of the panel reads.
//!
//! Lane sums stay exact: a `vpmaddubsw` pair is at most 2·24·127 = 6096, the two halves' sum
//! 12192, less the offset (at most 6096) still inside i16.
//!
//! Float order per (row, token): per group of 8 blocks `d8 = dx8 · dy8`; per pair q, `acc[q % 2]
//! += perm(d8, q) · cvt(lanes)`; the result is `hsum(acc[0] + acc[1])`. Every tile shape runs
//! exactly these operations per (row, token).

// Tiles index several per-row and per-token arrays with the same loop variable.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::E8M0_HALF;
use super::simd256::{hsum_ps, load128, load128_of};
use crate::blocks::{BlockMxfp4, BlockQ8_0, KVALUES_MXFP4, f16_bytes};
use crate::panel::Panel;

/// 8 blocks = 4 pairs: per pair `[y lo, y hi, 12·Σy pairs]`, then the group's 8 f16 scales as f32.
const GROUP_VECS: usize = 4 * 3 + 1;

/// `KVALUES_MXFP4 + 12`: the E2M1 values (doubled) made unsigned.
static KVALUES_OFFSET: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (KVALUES_MXFP4[i] + 12) as u8;
        i += 1;
    }
    t
};

thread_local! {
    static PREPARED: RefCell<Vec<__m256i>> = const { RefCell::new(Vec::new()) };
}

/// Vectors one token's prepared row of `nb` blocks takes.
fn prepared_len(nb: usize) -> usize {
    nb.div_ceil(8) * GROUP_VECS
}

/// Largest token tile: 2 accumulators per token, 16 registers.
const MAX_T: usize = 4;

/// The kernel of one level: `prepare`, `tile`, `pair_step`, `dot` and `panel`, compiled with
/// `$features`. The level's module supplies the two integer steps that differ, as
/// `#[inline]` functions named `block_offsets` (a block pair's `12·Σy` in the form the level's
/// lanes take it) and `lane_sums` (one pair's products less that offset, in i32 lanes). Both
/// levels' lane sums are exact integers, so the levels give the same bits.
macro_rules! mxfp4_level {
    ($features:tt) => {
        /// Rearranges the Q8_0 row `a` (`nb` blocks) into `out` (`prepared_len(nb)` vectors).
        ///
        /// # Safety
        /// `a` points at `nb` readable Q8_0 blocks.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn prepare(nb: usize, a: *const BlockQ8_0, out: &mut [__m256i]) {
            let k12 = _mm256_set1_epi8(12);
            let zero = _mm_setzero_si128();
            for g in 0..nb.div_ceil(8) {
                let vecs = &mut out[g * GROUP_VECS..(g + 1) * GROUP_VECS];
                let mut dy = [0f32; 8];
                for q in 0..4 {
                    let j = 8 * g + 2 * q;
                    // Halves of block j (or zeros past the row's end).
                    let part = |j: usize, h: usize| -> __m128i {
                        if j < nb {
                            // SAFETY: block j < nb is readable (the contract above); bytes 16h..16h + 16
                            // of its 32 quants (h < 2).
                            unsafe { load128(((*a.add(j)).qs.as_ptr() as *const u8).add(16 * h)) }
                        } else {
                            zero
                        }
                    };
                    let lo = _mm256_set_m128i(part(j + 1, 0), part(j, 0));
                    let hi = _mm256_set_m128i(part(j + 1, 1), part(j, 1));
                    let corr = block_offsets(k12, lo, hi);
                    vecs[3 * q] = lo;
                    vecs[3 * q + 1] = hi;
                    vecs[3 * q + 2] = corr;
                    for b in 0..2 {
                        if j + b < nb {
                            // SAFETY: block j + b < nb is readable (the contract above).
                            dy[2 * q + b] = f16_bytes(unsafe { (*a.add(j + b)).d });
                        }
                    }
                }
                // SAFETY: `dy` holds 8 floats.
                vecs[12] = _mm256_castps_si256(unsafe { _mm256_loadu_ps(dy.as_ptr()) });
            }
        }

        /// R weight rows × T prepared tokens.
        ///
        /// # Safety
        /// Each `w[r]` points at `nb` readable MXFP4 blocks; each `a[t]` at `prepared_len(nb)`
        /// vectors made by [`prepare`] for `nb` blocks.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn tile<const R: usize, const T: usize>(
            nb: usize,
            w: [*const BlockMxfp4; R],
            a: [*const __m256i; T],
        ) -> [[f32; T]; R] {
            let m4 = _mm256_set1_epi8(0x0F);
            let table = _mm256_broadcastsi128_si256(load128_of(&KVALUES_OFFSET));
            let mut acc = [[[_mm256_setzero_ps(); 2]; T]; R];
            let full = nb / 8;
            for g in 0..nb.div_ceil(8) {
                // The half scales `2^(e-128)` of the group's blocks (zeros past the row's end).
                let mut dx = [_mm256_setzero_ps(); R];
                for r in 0..R {
                    if g < full {
                        // SAFETY: blocks 8g..8g + 8 ≤ nb of row r are readable (the contract above).
                        let e = |k: usize| E8M0_HALF[unsafe { (*w[r].add(8 * g + k)).e } as usize];
                        dx[r] = _mm256_setr_ps(e(0), e(1), e(2), e(3), e(4), e(5), e(6), e(7));
                        continue;
                    }
                    let mut e = [0f32; 8];
                    for k in 0..nb - 8 * g {
                        // SAFETY: block 8g + k < nb of row r is readable (the contract above).
                        e[k] = E8M0_HALF[unsafe { (*w[r].add(8 * g + k)).e } as usize];
                    }
                    // SAFETY: `e` holds 8 floats.
                    dx[r] = unsafe { _mm256_loadu_ps(e.as_ptr()) };
                }
                let d: [[__m256; T]; R] = std::array::from_fn(|r| {
                    std::array::from_fn(|t| {
                        // SAFETY: vector 13g + 12 of a prepared row of `nb` blocks (the contract above).
                        let dy = unsafe { *a[t].add(g * GROUP_VECS + 12) };
                        _mm256_mul_ps(dx[r], _mm256_castsi256_ps(dy))
                    })
                });
                // Written out so that the pair index is a constant in each step.
                // SAFETY: every step gets the contract of this function (rows of `nb` blocks, prepared
                // tokens of `nb` blocks); `pair_step` reads blocks j, j + 1 < nb of each row in a full
                // group and checks the bounds in the last one.
                unsafe {
                    if g < full {
                        pair_step::<R, T, 0, true>(nb, g, &w, &a, &d, &mut acc, table, m4);
                        pair_step::<R, T, 1, true>(nb, g, &w, &a, &d, &mut acc, table, m4);
                        pair_step::<R, T, 2, true>(nb, g, &w, &a, &d, &mut acc, table, m4);
                        pair_step::<R, T, 3, true>(nb, g, &w, &a, &d, &mut acc, table, m4);
                    } else {
                        pair_step::<R, T, 0, false>(nb, g, &w, &a, &d, &mut acc, table, m4);
                        pair_step::<R, T, 1, false>(nb, g, &w, &a, &d, &mut acc, table, m4);
                        pair_step::<R, T, 2, false>(nb, g, &w, &a, &d, &mut acc, table, m4);
                        pair_step::<R, T, 3, false>(nb, g, &w, &a, &d, &mut acc, table, m4);
                    }
                }
            }
            acc.map(|row| row.map(|[a0, a1]| hsum_ps(_mm256_add_ps(a0, a1))))
        }

        /// Pair `Q` (blocks `8g + 2Q`, `+1`) of group `g` for every (row, token). `FULL`: the group has
        /// all 8 blocks, so no bound is checked.
        ///
        /// # Safety
        /// As for [`tile`].
        #[inline]
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = $features)]
        unsafe fn pair_step<const R: usize, const T: usize, const Q: usize, const FULL: bool>(
            nb: usize,
            g: usize,
            w: &[*const BlockMxfp4; R],
            a: &[*const __m256i; T],
            d: &[[__m256; T]; R],
            acc: &mut [[[__m256; 2]; T]; R],
            table: __m256i,
            m4: __m256i,
        ) {
            let j = 8 * g + 2 * Q;
            if !FULL && j >= nb {
                return;
            }
            let second = FULL || j + 1 < nb;
            // SAFETY: see the loads below.
            unsafe {
                let idx = _mm256_setr_epi32(
                    2 * Q as i32,
                    2 * Q as i32,
                    2 * Q as i32,
                    2 * Q as i32,
                    2 * Q as i32 + 1,
                    2 * Q as i32 + 1,
                    2 * Q as i32 + 1,
                    2 * Q as i32 + 1,
                );
                let u: [[__m256i; 2]; R] = std::array::from_fn(|r| {
                    // SAFETY: block j < nb of row r is readable, and block j + 1 when `second` (the
                    // contract of `tile`); 16 bytes of nibbles each.
                    let x0 = load128((*w[r].add(j)).qs.as_ptr());
                    let x1 = if second {
                        load128((*w[r].add(j + 1)).qs.as_ptr())
                    } else {
                        _mm_setzero_si128()
                    };
                    let v = _mm256_set_m128i(x1, x0);
                    let lo = _mm256_and_si256(v, m4);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                    [
                        _mm256_shuffle_epi8(table, lo),
                        _mm256_shuffle_epi8(table, hi),
                    ]
                });
                let base = g * GROUP_VECS + 3 * Q;
                for t in 0..T {
                    // SAFETY: vectors 13g + 3Q.. + 3 of a prepared row (the contract of `tile`).
                    let (ylo, yhi, corr) =
                        (*a[t].add(base), *a[t].add(base + 1), *a[t].add(base + 2));
                    for r in 0..R {
                        let s = lane_sums(u[r][0], u[r][1], ylo, yhi, corr);
                        let dq = _mm256_permutevar8x32_ps(d[r][t], idx);
                        acc[r][t][Q % 2] =
                            _mm256_fmadd_ps(dq, _mm256_cvtepi32_ps(s), acc[r][t][Q % 2]);
                    }
                }
            }
        }

        /// The single-row dot of `n` elements.
        ///
        /// # Safety
        /// `w` and `a` hold `n / 32` MXFP4 and Q8_0 blocks; the CPU has AVX2, FMA and F16C.
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
            let nb = n / 32;
            let w = w.as_ptr() as *const BlockMxfp4;
            let a = a.as_ptr() as *const BlockQ8_0;
            with_prepared(prepared_len(nb), |buf| {
                // SAFETY: the contract above; `buf` holds `prepared_len(nb)` vectors. The closure runs
                // in this function's frame on the same CPU, whose features the contract guarantees.
                unsafe {
                    prepare(nb, a, buf);
                    tile::<1, 1>(nb, [w], [buf.as_ptr()])[0][0]
                }
            })
        }

        /// The panel kernel (`crate::panel::PanelFn`): tokens in tiles of up to 4, prepared once per
        /// tile; each weight row streamed once per tile.
        ///
        /// # Safety
        /// As for [`crate::panel::PanelFn`], with AVX2, FMA and F16C.
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn panel(p: &Panel) {
            let nb = p.k / 32;
            let per = prepared_len(nb);
            // Decode streams each row once: ask for the bytes ahead (`crate::prefetch`).
            let ahead = crate::prefetch::decode_prefetch(p.n);
            with_prepared(per * MAX_T, |buf| {
                let mut t0 = 0;
                while t0 < p.n {
                    let tn = (p.n - t0).min(MAX_T);
                    for t in 0..tn {
                        // SAFETY: token t0 + t < n is readable (`nb` blocks at `a + (t0 + t) · stride`,
                        // the panel contract); the CPU has the features (the contract).
                        unsafe {
                            prepare(
                                nb,
                                p.a.add((t0 + t) * p.a_stride) as *const BlockQ8_0,
                                &mut buf[t * per..(t + 1) * per],
                            )
                        };
                    }
                    let toks: [*const __m256i; MAX_T] =
                        std::array::from_fn(|t| buf[t.min(tn - 1) * per..].as_ptr());
                    for r in 0..p.rows {
                        crate::prefetch::panel_rows_ahead(p, r, 1, ahead);
                        // SAFETY: row r < rows holds `nb` blocks (the panel contract).
                        let w = [unsafe { p.w.add(r * p.w_stride) } as *const BlockMxfp4];
                        // SAFETY: `w` and the prepared tokens satisfy `tile`'s contract; the outputs
                        // (t0 + t, r) lie inside the panel, writable by its contract.
                        unsafe {
                            match tn {
                                1 => store(p, r, t0, &tile::<1, 1>(nb, w, [toks[0]])[0]),
                                2 => store(p, r, t0, &tile::<1, 2>(nb, w, [toks[0], toks[1]])[0]),
                                3 => store(
                                    p,
                                    r,
                                    t0,
                                    &tile::<1, 3>(nb, w, [toks[0], toks[1], toks[2]])[0],
                                ),
                                _ => store(p, r, t0, &tile::<1, 4>(nb, w, toks)[0]),
                            }
                        }
                    }
                    t0 += tn;
                }
            })
        }
    };
}

/// AVX2: `vpmaddubsw` products in i16 (exact: see the module comment), the offset removed in
/// i16, `vpmaddwd` with ones to i32.
mod avx2_level {
    use super::*;

    /// The pair's `12·Σy` per i16 lane (the lanes `lane_sums` subtracts them from).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn block_offsets(k12: __m256i, lo: __m256i, hi: __m256i) -> __m256i {
        _mm256_add_epi16(_mm256_maddubs_epi16(k12, lo), _mm256_maddubs_epi16(k12, hi))
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn lane_sums(u0: __m256i, u1: __m256i, ylo: __m256i, yhi: __m256i, corr: __m256i) -> __m256i {
        let p = _mm256_add_epi16(_mm256_maddubs_epi16(u0, ylo), _mm256_maddubs_epi16(u1, yhi));
        _mm256_madd_epi16(_mm256_sub_epi16(p, corr), _mm256_set1_epi16(1))
    }

    mxfp4_level!("avx2,fma,f16c");
}

/// AVX-512 VNNI on 256-bit registers: `vpdpbusd` sums four unsigned-weight products straight
/// into i32 lanes that start at `−12·Σy`, two instructions where AVX2 takes five. The i32 lanes
/// are the AVX2 ones exactly, and the float steps are shared, so the bits are the same.
mod vnni_level {
    use super::*;

    /// The pair's `−12·Σy` per i32 lane: the accumulator `lane_sums` starts from.
    #[inline]
    #[target_feature(enable = "avx2,avx512vl,avx512vnni")]
    fn block_offsets(k12: __m256i, lo: __m256i, hi: __m256i) -> __m256i {
        let zero = _mm256_setzero_si256();
        let sum = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(zero, k12, lo), k12, hi);
        _mm256_sub_epi32(zero, sum)
    }

    #[inline]
    #[target_feature(enable = "avx2,avx512vl,avx512vnni")]
    fn lane_sums(u0: __m256i, u1: __m256i, ylo: __m256i, yhi: __m256i, corr: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(corr, u0, ylo), u1, yhi)
    }

    mxfp4_level!("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni");
}

/// The thread's buffer of prepared activations, at least `len` vectors, for `f`.
fn with_prepared<R>(len: usize, f: impl FnOnce(&mut [__m256i]) -> R) -> R {
    PREPARED.with_borrow_mut(|buf| {
        if buf.len() < len {
            // SAFETY: an all-zero bit pattern is a valid `__m256i`.
            buf.resize(len, unsafe { std::mem::zeroed() });
        }
        f(&mut buf[..len])
    })
}

// Handed out only after `crate::isa` detected each level's features: the AVX2 form by the
// AVX2 level, the VNNI form by the AVX-512 level (whose features include AVX2, FMA and F16C).
super::dot_wrapper!(pub(crate) dot_checked => avx2_level::dot, gguf::GgmlType::Mxfp4, gguf::GgmlType::Q8_0);
super::dot_wrapper!(pub(crate) dot_vnni_checked => vnni_level::dot, gguf::GgmlType::Mxfp4, gguf::GgmlType::Q8_0);
pub(crate) use avx2_level::panel;
pub(crate) use vnni_level::panel as panel_vnni;

/// Writes one row's values for tokens `t0..t0 + T`.
///
/// # Safety
/// Row `r` and those tokens lie inside the panel `p`.
#[inline(always)]
unsafe fn store<const T: usize>(p: &Panel, r: usize, t0: usize, v: &[f32; T]) {
    for (t, &x) in v.iter().enumerate() {
        // SAFETY: the contract above; the caller of the panel kernel guarantees the outputs
        // writable and unaliased.
        unsafe { *p.out.add((t0 + t) * p.out_stride + r) = x };
    }
}
