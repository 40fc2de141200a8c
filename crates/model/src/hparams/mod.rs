//! Hyperparameters, read from `{arch}.*` metadata. A missing required key or an inconsistent
//! combination is an error naming the key.

mod dsa;

pub use dsa::DsaParams;

use gguf::Metadata;

use crate::arch::{ArchSpec, Gating, RopeKind};
use crate::error::{ModelError, Result};
use crate::names::keys;

mod glm5next;

pub use glm5next::{Glm5LayerKind, Glm5NextParams};

#[derive(Clone, Debug, PartialEq)]
pub struct RopeParams {
    pub kind: RopeKind,
    /// Dimensions rotated per head (the rest pass through).
    pub n_rot: usize,
    pub freq_base: f32,
    /// Position multiplier (`1 / factor` for linear scaling; 1 under YaRN, whose scaling is
    /// per frequency).
    pub freq_scale: f32,
    /// YaRN (`rope.scaling.type = yarn`): frequencies blended between interpolation and
    /// extrapolation, cos/sin scaled by `mscale`.
    pub yarn: Option<YarnParams>,
}

/// YaRN's parameters as the GGUF's rope keys give them (HF `_compute_yarn_parameters`).
#[derive(Clone, Debug, PartialEq)]
pub struct YarnParams {
    pub factor: f32,
    /// Context the model was trained at before extension.
    pub orig_ctx: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
    /// How much of the extrapolated frequencies is mixed in (1 = YaRN proper).
    pub ext_factor: f32,
    /// Multiplier on cos/sin (HF `attention_factor`).
    pub mscale: f32,
    /// Round the correction range out to whole dimensions (see `ArchSpec::yarn_truncate`).
    pub truncate: bool,
}

/// Multi-head latent attention sizes (DeepSeek V2/V3). The KV cache holds, per position and
/// layer, one row of `kv_lora_rank + n_rot` values: the normalized latent, then the rotated
/// shared rope key.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaParams {
    /// Rank of the query compression; 0 = a plain `attn_q` projection (V2-Lite).
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    /// Per-head query/key dimensions without position (`qk_nope_head_dim`).
    pub qk_nope: usize,
    /// Per-head value dimension after decompression (`v_head_dim`).
    pub v_head_dim: usize,
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
    /// Group-limited routing: experts in `n_group` equal groups, only the `n_group_used` best
    /// groups (by the sum of their two best selection scores) compete (1 = no groups).
    pub n_group: usize,
    pub n_group_used: usize,
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
    /// Multi-head latent attention; `n_head_kv` is then 1, `head_dim_k` the cache row
    /// (`kv_lora_rank + n_rot`) and `head_dim_v` 0 (values are the latent part of that row).
    pub mla: Option<MlaParams>,
    /// Multiplier on the attention softmax scale `1/sqrt(head_dim)` (DeepSeek's YaRN
    /// `mscale²`; 1 elsewhere).
    pub attn_scale_mul: f32,
    /// Layers in the file past `n_layer` that are NextN/MTP heads (not run).
    pub n_nextn: usize,
    /// DeepSeek V4's hyper-connections, compressed attention and routing (`deepseek4`).
    pub dsv4: Option<Dsv4Params>,
    /// GLM-5's sparse attention (`glm-dsa`).
    pub dsa: Option<DsaParams>,
    /// GLM-5.3 Flash's layer kinds, KDA, k-pool indexer and hyper-connections (`glm5-next`).
    pub glm5next: Option<Glm5NextParams>,
}

/// DeepSeek V4: the residual is `hc` streams of `n_embd`; every layer attends to a sliding
/// window of raw rows (`sliding_window`) and, where `compress_ratios[il]` is 4 or 128, to rows
/// that each pool a window of that many positions. The KV cache view is one key row of
/// `head_dim_k` per position (values are the keys).
#[derive(Clone, Debug, PartialEq)]
pub struct Dsv4Params {
    pub hc: usize,
    pub sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    /// Per layer: 0 (window only), 4 (overlapping windows + indexer) or 128.
    pub compress_ratios: Vec<usize>,
    /// RoPE of compressed layers (their queries, keys and compressed rows): its own base and
    /// YaRN, with cos/sin unscaled (DeepSeek's reference and llama.cpp cancel YaRN's mscale).
    pub compress_rope: RopeParams,
    pub index_n_head: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    /// The first `n_hash_layers` layers take their experts from `ffn_gate_tid2eid[token]`.
    pub n_hash_layers: usize,
    pub swiglu_limit: f32,
    pub swiglu_limit_shexp: f32,
}

impl Dsv4Params {
    pub fn ratio(&self, il: usize) -> usize {
        self.compress_ratios.get(il).copied().unwrap_or(0)
    }
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
        // NextN/MTP blocks are counted in block_count and appended after the trunk; they
        // predict further tokens for speculative decoding, which we do not run.
        let n_nextn = u_opt(keys::NEXTN_PREDICT_LAYERS)?.unwrap_or(0);
        let n_layer = u(keys::BLOCK_COUNT)?.saturating_sub(n_nextn);
        let n_embd = u(keys::EMBEDDING_LENGTH)?;
        let n_head = u(keys::HEAD_COUNT)?;
        let n_head_kv = match glm5next::kv_heads_of_array(meta)? {
            Some(n) => n,
            None => u_opt(keys::HEAD_COUNT_KV)?.unwrap_or(n_head),
        };
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
        let mut yarn = None;
        let mut attn_scale_mul = 1.0;
        let freq_scale = match meta.arch_str_opt(keys::ROPE_SCALING_TYPE)? {
            None | Some("none") => match meta.arch_f32_opt(keys::ROPE_SCALE_LINEAR)? {
                Some(f) if f > 0.0 => 1.0 / f,
                _ => 1.0,
            },
            Some("linear") => match meta.arch_f32_opt(keys::ROPE_SCALING_FACTOR)? {
                Some(f) if f > 0.0 => 1.0 / f,
                _ => 1.0,
            },
            Some("yarn") => {
                let is_mla = meta.arch_u32_opt(keys::KV_LORA_RANK)?.is_some();
                let (params, scale_mul) = yarn_params(meta, spec, is_mla, n_ctx_train_of(meta)?)?;
                attn_scale_mul = scale_mul;
                yarn = Some(params);
                1.0
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
        let n_ctx_train = n_ctx_train_of(meta)?;

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
                    Some(2) => Gating::Sigmoid,
                    Some(3) => Gating::SoftmaxSelected,
                    Some(4) => Gating::SqrtSoftplus,
                    Some(func) => {
                        return Err(bad(
                            meta,
                            keys::EXPERT_GATING_FUNC,
                            format!(
                                "gating function {func} is not supported \
                                 (1 = softmax, 2 = sigmoid, 3 = softmax over the selected, 4 = sqrt-softplus)"
                            ),
                        ));
                    }
                };
                let n_group = u_opt(keys::EXPERT_GROUP_COUNT)?.unwrap_or(1).max(1);
                let n_group_used = u_opt(keys::EXPERT_GROUP_USED_COUNT)?.unwrap_or(n_group);
                if n_expert % n_group != 0
                    || n_group_used == 0
                    || n_group_used > n_group
                    || (n_group > 1 && n_expert / n_group < 2)
                    || n_group_used * (n_expert / n_group) < n_expert_used
                {
                    return Err(bad(
                        meta,
                        keys::EXPERT_GROUP_COUNT,
                        format!(
                            "{n_group} expert groups ({n_group_used} used) do not fit {n_expert} \
                             experts with {n_expert_used} used"
                        ),
                    ));
                }
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
                    n_group,
                    n_group_used,
                })
            }
            _ => None,
        };
        let mla = mla_params(meta, n_head_kv, head_dim_k, head_dim_v, n_rot)?;
        let (head_dim_k, head_dim_v) = match &mla {
            // The cache view: one latent + rope row per position, values inside it.
            Some(m) => (m.kv_lora_rank + n_rot, 0),
            None => (head_dim_k, head_dim_v),
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
            mla,
            attn_scale_mul,
            n_nextn,
            dsv4: None,
            dsa: None,
            glm5next: None,
        })
        .and_then(|hp| match spec.name {
            "deepseek4" => dsv4_params(meta, hp),
            "glm-dsa" => dsa::dsa_params(meta, hp),
            "glm5-next" => glm5next::glm5next_params(meta, hp),
            _ => Ok(hp),
        })
    }

    /// Values per position of the residual stream between layers: `hc · n_embd` for
    /// DeepSeek V4 and GLM-5.3 Flash.
    pub fn stream_width(&self) -> usize {
        let streams = match (&self.dsv4, &self.glm5next) {
            (Some(p), _) => p.hc,
            (None, Some(p)) => p.hc,
            (None, None) => 1,
        };
        streams * self.n_embd
    }

    /// Values per position that travel between pipeline stages besides the stream, exactly
    /// (not in the wire's activation format): GLM-5's and GLM-5.3 Flash's sparse-attention
    /// selection, the attended positions as `u32` bit patterns, which a stage starting at a
    /// shared layer attends through.
    pub fn carried_width(&self) -> usize {
        match (&self.dsa, &self.glm5next) {
            (Some(p), _) => p.top_k,
            // The chosen pools' members and the incomplete pool's tail.
            (None, Some(p)) => p.index_topk + p.kpool - 1,
            (None, None) => 0,
        }
    }

    /// Values per position between pipeline stages: the stream, then what is carried.
    pub fn hidden_width(&self) -> usize {
        self.stream_width() + self.carried_width()
    }

    /// Softmax scale of attention: `1/sqrt(d)` over the head size queries and keys are
    /// compared at (for MLA the decompressed `qk_nope + n_rot`, whichever form computes it),
    /// times the architecture's multiplier.
    pub fn attn_scale(&self) -> f32 {
        let d = match &self.mla {
            Some(m) => m.qk_nope + self.rope.n_rot,
            None => self.head_dim_k,
        };
        self.attn_scale_mul / (d as f32).sqrt()
    }

    /// Values per head entering the attention output projection.
    pub fn head_dim_out(&self) -> usize {
        if self.dsv4.is_some() {
            return self.head_dim_k;
        }
        self.mla.as_ref().map_or(self.head_dim_v, |m| m.v_head_dim)
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

fn n_ctx_train_of(meta: &Metadata) -> Result<usize> {
    Ok(meta
        .arch_u32_opt(keys::CONTEXT_LENGTH)?
        .map_or(4096, |v| v as usize))
}

/// HF's `get_mscale`: YaRN's magnitude correction for a context extended by `factor`.
fn yarn_get_mscale(factor: f32, mscale: f32) -> f32 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * mscale * factor.ln() + 1.0
    }
}

/// YaRN from the rope keys, and the multiplier it puts on the attention softmax scale.
///
/// DeepSeek's configs give `mscale` and `mscale_all_dim`; the converter keeps only
/// `0.1 · mscale_all_dim` (`yarn_log_multiplier`). DeepSeek's reference (and transformers)
/// scale cos/sin by `get_mscale(f, mscale) / get_mscale(f, mscale_all_dim)` and the softmax
/// by `get_mscale(f, mscale_all_dim)²`. Every released DeepSeek config has
/// `mscale == mscale_all_dim` (V3: 1/1, V2-Lite: 0.707/0.707), which llama.cpp assumes too,
/// so cos/sin are unscaled. Without the key, YaRN's own `get_mscale(f, 1)` scales cos/sin
/// and the softmax is left alone (transformers' semantics; see docs/models.md).
fn yarn_params(
    meta: &Metadata,
    spec: &ArchSpec,
    is_mla: bool,
    n_ctx_train: usize,
) -> Result<(YarnParams, f32)> {
    let factor = meta
        .arch_f32_opt(keys::ROPE_SCALING_FACTOR)?
        .filter(|f| *f > 0.0)
        .ok_or_else(|| {
            bad(
                meta,
                keys::ROPE_SCALING_FACTOR,
                "yarn needs a scaling factor",
            )
        })?;
    let orig_ctx = meta
        .arch_u32_opt(keys::ROPE_SCALING_ORIG_CTX)?
        .map_or(n_ctx_train, |v| v as usize);
    let log_mul = meta.arch_f32_opt(keys::ROPE_YARN_LOG_MUL)?.unwrap_or(0.0);
    let attn_factor = meta
        .arch_f32_opt(keys::ROPE_SCALING_ATTN_FACTOR)?
        .unwrap_or(1.0);
    // The converter writes a config's `attention_factor` (transformers' name for the cos/sin
    // multiplier itself) as `yarn_attn_factor`.
    let yarn_attn_factor = meta.arch_f32_opt(keys::ROPE_YARN_ATTN_FACTOR)?;
    let (mscale, scale_mul) = if log_mul != 0.0 && is_mla {
        // DeepSeek's converter: yarn_log_multiplier = 0.1 · mscale_all_dim.
        let m = yarn_get_mscale(factor, log_mul / 0.1);
        (attn_factor, m * m)
    } else if let Some(m) = yarn_attn_factor {
        (m, 1.0)
    } else if log_mul != 0.0 {
        // Elsewhere the key is `mscale_all_dim` itself, with `mscale` 1 (llama.cpp).
        (
            attn_factor * yarn_get_mscale(factor, 1.0) / yarn_get_mscale(factor, log_mul),
            1.0,
        )
    } else {
        (attn_factor * yarn_get_mscale(factor, 1.0), 1.0)
    };
    Ok((
        YarnParams {
            factor,
            orig_ctx,
            beta_fast: meta
                .arch_f32_opt(keys::ROPE_YARN_BETA_FAST)?
                .unwrap_or(32.0),
            beta_slow: meta.arch_f32_opt(keys::ROPE_YARN_BETA_SLOW)?.unwrap_or(1.0),
            // llama.cpp: a negative extrapolation factor means "not set" (1 for YaRN).
            ext_factor: meta
                .arch_f32_opt(keys::ROPE_YARN_EXT_FACTOR)?
                .filter(|e| *e >= 0.0)
                .unwrap_or(1.0),
            mscale,
            truncate: spec.yarn_truncate,
        },
        scale_mul,
    ))
}

/// MLA sizes when the file has `attention.kv_lora_rank` (the converter then writes the
/// cache view as `key_length = kv_lora_rank + n_rot`, `value_length = kv_lora_rank`, one kv
/// head, and the decompressed head sizes as `key_length_mla`/`value_length_mla`).
fn mla_params(
    meta: &Metadata,
    n_head_kv: usize,
    head_dim_k: usize,
    head_dim_v: usize,
    n_rot: usize,
) -> Result<Option<MlaParams>> {
    let Some(kv_lora_rank) = meta.arch_u32_opt(keys::KV_LORA_RANK)? else {
        return Ok(None);
    };
    let kv_lora_rank = kv_lora_rank as usize;
    let q_lora_rank = meta.arch_u32_opt(keys::Q_LORA_RANK)?.unwrap_or(0) as usize;
    let k_mla = meta
        .arch_u32_opt(keys::KEY_LENGTH_MLA)?
        .map_or(head_dim_k, |v| v as usize);
    let v_head_dim = meta
        .arch_u32_opt(keys::VALUE_LENGTH_MLA)?
        .map_or(head_dim_v, |v| v as usize);
    if n_head_kv != 1
        || head_dim_k != kv_lora_rank + n_rot
        || head_dim_v != kv_lora_rank
        || k_mla <= n_rot
        || v_head_dim == 0
    {
        return Err(bad(
            meta,
            keys::KV_LORA_RANK,
            format!(
                "MLA sizes do not fit together: kv_lora_rank {kv_lora_rank}, rope {n_rot}, \
                 {n_head_kv} kv heads of {head_dim_k}/{head_dim_v}, decompressed heads \
                 {k_mla}/{v_head_dim} (older files with MHA-style key_length are not read)"
            ),
        ));
    }
    Ok(Some(MlaParams {
        q_lora_rank,
        kv_lora_rank,
        qk_nope: k_mla - n_rot,
        v_head_dim,
    }))
}

/// DeepSeek V4's keys on top of the common ones (names as llama.cpp's converter writes them).
fn dsv4_params(meta: &Metadata, mut hp: Hparams) -> Result<Hparams> {
    let u = |s: &str| -> Result<usize> { Ok(meta.arch_u32(s)? as usize) };
    let n = hp.n_layer + hp.n_nextn;
    let ratios = meta.arch_u32_array(keys::COMPRESS_RATIOS)?;
    if ratios.len() < hp.n_layer {
        return Err(bad(
            meta,
            keys::COMPRESS_RATIOS,
            format!("{} ratios for {} layers", ratios.len(), hp.n_layer),
        ));
    }
    let compress_ratios: Vec<usize> = ratios.iter().map(|&r| r as usize).collect();
    if let Some(r) = compress_ratios.iter().find(|&&r| ![0, 4, 128].contains(&r)) {
        return Err(bad(
            meta,
            keys::COMPRESS_RATIOS,
            format!("compression ratio {r}: DeepSeek V4 layers use 0, 4 or 128"),
        ));
    }
    let per_layer_f32 = |key: &str| -> Result<Option<f32>> {
        let full = meta.arch_key(key)?;
        Ok(match meta.get(&full) {
            None => None,
            Some(gguf::Value::Array(gguf::Array::F32(v))) => v.first().copied(),
            Some(_) => meta.arch_f32_opt(key)?,
        })
    };
    let swiglu_limit = per_layer_f32(keys::SWIGLU_CLAMP_EXP)?.unwrap_or(0.0);
    let swiglu_limit_shexp = per_layer_f32(keys::SWIGLU_CLAMP_SHEXP)?.unwrap_or(swiglu_limit);
    let hc = u(keys::HC_COUNT)?;
    if hc == 0 {
        return Err(bad(meta, keys::HC_COUNT, "zero hyper-connection streams"));
    }
    let head_dim = hp.head_dim_k;
    let o_groups = u(keys::OUTPUT_GROUP_COUNT)?;
    if o_groups == 0 || !hp.n_head.is_multiple_of(o_groups) {
        return Err(bad(
            meta,
            keys::OUTPUT_GROUP_COUNT,
            format!("{o_groups} output groups for {} heads", hp.n_head),
        ));
    }
    let index_head_dim = u(keys::INDEXER_KEY_LENGTH)?;
    if index_head_dim < hp.rope.n_rot {
        return Err(bad(
            meta,
            keys::INDEXER_KEY_LENGTH,
            format!(
                "indexer heads of {index_head_dim} for {} rotary dims",
                hp.rope.n_rot
            ),
        ));
    }
    // Compressed layers: their own base, the file's YaRN, cos/sin unscaled.
    let mut compress_rope = hp.rope.clone();
    compress_rope.freq_base = meta.arch_f32(keys::COMPRESS_ROPE_FREQ_BASE)?;
    if let Some(y) = &mut compress_rope.yarn {
        y.mscale = 1.0;
    }
    // Sliding layers rotate with the plain base, no scaling.
    hp.rope.yarn = None;
    hp.rope.freq_scale = 1.0;
    hp.attn_scale_mul = 1.0;
    let window = hp.sliding_window.ok_or_else(|| {
        bad(
            meta,
            keys::SLIDING_WINDOW,
            "DeepSeek V4 needs a sliding window",
        )
    })?;
    hp.sliding_window = Some(window);
    hp.swa_layers = vec![true; hp.n_layer];
    // The cache view: one shared key/value row per position.
    hp.n_head_kv = 1;
    hp.head_dim_v = 0;
    hp.dsv4 = Some(Dsv4Params {
        hc,
        sinkhorn_iters: u(keys::HC_SINKHORN_ITERS)?,
        hc_eps: meta.arch_f32(keys::HC_EPS)?,
        q_lora_rank: u(keys::Q_LORA_RANK)?,
        o_groups,
        o_lora_rank: u(keys::OUTPUT_LORA_RANK)?,
        compress_ratios: compress_ratios[..n.min(compress_ratios.len())].to_vec(),
        compress_rope,
        index_n_head: u(keys::INDEXER_HEAD_COUNT)?,
        index_head_dim,
        index_topk: u(keys::INDEXER_TOP_K)?,
        n_hash_layers: meta.arch_u32_opt(keys::HASH_LAYER_COUNT)?.unwrap_or(0) as usize,
        swiglu_limit,
        swiglu_limit_shexp,
    });
    let _ = head_dim;
    Ok(hp)
}
