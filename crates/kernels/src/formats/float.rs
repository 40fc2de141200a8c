//! Unquantized weights (F32, F16, BF16) against f32 activations. llama.cpp rounds the
//! activation to the weight's type first; we keep it in f32, which is never less accurate.

use crate::blocks::{bf16_bits_to_f32, f16_bytes, f16_to_bytes, f32_to_bf16_bits};

#[inline(always)]
fn f32s(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

pub fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (y, v) in dst.iter_mut().zip(f32s(src)) {
        *y = v;
    }
}

pub fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    for (y, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *y = f16_bytes([c[0], c[1]]);
    }
}

pub fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (y, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *y = bf16_bits_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
}

pub fn quantize_f32(src: &[f32], dst: &mut [u8]) {
    for (v, c) in src.iter().zip(dst.chunks_exact_mut(4)) {
        c.copy_from_slice(&v.to_le_bytes());
    }
}

pub fn quantize_f16(src: &[f32], dst: &mut [u8]) {
    for (v, c) in src.iter().zip(dst.chunks_exact_mut(2)) {
        c.copy_from_slice(&f16_to_bytes(*v));
    }
}

pub fn quantize_bf16(src: &[f32], dst: &mut [u8]) {
    for (v, c) in src.iter().zip(dst.chunks_exact_mut(2)) {
        c.copy_from_slice(&f32_to_bf16_bits(*v).to_le_bytes());
    }
}

pub fn dot_f32(n: usize, w: &[u8], a: &[u8]) -> f32 {
    f32s(w).zip(f32s(a)).take(n).map(|(x, y)| x * y).sum()
}

pub fn dot_f16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    w.chunks_exact(2)
        .zip(f32s(a))
        .take(n)
        .map(|(c, y)| f16_bytes([c[0], c[1]]) * y)
        .sum()
}

pub fn dot_bf16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    w.chunks_exact(2)
        .zip(f32s(a))
        .take(n)
        .map(|(c, y)| bf16_bits_to_f32(u16::from_le_bytes([c[0], c[1]])) * y)
        .sum()
}
