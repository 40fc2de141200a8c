//! GLM-5's sparse attention in synthetic files: the lightning indexer's tensors on the layers
//! GLM-5.2 runs it on, and its metadata.

use gguf::{GgmlType, GgufWriter, Value};

use super::{MlaShape, Preset, TensorPlan};

/// The indexer of a `glm-dsa` preset.
#[derive(Clone, Debug)]
pub struct DsaShape {
    pub n_head: usize,
    pub head_dim: usize,
    pub top_k: usize,
}

/// GLM-5.2's pattern (its config.json, llama.cpp's default): layers 0 and 1 run their own
/// indexer, then every fourth from layer 2; the others reuse the latest selection.
pub(super) fn runs_indexer(il: usize) -> bool {
    il < 2 || (il - 2).is_multiple_of(4)
}

/// The indexer tensors of layer `il` (none on a layer that reuses a selection), in the types
/// llama.cpp's Q4_K_M gives them (row-sized ones in Q8_0, norms F32).
pub(super) fn push_indexer(
    v: &mut Vec<TensorPlan>,
    p: &Preset,
    m: &MlaShape,
    dsa: &DsaShape,
    il: usize,
) {
    if !runs_indexer(il) {
        return;
    }
    use GgmlType::{F32, Q8_0};
    let d = p.n_embd as u64;
    let (nh, hd) = (dsa.n_head as u64, dsa.head_dim as u64);
    let w = |s: &str| format!("blk.{il}.indexer.{s}.weight");
    v.push(TensorPlan::of_std(
        w("attn_q_b"),
        Q8_0,
        vec![m.q_lora_rank as u64, nh * hd],
        0.02,
    ));
    v.push(TensorPlan::of_std(w("attn_k"), Q8_0, vec![d, hd], 0.02));
    v.push(TensorPlan::of_std(w("k_norm"), F32, vec![hd], 0.0));
    v.push(TensorPlan::of_std(
        format!("blk.{il}.indexer.k_norm.bias"),
        F32,
        vec![hd],
        0.02,
    ));
    v.push(TensorPlan::of_std(w("proj"), F32, vec![d, nh], 0.02));
}

pub(super) fn dsa_metadata(w: &mut GgufWriter, p: &Preset, dsa: &DsaShape) -> anyhow::Result<()> {
    let a = p.arch;
    let u = |v: usize| Value::U32(v as u32);
    w.add_metadata(format!("{a}.attention.indexer.head_count"), u(dsa.n_head))?;
    w.add_metadata(format!("{a}.attention.indexer.key_length"), u(dsa.head_dim))?;
    w.add_metadata(format!("{a}.attention.indexer.top_k"), u(dsa.top_k))?;
    let types: Vec<bool> = (0..p.n_layer).map(runs_indexer).collect();
    w.add_metadata(format!("{a}.attention.indexer.types"), types)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{ExpertMix, PRESETS, logits_of_file, write};
    use super::*;

    /// A shrunken glm-5.2-4l (GLM-5.2's indexer pattern, dense lead, the routed layer reusing
    /// a selection) loads and runs: the indexer selects among more positions than its top-k
    /// and the logits are finite and moderate.
    #[test]
    fn glm_dsa_synth_file_loads_and_runs() {
        let glm = PRESETS.iter().find(|p| p.name == "glm-5.2-4l").unwrap();
        let tiny = Preset {
            n_embd: 256,
            n_head: 4,
            head_dim: 96,
            n_expert: 8,
            n_expert_used: 2,
            n_ff_exp: 256,
            n_ff_dense: 512,
            n_vocab: 300,
            n_ctx: 512,
            n_rot: 32,
            mla: Some(MlaShape {
                q_lora_rank: 128,
                kv_lora_rank: 64,
                qk_nope: 64,
                v_head_dim: 64,
            }),
            dsa: Some(DsaShape {
                n_head: 4,
                head_dim: 64,
                top_k: 16,
            }),
            ..glm.clone()
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny-glm-dsa.gguf");
        write(&tiny, ExpertMix::Q4KM, 1, &path).unwrap();
        let tokens: Vec<u32> = (0..64).map(|i| (i * 7 % 300) as u32).collect();
        let (model, _) = logits_of_file(&path, &tokens, model::KvType::F16);
        let dsa = model.hp.dsa.as_ref().unwrap();
        assert_eq!(dsa.full, vec![true, true, true, false]);
    }
}
