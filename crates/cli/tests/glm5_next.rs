//! GLM-5.3 Flash (`glm5-next`, the tiny fixture: KDA layers 0 and 3, the k-pool indexer on
//! layer 1, layer 2 reusing its selection) across real processes: pipelines whose stages start
//! at the shared layer (the selection travels with the hidden state) or at KDA layers, a 2-rank
//! tensor-parallel group (latent and KDA heads split) and SSD streaming: all bit-identical to one
//! node; snapshots moved between splits and groups.

mod common;

use std::path::Path;

use common::cluster::{BASE, FixtureCluster, differing};
use common::*;

fn family() -> FixtureCluster {
    FixtureCluster::new("glm5-next")
}

fn logits(out: &Path, extra: &[&str], stages: &[&str], ranks: usize) -> Vec<f32> {
    family().logits(out, extra, stages, ranks)
}

fn with_cluster(args: &[&str], stages: &[&str], ranks: usize) -> String {
    family().with_cluster(args, stages, ranks)
}

fn model() -> String {
    family().model()
}

#[test]
fn glm5_next_pipelines_groups_and_streaming_are_bit_identical_to_single_node() {
    let dir = tempfile::tempdir().unwrap();
    let at = |name: &str| dir.path().join(name);
    let single = logits(&at("single.npy"), &[], &[], 1);
    assert_eq!(single.len(), 473 * 320, "every prompt position's logits");
    for (name, splits, chunk) in [
        // The worker starts at the shared layer: layer 1's selection comes with the work.
        ("2 stages", &["0:1", "2:output"][..], "37"),
        ("3 stages", &["0:0", "1:2", "3:output"][..], "64"),
        // Worker to worker: the selection made on the second stage reaches the third.
        ("4 stages", &["0:0", "1:1", "2:2", "3:output"][..], "50"),
    ] {
        let layers = ["--layers", splits[0], "--dist-prefill-chunk", chunk];
        let extra = [&layers[..], &["--dist-prefill-window", "2"]].concat();
        let got = logits(&at(&format!("{name}.npy")), &extra, &splits[1..], 1);
        assert_eq!(differing(&got, &single), 0, "{name}");
    }
    // Two ranks: each half the latent and KDA heads, half the experts, half the vocabulary.
    let got = logits(
        &at("tp.npy"),
        &["--tensor-parallel", "--tp-size", "2"],
        &[],
        2,
    );
    assert_eq!(differing(&got, &single), 0, "2 ranks");
    // Streaming with one cache slot, and with the whole layer cached.
    for cache in ["1", "8"] {
        let extra = ["--ssd-streaming", "--expert-cache", cache];
        let got = logits(&at(&format!("stream{cache}.npy")), &extra, &[], 1);
        assert_eq!(differing(&got, &single), 0, "streaming, cache {cache}");
    }
}

/// A session saved on a 2-stage split whose second stage starts at the shared layer, and one
/// saved on a 2-rank group (each rank its heads' KDA states, merged into the snapshot), continue
/// on one node and on a group with the single node's greedy tokens.
#[test]
fn glm5_next_snapshots_move_between_splits_and_groups() {
    let dir = tempfile::tempdir().unwrap();
    let m = model();
    let text = std::fs::read_to_string(fixture("glm5-next", "prompt_tokens.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let prompt: String = v["text"].as_str().unwrap().chars().take(600).collect();
    let greedy = ["--temp", "0"];
    let mut args = vec!["run", "-m", &m, "-p", &prompt, "-n", "16"];
    args.extend_from_slice(&greedy);
    args.extend_from_slice(&BASE[..5]);
    let want = run_ok(&args);
    let want = want
        .strip_prefix(prompt.as_str())
        .unwrap_or(&want)
        .trim_end()
        .to_string();
    assert!(!want.is_empty(), "the single node generated nothing");
    let tp = ["--tensor-parallel", "--tp-size", "2"];
    for (name, split, stages, ranks) in [
        ("2-stage", &["--layers", "0:1"][..], &["2:output"][..], 1),
        ("2-rank", &tp[..], &[][..], 2),
    ] {
        let snap = dir.path().join(format!("{name}.snap"));
        let snap_s = snap.to_str().unwrap();
        let mut save = vec!["run", "-m", &m, "-p", &prompt, "-n", "0"];
        save.extend_from_slice(split);
        save.extend_from_slice(&["--save-snapshot", snap_s]);
        save.extend_from_slice(&greedy);
        with_cluster(&save, stages, ranks);
        let mut load = vec!["run", "-m", &m, "-n", "16", "--load-snapshot", snap_s];
        load.extend_from_slice(&greedy);
        let mut single = load.clone();
        single.extend_from_slice(&BASE[..5]);
        assert_eq!(
            run_ok(&single).trim_end(),
            want,
            "{name} snapshot continued on one node"
        );
        load.extend_from_slice(&tp);
        assert_eq!(
            with_cluster(&load, &[], 2).trim_end(),
            want,
            "{name} snapshot continued on 2 ranks"
        );
    }
}
