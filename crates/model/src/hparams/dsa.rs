//! GLM-5's DeepSeek sparse attention (`glm-dsa`): the lightning indexer's shape and which
//! layers run it.

use gguf::Metadata;

use super::{Hparams, bad};
use crate::error::Result;
use crate::names::keys;

/// A lightning indexer scores every visible token for each query; multi-head latent attention
/// then attends to the `top_k` best only. Layers marked full run their own indexer; the others
/// (GLM-5.2's "shared" layers) reuse the selection of the latest full layer before them.
#[derive(Clone, Debug, PartialEq)]
pub struct DsaParams {
    pub n_head: usize,
    pub head_dim: usize,
    pub top_k: usize,
    /// Per layer: whether it runs its own indexer.
    pub full: Vec<bool>,
    /// Epsilon of the indexer key's LayerNorm (transformers' 1e-6; the file has no key for it).
    pub k_norm_eps: f32,
}

impl DsaParams {
    pub fn is_full(&self, il: usize) -> bool {
        self.full.get(il).copied().unwrap_or(false)
    }
}

/// llama.cpp's default for GLM-5.2 files without `attention.indexer.types` (its config.json):
/// layers 0 and 1 full, then every fourth from layer 2.
fn glm_5_2_pattern(il: usize) -> bool {
    il < 2 || (il - 2).is_multiple_of(4)
}

/// Context lengths from which a file without indexer types is GLM-5.2 (earlier GLM-5 releases
/// run the indexer on every layer), as llama.cpp decides.
const GLM_5_2_MIN_CONTEXT: usize = 1 << 20;

pub(super) fn dsa_params(meta: &Metadata, mut hp: Hparams) -> Result<Hparams> {
    let u = |s: &str| -> Result<usize> { Ok(meta.arch_u32(s)? as usize) };
    let n_layer = hp.n_layer;
    let full: Vec<bool> = match meta.get(&meta.arch_key(keys::INDEXER_TYPES)?) {
        Some(gguf::Value::Array(gguf::Array::Bool(flags))) => {
            if flags.len() < n_layer {
                return Err(bad(
                    meta,
                    keys::INDEXER_TYPES,
                    format!("{} indexer types for {n_layer} layers", flags.len()),
                ));
            }
            flags[..n_layer].to_vec()
        }
        Some(_) => {
            return Err(bad(
                meta,
                keys::INDEXER_TYPES,
                "expected an array of booleans (true: the layer runs its own indexer)",
            ));
        }
        None if hp.n_ctx_train >= GLM_5_2_MIN_CONTEXT => {
            (0..n_layer).map(glm_5_2_pattern).collect()
        }
        None => vec![true; n_layer],
    };
    if full.first() == Some(&false) {
        return Err(bad(
            meta,
            keys::INDEXER_TYPES,
            "layer 0 reuses an indexer selection, but no earlier layer makes one",
        ));
    }
    let params = DsaParams {
        n_head: u(keys::INDEXER_HEAD_COUNT)?,
        head_dim: u(keys::INDEXER_KEY_LENGTH)?,
        top_k: u(keys::INDEXER_TOP_K)?,
        full,
        k_norm_eps: 1e-6,
    };
    if params.n_head == 0 || params.top_k == 0 || params.head_dim < hp.rope.n_rot {
        return Err(bad(
            meta,
            keys::INDEXER_KEY_LENGTH,
            format!(
                "indexer of {} heads × {} dims, top {} (needs heads, a top-k and at least the {} rotary dims)",
                params.n_head, params.head_dim, params.top_k, hp.rope.n_rot
            ),
        ));
    }
    if hp.mla.is_none() {
        return Err(bad(
            meta,
            keys::KV_LORA_RANK,
            "sparse attention runs on multi-head latent attention",
        ));
    }
    hp.dsa = Some(params);
    Ok(hp)
}
