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

/// Per position, the largest difference.
fn per_position(got: &[f32], want: &[f32], n_vocab: usize) -> Vec<f32> {
    got.chunks(n_vocab)
        .zip(want.chunks(n_vocab))
        .map(|(g, w)| max_diff(g, w))
        .collect()
}

/// Whether the GPU's logits are the CPU's on `file`. F32 weights: within 1e-3 everywhere. With
/// quantized weights the activations are quantized too, and a value whose product lands within
/// rounding of a step boundary may take the neighbouring step on one side (the two sum in
/// different orders); the positions after it carry that step. Attention is causal, so such a
/// difference leaves every position before it within rounding (1e-4), while a wrong kernel
/// shows from the first position on; and it stays well below what quantizing the weights moved
/// the logits (`quant_noise`: this file's CPU logits against the F32 file's).
/// Returns the report and whether a quantization step was taken differently (then the greedy
/// continuation may part where its top two logits are closer than the step moved them).
fn check_close(
    got: &[f32],
    want: &[f32],
    n_vocab: usize,
    file: &str,
    quant_noise: f32,
) -> (String, bool) {
    let per = per_position(got, want, n_vocab);
    let d = per.iter().copied().fold(0f32, f32::max);
    let start = per.iter().position(|&e| e > 1e-4);
    let how = match start {
        None => format!("every one of {} positions within 1e-4", per.len()),
        Some(p) => format!(
            "positions 0..{p} within 1e-4, from {p} on up to {d:.1e} (of {})",
            per.len()
        ),
    };
    let ok = d <= 1e-3
        || (!file.contains("f32") && start.is_some_and(|p| p > 0) && d <= 0.5 * quant_noise);
    assert!(
        ok,
        "{file}: logits differ by {d} ({how}; quantization moved them by {quant_noise:.1e})"
    );
    (format!("max |gpu − cpu| = {d:.2e}: {how}"), d > 1e-3)
}

/// The greedy tokens are the CPU's, unless a quantization step was taken differently: then
/// they must agree up to where the difference started to show and the rest is printed.
fn check_greedy(got: &[u32], want: &[u32], stepped: bool, what: &str) {
    if !stepped {
        assert_eq!(got, want, "{what}: greedy tokens");
    } else if got != want {
        assert_eq!(got[0], want[0], "{what}: the first greedy token");
        eprintln!(
            "{what}: greedy tokens after a quantization step taken differently: {got:?} vs the CPU's {want:?}"
        );
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

/// A fixture and the CPU's answers on it.
struct CpuRun {
    what: String,
    model: Arc<Model>,
    tokens: Vec<u32>,
    cpu: Compute,
    want: Vec<f32>,
    want_tokens: Vec<u32>,
    /// What quantizing the weights moved the logits (this file's against the F32 file's).
    noise: f32,
    n_vocab: usize,
    /// The architecture's F32 file (the reference for the noise of other prompts).
    reference: Arc<Model>,
}

impl CpuRun {
    /// What quantizing the weights moved the CPU's logits of `tokens` taken `chunk` rows a
    /// step: a long prompt runs into more near-ties than the short one `noise` was measured
    /// on, and a step taken differently there moves everything after it by as much.
    fn noise_of(&self, tokens: &[u32], chunk: usize, want: &[f32]) -> f32 {
        if Arc::ptr_eq(&self.model, &self.reference) {
            return 0.0;
        }
        max_diff(
            want,
            &common::logits_chunked(&self.reference, &self.cpu, tokens, chunk),
        )
    }
}

/// Whether a GPU opens; only a missing device skips (a device whose kernels fail to build
/// fails the test).
fn gpu_present() -> bool {
    match gpu::open(0) {
        Ok(_) => true,
        Err(e) => {
            assert!(matches!(e, gpu::GpuError::Unavailable(_)), "{e}");
            eprintln!("skipped (no GPU): {e}");
            false
        }
    }
}

/// The fixture files of each architecture, F32 first (the others' quantization noise is
/// measured against it): the formats every fixture has, then those some have (olmoe every IQ
/// format, qwen3moe IQ4_NL and IQ4_XS, gpt-oss MXFP4 experts).
const QUANTIZATIONS: [&str; 13] = [
    "model-f32.gguf",
    "model-q8_0.gguf",
    "model-q4_k.gguf",
    "model-mxfp4.gguf",
    "model-iq4_nl.gguf",
    "model-iq4_xs.gguf",
    "model-iq3_s.gguf",
    "model-iq3_xxs.gguf",
    "model-iq2_s.gguf",
    "model-iq2_xs.gguf",
    "model-iq2_xxs.gguf",
    "model-iq1_m.gguf",
    "model-iq1_s.gguf",
];

/// Runs `f` on every fixture model (F32 first, then its quantized files) with the CPU's
/// prompt logits and greedy tokens; returns how many there were.
fn for_each_fixture(mut f: impl FnMut(CpuRun)) -> usize {
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
        let mut f32_model: Option<Arc<Model>> = None;
        for file in QUANTIZATIONS {
            let path = dir.join(file);
            if !path.exists() {
                continue;
            }
            let model = Arc::new(Model::load(&path).unwrap());
            let tokens = prompt(arch);
            let cpu = Compute::new(2);
            let (want, want_tokens) = run(&model, &cpu, &tokens);
            let reference = f32_logits.get_or_insert_with(|| want.clone());
            let noise = max_diff(&want, reference);
            let reference = f32_model.get_or_insert_with(|| model.clone()).clone();
            let n_vocab = want.len() / tokens.len();
            f(CpuRun {
                what: format!("{arch} {file}"),
                model,
                tokens,
                cpu,
                want,
                want_tokens,
                noise,
                n_vocab,
                reference,
            });
            ran += 1;
        }
    }
    ran
}

#[test]
fn gpu_logits_and_greedy_tokens_match_the_cpu() {
    if !gpu_present() {
        return;
    }
    let ran = for_each_fixture(|r| {
        let mut dev = gpu::open(0).unwrap();
        let report =
            gpu::upload_model(&mut dev, &r.model, &whole(&r.model), u64::MAX, None).unwrap();
        let on_gpu = Compute::new(2).with_offload(Arc::new(dev));
        let (got, got_tokens) = run(&r.model, &on_gpu, &r.tokens);
        let (how, stepped) = check_close(&got, &r.want, r.n_vocab, &r.what, r.noise);
        eprintln!("{}: {report}; prompt logits {how}", r.what);
        check_greedy(&got_tokens, &r.want_tokens, stepped, &r.what);
    });
    assert!(ran > 0, "no fixture found under {}", fixtures().display());
}

/// A memory limit below the model's size: dense weights and some experts on the GPU, the rest
/// on the CPU, both in the same step; the same tokens.
#[test]
fn hybrid_placement_matches_the_cpu() {
    if !gpu_present() {
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
        gpu::upload_model(&mut probe, &model, &sel, u64::MAX, None).unwrap()
    };
    // A third of the experts (the first layers whole), and a few of layer 0's only: there the
    // very first step already splits between the GPU and the CPU.
    let n_layer = model.n_layer() as u64;
    for budget in [
        full.dense_on_gpu + full.experts_on_gpu / 3,
        full.dense_on_gpu + full.experts_on_gpu / (n_layer * 4),
    ] {
        let mut dev = gpu::open(0).unwrap();
        dev.stream_experts(None, None);
        let report = gpu::upload_model(&mut dev, &model, &sel, budget, None).unwrap();
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
    // Experts left on the host copied in for each step where they serve a row or more (every
    // step then: prompt and decode), through a buffer of a whole layer's experts (one pass) and
    // of two and a half experts (passes of two, the sums added up on the device).
    let per_expert: usize = model
        .files()
        .tensors()
        .filter(|t| t.info.name.starts_with("blk.0.") && t.info.name.contains("_exps."))
        .map(|t| t.info.n_bytes as usize / t.info.shape.dims()[2] as usize)
        .sum();
    for limit in [1 << 30, per_expert * 5 / 2 + 3 * 256] {
        let mut dev = gpu::open(0).unwrap();
        dev.stream_experts(Some(1), Some(limit));
        let budget = full.dense_on_gpu + full.experts_on_gpu / 3;
        let report = gpu::upload_model(&mut dev, &model, &sel, budget, None).unwrap();
        assert!(
            report.streaming_buffer > 0 && report.experts_on_gpu < full.experts_on_gpu,
            "{report}"
        );
        let dev = Arc::new(dev);
        let on_gpu = Compute::new(2).with_offload(dev.clone());
        let (got, got_tokens) = run(&model, &on_gpu, &tokens);
        let d = max_diff(&got, &want);
        let streamed = dev.streamed_bytes();
        eprintln!(
            "qwen3moe q4_k hybrid, experts streamed ({limit}-byte limit): {report}; \
             {streamed} bytes copied in; max |gpu − cpu| = {d:.2e}"
        );
        assert!(streamed > 0);
        assert!(d <= 1e-3);
        assert_eq!(got_tokens, want_tokens);
    }
}

/// Whole steps under a memory limit below the model's size: the dense weights and some
/// experts on the GPU, the rest copied in layer by layer through a buffer of one layer's
/// experts in each step of enough rows (a prompt's), and computed by the CPU between the
/// GPU's routing and its weighted sum in smaller steps (decode); the CPU's logits and tokens.
/// Budgets: the first layers whole, and a quarter of layer 0's experts only. Copies from one
/// row per expert on average (the prompts copy, decode computes on the host), and from more
/// rows than any step has (every step computes on the host: one row, and many rows in one
/// routing block or routed across the device first).
#[test]
fn hybrid_whole_steps_match_the_cpu() {
    if !gpu_present() {
        return;
    }
    let mut ran = 0;
    for_each_fixture(|r| {
        let (what, model, tokens, cpu) = (&r.what, &r.model, &r.tokens, &r.cpu);
        let sel = whole(model);
        let full = {
            let mut probe = gpu::open(0).unwrap();
            gpu::upload_model(&mut probe, model, &sel, u64::MAX, None).unwrap()
        };
        if full.experts_total == 0 {
            return;
        }
        let n_layer = model.n_layer() as u64;
        let per_layer = full.experts_on_gpu / n_layer;
        let mut long_noise: Option<f32> = None;
        // A routing profile that scatters the device's experts over every layer (each layer
        // then has some on the device and some on the host), as `--expert-profile` may.
        let scattered = |l: usize, e: usize| ((l * 7 + e * 13) % 17) as u64;
        for (budget, hot) in [
            (full.dense_on_gpu + full.experts_on_gpu / 2, None),
            (full.dense_on_gpu + per_layer + per_layer / 4, None),
            (
                full.dense_on_gpu + full.experts_on_gpu / 2,
                Some(&scattered as gpu::Hotness),
            ),
        ] {
            // Prompts copying; every step computing host experts on the host; and the same
            // with decode's device reading two of a row's host experts over the link.
            for (copy_from, read) in [(1, 0), (1 << 20, 0), (1 << 20, 2)] {
                let mut dev = gpu::open(0).unwrap();
                dev.stream_experts(Some(copy_from), None);
                dev.read_host_experts(gpu::HostRead::Fixed(read));
                let report = gpu::upload_model(&mut dev, model, &sel, budget, hot).unwrap();
                assert!(
                    report.streaming_buffer > 0 && report.experts_on_gpu < full.experts_on_gpu,
                    "{what}: {report}"
                );
                assert_eq!(
                    report.routes_on_gpu.is_some(),
                    hot.is_some(),
                    "{what}: {report}"
                );
                let dev = Arc::new(dev);
                let whole_dev = match gpu::whole_model(dev.clone(), model) {
                    Ok(w) => w,
                    Err(why) => {
                        eprintln!("{what}: not whole on the GPU: {why}");
                        assert!(!why.contains("memory") && !why.contains("buffer"), "{why}");
                        return;
                    }
                };
                let on_gpu = Compute::new(2)
                    .with_offload(dev.clone())
                    .with_layer_device(whole_dev.clone());
                let hybrid = format!(
                    "{what} hybrid whole steps, copies from {copy_from} rows, {read} read over \
                     the link ({report})"
                );
                let (got, got_tokens) = run(model, &on_gpu, tokens);
                let steps = whole_dev.steps();
                let (how, stepped) = check_close(&got, &r.want, r.n_vocab, &hybrid, r.noise);
                eprintln!(
                    "{hybrid}: {steps} whole steps, {} bytes copied in, {} experts read over \
                     the link; prompt logits {how}",
                    dev.streamed_bytes(),
                    dev.experts_read_over_link()
                );
                check_greedy(&got_tokens, &r.want_tokens, stepped, &hybrid);
                // Decode's device reads host experts exactly when asked to.
                assert_eq!(
                    dev.experts_read_over_link() > 0,
                    read > 0,
                    "{hybrid}: experts read over the link"
                );
                // Every step ran whole: the prompt's logits, and the greedy run's prompt and
                // 15 decode steps.
                assert_eq!(steps, 17, "{hybrid}: steps that ran whole");
                // Only steps that copy count copied bytes: the two prompts' when they copy.
                if copy_from > 1 {
                    assert_eq!(dev.streamed_bytes(), 0, "{hybrid}: bytes copied in");
                } else {
                    assert!(dev.streamed_bytes() > 0, "{hybrid}: bytes copied in");
                }
                // Two steps of 330 rows: many token tiles per expert, attention over the first
                // step's positions in the mirror, every layer's copies (or host experts) twice.
                let long: Vec<u32> = tokens.iter().copied().cycle().take(660).collect();
                let want = common::logits_chunked(model, cpu, &long, 330);
                let got = common::logits_chunked(model, &on_gpu, &long, 330);
                let long_what = format!("{hybrid} (660 tokens in 2 steps)");
                let long_noise = long_noise.get_or_insert_with(|| r.noise_of(&long, 330, &want));
                let (how, _) = check_close(&got, &want, r.n_vocab, &long_what, *long_noise);
                eprintln!("{long_what}: {how}; quantization moved them by {long_noise:.1e}");
                assert_eq!(whole_dev.steps(), 19, "{long_what}: steps that ran whole");
                // Steps of 3 rows (in one routing block) and of 9 (routed across the device
                // first), continuing one cache.
                let mixed_what = format!("{hybrid} (steps of 3 and 9 rows)");
                let want = common::logits_chunked(model, cpu, &long[..36], 3);
                let got = common::logits_chunked(model, &on_gpu, &long[..36], 3);
                let (how, _) = check_close(&got, &want, r.n_vocab, &mixed_what, r.noise);
                eprintln!("{mixed_what}, 3: {how}");
                let want = common::logits_chunked(model, cpu, &long[..36], 9);
                let got = common::logits_chunked(model, &on_gpu, &long[..36], 9);
                let (how, _) = check_close(&got, &want, r.n_vocab, &mixed_what, r.noise);
                eprintln!("{mixed_what}, 9: {how}");
                assert_eq!(
                    whole_dev.steps(),
                    19 + 12 + 4,
                    "{mixed_what}: steps that ran whole"
                );
                ran += 1;
            }
        }
    });
    assert!(ran > 0, "no model ran hybrid whole steps on the GPU");
}

/// Logits of `tokens` in chunks of 4 over one cache of `kv_type`, chunk `i` on `pick(i)`; then
/// a rewind of 2 positions and those 2 again on the last compute.
fn mixed(
    model: &Model,
    computes: &[&Compute],
    pick: impl Fn(usize) -> usize,
    tokens: &[u32],
    kv_type: model::KvType,
) -> Vec<f32> {
    use model::KvCache;
    let last = model.n_layer() - 1;
    let mut kv = KvCache::new(model.kv_layout(kv_type, 0..=last, 1024));
    let mut out = Vec::new();
    let step = |kv: &mut KvCache, cx: &Compute, part: &[u32], out: &mut Vec<f32>| {
        out.extend(common::forward_logits(model, cx, kv, part));
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
    if !gpu_present() {
        return;
    }
    let mut ran = 0;
    for_each_fixture(|r| {
        let (what, model, tokens, cpu, noise, n_vocab) =
            (&r.what, &r.model, &r.tokens, &r.cpu, r.noise, r.n_vocab);
        let mut dev = gpu::open(0).unwrap();
        gpu::upload_model(&mut dev, model, &whole(model), u64::MAX, None).unwrap();
        let dev = Arc::new(dev);
        let whole_dev = match gpu::whole_model(dev.clone(), model) {
            Ok(w) => w,
            Err(why) => {
                eprintln!("{what}: not whole on the GPU: {why}");
                assert!(!why.is_empty());
                return;
            }
        };
        let on_gpu = Compute::new(2)
            .with_offload(dev.clone())
            .with_layer_device(whole_dev.clone());
        let (got, got_tokens) = run(model, &on_gpu, tokens);
        let steps = whole_dev.steps();
        assert!(steps >= 17, "{what}: {steps} steps ran whole on the GPU");
        let (how, stepped) = check_close(&got, &r.want, n_vocab, what, noise);
        eprintln!("{what}: whole steps {steps}; prompt logits {how}");
        check_greedy(&got_tokens, &r.want_tokens, stepped, what);
        // The prompt one row a step: decode's launches (one-token matrices, one-row attention
        // and routing) at every position, each a whole step on the GPU.
        let one_row = format!("{what} (one row a step)");
        let want = common::logits_chunked(model, cpu, tokens, 1);
        let before = whole_dev.steps();
        let got = common::logits_chunked(model, &on_gpu, tokens, 1);
        let whole = whole_dev.steps() - before;
        assert!(
            whole >= tokens.len() as u64,
            "{one_row}: {whole} of {} steps ran whole on the GPU",
            tokens.len()
        );
        let (how, _) = check_close(&got, &want, n_vocab, &one_row, noise);
        eprintln!("{one_row}: {how}");
        // The CPU's chunks read the rows the GPU's handed back into the host cache, in
        // either element type.
        for (kv_type, name) in [
            (model::KvType::F16, "f16"),
            (model::KvType::F32, "single-precision"),
        ] {
            let want = mixed(model, &[cpu], |_| 0, tokens, kv_type);
            let got = mixed(model, &[cpu, &on_gpu], |i| i % 2, tokens, kv_type);
            let chunks = format!("{what} (CPU/GPU alternating chunks, {name} cache)");
            let (how, _) = check_close(&got, &want, n_vocab, &chunks, noise);
            eprintln!("{chunks}: {how}");
        }
        if what.contains("f32") {
            // A long prompt in two steps of 330 rows: hundreds of rows per expert (many
            // token tiles, routing over many chunks of slots), attention over earlier
            // steps' positions in the mirror.
            let long: Vec<u32> = tokens.iter().copied().cycle().take(660).collect();
            let want = common::logits_chunked(model, cpu, &long, 330);
            let got = common::logits_chunked(model, &on_gpu, &long, 330);
            let long_what = format!("{what} (660 tokens in 2 steps)");
            let (how, _) = check_close(&got, &want, n_vocab, &long_what, noise);
            eprintln!("{long_what}: {how}");
            // Several sequences at once, as `serve --parallel` steps them: three caches of
            // 300, 170 and 40 positions, then one step of 8 + 6 + 4 rows (18 rows of several
            // sequences: a block per kv head, split and row where heads share kv heads) and
            // one of a row each (a block per head, split and row).
            let batched = |cx: &Compute| {
                let last = model.n_layer() - 1;
                let mut caches: Vec<model::KvCache> = [300, 170, 40]
                    .iter()
                    .map(|&len| {
                        let layout = model.kv_layout(model::KvType::F32, 0..=last, 1024);
                        let mut kv = model::KvCache::new(layout);
                        common::forward_logits(model, cx, &mut kv, &long[..len]);
                        kv
                    })
                    .collect();
                let mut out = Vec::new();
                for sizes in [[8, 6, 4], [1, 1, 1]] {
                    let mut batch = Vec::new();
                    let mut seqs: Vec<model::SeqInput> = caches
                        .iter_mut()
                        .zip(sizes)
                        .map(|(kv, n_tokens)| {
                            let at = kv.len();
                            batch.extend_from_slice(&long[at..at + n_tokens]);
                            model::SeqInput {
                                kv,
                                n_tokens,
                                logits: model::LogitsWanted::All,
                            }
                        })
                        .collect();
                    out.extend(common::forward_batch(model, cx, &batch, &mut seqs).data);
                }
                out
            };
            let before = whole_dev.steps();
            let got = batched(&on_gpu);
            assert_eq!(
                whole_dev.steps() - before,
                5,
                "{what}: batched steps that ran whole"
            );
            let want = batched(cpu);
            let batched_what = format!("{what} (3 sequences at 300, 170 and 40 positions)");
            let (how, _) = check_close(&got, &want, n_vocab, &batched_what, noise);
            eprintln!("{batched_what}: {how}");
            // One-row steps after a prompt of two steps, against the CPU's. At 650-659 in a
            // cache of 1024: the attention splits the sequence (128 positions a block: six
            // splits, the last partly filled, and idle ones past it). At 2040-2063 in a cache of
            // 4096: the device's mirror grows on the device (1024 -> 2048 positions in the
            // second prompt step, 2048 -> 4096 at position 2048), and the decode rows'
            // attention goes from a block per head and split to the grouped kernel once the
            // step's context passes 2048 positions.
            for (split, decode, n_ctx) in [(330, 650..660, 1024), (1020, 2040..2064, 4096)] {
                let tokens: Vec<u32> = tokens.iter().copied().cycle().take(decode.end).collect();
                let run = |cx: &Compute| {
                    let last = model.n_layer() - 1;
                    let kv_layout = model.kv_layout(model::KvType::F32, 0..=last, n_ctx);
                    let mut kv = model::KvCache::new(kv_layout);
                    common::forward_logits(model, cx, &mut kv, &tokens[..split]);
                    common::forward_logits(model, cx, &mut kv, &tokens[split..decode.start]);
                    let mut out = Vec::new();
                    for t in &tokens[decode.clone()] {
                        out.extend(common::forward_logits(model, cx, &mut kv, &[*t]));
                    }
                    out
                };
                let before = whole_dev.steps();
                let got = run(&on_gpu);
                let decode_what = format!(
                    "{what} (one-row steps at positions {}-{})",
                    decode.start,
                    decode.end - 1
                );
                assert_eq!(
                    whole_dev.steps() - before,
                    2 + decode.len() as u64,
                    "{decode_what}: steps that ran whole"
                );
                let want = run(cpu);
                let (how, _) = check_close(&got, &want, n_vocab, &decode_what, noise);
                eprintln!("{decode_what}: {how}");
            }
        }
        ran += 1;
    });
    assert!(ran > 0, "no model ran whole on the GPU");
}
