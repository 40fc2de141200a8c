//! GLM-5.3 Flash (`glm5-next`, the tiny fixture: KDA layers 0 and 3, the k-pool indexer on
//! layer 1, layer 2 reusing its selection) across real processes: pipelines whose stages start
//! at the shared layer (the selection travels with the hidden state) or at KDA layers, a 2-rank
//! tensor-parallel group (latent and KDA heads split) and SSD streaming: all bit-identical to one
//! node; snapshots moved between splits and groups.

mod common;

use common::cluster::{BASE, FixtureCluster};
use common::*;

fn family() -> FixtureCluster {
    FixtureCluster::new("glm5-next")
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
    let fam = family();
    let single = fam.logits(&dir.path().join("single.npy"), &[], &[], 1);
    assert_eq!(single.len(), 473 * 320, "every prompt position's logits");
    fam.assert_splits_match(
        dir.path(),
        &single,
        &[
            // The worker starts at the shared layer: layer 1's selection comes with the work.
            ("2 stages", &["0:1", "2:output"], "37"),
            ("3 stages", &["0:0", "1:2", "3:output"], "64"),
            // Worker to worker: the selection made on the second stage reaches the third.
            ("4 stages", &["0:0", "1:1", "2:2", "3:output"], "50"),
        ],
    );
    // The streams at 16 and 8 bits on the wire, the selection exactly, into the shared layer.
    for (bits, min_agree_pct) in [("16", 90), ("8", 70)] {
        fam.assert_lossy_wire(
            dir.path(),
            &single,
            ("0:1", "2:output"),
            bits,
            min_agree_pct,
            320,
        );
    }
    // Two ranks: each half the latent and KDA heads, half the experts, half the vocabulary.
    fam.assert_tp_and_streaming_match(dir.path(), &single);
}

/// A session saved on a 2-stage split whose second stage starts at the shared layer, and one
/// saved on a 2-rank group (each rank its heads' KDA states, merged into the snapshot), continue
/// on one node and on a group with the single node's greedy tokens.
#[test]
fn glm5_next_snapshots_move_between_splits_and_groups() {
    let dir = tempfile::tempdir().unwrap();
    let m = model();
    let (prompt, want) = family().greedy_text(600, "16");
    let greedy = ["--temp", "0"];
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
