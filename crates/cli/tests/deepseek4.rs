//! DeepSeek V4 (`deepseek4`, the tiny fixture: a sliding-only layer, ratio-4 layers with the
//! indexer, a ratio-128 layer, a hash-routed first layer) across real processes: 2- and
//! 3-stage pipelines (chunked prefill crossing window and compression boundaries, the
//! hyper-connection streams on the wire, also at 16 and 8 bits), a 2-rank tensor-parallel
//! group (output groups of heads and experts split), SSD streaming, and snapshots moved from a
//! pipeline to one node and to a group: all bit-identical to one node.

mod common;

use common::cluster::{BASE, FixtureCluster};
use common::*;

fn family() -> FixtureCluster {
    FixtureCluster::new("deepseek4")
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
    let fam = family();
    let single = fam.logits(&dir.path().join("single.npy"), &[], &[], 1);
    fam.assert_splits_match(
        dir.path(),
        &single,
        &[
            ("2 stages", &["0:1", "2:output"], "37"),
            ("3 stages", &["0:0", "1:2", "3:output"], "64"),
        ],
    );
    // The hyper-connection streams (4 × n_embd per token) in the 16- and 8-bit wire formats.
    for bits in ["16", "8"] {
        fam.assert_lossy_wire(dir.path(), &single, ("0:1", "2:output"), bits, 90, 320);
    }
    // Two ranks: each its output groups of heads, half the experts, half the vocabulary.
    fam.assert_tp_and_streaming_match(dir.path(), &single);
}

/// A session saved on a 2-stage split (raw window rows, compressed rows and the compressors'
/// pending inputs of every layer) continues on one node and on a 2-rank group with the single
/// node's greedy tokens.
#[test]
fn deepseek4_snapshots_move_between_splits() {
    let dir = tempfile::tempdir().unwrap();
    let m = model();
    // A prompt long enough for ratio-128 rows, cut mid-window of both ratios.
    let (prompt, want) = family().greedy_text(700, "16");
    let greedy = ["--temp", "0"];
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
