//! The loop shared by the AVX2 and AVX-512 kernels of the 32-element formats (Q4_0 … Q8_0;
//! MXFP4 has its own, `crate::x86::mxfp4`) against Q8_0 activations: one block per 256-bit
//! register, blocks taken in batches of 8.
//!
//! Per block, the integer work is only 5 to 9 instructions, so the two f16 scales would cost
//! almost as much again if each were broadcast and converted on its own. A batch gathers its 8
//! weight scales and 8 activation scales with scalar loads into one register each, converts them
//! with one `vcvtph2ps` and multiplies them once; each block then takes its product with one or
//! two shuffles. (Measured on Zen 4: −11% time for Q4_0 with AVX2; gathering the scales with
//! `vpermt2w` from vector loads was three times slower.)

use std::arch::x86_64::*;

/// The f16 field `field(b)` of 8 blocks, as 8 lanes of f32.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn f16x8<T>(blocks: &[T], field: impl Fn(&T) -> [u8; 2]) -> __m256 {
    let (mut lo, mut hi) = (0u64, 0u64);
    for k in 0..4 {
        lo |= (u16::from_le_bytes(field(&blocks[k])) as u64) << (16 * k);
        hi |= (u16::from_le_bytes(field(&blocks[k + 4])) as u64) << (16 * k);
    }
    _mm256_cvtph_ps(_mm_set_epi64x(hi as i64, lo as i64))
}

/// Σ over the blocks of one row of `scale · lanes`, where `body(x, y) -> __m256i` gives the
/// integer lanes of one block and each lane's f32 multiplier alternates between two values
/// `(p, q)` of the block (`p = q = d·dy` for most formats; `d·dy, m·dy` for Q4_1/Q5_1, whose
/// `body` interleaves `Σ q·y` and `Σ y` lanes):
/// - `scales8(xs, ys) -> (__m256, __m256)`: `p` and `q` of 8 blocks, lane k for block k;
/// - `scales1(x, y) -> __m256`: the multipliers of one leftover block, `[p, q, p, q, ...]`.
///
/// A block's `[p, q]` pair is one 64-bit lane of `unpacklo/hi_ps(p, q)`, so it is broadcast with
/// a single `vpermpd` (LLVM picks cheaper shuffles where `p = q`). Two accumulators alternate
/// blocks. Expands inside a `#[target_feature]`
/// function that has `std::arch::x86_64::*` in scope.
macro_rules! sum_blocks {
    ($wty:ty, $n:expr, $w:expr, $a:expr,
     scales8: |$xs:ident, $ys:ident| $scales8:expr,
     scales1: |$x1:ident, $y1:ident| $scales1:expr,
     body: |$x:ident, $y:ident| $body:expr $(,)?) => {{
        let nb = $n / 32;
        let w: &[$wty] = &bytemuck::cast_slice($w)[..nb];
        let a: &[$crate::blocks::BlockQ8_0] = &bytemuck::cast_slice($a)[..nb];
        let mut acc = [_mm256_setzero_ps(); 2];
        for (xs8, ys8) in w.chunks_exact(8).zip(a.chunks_exact(8)) {
            let (p, q): (__m256, __m256) = {
                let ($xs, $ys) = (xs8, ys8);
                $scales8
            };
            // 64-bit lanes: [b0, b1, b4, b5] and [b2, b3, b6, b7].
            let pairs = [_mm256_unpacklo_ps(p, q), _mm256_unpackhi_ps(p, q)];
            // Written out so that the lane index is a constant (a loop was not always unrolled).
            $crate::x86::blocks32::batch_step!(0, xs8, ys8, pairs, acc, |$x, $y| $body);
            $crate::x86::blocks32::batch_step!(1, xs8, ys8, pairs, acc, |$x, $y| $body);
            $crate::x86::blocks32::batch_step!(2, xs8, ys8, pairs, acc, |$x, $y| $body);
            $crate::x86::blocks32::batch_step!(3, xs8, ys8, pairs, acc, |$x, $y| $body);
            $crate::x86::blocks32::batch_step!(4, xs8, ys8, pairs, acc, |$x, $y| $body);
            $crate::x86::blocks32::batch_step!(5, xs8, ys8, pairs, acc, |$x, $y| $body);
            $crate::x86::blocks32::batch_step!(6, xs8, ys8, pairs, acc, |$x, $y| $body);
            $crate::x86::blocks32::batch_step!(7, xs8, ys8, pairs, acc, |$x, $y| $body);
        }
        for j in nb - nb % 8..nb {
            let ($x1, $y1) = (&w[j], &a[j]);
            let d: __m256 = $scales1;
            let ($x, $y) = (&w[j], &a[j]);
            let s: __m256i = $body;
            acc[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), acc[0]);
        }
        $crate::x86::simd256::hsum_ps(_mm256_add_ps(acc[0], acc[1]))
    }};
}
pub(crate) use sum_blocks;

/// Block `$j` (a literal) of a batch in [`sum_blocks`]: its `[p, q]` pair is 64-bit lane
/// `j % 2 + 2·(j / 4)` of `pairs[(j / 2) % 2]`.
macro_rules! batch_step {
    ($j:literal, $xs8:ident, $ys8:ident, $pairs:ident, $acc:ident,
     |$x:ident, $y:ident| $body:expr) => {{
        let ($x, $y) = (&$xs8[$j], &$ys8[$j]);
        let s: __m256i = $body;
        const LANE: i32 = ($j % 2 + 2 * ($j / 4)) as i32;
        let idx = _mm256_setr_epi32(
            2 * LANE,
            2 * LANE + 1,
            2 * LANE,
            2 * LANE + 1,
            2 * LANE,
            2 * LANE + 1,
            2 * LANE,
            2 * LANE + 1,
        );
        let d = _mm256_permutevar8x32_ps($pairs[($j / 2) % 2], idx);
        $acc[$j % 2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), $acc[$j % 2]);
    }};
}
pub(crate) use batch_step;
