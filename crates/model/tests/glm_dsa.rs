//! GLM-5 sparse attention (`glm-dsa`) against transformers 5.24 and llama.cpp on the tiny
//! random fixture (`tools/fixtures/models/glm_dsa.py`): MLA with the lightning indexer's top-16
//! dropping tokens from position 16 on, a shared layer after each full one, sigmoid routing
//! with a shared expert, 473 prompt positions and 32 greedy tokens.

mod common;

use std::path::PathBuf;

use common::{argmax, greedy, ids, json, logits_chunked, npy_f32, row_diffs};
use model::{Compute, KvCache, KvType, Model};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/glm-dsa")
}

fn worst(d: &[f32]) -> f32 {
    d.iter().copied().fold(0f32, f32::max)
}

#[test]
fn glm_dsa_matches_transformers_at_every_position() {
    let dir = fixture();
    let model = Model::load(dir.join("model-f32.gguf")).unwrap();
    assert_eq!(
        model.n_layer(),
        4,
        "the NextN block is not part of the trunk"
    );
    let cx = Compute::new(2);
    let prompt = ids(&json(&dir.join("prompt_tokens.json"))["tokens"]);
    assert!(prompt.len() >= 300, "{} prompt tokens", prompt.len());
    let (shape, want) = npy_f32(&dir.join("logits.npy"));
    let v = model.hp.n_vocab;
    assert_eq!(shape, vec![prompt.len(), v]);
    let got = logits_chunked(&model, &cx, &prompt, prompt.len());
    let diffs = row_diffs(&got, &want, v);
    let first_bad = diffs.iter().position(|&d| d > 1e-4);
    eprintln!(
        "glm-dsa: prompt logits max |ours − transformers| = {:.2e} over {} positions (first > 1e-4: {first_bad:?})",
        worst(&diffs),
        prompt.len()
    );
    let (_, lcpp) = npy_f32(&dir.join("llama_cpp_logits_f32.npy"));
    let dl = worst(&row_diffs(&got, &lcpp, v));
    eprintln!("glm-dsa: max |ours − llama.cpp| = {dl:.2e}");
    assert!(worst(&diffs) <= 1e-4, "first > 1e-4 at {first_bad:?}");
    assert!(dl <= 2e-4, "llama.cpp: {dl}");
    for chunk in [1, 7, 64] {
        let c = logits_chunked(&model, &cx, &prompt, chunk);
        let d = worst(&row_diffs(&c, &want, v));
        eprintln!("glm-dsa: chunks of {chunk}: max diff {d:.2e}");
        assert!(d <= 1e-4, "chunks of {chunk}: {d}");
    }
    let g = json(&dir.join("greedy.json"));
    let want_tokens = ids(&g["generated_tokens"]);
    assert_eq!(
        greedy(&model, &cx, &prompt, want_tokens.len()),
        want_tokens,
        "greedy tokens"
    );
    let mut all = prompt.clone();
    all.extend_from_slice(&want_tokens[..want_tokens.len() - 1]);
    let got = logits_chunked(&model, &cx, &all, all.len());
    let (_, want_steps) = npy_f32(&dir.join("greedy_logits.npy"));
    let d = worst(&row_diffs(&got[(prompt.len() - 1) * v..], &want_steps, v));
    eprintln!("glm-dsa: decode-step logits max diff {d:.2e}");
    assert!(d <= 1e-4, "decode-step logits differ by {d}");
    assert_eq!(
        argmax(&got[(all.len() - 1) * v..]) as u32,
        *want_tokens.last().unwrap()
    );
}

/// The selection matters: with every visible token attended (top-k as large as the context)
/// the logits leave the reference from position 16 on, where the indexer starts dropping.
#[test]
fn glm_dsa_indexer_drops_tokens_that_change_the_output() {
    let dir = fixture();
    let mut model = Model::load(dir.join("model-f32.gguf")).unwrap();
    let cx = Compute::new(2);
    let prompt = ids(&json(&dir.join("prompt_tokens.json"))["tokens"]);
    let prompt = &prompt[..64];
    let (_, want) = npy_f32(&dir.join("logits.npy"));
    let v = model.hp.n_vocab;
    model.hp.dsa.as_mut().unwrap().top_k = 1 << 20;
    let dense = logits_chunked(&model, &cx, prompt, prompt.len());
    let diffs = row_diffs(&dense, &want[..prompt.len() * v], v);
    assert!(worst(&diffs[..16]) <= 1e-4, "{:?}", &diffs[..16]);
    assert!(worst(&diffs[16..]) > 1e-2, "{:?}", &diffs[16..]);
}

/// Threads only split work: prompt logits and one-token steps give the same bits at 1 and 3
/// threads.
#[test]
fn glm_dsa_thread_count_does_not_change_a_bit() {
    let dir = fixture();
    let model = Model::load(dir.join("model-f32.gguf")).unwrap();
    let prompt = ids(&json(&dir.join("prompt_tokens.json"))["tokens"]);
    let prompt = &prompt[..120];
    let runs: Vec<(Vec<f32>, Vec<f32>)> = [1, 3]
        .iter()
        .map(|&t| {
            let cx = Compute::new(t);
            (
                logits_chunked(&model, &cx, prompt, prompt.len()),
                logits_chunked(&model, &cx, prompt, 1),
            )
        })
        .collect();
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    assert!(same(&runs[0].0, &runs[1].0), "prompt logits");
    assert!(same(&runs[0].1, &runs[1].1), "token-by-token logits");
}

/// The cache holds the latent row of every layer and the indexer key of the full layers only,
/// the keys in f32 whatever the KV type; a snapshot of a cache restores it exactly.
#[test]
fn glm_dsa_cache_keeps_f32_indexer_keys_of_full_layers() {
    let dir = fixture();
    let model = Model::load(dir.join("model-f32.gguf")).unwrap();
    let last = model.n_layer() - 1;
    let kv = KvCache::new(model.kv_layout(KvType::F16, 0..=last, 512));
    // Latent 32 + rope 16 in f16 on 4 layers, 64 f32 indexer values on layers 0 and 2.
    assert_eq!(kv.bytes_per_position(), 4 * 48 * 2 + 2 * 64 * 4);
}
