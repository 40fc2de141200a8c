//! DeepSeek V4 (`deepseek4`, the tiny fixture: a sliding-only layer, ratio-4 layers with the
//! indexer, a ratio-128 layer, a hash-routed first layer) across real processes: 2- and
//! 3-stage pipelines (chunked prefill crossing window and compression boundaries, the
//! hyper-connection streams on the wire), a 2-rank tensor-parallel group (output groups of heads
//! and experts split), and SSD streaming: all bit-identical to one node.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

const T: Duration = Duration::from_secs(240);

fn tokens() -> String {
    let text = std::fs::read_to_string(fixture("deepseek4", "prompt_tokens.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn logits_args<'a>(model: &'a str, toks: &'a str, out: &'a str) -> Vec<&'a str> {
    vec![
        "logits",
        "-m",
        model,
        "--tokens",
        toks,
        "--out",
        out,
        "--kv-type",
        "f32",
        "--no-warm",
    ]
}

fn differing(a: &[f32], b: &[f32]) -> usize {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

fn out(dir: &Path, name: &str) -> String {
    dir.join(name).to_string_lossy().into_owned()
}

#[test]
fn deepseek4_pipelines_groups_and_streaming_are_bit_identical_to_single_node() {
    let dir = tempfile::tempdir().unwrap();
    let m = fixture("deepseek4", "model-f32.gguf");
    let m = m.to_str().unwrap();
    let toks = tokens();
    let single_out = out(dir.path(), "single.npy");
    let mut args = logits_args(m, &toks, &single_out);
    args.extend_from_slice(&["--threads", "2"]);
    run_ok(&args);
    let single = read_npy_f32(Path::new(&single_out)).1;

    for (name, splits, chunk) in [
        ("2 stages", &["0:1", "2:output"][..], "37"),
        ("3 stages", &["0:0", "1:2", "3:output"][..], "64"),
    ] {
        let o = out(dir.path(), &format!("{name}.npy"));
        let mut args = logits_args(m, &toks, &o);
        args.extend_from_slice(&[
            "--threads",
            "1",
            "--insecure",
            "--layers",
            splits[0],
            "--dist-prefill-chunk",
            chunk,
            "--dist-prefill-window",
            "2",
            "--listen",
            "127.0.0.1:0",
        ]);
        let coord = Proc::spawn("coordinator", &args);
        let addr = format!("127.0.0.1:{}", coord.coordinator_port());
        let _workers: Vec<Proc> = splits[1..]
            .iter()
            .map(|s| {
                Proc::spawn(
                    &format!("worker {s}"),
                    &[
                        "worker",
                        "-m",
                        m,
                        "--layers",
                        s,
                        "--coordinator",
                        &addr,
                        "--threads",
                        "1",
                        "--kv-type",
                        "f32",
                        "--no-warm",
                        "--insecure",
                    ],
                )
            })
            .collect();
        let (ok, _, err) = coord.finish(T);
        assert!(ok, "{name}: {err}");
        let got = read_npy_f32(Path::new(&o)).1;
        assert_eq!(differing(&got, &single), 0, "{name}");
    }

    // The hyper-connection streams (4 × n_embd per token) in the 16- and 8-bit wire formats.
    let n_vocab = 320;
    for bits in ["16", "8"] {
        let o = out(dir.path(), &format!("bits{bits}.npy"));
        let mut args = logits_args(m, &toks, &o);
        args.extend_from_slice(&[
            "--threads",
            "1",
            "--insecure",
            "--layers",
            "0:1",
            "--dist-activation-bits",
            bits,
            "--listen",
            "127.0.0.1:0",
        ]);
        let coord = Proc::spawn("coordinator", &args);
        let addr = format!("127.0.0.1:{}", coord.coordinator_port());
        let _w = Proc::spawn(
            "worker 2:output",
            &[
                "worker",
                "-m",
                m,
                "--layers",
                "2:output",
                "--coordinator",
                &addr,
                "--threads",
                "1",
                "--kv-type",
                "f32",
                "--no-warm",
                "--insecure",
            ],
        );
        let (ok, _, err) = coord.finish(T);
        assert!(ok, "{bits}-bit: {err}");
        let got = read_npy_f32(Path::new(&o)).1;
        let max_err = got
            .iter()
            .zip(&single)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let argmax = |v: &[f32]| {
            v.iter()
                .enumerate()
                .fold(0, |b, (i, &x)| if x > v[b] { i } else { b })
        };
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
    let o = out(dir.path(), "tp.npy");
    let mut args = logits_args(m, &toks, &o);
    args.extend_from_slice(&[
        "--tensor-parallel",
        "--tp-size",
        "2",
        "--listen",
        "127.0.0.1:0",
        "--insecure",
        "--threads",
        "1",
    ]);
    let coord = Proc::spawn("tp coordinator", &args);
    let addr = format!("127.0.0.1:{}", coord.coordinator_port());
    let _rank = Proc::spawn(
        "rank",
        &[
            "worker",
            "--tensor-parallel",
            "-m",
            m,
            "--coordinator",
            &addr,
            "--threads",
            "1",
            "--kv-type",
            "f32",
            "--no-warm",
            "--insecure",
        ],
    );
    let (ok, _, err) = coord.finish(T);
    assert!(ok, "2 ranks: {err}");
    let got = read_npy_f32(Path::new(&o)).1;
    assert_eq!(differing(&got, &single), 0, "2 ranks");

    // Streaming with one cache slot, and with the whole layer cached.
    for cache in ["1", "8"] {
        let o = out(dir.path(), &format!("stream{cache}.npy"));
        let mut args = logits_args(m, &toks, &o);
        args.extend_from_slice(&["--threads", "2", "--ssd-streaming", "--expert-cache", cache]);
        run_ok(&args);
        let got = read_npy_f32(Path::new(&o)).1;
        assert_eq!(differing(&got, &single), 0, "streaming, cache {cache}");
    }
}

/// A session saved on a 2-stage split (raw window rows, compressed rows and the compressors'
/// pending inputs of every layer) continues on one node and on a 2-rank group with the single
/// node's greedy tokens.
#[test]
fn deepseek4_snapshots_move_between_splits() {
    let dir = tempfile::tempdir().unwrap();
    let m = fixture("deepseek4", "model-f32.gguf");
    let m = m.to_str().unwrap();
    let text = std::fs::read_to_string(fixture("deepseek4", "prompt_tokens.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    // A prompt long enough for ratio-128 rows, cut mid-window of both ratios.
    let prompt: String = v["text"].as_str().unwrap().chars().take(700).collect();
    let base = [
        "--temp",
        "0",
        "--kv-type",
        "f32",
        "--no-warm",
        "--threads",
        "1",
    ];
    let mut args = vec!["run", "-m", m, "-p", &prompt, "-n", "16"];
    args.extend_from_slice(&base);
    let want = run_ok(&args);
    let want = want
        .strip_prefix(prompt.as_str())
        .unwrap_or(&want)
        .trim_end()
        .to_string();
    let snap = dir.path().join("v4.snap");
    let snap_s = snap.to_str().unwrap();
    let mut args = vec![
        "run",
        "-m",
        m,
        "-p",
        &prompt,
        "-n",
        "0",
        "--insecure",
        "--layers",
        "0:1",
        "--save-snapshot",
        snap_s,
        "--listen",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(&base);
    let coord = Proc::spawn("coordinator save", &args);
    let addr = format!("127.0.0.1:{}", coord.coordinator_port());
    let _w = Proc::spawn(
        "worker 2:output",
        &[
            "worker",
            "-m",
            m,
            "--layers",
            "2:output",
            "--coordinator",
            &addr,
            "--threads",
            "1",
            "--kv-type",
            "f32",
            "--no-warm",
            "--insecure",
        ],
    );
    let (ok, _, err) = coord.finish(T);
    assert!(ok, "save on 2 stages: {err}");
    let mut args = vec!["run", "-m", m, "-n", "16", "--load-snapshot", snap_s];
    args.extend_from_slice(&base);
    let got = run_ok(&args);
    assert_eq!(
        got.trim_end(),
        want,
        "2-stage snapshot continued on one node"
    );
    let mut args = vec![
        "run",
        "-m",
        m,
        "-n",
        "16",
        "--load-snapshot",
        snap_s,
        "--tensor-parallel",
        "--tp-size",
        "2",
        "--listen",
        "127.0.0.1:0",
        "--insecure",
    ];
    args.extend_from_slice(&base);
    let coord = Proc::spawn("tp coordinator", &args);
    let addr = format!("127.0.0.1:{}", coord.coordinator_port());
    let _rank = Proc::spawn(
        "rank",
        &[
            "worker",
            "--tensor-parallel",
            "-m",
            m,
            "--coordinator",
            &addr,
            "--threads",
            "1",
            "--kv-type",
            "f32",
            "--no-warm",
            "--insecure",
        ],
    );
    let (ok, out, err) = coord.finish(T);
    assert!(ok, "load on 2 ranks: {err}");
    assert_eq!(
        out.trim_end(),
        want,
        "2-stage snapshot continued on 2 ranks"
    );
}
