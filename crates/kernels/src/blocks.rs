//! Byte layouts of the ggml block formats (`block_*` in ggml-common.h).
//!
//! Every field is stored as bytes so each block has alignment 1: tensor data in a GGUF map is only
//! guaranteed to be 32-byte aligned at the start of a tensor, and block sizes like 18 or 17 bytes
//! leave later blocks at odd addresses. Accessors decode the little-endian scalars.

use bytemuck::{Pod, Zeroable};
use half::{bf16, f16};

pub const QK4_0: usize = 32;
pub const QK4_1: usize = 32;
pub const QK5_0: usize = 32;
pub const QK5_1: usize = 32;
pub const QK8_0: usize = 32;
pub const QK_MXFP4: usize = 32;
pub use gguf::QK_K;

#[inline(always)]
pub fn f16_bytes(b: [u8; 2]) -> f32 {
    f16::from_bits(u16::from_le_bytes(b)).to_f32()
}

#[inline(always)]
pub fn f16_to_bytes(v: f32) -> [u8; 2] {
    // `half` rounds to nearest even, as ggml's GGML_FP32_TO_FP16 does.
    f16::from_f32(v).to_bits().to_le_bytes()
}

#[inline(always)]
pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    bf16::from_bits(bits).to_f32()
}

/// ggml's `ggml_compute_fp32_to_bf16`: round to nearest even, NaN forced quiet.
#[inline(always)]
pub fn f32_to_bf16_bits(v: f32) -> u16 {
    let u = v.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    ((u.wrapping_add(0x7fff + ((u >> 16) & 1))) >> 16) as u16
}

/// `ggml_e8m0_to_fp32_half`: 2^(e-128), i.e. half the E8M0 scale, because the E2M1 table below
/// stores doubled values so that it is integral.
#[inline(always)]
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits: u32 = if e < 2 {
        0x0020_0000 << e
    } else {
        ((e as u32) - 1) << 23
    };
    f32::from_bits(bits)
}

/// E2M1 values, doubled (ggml `kvalues_mxfp4`).
pub const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

macro_rules! block {
    ($(#[$m:meta])* $name:ident { $($field:ident : $ty:ty),* $(,)? } = $size:expr) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Clone, Copy, Pod, Zeroable, Debug)]
        pub struct $name { $(pub $field: $ty),* }
        const _: () = assert!(std::mem::size_of::<$name>() == $size);
        const _: () = assert!(std::mem::align_of::<$name>() == 1);
    };
}

block!(
    /// 32 weights: `(q - 8) * d`.
    BlockQ4_0 { d: [u8; 2], qs: [u8; 16] } = 18
);
block!(
    /// 32 weights: `q * d + m`.
    BlockQ4_1 { d: [u8; 2], m: [u8; 2], qs: [u8; 16] } = 20
);
block!(
    /// 32 weights: `(q5 - 16) * d`, fifth bits in `qh`.
    BlockQ5_0 { d: [u8; 2], qh: [u8; 4], qs: [u8; 16] } = 22
);
block!(
    /// 32 weights: `q5 * d + m`.
    BlockQ5_1 { d: [u8; 2], m: [u8; 2], qh: [u8; 4], qs: [u8; 16] } = 24
);
block!(
    /// 32 values: `q * d`. Also the activation format paired with the legacy formats.
    BlockQ8_0 { d: [u8; 2], qs: [i8; 32] } = 34
);
block!(
    /// 256 weights in 16 groups of 16 with 4-bit scale and min: `d*sc*q - dmin*m`.
    BlockQ2K { scales: [u8; 16], qs: [u8; 64], d: [u8; 2], dmin: [u8; 2] } = 84
);
block!(
    /// 256 weights, 3 bits (2 in `qs`, 1 in `hmask`), 16 groups with 6-bit signed scales.
    BlockQ3K { hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: [u8; 2] } = 110
);
block!(
    /// 256 weights in 8 groups of 32 with 6-bit scale and min.
    BlockQ4K { d: [u8; 2], dmin: [u8; 2], scales: [u8; 12], qs: [u8; 128] } = 144
);
block!(
    /// 256 weights, 5 bits (4 in `qs`, 1 in `qh`), 8 groups of 32 with 6-bit scale and min.
    BlockQ5K { d: [u8; 2], dmin: [u8; 2], scales: [u8; 12], qh: [u8; 32], qs: [u8; 128] } = 176
);
block!(
    /// 256 weights, 6 bits (4 in `ql`, 2 in `qh`), 16 groups with 8-bit signed scales.
    BlockQ6K { ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: [u8; 2] } = 210
);
block!(
    /// 256 values with an f32 scale and sums of each 16: the activation format of the K-quants.
    BlockQ8K { d: [u8; 4], qs: [i8; 256], bsums: [u8; 32] } = 292
);
block!(
    /// 32 weights: E2M1 nibbles with a shared E8M0 exponent (gpt-oss).
    BlockMxfp4 { e: u8, qs: [u8; 16] } = 17
);

block!(
    /// 32 weights: `d * kvalues_iq4nl[q]`, nibbles as in Q4_0.
    BlockIq4Nl { d: [u8; 2], qs: [u8; 16] } = 18
);
block!(
    /// 256 weights in 8 groups of 32 with 6-bit scales (`ls - 32`, low 4 bits in `scales_l`,
    /// high 2 in `scales_h`), the IQ4_NL levels.
    BlockIq4Xs { d: [u8; 2], scales_h: [u8; 2], scales_l: [u8; 4], qs: [u8; 128] } = 136
);
block!(
    /// 256 weights in 8 groups of 32; each group's 8 bytes: 4 grid indices, then 4×7 sign bits
    /// and a 4-bit scale (a little-endian u32).
    BlockIq2Xxs { d: [u8; 2], qs: [u8; 64] } = 66
);
block!(
    /// 256 weights: 32 u16 of 9-bit grid index and 7 sign bits, two 4-bit scales per 32.
    BlockIq2Xs { d: [u8; 2], qs: [u8; 64], scales: [u8; 8] } = 74
);
block!(
    /// 256 weights: 32 low grid-index bytes then 32 sign bytes in `qs`, 2 high bits per index
    /// in `qh`, two 4-bit scales per 32.
    BlockIq2S { d: [u8; 2], qs: [u8; 64], qh: [u8; 8], scales: [u8; 8] } = 82
);
block!(
    /// 256 weights: 64 grid indices (4 elements each), then per group of 32 a u32 of 4×7 sign
    /// bits and a 4-bit scale.
    BlockIq3Xxs { d: [u8; 2], qs: [u8; 96] } = 98
);
block!(
    /// 256 weights: 64 low grid-index bytes, their ninth bits in `qh`, 8 sign bits per 8
    /// elements, a 4-bit scale per 32.
    BlockIq3S { d: [u8; 2], qs: [u8; 64], qh: [u8; 8], signs: [u8; 32], scales: [u8; 4] } = 110
);
block!(
    /// 256 weights: 32 low grid-index bytes; per 32 a u16 of 4×3 high index bits, a 3-bit
    /// scale and the sign of the ±1/8 shift.
    BlockIq1S { d: [u8; 2], qs: [u8; 32], qh: [u8; 16] } = 50
);
block!(
    /// 256 weights: 32 low grid-index bytes, per 8 elements 3 high bits and a shift sign in
    /// `qh`, 3-bit scales per 16 in `scales`, whose top nibbles hold the f16 block scale.
    BlockIq1M { qs: [u8; 32], qh: [u8; 16], scales: [u8; 8] } = 56
);
block!(
    /// 256 ternary weights `(t - 1) * d`: 5 trits per byte in `qs` (240 weights, base 3 as a
    /// fraction of 256), 4 per byte in `qh`.
    BlockTq1_0 { qs: [u8; 48], qh: [u8; 4], d: [u8; 2] } = 54
);
block!(
    /// 256 weights `(q - 1) * d`, 2 bits each.
    BlockTq2_0 { qs: [u8; 64], d: [u8; 2] } = 66
);

impl BlockQ8K {
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f32::from_le_bytes(self.d)
    }
    #[inline(always)]
    pub fn bsum(&self, j: usize) -> i16 {
        i16::from_le_bytes([self.bsums[2 * j], self.bsums[2 * j + 1]])
    }
}

/// Decodes the 6-bit scale and min of group `j` (0..8) of a Q4_K/Q5_K block
/// (ggml `get_scale_min_k4`).
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Unpacks the twelve scale bytes of a Q4_K/Q5_K block into 8 scales then 8 mins (16 bytes).
#[inline(always)]
pub fn unpack_scales_mins_k4(raw: &[u8; 12]) -> [u32; 4] {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let mut u = [
        u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]),
        u32::from_le_bytes([raw[4], raw[5], raw[6], raw[7]]),
        u32::from_le_bytes([raw[8], raw[9], raw[10], raw[11]]),
        0,
    ];
    u[3] = ((u[2] >> 4) & KMASK2) | (((u[1] >> 6) & KMASK3) << 4);
    let uaux = u[1] & KMASK1;
    u[1] = (u[2] & KMASK2) | (((u[0] >> 6) & KMASK3) << 4);
    u[2] = uaux;
    u[0] &= KMASK1;
    u
}

/// Decodes the sixteen 6-bit scales of a Q3_K block, still biased by 32.
#[inline(always)]
pub fn q3k_scales(raw: &[u8; 12]) -> [i8; 16] {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let a0 = u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]);
    let a1 = u32::from_le_bytes([raw[4], raw[5], raw[6], raw[7]]);
    let tmp = u32::from_le_bytes([raw[8], raw[9], raw[10], raw[11]]);
    let s2 = ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4);
    let s3 = ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4);
    let s0 = (a0 & KMASK2) | ((tmp & KMASK1) << 4);
    let s1 = (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4);
    let mut out = [0i8; 16];
    for (i, w) in [s0, s1, s2, s3].iter().enumerate() {
        for (b, byte) in w.to_le_bytes().iter().enumerate() {
            out[4 * i + b] = *byte as i8;
        }
    }
    out
}

/// Byte offsets of the f16 scale fields (`d`, and `m`/`dmin` where present) within one block of
/// `t`; every dequantized value is linear in them. Empty for unscaled or non-f16-scaled types.
pub fn f16_scale_fields(t: gguf::GgmlType) -> &'static [usize] {
    use gguf::GgmlType as T;
    match t {
        T::Q4_0 | T::Q5_0 | T::Q8_0 => &[0],
        T::Q4_1 | T::Q5_1 => &[0, 2],
        T::Q2K => &[80, 82],
        T::Q3K => &[108],
        T::Q4K | T::Q5K => &[0, 2],
        T::Q6K => &[208],
        // IQ1_M has no f16 field: its scale is spread over four scale words.
        T::Iq4Nl | T::Iq4Xs | T::Iq2Xxs | T::Iq2Xs | T::Iq2S | T::Iq3Xxs | T::Iq3S | T::Iq1S => {
            &[0]
        }
        T::Tq1_0 => &[52],
        T::Tq2_0 => &[64],
        _ => &[],
    }
}

/// Multiplies every value of a row of `t` by `factor`, a power of two, by scaling the block
/// scales (exact unless a scale overflows f16). `None` for types without such scales.
pub fn scale_row_pow2(t: gguf::GgmlType, row: &mut [u8], factor: f32) -> Option<()> {
    use gguf::GgmlType as T;
    match t {
        T::F32 => {
            for c in row.chunks_exact_mut(4) {
                let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * factor;
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        T::F16 => {
            for c in row.chunks_exact_mut(2) {
                c.copy_from_slice(&f16_to_bytes(f16_bytes([c[0], c[1]]) * factor));
            }
        }
        _ => {
            let fields = f16_scale_fields(t);
            if fields.is_empty() {
                return None;
            }
            for block in row.chunks_exact_mut(t.type_size()) {
                for &o in fields {
                    let v = f16_bytes([block[o], block[o + 1]]) * factor;
                    block[o..o + 2].copy_from_slice(&f16_to_bytes(v));
                }
            }
        }
    }
    Some(())
}
