//! Pipeline parallelism with real processes on 127.0.0.1: bit-identical logits, wire formats,
//! recovery from a killed worker, refusals, and snapshots across splits.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;

const T: Duration = Duration::from_secs(120);

fn key_file(dir: &Path, name: &str, key: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, key).unwrap();
    p.to_string_lossy().into_owned()
}

/// Starts a coordinator command (`logits`, `run`, ...) listening on an OS-chosen port.
fn coordinator(name: &str, args: &[&str]) -> (Proc, String) {
    let mut full = args.to_vec();
    full.extend_from_slice(&["--listen", "127.0.0.1:0"]);
    let p = Proc::spawn(name, &full);
    let addr = format!("127.0.0.1:{}", p.coordinator_port());
    (p, addr)
}

fn worker(model: &str, layers: &str, coord: &str, extra: &[&str]) -> Proc {
    let mut args = vec![
        "worker",
        "-m",
        model,
        "--layers",
        layers,
        "--coordinator",
        coord,
        "--threads",
        "1",
        "--kv-type",
        "f32",
        "--no-warm",
    ];
    args.extend_from_slice(extra);
    Proc::spawn(&format!("worker {layers}"), &args)
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
        "--threads",
        "2",
        "--no-warm",
    ]);
    read_npy_f32(out).1
}

fn logits_pipeline(
    model: &str,
    tokens: &str,
    out: &Path,
    splits: &[&str],
    extra: &[&str],
) -> Vec<f32> {
    let mut args = vec![
        "logits",
        "-m",
        model,
        "--tokens",
        tokens,
        "--out",
        out.to_str().unwrap(),
        "--kv-type",
        "f32",
        "--threads",
        "1",
        "--no-warm",
        "--insecure",
        "--layers",
        splits[0],
    ];
    args.extend_from_slice(extra);
    let (coord, addr) = coordinator("coordinator", &args);
    let _workers: Vec<Proc> = splits[1..]
        .iter()
        .map(|s| worker(model, s, &addr, &["--insecure"]))
        .collect();
    let (ok, _, err) = coord.finish(T);
    assert!(ok, "pipeline logits failed:\n{err}");
    read_npy_f32(out).1
}

const PROMPT_TOKENS: &str =
    "1,504,3575,282,4521,314,30,1062,3575,282,4468,314,7042,30,378,2671,282,260,1458,3600,314";

#[test]
fn two_and_three_stage_logits_are_bit_identical_to_single_node() {
    let dir = tempfile::tempdir().unwrap();
    let m = smollm2();
    let m = m.to_str().unwrap();
    let single = logits_single(m, PROMPT_TOKENS, &dir.path().join("single.npy"));
    // Small chunks and a window so the prefill really is pipelined.
    let two = logits_pipeline(
        m,
        PROMPT_TOKENS,
        &dir.path().join("two.npy"),
        &["0:14", "15:output"],
        &["--dist-prefill-chunk", "4", "--dist-prefill-window", "3"],
    );
    let three = logits_pipeline(
        m,
        PROMPT_TOKENS,
        &dir.path().join("three.npy"),
        &["0:9", "10:19", "20:output"],
        &["--dist-prefill-chunk", "5", "--dist-prefill-window", "2"],
    );
    for (name, got) in [("2 stages", &two), ("3 stages", &three)] {
        assert_eq!(got.len(), single.len(), "{name}");
        let differing = got
            .iter()
            .zip(&single)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differing, 0,
            "{name}: {differing} logits differ from single node"
        );
    }
}

#[test]
fn compressed_activations_stay_close() {
    let dir = tempfile::tempdir().unwrap();
    let m = smollm2();
    let m = m.to_str().unwrap();
    let single = logits_single(m, PROMPT_TOKENS, &dir.path().join("single.npy"));
    let n_vocab = 49152;
    for bits in ["16", "8"] {
        let got = logits_pipeline(
            m,
            PROMPT_TOKENS,
            &dir.path().join(format!("b{bits}.npy")),
            &["0:14", "15:output"],
            &["--dist-activation-bits", bits],
        );
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
            "{bits}-bit activations: max |Δlogit| {max_err:.4}, top-1 agreement {agree}/{rows}"
        );
        // SmolLM2's Q4_1 weights re-quantize activations to Q8_0, so a rounded hidden state can
        // flip an int8 rounding and move logits by more than the wire rounding itself.
        assert!(max_err < 3.0, "{bits}-bit: max logit error {max_err}");
        assert!(
            agree + 1 >= rows,
            "{bits}-bit: top-1 agreement only {agree}/{rows}"
        );
    }
}

fn greedy_single(m: &str, prompt: &str, n: &str) -> String {
    run_ok(&[
        "run",
        "-m",
        m,
        "-p",
        prompt,
        "-n",
        n,
        "--temp",
        "0",
        "--kv-type",
        "f32",
        "--threads",
        "2",
        "--no-warm",
    ])
}

#[test]
fn a_killed_worker_is_replaced_and_the_request_finishes_identically() {
    let m = smollm2();
    let m = m.to_str().unwrap();
    let prompt = "Once upon a time, in a small village,";
    let want = greedy_single(m, prompt, "48");
    let (mut coord, addr) = coordinator(
        "coordinator",
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
            "--kv-type",
            "f32",
            "--threads",
            "1",
            "--no-warm",
            "--insecure",
            "--layers",
            "0:14",
            "--route-wait",
            "60",
        ],
    );
    let mut w = worker(m, "15:output", &addr, &["--insecure"]);
    // Wait for some generated text, then kill the worker mid-generation.
    let t0 = Instant::now();
    while coord.poll_stdout().len() < prompt.len() + 12 {
        assert!(
            t0.elapsed() < T,
            "no output; stderr:\n{}",
            coord.stderr_text()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    w.kill9();
    std::thread::sleep(Duration::from_millis(300));
    let _w2 = worker(m, "15:output", &addr, &["--insecure"]);
    let (ok, out, err) = coord.finish(T);
    assert!(ok, "coordinator failed:\n{err}");
    assert!(
        err.contains("replaying session"),
        "expected a replay:\n{err}"
    );
    assert_eq!(
        out, want,
        "the recovered request must produce the undisturbed tokens"
    );
}

#[test]
fn without_a_worker_the_request_fails_within_route_wait() {
    let m = smollm2();
    let m = m.to_str().unwrap();
    let t0 = Instant::now();
    let (coord, _addr) = coordinator(
        "coordinator",
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
            "--no-warm",
            "--insecure",
            "--layers",
            "0:14",
            "--route-wait",
            "2",
        ],
    );
    let (ok, _, err) = coord.finish(T);
    assert!(!ok);
    assert!(t0.elapsed() < Duration::from_secs(30));
    assert!(
        err.contains("no stage serves layer 15"),
        "the error must name the first missing layer:\n{err}"
    );
}

#[test]
fn refusals_name_the_reason_and_leave_the_cluster_working() {
    let dir = tempfile::tempdir().unwrap();
    let m = smollm2();
    let m = m.to_str().unwrap();
    let key = key_file(dir.path(), "key", "correct horse battery staple 1234");
    let wrong = key_file(dir.path(), "wrong", "a different cluster key entirely");
    // A different model: the upcycled SmolLM2 has another fingerprint.
    let other = dir.path().join("moe.gguf");
    run_ok(&["upcycle", m, other.to_str().unwrap(), "--experts", "2"]);
    let prompt = "The capital of Germany is";
    let want = greedy_single(m, prompt, "8");
    let (coord, addr) = coordinator(
        "coordinator",
        &[
            "run",
            "-m",
            m,
            "-p",
            prompt,
            "-n",
            "8",
            "--temp",
            "0",
            "--kv-type",
            "f32",
            "--threads",
            "1",
            "--no-warm",
            "--cluster-key-file",
            &key,
            "--layers",
            "0:14",
            "--route-wait",
            "60",
        ],
    );
    // Garbage first: an HTTP request, random bytes, a connection that just closes.
    for payload in [
        &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        &[0x13u8, 0x37, 0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4, 5, 6][..],
        &[][..],
    ] {
        let mut s = TcpStream::connect(&addr).unwrap();
        s.write_all(payload).unwrap();
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut sink = Vec::new();
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = s.read_to_end(&mut sink);
    }
    // A peer speaking another protocol version gets an error naming both versions.
    {
        let mut s = TcpStream::connect(&addr).unwrap();
        let mut h = Vec::new();
        h.extend_from_slice(b"MSHD");
        h.extend_from_slice(&99u16.to_le_bytes());
        h.extend_from_slice(&1u16.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&0u64.to_le_bytes());
        h.extend_from_slice(&0u64.to_le_bytes());
        s.write_all(&h).unwrap();
        let mut reply = Vec::new();
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = s.read_to_end(&mut reply);
        let text = String::from_utf8_lossy(&reply);
        assert!(
            text.contains("version") && text.contains("99"),
            "version refusal: {text:?}"
        );
    }
    let refused = |name: &str, args: &[&str], reason: &str| {
        let mut full = vec![
            "worker",
            "-m",
            args[0],
            "--layers",
            args[1],
            "--coordinator",
            &addr,
            "--threads",
            "1",
            "--no-warm",
        ];
        full.extend_from_slice(&args[2..]);
        let (ok, _, err) = Proc::spawn(name, &full).finish(T);
        assert!(!ok, "{name} must be refused");
        assert!(
            err.contains(reason),
            "{name}: expected {reason:?} in:\n{err}"
        );
    };
    refused(
        "wrong model",
        &[
            other.to_str().unwrap(),
            "15:output",
            "--cluster-key-file",
            &key,
        ],
        "different model",
    );
    refused(
        "wrong key",
        &[m, "15:output", "--cluster-key-file", &wrong],
        "different cluster key",
    );
    refused("no key", &[m, "15:output", "--insecure"], "requires a key");
    refused(
        "overlap with the coordinator",
        &[m, "10:output", "--cluster-key-file", &key],
        "overlapping range",
    );
    // Now a correct worker: the request completes as if nothing happened.
    let _good = worker(m, "15:output", &addr, &["--cluster-key-file", &key]);
    let (ok, out, err) = coord.finish(T);
    assert!(ok, "coordinator failed:\n{err}");
    assert_eq!(out, want);
    for reason in [
        "does not speak the protocol",
        "different model",
        "different cluster key",
        "overlapping range",
    ] {
        assert!(
            err.contains(reason),
            "the coordinator must log {reason:?}:\n{err}"
        );
    }
}

#[test]
fn a_snapshot_saved_on_one_split_continues_identically_on_another() {
    let dir = tempfile::tempdir().unwrap();
    let m = smollm2();
    let m = m.to_str().unwrap();
    let prompt = "The three primary colors are";
    let want = greedy_single(m, prompt, "24");
    let snap = dir.path().join("session.snap");
    let snap_s = snap.to_str().unwrap();
    // Save after the prompt on a 2-stage split.
    let (coord, addr) = coordinator(
        "coordinator save",
        &[
            "run",
            "-m",
            m,
            "-p",
            prompt,
            "-n",
            "0",
            "--kv-type",
            "f32",
            "--threads",
            "1",
            "--no-warm",
            "--insecure",
            "--layers",
            "0:7",
            "--save-snapshot",
            snap_s,
        ],
    );
    let _w = worker(m, "8:output", &addr, &["--insecure"]);
    let (ok, _, err) = coord.finish(T);
    assert!(ok, "save failed:\n{err}");
    // Continue on a 3-stage split with different boundaries.
    let (coord, addr) = coordinator(
        "coordinator load",
        &[
            "run",
            "-m",
            m,
            "-n",
            "24",
            "--temp",
            "0",
            "--kv-type",
            "f32",
            "--threads",
            "1",
            "--no-warm",
            "--insecure",
            "--layers",
            "0:3",
            "--load-snapshot",
            snap_s,
        ],
    );
    let _w1 = worker(m, "4:9", &addr, &["--insecure"]);
    let _w2 = worker(m, "10:output", &addr, &["--insecure"]);
    let (ok, out, err) = coord.finish(T);
    assert!(ok, "load failed:\n{err}");
    // `want` starts with the prompt text; the continuation printed after loading does not.
    assert_eq!(
        out.trim_end(),
        want.trim_end().strip_prefix(prompt).unwrap().trim_end(),
        "continuation differs"
    );
    // And on a single node.
    let out = run_ok(&[
        "run",
        "-m",
        m,
        "-n",
        "24",
        "--temp",
        "0",
        "--kv-type",
        "f32",
        "--no-warm",
        "--load-snapshot",
        snap_s,
    ]);
    assert_eq!(
        out.trim_end(),
        want.trim_end().strip_prefix(prompt).unwrap().trim_end()
    );
}

/// Streaming on every stage: each streams the experts of its own layers and the logits stay
/// bit-identical to a resident single node.
#[test]
fn stages_streaming_their_experts_match_single_node() {
    let dir = tempfile::tempdir().unwrap();
    let m = fixture("qwen3moe", "model-q8_0.gguf");
    let m = m.to_str().unwrap();
    let toks = "1,2,3,4,5,6,7,8,9,10,11,12";
    let single = logits_single(m, toks, &dir.path().join("single.npy"));
    let out = dir.path().join("pipe.npy");
    let args = [
        "logits",
        "-m",
        m,
        "--tokens",
        toks,
        "--out",
        out.to_str().unwrap(),
        "--kv-type",
        "f32",
        "--threads",
        "1",
        "--no-warm",
        "--insecure",
        "--layers",
        "0:1",
        "--ssd-streaming",
        "--expert-cache",
        "1",
    ];
    let (coord, addr) = coordinator("coordinator", &args);
    let _w = worker(
        m,
        "2:output",
        &addr,
        &["--insecure", "--ssd-streaming", "--expert-cache", "1"],
    );
    let (ok, _, err) = coord.finish(T);
    assert!(ok, "streaming pipeline failed:\n{err}");
    let got = read_npy_f32(&out).1;
    assert!(
        got.iter()
            .zip(&single)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "logits differ"
    );
}

/// DeepSeek (latent attention, a dense first layer, grouped routing) and GLM-4.5-style
/// fixtures in 2 and 3 stages — one boundary right after the leading dense layer, one inside
/// the routed layers — are bit-identical to one node; a session's latent cache saved on a
/// 2-stage split continues on one node with the single node's tokens.
#[test]
fn deepseek2_and_glm4moe_stages_are_bit_identical_to_single_node() {
    let dir = tempfile::tempdir().unwrap();
    for fx in ["deepseek2", "deepseek2-lite", "glm4moe"] {
        let m = fixture(fx, "model-f32.gguf");
        let m = m.to_str().unwrap();
        let toks = fixture_tokens(fx);
        let single = logits_single(m, &toks, &dir.path().join(format!("{fx}.npy")));
        let two = logits_pipeline(
            m,
            &toks,
            &dir.path().join(format!("{fx}-2.npy")),
            &["0:0", "1:output"],
            &["--dist-prefill-chunk", "4", "--dist-prefill-window", "3"],
        );
        let three = logits_pipeline(
            m,
            &toks,
            &dir.path().join(format!("{fx}-3.npy")),
            &["0:1", "2:2", "3:output"],
            &["--dist-prefill-chunk", "5", "--dist-prefill-window", "2"],
        );
        for (name, got) in [("2 stages", &two), ("3 stages", &three)] {
            assert_eq!(got.len(), single.len(), "{fx} {name}");
            let differing = got
                .iter()
                .zip(&single)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(differing, 0, "{fx} {name}: {differing} logits differ");
        }
    }
    let m = fixture("deepseek2", "model-f32.gguf");
    let m = m.to_str().unwrap();
    let prompt = "The ferry";
    let want = greedy_single(m, prompt, "16");
    let snap = dir.path().join("mla.snap");
    let snap_s = snap.to_str().unwrap();
    let (coord, addr) = coordinator(
        "coordinator save",
        &[
            "run",
            "-m",
            m,
            "-p",
            prompt,
            "-n",
            "0",
            "--kv-type",
            "f32",
            "--threads",
            "1",
            "--no-warm",
            "--insecure",
            "--layers",
            "0:0",
            "--save-snapshot",
            snap_s,
        ],
    );
    let _w = worker(m, "1:output", &addr, &["--insecure"]);
    let (ok, _, err) = coord.finish(T);
    assert!(ok, "save failed:\n{err}");
    let out = run_ok(&[
        "run",
        "-m",
        m,
        "-n",
        "16",
        "--temp",
        "0",
        "--kv-type",
        "f32",
        "--no-warm",
        "--load-snapshot",
        snap_s,
    ]);
    assert_eq!(
        out.trim_end(),
        want.trim_end().strip_prefix(prompt).unwrap().trim_end(),
        "MLA snapshot from a 2-stage split continued on one node"
    );
}

/// gpt-oss (sliding-window layers with sinks alternating with full ones): stage boundaries after
/// a sliding layer and after a full one, prefill chunks that cross the 8-position window, a
/// stage streaming its experts, and a snapshot saved on one split and continued on another —
/// all bit-identical to a single node; the single node's full cache (`--swa-full`) too.
#[test]
fn gpt_oss_stages_match_single_node() {
    let dir = tempfile::tempdir().unwrap();
    let m = fixture("gpt-oss", "model-f32.gguf");
    let m = m.to_str().unwrap();
    let toks = fixture_tokens("gpt-oss");
    let single = logits_single(m, &toks, &dir.path().join("single.npy"));
    let same = |got: &[f32]| {
        got.len() == single.len()
            && got
                .iter()
                .zip(&single)
                .all(|(a, b)| a.to_bits() == b.to_bits())
    };
    let two = logits_pipeline(
        m,
        &toks,
        &dir.path().join("two.npy"),
        &["0:0", "1:output"],
        &["--dist-prefill-chunk", "5", "--dist-prefill-window", "2"],
    );
    assert!(same(&two), "2 stages (0:0, 1:output): logits differ");
    let three = logits_pipeline(
        m,
        &toks,
        &dir.path().join("three.npy"),
        &["0:1", "2:2", "3:output"],
        &["--dist-prefill-chunk", "3", "--dist-prefill-window", "3"],
    );
    assert!(same(&three), "3 stages (0:1, 2:2, 3:output): logits differ");
    let streamed = logits_pipeline(
        m,
        &toks,
        &dir.path().join("streamed.npy"),
        &["0:2", "3:output"],
        &["--ssd-streaming", "--expert-cache", "1"],
    );
    assert!(same(&streamed), "a streaming first stage: logits differ");

    let want = greedy_single(m, "The ferry", "24");
    let snap = dir.path().join("session.snap");
    let snap_s = snap.to_str().unwrap();
    let (coord, addr) = coordinator(
        "coordinator save",
        &[
            "run",
            "-m",
            m,
            "-p",
            "The ferry",
            "-n",
            "0",
            "--kv-type",
            "f32",
            "--threads",
            "1",
            "--no-warm",
            "--insecure",
            "--layers",
            "0:2",
            "--save-snapshot",
            snap_s,
        ],
    );
    let _w = worker(m, "3:output", &addr, &["--insecure"]);
    let (ok, _, err) = coord.finish(T);
    assert!(ok, "save failed:\n{err}");
    let (coord, addr) = coordinator(
        "coordinator load",
        &[
            "run",
            "-m",
            m,
            "-n",
            "24",
            "--temp",
            "0",
            "--kv-type",
            "f32",
            "--threads",
            "1",
            "--no-warm",
            "--insecure",
            "--layers",
            "0:0",
            "--load-snapshot",
            snap_s,
        ],
    );
    let _w = worker(m, "1:output", &addr, &["--insecure"]);
    let (ok, out, err) = coord.finish(T);
    assert!(ok, "load failed:\n{err}");
    assert_eq!(
        out.trim_end(),
        want.trim_end()
            .strip_prefix("The ferry")
            .unwrap()
            .trim_end(),
        "continuation after the snapshot differs"
    );

    // The full cache (`--swa-full`) gives the same greedy text on one node; with a pipeline it
    // is refused before anything starts (every stage would need it).
    let full = run_ok(&[
        "run",
        "-m",
        m,
        "-p",
        "The ferry",
        "-n",
        "24",
        "--temp",
        "0",
        "--kv-type",
        "f32",
        "--threads",
        "2",
        "--no-warm",
        "--swa-full",
    ]);
    assert_eq!(full, want, "--swa-full changes the greedy text");
    let refused = std::process::Command::new(bin())
        .args(["run", "-m", m, "-p", "The ferry", "--no-warm", "--insecure"])
        .args(["--layers", "0:1", "--listen", "127.0.0.1:0", "--swa-full"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && err.contains("--swa-full works on a single node only"),
        "{err}"
    );
}

/// The HTTP address a `serve` process prints.
fn http_addr(p: &Proc) -> String {
    let line = p.wait_for_stderr("listening on http://", T);
    line.rsplit("http://")
        .next()
        .and_then(|s| s.split_whitespace().next())
        .unwrap()
        .to_string()
}

/// gpt-oss served by a 2-stage pipeline (coordinator 0:1, worker 2:output) and by one node,
/// one slot each, the same requests in order: a prompt sharing only its start with the cached
/// history needs a rewind past what the sliding layers keep, which the pipeline's coordinator
/// refuses for all its stages as the single node does — both evaluate the prompt afresh and
/// log it — and short rewinds and extensions reuse the cache; the texts are the same.
#[test]
fn gpt_oss_server_rewinds_past_the_window_are_cache_misses_on_a_pipeline() {
    let m = fixture("gpt-oss", "model-f32.gguf");
    let m = m.to_str().unwrap();
    let base = [
        "serve",
        "-m",
        m,
        "--port",
        "0",
        "-t",
        "1",
        "--parallel",
        "1",
        "--kv-type",
        "f32",
        "--no-warm",
    ];
    let mut pipe_args = base.to_vec();
    pipe_args.extend_from_slice(&["--insecure", "--layers", "0:1"]);
    let (coord, addr) = coordinator("serve pipeline", &pipe_args);
    let _w = worker(m, "2:output", &addr, &["--insecure"]);
    let pipe = http_addr(&coord);
    let local_proc = Proc::spawn("serve local", &base);
    let local = http_addr(&local_proc);

    let first = "The ferry left the harbour at dawn with farmers, their carts, two goats and a brass band that played until the island came into view";
    let far = "The ferry left the harbour at noon without anyone on board, and the brass band stayed on the pier playing for the gulls";
    let extended = format!("{far} until sunset");
    let short = format!("{far} until dusk");
    let mut cached = Vec::new();
    for prompt in [first, far, &extended, &short] {
        let body =
            serde_json::json!({"prompt": prompt, "max_tokens": 3, "temperature": 0}).to_string();
        let answer = |addr: &str| {
            let (status, text) =
                common::http::http(addr, "POST", "/v1/completions", Some(&body), &[]);
            assert_eq!(status, 200, "{prompt}: {text}");
            serde_json::from_str::<serde_json::Value>(&text).unwrap()
        };
        let (p, l) = (answer(&pipe), answer(&local));
        assert_eq!(
            p["choices"][0]["text"], l["choices"][0]["text"],
            "{prompt}: the pipeline's text differs"
        );
        let tokens = |v: &serde_json::Value| {
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
        };
        cached.push((tokens(&p), tokens(&l)));
    }
    eprintln!("cached prompt tokens (pipeline, single node): {cached:?}");
    assert_eq!(
        cached[1],
        (0, 0),
        "the far rewind is a cache miss: {cached:?}"
    );
    assert!(
        cached[2..].iter().all(|&(p, l)| p > 0 && l > 0),
        "extensions and short rewinds reuse the cache: {cached:?}"
    );
    for (name, p) in [("pipeline", &coord), ("single node", &local_proc)] {
        let log = p.wait_for_stderr("evaluating the prompt afresh", Duration::from_secs(5));
        assert!(log.contains("cannot rewind"), "{name}: {log}");
    }

    // `/v1/status` (the web page's cluster view) describes both: the pipeline's stages with
    // their layers and addresses and the last item's time in each, once the scheduler has
    // published after the requests (at most a second later).
    let status = |addr: &str| {
        let (code, text) = common::http::http(addr, "GET", "/v1/status", None, &[]);
        assert_eq!(code, 200, "{text}");
        serde_json::from_str::<serde_json::Value>(&text).unwrap()
    };
    let t0 = Instant::now();
    let view = loop {
        let s = status(&pipe);
        if s["cluster"]["hops"]
            .as_array()
            .is_some_and(|h| !h.is_empty())
        {
            break s["cluster"].clone();
        }
        assert!(t0.elapsed() < T, "no hop timings in /v1/status: {s}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(view["kind"], "pipeline", "{view}");
    assert_eq!(view["complete"], true, "{view}");
    let nodes = view["nodes"].as_array().unwrap();
    let layers: Vec<&str> = nodes
        .iter()
        .map(|n| n["layers"].as_str().unwrap())
        .collect();
    assert_eq!(layers, ["0:1", "2:output"], "{view}");
    assert_eq!(nodes[0]["role"], "coordinator");
    assert_eq!(nodes[0]["address"], addr.as_str());
    assert_eq!(nodes[1]["role"], "stage");
    assert!(
        nodes[1]["address"]
            .as_str()
            .is_some_and(|a| a.starts_with("127.0.0.1:"))
    );
    let hops = view["hops"].as_array().unwrap();
    let stages: Vec<&str> = hops.iter().map(|h| h["stage"].as_str().unwrap()).collect();
    assert_eq!(stages, ["0:1", "2:output"], "{view}");
    assert!(hops[1]["bytes_in"].as_u64().unwrap() > 0, "{view}");
    let local_view = status(&local)["cluster"].clone();
    assert_eq!(local_view["kind"], "local", "{local_view}");
    assert_eq!(local_view["nodes"][0]["layers"], "0:output", "{local_view}");
}
