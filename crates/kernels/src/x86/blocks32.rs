//! What the AVX2 and AVX-512 kernels of the 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
//! IQ4_NL; MXFP4 has its own, `crate::x86::mxfp4`) against Q8_0 activations share.
//!
//! **Arithmetic.** These kernels give the scalar reference's bits (`crate::formats::legacy`,
//! `dot_iq4_nl`): per block one exact integer `isum`, then `sum += isum·(dx·dy)` (plus
//! `m·(Σy·dy)` for Q4_1/Q5_1), in block order, in f32 without fused multiply-adds. So x86 nodes of
//! either level and ARM nodes (whose kernels equal the reference too) agree bit for bit, and a
//! panel can run any number of tokens at once with one token per lane: the float steps are
//! element-wise, so vectorizing them over tokens (panels), over 8 blocks of one row (the
//! single-row dot, [`reference_sums`], which then adds the 8 lanes in order) or over 8 rows
//! (decode's row lanes, [`row_lane_sums`]) changes nothing.
//!
//! **Panels** transpose the activations of a group of tokens once ([`pack_tokens`]): for each
//! block, register g holds the 4 bytes `4g..4g+4` of every token, one token per 32-bit lane. A
//! weight row's 4 bytes are broadcast and one `vpdpbusd` (or `vpmaddubsw` + `vpmaddwd`) adds
//! their products to every token's lane, so eight of them give every token's block integer with
//! no horizontal reduction, and the weights are unpacked once per row for the whole group.

use std::arch::x86_64::*;

use crate::blocks::BlockQ8_0;
use crate::panel::Panel;
use crate::x86::simd256::{f16_scalar, hsum_epi32, load128_of, load256_of};

/// The f16 values `field(k)` for `k < n ≤ 8` (a field of a row's first `n` blocks), as lanes of
/// f32 (lanes `n..8` zero). They are put together in two 64-bit integers and moved over once
/// each: `_mm_setr_epi16` would be eight `vpinsrw`, each a shuffle on the one port that the
/// horizontal sums also need. (Eight rows' scales come from [`scales8`] instead.)
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn f16xn(n: usize, field: impl Fn(usize) -> [u8; 2]) -> __m256 {
    let (mut lo, mut hi) = (0u64, 0u64);
    for k in 0..4 {
        if k < n {
            lo |= (u16::from_le_bytes(field(k)) as u64) << (16 * k);
        }
        if k + 4 < n {
            hi |= (u16::from_le_bytes(field(k + 4)) as u64) << (16 * k);
        }
    }
    _mm256_cvtph_ps(_mm_set_epi64x(hi as i64, lo as i64))
}

/// The eight rows' first blocks as pointers, after checking once that every row and the
/// activations' sides hold `nb` blocks: the eight-row loops then read through the pointers.
/// Indexing eight slices there kept eight length checks (a reload, a compare and a branch each)
/// in every block, as many instructions as the products of a row.
#[inline(always)]
pub(crate) fn checked_rows<B>(w: [&[B]; 8], nb: usize, sides: usize) -> [*const B; 8] {
    assert!(
        sides >= nb,
        "the activations' sides are shorter than their blocks"
    );
    let mut rows = [std::ptr::null(); 8];
    for (r, (row, w)) in rows.iter_mut().zip(w).enumerate() {
        assert!(
            w.len() >= nb,
            "row {r} of an eight-row dot is shorter than its activations"
        );
        *row = w.as_ptr();
    }
    rows
}

/// The first 16 bytes at each of eight places (`at[r]`, row r's block) as four dword lanes:
/// lane r of the k-th vector holds dword k of row r. Rows r and r + 4 share a register, [row r's
/// 16 bytes | row r+4's], and a 4×4 transpose of dwords in each half does the rest (eight
/// shuffles), so eight rows' bytes meet one broadcast activation dword without any horizontal
/// sum ([`nibble_row_lane_sums`]), and the blocks' first dwords give the eight scales
/// ([`scales8`]).
///
/// # Safety
/// Each `at[r]` has 16 readable bytes.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn transposed_dwords(at: [*const u8; 8]) -> [__m256i; 4] {
    // SAFETY: 16 readable bytes at each place (the contract).
    let load = |r: usize| unsafe { _mm_loadu_si128(at[r].cast()) };
    let pair =
        |r: usize| _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(load(r)), load(r + 4));
    let (p0, p1, p2, p3) = (pair(0), pair(1), pair(2), pair(3));
    let (t0, t1) = (_mm256_unpacklo_epi32(p0, p1), _mm256_unpackhi_epi32(p0, p1));
    let (t2, t3) = (_mm256_unpacklo_epi32(p2, p3), _mm256_unpackhi_epi32(p2, p3));
    [
        _mm256_unpacklo_epi64(t0, t2),
        _mm256_unpackhi_epi64(t0, t2),
        _mm256_unpacklo_epi64(t1, t3),
        _mm256_unpackhi_epi64(t1, t3),
    ]
}

/// The f16 pairs that start eight blocks (`heads[r]`: row r's block, at least 16 readable
/// bytes) as two vectors of f32 with one row per lane: the first f16 of each (the scale) and the
/// second (the min of Q4_1/Q5_1; whatever else for the other formats), from the blocks' first
/// dwords ([`transposed_dwords`]; the compiler keeps only the shuffles that the first needs) and
/// two shuffles: composing the same lanes from sixteen 16-bit loads and their shifts took about
/// fifty instructions per block of eight rows.
///
/// # Safety
/// Each `heads[r]` has 16 readable bytes.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn scales8(heads: [*const u8; 8]) -> (__m256, __m256) {
    // SAFETY: the contract above, which is `transposed_dwords`'.
    let [first, ..] = unsafe { transposed_dwords(heads) };
    // Each half [s0 m0 s1 m1 s2 m2 s3 m3] (16-bit) to [s0 s1 s2 s3 m0 m1 m2 m3], then the
    // scales in the low 128 bits and the seconds in the high.
    let split = _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, //
        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
    );
    let sm = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(first, split));
    (
        _mm256_cvtph_ps(_mm256_castsi256_si128(sm)),
        _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(sm)),
    )
}

/// `R` rows' dots with one activation row, in the reference's order: `$w` is `[&[B]; R]`,
/// `$a` the `&[BlockQ8_0]` of the same length; `isum: |x, y|` gives lanes whose sum is the
/// block's exact integer (`Σ w·y`, or `Σ q·y` where `min: true`), `ysum: |y|` lanes whose sum
/// is `Σ y` (evaluated only where `min: true`), `d: |x|` and `m: |x|` the block's f16 scale and
/// min. Eight blocks at a time ([`reference_group`]): each row's integers are reduced together
/// ([`hsums`]), its float steps run with one block per lane, and the lanes are added to its sum
/// one by one. That last chain of dependent adds bounds a single row; `R` rows run `R` chains
/// side by side and share the activations' scales and sums. A macro, not a function taking
/// closures: the closures were not inlined, and each call then cost more than the block it
/// computed. Expands inside a `#[target_feature]` function with AVX2, FMA and F16C that has
/// `std::arch::x86_64::*` in scope; evaluates to `[f32; R]`.
macro_rules! reference_sums {
    ($r:expr, $w:expr, $a:expr, min: $min:expr,
     isum: |$x:ident, $y:ident| $isum:expr,
     ysum: |$y2:ident| $ysum:expr,
     d: |$xd:ident| $d:expr,
     m: |$xm:ident| $m:expr $(,)?) => {{
        let w: [&[_]; $r] = $w;
        let a: &[$crate::blocks::BlockQ8_0] = $a;
        let mut sum = [0f32; $r];
        let nb = a.len();
        let main = nb - nb % 8;
        let mut j0 = 0;
        while j0 < main {
            $crate::x86::blocks32::reference_group!($r, w, a, j0, 8, sum, min: $min,
                isum: |$x, $y| $isum, ysum: |$y2| $ysum, d: |$xd| $d, m: |$xm| $m);
            j0 += 8;
        }
        // The last blocks as one partial group: their lanes hold the values the scalar steps
        // would give (the same f32 operations per block), and only those lanes are added. A
        // row of a few blocks (latent attention's 128-column per-head rows) spent most of its
        // time in per-block horizontal sums before.
        if main < nb {
            $crate::x86::blocks32::reference_group!($r, w, a, main, nb - main, sum, min: $min,
                isum: |$x, $y| $isum, ysum: |$y2| $ysum, d: |$xd| $d, m: |$xm| $m);
        }
        sum
    }};
}
pub(crate) use reference_sums;

/// One group of `$cnt ≤ 8` blocks from block `$j0` of [`reference_sums`], added to `$sum`.
macro_rules! reference_group {
    ($r:expr, $w:ident, $a:ident, $j0:expr, $cnt:expr, $sum:ident, min: $min:expr,
     isum: |$x:ident, $y:ident| $isum:expr,
     ysum: |$y2:ident| $ysum:expr,
     d: |$xd:ident| $d:expr,
     m: |$xm:ident| $m:expr $(,)?) => {{
        use $crate::x86::blocks32::f16xn;
        use $crate::x86::simd256::{hsums, lanes};
        let (j0, cnt): (usize, usize) = ($j0, $cnt);
        let ys = &$a[j0..j0 + cnt];
        let dy = f16xn(cnt, |k| ys[k].d);
        let sydy = if $min {
            let mut sv = [_mm256_setzero_si256(); 8];
            for j in 0..8 {
                if j < cnt {
                    let $y2 = &ys[j];
                    sv[j] = $ysum;
                }
            }
            _mm256_mul_ps(_mm256_cvtepi32_ps(hsums(&sv)), dy)
        } else {
            dy
        };
        let mut t = [[0f32; 8]; $r];
        for r in 0..$r {
            let xs = &$w[r][j0..j0 + cnt];
            let mut iv = [_mm256_setzero_si256(); 8];
            for j in 0..8 {
                if j < cnt {
                    let ($x, $y) = (&xs[j], &ys[j]);
                    iv[j] = $isum;
                }
            }
            let dxdy = _mm256_mul_ps(
                f16xn(cnt, |k| {
                    let $xd = &xs[k];
                    $d
                }),
                dy,
            );
            let mut v = _mm256_mul_ps(_mm256_cvtepi32_ps(hsums(&iv)), dxdy);
            if $min {
                v = _mm256_add_ps(
                    v,
                    _mm256_mul_ps(
                        f16xn(cnt, |k| {
                            let $xm = &xs[k];
                            $m
                        }),
                        sydy,
                    ),
                );
            }
            t[r] = lanes::<8>(v);
        }
        for j in 0..cnt {
            for r in 0..$r {
                $sum[r] += t[r][j];
            }
        }
    }};
}
pub(crate) use reference_group;

/// Eight rows' dots with one activation row, one row per f32 lane: `$w` is `[&[B]; 8]` of
/// blocks whose f16 scale is their first field (and whose min, where `min`, the second), `$a`
/// the `&[BlockQ8_0]` (rows at least as long), `$side` their [`YSide`]s; `isum` as for
/// [`reference_sums`]. Per block, the eight rows' exact integers come out of one `hsums`, the
/// eight scales (and mins) of one transpose of the blocks' first dwords ([`scales8`]), and the
/// reference's float steps (`isum·(dx·dy)`, plus `m·(Σy·dy)` where `min`) run for the eight
/// rows at once, each added to its row's lane in block order: the reference's bits, as in
/// [`reference_sums`], but with nothing per group (no partial last group, no lanes added one by
/// one) and the activation side computed once per token. Evaluates to `[f32; 8]`; expands where
/// [`reference_sums`] does.
macro_rules! row_lane_sums {
    ($w:expr, $a:expr, $side:expr, $block:ty, min: $min:expr,
     isum: |$x:ident, $y:ident| $isum:expr $(,)?) => {{
        use $crate::x86::blocks32::scales8;
        use $crate::x86::simd256::{hsums, lanes};
        const {
            assert!(std::mem::offset_of!($block, d) == 0);
            // The min, where there is one, is the f16 right after the scale, before the quants.
            assert!(!$min || std::mem::offset_of!($block, qs) >= 4);
            assert!(size_of::<$block>() >= 16);
        }
        let w: [&[$block]; 8] = $w;
        let a: &[$crate::blocks::BlockQ8_0] = $a;
        let side: &[$crate::x86::blocks32::YSide] = $side;
        let nb = a.len();
        let rows = $crate::x86::blocks32::checked_rows(w, nb, side.len());
        // Every `unsafe` below reads block j < nb of a row, of the activations or of their
        // sides, in bounds by the checks above.
        // SAFETY: in bounds by the checks above.
        let block = |r: usize, j: usize| unsafe { &*rows[r].add(j) };
        let mut sum = _mm256_setzero_ps();
        for j in 0..nb {
            // SAFETY: in bounds by the checks above.
            let y = unsafe { &*a.as_ptr().add(j) };
            // SAFETY: in bounds by the checks above.
            let ys = unsafe { &*side.as_ptr().add(j) };
            let dy = _mm256_set1_ps(ys.dy);
            let mut iv = [_mm256_setzero_si256(); 8];
            for r in 0..8 {
                let ($x, $y) = (block(r, j), y);
                iv[r] = $isum;
            }
            // SAFETY: each block is at least 16 bytes (asserted above), in bounds.
            let (dx, mx) = unsafe { scales8(std::array::from_fn(|r| rows[r].add(j).cast())) };
            let dxdy = _mm256_mul_ps(dx, dy);
            let mut v = _mm256_mul_ps(_mm256_cvtepi32_ps(hsums(&iv)), dxdy);
            if $min {
                v = _mm256_add_ps(v, _mm256_mul_ps(mx, _mm256_set1_ps(ys.sydy)));
            }
            sum = _mm256_add_ps(sum, v);
        }
        lanes::<8>(sum)
    }};
}
pub(crate) use row_lane_sums;

/// [`row_lane_sums`] for the formats whose block is an f16 scale (and, where `min`, an f16 min
/// right after it) followed by 32 quants as 16 bytes of nibbles (Q4_0, Q4_1, IQ4_NL): the eight rows'
/// bytes are transposed in registers, so that lane r holds row r's bytes. One activation dword,
/// broadcast, then meets all eight rows in one `$dot4` (`|acc, q, y|`: `acc` plus, per 32-bit
/// lane, the sum of the four byte products of unsigned `q` and signed `y`), and the eight lanes
/// come out as the rows' block integers with no horizontal reduction; the blocks' first dwords,
/// transposed the same way, give the eight scales (and mins) with three shuffles, where
/// composing them from sixteen 16-bit loads took about fifty instructions. Per block of eight
/// rows the loop went from about 130 instructions to 68; Q4_1 1536×576, one thread, one token:
/// 41 → 28–32 µs (Xeon, AVX-512 level), with four sums so that the dependent products stay
/// short chains (two sums: 31–34 µs).
/// `map: |q|` turns the nibbles into the values that `$dot4` multiplies (IQ4_NL's levels);
/// `$offset` is subtracted from every value (Q4_0's 8) as `offset·Σy` from the exact integer.
/// The activation side of each block (its scale, `Σy`, `Σy·dy`) comes from `$side`
/// ([`y_sides`]), computed once per token for all the groups of eight rows. The same bits as
/// [`row_lane_sums`]: the integers are exact, and the float steps are the same.
macro_rules! nibble_row_lane_sums {
    ($w:expr, $a:expr, $side:expr, $block:ty, min: $min:expr, offset: $offset:expr,
     map: |$mq:ident| $map:expr,
     dot4: |$acc:ident, $q:ident, $yq:ident| $dot4:expr $(,)?) => {{
        use $crate::x86::blocks32::{scales8, transposed_dwords};
        use $crate::x86::simd256::lanes;
        const {
            assert!(std::mem::offset_of!($block, d) == 0);
            // The min, where there is one, is the f16 between the scale and the quants.
            assert!(std::mem::offset_of!($block, qs) == if $min { 4 } else { 2 });
            assert!(size_of::<$block>() >= 16);
        }
        let w: [&[$block]; 8] = $w;
        let a: &[$crate::blocks::BlockQ8_0] = $a;
        let side: &[$crate::x86::blocks32::YSide] = $side;
        let nb = a.len();
        let rows = $crate::x86::blocks32::checked_rows(w, nb, side.len());
        // Every `unsafe` below reads block j < nb of a row, of the activations or of their
        // sides, in bounds by the checks above (a weight block is at least 16 bytes, an
        // activation block's `qs` 32, eight dwords).
        // SAFETY: in bounds by the checks above.
        let block = |r: usize, j: usize| unsafe { &*rows[r].add(j) };
        let offset: i32 = $offset;
        let m4 = _mm256_set1_epi8(0x0F);
        let mut sum = _mm256_setzero_ps();
        for j in 0..nb {
            // SAFETY: in bounds by the checks above.
            let y = unsafe { &*a.as_ptr().add(j) };
            // SAFETY: in bounds by the checks above.
            let ys = unsafe { &*side.as_ptr().add(j) };
            let dy = _mm256_set1_ps(ys.dy);
            // g[k], lane r: dword k of row r's nibbles.
            // SAFETY: each block's `qs` is 16 bytes, in bounds.
            let g = unsafe { transposed_dwords(std::array::from_fn(|r| block(r, j).qs.as_ptr())) };
            let yd = y.qs.as_ptr() as *const i32;
            let mut acc = [_mm256_setzero_si256(); 4];
            for k in 0..4 {
                // Low nibbles of bytes 4k..4k+4 are quants 4k..4k+4, their high nibbles quants
                // 16+4k..20+4k. Four sums keep the chains of dependent products short.
                // SAFETY: in bounds by the checks above.
                let ylo = _mm256_set1_epi32(unsafe { yd.add(k).read_unaligned() });
                // SAFETY: in bounds by the checks above.
                let yhi = _mm256_set1_epi32(unsafe { yd.add(4 + k).read_unaligned() });
                let lo = {
                    let $mq = _mm256_and_si256(g[k], m4);
                    $map
                };
                let hi = {
                    let $mq = _mm256_and_si256(_mm256_srli_epi16::<4>(g[k]), m4);
                    $map
                };
                let (c0, c1) = (2 * (k % 2), 2 * (k % 2) + 1);
                acc[c0] = {
                    let ($acc, $q, $yq) = (acc[c0], lo, ylo);
                    $dot4
                };
                acc[c1] = {
                    let ($acc, $q, $yq) = (acc[c1], hi, yhi);
                    $dot4
                };
            }
            let mut isum = _mm256_add_epi32(
                _mm256_add_epi32(acc[0], acc[1]),
                _mm256_add_epi32(acc[2], acc[3]),
            );
            if offset != 0 {
                isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(offset * ys.sy));
            }
            // SAFETY: each block is at least 16 bytes (asserted above), in bounds.
            let (dx, mx) = unsafe { scales8(std::array::from_fn(|r| rows[r].add(j).cast())) };
            let dxdy = _mm256_mul_ps(dx, dy);
            let mut v = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), dxdy);
            if $min {
                v = _mm256_add_ps(v, _mm256_mul_ps(mx, _mm256_set1_ps(ys.sydy)));
            }
            sum = _mm256_add_ps(sum, v);
        }
        lanes::<8>(sum)
    }};
}
pub(crate) use nibble_row_lane_sums;

/// A format's dots from one description of its block arithmetic, compiled for `$features`
/// (in a level's `legacy` module, which has the `blocks` helper): `$dot`, the single-row dot
/// ([`reference_sums`]), and `$dots8`, eight rows a row per lane ([`row_lane_sums`]: the panels
/// and chunked sums below four tokens), with the same bits.
macro_rules! dots_fns {
    ($features:literal; $(#[$doc:meta])* $dot:ident, $dots8:ident, $block:ty, min: $min:literal,
     setup: { $($setup:tt)* },
     isum: |$x:ident, $y:ident| $isum:expr,
     ysum: |$y2:ident| $ysum:expr,
     d: |$xd:ident| $d:expr,
     m: |$xm:ident| $m:expr $(,)?) => {
        $crate::x86::blocks32::dots_fns!(@fns $features; $(#[$doc])* $dot, $dots8, $block,
            min: $min, setup: { $($setup)* }, isum: |$x, $y| $isum, ysum: |$y2| $ysum,
            d: |$xd| $d, m: |$xm| $m,
            rows8: |w, a, side| $crate::x86::blocks32::row_lane_sums!(w, a, side, $block,
                min: $min, isum: |$x, $y| $isum));
    };
    // The nibble formats: `$dots8` transposes the rows' nibbles ([`nibble_row_lane_sums`]).
    ($features:literal; $(#[$doc:meta])* $dot:ident, $dots8:ident, $block:ty, min: $min:literal,
     setup: { $($setup:tt)* },
     isum: |$x:ident, $y:ident| $isum:expr,
     ysum: |$y2:ident| $ysum:expr,
     d: |$xd:ident| $d:expr,
     m: |$xm:ident| $m:expr,
     nibbles: {
         offset: $offset:expr,
         map: |$mq:ident| $map:expr,
         dot4: |$acc:ident, $q:ident, $yq:ident| $dot4:expr $(,)?
     } $(,)?) => {
        $crate::x86::blocks32::dots_fns!(@fns $features; $(#[$doc])* $dot, $dots8, $block,
            min: $min, setup: { $($setup)* }, isum: |$x, $y| $isum, ysum: |$y2| $ysum,
            d: |$xd| $d, m: |$xm| $m,
            rows8: |w, a, side| $crate::x86::blocks32::nibble_row_lane_sums!(w, a, side, $block,
                min: $min, offset: $offset, map: |$mq| $map, dot4: |$acc, $q, $yq| $dot4));
    };
    (@fns $features:literal; $(#[$doc:meta])* $dot:ident, $dots8:ident, $block:ty,
     min: $min:literal,
     setup: { $($setup:tt)* },
     isum: |$x:ident, $y:ident| $isum:expr,
     ysum: |$y2:ident| $ysum:expr,
     d: |$xd:ident| $d:expr,
     m: |$xm:ident| $m:expr,
     rows8: |$w:ident, $a:ident, $side:ident| $rows8:expr) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        pub(super) fn $dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
            $($setup)*
            let (w, a) = blocks::<$block, 1>(n, [w], a);
            let [s] = $crate::x86::blocks32::reference_sums!(1, w, a, min: $min,
                isum: |$x, $y| $isum, ysum: |$y2| $ysum, d: |$xd| $d, m: |$xm| $m);
            s
        }

        /// Eight rows' dots with one activation row, a row per lane (the same bits as `$dot`),
        /// the activations' sides from [`y_sides`].
        // The setup is the single-row dot's; this form uses what its own arithmetic names.
        #[allow(unused_variables)]
        #[target_feature(enable = $features)]
        pub(crate) fn $dots8(
            n: usize,
            $w: [&[u8]; 8],
            $a: &[u8],
            $side: &[$crate::x86::blocks32::YSide],
        ) -> [f32; 8] {
            $($setup)*
            let ($w, $a) = blocks::<$block, 8>(n, $w, $a);
            $rows8
        }
    };
}
pub(crate) use dots_fns;

/// One block of a group of `G` tokens' activations (Q8_0), one token per 32-bit lane: what the
/// panels' inner loop reads, 64-byte aligned.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct TokenBlock<const G: usize> {
    /// `y[g][t]`: bytes `4g..4g+4` of token t's quants.
    pub y: [[i32; G]; 8],
    /// `−k·Σy` of each token, for weights stored as `w + k` (the start of the integer sums).
    pub start: [i32; G],
    /// Each token's scale.
    pub dy: [f32; G],
    /// `(Σy as f32)·dy` of each token, for the min of Q4_1/Q5_1.
    pub sydy: [f32; G],
}

impl<const G: usize> TokenBlock<G> {
    const ZERO: TokenBlock<G> = TokenBlock {
        y: [[0; G]; 8],
        start: [0; G],
        dy: [0.0; G],
        sydy: [0.0; G],
    };
}

/// Tokens that packed nothing (past the panel's last token) read this block: zero quants and
/// scales, so their lanes stay zero.
static ZERO_BLOCK: BlockQ8_0 = BlockQ8_0 {
    d: [0; 2],
    qs: [0; 32],
};

/// Packs tokens `t0..t0 + G` (those below `p.n`; the others are zero) of the panel's
/// activations, all `nb` blocks, into `out`, with `start = −k·Σy`.
///
/// # Safety
/// The panel's activation rows `t0..min(t0 + G, p.n)` hold `nb` readable Q8_0 blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn pack_tokens<const G: usize>(
    p: &Panel,
    t0: usize,
    nb: usize,
    k: i32,
    out: &mut Vec<TokenBlock<G>>,
) {
    const { assert!(G.is_multiple_of(8)) };
    out.clear();
    out.resize(nb, TokenBlock::ZERO);
    let rows: [&[BlockQ8_0]; G] = std::array::from_fn(|t| {
        if t0 + t < p.n {
            // SAFETY: token t0 + t < n has `nb` readable Q8_0 blocks (the contract above); they
            // are plain bytes of alignment 1 and not written while the panel runs.
            unsafe { std::slice::from_raw_parts(p.a.add((t0 + t) * p.a_stride).cast(), nb) }
        } else {
            std::slice::from_ref(&ZERO_BLOCK)
        }
    });
    let block = |t: usize, j: usize| {
        let r = rows[t];
        if r.len() == 1 { &r[0] } else { &r[j] }
    };
    let ones8 = _mm256_set1_epi8(1);
    let ones16 = _mm256_set1_epi16(1);
    let neg_k = _mm256_set1_epi32(-k);
    for (j, tb) in out.iter_mut().enumerate() {
        for o in (0..G).step_by(8) {
            let r: [__m256i; 8] = std::array::from_fn(|i| load256_of(&block(o + i, j).qs));
            let y = transpose8x8(r);
            let mut sy = _mm256_setzero_si256();
            for (g, &yg) in y.iter().enumerate() {
                // SAFETY: lanes o..o + 8 of row g (o + 8 ≤ G): 32 bytes inside `tb.y`.
                unsafe { _mm256_storeu_si256(tb.y[g].as_mut_ptr().add(o).cast(), yg) };
                sy = _mm256_add_epi32(
                    sy,
                    _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, yg), ones16),
                );
            }
            let dy: [u8; 16] = std::array::from_fn(|b| block(o + b / 2, j).d[b % 2]);
            let dy = _mm256_cvtph_ps(load128_of(&dy));
            let start = _mm256_mullo_epi32(sy, neg_k);
            let sydy = _mm256_mul_ps(_mm256_cvtepi32_ps(sy), dy);
            // SAFETY: lanes o..o + 8 (o + 8 ≤ G) of `start`, `dy` and `sydy`.
            unsafe {
                _mm256_storeu_si256(tb.start.as_mut_ptr().add(o).cast(), start);
                _mm256_storeu_ps(tb.dy.as_mut_ptr().add(o), dy);
                _mm256_storeu_ps(tb.sydy.as_mut_ptr().add(o), sydy);
            }
        }
    }
}

/// Row i of the result is lane i of every input: an 8×8 transpose of 32-bit lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn transpose8x8(r: [__m256i; 8]) -> [__m256i; 8] {
    let t0 = _mm256_unpacklo_epi32(r[0], r[1]);
    let t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    let t2 = _mm256_unpacklo_epi32(r[2], r[3]);
    let t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    let t4 = _mm256_unpacklo_epi32(r[4], r[5]);
    let t5 = _mm256_unpackhi_epi32(r[4], r[5]);
    let t6 = _mm256_unpacklo_epi32(r[6], r[7]);
    let t7 = _mm256_unpackhi_epi32(r[6], r[7]);
    // [column c of rows 0..4 | column c + 4 of rows 0..4], likewise rows 4..8.
    let u0 = _mm256_unpacklo_epi64(t0, t2);
    let u1 = _mm256_unpackhi_epi64(t0, t2);
    let u2 = _mm256_unpacklo_epi64(t1, t3);
    let u3 = _mm256_unpackhi_epi64(t1, t3);
    let u4 = _mm256_unpacklo_epi64(t4, t6);
    let u5 = _mm256_unpackhi_epi64(t4, t6);
    let u6 = _mm256_unpacklo_epi64(t5, t7);
    let u7 = _mm256_unpackhi_epi64(t5, t7);
    [
        _mm256_permute2x128_si256::<0x20>(u0, u4),
        _mm256_permute2x128_si256::<0x20>(u1, u5),
        _mm256_permute2x128_si256::<0x20>(u2, u6),
        _mm256_permute2x128_si256::<0x20>(u3, u7),
        _mm256_permute2x128_si256::<0x31>(u0, u4),
        _mm256_permute2x128_si256::<0x31>(u1, u5),
        _mm256_permute2x128_si256::<0x31>(u2, u6),
        _mm256_permute2x128_si256::<0x31>(u3, u7),
    ]
}

/// The dwords of a block's 32 weight bytes, for broadcasting one at a time.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn dwords(v: __m256i) -> [i32; 8] {
    let mut out = [0i32; 8];
    // SAFETY: the store writes 32 bytes, exactly `out`.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), v) };
    out
}

/// Writes a panel result of one row and a group of tokens (`v[t]` for token `t0 + t`, those
/// below `p.n`) to the output.
///
/// # Safety
/// Row `r` lies inside the panel.
#[inline(always)]
pub(crate) unsafe fn store_tokens<const G: usize>(p: &Panel, r: usize, t0: usize, v: &[f32; G]) {
    for (t, &x) in v.iter().enumerate().take(p.n.saturating_sub(t0)) {
        // SAFETY: row r and token t0 + t < n lie inside the panel, whose outputs the caller of
        // the panel kernel guarantees writable and unaliased.
        unsafe { *p.out.add((t0 + t) * p.out_stride + r) = x };
    }
}

/// What the nibble formats' eight-row dots read of one Q8_0 activation block, computed once per
/// token ([`y_sides`]) instead of once per group of eight rows: its scale, `Σy`, and `Σy·dy` (as
/// the reference computes it, `(Σy as f32)·dy`).
#[derive(Clone, Copy, Default)]
pub(crate) struct YSide {
    pub dy: f32,
    pub sy: i32,
    pub sydy: f32,
}

/// The sides of the activation blocks `a`, into `out` (cleared first).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn y_sides(a: &[BlockQ8_0], out: &mut Vec<YSide>) {
    let ones8 = _mm256_set1_epi8(1);
    let ones16 = _mm256_set1_epi16(1);
    out.clear();
    out.extend(a.iter().map(|y| {
        let dy = f16_scalar(&y.d);
        let sy = hsum_epi32(_mm256_madd_epi16(
            _mm256_maddubs_epi16(ones8, load256_of(&y.qs)),
            ones16,
        ));
        YSide {
            dy,
            sy,
            sydy: sy as f32 * dy,
        }
    }));
}

std::thread_local! {
    static Y_SIDES: std::cell::Cell<Vec<YSide>> = const { std::cell::Cell::new(Vec::new()) };
    static GROUPS8: std::cell::Cell<Vec<TokenBlock<8>>> = const { std::cell::Cell::new(Vec::new()) };
    static GROUPS16: std::cell::Cell<Vec<TokenBlock<16>>> =
        const { std::cell::Cell::new(Vec::new()) };
}

/// The thread's buffer of packed blocks for groups of 8 tokens (reused across panel calls; give
/// it back with [`put_groups8`]).
pub(crate) fn take_groups8() -> Vec<TokenBlock<8>> {
    GROUPS8.take()
}

pub(crate) fn put_groups8(v: Vec<TokenBlock<8>>) {
    GROUPS8.set(v);
}

/// The thread's buffer of activation sides (give it back with [`put_y_sides`]).
pub(crate) fn take_y_sides() -> Vec<YSide> {
    Y_SIDES.take()
}

pub(crate) fn put_y_sides(v: Vec<YSide>) {
    Y_SIDES.set(v);
}

/// As [`take_groups8`], for groups of 16 tokens.
pub(crate) fn take_groups16() -> Vec<TokenBlock<16>> {
    GROUPS16.take()
}

pub(crate) fn put_groups16(v: Vec<TokenBlock<16>>) {
    GROUPS16.set(v);
}

/// A level's chunk-rows kernels (see [`crate::panel::ChunkRowsFn`]) with eight rows a row per
/// lane, each `$name = $dots8` with `$dots8` the format's eight-row dot (`legacy::dots8_*`, from
/// [`row_lane_sums`]): a task's rows eight at a time, chunk by chunk.
macro_rules! chunk_row_lanes_kernels {
    ($features:literal; $($name:ident = $($dots8:ident)::+),+ $(,)?) => {$(
        /// The chunk-rows kernel of this format (the dot's bits per chunk and row).
        ///
        /// # Safety
        /// As for [`crate::panel::ChunkRowsFn`].
        #[target_feature(enable = $features)]
        pub unsafe fn $name(cd: &$crate::panel::ChunkDots, rows: usize, w_stride: usize) {
            if rows == 0 || cd.chunks == 0 {
                return;
            }
            // SAFETY: the token's chunks are `chunks` contiguous runs of `a_bytes` bytes (the
            // kernel's contract).
            let acts = unsafe { std::slice::from_raw_parts(cd.a, cd.chunks * cd.a_bytes) };
            let mut sides = $crate::x86::blocks32::take_y_sides();
            $crate::x86::blocks32::y_sides(bytemuck::cast_slice(acts), &mut sides);
            let chunk_blocks = cd.a_bytes / size_of::<$crate::blocks::BlockQ8_0>();
            let ahead = $crate::prefetch::stream_prefetch();
            for r0 in (0..rows).step_by(8) {
                $crate::x86::blocks32::next_group_ahead(cd.w, r0, rows, w_stride, ahead);
                for c in 0..cd.chunks {
                    let w: [&[u8]; 8] = std::array::from_fn(|i| {
                        let r = (r0 + i).min(rows - 1);
                        // SAFETY: chunk c of row r < rows is readable (the contract).
                        unsafe {
                            std::slice::from_raw_parts(
                                cd.w.add(r * w_stride + c * cd.w_bytes),
                                cd.w_bytes,
                            )
                        }
                    });
                    let a = &acts[c * cd.a_bytes..(c + 1) * cd.a_bytes];
                    let side = &sides[c * chunk_blocks..(c + 1) * chunk_blocks];
                    let v = $($dots8)::+(cd.k, w, a, side);
                    for (i, &x) in v.iter().enumerate().take(rows - r0) {
                        // SAFETY: output (r0 + i, c) is one of the `rows · chunks` writable
                        // values, aliasing no input.
                        unsafe { *cd.out.add((r0 + i) * cd.chunks + c) = x };
                    }
                }
            }
            $crate::x86::blocks32::put_y_sides(sides);
        }
    )+};
}
pub(crate) use chunk_row_lanes_kernels;

/// Before eight rows a row per lane run, asks for the next eight rows' bytes (`rows` rows
/// `stride` bytes apart from `base`) where this machine prefetches decode streams of this
/// size (`ahead`, `crate::prefetch`) and they are at most 16 KiB. Their lanes read eight rows at once, so
/// the rows-ahead ranges of the single-row loops do not fit: in SmolLM2-135M's decode (cold
/// weights, 2 threads, Xeon) this took tg64 from 76-93 to 99-121 t/s in four alternating
/// rounds, where no prefetch gave 82-106 and rows-ahead 90-122. Longer groups stream well
/// without it (Q8_0 8192x8192, one thread: 2.4 ms; 4.3 ms with rows-ahead).
#[inline(always)]
pub(crate) fn next_group_ahead(
    base: *const u8,
    r0: usize,
    rows: usize,
    stride: usize,
    ahead: crate::prefetch::StreamPrefetch,
) {
    const MAX_GROUP: usize = 16 * 1024;
    if ahead.distance == 0 || 8 * stride > MAX_GROUP || rows * stride > ahead.max_block {
        return;
    }
    let (from, to) = ((r0 + 8).min(rows) * stride, (r0 + 16).min(rows) * stride);
    crate::prefetch::prefetch(base.wrapping_add(from), to - from);
}

/// A panel of fewer tokens than a level's `tokens_panel` packs, eight rows at a time with a row
/// per lane (`dots8`: the format's `legacy::dots8_*`); the last rows repeat the panel's last
/// row to fill a call, and only the panel's outputs are written. Each row stays one stream, and
/// the eight streams advance together; [`next_group_ahead`] asks for the next eight rows.
///
/// # Safety
/// As for [`crate::panel::PanelFn`], for a 32-element format with blocks `B`.
#[inline(always)]
pub(crate) unsafe fn few_tokens_row_lanes<B>(
    p: &Panel,
    dots8: impl Fn(usize, [&[u8]; 8], &[u8], &[YSide]) -> [f32; 8],
) {
    let nb = p.k / crate::blocks::QK8_0;
    let (w_bytes, a_bytes) = (nb * size_of::<B>(), nb * size_of::<BlockQ8_0>());
    let ahead = crate::prefetch::decode_prefetch(p.n);
    let mut sides = take_y_sides();
    for t in 0..p.n {
        // SAFETY: token t < n has `a_bytes` readable bytes (the panel's contract), not written
        // while the panel runs.
        let a = unsafe { std::slice::from_raw_parts(p.a.add(t * p.a_stride), a_bytes) };
        // SAFETY: the panel kernels that call this run with AVX2, FMA and F16C.
        unsafe { y_sides(bytemuck::cast_slice(a), &mut sides) };
        for r0 in (0..p.rows).step_by(8) {
            next_group_ahead(p.w, r0, p.rows, p.w_stride, ahead);
            let w: [&[u8]; 8] = std::array::from_fn(|i| {
                let r = (r0 + i).min(p.rows - 1);
                // SAFETY: row r < rows has `w_bytes` readable bytes, likewise.
                unsafe { std::slice::from_raw_parts(p.w.add(r * p.w_stride), w_bytes) }
            });
            let v = dots8(p.k, w, a, &sides);
            for (i, &x) in v.iter().enumerate().take(p.rows - r0) {
                // SAFETY: output (t, r0 + i) lies inside the panel, writable and unaliased.
                unsafe { *p.out.add(t * p.out_stride + r0 + i) = x };
            }
        }
    }
    put_y_sides(sides);
}
