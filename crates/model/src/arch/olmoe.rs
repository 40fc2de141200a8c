//! `olmoe` (OLMoE-1B-7B): RMSNorm over the whole q and k projections (not per head), NeoX RoPE,
//! softmax router without renormalization.

use super::{ArchSpec, FfnLayout, QkNorm, RopeKind};

pub const SPEC: ArchSpec = ArchSpec {
    name: "olmoe",
    rope: RopeKind::Neox,
    qk_norm: QkNorm::Whole,
    ffn: FfnLayout::Moe,
    norm_topk: false,
    shared_expert: false,
    ..super::BASE
};
