//! Attention inner loops: scores of one query against many keys, a numerically stable softmax
//! with a vectorized exponential, and the probability-weighted sum of values — over keys and
//! values stored as f32 or f16 rows at a stride (a KV cache's `[pos][kv_head][dim]` layout).
//! Scalar reference plus AVX2, AVX-512 and NEON paths, chosen once like the dot products.

// The reference loops index queries, keys and outputs with one dimension variable.
#![allow(clippy::needless_range_loop)]

use crate::Isa;
use crate::exp::exp_poly;

mod heads;
pub use heads::{attend_heads, scores_heads, weighted_sum_heads};

/// Element type of cached keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvElem {
    F32,
    F16,
}

impl KvElem {
    pub fn bytes(self) -> usize {
        match self {
            KvElem::F32 => 4,
            KvElem::F16 => 2,
        }
    }
}

/// Rows `0..n` of `d` values each, `stride` bytes apart, starting at `data[0]`.
#[derive(Clone, Copy)]
pub struct Rows<'a> {
    pub data: &'a [u8],
    pub stride: usize,
    pub n: usize,
    pub d: usize,
    pub elem: KvElem,
}

impl<'a> Rows<'a> {
    /// Rows `range` of these (`range.end <= n`).
    pub fn range(&self, range: std::ops::Range<usize>) -> Rows<'a> {
        assert!(
            range.start <= range.end && range.end <= self.n,
            "rows {range:?} of {}",
            self.n
        );
        let data = if range.is_empty() {
            &self.data[..0]
        } else {
            &self.data[range.start * self.stride..]
        };
        Rows {
            data,
            stride: self.stride,
            n: range.len(),
            d: self.d,
            elem: self.elem,
        }
    }

    /// Panics unless `data` holds all `n` rows (the SIMD paths read them through raw pointers).
    fn check(&self) {
        let need = match self.n {
            0 => Some(0),
            n => (n - 1).checked_mul(self.stride).and_then(|s| {
                self.d
                    .checked_mul(self.elem.bytes())
                    .and_then(|row| s.checked_add(row))
            }),
        };
        assert!(
            need.is_some_and(|need| self.data.len() >= need),
            "attention rows: {} bytes for {} rows of {}",
            self.data.len(),
            self.n,
            self.d
        );
    }

    pub(crate) fn value(&self, j: usize, c: usize) -> f32 {
        let o = j * self.stride + c * self.elem.bytes();
        match self.elem {
            KvElem::F32 => f32::from_le_bytes([
                self.data[o],
                self.data[o + 1],
                self.data[o + 2],
                self.data[o + 3],
            ]),
            KvElem::F16 => {
                half::f16::from_bits(u16::from_le_bytes([self.data[o], self.data[o + 1]])).to_f32()
            }
        }
    }
}

/// `out[j] = scale · (q · k_j)` for every key row.
pub fn scores(isa: Isa, q: &[f32], keys: Rows, scale: f32, out: &mut [f32]) {
    keys.check();
    assert!(q.len() >= keys.d && out.len() >= keys.n);
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx512 && Isa::Avx512.is_supported() {
        // SAFETY: the CPU has the AVX-512 level's features (checked), which include the
        // function's; `keys.check()` and the assert above are its bounds contract.
        return unsafe { x86::scores_avx512(q, keys, scale, out) };
    } else if isa >= Isa::Avx2 && Isa::Avx2.is_supported() {
        // SAFETY: as above, for AVX2.
        return unsafe { x86::scores_avx2(q, keys, scale, out) };
    }
    #[cfg(target_arch = "aarch64")]
    if isa >= Isa::Neon {
        return crate::aarch64::scores(q, keys, scale, out);
    }
    let _ = isa;
    for (j, o) in out.iter_mut().enumerate().take(keys.n) {
        let mut s = 0f32;
        for c in 0..keys.d {
            s += q[c] * keys.value(j, c);
        }
        *o = s * scale;
    }
}

/// Replaces `x` by `softmax(x)`; the exponential is a polynomial (relative error < 2e-7).
pub fn softmax(isa: Isa, x: &mut [f32]) {
    softmax_with_sink(isa, x, None);
}

/// Softmax over `x` and, when given, one more logit `sink` that joins the normalization but
/// has no value row (gpt-oss' learned attention sinks: the weights of `x` then sum to less
/// than one).
pub fn softmax_with_sink(isa: Isa, x: &mut [f32], sink: Option<f32>) {
    let max = x
        .iter()
        .copied()
        .fold(sink.unwrap_or(f32::NEG_INFINITY), f32::max);
    let sink_exp = sink.map_or(0.0, |s| exp_poly(s - max));
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 && Isa::Avx2.is_supported() {
        // SAFETY: the CPU has AVX2 and FMA (checked as part of the AVX2 level).
        let sum = unsafe { x86::exp_sub_sum_avx2(x, max) } + sink_exp;
        let inv = 1.0 / sum;
        x.iter_mut().for_each(|v| *v *= inv);
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if isa >= Isa::Neon {
        let inv = 1.0 / (crate::aarch64::exp_sub_sum(x, max) + sink_exp);
        x.iter_mut().for_each(|v| *v *= inv);
        return;
    }
    let _ = isa;
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = exp_poly(*v - max);
        sum += *v;
    }
    sum += sink_exp;
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// `out += Σ_j p[j] · v_j`.
pub fn weighted_sum(isa: Isa, p: &[f32], values: Rows, out: &mut [f32]) {
    values.check();
    assert!(p.len() >= values.n && out.len() >= values.d);
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx512 && Isa::Avx512.is_supported() {
        // SAFETY: the CPU has the AVX-512 level's features (checked), which include the
        // function's; `values.check()` and the assert above are its bounds contract.
        return unsafe { x86::weighted_sum_avx512(p, values, out) };
    } else if isa >= Isa::Avx2 && Isa::Avx2.is_supported() {
        // SAFETY: as above, for AVX2.
        return unsafe { x86::weighted_sum_avx2(p, values, out) };
    }
    #[cfg(target_arch = "aarch64")]
    if isa >= Isa::Neon {
        return crate::aarch64::weighted_sum(p, values, out);
    }
    let _ = isa;
    for (j, &pj) in p.iter().enumerate().take(values.n) {
        for (c, o) in out.iter_mut().enumerate().take(values.d) {
            *o += pj * values.value(j, c);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{KvElem, Rows};

    /// Independent accumulators per step of the score and weighted-sum loops: enough to cover
    /// an FMA's latency at two a cycle.
    const KEYS: usize = 8;

    /// Values `c..c + 16` of row `j` as f32.
    ///
    /// # Safety
    /// `rows` passed `Rows::check`, `j < rows.n` and `c + 16 <= rows.d`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn load16(rows: &Rows, j: usize, c: usize) -> __m512 {
        // SAFETY: row j < n starts at j·stride, and its values c..c + 16 end within its
        // d·bytes, inside `data` (checked by `Rows::check`).
        let p = unsafe {
            rows.data
                .as_ptr()
                .add(j * rows.stride + c * rows.elem.bytes())
        };
        match rows.elem {
            // SAFETY: 16 values of 4 bytes from `p`, in bounds as above; unaligned load.
            KvElem::F32 => unsafe { _mm512_loadu_ps(p as *const f32) },
            // SAFETY: 16 values of 2 bytes from `p`, in bounds as above; unaligned load.
            KvElem::F16 => unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) },
        }
    }

    /// Values `c..c + 8` of row `j` as f32.
    ///
    /// # Safety
    /// `rows` passed `Rows::check`, `j < rows.n` and `c + 8 <= rows.d`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn load8(rows: &Rows, j: usize, c: usize) -> __m256 {
        // SAFETY: row j < n starts at j·stride, and its values c..c + 8 end within its
        // d·bytes, inside `data` (checked by `Rows::check`).
        let p = unsafe {
            rows.data
                .as_ptr()
                .add(j * rows.stride + c * rows.elem.bytes())
        };
        match rows.elem {
            // SAFETY: 8 values of 4 bytes from `p`, in bounds as above; unaligned load.
            KvElem::F32 => unsafe { _mm256_loadu_ps(p as *const f32) },
            // SAFETY: 8 values of 2 bytes from `p`, in bounds as above; unaligned load.
            KvElem::F16 => unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) },
        }
    }

    /// [`super::scores`] with AVX-512.
    ///
    /// # Safety
    /// `keys` passed `Rows::check`, `q.len() >= keys.d`, and the CPU has the features this
    /// function is compiled for.
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
    pub unsafe fn scores_avx512(q: &[f32], keys: Rows, scale: f32, out: &mut [f32]) {
        let d16 = keys.d / 16 * 16;
        // KEYS rows at a time, each with its own accumulator: a single row's chain of FMAs
        // waits on each one's latency, independent rows fill the pipes. Every row's
        // operations and their order are those of one row alone, so the bits are too.
        let mut j = 0;
        while j < keys.n {
            let m = KEYS.min(keys.n - j);
            let mut acc = [_mm512_setzero_ps(); KEYS];
            for c in (0..d16).step_by(16) {
                // SAFETY: c + 16 <= d16 <= d <= q.len() (the contract above).
                let qc = unsafe { _mm512_loadu_ps(q.as_ptr().add(c)) };
                for (u, a) in acc.iter_mut().enumerate().take(m) {
                    // SAFETY: j + u < n, c + 16 <= d (the contract above).
                    *a = unsafe { _mm512_fmadd_ps(qc, load16(&keys, j + u, c), *a) };
                }
            }
            for (u, a) in acc.iter().enumerate().take(m) {
                let mut s = _mm512_reduce_add_ps(*a);
                for c in d16..keys.d {
                    s += q[c] * keys.value(j + u, c);
                }
                out[j + u] = s * scale;
            }
            j += m;
        }
    }

    /// [`super::scores`] with AVX2.
    ///
    /// # Safety
    /// `keys` passed `Rows::check`, `q.len() >= keys.d`, and the CPU has AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scores_avx2(q: &[f32], keys: Rows, scale: f32, out: &mut [f32]) {
        let d8 = keys.d / 8 * 8;
        // KEYS rows at a time, as in `scores_avx512` (same bits as one row alone).
        let mut j = 0;
        while j < keys.n {
            let m = KEYS.min(keys.n - j);
            let mut acc = [_mm256_setzero_ps(); KEYS];
            for c in (0..d8).step_by(8) {
                // SAFETY: c + 8 <= d8 <= d <= q.len() (the contract above).
                let qc = unsafe { _mm256_loadu_ps(q.as_ptr().add(c)) };
                for (u, a) in acc.iter_mut().enumerate().take(m) {
                    // SAFETY: j + u < n, c + 8 <= d (the contract above).
                    *a = unsafe { _mm256_fmadd_ps(qc, load8(&keys, j + u, c), *a) };
                }
            }
            for (u, a) in acc.iter().enumerate().take(m) {
                let h = _mm_add_ps(_mm256_castps256_ps128(*a), _mm256_extractf128_ps::<1>(*a));
                let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
                let mut s = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
                for c in d8..keys.d {
                    s += q[c] * keys.value(j + u, c);
                }
                out[j + u] = s * scale;
            }
            j += m;
        }
    }

    /// [`super::weighted_sum`] with AVX-512.
    ///
    /// # Safety
    /// `values` passed `Rows::check`, `out.len() >= values.d`, and the CPU has the features
    /// this function is compiled for.
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
    pub unsafe fn weighted_sum_avx512(p: &[f32], values: Rows, out: &mut [f32]) {
        let d16 = values.d / 16 * 16;
        // KEYS column blocks at a time, each with its own accumulator (independent chains; the
        // operations of every lane, in order, are those of one block alone).
        let mut c0 = 0;
        while c0 < d16 {
            let m = KEYS.min((d16 - c0) / 16);
            let mut acc = [_mm512_setzero_ps(); KEYS];
            for (u, a) in acc.iter_mut().enumerate().take(m) {
                // SAFETY: c0 + 16u + 16 <= d16 <= d <= out.len() (the contract above).
                *a = unsafe { _mm512_loadu_ps(out.as_ptr().add(c0 + 16 * u)) };
            }
            for (j, &pj) in p.iter().enumerate().take(values.n) {
                let pv = _mm512_set1_ps(pj);
                for (u, a) in acc.iter_mut().enumerate().take(m) {
                    // SAFETY: j < n, c0 + 16u + 16 <= d, and `values` passed `Rows::check`.
                    *a = unsafe { _mm512_fmadd_ps(pv, load16(&values, j, c0 + 16 * u), *a) };
                }
            }
            for (u, a) in acc.iter().enumerate().take(m) {
                // SAFETY: as for the loads of `acc`.
                unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(c0 + 16 * u), *a) };
            }
            c0 += 16 * m;
        }
        for c in d16..values.d {
            for (j, &pj) in p.iter().enumerate().take(values.n) {
                out[c] += pj * values.value(j, c);
            }
        }
    }

    /// [`super::weighted_sum`] with AVX2.
    ///
    /// # Safety
    /// `values` passed `Rows::check`, `out.len() >= values.d`, and the CPU has AVX2, FMA and
    /// F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn weighted_sum_avx2(p: &[f32], values: Rows, out: &mut [f32]) {
        let d8 = values.d / 8 * 8;
        // KEYS column blocks at a time, as in `weighted_sum_avx512`.
        let mut c0 = 0;
        while c0 < d8 {
            let m = KEYS.min((d8 - c0) / 8);
            let mut acc = [_mm256_setzero_ps(); KEYS];
            for (u, a) in acc.iter_mut().enumerate().take(m) {
                // SAFETY: c0 + 8u + 8 <= d8 <= d <= out.len() (the contract above).
                *a = unsafe { _mm256_loadu_ps(out.as_ptr().add(c0 + 8 * u)) };
            }
            for (j, &pj) in p.iter().enumerate().take(values.n) {
                let pv = _mm256_set1_ps(pj);
                for (u, a) in acc.iter_mut().enumerate().take(m) {
                    // SAFETY: j < n, c0 + 8u + 8 <= d, and `values` passed `Rows::check`.
                    *a = unsafe { _mm256_fmadd_ps(pv, load8(&values, j, c0 + 8 * u), *a) };
                }
            }
            for (u, a) in acc.iter().enumerate().take(m) {
                // SAFETY: as for the loads of `acc`.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(c0 + 8 * u), *a) };
            }
            c0 += 8 * m;
        }
        for c in d8..values.d {
            for (j, &pj) in p.iter().enumerate().take(values.n) {
                out[c] += pj * values.value(j, c);
            }
        }
    }

    /// `x[i] = e^(x[i] - max)`, returning the sum (same operations as `crate::exp::exp_poly`).
    #[target_feature(enable = "avx2,fma")]
    pub fn exp_sub_sum_avx2(x: &mut [f32], max: f32) -> f32 {
        let n8 = x.len() / 8 * 8;
        let mut sum = _mm256_setzero_ps();
        let vmax = _mm256_set1_ps(max);
        for i in (0..n8).step_by(8) {
            // SAFETY: elements i..i + 8 of `x` (i + 8 <= n8 <= x.len()).
            let v = unsafe { _mm256_sub_ps(_mm256_loadu_ps(x.as_ptr().add(i)), vmax) };
            let e = crate::exp::x86::exp8(v);
            // SAFETY: as for the load above.
            unsafe { _mm256_storeu_ps(x.as_mut_ptr().add(i), e) };
            sum = _mm256_add_ps(sum, e);
        }
        let h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps::<1>(sum));
        let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        let mut s = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
        for v in x[n8..].iter_mut() {
            *v = crate::exp::exp_poly(*v - max);
            s += *v;
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, d: usize, elem: KvElem, seed: u32) -> Vec<u8> {
        (0..n * d)
            .flat_map(|i| {
                let v = (((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32
                    / (1u32 << 24) as f32)
                    - 0.5;
                match elem {
                    KvElem::F32 => v.to_le_bytes().to_vec(),
                    KvElem::F16 => half::f16::from_f32(v).to_bits().to_le_bytes().to_vec(),
                }
            })
            .collect()
    }

    /// A key's score and a value column's sum do not depend on which other rows or columns
    /// one call computes with it (the SIMD loops run several independent accumulators), so a
    /// split of the positions or of the head dimensions gives the same bits.
    #[test]
    fn results_do_not_depend_on_the_rows_and_columns_computed_together() {
        for isa in Isa::supported() {
            for elem in [KvElem::F32, KvElem::F16] {
                for d in [576usize, 72, 200] {
                    let n = 37;
                    let data = rows(n, d, elem, 5);
                    let stride = d * elem.bytes();
                    let all = Rows {
                        data: &data,
                        stride,
                        n,
                        d,
                        elem,
                    };
                    let q: Vec<f32> = (0..d)
                        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 97.0)
                        .collect();
                    let mut together = vec![0f32; n];
                    scores(isa, &q, all, 0.125, &mut together);
                    for j in 0..n {
                        let one = Rows {
                            data: &data[j * stride..],
                            n: 1,
                            ..all
                        };
                        let mut alone = [0f32];
                        scores(isa, &q, one, 0.125, &mut alone);
                        assert_eq!(
                            alone[0].to_bits(),
                            together[j].to_bits(),
                            "{isa:?} {elem:?} d={d} key {j}"
                        );
                    }
                    let p: Vec<f32> = (0..n).map(|j| 1.0 / (j + 2) as f32).collect();
                    let mut together = vec![0.5f32; d];
                    weighted_sum(isa, &p, all, &mut together);
                    // Columns in blocks of 16 (and the rest), each call on its own.
                    for c0 in (0..d).step_by(16) {
                        let w = 16.min(d - c0);
                        let cols = Rows {
                            data: &data[c0 * elem.bytes()..],
                            d: w,
                            ..all
                        };
                        let mut alone = vec![0.5f32; w];
                        weighted_sum(isa, &p, cols, &mut alone);
                        for (c, v) in alone.iter().enumerate() {
                            assert_eq!(
                                v.to_bits(),
                                together[c0 + c].to_bits(),
                                "{isa:?} {elem:?} d={d} column {}",
                                c0 + c
                            );
                        }
                    }
                }
            }
        }
    }

    /// Several heads at once give each head the bits it gets alone (scores and sums), for
    /// block sizes and remainders of heads, keys and columns.
    #[test]
    fn heads_together_equal_each_head_alone() {
        for isa in Isa::supported() {
            for elem in [KvElem::F32, KvElem::F16] {
                for (d, dv, n) in [
                    (576usize, 512usize, 37usize),
                    (72, 72, 5),
                    (200, 136, 1),
                    (128, 128, 9),
                ] {
                    let data = rows(n, d, elem, 7);
                    let stride = d * elem.bytes();
                    let keys = Rows {
                        data: &data,
                        stride,
                        n,
                        d,
                        elem,
                    };
                    let values = Rows { d: dv, ..keys };
                    for heads in [1usize, 3, 4, 5, 9] {
                        let q: Vec<f32> = (0..heads * (d + 3))
                            .map(|i| ((i * 53 % 211) as f32 - 105.0) / 131.0)
                            .collect();
                        let mut together = vec![f32::NAN; heads * (n + 2)];
                        scores_heads(isa, &q, d + 3, heads, keys, 0.07, &mut together, n + 2);
                        let p: Vec<f32> = (0..heads * (n + 1))
                            .map(|i| 1.0 / (i % 13 + 2) as f32)
                            .collect();
                        let mut sums = vec![0.25f32; heads * (dv + 1)];
                        weighted_sum_heads(isa, &p, n + 1, heads, values, &mut sums, dv + 1);
                        for h in 0..heads {
                            let mut alone = vec![0f32; n];
                            scores(isa, &q[h * (d + 3)..], keys, 0.07, &mut alone);
                            for j in 0..n {
                                assert_eq!(
                                    together[h * (n + 2) + j].to_bits(),
                                    alone[j].to_bits(),
                                    "{isa:?} {elem:?} d={d} heads={heads}: head {h} key {j}"
                                );
                            }
                            assert!(
                                together[h * (n + 2) + n].is_nan(),
                                "wrote past a head's scores"
                            );
                            let mut alone = vec![0.25f32; dv];
                            weighted_sum(isa, &p[h * (n + 1)..], values, &mut alone);
                            for c in 0..dv {
                                assert_eq!(
                                    sums[h * (dv + 1) + c].to_bits(),
                                    alone[c].to_bits(),
                                    "{isa:?} {elem:?} dv={dv} heads={heads}: head {h} column {c}"
                                );
                            }
                            assert_eq!(sums[h * (dv + 1) + dv], 0.25, "wrote past a head's sums");
                        }
                    }
                }
            }
        }
    }

    /// Heads attended together, over their rows whole or in tiles of a few rows, give each
    /// head the bits of its own scores, softmax (with its sink) and weighted sum, for head
    /// counts around the kernels' block size and across two groups of heads.
    #[test]
    fn attend_heads_equals_each_head_alone() {
        for isa in Isa::supported() {
            let (d, dv, n) = (72usize, 64usize, 11usize);
            let data = rows(n, d, KvElem::F16, 9);
            let keys = Rows {
                data: &data,
                stride: d * 2,
                n,
                d,
                elem: KvElem::F16,
            };
            let values = Rows { d: dv, ..keys };
            // Whole; 3 key rows (and 4 value rows) a tile; one row a tile.
            for tile_bytes in [1 << 20, 3 * d * 2 + 1, 1] {
                for heads in [1usize, 4, 6, 18] {
                    let q: Vec<f32> = (0..heads * d)
                        .map(|i| ((i * 29 % 97) as f32 - 48.0) / 61.0)
                        .collect();
                    let sinks: Vec<f32> = (0..heads).map(|h| h as f32 * 0.3 - 0.5).collect();
                    let mut scratch = Vec::new();
                    let mut out = vec![f32::NAN; heads * (dv + 1)];
                    heads::attend_heads_in_tiles(
                        isa,
                        &q,
                        d,
                        heads,
                        keys,
                        values,
                        0.11,
                        Some(&sinks),
                        &mut scratch,
                        &mut out,
                        dv + 1,
                        tile_bytes,
                    );
                    for h in 0..heads {
                        let mut p = vec![0f32; n];
                        scores(isa, &q[h * d..], keys, 0.11, &mut p);
                        softmax_with_sink(isa, &mut p, Some(sinks[h]));
                        let mut want = vec![0f32; dv];
                        weighted_sum(isa, &p, values, &mut want);
                        for c in 0..dv {
                            assert_eq!(
                                out[h * (dv + 1) + c].to_bits(),
                                want[c].to_bits(),
                                "{isa:?} tiles of {tile_bytes} B, heads={heads}: head {h} column {c}"
                            );
                        }
                        assert!(
                            out[h * (dv + 1) + dv].is_nan(),
                            "wrote past a head's output"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn simd_paths_match_the_scalar_reference() {
        for elem in [KvElem::F32, KvElem::F16] {
            for d in [32, 64, 80, 128] {
                let n = 37;
                let k = rows(n, d, elem, 1);
                let v = rows(n, d, elem, 2);
                let q: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin()).collect();
                let kr = Rows {
                    data: &k,
                    stride: d * elem.bytes(),
                    n,
                    d,
                    elem,
                };
                let vr = Rows {
                    data: &v,
                    stride: d * elem.bytes(),
                    n,
                    d,
                    elem,
                };
                let mut want_s = vec![0f32; n];
                scores(Isa::Scalar, &q, kr, 0.125, &mut want_s);
                let mut want_o = vec![0.5f32; d];
                let mut p = want_s.clone();
                softmax(Isa::Scalar, &mut p);
                weighted_sum(Isa::Scalar, &p, vr, &mut want_o);
                for isa in Isa::supported() {
                    let mut s = vec![0f32; n];
                    scores(isa, &q, kr, 0.125, &mut s);
                    let mut p2 = s.clone();
                    softmax(isa, &mut p2);
                    let mut o = vec![0.5f32; d];
                    weighted_sum(isa, &p2, vr, &mut o);
                    for (a, b) in s.iter().zip(&want_s).chain(o.iter().zip(&want_o)) {
                        assert!(
                            (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                            "{isa:?} {elem:?} d={d}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_sink_joins_the_normalization_only() {
        let logits = [0.3f32, -1.2, 2.0, 0.7, -0.1, 1.1, 0.0, -2.5, 0.9, 1.4];
        for sink in [-3.0f32, 0.5, 4.0] {
            let m = logits.iter().copied().fold(sink, f32::max) as f64;
            let denom: f64 =
                logits.iter().map(|&l| (l as f64 - m).exp()).sum::<f64>() + (sink as f64 - m).exp();
            for isa in Isa::supported() {
                let mut p = logits;
                softmax_with_sink(isa, &mut p, Some(sink));
                for (&got, &l) in p.iter().zip(&logits) {
                    let want = (l as f64 - m).exp() / denom;
                    assert!((got as f64 - want).abs() < 1e-6, "{isa:?} sink {sink}");
                }
                let total: f32 = p.iter().sum();
                assert!(total < 1.0, "{isa:?}: the sink takes a share");
            }
        }
    }
}
