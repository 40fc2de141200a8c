//! Rotary position embedding. Angles are computed the way transformers does (f32 inverse
//! frequencies, f32 angle), with accurate cos/sin of that angle.

use crate::arch::RopeKind;
use crate::hparams::{RopeParams, YarnParams};

/// YaRN: each frequency becomes a blend of itself (extrapolation, for the fast-rotating
/// dimensions that already saw whole periods in training) and itself divided by the factor
/// (interpolation, for the slow ones), with a linear ramp between the dimensions where
/// `beta_fast` and `beta_slow` rotations fit the original context (HF
/// `_compute_yarn_parameters`, ggml `rope_yarn`). The range is rounded out to whole
/// dimensions unless the architecture says otherwise (`YarnParams::truncate`).
pub fn yarn_blend(inv_freq: &mut [f32], y: &YarnParams, base: f32, n_rot: usize) {
    let dim = n_rot as f32;
    let correction_dim = |rotations: f32| {
        dim * (y.orig_ctx as f32 / (rotations * 2.0 * std::f32::consts::PI)).ln()
            / (2.0 * base.ln())
    };
    let mut low = correction_dim(y.beta_fast);
    let mut high = correction_dim(y.beta_slow);
    if y.truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, high) = (low.max(0.0), high.min(dim - 1.0));
    let span = if high == low { 0.001 } else { high - low };
    for (i, f) in inv_freq.iter_mut().enumerate() {
        let ramp = ((i as f32 - low) / span).clamp(0.0, 1.0);
        let extrapolate = (1.0 - ramp) * y.ext_factor;
        let interpolated = *f / y.factor;
        *f = interpolated * (1.0 - extrapolate) + *f * extrapolate;
    }
}

/// Cos/sin tables for a set of positions: `[pos][pair]`.
pub struct RopeTable {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    pub fn new(
        params: &RopeParams,
        freq_factors: Option<&[f32]>,
        positions: &[usize],
    ) -> RopeTable {
        let half = params.n_rot / 2;
        let mut inv_freq: Vec<f32> = (0..half)
            .map(|i| {
                let f = 1.0f32 / params.freq_base.powf((2 * i) as f32 / params.n_rot as f32);
                match freq_factors {
                    Some(ff) => f / ff[i],
                    None => f,
                }
            })
            .collect();
        let mut mscale = 1.0f32;
        if let Some(y) = &params.yarn {
            yarn_blend(&mut inv_freq, y, params.freq_base, params.n_rot);
            mscale = y.mscale;
        }
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            let pos = p as f32 * params.freq_scale;
            for &f in &inv_freq {
                let angle = (pos * f) as f64;
                cos.push(angle.cos() as f32 * mscale);
                sin.push(angle.sin() as f32 * mscale);
            }
        }
        RopeTable { half, cos, sin }
    }

    /// Pairs per position, and the cos and sin tables (`[pos][pair]`, the YaRN mscale in).
    pub fn tables(&self) -> (usize, &[f32], &[f32]) {
        (self.half, &self.cos, &self.sin)
    }

    /// Undoes [`RopeTable::apply`] (consecutive pairs) on one head of `2 · half` values.
    pub fn apply_inverse(&self, t: usize, head: &mut [f32]) {
        let cos = &self.cos[t * self.half..(t + 1) * self.half];
        let sin = &self.sin[t * self.half..(t + 1) * self.half];
        for i in 0..self.half {
            let (x0, x1) = (head[2 * i], head[2 * i + 1]);
            head[2 * i] = x0 * cos[i] + x1 * sin[i];
            head[2 * i + 1] = x1 * cos[i] - x0 * sin[i];
        }
    }

    /// Rotates every head of row `t` (`n_heads × head_dim` values) in place.
    pub fn apply(&self, kind: RopeKind, t: usize, row: &mut [f32], head_dim: usize) {
        let cos = &self.cos[t * self.half..(t + 1) * self.half];
        let sin = &self.sin[t * self.half..(t + 1) * self.half];
        for head in row.chunks_exact_mut(head_dim) {
            match kind {
                RopeKind::Norm => {
                    for i in 0..self.half {
                        let (x0, x1) = (head[2 * i], head[2 * i + 1]);
                        head[2 * i] = x0 * cos[i] - x1 * sin[i];
                        head[2 * i + 1] = x0 * sin[i] + x1 * cos[i];
                    }
                }
                RopeKind::Neox => {
                    for i in 0..self.half {
                        let (x0, x1) = (head[i], head[i + self.half]);
                        head[i] = x0 * cos[i] - x1 * sin[i];
                        head[i + self.half] = x0 * sin[i] + x1 * cos[i];
                    }
                }
            }
        }
    }
}
