//! `glm5-next` (GLM-5.3 Flash): `hc_mult` residual streams mixed by DeepSeek V4's
//! hyper-connections (the head takes their plain mean), KDA linear-attention layers (short
//! causal convolutions, a gated delta rule over a per-head recurrent state, a gated RMSNorm)
//! interleaved with nope-only latent-attention layers in which each query attends only to the
//! tokens a k-pool lightning indexer selects (or, on a shared layer, the last indexer's
//! selection), leading dense layers, then sigmoid-routed experts with a shared expert, the
//! clamped SwiGLU everywhere. Its forward path is `crate::glm5next`; this declares the parts
//! the shared blocks read.

use super::{ArchSpec, FfnLayout, Gating, Glu, RopeKind};

pub const SPEC: ArchSpec = ArchSpec {
    name: "glm5-next",
    // No layer rotates (`rope.dimension_count` 0).
    rope: RopeKind::Norm,
    ffn: FfnLayout::MoeWhenRouted,
    norm_topk: true,
    shared_expert: true,
    gating: Gating::Sigmoid,
    // The file's `swiglu_clamp_exp` / `swiglu_clamp_shexp` replace this limit.
    glu: Glu::ClampedSilu { limit: 3.0 },
    ..super::BASE
};
