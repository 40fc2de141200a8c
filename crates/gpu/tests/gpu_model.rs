//! Whole models with their matrix products on the GPU against the CPU path: the prompt's
//! logits (the batched path) and a greedy continuation (one token per forward), on the F32 and
//! quantized fixtures of the model crate. Runs where a CUDA device opens; elsewhere it prints
//! why it was skipped.

use std::path::PathBuf;
use std::sync::Arc;

use model::{Compute, Model, WeightSelection};

#[path = "../../model/tests/common/mod.rs"]
mod common;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures")
}

/// Prompt logits (whole prompt at once: the batched path) and 16 greedy tokens (the decode path).
fn run(model: &Model, cx: &Compute, tokens: &[u32]) -> (Vec<f32>, Vec<u32>) {
    (
        common::logits_chunked(model, cx, tokens, tokens.len()),
        common::greedy(model, cx, tokens, 16),
    )
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// How far the GPU may be from the CPU on `file`: 1e-3 on F32 weights. With quantized weights
/// the activations are quantized too, and a value whose product lands within rounding of a
/// quantization step boundary may take the neighbouring step on one side (the two sum in
/// different orders): the rest of the sequence carries that step. Such a difference must stay
/// well below what quantizing the weights moved the logits (`quant_noise`: this file's CPU
/// logits against the F32 file's).
fn tolerance(file: &str, quant_noise: f32) -> f32 {
    if file.contains("f32") {
        1e-3
    } else {
        1e-3f32.max(0.25 * quant_noise)
    }
}

fn whole(model: &Model) -> WeightSelection {
    WeightSelection {
        layers: 0..=model.n_layer() - 1,
        embeddings: true,
        head: true,
        experts: true,
    }
}

fn prompt(arch: &str) -> Vec<u32> {
    common::ids(&common::json(&fixtures().join(arch).join("prompt_tokens.json"))["tokens"])
}

#[test]
fn gpu_logits_and_greedy_tokens_match_the_cpu() {
    if let Err(e) = gpu::open(0) {
        // Only a missing device skips; a device whose kernels fail to build fails.
        assert!(matches!(e, gpu::GpuError::Unavailable(_)), "{e}");
        eprintln!("skipped (no GPU): {e}");
        return;
    }
    let mut ran = 0;
    for arch in [
        "qwen3moe",
        "mixtral",
        "llama",
        "olmoe",
        "qwen2moe",
        "gpt-oss",
        "deepseek2",
    ] {
        let dir = fixtures().join(arch);
        let mut f32_logits: Option<Vec<f32>> = None;
        for file in ["model-f32.gguf", "model-q8_0.gguf", "model-q4_k.gguf"] {
            let path = dir.join(file);
            if !path.exists() {
                continue;
            }
            let model = Arc::new(Model::load(&path).unwrap());
            let tokens = prompt(arch);
            let cpu = Compute::new(2);
            let (want, want_tokens) = run(&model, &cpu, &tokens);
            let reference = f32_logits.get_or_insert_with(|| want.clone());
            let tol = tolerance(file, max_diff(&want, reference));
            let mut dev = gpu::open(0).unwrap();
            let report = gpu::upload_model(&mut dev, &model, &whole(&model), u64::MAX).unwrap();
            let on_gpu = Compute::new(2).with_offload(Arc::new(dev));
            let (got, got_tokens) = run(&model, &on_gpu, &tokens);
            let d = max_diff(&got, &want);
            eprintln!(
                "{arch} {file}: {report}; prompt logits max |gpu − cpu| = {d:.2e} (bound {tol:.1e})"
            );
            assert!(d <= tol, "{arch} {file}: logits differ by {d}");
            assert_eq!(got_tokens, want_tokens, "{arch} {file}: greedy tokens");
            ran += 1;
        }
    }
    assert!(ran > 0, "no fixture found under {}", fixtures().display());
}

/// A memory limit below the model's size: dense weights and some experts on the GPU, the rest
/// on the CPU, both in the same step; the same tokens.
#[test]
fn hybrid_placement_matches_the_cpu() {
    if let Err(e) = gpu::open(0) {
        // Only a missing device skips; a device whose kernels fail to build fails.
        assert!(matches!(e, gpu::GpuError::Unavailable(_)), "{e}");
        eprintln!("skipped (no GPU): {e}");
        return;
    }
    let dir = fixtures().join("qwen3moe");
    let model = Arc::new(Model::load(dir.join("model-q4_k.gguf")).unwrap());
    let tokens = prompt("qwen3moe");
    let (want, want_tokens) = run(&model, &Compute::new(2), &tokens);
    let sel = whole(&model);
    // What the whole model takes on the device (that device is released at the block's end).
    let full = {
        let mut probe = gpu::open(0).unwrap();
        gpu::upload_model(&mut probe, &model, &sel, u64::MAX).unwrap()
    };
    // A third of the experts (the first layers whole), and a few of layer 0's only: there the
    // very first step already splits between the GPU and the CPU.
    let n_layer = model.n_layer() as u64;
    for budget in [
        full.dense_on_gpu + full.experts_on_gpu / 3,
        full.dense_on_gpu + full.experts_on_gpu / (n_layer * 4),
    ] {
        let mut dev = gpu::open(0).unwrap();
        let report = gpu::upload_model(&mut dev, &model, &sel, budget).unwrap();
        assert!(
            report.experts_on_gpu > 0 && report.experts_on_gpu < full.experts_on_gpu,
            "{report}"
        );
        let on_gpu = Compute::new(2).with_offload(Arc::new(dev));
        let (got, got_tokens) = run(&model, &on_gpu, &tokens);
        let d = max_diff(&got, &want);
        eprintln!("qwen3moe q4_k hybrid: {report}; max |gpu − cpu| = {d:.2e}");
        assert!(d <= 1e-3);
        assert_eq!(got_tokens, want_tokens);
    }
}

/// Logits of `tokens` in chunks of 4 over one f16 cache, chunk `i` on `pick(i)`; then a rewind
/// of 2 positions and those 2 again on the last compute.
fn mixed(
    model: &Model,
    computes: &[&Compute],
    pick: impl Fn(usize) -> usize,
    tokens: &[u32],
) -> Vec<f32> {
    use model::{
        KvCache, KvType, LogitsWanted, NoHooks, ResidentExperts, SeqInput, StageInput, StageOutput,
    };
    let last = model.n_layer() - 1;
    let mut kv = KvCache::new(model.kv_layout(KvType::F16, 0..=last, 1024));
    let src = ResidentExperts::new(model);
    let mut out = Vec::new();
    let step = |kv: &mut KvCache, cx: &Compute, part: &[u32], out: &mut Vec<f32>| {
        let mut seqs = [SeqInput {
            kv,
            n_tokens: part.len(),
            logits: LogitsWanted::All,
        }];
        match model
            .forward(
                cx,
                &src,
                0..=last,
                true,
                StageInput::Tokens(part),
                &mut seqs,
                &mut NoHooks,
            )
            .unwrap()
        {
            StageOutput::Logits(l) => out.extend(l.data),
            StageOutput::Hidden(_) => unreachable!(),
        }
    };
    for (i, part) in tokens.chunks(4).enumerate() {
        step(&mut kv, computes[pick(i)], part, &mut out);
    }
    let n = tokens.len();
    kv.truncate(n - 2).unwrap();
    step(
        &mut kv,
        computes[computes.len() - 1],
        &tokens[n - 2..],
        &mut out,
    );
    out
}

/// Whole steps on the GPU (every layer and the head there, the caches mirrored in its memory)
/// against the CPU: the prompt's logits, greedy tokens, and a cache that moves between the
/// CPU path and the GPU (re-copied when stale, kept across a rewind). Models whose layers have
/// no whole-layer form must say why.
#[test]
fn whole_steps_on_the_gpu_match_the_cpu() {
    if let Err(e) = gpu::open(0) {
        // Only a missing device skips; a device whose kernels fail to build fails.
        assert!(matches!(e, gpu::GpuError::Unavailable(_)), "{e}");
        eprintln!("skipped (no GPU): {e}");
        return;
    }
    let mut ran = 0;
    for arch in [
        "qwen3moe",
        "mixtral",
        "llama",
        "olmoe",
        "qwen2moe",
        "gpt-oss",
        "deepseek2",
    ] {
        let dir = fixtures().join(arch);
        let mut f32_logits: Option<Vec<f32>> = None;
        for file in ["model-f32.gguf", "model-q8_0.gguf", "model-q4_k.gguf"] {
            let path = dir.join(file);
            if !path.exists() {
                continue;
            }
            let model = Arc::new(Model::load(&path).unwrap());
            let cpu = Compute::new(2);
            let tokens = prompt(arch);
            let (want, want_tokens) = run(&model, &cpu, &tokens);
            let reference = f32_logits.get_or_insert_with(|| want.clone());
            let tol = tolerance(file, max_diff(&want, reference));
            let mut dev = gpu::open(0).unwrap();
            gpu::upload_model(&mut dev, &model, &whole(&model), u64::MAX).unwrap();
            let dev = Arc::new(dev);
            let whole_dev = match gpu::whole_model(dev.clone(), &model) {
                Ok(w) => w,
                Err(why) => {
                    eprintln!("{arch} {file}: not whole on the GPU: {why}");
                    assert!(!why.is_empty());
                    continue;
                }
            };
            let on_gpu = Compute::new(2)
                .with_offload(dev.clone())
                .with_layer_device(whole_dev.clone());
            let (got, got_tokens) = run(&model, &on_gpu, &tokens);
            let d = max_diff(&got, &want);
            let steps = whole_dev.steps();
            eprintln!(
                "{arch} {file}: whole steps {steps}; prompt logits max |gpu − cpu| = {d:.2e} \
                 (bound {tol:.1e})"
            );
            assert!(
                steps >= 17,
                "{arch} {file}: {steps} steps ran whole on the GPU"
            );
            assert!(d <= tol, "{arch} {file}: logits differ by {d}");
            assert_eq!(got_tokens, want_tokens, "{arch} {file}: greedy tokens");
            let want = mixed(&model, &[&cpu], |_| 0, &tokens);
            let got = mixed(&model, &[&cpu, &on_gpu], |i| i % 2, &tokens);
            let d = max_diff(&got, &want);
            eprintln!("{arch} {file}: CPU/GPU alternating chunks, f16 cache: max diff {d:.2e}");
            assert!(d <= tol, "{arch} {file}: alternating chunks differ by {d}");
            ran += 1;
        }
    }
    assert!(ran > 0, "no model ran whole on the GPU");
}
