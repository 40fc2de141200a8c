//! `glm4moe` (GLM-4.5, 4.6, 4.7; GLM-4.5-Air): grouped-query attention with q/k/v biases,
//! partial NeoX rope (the file's `rope.dimension_count`, half the head), per-head q/k norms
//! when the file has them, the pre-FFN norm named `post_attention_norm`, leading dense
//! layers, then sigmoid-gated experts (correction bias for selection, renormalized,
//! `expert_weights_scale`) plus a shared expert. The NextN/MTP block the converter appends is
//! counted in `block_count` and skipped.

use super::{ArchSpec, FfnLayout, Gating, QkNorm, RopeKind};

pub const SPEC: ArchSpec = ArchSpec {
    name: "glm4moe",
    rope: RopeKind::Neox,
    qk_norm: QkNorm::PerHeadIfPresent,
    ffn: FfnLayout::MoeWhenRouted,
    norm_topk: false,
    shared_expert: true,
    gating: Gating::Sigmoid,
    post_attention_norm: true,
    ..super::BASE
};
