//! Several query heads against the same keys and values (grouped-query attention's group, or
//! latent attention's heads over their one shared latent): each key or value row is loaded
//! once for a block of heads instead of once per head. Each head's scores and sums are those
//! of [`super::scores`] and [`super::weighted_sum`] alone, bit for bit: every (head, key) and
//! (head, column) accumulator runs the single-head loop's operations in its order, so a head
//! does not depend on which others share its block (tensor-parallel ranks split heads
//! differently from one node).

use super::{Rows, scores, softmax_with_sink, weighted_sum};
use crate::Isa;

/// Bytes of key (or value) rows that [`attend_heads`] runs every head over before the next
/// rows: a tile that stays in L2 while all the heads' blocks read it, so many heads over one
/// long set of rows (latent attention's 64–128 heads over thousands of positions) read the rows
/// from memory once instead of once per block of heads.
const ROW_TILE_BYTES: usize = 64 << 10;

/// Heads whose scores [`attend_heads`] keeps at once: enough to read the rows a few times per
/// query instead of once per block of four heads, few enough that the scores stay in L2 beside
/// a tile of rows (all 64–128 heads' scores over thousands of keys did not, and were slower).
const HEAD_GROUP: usize = 16;

/// Attention of `heads` queries over the same keys and values: head `h`'s output
/// `out[h * out_stride..][..values.d]` is `Σ_j p_h[j] · v_j` with `p_h` the softmax of its
/// scores (and of `sinks[h]`, when given), each head's bits those of [`scores`],
/// [`softmax_with_sink`] and [`weighted_sum`] alone. `scratch` holds the scores between the
/// steps (any vector; it is resized).
#[allow(clippy::too_many_arguments)]
pub fn attend_heads(
    isa: Isa,
    q: &[f32],
    q_stride: usize,
    heads: usize,
    keys: Rows,
    values: Rows,
    scale: f32,
    sinks: Option<&[f32]>,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
    out_stride: usize,
) {
    let tiles = ROW_TILE_BYTES;
    attend_heads_in_tiles(
        isa, q, q_stride, heads, keys, values, scale, sinks, scratch, out, out_stride, tiles,
    );
}

/// [`attend_heads`] over rows in tiles of about `tile_bytes`.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend_heads_in_tiles(
    isa: Isa,
    q: &[f32],
    q_stride: usize,
    heads: usize,
    keys: Rows,
    values: Rows,
    scale: f32,
    sinks: Option<&[f32]>,
    scratch: &mut Vec<f32>,
    out: &mut [f32],
    out_stride: usize,
    tile_bytes: usize,
) {
    let n = keys.n;
    scratch.resize(HEAD_GROUP.min(heads) * n, 0.0);
    // A (head, key) score does not depend on the other keys, and each (head, column) sum
    // continues its chain from the output's value, so the tiles give the untiled bits.
    let tile = |rows: &Rows| (tile_bytes / (rows.d * rows.elem.bytes()).max(1)).max(1);
    for g0 in (0..heads).step_by(HEAD_GROUP) {
        let gh = HEAD_GROUP.min(heads - g0);
        let q = &q[g0 * q_stride..];
        for j in (0..n).step_by(tile(&keys)) {
            let keys = keys.range(j..n.min(j + tile(&keys)));
            scores_heads(isa, q, q_stride, gh, keys, scale, &mut scratch[j..], n);
        }
        let out = &mut out[g0 * out_stride..];
        for h in 0..gh {
            let sink = sinks.map(|s| s[g0 + h]);
            softmax_with_sink(isa, &mut scratch[h * n..(h + 1) * n], sink);
            out[h * out_stride..h * out_stride + values.d].fill(0.0);
        }
        for j in (0..n).step_by(tile(&values)) {
            let values = values.range(j..n.min(j + tile(&values)));
            weighted_sum_heads(isa, &scratch[j..], n, gh, values, out, out_stride);
        }
    }
}

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

    /// `scores_avx512`'s reduction of one key's accumulator.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
    fn reduce_512(a: __m512) -> f32 {
        _mm512_reduce_add_ps(a)
    }

    /// `scores_avx2`'s reduction of one key's accumulator.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn reduce_256(a: __m256) -> f32 {
        let x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
        _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)))
    }

    /// Defines the multi-head kernels of one vector width: `$scores` and `$sums` (the public
    /// entry points, [`super::scores_heads`] and [`super::weighted_sum_heads`]) run blocks of
    /// [`HEADS`] heads through `$scores_block::<H>` and `$sums_block::<H>`, which keep `$keys`
    /// keys (or column vectors) × H heads of accumulators in registers. Per (head, key) and
    /// (head, column) the operations are the one-head kernel's of that width, in its order.
    macro_rules! width {
        ($features:literal, $v:ty, $lanes:literal, $keys:literal, $zero:ident, $loadu:ident,
         $storeu:ident, $fmadd:ident, $set1:ident, $load_row:ident, $reduce:ident,
         $scores:ident, $scores_block:ident, $sums:ident, $sums_block:ident) => {
            /// The multi-head scores at this width.
            ///
            /// # Safety
            /// `keys` passed `Rows::check`, the queries and outputs of every head are in
            /// bounds (the assert of `scores_heads`), and the CPU has the features this
            /// function is compiled for.
            #[allow(clippy::too_many_arguments)]
            #[target_feature(enable = $features)]
            pub unsafe fn $scores(
                q: &[f32],
                q_stride: usize,
                heads: usize,
                keys: Rows,
                scale: f32,
                out: &mut [f32],
                out_stride: usize,
            ) {
                let mut h0 = 0;
                while h0 < heads {
                    let h = HEADS.min(heads - h0);
                    // SAFETY: heads h0..h0 + h are in bounds (the contract above).
                    unsafe {
                        match h {
                            4 => $scores_block::<4>(q, q_stride, h0, keys, scale, out, out_stride),
                            3 => $scores_block::<3>(q, q_stride, h0, keys, scale, out, out_stride),
                            2 => $scores_block::<2>(q, q_stride, h0, keys, scale, out, out_stride),
                            _ => $scores_block::<1>(q, q_stride, h0, keys, scale, out, out_stride),
                        }
                    }
                    h0 += h;
                }
            }

            /// Heads `h0..h0 + H` of the scores: per key, the one-head kernel's accumulator
            /// (lanes over the columns in order, its reduction, the columns past the last
            /// whole vector added one by one, times `scale`).
            ///
            /// # Safety
            /// As for the entry point, for these heads.
            #[allow(clippy::too_many_arguments)]
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn $scores_block<const H: usize>(
                q: &[f32],
                q_stride: usize,
                h0: usize,
                keys: Rows,
                scale: f32,
                out: &mut [f32],
                out_stride: usize,
            ) {
                let whole = keys.d / $lanes * $lanes;
                let qs: [&[f32]; H] = std::array::from_fn(|h| &q[(h0 + h) * q_stride..]);
                let mut j = 0;
                while j < keys.n {
                    let m = $keys.min(keys.n - j);
                    let mut acc = [[$zero(); $keys]; H];
                    for c in (0..whole).step_by($lanes) {
                        // SAFETY: row j + min(u, m - 1) < n and c + lanes <= d (keys passed
                        // `Rows::check`).
                        let k: [$v; $keys] = std::array::from_fn(|u| unsafe {
                            $load_row(&keys, j + u.min(m - 1), c)
                        });
                        for h in 0..H {
                            // SAFETY: c + lanes <= d <= the query's length (the contract).
                            let qc = unsafe { $loadu(qs[h].as_ptr().add(c)) };
                            for u in 0..m {
                                acc[h][u] = $fmadd(qc, k[u], acc[h][u]);
                            }
                        }
                    }
                    for h in 0..H {
                        for u in 0..m {
                            let mut s = $reduce(acc[h][u]);
                            for c in whole..keys.d {
                                s += qs[h][c] * keys.value(j + u, c);
                            }
                            out[(h0 + h) * out_stride + j + u] = s * scale;
                        }
                    }
                    j += m;
                }
            }

            /// The multi-head weighted sums at this width.
            ///
            /// # Safety
            /// `values` passed `Rows::check`, the weights and outputs of every head are in
            /// bounds (the assert of `weighted_sum_heads`), and the CPU has the features this
            /// function is compiled for.
            #[target_feature(enable = $features)]
            pub unsafe fn $sums(
                p: &[f32],
                p_stride: usize,
                heads: usize,
                values: Rows,
                out: &mut [f32],
                out_stride: usize,
            ) {
                let mut h0 = 0;
                while h0 < heads {
                    let h = HEADS.min(heads - h0);
                    // SAFETY: heads h0..h0 + h are in bounds (the contract above).
                    unsafe {
                        match h {
                            4 => $sums_block::<4>(p, p_stride, h0, values, out, out_stride),
                            3 => $sums_block::<3>(p, p_stride, h0, values, out, out_stride),
                            2 => $sums_block::<2>(p, p_stride, h0, values, out, out_stride),
                            _ => $sums_block::<1>(p, p_stride, h0, values, out, out_stride),
                        }
                    }
                    h0 += h;
                }
            }

            /// Heads `h0..h0 + H` of the weighted sums: per column, the one-head kernel's
            /// chain (from the output's value, one FMA per row in order; columns past the
            /// last whole vector one by one).
            ///
            /// # Safety
            /// As for the entry point, for these heads.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn $sums_block<const H: usize>(
                p: &[f32],
                p_stride: usize,
                h0: usize,
                values: Rows,
                out: &mut [f32],
                out_stride: usize,
            ) {
                let whole = values.d / $lanes * $lanes;
                let ps: [&[f32]; H] = std::array::from_fn(|h| &p[(h0 + h) * p_stride..]);
                let o: [*mut f32; H] =
                    std::array::from_fn(|h| out[(h0 + h) * out_stride..].as_mut_ptr());
                let mut c0 = 0;
                while c0 < whole {
                    let m = $keys.min((whole - c0) / $lanes);
                    let mut acc = [[$zero(); $keys]; H];
                    for h in 0..H {
                        for u in 0..m {
                            // SAFETY: c0 + lanes·(u + 1) <= whole <= d, inside head h's output.
                            acc[h][u] = unsafe { $loadu(o[h].add(c0 + $lanes * u)) };
                        }
                    }
                    for j in 0..values.n {
                        // SAFETY: j < n, the columns are inside d, `values` passed the check.
                        let v: [$v; $keys] = std::array::from_fn(|u| unsafe {
                            $load_row(&values, j, c0 + $lanes * u.min(m - 1))
                        });
                        for h in 0..H {
                            let pv = $set1(ps[h][j]);
                            for u in 0..m {
                                acc[h][u] = $fmadd(pv, v[u], acc[h][u]);
                            }
                        }
                    }
                    for h in 0..H {
                        for u in 0..m {
                            // SAFETY: as for the loads of `acc`.
                            unsafe { $storeu(o[h].add(c0 + $lanes * u), acc[h][u]) };
                        }
                    }
                    c0 += $lanes * m;
                }
                for h in 0..H {
                    for c in whole..values.d {
                        let mut x = out[(h0 + h) * out_stride + c];
                        for (j, &pj) in ps[h].iter().enumerate().take(values.n) {
                            x += pj * values.value(j, c);
                        }
                        out[(h0 + h) * out_stride + c] = x;
                    }
                }
            }
        };
    }

    // 32 registers: 4 heads × 4 keys of accumulators, 4 key vectors and a query.
    width!(
        "avx512f,avx512vl,avx2,fma,f16c",
        __m512,
        16,
        4,
        _mm512_setzero_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_fmadd_ps,
        _mm512_set1_ps,
        load16,
        reduce_512,
        scores_heads_avx512,
        scores_block_512,
        weighted_sum_heads_avx512,
        sums_block_512
    );
    // 16 registers: 4 heads × 2 keys of accumulators, 2 key vectors and a query.
    width!(
        "avx2,fma,f16c",
        __m256,
        8,
        2,
        _mm256_setzero_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_fmadd_ps,
        _mm256_set1_ps,
        load8,
        reduce_256,
        scores_heads_avx2,
        scores_block_256,
        weighted_sum_heads_avx2,
        sums_block_256
    );
}
