//! Architectures: each file declares how its layer is composed from the shared blocks in
//! `crate::blocks`; the registry maps `general.architecture` to that declaration. Adding an
//! architecture touches its own file and the `REGISTRY` line, nothing else.

mod deepseek2;
mod deepseek4;
mod glm4moe;
mod glm5_next;
mod glm_dsa;
mod gpt_oss;
mod llama;
mod olmoe;
mod qwen2moe;
mod qwen3moe;

/// How RoPE pairs up the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeKind {
    /// Consecutive pairs `(x[2i], x[2i+1])` (llama.cpp `LLAMA_ROPE_TYPE_NORM`; the converter
    /// permutes llama q/k weights into this layout).
    Norm,
    /// Halves `(x[i], x[i + d/2])` (`LLAMA_ROPE_TYPE_NEOX`, HF's `rotate_half`).
    Neox,
}

/// RMSNorm applied to queries and keys before RoPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// One weight of `head_dim` shared by every head (Qwen3).
    PerHead,
    /// One weight over the whole projection, all heads at once (OLMoE).
    Whole,
    /// Per head as `PerHead` when the file has `attn_q_norm`/`attn_k_norm`, none otherwise
    /// (GLM-4.5 has them, GLM-4.5-Air does not).
    PerHeadIfPresent,
}

/// Which feed-forward block a layer uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnLayout {
    /// Every layer routes through experts.
    Moe,
    /// A layer is MoE when it has a router (`ffn_gate_inp`), dense otherwise (llama/Mixtral).
    MoeWhenRouted,
}

/// How the router turns logits into expert weights (`{arch}.expert_gating_func` overrides it:
/// 1 = softmax, 2 = sigmoid, 3 = softmax over the selected).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over every expert, then the top-k of those probabilities (llama.cpp's 1).
    Softmax,
    /// Independent sigmoid per expert (DeepSeek V3, GLM-4.5; llama.cpp's 2).
    Sigmoid,
    /// Top-k of the raw logits, then a softmax over the selected ones (gpt-oss; llama.cpp's
    /// 3, `SOFTMAX_WEIGHT`).
    SoftmaxSelected,
    /// `sqrt(softplus(logit))` per expert (DeepSeek V4; llama.cpp's 4).
    SqrtSoftplus,
}

/// The gated activation of the expert FFNs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Glu {
    /// `silu(gate) · up`.
    Silu,
    /// gpt-oss: `g = min(gate, limit)`, `u = clamp(up, -limit, limit)`, `g·σ(alpha·g)·(u + 1)`.
    ClampedSwiglu { alpha: f32, limit: f32 },
    /// DeepSeek V4: `silu(min(gate, limit)) · clamp(up, -limit, limit)` (the limit comes from
    /// the file's `swiglu_clamp_exp` / `swiglu_clamp_shexp`).
    ClampedSilu { limit: f32 },
}

/// What distinguishes one architecture's layer from another's.
#[derive(Clone, Copy, Debug)]
pub struct ArchSpec {
    /// `general.architecture`.
    pub name: &'static str,
    pub rope: RopeKind,
    pub qk_norm: QkNorm,
    pub ffn: FfnLayout,
    /// Whether the top-k routing weights are renormalized to sum to 1, unless the file says
    /// otherwise with `{arch}.expert_weights_norm`.
    pub norm_topk: bool,
    /// Whether layers may carry a shared expert with a sigmoid gate (`ffn_*_shexp`).
    pub shared_expert: bool,
    /// Gating when the file has no `expert_gating_func` (llama.cpp's per-architecture default).
    pub gating: Gating,
    pub glu: Glu,
    /// The norm in front of the FFN is named `post_attention_norm` instead of `ffn_norm`.
    pub post_attention_norm: bool,
    /// With `{arch}.attention.sliding_window` set: the last of every `n` layers attends to the
    /// whole context, the others to the window (llama.cpp's `set_swa_pattern(n)`); `None`
    /// means every layer slides. `{arch}.attention.sliding_window_pattern` overrides it.
    pub swa_pattern: Option<usize>,
    /// Whether YaRN's correction range is rounded out to whole dimensions (llama.cpp, DeepSeek's
    /// reference) or kept fractional (OpenAI's gpt-oss reference, HF `truncate: false`).
    pub yarn_truncate: bool,
}

/// The fields most architectures share; specs list their own and take the rest from here.
pub const BASE: ArchSpec = ArchSpec {
    name: "",
    rope: RopeKind::Neox,
    qk_norm: QkNorm::None,
    ffn: FfnLayout::Moe,
    norm_topk: false,
    shared_expert: false,
    gating: Gating::Softmax,
    glu: Glu::Silu,
    post_attention_norm: false,
    swa_pattern: None,
    yarn_truncate: true,
};

const REGISTRY: [&ArchSpec; 10] = [
    &llama::SPEC,
    &qwen3moe::SPEC,
    &qwen2moe::SPEC,
    &olmoe::SPEC,
    &deepseek2::SPEC,
    &deepseek4::SPEC,
    &glm4moe::SPEC,
    &glm_dsa::SPEC,
    &gpt_oss::SPEC,
    &glm5_next::SPEC,
];

/// The declaration for `general.architecture == name`.
pub fn lookup(name: &str) -> Option<&'static ArchSpec> {
    REGISTRY.iter().copied().find(|s| s.name == name)
}

/// Names of every supported architecture, for error messages.
pub fn supported() -> Vec<&'static str> {
    REGISTRY.iter().map(|s| s.name).collect()
}
