//! The IQ formats (IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M):
//! scalar dequantization (bit-exact with ggml's `dequantize_row_iq*`, including its operation
//! order) and scalar dot products against the activation form ggml pairs them with (Q8_0 for
//! IQ4_NL, Q8_K for the rest).
//!
//! Every 256-element format is first decoded into signed integer weights with one integer scale
//! per 16 elements ([`Superblock`]); the dot product of a superblock is then one exact integer,
//! multiplied once by `d·dy` (and the format's constant factor at the end, as ggml does). The
//! SIMD kernels compute the same integer and the same float steps, so they give these bits.

use super::iq_grids::*;
use crate::blocks::*;

#[inline(always)]
fn blocks<T: bytemuck::Pod>(bytes: &[u8]) -> &[T] {
    bytemuck::cast_slice(bytes)
}

/// The eight ±1 factors of a sign byte (bit j set: element j negative).
#[inline(always)]
fn sign_of(signs: u8, j: usize) -> i8 {
    if signs & (1 << j) != 0 { -1 } else { 1 }
}

#[inline(always)]
fn grid_byte(entry: u64, j: usize) -> u8 {
    (entry >> (8 * j)) as u8
}

/// One 256-element block decoded to integers: `value_i = scale[i / 16] · w_i` (before the
/// block's float scale), and for IQ1_S/IQ1_M the sign of the ±1/8 shift of each 8 elements.
pub struct Superblock {
    pub w: [i8; QK_K],
    pub scale: [i32; 16],
    pub shift: [i8; 32],
}

impl Superblock {
    pub(crate) fn new() -> Superblock {
        Superblock {
            w: [0; QK_K],
            scale: [0; 16],
            shift: [0; 32],
        }
    }

    /// `Σ_k scale_k · Σ w·a` over the block's 16-element groups, and (when `shifted`)
    /// `Σ_k scale_k · Σ shift·a`.
    #[inline(always)]
    fn dot(&self, a: &[i8; QK_K], shifted: bool) -> (i32, i32) {
        let (mut sum, mut shift_sum) = (0i32, 0i32);
        let groups = self.w.chunks_exact(16).zip(a.chunks_exact(16));
        for (k, (w16, a16)) in groups.enumerate() {
            let s: i32 = w16
                .iter()
                .zip(a16)
                .map(|(&w, &a)| w as i32 * a as i32)
                .sum();
            sum += self.scale[k] * s;
            if shifted {
                let h: i32 = a16
                    .chunks_exact(8)
                    .zip(&self.shift[2 * k..2 * k + 2])
                    .map(|(a8, &sh)| sh as i32 * a8.iter().map(|&v| v as i32).sum::<i32>())
                    .sum();
                shift_sum += self.scale[k] * h;
            }
        }
        (sum, shift_sum)
    }
}

/// 8 grid magnitudes with their signs into `w[8l..8l + 8]`.
#[inline(always)]
fn put8(w: &mut [i8], l: usize, entry: u64, signs: u8) {
    for j in 0..8 {
        w[8 * l + j] = grid_byte(entry, j) as i8 * sign_of(signs, j);
    }
}

/// The sign byte of a 7-bit index (ggml's `ksigns_iq2xs`: the eighth sign keeps the count of
/// negatives even).
#[inline(always)]
fn ksigns(bits: u32) -> u8 {
    KSIGNS_IQ2XS[(bits & 127) as usize]
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}

// ---------------------------------------------------------------------------------------------
// IQ4_NL, IQ4_XS: 4-bit indices into 16 non-linear levels.

pub fn dequantize_iq4_nl(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BlockIq4Nl>(src)
        .iter()
        .zip(dst.chunks_exact_mut(32))
    {
        let d = f16_bytes(b.d);
        for j in 0..16 {
            y[j] = d * KVALUES_IQ4NL[(b.qs[j] & 0xF) as usize] as f32;
            y[j + 16] = d * KVALUES_IQ4NL[(b.qs[j] >> 4) as usize] as f32;
        }
    }
}

pub fn dot_iq4_nl(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (w, a) = (blocks::<BlockIq4Nl>(w), blocks::<BlockQ8_0>(a));
    let mut sum = 0.0f32;
    for (x, y) in w.iter().zip(a).take(n / 32) {
        let mut isum = 0i32;
        for j in 0..16 {
            isum += KVALUES_IQ4NL[(x.qs[j] & 0xF) as usize] as i32 * y.qs[j] as i32;
            isum += KVALUES_IQ4NL[(x.qs[j] >> 4) as usize] as i32 * y.qs[j + 16] as i32;
        }
        sum += f16_bytes(x.d) * f16_bytes(y.d) * isum as f32;
    }
    sum
}

/// The 6-bit scale of group `ib` (0..8) of an IQ4_XS block, with its bias of 32 removed.
#[inline(always)]
fn iq4xs_scale(b: &BlockIq4Xs, ib: usize) -> i32 {
    let lo = (b.scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF;
    let hi = (u16::from_le_bytes(b.scales_h) >> (2 * ib)) & 3;
    (lo as i32 | (hi as i32) << 4) - 32
}

pub fn decode_iq4_xs(b: &BlockIq4Xs) -> Superblock {
    let mut s = Superblock::new();
    for ib in 0..8 {
        let ls = iq4xs_scale(b, ib);
        s.scale[2 * ib] = ls;
        s.scale[2 * ib + 1] = ls;
        for j in 0..16 {
            let q = b.qs[16 * ib + j];
            s.w[32 * ib + j] = KVALUES_IQ4NL[(q & 0xF) as usize];
            s.w[32 * ib + j + 16] = KVALUES_IQ4NL[(q >> 4) as usize];
        }
    }
    s
}

pub fn dequantize_iq4_xs(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BlockIq4Xs>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_bytes(b.d);
        for ib in 0..8 {
            let dl = d * iq4xs_scale(b, ib) as f32;
            for j in 0..16 {
                let q = b.qs[16 * ib + j];
                y[32 * ib + j] = dl * KVALUES_IQ4NL[(q & 0xF) as usize] as f32;
                y[32 * ib + j + 16] = dl * KVALUES_IQ4NL[(q >> 4) as usize] as f32;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// IQ2_XXS, IQ2_XS, IQ2_S: groups of 8 magnitudes from a grid, with sign bits.

pub fn decode_iq2_xxs(b: &BlockIq2Xxs) -> Superblock {
    let mut s = Superblock::new();
    for ib in 0..8 {
        let (idx, aux) = (u32_at(&b.qs, 8 * ib), u32_at(&b.qs, 8 * ib + 4));
        let ls = 2 * (aux >> 28) as i32 + 1;
        s.scale[2 * ib] = ls;
        s.scale[2 * ib + 1] = ls;
        for l in 0..4 {
            let entry = IQ2XXS_GRID[((idx >> (8 * l)) & 0xFF) as usize];
            put8(&mut s.w[32 * ib..], l, entry, ksigns(aux >> (7 * l)));
        }
    }
    s
}

pub fn dequantize_iq2_xxs(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BlockIq2Xxs>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_bytes(b.d);
        for ib in 0..8 {
            let (idx, aux) = (u32_at(&b.qs, 8 * ib), u32_at(&b.qs, 8 * ib + 4));
            let db = d * (0.5 + (aux >> 28) as f32) * 0.25;
            for l in 0..4 {
                let entry = IQ2XXS_GRID[((idx >> (8 * l)) & 0xFF) as usize];
                let signs = ksigns(aux >> (7 * l));
                for j in 0..8 {
                    y[32 * ib + 8 * l + j] =
                        db * grid_byte(entry, j) as f32 * sign_of(signs, j) as f32;
                }
            }
        }
    }
}

pub fn decode_iq2_xs(b: &BlockIq2Xs) -> Superblock {
    let mut s = Superblock::new();
    for ib in 0..8 {
        s.scale[2 * ib] = 2 * (b.scales[ib] & 0xF) as i32 + 1;
        s.scale[2 * ib + 1] = 2 * (b.scales[ib] >> 4) as i32 + 1;
        for l in 0..4 {
            let q = u16_at(&b.qs, 2 * (4 * ib + l));
            let entry = IQ2XS_GRID[(q & 511) as usize];
            put8(&mut s.w[32 * ib..], l, entry, ksigns((q >> 9) as u32));
        }
    }
    s
}

pub fn dequantize_iq2_xs(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BlockIq2Xs>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_bytes(b.d);
        for ib in 0..8 {
            let db = [
                d * (0.5 + (b.scales[ib] & 0xF) as f32) * 0.25,
                d * (0.5 + (b.scales[ib] >> 4) as f32) * 0.25,
            ];
            for l in 0..4 {
                let q = u16_at(&b.qs, 2 * (4 * ib + l));
                let entry = IQ2XS_GRID[(q & 511) as usize];
                let signs = ksigns((q >> 9) as u32);
                for j in 0..8 {
                    y[32 * ib + 8 * l + j] =
                        db[l / 2] * grid_byte(entry, j) as f32 * sign_of(signs, j) as f32;
                }
            }
        }
    }
}

/// The 10-bit grid index of 8-element group `l` (0..4) of group `ib` of an IQ2_S block.
#[inline(always)]
fn iq2s_index(b: &BlockIq2S, ib: usize, l: usize) -> usize {
    b.qs[4 * ib + l] as usize | (((b.qh[ib] as usize) << (8 - 2 * l)) & 0x300)
}

pub fn decode_iq2_s(b: &BlockIq2S) -> Superblock {
    let mut s = Superblock::new();
    for ib in 0..8 {
        s.scale[2 * ib] = 2 * (b.scales[ib] & 0xF) as i32 + 1;
        s.scale[2 * ib + 1] = 2 * (b.scales[ib] >> 4) as i32 + 1;
        for l in 0..4 {
            let entry = IQ2S_GRID[iq2s_index(b, ib, l)];
            put8(&mut s.w[32 * ib..], l, entry, b.qs[32 + 4 * ib + l]);
        }
    }
    s
}

pub fn dequantize_iq2_s(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BlockIq2S>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_bytes(b.d);
        for ib in 0..8 {
            let db = [
                d * (0.5 + (b.scales[ib] & 0xF) as f32) * 0.25,
                d * (0.5 + (b.scales[ib] >> 4) as f32) * 0.25,
            ];
            for l in 0..4 {
                let entry = IQ2S_GRID[iq2s_index(b, ib, l)];
                let signs = b.qs[32 + 4 * ib + l];
                for j in 0..8 {
                    y[32 * ib + 8 * l + j] =
                        db[l / 2] * grid_byte(entry, j) as f32 * sign_of(signs, j) as f32;
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// IQ3_XXS, IQ3_S: groups of 4 magnitudes from a grid, with sign bits per 8.

pub fn decode_iq3_xxs(b: &BlockIq3Xxs) -> Superblock {
    let mut s = Superblock::new();
    for ib in 0..8 {
        let aux = u32_at(&b.qs, 64 + 4 * ib);
        let ls = 2 * (aux >> 28) as i32 + 1;
        s.scale[2 * ib] = ls;
        s.scale[2 * ib + 1] = ls;
        for l in 0..4 {
            let g1 = IQ3XXS_GRID[b.qs[8 * ib + 2 * l] as usize] as u64;
            let g2 = IQ3XXS_GRID[b.qs[8 * ib + 2 * l + 1] as usize] as u64;
            put8(
                &mut s.w[32 * ib..],
                l,
                g1 | g2 << 32,
                ksigns(aux >> (7 * l)),
            );
        }
    }
    s
}

pub fn dequantize_iq3_xxs(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BlockIq3Xxs>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_bytes(b.d);
        for ib in 0..8 {
            let aux = u32_at(&b.qs, 64 + 4 * ib);
            let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
            for l in 0..4 {
                let g1 = IQ3XXS_GRID[b.qs[8 * ib + 2 * l] as usize] as u64;
                let g2 = IQ3XXS_GRID[b.qs[8 * ib + 2 * l + 1] as usize] as u64;
                let (entry, signs) = (g1 | g2 << 32, ksigns(aux >> (7 * l)));
                for j in 0..8 {
                    y[32 * ib + 8 * l + j] =
                        db * grid_byte(entry, j) as f32 * sign_of(signs, j) as f32;
                }
            }
        }
    }
}

/// The 8 magnitudes of 8-element group `l` (0..4) of group `ib` of an IQ3_S block.
#[inline(always)]
fn iq3s_entry(b: &BlockIq3S, ib: usize, l: usize) -> u64 {
    let qh = b.qh[ib] as usize;
    let i1 = b.qs[8 * ib + 2 * l] as usize | ((qh << (8 - 2 * l)) & 256);
    let i2 = b.qs[8 * ib + 2 * l + 1] as usize | ((qh << (7 - 2 * l)) & 256);
    IQ3S_GRID[i1] as u64 | (IQ3S_GRID[i2] as u64) << 32
}

pub fn decode_iq3_s(b: &BlockIq3S) -> Superblock {
    let mut s = Superblock::new();
    for ib in 0..8 {
        let ls = 2 * ((b.scales[ib / 2] >> (4 * (ib % 2))) & 0xF) as i32 + 1;
        s.scale[2 * ib] = ls;
        s.scale[2 * ib + 1] = ls;
        for l in 0..4 {
            put8(
                &mut s.w[32 * ib..],
                l,
                iq3s_entry(b, ib, l),
                b.signs[4 * ib + l],
            );
        }
    }
    s
}

pub fn dequantize_iq3_s(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BlockIq3S>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_bytes(b.d);
        for ib in 0..8 {
            // ggml converts the odd integer `1 + 2·scale` to float, then multiplies.
            let db = d * (1 + 2 * ((b.scales[ib / 2] >> (4 * (ib % 2))) & 0xF) as i32) as f32;
            for l in 0..4 {
                let (entry, signs) = (iq3s_entry(b, ib, l), b.signs[4 * ib + l]);
                for j in 0..8 {
                    y[32 * ib + 8 * l + j] =
                        db * grid_byte(entry, j) as f32 * sign_of(signs, j) as f32;
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// IQ1_S, IQ1_M: groups of 8 values in {-1, 0, 1} from a grid, shifted by ±1/8.

/// The shift ggml adds to every IQ1 grid value (`IQ1S_DELTA`, `IQ1M_DELTA`).
const IQ1_DELTA: f32 = 0.125;

pub fn decode_iq1_s(b: &BlockIq1S) -> Superblock {
    let mut s = Superblock::new();
    for ib in 0..8 {
        let qh = u16_at(&b.qh, 2 * ib);
        let ls = 2 * ((qh >> 12) & 7) as i32 + 1;
        s.scale[2 * ib] = ls;
        s.scale[2 * ib + 1] = ls;
        let shift = if qh & 0x8000 != 0 { -1 } else { 1 };
        for l in 0..4 {
            let idx = b.qs[4 * ib + l] as usize | ((((qh >> (3 * l)) & 7) as usize) << 8);
            put8(&mut s.w[32 * ib..], l, IQ1S_GRID[idx], 0);
            s.shift[4 * ib + l] = shift;
        }
    }
    s
}

pub fn dequantize_iq1_s(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BlockIq1S>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_bytes(b.d);
        for ib in 0..8 {
            let qh = u16_at(&b.qh, 2 * ib);
            let dl = d * (2 * ((qh >> 12) & 7) as i32 + 1) as f32;
            let delta = if qh & 0x8000 != 0 {
                -IQ1_DELTA
            } else {
                IQ1_DELTA
            };
            for l in 0..4 {
                let idx = b.qs[4 * ib + l] as usize | ((((qh >> (3 * l)) & 7) as usize) << 8);
                let entry = IQ1S_GRID[idx];
                for j in 0..8 {
                    y[32 * ib + 8 * l + j] = dl * (grid_byte(entry, j) as i8 as f32 + delta);
                }
            }
        }
    }
}

/// The f16 block scale of an IQ1_M block, spread over the top nibbles of its scale words.
#[inline(always)]
pub fn iq1m_d(b: &BlockIq1M) -> f32 {
    let sc = |i: usize| u16_at(&b.scales, 2 * i);
    let bits = (sc(0) >> 12) | ((sc(1) >> 8) & 0x00F0) | ((sc(2) >> 4) & 0x0F00) | (sc(3) & 0xF000);
    f16_bytes(bits.to_le_bytes())
}

/// The 3-bit scales (as `2s + 1`) of the two 16-element halves of group `ib` of an IQ1_M block.
#[inline(always)]
fn iq1m_scales(b: &BlockIq1M, ib: usize) -> [i32; 2] {
    let sc = u16_at(&b.scales, 2 * (ib / 2));
    let s = |o: usize| 2 * ((sc >> (6 * (ib % 2) + o)) & 7) as i32 + 1;
    [s(0), s(3)]
}

/// The grid index and shift sign of 8-element group `l` (0..4) of group `ib` of an IQ1_M block.
#[inline(always)]
fn iq1m_group(b: &BlockIq1M, ib: usize, l: usize) -> (usize, bool) {
    let qh = b.qh[2 * ib + l / 2] as usize;
    let (hi, neg) = if l.is_multiple_of(2) {
        ((qh << 8) & 0x700, qh & 0x08 != 0)
    } else {
        ((qh << 4) & 0x700, qh & 0x80 != 0)
    };
    (b.qs[4 * ib + l] as usize | hi, neg)
}

pub fn decode_iq1_m(b: &BlockIq1M) -> Superblock {
    let mut s = Superblock::new();
    for ib in 0..8 {
        let [ls1, ls2] = iq1m_scales(b, ib);
        s.scale[2 * ib] = ls1;
        s.scale[2 * ib + 1] = ls2;
        for l in 0..4 {
            let (idx, neg) = iq1m_group(b, ib, l);
            put8(&mut s.w[32 * ib..], l, IQ1S_GRID[idx], 0);
            s.shift[4 * ib + l] = if neg { -1 } else { 1 };
        }
    }
    s
}

pub fn dequantize_iq1_m(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BlockIq1M>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = iq1m_d(b);
        for ib in 0..8 {
            let [ls1, ls2] = iq1m_scales(b, ib);
            let dl = [d * ls1 as f32, d * ls2 as f32];
            for l in 0..4 {
                let (idx, neg) = iq1m_group(b, ib, l);
                let delta = if neg { -IQ1_DELTA } else { IQ1_DELTA };
                let entry = IQ1S_GRID[idx];
                for j in 0..8 {
                    y[32 * ib + 8 * l + j] = dl[l / 2] * (grid_byte(entry, j) as i8 as f32 + delta);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Dot products of the 256-element formats against Q8_K.

/// `factor · Σ_blocks (d·dy) · total`, where `total` is the exact integer dot of a superblock
/// (`sum`, plus `shifted / 8` for the IQ1 formats, kept integral as `8·sum + shifted`).
#[inline(always)]
pub(crate) fn dot_superblocks<B: bytemuck::Pod>(
    n: usize,
    w: &[u8],
    a: &[u8],
    decode: impl Fn(&B) -> (f32, Superblock),
    shifted: bool,
    factor: f32,
) -> f32 {
    let (w, a) = (blocks::<B>(w), blocks::<BlockQ8K>(a));
    let mut sum = 0.0f32;
    for (x, y) in w.iter().zip(a).take(n / QK_K) {
        let (d, sb) = decode(x);
        let (s, h) = sb.dot(&y.qs, shifted);
        let total = if shifted { 8 * s + h } else { s };
        sum += d * y.d() * total as f32;
    }
    factor * sum
}

/// `pub fn $name(n, w, a) -> f32`: the scalar dot of a 256-element format through
/// [`dot_superblocks`], from its block type, block scale, decoder, IQ1-style shift and factor.
macro_rules! superblock_dot {
    ($($name:ident: $blk:ty, $scale:expr, $decode:ident, $shifted:expr, $factor:expr;)+) => {$(
        pub fn $name(n: usize, w: &[u8], a: &[u8]) -> f32 {
            dot_superblocks(n, w, a, |b: &$blk| ($scale(b), $decode(b)), $shifted, $factor)
        }
    )+};
}

superblock_dot! {
    dot_iq4_xs: BlockIq4Xs, |b: &BlockIq4Xs| f16_bytes(b.d), decode_iq4_xs, false, 1.0;
    dot_iq2_xxs: BlockIq2Xxs, |b: &BlockIq2Xxs| f16_bytes(b.d), decode_iq2_xxs, false, 0.125;
    dot_iq2_xs: BlockIq2Xs, |b: &BlockIq2Xs| f16_bytes(b.d), decode_iq2_xs, false, 0.125;
    dot_iq2_s: BlockIq2S, |b: &BlockIq2S| f16_bytes(b.d), decode_iq2_s, false, 0.125;
    dot_iq3_xxs: BlockIq3Xxs, |b: &BlockIq3Xxs| f16_bytes(b.d), decode_iq3_xxs, false, 0.25;
    dot_iq3_s: BlockIq3S, |b: &BlockIq3S| f16_bytes(b.d), decode_iq3_s, false, 1.0;
    dot_iq1_s: BlockIq1S, |b: &BlockIq1S| f16_bytes(b.d), decode_iq1_s, true, IQ1_DELTA;
    dot_iq1_m: BlockIq1M, iq1m_d, decode_iq1_m, true, IQ1_DELTA;
}
