//! The streamed source against the resident one on every MoE fixture: bit-identical logits over
//! a prefill chunk and decode steps at cache sizes from one slot to every expert, O_DIRECT and
//! buffered; bytes handed over equal to the map's; prefetch, preload, profiles, resident
//! layers, the ownership filter and concurrent callers.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use experts::{CacheSize, Profile, StreamedExperts, StreamingOptions};
use model::{
    Compute, ExpertMatrices, ExpertSource, KvCache, KvType, LogitsWanted, Model, NoHooks,
    ResidentExperts, SeqInput, StageInput, StageOutput,
};

fn fixture(arch: &str, quant: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures")
        .join(arch)
        .join(format!("model-{quant}.gguf"))
}

const MOE_ARCHS: [&str; 5] = ["mixtral", "olmoe", "qwen2moe", "qwen3moe", "gpt-oss"];
const QUANTS: [&str; 3] = ["f32", "q8_0", "q4_k"];

const TOKENS: [u32; 14] = [1, 17, 42, 99, 5, 250, 31, 8, 77, 120, 3, 64, 200, 11];
/// A prefill chunk, a second chunk, then single-token decode steps.
const CHUNKS: [usize; 7] = [6, 3, 1, 1, 1, 1, 1];

fn load(path: &PathBuf) -> Arc<Model> {
    Arc::new(Model::load(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

fn moe_layers(m: &Model) -> usize {
    (0..m.n_layer()).filter(|&l| m.is_moe_layer(l)).count()
}

fn n_expert(m: &Model) -> usize {
    m.hp.moe.as_ref().unwrap().n_expert
}

/// Logits of every position, evaluated in `CHUNKS`.
fn logits(model: &Model, source: &dyn ExpertSource) -> model::Result<Vec<f32>> {
    let cx = Compute::new(2);
    let last = model.n_layer() - 1;
    let mut kv = KvCache::new(model.kv_layout(KvType::F32, 0..=last, 64));
    let mut out = Vec::new();
    let mut at = 0;
    for n in CHUNKS {
        let mut seqs = [SeqInput {
            kv: &mut kv,
            n_tokens: n,
            logits: LogitsWanted::All,
        }];
        let r = model.forward(
            &cx,
            source,
            0..=last,
            true,
            StageInput::Tokens(&TOKENS[at..at + n]),
            &mut seqs,
            &mut NoHooks,
        )?;
        let StageOutput::Logits(l) = r else {
            panic!("no logits")
        };
        out.extend(l.data);
        at += n;
    }
    Ok(out)
}

fn assert_bits_eq(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let diff = a
        .iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits());
    assert!(diff.is_none(), "{what}: first difference at {diff:?}");
}

fn opts(cache: CacheSize) -> StreamingOptions {
    StreamingOptions {
        cache,
        readers: 3,
        ..StreamingOptions::default()
    }
}

#[test]
fn logits_match_the_resident_run_at_every_cache_size() {
    for arch in MOE_ARCHS {
        // gpt-oss also with MXFP4 experts (17-byte blocks: slices not aligned to anything).
        let extra: &[&str] = if arch == "gpt-oss" { &["mxfp4"] } else { &[] };
        for &quant in QUANTS.iter().chain(extra) {
            let path = fixture(arch, quant);
            let model = load(&path);
            let want = logits(&model, &ResidentExperts::new(&model)).unwrap();
            let per_layer = moe_layers(&model);
            let all = per_layer * n_expert(&model);
            for (cache, cold) in [
                (1, true),
                (per_layer, true),
                (per_layer, false),
                (all / 2, true),
                (all, false),
            ] {
                let src = StreamedExperts::new(
                    Arc::clone(&model),
                    StreamingOptions {
                        cold,
                        ..opts(CacheSize::Count(cache))
                    },
                )
                .unwrap();
                let got = logits(&model, &src).unwrap();
                assert_bits_eq(
                    &got,
                    &want,
                    &format!("{arch} {quant}, {cache} slots, cold {cold}"),
                );
                let stats: std::collections::HashMap<String, f64> =
                    src.stats().into_iter().collect();
                assert_eq!(stats["expert_read_errors"], 0.0);
                if cold {
                    assert!(stats["expert_misses"] > 0.0);
                }
            }
        }
    }
}

#[test]
fn resident_layers_and_buffered_reads_give_the_same_bits() {
    let model = load(&fixture("qwen3moe", "q8_0"));
    let want = logits(&model, &ResidentExperts::new(&model)).unwrap();
    let src = StreamedExperts::new(
        Arc::clone(&model),
        StreamingOptions {
            resident_layers: 2,
            direct_io: false,
            ..opts(CacheSize::Count(1))
        },
    )
    .unwrap();
    assert!(!src.direct_io());
    assert_bits_eq(
        &logits(&model, &src).unwrap(),
        &want,
        "2 resident layers, buffered",
    );
    let stats: std::collections::HashMap<String, f64> = src.stats().into_iter().collect();
    assert!(stats["expert_resident_hits"] > 0.0);
    // The first two MoE layers are all there, plus the one cache slot.
    let cached = src.cached();
    let n = n_expert(&model);
    for l in 0..2 {
        assert_eq!(cached.iter().filter(|(cl, _)| *cl == l).count(), n);
    }
}

#[test]
fn a_copy_on_tmpfs_streams_the_same_bits() {
    // Older kernels refuse O_DIRECT on tmpfs (the buffered fallback runs); newer accept it.
    let shm = PathBuf::from("/dev/shm");
    if !shm.is_dir() {
        eprintln!("no /dev/shm: skipped");
        return;
    }
    let dir = tempfile::tempdir_in(&shm).unwrap();
    let path = dir.path().join("m.gguf");
    std::fs::copy(fixture("olmoe", "q4_k"), &path).unwrap();
    let model = load(&path);
    let want = logits(&model, &ResidentExperts::new(&model)).unwrap();
    let src = StreamedExperts::new(Arc::clone(&model), opts(CacheSize::Count(2))).unwrap();
    let how = if src.direct_io() {
        "O_DIRECT"
    } else {
        "buffered"
    };
    assert_bits_eq(
        &logits(&model, &src).unwrap(),
        &want,
        &format!("tmpfs, {how}"),
    );
}

/// Collects what a source hands over and checks it against the map.
fn check_bytes(model: &Model, layer: usize, got: &[(usize, ExpertMatrices<'_>)]) {
    for (e, m) in got {
        let r = model.expert_weights(layer, *e).unwrap();
        assert_eq!(
            m.gate.data, r.gate.data,
            "gate of expert {e} of layer {layer}"
        );
        assert_eq!(m.up.data, r.up.data, "up of expert {e} of layer {layer}");
        assert_eq!(
            m.down.data, r.down.data,
            "down of expert {e} of layer {layer}"
        );
        assert_eq!((m.gate.rows, m.gate.cols), (r.gate.rows, r.gate.cols));
        assert_eq!(
            (m.down.rows, m.down.cols, m.down.dtype),
            (r.down.rows, r.down.cols, r.down.dtype)
        );
    }
}

fn fetch(
    src: &StreamedExperts,
    model: &Model,
    layer: usize,
    experts: &[usize],
) -> model::Result<Vec<usize>> {
    let mut seen = Vec::new();
    src.with_experts(layer, experts, &mut |batch| {
        check_bytes(model, layer, batch);
        seen.extend(batch.iter().map(|(e, _)| *e));
        Ok(())
    })?;
    seen.sort_unstable();
    Ok(seen)
}

#[test]
fn each_expert_is_handed_over_once_with_the_maps_bytes() {
    for arch in MOE_ARCHS {
        let model = load(&fixture(arch, "q4_k"));
        let n = n_expert(&model);
        let src = StreamedExperts::new(
            Arc::clone(&model),
            StreamingOptions {
                cold: true,
                ..opts(CacheSize::Count(2))
            },
        )
        .unwrap();
        for l in (0..model.n_layer()).filter(|&l| model.is_moe_layer(l)) {
            let all: Vec<usize> = (0..n).rev().collect();
            assert_eq!(
                fetch(&src, &model, l, &all).unwrap(),
                (0..n).collect::<Vec<_>>()
            );
        }
        // Asking twice for one expert, or for one that does not exist, is an error.
        assert!(fetch(&src, &model, 0, &[1, 1]).is_err());
        assert!(fetch(&src, &model, 0, &[n]).is_err());
    }
}

#[test]
fn hits_are_handed_over_before_misses_are_read() {
    let model = load(&fixture("qwen3moe", "f32"));
    let src = StreamedExperts::new(
        Arc::clone(&model),
        StreamingOptions {
            cold: true,
            ..opts(CacheSize::Count(8))
        },
    )
    .unwrap();
    fetch(&src, &model, 1, &[2]).unwrap();
    let mut batches: Vec<Vec<usize>> = Vec::new();
    src.with_experts(1, &[4, 2, 5], &mut |b| {
        batches.push(b.iter().map(|(e, _)| *e).collect());
        Ok(())
    })
    .unwrap();
    assert_eq!(batches[0], vec![2], "the cached expert comes first, alone");
    assert_eq!(batches.concat().len(), 3);
}

#[test]
fn prefetched_experts_are_used_and_counted() {
    let model = load(&fixture("mixtral", "q8_0"));
    let src = StreamedExperts::new(
        Arc::clone(&model),
        StreamingOptions {
            cold: true,
            ..opts(CacheSize::Count(8))
        },
    )
    .unwrap();
    src.prefetch(1, &[0, 3]);
    fetch(&src, &model, 1, &[3, 0, 1]).unwrap();
    let s: std::collections::HashMap<String, f64> = src.stats().into_iter().collect();
    assert_eq!(s["expert_prefetch_reads"], 2.0);
    assert_eq!(s["expert_prefetch_used"], 2.0);
    assert_eq!(s["expert_misses"], 1.0);
    assert_eq!(s["expert_hits"] + s["expert_inflight_hits"], 2.0);
    assert_eq!(s["expert_reads"], 3.0);
}

#[test]
fn a_saved_profile_preloads_the_hottest_experts() {
    let model = load(&fixture("qwen2moe", "q4_k"));
    let dir = tempfile::tempdir().unwrap();
    let prof = dir.path().join("p.txt");
    {
        let src = StreamedExperts::new(
            Arc::clone(&model),
            StreamingOptions {
                cold: true,
                save_profile: Some(prof.clone()),
                ..opts(CacheSize::Count(4))
            },
        )
        .unwrap();
        for _ in 0..3 {
            fetch(&src, &model, 0, &[3]).unwrap();
            fetch(&src, &model, 2, &[1, 2]).unwrap();
        }
        fetch(&src, &model, 0, &[3, 0]).unwrap();
    }
    let p = Profile::load(&prof, &model.files().fingerprint().to_string()).unwrap();
    assert_eq!(p.steps, 4);
    assert_eq!((p.count(0, 3), p.count(2, 1), p.count(0, 0)), (4, 3, 1));
    let src = StreamedExperts::new(
        Arc::clone(&model),
        StreamingOptions {
            profile: Some(prof.clone()),
            preload: Some(3),
            ..opts(CacheSize::Count(4))
        },
    )
    .unwrap();
    let mut cached = src.cached();
    cached.sort_unstable();
    assert_eq!(cached, vec![(0, 3), (2, 1), (2, 2)]);
    // Without a profile, a full preload spreads over the layers.
    let even = StreamedExperts::new(
        Arc::clone(&model),
        opts(CacheSize::Count(moe_layers(&model))),
    )
    .unwrap();
    let layers: std::collections::BTreeSet<usize> = even.cached().iter().map(|c| c.0).collect();
    assert_eq!(layers.len(), moe_layers(&model));
    // A profile of another model is refused.
    let other = load(&fixture("olmoe", "q4_k"));
    let r = StreamedExperts::new(
        other,
        StreamingOptions {
            profile: Some(prof),
            ..opts(CacheSize::Count(4))
        },
    );
    assert!(r.err().unwrap().to_string().contains("made for model"));
}

#[test]
fn only_owned_experts_are_streamed() {
    let model = load(&fixture("olmoe", "q8_0"));
    let n = n_expert(&model);
    let src = StreamedExperts::new(
        Arc::clone(&model),
        StreamingOptions {
            owned: Some(Arc::new(|_, e| e % 2 == 0)),
            ..opts(CacheSize::Count(1000))
        },
    )
    .unwrap();
    assert!(src.owns(0, 2) && !src.owns(0, 3));
    let cached = src.cached();
    assert_eq!(cached.len(), moe_layers(&model) * n.div_ceil(2));
    assert!(cached.iter().all(|(_, e)| e % 2 == 0));
    // The logits of a node owning the even experts plus one owning the odd ones add up to the
    // resident run's only up to summation order, so here just check the node computes.
    let evens: Vec<usize> = (0..n).step_by(2).collect();
    assert_eq!(fetch(&src, &model, 0, &evens).unwrap(), evens);
}

#[test]
fn concurrent_callers_share_a_tiny_cache() {
    let model = load(&fixture("qwen3moe", "q4_k"));
    let n = n_expert(&model);
    let src = Arc::new(
        StreamedExperts::new(
            Arc::clone(&model),
            StreamingOptions {
                cold: true,
                ..opts(CacheSize::Count(3))
            },
        )
        .unwrap(),
    );
    let errors = Arc::new(Mutex::new(Vec::new()));
    std::thread::scope(|s| {
        for t in 0..4 {
            let (src, model, errors) = (&src, &model, &errors);
            s.spawn(move || {
                for i in 0..40 {
                    let l = (t + i) % model.n_layer();
                    let ex: Vec<usize> = (0..3).map(|j| (t * 7 + i * 3 + j) % n).collect();
                    let mut ex2 = ex.clone();
                    ex2.dedup();
                    ex2.sort_unstable();
                    ex2.dedup();
                    match fetch(src, model, l, &ex2) {
                        Ok(got) => assert_eq!(got, ex2),
                        Err(e) => errors.lock().unwrap().push(e.to_string()),
                    }
                }
            });
        }
    });
    assert!(
        errors.lock().unwrap().is_empty(),
        "{:?}",
        errors.lock().unwrap()
    );
}
