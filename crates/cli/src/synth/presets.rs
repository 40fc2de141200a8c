//! The presets: real models' shapes with fewer layers.

use super::dsa::DsaShape;
use super::dsv4::Dsv4Shape;
use super::glm5next::Glm5NextShape;

/// Shapes of a synthetic MoE model.
#[derive(Clone, Debug)]
pub struct Preset {
    pub name: &'static str,
    pub arch: &'static str,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub n_ff_exp: usize,
    pub n_vocab: usize,
    pub n_ctx: usize,
    /// Multi-head latent attention instead of GQA (`deepseek2`).
    pub mla: Option<MlaShape>,
    /// Shared experts of `n_ff_exp` each (DeepSeek, GLM: one `ffn_*_shexp` of their sum).
    pub n_shared_exp: usize,
    /// Leading dense layers and their FFN width.
    pub n_dense_lead: usize,
    pub n_ff_dense: usize,
    /// Rotary dimensions per head (0: all of `head_dim`).
    pub n_rot: usize,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    /// Sigmoid gating with a selection bias (DeepSeek V3, GLM-4.5), else softmax.
    pub sigmoid_gating: bool,
    pub n_group: usize,
    pub n_group_used: usize,
    pub weights_scale: f32,
    pub norm_topk: bool,
    /// DeepSeek V4's hyper-connections, compressed attention and hash routing (`deepseek4`).
    pub dsv4: Option<Dsv4Shape>,
    /// GLM-5's lightning indexer over latent attention (`glm-dsa`).
    pub dsa: Option<DsaShape>,
    /// GLM-5.3 Flash's KDA layers, k-pool indexer and streams (`glm5-next`).
    pub glm5next: Option<Glm5NextShape>,
}

/// Latent attention sizes of a preset.
#[derive(Clone, Debug)]
pub struct MlaShape {
    /// 0: a plain `attn_q` (V2-Lite).
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope: usize,
    pub v_head_dim: usize,
}

/// What the Qwen3/OLMoE presets leave at their defaults.
const GQA_ONLY: Preset = Preset {
    name: "",
    arch: "",
    n_layer: 0,
    n_embd: 0,
    n_head: 0,
    n_head_kv: 0,
    head_dim: 0,
    n_expert: 0,
    n_expert_used: 0,
    n_ff_exp: 0,
    n_vocab: 0,
    n_ctx: 0,
    mla: None,
    n_shared_exp: 0,
    n_dense_lead: 0,
    n_ff_dense: 0,
    n_rot: 0,
    qkv_bias: false,
    qk_norm: true,
    sigmoid_gating: false,
    n_group: 1,
    n_group_used: 1,
    weights_scale: 1.0,
    norm_topk: true,
    dsv4: None,
    dsa: None,
    glm5next: None,
};

/// DeepSeek-V4-Flash's layer count (`compress_ratios` follows the real pattern only at it).
pub const DSV4_FLASH_LAYERS: usize = 43;

pub const PRESETS: [Preset; 10] = [
    Preset {
        name: "qwen3-30b-a3b",
        arch: "qwen3moe",
        n_layer: 48,
        n_embd: 2048,
        n_head: 32,
        n_head_kv: 4,
        head_dim: 128,
        n_expert: 128,
        n_expert_used: 8,
        n_ff_exp: 768,
        n_vocab: 151_936,
        n_ctx: 40_960,
        ..GQA_ONLY
    },
    Preset {
        name: "olmoe-7b-a1b",
        arch: "olmoe",
        n_layer: 16,
        n_embd: 2048,
        n_head: 16,
        n_head_kv: 16,
        head_dim: 128,
        n_expert: 64,
        n_expert_used: 8,
        n_ff_exp: 1024,
        n_vocab: 50_304,
        n_ctx: 4096,
        norm_topk: false,
        ..GQA_ONLY
    },
    Preset {
        name: "small-2b",
        arch: "qwen3moe",
        n_layer: 8,
        n_embd: 1024,
        n_head: 16,
        n_head_kv: 4,
        head_dim: 64,
        n_expert: 32,
        n_expert_used: 4,
        n_ff_exp: 512,
        n_vocab: 151_936,
        n_ctx: 32_768,
        ..GQA_ONLY
    },
    // DeepSeek-V2-Lite (16B-A2.4B): latent attention without query compression, 64 experts
    // top-6 + 2 shared, softmax gating, one dense layer; 10.6 GiB.
    Preset {
        name: "deepseek-v2-lite",
        arch: "deepseek2",
        n_layer: 27,
        n_embd: 2048,
        n_head: 16,
        n_head_kv: 1,
        head_dim: 192,
        n_expert: 64,
        n_expert_used: 6,
        n_ff_exp: 1408,
        n_vocab: 102_400,
        n_ctx: 32_768,
        mla: Some(MlaShape {
            q_lora_rank: 0,
            kv_lora_rank: 512,
            qk_nope: 128,
            v_head_dim: 128,
        }),
        n_shared_exp: 2,
        n_dense_lead: 1,
        n_ff_dense: 10_944,
        n_rot: 64,
        qk_norm: false,
        norm_topk: false,
        ..GQA_ONLY
    },
    // DeepSeek-V3/R1 shapes (671B-A37B) with 4 of 61 layers: the 3 dense ones and one routed
    // (256 experts top-8 in 8 groups, 4 used, sigmoid + bias, scale 2.5); 9.2 GiB, most of it
    // the one routed layer — for streaming.
    Preset {
        name: "deepseek-v3-4l",
        arch: "deepseek2",
        n_layer: 4,
        n_embd: 7168,
        n_head: 128,
        n_head_kv: 1,
        head_dim: 192,
        n_expert: 256,
        n_expert_used: 8,
        n_ff_exp: 2048,
        n_vocab: 129_280,
        n_ctx: 32_768,
        mla: Some(MlaShape {
            q_lora_rank: 1536,
            kv_lora_rank: 512,
            qk_nope: 128,
            v_head_dim: 128,
        }),
        n_shared_exp: 1,
        n_dense_lead: 3,
        n_ff_dense: 18_432,
        n_rot: 64,
        qk_norm: false,
        sigmoid_gating: true,
        n_group: 8,
        n_group_used: 4,
        weights_scale: 2.5,
        ..GQA_ONLY
    },
    // GLM-5.2 shapes (744B-A40B) with 4 of 78 layers: the 3 dense ones (indexer on each, as
    // GLM-5.2's layers 0-2) and one routed whose attention reuses layer 2's selection (256
    // experts top-8 + 1 shared, sigmoid + bias, scale 2.5); latent attention 64 heads of
    // 192 + 64 / values 256 over a latent of 512, indexer 32 heads × 128, top 2048.
    Preset {
        name: "glm-5.2-4l",
        arch: "glm-dsa",
        n_layer: 4,
        n_embd: 6144,
        n_head: 64,
        n_head_kv: 1,
        head_dim: 256,
        n_expert: 256,
        n_expert_used: 8,
        n_ff_exp: 2048,
        n_vocab: 154_880,
        n_ctx: 1 << 20,
        mla: Some(MlaShape {
            q_lora_rank: 2048,
            kv_lora_rank: 512,
            qk_nope: 192,
            v_head_dim: 256,
        }),
        n_shared_exp: 1,
        n_dense_lead: 3,
        n_ff_dense: 12_288,
        n_rot: 64,
        qk_norm: false,
        sigmoid_gating: true,
        weights_scale: 2.5,
        dsa: Some(DsaShape {
            n_head: 32,
            head_dim: 128,
            top_k: 2048,
        }),
        ..GQA_ONLY
    },
    // GLM-5.3 Flash shapes (transformers' defaults) with 4 of 45 layers: three KDA layers
    // (64 heads × 128, conv 4; the dense ones) and one latent layer (64 heads, nope 256 / values
    // 256 over a latent of 512, the k-pool indexer: 32 × 128, pools of 16, top 2048) with 288
    // experts top-8 + 1 shared (sigmoid + bias, scale 2.5), 4 streams, SwiGLU clamped at 10.
    Preset {
        name: "glm-5.3-flash-4l",
        arch: "glm5-next",
        n_layer: 4,
        n_embd: 4096,
        n_head: 64,
        n_head_kv: 1,
        head_dim: 256,
        n_expert: 288,
        n_expert_used: 8,
        n_ff_exp: 2048,
        n_vocab: 154_880,
        n_ctx: 1 << 20,
        mla: Some(MlaShape {
            q_lora_rank: 1536,
            kv_lora_rank: 512,
            qk_nope: 256,
            v_head_dim: 256,
        }),
        n_shared_exp: 1,
        n_dense_lead: 3,
        n_ff_dense: 12_288,
        n_rot: 0,
        qk_norm: false,
        sigmoid_gating: true,
        weights_scale: 2.5,
        glm5next: Some(Glm5NextShape {
            kda_heads: 64,
            kda_head_dim: 128,
            conv_kernel: 4,
            index_n_head: 32,
            index_head_dim: 128,
            index_topk: 2048,
            kpool: 16,
            hc: 4,
            swiglu_limit: 10.0,
        }),
        ..GQA_ONLY
    },
    // GLM-4.5-Air shapes (106B-A12B) with 8 of 46 layers: 96 heads / 8 kv of 128, half-rope,
    // q/k/v biases, 128 experts top-8 + 1 shared, sigmoid + bias; 12.0 GiB.
    Preset {
        name: "glm-4.5-air-8l",
        arch: "glm4moe",
        n_layer: 8,
        n_embd: 4096,
        n_head: 96,
        n_head_kv: 8,
        head_dim: 128,
        n_expert: 128,
        n_expert_used: 8,
        n_ff_exp: 1408,
        n_vocab: 151_552,
        n_ctx: 32_768,
        n_shared_exp: 1,
        n_dense_lead: 1,
        n_ff_dense: 10_944,
        n_rot: 64,
        qkv_bias: true,
        qk_norm: false,
        sigmoid_gating: true,
        ..GQA_ONLY
    },
    // gpt-oss-20b as ggml-org's GGUF has it: MXFP4 experts, Q8_0 elsewhere (2880 is not whole
    // K-quant superblocks), sinks, biases, sliding window 128 on even layers, YaRN.
    Preset {
        name: "gpt-oss-20b",
        arch: "gpt-oss",
        n_layer: 24,
        n_embd: 2880,
        n_head: 64,
        n_head_kv: 8,
        head_dim: 64,
        n_expert: 32,
        n_expert_used: 4,
        n_ff_exp: 2880,
        n_vocab: 201_088,
        n_ctx: 131_072,
        qk_norm: false,
        norm_topk: false,
        ..GQA_ONLY
    },
    // DeepSeek-V4-Flash shapes (`deepseek4`): 43 layers of 4096 in 4 hyper-connection streams,
    // 64 query heads of 512 over one shared key/value head (64 rotary dims), sliding window 128
    // on every layer plus compressed rows (`Dsv4Shape::compress_ratios`), 256 experts top-6 of
    // 2048 + 1 shared, sqrt-softplus routing (the first 3 layers hash-routed), SwiGLU clamped at
    // 10. About 4.0 GiB a layer with Q4_K_M experts (1.9 with iq2_xxs) plus 0.7 GiB of
    // embeddings and head (175 GiB in all): use `--layers`.
    Preset {
        name: "deepseek-v4-flash",
        arch: "deepseek4",
        n_layer: DSV4_FLASH_LAYERS,
        n_embd: 4096,
        n_head: 64,
        n_head_kv: 1,
        head_dim: 512,
        n_expert: 256,
        n_expert_used: 6,
        n_ff_exp: 2048,
        n_vocab: 129_280,
        n_ctx: 1_048_576,
        n_shared_exp: 1,
        n_rot: 64,
        qk_norm: false,
        weights_scale: 1.5,
        dsv4: Some(Dsv4Shape {
            q_lora_rank: 1024,
            o_groups: 8,
            o_lora_rank: 1024,
            index_n_head: 64,
            index_head_dim: 128,
            index_topk: 512,
            sliding_window: 128,
            hc: 4,
            sinkhorn_iters: 20,
            hc_eps: 1e-6,
            n_hash_layers: 3,
            swiglu_limit: 10.0,
            rope_base: 10_000.0,
            compress_rope_base: 160_000.0,
            yarn_factor: 16.0,
            yarn_orig_ctx: 65_536,
            yarn_beta_fast: 32.0,
            yarn_beta_slow: 1.0,
        }),
        ..GQA_ONLY
    },
];
