//! One fixture model across real processes: a coordinator with pipeline stages or
//! tensor-parallel ranks on 127.0.0.1, the `logits` of its prompt, bit comparisons.

use std::path::Path;
use std::time::Duration;

use super::{Proc, fixture, fixture_tokens, read_npy_f32, run_ok};

const T: Duration = Duration::from_secs(240);

/// Flags every process of these tests shares (the first five: those a single node takes).
pub const BASE: [&str; 6] = [
    "--kv-type",
    "f32",
    "--no-warm",
    "--threads",
    "1",
    "--insecure",
];

/// A fixture directory under `crates/model/tests/fixtures` with `model-f32.gguf` and
/// `prompt_tokens.json`.
pub struct FixtureCluster {
    pub name: &'static str,
}

impl FixtureCluster {
    pub fn new(name: &'static str) -> FixtureCluster {
        FixtureCluster { name }
    }

    pub fn model(&self) -> String {
        fixture(self.name, "model-f32.gguf")
            .to_string_lossy()
            .into_owned()
    }

    /// Runs `args` as a coordinator listening on an OS-chosen port, with a pipeline worker
    /// per range in `stages` or (`stages` empty) `ranks - 1` tensor-parallel ranks; its stdout.
    pub fn with_cluster(&self, args: &[&str], stages: &[&str], ranks: usize) -> String {
        let m = self.model();
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
    pub fn logits(&self, out: &Path, extra: &[&str], stages: &[&str], ranks: usize) -> Vec<f32> {
        let (m, toks) = (self.model(), fixture_tokens(self.name));
        let o = out.to_string_lossy().into_owned();
        let mut args = vec!["logits", "-m", &m, "--tokens", &toks, "--out", &o];
        args.extend_from_slice(extra);
        if stages.is_empty() && ranks <= 1 {
            args.extend_from_slice(&BASE[..5]);
            run_ok(&args);
        } else {
            self.with_cluster(&args, stages, ranks);
        }
        read_npy_f32(out).1
    }
}

/// How many values of `a` and `b` differ in any bit.
pub fn differing(a: &[f32], b: &[f32]) -> usize {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

pub fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(0, |b, (i, &x)| if x > v[b] { i } else { b })
}
