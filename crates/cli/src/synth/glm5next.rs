//! GLM-5.3 Flash (`glm5-next`) in synthetic files: KDA layers (three of every four), latent
//! attention with the k-pool indexer, hyper-connection streams, the clamped SwiGLU; tensor
//! names, shapes and keys as llama.cpp's converter writes them (see
//! `crates/model/tests/fixtures/glm5-next/hparams.txt`).

use gguf::{GgmlType, GgufWriter, Value};

use super::{ExpertMix, Fill, Preset, TensorPlan};

/// The parts of a `glm5-next` preset beyond the shared fields (`mla` holds the latent sizes).
#[derive(Clone, Debug)]
pub struct Glm5NextShape {
    pub kda_heads: usize,
    pub kda_head_dim: usize,
    pub conv_kernel: usize,
    pub index_n_head: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub kpool: usize,
    pub hc: usize,
    pub swiglu_limit: f32,
}

/// GLM-5.3 Flash's pattern (transformers' default): layer `i` is a KDA layer unless
/// `i % 4 == 3`.
pub(super) fn is_kda(il: usize) -> bool {
    il % 4 != 3
}

pub(super) fn plan_glm5next(p: &Preset, g: &Glm5NextShape, experts: ExpertMix) -> Vec<TensorPlan> {
    use GgmlType::{F16, F32, Q4K, Q6K, Q8_0};
    let m = p.mla.as_ref().expect("glm5-next presets have latent sizes");
    let (exp_gate_up, exp_down) = experts.gate_up_down();
    let (d, nh) = (p.n_embd as u64, p.n_head as u64);
    let (e, ff, vocab) = (p.n_expert as u64, p.n_ff_exp as u64, p.n_vocab as u64);
    let (ql, r) = (m.q_lora_rank as u64, m.kv_lora_rank as u64);
    let (nope, dv) = (m.qk_nope as u64, m.v_head_dim as u64);
    let (kh, kd) = (g.kda_heads as u64, g.kda_head_dim as u64);
    let (inh, ihd) = (g.index_n_head as u64, g.index_head_dim as u64);
    let hc = g.hc as u64;
    let (random, constant) = (TensorPlan::random, TensorPlan::constant);
    let mut v = vec![random("token_embd.weight".into(), Q4K, vec![d, vocab], 1.0)];
    for i in 0..p.n_layer {
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        v.push(constant(b("attn_norm"), vec![d], 1.0));
        for site in ["hc_attn", "hc_ffn"] {
            // Small mixing weights, zero bases, unit scales: every stream weighs the same.
            let rows = (2 + hc) * hc;
            v.push(random(
                b(&format!("{site}_fn")),
                F16,
                vec![hc * d, rows],
                0.005,
            ));
            v.push(constant(b(&format!("{site}_base")), vec![rows], 0.0));
            v.push(constant(b(&format!("{site}_scale")), vec![3], 1.0));
        }
        if is_kda(i) {
            let width = kh * kd;
            for name in ["attn_q", "attn_k", "attn_v"] {
                v.push(random(b(name), Q4K, vec![d, width], 0.02));
            }
            for name in ["ssm_conv1d_q", "ssm_conv1d_k", "ssm_conv1d_v"] {
                v.push(TensorPlan {
                    name: b(name),
                    dtype: F32,
                    shape: vec![g.conv_kernel as u64, 1, width, 1],
                    fill: Fill::Random(0.2),
                });
            }
            v.push(random(b("ssm_f_a"), Q8_0, vec![d, kd], 0.02));
            v.push(random(b("ssm_f_b"), Q8_0, vec![kd, width], 0.02));
            v.push(random(b("ssm_g_a"), Q8_0, vec![d, kd], 0.02));
            v.push(random(b("ssm_g_b"), Q8_0, vec![kd, width], 0.02));
            v.push(random(b("ssm_beta"), F32, vec![d, kh], 0.02));
            v.push(random(
                format!("blk.{i}.ssm_dt.bias"),
                F32,
                vec![width],
                0.1,
            ));
            v.push(constant(format!("blk.{i}.ssm_a"), vec![kh], -1.0));
            v.push(constant(b("ssm_norm"), vec![kd], 1.0));
            v.push(random(b("attn_output"), Q4K, vec![width, d], 0.02));
        } else {
            v.push(random(b("attn_q_a"), Q4K, vec![d, ql], 0.02));
            v.push(constant(b("attn_q_a_norm"), vec![ql], 1.0));
            v.push(random(b("attn_q_b"), Q4K, vec![ql, nh * nope], 0.02));
            v.push(random(b("attn_kv_a_mqa"), Q4K, vec![d, r], 0.02));
            v.push(constant(b("attn_kv_a_norm"), vec![r], 1.0));
            v.push(random(b("attn_k_b"), Q8_0, vec![nope, r, nh], 0.02));
            v.push(random(b("attn_v_b"), Q8_0, vec![r, dv, nh], 0.02));
            v.push(random(b("attn_output"), Q4K, vec![nh * dv, d], 0.02));
            v.push(random(
                b("indexer.attn_q_b"),
                Q8_0,
                vec![ql, inh * ihd],
                0.02,
            ));
            v.push(random(b("indexer.attn_k"), Q8_0, vec![d, ihd], 0.02));
            v.push(constant(b("indexer.k_norm"), vec![ihd], 1.0));
            v.push(random(
                format!("blk.{i}.indexer.k_norm.bias"),
                F32,
                vec![ihd],
                0.02,
            ));
            v.push(random(b("indexer.proj"), F32, vec![d, inh], 0.02));
            v.push(random(
                b("indexer_compressor_gate"),
                Q8_0,
                vec![d, ihd],
                0.02,
            ));
            v.push(random(
                b("indexer_compressor_ape"),
                F32,
                vec![ihd, g.kpool as u64],
                0.1,
            ));
        }
        v.push(constant(b("ffn_norm"), vec![d], 1.0));
        if i < p.n_dense_lead {
            let fd = p.n_ff_dense as u64;
            v.push(random(b("ffn_gate"), Q4K, vec![d, fd], 0.02));
            v.push(random(b("ffn_up"), Q4K, vec![d, fd], 0.02));
            v.push(random(b("ffn_down"), Q6K, vec![fd, d], 0.02));
            continue;
        }
        v.push(random(b("ffn_gate_inp"), F32, vec![d, e], 0.1));
        v.push(random(
            format!("blk.{i}.exp_probs_b.bias"),
            F32,
            vec![e],
            0.01,
        ));
        v.push(random(
            b("ffn_gate_exps"),
            exp_gate_up,
            vec![d, ff, e],
            0.02,
        ));
        v.push(random(b("ffn_up_exps"), exp_gate_up, vec![d, ff, e], 0.02));
        v.push(random(b("ffn_down_exps"), exp_down, vec![ff, d, e], 0.02));
        let fs = ff * p.n_shared_exp as u64;
        v.push(random(b("ffn_gate_shexp"), Q4K, vec![d, fs], 0.02));
        v.push(random(b("ffn_up_shexp"), Q4K, vec![d, fs], 0.02));
        v.push(random(b("ffn_down_shexp"), Q6K, vec![fs, d], 0.02));
    }
    v.push(constant("output_norm.weight".into(), vec![d], 1.0));
    v.push(random("output.weight".into(), Q6K, vec![d, vocab], 0.02));
    v
}

pub(super) fn glm5next_metadata(
    w: &mut GgufWriter,
    p: &Preset,
    g: &Glm5NextShape,
) -> anyhow::Result<()> {
    let m = p.mla.as_ref().expect("glm5-next presets have latent sizes");
    let a = p.arch;
    let u = |v: usize| Value::U32(v as u32);
    let f = Value::F32;
    let kv_heads: Vec<i32> = (0..p.n_layer).map(|i| i32::from(!is_kda(i))).collect();
    let keys: Vec<(&str, Value)> = vec![
        ("block_count", u(p.n_layer)),
        ("context_length", u(p.n_ctx)),
        ("embedding_length", u(p.n_embd)),
        ("feed_forward_length", u(p.n_ff_dense)),
        ("attention.head_count", u(p.n_head)),
        ("attention.head_count_kv", kv_heads.into()),
        ("attention.layer_norm_rms_epsilon", f(1e-5)),
        ("attention.layer_norm_epsilon", f(1e-6)),
        ("ssm.conv_kernel", u(g.conv_kernel)),
        ("kda.head_dim", u(g.kda_head_dim)),
        ("kda.gate_lower_bound", f(-5.0)),
        ("attention.q_lora_rank", u(m.q_lora_rank)),
        ("attention.kv_lora_rank", u(m.kv_lora_rank)),
        ("rope.dimension_count", u(0)),
        ("attention.key_length", u(m.kv_lora_rank)),
        ("attention.value_length", u(m.kv_lora_rank)),
        ("attention.key_length_mla", u(m.qk_nope)),
        ("attention.value_length_mla", u(m.v_head_dim)),
        ("attention.indexer.head_count", u(g.index_n_head)),
        ("attention.indexer.key_length", u(g.index_head_dim)),
        ("attention.indexer.top_k", u(g.index_topk)),
        ("attention.indexer.kpool", u(g.kpool)),
        ("attention.indexer.kpool_select_tail", Value::Bool(true)),
        ("attention.indexer.types", vec![true; p.n_layer].into()),
        ("hyper_connection.count", u(g.hc)),
        ("hyper_connection.sinkhorn_iterations", u(20)),
        ("hyper_connection.epsilon", f(1e-6)),
        ("leading_dense_block_count", u(p.n_dense_lead)),
        ("expert_count", u(p.n_expert)),
        ("expert_used_count", u(p.n_expert_used)),
        ("expert_group_count", u(1)),
        ("expert_group_used_count", u(1)),
        ("expert_feed_forward_length", u(p.n_ff_exp)),
        ("expert_shared_count", u(p.n_shared_exp)),
        ("expert_weights_scale", f(p.weights_scale)),
        ("expert_weights_norm", Value::Bool(p.norm_topk)),
        ("swiglu_clamp_exp", vec![g.swiglu_limit; p.n_layer].into()),
        ("swiglu_clamp_shexp", vec![g.swiglu_limit; p.n_layer].into()),
    ];
    for (key, value) in keys {
        w.add_metadata(format!("{a}.{key}"), value)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{MlaShape, PRESETS, logits_of_file, write};
    use super::*;

    /// A shrunken glm-5.3-flash-4l (three KDA layers, then latent attention with the k-pool
    /// indexer on a routed layer) loads and runs over more positions than its top-k.
    #[test]
    fn glm5next_synth_file_loads_and_runs() {
        let flash = PRESETS
            .iter()
            .find(|p| p.name == "glm-5.3-flash-4l")
            .unwrap();
        let tiny = Preset {
            n_embd: 256,
            n_head: 4,
            n_expert: 8,
            n_expert_used: 2,
            n_ff_exp: 256,
            n_ff_dense: 512,
            n_vocab: 300,
            n_ctx: 512,
            mla: Some(MlaShape {
                q_lora_rank: 128,
                kv_lora_rank: 64,
                qk_nope: 64,
                v_head_dim: 64,
            }),
            glm5next: Some(Glm5NextShape {
                kda_heads: 4,
                kda_head_dim: 64,
                index_n_head: 4,
                index_head_dim: 64,
                index_topk: 16,
                kpool: 4,
                ..flash.glm5next.clone().unwrap()
            }),
            ..flash.clone()
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny-glm5next.gguf");
        write(&tiny, ExpertMix::Q4KM, 1, &path).unwrap();
        let tokens: Vec<u32> = (0..64).map(|i| (i * 7 % 300) as u32).collect();
        let (model, _) = logits_of_file(&path, &tokens, model::KvType::F16);
        assert_eq!(model.n_layer(), 4);
    }
}
