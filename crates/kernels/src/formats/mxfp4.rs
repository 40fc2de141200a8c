//! MXFP4 (gpt-oss): 32 E2M1 values sharing an E8M0 exponent. Dequantization bit-exact with ggml;
//! the dot product pairs with Q8_0 activations as in llama.cpp.

use crate::blocks::*;

pub fn dequantize_mxfp4(src: &[u8], dst: &mut [f32]) {
    let src: &[BlockMxfp4] = bytemuck::cast_slice(src);
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_MXFP4)) {
        let d = e8m0_to_f32_half(b.e);
        for j in 0..16 {
            y[j] = KVALUES_MXFP4[(b.qs[j] & 0x0F) as usize] as f32 * d;
            y[j + 16] = KVALUES_MXFP4[(b.qs[j] >> 4) as usize] as f32 * d;
        }
    }
}

pub fn dot_mxfp4(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let w: &[BlockMxfp4] = bytemuck::cast_slice(w);
    let a: &[BlockQ8_0] = bytemuck::cast_slice(a);
    let mut sum = 0.0f32;
    for (x, y) in w.iter().zip(a).take(n / QK_MXFP4) {
        let mut isum = 0i32;
        for j in 0..16 {
            isum += KVALUES_MXFP4[(x.qs[j] & 0x0F) as usize] as i32 * y.qs[j] as i32;
            isum += KVALUES_MXFP4[(x.qs[j] >> 4) as usize] as i32 * y.qs[j + 16] as i32;
        }
        sum += f16_bytes(y.d) * e8m0_to_f32_half(x.e) * isum as f32;
    }
    sum
}

/// ggml's `quantize_row_mxfp4_ref` (used to make test weights): exponent from the largest
/// magnitude, each value mapped to the nearest table entry (first wins on ties).
pub fn quantize_mxfp4(src: &[f32], dst: &mut [u8]) {
    let dst: &mut [BlockMxfp4] = bytemuck::cast_slice_mut(dst);
    for (x, y) in src.chunks_exact(QK_MXFP4).zip(dst) {
        let amax = x
            .iter()
            .fold(0.0f32, |m, v| if m < v.abs() { v.abs() } else { m });
        let e = if amax > 0.0 {
            (amax.log2().floor() - 2.0 + 127.0) as u8
        } else {
            0
        };
        let d = e8m0_to_f32_half(e);
        y.e = e;
        let best = |v: f32| {
            let mut best_i = 0usize;
            let mut best_err = (KVALUES_MXFP4[0] as f32 * d - v).abs();
            for (i, &k) in KVALUES_MXFP4.iter().enumerate().skip(1) {
                let err = (k as f32 * d - v).abs();
                if err < best_err {
                    best_i = i;
                    best_err = err;
                }
            }
            best_i as u8
        };
        for j in 0..16 {
            y.qs[j] = best(x[j]) | (best(x[j + 16]) << 4);
        }
    }
}
