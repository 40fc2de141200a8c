//! e^x for the softmax of attention and the gated activations of FFNs: one polynomial, in
//! scalar and SIMD forms that give the same bits, so a path's choice never changes a result.

/// e^x by range reduction (x = k·ln2 + r) and a degree-6 polynomial for e^r; the same
/// operations as the SIMD paths, so every path gives the same bits.
pub fn exp_poly(x: f32) -> f32 {
    let x = x.clamp(-87.3, 88.3);
    let k = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (-k).mul_add(LN2_HI, x);
    let r = (-k).mul_add(LN2_LO, r);
    let mut p = EXP_C[6];
    for &c in EXP_C[..6].iter().rev() {
        p = p.mul_add(r, c);
    }
    p * f32::from_bits(((k as i32 + 127) as u32) << 23)
}

pub(crate) const LN2_HI: f32 = 0.693_359_4;
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
/// Taylor coefficients of e^r on |r| ≤ ln2/2: 1, 1, 1/2, 1/6, 1/24, 1/120, 1/720.
pub(crate) const EXP_C: [f32; 7] = [
    1.0,
    1.0,
    0.5,
    0.166_666_67,
    0.041_666_668,
    0.008_333_334,
    0.001_388_889,
];

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    use super::{EXP_C, LN2_HI, LN2_LO};

    /// e^v of eight floats by [`super::exp_poly`]'s operations (same bits for every
    /// non-NaN input).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn exp8(v: __m256) -> __m256 {
        let v = _mm256_min_ps(
            _mm256_max_ps(v, _mm256_set1_ps(-87.3)),
            _mm256_set1_ps(88.3),
        );
        let k = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(v, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let nk = _mm256_sub_ps(_mm256_setzero_ps(), k);
        let r = _mm256_fmadd_ps(nk, _mm256_set1_ps(LN2_HI), v);
        let r = _mm256_fmadd_ps(nk, _mm256_set1_ps(LN2_LO), r);
        let mut p = _mm256_set1_ps(EXP_C[6]);
        for &c in EXP_C[..6].iter().rev() {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(k),
            _mm256_set1_epi32(127),
        )));
        _mm256_mul_ps(p, pow2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_poly_is_accurate() {
        let mut worst = 0f64;
        for i in -8700..=8830 {
            let x = i as f32 / 100.0;
            let e = (x as f64).exp();
            worst = worst.max(((exp_poly(x) as f64 - e) / e).abs());
        }
        assert!(worst < 4e-7, "relative error {worst}");
    }
}
