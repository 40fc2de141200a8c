//! DeepSeek V4 (`deepseek4`, the tiny fixture: a sliding-only layer, ratio-4 layers with the
//! indexer, a ratio-128 layer, a hash-routed first layer) across real processes: 2- and
//! 3-stage pipelines (chunked prefill crossing window and compression boundaries, the
//! hyper-connection streams on the wire, also at 16 and 8 bits), a 2-rank tensor-parallel
//! group (output groups of heads and experts split), SSD streaming, and snapshots moved from a
//! pipeline to one node and to a group: all bit-identical to one node.

mod common;

use std::path::Path;

use common::cluster::{BASE, FixtureCluster, argmax, differing};
use common::*;

fn family() -> FixtureCluster {
    FixtureCluster::new("deepseek4")
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
fn deepseek4_pipelines_groups_and_streaming_are_bit_identical_to_single_node() {
    let dir = tempfile::tempdir().unwrap();
    let at = |name: &str| dir.path().join(name);
    let single = logits(&at("single.npy"), &[], &[], 1);

    for (name, splits, chunk) in [
        ("2 stages", &["0:1", "2:output"][..], "37"),
        ("3 stages", &["0:0", "1:2", "3:output"][..], "64"),
    ] {
        let layers = ["--layers", splits[0], "--dist-prefill-chunk", chunk];
        let extra = [&layers[..], &["--dist-prefill-window", "2"]].concat();
        let got = logits(&at(&format!("{name}.npy")), &extra, &splits[1..], 1);
        assert_eq!(differing(&got, &single), 0, "{name}");
    }

    // The hyper-connection streams (4 × n_embd per token) in the 16- and 8-bit wire formats.
    let n_vocab = 320;
    for bits in ["16", "8"] {
        let extra = ["--layers", "0:1", "--dist-activation-bits", bits];
        let got = logits(&at(&format!("bits{bits}.npy")), &extra, &["2:output"], 1);
        let max_err = got
            .iter()
            .zip(&single)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let agree = got
            .chunks(n_vocab)
            .zip(single.chunks(n_vocab))
            .filter(|(a, b)| argmax(a) == argmax(b))
            .count();
        let rows = single.len() / n_vocab;
        eprintln!(
            "deepseek4 {bits}-bit activations: max |Δlogit| {max_err:.4}, top-1 agreement {agree}/{rows}"
        );
        assert!(
            max_err < 3.0 && agree * 10 >= rows * 9,
            "{bits}-bit: {max_err}, {agree}/{rows}"
        );
    }

    // Two ranks: each its output groups of heads, half the experts, half the vocabulary.
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

/// A session saved on a 2-stage split (raw window rows, compressed rows and the compressors'
/// pending inputs of every layer) continues on one node and on a 2-rank group with the single
/// node's greedy tokens.
#[test]
fn deepseek4_snapshots_move_between_splits() {
    let dir = tempfile::tempdir().unwrap();
    let m = model();
    let text = std::fs::read_to_string(fixture("deepseek4", "prompt_tokens.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    // A prompt long enough for ratio-128 rows, cut mid-window of both ratios.
    let prompt: String = v["text"].as_str().unwrap().chars().take(700).collect();
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
    let snap = dir.path().join("v4.snap");
    let snap_s = snap.to_str().unwrap();
    let mut save = vec!["run", "-m", &m, "-p", &prompt, "-n", "0"];
    save.extend_from_slice(&["--layers", "0:1", "--save-snapshot", snap_s]);
    save.extend_from_slice(&greedy);
    with_cluster(&save, &["2:output"], 1);
    let mut load = vec!["run", "-m", &m, "-n", "16", "--load-snapshot", snap_s];
    load.extend_from_slice(&greedy);
    let mut single = load.clone();
    single.extend_from_slice(&BASE[..5]);
    assert_eq!(
        run_ok(&single).trim_end(),
        want,
        "2-stage snapshot continued on one node"
    );
    load.extend_from_slice(&["--tensor-parallel", "--tp-size", "2"]);
    assert_eq!(
        with_cluster(&load, &[], 2).trim_end(),
        want,
        "2-stage snapshot continued on 2 ranks"
    );
}
