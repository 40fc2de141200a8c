//! The ternary formats TQ1_0 and TQ2_0 (BitNet-style weights in {-1, 0, 1} times a block
//! scale): scalar dequantization bit-exact with ggml's `dequantize_row_tq*`, and dot products
//! against Q8_K through the integer superblocks of `crate::formats::iquants`.

use super::iquants::{Superblock, dot_superblocks};
use crate::blocks::*;

/// Powers of three: a byte times `3^n` (mod 256), times 3, over 256 is its n-th trit.
const POW3: [u8; 5] = [1, 3, 9, 27, 81];

/// The n-th trit of a TQ1_0 byte (ggml stores trits as a base-3 fraction of 256).
#[inline(always)]
pub fn trit(byte: u8, n: usize) -> i8 {
    let q = byte.wrapping_mul(POW3[n]);
    ((q as u16 * 3) >> 8) as i8
}

/// The 256 values `t - 1` of a TQ1_0 block, in ggml's element order: five rows of 32 from
/// `qs[0..32]`, five rows of 16 from `qs[32..48]`, four rows of 4 from `qh`.
pub fn decode_tq1_0(b: &BlockTq1_0) -> Superblock {
    let mut s = Superblock::new();
    s.scale = [1; 16];
    let mut i = 0;
    for n in 0..5 {
        for &q in &b.qs[..32] {
            s.w[i] = trit(q, n) - 1;
            i += 1;
        }
    }
    for n in 0..5 {
        for &q in &b.qs[32..48] {
            s.w[i] = trit(q, n) - 1;
            i += 1;
        }
    }
    for n in 0..4 {
        for &q in &b.qh {
            s.w[i] = trit(q, n) - 1;
            i += 1;
        }
    }
    s
}

/// The 256 values `q - 1` of a TQ2_0 block: per 32 bytes, four rows of 32 (bits 0-1, 2-3, …).
pub fn decode_tq2_0(b: &BlockTq2_0) -> Superblock {
    let mut s = Superblock::new();
    s.scale = [1; 16];
    for j in 0..2 {
        for l in 0..4 {
            for m in 0..32 {
                s.w[128 * j + 32 * l + m] = ((b.qs[32 * j + m] >> (2 * l)) & 3) as i8 - 1;
            }
        }
    }
    s
}

pub fn dequantize_tq1_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in bytemuck::cast_slice::<u8, BlockTq1_0>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_bytes(b.d);
        for (v, &w) in y.iter_mut().zip(&decode_tq1_0(b).w) {
            *v = w as f32 * d;
        }
    }
}

pub fn dequantize_tq2_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in bytemuck::cast_slice::<u8, BlockTq2_0>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_bytes(b.d);
        for (v, &w) in y.iter_mut().zip(&decode_tq2_0(b).w) {
            *v = w as f32 * d;
        }
    }
}

pub fn dot_tq1_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_superblocks(
        n,
        w,
        a,
        |b: &BlockTq1_0| (f16_bytes(b.d), decode_tq1_0(b)),
        false,
        1.0,
    )
}

pub fn dot_tq2_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    dot_superblocks(
        n,
        w,
        a,
        |b: &BlockTq2_0| (f16_bytes(b.d), decode_tq2_0(b)),
        false,
        1.0,
    )
}
