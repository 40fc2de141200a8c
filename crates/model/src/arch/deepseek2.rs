//! `deepseek2` (DeepSeek V2, V2-Lite, V3, R1, Kimi K2): multi-head latent attention (the
//! file's `kv_lora_rank` selects it; see `blocks::mla`), rope on consecutive pairs, leading
//! dense layers then routed experts with shared experts. Routing follows the file:
//! softmax (V2) or sigmoid (V3) gating, the `exp_probs_b` correction bias for selection,
//! group-limited top-k, optional renormalization and `expert_weights_scale`. llama.cpp reads
//! `expert_weights_norm` as false when absent, as DeepSeek V2 does.

use super::{ArchSpec, FfnLayout, Gating, QkNorm, RopeKind};

pub const SPEC: ArchSpec = ArchSpec {
    name: "deepseek2",
    rope: RopeKind::Norm,
    qk_norm: QkNorm::None,
    ffn: FfnLayout::MoeWhenRouted,
    norm_topk: false,
    shared_expert: true,
    gating: Gating::Softmax,
    ..super::BASE
};
