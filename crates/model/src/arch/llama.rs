//! `llama`: dense Llama, and Mixtral-style MoE when a layer has a router and `ffn_*_exps`.
//! Normal (interleaved) RoPE, because the converter permutes q/k into that layout; the routing
//! weights are renormalized over the top-k (Mixtral's softmax over the selected logits).

use super::{ArchSpec, FfnLayout, QkNorm, RopeKind};

pub const SPEC: ArchSpec = ArchSpec {
    name: "llama",
    rope: RopeKind::Norm,
    qk_norm: QkNorm::None,
    ffn: FfnLayout::MoeWhenRouted,
    norm_topk: true,
    shared_expert: false,
    ..super::BASE
};
