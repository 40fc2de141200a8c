//! The README's cluster commands, verbatim but for the model, key and prompt, across network
//! namespaces: three "machines" (10.77.0.1–3) on a bridge of their own, no loopback between
//! them. A 3-stage pipeline and a 3-rank tensor-parallel group give the single node's greedy
//! tokens; a stopped (SIGSTOP) last stage is detected within the peer timeout.
//!
//! Needs root (CI and the development machines run as root); where namespaces cannot be made
//! the test says why and does nothing else.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::netns::Net;
use common::*;

const T: Duration = Duration::from_secs(120);

fn demo() -> String {
    repo()
        .join("models/shakespeare-moe.gguf")
        .to_string_lossy()
        .into_owned()
}

fn single_node(m: &str) -> String {
    run_ok(&[
        "run",
        "-m",
        m,
        "-p",
        "ROMEO:",
        "-n",
        "24",
        "--temp",
        "0",
        "--no-warm",
    ])
}

/// Three hosts, a fresh key (`moeshard keygen`), the demo model and its single-node output.
fn cluster(tag: &str) -> Option<(Net, tempfile::TempDir, String, String, String)> {
    let net = Net::setup(tag, 3)?;
    let dir = tempfile::tempdir().unwrap();
    let key = dir
        .path()
        .join("cluster.key")
        .to_string_lossy()
        .into_owned();
    run_ok(&["keygen", &key]);
    let m = demo();
    let want = single_node(&m);
    Some((net, dir, key, m, want))
}

#[test]
fn readme_pipeline_across_machines_then_a_stopped_stage_is_detected() {
    let Some((net, _dir, key, m, want)) = cluster("p") else {
        return;
    };
    let worker = |h: usize, layers: &str| {
        Proc::spawn_in(
            &net.hosts[h],
            "worker",
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
            ],
        )
    };
    let _w1 = worker(1, "2:3");
    let mut w2 = worker(2, "4:output");
    // The README's coordinator command, with greedy sampling and the given extra flags.
    let coordinator = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "-m",
            &m,
            "--layers",
            "0:1",
            "--listen",
            "0.0.0.0:7000",
            "--cluster-key-file",
            &key,
            "-p",
            "ROMEO:",
            "--temp",
            "0",
            "--no-warm",
        ];
        args.extend_from_slice(extra);
        Proc::spawn_in(&net.hosts[0], "coordinator", &args)
    };
    let (ok, out, err) = coordinator(&["-n", "24"]).finish(T);
    assert!(ok, "pipeline across namespaces failed:\n{err}");
    assert_eq!(out, want, "3 stages on 3 hosts vs one node");

    // Stop the last stage in the middle of a long generation: the coordinator must notice
    // within the peer timeout (2 s here) and say which stage.
    let coord = coordinator(&["-n", "100000", "--peer-timeout", "2", "--route-wait", "4"]);
    coord.wait_for_stderr("route: 0:1", T);
    std::thread::sleep(Duration::from_millis(500));
    let pid = w2.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-STOP", &pid])
            .status()
            .unwrap()
            .success()
    );
    let stopped = Instant::now();
    let line = coord.wait_for_stderr("not even a heartbeat", Duration::from_secs(20));
    let noticed = stopped.elapsed();
    let (ok, _, err) = coord.finish(T);
    let _ = Command::new("kill").args(["-CONT", &pid]).status();
    w2.kill9();
    eprintln!("stopped stage noticed after {noticed:?}: {line}");
    assert!(
        line.contains("4:output"),
        "the silent stage is named: {line}"
    );
    assert!(
        !ok,
        "the request cannot finish without its last stage:\n{err}"
    );
    assert!(
        noticed < Duration::from_secs(4),
        "noticed after {noticed:?}:\n{err}"
    );
}

#[test]
fn readme_tensor_parallel_across_machines() {
    let Some((net, _dir, key, m, want)) = cluster("t") else {
        return;
    };
    let ranks: Vec<Proc> = (1..3)
        .map(|h| {
            Proc::spawn_in(
                &net.hosts[h],
                "rank",
                &[
                    "worker",
                    "-m",
                    &m,
                    "--tensor-parallel",
                    "--coordinator",
                    "10.77.0.1:7000",
                    "--cluster-key-file",
                    &key,
                ],
            )
        })
        .collect();
    let coord = Proc::spawn_in(
        &net.hosts[0],
        "coordinator",
        &[
            "run",
            "-m",
            &m,
            "--tensor-parallel",
            "--tp-size",
            "3",
            "--listen",
            "0.0.0.0:7000",
            "--cluster-key-file",
            &key,
            "-p",
            "ROMEO:",
            "-n",
            "24",
            "--temp",
            "0",
            "--no-warm",
        ],
    );
    let (ok, out, err) = coord.finish(T);
    drop(ranks);
    assert!(ok, "tensor parallel across namespaces failed:\n{err}");
    assert_eq!(out, want, "3 ranks on 3 hosts vs one node");
}
