//! Q4_K at the AVX2 and AVX-512 levels, in the **octet arithmetic**: superblock b's float step
//! is the scalar reference's (`formats::kquants::dot_q4_k`: `(dy·d)·isum − (dy·dmin)·msum` from
//! the superblock's exact integer sums), it is added to lane b mod 8 of eight f32 sums
//! (superblocks in order, the sums starting at 0.0), and the dot is `simd256::hsum_ps` of the
//! eight sums (`((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7))`). Both levels give the same
//! bits, so a cluster mixing them stays bit-identical.
//!
//! Why this arithmetic: a dot of one row reduces eight superblocks' integer sums together
//! (`hsums`) and runs their float steps as one vector, about as cheap as the lane arithmetic it
//! replaced (every integer lane of every superblock scaled into two float accumulators; Zen 4,
//! one thread: 97 against 94 µs for a 2048×2048 matvec from L3, the same from DRAM) and without
//! the serial chain of the reference's running sum (the AMX level's arithmetic, ~18 % slower).
//! And a panel with one weight row per lane (`avx512::row_lanes`), which gets each superblock's
//! exact integer sum per row and token for free, only adds each step to one of eight sums:
//! the lane arithmetic would need eight integer and float lanes per row and token there, which
//! is what kept the Q4_K GEMM at about 120 GFLOP/s a thread (now 260, Zen 4).

use std::arch::x86_64::*;

use crate::x86::simd256::hsums;

/// The reference's float steps of up to eight superblocks, lane i for superblock i (lanes past
/// the superblocks: zero sums, scales and `d` give +0.0), from their integer sums (`isum`,
/// `msum`: eight lanes each, reduced here), the activations' scales `dy` and the blocks' f16
/// `d` and `dmin` (little-endian, as stored).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn steps(
    isum: &[__m256i; 8],
    msum: &[__m256i; 8],
    dy: __m256,
    d: &[u16; 8],
    dmin: &[u16; 8],
) -> __m256 {
    // SAFETY: each load reads the sixteen bytes of one array.
    let (d, dmin) = unsafe {
        (
            _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr() as *const __m128i)),
            _mm256_cvtph_ps(_mm_loadu_si128(dmin.as_ptr() as *const __m128i)),
        )
    };
    let scaled = _mm256_mul_ps(_mm256_mul_ps(dy, d), _mm256_cvtepi32_ps(hsums(isum)));
    let mins = _mm256_mul_ps(_mm256_mul_ps(dy, dmin), _mm256_cvtepi32_ps(hsums(msum)));
    _mm256_sub_ps(scaled, mins)
}

/// `simd256::hsum_ps`'s tree over eight vectors of sums, lane by lane: lane t of the result is
/// the dot whose eight sums are lane t of `s[0..8]`.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn tree(s: &[__m256; 8]) -> __m256 {
    let a = |i: usize| _mm256_add_ps(s[i], s[i + 4]);
    _mm256_add_ps(_mm256_add_ps(a(0), a(2)), _mm256_add_ps(a(1), a(3)))
}

/// `q4k_octet_kernels!(features, accumulate)`: the octet arithmetic's Q4_K dot
/// (`dot_q4_k_impl`), chunk-dots kernel (`chunks_q4_k`) and a tile that computes each
/// (row, token)'s integer sums as the dot does (`tile_by_dots`), for a level's features and its
/// `accumulate(acc, pairs, scales)` of 16-bit products.
macro_rules! q4k_octet_kernels {
    ($features:literal, $acc:path) => {
        /// Superblocks `b0..b0 + K` (K = 8) or `b0..b0 + k` (K = 0) of a row and a token:
        /// their float steps.
        ///
        /// # Safety
        /// Those blocks of `w` and `a` are readable.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn octet<const K: usize>(
            w: *const BlockQ4K,
            a: *const BlockQ8K,
            b0: usize,
            k: usize,
        ) -> __m256 {
            let m4 = _mm256_set1_epi8(0x0F);
            let zero = _mm256_setzero_si256();
            macro_rules! superblock {
                ($i:expr) => {{
                    // SAFETY: block b0 + i of the row and the token is readable (i < 8 = K,
                    // or i < k: the contract above); plain bytes of alignment 1.
                    let (x, y) = unsafe { (&*w.add(b0 + $i), &*a.add(b0 + $i)) };
                    let (isum, msum) =
                        $crate::x86::kq256::q4k_q5k_body!(x, y, m4, $acc, |g, lo, hi| (lo, hi));
                    (
                        isum,
                        msum,
                        u16::from_le_bytes(x.d),
                        u16::from_le_bytes(x.dmin),
                        y.d(),
                    )
                }};
            }
            let mut isum = [zero; 8];
            let mut msum = [zero; 8];
            let mut d = [0u16; 8];
            let mut dmin = [0u16; 8];
            let mut dy = [0f32; 8];
            if K == 8 {
                // A whole octet written out, so that the sums stay in registers (a loop
                // indexing the arrays kept them in memory: 20 % slower on Zen 4).
                let p = [
                    superblock!(0),
                    superblock!(1),
                    superblock!(2),
                    superblock!(3),
                    superblock!(4),
                    superblock!(5),
                    superblock!(6),
                    superblock!(7),
                ];
                for i in 0..8 {
                    (isum[i], msum[i], d[i], dmin[i], dy[i]) = p[i];
                }
            } else {
                for i in 0..k {
                    (isum[i], msum[i], d[i], dmin[i], dy[i]) = superblock!(i);
                }
            }
            // SAFETY: the load reads the eight values of `dy`.
            let dy = unsafe { _mm256_loadu_ps(dy.as_ptr()) };
            $crate::x86::q4k_octets::steps(&isum, &msum, dy, &d, &dmin)
        }

        /// The eight sums of superblocks `b0..b1` of a row and a token.
        ///
        /// # Safety
        /// Blocks `b0..b1` of `w` and `a` are readable.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn octet_sums(
            w: *const BlockQ4K,
            a: *const BlockQ8K,
            b0: usize,
            b1: usize,
        ) -> __m256 {
            let mut s = _mm256_setzero_ps();
            let mut b = b0;
            while b + 8 <= b1 {
                // SAFETY: blocks b..b + 8 ≤ b1 (the contract above).
                s = _mm256_add_ps(s, unsafe { octet::<8>(w, a, b, 8) });
                b += 8;
            }
            if b < b1 {
                // SAFETY: blocks b..b1 (the contract above).
                s = _mm256_add_ps(s, unsafe { octet::<0>(w, a, b, b1 - b) });
            }
            s
        }

        /// The Q4_K dot in the octet arithmetic.
        #[target_feature(enable = $features)]
        pub(super) fn dot_q4_k_impl(n: usize, w: &[u8], a: &[u8]) -> f32 {
            let nb = n / QK_K;
            let (w, a): (&[BlockQ4K], &[BlockQ8K]) =
                (bytemuck::cast_slice(w), bytemuck::cast_slice(a));
            assert!(
                w.len() >= nb && a.len() >= nb,
                "Q4_K dot of {nb} superblocks"
            );
            // SAFETY: blocks 0..nb of both, checked above.
            $crate::x86::simd256::hsum_ps(unsafe { octet_sums(w.as_ptr(), a.as_ptr(), 0, nb) })
        }

        /// The chunk-dots kernel of the Q4_K dot (`crate::panel::ChunkDotsFn`): each chunk's
        /// value is that dot's bits on the chunk. Chunks of one superblock (256 columns, the
        /// common case) run eight at a time, their steps as one vector: a one-step dot is
        /// `hsum_ps([0 + s, 0, …])`, which `tree` reproduces with zero sums.
        ///
        /// # Safety
        /// As for [`crate::panel::ChunkDotsFn`]; the chunks are contiguous (chunk c starts at
        /// block c·k/256 of the row and of the activations).
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn chunks_q4_k(c: &$crate::panel::ChunkDots) {
            let per = c.k / QK_K;
            let (w, a) = (c.w as *const BlockQ4K, c.a as *const BlockQ8K);
            if per == 1 {
                let zero = _mm256_setzero_ps();
                let mut ch = 0;
                while ch < c.chunks {
                    let k = (c.chunks - ch).min(8);
                    // SAFETY: blocks ch..ch + k of the row and the activations (chunks of one
                    // block, contiguous and readable by the contract).
                    let s = unsafe {
                        if k == 8 {
                            octet::<8>(w, a, ch, 8)
                        } else {
                            octet::<0>(w, a, ch, k)
                        }
                    };
                    let s = _mm256_add_ps(zero, s);
                    let v = $crate::x86::q4k_octets::tree(&[
                        s, zero, zero, zero, zero, zero, zero, zero,
                    ]);
                    let mut out = [0f32; 8];
                    // SAFETY: the store writes the eight values of `out`.
                    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
                    for (i, &x) in out[..k].iter().enumerate() {
                        // SAFETY: chunk ch + i < chunks: an output of the contract.
                        unsafe { *c.out.add(ch + i) = x };
                    }
                    ch += k;
                }
                return;
            }
            for ch in 0..c.chunks {
                // SAFETY: blocks ch·per..(ch + 1)·per (chunk ch, contiguous and readable);
                // output ch.
                unsafe {
                    *c.out.add(ch) =
                        $crate::x86::simd256::hsum_ps(octet_sums(w, a, ch * per, (ch + 1) * per))
                };
            }
        }
    };
}
pub(crate) use q4k_octet_kernels;

/// `q4k_octet_tile!(name, features, accumulate)`: a register tile (`crate::x86::tiles`) of R
/// rows × T ≤ 8 tokens in the octet arithmetic with `vpmaddubsw` byte products and
/// `accumulate(acc, pairs, scales)` (for levels without VNNI: AVX2): each row's quants and
/// scales unpacked once per superblock for the T tokens; per superblock and row the tokens'
/// integer sums are reduced together (one token per lane) and their float steps go into the
/// row's sums for lane b mod 8.
macro_rules! q4k_octet_tile {
    ($name:ident, $features:literal, $acc:path) => {
        /// # Safety
        /// Each `w[r]` points at `nb` readable Q4_K blocks and each `a[t]` at `nb` Q8_K blocks.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize, const T: usize>(
            nb: usize,
            w: [*const u8; R],
            a: [*const u8; T],
        ) -> [[f32; T]; R] {
            use $crate::x86::kq256::{K4_MINS, K4_SCALE};
            use $crate::x86::scales::unpack_k4;
            use $crate::x86::simd256::{load128, load256, load256_of};
            const { assert!(T <= 8) };
            let w = w.map(|p| p as *const BlockQ4K);
            let a = a.map(|p| p as *const BlockQ8K);
            let m4 = _mm256_set1_epi8(0x0F);
            let zero = _mm256_setzero_si256();
            let mut sums = [[_mm256_setzero_ps(); 8]; R];
            for b in 0..nb {
                // SAFETY: block b < nb of every row is readable (the contract above).
                let xs: [&BlockQ4K; R] = std::array::from_fn(|r| unsafe { &*w[r].add(b) });
                // SAFETY: block b < nb of every token is readable (the contract above); plain
                // bytes of alignment 1.
                let ys: [&BlockQ8K; T] = std::array::from_fn(|t| unsafe { &*a[t].add(b) });
                let u: [__m256i; R] = std::array::from_fn(|r| {
                    // SAFETY: the first 16 of the 144 bytes of block `xs[r]`.
                    let raw = unsafe { load128(xs[r] as *const BlockQ4K as *const u8) };
                    _mm256_broadcastsi128_si256(unpack_k4(raw))
                });
                let mut isum = [[zero; 8]; R];
                for g in 0..4 {
                    let mut lo = [zero; R];
                    let mut hi = [zero; R];
                    let mut slo = [zero; R];
                    let mut shi = [zero; R];
                    for r in 0..R {
                        // SAFETY: bytes 32g..32g + 32 of the 128 in `qs` (g < 4).
                        let q = unsafe { load256(xs[r].qs.as_ptr().add(32 * g)) };
                        lo[r] = _mm256_and_si256(q, m4);
                        hi[r] = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
                        slo[r] = _mm256_shuffle_epi8(u[r], load256_of(&K4_SCALE[2 * g]));
                        shi[r] = _mm256_shuffle_epi8(u[r], load256_of(&K4_SCALE[2 * g + 1]));
                    }
                    for t in 0..T {
                        let q8 = ys[t].qs.as_ptr() as *const u8;
                        // SAFETY: bytes 64g..64g + 64 of the 256 in `ys[t].qs` (g < 4).
                        let alo = unsafe { load256(q8.add(64 * g)) };
                        // SAFETY: as above.
                        let ahi = unsafe { load256(q8.add(64 * g + 32)) };
                        for r in 0..R {
                            let plo = _mm256_maddubs_epi16(lo[r], alo);
                            let phi = _mm256_maddubs_epi16(hi[r], ahi);
                            isum[r][t] = $acc($acc(isum[r][t], plo, slo[r]), phi, shi[r]);
                        }
                    }
                }
                let dy: [f32; 8] = std::array::from_fn(|t| if t < T { ys[t].d() } else { 0.0 });
                // SAFETY: the load reads the 8 floats of `dy`.
                let dy = unsafe { _mm256_loadu_ps(dy.as_ptr()) };
                for r in 0..R {
                    let mins = _mm256_shuffle_epi8(u[r], load256_of(&K4_MINS));
                    let mut msum = [zero; 8];
                    for t in 0..T {
                        msum[t] = _mm256_madd_epi16(mins, load256_of(&ys[t].bsums));
                    }
                    let d = [u16::from_le_bytes(xs[r].d); 8];
                    let dmin = [u16::from_le_bytes(xs[r].dmin); 8];
                    let s = $crate::x86::q4k_octets::steps(&isum[r], &msum, dy, &d, &dmin);
                    sums[r][b % 8] = _mm256_add_ps(sums[r][b % 8], s);
                }
            }
            std::array::from_fn(|r| {
                $crate::x86::simd256::lanes($crate::x86::q4k_octets::tree(&sums[r]))
            })
        }
    };
}
pub(crate) use q4k_octet_tile;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::x86::simd256::hsum_ps;

    /// `tree` adds the same pairs as `hsum_ps` does within a vector, so lane t of it is
    /// `hsum_ps` of the vector of everyone's lane t, bit for bit.
    #[test]
    fn tree_is_hsum_of_each_lane_bit_for_bit() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
        let mut seed = 0x2545_f491_u32;
        let mut f = || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            // Mixed magnitudes and signs, so that the order of additions shows in the bits.
            let m = (seed % 1000) as f32 / 7.0 - 70.0;
            m * 10f32.powi((seed >> 20) as i32 % 7 - 3)
        };
        for _ in 0..200 {
            let sums: Vec<[f32; 8]> = (0..8).map(|_| std::array::from_fn(|_| f())).collect();
            // SAFETY: AVX2 is present (checked above); each load reads one 8-float array.
            let (got, want) = unsafe {
                let s: [__m256; 8] = std::array::from_fn(|j| _mm256_loadu_ps(sums[j].as_ptr()));
                let across: [[f32; 8]; 8] =
                    std::array::from_fn(|t| std::array::from_fn(|j| sums[j][t]));
                (
                    crate::x86::simd256::lanes::<8>(tree(&s)),
                    across.map(|v| hsum_ps(_mm256_loadu_ps(v.as_ptr()))),
                )
            };
            assert_eq!(got.map(f32::to_bits), want.map(f32::to_bits), "{sums:?}");
        }
    }
}
