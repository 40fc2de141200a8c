//! `qwen3moe` (Qwen3-30B-A3B, 235B-A22B): per-head q/k RMSNorm, NeoX RoPE, softmax router over
//! all experts with the top-k weights renormalized. GGUF has no key for HF's `norm_topk_prob`;
//! llama.cpp always renormalizes for this architecture, as every released checkpoint does.

use super::{ArchSpec, FfnLayout, QkNorm, RopeKind};

pub const SPEC: ArchSpec = ArchSpec {
    name: "qwen3moe",
    rope: RopeKind::Neox,
    qk_norm: QkNorm::PerHead,
    ffn: FfnLayout::Moe,
    norm_topk: true,
    shared_expert: false,
    ..super::BASE
};
