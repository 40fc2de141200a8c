//! `qwen2moe` (Qwen1.5-MoE, Qwen2-57B-A14B): q/k/v biases, NeoX RoPE, softmax router without
//! renormalization, plus a shared expert whose output is scaled by `sigmoid(x · w_gate_shexp)`.

use super::{ArchSpec, FfnLayout, QkNorm, RopeKind};

pub const SPEC: ArchSpec = ArchSpec {
    name: "qwen2moe",
    rope: RopeKind::Neox,
    qk_norm: QkNorm::None,
    ffn: FfnLayout::Moe,
    norm_topk: false,
    shared_expert: true,
    ..super::BASE
};
