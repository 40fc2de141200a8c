//! Every quantized weight format as the NEON kernels see it: a block's quants unpacked to signed
//! bytes in element order (the order of the activation block they meet), the length of the
//! sub-blocks that share one integer scale, and how the block's value follows from the exact
//! integer sums of its sub-blocks. The value is computed with the scalar reference's float
//! operations in its order, so a NEON dot product gives the reference's bits, and a panel
//! (which finds the same integer sums another way) gives the dot product's.

// The loops index several arrays (blocks, sub-block sums, lanes) with one position variable,
// as the scalar reference they mirror does.
#![allow(clippy::needless_range_loop)]

use std::arch::aarch64::*;

use super::int8::{load16, load16u, store16};
use crate::blocks::*;

/// An activation block: its signed quants.
pub(super) trait ActBlock: bytemuck::Pod {
    fn quants(&self) -> &[i8];
}

impl ActBlock for BlockQ8_0 {
    #[inline(always)]
    fn quants(&self) -> &[i8] {
        &self.qs
    }
}

impl ActBlock for BlockQ8K {
    #[inline(always)]
    fn quants(&self) -> &[i8] {
        &self.qs
    }
}

/// One quantized weight format.
pub(super) trait Quant {
    type W: bytemuck::Pod;
    type A: ActBlock;
    /// Elements per block (32 or 256).
    const N: usize;
    /// Elements per sub-block sharing one integer scale: 16 or 32, dividing `N`.
    const SUB: usize;
    /// Writes the block's quants (scales not applied, offsets removed where the format has
    /// them) to `out[..N]`, each in -128..128.
    fn unpack(w: &Self::W, out: &mut [i8; 256]);
    /// The block's contribution to the dot product, given `sums[s]` = Σ of quant · activation
    /// over sub-block `s`, with the reference's float operations.
    fn finish(w: &Self::W, a: &Self::A, sums: &[i32; 16]) -> f32;
}

#[inline]
#[target_feature(enable = "neon")]
fn m4() -> uint8x16_t {
    vdupq_n_u8(0x0F)
}

/// Low and high nibbles of 16 packed bytes.
#[inline]
#[target_feature(enable = "neon")]
fn nibbles(qs: &[u8; 16]) -> (uint8x16_t, uint8x16_t) {
    let v = load16u(qs, 0);
    (vandq_u8(v, m4()), vshrq_n_u8::<4>(v))
}

/// `0x10` in byte j where bit j of the 16 bits `bits` is set.
#[inline]
#[target_feature(enable = "neon")]
fn fifth_bits(bits: u16) -> uint8x16_t {
    const BIT: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    let spread = vcombine_u8(vdup_n_u8(bits as u8), vdup_n_u8((bits >> 8) as u8));
    let set = vtstq_u8(spread, load16u(&BIT, 0));
    vandq_u8(set, vdupq_n_u8(0x10))
}

#[inline]
#[target_feature(enable = "neon")]
fn as_i8(v: uint8x16_t) -> int8x16_t {
    vreinterpretq_s8_u8(v)
}

/// Σ of the 32 activation quants of a Q8_0 block, exact.
#[inline]
#[target_feature(enable = "neon")]
fn q8_sum(a: &BlockQ8_0) -> i32 {
    vaddlvq_s8(load16(&a.qs, 0)) as i32 + vaddlvq_s8(load16(&a.qs, 16)) as i32
}

pub(super) struct Q4_0;
impl Quant for Q4_0 {
    type W = BlockQ4_0;
    type A = BlockQ8_0;
    const N: usize = 32;
    const SUB: usize = 32;
    #[inline(always)]
    fn unpack(w: &BlockQ4_0, out: &mut [i8; 256]) {
        // SAFETY: NEON, which every AArch64 target enables (checked in `super`).
        unsafe {
            let (lo, hi) = nibbles(&w.qs);
            let k8 = vdupq_n_s8(8);
            store16(out, 0, vsubq_s8(as_i8(lo), k8));
            store16(out, 16, vsubq_s8(as_i8(hi), k8));
        }
    }
    #[inline(always)]
    fn finish(w: &BlockQ4_0, a: &BlockQ8_0, sums: &[i32; 16]) -> f32 {
        sums[0] as f32 * (f16_bytes(w.d) * f16_bytes(a.d))
    }
}

pub(super) struct Q4_1;
impl Quant for Q4_1 {
    type W = BlockQ4_1;
    type A = BlockQ8_0;
    const N: usize = 32;
    const SUB: usize = 32;
    #[inline(always)]
    fn unpack(w: &BlockQ4_1, out: &mut [i8; 256]) {
        // SAFETY: NEON, which every AArch64 target enables (checked in `super`).
        unsafe {
            let (lo, hi) = nibbles(&w.qs);
            store16(out, 0, as_i8(lo));
            store16(out, 16, as_i8(hi));
        }
    }
    #[inline(always)]
    fn finish(w: &BlockQ4_1, a: &BlockQ8_0, sums: &[i32; 16]) -> f32 {
        let dy = f16_bytes(a.d);
        // SAFETY: NEON, which every AArch64 target enables (checked in `super`).
        let sum_y = unsafe { q8_sum(a) };
        sums[0] as f32 * (f16_bytes(w.d) * dy) + f16_bytes(w.m) * (sum_y as f32 * dy)
    }
}

/// Quants 0..32 of a Q5 block: nibbles plus 16 for each set bit of `qh`.
#[inline]
#[target_feature(enable = "neon")]
fn q5_quants(qh: [u8; 4], qs: &[u8; 16], out: &mut [i8; 256], offset: i8) {
    let qh = u32::from_le_bytes(qh);
    let (lo, hi) = nibbles(qs);
    let lo = vorrq_u8(lo, fifth_bits(qh as u16));
    let hi = vorrq_u8(hi, fifth_bits((qh >> 16) as u16));
    let k = vdupq_n_s8(offset);
    store16(out, 0, vsubq_s8(as_i8(lo), k));
    store16(out, 16, vsubq_s8(as_i8(hi), k));
}

pub(super) struct Q5_0;
impl Quant for Q5_0 {
    type W = BlockQ5_0;
    type A = BlockQ8_0;
    const N: usize = 32;
    const SUB: usize = 32;
    #[inline(always)]
    fn unpack(w: &BlockQ5_0, out: &mut [i8; 256]) {
        // SAFETY: NEON, which every AArch64 target enables (checked in `super`).
        unsafe {
            q5_quants(w.qh, &w.qs, out, 16);
        }
    }
    #[inline(always)]
    fn finish(w: &BlockQ5_0, a: &BlockQ8_0, sums: &[i32; 16]) -> f32 {
        sums[0] as f32 * (f16_bytes(w.d) * f16_bytes(a.d))
    }
}

pub(super) struct Q5_1;
impl Quant for Q5_1 {
    type W = BlockQ5_1;
    type A = BlockQ8_0;
    const N: usize = 32;
    const SUB: usize = 32;
    #[inline(always)]
    fn unpack(w: &BlockQ5_1, out: &mut [i8; 256]) {
        // SAFETY: NEON, which every AArch64 target enables (checked in `super`).
        unsafe {
            q5_quants(w.qh, &w.qs, out, 0);
        }
    }
    #[inline(always)]
    fn finish(w: &BlockQ5_1, a: &BlockQ8_0, sums: &[i32; 16]) -> f32 {
        let dy = f16_bytes(a.d);
        // SAFETY: NEON, which every AArch64 target enables (checked in `super`).
        let sum_y = unsafe { q8_sum(a) };
        sums[0] as f32 * (f16_bytes(w.d) * dy) + f16_bytes(w.m) * (sum_y as f32 * dy)
    }
}

pub(super) struct Q8_0;
impl Quant for Q8_0 {
    type W = BlockQ8_0;
    type A = BlockQ8_0;
    const N: usize = 32;
    const SUB: usize = 32;
    #[inline(always)]
    fn unpack(w: &BlockQ8_0, out: &mut [i8; 256]) {
        out[..32].copy_from_slice(&w.qs);
    }
    #[inline(always)]
    fn finish(w: &BlockQ8_0, a: &BlockQ8_0, sums: &[i32; 16]) -> f32 {
        sums[0] as f32 * (f16_bytes(w.d) * f16_bytes(a.d))
    }
}

pub(super) struct Mxfp4;
impl Quant for Mxfp4 {
    type W = BlockMxfp4;
    type A = BlockQ8_0;
    const N: usize = 32;
    const SUB: usize = 32;
    #[inline(always)]
    fn unpack(w: &BlockMxfp4, out: &mut [i8; 256]) {
        // SAFETY: NEON, which every AArch64 target enables (checked in `super`).
        unsafe {
            let table = load16(&KVALUES_MXFP4, 0);
            let (lo, hi) = nibbles(&w.qs);
            store16(out, 0, vqtbl1q_s8(table, lo));
            store16(out, 16, vqtbl1q_s8(table, hi));
        }
    }
    #[inline(always)]
    fn finish(w: &BlockMxfp4, a: &BlockQ8_0, sums: &[i32; 16]) -> f32 {
        f16_bytes(a.d) * e8m0_to_f32_half(w.e) * sums[0] as f32
    }
}

/// Shifts every byte right by `2·s` (s in 0..4) and keeps 2 bits.
#[inline]
#[target_feature(enable = "neon")]
fn crumbs(v: uint8x16_t, s: usize) -> uint8x16_t {
    vandq_u8(vshlq_u8(v, vdupq_n_s8(-2 * s as i8)), vdupq_n_u8(3))
}

pub(super) struct Q2K;
impl Quant for Q2K {
    type W = BlockQ2K;
    type A = BlockQ8K;
    const N: usize = 256;
    const SUB: usize = 16;
    #[inline(always)]
    fn unpack(w: &BlockQ2K, out: &mut [i8; 256]) {
        // SAFETY: NEON, which every AArch64 target enables (checked in `super`).
        unsafe {
            // Element 128h + 32s + 16p + l is bits 2s..2s+2 of qs[32h + 16p + l].
            for h in 0..2 {
                let q = [load16u(&w.qs, 32 * h), load16u(&w.qs, 32 * h + 16)];
                for s in 0..4 {
                    for (p, qp) in q.iter().enumerate() {
                        store16(out, 128 * h + 32 * s + 16 * p, as_i8(crumbs(*qp, s)));
                    }
                }
            }
        }
    }
    #[inline(always)]
    fn finish(w: &BlockQ2K, a: &BlockQ8K, sums: &[i32; 16]) -> f32 {
        let mut summs = 0i32;
        let mut isum = 0i32;
        for j in 0..16 {
            summs += (w.scales[j] >> 4) as i32 * a.bsum(j) as i32;
            isum += (w.scales[j] & 0xF) as i32 * sums[j];
        }
        let dall = a.d() * f16_bytes(w.d);
        let dmin = a.d() * f16_bytes(w.dmin);
        dall * isum as f32 - dmin * summs as f32
    }
}

pub(super) struct Q3K;
impl Quant for Q3K {
    type W = BlockQ3K;
    type A = BlockQ8K;
    const N: usize = 256;
    const SUB: usize = 16;
    #[inline(always)]
    fn unpack(w: &BlockQ3K, out: &mut [i8; 256]) {
        // SAFETY: NEON, which every AArch64 target enables (checked in `super`).
        unsafe {
            // Element 128h + 32s + 16p + l: bits 2s..2s+2 of qs[32h + 16p + l], minus 4 unless bit
            // 4h + s of hmask[16p + l] is set.
            let hm = [load16u(&w.hmask, 0), load16u(&w.hmask, 16)];
            let k4 = vdupq_n_u8(4);
            for h in 0..2 {
                let q = [load16u(&w.qs, 32 * h), load16u(&w.qs, 32 * h + 16)];
                for s in 0..4 {
                    let bit = vdupq_n_u8(1 << (4 * h + s));
                    for p in 0..2 {
                        let lo = crumbs(q[p], s);
                        let minus = vbicq_u8(k4, vtstq_u8(hm[p], bit));
                        store16(
                            out,
                            128 * h + 32 * s + 16 * p,
                            vsubq_s8(as_i8(lo), as_i8(minus)),
                        );
                    }
                }
            }
        }
    }
    #[inline(always)]
    fn finish(w: &BlockQ3K, a: &BlockQ8K, sums: &[i32; 16]) -> f32 {
        let scales = q3k_scales(&w.scales);
        let mut isum = 0i32;
        for j in 0..16 {
            isum += (scales[j] as i32 - 32) * sums[j];
        }
        f16_bytes(w.d) * a.d() * isum as f32
    }
}

/// Q4_K and Q5_K: `isum = Σ sc·t` over the 8 groups of 32, mins against the activation sums.
#[inline(always)]
fn finish_k4(d: [u8; 2], dmin: [u8; 2], scales: &[u8; 12], a: &BlockQ8K, sums: &[i32; 16]) -> f32 {
    let mut isum = 0i32;
    let mut summin = 0i32;
    for g in 0..8 {
        let (sc, m) = scale_min_k4(g, scales);
        isum += sc as i32 * sums[g];
        summin += m as i32 * (a.bsum(2 * g) as i32 + a.bsum(2 * g + 1) as i32);
    }
    a.d() * f16_bytes(d) * isum as f32 - a.d() * f16_bytes(dmin) * summin as f32
}

pub(super) struct Q4K;
impl Quant for Q4K {
    type W = BlockQ4K;
    type A = BlockQ8K;
    const N: usize = 256;
    const SUB: usize = 32;
    #[inline(always)]
    fn unpack(w: &BlockQ4K, out: &mut [i8; 256]) {
        // SAFETY: NEON, which every AArch64 target enables (checked in `super`).
        unsafe {
            // Group g: elements 64g..64g+32 are the low nibbles of qs[32g..32g+32], the next 32
            // the high nibbles.
            for g in 0..4 {
                for half in 0..2 {
                    let v = load16u(&w.qs, 32 * g + 16 * half);
                    store16(out, 64 * g + 16 * half, as_i8(vandq_u8(v, m4())));
                    store16(out, 64 * g + 32 + 16 * half, as_i8(vshrq_n_u8::<4>(v)));
                }
            }
        }
    }
    #[inline(always)]
    fn finish(w: &BlockQ4K, a: &BlockQ8K, sums: &[i32; 16]) -> f32 {
        finish_k4(w.d, w.dmin, &w.scales, a, sums)
    }
}

pub(super) struct Q5K;
impl Quant for Q5K {
    type W = BlockQ5K;
    type A = BlockQ8K;
    const N: usize = 256;
    const SUB: usize = 32;
    #[inline(always)]
    fn unpack(w: &BlockQ5K, out: &mut [i8; 256]) {
        // SAFETY: NEON, which every AArch64 target enables (checked in `super`).
        unsafe {
            // As Q4_K, plus 16 where bit 2g (low nibbles) or 2g+1 (high) of qh[l] is set.
            let qh = [load16u(&w.qh, 0), load16u(&w.qh, 16)];
            let k16 = vdupq_n_u8(16);
            for g in 0..4 {
                let (u1, u2) = (vdupq_n_u8(1 << (2 * g)), vdupq_n_u8(2 << (2 * g)));
                for half in 0..2 {
                    let v = load16u(&w.qs, 32 * g + 16 * half);
                    let h1 = vandq_u8(vtstq_u8(qh[half], u1), k16);
                    let h2 = vandq_u8(vtstq_u8(qh[half], u2), k16);
                    let lo = vorrq_u8(vandq_u8(v, m4()), h1);
                    let hi = vorrq_u8(vshrq_n_u8::<4>(v), h2);
                    store16(out, 64 * g + 16 * half, as_i8(lo));
                    store16(out, 64 * g + 32 + 16 * half, as_i8(hi));
                }
            }
        }
    }
    #[inline(always)]
    fn finish(w: &BlockQ5K, a: &BlockQ8K, sums: &[i32; 16]) -> f32 {
        finish_k4(w.d, w.dmin, &w.scales, a, sums)
    }
}

pub(super) struct Q6K;
impl Quant for Q6K {
    type W = BlockQ6K;
    type A = BlockQ8K;
    const N: usize = 256;
    const SUB: usize = 16;
    #[inline(always)]
    fn unpack(w: &BlockQ6K, out: &mut [i8; 256]) {
        // SAFETY: NEON, which every AArch64 target enables (checked in `super`).
        unsafe {
            // Half h, l in 0..32: element 128h + 32k + l is a nibble of ql (low for k = 0, 1, high
            // for k = 2, 3; of byte l for even k, l + 32 for odd) with bits 2k..2k+2 of qh[l] above
            // it, minus 32.
            let k32 = vdupq_n_s8(32);
            let m3 = vdupq_n_u8(3);
            for h in 0..2 {
                for c in 0..2 {
                    let l = 16 * c;
                    let ql0 = load16u(&w.ql, 64 * h + l);
                    let ql1 = load16u(&w.ql, 64 * h + l + 32);
                    let qh = load16u(&w.qh, 32 * h + l);
                    let hi =
                        |k: i8| vshlq_n_u8::<4>(vandq_u8(vshlq_u8(qh, vdupq_n_s8(-2 * k)), m3));
                    let v = [
                        vorrq_u8(vandq_u8(ql0, m4()), hi(0)),
                        vorrq_u8(vandq_u8(ql1, m4()), hi(1)),
                        vorrq_u8(vshrq_n_u8::<4>(ql0), hi(2)),
                        vorrq_u8(vshrq_n_u8::<4>(ql1), hi(3)),
                    ];
                    for (k, vk) in v.iter().enumerate() {
                        store16(out, 128 * h + 32 * k + l, vsubq_s8(as_i8(*vk), k32));
                    }
                }
            }
        }
    }
    #[inline(always)]
    fn finish(w: &BlockQ6K, a: &BlockQ8K, sums: &[i32; 16]) -> f32 {
        let mut isum = 0i32;
        for j in 0..16 {
            isum += w.scales[j] as i32 * sums[j];
        }
        f16_bytes(w.d) * a.d() * isum as f32
    }
}

pub(super) struct Q8K;
impl Quant for Q8K {
    type W = BlockQ8K;
    type A = BlockQ8K;
    const N: usize = 256;
    const SUB: usize = 32;
    #[inline(always)]
    fn unpack(w: &BlockQ8K, out: &mut [i8; 256]) {
        out.copy_from_slice(&w.qs);
    }
    #[inline(always)]
    fn finish(w: &BlockQ8K, a: &BlockQ8K, sums: &[i32; 16]) -> f32 {
        let isum: i32 = sums[..8].iter().sum();
        w.d() * a.d() * isum as f32
    }
}
