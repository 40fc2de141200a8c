//! GLM-5.3 Flash's layer (`glm5-next`): the residual is `hc` streams of `n_embd` mixed around
//! each block by DeepSeek V4's hyper-connections (`crate::dsv4::hyper`); the attention block is
//! either KDA linear attention (`kda`) or nope-only latent attention over the tokens the k-pool
//! lightning indexer selects (`attention`, `indexer`); the FFN is dense (leading layers) or
//! sigmoid-routed experts plus a shared expert, all with the clamped SwiGLU. The head takes
//! the plain mean of the streams.
//!
//! Semantics follow transformers 5.24 (`Glm5NextForConditionalGeneration`, text model), which
//! llama.cpp matches; see `tools/fixtures/models/README.md` and docs/models.md.

mod attention;
mod indexer;
mod kda;

use std::ops::RangeInclusive;

use kernels::Input;

use crate::Model;
use crate::arch::Glu;
use crate::blocks::Compute;
use crate::blocks::moe::{ExpertFfn, moe_ffn, route_tokens};
use crate::dsv4::hyper::{HcShape, hc_pre};
use crate::error::{ModelError, Result};
use crate::experts::ExpertSource;
use crate::hparams::{Glm5LayerKind, Glm5NextParams};
use crate::kv::{HybridLayers, LayerMemory};
use crate::pass::{Hooks, ReducePoint, SeqInput, keep_rows};
use crate::profile::{Phase, span, timed};
use crate::shard::Shard;
use crate::weights::{AttentionWeights, Ffn, Glm5Block};

/// Per batch row, the positions its query attends to in the latent layers that reuse an
/// indexer's selection (the shared layers), ascending.
pub(crate) type Selection = Vec<Vec<u32>>;

pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

impl From<&Glm5NextParams> for HcShape {
    fn from(p: &Glm5NextParams) -> HcShape {
        HcShape {
            hc: p.hc,
            sinkhorn_iters: p.sinkhorn_iters,
            hc_eps: p.hc_eps,
        }
    }
}

/// Refuses a carried selection that is not one row per batch row of positions each row's query
/// sees (it comes from another process).
fn check_carried(sel: &Selection, seqs: &[SeqInput], pos0: &[usize]) -> Result<()> {
    let n: usize = seqs.iter().map(|s| s.n_tokens).sum();
    let mut rows = sel.iter();
    let bad = sel.len() != n
        || seqs.iter().zip(pos0).any(|(s, &p0)| {
            (0..s.n_tokens).any(|t| {
                rows.next()
                    .is_none_or(|r| r.iter().any(|&q| q as usize > p0 + t))
            })
        });
    if bad {
        return Err(ModelError::Input(format!(
            "the carried indexer selection ({} rows) does not fit the batch's {n} rows and positions",
            sel.len()
        )));
    }
    Ok(())
}

/// What each of `layers` keeps in the cache of a rank with `shard`'s heads.
pub(crate) fn cache_layers(
    p: &Glm5NextParams,
    shard: &Shard,
    layers: RangeInclusive<usize>,
) -> HybridLayers {
    HybridLayers {
        layers: layers
            .map(|il| match p.kind(il) {
                Glm5LayerKind::Kda => LayerMemory::Recurrent {
                    n_head: shard.heads.len(),
                    head_dim: p.kda_head_dim,
                    conv_taps: p.conv_kernel - 1,
                },
                Glm5LayerKind::Mla { indexer: true } => LayerMemory::RowsAndIndexKeys {
                    width: p.index_head_dim,
                    pool: p.kpool,
                },
                Glm5LayerKind::Mla { indexer: false } => LayerMemory::Rows,
            })
            .collect(),
    }
}

/// The head's collapse: each row of `hc` streams of `d` to their mean.
pub(crate) fn mean_of_streams(h: &[f32], hc: usize, d: usize) -> Vec<f32> {
    let _span = span(Phase::HyperMix);
    let wide = hc * d;
    let mut out = Vec::with_capacity(h.len() / hc.max(1));
    for row in h.chunks_exact(wide) {
        for i in 0..d {
            let sum: f32 = (0..hc).map(|s| row[s * d + i]).sum();
            out.push(sum / hc as f32);
        }
    }
    out
}

impl Model {
    fn glm5_params(&self) -> &Glm5NextParams {
        self.hp.glm5next.as_ref().expect("glm5-next hparams")
    }

    /// The clamped SwiGLU of the routed experts, or (`shared`) of the shared expert and the
    /// dense FFN (llama.cpp applies the shared limit to the dense layers too).
    fn glm5_glu(&self, shared: bool) -> Glu {
        let p = self.glm5_params();
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

    /// Whether the first latent layer from `il` on reuses an earlier layer's selection (a pass
    /// starting there needs the selection handed on by the stage before).
    fn reuses_selection_from(&self, il: usize) -> bool {
        let p = self.glm5_params();
        (il..self.hp.n_layer)
            .map(|j| p.kind(j))
            .find(|k| matches!(k, Glm5LayerKind::Mla { .. }))
            == Some(Glm5LayerKind::Mla { indexer: false })
    }

    /// Layers `layers` over the streams `x` (`n × hc·n_embd`). A shared latent layer reuses the
    /// selection of the last layer before it that ran the indexer, KDA layers in between; across
    /// a pipeline stage boundary the selection travels with the hidden state (`carried` in, the
    /// result out when the next stage's first latent layer reuses it).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn glm5next_layers(
        &self,
        cx: &Compute,
        layers: RangeInclusive<usize>,
        x: &mut Vec<f32>,
        seqs: &mut [SeqInput],
        pos0: &[usize],
        experts: &dyn ExpertSource,
        carried: Option<Selection>,
        trim: Option<(usize, &[usize])>,
        hooks: &mut dyn Hooks,
    ) -> Result<Option<Selection>> {
        let (first, last) = (*layers.start(), *layers.end());
        let mut selection: Option<Selection> = None;
        if self.reuses_selection_from(first) {
            selection = carried;
            if let Some(sel) = &selection {
                check_carried(sel, seqs, pos0)?;
            }
        }
        for il in layers {
            let keep = trim.filter(|&(last, _)| il == last).map(|(_, kept)| kept);
            self.glm5next_layer(cx, il, x, keep, seqs, pos0, &mut selection, experts, hooks)?;
            hooks.observe(Some(il), "l_out", x);
        }
        let hands_on = last + 1 < self.hp.n_layer && self.reuses_selection_from(last + 1);
        Ok(selection.filter(|_| hands_on))
    }

    #[allow(clippy::too_many_arguments)]
    fn glm5next_layer(
        &self,
        cx: &Compute,
        il: usize,
        x: &mut Vec<f32>,
        keep: Option<&[usize]>,
        seqs: &mut [SeqInput],
        pos0: &[usize],
        selection: &mut Option<Selection>,
        experts: &dyn ExpertSource,
        hooks: &mut dyn Hooks,
    ) -> Result<()> {
        let hp = &self.hp;
        let p = self.glm5_params();
        let l = self.held_layer(il)?;
        let AttentionWeights::Glm5Next(a) = &l.attn else {
            return Err(ModelError::Input(format!(
                "layer {il} is not a GLM-5.3 Flash layer"
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
        let mut att = match &a.block {
            Glm5Block::Kda(w) => self.kda_block(cx, il, w, &h, seqs, pos0, hooks)?,
            Glm5Block::Mla { mla, indexer } => self.indexed_mla(
                cx,
                il,
                mla,
                indexer.as_ref(),
                &h,
                seqs,
                pos0,
                selection,
                hooks,
            )?,
        };
        let split = self.shard.attention_split;
        let point = ReducePoint::AttentionOutput;
        self.hc_merge_block(cx, il, x, &mut att, &mix, p.hc, point, split, hooks)?;
        hooks.observe(Some(il), "hc_attn_post", x);
        if let Some(rows) = keep {
            keep_rows(x, rows, p.hc * d);
            h.truncate(rows.len() * d);
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
            // The next layer's experts, guessed from this layer's collapsed FFN input.
            self.prefetch_next_layer(cx, il, &mix.collapsed, experts)?;
        }
        let mut out = self.glm5next_ffn(cx, il, &h, experts, hooks)?;
        let split = self.shard.is_split();
        let point = ReducePoint::FfnOutput;
        self.hc_merge_block(cx, il, x, &mut out, &mix, p.hc, point, split, hooks)?;
        Ok(())
    }

    /// The dense FFN, or routed experts plus the shared expert, as this rank's partial sum.
    fn glm5next_ffn(
        &self,
        cx: &Compute,
        il: usize,
        h: &[f32],
        experts: &dyn ExpertSource,
        hooks: &mut dyn Hooks,
    ) -> Result<Vec<f64>> {
        let hp = &self.hp;
        let d = hp.n_embd;
        let n = h.len() / d;
        let hin = Input::new(h, n, d)?;
        match &self.held_layer(il)?.ffn {
            Ffn::Dense { gate, up, down } => timed(Phase::DenseFfn, || {
                self.split_glu(cx, &hin, gate, up, down, self.glm5_glu(true))
            }),
            Ffn::Moe {
                router,
                selection_bias,
                experts: tensors,
                shared,
                ..
            } => {
                let moe = hp.moe.as_ref().expect("MoE layers have MoE params");
                let logits = timed(Phase::Router, || {
                    cx.project(&hin, &[router.weights(self.files())])
                })?
                .pop()
                .expect("router");
                hooks.observe(Some(il), "ffn_moe_logits", &logits);
                let n_expert = tensors.gate.n_expert;
                let routing = timed(Phase::Route, || {
                    route_tokens(cx, &logits, n_expert, moe, selection_bias.as_deref())
                });
                let kind = ExpertFfn {
                    glu: self.glm5_glu(false),
                    biases: None,
                };
                let mut out = moe_ffn(cx, il, &hin, &routing, n_expert, d, &kind, experts)
                    .map_err(|e| match e {
                        ModelError::Matmul(source) => ModelError::Kernel { layer: il, source },
                        other => other,
                    })?;
                if let Some(sh) = shared {
                    let _shared = span(Phase::DenseFfn);
                    let s =
                        self.split_glu(cx, &hin, &sh.gate, &sh.up, &sh.down, self.glm5_glu(true))?;
                    for (a, b) in out.iter_mut().zip(&s) {
                        *a += b;
                    }
                }
                Ok(out)
            }
        }
    }
}
