//! The 32-element formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: scalar dequantization (bit-exact with
//! ggml's `dequantize_row_*`) and scalar dot products against Q8_0 activations.
//!
//! llama.cpp pairs Q4_1/Q5_1 with Q8_1, whose block carries `d * sum(q)` as an f16. We pair them
//! with Q8_0 and sum the activation quants exactly instead, which avoids that f16 rounding.

use crate::blocks::*;

#[inline(always)]
fn blocks<T: bytemuck::Pod>(bytes: &[u8]) -> &[T] {
    bytemuck::cast_slice(bytes)
}

#[inline(always)]
fn q5_high_bits(qh: [u8; 4], j: usize) -> (u8, u8) {
    let qh = u32::from_le_bytes(qh);
    (((qh >> j) << 4) as u8 & 0x10, (qh >> (j + 12)) as u8 & 0x10)
}

pub fn dequantize_q4_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BlockQ4_0>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK4_0))
    {
        let d = f16_bytes(b.d);
        for j in 0..16 {
            y[j] = ((b.qs[j] & 0x0F) as i32 - 8) as f32 * d;
            y[j + 16] = ((b.qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

pub fn dequantize_q4_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BlockQ4_1>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK4_1))
    {
        let (d, m) = (f16_bytes(b.d), f16_bytes(b.m));
        for j in 0..16 {
            y[j] = (b.qs[j] & 0x0F) as f32 * d + m;
            y[j + 16] = (b.qs[j] >> 4) as f32 * d + m;
        }
    }
}

pub fn dequantize_q5_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BlockQ5_0>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK5_0))
    {
        let d = f16_bytes(b.d);
        for j in 0..16 {
            let (h0, h1) = q5_high_bits(b.qh, j);
            y[j] = (((b.qs[j] & 0x0F) | h0) as i32 - 16) as f32 * d;
            y[j + 16] = (((b.qs[j] >> 4) | h1) as i32 - 16) as f32 * d;
        }
    }
}

pub fn dequantize_q5_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BlockQ5_1>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK5_1))
    {
        let (d, m) = (f16_bytes(b.d), f16_bytes(b.m));
        for j in 0..16 {
            let (h0, h1) = q5_high_bits(b.qh, j);
            y[j] = ((b.qs[j] & 0x0F) | h0) as f32 * d + m;
            y[j + 16] = ((b.qs[j] >> 4) | h1) as f32 * d + m;
        }
    }
}

pub fn dequantize_q8_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BlockQ8_0>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK8_0))
    {
        let d = f16_bytes(b.d);
        for (v, &q) in y.iter_mut().zip(&b.qs) {
            *v = q as f32 * d;
        }
    }
}

/// Sum of a Q8_0 block's quants (the `s` that Q8_1 would carry, but exact).
#[inline(always)]
fn q8_sum(a: &BlockQ8_0) -> i32 {
    a.qs.iter().map(|&v| v as i32).sum()
}

pub fn dot_q4_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (w, a) = (blocks::<BlockQ4_0>(w), blocks::<BlockQ8_0>(a));
    let mut sum = 0.0f32;
    for (x, y) in w.iter().zip(a).take(n / QK4_0) {
        let mut isum = 0i32;
        for j in 0..16 {
            isum += ((x.qs[j] & 0x0F) as i32 - 8) * y.qs[j] as i32;
            isum += ((x.qs[j] >> 4) as i32 - 8) * y.qs[j + 16] as i32;
        }
        sum += isum as f32 * (f16_bytes(x.d) * f16_bytes(y.d));
    }
    sum
}

pub fn dot_q4_1(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (w, a) = (blocks::<BlockQ4_1>(w), blocks::<BlockQ8_0>(a));
    let mut sum = 0.0f32;
    for (x, y) in w.iter().zip(a).take(n / QK4_1) {
        let mut isum = 0i32;
        for j in 0..16 {
            isum += (x.qs[j] & 0x0F) as i32 * y.qs[j] as i32;
            isum += (x.qs[j] >> 4) as i32 * y.qs[j + 16] as i32;
        }
        let dy = f16_bytes(y.d);
        sum += isum as f32 * (f16_bytes(x.d) * dy) + f16_bytes(x.m) * (q8_sum(y) as f32 * dy);
    }
    sum
}

pub fn dot_q5_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (w, a) = (blocks::<BlockQ5_0>(w), blocks::<BlockQ8_0>(a));
    let mut sum = 0.0f32;
    for (x, y) in w.iter().zip(a).take(n / QK5_0) {
        let mut isum = 0i32;
        for j in 0..16 {
            let (h0, h1) = q5_high_bits(x.qh, j);
            isum += (((x.qs[j] & 0x0F) | h0) as i32 - 16) * y.qs[j] as i32;
            isum += (((x.qs[j] >> 4) | h1) as i32 - 16) * y.qs[j + 16] as i32;
        }
        sum += isum as f32 * (f16_bytes(x.d) * f16_bytes(y.d));
    }
    sum
}

pub fn dot_q5_1(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (w, a) = (blocks::<BlockQ5_1>(w), blocks::<BlockQ8_0>(a));
    let mut sum = 0.0f32;
    for (x, y) in w.iter().zip(a).take(n / QK5_1) {
        let mut isum = 0i32;
        for j in 0..16 {
            let (h0, h1) = q5_high_bits(x.qh, j);
            isum += ((x.qs[j] & 0x0F) | h0) as i32 * y.qs[j] as i32;
            isum += ((x.qs[j] >> 4) | h1) as i32 * y.qs[j + 16] as i32;
        }
        let dy = f16_bytes(y.d);
        sum += isum as f32 * (f16_bytes(x.d) * dy) + f16_bytes(x.m) * (q8_sum(y) as f32 * dy);
    }
    sum
}

pub fn dot_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (w, a) = (blocks::<BlockQ8_0>(w), blocks::<BlockQ8_0>(a));
    let mut sum = 0.0f32;
    for (x, y) in w.iter().zip(a).take(n / QK8_0) {
        let isum: i32 =
            x.qs.iter()
                .zip(&y.qs)
                .map(|(&p, &q)| p as i32 * q as i32)
                .sum();
        sum += isum as f32 * (f16_bytes(x.d) * f16_bytes(y.d));
    }
    sum
}

/// ggml's `quantize_row_q8_0_ref`: scale = amax/127 stored as f16, values rounded half away from
/// zero with the f32 inverse scale.
pub fn quantize_q8_0(src: &[f32], dst: &mut [u8]) {
    let dst: &mut [BlockQ8_0] = bytemuck::cast_slice_mut(dst);
    for (x, y) in src.chunks_exact(QK8_0).zip(dst) {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        y.d = f16_to_bytes(d);
        for (q, v) in y.qs.iter_mut().zip(x) {
            *q = (v * id).round() as i8;
        }
    }
}

/// Q8_0 for activations as llama.cpp's CPU backend makes them (`quantize_row_q8_0` on x86):
/// the inverse scale is `127 / amax` and values round half to even. The weights' reference
/// quantizer ([`quantize_q8_0`]) divides by `amax / 127` and rounds half away from zero; using
/// llama.cpp's runtime form here keeps our activations equal to the ones it computes with.
pub fn quantize_q8_0_activations(src: &[f32], dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::Isa::detect().allows_avx2() {
        // SAFETY: `Isa::detect` returns only levels the CPU supports, and AVX2 and above
        // have AVX2 and FMA.
        return unsafe { crate::x86::act_quant::quantize_q8_0(src, dst) };
    }
    quantize_q8_0_activations_reference(src, dst)
}

/// Q8_0 activation blocks: scale from the largest magnitude, values rounded half to even (the
/// scalar reference of [`quantize_q8_0_activations`]).
pub fn quantize_q8_0_activations_reference(src: &[f32], dst: &mut [u8]) {
    let dst: &mut [BlockQ8_0] = bytemuck::cast_slice_mut(dst);
    for (x, y) in src.chunks_exact(QK8_0).zip(dst) {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        y.d = f16_to_bytes(d);
        for (q, v) in y.qs.iter_mut().zip(x) {
            *q = (v * id).round_ties_even() as i8;
        }
    }
}

/// ggml's `quantize_row_q4_0_ref` (used to make test weights).
pub fn quantize_q4_0(src: &[f32], dst: &mut [u8]) {
    let dst: &mut [BlockQ4_0] = bytemuck::cast_slice_mut(dst);
    for (x, y) in src.chunks_exact(QK4_0).zip(dst) {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        y.d = f16_to_bytes(d);
        for j in 0..16 {
            let x0 = x[j] * id;
            let x1 = x[j + 16] * id;
            let q0 = ((x0 + 8.5) as i32).min(15) as u8;
            let q1 = ((x1 + 8.5) as i32).min(15) as u8;
            y.qs[j] = q0 | (q1 << 4);
        }
    }
}
