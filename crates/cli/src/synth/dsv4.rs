//! The DeepSeek V4 part of `moeshard synth`: the shape of a `deepseek4` preset, its tensors
//! and its metadata keys, as llama.cpp's converter names and types them.

use gguf::{GgmlType, GgufWriter, Value};

use super::{DSV4_FLASH_LAYERS, ExpertMix, Fill, Preset, TensorPlan};

/// The DeepSeek V4 sizes of a preset (on top of `n_head` heads of `head_dim`, one shared
/// key/value head, `n_rot` rotary dims).
#[derive(Clone, Debug)]
pub struct Dsv4Shape {
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub index_n_head: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub sliding_window: usize,
    /// Residual streams (`hc_mult`).
    pub hc: usize,
    pub sinkhorn_iters: usize,
    pub hc_eps: f32,
    /// Leading layers routed by `ffn_gate_tid2eid[token]` (capped at the layer count).
    pub n_hash_layers: usize,
    pub swiglu_limit: f32,
    pub rope_base: f32,
    /// Compressed layers' RoPE: its own base, with YaRN.
    pub compress_rope_base: f32,
    pub yarn_factor: f32,
    pub yarn_orig_ctx: usize,
    pub yarn_beta_fast: f32,
    pub yarn_beta_slow: f32,
}

impl Dsv4Shape {
    /// Per-layer compression ratios. All 43 layers: DeepSeek-V4-Flash's `[0, 0, 4, 128, 4, …]`
    /// (two window-only layers, then ratio 4 and 128 in turn). Fewer layers: the same without
    /// the two window-only ones, `[4, 128, 4, …]`, so that one layer already has a compressor
    /// and the lightning indexer and two have both kinds — llama.cpp cannot run a file without
    /// a ratio-4 layer (its indexer cache of no layers divides by zero building the rotation).
    pub(super) fn compress_ratios(n_layer: usize) -> Vec<i32> {
        let first_compressed = if n_layer == DSV4_FLASH_LAYERS { 2 } else { 0 };
        (0..n_layer)
            .map(|il| {
                if il < first_compressed {
                    0
                } else if (il - first_compressed).is_multiple_of(2) {
                    4
                } else {
                    128
                }
            })
            .collect()
    }
}

/// DeepSeek V4's tensors as `crates/model/src/weights.rs` and llama.cpp's
/// `llama_model_deepseek4::load_arch_tensors` bind them (ggml shapes, ne0 first), typed as the
/// Q4_K_M-style V4 GGUFs in circulation: routed experts per `experts`, attention projections and
/// the shared expert Q8_0, compressor / indexer projections and the hyper-connection mixes F16,
/// the router F32, norms, ape, sinks and hyper-connection bases/scales F32, embeddings Q4_K and
/// head Q6_K as the other presets.
pub(super) fn plan_dsv4(p: &Preset, v4: &Dsv4Shape, experts: ExpertMix) -> Vec<TensorPlan> {
    use GgmlType::{F16, F32, I32, Q4K, Q6K, Q8_0};
    let (exp_gate_up, exp_down) = experts.gate_up_down();
    let (d, hd, nh) = (p.n_embd as u64, p.head_dim as u64, p.n_head as u64);
    let (e, ff, vocab) = (p.n_expert as u64, p.n_ff_exp as u64, p.n_vocab as u64);
    let ql = v4.q_lora_rank as u64;
    let (og, olr) = (v4.o_groups as u64, v4.o_lora_rank as u64);
    let (inh, ihd) = (v4.index_n_head as u64, v4.index_head_dim as u64);
    let hc = v4.hc as u64;
    // Each hyper-connection mix reads all streams and writes pre (hc), post (hc) and the hc × hc
    // combination.
    let (hc_dim, hc_mix) = (hc * d, (2 + hc) * hc);
    let (random, constant) = (TensorPlan::random, TensorPlan::constant);
    // Small mixing weights, zero bases and unit scales: every stream weighs about the same
    // (sigmoid(0)), so the streams neither vanish nor blow up over the layers.
    let hyper_mix = |v: &mut Vec<TensorPlan>, prefix: String, rows: u64, n_scale: u64| {
        v.push(random(
            format!("{prefix}_fn.weight"),
            F16,
            vec![hc_dim, rows],
            0.005,
        ));
        v.push(constant(format!("{prefix}_base.weight"), vec![rows], 0.0));
        v.push(constant(
            format!("{prefix}_scale.weight"),
            vec![n_scale],
            1.0,
        ));
    };
    let ratios = Dsv4Shape::compress_ratios(p.n_layer);
    let mut v = vec![random("token_embd.weight".into(), Q4K, vec![d, vocab], 1.0)];
    for (i, &ratio) in ratios.iter().enumerate() {
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        v.push(constant(b("attn_norm"), vec![d], 1.0));
        v.push(random(b("attn_sinks"), F32, vec![nh], 0.1));
        v.push(random(b("attn_q_a"), Q8_0, vec![d, ql], 0.02));
        v.push(constant(b("attn_q_a_norm"), vec![ql], 1.0));
        v.push(random(b("attn_q_b"), Q8_0, vec![ql, nh * hd], 0.02));
        v.push(random(b("attn_kv"), Q8_0, vec![d, hd], 0.02));
        v.push(constant(b("attn_kv_a_norm"), vec![hd], 1.0));
        // Grouped output: each of `og` groups of heads projects to its own `olr` rows.
        v.push(random(
            b("attn_output_a"),
            Q8_0,
            vec![nh * hd / og, og * olr],
            0.02,
        ));
        v.push(random(b("attn_output_b"), Q8_0, vec![og * olr, d], 0.02));
        hyper_mix(&mut v, format!("blk.{i}.hc_attn"), hc_mix, 3);
        hyper_mix(&mut v, format!("blk.{i}.hc_ffn"), hc_mix, 3);
        if ratio > 0 {
            let ratio = ratio as u64;
            // Ratio 4 pools overlapping windows: two rows of every width.
            let overlap = if ratio == 4 { 2 } else { 1 };
            v.push(random(
                b("attn_compressor_kv"),
                F16,
                vec![d, overlap * hd],
                0.02,
            ));
            v.push(random(
                b("attn_compressor_gate"),
                F16,
                vec![d, overlap * hd],
                0.02,
            ));
            v.push(random(
                b("attn_compressor_ape"),
                F32,
                vec![overlap * hd, ratio],
                0.02,
            ));
            v.push(constant(b("attn_compressor_norm"), vec![hd], 1.0));
            if ratio == 4 {
                v.push(random(b("indexer.proj"), F16, vec![d, inh], 0.02));
                v.push(random(
                    b("indexer.attn_q_b"),
                    F16,
                    vec![ql, inh * ihd],
                    0.02,
                ));
                v.push(random(
                    b("indexer_compressor_kv"),
                    F16,
                    vec![d, 2 * ihd],
                    0.02,
                ));
                v.push(random(
                    b("indexer_compressor_gate"),
                    F16,
                    vec![d, 2 * ihd],
                    0.02,
                ));
                v.push(random(
                    b("indexer_compressor_ape"),
                    F32,
                    vec![2 * ihd, ratio],
                    0.02,
                ));
                v.push(constant(b("indexer_compressor_norm"), vec![ihd], 1.0));
            }
        }
        v.push(random(b("ffn_gate_inp"), F32, vec![d, e], 0.1));
        // Hash layers take their experts from the token id and have no selection bias.
        if i < v4.n_hash_layers {
            v.push(TensorPlan {
                name: b("ffn_gate_tid2eid"),
                dtype: I32,
                shape: vec![p.n_expert_used as u64, vocab],
                fill: Fill::ExpertIds(p.n_expert as u32),
            });
        } else {
            v.push(random(
                format!("blk.{i}.exp_probs_b.bias"),
                F32,
                vec![e],
                0.01,
            ));
        }
        v.push(constant(b("ffn_norm"), vec![d], 1.0));
        v.push(random(
            b("ffn_gate_exps"),
            exp_gate_up,
            vec![d, ff, e],
            0.02,
        ));
        v.push(random(b("ffn_up_exps"), exp_gate_up, vec![d, ff, e], 0.02));
        v.push(random(b("ffn_down_exps"), exp_down, vec![ff, d, e], 0.02));
        let fs = ff * p.n_shared_exp as u64;
        v.push(random(b("ffn_gate_shexp"), Q8_0, vec![d, fs], 0.02));
        v.push(random(b("ffn_up_shexp"), Q8_0, vec![d, fs], 0.02));
        v.push(random(b("ffn_down_shexp"), Q8_0, vec![fs, d], 0.02));
    }
    v.push(constant("output_norm.weight".into(), vec![d], 1.0));
    v.push(random("output.weight".into(), Q6K, vec![d, vocab], 0.02));
    hyper_mix(&mut v, "output_hc".into(), hc, 1);
    v
}

/// DeepSeek V4's keys, named and typed as llama.cpp's converter writes them (see
/// `crates/model/tests/fixtures/deepseek4/hparams.txt`): per-layer ratios as an INT32 array,
/// the SwiGLU limits as per-layer F32 arrays, sqrt-softplus gating (llama.cpp refuses any other).
pub(super) fn dsv4_metadata(w: &mut GgufWriter, p: &Preset, v4: &Dsv4Shape) -> anyhow::Result<()> {
    let a = p.arch;
    let u = |v: usize| Value::U32(v as u32);
    let f = Value::F32;
    let n_hash_layers = v4.n_hash_layers.min(p.n_layer);
    let keys: Vec<(&str, Value)> = vec![
        ("block_count", u(p.n_layer)),
        ("context_length", u(p.n_ctx)),
        ("embedding_length", u(p.n_embd)),
        ("embedding_length_out", u(v4.hc * p.n_embd)),
        ("attention.head_count", u(p.n_head)),
        ("attention.head_count_kv", u(p.n_head_kv)),
        ("attention.key_length", u(p.head_dim)),
        ("attention.value_length", u(p.head_dim)),
        ("attention.layer_norm_rms_epsilon", f(1e-6)),
        ("attention.q_lora_rank", u(v4.q_lora_rank)),
        ("attention.sliding_window", u(v4.sliding_window)),
        ("attention.output_group_count", u(v4.o_groups)),
        ("attention.output_lora_rank", u(v4.o_lora_rank)),
        ("attention.indexer.head_count", u(v4.index_n_head)),
        ("attention.indexer.key_length", u(v4.index_head_dim)),
        ("attention.indexer.top_k", u(v4.index_topk)),
        (
            "attention.compress_ratios",
            Dsv4Shape::compress_ratios(p.n_layer).into(),
        ),
        (
            "attention.compress_rope_freq_base",
            f(v4.compress_rope_base),
        ),
        ("rope.dimension_count", u(p.n_rot)),
        ("rope.freq_base", f(v4.rope_base)),
        ("rope.scaling.type", "yarn".into()),
        ("rope.scaling.factor", f(v4.yarn_factor)),
        ("rope.scaling.original_context_length", u(v4.yarn_orig_ctx)),
        ("rope.scaling.yarn_beta_fast", f(v4.yarn_beta_fast)),
        ("rope.scaling.yarn_beta_slow", f(v4.yarn_beta_slow)),
        ("expert_count", u(p.n_expert)),
        ("expert_used_count", u(p.n_expert_used)),
        // LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS.
        ("expert_gating_func", u(4)),
        ("expert_feed_forward_length", u(p.n_ff_exp)),
        ("expert_shared_count", u(p.n_shared_exp)),
        ("expert_weights_scale", f(p.weights_scale)),
        ("expert_weights_norm", Value::Bool(p.norm_topk)),
        ("swiglu_clamp_exp", vec![v4.swiglu_limit; p.n_layer].into()),
        (
            "swiglu_clamp_shexp",
            vec![v4.swiglu_limit; p.n_layer].into(),
        ),
        ("hyper_connection.count", u(v4.hc)),
        ("hyper_connection.sinkhorn_iterations", u(v4.sinkhorn_iters)),
        ("hyper_connection.epsilon", f(v4.hc_eps)),
        ("hash_layer_count", u(n_hash_layers)),
    ];
    for (key, value) in keys {
        w.add_metadata(format!("{a}.{key}"), value)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{PRESETS, logits_of_file, plan, write};
    use super::*;

    fn of<'a>(plans: &'a [TensorPlan], name: &str) -> Option<&'a TensorPlan> {
        plans.iter().find(|t| t.name == name)
    }

    #[test]
    fn dsv4_ratios_follow_flash_and_keep_both_kinds_in_short_files() {
        let full = Dsv4Shape::compress_ratios(DSV4_FLASH_LAYERS);
        assert_eq!(full.len(), 43);
        assert_eq!(&full[..6], &[0, 0, 4, 128, 4, 128]);
        assert_eq!(full[42], 4);
        assert_eq!(Dsv4Shape::compress_ratios(1), vec![4]);
        assert_eq!(Dsv4Shape::compress_ratios(4), vec![4, 128, 4, 128]);
    }

    /// The full preset's tensors as the `deepseek4` loaders bind them (shapes in ggml order).
    #[test]
    fn dsv4_flash_plan_has_the_loaders_tensors() {
        let p = PRESETS
            .iter()
            .find(|p| p.name == "deepseek-v4-flash")
            .unwrap();
        let plans = plan(p, ExpertMix::Q4KM);
        let shape = |name: &str| of(&plans, name).map(|t| (t.dtype, t.shape.clone()));
        use GgmlType::{F16, F32, I32, Q4K, Q6K, Q8_0};
        assert_eq!(
            shape("blk.0.ffn_gate_tid2eid.weight"),
            Some((I32, vec![6, 129_280]))
        );
        assert!(shape("blk.0.exp_probs_b.bias").is_none());
        assert!(shape("blk.2.ffn_gate_tid2eid.weight").is_some());
        assert_eq!(shape("blk.3.exp_probs_b.bias"), Some((F32, vec![256])));
        assert_eq!(
            shape("blk.0.attn_q_b.weight"),
            Some((Q8_0, vec![1024, 32_768]))
        );
        assert_eq!(
            shape("blk.0.attn_output_a.weight"),
            Some((Q8_0, vec![4096, 8192]))
        );
        assert_eq!(
            shape("blk.0.attn_output_b.weight"),
            Some((Q8_0, vec![8192, 4096]))
        );
        assert_eq!(
            shape("blk.0.hc_attn_fn.weight"),
            Some((F16, vec![16_384, 24]))
        );
        assert_eq!(shape("output_hc_fn.weight"), Some((F16, vec![16_384, 4])));
        assert!(shape("blk.1.attn_compressor_kv.weight").is_none());
        // Layer 2 is ratio 4 (overlapping: two rows per width, and the indexer), 3 is 128.
        assert_eq!(
            shape("blk.2.attn_compressor_kv.weight"),
            Some((F16, vec![4096, 1024]))
        );
        assert_eq!(
            shape("blk.2.attn_compressor_ape.weight"),
            Some((F32, vec![1024, 4]))
        );
        assert_eq!(
            shape("blk.2.indexer.attn_q_b.weight"),
            Some((F16, vec![1024, 8192]))
        );
        assert_eq!(
            shape("blk.2.indexer_compressor_ape.weight"),
            Some((F32, vec![256, 4]))
        );
        assert_eq!(
            shape("blk.3.attn_compressor_ape.weight"),
            Some((F32, vec![512, 128]))
        );
        assert!(shape("blk.3.indexer.proj.weight").is_none());
        assert_eq!(
            shape("blk.3.ffn_gate_exps.weight"),
            Some((Q4K, vec![4096, 2048, 256]))
        );
        assert_eq!(
            shape("blk.3.ffn_down_exps.weight"),
            Some((Q6K, vec![2048, 4096, 256]))
        );
        assert_eq!(
            shape("blk.3.ffn_down_shexp.weight"),
            Some((Q8_0, vec![2048, 4096]))
        );
    }

    /// DeepSeek V4 at toy widths but the real 43 layers (window-only, ratio-4 and ratio-128
    /// layers, 3 hash-routed) through the same plan and writer: the model loads the file (every
    /// tensor it binds is there, shaped and typed as it wants) and its logits over a prompt long
    /// enough to fill a ratio-128 compressed row are finite and moderate.
    #[test]
    fn dsv4_synth_file_loads_and_runs() {
        let flash = PRESETS
            .iter()
            .find(|p| p.name == "deepseek-v4-flash")
            .unwrap();
        let v4 = flash.dsv4.clone().unwrap();
        let tiny = Preset {
            n_layer: DSV4_FLASH_LAYERS,
            n_embd: 256,
            n_head: 4,
            head_dim: 128,
            n_expert: 8,
            n_expert_used: 2,
            n_ff_exp: 256,
            n_vocab: 300,
            n_ctx: 512,
            dsv4: Some(Dsv4Shape {
                q_lora_rank: 128,
                o_groups: 2,
                o_lora_rank: 64,
                index_n_head: 2,
                index_head_dim: 64,
                index_topk: 8,
                sliding_window: 16,
                ..v4
            }),
            ..flash.clone()
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny-dsv4.gguf");
        write(&tiny, ExpertMix::Q4KM, 1, &path).unwrap();
        let tokens: Vec<u32> = (0..140).map(|i| (i * 7 % 300) as u32).collect();
        let (model, _) = logits_of_file(&path, &tokens, model::KvType::F32);
        assert_eq!(model.n_layer(), DSV4_FLASH_LAYERS);
    }
}
