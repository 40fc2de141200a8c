//! GLM-5.3 Flash's tensors: per layer the two stream mixes, then either a KDA block or a
//! nope-only latent-attention block with (on full-indexer layers) its k-pool indexer.

use super::{Binder, FfnLayout, HyperMix, Layer, Matrix, MlaAttention};
use crate::arch::ArchSpec;
use crate::error::{Result, bad_tensor};
use crate::hparams::{Glm5LayerKind, Hparams};
use crate::names::TensorName;

/// A KDA block: q/k/v projections, each with its short causal depthwise convolution, the
/// low-rank log-decay and output-gate projections, the per-head write strength `beta`, the
/// gated RMSNorm and the output projection.
#[derive(Clone, Debug)]
pub struct KdaWeights {
    pub q: Matrix,
    pub k: Matrix,
    pub v: Matrix,
    /// Per channel of q, k, v (`kda_width` each): `conv_kernel` taps, oldest first.
    pub conv: [Vec<f32>; 3],
    /// Per head `e^{A_log}` (the file stores `ssm_a = −e^{A_log}`).
    pub decay_rate: Vec<f32>,
    pub f_a: Matrix,
    pub f_b: Matrix,
    pub dt_bias: Vec<f32>,
    pub beta: Matrix,
    pub g_a: Matrix,
    pub g_b: Matrix,
    /// Weight of the per-head RMSNorm of the output (`kda_head_dim`).
    pub out_norm: Vec<f32>,
    pub o: Matrix,
}

/// The k-pool lightning indexer of a full-indexer latent layer.
#[derive(Clone, Debug)]
pub struct KpoolIndexer {
    /// `q_lora_rank` → `index_n_head × index_head_dim`.
    pub q_b: Matrix,
    /// `n_embd` → `index_head_dim`, then LayerNorm with `k_norm` and `k_norm_bias`.
    pub k: Matrix,
    pub k_norm: Vec<f32>,
    pub k_norm_bias: Vec<f32>,
    /// `n_embd` → `index_n_head` head weights.
    pub proj: Matrix,
    /// `n_embd` → `index_head_dim` pooling scores.
    pub gate: Matrix,
    /// `kpool` rows of `index_head_dim`: added to the pooling scores by place in the pool.
    pub ape: Vec<f32>,
}

#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum Glm5Block {
    Kda(KdaWeights),
    Mla {
        mla: MlaAttention,
        indexer: Option<KpoolIndexer>,
    },
}

#[derive(Clone, Debug)]
pub struct Glm5NextAttention {
    pub norm: Vec<f32>,
    pub block: Glm5Block,
    pub hc_attn: HyperMix,
    pub hc_ffn: HyperMix,
}

impl Glm5NextAttention {
    pub fn o(&self) -> &Matrix {
        match &self.block {
            Glm5Block::Kda(k) => &k.o,
            Glm5Block::Mla { mla, .. } => &mla.o,
        }
    }
}

/// `blk.{il}.{suffix}` for the names without a `.weight` ending.
fn blk(il: usize, suffix: &str) -> String {
    format!("blk.{il}.{suffix}")
}

impl<'m> Binder<'m> {
    fn glm5_mix(&self, [f, b, s]: [TensorName; 3], il: usize, hp: &Hparams) -> Result<HyperMix> {
        let hc = hp.glm5next.as_ref().expect("glm5-next hparams").hc;
        let rows = (2 + hc) * hc;
        Ok(HyperMix {
            fn_: self.matrix(&f.weight(il), hc * hp.n_embd, rows)?,
            base: self.vector(&b.weight(il), rows)?,
            scale: self.vector(&s.weight(il), 3)?,
        })
    }

    /// A depthwise convolution stored `[taps, 1, channels, 1]`: per channel its taps.
    fn depthwise_conv(&self, name: &str, taps: usize, channels: usize) -> Result<Vec<f32>> {
        let t = self.require(name)?;
        let dims: Vec<usize> = t.info.shape.dims().iter().map(|&d| d as usize).collect();
        let ok = dims.first() == Some(&taps)
            && dims.get(2) == Some(&channels)
            && dims.iter().product::<usize>() == taps * channels;
        if !ok {
            return Err(bad_tensor(
                name,
                format!("shape {dims:?}, expected [{taps}, 1, {channels}, 1]"),
            ));
        }
        self.values_of(name, &t, taps * channels)
    }

    fn kda_block(&self, hp: &Hparams, il: usize) -> Result<KdaWeights> {
        use TensorName as T;
        let p = hp.glm5next.as_ref().expect("glm5-next hparams");
        let (d, width, nh) = (hp.n_embd, p.kda_width(), p.kda_n_head);
        let f_a = self.matrix_any_rows(&blk(il, "ssm_f_a.weight"), d)?;
        let g_a = self.matrix_any_rows(&blk(il, "ssm_g_a.weight"), d)?;
        let conv = |name: &str| self.depthwise_conv(&blk(il, name), p.conv_kernel, width);
        let ssm_a = self.vector(&blk(il, "ssm_a"), nh)?;
        Ok(KdaWeights {
            q: self.matrix(&T::AttnQ.weight(il), d, width)?,
            k: self.matrix(&T::AttnK.weight(il), d, width)?,
            v: self.matrix(&T::AttnV.weight(il), d, width)?,
            conv: [
                conv("ssm_conv1d_q.weight")?,
                conv("ssm_conv1d_k.weight")?,
                conv("ssm_conv1d_v.weight")?,
            ],
            decay_rate: ssm_a.iter().map(|a| -a).collect(),
            f_b: self.matrix(&blk(il, "ssm_f_b.weight"), f_a.rows, width)?,
            f_a,
            dt_bias: self.vector(&blk(il, "ssm_dt.bias"), width)?,
            beta: self.matrix(&blk(il, "ssm_beta.weight"), d, nh)?,
            g_b: self.matrix(&blk(il, "ssm_g_b.weight"), g_a.rows, width)?,
            g_a,
            out_norm: self.vector(&blk(il, "ssm_norm.weight"), p.kda_head_dim)?,
            o: self.matrix(&T::AttnOut.weight(il), width, d)?,
        })
    }

    fn kpool_indexer(&self, hp: &Hparams, il: usize) -> Result<KpoolIndexer> {
        let p = hp.glm5next.as_ref().expect("glm5-next hparams");
        let m = hp.mla.as_ref().expect("glm5-next has latent attention");
        let (d, dh) = (hp.n_embd, p.index_head_dim);
        Ok(KpoolIndexer {
            q_b: self.matrix(
                &blk(il, "indexer.attn_q_b.weight"),
                m.q_lora_rank,
                p.index_n_head * dh,
            )?,
            k: self.matrix(&blk(il, "indexer.attn_k.weight"), d, dh)?,
            k_norm: self.vector(&blk(il, "indexer.k_norm.weight"), dh)?,
            k_norm_bias: self.vector(&blk(il, "indexer.k_norm.bias"), dh)?,
            proj: self.matrix(&blk(il, "indexer.proj.weight"), d, p.index_n_head)?,
            gate: self.matrix(&blk(il, "indexer_compressor_gate.weight"), d, dh)?,
            ape: self.vector_rows(&blk(il, "indexer_compressor_ape.weight"), dh, p.kpool)?,
        })
    }

    /// GLM-5.3 Flash's layer `il`.
    pub(super) fn glm5next_layer(&self, spec: &ArchSpec, hp: &Hparams, il: usize) -> Result<Layer> {
        use TensorName as T;
        let p = hp.glm5next.as_ref().expect("glm5-next hparams");
        let block = match p.kind(il) {
            Glm5LayerKind::Kda => Glm5Block::Kda(self.kda_block(hp, il)?),
            Glm5LayerKind::Mla { indexer } => Glm5Block::Mla {
                mla: self.mla_attention(hp, il)?,
                indexer: indexer.then(|| self.kpool_indexer(hp, il)).transpose()?,
            },
        };
        let attn = super::AttentionWeights::Glm5Next(Box::new(Glm5NextAttention {
            norm: self.vector(&T::AttnNorm.weight(il), hp.n_embd)?,
            block,
            hc_attn: self.glm5_mix([T::HcAttnFn, T::HcAttnBase, T::HcAttnScale], il, hp)?,
            hc_ffn: self.glm5_mix([T::HcFfnFn, T::HcFfnBase, T::HcFfnScale], il, hp)?,
        }));
        let routed = match spec.ffn {
            FfnLayout::Moe => true,
            FfnLayout::MoeWhenRouted => self.get(&T::FfnGateInp.weight(il)).is_some(),
        };
        self.ffn_layer(spec, hp, il, attn, routed)
    }
}
