//! Soak: `moeshard serve` over a 3-stage pipeline, one network namespace per stage, under a
//! steady load from several clients while a harness kills (-9) and restarts a random worker every
//! few seconds. Every request must come back, and with the single node's greedy text; the
//! server must not leak threads, descriptors or memory (measured before and after).
//!
//! The size comes from the environment, so one test serves both the CI run and the long soak
//! (`scripts/soak`): `SOAK_REQUESTS` (default 600), `SOAK_CLIENTS` (4), `SOAK_RESTART_MS`
//! (mean time between restarts, 1500), `SOAK_TOKENS` (tokens per request, 12), `CHAOS_SEED`.
//! Needs root for the namespaces; where they cannot be made the test says why and does nothing.

// Network namespaces, signals and /proc: Linux only.
#![cfg(target_os = "linux")]

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::http::try_http;
use common::netns::Net;
use common::*;
use serde_json::{Value, json};

const PROMPTS: [&str; 8] = [
    "ROMEO:",
    "JULIET:",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "KING RICHARD II:",
    "To be, or not to be,",
    "HAMLET:\nO, that this too too solid flesh would melt",
    "Now is the winter of our discontent",
    "MERCUTIO:\nNay, I'll conjure too.",
];

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn demo() -> String {
    repo()
        .join("models/shakespeare-moe.gguf")
        .to_string_lossy()
        .into_owned()
}

fn body(i: usize, tokens: u64) -> String {
    json!({
        "model": "demo",
        "prompt": PROMPTS[i % PROMPTS.len()],
        "max_tokens": tokens,
        "temperature": 0,
    })
    .to_string()
}

/// The completion text of a 200 answer, or what went wrong.
fn complete(addr: &str, i: usize, tokens: u64) -> Result<String, String> {
    let b = body(i, tokens);
    let (status, text) = try_http(
        addr,
        "POST",
        "/v1/completions",
        Some(&b),
        &[],
        Duration::from_secs(120),
    )?;
    if status != 200 {
        return Err(format!("HTTP {status}: {text}"));
    }
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{e}: {text}"))?;
    v["choices"][0]["text"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| format!("no text in {text}"))
}

/// Threads, open descriptors and resident memory of a process.
#[derive(Debug, Clone, Copy)]
struct Usage {
    threads: usize,
    fds: usize,
    rss_kib: u64,
}

fn usage(pid: u32) -> Usage {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
    };
    Usage {
        threads: field("Threads:") as usize,
        fds: std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .count(),
        rss_kib: field("VmRSS:"),
    }
}

/// `usage` once the process has been idle long enough for threads that outlive their work
/// by design to end: tokio's blocking pool keeps an idle thread 10 s, a closed link's heartbeat
/// thread notices within a fraction of the peer timeout.
fn settled_usage(pid: u32) -> Usage {
    std::thread::sleep(Duration::from_secs(11));
    usage(pid)
}

fn start_serve(name: &str, ns: Option<&str>, args: &[&str]) -> (Proc, String) {
    let p = match ns {
        Some(ns) => Proc::spawn_in(ns, name, args),
        None => Proc::spawn(name, args),
    };
    let line = p.wait_for_stderr("listening on http://", Duration::from_secs(120));
    let addr = line
        .rsplit("http://")
        .next()
        .and_then(|s| s.split_whitespace().next())
        .unwrap()
        .to_string();
    (p, addr)
}

#[test]
fn serve_over_a_pipeline_loses_nothing_while_workers_restart() {
    let requests = env_or("SOAK_REQUESTS", 600) as usize;
    let clients = env_or("SOAK_CLIENTS", 4) as usize;
    let restart_ms = env_or("SOAK_RESTART_MS", 1500);
    let tokens = env_or("SOAK_TOKENS", 12);
    let mut rng = env_or("CHAOS_SEED", 0x5eed_cafe);
    eprintln!(
        "soak: {requests} requests, {clients} clients, a restart every ~{restart_ms} ms, \
         {tokens} tokens each, CHAOS_SEED={rng}"
    );
    let Some(net) = Net::setup("soak", 3) else {
        return;
    };
    let m = demo();
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key").to_string_lossy().into_owned();
    run_ok(&["keygen", &key]);

    // The single node's answers (same server code, no cluster).
    let want: Vec<String> = {
        let (single, addr) = start_serve(
            "single-node serve",
            None,
            &[
                "serve",
                "-m",
                &m,
                "--alias",
                "demo",
                "--port",
                "0",
                "-t",
                "1",
                "--no-warm",
            ],
        );
        let w = (0..PROMPTS.len())
            .map(|i| complete(&addr, i, tokens).unwrap_or_else(|e| panic!("single node: {e}")))
            .collect();
        drop(single);
        w
    };

    let stage = |h: usize| {
        let layers = ["", "2:3", "4:output"][h];
        Proc::spawn_in(
            &net.hosts[h],
            &format!("stage {layers}"),
            &[
                "worker",
                "-m",
                &m,
                "--layers",
                layers,
                "--coordinator",
                "10.77.0.1:7000",
                "--cluster-key-file",
                &key,
                "--threads",
                "1",
                "--peer-timeout",
                "3",
            ],
        )
    };
    let workers = Arc::new(Mutex::new(vec![stage(1), stage(2)]));
    let (serve, _) = start_serve(
        "pipeline serve",
        Some(&net.hosts[0]),
        &[
            "serve",
            "-m",
            &m,
            "--alias",
            "demo",
            "--layers",
            "0:1",
            "--listen",
            "0.0.0.0:7000",
            "--cluster-key-file",
            &key,
            "--host",
            "0.0.0.0",
            "--port",
            "8080",
            "-t",
            "1",
            "--no-warm",
            "--peer-timeout",
            "3",
            "--route-wait",
            "60",
        ],
    );
    let addr = "10.77.0.1:8080";
    let pid = serve.child.id();

    // Warm up (routes, caches, thread pools), then measure the baseline.
    std::thread::scope(|s| {
        s.spawn(|| {
            net.enter(0);
            for (i, expected) in want.iter().enumerate() {
                let got = complete(addr, i, tokens).unwrap_or_else(|e| panic!("warm-up: {e}"));
                assert_eq!(&got, expected, "warm-up answer {i} vs single node");
            }
        });
    });
    let before = settled_usage(pid);

    let next = AtomicUsize::new(0);
    let done = AtomicBool::new(false);
    let failures: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let latencies: Mutex<Vec<Duration>> = Mutex::new(Vec::new());
    let restarts = AtomicUsize::new(0);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..clients {
            s.spawn(|| {
                net.enter(0);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= requests {
                        break;
                    }
                    let start = Instant::now();
                    match complete(addr, i, tokens) {
                        Ok(text) if text == want[i % PROMPTS.len()] => {
                            latencies.lock().unwrap().push(start.elapsed())
                        }
                        Ok(text) => failures.lock().unwrap().push(format!(
                            "request {i}: wrong text {text:?}, single node {:?}",
                            want[i % PROMPTS.len()]
                        )),
                        Err(e) => failures
                            .lock()
                            .unwrap()
                            .push(format!("request {i}: lost: {e}")),
                    }
                }
            });
        }
        // The harness: kill -9 and restart a random worker every few seconds.
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                rng = rng
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let wait = restart_ms / 2 + (rng >> 33) % restart_ms.max(1);
                let until = Instant::now() + Duration::from_millis(wait);
                while Instant::now() < until && !done.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(20));
                }
                if done.load(Ordering::Relaxed) {
                    break;
                }
                let h = 1 + ((rng >> 17) % 2) as usize;
                let mut w = workers.lock().unwrap();
                w[h - 1].kill9();
                w[h - 1] = stage(h);
                restarts.fetch_add(1, Ordering::Relaxed);
            }
        });
        // Ends the harness once every client is done.
        s.spawn(|| {
            while next.load(Ordering::Relaxed) < requests + clients {
                std::thread::sleep(Duration::from_millis(50));
            }
            done.store(true, Ordering::Relaxed);
        });
    });
    let elapsed = t0.elapsed();
    let after = settled_usage(pid);
    let failures = failures.into_inner().unwrap();
    let mut lat = latencies.into_inner().unwrap();
    lat.sort();
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    };
    let log = serve.stderr_text();
    let replays = log.matches("replaying session").count();
    let mut kinds: HashMap<&str, usize> = HashMap::new();
    for f in &failures {
        *kinds
            .entry(if f.contains("lost") { "lost" } else { "wrong" })
            .or_default() += 1;
    }
    eprintln!(
        "soak: {} ok, {} lost, {} wrong of {requests} in {elapsed:.1?} ({:.1} req/s); \
         {} restarts, {replays} session replays; latency p50 {:?} p99 {:?} max {:?}",
        lat.len(),
        kinds.get("lost").unwrap_or(&0),
        kinds.get("wrong").unwrap_or(&0),
        requests as f64 / elapsed.as_secs_f64(),
        restarts.load(Ordering::Relaxed),
        pct(0.5),
        pct(0.99),
        lat.last().copied().unwrap_or_default(),
    );
    eprintln!("soak: serve before {before:?}, after {after:?}");
    assert!(
        failures.is_empty(),
        "{} of {requests} requests failed:\n{}\nserve stderr:\n{log}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        restarts.load(Ordering::Relaxed) >= 1,
        "the load ended before any restart: raise SOAK_REQUESTS"
    );
    // Links to killed workers must not leave threads or descriptors behind (one restart may
    // have happened just before the measurement).
    assert!(
        after.threads <= before.threads + 2,
        "threads {} → {}",
        before.threads,
        after.threads
    );
    assert!(
        after.fds <= before.fds + 8,
        "descriptors {} → {}",
        before.fds,
        after.fds
    );
    assert!(
        after.rss_kib <= before.rss_kib + before.rss_kib / 4 + 32 * 1024,
        "resident memory {} → {} KiB",
        before.rss_kib,
        after.rss_kib
    );
    drop(serve);
}
