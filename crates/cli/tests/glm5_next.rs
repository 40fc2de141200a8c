//! GLM-5.3 Flash (`glm5-next`, the tiny fixture: KDA layers 0 and 3, the k-pool indexer on
//! layer 1, layer 2 reusing its selection) across real processes: pipelines whose stages start
//! at the shared layer (the selection travels in the work header) or at KDA layers, and a
//! 2-rank tensor-parallel group (latent and KDA heads split): all bit-identical to one node.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

const T: Duration = Duration::from_secs(240);

/// Flags every process of these tests shares.
const BASE: [&str; 6] = [
    "--kv-type",
    "f32",
    "--no-warm",
    "--threads",
    "1",
    "--insecure",
];

fn model() -> String {
    fixture("glm5-next", "model-f32.gguf")
        .to_string_lossy()
        .into_owned()
}

/// Runs `args` as a coordinator listening on an OS-chosen port, with a pipeline worker per
/// range in `stages` or (`stages` empty) `ranks - 1` tensor-parallel ranks; its stdout.
fn with_cluster(args: &[&str], stages: &[&str], ranks: usize) -> String {
    let m = model();
    let mut full = args.to_vec();
    full.extend_from_slice(&BASE);
    full.extend_from_slice(&["--listen", "127.0.0.1:0"]);
    let coord = Proc::spawn("coordinator", &full);
    let addr = format!("127.0.0.1:{}", coord.coordinator_port());
    let mut peers = Vec::new();
    for s in stages {
        let mut a = vec!["worker", "-m", &m, "--layers", s, "--coordinator", &addr];
        a.extend_from_slice(&BASE);
        peers.push(Proc::spawn(&format!("worker {s}"), &a));
    }
    for _ in 1..ranks {
        let mut a = vec![
            "worker",
            "--tensor-parallel",
            "-m",
            &m,
            "--coordinator",
            &addr,
        ];
        a.extend_from_slice(&BASE);
        peers.push(Proc::spawn("rank", &a));
    }
    let (ok, out, err) = coord.finish(T);
    assert!(ok, "{args:?} on {stages:?} / {ranks} ranks: {err}");
    out
}

/// `logits` of the fixture prompt into `out`, with `extra` flags and the cluster above.
fn logits(out: &Path, extra: &[&str], stages: &[&str], ranks: usize) -> Vec<f32> {
    let (m, toks) = (model(), fixture_tokens("glm5-next"));
    let o = out.to_string_lossy().into_owned();
    let mut args = vec!["logits", "-m", &m, "--tokens", &toks, "--out", &o];
    args.extend_from_slice(extra);
    if stages.is_empty() && ranks <= 1 {
        args.extend_from_slice(&BASE[..5]);
        run_ok(&args);
    } else {
        with_cluster(&args, stages, ranks);
    }
    read_npy_f32(out).1
}

fn differing(a: &[f32], b: &[f32]) -> usize {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

#[test]
fn glm5_next_pipelines_and_groups_are_bit_identical_to_single_node() {
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
}
