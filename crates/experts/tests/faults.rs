//! Faults: an I/O error, a short read, a refused O_DIRECT read, and the file growing, shrinking
//! or being rewritten underneath. Each fails the request with an error that says what happened
//! and leaves the source serving (what it has cached, and everything once the fault is gone).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use experts::{CacheSize, InjectedFault, ReadHook, StreamedExperts, StreamingOptions};
use model::{
    Compute, ExpertSource, KvCache, KvType, LogitsWanted, Model, NoHooks, ResidentExperts,
    SeqInput, StageInput, StageOutput,
};

fn fixture(arch: &str, quant: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures")
        .join(arch)
        .join(format!("model-{quant}.gguf"))
}

const TOKENS: [u32; 5] = [3, 70, 12, 140, 9];

fn logits(model: &Model, source: &dyn ExpertSource) -> model::Result<Vec<f32>> {
    let cx = Compute::new(2);
    let last = model.n_layer() - 1;
    let mut kv = KvCache::new(model.kv_layout(KvType::F32, 0..=last, 16));
    let mut seqs = [SeqInput {
        kv: &mut kv,
        n_tokens: TOKENS.len(),
        logits: LogitsWanted::All,
    }];
    match model.forward(
        &cx,
        source,
        0..=last,
        true,
        StageInput::Tokens(&TOKENS),
        &mut seqs,
        &mut NoHooks,
    )? {
        StageOutput::Logits(l) => Ok(l.data),
        StageOutput::Hidden(_) => panic!("no logits"),
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A hook that injects `fault` into the reads of `layer` while `armed`.
fn hook(
    layer: usize,
    fault: InjectedFault,
    armed: Arc<AtomicBool>,
    hits: Arc<AtomicUsize>,
) -> ReadHook {
    Arc::new(move |ev| {
        (ev.layer == layer && armed.load(Ordering::SeqCst)).then(|| {
            hits.fetch_add(1, Ordering::SeqCst);
            fault.clone()
        })
    })
}

fn source(model: &Arc<Model>, slots: usize, read_hook: Option<ReadHook>) -> StreamedExperts {
    StreamedExperts::new(
        Arc::clone(model),
        StreamingOptions {
            cache: CacheSize::Count(slots),
            cold: true,
            readers: 2,
            read_hook,
            ..StreamingOptions::default()
        },
    )
    .unwrap()
}

#[test]
fn a_read_error_fails_the_request_and_the_next_one_succeeds() {
    let model = Arc::new(Model::load(fixture("qwen3moe", "q4_k")).unwrap());
    let want = logits(&model, &ResidentExperts::new(&model)).unwrap();
    let armed = Arc::new(AtomicBool::new(true));
    let hits = Arc::new(AtomicUsize::new(0));
    let src = source(
        &model,
        3,
        Some(hook(
            2,
            InjectedFault::Error(std::io::ErrorKind::Other),
            armed.clone(),
            hits.clone(),
        )),
    );
    let err = logits(&model, &src).unwrap_err().to_string();
    assert!(hits.load(Ordering::SeqCst) > 0);
    assert!(
        err.contains("of layer 2") && err.contains("injected read error"),
        "{err}"
    );
    let stats: std::collections::HashMap<String, f64> = src.stats().into_iter().collect();
    assert!(stats["expert_read_errors"] >= 1.0);
    armed.store(false, Ordering::SeqCst);
    assert_eq!(
        bits(&logits(&model, &src).unwrap()),
        bits(&want),
        "after the fault"
    );
}

#[test]
fn a_short_read_is_an_error() {
    let model = Arc::new(Model::load(fixture("mixtral", "q8_0")).unwrap());
    let armed = Arc::new(AtomicBool::new(true));
    let src = source(
        &model,
        2,
        Some(hook(
            1,
            InjectedFault::Short(100),
            armed.clone(),
            Arc::new(AtomicUsize::new(0)),
        )),
    );
    let err = logits(&model, &src).unwrap_err().to_string();
    assert!(
        err.contains("short read of expert")
            && err.contains("of layer 1")
            && err.contains("100 of"),
        "{err}"
    );
    armed.store(false, Ordering::SeqCst);
    let want = logits(&model, &ResidentExperts::new(&model)).unwrap();
    assert_eq!(bits(&logits(&model, &src).unwrap()), bits(&want));
}

#[test]
fn refused_o_direct_falls_back_to_buffered_reads() {
    let model = Arc::new(Model::load(fixture("olmoe", "f32")).unwrap());
    let want = logits(&model, &ResidentExperts::new(&model)).unwrap();
    let refuse: ReadHook = Arc::new(|_| Some(InjectedFault::RefuseDirect));
    let src = source(&model, 2, Some(refuse));
    assert!(
        src.direct_io(),
        "O_DIRECT works on this filesystem until refused"
    );
    assert_eq!(bits(&logits(&model, &src).unwrap()), bits(&want));
    assert!(!src.direct_io(), "a refusal switches to buffered reads");
}

fn copy_of(arch: &str, quant: &str, dir: &Path) -> PathBuf {
    let p = dir.join(format!("{arch}-{quant}.gguf"));
    std::fs::copy(fixture(arch, quant), &p).unwrap();
    p
}

/// Fetches `experts` of `layer` without looking at the map (which may be cut short).
fn fetch(src: &StreamedExperts, layer: usize, experts: &[usize]) -> model::Result<usize> {
    let mut n = 0;
    src.with_experts(layer, experts, &mut |b| {
        n += b.len();
        Ok(())
    })?;
    Ok(n)
}

#[test]
fn a_file_that_grows_is_refused_but_cached_experts_still_serve() {
    let dir = tempfile::tempdir().unwrap();
    let path = copy_of("qwen2moe", "q4_k", dir.path());
    let model = Arc::new(Model::load(&path).unwrap());
    // Room for layer 0's two experts, the prefill prefetch of layer 1, and the failed read.
    let src = source(&model, 8, None);
    assert_eq!(fetch(&src, 0, &[0, 1]).unwrap(), 2);
    let f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    std::io::Write::write_all(&mut &f, &[0u8; 8192]).unwrap();
    let err = fetch(&src, 3, &[2]).unwrap_err().to_string();
    assert!(
        err.contains("changed since the model was loaded") && err.contains("size"),
        "{err}"
    );
    // Cached experts need no read; the source keeps answering.
    assert_eq!(fetch(&src, 0, &[1, 0]).unwrap(), 2);
    assert!(
        fetch(&src, 3, &[3]).is_err(),
        "every read of the changed file fails"
    );
}

#[test]
fn a_truncated_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = copy_of("qwen3moe", "q8_0", dir.path());
    let model = Arc::new(Model::load(&path).unwrap());
    let src = source(&model, 2, None);
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len / 3)
        .unwrap();
    let last = model.n_layer() - 1;
    let err = fetch(&src, last, &[5]).unwrap_err().to_string();
    assert!(err.contains("changed since the model was loaded"), "{err}");
    // Restoring the size does not make it the same file.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len)
        .unwrap();
    assert!(fetch(&src, last, &[4]).is_err());
}

#[test]
fn a_file_rewritten_in_place_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = copy_of("olmoe", "q8_0", dir.path());
    let model = Arc::new(Model::load(&path).unwrap());
    let src = source(&model, 2, None);
    assert_eq!(fetch(&src, 0, &[0]).unwrap(), 1);
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let m = f.metadata().unwrap().modified().unwrap();
    f.set_modified(m + std::time::Duration::from_secs(5))
        .unwrap();
    let err = fetch(&src, 1, &[1]).unwrap_err().to_string();
    assert!(err.contains("modified"), "{err}");
}
