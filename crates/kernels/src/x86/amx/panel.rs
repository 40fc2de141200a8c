//! The AMX panel: blocks of 16 weight rows packed for the tiles (planes transposed into the
//! VNNI layout), then 16-token tiles over every superblock with the format's float step.

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::TILE;
use super::formats::{Q4K, Q6K, TileFormat};
use super::unit::{A, B_HI, B_LO, C_HI, C_HI2, C_LO, C_LO2, Hardware, TileUnit};
use crate::blocks::{BlockQ8K, QK_K};
use crate::panel::{Panel, PanelFn};
use crate::x86::avx512::transpose16;

/// Bytes of one plane of one superblock: four B tiles of 16 rows × 64 bytes.
const PLANE_BYTES: usize = 4 * TILE * 64;

/// A block of up to 16 weight rows made ready for the tiles (rows past the block's end are
/// zeros): per superblock the two planes in the VNNI layout, and per row `d`, `dmin` and the
/// min pairs.
#[derive(Default)]
struct PackedRows {
    planes: Vec<u8>,
    min_pairs: Vec<[i32; TILE]>,
    d: Vec<[f32; TILE]>,
    dmin: Vec<[f32; TILE]>,
}

impl PackedRows {
    /// Packs the `rows` (≤ 16) rows `w[0..rows]` of `nb` superblocks each.
    ///
    /// # Safety
    /// Each `w[m]`, m < rows, points at `nb` readable blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    unsafe fn pack<F: TileFormat>(&mut self, nb: usize, w: &[*const F::Block; TILE], rows: usize) {
        self.planes.resize(nb * 2 * PLANE_BYTES, 0);
        self.min_pairs.resize(nb * 4, [0; TILE]);
        self.d.resize(nb, [0.0; TILE]);
        self.dmin.resize(nb, [0.0; TILE]);
        for b in 0..nb {
            let mut lo = [[_mm512_setzero_si512(); TILE]; 4];
            let mut hi = [[_mm512_setzero_si512(); TILE]; 4];
            for m in 0..TILE {
                if m >= rows {
                    self.d[b][m] = 0.0;
                    self.dmin[b][m] = 0.0;
                    for p in 0..4 {
                        self.min_pairs[b * 4 + p][m] = 0;
                    }
                    continue;
                }
                // SAFETY: block b < nb of row m < rows is readable (the contract above); the
                // blocks are plain bytes of alignment 1.
                let x = unsafe { &*w[m].add(b) };
                // SAFETY: this function runs only where the AVX-512 features it is compiled for
                // exist (its callers' contract).
                let u = unsafe { F::unpack(x) };
                self.d[b][m] = u.d;
                self.dmin[b][m] = u.dmin;
                for (p, pair) in u.min_pairs.into_iter().enumerate() {
                    self.min_pairs[b * 4 + p][m] = pair;
                }
                for c in 0..4 {
                    // SAFETY: as above.
                    (lo[c][m], hi[c][m]) = unsafe { F::planes(x, c, &u) };
                }
            }
            let dst = &mut self.planes[b * 2 * PLANE_BYTES..(b + 1) * 2 * PLANE_BYTES];
            for (plane, chunks) in [lo, hi].iter().enumerate() {
                for (c, chunk) in chunks.iter().enumerate() {
                    for (k, v) in transpose16(chunk).iter().enumerate() {
                        let at = plane * PLANE_BYTES + c * TILE * 64 + k * 64;
                        // SAFETY: 64 bytes at `at` lie inside `dst` (2 planes × 4 chunks × 16
                        // rows of 64 bytes).
                        unsafe { _mm512_storeu_si512(dst.as_mut_ptr().add(at) as *mut _, *v) };
                    }
                }
            }
        }
    }
}

/// Scratch of one thread: the packed weight rows, the last token tile padded to 16 tokens, and
/// per (token, superblock) the activations' scale and their (Σ sub-block 2p, Σ sub-block 2p+1)
/// pairs for the mins (shared by every block of rows).
#[derive(Default)]
struct Scratch {
    packed: PackedRows,
    tail: Vec<u8>,
    token_sums: Vec<TokenSums>,
}

#[derive(Clone, Copy, Default)]
struct TokenSums {
    dy: f32,
    pairs: [i32; 4],
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Panels of fewer tokens than this run through the AVX-512 register tiles of the same
/// arithmetic (`small`): packing a block of rows for the tiles costs about as much as one tile
/// of 16 tokens computes (measured on the 16-core host, one thread: at 8 tokens the register
/// tiles were twice as fast, at 16 from even to 15 % faster, at 32 the AMX tiles 1.4–1.5×
/// faster).
pub const MIN_TOKENS: usize = 24;

/// The AMX Q4_K panel (a `crate::panel::PanelFn`).
///
/// # Safety
/// As for `crate::panel::PanelFn`, on a CPU where [`super::available`] is true.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub unsafe fn panel_q4_k(p: &Panel) {
    // SAFETY: the caller's contract, and the CPU has AMX (`available`).
    unsafe { panel_on::<Q4K, _>(&mut Hardware, p, crate::x86::avx512::panel_q4_k_exact) }
}

/// The AMX Q6_K panel (a `crate::panel::PanelFn`): the same bits as the AVX-512 Q6_K dot.
///
/// # Safety
/// As for [`panel_q4_k`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub unsafe fn panel_q6_k(p: &Panel) {
    if p.n < Q6K_ROW_LANES_BELOW {
        // SAFETY: the caller's contract; the AVX-512 panel runs on this CPU (it has AMX).
        return unsafe { crate::x86::avx512::panel_q6_k(p) };
    }
    // SAFETY: as in `panel_q4_k`.
    unsafe { panel_on::<Q6K, _>(&mut Hardware, p, crate::x86::avx512::panel_q6_k) }
}

/// Q6_K batches of fewer tokens than this run through the AVX-512 level's panel — its row lanes
/// from 16 tokens, which compute in the same arithmetic (the same bits): on the 16-core host
/// at 16 threads they beat the tiles at 32 tokens (1829 against 1274 GFLOP/s, 7168 × 2048) and
/// lost at 64 (1888 against 2184; docs/measurements/2026-12-04-run24-*).
const Q6K_ROW_LANES_BELOW: usize = 48;

/// A panel of format `F` over any [`TileUnit`] (the tests' emulated one too): 16-row × 16-token
/// tiles, the last row block padded with zero rows and the last token tile with zero tokens
/// (copies), whose outputs are dropped; panels of fewer than [`MIN_TOKENS`] tokens run through
/// `small`, the AVX-512 panel of the same arithmetic (the same bits).
///
/// # Safety
/// As for `crate::panel::PanelFn`; `unit` can run on this CPU.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
pub unsafe fn panel_on<F: TileFormat, U: TileUnit>(unit: &mut U, p: &Panel, small: PanelFn) {
    let nb = p.k / QK_K;
    let a_bytes = nb * size_of::<BlockQ8K>();
    if p.n < MIN_TOKENS {
        // SAFETY: the caller's contract; `small` runs on AVX-512, which this CPU has.
        unsafe { small(p) };
        return;
    }
    SCRATCH.with_borrow_mut(|scratch| {
        let Scratch {
            packed,
            tail,
            token_sums,
        } = scratch;
        // The last partial token tile, copied and padded with zero blocks (d = 0, bsums 0).
        let tail_start = p.n / TILE * TILE;
        let tail_len = p.n - tail_start;
        if tail_len > 0 {
            tail.clear();
            tail.resize(TILE * a_bytes, 0);
            for t in 0..tail_len {
                // SAFETY: token tail_start + t < n is in the panel: `a_bytes` readable bytes.
                let src = unsafe {
                    std::slice::from_raw_parts(p.a.add((tail_start + t) * p.a_stride), a_bytes)
                };
                tail[t * a_bytes..(t + 1) * a_bytes].copy_from_slice(src);
            }
        }
        let padded = p.n.next_multiple_of(TILE);
        token_sums.clear();
        token_sums.resize(padded * nb, TokenSums::default());
        for t in 0..p.n {
            for b in 0..nb {
                // SAFETY: block b of token t < n is in the panel; alignment 1, plain bytes.
                let y = unsafe {
                    &*(p.a.add(t * p.a_stride + b * size_of::<BlockQ8K>()) as *const BlockQ8K)
                };
                let sub = |j: usize| y.bsum(2 * j) as i32 + y.bsum(2 * j + 1) as i32;
                token_sums[t * nb + b] = TokenSums {
                    dy: y.d(),
                    pairs: std::array::from_fn(|pi| {
                        (sub(2 * pi) & 0xFFFF) | (sub(2 * pi + 1) << 16)
                    }),
                };
            }
        }
        unit.begin();
        let mut c_lo = [[0i32; TILE]; TILE];
        let mut c_hi = [[0i32; TILE]; TILE];
        for r0 in (0..p.rows).step_by(TILE) {
            let rows = (p.rows - r0).min(TILE);
            let w: [*const F::Block; TILE] =
                std::array::from_fn(|m| p.w.wrapping_add((r0 + m) * p.w_stride) as *const F::Block);
            // SAFETY: rows r0..r0 + rows are in the panel, `nb` blocks each.
            unsafe { packed.pack::<F>(nb, &w, rows) };
            let row_mask: __mmask16 = if rows == TILE { !0 } else { (1 << rows) - 1 };
            for t0 in (0..p.n).step_by(TILE) {
                let (a0, a_stride, tokens) = if t0 == tail_start {
                    (tail.as_ptr(), a_bytes, tail_len)
                } else {
                    (p.a.wrapping_add(t0 * p.a_stride), p.a_stride, TILE)
                };
                let mut acc = [_mm512_setzero_ps(); TILE];
                // Superblock b's tile products are issued before superblock b − 1 is scaled.
                for step in 0..=nb {
                    if step < nb {
                        let b = step;
                        let (lo, hi) = if b % 2 == 0 {
                            (C_LO, C_HI)
                        } else {
                            (C_LO2, C_HI2)
                        };
                        unit.zero(lo);
                        unit.zero(hi);
                        let planes = &packed.planes[b * 2 * PLANE_BYTES..];
                        for c in 0..4 {
                            // SAFETY: the A tile is bytes 64c..64c + 64 of block b's quants of
                            // 16 token rows `a_stride` apart (the panel's, or the padded copy);
                            // the B tiles are chunk c of this superblock's two planes, 16 rows
                            // of 64 bytes.
                            unsafe {
                                let q = a0.add(b * size_of::<BlockQ8K>() + 4 + 64 * c);
                                unit.load(A, q, a_stride);
                                unit.load(B_LO, planes[c * TILE * 64..].as_ptr(), 64);
                                unit.load(B_HI, planes[PLANE_BYTES + c * TILE * 64..].as_ptr(), 64);
                            }
                            unit.dot(lo, A, B_LO);
                            unit.dot(hi, A, B_HI);
                        }
                    }
                    if step == 0 {
                        continue;
                    }
                    let b = step - 1;
                    let (lo, hi) = if b % 2 == 0 {
                        (C_LO, C_HI)
                    } else {
                        (C_LO2, C_HI2)
                    };
                    // SAFETY: each store writes 16 rows of 64 bytes into a 16×16 i32 array.
                    unsafe {
                        unit.store(lo, c_lo.as_mut_ptr() as *mut u8, 64);
                        unit.store(hi, c_hi.as_mut_ptr() as *mut u8, 64);
                    }
                    // SAFETY: the loads read the 16 f32 of `packed.d[b]` and `packed.dmin[b]`.
                    let (d, dmin) = unsafe {
                        (
                            _mm512_loadu_ps(packed.d[b].as_ptr()),
                            _mm512_loadu_ps(packed.dmin[b].as_ptr()),
                        )
                    };
                    let min_pairs: [__m512i; 4] = std::array::from_fn(|pi| {
                        // SAFETY: the 16 i32 of one entry of `min_pairs`.
                        unsafe {
                            _mm512_loadu_si512(packed.min_pairs[b * 4 + pi].as_ptr() as *const _)
                        }
                    });
                    for t in 0..TILE {
                        let sums = token_sums[(t0 + t) * nb + b];
                        // SAFETY: the loads read row t (16 i32) of each accumulator array.
                        let (lo, hi) = unsafe {
                            (
                                _mm512_loadu_si512(c_lo[t].as_ptr() as *const _),
                                _mm512_loadu_si512(c_hi[t].as_ptr() as *const _),
                            )
                        };
                        let isum = _mm512_add_epi32(_mm512_slli_epi32::<7>(hi), lo);
                        let mut msum = _mm512_setzero_si512();
                        if F::MINS {
                            // Σ_j min_j · (bsum_2j + bsum_2j+1), two sub-blocks per vpdpwssd.
                            for (pairs, bs) in min_pairs.iter().zip(sums.pairs) {
                                msum = _mm512_dpwssd_epi32(msum, _mm512_set1_epi32(bs), *pairs);
                            }
                        }
                        // SAFETY: AVX-512 is there (this function's contract).
                        acc[t] = unsafe {
                            F::step(acc[t], _mm512_set1_ps(sums.dy), d, dmin, isum, msum)
                        };
                    }
                }
                for (t, v) in acc.iter().enumerate().take(tokens) {
                    // SAFETY: outputs (t0 + t, r0..r0 + rows) are in the panel; the mask stores
                    // only those `rows` consecutive f32.
                    unsafe {
                        _mm512_mask_storeu_ps(p.out.add((t0 + t) * p.out_stride + r0), row_mask, *v)
                    };
                }
            }
        }
        unit.end();
    });
}
