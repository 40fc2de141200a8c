//! The gpt-oss preset's tensor plan.

use gguf::GgmlType;

use super::{Preset, TensorPlan};

/// gpt-oss' tensors (`crates/model/src/arch/gpt_oss.rs`): Q8_0 attention, embeddings and head,
/// MXFP4 experts, F32 norms, sinks and biases.
pub(super) fn plan_gpt_oss(p: &Preset) -> Vec<TensorPlan> {
    use GgmlType::{F32, Mxfp4, Q8_0};
    let (d, hd) = (p.n_embd as u64, p.head_dim as u64);
    let (q, kv) = (p.n_head as u64 * hd, p.n_head_kv as u64 * hd);
    let (e, ff) = (p.n_expert as u64, p.n_ff_exp as u64);
    let t = TensorPlan::of_std;
    let mut v = vec![t(
        "token_embd.weight".into(),
        Q8_0,
        vec![d, p.n_vocab as u64],
        1.0,
    )];
    for i in 0..p.n_layer {
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        let bias = |s: &str| format!("blk.{i}.{s}.bias");
        v.push(t(b("attn_norm"), F32, vec![d], 0.0));
        for (name, rows) in [("attn_q", q), ("attn_k", kv), ("attn_v", kv)] {
            v.push(t(b(name), Q8_0, vec![d, rows], 0.02));
            v.push(t(bias(name), F32, vec![rows], 0.02));
        }
        v.push(t(b("attn_output"), Q8_0, vec![q, d], 0.02));
        v.push(t(bias("attn_output"), F32, vec![d], 0.02));
        v.push(t(b("attn_sinks"), F32, vec![p.n_head as u64], 0.5));
        v.push(t(b("post_attention_norm"), F32, vec![d], 0.0));
        v.push(t(b("ffn_gate_inp"), F32, vec![d, e], 0.1));
        v.push(t(bias("ffn_gate_inp"), F32, vec![e], 0.1));
        v.push(t(b("ffn_gate_exps"), Mxfp4, vec![d, ff, e], 0.02));
        v.push(t(b("ffn_up_exps"), Mxfp4, vec![d, ff, e], 0.02));
        v.push(t(b("ffn_down_exps"), Mxfp4, vec![ff, d, e], 0.02));
        v.push(t(bias("ffn_gate_exps"), F32, vec![ff, e], 0.02));
        v.push(t(bias("ffn_up_exps"), F32, vec![ff, e], 0.02));
        v.push(t(bias("ffn_down_exps"), F32, vec![d, e], 0.02));
    }
    v.push(t("output_norm.weight".into(), F32, vec![d], 0.0));
    v.push(t(
        "output.weight".into(),
        Q8_0,
        vec![d, p.n_vocab as u64],
        0.02,
    ));
    v
}
