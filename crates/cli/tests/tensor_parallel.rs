//! Tensor/expert parallelism with real processes on 127.0.0.1: 2 and 3 ranks reproduce the
//! single node's greedy tokens and (nearly) its logits on every fixture architecture and on
//! SmolLM2 and its upcycled MoE; uneven expert shares; a killed rank fails the step within the
//! timeout, and a rank that comes back lets the request finish; refusals by name.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;

const T: Duration = Duration::from_secs(180);

fn rank(model: &str, coord: &str, extra: &[&str]) -> Proc {
    let mut args = vec![
        "worker",
        "--tensor-parallel",
        "-m",
        model,
        "--coordinator",
        coord,
        "--threads",
        "1",
        "--kv-type",
        "f32",
        "--no-warm",
    ];
    args.extend_from_slice(extra);
    Proc::spawn("rank", &args)
}

/// Runs a coordinator command with `--tensor-parallel --tp-size n` and `n - 1` ranks.
fn with_group(
    args: &[&str],
    model: &str,
    n: usize,
    rank_extra: &[&str],
) -> (bool, String, String, Vec<u64>) {
    let n_s = n.to_string();
    let mut full = args.to_vec();
    full.extend_from_slice(&[
        "--tensor-parallel",
        "--tp-size",
        &n_s,
        "--listen",
        "127.0.0.1:0",
        "--insecure",
        "--threads",
        "1",
        "--kv-type",
        "f32",
        "--no-warm",
    ]);
    let coord = Proc::spawn("tp coordinator", &full);
    let addr = format!("127.0.0.1:{}", coord.coordinator_port());
    let mut extra = vec!["--insecure"];
    extra.extend_from_slice(rank_extra);
    let ranks: Vec<Proc> = (1..n).map(|_| rank(model, &addr, &extra)).collect();
    // Peak memory of each rank while the group works (VmHWM), for the record.
    let (ok, out, err) = coord.finish(T);
    let rss = ranks.iter().map(|p| vm_hwm_kib(p.child.id())).collect();
    (ok, out, err, rss)
}

fn vm_hwm_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn logits_single(model: &str, tokens: &str, out: &Path) -> Vec<f32> {
    run_ok(&[
        "logits",
        "-m",
        model,
        "--tokens",
        tokens,
        "--out",
        out.to_str().unwrap(),
        "--kv-type",
        "f32",
        "--no-warm",
    ]);
    read_npy_f32(out).1
}

/// `logits` of `tokens` on a group of `n` (coordinator flags `extra`) written to `out`; the
/// largest difference from `single`.
fn group_logits_diff(
    model: &str,
    tokens: &str,
    single: &[f32],
    n: usize,
    extra: &[&str],
    out: &Path,
) -> f32 {
    let mut args = vec![
        "logits",
        "-m",
        model,
        "--tokens",
        tokens,
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let (ok, _, err, _) = with_group(&args, model, n, &[]);
    assert!(ok, "{model} on {n} ranks {extra:?}: logits failed:\n{err}");
    read_npy_f32(out)
        .1
        .iter()
        .zip(single)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
}

#[test]
fn two_and_three_ranks_match_single_node_on_every_fixture() {
    let dir = tempfile::tempdir().unwrap();
    // deepseek2 has 6 query heads (split 3+3 and 2+2+2 over one latent cache every rank keeps
    // whole), deepseek2-lite 4 (split over 2 ranks, computed by rank 0 alone over 3), glm4moe 2
    // kv heads (split over 2, replicated over 3).
    for fx in [
        "qwen3moe",
        "qwen2moe",
        "mixtral",
        "olmoe",
        "llama",
        "deepseek2",
        "deepseek2-lite",
        "glm4moe",
        "gpt-oss",
    ] {
        let m = fixture(fx, "model-f32.gguf");
        let m = m.to_str().unwrap();
        let toks = fixture_tokens(fx);
        let single = logits_single(m, &toks, &dir.path().join(format!("{fx}.npy")));
        let greedy = run_ok(&[
            "run",
            "-m",
            m,
            "-p",
            "The",
            "-n",
            "64",
            "--temp",
            "0",
            "--ignore-eos",
            "--kv-type",
            "f32",
            "--no-warm",
        ]);
        for n in [2, 3] {
            let out = dir.path().join(format!("{fx}-{n}.npy"));
            let d = group_logits_diff(m, &toks, &single, n, &[], &out);
            eprintln!("{fx}: {n} ranks, max |Δlogit| vs single node = {d:e}");
            assert!(d <= 1e-5, "{fx} {n} ranks: logits differ by {d}");
            let (ok, out, err, _) = with_group(
                &[
                    "run",
                    "-m",
                    m,
                    "-p",
                    "The",
                    "-n",
                    "64",
                    "--temp",
                    "0",
                    "--ignore-eos",
                ],
                m,
                n,
                &[],
            );
            assert!(ok, "{fx} {n} ranks run failed:\n{err}");
            assert_eq!(out, greedy, "{fx} {n} ranks: greedy tokens differ");
        }
    }
}

/// `--gpu` on a rank (the worker, and rank 0 through the coordinator's flags): its routed
/// experts go to its GPU and run there, everything else on its CPU. Where a GPU opens, the
/// group's logits are the single node's to GPU rounding and its greedy text the same; where
/// none does (CI), the coordinator and the worker stop at once with an error that names the
/// GPU and why. Flags a rank cannot use are refused before it connects.
#[test]
fn a_rank_with_a_gpu_runs_its_experts_there() {
    let dir = tempfile::tempdir().unwrap();
    let m = fixture("qwen3moe", "model-f32.gguf");
    let m = m.to_str().unwrap();
    let toks = fixture_tokens("qwen3moe");
    let single = logits_single(m, &toks, &dir.path().join("single.npy"));
    let out = dir.path().join("group.npy");
    let out_s = out.to_str().unwrap();
    let logits = [
        "logits", "-m", m, "--tokens", &toks, "--out", out_s, "--gpu",
    ];
    let no_gpu = |what: &str, ok: bool, err: &str| {
        assert!(
            !ok && err.contains("--gpu 0") && err.contains("no CUDA here"),
            "{what} without a GPU: the error names the GPU:\n{err}"
        );
    };
    // A worker with `flags` and no coordinator to reach: whether it succeeded, its stderr.
    let lone_worker = |flags: &[&str]| {
        let extra: Vec<&str> = ["--insecure"].iter().chain(flags).copied().collect();
        let (ok, _, err) = rank(m, "127.0.0.1:9", &extra).finish(T);
        (ok, err)
    };
    // Whether this machine has a GPU: a single node's answer.
    let (gpu_here, _, err) = Proc::spawn("single node", &logits).finish(T);
    if gpu_here {
        let (ok, _, err, _) = with_group(&logits, m, 2, &["--gpu"]);
        assert!(ok, "2 ranks with GPUs: logits failed:\n{err}");
        let d = read_npy_f32(&out)
            .1
            .iter()
            .zip(&single)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!("2 ranks with GPUs: max |Δlogit| vs single node = {d:e}");
        assert!(d <= 1e-3, "2 ranks with GPUs: logits differ by {d}");
        let run = [
            "run",
            "-m",
            m,
            "-p",
            "The",
            "-n",
            "32",
            "--temp",
            "0",
            "--ignore-eos",
        ];
        let mut single_run = run.to_vec();
        single_run.extend_from_slice(&["--kv-type", "f32", "--no-warm"]);
        let greedy = run_ok(&single_run);
        let mut gpu_run = run.to_vec();
        gpu_run.push("--gpu");
        let (ok, text, err, _) = with_group(&gpu_run, m, 2, &["--gpu"]);
        assert!(ok, "2 ranks with GPUs: run failed:\n{err}");
        assert_eq!(text, greedy, "2 ranks with GPUs: greedy tokens differ");
    } else {
        no_gpu("a single node", gpu_here, &err);
        let mut coord = logits.to_vec();
        coord.extend_from_slice(&[
            "--tensor-parallel",
            "--tp-size",
            "2",
            "--listen",
            "127.0.0.1:0",
            "--insecure",
        ]);
        let (ok, _, err) = Proc::spawn("tp coordinator", &coord).finish(T);
        no_gpu("rank 0", ok, &err);
        let (ok, err) = lone_worker(&["--gpu"]);
        no_gpu("a worker", ok, &err);
    }
    // Refused by name, before the rank connects anywhere.
    for (flags, says) in [
        (&["--gpu", "--ssd-streaming"][..], "--ssd-streaming"),
        (&["--gpu", "--gpu-piecewise"][..], "--gpu-piecewise"),
    ] {
        let (ok, err) = lone_worker(flags);
        assert!(!ok && err.contains(says), "{flags:?}:\n{err}");
    }
}

#[test]
fn smollm2_and_its_upcycled_moe_with_uneven_expert_shares() {
    let dir = tempfile::tempdir().unwrap();
    let m = smollm2();
    let m = m.to_str().unwrap();
    let moe = dir.path().join("moe.gguf");
    let moe_s = moe.to_str().unwrap();
    run_ok(&["upcycle", m, moe_s, "--experts", "4"]);
    let prompt = "The capital of Germany is";
    for (model, name) in [(m, "SmolLM2"), (moe_s, "SmolLM2 upcycled")] {
        let want = run_ok(&[
            "run",
            "-m",
            model,
            "-p",
            prompt,
            "-n",
            "64",
            "--temp",
            "0",
            "--kv-type",
            "f32",
            "--no-warm",
        ]);
        for (n, weights) in [(2, ""), (3, ""), (2, "2,1")] {
            let mut args = vec![
                "run", "-m", model, "-p", prompt, "-n", "64", "--temp", "0", "--stats",
            ];
            if !weights.is_empty() {
                args.extend_from_slice(&["--expert-weights", weights]);
            }
            let (ok, out, err, rss) = with_group(&args, model, n, &[]);
            assert!(ok, "{name} {n} ranks {weights}: failed:\n{err}");
            assert_eq!(out, want, "{name} {n} ranks {weights}: greedy text differs");
            let stat = |k: &str| {
                err.lines()
                    .find(|l| l.starts_with(k))
                    .unwrap_or("")
                    .to_string()
            };
            eprintln!(
                "{name}: {n} ranks {weights:>3}: rank peak RSS {rss:?} KiB; {} {}",
                stat("tp_exchanges_per_step"),
                stat("tp_exchange_mean_us")
            );
        }
    }
}

#[test]
fn balanced_expert_placement_matches_single_node() {
    // Every step's experts dealt out afresh (--tp-balance-experts): the expert sum is f64, so
    // who computes which expert must not change a bit.
    let dir = tempfile::tempdir().unwrap();
    for fx in ["qwen3moe", "olmoe", "mixtral", "gpt-oss"] {
        let m = fixture(fx, "model-f32.gguf");
        let m = m.to_str().unwrap();
        let toks = fixture_tokens(fx);
        let single = logits_single(m, &toks, &dir.path().join(format!("{fx}.npy")));
        for (n, weights) in [(2, "1,1"), (3, "2,1,1")] {
            let out = dir.path().join(format!("{fx}-balanced-{n}.npy"));
            let extra = ["--tp-balance-experts", "--expert-weights", weights];
            let d = group_logits_diff(m, &toks, &single, n, &extra, &out);
            eprintln!("{fx}: {n} balanced ranks, max |Δlogit| vs single node = {d:e}");
            assert_eq!(d, 0.0, "{fx} {n} balanced ranks: logits differ by {d}");
        }
    }
    // Streaming ranks stream the experts they own; balance would make them read every expert.
    let m = fixture("qwen3moe", "model-f32.gguf");
    let out = std::process::Command::new(bin())
        .args([
            "logits",
            "-m",
            m.to_str().unwrap(),
            "--tokens",
            "1,2,3",
            "--out",
            dir.path().join("x.npy").to_str().unwrap(),
            "--tensor-parallel",
            "--listen",
            "127.0.0.1:0",
            "--insecure",
            "--tp-balance-experts",
            "--ssd-streaming",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("--tp-balance-experts needs resident experts"),
        "{err}"
    );
}

#[test]
fn placement_planned_from_a_routing_profile_matches_single_node() {
    // A profile recorded on a real prompt, a placement with replicas of the hottest experts
    // (dealt out per step between their holders), resident and streaming ranks: the expert
    // sum is f64, so the placement must not change a bit.
    let dir = tempfile::tempdir().unwrap();
    for fx in ["qwen3moe", "olmoe"] {
        let m = fixture(fx, "model-f32.gguf");
        let m = m.to_str().unwrap();
        let profile = dir.path().join(format!("{fx}.profile"));
        run_ok(&[
            "run",
            "-m",
            m,
            "-p",
            "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
            "-n",
            "32",
            "--temp",
            "0",
            "--ignore-eos",
            "--ssd-streaming",
            "--save-expert-profile",
            profile.to_str().unwrap(),
            "--no-warm",
        ]);
        let toks = fixture_tokens(fx);
        let single = logits_single(m, &toks, &dir.path().join(format!("{fx}.npy")));
        // Replicas are whole experts per layer: 100 % of the smallest rank's one expert is one.
        for (n, weights, replicas) in [(2, "1,1", "50%"), (3, "2,1,1", "100%"), (2, "1,1", "0%")] {
            let plan = dir.path().join(format!("{fx}-{n}-{replicas}.placement"));
            let report = run_ok(&[
                "plan",
                "-m",
                m,
                "--expert-profile",
                profile.to_str().unwrap(),
                "--tp-size",
                &n.to_string(),
                "--expert-weights",
                weights,
                "--expert-replicas",
                replicas,
                "-o",
                plan.to_str().unwrap(),
            ]);
            eprintln!("{fx} {n} ranks {weights} {replicas}:\n{report}");
            assert!(report.contains("this placement:"), "{report}");
            let text = std::fs::read_to_string(&plan).unwrap();
            let replicated = text
                .lines()
                .filter(|l| l.split_whitespace().nth(2).is_some_and(|r| r.contains(',')))
                .count();
            assert_eq!(
                replicated > 0,
                replicas != "0%",
                "{fx}: {replicated} replicated"
            );
            let extra = ["--expert-placement", plan.to_str().unwrap()];
            let out = dir.path().join(format!("{fx}-placed-{n}.npy"));
            let d = group_logits_diff(m, &toks, &single, n, &extra, &out);
            eprintln!("{fx}: {n} placed ranks, max |Δlogit| vs single node = {d:e}");
            assert_eq!(d, 0.0, "{fx} {n} placed ranks: logits differ by {d}");
        }
        // Streaming ranks read exactly the experts the placement gives them.
        let plan = dir.path().join(format!("{fx}-2-50%.placement"));
        let mut args = vec![
            "logits",
            "-m",
            m,
            "--tokens",
            &toks,
            "--expert-placement",
            plan.to_str().unwrap(),
            "--ssd-streaming",
            "--expert-cache",
            "2",
        ];
        let out = dir.path().join(format!("{fx}-placed-streaming.npy"));
        let out_s = out.to_str().unwrap().to_string();
        args.extend_from_slice(&["--out", &out_s]);
        let (ok, _, err, _) = with_group(&args, m, 2, &["--ssd-streaming", "--expert-cache", "2"]);
        assert!(ok, "{fx} placed streaming ranks failed:\n{err}");
        let got = read_npy_f32(&out).1;
        assert_eq!(
            got, single,
            "{fx}: placed streaming ranks differ from single node"
        );
    }
    // A placement for another group size, or with weights of its own, is refused by name.
    let m = fixture("qwen3moe", "model-f32.gguf");
    let plan = dir.path().join("qwen3moe-2-50%.placement");
    for (flags, want) in [
        (
            vec!["--tp-size", "3"],
            "made for 2 ranks, the group has --tp-size 3",
        ),
        (
            vec!["--expert-weights", "2,1"],
            "leave out --tp-balance-experts and --expert-weights",
        ),
    ] {
        let mut args = vec![
            "logits".to_string(),
            "-m".into(),
            m.to_str().unwrap().into(),
            "--tokens".into(),
            "1,2,3".into(),
            "--out".into(),
            dir.path().join("x.npy").to_str().unwrap().into(),
            "--tensor-parallel".into(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--insecure".into(),
            "--expert-placement".into(),
            plan.to_str().unwrap().into(),
        ];
        args.extend(flags.iter().map(|f| f.to_string()));
        let out = std::process::Command::new(bin())
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        assert!(err.contains(want), "wanted {want:?} in:\n{err}");
    }
}

#[test]
fn a_killed_rank_fails_the_step_in_time_and_a_returning_rank_completes_it() {
    let m = smollm2();
    let m = m.to_str().unwrap();
    let prompt = "Once upon a time, in a small village,";
    let want = run_ok(&[
        "run",
        "-m",
        m,
        "-p",
        prompt,
        "-n",
        "48",
        "--temp",
        "0",
        "--kv-type",
        "f32",
        "--no-warm",
    ]);
    // A rank that comes back within --route-wait: the request completes with the same tokens.
    let mut coord = Proc::spawn(
        "tp coordinator",
        &[
            "run",
            "-m",
            m,
            "-p",
            prompt,
            "-n",
            "48",
            "--temp",
            "0",
            "--tensor-parallel",
            "--tp-size",
            "2",
            "--listen",
            "127.0.0.1:0",
            "--insecure",
            "--threads",
            "1",
            "--kv-type",
            "f32",
            "--no-warm",
            "--tp-timeout",
            "3",
            "--route-wait",
            "60",
        ],
    );
    let addr = format!("127.0.0.1:{}", coord.coordinator_port());
    let mut r = rank(m, &addr, &["--insecure"]);
    let t0 = Instant::now();
    while coord.poll_stdout().len() < prompt.len() + 12 {
        assert!(t0.elapsed() < T, "no output:\n{}", coord.stderr_text());
        std::thread::sleep(Duration::from_millis(5));
    }
    r.kill9();
    std::thread::sleep(Duration::from_millis(500));
    let _r2 = rank(m, &addr, &["--insecure"]);
    let (ok, out, err) = coord.finish(T);
    assert!(
        ok,
        "the request must complete after the rank returns:\n{err}"
    );
    assert!(
        err.contains("replaying session"),
        "expected a replay:\n{err}"
    );
    assert_eq!(out, want);
    // A rank that never comes back: a clear error within the timeouts.
    let mut coord = Proc::spawn(
        "tp coordinator",
        &[
            "run",
            "-m",
            m,
            "-p",
            prompt,
            "-n",
            "200",
            "--temp",
            "0",
            "--tensor-parallel",
            "--tp-size",
            "2",
            "--listen",
            "127.0.0.1:0",
            "--insecure",
            "--threads",
            "1",
            "--no-warm",
            "--tp-timeout",
            "2",
            "--route-wait",
            "4",
        ],
    );
    let addr = format!("127.0.0.1:{}", coord.coordinator_port());
    let mut r = rank(m, &addr, &["--insecure"]);
    let t0 = Instant::now();
    while coord.poll_stdout().len() < prompt.len() + 12 {
        assert!(t0.elapsed() < T, "no output:\n{}", coord.stderr_text());
        std::thread::sleep(Duration::from_millis(5));
    }
    r.kill9();
    let killed = Instant::now();
    let (ok, _, err) = coord.finish(T);
    assert!(!ok, "the request must fail without the rank");
    assert!(
        killed.elapsed() < Duration::from_secs(20),
        "failing took {:?}",
        killed.elapsed()
    );
    assert!(
        err.contains("rank 1"),
        "the error must name the rank:\n{err}"
    );
}

#[test]
fn wrong_model_key_and_version_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let m = smollm2();
    let m = m.to_str().unwrap();
    // Keys as users make them: `moeshard keygen` (32 random bytes, mode 0600).
    let key = dir.path().join("key");
    let wrong = dir.path().join("wrong");
    for k in [&key, &wrong] {
        run_ok(&["keygen", k.to_str().unwrap()]);
        let meta = std::fs::metadata(k).unwrap();
        assert_eq!(meta.len(), 32);
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    }
    let (ok, _, err) = Proc::spawn("keygen again", &["keygen", key.to_str().unwrap()]).finish(T);
    assert!(
        !ok && err.contains("exists"),
        "keygen must not overwrite a key:\n{err}"
    );
    let short = dir.path().join("short");
    std::fs::write(&short, [7u8; 31]).unwrap();
    let (k, w) = (key.to_str().unwrap(), wrong.to_str().unwrap());
    let other = fixture("llama", "model-f32.gguf");
    let coord = Proc::spawn(
        "tp coordinator",
        &[
            "run",
            "-m",
            m,
            "-p",
            "Hello",
            "-n",
            "4",
            "--temp",
            "0",
            "--tensor-parallel",
            "--tp-size",
            "2",
            "--listen",
            "127.0.0.1:0",
            "--cluster-key-file",
            k,
            "--no-warm",
            "--route-wait",
            "60",
        ],
    );
    let addr = format!("127.0.0.1:{}", coord.coordinator_port());
    let refused = |model: &str, extra: &[&str], reason: &str| {
        let mut args = vec![
            "worker",
            "--tensor-parallel",
            "-m",
            model,
            "--coordinator",
            &addr,
            "--no-warm",
        ];
        args.extend_from_slice(extra);
        let (ok, _, err) = Proc::spawn("rank", &args).finish(T);
        assert!(!ok);
        assert!(err.contains(reason), "expected {reason:?}:\n{err}");
    };
    refused(
        other.to_str().unwrap(),
        &["--cluster-key-file", k],
        "different model",
    );
    refused(m, &["--cluster-key-file", w], "different cluster key");
    refused(
        m,
        &["--cluster-key-file", short.to_str().unwrap()],
        "at least 32",
    );
    refused(m, &["--cluster-key-file", k, "--rank", "5"], "outside");
    {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        let mut h = b"MSHD".to_vec();
        h.extend_from_slice(&7u16.to_le_bytes());
        h.extend_from_slice(&[1, 0, 0, 0, 0, 0]);
        h.extend_from_slice(&[0u8; 16]);
        s.write_all(&h).unwrap();
        let mut reply = Vec::new();
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = s.read_to_end(&mut reply);
        assert!(
            String::from_utf8_lossy(&reply).contains("version"),
            "version refusal"
        );
    }
    let _good = rank(m, &addr, &["--cluster-key-file", k]);
    let (ok, _, err) = coord.finish(T);
    assert!(ok, "the group must work after the refusals:\n{err}");
}

/// Streaming inside the group: every rank streams only the experts it owns (here through a cache
/// of a single slot) and the logits stay those of a resident single node.
#[test]
fn ranks_streaming_their_own_experts_match_single_node() {
    let dir = tempfile::tempdir().unwrap();
    for fx in ["qwen3moe", "mixtral"] {
        let m = fixture(fx, "model-q8_0.gguf");
        let m = m.to_str().unwrap();
        let toks = fixture_tokens(fx);
        let single = logits_single(m, &toks, &dir.path().join(format!("{fx}.npy")));
        let out = dir.path().join(format!("{fx}-tp.npy"));
        let stream = ["--ssd-streaming", "--expert-cache", "1"];
        let mut args = vec![
            "logits",
            "-m",
            m,
            "--tokens",
            &toks,
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(&stream);
        let (ok, _, err, _) = with_group(&args, m, 2, &stream);
        assert!(ok, "{fx}: streaming group failed:\n{err}");
        assert!(
            err.contains("streaming experts"),
            "{fx}: the coordinator must stream:\n{err}"
        );
        let tp = read_npy_f32(&out).1;
        assert!(
            tp.iter()
                .zip(&single)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{fx}: logits differ"
        );
    }
}

/// Snapshots are topology-free across tensor parallel too: a session saved by a 3-rank group
/// (SmolLM2's 3 kv heads split one per rank, merged back on save) continues on a single node
/// with the single node's greedy tokens, and one saved on a single node continues on the group
/// (split again on restore).
#[test]
fn a_snapshot_moves_between_a_group_and_a_single_node() {
    let dir = tempfile::tempdir().unwrap();
    let m = smollm2();
    let m = m.to_str().unwrap();
    let prompt = "The three primary colors are";
    let single = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "-m",
            m,
            "--temp",
            "0",
            "--kv-type",
            "f32",
            "--no-warm",
        ];
        args.extend_from_slice(extra);
        run_ok(&args)
    };
    let want = single(&["-p", prompt, "-n", "16"]);
    let want = want.trim_end().strip_prefix(prompt).unwrap().trim_end();
    let from_group = dir.path().join("group.snap");
    let from_group = from_group.to_str().unwrap();
    let (ok, _, err, _) = with_group(
        &[
            "run",
            "-m",
            m,
            "-p",
            prompt,
            "-n",
            "0",
            "--save-snapshot",
            from_group,
        ],
        m,
        3,
        &[],
    );
    assert!(ok, "saving on the group failed:\n{err}");
    let out = single(&["-n", "16", "--load-snapshot", from_group]);
    assert_eq!(out.trim_end(), want, "group snapshot continued on one node");
    let from_single = dir.path().join("single.snap");
    let from_single = from_single.to_str().unwrap();
    single(&["-p", prompt, "-n", "0", "--save-snapshot", from_single]);
    let (ok, out, err, _) = with_group(
        &[
            "run",
            "-m",
            m,
            "-n",
            "16",
            "--temp",
            "0",
            "--load-snapshot",
            from_single,
        ],
        m,
        3,
        &[],
    );
    assert!(ok, "loading on the group failed:\n{err}");
    assert_eq!(
        out.trim_end(),
        want,
        "single-node snapshot continued on the group"
    );
}

/// A latent-attention session saved on a 3-rank group (heads split, each rank holding the whole
/// latent cache; the snapshot takes rank 0's) continues on one node with its greedy tokens, and
/// one saved on a single node continues on a 2-rank group.
#[test]
fn an_mla_snapshot_moves_between_a_group_and_a_single_node() {
    let m = fixture("deepseek2", "model-f32.gguf");
    snapshot_moves_between_a_group_and_a_single_node(m.to_str().unwrap(), "The ferry", 3, 2);
}

/// gpt-oss: the snapshot holds only the latest 7 positions (window − 1) of each sliding layer,
/// from a prompt long enough that the sliding layers dropped positions; saved on 2 ranks (kv
/// heads split, merged by the layer's length) it continues on one node, and one saved on a
/// single node continues on 3 ranks (kv heads replicated), both with the single node's greedy
/// tokens.
#[test]
fn a_sliding_window_snapshot_moves_between_a_group_and_a_single_node() {
    let m = fixture("gpt-oss", "model-f32.gguf");
    let prompt = "The ferry left the harbour at dawn with farmers, their carts, two goats and a brass band that played until the island came into view";
    snapshot_moves_between_a_group_and_a_single_node(m.to_str().unwrap(), prompt, 2, 3);
}

/// Saves `prompt` on a group of `save_ranks` and continues it on one node, then the reverse
/// onto `load_ranks`: both give the single node's 16 greedy tokens.
fn snapshot_moves_between_a_group_and_a_single_node(
    m: &str,
    prompt: &str,
    save_ranks: usize,
    load_ranks: usize,
) {
    let dir = tempfile::tempdir().unwrap();
    let single = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "-m",
            m,
            "--temp",
            "0",
            "--kv-type",
            "f32",
            "--no-warm",
        ];
        args.extend_from_slice(extra);
        run_ok(&args)
    };
    let want = single(&["-p", prompt, "-n", "16"]);
    let want = want.trim_end().strip_prefix(prompt).unwrap().trim_end();
    let from_group = dir.path().join("group.snap");
    let from_group = from_group.to_str().unwrap();
    let save = [
        "run",
        "-m",
        m,
        "-p",
        prompt,
        "-n",
        "0",
        "--save-snapshot",
        from_group,
    ];
    let (ok, _, err, _) = with_group(&save, m, save_ranks, &[]);
    assert!(ok, "saving on the group failed:\n{err}");
    let out = single(&["-n", "16", "--load-snapshot", from_group]);
    assert_eq!(out.trim_end(), want, "group snapshot continued on one node");
    let from_single = dir.path().join("single.snap");
    let from_single = from_single.to_str().unwrap();
    single(&["-p", prompt, "-n", "0", "--save-snapshot", from_single]);
    let load = [
        "run",
        "-m",
        m,
        "-n",
        "16",
        "--temp",
        "0",
        "--load-snapshot",
        from_single,
    ];
    let (ok, out, err, _) = with_group(&load, m, load_ranks, &[]);
    assert!(ok, "loading on the group failed:\n{err}");
    assert_eq!(
        out.trim_end(),
        want,
        "single-node snapshot continued on the group"
    );
}

/// `moeshard serve` as rank 0 of a 2-rank group: `/v1/status` (the web page's cluster view)
/// lists both ranks with their addresses and, after a completion, rank 0's last step.
#[test]
fn served_group_is_described_by_the_status_endpoint() {
    let m = common::fixture("qwen3moe", "model-q8_0.gguf");
    let m = m.to_str().unwrap();
    let coord = Proc::spawn(
        "tp serve",
        &[
            "serve",
            "-m",
            m,
            "--port",
            "0",
            "--tensor-parallel",
            "--tp-size",
            "2",
            "--listen",
            "127.0.0.1:0",
            "--insecure",
            "--threads",
            "1",
            "--no-warm",
        ],
    );
    let addr = format!("127.0.0.1:{}", coord.coordinator_port());
    let _rank = rank(m, &addr, &["--insecure"]);
    let line = coord.wait_for_stderr("listening on http://", T);
    let http_addr = line
        .rsplit("http://")
        .next()
        .and_then(|s| s.split_whitespace().next())
        .unwrap()
        .to_string();
    let body = serde_json::json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0});
    let (code, text) = common::http::http(
        &http_addr,
        "POST",
        "/v1/completions",
        Some(&body.to_string()),
        &[],
    );
    assert_eq!(code, 200, "{text}");
    let t0 = Instant::now();
    let view = loop {
        let (code, text) = common::http::http(&http_addr, "GET", "/v1/status", None, &[]);
        assert_eq!(code, 200, "{text}");
        let s: serde_json::Value = serde_json::from_str(&text).unwrap();
        if !s["cluster"]["tp_step"].is_null() {
            break s["cluster"].clone();
        }
        assert!(t0.elapsed() < T, "no step in /v1/status: {s}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(view["kind"], "tensor_parallel", "{view}");
    assert_eq!(view["complete"], true, "{view}");
    let nodes = view["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 2, "{view}");
    assert_eq!(
        (&nodes[0]["role"], &nodes[0]["rank"]),
        (&"coordinator".into(), &0.into())
    );
    assert_eq!(
        (&nodes[1]["role"], &nodes[1]["rank"]),
        (&"rank".into(), &1.into())
    );
    assert!(
        nodes[1]["address"]
            .as_str()
            .is_some_and(|a| a.starts_with("127.0.0.1:"))
    );
    assert!(view["tp_step"]["exchanges"].as_u64().unwrap() > 0, "{view}");
}
