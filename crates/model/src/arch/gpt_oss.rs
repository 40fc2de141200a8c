//! `gpt-oss` (gpt-oss-20b, gpt-oss-120b): learned attention sinks per head, sliding-window
//! attention on every other layer (layer 0 slides), biases on q/k/v/o, the router and the
//! experts, top-k of the router logits with a softmax over the selected ones, the clamped SwiGLU
//! (alpha 1.702, limit 7.0), NeoX YaRN RoPE without rounding the correction range (OpenAI's
//! reference), and the FFN norm named `post_attention_norm`. The sinks, biases and window are
//! read from the file where they appear; this declares only what the file does not say.

use super::{ArchSpec, Gating, Glu, RopeKind};

pub const SPEC: ArchSpec = ArchSpec {
    name: "gpt-oss",
    rope: RopeKind::Neox,
    norm_topk: false,
    gating: Gating::SoftmaxSelected,
    glu: Glu::ClampedSwiglu {
        alpha: 1.702,
        limit: 7.0,
    },
    post_attention_norm: true,
    swa_pattern: Some(2),
    yarn_truncate: false,
    ..super::BASE
};
