//! Speculative decoding (prompt lookup, a draft model) keeps greedy output exactly the
//! non-speculative one, on a single node (dense, MoE, sliding-window attention), in a pipeline
//! and in a tensor-parallel group, while actually accepting drafts; a draft model with another
//! vocabulary is refused by name.

mod common;

use std::time::Duration;

use common::*;

const T: Duration = Duration::from_secs(180);

fn demo_model() -> String {
    repo()
        .join("models/shakespeare-moe.gguf")
        .to_string_lossy()
        .into_owned()
}

fn greedy_args<'a>(model: &'a str, prompt: &'a str, n: &'a str) -> Vec<&'a str> {
    vec![
        "run",
        "-m",
        model,
        "-p",
        prompt,
        "-n",
        n,
        "--temp",
        "0",
        "--kv-type",
        "f32",
        "--no-warm",
    ]
}

const SPECULATIVE: [&str; 4] = ["--speculative", "prompt-lookup", "--draft-max", "6"];

/// The `accepted N` count of the summary line; fails when the run drafted nothing.
fn accepted(stderr: &str) -> usize {
    let line = stderr
        .lines()
        .find(|l| l.contains("generation:"))
        .unwrap_or_else(|| panic!("no summary line:\n{stderr}"));
    let rest = line
        .split("accepted ")
        .nth(1)
        .unwrap_or_else(|| panic!("nothing was drafted: {line}"));
    rest.split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("unreadable acceptance in {line}"))
}

fn run_with_stderr(args: &[&str]) -> (String, String) {
    let (ok, out, err) = Proc::spawn("run", args).finish(T);
    assert!(ok, "{args:?} failed:\n{err}");
    (out, err)
}

#[test]
fn greedy_speculative_output_is_the_plain_output_on_a_single_node() {
    let smollm2 = smollm2();
    let gpt_oss = fixture("gpt-oss", "model-f32.gguf");
    let cases = [
        (demo_model(), "ROMEO:", "160"),
        (
            smollm2.to_string_lossy().into_owned(),
            "def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return a + b + c\n\ndef add4(",
            "48",
        ),
        // A sliding window smaller than some drafts: rewinds past it are recomputed.
        (
            gpt_oss.to_string_lossy().into_owned(),
            "hello hello hello",
            "48",
        ),
    ];
    for (model, prompt, n) in &cases {
        let want = run_ok(&greedy_args(model, prompt, n));
        let mut args = greedy_args(model, prompt, n);
        args.extend_from_slice(&SPECULATIVE);
        let (out, err) = run_with_stderr(&args);
        assert_eq!(out, want, "{model}: speculative greedy text differs");
        eprintln!("{model}: accepted {} drafted tokens", accepted(&err));
    }
}

/// The demo model requantized to Q4_0: the same vocabulary, close but not equal predictions.
fn draft_model(dir: &std::path::Path) -> String {
    let out = dir.join("draft-q4_0.gguf");
    let out = out.to_string_lossy().into_owned();
    run_ok(&["quantize", "--type", "q4_0", &demo_model(), &out]);
    out
}

#[test]
fn a_draft_model_keeps_greedy_output_and_another_vocabulary_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let draft = draft_model(dir.path());
    let m = demo_model();
    let want = run_ok(&greedy_args(&m, "ROMEO:", "160"));
    let mut args = greedy_args(&m, "ROMEO:", "160");
    args.extend_from_slice(&["--draft-model", &draft]);
    let (out, err) = run_with_stderr(&args);
    assert_eq!(out, want, "draft-model greedy text differs");
    assert!(
        accepted(&err) > 0,
        "the draft model's drafts were never kept:\n{err}"
    );

    let other = smollm2();
    let mut args = greedy_args(&m, "ROMEO:", "4");
    args.extend_from_slice(&["--draft-model", other.to_str().unwrap()]);
    let (ok, _, err) = Proc::spawn("run", &args).finish(T);
    assert!(!ok, "a draft model with another vocabulary was accepted");
    assert!(
        err.contains("draft model") && err.contains("vocabulary"),
        "the refusal does not say why:\n{err}"
    );
}

#[test]
fn greedy_speculative_output_is_the_plain_output_in_a_pipeline_and_a_group() {
    let dir = tempfile::tempdir().unwrap();
    let draft = draft_model(dir.path());
    let m = demo_model();
    let (prompt, n) = ("ROMEO:", "120");
    let want = run_ok(&greedy_args(&m, prompt, n));
    let configs: [(&str, Vec<&str>); 2] = [
        ("prompt lookup", SPECULATIVE.to_vec()),
        ("draft model", vec!["--draft-model", &draft]),
    ];
    for (name, spec) in &configs {
        // (topology, the coordinator's flags, its one worker's flags).
        let topologies: [(&str, &[&str], &[&str]); 2] = [
            (
                "2-stage pipeline",
                &["--layers", "0:2"],
                &["--layers", "3:output"],
            ),
            (
                "2-rank group",
                &["--tensor-parallel", "--tp-size", "2"],
                &["--tensor-parallel"],
            ),
        ];
        for (topology, coord_flags, worker_flags) in topologies {
            let mut args = greedy_args(&m, prompt, n);
            args.extend_from_slice(spec);
            args.extend_from_slice(coord_flags);
            args.extend_from_slice(&["--listen", "127.0.0.1:0", "--insecure"]);
            let coord = Proc::spawn("coordinator", &args);
            let addr = format!("127.0.0.1:{}", coord.coordinator_port());
            let mut worker = vec!["worker", "-m", &m, "--coordinator", &addr];
            worker.extend_from_slice(worker_flags);
            worker.extend_from_slice(&["--kv-type", "f32", "--no-warm", "--insecure"]);
            let _worker = Proc::spawn("worker", &worker);
            let (ok, out, err) = coord.finish(T);
            assert!(ok, "{name}, {topology}: failed:\n{err}");
            assert_eq!(
                out, want,
                "{name}, {topology}: speculative greedy text differs"
            );
            assert!(
                accepted(&err) > 0,
                "{name}, {topology}: no draft was accepted:\n{err}"
            );
        }
    }
}

/// `bench --speculative prompt-lookup --prompt-file`: the generation test generates after the
/// code prompt and reports what it drafted and kept, in the table's notes and in JSON.
#[test]
fn bench_reports_the_acceptance_of_speculative_generation() {
    let m = demo_model();
    let prompt = repo().join("tools/bench/code_edit_prompt.txt");
    let prompt = prompt.to_str().unwrap();
    let base = [
        "bench",
        "-m",
        &m,
        "-t",
        "1",
        "--no-warm",
        "-n",
        "48",
        "-r",
        "2",
        "--prompt-file",
        prompt,
        "--speculative",
        "prompt-lookup",
    ];
    let out = run_ok(&base);
    let line = out
        .lines()
        .find(|l| l.starts_with("tg48 speculative (prompt-lookup): drafted "))
        .unwrap_or_else(|| panic!("no acceptance line:\n{out}"));
    let numbers: Vec<f64> = line
        .split(|c: char| !c.is_ascii_digit() && c != '.')
        .filter(|w| !w.is_empty() && *w != ".")
        .filter_map(|w| w.parse().ok())
        .collect();
    // tg48, drafted, accepted, rate, repetitions.
    let (drafted, accepted, rate) = (numbers[1], numbers[2], numbers[3]);
    assert!(drafted > 0.0 && accepted <= drafted, "{line}");
    assert!((rate - 100.0 * accepted / drafted).abs() < 0.1, "{line}");
    assert!(line.ends_with("over 2 repetitions"), "{line}");

    let mut args = base.to_vec();
    args.push("--json");
    let json: serde_json::Value = serde_json::from_str(&run_ok(&args)).unwrap();
    assert_eq!(json["speculative"], "prompt-lookup", "{json}");
    let tg = json["tests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["test"] == "tg48")
        .unwrap_or_else(|| panic!("no tg48 in {json}"));
    let drafted = tg["drafted_tokens"].as_u64().unwrap();
    let accepted = tg["accepted_tokens"].as_u64().unwrap();
    assert!(drafted > 0 && accepted <= drafted, "{tg}");
    let rate = tg["acceptance_rate"].as_f64().unwrap();
    assert!(
        (rate - accepted as f64 / drafted as f64).abs() < 1e-9,
        "{tg}"
    );
    // Without drafts the generation test reports none.
    let plain = run_ok(&base[..base.len() - 2]);
    assert!(!plain.contains("speculative"), "{plain}");
}
