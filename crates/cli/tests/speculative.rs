//! Speculative decoding by prompt lookup keeps greedy output exactly the non-speculative one,
//! on a single node (dense, MoE, sliding-window attention), in a pipeline and in a
//! tensor-parallel group, while actually accepting drafts.

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

#[test]
fn greedy_speculative_output_is_the_plain_output_in_a_pipeline_and_a_group() {
    let m = demo_model();
    let (prompt, n) = ("ROMEO:", "120");
    let want = run_ok(&greedy_args(&m, prompt, n));

    // Two stages.
    let mut args = greedy_args(&m, prompt, n);
    args.extend_from_slice(&SPECULATIVE);
    args.extend_from_slice(&["--layers", "0:2", "--listen", "127.0.0.1:0", "--insecure"]);
    let coord = Proc::spawn("pipeline coordinator", &args);
    let addr = format!("127.0.0.1:{}", coord.coordinator_port());
    let _worker = Proc::spawn(
        "worker 3:output",
        &[
            "worker",
            "-m",
            &m,
            "--layers",
            "3:output",
            "--coordinator",
            &addr,
            "--kv-type",
            "f32",
            "--no-warm",
            "--insecure",
        ],
    );
    let (ok, out, err) = coord.finish(T);
    assert!(ok, "pipeline failed:\n{err}");
    assert_eq!(out, want, "2-stage speculative greedy text differs");
    assert!(accepted(&err) > 0, "the pipeline accepted no draft:\n{err}");

    // Two tensor-parallel ranks.
    let mut args = greedy_args(&m, prompt, n);
    args.extend_from_slice(&SPECULATIVE);
    args.extend_from_slice(&[
        "--tensor-parallel",
        "--tp-size",
        "2",
        "--listen",
        "127.0.0.1:0",
        "--insecure",
    ]);
    let coord = Proc::spawn("tp coordinator", &args);
    let addr = format!("127.0.0.1:{}", coord.coordinator_port());
    let _rank = Proc::spawn(
        "rank",
        &[
            "worker",
            "--tensor-parallel",
            "-m",
            &m,
            "--coordinator",
            &addr,
            "--kv-type",
            "f32",
            "--no-warm",
            "--insecure",
        ],
    );
    let (ok, out, err) = coord.finish(T);
    assert!(ok, "tensor-parallel group failed:\n{err}");
    assert_eq!(out, want, "2-rank speculative greedy text differs");
    assert!(accepted(&err) > 0, "the group accepted no draft:\n{err}");
}
