//! The loop shared by the x86 panel kernels (see `crate::panel`): token tiles outer, row tiles
//! inner, so a tile of activation rows stays in L1 while the panel's weight rows pass by it; a
//! tile kernel `tile::<R, T>(blocks, weight rows, activation rows) -> [[f32; T]; R]` computes
//! R rows × T tokens with its accumulators in registers.
//!
//! Rows left over after the full R-row tiles go one at a time (R = 1); a token tile has
//! `min(T, tokens left)` tokens. Every (row, token) value is computed by the same operations
//! whatever the tile shape, so the shapes only matter for speed.
//!
//! Shapes measured on Zen 4: batches do best with one row × up to 8 tokens (weights reused from
//! registers, activations from L1; more rows per tile only add register pressure). Single tokens
//! (decode) run the single-row kernel row by row (`dot_tile`): multi-row tiles (2–4 rows sharing
//! the activation loads, scale conversions and a joint reduction) were 0–20% slower on
//! L2-resident weights, and streamed DRAM at a third of the speed (6.8 against 19–23 GB/s for
//! 256 MiB of Q4_K) because the hardware prefetcher does not follow four interleaved row streams;
//! software prefetch (0.5–4 KiB ahead) made the one-row stream slower too on Zen 4 (16–17 GB/s),
//! while on the Intel host it is what feeds the stream (`crate::prefetch` picks per vendor).

use crate::panel::Panel;

/// Pointers to `N` consecutive rows starting at row `first` (computed with wrapping arithmetic,
/// so safe; reading through them is the caller's business).
#[inline(always)]
pub(crate) fn rows<const N: usize>(base: *const u8, stride: usize, first: usize) -> [*const u8; N] {
    std::array::from_fn(|i| base.wrapping_add((first + i) * stride))
}

/// Writes a tile's results to `out[(t0 + t) * out_stride + r0 + r]`.
///
/// # Safety
/// The tile lies inside the panel `p`.
#[inline(always)]
pub(crate) unsafe fn store<const R: usize, const T: usize>(
    p: &Panel,
    r0: usize,
    t0: usize,
    v: &[[f32; T]; R],
) {
    for (r, row) in v.iter().enumerate() {
        for (t, &x) in row.iter().enumerate() {
            // SAFETY: row r0 + r and token t0 + t lie inside the panel (the contract above), whose
            // output elements the caller of the panel kernel guarantees writable and unaliased.
            unsafe { *p.out.add((t0 + t) * p.out_stride + r0 + r) = x };
        }
    }
}

/// Defines `unsafe fn $name(p: &Panel)` compiled with `$features`, running
/// `$tile::<R, T>(p.k / $block, rows, tokens)` over the panel: token tiles of up to the largest
/// of `$tokens` tokens (the list must hold 2..=T) with R = `$rows` rows, and single tokens
/// (decode) through `$tile1::<R, 1>` with R = `$rows1` rows; leftover rows go one at a time.
/// The tiles must be compiled with (a subset of) `$features` and read `nb` blocks of each row
/// and token they are given, no more.
macro_rules! panel_kernel {
    ($vis:vis $name:ident, $features:literal, block = $block:expr,
     batch = $tile:ident($rows:literal, [$($t:literal),+]), single = $tile1:ident($rows1:literal),
     chunk_panel = $cp:ident $(, chunks = $chunks:ident)?) => {
        $crate::x86::tiles::panel_kernel!($vis $name, $features, block = $block,
            batch = $tile($rows, [$($t),+]), single = $tile1($rows1) $(, chunks = $chunks)?);

        /// A chunk-panel kernel (`crate::panel::ChunkPanelFn`): the panel's tiles, run chunk
        /// by chunk with each tile's values added into f64 sums held per tile.
        ///
        /// # Safety
        /// As for [`crate::panel::ChunkPanelFn`]: every chunk of the panel's rows and tokens is
        /// readable, the outputs writable and unaliased, and the CPU has the features this
        /// function is compiled for.
        #[target_feature(enable = $features)]
        $vis unsafe fn $cp(p: &$crate::panel::ChunkPanel) {
            const MAX_T: usize = { let mut m = 1; $(if $t > m { m = $t; })+ m };
            let mut t0 = 0;
            while t0 < p.n {
                let tn = (p.n - t0).min(MAX_T);
                let mut r0 = 0;
                while r0 < p.rows {
                    let left = p.rows - r0;
                    // In every arm the tile's rows r0..r0 + R (R ≤ left) and tokens t0..t0 + tn
                    // lie inside the panel, whose chunks the caller guarantees readable and
                    // whose outputs writable; the tiles are compiled for features this
                    // function has.
                    match tn {
                        // SAFETY: see above the `match`; R = 1 ≤ left, T = 1.
                        1 => unsafe {
                            $crate::x86::tiles::chunk_sums!(p, $block, $tile1::<1, 1>, 1, 1, r0, t0);
                            r0 += 1;
                        },
                        $(
                            // SAFETY: see above the `match`; R = $rows ≤ left, T = tn.
                            $t if left >= $rows => unsafe {
                                $crate::x86::tiles::chunk_sums!(p, $block, $tile::<$rows, $t>,
                                    $rows, $t, r0, t0);
                                r0 += $rows;
                            },
                            // SAFETY: see above the `match`; R = 1 ≤ left, T = tn.
                            $t => unsafe {
                                $crate::x86::tiles::chunk_sums!(p, $block, $tile::<1, $t>,
                                    1, $t, r0, t0);
                                r0 += 1;
                            },
                        )+
                        _ => unreachable!("token tile of {tn}"),
                    }
                }
                t0 += tn;
            }
        }
    };
    ($vis:vis $name:ident, $features:literal, block = $block:expr,
     batch = $tile:ident($rows:literal, [$($t:literal),+]), single = $tile1:ident($rows1:literal),
     chunks = $chunks:ident) => {
        $crate::x86::tiles::panel_kernel!($vis $name, $features, block = $block,
            batch = $tile($rows, [$($t),+]), single = $tile1($rows1));

        /// A chunk-dots kernel (`crate::panel::ChunkDotsFn`): the single-row tile per chunk,
        /// inlined, which is the dot's arithmetic.
        ///
        /// # Safety
        /// As for [`crate::panel::ChunkDotsFn`]: the chunks are readable, the outputs writable
        /// and unaliased, and the CPU has the features this function is compiled for.
        #[target_feature(enable = $features)]
        $vis unsafe fn $chunks(c: &$crate::panel::ChunkDots) {
            let nb = c.k / $block;
            for i in 0..c.chunks {
                // SAFETY: chunk i's `nb` blocks of weights and activations are readable and
                // output i writable (the contract above); the tile is compiled for features
                // this function has.
                unsafe {
                    let v = $tile1::<1, 1>(
                        nb,
                        [c.w.add(i * c.w_bytes)],
                        [c.a.add(i * c.a_bytes)],
                    );
                    *c.out.add(i) = v[0][0];
                }
            }
        }
    };
    ($vis:vis $name:ident, $features:literal, block = $block:expr,
     batch = $tile:ident($rows:literal, [$($t:literal),+]), single = $tile1:ident($rows1:literal)) => {
        /// A panel kernel (`crate::panel::PanelFn`).
        ///
        /// # Safety
        /// As for [`crate::panel::PanelFn`]: the panel's rows, tokens and outputs are in bounds,
        /// the outputs alias no input, and the CPU has the features this function is compiled
        /// for.
        #[target_feature(enable = $features)]
        $vis unsafe fn $name(p: &$crate::panel::Panel) {
            use $crate::x86::tiles::{rows, store};
            const MAX_T: usize = { let mut m = 1; $(if $t > m { m = $t; })+ m };
            let nb = p.k / $block;
            // Decode, and a call of at most MAX_T tokens (one pass over the rows), streams each
            // row once: ask for the bytes ahead (`crate::prefetch`).
            let ahead = $crate::prefetch::single_pass_prefetch(p.n, MAX_T);
            let mut t0 = 0;
            while t0 < p.n {
                let tn = (p.n - t0).min(MAX_T);
                let mut r0 = 0;
                while r0 < p.rows {
                    let left = p.rows - r0;
                    // In every arm, the tile's rows r0..r0 + R (R ≤ left) and tokens t0..t0 + tn
                    // lie inside the panel, whose rows and tokens of `nb` whole blocks the caller
                    // guarantees readable and whose outputs writable; the tile is compiled for
                    // features this function has.
                    match tn {
                        // SAFETY: see above the `match`; R = $rows1 ≤ left.
                        1 if left >= $rows1 => unsafe {
                            $crate::prefetch::panel_rows_ahead(p, r0, $rows1, ahead);
                            let v = $tile1::<$rows1, 1>(
                                nb,
                                rows(p.w, p.w_stride, r0),
                                rows(p.a, p.a_stride, t0),
                            );
                            store(p, r0, t0, &v);
                            r0 += $rows1;
                        },
                        // SAFETY: see above the `match`; R = 1 ≤ left.
                        1 => unsafe {
                            $crate::prefetch::panel_rows_ahead(p, r0, 1, ahead);
                            let v = $tile1::<1, 1>(
                                nb,
                                rows(p.w, p.w_stride, r0),
                                rows(p.a, p.a_stride, t0),
                            );
                            store(p, r0, t0, &v);
                            r0 += 1;
                        },
                        $(
                            // SAFETY: see above the `match`; R = $rows ≤ left, T = tn.
                            $t if left >= $rows => unsafe {
                                $crate::prefetch::panel_rows_ahead(p, r0, $rows, ahead);
                                let v = $tile::<$rows, $t>(
                                    nb,
                                    rows(p.w, p.w_stride, r0),
                                    rows(p.a, p.a_stride, t0),
                                );
                                store(p, r0, t0, &v);
                                r0 += $rows;
                            },
                            // SAFETY: see above the `match`; R = 1 ≤ left, T = tn.
                            $t => unsafe {
                                $crate::prefetch::panel_rows_ahead(p, r0, 1, ahead);
                                let v = $tile::<1, $t>(
                                    nb,
                                    rows(p.w, p.w_stride, r0),
                                    rows(p.a, p.a_stride, t0),
                                );
                                store(p, r0, t0, &v);
                                r0 += 1;
                            },
                        )+
                        _ => unreachable!("token tile of {tn}"),
                    }
                }
                t0 += tn;
            }
        }
    };
}
pub(crate) use panel_kernel;

/// Runs the tile `$tile` (R = `$r` rows, T = `$t` tokens at `$r0`, `$t0` of the chunk panel
/// `$p`) on every chunk, adds its values into f64 sums in chunk order, and stores the sums.
/// Expands inside an `unsafe` block of a function compiled for the tile's features, whose
/// caller guarantees the tile's chunks readable and its outputs writable.
macro_rules! chunk_sums {
    ($p:ident, $block:expr, $tile:path, $r:expr, $t:expr, $r0:ident, $t0:ident) => {{
        let (nb, tail_nb) = ($p.k / $block, $p.tail_k / $block);
        let mut sums = [[0f64; $t]; $r];
        for c in 0..$p.chunks + usize::from(tail_nb > 0) {
            let nbc = if c < $p.chunks { nb } else { tail_nb };
            let v = $tile(
                nbc,
                $crate::x86::tiles::rows($p.w.wrapping_add(c * $p.w_chunk), $p.w_stride, $r0),
                $crate::x86::tiles::rows($p.a.wrapping_add(c * $p.a_chunk), $p.a_stride, $t0),
            );
            for (s, v) in sums.iter_mut().zip(&v) {
                for (s, &v) in s.iter_mut().zip(v) {
                    *s += v as f64;
                }
            }
        }
        for (r, row) in sums.iter().enumerate() {
            for (t, &x) in row.iter().enumerate() {
                *$p.out.add(($t0 + t) * $p.out_stride + $r0 + r) = x;
            }
        }
    }};
}
pub(crate) use chunk_sums;

/// Defines `unsafe fn $name<R, T>`, a Q5_K × Q8_K tile: [`q4k_rows`] with the fifth bits of
/// `kq256::q5k_256` (bit 2g of `qh` over group g's low nibbles, bit 2g+1 over its high ones),
/// unpacked once per row for every token.
macro_rules! q5k_rows {
    ($name:ident, $features:literal, $acc:path) => {
        /// # Safety
        /// Each `w[r]` points at `nb` readable Q5_K blocks and each `a[t]` at `nb` Q8_K blocks.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize, const T: usize>(
            nb: usize,
            w: [*const u8; R],
            a: [*const u8; T],
        ) -> [[f32; T]; R] {
            use $crate::x86::kq256::prelude::*;
            let w = w.map(|p| p as *const BlockQ5K);
            let k16 = _mm256_set1_epi8(16);
            let a = a.map(|p| p as *const BlockQ8K);
            let m4 = _mm256_set1_epi8(0x0F);
            let zero = _mm256_setzero_si256();
            let mut acc = [[[_mm256_setzero_ps(); 2]; T]; R];
            for b in 0..nb {
                let xs: [*const u8; R] = std::array::from_fn(|r| {
                    // SAFETY: block b < nb of every row is readable (the contract above), so its
                    // start is in bounds.
                    unsafe { w[r].add(b) as *const u8 }
                });
                // SAFETY: block b < nb of every token is readable (the contract above); the
                // blocks have alignment 1 and are plain bytes, so a reference to one is valid.
                let ys: [&BlockQ8K; T] = std::array::from_fn(|t| unsafe { &*a[t].add(b) });
                let u: [__m256i; R] = std::array::from_fn(|r| {
                    // SAFETY: the first 16 of the 176 bytes of block `xs[r]`.
                    _mm256_broadcastsi128_si256(unpack_k4(unsafe { load128(xs[r]) }))
                });
                // Low and high nibbles in separate accumulators, as in the single-row kernel: two
                // independent chains of multiply-adds.
                let mut isum = [[[zero; 2]; T]; R];
                let mut hbits: [__m256i; R] = std::array::from_fn(|r| {
                    // SAFETY: bytes 16..48 of the 176 in block `xs[r]` (its `qh`).
                    unsafe { load256(xs[r].add(16)) }
                });
                for g in 0..4 {
                    for r in 0..R {
                        // SAFETY: bytes 48 + 32g.. + 32 of the 176 in block `xs[r]` (its `qs`;
                        // g < 4).
                        let q = unsafe { load256(xs[r].add(48 + 32 * g)) };
                        let hlo = _mm256_and_si256(_mm256_slli_epi16::<4>(hbits[r]), k16);
                        let hhi = _mm256_and_si256(_mm256_slli_epi16::<3>(hbits[r]), k16);
                        hbits[r] = _mm256_srli_epi16::<2>(hbits[r]);
                        let lo = _mm256_or_si256(_mm256_and_si256(q, m4), hlo);
                        let hi =
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(q), m4), hhi);
                        let slo = _mm256_shuffle_epi8(u[r], load256_of(&K4_SCALE[2 * g]));
                        let shi = _mm256_shuffle_epi8(u[r], load256_of(&K4_SCALE[2 * g + 1]));
                        for t in 0..T {
                            let q8 = ys[t].qs.as_ptr() as *const u8;
                            // SAFETY: bytes 64g..64g + 32 of the 256 in `ys[t].qs` (g < 4).
                            let alo = unsafe { load256(q8.add(64 * g)) };
                            // SAFETY: bytes 64g + 32..64g + 64 of the 256 in `ys[t].qs`.
                            let ahi = unsafe { load256(q8.add(64 * g + 32)) };
                            let [s0, s1] = isum[r][t];
                            isum[r][t] = [
                                $acc(s0, _mm256_maddubs_epi16(lo, alo), slo),
                                $acc(s1, _mm256_maddubs_epi16(hi, ahi), shi),
                            ];
                        }
                    }
                }
                for r in 0..R {
                    // SAFETY: the first 4 bytes (d, dmin) of block `xs[r]`; `read_unaligned`
                    // has no alignment requirement.
                    let dm = _mm_cvtph_ps(_mm_set1_epi32(unsafe {
                        (xs[r] as *const i32).read_unaligned()
                    }));
                    let mins = _mm256_shuffle_epi8(u[r], load256_of(&K4_MINS));
                    for t in 0..T {
                        let msum = _mm256_madd_epi16(mins, load256_of(&ys[t].bsums));
                        let p = _mm_mul_ps(dm, _mm_set1_ps(ys[t].d()));
                        let [s0, s1] = isum[r][t];
                        acc[r][t][0] = _mm256_fmadd_ps(
                            _mm256_broadcastss_ps(p),
                            _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)),
                            acc[r][t][0],
                        );
                        acc[r][t][1] = _mm256_fnmadd_ps(
                            _mm256_broadcastss_ps(_mm_movehdup_ps(p)),
                            _mm256_cvtepi32_ps(msum),
                            acc[r][t][1],
                        );
                    }
                }
            }
            acc.map(|row| row.map(|[a0, a1]| hsum_ps(_mm256_add_ps(a0, a1))))
        }
    };
}
pub(crate) use q5k_rows;

/// Defines `unsafe fn $name<R, T>`, a tile that runs the single-row kernel
/// `$dot(n, weights, activations)` for each of its (row, token) pairs: the decode path where
/// tiling has nothing to share (see the module notes) and the tuned single-row loop is fastest.
macro_rules! dot_tile {
    ($name:ident, $features:literal, $dot:path, $wblock:ty, $ablock:ty, $block:expr) => {
        /// # Safety
        /// Each `w[r]` points at `nb` readable weight blocks and each `a[t]` at `nb` activation
        /// blocks (of the types named where the macro is called), not written while the tile
        /// runs.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize, const T: usize>(
            nb: usize,
            w: [*const u8; R],
            a: [*const u8; T],
        ) -> [[f32; T]; R] {
            let (wb, ab) = (
                nb * std::mem::size_of::<$wblock>(),
                nb * std::mem::size_of::<$ablock>(),
            );
            std::array::from_fn(|r| {
                // SAFETY: `nb` blocks of every row and token are readable and not written (the
                // contract above): `wb` and `ab` bytes; `$dot` is compiled for features this
                // function has.
                std::array::from_fn(|t| unsafe {
                    $dot(
                        nb * $block,
                        std::slice::from_raw_parts(w[r], wb),
                        std::slice::from_raw_parts(a[t], ab),
                    )
                })
            })
        }
    };
}
pub(crate) use dot_tile;

/// Defines `unsafe fn $name<R, T>`, a Q2_K × Q8_K tile in the form of the single-row
/// `kq256::q2k_256` with `$acc(acc, pairs, scale)` applying the sub-block scales: per superblock,
/// each row's 2-bit quants and scales are unpacked once and used for every token, each
/// activation load serves every row; the integer sums are exact (their grouping into the dot's
/// two accumulators does not matter) and the float steps are `fma_d_dmin`'s, per (row, token).
macro_rules! q2k_rows {
    ($name:ident, $features:literal, $acc:path) => {
        /// # Safety
        /// Each `w[r]` points at `nb` readable Q2_K blocks and each `a[t]` at `nb` Q8_K blocks.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize, const T: usize>(
            nb: usize,
            w: [*const u8; R],
            a: [*const u8; T],
        ) -> [[f32; T]; R] {
            use $crate::x86::kq256::prelude::*;
            let w = w.map(|p| p as *const BlockQ2K);
            let a = a.map(|p| p as *const BlockQ8K);
            let m3 = _mm256_set1_epi8(3);
            let m4 = _mm_set1_epi8(0x0F);
            let zero = _mm256_setzero_si256();
            let mut acc = [[[_mm256_setzero_ps(); 2]; T]; R];
            for b in 0..nb {
                // SAFETY: block b < nb of every row and token is readable (the contract above);
                // the blocks have alignment 1 and are plain bytes, so a reference is valid.
                let xs: [&BlockQ2K; R] = std::array::from_fn(|r| unsafe { &*w[r].add(b) });
                // SAFETY: as above.
                let ys: [&BlockQ8K; T] = std::array::from_fn(|t| unsafe { &*a[t].add(b) });
                let raw: [__m128i; R] = std::array::from_fn(|r| load128_of(&xs[r].scales));
                let sc: [__m256i; R] =
                    std::array::from_fn(|r| _mm256_broadcastsi128_si256(_mm_and_si128(raw[r], m4)));
                let mut isum = [[zero; T]; R];
                for h in 0..2 {
                    let q: [__m256i; R] = std::array::from_fn(|r| {
                        // SAFETY: bytes 32h..32h + 32 of the 64 in `qs` (h < 2).
                        unsafe { load256(xs[r].qs.as_ptr().add(32 * h)) }
                    });
                    for s in 0..4 {
                        let part: [__m256i; R] = std::array::from_fn(|r| {
                            let shifted = match s {
                                0 => q[r],
                                1 => _mm256_srli_epi16::<2>(q[r]),
                                2 => _mm256_srli_epi16::<4>(q[r]),
                                _ => _mm256_srli_epi16::<6>(q[r]),
                            };
                            _mm256_and_si256(shifted, m3)
                        });
                        let scale: [__m256i; R] = std::array::from_fn(|r| {
                            _mm256_shuffle_epi8(sc[r], load256_of(&Q2K_SCALE[4 * h + s]))
                        });
                        for t in 0..T {
                            let q8 = ys[t].qs.as_ptr() as *const u8;
                            // SAFETY: bytes 128h + 32s.. + 32 of the 256 in `qs` (h < 2, s < 4).
                            let a8 = unsafe { load256(q8.add(128 * h + 32 * s)) };
                            for r in 0..R {
                                let p = _mm256_maddubs_epi16(part[r], a8);
                                isum[r][t] = $acc(isum[r][t], p, scale[r]);
                            }
                        }
                    }
                }
                for r in 0..R {
                    let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(raw[r]), m4));
                    // d and dmin are adjacent at offset 80 of the 84-byte block.
                    // SAFETY: bytes 80..84 of block `xs[r]`; `read_unaligned` has no alignment
                    // requirement.
                    let dm = _mm_cvtph_ps(_mm_set1_epi32(unsafe {
                        ((xs[r] as *const BlockQ2K as *const u8).add(80) as *const i32)
                            .read_unaligned()
                    }));
                    for t in 0..T {
                        let msum = _mm256_madd_epi16(mins, load256_of(&ys[t].bsums));
                        let p = _mm_mul_ps(dm, _mm_set1_ps(ys[t].d()));
                        acc[r][t][0] = _mm256_fmadd_ps(
                            _mm256_broadcastss_ps(p),
                            _mm256_cvtepi32_ps(isum[r][t]),
                            acc[r][t][0],
                        );
                        acc[r][t][1] = _mm256_fnmadd_ps(
                            _mm256_broadcastss_ps(_mm_movehdup_ps(p)),
                            _mm256_cvtepi32_ps(msum),
                            acc[r][t][1],
                        );
                    }
                }
            }
            acc.map(|row| row.map(|[a0, a1]| hsum_ps(_mm256_add_ps(a0, a1))))
        }
    };
}
pub(crate) use q2k_rows;

/// Defines `unsafe fn $name<R, T>` (T ≤ 8), a Q3_K × Q8_K tile in the form of the single-row
/// `kq256::q3k_256` with `$acc(acc, pairs, scale)` applying the sub-block scales: per
/// superblock, each row's 3-bit quants (low bits and `hmask`) and scales are unpacked once for
/// every token; each (row, token)'s exact integer is reduced with the other tokens' (`hsums`)
/// and the dot's float step `acc + (d·dy)·isum` runs with one token per lane.
macro_rules! q3k_rows {
    ($name:ident, $features:literal, $acc:path) => {
        /// # Safety
        /// Each `w[r]` points at `nb` readable Q3_K blocks and each `a[t]` at `nb` Q8_K blocks.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize, const T: usize>(
            nb: usize,
            w: [*const u8; R],
            a: [*const u8; T],
        ) -> [[f32; T]; R] {
            use $crate::x86::kq256::prelude::*;
            use $crate::x86::simd256::{bcast_f16, hsums, lanes};
            let w = w.map(|p| p as *const BlockQ3K);
            let a = a.map(|p| p as *const BlockQ8K);
            let m3 = _mm256_set1_epi8(3);
            let k4 = _mm256_set1_epi8(4);
            let zero = _mm256_setzero_si256();
            // One lane per token.
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..nb {
                // SAFETY: block b < nb of every row and token is readable (the contract above);
                // the blocks have alignment 1 and are plain bytes, so a reference is valid.
                let xs: [&BlockQ3K; R] = std::array::from_fn(|r| unsafe { &*w[r].add(b) });
                // SAFETY: as above.
                let ys: [&BlockQ8K; T] = std::array::from_fn(|t| unsafe { &*a[t].add(b) });
                let sc16: [__m256i; R] = std::array::from_fn(|r| {
                    // SAFETY: bytes 94..110 of the 110-byte block `xs[r]` (the 16 bytes ending
                    // at its end, scales at 2..14), through a pointer to the whole block.
                    let tail = unsafe { load128((xs[r] as *const BlockQ3K as *const u8).add(94)) };
                    _mm256_cvtepi8_epi16(unpack_q3k(tail))
                });
                let mut hbits: [__m256i; R] = std::array::from_fn(|r| load256_of(&xs[r].hmask));
                let mut isum = [[zero; T]; R];
                for h in 0..2 {
                    let sc: [__m256i; R] = std::array::from_fn(|r| {
                        if h == 0 {
                            _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sc16[r]))
                        } else {
                            _mm256_broadcastsi128_si256(_mm256_extracti128_si256::<1>(sc16[r]))
                        }
                    });
                    let q: [__m256i; R] = std::array::from_fn(|r| {
                        // SAFETY: bytes 32h..32h + 32 of the 64 in `qs` (h < 2).
                        unsafe { load256(xs[r].qs.as_ptr().add(32 * h)) }
                    });
                    for s in 0..4 {
                        let mut u = [zero; R];
                        let mut scale = [zero; R];
                        for r in 0..R {
                            let part = match s {
                                0 => q[r],
                                1 => _mm256_srli_epi16::<2>(q[r]),
                                2 => _mm256_srli_epi16::<4>(q[r]),
                                _ => _mm256_srli_epi16::<6>(q[r]),
                            };
                            // Bits moved across bytes by the 16-bit shifts never reach bit 2.
                            let hb = _mm256_and_si256(_mm256_slli_epi16::<2>(hbits[r]), k4);
                            hbits[r] = _mm256_srli_epi16::<1>(hbits[r]);
                            u[r] = _mm256_or_si256(_mm256_and_si256(part, m3), hb);
                            scale[r] = _mm256_shuffle_epi8(sc[r], load256_of(&Q3K_SCALE[s]));
                        }
                        for t in 0..T {
                            let q8 = ys[t].qs.as_ptr() as *const u8;
                            // SAFETY: bytes 128h + 32s.. + 32 of the 256 in `qs` (h < 2, s < 4).
                            let a8 = unsafe { load256(q8.add(128 * h + 32 * s)) };
                            for r in 0..R {
                                let p = _mm256_maddubs_epi16(u[r], a8);
                                isum[r][t] = $acc(isum[r][t], p, scale[r]);
                            }
                        }
                    }
                }
                let dy: [f32; 8] = std::array::from_fn(|t| if t < T { ys[t].d() } else { 0.0 });
                // SAFETY: the load reads the 8 floats of `dy`.
                let dy = unsafe { _mm256_loadu_ps(dy.as_ptr()) };
                for r in 0..R {
                    // Quants are stored as `lo + 4·hbit − 4`: subtract 4·Σ scale·(sum of the 16
                    // activations), as the dot does.
                    let tot: [__m256i; T] = std::array::from_fn(|t| {
                        let bias = _mm256_madd_epi16(sc16[r], load256_of(&ys[t].bsums));
                        _mm256_sub_epi32(isum[r][t], _mm256_slli_epi32::<2>(bias))
                    });
                    let tot = _mm256_cvtepi32_ps(hsums(&tot));
                    let dd = _mm256_mul_ps(bcast_f16(&xs[r].d), dy);
                    acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(dd, tot));
                }
            }
            acc.map(|v| lanes(v))
        }
    };
}
pub(crate) use q3k_rows;
