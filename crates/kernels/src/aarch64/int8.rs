//! Signed byte products, the integer core of every quantized kernel, at each level:
//! plain NEON (`smull` + pairwise add-accumulate), `sdot` (FEAT_DotProd) and `smmla` (FEAT_I8MM).
//!
//! `sdot` and `smmla` are written as inline assembly: their intrinsics (`vdotq_s32`,
//! `vmmlaq_s32`) are not stable on the compiler we build with. Each instruction sits in its own
//! small function compiled with the feature, so the assembler always accepts it; callers
//! compiled with the same feature inline it.
//!
//! All three give exact integer sums (no product or partial sum can overflow: |q·y| ≤ 128·128
//! and at most 256 terms per sum), so they differ only in how the sum is spread over lanes;
//! callers only use the total of a register's lanes, which is the same at every level.

use std::arch::aarch64::*;
use std::arch::asm;

/// `acc + Σ x·y` spread over 4 lanes, with `sdot` when `SDOT` (the caller then runs with
/// FEAT_DotProd: only code reached after `crate::isa` detected it instantiates `SDOT = true`).
#[inline]
#[target_feature(enable = "neon")]
pub(super) fn dot16<const SDOT: bool>(acc: int32x4_t, x: int8x16_t, y: int8x16_t) -> int32x4_t {
    if SDOT {
        // SAFETY: `SDOT = true` is only instantiated by kernels of the dotprod and i8mm levels,
        // which `crate::isa` hands out after detecting FEAT_DotProd (see the module doc).
        unsafe { sdot(acc, x, y) }
    } else {
        let lo = vmull_s8(vget_low_s8(x), vget_low_s8(y));
        let hi = vmull_high_s8(x, y);
        vpadalq_s16(vpadalq_s16(acc, lo), hi)
    }
}

/// `sdot acc.4s, x.16b, y.16b`: lane i += Σ of the products of bytes 4i..4i+4.
#[inline]
#[target_feature(enable = "dotprod")]
fn sdot(mut acc: int32x4_t, x: int8x16_t, y: int8x16_t) -> int32x4_t {
    // SAFETY: a register-only instruction of FEAT_DotProd, which this function is compiled
    // for; it touches no memory, stack or flags.
    unsafe {
        asm!(
            "sdot {acc:v}.4s, {x:v}.16b, {y:v}.16b",
            acc = inout(vreg) acc,
            x = in(vreg) x,
            y = in(vreg) y,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

/// `smmla acc.4s, a.16b, b.16b`: `a` holds two rows of 8 bytes, `b` two columns of 8 bytes;
/// `acc += [a0·b0, a0·b1, a1·b0, a1·b1]`.
#[inline]
#[target_feature(enable = "i8mm")]
pub(super) fn smmla(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: a register-only instruction of FEAT_I8MM, which this function is compiled for;
    // it touches no memory, stack or flags.
    unsafe {
        asm!(
            "smmla {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

/// 16 bytes of `s` from `off`.
#[inline]
#[target_feature(enable = "neon")]
pub(super) fn load16(s: &[i8], off: usize) -> int8x16_t {
    let v: &[i8; 16] = s[off..off + 16].try_into().expect("16 bytes");
    // SAFETY: `v` is 16 readable bytes; unaligned loads are allowed.
    unsafe { vld1q_s8(v.as_ptr()) }
}

/// 8 bytes of `s` from `off`.
#[inline]
#[target_feature(enable = "neon")]
pub(super) fn load8(s: &[i8], off: usize) -> int8x8_t {
    let v: &[i8; 8] = s[off..off + 8].try_into().expect("8 bytes");
    // SAFETY: `v` is 8 readable bytes; unaligned loads are allowed.
    unsafe { vld1_s8(v.as_ptr()) }
}

/// 16 unsigned bytes of `s` from `off`.
#[inline]
#[target_feature(enable = "neon")]
pub(super) fn load16u(s: &[u8], off: usize) -> uint8x16_t {
    let v: &[u8; 16] = s[off..off + 16].try_into().expect("16 bytes");
    // SAFETY: `v` is 16 readable bytes; unaligned loads are allowed.
    unsafe { vld1q_u8(v.as_ptr()) }
}

/// Stores `v` at `s[off..off + 16]`.
#[inline]
#[target_feature(enable = "neon")]
pub(super) fn store16(s: &mut [i8], off: usize, v: int8x16_t) {
    let d: &mut [i8; 16] = (&mut s[off..off + 16]).try_into().expect("16 bytes");
    // SAFETY: `d` is 16 writable bytes that nothing else references; unaligned stores are
    // allowed.
    unsafe { vst1q_s8(d.as_mut_ptr(), v) }
}
