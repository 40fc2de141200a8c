//! DeepSeek V4 (`deepseek4`) against transformers 5.24 and llama.cpp on the tiny random
//! fixture (`tools/fixtures/models/deepseek4.py`): every attention kind (sliding only, ratio 4
//! with the indexer dropping rows from position 35 on, ratio 128), both routing kinds (hash and
//! sqrt-softplus), hyper-connections, 459 prompt positions, 32 greedy tokens.

mod common;

use std::path::{Path, PathBuf};

use common::{argmax, ids, json, logits_chunked, npy_f32, row_diffs};

use model::{
    Compute, KvCache, KvType, LogitsWanted, Model, NoHooks, ResidentExperts, SeqInput, StageInput,
    StageOutput,
};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek4")
}

/// `src` with every MXFP4 tensor rewritten as F32 (the same values), everything else as is.
fn dequantized_copy(src: &Path, dst: &Path) {
    let model = gguf::GgufModel::open(src).unwrap();
    let mut w = gguf::GgufWriter::with_metadata(model.metadata().clone()).unwrap();
    for t in model.tensors() {
        let info = t.info;
        let dims = info.shape.dims();
        if info.dtype != gguf::GgmlType::Mxfp4 {
            w.add_tensor(info.name.clone(), info.dtype, dims, t.data())
                .unwrap();
            continue;
        }
        let (row_len, rows, rb) = (
            dims[0] as usize,
            info.rows() as usize,
            info.row_bytes() as usize,
        );
        let mut out = Vec::with_capacity(rows * row_len * 4);
        let mut tmp = vec![0f32; row_len];
        for r in 0..rows {
            kernels::formats::dequantize_row(info.dtype, &t.data()[r * rb..(r + 1) * rb], &mut tmp)
                .unwrap();
            out.extend(tmp.iter().flat_map(|x| x.to_le_bytes()));
        }
        w.add_tensor(info.name.clone(), gguf::GgmlType::F32, dims, out)
            .unwrap();
    }
    w.write_to_path(dst).unwrap();
}

/// The file as converted (MXFP4 experts) against llama.cpp on the same file: both round the
/// experts' activations to Q8_0, so they agree to float rounding until a last-bit difference
/// moves one int8 code (then by up to a few hundredths on a random model).
#[test]
fn deepseek4_mxfp4_experts_agree_with_llama_cpp() {
    let dir = fixture();
    let model = Model::load(dir.join("model-f32.gguf")).unwrap();
    let cx = Compute::new(2);
    let prompt = ids(&json(&dir.join("prompt_tokens.json"))["tokens"]);
    let v = model.hp.n_vocab;
    let got = logits_chunked(&model, &cx, &prompt, prompt.len());
    let (_, want) = npy_f32(&dir.join("llama_cpp_logits_f32.npy"));
    let diffs = row_diffs(&got, &want, v);
    let worst = diffs.iter().copied().fold(0f32, f32::max);
    let close = diffs.iter().filter(|&&d| d <= 1e-4).count();
    let top1 = got
        .chunks_exact(v)
        .zip(want.chunks_exact(v))
        .filter(|(a, b)| argmax(a) == argmax(b))
        .count();
    eprintln!(
        "deepseek4 MXFP4 experts vs llama.cpp: max {worst:.3e}, {close}/{} positions within 1e-4, top-1 {top1}/{}",
        prompt.len(),
        prompt.len()
    );
    assert!(diffs[..15].iter().all(|&d| d <= 1e-5), "{:?}", &diffs[..15]);
    assert!(
        worst < 0.1 && top1 + 2 >= prompt.len(),
        "max {worst}, top-1 {top1}"
    );
}

#[test]
fn deepseek4_matches_transformers_at_every_position() {
    let dir = fixture();
    // The converter writes the routed experts as MXFP4, whose dot products (ours and
    // llama.cpp's) round activations to Q8_0; transformers computes them in f32. The exact
    // comparison runs on a copy with the experts dequantized to F32.
    let tmp = tempfile::tempdir().unwrap();
    let f32_experts = tmp.path().join("experts-f32.gguf");
    dequantized_copy(&dir.join("model-f32.gguf"), &f32_experts);
    let model = Model::load(&f32_experts).unwrap();
    let cx = Compute::new(2);
    let prompt = ids(&json(&dir.join("prompt_tokens.json"))["tokens"]);
    assert!(prompt.len() >= 300, "{} prompt tokens", prompt.len());
    let (shape, want) = npy_f32(&dir.join("logits.npy"));
    let v = model.hp.n_vocab;
    assert_eq!(shape, vec![prompt.len(), v]);
    let got = logits_chunked(&model, &cx, &prompt, prompt.len());
    let (_, lcpp) = npy_f32(&dir.join("llama_cpp_logits_f32_experts_f32.npy"));
    let dl = row_diffs(&got, &lcpp, v).into_iter().fold(0f32, f32::max);
    eprintln!("deepseek4: F32 experts, max |ours − llama.cpp| = {dl:.2e}");
    assert!(dl <= 1e-4, "llama.cpp with F32 experts: {dl}");
    let diffs = row_diffs(&got, &want, v);
    let worst = diffs.iter().copied().fold(0f32, f32::max);
    let first_bad = diffs.iter().position(|&d| d > 1e-4);
    eprintln!(
        "deepseek4: prompt logits max |ours − transformers| = {worst:.2e} over {} positions (first > 1e-4: {first_bad:?}); pos 0..4: {:?}",
        prompt.len(),
        &diffs[..4]
    );
    assert!(
        worst <= 1e-4,
        "prompt logits differ by {worst} (first at {first_bad:?})"
    );
    // The same prompt fed in chunks (the decode and chunked-prefill paths of the cache).
    for chunk in [1, 7, 64] {
        let c = logits_chunked(&model, &cx, &prompt, chunk);
        let d = row_diffs(&c, &want, v).into_iter().fold(0f32, f32::max);
        eprintln!("deepseek4: chunks of {chunk}: max diff {d:.2e}");
        assert!(d <= 1e-4, "chunks of {chunk}: {d}");
    }
    // 32 greedy tokens, one per forward, and their logits.
    let g = json(&dir.join("greedy.json"));
    let want_tokens = ids(&g["generated_tokens"]);
    let last = model.n_layer() - 1;
    let mut kv = KvCache::new(model.kv_layout(KvType::F32, 0..=last, 1024));
    let src = ResidentExperts::new(&model);
    let mut input = prompt.clone();
    let mut tokens = Vec::new();
    for _ in 0..want_tokens.len() {
        let mut seqs = [SeqInput {
            kv: &mut kv,
            n_tokens: input.len(),
            logits: LogitsWanted::Last,
        }];
        let StageOutput::Logits(l) = model
            .forward(
                &cx,
                &src,
                0..=last,
                true,
                StageInput::Tokens(&input),
                &mut seqs,
                &mut NoHooks,
            )
            .unwrap()
        else {
            unreachable!()
        };
        let t = argmax(l.row(0)) as u32;
        tokens.push(t);
        input = vec![t];
    }
    assert_eq!(tokens, want_tokens, "greedy tokens");
    let mut all = prompt.clone();
    all.extend_from_slice(&want_tokens[..want_tokens.len() - 1]);
    let got = logits_chunked(&model, &cx, &all, all.len());
    let (_, want_steps) = npy_f32(&dir.join("greedy_logits.npy"));
    let d = row_diffs(&got[(prompt.len() - 1) * v..], &want_steps, v)
        .into_iter()
        .fold(0f32, f32::max);
    eprintln!("deepseek4: decode-step logits max diff {d:.2e}");
    assert!(d <= 1e-4, "decode-step logits differ by {d}");
}

/// Threads only split work: prompt logits and one-token steps give the same bits at 1 and 3
/// threads (stream mixes, compressors, the indexer and attention run per row on the pool).
#[test]
fn deepseek4_thread_count_does_not_change_a_bit() {
    let dir = fixture();
    let model = Model::load(dir.join("model-f32.gguf")).unwrap();
    let prompt = ids(&json(&dir.join("prompt_tokens.json"))["tokens"]);
    let prompt = &prompt[..200];
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
    assert!(
        same(&runs[0].0, &runs[1].0),
        "prompt logits differ between 1 and 3 threads"
    );
    assert!(
        same(&runs[0].1, &runs[1].1),
        "token-by-token logits differ between 1 and 3 threads"
    );
}

/// A stage that starts inside the hash-routed layers gets the batch's token ids with the hidden
/// state (the pipeline's work header carries them): on a copy of the fixture whose layer 1 is
/// hash-routed too, layers 0 | 1..3 give the single pass's bits, and without the ids the stage
/// is refused by name.
#[test]
fn deepseek4_stage_inside_the_hash_layers_gets_the_token_ids() {
    let dir = fixture();
    let tmp = tempfile::tempdir().unwrap();
    let two_hash = tmp.path().join("two-hash.gguf");
    {
        let src = gguf::GgufModel::open(dir.join("model-f32.gguf")).unwrap();
        let mut meta = src.metadata().clone();
        meta.insert("deepseek4.hash_layer_count", 2u32);
        let mut w = gguf::GgufWriter::with_metadata(meta).unwrap();
        for t in src.tensors() {
            let info = t.info;
            w.add_tensor(info.name.clone(), info.dtype, info.shape.dims(), t.data())
                .unwrap();
            if info.name == "blk.0.ffn_gate_tid2eid.weight" {
                let dims = info.shape.dims();
                w.add_tensor("blk.1.ffn_gate_tid2eid.weight", info.dtype, dims, t.data())
                    .unwrap();
            }
        }
        w.write_to_path(&two_hash).unwrap();
    }
    let model = Model::load(&two_hash).unwrap();
    let cx = Compute::new(2);
    let prompt = ids(&json(&dir.join("prompt_tokens.json"))["tokens"]);
    let prompt = &prompt[..64];
    let whole = logits_chunked(&model, &cx, prompt, prompt.len());
    let src = ResidentExperts::new(&model);
    let layout = |layers| model.kv_layout(KvType::F32, layers, 1024);
    let (mut kv0, mut kv1) = (KvCache::new(layout(0..=0)), KvCache::new(layout(1..=3)));
    fn seq(kv: &mut KvCache, n_tokens: usize, logits: LogitsWanted) -> SeqInput<'_> {
        SeqInput {
            kv,
            n_tokens,
            logits,
        }
    }
    let StageOutput::Hidden(h) = model
        .forward(
            &cx,
            &src,
            0..=0,
            false,
            StageInput::Tokens(prompt),
            &mut [seq(&mut kv0, prompt.len(), LogitsWanted::None)],
            &mut NoHooks,
        )
        .unwrap()
    else {
        unreachable!()
    };
    let refused = model.forward(
        &cx,
        &src,
        1..=3,
        true,
        StageInput::Hidden(&h),
        &mut [seq(&mut kv1, prompt.len(), LogitsWanted::All)],
        &mut NoHooks,
    );
    let err = refused
        .expect_err("no token ids for a hash layer")
        .to_string();
    assert!(err.contains("layer 1 routes by token id"), "{err}");
    let StageOutput::Logits(l) = model
        .forward(
            &cx,
            &src,
            1..=3,
            true,
            StageInput::HiddenWithTokens(&h, prompt),
            &mut [seq(&mut kv1, prompt.len(), LogitsWanted::All)],
            &mut NoHooks,
        )
        .unwrap()
    else {
        unreachable!()
    };
    assert!(
        l.data
            .iter()
            .zip(&whole)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "layers 0 | 1..3 differ from one pass"
    );
}
