//! DeepSeek V4's layer (`deepseek4`): the residual is `hc` streams of `n_embd`; around each
//! block a hyper-connection mix collapses them into the block's input and spreads its output
//! back (Sinkhorn-normalized stream mixing). Attention has one shared key/value head (keys are
//! the values), rope on the trailing `n_rot` dims with the inverse rope on the output, a raw
//! sliding window on every layer plus the compressed rows of ratio-4 layers (those the
//! lightning indexer picks) or ratio-128 layers (all that are complete), learned sinks and a
//! grouped low-rank output projection. The FFN is sqrt-softplus routed experts (the first
//! layers hash-routed by token id) plus a shared expert, both with the clamped SwiGLU.
//!
//! Semantics follow DeepSeek's reference as transformers 5.24 computes it in float32 (the
//! simulated FP8/FP4 activation rounding of DeepSeek's own inference code is not applied; see
//! docs/models.md).
//!
//! `hyper`: the stream mixes; `attention`: the attention block; `compress`: the compressors'
//! pooled rows. This file: the layer, its FFN, and what they share.

mod attention;
mod compress;
pub(crate) mod hyper;

use kernels::Input;

use crate::Model;
use crate::arch::Glu;
use crate::blocks::Compute;
use crate::blocks::moe::{ExpertFfn, Routing, moe_ffn, route_tokens, softplus};
use crate::blocks::rope::RopeTable;
use crate::error::{ModelError, Result};
use crate::experts::ExpertSource;
use crate::hparams::Hparams;
use crate::pass::{Hooks, ReducePoint, SeqInput, keep_rows};
use crate::profile::{Phase, span, timed};
use crate::weights::Ffn;
use hyper::hc_pre;

/// The rope tables of a batch: sliding layers rotate with the main base, compressed layers
/// (queries, keys, indexer queries) with the compressed one.
pub(crate) struct Dsv4Ropes {
    pub main: RopeTable,
    pub compress: RopeTable,
}

impl Dsv4Ropes {
    pub fn new(hp: &Hparams, positions: &[usize]) -> Dsv4Ropes {
        let p = hp.dsv4.as_ref().expect("deepseek4 hparams");
        Dsv4Ropes {
            main: RopeTable::new(&hp.rope, None, positions),
            compress: RopeTable::new(&p.compress_rope, None, positions),
        }
    }
}

/// `x / sqrt(mean(x²) + eps)` (no weight).
pub(super) fn unit_rms(x: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    let scale = 1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt();
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v * scale;
    }
}

pub(super) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Rotates (or, `inverse`, rotates back) the trailing `n_rot` dims of every `head_dim` head of
/// `row` by row `t` of `table` (consecutive pairs).
pub(super) fn rope_tail(
    table: &RopeTable,
    t: usize,
    row: &mut [f32],
    head_dim: usize,
    n_rot: usize,
    inverse: bool,
) {
    for head in row.chunks_exact_mut(head_dim) {
        let tail = &mut head[head_dim - n_rot..];
        if inverse {
            table.apply_inverse(t, tail);
        } else {
            table.apply(crate::arch::RopeKind::Norm, t, tail, n_rot);
        }
    }
}

impl Model {
    /// The glu of the routed (`shared` false) or shared experts.
    fn dsv4_glu(&self, shared: bool) -> Glu {
        let p = self.hp.dsv4.as_ref().expect("deepseek4 hparams");
        let limit = if shared {
            p.swiglu_limit_shexp
        } else {
            p.swiglu_limit
        };
        if limit > 1e-6 {
            Glu::ClampedSilu { limit }
        } else {
            Glu::Silu
        }
    }

    /// One DeepSeek V4 layer over the streams `x` (`n × hc·n_embd`); with `keep`, only those
    /// batch rows go on past the attention (see `forward::final_rows`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dsv4_layer(
        &self,
        cx: &Compute,
        il: usize,
        x: &mut Vec<f32>,
        tokens: Option<&[u32]>,
        keep: Option<&[usize]>,
        seqs: &mut [SeqInput],
        pos0: &[usize],
        ropes: &Dsv4Ropes,
        experts: &dyn ExpertSource,
        hooks: &mut dyn Hooks,
    ) -> Result<()> {
        let hp = &self.hp;
        let p = hp.dsv4.as_ref().expect("deepseek4 hparams");
        let l = self.held_layer(il)?;
        let crate::weights::AttentionWeights::Dsv4(a) = &l.attn else {
            return Err(ModelError::Input(format!(
                "layer {il} is not a DeepSeek V4 layer"
            )));
        };
        let d = hp.n_embd;
        let mix = timed(Phase::HyperMix, || {
            hc_pre(cx, self, x, &a.hc_attn, p.into(), hp.rms_eps)
        })?;
        let n = mix.collapsed.len() / d;
        let mut h = vec![0f32; n * d];
        cx.rms_norm_rows(&mix.collapsed, &a.norm, hp.rms_eps, &mut h);
        hooks.observe(Some(il), "attn_norm", &h);
        let mut att = self.dsv4_attention(cx, il, a, &h, seqs, pos0, ropes, hooks)?;
        let split = self.shard.attention_split;
        let point = ReducePoint::AttentionOutput;
        self.hc_merge_block(cx, il, x, &mut att, &mix, p.hc, point, split, hooks)?;
        hooks.observe(Some(il), "hc_attn_post", x);
        let kept_tokens: Option<Vec<u32>>;
        let mut tokens = tokens;
        if let Some(rows) = keep {
            keep_rows(x, rows, p.hc * d);
            h.truncate(rows.len() * d);
            kept_tokens = tokens.map(|t| rows.iter().map(|&r| t[r]).collect());
            tokens = kept_tokens.as_deref();
            if rows.is_empty() {
                return Ok(());
            }
        }

        let mix = timed(Phase::HyperMix, || {
            hc_pre(cx, self, x, &a.hc_ffn, p.into(), hp.rms_eps)
        })?;
        cx.rms_norm_rows(&mix.collapsed, &l.ffn_norm, hp.rms_eps, &mut h);
        hooks.observe(Some(il), "ffn_norm", &h);
        if experts.lookahead() {
            // The next layer's experts, guessed from this layer's collapsed FFN input (its
            // own input is one stream mix away), so reads overlap this layer's work.
            self.prefetch_next_layer(cx, il, &mix.collapsed, experts)?;
        }
        let mut out = self.dsv4_ffn(cx, il, &h, tokens, experts, hooks)?;
        let split = self.shard.is_split();
        let point = ReducePoint::FfnOutput;
        self.hc_merge_block(cx, il, x, &mut out, &mix, p.hc, point, split, hooks)?;
        Ok(())
    }

    /// Routed experts (hash- or score-selected) plus the shared expert, as a partial sum of
    /// this rank's experts.
    fn dsv4_ffn(
        &self,
        cx: &Compute,
        il: usize,
        h: &[f32],
        tokens: Option<&[u32]>,
        experts: &dyn ExpertSource,
        hooks: &mut dyn Hooks,
    ) -> Result<Vec<f64>> {
        let hp = &self.hp;
        let d = hp.n_embd;
        let n = h.len() / d;
        let Ffn::Moe {
            router,
            selection_bias,
            experts: tensors,
            shared,
            hash_routes,
            ..
        } = &self.held_layer(il)?.ffn
        else {
            return Err(ModelError::Input(format!("layer {il} has no experts")));
        };
        let moe = hp.moe.as_ref().expect("MoE layers have MoE params");
        let hin = Input::new(h, n, d)?;
        let logits = timed(Phase::Router, || {
            cx.project(&hin, &[router.weights(self.files())])
        })?
        .pop()
        .expect("router");
        hooks.observe(Some(il), "ffn_moe_logits", &logits);
        let n_expert = tensors.gate.n_expert;
        let routing = match hash_routes {
            Some(table) => {
                let tokens = tokens.ok_or_else(|| {
                    ModelError::Input(format!(
                        "layer {il} routes by token id and the hidden-state input came without \
                         the batch's token ids"
                    ))
                })?;
                let k = moe.n_expert_used;
                let mut r = Routing {
                    k,
                    experts: Vec::with_capacity(n * k),
                    weights: Vec::with_capacity(n * k),
                };
                for (t, &tok) in tokens.iter().enumerate() {
                    let ids = table
                        .get(tok as usize * k..(tok as usize + 1) * k)
                        .ok_or_else(|| {
                            ModelError::Input(format!("token id {tok} outside the hash table"))
                        })?;
                    let scores: Vec<f32> = ids
                        .iter()
                        .map(|&e| softplus(logits[t * n_expert + e as usize]).sqrt())
                        .collect();
                    let sum: f32 = scores.iter().sum();
                    for (&e, &s) in ids.iter().zip(&scores) {
                        r.experts.push(e as usize);
                        let w = if moe.norm_topk { s / sum } else { s };
                        r.weights.push(w * moe.weights_scale);
                    }
                }
                r
            }
            None => timed(Phase::Route, || {
                route_tokens(cx, &logits, n_expert, moe, selection_bias.as_deref())
            }),
        };
        let kind = ExpertFfn {
            glu: self.dsv4_glu(false),
            biases: None,
        };
        let mut out =
            moe_ffn(cx, il, &hin, &routing, n_expert, d, &kind, experts).map_err(|e| match e {
                ModelError::Matmul(source) => ModelError::Kernel { layer: il, source },
                other => other,
            })?;
        if let Some(sh) = shared {
            let _shared = span(Phase::DenseFfn);
            let s = self.split_glu(cx, &hin, &sh.gate, &sh.up, &sh.down, self.dsv4_glu(true))?;
            for (a, b) in out.iter_mut().zip(&s) {
                *a += b;
            }
        }
        Ok(out)
    }
}
