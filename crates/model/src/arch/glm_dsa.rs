//! `glm-dsa` (GLM-5, 5.1, 5.2): DeepSeek V3's multi-head latent attention made sparse by a
//! lightning indexer (the file's `attention.indexer.*`; see `crate::blocks::indexer`): full
//! layers score every visible token per query and attend to the top-k, shared layers reuse the
//! latest full layer's selection. Routing as GLM-4.5 (sigmoid with correction bias,
//! renormalized, scaled) with a shared expert after leading dense layers; the NextN block the
//! converter counts in `block_count` is skipped.

use super::{ArchSpec, FfnLayout, Gating, RopeKind};

pub const SPEC: ArchSpec = ArchSpec {
    name: "glm-dsa",
    rope: RopeKind::Norm,
    ffn: FfnLayout::MoeWhenRouted,
    norm_topk: true,
    shared_expert: true,
    gating: Gating::Sigmoid,
    ..super::BASE
};
