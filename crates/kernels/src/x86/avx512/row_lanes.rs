//! Q4_K and Q6_K panels with one weight row per 32-bit lane, for batches of many tokens. A
//! block of 16 weight rows is unpacked once per panel call into bytes in the VNNI layout (for
//! each four columns, the 16 rows' four bytes: one register), and each token's four activation
//! bytes are broadcast against it: one 512-bit `vpdpbusd` does 64 multiply-adds for 16 rows, and
//! nothing is reduced across lanes. The register tiles keep a token's sum spread over lanes and
//! spend about a third of their multiplies on sub-block scales and the final reductions (Zen 4,
//! one thread, 256 tokens: Q6_K 97 → 255 GFLOP/s, Q4_K 118 → 264; llama.cpp's tiled kernels
//! are built the same way).
//!
//! **Same bits** as the level's dots. Q6_K's arithmetic is the scalar reference's: per
//! superblock the exact integer Σ scale·(q − 32)·a (here Σ_s scale_s·Σ q·a over each sub-block,
//! less 32·Σ_s scale_s·bsum_s, both exact in i32), then the float step `acc + (d·dy)·isum`, one
//! row per lane, superblocks in order. Q4_K's is the octet arithmetic of
//! `crate::x86::q4k_octets`: the same exact integers and float step, each step added to the
//! sums of lane b mod 8, reduced by `hsum_ps`'s tree at the end. Chunked products add each
//! chunk's value (the dot of the chunk alone) to f64 sums in chunk order, as
//! `crate::panel::ChunkPanel` asks.
//!
//! Packing a block of rows costs about what two tokens' products cost, so fewer tokens than
//! [`MIN_TOKENS`] run through the register tiles instead.

// Tiles index several per-row and per-token arrays with the same loop variable.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::transpose16;
use crate::blocks::{BlockQ4K, BlockQ6K, BlockQ8K, QK_K};
use crate::panel::{ChunkPanel, Panel};
use crate::x86::kq256::q6k_quants;
use crate::x86::token_runs;

/// Weight rows per packed block: one per 32-bit lane of a 512-bit register.
pub const ROWS: usize = 16;

/// Tokens whose sums stay in registers together: each packed weight register loaded serves
/// this many tokens.
const TOKENS: usize = 8;

/// Panels of fewer tokens than this run through the register tiles of `super::panels`.
pub const MIN_TOKENS: usize = 16;

/// 64 bytes, aligned for whole-register loads.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

impl Line {
    const ZERO: Line = Line([0; 64]);
}

/// A block of up to 16 Q6_K rows, unpacked (rows past the block's end are zeros). Per
/// superblock: 64 lines of quants `q` (0..63, the stored 6 bits) in the VNNI layout, 16 lines of
/// sub-block scales (one i32 per row), 8 lines of scale pairs `(scale_2p, scale_2p+1)` as two
/// i16 per row, and a line of each row's `d` as f32.
#[derive(Default)]
struct PackedQ6K {
    quants: Vec<Line>,
    scales: Vec<Line>,
    scale_pairs: Vec<Line>,
    d: Vec<Line>,
}

impl PackedQ6K {
    /// Packs rows `w[0..rows]` (rows ≤ 16), `nb` superblocks each.
    ///
    /// # Safety
    /// Each `w[m]`, m < rows, points at `nb` readable blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    unsafe fn pack(&mut self, nb: usize, w: &[*const BlockQ6K; ROWS], rows: usize) {
        self.quants.resize(nb * 64, Line::ZERO);
        self.scales.resize(nb * 16, Line::ZERO);
        self.scale_pairs.resize(nb * 8, Line::ZERO);
        self.d.resize(nb, Line::ZERO);
        for b in 0..nb {
            // Called for rows m < rows only.
            let block = |m: usize| {
                // SAFETY: block b < nb of row m < rows is readable (the contract above); the
                // blocks are plain bytes of alignment 1.
                unsafe { &*w[m].add(b) }
            };
            let scales16 = |m: usize| {
                // SAFETY: the 16 bytes of the block's `scales`.
                unsafe { _mm_loadu_si128(block(m).scales.as_ptr() as *const __m128i) }
            };
            // Row m's sixteen scales as i32, and as eight i16 pairs (upper half zero); the
            // transposes turn them into one line per sub-block (pair) with a lane per row.
            let (by_row, pairs_by_row): ([__m512i; ROWS], [__m512i; ROWS]) = (
                std::array::from_fn(|m| {
                    if m < rows {
                        _mm512_cvtepi8_epi32(scales16(m))
                    } else {
                        _mm512_setzero_si512()
                    }
                }),
                std::array::from_fn(|m| {
                    if m < rows {
                        _mm512_castsi256_si512(_mm256_cvtepi8_epi16(scales16(m)))
                    } else {
                        _mm512_setzero_si512()
                    }
                }),
            );
            let lines = [
                (transpose16(&by_row), &mut self.scales[b * 16..b * 16 + 16]),
                (
                    transpose16(&pairs_by_row),
                    &mut self.scale_pairs[b * 8..b * 8 + 8],
                ),
            ];
            for (columns, dst) in lines {
                for (line, v) in dst.iter_mut().zip(columns) {
                    // SAFETY: a 64-byte store into a 64-byte-aligned `Line`.
                    unsafe { _mm512_store_si512(line.0.as_mut_ptr() as *mut __m512i, v) };
                }
            }
            let d: [f32; ROWS] = std::array::from_fn(|m| {
                if m < rows {
                    half::f16::from_le_bytes(block(m).d).to_f32()
                } else {
                    0.0
                }
            });
            self.d[b] = Line(bytemuck::cast(d));
            for c in 0..4 {
                let rows_c: [__m512i; ROWS] = std::array::from_fn(|m| {
                    if m < rows {
                        // SAFETY: as above.
                        let (first, second) = q6k_quants(unsafe { &*w[m].add(b) }, c);
                        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(first), second)
                    } else {
                        _mm512_setzero_si512()
                    }
                });
                for (j, v) in transpose16(&rows_c).into_iter().enumerate() {
                    let line = &mut self.quants[b * 64 + 16 * c + j];
                    // SAFETY: a 64-byte store into a 64-byte-aligned `Line`.
                    unsafe { _mm512_store_si512(line.0.as_mut_ptr() as *mut __m512i, v) };
                }
            }
        }
    }
}

thread_local! {
    static PACKED: RefCell<PackedQ6K> = RefCell::new(PackedQ6K::default());
}

/// `T` tokens against a packed block of rows, superblock by superblock; at the end of every
/// chunk of `per` superblocks (and of the row) `emit(chunk, sums)` gets each token's 16 rows'
/// values of that chunk, and the sums start again from 0.0.
///
/// # Safety
/// `pk` holds `nb` packed superblocks and each `a[t]` points at `nb` readable Q8_K blocks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q6k_tokens<const T: usize>(
    pk: &PackedQ6K,
    nb: usize,
    per: usize,
    a: [*const BlockQ8K; T],
    mut emit: impl FnMut(usize, &[__m512; T]),
) {
    let zero = _mm512_setzero_si512();
    let mut acc = [_mm512_setzero_ps(); T];
    let mut chunk = 0;
    for b in 0..nb {
        // SAFETY: block b < nb of every token is readable (the contract above); alignment 1.
        let ys: [&BlockQ8K; T] = std::array::from_fn(|t| unsafe { &*a[t].add(b) });
        let quants = &pk.quants[b * 64..b * 64 + 64];
        let mut isum = [zero; T];
        for s in 0..16 {
            let mut raw = [zero; T];
            for j in 0..4 {
                let kq = 4 * s + j;
                // SAFETY: an aligned 64-byte line.
                let wq = unsafe { _mm512_load_si512(quants[kq].0.as_ptr() as *const __m512i) };
                for t in 0..T {
                    // SAFETY: bytes 4kq..4kq + 4 of the 256 in `qs` (kq < 64).
                    let x =
                        unsafe { (ys[t].qs.as_ptr().add(4 * kq) as *const i32).read_unaligned() };
                    raw[t] = _mm512_dpbusd_epi32(raw[t], wq, _mm512_set1_epi32(x));
                }
            }
            // SAFETY: an aligned 64-byte line.
            let sc = unsafe { _mm512_load_si512(pk.scales[b * 16 + s].0.as_ptr() as *const _) };
            for t in 0..T {
                isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(raw[t], sc));
            }
        }
        // The quants are stored with +32: Σ_s scale_s·bsum_s, by pairs of sub-blocks.
        let mut offset = [zero; T];
        for p in 0..8 {
            // SAFETY: an aligned 64-byte line.
            let sp = unsafe { _mm512_load_si512(pk.scale_pairs[b * 8 + p].0.as_ptr() as *const _) };
            for t in 0..T {
                // SAFETY: bytes 4p..4p + 4 of the 32 in `bsums`: (bsum_2p, bsum_2p+1) (p < 8).
                let pair =
                    unsafe { (ys[t].bsums.as_ptr().add(4 * p) as *const i32).read_unaligned() };
                offset[t] = _mm512_dpwssd_epi32(offset[t], sp, _mm512_set1_epi32(pair));
            }
        }
        // SAFETY: an aligned 64-byte line.
        let d = unsafe { _mm512_load_ps(pk.d[b].0.as_ptr() as *const f32) };
        for t in 0..T {
            let exact = _mm512_sub_epi32(isum[t], _mm512_slli_epi32::<5>(offset[t]));
            let scale = _mm512_mul_ps(d, _mm512_set1_ps(ys[t].d()));
            acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(scale, _mm512_cvtepi32_ps(exact)));
        }
        if (b + 1) % per == 0 || b + 1 == nb {
            emit(chunk, &acc);
            chunk += 1;
            acc = [_mm512_setzero_ps(); T];
        }
    }
}

/// The weight rows `r0..r0 + ROWS` (or fewer at the end) of a panel, as block pointers.
fn row_block<B>(w: *const u8, w_stride: usize, r0: usize, rows: usize) -> [*const B; ROWS] {
    std::array::from_fn(|m| w.wrapping_add((r0 + m.min(rows - 1)) * w_stride) as *const B)
}

/// `row_lane_panels!(panel, chunk_panel, packed, tokens, small_panel, small_chunk_panel)`: the
/// panel and chunk-panel kernels of one format — blocks of 16 rows packed into the thread's
/// `packed` and run against runs of up to eight tokens by `tokens`, batches of fewer than
/// [`MIN_TOKENS`] tokens through the register tiles `small_*`.
macro_rules! row_lane_panels {
    ($panel:ident, $chunk_panel:ident, $packed:ident, $tokens:ident,
     $small:path, $small_chunk:path, $fmt:literal) => {
        #[doc = concat!("The ", $fmt, " panel of the AVX-512 level (`crate::panel::PanelFn`): row")]
        /// lanes for batches of at least [`MIN_TOKENS`] tokens, the register tiles below that.
        ///
        /// # Safety
        /// As for `crate::panel::PanelFn`.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
        pub unsafe fn $panel(p: &Panel) {
            if p.n < MIN_TOKENS {
                // SAFETY: the caller's contract.
                return unsafe { $small(p) };
            }
            let nb = p.k / QK_K;
            $packed.with_borrow_mut(|pk| {
                for r0 in (0..p.rows).step_by(ROWS) {
                    let rows = (p.rows - r0).min(ROWS);
                    // SAFETY: rows r0..r0 + rows < p.rows of the panel, `nb` blocks each, are
                    // readable (the caller's contract).
                    unsafe { pk.pack(nb, &row_block(p.w, p.w_stride, r0, rows), rows) };
                    let mask = ((1u32 << rows) - 1) as u16;
                    token_runs!(p.n, [8, 7, 6, 5, 4, 3, 2], |t0, T| {
                        let a: [*const BlockQ8K; T] = std::array::from_fn(|t| {
                            p.a.wrapping_add((t0 + t) * p.a_stride) as *const _
                        });
                        let mut values = [_mm512_setzero_ps(); T];
                        let emit = |_, v: &[__m512; T]| values = *v;
                        // SAFETY: `pk` holds the `nb` superblocks just packed; tokens
                        // t0..t0 + T < n each have `nb` readable blocks (the caller's contract).
                        unsafe { $tokens::<T>(pk, nb, nb, a, emit) };
                        for (t, v) in values.iter().enumerate() {
                            let at = p.out.wrapping_add((t0 + t) * p.out_stride + r0);
                            // SAFETY: outputs (t0 + t, r0 + m) for the lanes m < rows of
                            // `mask`, inside the panel: writable and unaliased (the contract).
                            unsafe { _mm512_mask_storeu_ps(at, mask, *v) };
                        }
                    });
                }
            });
        }

        #[doc = concat!("The ", $fmt, " chunk panel of the AVX-512 level")]
        /// (`crate::panel::ChunkPanelFn`): row lanes for batches of at least [`MIN_TOKENS`]
        /// tokens, the register tiles below that. The chunks must be contiguous (chunk c at
        /// block c·k/256), as `Kernels::matmul_chunked` lays them out.
        ///
        /// # Safety
        /// As for `crate::panel::ChunkPanelFn`.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
        pub unsafe fn $chunk_panel(p: &ChunkPanel) {
            if p.n < MIN_TOKENS {
                // SAFETY: the caller's contract.
                return unsafe { $small_chunk(p) };
            }
            let per = p.k / QK_K;
            let nb = p.chunks * per + p.tail_k / QK_K;
            $packed.with_borrow_mut(|pk| {
                for r0 in (0..p.rows).step_by(ROWS) {
                    let rows = (p.rows - r0).min(ROWS);
                    // SAFETY: as in the panel; the chunks of a row are contiguous blocks.
                    unsafe { pk.pack(nb, &row_block(p.w, p.w_stride, r0, rows), rows) };
                    let mask = ((1u32 << rows) - 1) as u16;
                    let (lo, hi) = (mask as u8, (mask >> 8) as u8);
                    token_runs!(p.n, [8, 7, 6, 5, 4, 3, 2], |t0, T| {
                        let a: [*const BlockQ8K; T] = std::array::from_fn(|t| {
                            p.a.wrapping_add((t0 + t) * p.a_stride) as *const _
                        });
                        // The f64 sums of 16 rows per token, in whole registers until the
                        // tokens are done (masked stores and loads at the outputs after each
                        // chunk stalled on store forwarding).
                        let mut sums = [[_mm512_setzero_pd(); 2]; T];
                        let emit = |_, values: &[__m512; T]| {
                            for (sum, v) in sums.iter_mut().zip(values) {
                                let (l, h) =
                                    (_mm512_castps512_ps256(*v), _mm512_extractf32x8_ps::<1>(*v));
                                sum[0] = _mm512_add_pd(sum[0], _mm512_cvtps_pd(l));
                                sum[1] = _mm512_add_pd(sum[1], _mm512_cvtps_pd(h));
                            }
                        };
                        // SAFETY: as in the panel.
                        unsafe { $tokens::<T>(pk, nb, per, a, emit) };
                        for (t, sum) in sums.iter().enumerate() {
                            let at = p.out.wrapping_add((t0 + t) * p.out_stride + r0);
                            // SAFETY: outputs (t0 + t, r0 + m) for the lanes m < rows of the
                            // mask, inside the panel: writable and unaliased (the contract).
                            unsafe {
                                _mm512_mask_storeu_pd(at, lo, sum[0]);
                                _mm512_mask_storeu_pd(at.wrapping_add(8), hi, sum[1]);
                            }
                        }
                    });
                }
            });
        }
    };
}

row_lane_panels!(
    panel_q6_k,
    chunk_panel_q6_k,
    PACKED,
    q6k_tokens,
    super::panels::panel_q6_k,
    super::panels::chunk_panel_q6_k,
    "Q6_K"
);
row_lane_panels!(
    panel_q4_k,
    chunk_panel_q4_k,
    PACKED_Q4K,
    q4k_tokens,
    super::q4k_octets::panel_q4_k,
    super::q4k_octets::chunk_panel_tiles,
    "Q4_K"
);

/// A block of up to 16 Q4_K rows, unpacked (rows past the block's end are zeros). Per
/// superblock: 64 lines of quants (0..15) in the VNNI layout, 8 lines of sub-block scales (one
/// i32 per row), 4 lines of min pairs `(min_2p, min_2p+1)` as two i16 per row, and a line
/// each of the rows' `d` and `dmin` as f32.
#[derive(Default)]
struct PackedQ4K {
    quants: Vec<Line>,
    scales: Vec<Line>,
    min_pairs: Vec<Line>,
    d: Vec<Line>,
    dmin: Vec<Line>,
}

impl PackedQ4K {
    /// Packs rows `w[0..rows]` (rows ≤ 16), `nb` superblocks each.
    ///
    /// # Safety
    /// Each `w[m]`, m < rows, points at `nb` readable blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    unsafe fn pack(&mut self, nb: usize, w: &[*const BlockQ4K; ROWS], rows: usize) {
        use crate::x86::scales::unpack_k4;
        self.quants.resize(nb * 64, Line::ZERO);
        self.scales.resize(nb * 8, Line::ZERO);
        self.min_pairs.resize(nb * 4, Line::ZERO);
        self.d.resize(nb, Line::ZERO);
        self.dmin.resize(nb, Line::ZERO);
        let m4 = _mm256_set1_epi8(0x0F);
        for b in 0..nb {
            let mut by_row = [_mm512_setzero_si512(); ROWS];
            let mut pairs_by_row = [_mm512_setzero_si512(); ROWS];
            let mut d = [0f32; ROWS];
            let mut dmin = [0f32; ROWS];
            for m in 0..rows {
                // SAFETY: block b < nb of row m < rows is readable (the contract above); plain
                // bytes of alignment 1; its first 16 bytes are d, dmin and the 12 scale bytes.
                let (x, raw) = unsafe {
                    (
                        &*w[m].add(b),
                        _mm_loadu_si128(w[m].add(b) as *const __m128i),
                    )
                };
                // Eight scales then eight mins, as bytes.
                let u = unpack_k4(raw);
                by_row[m] = _mm512_cvtepu8_epi32(u);
                pairs_by_row[m] = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(u));
                d[m] = half::f16::from_le_bytes(x.d).to_f32();
                dmin[m] = half::f16::from_le_bytes(x.dmin).to_f32();
            }
            // Lines 0..8 of the first transpose are the scales (lines 8..16 the mins as i32,
            // unused); lines 4..8 of the second are the min pairs.
            let scales = transpose16(&by_row);
            let pairs = transpose16(&pairs_by_row);
            for s in 0..8 {
                // SAFETY: a 64-byte store into a 64-byte-aligned `Line`.
                unsafe {
                    _mm512_store_si512(self.scales[b * 8 + s].0.as_mut_ptr() as *mut _, scales[s])
                };
            }
            for p in 0..4 {
                // SAFETY: as above.
                unsafe {
                    _mm512_store_si512(
                        self.min_pairs[b * 4 + p].0.as_mut_ptr() as *mut _,
                        pairs[4 + p],
                    )
                };
            }
            self.d[b] = Line(bytemuck::cast(d));
            self.dmin[b] = Line(bytemuck::cast(dmin));
            for c in 0..4 {
                // Elements 64c..64c + 64: the low nibbles of qs[32c..32c + 32] (sub-block 2c),
                // then the high ones (2c + 1).
                let rows_c: [__m512i; ROWS] = std::array::from_fn(|m| {
                    if m >= rows {
                        return _mm512_setzero_si512();
                    }
                    // SAFETY: bytes 32c..32c + 32 of the 128 in `qs` of block b of row m.
                    let q = unsafe {
                        _mm256_loadu_si256((*w[m].add(b)).qs.as_ptr().add(32 * c) as *const __m256i)
                    };
                    let lo = _mm256_and_si256(q, m4);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
                });
                for (j, v) in transpose16(&rows_c).into_iter().enumerate() {
                    let line = &mut self.quants[b * 64 + 16 * c + j];
                    // SAFETY: a 64-byte store into a 64-byte-aligned `Line`.
                    unsafe { _mm512_store_si512(line.0.as_mut_ptr() as *mut __m512i, v) };
                }
            }
        }
    }
}

thread_local! {
    static PACKED_Q4K: RefCell<PackedQ4K> = RefCell::new(PackedQ4K::default());
}

/// [`q6k_tokens`] for Q4_K in the octet arithmetic (`crate::x86::q4k_octets`): per superblock
/// and token the exact Σ scale·q·a (eight sub-blocks of eight broadcast groups each) and
/// Σ min·bsum, the reference's float step, added to the token's sums for lane b mod 8 of its
/// chunk; at the end of a chunk `tree512` gives the chunk's values.
///
/// # Safety
/// As for [`q6k_tokens`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn q4k_tokens<const T: usize>(
    pk: &PackedQ4K,
    nb: usize,
    per: usize,
    a: [*const BlockQ8K; T],
    mut emit: impl FnMut(usize, &[__m512; T]),
) {
    use super::q4k_octets::tree512;
    let zero = _mm512_setzero_si512();
    let mut sums = [[_mm512_setzero_ps(); 8]; T];
    let mut chunk = 0;
    let mut first = 0;
    for b in 0..nb {
        // SAFETY: block b < nb of every token is readable (the contract above); alignment 1.
        let ys: [&BlockQ8K; T] = std::array::from_fn(|t| unsafe { &*a[t].add(b) });
        let quants = &pk.quants[b * 64..b * 64 + 64];
        let mut isum = [zero; T];
        for s in 0..8 {
            let mut raw = [zero; T];
            for j in 0..8 {
                let kq = 8 * s + j;
                // SAFETY: an aligned 64-byte line.
                let wq = unsafe { _mm512_load_si512(quants[kq].0.as_ptr() as *const __m512i) };
                for t in 0..T {
                    // SAFETY: bytes 4kq..4kq + 4 of the 256 in `qs` (kq < 64).
                    let x =
                        unsafe { (ys[t].qs.as_ptr().add(4 * kq) as *const i32).read_unaligned() };
                    raw[t] = _mm512_dpbusd_epi32(raw[t], wq, _mm512_set1_epi32(x));
                }
            }
            // SAFETY: an aligned 64-byte line.
            let sc = unsafe { _mm512_load_si512(pk.scales[b * 8 + s].0.as_ptr() as *const _) };
            for t in 0..T {
                isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(raw[t], sc));
            }
        }
        let mut msum = [zero; T];
        for p in 0..4 {
            // SAFETY: an aligned 64-byte line.
            let mp = unsafe { _mm512_load_si512(pk.min_pairs[b * 4 + p].0.as_ptr() as *const _) };
            for t in 0..T {
                let bs = |j: usize| ys[t].bsum(j) as i32;
                let (lo, hi) = (bs(4 * p) + bs(4 * p + 1), bs(4 * p + 2) + bs(4 * p + 3));
                let pair = (lo & 0xFFFF) | (hi << 16);
                msum[t] = _mm512_dpwssd_epi32(msum[t], mp, _mm512_set1_epi32(pair));
            }
        }
        // SAFETY: aligned 64-byte lines.
        let (d, dmin) = unsafe {
            (
                _mm512_load_ps(pk.d[b].0.as_ptr() as *const f32),
                _mm512_load_ps(pk.dmin[b].0.as_ptr() as *const f32),
            )
        };
        let lane = (b - first) % 8;
        for t in 0..T {
            let dy = _mm512_set1_ps(ys[t].d());
            let scaled = _mm512_mul_ps(_mm512_mul_ps(dy, d), _mm512_cvtepi32_ps(isum[t]));
            let mins = _mm512_mul_ps(_mm512_mul_ps(dy, dmin), _mm512_cvtepi32_ps(msum[t]));
            sums[t][lane] = _mm512_add_ps(sums[t][lane], _mm512_sub_ps(scaled, mins));
        }
        if (b + 1) % per == 0 || b + 1 == nb {
            let values: [__m512; T] = std::array::from_fn(|t| tree512(&sums[t]));
            emit(chunk, &values);
            chunk += 1;
            first = b + 1;
            sums = [[_mm512_setzero_ps(); 8]; T];
        }
    }
}
