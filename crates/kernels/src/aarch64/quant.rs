//! The loops of the quantized kernels, shared by every format of `super::formats`:
//!
//! - **dot** (every level): per block, unpack the weight quants to bytes, take the exact integer
//!   sum of each sub-block against the activations (`smull` or `sdot`), and add the block's
//!   value ([`Quant::finish`]) to one f32 sum in block order — the reference's operations, so
//!   the result has the scalar reference's bits.
//! - **panel** (i8mm level): two weight rows × two tokens at a time with `smmla`, which yields
//!   the four (row, token) sub-block sums of 8 bytes per instruction. Each row pair is unpacked
//!   once for all tokens of the panel; the four sums go through the same `finish` and the same
//!   f32 sum as the dot, so each value equals the dot product's bits (`crate::panel`'s
//!   contract). A leftover row or token is computed by the dot.

// The loops index several arrays (blocks, sub-block sums, lanes) with one position variable,
// as the scalar reference they mirror does.
#![allow(clippy::needless_range_loop)]

use std::arch::aarch64::*;

use super::formats::{ActBlock, Quant};
use super::int8::{dot16, load8, load16, smmla};
use crate::panel::Panel;

/// Blocks of `bytes` as `T`s, `nb` of them; panics (naming the sizes) if `bytes` is short.
#[inline(always)]
fn blocks<'a, T: bytemuck::Pod>(bytes: &'a [u8], nb: usize, what: &str) -> &'a [T] {
    let need = nb * size_of::<T>();
    assert!(
        bytes.len() >= need,
        "{what}: {} bytes for {nb} blocks of {}",
        bytes.len(),
        size_of::<T>()
    );
    bytemuck::cast_slice(&bytes[..need])
}

/// Σ over sub-block `s` of `q · y` for every sub-block of one block.
#[inline]
#[target_feature(enable = "neon")]
fn sub_sums<Q: Quant, const SDOT: bool>(q: &[i8; 256], y: &[i8]) -> [i32; 16] {
    let mut sums = [0i32; 16];
    for (s, sum) in sums.iter_mut().enumerate().take(Q::N / Q::SUB) {
        let mut acc = vdupq_n_s32(0);
        for c in (s * Q::SUB..(s + 1) * Q::SUB).step_by(16) {
            acc = dot16::<SDOT>(acc, load16(q, c), load16(y, c));
        }
        *sum = vaddvq_s32(acc);
    }
    sums
}

/// The dot product of `n` elements of one weight row and one activation row.
#[inline]
#[target_feature(enable = "neon")]
pub(super) fn dot<Q: Quant, const SDOT: bool>(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let nb = n / Q::N;
    let w: &[Q::W] = blocks(w, nb, "weight row");
    let a: &[Q::A] = blocks(a, nb, "activation row");
    let mut q = [0i8; 256];
    let mut sum = 0f32;
    for (x, y) in w.iter().zip(a) {
        Q::unpack(x, &mut q);
        sum += Q::finish(x, y, &sub_sums::<Q, SDOT>(&q, y.quants()));
    }
    sum
}

/// Plain-NEON dot product of format `Q` (every AArch64 CPU has NEON).
pub(super) fn dot_neon<Q: Quant>(n: usize, w: &[u8], a: &[u8]) -> f32 {
    // SAFETY: NEON, which every AArch64 target enables (checked in `super`).
    unsafe { dot::<Q, false>(n, w, a) }
}

#[target_feature(enable = "dotprod")]
fn dot_sdot_impl<Q: Quant>(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot::<Q, true>(n, w, a)
}

/// `sdot` dot product of format `Q`. Only for `super::dot`, which hands it out for the dotprod
/// and i8mm levels only (which `crate::isa` offers after detecting FEAT_DotProd).
pub(super) fn dot_sdot<Q: Quant>(n: usize, w: &[u8], a: &[u8]) -> f32 {
    // SAFETY: reached only through `crate::isa::simd_dot` at a level that requires FEAT_DotProd,
    // after `Isa::is_supported` found it on this CPU (see above).
    unsafe { dot_sdot_impl::<Q>(n, w, a) }
}

/// The `smmla` panel of format `Q`.
///
/// # Safety
/// [`crate::panel::PanelFn`]'s contract, with FEAT_DotProd and FEAT_I8MM on this CPU.
#[target_feature(enable = "dotprod,i8mm")]
pub(super) unsafe fn panel_i8mm<Q: Quant>(p: &Panel) {
    let nb = p.k / Q::N;
    let wb = nb * size_of::<Q::W>();
    let ab = nb * size_of::<Q::A>();
    // Called with r < p.rows and t < p.n only.
    let w_row = |r: usize| {
        // SAFETY: weight row r < rows, `wb` bytes at `w + r·w_stride`, is readable and not
        // written while the panel runs (outputs alias no input): the caller's contract.
        unsafe { std::slice::from_raw_parts(p.w.add(r * p.w_stride), wb) }
    };
    let a_row = |t: usize| {
        // SAFETY: activation row t < n, `ab` bytes at `a + t·a_stride`, likewise.
        unsafe { std::slice::from_raw_parts(p.a.add(t * p.a_stride), ab) }
    };
    let out = |t: usize, r: usize, v: f32| {
        // SAFETY: output (t, r), t < n and r < rows, is writable by the caller's contract.
        unsafe { *p.out.add(t * p.out_stride + r) = v }
    };
    // Both rows of a pair, unpacked: block b of row i at `q[i][N·b..]`.
    let mut q = [vec![0i8; Q::N * nb], vec![0i8; Q::N * nb]];
    let mut scratch = [0i8; 256];
    let mut r = 0;
    while r + 2 <= p.rows {
        let rows: [&[Q::W]; 2] = [
            blocks(w_row(r), nb, "weight row"),
            blocks(w_row(r + 1), nb, "weight row"),
        ];
        for (qi, row) in q.iter_mut().zip(rows) {
            for (b, x) in row.iter().enumerate() {
                Q::unpack(x, &mut scratch);
                qi[Q::N * b..Q::N * (b + 1)].copy_from_slice(&scratch[..Q::N]);
            }
        }
        let mut t = 0;
        while t + 2 <= p.n {
            let acts: [&[Q::A]; 2] = [
                blocks(a_row(t), nb, "activation row"),
                blocks(a_row(t + 1), nb, "activation row"),
            ];
            // [r·t, r·t+1, r+1·t, r+1·t+1], as `smmla` lays out its lanes.
            let mut sum = [0f32; 4];
            for b in 0..nb {
                let (q0, q1) = (&q[0][Q::N * b..], &q[1][Q::N * b..]);
                let (y0, y1) = (acts[0][b].quants(), acts[1][b].quants());
                let mut sums = [[0i32; 16]; 4];
                for s in 0..Q::N / Q::SUB {
                    let mut acc = vdupq_n_s32(0);
                    for c in (s * Q::SUB..(s + 1) * Q::SUB).step_by(8) {
                        let x = vcombine_s8(load8(q0, c), load8(q1, c));
                        let y = vcombine_s8(load8(y0, c), load8(y1, c));
                        acc = smmla(acc, x, y);
                    }
                    let mut lanes = [0i32; 4];
                    // SAFETY: `lanes` is 4 writable i32s.
                    unsafe { vst1q_s32(lanes.as_mut_ptr(), acc) };
                    for (k, lane) in lanes.into_iter().enumerate() {
                        sums[k][s] = lane;
                    }
                }
                for (k, sk) in sums.iter().enumerate() {
                    sum[k] += Q::finish(&rows[k / 2][b], &acts[k % 2][b], sk);
                }
            }
            for (k, v) in sum.into_iter().enumerate() {
                out(t + k % 2, r + k / 2, v);
            }
            t += 2;
        }
        if t < p.n {
            for i in 0..2 {
                out(t, r + i, dot::<Q, true>(p.k, w_row(r + i), a_row(t)));
            }
        }
        r += 2;
    }
    if r < p.rows {
        for t in 0..p.n {
            out(t, r, dot::<Q, true>(p.k, w_row(r), a_row(t)));
        }
    }
}
