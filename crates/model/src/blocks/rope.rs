//! Rotary position embedding. Angles are computed the way transformers does (f32 inverse
//! frequencies, f32 angle), with accurate cos/sin of that angle.

use crate::arch::RopeKind;
use crate::hparams::RopeParams;

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
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| {
                let f = 1.0f32 / params.freq_base.powf((2 * i) as f32 / params.n_rot as f32);
                match freq_factors {
                    Some(ff) => f / ff[i],
                    None => f,
                }
            })
            .collect();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            let pos = p as f32 * params.freq_scale;
            for &f in &inv_freq {
                let angle = (pos * f) as f64;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        RopeTable { half, cos, sin }
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
