//! GLM-5.3 Flash's keys (`glm5-next`) on top of the common ones: which layers are KDA linear
//! attention and which latent attention, which latent layers run the k-pool indexer, the KDA
//! sizes, the hyper-connections and the SwiGLU clamp.

use gguf::Metadata;

use super::{Hparams, bad};
use crate::error::Result;

/// Key suffixes only this architecture's converter writes.
mod key {
    pub const LAYER_NORM_EPS: &str = "attention.layer_norm_epsilon";
    pub const CONV_KERNEL: &str = "ssm.conv_kernel";
    pub const KDA_HEAD_DIM: &str = "kda.head_dim";
    pub const KDA_GATE_LOWER_BOUND: &str = "kda.gate_lower_bound";
    pub const INDEXER_KPOOL: &str = "attention.indexer.kpool";
    pub const INDEXER_KPOOL_SELECT_TAIL: &str = "attention.indexer.kpool_select_tail";
    pub const INDEXER_TYPES: &str = "attention.indexer.types";
}

/// What a layer's attention block is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Glm5LayerKind {
    /// Kimi delta attention: a recurrent state per head instead of per-position rows.
    Kda,
    /// Nope-only latent attention over the tokens the indexer selected; `indexer` false: the
    /// layer reuses the selection of the last layer that ran one.
    Mla { indexer: bool },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Glm5NextParams {
    pub hc: usize,
    pub sinkhorn_iters: usize,
    pub hc_eps: f32,
    /// Per layer.
    pub kinds: Vec<Glm5LayerKind>,
    pub kda_n_head: usize,
    pub kda_head_dim: usize,
    /// Taps of the short causal convolution (the current token is the last).
    pub conv_kernel: usize,
    /// The log-decay is `gate_lower_bound · sigmoid(·)`.
    pub gate_lower_bound: f32,
    pub index_n_head: usize,
    pub index_head_dim: usize,
    /// Tokens a query attends to at most through chosen pools (`index_topk / kpool` pools).
    pub index_topk: usize,
    /// Tokens per pool.
    pub kpool: usize,
    /// The incomplete pool at the query is always attended.
    pub select_tail: bool,
    /// The indexer keys' LayerNorm.
    pub layer_norm_eps: f32,
    pub swiglu_limit: f32,
    pub swiglu_limit_shexp: f32,
}

impl Glm5NextParams {
    pub fn kind(&self, il: usize) -> Glm5LayerKind {
        self.kinds.get(il).copied().unwrap_or(Glm5LayerKind::Kda)
    }

    /// Pools each query picks.
    pub fn pools_chosen(&self) -> usize {
        self.index_topk / self.kpool
    }

    /// Values per position of one KDA projection (q, k or v) over all heads.
    pub fn kda_width(&self) -> usize {
        self.kda_n_head * self.kda_head_dim
    }
}

/// `attention.head_count_kv` is an array here (0 marks a KDA layer): the latent layers' one
/// kv head, for the common fields.
pub(super) fn kv_heads_of_array(meta: &Metadata) -> Result<Option<usize>> {
    let full = meta.arch_key(crate::names::keys::HEAD_COUNT_KV)?;
    match meta.get(&full) {
        Some(gguf::Value::Array(_)) => Ok(meta
            .arch_u32_array(crate::names::keys::HEAD_COUNT_KV)?
            .iter()
            .copied()
            .max()
            .map(|v| v as usize)),
        _ => Ok(None),
    }
}

pub(super) fn glm5next_params(meta: &Metadata, mut hp: Hparams) -> Result<Hparams> {
    use crate::names::keys;
    let u = |s: &str| -> Result<usize> { Ok(meta.arch_u32(s)? as usize) };
    let kv_per_layer = meta.arch_u32_array(keys::HEAD_COUNT_KV)?;
    if kv_per_layer.len() < hp.n_layer {
        return Err(bad(
            meta,
            keys::HEAD_COUNT_KV,
            format!("{} entries for {} layers", kv_per_layer.len(), hp.n_layer),
        ));
    }
    let index_full: Vec<bool> = {
        let full = meta.arch_key(key::INDEXER_TYPES)?;
        match meta.get(&full) {
            Some(gguf::Value::Array(gguf::Array::Bool(flags))) if flags.len() >= hp.n_layer => {
                flags.clone()
            }
            Some(_) => {
                return Err(bad(
                    meta,
                    key::INDEXER_TYPES,
                    format!("expected one bool per layer ({})", hp.n_layer),
                ));
            }
            // Without the key every latent layer runs its own indexer.
            None => vec![true; hp.n_layer],
        }
    };
    let kinds: Vec<Glm5LayerKind> = (0..hp.n_layer)
        .map(|il| match kv_per_layer[il] {
            0 => Glm5LayerKind::Kda,
            _ => Glm5LayerKind::Mla {
                indexer: index_full[il],
            },
        })
        .collect();
    if let Some(first_mla) = kinds
        .iter()
        .find(|k| matches!(k, Glm5LayerKind::Mla { .. }))
        && *first_mla == (Glm5LayerKind::Mla { indexer: false })
    {
        return Err(bad(
            meta,
            key::INDEXER_TYPES,
            "the first latent layer reuses a selection no layer before it made",
        ));
    }
    let per_layer_f32 = |k: &str| -> Result<Option<f32>> {
        let full = meta.arch_key(k)?;
        Ok(match meta.get(&full) {
            None => None,
            Some(gguf::Value::Array(gguf::Array::F32(v))) => v.first().copied(),
            Some(_) => meta.arch_f32_opt(k)?,
        })
    };
    let swiglu_limit = per_layer_f32(keys::SWIGLU_CLAMP_EXP)?.unwrap_or(0.0);
    let swiglu_limit_shexp = per_layer_f32(keys::SWIGLU_CLAMP_SHEXP)?.unwrap_or(swiglu_limit);
    let hc = u(keys::HC_COUNT)?;
    if hc == 0 {
        return Err(bad(meta, keys::HC_COUNT, "zero hyper-connection streams"));
    }
    let kda_head_dim = u(key::KDA_HEAD_DIM)?;
    let conv_kernel = u(key::CONV_KERNEL)?;
    if kda_head_dim == 0 || conv_kernel == 0 {
        return Err(bad(meta, key::KDA_HEAD_DIM, "zero KDA head size or kernel"));
    }
    let index_topk = u(keys::INDEXER_TOP_K)?;
    let kpool = u(key::INDEXER_KPOOL)?;
    if kpool == 0 || !index_topk.is_multiple_of(kpool) {
        return Err(bad(
            meta,
            key::INDEXER_KPOOL,
            format!("pools of {kpool} for a top-k of {index_topk}"),
        ));
    }
    if hp.rope.n_rot != 0 {
        return Err(bad(
            meta,
            keys::ROPE_DIMENSION_COUNT,
            "GLM-5.3 Flash's attention has no rope",
        ));
    }
    hp.glm5next = Some(Glm5NextParams {
        hc,
        sinkhorn_iters: u(keys::HC_SINKHORN_ITERS)?,
        hc_eps: meta.arch_f32(keys::HC_EPS)?,
        kinds,
        kda_n_head: hp.n_head,
        kda_head_dim,
        conv_kernel,
        gate_lower_bound: meta.arch_f32(key::KDA_GATE_LOWER_BOUND)?,
        index_n_head: u(keys::INDEXER_HEAD_COUNT)?,
        index_head_dim: u(keys::INDEXER_KEY_LENGTH)?,
        index_topk,
        kpool,
        select_tail: meta
            .arch_bool_opt(key::INDEXER_KPOOL_SELECT_TAIL)?
            .unwrap_or(true),
        layer_norm_eps: meta.arch_f32_opt(key::LAYER_NORM_EPS)?.unwrap_or(1e-6),
        swiglu_limit,
        swiglu_limit_shexp,
    });
    Ok(hp)
}
