//! The one table of GGUF tensor and metadata names (llama.cpp's `llama-arch.cpp` spelling).
//! Names are resolved once at load into typed per-layer structs; no name strings after that.

/// A tensor role. Per-layer roles are spelled `blk.{layer}.{base}.{weight|bias}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorName {
    TokenEmbd,
    OutputNorm,
    Output,
    RopeFreqs,
    AttnNorm,
    AttnQ,
    AttnK,
    AttnV,
    AttnOut,
    AttnQNorm,
    AttnKNorm,
    AttnSinks,
    /// GLM-4.5's pre-FFN norm (HF `post_attention_layernorm`).
    AttnPostNorm,
    FfnNorm,
    FfnGate,
    FfnUp,
    FfnDown,
    FfnGateInp,
    FfnGateExps,
    FfnUpExps,
    FfnDownExps,
    FfnGateUpExps,
    FfnGateInpShexp,
    FfnGateShexp,
    FfnUpShexp,
    FfnDownShexp,
    /// DeepSeek's router correction bias (`exp_probs_b.bias`), added for expert selection only.
    FfnExpProbsB,
    /// Multi-head latent attention (DeepSeek V2/V3): low-rank query (`attn_q_a`, its norm,
    /// `attn_q_b`), the joint latent + rope key projection, its norm, and the per-head
    /// decompression matrices.
    AttnQA,
    AttnQANorm,
    AttnQB,
    AttnKvAMqa,
    AttnKvANorm,
    AttnKB,
    AttnVB,
    AttnKvB,
    /// DeepSeek V4: the shared key/value projection, the grouped output projection, the
    /// hyper-connection mixes (per layer for attention and FFN, and the head's collapse), the
    /// compressors of compressed layers, the lightning indexer, and the hash-routing table.
    AttnKv,
    AttnOutA,
    AttnOutB,
    HcAttnFn,
    HcAttnBase,
    HcAttnScale,
    HcFfnFn,
    HcFfnBase,
    HcFfnScale,
    HcHeadFn,
    HcHeadBase,
    HcHeadScale,
    AttnCompressorKv,
    AttnCompressorGate,
    AttnCompressorApe,
    AttnCompressorNorm,
    IndexerProj,
    IndexerAttnK,
    IndexerKNorm,
    IndexerAttnQB,
    IndexerCompressorKv,
    IndexerCompressorGate,
    IndexerCompressorApe,
    IndexerCompressorNorm,
    FfnGateTid2Eid,
}

impl TensorName {
    pub fn base(self) -> &'static str {
        use TensorName::*;
        match self {
            TokenEmbd => "token_embd",
            OutputNorm => "output_norm",
            Output => "output",
            RopeFreqs => "rope_freqs",
            AttnNorm => "attn_norm",
            AttnQ => "attn_q",
            AttnK => "attn_k",
            AttnV => "attn_v",
            AttnOut => "attn_output",
            AttnQNorm => "attn_q_norm",
            AttnKNorm => "attn_k_norm",
            AttnSinks => "attn_sinks",
            AttnPostNorm => "post_attention_norm",
            FfnNorm => "ffn_norm",
            FfnGate => "ffn_gate",
            FfnUp => "ffn_up",
            FfnDown => "ffn_down",
            FfnGateInp => "ffn_gate_inp",
            FfnGateExps => "ffn_gate_exps",
            FfnUpExps => "ffn_up_exps",
            FfnDownExps => "ffn_down_exps",
            FfnGateUpExps => "ffn_gate_up_exps",
            FfnGateInpShexp => "ffn_gate_inp_shexp",
            FfnGateShexp => "ffn_gate_shexp",
            FfnUpShexp => "ffn_up_shexp",
            FfnDownShexp => "ffn_down_shexp",
            FfnExpProbsB => "exp_probs_b",
            AttnQA => "attn_q_a",
            AttnQANorm => "attn_q_a_norm",
            AttnQB => "attn_q_b",
            AttnKvAMqa => "attn_kv_a_mqa",
            AttnKvANorm => "attn_kv_a_norm",
            AttnKB => "attn_k_b",
            AttnVB => "attn_v_b",
            AttnKvB => "attn_kv_b",
            AttnKv => "attn_kv",
            AttnOutA => "attn_output_a",
            AttnOutB => "attn_output_b",
            HcAttnFn => "hc_attn_fn",
            HcAttnBase => "hc_attn_base",
            HcAttnScale => "hc_attn_scale",
            HcFfnFn => "hc_ffn_fn",
            HcFfnBase => "hc_ffn_base",
            HcFfnScale => "hc_ffn_scale",
            HcHeadFn => "output_hc_fn",
            HcHeadBase => "output_hc_base",
            HcHeadScale => "output_hc_scale",
            AttnCompressorKv => "attn_compressor_kv",
            AttnCompressorGate => "attn_compressor_gate",
            AttnCompressorApe => "attn_compressor_ape",
            AttnCompressorNorm => "attn_compressor_norm",
            IndexerProj => "indexer.proj",
            IndexerAttnK => "indexer.attn_k",
            IndexerKNorm => "indexer.k_norm",
            IndexerAttnQB => "indexer.attn_q_b",
            IndexerCompressorKv => "indexer_compressor_kv",
            IndexerCompressorGate => "indexer_compressor_gate",
            IndexerCompressorApe => "indexer_compressor_ape",
            IndexerCompressorNorm => "indexer_compressor_norm",
            FfnGateTid2Eid => "ffn_gate_tid2eid",
        }
    }

    pub fn is_per_layer(self) -> bool {
        !matches!(
            self,
            TensorName::TokenEmbd
                | TensorName::OutputNorm
                | TensorName::Output
                | TensorName::RopeFreqs
                | TensorName::HcHeadFn
                | TensorName::HcHeadBase
                | TensorName::HcHeadScale
        )
    }

    /// Whether the tensor holds routed experts (what streaming and expert sharding move around).
    pub fn is_routed_expert(self) -> bool {
        matches!(
            self,
            TensorName::FfnGateExps
                | TensorName::FfnUpExps
                | TensorName::FfnDownExps
                | TensorName::FfnGateUpExps
        )
    }

    pub fn weight(self, layer: usize) -> String {
        self.full(layer, "weight")
    }

    pub fn bias(self, layer: usize) -> String {
        self.full(layer, "bias")
    }

    fn full(self, layer: usize, suffix: &str) -> String {
        if self.is_per_layer() {
            format!("blk.{layer}.{}.{suffix}", self.base())
        } else {
            format!("{}.{suffix}", self.base())
        }
    }
}

/// Architecture-scoped metadata keys (`{arch}.{suffix}`).
pub mod keys {
    pub const BLOCK_COUNT: &str = "block_count";
    pub const CONTEXT_LENGTH: &str = "context_length";
    pub const EMBEDDING_LENGTH: &str = "embedding_length";
    pub const FEED_FORWARD_LENGTH: &str = "feed_forward_length";
    pub const HEAD_COUNT: &str = "attention.head_count";
    pub const HEAD_COUNT_KV: &str = "attention.head_count_kv";
    pub const KEY_LENGTH: &str = "attention.key_length";
    pub const VALUE_LENGTH: &str = "attention.value_length";
    pub const RMS_EPS: &str = "attention.layer_norm_rms_epsilon";
    pub const ROPE_DIMENSION_COUNT: &str = "rope.dimension_count";
    pub const ROPE_FREQ_BASE: &str = "rope.freq_base";
    pub const ROPE_SCALING_TYPE: &str = "rope.scaling.type";
    pub const ROPE_SCALING_FACTOR: &str = "rope.scaling.factor";
    pub const ROPE_SCALE_LINEAR: &str = "rope.scale_linear";
    pub const EXPERT_COUNT: &str = "expert_count";
    pub const EXPERT_USED_COUNT: &str = "expert_used_count";
    pub const EXPERT_FEED_FORWARD_LENGTH: &str = "expert_feed_forward_length";
    pub const EXPERT_SHARED_FEED_FORWARD_LENGTH: &str = "expert_shared_feed_forward_length";
    pub const EXPERT_WEIGHTS_SCALE: &str = "expert_weights_scale";
    pub const EXPERT_WEIGHTS_NORM: &str = "expert_weights_norm";
    pub const EXPERT_GATING_FUNC: &str = "expert_gating_func";
    pub const EXPERT_SHARED_COUNT: &str = "expert_shared_count";
    pub const EXPERT_GROUP_COUNT: &str = "expert_group_count";
    pub const EXPERT_GROUP_USED_COUNT: &str = "expert_group_used_count";
    pub const LEADING_DENSE_BLOCK_COUNT: &str = "leading_dense_block_count";
    pub const NEXTN_PREDICT_LAYERS: &str = "nextn_predict_layers";
    pub const Q_LORA_RANK: &str = "attention.q_lora_rank";
    pub const KV_LORA_RANK: &str = "attention.kv_lora_rank";
    pub const KEY_LENGTH_MLA: &str = "attention.key_length_mla";
    pub const VALUE_LENGTH_MLA: &str = "attention.value_length_mla";
    pub const SLIDING_WINDOW: &str = "attention.sliding_window";
    pub const SLIDING_WINDOW_PATTERN: &str = "attention.sliding_window_pattern";
    pub const ROPE_SCALING_ORIG_CTX: &str = "rope.scaling.original_context_length";
    pub const ROPE_SCALING_ATTN_FACTOR: &str = "rope.scaling.attn_factor";
    pub const ROPE_YARN_LOG_MUL: &str = "rope.scaling.yarn_log_multiplier";
    pub const ROPE_YARN_EXT_FACTOR: &str = "rope.scaling.yarn_ext_factor";
    pub const ROPE_YARN_ATTN_FACTOR: &str = "rope.scaling.yarn_attn_factor";
    pub const ROPE_YARN_BETA_FAST: &str = "rope.scaling.yarn_beta_fast";
    pub const ROPE_YARN_BETA_SLOW: &str = "rope.scaling.yarn_beta_slow";
    pub const COMPRESS_RATIOS: &str = "attention.compress_ratios";
    pub const COMPRESS_ROPE_FREQ_BASE: &str = "attention.compress_rope_freq_base";
    pub const OUTPUT_GROUP_COUNT: &str = "attention.output_group_count";
    pub const OUTPUT_LORA_RANK: &str = "attention.output_lora_rank";
    pub const INDEXER_HEAD_COUNT: &str = "attention.indexer.head_count";
    pub const INDEXER_KEY_LENGTH: &str = "attention.indexer.key_length";
    pub const INDEXER_TOP_K: &str = "attention.indexer.top_k";
    pub const INDEXER_TYPES: &str = "attention.indexer.types";
    pub const HC_COUNT: &str = "hyper_connection.count";
    pub const HC_SINKHORN_ITERS: &str = "hyper_connection.sinkhorn_iterations";
    pub const HC_EPS: &str = "hyper_connection.epsilon";
    pub const HASH_LAYER_COUNT: &str = "hash_layer_count";
    pub const SWIGLU_CLAMP_EXP: &str = "swiglu_clamp_exp";
    pub const SWIGLU_CLAMP_SHEXP: &str = "swiglu_clamp_shexp";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_llama_cpp_spelling() {
        assert_eq!(TensorName::AttnQ.weight(3), "blk.3.attn_q.weight");
        assert_eq!(TensorName::AttnQ.bias(0), "blk.0.attn_q.bias");
        assert_eq!(TensorName::TokenEmbd.weight(7), "token_embd.weight");
        assert_eq!(
            TensorName::FfnDownExps.weight(1),
            "blk.1.ffn_down_exps.weight"
        );
    }
}
