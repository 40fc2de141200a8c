//! F32, F16 and BF16 weights against f32 activations, and the attention loops over f32 or f16
//! keys and values: plain NEON (every AArch64 CPU), four accumulators of 4 lanes.
//!
//! F16 is widened with `fcvtl`/`fcvtl2` (base ARMv8 SIMD, no FEAT_FP16 needed) in inline
//! assembly, because the `float16x4_t` intrinsics are not stable on the compiler we build with.

// The loops index several arrays (blocks, sub-block sums, lanes) with one position variable,
// as the scalar reference they mirror does.
#![allow(clippy::needless_range_loop)]

use std::arch::aarch64::*;
use std::arch::asm;

use crate::attn::{KvElem, Rows};
use crate::exp::{EXP_C, LN2_HI, LN2_LO};

/// 8 f16 bit patterns as two vectors of 4 f32 (exact).
#[inline(always)]
pub(super) fn widen_f16(h: uint16x8_t) -> (float32x4_t, float32x4_t) {
    let (lo, hi): (float32x4_t, float32x4_t);
    // SAFETY: register-only conversions of base ARMv8 Advanced SIMD; no memory, stack or flags.
    // `out` (not `lateout`) keeps `lo` from sharing `h`'s register, which `fcvtl2` still reads.
    unsafe {
        asm!(
            "fcvtl {lo:v}.4s, {h:v}.4h",
            "fcvtl2 {hi:v}.4s, {h:v}.8h",
            h = in(vreg) h,
            lo = out(vreg) lo,
            hi = out(vreg) hi,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    (lo, hi)
}

/// 8 bf16 bit patterns as two vectors of 4 f32 (exact: the high half of an f32).
#[inline]
#[target_feature(enable = "neon")]
fn widen_bf16(h: uint16x8_t) -> (float32x4_t, float32x4_t) {
    let lo = vshll_n_u16::<16>(vget_low_u16(h));
    let hi = vshll_high_n_u16::<16>(h);
    (vreinterpretq_f32_u32(lo), vreinterpretq_f32_u32(hi))
}

#[inline]
#[target_feature(enable = "neon")]
fn f32x4(s: &[f32], off: usize) -> float32x4_t {
    let v: &[f32; 4] = s[off..off + 4].try_into().expect("4 values");
    // SAFETY: `v` is 4 readable f32s; unaligned loads are allowed.
    unsafe { vld1q_f32(v.as_ptr()) }
}

#[inline]
#[target_feature(enable = "neon")]
fn u16x8(s: &[u8], off: usize) -> uint16x8_t {
    let v: &[u8; 16] = s[off..off + 16].try_into().expect("16 bytes");
    // SAFETY: `v` is 16 readable bytes; unaligned loads are allowed.
    unsafe { vreinterpretq_u16_u8(vld1q_u8(v.as_ptr())) }
}

/// Little-endian f32s of a byte row (any alignment: a copy where `a` is not 4-byte aligned).
fn f32s(a: &[u8], n: usize) -> std::borrow::Cow<'_, [f32]> {
    let a = &a[..4 * n];
    match bytemuck::try_cast_slice(a) {
        Ok(s) => std::borrow::Cow::Borrowed(s),
        Err(_) => std::borrow::Cow::Owned(
            a.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
    }
}

#[inline]
#[target_feature(enable = "neon")]
fn hsum(acc: [float32x4_t; 4]) -> f32 {
    vaddvq_f32(vaddq_f32(
        vaddq_f32(acc[0], acc[1]),
        vaddq_f32(acc[2], acc[3]),
    ))
}

/// Σ w·a over `n` values, where `widen(bytes, off)` gives the 8 weights from element `off`
/// (`W` bytes each) as f32, and `scalar(i)` weight i.
#[inline]
#[target_feature(enable = "neon")]
fn dot_widened<const W: usize>(
    n: usize,
    w: &[u8],
    a: &[f32],
    widen: impl Fn(&[u8], usize) -> (float32x4_t, float32x4_t),
    scalar: impl Fn(usize) -> f32,
) -> f32 {
    let mut acc = [vdupq_n_f32(0.0); 4];
    let n16 = n / 16 * 16;
    for i in (0..n16).step_by(16) {
        let (w0, w1) = widen(w, i * W);
        let (w2, w3) = widen(w, (i + 8) * W);
        acc[0] = vfmaq_f32(acc[0], w0, f32x4(a, i));
        acc[1] = vfmaq_f32(acc[1], w1, f32x4(a, i + 4));
        acc[2] = vfmaq_f32(acc[2], w2, f32x4(a, i + 8));
        acc[3] = vfmaq_f32(acc[3], w3, f32x4(a, i + 12));
    }
    let mut s = hsum(acc);
    for i in n16..n {
        s += scalar(i) * a[i];
    }
    s
}

pub(super) fn dot_f32(n: usize, w: &[u8], a: &[u8]) -> f32 {
    // SAFETY: NEON, which every AArch64 target enables (checked in `super`).
    unsafe { dot_f32_neon(n, w, a) }
}

#[target_feature(enable = "neon")]
fn dot_f32_neon(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let (w, a) = (f32s(w, n), f32s(a, n));
    let mut acc = [vdupq_n_f32(0.0); 4];
    let n16 = n / 16 * 16;
    for i in (0..n16).step_by(16) {
        for (k, acc_k) in acc.iter_mut().enumerate() {
            *acc_k = vfmaq_f32(*acc_k, f32x4(&w, i + 4 * k), f32x4(&a, i + 4 * k));
        }
    }
    let mut s = hsum(acc);
    for i in n16..n {
        s += w[i] * a[i];
    }
    s
}

pub(super) fn dot_f16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    // SAFETY: NEON, which every AArch64 target enables (checked in `super`).
    unsafe { dot_f16_neon(n, w, a) }
}

#[target_feature(enable = "neon")]
fn dot_f16_neon(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let a = f32s(a, n);
    let w = &w[..2 * n];
    dot_widened::<2>(
        n,
        w,
        &a,
        |b, off| widen_f16(u16x8(b, off)),
        |i| crate::blocks::f16_bytes([w[2 * i], w[2 * i + 1]]),
    )
}

pub(super) fn dot_bf16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    // SAFETY: NEON, which every AArch64 target enables (checked in `super`).
    unsafe { dot_bf16_neon(n, w, a) }
}

#[target_feature(enable = "neon")]
fn dot_bf16_neon(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let a = f32s(a, n);
    let w = &w[..2 * n];
    dot_widened::<2>(
        n,
        w,
        &a,
        |b, off| widen_bf16(u16x8(b, off)),
        |i| crate::blocks::bf16_bits_to_f32(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])),
    )
}

/// Values `c..c + 8` of row `j` as f32; `rows` passed `Rows::check`, `j < n`, `c + 8 <= d`
/// (the slice indexing checks it again).
#[inline]
#[target_feature(enable = "neon")]
fn row8(rows: &Rows, j: usize, c: usize) -> (float32x4_t, float32x4_t) {
    let o = j * rows.stride + c * rows.elem.bytes();
    match rows.elem {
        KvElem::F32 => {
            let b: &[u8; 32] = rows.data[o..o + 32].try_into().expect("32 bytes");
            // SAFETY: `b` is 32 readable bytes, two vectors of 4 f32; unaligned loads are
            // allowed.
            unsafe {
                let p = b.as_ptr() as *const f32;
                (vld1q_f32(p), vld1q_f32(p.add(4)))
            }
        }
        KvElem::F16 => widen_f16(u16x8(rows.data, o)),
    }
}

/// [`crate::attn::scores`] with NEON.
pub(crate) fn scores(q: &[f32], keys: Rows, scale: f32, out: &mut [f32]) {
    // SAFETY: NEON, which every AArch64 target enables (checked in `super`).
    unsafe { scores_neon(q, keys, scale, out) }
}

#[target_feature(enable = "neon")]
fn scores_neon(q: &[f32], keys: Rows, scale: f32, out: &mut [f32]) {
    let d8 = keys.d / 8 * 8;
    for (j, o) in out.iter_mut().enumerate().take(keys.n) {
        let mut acc = [vdupq_n_f32(0.0); 2];
        for c in (0..d8).step_by(8) {
            let (k0, k1) = row8(&keys, j, c);
            acc[0] = vfmaq_f32(acc[0], f32x4(q, c), k0);
            acc[1] = vfmaq_f32(acc[1], f32x4(q, c + 4), k1);
        }
        let mut s = vaddvq_f32(vaddq_f32(acc[0], acc[1]));
        for c in d8..keys.d {
            s += q[c] * keys.value(j, c);
        }
        *o = s * scale;
    }
}

/// [`crate::attn::weighted_sum`] with NEON.
pub(crate) fn weighted_sum(p: &[f32], values: Rows, out: &mut [f32]) {
    // SAFETY: NEON, which every AArch64 target enables (checked in `super`).
    unsafe { weighted_sum_neon(p, values, out) }
}

#[target_feature(enable = "neon")]
fn weighted_sum_neon(p: &[f32], values: Rows, out: &mut [f32]) {
    let d8 = values.d / 8 * 8;
    for c in (0..d8).step_by(8) {
        let mut acc = [f32x4(out, c), f32x4(out, c + 4)];
        for (j, &pj) in p.iter().enumerate().take(values.n) {
            let (v0, v1) = row8(&values, j, c);
            acc[0] = vfmaq_n_f32(acc[0], v0, pj);
            acc[1] = vfmaq_n_f32(acc[1], v1, pj);
        }
        for (k, a) in acc.into_iter().enumerate() {
            let o: &mut [f32; 4] = (&mut out[c + 4 * k..c + 4 * k + 4])
                .try_into()
                .expect("4 values");
            // SAFETY: `o` is 4 writable f32s that nothing else references.
            unsafe { vst1q_f32(o.as_mut_ptr(), a) };
        }
    }
    for c in d8..values.d {
        for (j, &pj) in p.iter().enumerate().take(values.n) {
            out[c] += pj * values.value(j, c);
        }
    }
}

/// `x[i] = e^(x[i] - max)`, returning the sum; per value the operations of
/// [`crate::exp::exp_poly`] (same bits), summed in 4 lanes.
pub(crate) fn exp_sub_sum(x: &mut [f32], max: f32) -> f32 {
    // SAFETY: NEON, which every AArch64 target enables (checked in `super`).
    unsafe { exp_sub_sum_neon(x, max) }
}

#[target_feature(enable = "neon")]
fn exp_sub_sum_neon(x: &mut [f32], max: f32) -> f32 {
    let n4 = x.len() / 4 * 4;
    let mut sum = vdupq_n_f32(0.0);
    let vmax = vdupq_n_f32(max);
    for i in (0..n4).step_by(4) {
        let v = vsubq_f32(f32x4(x, i), vmax);
        let v = vminq_f32(vmaxq_f32(v, vdupq_n_f32(-87.3)), vdupq_n_f32(88.3));
        let k = vrndnq_f32(vmulq_n_f32(v, std::f32::consts::LOG2_E));
        let nk = vnegq_f32(k);
        let r = vfmaq_n_f32(v, nk, LN2_HI);
        let r = vfmaq_n_f32(r, nk, LN2_LO);
        let mut p = vdupq_n_f32(EXP_C[6]);
        for &c in EXP_C[..6].iter().rev() {
            p = vfmaq_f32(vdupq_n_f32(c), p, r);
        }
        let pow2 = vshlq_n_s32::<23>(vaddq_s32(vcvtq_s32_f32(k), vdupq_n_s32(127)));
        let e = vmulq_f32(p, vreinterpretq_f32_s32(pow2));
        let o: &mut [f32; 4] = (&mut x[i..i + 4]).try_into().expect("4 values");
        // SAFETY: `o` is 4 writable f32s that nothing else references.
        unsafe { vst1q_f32(o.as_mut_ptr(), e) };
        sum = vaddq_f32(sum, e);
    }
    let mut s = vaddvq_f32(sum);
    for v in x[n4..].iter_mut() {
        *v = crate::exp::exp_poly(*v - max);
        s += *v;
    }
    s
}
