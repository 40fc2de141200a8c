//! The 256-element K-quant formats Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and Q8_K: scalar dequantization
//! (bit-exact with ggml's `dequantize_row_*`, including its operation order), scalar dot products
//! against Q8_K activations, and the Q8_K activation quantizer.

use crate::blocks::*;

#[inline(always)]
fn blocks<T: bytemuck::Pod>(bytes: &[u8]) -> &[T] {
    bytemuck::cast_slice(bytes)
}

pub fn dequantize_q2_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BlockQ2K>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let (d, min) = (f16_bytes(b.d), f16_bytes(b.dmin));
        let mut out = 0;
        let mut is = 0;
        for half in 0..2 {
            let q = &b.qs[32 * half..32 * half + 32];
            for shift in [0, 2, 4, 6] {
                for part in 0..2 {
                    let sc = b.scales[is];
                    is += 1;
                    let dl = d * (sc & 0xF) as f32;
                    let ml = min * (sc >> 4) as f32;
                    for l in 0..16 {
                        y[out] = dl * ((q[16 * part + l] >> shift) & 3) as f32 - ml;
                        out += 1;
                    }
                }
            }
        }
    }
}

pub fn dequantize_q3_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BlockQ3K>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d_all = f16_bytes(b.d);
        let scales = q3k_scales(&b.scales);
        let mut out = 0;
        let mut is = 0;
        let mut m = 1u8;
        for half in 0..2 {
            let q = &b.qs[32 * half..32 * half + 32];
            for shift in [0, 2, 4, 6] {
                for part in 0..2 {
                    let dl = d_all * (scales[is] as i32 - 32) as f32;
                    is += 1;
                    for l in 0..16 {
                        let lo = ((q[16 * part + l] >> shift) & 3) as i32;
                        let hi = if b.hmask[16 * part + l] & m != 0 {
                            0
                        } else {
                            4
                        };
                        y[out] = dl * (lo - hi) as f32;
                        out += 1;
                    }
                }
                m <<= 1;
            }
        }
    }
}

pub fn dequantize_q4_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BlockQ4K>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let (d, min) = (f16_bytes(b.d), f16_bytes(b.dmin));
        for g in 0..4 {
            let q = &b.qs[32 * g..32 * g + 32];
            let (sc1, m1) = scale_min_k4(2 * g, &b.scales);
            let (sc2, m2) = scale_min_k4(2 * g + 1, &b.scales);
            let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
            let y = &mut y[64 * g..64 * g + 64];
            for l in 0..32 {
                y[l] = d1 * (q[l] & 0xF) as f32 - m1;
                y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }
}

pub fn dequantize_q5_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BlockQ5K>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let (d, min) = (f16_bytes(b.d), f16_bytes(b.dmin));
        for g in 0..4 {
            let ql = &b.qs[32 * g..32 * g + 32];
            let (u1, u2) = (1u8 << (2 * g), 2u8 << (2 * g));
            let (sc1, m1) = scale_min_k4(2 * g, &b.scales);
            let (sc2, m2) = scale_min_k4(2 * g + 1, &b.scales);
            let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
            let y = &mut y[64 * g..64 * g + 64];
            for l in 0..32 {
                let h1 = if b.qh[l] & u1 != 0 { 16 } else { 0 };
                let h2 = if b.qh[l] & u2 != 0 { 16 } else { 0 };
                y[l] = d1 * ((ql[l] & 0xF) + h1) as f32 - m1;
                y[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
            }
        }
    }
}

/// The signed 6-bit value `l` (0..128 within a 128-half) of a Q6_K block half.
#[inline(always)]
fn q6_values(ql: &[u8], qh: &[u8], l: usize) -> [i32; 4] {
    [
        ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32,
        ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32,
        ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32,
        ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32,
    ]
}

pub fn dequantize_q6_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BlockQ6K>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_bytes(b.d);
        for half in 0..2 {
            let ql = &b.ql[64 * half..64 * half + 64];
            let qh = &b.qh[32 * half..32 * half + 32];
            let sc = &b.scales[8 * half..8 * half + 8];
            let y = &mut y[128 * half..128 * half + 128];
            for l in 0..32 {
                let is = l / 16;
                let q = q6_values(ql, qh, l);
                for (k, qk) in q.iter().enumerate() {
                    y[l + 32 * k] = d * sc[is + 2 * k] as f32 * *qk as f32;
                }
            }
        }
    }
}

pub fn dequantize_q8_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BlockQ8K>(src)
        .iter()
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = b.d();
        for (v, &q) in y.iter_mut().zip(&b.qs) {
            *v = d * q as f32;
        }
    }
}

/// ggml's `nearest_int`: round half to even via the 1.5·2^23 trick (valid for |v| < 2^22).
#[inline(always)]
pub fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.0f32).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// [`quantize_q8_k_reference`]'s bits, in AVX2 where [`crate::isa::Isa::detect`]'s level
/// allows it.
pub fn quantize_q8_k(src: &[f32], dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::Isa::detect().allows_avx2() {
        // SAFETY: `Isa::detect` returns only levels the CPU supports, and AVX2 and above
        // have AVX2 and FMA.
        return unsafe { crate::x86::act_quant::quantize_q8_k(src, dst) };
    }
    quantize_q8_k_reference(src, dst)
}

/// ggml's `quantize_row_q8_K_ref`: scale from the signed value of largest magnitude, values
/// rounded half to even, plus exact sums of each group of 16. An all-zero block gets zero sums
/// (ggml leaves them unwritten).
pub fn quantize_q8_k_reference(src: &[f32], dst: &mut [u8]) {
    let dst: &mut [BlockQ8K] = bytemuck::cast_slice_mut(dst);
    for (x, y) in src.chunks_exact(QK_K).zip(dst) {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *y = bytemuck::Zeroable::zeroed();
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in y.qs.iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for j in 0..16 {
            let s: i32 = y.qs[16 * j..16 * j + 16].iter().map(|&q| q as i32).sum();
            y.bsums[2 * j..2 * j + 2].copy_from_slice(&(s as i16).to_le_bytes());
        }
        y.d = (1.0 / iscale).to_le_bytes();
    }
}

pub fn dot_q2_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (w, a) = (blocks::<BlockQ2K>(w), blocks::<BlockQ8K>(a));
    let mut sum = 0.0f32;
    for (x, y) in w.iter().zip(a).take(n / QK_K) {
        let mut summs = 0i32;
        for j in 0..16 {
            summs += (x.scales[j] >> 4) as i32 * y.bsum(j) as i32;
        }
        let mut isum = 0i32;
        let mut is = 0;
        for half in 0..2 {
            let q = &x.qs[32 * half..32 * half + 32];
            let a8 = &y.qs[128 * half..128 * half + 128];
            for (s, shift) in [0, 2, 4, 6].into_iter().enumerate() {
                for part in 0..2 {
                    let sc = (x.scales[is] & 0xF) as i32;
                    is += 1;
                    let mut t = 0i32;
                    for l in 0..16 {
                        let qv = ((q[16 * part + l] >> shift) & 3) as i32;
                        t += qv * a8[32 * s + 16 * part + l] as i32;
                    }
                    isum += sc * t;
                }
            }
        }
        let dall = y.d() * f16_bytes(x.d);
        let dmin = y.d() * f16_bytes(x.dmin);
        sum += dall * isum as f32 - dmin * summs as f32;
    }
    sum
}

pub fn dot_q3_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (w, a) = (blocks::<BlockQ3K>(w), blocks::<BlockQ8K>(a));
    let mut sum = 0.0f32;
    for (x, y) in w.iter().zip(a).take(n / QK_K) {
        let scales = q3k_scales(&x.scales);
        let mut isum = 0i32;
        let mut is = 0;
        let mut m = 1u8;
        for half in 0..2 {
            let q = &x.qs[32 * half..32 * half + 32];
            let a8 = &y.qs[128 * half..128 * half + 128];
            for (s, shift) in [0, 2, 4, 6].into_iter().enumerate() {
                for part in 0..2 {
                    let sc = scales[is] as i32 - 32;
                    is += 1;
                    let mut t = 0i32;
                    for l in 0..16 {
                        let i = 16 * part + l;
                        let lo = ((q[i] >> shift) & 3) as i32;
                        let hi = if x.hmask[i] & m != 0 { 0 } else { 4 };
                        t += (lo - hi) * a8[32 * s + i] as i32;
                    }
                    isum += sc * t;
                }
                m <<= 1;
            }
        }
        sum += f16_bytes(x.d) * y.d() * isum as f32;
    }
    sum
}

pub fn dot_q4_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (w, a) = (blocks::<BlockQ4K>(w), blocks::<BlockQ8K>(a));
    let mut sum = 0.0f32;
    for (x, y) in w.iter().zip(a).take(n / QK_K) {
        let mut isum = 0i32;
        let mut summin = 0i32;
        for g in 0..4 {
            let q = &x.qs[32 * g..32 * g + 32];
            let a8 = &y.qs[64 * g..64 * g + 64];
            let (sc1, m1) = scale_min_k4(2 * g, &x.scales);
            let (sc2, m2) = scale_min_k4(2 * g + 1, &x.scales);
            let (mut t1, mut t2) = (0i32, 0i32);
            for l in 0..32 {
                t1 += (q[l] & 0xF) as i32 * a8[l] as i32;
                t2 += (q[l] >> 4) as i32 * a8[l + 32] as i32;
            }
            isum += sc1 as i32 * t1 + sc2 as i32 * t2;
            summin += m1 as i32 * (y.bsum(4 * g) as i32 + y.bsum(4 * g + 1) as i32);
            summin += m2 as i32 * (y.bsum(4 * g + 2) as i32 + y.bsum(4 * g + 3) as i32);
        }
        sum += y.d() * f16_bytes(x.d) * isum as f32 - y.d() * f16_bytes(x.dmin) * summin as f32;
    }
    sum
}

pub fn dot_q5_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (w, a) = (blocks::<BlockQ5K>(w), blocks::<BlockQ8K>(a));
    let mut sum = 0.0f32;
    for (x, y) in w.iter().zip(a).take(n / QK_K) {
        let mut isum = 0i32;
        let mut summin = 0i32;
        for g in 0..4 {
            let ql = &x.qs[32 * g..32 * g + 32];
            let a8 = &y.qs[64 * g..64 * g + 64];
            let (u1, u2) = (1u8 << (2 * g), 2u8 << (2 * g));
            let (sc1, m1) = scale_min_k4(2 * g, &x.scales);
            let (sc2, m2) = scale_min_k4(2 * g + 1, &x.scales);
            let (mut t1, mut t2) = (0i32, 0i32);
            for l in 0..32 {
                let h1 = if x.qh[l] & u1 != 0 { 16 } else { 0 };
                let h2 = if x.qh[l] & u2 != 0 { 16 } else { 0 };
                t1 += ((ql[l] & 0xF) as i32 + h1) * a8[l] as i32;
                t2 += ((ql[l] >> 4) as i32 + h2) * a8[l + 32] as i32;
            }
            isum += sc1 as i32 * t1 + sc2 as i32 * t2;
            summin += m1 as i32 * (y.bsum(4 * g) as i32 + y.bsum(4 * g + 1) as i32);
            summin += m2 as i32 * (y.bsum(4 * g + 2) as i32 + y.bsum(4 * g + 3) as i32);
        }
        sum += y.d() * f16_bytes(x.d) * isum as f32 - y.d() * f16_bytes(x.dmin) * summin as f32;
    }
    sum
}

pub fn dot_q6_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (w, a) = (blocks::<BlockQ6K>(w), blocks::<BlockQ8K>(a));
    let mut sum = 0.0f32;
    for (x, y) in w.iter().zip(a).take(n / QK_K) {
        let mut isum = 0i32;
        for half in 0..2 {
            let ql = &x.ql[64 * half..64 * half + 64];
            let qh = &x.qh[32 * half..32 * half + 32];
            let sc = &x.scales[8 * half..8 * half + 8];
            let a8 = &y.qs[128 * half..128 * half + 128];
            let mut t = [0i32; 8];
            for l in 0..32 {
                let q = q6_values(ql, qh, l);
                for (k, qk) in q.iter().enumerate() {
                    t[2 * k + l / 16] += qk * a8[l + 32 * k] as i32;
                }
            }
            for (k, tk) in t.iter().enumerate() {
                isum += sc[k] as i32 * tk;
            }
        }
        sum += f16_bytes(x.d) * y.d() * isum as f32;
    }
    sum
}

pub fn dot_q8_k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (w, a) = (blocks::<BlockQ8K>(w), blocks::<BlockQ8K>(a));
    let mut sum = 0.0f32;
    for (x, y) in w.iter().zip(a).take(n / QK_K) {
        let isum: i32 =
            x.qs.iter()
                .zip(&y.qs)
                .map(|(&p, &q)| p as i32 * q as i32)
                .sum();
        sum += x.d() * y.d() * isum as f32;
    }
    sum
}
