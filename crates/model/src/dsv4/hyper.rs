//! DeepSeek V4's hyper-connections: the mix of `hc` residual streams around each block
//! (collapse into the block input, Sinkhorn-normalized recombination with the block output) and
//! the head's collapse before the output norm. GLM-5.3 Flash mixes its streams the same way.

use kernels::Input;

use super::{sigmoid, unit_rms};
use crate::Model;
use crate::blocks::Compute;
use crate::error::Result;
use crate::hparams::Dsv4Params;
use crate::pass::{Hooks, ReducePoint};
use crate::profile::{Phase, span, timed};
use crate::weights::HyperMix;

/// The stream mix around a block: the collapsed block input (`n × d`) and, per token, the
/// `hc` post weights and the `hc × hc` combination (`comb[src·hc + dst]`).
pub(crate) struct Mix {
    pub collapsed: Vec<f32>,
    post: Vec<f32>,
    comb: Vec<f32>,
}

/// Per token, the mix logits of `w` over the weightless-RMS-normed streams `x` (`n × hc·d`):
/// `w.fn_.rows` values each.
fn mix_logits(cx: &Compute, model: &Model, x: &[f32], w: &HyperMix, eps: f32) -> Result<Vec<f32>> {
    let wide = w.fn_.cols;
    let n = x.len() / wide;
    let mut flat = vec![0f32; x.len()];
    cx.par_rows(&mut flat, wide, |first, rows| {
        for (j, out) in rows.chunks_exact_mut(wide).enumerate() {
            let t = first + j;
            unit_rms(&x[t * wide..(t + 1) * wide], eps, out);
        }
    });
    let input = Input::new(&flat, n, wide)?;
    Ok(cx
        .project(&input, &[w.fn_.weights(model.files())])?
        .pop()
        .expect("one output"))
}

/// `Σ_j pre[t·hc + j] · x_j` per token: the streams collapsed into one row of `d`, row by row
/// on the pool (the same operations in the same order per row whatever the split).
fn collapse(cx: &Compute, x: &[f32], pre: &[f32], hc: usize, d: usize) -> Vec<f32> {
    let wide = hc * d;
    let mut collapsed = vec![0f32; x.len() / hc];
    cx.par_rows(&mut collapsed, d, |first, rows| {
        for (k, out) in rows.chunks_exact_mut(d).enumerate() {
            let t = first + k;
            for (j, &pj) in pre[t * hc..(t + 1) * hc].iter().enumerate() {
                let stream = &x[t * wide + j * d..t * wide + (j + 1) * d];
                if j == 0 {
                    for (o, &v) in out.iter_mut().zip(stream) {
                        *o = pj * v;
                    }
                } else {
                    for (o, &v) in out.iter_mut().zip(stream) {
                        *o += pj * v;
                    }
                }
            }
        }
    });
    collapsed
}

/// How streams are mixed: how many, Sinkhorn iterations, the epsilon of the weights.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HcShape {
    pub hc: usize,
    pub sinkhorn_iters: usize,
    pub hc_eps: f32,
}

impl From<&Dsv4Params> for HcShape {
    fn from(p: &Dsv4Params) -> HcShape {
        HcShape {
            hc: p.hc,
            sinkhorn_iters: p.sinkhorn_iters,
            hc_eps: p.hc_eps,
        }
    }
}

/// Hyper-connection pre-mix of `x` (`n × hc·d`).
pub(crate) fn hc_pre(
    cx: &Compute,
    model: &Model,
    x: &[f32],
    w: &HyperMix,
    p: HcShape,
    eps: f32,
) -> Result<Mix> {
    let hc = p.hc;
    let d = w.fn_.cols / hc;
    let mixes = mix_logits(cx, model, x, w, eps)?;
    let m = w.fn_.rows;
    let n = mixes.len() / m;
    let mut pre = vec![0f32; n * hc];
    let mut post = vec![0f32; n * hc];
    let mut comb = vec![0f32; n * hc * hc];
    for t in 0..n {
        let mx = &mixes[t * m..(t + 1) * m];
        for j in 0..hc {
            pre[t * hc + j] = sigmoid(mx[j] * w.scale[0] + w.base[j]) + p.hc_eps;
            post[t * hc + j] = 2.0 * sigmoid(mx[hc + j] * w.scale[1] + w.base[hc + j]);
        }
        let c = &mut comb[t * hc * hc..(t + 1) * hc * hc];
        for (i, v) in c.iter_mut().enumerate() {
            *v = mx[2 * hc + i] * w.scale[2] + w.base[2 * hc + i];
        }
        sinkhorn(c, hc, p.sinkhorn_iters, p.hc_eps);
    }
    Ok(Mix {
        collapsed: collapse(cx, x, &pre, hc, d),
        post,
        comb,
    })
}

/// Softmax over each source's destinations, `+ eps`, then alternating normalization of the
/// destinations' columns and the sources' rows (columns first and last), every denominator
/// `sum + eps` (DeepSeek's reference).
fn sinkhorn(c: &mut [f32], hc: usize, iters: usize, eps: f32) {
    for row in c.chunks_exact_mut(hc) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for v in row.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        for v in row.iter_mut() {
            *v = *v / sum + eps;
        }
    }
    let norm_cols = |c: &mut [f32]| {
        for k in 0..hc {
            let s: f32 = (0..hc).map(|j| c[j * hc + k]).sum::<f32>() + eps;
            for j in 0..hc {
                c[j * hc + k] /= s;
            }
        }
    };
    norm_cols(c);
    for _ in 1..iters {
        for row in c.chunks_exact_mut(hc) {
            let s: f32 = row.iter().sum::<f32>() + eps;
            for v in row.iter_mut() {
                *v /= s;
            }
        }
        norm_cols(c);
    }
}

/// `x ← post ⊗ y + combᵀ · x` per token (`y` is the block output, `n × d`).
pub(crate) fn hc_post(cx: &Compute, x: &mut [f32], y: &[f64], mix: &Mix, hc: usize) {
    let n = mix.post.len() / hc;
    let wide = x.len() / n.max(1);
    let d = wide / hc;
    cx.par_rows(x, wide, |first, rows| {
        let mut old = vec![0f32; wide];
        for (j, row) in rows.chunks_exact_mut(wide).enumerate() {
            let t = first + j;
            old.copy_from_slice(row);
            let post = &mix.post[t * hc..(t + 1) * hc];
            let comb = &mix.comb[t * hc * hc..(t + 1) * hc * hc];
            let yt = &y[t * d..(t + 1) * d];
            for k in 0..hc {
                let out = &mut row[k * d..(k + 1) * d];
                for (i, o) in out.iter_mut().enumerate() {
                    let mut v = post[k] * yt[i] as f32;
                    for src in 0..hc {
                        v += comb[src * hc + k] * old[src * d + i];
                    }
                    *o = v;
                }
            }
        }
    });
}

impl Model {
    /// Collapses the streams of each head row (`rows × hc·d`) into `rows × d` (the head's
    /// hyper-connection: `pre` weights only), for the output norm.
    pub(crate) fn dsv4_head_collapse(&self, cx: &Compute, x: &[f32]) -> Result<Vec<f32>> {
        let _span = span(Phase::HyperMix);
        let hp = &self.hp;
        let p = hp.dsv4.as_ref().expect("deepseek4 hparams");
        let w = self
            .hc_head
            .as_ref()
            .ok_or_else(|| self.not_held("the output hyper-connection"))?;
        let mixes = mix_logits(cx, self, x, w, hp.rms_eps)?;
        let pre: Vec<f32> = mixes
            .chunks_exact(p.hc)
            .flat_map(|mx| (0..p.hc).map(|j| sigmoid(mx[j] * w.scale[0] + w.base[j]) + p.hc_eps))
            .collect();
        Ok(collapse(cx, x, &pre, p.hc, hp.n_embd))
    }
}

impl Model {
    /// A block's output `out` (this rank's partial sum when `split`) summed across ranks at
    /// `point`, then spread back over the streams `x` with `mix`'s post weights.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn hc_merge_block(
        &self,
        cx: &Compute,
        il: usize,
        x: &mut [f32],
        out: &mut [f64],
        mix: &Mix,
        hc: usize,
        point: ReducePoint,
        split: bool,
        hooks: &mut dyn Hooks,
    ) -> Result<()> {
        if split {
            timed(Phase::AllReduce, || hooks.all_reduce(il, point, out))?;
        }
        timed(Phase::HyperMix, || hc_post(cx, x, out, mix, hc));
        Ok(())
    }
}
