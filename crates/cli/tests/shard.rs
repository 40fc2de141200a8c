//! `moeshard shard`: per-stage and per-rank files. The plan's bytes are the written files'
//! sizes; a 3-stage pipeline and a 3-rank group started from shard files only (the full model
//! deleted before they start) give the single node's logits bit for bit, streamed experts
//! included; a file that lacks what its role runs is refused, naming both; a shard file and a
//! full file of one model join one cluster.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

const T: Duration = Duration::from_secs(180);

/// The common flags of every model-running process here.
const QUIET: [&str; 6] = [
    "--threads",
    "1",
    "--kv-type",
    "f32",
    "--no-warm",
    "--insecure",
];

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A copy of the qwen3moe fixture (4 layers, 6 experts top-2) in `dir`.
fn copy_model(dir: &Path, quant: &str) -> PathBuf {
    let full = dir.join("full.gguf");
    std::fs::copy(fixture("qwen3moe", &format!("model-{quant}.gguf")), &full).unwrap();
    full
}

fn logits_args<'a>(model: &'a str, tokens: &'a str, out: &'a str) -> Vec<&'a str> {
    let mut a = vec!["logits", "-m", model, "--tokens", tokens, "--out", out];
    a.extend_from_slice(&QUIET[..5]);
    a
}

fn single(model: &Path, tokens: &str, out: &Path) -> Vec<f32> {
    run_ok(&logits_args(s(model), tokens, s(out)));
    read_npy_f32(out).1
}

/// `(machine, file, bytes)` of each line of `shard --plan` (the totals line left out).
fn plan_lines(stdout: &str) -> Vec<(String, PathBuf, u64)> {
    stdout
        .lines()
        .skip(1)
        .filter(|l| !l.starts_with("all machines"))
        .map(|l| {
            let cols: Vec<&str> = l.split('\t').collect();
            (
                cols[0].to_string(),
                PathBuf::from(cols[1]),
                cols[2].parse().unwrap_or_else(|_| panic!("bytes in {l:?}")),
            )
        })
        .collect()
}

/// Writes the files of a layout (`layout` are the `shard` flags), checking first that the
/// plan names the same files with the sizes they then have. Returns the files in order.
fn write_layout(model: &Path, prefix: &Path, layout: &[&str]) -> Vec<PathBuf> {
    let mut args = vec!["shard", s(model), "--all", "-o", s(prefix)];
    args.extend_from_slice(layout);
    let mut plan_args = args.clone();
    plan_args.push("--plan");
    let plan = plan_lines(&run_ok(&plan_args));
    assert!(
        plan.iter().all(|(_, f, _)| !f.exists()),
        "--plan wrote files"
    );
    run_ok(&args);
    for (machine, file, bytes) in &plan {
        let len = std::fs::metadata(file)
            .unwrap_or_else(|e| panic!("{machine}: {}: {e}", file.display()))
            .len();
        assert_eq!(
            len, *bytes,
            "{machine}: the plan says {bytes} bytes, the file has {len}"
        );
    }
    plan.into_iter().map(|(_, f, _)| f).collect()
}

fn assert_bits(name: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{name}");
    let differing = got
        .iter()
        .zip(want)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(
        differing, 0,
        "{name}: {differing} logits differ from single node"
    );
}

/// Logits from a pipeline: the coordinator runs `stages[0]` from its file, a worker each
/// other stage from its own.
fn pipeline_logits(stages: &[(&str, &Path)], tokens: &str, out: &Path) -> Vec<f32> {
    let mut args = logits_args(s(stages[0].1), tokens, s(out));
    args.extend_from_slice(&[
        "--insecure",
        "--layers",
        stages[0].0,
        "--listen",
        "127.0.0.1:0",
    ]);
    let coord = Proc::spawn("pipeline coordinator", &args);
    let addr = format!("127.0.0.1:{}", coord.coordinator_port());
    let _workers: Vec<Proc> = stages[1..]
        .iter()
        .map(|(layers, file)| {
            let mut a = vec![
                "worker",
                "-m",
                s(file),
                "--layers",
                layers,
                "--coordinator",
                &addr,
            ];
            a.extend_from_slice(&QUIET);
            Proc::spawn(&format!("worker {layers}"), &a)
        })
        .collect();
    let (ok, _, err) = coord.finish(T);
    assert!(ok, "pipeline logits failed:\n{err}");
    read_npy_f32(out).1
}

/// Logits from a tensor-parallel group of `files.len()` ranks, rank 0 on `files[0]`;
/// `coordinator_extra` goes to the coordinator (placement flags such as `--expert-weights`,
/// which workers do not take), `extra` to every process.
fn group_logits(
    files: &[&Path],
    tokens: &str,
    out: &Path,
    coordinator_extra: &[&str],
    extra: &[&str],
) -> Vec<f32> {
    let n = files.len().to_string();
    let mut args = logits_args(s(files[0]), tokens, s(out));
    args.extend_from_slice(&["--insecure", "--tensor-parallel", "--tp-size", &n]);
    args.extend_from_slice(&["--listen", "127.0.0.1:0"]);
    args.extend_from_slice(coordinator_extra);
    args.extend_from_slice(extra);
    let coord = Proc::spawn("tp coordinator", &args);
    let addr = format!("127.0.0.1:{}", coord.coordinator_port());
    let _ranks: Vec<Proc> = files[1..]
        .iter()
        .map(|file| {
            let mut a = vec![
                "worker",
                "--tensor-parallel",
                "-m",
                s(file),
                "--coordinator",
                &addr,
            ];
            a.extend_from_slice(&QUIET);
            a.extend_from_slice(extra);
            Proc::spawn("rank", &a)
        })
        .collect();
    let (ok, _, err) = coord.finish(T);
    assert!(ok, "tensor-parallel logits failed:\n{err}");
    read_npy_f32(out).1
}

#[test]
fn clusters_started_from_shard_files_only_match_single_node_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let toks = fixture_tokens("qwen3moe");
    let full = copy_model(d, "f32");
    let want = single(&full, &toks, &d.join("single.npy"));
    let stages = write_layout(&full, &d.join("st"), &["--layers", "0:0,1:2,3:output"]);
    let ranks = write_layout(
        &full,
        &d.join("tp"),
        &[
            "--tensor-parallel",
            "--tp-size",
            "3",
            "--expert-weights",
            "2,1,1",
        ],
    );
    let full_len = std::fs::metadata(&full).unwrap().len();
    for f in stages.iter().chain(&ranks) {
        assert!(
            std::fs::metadata(f).unwrap().len() < full_len,
            "{}",
            f.display()
        );
    }
    // From here on no process can read the full model.
    std::fs::remove_file(&full).unwrap();

    let got = pipeline_logits(
        &[
            ("0:0", &stages[0]),
            ("1:2", &stages[1]),
            ("3:output", &stages[2]),
        ],
        &toks,
        &d.join("pipeline.npy"),
    );
    assert_bits("3 stages from stage files", &got, &want);

    let files: Vec<&Path> = ranks.iter().map(PathBuf::as_path).collect();
    let weights = ["--expert-weights", "2,1,1"];
    let got = group_logits(&files, &toks, &d.join("tp.npy"), &weights, &[]);
    assert_bits("3 ranks from rank files", &got, &want);

    // Each rank streams its experts from its own file (experts 0..3, 3..4, 4..6), one slot.
    let streaming = ["--ssd-streaming", "--expert-cache", "1"];
    let got = group_logits(
        &files,
        &toks,
        &d.join("tp-stream.npy"),
        &weights,
        &streaming,
    );
    assert_bits("3 ranks streaming from rank files", &got, &want);
}

#[test]
fn streaming_a_stage_file_matches_single_node() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let toks = fixture_tokens("qwen3moe");
    let full = copy_model(d, "q4_k");
    let want = single(&full, &toks, &d.join("single.npy"));
    let stages = write_layout(&full, &d.join("st"), &["--layers", "0:1,2:output"]);
    std::fs::remove_file(&full).unwrap();
    let stream = ["--ssd-streaming", "--expert-cache", "1"];
    let out = d.join("stream.npy");
    let mut args = logits_args(s(&stages[0]), &toks, s(&out));
    args.extend_from_slice(&["--insecure", "--layers", "0:1", "--listen", "127.0.0.1:0"]);
    args.extend_from_slice(&stream);
    let coord = Proc::spawn("pipeline coordinator", &args);
    let addr = format!("127.0.0.1:{}", coord.coordinator_port());
    let mut w = vec![
        "worker",
        "-m",
        s(&stages[1]),
        "--layers",
        "2:output",
        "--coordinator",
        &addr,
    ];
    w.extend_from_slice(&QUIET);
    w.extend_from_slice(&stream);
    let _worker = Proc::spawn("worker 2:output", &w);
    let (ok, _, err) = coord.finish(T);
    assert!(ok, "streaming pipeline failed:\n{err}");
    assert_bits(
        "2 streaming stages from stage files",
        &read_npy_f32(&out).1,
        &want,
    );
}

#[test]
fn a_file_that_lacks_its_role_is_refused_naming_both_and_full_files_mix_with_shards() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let toks = fixture_tokens("qwen3moe");
    let full = copy_model(d, "f32");
    let stage = d.join("stage.gguf");
    run_ok(&["shard", s(&full), "--layers", "1:2", "-o", s(&stage)]);
    let uneven = d.join("uneven.gguf");
    run_ok(&[
        "shard",
        s(&full),
        "--tensor-parallel",
        "--tp-size",
        "2",
        "--rank",
        "1",
        "--expert-weights",
        "2,1",
        "-o",
        s(&uneven),
    ]);
    let even = d.join("even.gguf");
    run_ok(&[
        "shard",
        s(&full),
        "--tensor-parallel",
        "--tp-size",
        "2",
        "--rank",
        "1",
        "-o",
        s(&even),
    ]);

    // The stage file runs neither another stage nor the whole model.
    let mut a = vec![
        "worker",
        "-m",
        s(&stage),
        "--layers",
        "2:output",
        "--coordinator",
        "127.0.0.1:9",
    ];
    a.extend_from_slice(&QUIET);
    let (ok, _, err) = Proc::spawn("wrong stage", &a).finish(T);
    assert!(!ok, "a stage file ran a stage it lacks");
    assert!(
        err.contains("layers 1:2") && err.contains("stage 2:output"),
        "the refusal names the file's slice and the role:\n{err}"
    );
    let out = d.join("x.npy");
    let (ok, _, err) = Proc::spawn("whole", &logits_args(s(&stage), &toks, s(&out))).finish(T);
    assert!(!ok && err.contains("the whole model"), "{err}");

    // A rank file written for --expert-weights 2,1 (experts 4..6) in an even group, where
    // rank 1 computes experts 3..6: the coordinator refuses it, and the rank says why.
    let mut args = logits_args(s(&full), &toks, s(&out));
    args.extend_from_slice(&["--insecure", "--tensor-parallel", "--tp-size", "2"]);
    args.extend_from_slice(&["--listen", "127.0.0.1:0", "--route-wait", "5"]);
    let coord = Proc::spawn("tp coordinator", &args);
    let addr = format!("127.0.0.1:{}", coord.coordinator_port());
    let mut a = vec![
        "worker",
        "--tensor-parallel",
        "-m",
        s(&uneven),
        "--coordinator",
        &addr,
    ];
    a.extend_from_slice(&QUIET);
    let (ok, _, err) = Proc::spawn("wrong rank", &a).finish(T);
    assert!(!ok, "a rank file without the rank's experts joined");
    assert!(
        err.contains("wrong shard file for rank 1")
            && err.contains("holds experts 4..6")
            && err.contains("computes experts 3..6"),
        "the refusal names both:\n{err}"
    );
    let (ok, _, _) = coord.finish(T);
    assert!(!ok, "the group formed without rank 1");

    // The right rank file joins a coordinator on the full file: one model identity.
    let want = single(&full, &toks, &d.join("single.npy"));
    let got = group_logits(&[&full, &even], &toks, &d.join("mixed.npy"), &[], &[]);
    assert_bits("full file + rank file", &got, &want);
}

#[test]
fn bad_shard_requests_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let full = copy_model(d, "q8_0");
    let m = s(&full);
    let o = d.join("o.gguf");
    for (args, why) in [
        (
            vec!["--layers", "0:1,3:output", "--all"],
            "should start at layer 2",
        ),
        (
            vec!["--layers", "0:1,2:3", "--all"],
            "must end with `output`",
        ),
        (vec!["--layers", "0:1,2:output"], "add --all"),
        (
            vec!["--tensor-parallel", "--tp-size", "3"],
            "--rank R or --all",
        ),
        (
            vec!["--tensor-parallel", "--tp-size", "3", "--rank", "3"],
            "outside 0..3",
        ),
        (vec!["--layers", "0:9"], "invalid for a model of 4 layers"),
    ] {
        let mut a = vec!["shard", m, "-o", s(&o)];
        a.extend_from_slice(&args);
        let out = std::process::Command::new(bin()).args(&a).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(why),
            "{args:?}: {err}"
        );
    }
    run_ok(&["shard", m, "--layers", "0:1", "-o", s(&o)]);
    let out = std::process::Command::new(bin())
        .args([
            "shard",
            s(&o),
            "--layers",
            "0:0",
            "-o",
            s(&d.join("p.gguf")),
        ])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("already a shard file"),
        "a shard of a shard"
    );
}
