//! The Q4_K and Q6_K panels of the AVX2 level for batches of many tokens, with one weight row
//! per 32-bit lane (the AVX-512 level's `row_lanes`, in 256 bits and without VNNI). A block of eight weight
//! rows is unpacked once per panel call into four-byte groups (for each four columns, the eight
//! rows' four bytes: one register), and each token's four activation bytes are broadcast
//! against it. `vpmaddubsw` gives each row two 16-bit sums of two products; the eight groups of
//! a 32-column sub-block are added in 16 bits (at most 16 × 15 × 127 = 30480, no overflow),
//! and one `vpmaddwd` with the rows' sub-block scales widens and scales them. The register
//! tiles spend a `vpmaddwd` on every `vpmaddubsw` and reduce each token's sums across lanes;
//! here a sub-block takes eight of the first and one of the second, and nothing crosses lanes.
//!
//! Q6_K's quants reach 63, so only two groups are added in 16 bits (2 × 2 × 63 × 127 = 32004)
//! before each `vpmaddwd`: six multiplies per 128 products against the tiles' eight.
//!
//! **Same bits** as the level's dots. Q4_K: the octet arithmetic of `crate::x86::q4k_octets`
//! (each superblock's exact integer sums and the reference's float step, added to the sums of
//! lane b mod 8 and reduced by `hsum_ps`'s tree), one row per lane. Q6_K: the scalar
//! reference's (per superblock the exact Σ scale·(q − 32)·a, then `acc + (d·dy)·isum`). Chunked products add each chunk's
//! value (the dot of the chunk alone) to f64 sums in chunk order, as
//! `crate::panel::ChunkPanel` asks.

// Tiles index several per-row and per-token arrays with the same loop variable.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;
use std::cell::RefCell;

use crate::blocks::{BlockQ4K, BlockQ6K, BlockQ8K, QK_K};
use crate::panel::{ChunkPanel, Panel, PanelFn};
use crate::x86::token_runs;

/// Weight rows per packed block: one per 32-bit lane of a 256-bit register.
pub const ROWS: usize = 8;

/// Tokens whose sums stay in registers together: each packed weight register loaded serves
/// this many tokens (sixteen registers: four tokens' 16-bit and 32-bit sums, the weights and
/// the broadcast).
const TOKENS: usize = 4;

/// Panels of fewer tokens than this run through the register tiles: packing a block of rows
/// costs about what two tokens' products cost.
pub const MIN_TOKENS: usize = 16;

/// 32 bytes, aligned for whole-register loads.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Line([u8; 32]);

impl Line {
    const ZERO: Line = Line([0; 32]);
}

/// A block of up to 8 Q4_K rows, unpacked (rows past the block's end are zeros). Per
/// superblock: 64 lines of quants (0..15), line j holding columns 4j..4j + 4 of every row; 8
/// lines of sub-block scales, each row's scale twice as i16 (`vpmaddwd` adds the row's two
/// 16-bit sums and scales them); 4 lines of min pairs `(min_2p, min_2p+1)` as two i16 per row;
/// and a line each of the rows' `d` and `dmin` as f32.
#[derive(Default)]
struct PackedQ4K {
    quants: Vec<Line>,
    scale_pairs: Vec<Line>,
    min_pairs: Vec<Line>,
    d: Vec<Line>,
    dmin: Vec<Line>,
}

/// The 8×8 transpose of 32-bit elements: lane m of result j is lane j of `r[m]`.
#[inline]
#[target_feature(enable = "avx2")]
fn transpose8(r: &[__m256i; 8]) -> [__m256i; 8] {
    let t: [__m256i; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[2 * (i / 2)], r[2 * (i / 2) + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_epi32(a, b)
        } else {
            _mm256_unpackhi_epi32(a, b)
        }
    });
    // u[4h + q]: within each 128-bit half, rows 4h..4h + 4 at column (half · 4 + q).
    let u: [__m256i; 8] = std::array::from_fn(|i| {
        let (h, q) = (i / 4, i % 4);
        let (a, b) = (t[4 * h + q / 2], t[4 * h + 2 + q / 2]);
        if q % 2 == 0 {
            _mm256_unpacklo_epi64(a, b)
        } else {
            _mm256_unpackhi_epi64(a, b)
        }
    });
    std::array::from_fn(|j| {
        let (half, q) = (j / 4, j % 4);
        if half == 0 {
            _mm256_permute2x128_si256::<0x20>(u[q], u[4 + q])
        } else {
            _mm256_permute2x128_si256::<0x31>(u[q], u[4 + q])
        }
    })
}

/// Columns 64c..64c + 64 of the block's rows (two registers of 32 bytes per row) as the 16
/// lines of column groups: line 8h + j holds bytes 4j..4j + 4 of every row's register h.
#[inline]
#[target_feature(enable = "avx2")]
fn store_columns(lines: &mut [Line], halves: [&[__m256i; ROWS]; 2]) {
    for (h, half) in halves.into_iter().enumerate() {
        for (line, v) in lines[8 * h..8 * h + 8].iter_mut().zip(transpose8(half)) {
            // SAFETY: a 32-byte store into a 32-byte-aligned `Line`.
            unsafe { _mm256_store_si256(line.0.as_mut_ptr() as *mut __m256i, v) };
        }
    }
}

impl PackedQ4K {
    /// Packs rows `w[0..rows]` (rows ≤ 8), `nb` superblocks each.
    ///
    /// # Safety
    /// Each `w[m]`, m < rows, points at `nb` readable blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pack(&mut self, nb: usize, w: &[*const BlockQ4K; ROWS], rows: usize) {
        use crate::x86::scales::unpack_k4;
        self.quants.resize(nb * 64, Line::ZERO);
        self.scale_pairs.resize(nb * 8, Line::ZERO);
        self.min_pairs.resize(nb * 4, Line::ZERO);
        self.d.resize(nb, Line::ZERO);
        self.dmin.resize(nb, Line::ZERO);
        let m4 = _mm256_set1_epi8(0x0F);
        for b in 0..nb {
            let mut scale_pairs = [[0u32; ROWS]; 8];
            let mut min_pairs = [[0u32; ROWS]; 4];
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
                let mut u = [0u8; 16];
                // SAFETY: a 16-byte store into the 16 bytes of `u`.
                unsafe { _mm_storeu_si128(u.as_mut_ptr() as *mut __m128i, unpack_k4(raw)) };
                for s in 0..8 {
                    scale_pairs[s][m] = u32::from(u[s]) * 0x0001_0001;
                }
                for p in 0..4 {
                    min_pairs[p][m] = u32::from(u[8 + 2 * p]) | u32::from(u[9 + 2 * p]) << 16;
                }
                d[m] = half::f16::from_le_bytes(x.d).to_f32();
                dmin[m] = half::f16::from_le_bytes(x.dmin).to_f32();
            }
            for s in 0..8 {
                self.scale_pairs[b * 8 + s] = Line(bytemuck::cast(scale_pairs[s]));
            }
            for p in 0..4 {
                self.min_pairs[b * 4 + p] = Line(bytemuck::cast(min_pairs[p]));
            }
            self.d[b] = Line(bytemuck::cast(d));
            self.dmin[b] = Line(bytemuck::cast(dmin));
            for c in 0..4 {
                // Columns 64c..64c + 32: the low nibbles of qs[32c..32c + 32] (sub-block 2c);
                // columns 64c + 32..64c + 64: the high ones (2c + 1).
                let mut lo = [_mm256_setzero_si256(); ROWS];
                let mut hi = [_mm256_setzero_si256(); ROWS];
                for m in 0..rows {
                    // SAFETY: bytes 32c..32c + 32 of the 128 in `qs` of block b of row m.
                    let q = unsafe {
                        _mm256_loadu_si256((*w[m].add(b)).qs.as_ptr().add(32 * c) as *const __m256i)
                    };
                    lo[m] = _mm256_and_si256(q, m4);
                    hi[m] = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
                }
                store_columns(&mut self.quants[b * 64 + 16 * c..][..16], [&lo, &hi]);
            }
        }
    }
}

thread_local! {
    static PACKED_Q4K: RefCell<PackedQ4K> = RefCell::new(PackedQ4K::default());
}

/// 32 bytes of an aligned line.
#[inline]
#[target_feature(enable = "avx2")]
fn load(line: &Line) -> __m256i {
    // SAFETY: an aligned 32-byte load of the line's 32 bytes.
    unsafe { _mm256_load_si256(line.0.as_ptr() as *const __m256i) }
}

/// Superblocks `0..nb` of the packed rows against tokens `a[0..T]` in the octet arithmetic:
/// per superblock and token the exact Σ scale·q·a (eight sub-blocks of eight broadcast groups
/// each) and Σ min·bsum, the reference's float step, added to the token's sums for lane b mod
/// 8 of its chunk (`per` superblocks); at the end of each chunk `emit(chunk, values)` gets the
/// chunk's values, token t's eight rows in `values[t]`.
///
/// # Safety
/// `pk` holds `nb` packed superblocks; each `a[t]` points at `nb` readable Q8_K blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4k_tokens<const T: usize>(
    pk: &PackedQ4K,
    nb: usize,
    per: usize,
    a: [*const BlockQ8K; T],
    mut emit: impl FnMut(usize, &[__m256; T]),
) {
    use crate::x86::q4k_octets::tree;
    let zero = _mm256_setzero_si256();
    let mut sums = [[_mm256_setzero_ps(); 8]; T];
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
                let wq = load(&quants[kq]);
                for t in 0..T {
                    // SAFETY: bytes 4kq..4kq + 4 of the 256 in `qs` (kq < 64).
                    let x =
                        unsafe { (ys[t].qs.as_ptr().add(4 * kq) as *const i32).read_unaligned() };
                    let p = _mm256_maddubs_epi16(wq, _mm256_set1_epi32(x));
                    raw[t] = _mm256_add_epi16(raw[t], p);
                }
            }
            let sc = load(&pk.scale_pairs[b * 8 + s]);
            for t in 0..T {
                isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(raw[t], sc));
            }
        }
        let mut msum = [zero; T];
        for p in 0..4 {
            let mp = load(&pk.min_pairs[b * 4 + p]);
            for t in 0..T {
                let bs = |j: usize| ys[t].bsum(j) as i32;
                let (lo, hi) = (bs(4 * p) + bs(4 * p + 1), bs(4 * p + 2) + bs(4 * p + 3));
                let pair = (lo & 0xFFFF) | (hi << 16);
                msum[t] = _mm256_add_epi32(msum[t], _mm256_madd_epi16(mp, _mm256_set1_epi32(pair)));
            }
        }
        // SAFETY: aligned 32-byte loads of the lines' eight f32.
        let (d, dmin) = unsafe {
            (
                _mm256_load_ps(pk.d[b].0.as_ptr() as *const f32),
                _mm256_load_ps(pk.dmin[b].0.as_ptr() as *const f32),
            )
        };
        let lane = (b - first) % 8;
        for t in 0..T {
            let dy = _mm256_set1_ps(ys[t].d());
            let scaled = _mm256_mul_ps(_mm256_mul_ps(dy, d), _mm256_cvtepi32_ps(isum[t]));
            let mins = _mm256_mul_ps(_mm256_mul_ps(dy, dmin), _mm256_cvtepi32_ps(msum[t]));
            sums[t][lane] = _mm256_add_ps(sums[t][lane], _mm256_sub_ps(scaled, mins));
        }
        if (b + 1) % per == 0 || b + 1 == nb {
            let values: [__m256; T] = std::array::from_fn(|t| tree(&sums[t]));
            emit(chunk, &values);
            chunk += 1;
            first = b + 1;
            sums = [[_mm256_setzero_ps(); 8]; T];
        }
    }
}

/// A block of up to 8 Q6_K rows, unpacked (rows past the block's end are zeros). Per
/// superblock: 64 lines of quants `q` (0..63, the stored 6 bits), line j holding columns
/// 4j..4j + 4 of every row; 16 lines of sub-block scales, each row's scale twice as i16; 8
/// lines of scale pairs `(scale_2p, scale_2p+1)` as two i16 per row (for the offset of 32);
/// and a line of the rows' `d` as f32.
#[derive(Default)]
struct PackedQ6K {
    quants: Vec<Line>,
    scales: Vec<Line>,
    scale_pairs: Vec<Line>,
    d: Vec<Line>,
}

impl PackedQ6K {
    /// Packs rows `w[0..rows]` (rows ≤ 8), `nb` superblocks each.
    ///
    /// # Safety
    /// Each `w[m]`, m < rows, points at `nb` readable blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pack(&mut self, nb: usize, w: &[*const BlockQ6K; ROWS], rows: usize) {
        use crate::x86::kq256::q6k_quants;
        self.quants.resize(nb * 64, Line::ZERO);
        self.scales.resize(nb * 16, Line::ZERO);
        self.scale_pairs.resize(nb * 8, Line::ZERO);
        self.d.resize(nb, Line::ZERO);
        for b in 0..nb {
            let mut scales = [[0u32; ROWS]; 16];
            let mut scale_pairs = [[0u32; ROWS]; 8];
            let mut d = [0f32; ROWS];
            for m in 0..rows {
                // SAFETY: block b < nb of row m < rows is readable (the contract above); plain
                // bytes of alignment 1.
                let x = unsafe { &*w[m].add(b) };
                let sc = |s: usize| u32::from(x.scales[s] as i16 as u16);
                for s in 0..16 {
                    scales[s][m] = sc(s) * 0x0001_0001;
                }
                for p in 0..8 {
                    scale_pairs[p][m] = sc(2 * p) | sc(2 * p + 1) << 16;
                }
                d[m] = half::f16::from_le_bytes(x.d).to_f32();
            }
            for s in 0..16 {
                self.scales[b * 16 + s] = Line(bytemuck::cast(scales[s]));
            }
            for p in 0..8 {
                self.scale_pairs[b * 8 + p] = Line(bytemuck::cast(scale_pairs[p]));
            }
            self.d[b] = Line(bytemuck::cast(d));
            for c in 0..4 {
                let mut first = [_mm256_setzero_si256(); ROWS];
                let mut second = [_mm256_setzero_si256(); ROWS];
                for m in 0..rows {
                    // SAFETY: as above.
                    (first[m], second[m]) = q6k_quants(unsafe { &*w[m].add(b) }, c);
                }
                store_columns(&mut self.quants[b * 64 + 16 * c..][..16], [&first, &second]);
            }
        }
    }
}

thread_local! {
    static PACKED_Q6K: RefCell<PackedQ6K> = RefCell::new(PackedQ6K::default());
}

/// [`q4k_tokens`] for Q6_K in the scalar reference's arithmetic: per superblock and token the
/// exact Σ scale·q·a (sixteen sub-blocks of four broadcast groups, added two groups at a time in
/// 16 bits), less 32·Σ scale·bsum, then `acc + (d·dy)·isum`; at the end of each chunk `emit`
/// gets the chunk's values and the sums start again from 0.0.
///
/// # Safety
/// As for [`q4k_tokens`], with Q6_K rows in `pk`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_tokens<const T: usize>(
    pk: &PackedQ6K,
    nb: usize,
    per: usize,
    a: [*const BlockQ8K; T],
    mut emit: impl FnMut(usize, &[__m256; T]),
) {
    let zero = _mm256_setzero_si256();
    let mut acc = [_mm256_setzero_ps(); T];
    let mut chunk = 0;
    for b in 0..nb {
        // SAFETY: block b < nb of every token is readable (the contract above); alignment 1.
        let ys: [&BlockQ8K; T] = std::array::from_fn(|t| unsafe { &*a[t].add(b) });
        let quants = &pk.quants[b * 64..b * 64 + 64];
        let mut isum = [zero; T];
        for s in 0..16 {
            let sc = load(&pk.scales[b * 16 + s]);
            for half in 0..2 {
                let mut raw = [zero; T];
                for j in 0..2 {
                    let kq = 4 * s + 2 * half + j;
                    let wq = load(&quants[kq]);
                    for t in 0..T {
                        // SAFETY: bytes 4kq..4kq + 4 of the 256 in `qs` (kq < 64).
                        let x = unsafe {
                            (ys[t].qs.as_ptr().add(4 * kq) as *const i32).read_unaligned()
                        };
                        let p = _mm256_maddubs_epi16(wq, _mm256_set1_epi32(x));
                        raw[t] = _mm256_add_epi16(raw[t], p);
                    }
                }
                for t in 0..T {
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(raw[t], sc));
                }
            }
        }
        // The quants are stored with +32: Σ_s scale_s·bsum_s, by pairs of sub-blocks.
        let mut offset = [zero; T];
        for p in 0..8 {
            let sp = load(&pk.scale_pairs[b * 8 + p]);
            for t in 0..T {
                // SAFETY: bytes 4p..4p + 4 of the 32 in `bsums`: (bsum_2p, bsum_2p+1) (p < 8).
                let pair =
                    unsafe { (ys[t].bsums.as_ptr().add(4 * p) as *const i32).read_unaligned() };
                offset[t] =
                    _mm256_add_epi32(offset[t], _mm256_madd_epi16(sp, _mm256_set1_epi32(pair)));
            }
        }
        // SAFETY: an aligned 32-byte load of the line's eight f32.
        let d = unsafe { _mm256_load_ps(pk.d[b].0.as_ptr() as *const f32) };
        for t in 0..T {
            let exact = _mm256_sub_epi32(isum[t], _mm256_slli_epi32::<5>(offset[t]));
            let scale = _mm256_mul_ps(d, _mm256_set1_ps(ys[t].d()));
            acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(scale, _mm256_cvtepi32_ps(exact)));
        }
        if (b + 1) % per == 0 || b + 1 == nb {
            emit(chunk, &acc);
            chunk += 1;
            acc = [_mm256_setzero_ps(); T];
        }
    }
}

/// The weight rows `r0..r0 + ROWS` (or fewer at the end) of a panel, as block pointers.
fn row_block<B>(w: *const u8, w_stride: usize, r0: usize, rows: usize) -> [*const B; ROWS] {
    std::array::from_fn(|m| w.wrapping_add((r0 + m.min(rows - 1)) * w_stride) as *const B)
}

/// The mask of `_mm256_maskstore_ps` for the first `n` 32-bit lanes (of `_mm256_maskstore_pd`
/// for the first n / 2 64-bit lanes, which read the sign of their upper half).
#[inline]
#[target_feature(enable = "avx2")]
fn first_lanes(n: usize) -> __m256i {
    let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), idx)
}

/// `row_lane_panels!(panel, chunk_panel, packed, tokens, small, "format")`: the panel and
/// chunk-panel kernels of one format: blocks of 8 rows packed into the thread's `packed` and run
/// against runs of up to four tokens by `tokens`, batches of fewer than [`MIN_TOKENS`] tokens
/// through the register tiles `small` (per chunk, for the chunk panel).
macro_rules! row_lane_panels {
    ($panel:ident, $chunk_panel:ident, $packed:ident, $tokens:ident, $small:path, $fmt:literal) => {
        #[doc = concat!("The ", $fmt, " panel of the AVX2 level (`crate::panel::PanelFn`): row lanes")]
        /// for batches of at least [`MIN_TOKENS`] tokens, the register tiles below that.
        ///
        /// # Safety
        /// As for `crate::panel::PanelFn`.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) unsafe fn $panel(p: &Panel) {
            if p.n < MIN_TOKENS {
                // SAFETY: the caller's contract.
                return unsafe { $small(p) };
            }
            let nb = p.k / QK_K;
            $packed.with_borrow_mut(|pk| {
                for r0 in (0..p.rows).step_by(ROWS) {
                    let rows = (p.rows - r0).min(ROWS);
                    // SAFETY: rows r0..r0 + rows < p.rows of the panel, `nb` blocks each, are readable
                    // (the caller's contract).
                    unsafe { pk.pack(nb, &row_block(p.w, p.w_stride, r0, rows), rows) };
                    let mask = first_lanes(rows);
                    token_runs!(p.n, [4, 3, 2], |t0, T| {
                        let a: [*const BlockQ8K; T] = std::array::from_fn(|t| {
                            p.a.wrapping_add((t0 + t) * p.a_stride) as *const _
                        });
                        let mut values = [_mm256_setzero_ps(); T];
                        let emit = |_, v: &[__m256; T]| values = *v;
                        // SAFETY: `pk` holds the `nb` superblocks just packed; tokens t0..t0 + T < n
                        // each have `nb` readable blocks (the caller's contract).
                        unsafe { $tokens::<T>(pk, nb, nb, a, emit) };
                        for (t, v) in values.iter().enumerate() {
                            let at = p.out.wrapping_add((t0 + t) * p.out_stride + r0);
                            // SAFETY: outputs (t0 + t, r0 + m) for the lanes m < rows of `mask`,
                            // inside the panel: writable and unaliased (the caller's contract).
                            unsafe { _mm256_maskstore_ps(at, mask, *v) };
                        }
                    });
                }
            });
        }

        #[doc = concat!("The ", $fmt, " chunk panel of the AVX2 level (`crate::panel::ChunkPanelFn`)")]
        /// for batches of at least [`MIN_TOKENS`] tokens: row lanes, each chunk's eight values per token added to f64
        /// sums as the chunk ends. Fewer tokens run `small` on each chunk (and the tail), whose f32
        /// values are added in chunk order. The chunks must be contiguous (chunk c at block c·k/256),
        /// as `Kernels::matmul_chunked` lays them out.
        ///
        /// # Safety
        /// As for `crate::panel::ChunkPanelFn`.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) unsafe fn $chunk_panel(p: &ChunkPanel) {
            if p.n < MIN_TOKENS {
                // SAFETY: the caller's contract.
                return unsafe { chunk_panel_by_panels(p, $small) };
            }
            let per = p.k / QK_K;
            let nb = p.chunks * per + p.tail_k / QK_K;
            $packed.with_borrow_mut(|pk| {
                for r0 in (0..p.rows).step_by(ROWS) {
                    let rows = (p.rows - r0).min(ROWS);
                    // SAFETY: as in the panel; the chunks of a row are contiguous blocks.
                    unsafe { pk.pack(nb, &row_block(p.w, p.w_stride, r0, rows), rows) };
                    let (lo, hi) = (first_lanes(2 * rows.min(4)), first_lanes(2 * rows.saturating_sub(4)));
                    token_runs!(p.n, [4, 3, 2], |t0, T| {
                        let a: [*const BlockQ8K; T] = std::array::from_fn(|t| {
                            p.a.wrapping_add((t0 + t) * p.a_stride) as *const _
                        });
                        let mut sums = [[_mm256_setzero_pd(); 2]; T];
                        let emit = |_, values: &[__m256; T]| {
                            for (sum, v) in sums.iter_mut().zip(values) {
                                let (l, h) = (_mm256_castps256_ps128(*v), _mm256_extractf128_ps::<1>(*v));
                                sum[0] = _mm256_add_pd(sum[0], _mm256_cvtps_pd(l));
                                sum[1] = _mm256_add_pd(sum[1], _mm256_cvtps_pd(h));
                            }
                        };
                        // SAFETY: as in the panel.
                        unsafe { $tokens::<T>(pk, nb, per, a, emit) };
                        for (t, sum) in sums.iter().enumerate() {
                            let at = p.out.wrapping_add((t0 + t) * p.out_stride + r0);
                            // SAFETY: outputs (t0 + t, r0 + m) for the lanes m < rows of the masks,
                            // inside the panel: writable and unaliased (the caller's contract).
                            unsafe {
                                _mm256_maskstore_pd(at, lo, sum[0]);
                                _mm256_maskstore_pd(at.wrapping_add(4), hi, sum[1]);
                            }
                        }
                    });
                }
            });
        }
    };
}

row_lane_panels!(
    panel_q4_k,
    chunk_panel_q4_k,
    PACKED_Q4K,
    q4k_tokens,
    super::panels::panel_q4_k_tiles,
    "Q4_K"
);
row_lane_panels!(
    panel_q6_k,
    chunk_panel_q6_k,
    PACKED_Q6K,
    q6k_tokens,
    super::panels::panel_q6_k_tiles,
    "Q6_K"
);

/// A chunk panel run as one `panel` call per chunk (and the tail) on the whole block of rows
/// and tokens, each value added to its f64 sum in chunk order: for batches too small to repay
/// the row lanes' packing.
///
/// # Safety
/// As for `crate::panel::ChunkPanelFn`; `panel` is a panel kernel of this level for the
/// chunks' format.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chunk_panel_by_panels(p: &ChunkPanel, panel: PanelFn) {
    let mut part = vec![0f32; p.n * p.rows];
    for t in 0..p.n {
        for r in 0..p.rows {
            // SAFETY: output (t, r) of the panel: writable and unaliased (the contract).
            unsafe { *p.out.add(t * p.out_stride + r) = 0.0 };
        }
    }
    let tail = (p.tail_k > 0).then_some((p.chunks, p.tail_k));
    for (c, k) in (0..p.chunks).map(|c| (c, p.k)).chain(tail) {
        let chunk = Panel {
            k,
            w: p.w.wrapping_add(c * p.w_chunk),
            w_stride: p.w_stride,
            rows: p.rows,
            a: p.a.wrapping_add(c * p.a_chunk),
            a_stride: p.a_stride,
            n: p.n,
            out: part.as_mut_ptr(),
            out_stride: p.rows,
        };
        // SAFETY: chunk c (or the tail) of every row and token is readable (the contract);
        // `part` holds n × rows values and aliases no input.
        unsafe { panel(&chunk) };
        for t in 0..p.n {
            for r in 0..p.rows {
                // SAFETY: as above.
                unsafe { *p.out.add(t * p.out_stride + r) += part[t * p.rows + r] as f64 };
            }
        }
    }
}
