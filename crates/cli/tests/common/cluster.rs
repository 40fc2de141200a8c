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

impl FixtureCluster {
    /// Each pipeline case (name, stage ranges — the first the coordinator's —, prefill chunk)
    /// gives `single`'s logits bit for bit.
    pub fn assert_splits_match(&self, dir: &Path, single: &[f32], cases: &[(&str, &[&str], &str)]) {
        for &(name, splits, chunk) in cases {
            let layers = ["--layers", splits[0], "--dist-prefill-chunk", chunk];
            let extra = [&layers[..], &["--dist-prefill-window", "2"]].concat();
            let out = dir.join(format!("{name}.npy"));
            let got = self.logits(&out, &extra, &splits[1..], 1);
            assert_eq!(differing(&got, single), 0, "{} {name}", self.name);
        }
    }

    /// A 2-rank group, and streaming with one cache slot and with the whole layer cached, give
    /// `single`'s logits bit for bit.
    pub fn assert_tp_and_streaming_match(&self, dir: &Path, single: &[f32]) {
        let tp = ["--tensor-parallel", "--tp-size", "2"];
        let got = self.logits(&dir.join("tp.npy"), &tp, &[], 2);
        assert_eq!(differing(&got, single), 0, "{}: 2 ranks", self.name);
        for cache in ["1", "8"] {
            let extra = ["--ssd-streaming", "--expert-cache", cache];
            let got = self.logits(&dir.join(format!("stream{cache}.npy")), &extra, &[], 1);
            assert_eq!(
                differing(&got, single),
                0,
                "{}: streaming, cache {cache}",
                self.name
            );
        }
    }

    /// A 2-stage split (`first` on the coordinator, `rest` on a worker) with the stream at
    /// `bits` on the wire: the logits stay within 3 of `single` and agree on the top token at
    /// `min_agree_pct` % of the positions or more.
    pub fn assert_lossy_wire(
        &self,
        dir: &Path,
        single: &[f32],
        split: (&str, &str),
        bits: &str,
        min_agree_pct: usize,
        n_vocab: usize,
    ) {
        let extra = ["--layers", split.0, "--dist-activation-bits", bits];
        let got = self.logits(&dir.join(format!("bits{bits}.npy")), &extra, &[split.1], 1);
        let max_err = got
            .iter()
            .zip(single)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let agree = got
            .chunks(n_vocab)
            .zip(single.chunks(n_vocab))
            .filter(|(a, b)| argmax(a) == argmax(b))
            .count();
        let rows = single.len() / n_vocab;
        eprintln!(
            "{} {bits}-bit activations: max |Δlogit| {max_err:.4}, top-1 agreement {agree}/{rows}",
            self.name
        );
        assert!(
            max_err < 3.0 && agree * 100 >= rows * min_agree_pct,
            "{} {bits}-bit: {max_err}, {agree}/{rows}",
            self.name
        );
    }

    /// The single node's greedy continuation (`n` tokens) of the first `chars` characters of
    /// the fixture's prompt text, and that prompt.
    pub fn greedy_text(&self, chars: usize, n: &str) -> (String, String) {
        let text = std::fs::read_to_string(fixture(self.name, "prompt_tokens.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let prompt: String = v["text"].as_str().unwrap().chars().take(chars).collect();
        let m = self.model();
        let mut args = vec!["run", "-m", &m, "-p", &prompt, "-n", n, "--temp", "0"];
        args.extend_from_slice(&BASE[..5]);
        let out = run_ok(&args);
        let want = out
            .strip_prefix(prompt.as_str())
            .unwrap_or(&out)
            .trim_end()
            .to_string();
        (prompt, want)
    }
}
