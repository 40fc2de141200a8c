//! The gated activation between an FFN's gate/up and down projections, `silu(gate) · up`, in
//! SIMD with the scalar form's bits. In decode it runs on one thread per expert between two
//! matmuls; with libm's `expf` per element it cost as much as a small matmul at 16 threads.

use crate::exp::exp_poly;

/// `gate[i] = silu(gate[i]) · up[i]`, where silu(g) = g / (1 + e^-g) with
/// [`exp_poly`]'s e^x, in AVX2 where [`crate::isa::Isa::detect`]'s level allows it; the bits of
/// [`silu_mul_reference`].
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "gate and up rows differ in length");
    #[cfg(target_arch = "x86_64")]
    if crate::isa::Isa::detect().allows_avx2() {
        // SAFETY: `Isa::detect` returns only levels the CPU supports, and AVX2 and above
        // have AVX2 and FMA.
        return unsafe { x86::silu_mul_avx2(gate, up) };
    }
    silu_mul_reference(gate, up)
}

/// The scalar form of [`silu_mul`].
pub fn silu_mul_reference(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu_times(*g, u);
    }
}

#[inline(always)]
fn silu_times(g: f32, u: f32) -> f32 {
    g / (1.0 + exp_poly(-g)) * u
}

/// The clamped SwiGLUs of gpt-oss (`alpha` 1.702, `up_plus_one`) and DeepSeek V4 (`alpha` 1):
/// `x / (1 + e^(-alpha·x)) · y` with `x = min(gate, limit)` and `y = clamp(up, ±limit)`, plus
/// one for gpt-oss.
#[derive(Clone, Copy, Debug)]
pub struct ClampedGlu {
    pub alpha: f32,
    pub limit: f32,
    pub up_plus_one: bool,
}

/// `gate[i] = ` the clamped SwiGLU of `gate[i]` and `up[i]`, in AVX2 where the chosen level allows;
/// the bits of [`clamped_silu_mul_reference`].
pub fn clamped_silu_mul(gate: &mut [f32], up: &[f32], glu: ClampedGlu) {
    assert_eq!(gate.len(), up.len(), "gate and up rows differ in length");
    #[cfg(target_arch = "x86_64")]
    if crate::isa::Isa::detect().allows_avx2() {
        // SAFETY: `Isa::detect` returns only levels the CPU supports, and AVX2 and above
        // have AVX2 and FMA.
        return unsafe { x86::clamped_silu_mul_avx2(gate, up, glu) };
    }
    clamped_silu_mul_reference(gate, up, glu)
}

/// The scalar form of [`clamped_silu_mul`].
pub fn clamped_silu_mul_reference(gate: &mut [f32], up: &[f32], glu: ClampedGlu) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = clamped_silu_times(*g, u, glu);
    }
}

#[inline(always)]
fn clamped_silu_times(g: f32, u: f32, glu: ClampedGlu) -> f32 {
    let x = g.min(glu.limit);
    let mut y = u.clamp(-glu.limit, glu.limit);
    if glu.up_plus_one {
        y += 1.0;
    }
    x / (1.0 + exp_poly(-glu.alpha * x)) * y
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    use crate::exp::x86::exp8;

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn clamped_silu_mul_avx2(gate: &mut [f32], up: &[f32], glu: super::ClampedGlu) {
        let n = gate.len().min(up.len());
        let n8 = n / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        let (hi, lo) = (_mm256_set1_ps(glu.limit), _mm256_set1_ps(-glu.limit));
        let neg_alpha = _mm256_set1_ps(-glu.alpha);
        let plus = _mm256_set1_ps(if glu.up_plus_one { 1.0 } else { 0.0 });
        for i in (0..n8).step_by(8) {
            // SAFETY: elements i..i + 8 of both slices (i + 8 <= n8 <= both lengths).
            let (g, u) = unsafe {
                (
                    _mm256_loadu_ps(gate.as_ptr().add(i)),
                    _mm256_loadu_ps(up.as_ptr().add(i)),
                )
            };
            // f32::min ignores a NaN gate, as `minps` does with its first operand.
            let x = _mm256_min_ps(g, hi);
            // f32::clamp keeps a NaN, which min/max would not: put it back.
            let y = _mm256_blendv_ps(
                _mm256_min_ps(_mm256_max_ps(u, lo), hi),
                u,
                _mm256_cmp_ps::<_CMP_UNORD_Q>(u, u),
            );
            // Adding 0.0 would turn -0.0 into 0.0: only gpt-oss adds its one.
            let y = if glu.up_plus_one {
                _mm256_add_ps(y, plus)
            } else {
                y
            };
            let e = exp8(_mm256_mul_ps(neg_alpha, x));
            let s = _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), y);
            // SAFETY: as for the loads.
            unsafe { _mm256_storeu_ps(gate.as_mut_ptr().add(i), s) };
        }
        for (g, &u) in gate[n8..n].iter_mut().zip(&up[n8..n]) {
            *g = super::clamped_silu_times(*g, u, glu);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn silu_mul_avx2(gate: &mut [f32], up: &[f32]) {
        let n = gate.len().min(up.len());
        let n8 = n / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        for i in (0..n8).step_by(8) {
            // SAFETY: elements i..i + 8 of both slices (i + 8 <= n8 <= both lengths).
            let (g, u) = unsafe {
                (
                    _mm256_loadu_ps(gate.as_ptr().add(i)),
                    _mm256_loadu_ps(up.as_ptr().add(i)),
                )
            };
            // -g exactly as the scalar negation (a sign flip, so -0.0 for 0.0).
            let e = exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0)));
            let s = _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u);
            // SAFETY: as for the loads.
            unsafe { _mm256_storeu_ps(gate.as_mut_ptr().add(i), s) };
        }
        for (g, &u) in gate[n8..n].iter_mut().zip(&up[n8..n]) {
            *g = super::silu_times(*g, u);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silu_mul_gives_the_scalar_bits() {
        let mut gate: Vec<f32> = (0..1003)
            .map(|i| ((i * 7919 % 2000) as f32 - 1000.0) / 37.0)
            .collect();
        let specials = [
            0.0,
            -0.0,
            1e-40,
            -1e-40,
            88.0,
            -88.0,
            200.0,
            -200.0,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        gate[..specials.len()].copy_from_slice(&specials);
        let up: Vec<f32> = (0..gate.len())
            .map(|i| ((i * 104_729 % 1000) as f32 - 500.0) / 300.0)
            .collect();
        let mut got = gate.clone();
        silu_mul(&mut got, &up);
        let mut want = gate.clone();
        silu_mul_reference(&mut want, &up);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "element {i} (gate {}): {g} against {w}",
                gate[i]
            );
        }
        for glu in [
            ClampedGlu {
                alpha: 1.702,
                limit: 7.0,
                up_plus_one: true,
            },
            ClampedGlu {
                alpha: 1.0,
                limit: 10.0,
                up_plus_one: false,
            },
        ] {
            let mut up_specials = up.clone();
            up_specials[..4].copy_from_slice(&[f32::NAN, -0.0, 1e9, -1e9]);
            let mut gate_specials = gate.clone();
            gate_specials[12] = f32::NAN;
            let mut got = gate_specials.clone();
            clamped_silu_mul(&mut got, &up_specials, glu);
            let mut want = gate_specials.clone();
            clamped_silu_mul_reference(&mut want, &up_specials, glu);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                    "{glu:?} element {i}: {g} against {w}"
                );
            }
        }
        // Close to the exact function.
        for ((g, &x), &u) in got.iter().zip(&gate).zip(&up).skip(specials.len()) {
            let exact = x as f64 / (1.0 + (-(x as f64)).exp()) * u as f64;
            assert!(
                (*g as f64 - exact).abs() <= 1e-6 * exact.abs().max(1e-3),
                "{x}"
            );
        }
    }
}
