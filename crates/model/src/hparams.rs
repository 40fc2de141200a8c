//! Hyperparameters, read from `{arch}.*` metadata. A missing required key or an inconsistent
//! combination is an error naming the key.

use gguf::Metadata;

use crate::arch::{ArchSpec, Gating, RopeKind};
use crate::error::{ModelError, Result};
use crate::names::keys;

#[derive(Clone, Debug, PartialEq)]
pub struct RopeParams {
    pub kind: RopeKind,
    /// Dimensions rotated per head (the rest pass through).
    pub n_rot: usize,
    pub freq_base: f32,
    /// Position multiplier (`1 / factor` for linear scaling and YaRN).
    pub freq_scale: f32,
    pub yarn: Option<YarnParams>,
}

/// YaRN (`rope.scaling.type = yarn`): per pair, a blend of the interpolated (`freq_scale`) and
/// the original frequency over a ramp between two correction dimensions, and cos/sin scaled by
/// `attn_factor · (1 + 0.1·ln(factor))`, as llama.cpp's `rope_yarn` and transformers'
/// `_compute_yarn_parameters` do.
#[derive(Clone, Debug, PartialEq)]
pub struct YarnParams {
    /// `rope.scaling.original_context_length`.
    pub orig_ctx: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
    /// Weight of the blend (1 unless the file says otherwise).
    pub ext_factor: f32,
    /// What cos and sin are multiplied by: `rope.scaling.yarn_attn_factor` when the file has
    /// it (the converter writes the config's `attention_factor` there), else
    /// `1 + 0.1·ln(factor)` (transformers' default; llama.cpp arrives at the same value).
    pub mscale: f32,
    /// Round the correction range out to whole dimensions (see `ArchSpec::yarn_truncate`).
    pub truncate: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MoeParams {
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// Renormalize the top-k routing weights to sum to one.
    pub norm_topk: bool,
    /// Multiplier on the routing weights (1 when absent).
    pub weights_scale: f32,
    pub gating: Gating,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Hparams {
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    pub n_ctx_train: usize,
    pub rms_eps: f32,
    pub rope: RopeParams,
    pub moe: Option<MoeParams>,
    /// `attention.sliding_window`: positions a sliding layer attends to (its own included).
    pub sliding_window: Option<usize>,
    /// Per layer: whether it uses the sliding window.
    pub swa_layers: Vec<bool>,
    /// Filled in from the embedding tensor's shape.
    pub n_vocab: usize,
}

fn bad(meta: &Metadata, suffix: &str, detail: impl Into<String>) -> ModelError {
    let key = meta.arch_key(suffix).unwrap_or_else(|_| suffix.to_string());
    ModelError::BadMetadata {
        key,
        detail: detail.into(),
    }
}

impl Hparams {
    pub fn from_metadata(meta: &Metadata, spec: &ArchSpec) -> Result<Hparams> {
        let u = |s: &str| -> Result<usize> { Ok(meta.arch_u32(s)? as usize) };
        let u_opt =
            |s: &str| -> Result<Option<usize>> { Ok(meta.arch_u32_opt(s)?.map(|v| v as usize)) };
        let n_layer = u(keys::BLOCK_COUNT)?;
        let n_embd = u(keys::EMBEDDING_LENGTH)?;
        let n_head = u(keys::HEAD_COUNT)?;
        let n_head_kv = u_opt(keys::HEAD_COUNT_KV)?.unwrap_or(n_head);
        if n_layer == 0 || n_embd == 0 || n_head == 0 || n_head_kv == 0 {
            return Err(bad(
                meta,
                keys::BLOCK_COUNT,
                "block_count, embedding_length and head counts must be nonzero",
            ));
        }
        if n_head % n_head_kv != 0 {
            return Err(bad(
                meta,
                keys::HEAD_COUNT_KV,
                format!("{n_head} query heads are not a multiple of {n_head_kv} kv heads"),
            ));
        }
        let head_dim_k = u_opt(keys::KEY_LENGTH)?.unwrap_or(n_embd / n_head);
        let head_dim_v = u_opt(keys::VALUE_LENGTH)?.unwrap_or(head_dim_k);
        let n_rot = u_opt(keys::ROPE_DIMENSION_COUNT)?.unwrap_or(head_dim_k);
        if n_rot > head_dim_k || n_rot % 2 != 0 {
            return Err(bad(
                meta,
                keys::ROPE_DIMENSION_COUNT,
                format!("{n_rot} rotary dims for head size {head_dim_k}"),
            ));
        }
        let freq_base = meta.arch_f32_opt(keys::ROPE_FREQ_BASE)?.unwrap_or(10_000.0);
        let scaling_factor = || -> Result<f32> {
            Ok(match meta.arch_f32_opt(keys::ROPE_SCALING_FACTOR)? {
                Some(f) if f > 0.0 => 1.0 / f,
                _ => 1.0,
            })
        };
        let mut yarn = None;
        let freq_scale = match meta.arch_str_opt(keys::ROPE_SCALING_TYPE)? {
            None | Some("none") => match meta.arch_f32_opt(keys::ROPE_SCALE_LINEAR)? {
                Some(f) if f > 0.0 => 1.0 / f,
                _ => 1.0,
            },
            Some("linear") => scaling_factor()?,
            Some("yarn") => {
                let orig_ctx = u(keys::ROPE_SCALING_ORIG_CTX)?;
                let f = |k: &str, default: f32| -> Result<f32> {
                    Ok(meta.arch_f32_opt(k)?.unwrap_or(default))
                };
                // llama.cpp: a negative extrapolation factor means "not set" (1 for YaRN).
                let ext = f(keys::ROPE_YARN_EXT_FACTOR, -1.0)?;
                let freq_scale = scaling_factor()?;
                let factor = 1.0 / freq_scale;
                let default_mscale = if factor <= 1.0 {
                    1.0
                } else {
                    0.1 * factor.ln() + 1.0
                };
                yarn = Some(YarnParams {
                    orig_ctx,
                    beta_fast: f(keys::ROPE_YARN_BETA_FAST, 32.0)?,
                    beta_slow: f(keys::ROPE_YARN_BETA_SLOW, 1.0)?,
                    ext_factor: if ext < 0.0 { 1.0 } else { ext },
                    mscale: f(keys::ROPE_YARN_ATTN_FACTOR, default_mscale)?,
                    truncate: spec.yarn_truncate,
                });
                freq_scale
            }
            Some(other) => {
                return Err(bad(
                    meta,
                    keys::ROPE_SCALING_TYPE,
                    format!("rope scaling {other:?} is not supported (none, linear, yarn)"),
                ));
            }
        };
        let rms_eps = meta.arch_f32_opt(keys::RMS_EPS)?.unwrap_or(1e-5);
        let n_ctx_train = u_opt(keys::CONTEXT_LENGTH)?.unwrap_or(4096);

        let moe = match u_opt(keys::EXPERT_COUNT)? {
            Some(n_expert) if n_expert > 0 => {
                let n_expert_used = u(keys::EXPERT_USED_COUNT)?;
                if n_expert_used == 0 || n_expert_used > n_expert {
                    return Err(bad(
                        meta,
                        keys::EXPERT_USED_COUNT,
                        format!("{n_expert_used} experts used of {n_expert}"),
                    ));
                }
                // llama.cpp: 1 = softmax, 2 = sigmoid, 3 = softmax over the selected weights.
                let gating = match u_opt(keys::EXPERT_GATING_FUNC)? {
                    None => spec.gating,
                    Some(1) => Gating::Softmax,
                    Some(3) => Gating::SoftmaxSelected,
                    Some(func) => {
                        return Err(bad(
                            meta,
                            keys::EXPERT_GATING_FUNC,
                            format!(
                                "gating function {func} is not supported \
                                 (1 = softmax, 3 = softmax over the selected)"
                            ),
                        ));
                    }
                };
                Some(MoeParams {
                    n_expert,
                    n_expert_used,
                    norm_topk: meta
                        .arch_bool_opt(keys::EXPERT_WEIGHTS_NORM)?
                        .unwrap_or(spec.norm_topk),
                    weights_scale: meta
                        .arch_f32_opt(keys::EXPERT_WEIGHTS_SCALE)?
                        .filter(|s| *s != 0.0)
                        .unwrap_or(1.0),
                    gating,
                })
            }
            _ => None,
        };
        let sliding_window = u_opt(keys::SLIDING_WINDOW)?.filter(|&w| w > 0);
        let swa_layers = match sliding_window {
            None => vec![false; n_layer],
            Some(_) => {
                let key = meta.arch_key(keys::SLIDING_WINDOW_PATTERN)?;
                match meta.get(&key) {
                    // One flag per layer (llama.cpp reads an array first).
                    Some(gguf::Value::Array(gguf::Array::Bool(flags))) => {
                        if flags.len() != n_layer {
                            return Err(bad(
                                meta,
                                keys::SLIDING_WINDOW_PATTERN,
                                format!("{} flags for {n_layer} layers", flags.len()),
                            ));
                        }
                        flags.clone()
                    }
                    _ => {
                        let pattern = u_opt(keys::SLIDING_WINDOW_PATTERN)?.or(spec.swa_pattern);
                        // llama.cpp's `set_swa_pattern`: pattern 0 (or none) slides every layer.
                        (0..n_layer)
                            .map(|il| match pattern {
                                None | Some(0) => true,
                                Some(n) => il % n < n - 1,
                            })
                            .collect()
                    }
                }
            }
        };
        Ok(Hparams {
            n_layer,
            n_embd,
            n_head,
            n_head_kv,
            head_dim_k,
            head_dim_v,
            n_ctx_train,
            rms_eps,
            rope: RopeParams {
                kind: spec.rope,
                n_rot,
                freq_base,
                freq_scale,
                yarn,
            },
            moe,
            sliding_window,
            swa_layers,
            n_vocab: 0,
        })
    }

    /// The window layer `il` attends within, or `None` for full attention.
    pub fn window(&self, il: usize) -> Option<usize> {
        self.sliding_window
            .filter(|_| self.swa_layers.get(il).copied().unwrap_or(false))
    }

    /// Query heads per kv head.
    pub fn gqa_ratio(&self) -> usize {
        self.n_head / self.n_head_kv
    }
}
