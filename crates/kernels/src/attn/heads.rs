//! Several query heads against the same keys and values (grouped-query attention's group, or
//! latent attention's heads over their one shared latent): each key or value row is loaded
//! once for a block of heads instead of once per head. Each head's scores and sums are those
//! of [`super::scores`] and [`super::weighted_sum`] alone, bit for bit: every (head, key) and
//! (head, column) accumulator runs the single-head loop's operations in its order, so a head
//! does not depend on which others share its block (tensor-parallel ranks split heads
//! differently from one node).

use super::{Rows, scores, weighted_sum};
use crate::Isa;

/// `out[h * out_stride + j] = scale · (q_h · k_j)` for `h < heads`, where query `h` is
/// `q[h * q_stride..][..keys.d]`.
#[allow(clippy::too_many_arguments)]
pub fn scores_heads(
    isa: Isa,
    q: &[f32],
    q_stride: usize,
    heads: usize,
    keys: Rows,
    scale: f32,
    out: &mut [f32],
    out_stride: usize,
) {
    if heads == 0 {
        return;
    }
    keys.check();
    assert!(
        q_stride >= keys.d
            && q.len() >= (heads - 1) * q_stride + keys.d
            && out_stride >= keys.n
            && out.len() >= (heads - 1) * out_stride + keys.n,
        "{heads} heads of queries ({} values, stride {q_stride}) or scores ({} values, stride {out_stride}) for {} keys of {}",
        q.len(),
        out.len(),
        keys.n,
        keys.d
    );
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx512 && Isa::Avx512.is_supported() {
        // SAFETY: the CPU has the AVX-512 level's features (checked); `keys.check()` and the
        // assert above are the bounds contract.
        return unsafe {
            x86::scores_heads_avx512(q, q_stride, heads, keys, scale, out, out_stride)
        };
    } else if isa >= Isa::Avx2 && Isa::Avx2.is_supported() {
        // SAFETY: as above, for AVX2.
        return unsafe { x86::scores_heads_avx2(q, q_stride, heads, keys, scale, out, out_stride) };
    }
    for h in 0..heads {
        let out_h = &mut out[h * out_stride..h * out_stride + keys.n];
        scores(isa, &q[h * q_stride..], keys, scale, out_h);
    }
}

/// `out_h += Σ_j p_h[j] · v_j` for `h < heads`, where `p_h` is `p[h * p_stride..][..values.n]`
/// and `out_h` is `out[h * out_stride..][..values.d]`.
pub fn weighted_sum_heads(
    isa: Isa,
    p: &[f32],
    p_stride: usize,
    heads: usize,
    values: Rows,
    out: &mut [f32],
    out_stride: usize,
) {
    if heads == 0 {
        return;
    }
    values.check();
    assert!(
        p_stride >= values.n
            && p.len() >= (heads - 1) * p_stride + values.n
            && out_stride >= values.d
            && out.len() >= (heads - 1) * out_stride + values.d,
        "{heads} heads of weights ({} values, stride {p_stride}) or outputs ({} values, stride {out_stride}) for {} rows of {}",
        p.len(),
        out.len(),
        values.n,
        values.d
    );
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx512 && Isa::Avx512.is_supported() {
        // SAFETY: the CPU has the AVX-512 level's features (checked); `values.check()` and the
        // assert above are the bounds contract.
        return unsafe {
            x86::weighted_sum_heads_avx512(p, p_stride, heads, values, out, out_stride)
        };
    } else if isa >= Isa::Avx2 && Isa::Avx2.is_supported() {
        // SAFETY: as above, for AVX2.
        return unsafe {
            x86::weighted_sum_heads_avx2(p, p_stride, heads, values, out, out_stride)
        };
    }
    for h in 0..heads {
        let out_h = &mut out[h * out_stride..h * out_stride + values.d];
        weighted_sum(isa, &p[h * p_stride..], values, out_h);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::Rows;
    use super::super::x86::{load8, load16};

    /// Heads per block: each loaded key or value vector serves this many heads.
    const HEADS: usize = 4;
    /// Keys (scores) or column vectors (sums) per step of a block, each with its own
    /// accumulator per head: HEADS × this many accumulators stay in registers.
    const KEYS_512: usize = 4;
    const KEYS_256: usize = 2;

    /// Calls `$f::<H>` on heads `h0..h0 + H` for blocks of [`HEADS`], then the rest.
    macro_rules! by_head_blocks {
        ($heads:expr, |$h0:ident, $h:ident| $body:expr) => {{
            let mut $h0 = 0;
            while $h0 < $heads {
                let $h = HEADS.min($heads - $h0);
                $body;
                $h0 += $h;
            }
        }};
    }

    /// [`super::scores_heads`] with AVX-512.
    ///
    /// # Safety
    /// `keys` passed `Rows::check`, the queries and outputs of every head are in bounds (the
    /// assert of `scores_heads`), and the CPU has the features this function is compiled for.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
    pub unsafe fn scores_heads_avx512(
        q: &[f32],
        q_stride: usize,
        heads: usize,
        keys: Rows,
        scale: f32,
        out: &mut [f32],
        out_stride: usize,
    ) {
        by_head_blocks!(heads, |h0, h| {
            // SAFETY: heads h0..h0 + h are in bounds (the contract above).
            unsafe {
                match h {
                    4 => scores_block_512::<4>(q, q_stride, h0, keys, scale, out, out_stride),
                    3 => scores_block_512::<3>(q, q_stride, h0, keys, scale, out, out_stride),
                    2 => scores_block_512::<2>(q, q_stride, h0, keys, scale, out, out_stride),
                    _ => scores_block_512::<1>(q, q_stride, h0, keys, scale, out, out_stride),
                }
            }
        });
    }

    /// Heads `h0..h0 + H` of [`scores_heads_avx512`]: per key, `super::super::x86::scores_avx512`'s
    /// accumulator (16 lanes over the columns in order, `_mm512_reduce_add_ps`, the columns
    /// past the last 16 added one by one, times `scale`).
    ///
    /// # Safety
    /// As for [`scores_heads_avx512`], for these heads.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
    unsafe fn scores_block_512<const H: usize>(
        q: &[f32],
        q_stride: usize,
        h0: usize,
        keys: Rows,
        scale: f32,
        out: &mut [f32],
        out_stride: usize,
    ) {
        let d16 = keys.d / 16 * 16;
        let qs: [&[f32]; H] = std::array::from_fn(|h| &q[(h0 + h) * q_stride..]);
        let mut j = 0;
        while j < keys.n {
            let m = KEYS_512.min(keys.n - j);
            let mut acc = [[_mm512_setzero_ps(); KEYS_512]; H];
            for c in (0..d16).step_by(16) {
                // SAFETY: j + u < n and c + 16 <= d (keys passed `Rows::check`).
                let k: [__m512; KEYS_512] =
                    std::array::from_fn(|u| unsafe { load16(&keys, j + u.min(m - 1), c) });
                for h in 0..H {
                    // SAFETY: c + 16 <= d <= the query's length (the contract above).
                    let qc = unsafe { _mm512_loadu_ps(qs[h].as_ptr().add(c)) };
                    for u in 0..m {
                        acc[h][u] = _mm512_fmadd_ps(qc, k[u], acc[h][u]);
                    }
                }
            }
            for h in 0..H {
                for u in 0..m {
                    let mut s = _mm512_reduce_add_ps(acc[h][u]);
                    for c in d16..keys.d {
                        s += qs[h][c] * keys.value(j + u, c);
                    }
                    out[(h0 + h) * out_stride + j + u] = s * scale;
                }
            }
            j += m;
        }
    }

    /// [`super::scores_heads`] with AVX2.
    ///
    /// # Safety
    /// As for [`scores_heads_avx512`], with AVX2, FMA and F16C.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scores_heads_avx2(
        q: &[f32],
        q_stride: usize,
        heads: usize,
        keys: Rows,
        scale: f32,
        out: &mut [f32],
        out_stride: usize,
    ) {
        by_head_blocks!(heads, |h0, h| {
            // SAFETY: heads h0..h0 + h are in bounds (the contract above).
            unsafe {
                match h {
                    4 => scores_block_256::<4>(q, q_stride, h0, keys, scale, out, out_stride),
                    3 => scores_block_256::<3>(q, q_stride, h0, keys, scale, out, out_stride),
                    2 => scores_block_256::<2>(q, q_stride, h0, keys, scale, out, out_stride),
                    _ => scores_block_256::<1>(q, q_stride, h0, keys, scale, out, out_stride),
                }
            }
        });
    }

    /// Heads `h0..h0 + H` of [`scores_heads_avx2`], per key `scores_avx2`'s accumulator and
    /// reduction.
    ///
    /// # Safety
    /// As for [`scores_heads_avx2`], for these heads.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scores_block_256<const H: usize>(
        q: &[f32],
        q_stride: usize,
        h0: usize,
        keys: Rows,
        scale: f32,
        out: &mut [f32],
        out_stride: usize,
    ) {
        let d8 = keys.d / 8 * 8;
        let qs: [&[f32]; H] = std::array::from_fn(|h| &q[(h0 + h) * q_stride..]);
        let mut j = 0;
        while j < keys.n {
            let m = KEYS_256.min(keys.n - j);
            let mut acc = [[_mm256_setzero_ps(); KEYS_256]; H];
            for c in (0..d8).step_by(8) {
                // SAFETY: j + u < n and c + 8 <= d (keys passed `Rows::check`).
                let k: [__m256; KEYS_256] =
                    std::array::from_fn(|u| unsafe { load8(&keys, j + u.min(m - 1), c) });
                for h in 0..H {
                    // SAFETY: c + 8 <= d <= the query's length (the contract above).
                    let qc = unsafe { _mm256_loadu_ps(qs[h].as_ptr().add(c)) };
                    for u in 0..m {
                        acc[h][u] = _mm256_fmadd_ps(qc, k[u], acc[h][u]);
                    }
                }
            }
            for h in 0..H {
                for u in 0..m {
                    let a = acc[h][u];
                    let x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
                    let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
                    let mut s = _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
                    for c in d8..keys.d {
                        s += qs[h][c] * keys.value(j + u, c);
                    }
                    out[(h0 + h) * out_stride + j + u] = s * scale;
                }
            }
            j += m;
        }
    }

    /// [`super::weighted_sum_heads`] with AVX-512.
    ///
    /// # Safety
    /// `values` passed `Rows::check`, the weights and outputs of every head are in bounds (the
    /// assert of `weighted_sum_heads`), and the CPU has the features this function is compiled
    /// for.
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
    pub unsafe fn weighted_sum_heads_avx512(
        p: &[f32],
        p_stride: usize,
        heads: usize,
        values: Rows,
        out: &mut [f32],
        out_stride: usize,
    ) {
        by_head_blocks!(heads, |h0, h| {
            // SAFETY: heads h0..h0 + h are in bounds (the contract above).
            unsafe {
                match h {
                    4 => sums_block_512::<4>(p, p_stride, h0, values, out, out_stride),
                    3 => sums_block_512::<3>(p, p_stride, h0, values, out, out_stride),
                    2 => sums_block_512::<2>(p, p_stride, h0, values, out, out_stride),
                    _ => sums_block_512::<1>(p, p_stride, h0, values, out, out_stride),
                }
            }
        });
    }

    /// Heads `h0..h0 + H` of [`weighted_sum_heads_avx512`]: per column, `weighted_sum_avx512`'s
    /// chain (from the output's value, one FMA per row in order; columns past the last 16
    /// one by one).
    ///
    /// # Safety
    /// As for [`weighted_sum_heads_avx512`], for these heads.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
    unsafe fn sums_block_512<const H: usize>(
        p: &[f32],
        p_stride: usize,
        h0: usize,
        values: Rows,
        out: &mut [f32],
        out_stride: usize,
    ) {
        let d16 = values.d / 16 * 16;
        let ps: [&[f32]; H] = std::array::from_fn(|h| &p[(h0 + h) * p_stride..]);
        let o: [*mut f32; H] = std::array::from_fn(|h| out[(h0 + h) * out_stride..].as_mut_ptr());
        let mut c0 = 0;
        while c0 < d16 {
            let m = KEYS_512.min((d16 - c0) / 16);
            let mut acc = [[_mm512_setzero_ps(); KEYS_512]; H];
            for h in 0..H {
                for u in 0..m {
                    // SAFETY: c0 + 16u + 16 <= d16 <= d, inside head h's output (the contract).
                    acc[h][u] = unsafe { _mm512_loadu_ps(o[h].add(c0 + 16 * u)) };
                }
            }
            for j in 0..values.n {
                // SAFETY: j < n, c0 + 16u + 16 <= d, and `values` passed `Rows::check`.
                let v: [__m512; KEYS_512] =
                    std::array::from_fn(|u| unsafe { load16(&values, j, c0 + 16 * u.min(m - 1)) });
                for h in 0..H {
                    let pv = _mm512_set1_ps(ps[h][j]);
                    for u in 0..m {
                        acc[h][u] = _mm512_fmadd_ps(pv, v[u], acc[h][u]);
                    }
                }
            }
            for h in 0..H {
                for u in 0..m {
                    // SAFETY: as for the loads of `acc`.
                    unsafe { _mm512_storeu_ps(o[h].add(c0 + 16 * u), acc[h][u]) };
                }
            }
            c0 += 16 * m;
        }
        for h in 0..H {
            for c in d16..values.d {
                let mut x = out[(h0 + h) * out_stride + c];
                for (j, &pj) in ps[h].iter().enumerate().take(values.n) {
                    x += pj * values.value(j, c);
                }
                out[(h0 + h) * out_stride + c] = x;
            }
        }
    }

    /// [`super::weighted_sum_heads`] with AVX2.
    ///
    /// # Safety
    /// As for [`weighted_sum_heads_avx512`], with AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn weighted_sum_heads_avx2(
        p: &[f32],
        p_stride: usize,
        heads: usize,
        values: Rows,
        out: &mut [f32],
        out_stride: usize,
    ) {
        by_head_blocks!(heads, |h0, h| {
            // SAFETY: heads h0..h0 + h are in bounds (the contract above).
            unsafe {
                match h {
                    4 => sums_block_256::<4>(p, p_stride, h0, values, out, out_stride),
                    3 => sums_block_256::<3>(p, p_stride, h0, values, out, out_stride),
                    2 => sums_block_256::<2>(p, p_stride, h0, values, out, out_stride),
                    _ => sums_block_256::<1>(p, p_stride, h0, values, out, out_stride),
                }
            }
        });
    }

    /// Heads `h0..h0 + H` of [`weighted_sum_heads_avx2`], per column `weighted_sum_avx2`'s
    /// chain.
    ///
    /// # Safety
    /// As for [`weighted_sum_heads_avx2`], for these heads.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn sums_block_256<const H: usize>(
        p: &[f32],
        p_stride: usize,
        h0: usize,
        values: Rows,
        out: &mut [f32],
        out_stride: usize,
    ) {
        let d8 = values.d / 8 * 8;
        let ps: [&[f32]; H] = std::array::from_fn(|h| &p[(h0 + h) * p_stride..]);
        let o: [*mut f32; H] = std::array::from_fn(|h| out[(h0 + h) * out_stride..].as_mut_ptr());
        let mut c0 = 0;
        while c0 < d8 {
            let m = KEYS_256.min((d8 - c0) / 8);
            let mut acc = [[_mm256_setzero_ps(); KEYS_256]; H];
            for h in 0..H {
                for u in 0..m {
                    // SAFETY: c0 + 8u + 8 <= d8 <= d, inside head h's output (the contract).
                    acc[h][u] = unsafe { _mm256_loadu_ps(o[h].add(c0 + 8 * u)) };
                }
            }
            for j in 0..values.n {
                // SAFETY: j < n, c0 + 8u + 8 <= d, and `values` passed `Rows::check`.
                let v: [__m256; KEYS_256] =
                    std::array::from_fn(|u| unsafe { load8(&values, j, c0 + 8 * u.min(m - 1)) });
                for h in 0..H {
                    let pv = _mm256_set1_ps(ps[h][j]);
                    for u in 0..m {
                        acc[h][u] = _mm256_fmadd_ps(pv, v[u], acc[h][u]);
                    }
                }
            }
            for h in 0..H {
                for u in 0..m {
                    // SAFETY: as for the loads of `acc`.
                    unsafe { _mm256_storeu_ps(o[h].add(c0 + 8 * u), acc[h][u]) };
                }
            }
            c0 += 8 * m;
        }
        for h in 0..H {
            for c in d8..values.d {
                let mut x = out[(h0 + h) * out_stride + c];
                for (j, &pj) in ps[h].iter().enumerate().take(values.n) {
                    x += pj * values.value(j, c);
                }
                out[(h0 + h) * out_stride + c] = x;
            }
        }
    }
}
