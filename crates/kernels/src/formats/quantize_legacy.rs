//! Reference quantizers for the 32-element formats Q4_1, Q5_0 and Q5_1, byte-identical with
//! ggml's `quantize_row_q*_ref` (Q4_0 and Q8_0 live next to their dequantizers in `legacy`).
//!
//! ggml converts `x + 0.5f` to a small integer with a C cast, which truncates toward zero; on
//! x86-64 that is `cvttss2si` into 32 bits followed by keeping the low byte. [`trunc_c`] does
//! the same, so even non-finite input produces ggml's bytes.

use crate::blocks::*;

/// C's float-to-`int` conversion as x86-64 performs it: truncation toward zero, and the
/// "integer indefinite" `i32::MIN` for NaN or out-of-range values (Rust's `as` saturates).
#[inline(always)]
fn trunc_c(v: f32) -> i32 {
    // 2^31: the first magnitude `cvttss2si` cannot represent (except -2^31 itself).
    const LIMIT: f32 = 2_147_483_648.0;
    // NaN is in no range, so it takes the second branch as well.
    if (-LIMIT..LIMIT).contains(&v) {
        v as i32
    } else {
        i32::MIN
    }
}

/// Smallest and largest value of a block, seeded with ±`f32::MAX` as ggml does.
#[inline(always)]
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// Bit 4 of the quant `q` (its fifth bit in Q5_0/Q5_1), moved to bit `j` of the `qh` word.
#[inline(always)]
fn fifth_bit(q: u8, j: usize) -> u32 {
    (((q & 0x10) >> 4) as u32) << j
}

/// ggml's `quantize_row_q4_1_ref`: `d = (max - min) / 15`, `m = min`, quants
/// `(x - min) / d` rounded half up and capped at 15.
pub fn quantize_q4_1(src: &[f32], dst: &mut [u8]) {
    let dst: &mut [BlockQ4_1] = bytemuck::cast_slice_mut(dst);
    for (x, y) in src.chunks_exact(QK4_1).zip(dst) {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        y.d = f16_to_bytes(d);
        y.m = f16_to_bytes(min);
        // The C source casts to int8_t before MIN(15, ·) and stores the result as uint8_t.
        let q = |v: f32| (trunc_c((v - min) * id + 0.5) as i8).min(15) as u8;
        for j in 0..16 {
            y.qs[j] = q(x[j]) | (q(x[j + 16]) << 4);
        }
    }
}

/// ggml's `quantize_row_q5_0_ref`: `d = max / -16` from the signed value of largest magnitude,
/// quants `x / d + 16` rounded half up and capped at 31.
pub fn quantize_q5_0(src: &[f32], dst: &mut [u8]) {
    let dst: &mut [BlockQ5_0] = bytemuck::cast_slice_mut(dst);
    for (x, y) in src.chunks_exact(QK5_0).zip(dst) {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        y.d = f16_to_bytes(d);
        let q = |v: f32| (trunc_c(v * id + 16.5) as i8).min(31) as u8;
        let mut qh = 0u32;
        for j in 0..16 {
            let (q0, q1) = (q(x[j]), q(x[j + 16]));
            y.qs[j] = (q0 & 0x0F) | ((q1 & 0x0F) << 4);
            qh |= fifth_bit(q0, j) | fifth_bit(q1, j + 16);
        }
        y.qh = qh.to_le_bytes();
    }
}

/// ggml's `quantize_row_q5_1_ref`: `d = (max - min) / 31`, `m = min`, quants
/// `(x - min) / d` rounded half up (ggml applies no cap here).
pub fn quantize_q5_1(src: &[f32], dst: &mut [u8]) {
    let dst: &mut [BlockQ5_1] = bytemuck::cast_slice_mut(dst);
    for (x, y) in src.chunks_exact(QK5_1).zip(dst) {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        y.d = f16_to_bytes(d);
        y.m = f16_to_bytes(min);
        let q = |v: f32| trunc_c((v - min) * id + 0.5) as u8;
        let mut qh = 0u32;
        for j in 0..16 {
            let (q0, q1) = (q(x[j]), q(x[j + 16]));
            y.qs[j] = (q0 & 0x0F) | ((q1 & 0x0F) << 4);
            qh |= fifth_bit(q0, j) | fifth_bit(q1, j + 16);
        }
        y.qh = qh.to_le_bytes();
    }
}
