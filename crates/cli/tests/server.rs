//! `moeshard serve` on real processes: the official OpenAI Python client (tools/server-tests),
//! continuous batching that does not change a single bit of any stream, the disk KV cache across
//! a restart, client disconnects, the queue limit and the API key. HTTP is spoken with a
//! minimal std-only client so the tests need no extra crates.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use common::http::http;
use common::{Proc, fixture, repo, smollm2};
use serde_json::{Value, json};

/// A server process and its address.
struct Server {
    proc: Proc,
    addr: String,
}

impl Server {
    fn start(model: &Path, extra: &[&str]) -> Server {
        Server::start_env(model, extra, &[])
    }

    fn start_env(model: &Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let m = model.to_str().unwrap();
        let mut args = vec!["serve", "-m", m, "--port", "0", "-t", "1"];
        args.extend_from_slice(extra);
        let proc = Proc::spawn_env("serve", &args, env);
        let line = proc.wait_for_stderr("listening on http://", Duration::from_secs(120));
        let addr = line
            .rsplit("http://")
            .next()
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .to_string();
        Server { proc, addr }
    }

    /// SIGTERM, then waits for a clean exit; returns stderr.
    fn terminate(self) -> String {
        let pid = self.proc.child.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success()
        );
        let (ok, _, stderr) = self.proc.finish(Duration::from_secs(60));
        assert!(ok, "serve did not exit cleanly after SIGTERM:\n{stderr}");
        stderr
    }

    fn post(&self, path: &str, body: &Value) -> (u16, String) {
        http(&self.addr, "POST", path, Some(&body.to_string()), &[])
    }

    fn post_json(&self, path: &str, body: &Value) -> Value {
        let (status, text) = self.post(path, body);
        assert_eq!(status, 200, "{path}: {text}");
        serde_json::from_str(&text).unwrap()
    }

    fn metric(&self, name: &str) -> f64 {
        let (_, text) = http(&self.addr, "GET", "/metrics", None, &[]);
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
            .parse()
            .unwrap()
    }
}

/// The `data:` payloads of an SSE body.
fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|ev| ev.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(str::to_string)
        .collect()
}

/// Sends a streaming completion with the API key and reads until the response headers and
/// `events` SSE events have arrived; the caller drops the socket to disconnect.
fn open_stream(addr: &str, body: &Value, events: usize) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    let b = body.to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sesame\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        b.len()
    );
    s.write_all((head + &b).as_bytes()).unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !seen.windows(4).any(|w| w == b"\r\n\r\n")
        || seen.windows(5).filter(|w| w == b"data:").count() < events
    {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "stream ended early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(
        seen.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&seen)
    );
    s
}

/// Streams a completion and returns its text (asserting the stream ends with `[DONE]`).
fn stream_text(addr: &str, body: &Value) -> String {
    stream_chunks(addr, body).0
}

#[test]
fn openai_python_client_and_curl() {
    let server = Server::start(
        &fixture("qwen3moe", "model-q8_0.gguf"),
        &[
            "--parallel",
            "2",
            "--sse-keepalive",
            "0.05",
            "--alias",
            "fixture-moe",
            "--ctx",
            "8192",
            // The real Qwen3 template (the fixture has none): tools and thinking switches.
            "--chat-template-file",
            repo()
                .join("crates/engine/tests/data/chat/qwen3.jinja")
                .to_str()
                .expect("a UTF-8 path"),
        ],
    );
    let script = repo().join("tools/server-tests/run.sh");
    let out = Command::new("bash")
        .arg(&script)
        .args([&format!("http://{}", server.addr), "fixture-moe"])
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "the OpenAI-client tests failed ({}):\n{text}\nserver log:\n{}",
        out.status,
        server.proc.stderr_text()
    );
    eprintln!("{text}");
    let log = server.terminate();
    assert!(log.contains("scheduler stopped"), "{log}");
}

/// 8 different prompts, each streamed alone and then all 8 at once: every text identical.
fn concurrent_matches_solo(model: &Path, n_tokens: usize) {
    let server = Server::start(model, &["--parallel", "8", "--prefill-chunk", "16"]);
    let prompts = [
        "The capital of France is",
        "Once upon a time, in a small village,",
        "def fibonacci(n):",
        "The three primary colors are",
        "Water boils at a temperature of",
        "My favourite book is",
        "In 1969, the first person to walk on the moon",
        "A recipe for pancakes: first,",
    ];
    let body = |p: &str, cache: bool| {
        json!({"prompt": p, "max_tokens": n_tokens, "temperature": 0, "stream": true,
               "ignore_eos": true, "cache_prompt": cache})
    };
    let solo: Vec<String> = prompts
        .iter()
        .map(|p| stream_text(&server.addr, &body(p, false)))
        .collect();
    assert!(
        solo.iter().any(|t| t != &solo[0]),
        "prompts should give different texts: {solo:?}"
    );
    for cache in [false, true] {
        let barrier = Arc::new(Barrier::new(prompts.len()));
        let threads: Vec<_> = prompts
            .iter()
            .map(|p| {
                let (addr, b, barrier) =
                    (server.addr.clone(), body(p, cache), Arc::clone(&barrier));
                std::thread::spawn(move || {
                    barrier.wait();
                    stream_text(&addr, &b)
                })
            })
            .collect();
        let together: Vec<String> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        for (i, (a, b)) in solo.iter().zip(&together).enumerate() {
            assert_eq!(
                a, b,
                "prompt {i} ({:?}) differs when batched (cache_prompt {cache})",
                prompts[i]
            );
        }
    }
    let max_batch = server.metric("moeshard_batch_size_max");
    assert!(
        max_batch >= 4.0,
        "the streams were not batched together (largest step: {max_batch} sessions)"
    );
    server.terminate();
}

#[test]
fn concurrent_greedy_streams_match_solo_smollm2() {
    concurrent_matches_solo(&smollm2(), 24);
}

#[test]
fn concurrent_greedy_streams_match_solo_moe_fixture() {
    concurrent_matches_solo(&fixture("mixtral", "model-q8_0.gguf"), 48);
}

#[test]
fn disk_kv_cache_restores_a_conversation_after_restart() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let model = smollm2();
    let flags = ["--parallel", "2", "--kv-disk-dir", d, "--kv-disk-max", "1G"];
    let mut messages = vec![
        json!({"role": "system", "content": "You are a helpful assistant who answers briefly."}),
        json!({"role": "user", "content": "What is the tallest mountain on Earth?"}),
    ];
    let server = Server::start(&model, &flags);
    let first = server.post_json(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 16, "temperature": 0}),
    );
    let reply = first["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let turn1_prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let log = server.terminate();
    assert!(log.contains("sessions saved at shutdown"), "{log}");

    messages.push(json!({"role": "assistant", "content": reply}));
    messages.push(json!({"role": "user", "content": "And the second tallest?"}));
    let server = Server::start(&model, &flags);
    let second = server.post_json(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 12, "temperature": 0}),
    );
    let usage = &second["usage"];
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= turn1_prompt,
        "only {cached} of the first turn's {turn1_prompt} prompt tokens were reused: {usage}"
    );
    let restored = server
        .proc
        .wait_for_stderr("tokens from the disk KV cache", Duration::from_secs(5));
    eprintln!("{restored}\nusage: {usage}");
    // The restored KV gives exactly what a cold evaluation gives.
    let cold = server.post_json(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 12, "temperature": 0, "cache_prompt": false}),
    );
    assert_eq!(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(
        second["choices"][0]["message"]["content"],
        cold["choices"][0]["message"]["content"]
    );
    server.terminate();
}

#[test]
fn disconnect_cancels_queue_limit_refuses_and_api_key_guards() {
    let model = fixture("qwen3moe", "model-q8_0.gguf");
    let server = Server::start(
        &model,
        &[
            "--parallel",
            "1",
            "--max-queue",
            "1",
            "--api-key",
            "sesame",
            "--ctx",
            "16384",
        ],
    );
    let auth = [("Authorization", "Bearer sesame")];
    let (status, body) = http(&server.addr, "GET", "/v1/models", None, &[]);
    assert_eq!(status, 401, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["error"]["code"],
        "invalid_api_key"
    );
    assert_eq!(http(&server.addr, "GET", "/v1/models", None, &auth).0, 200);
    assert_eq!(http(&server.addr, "GET", "/health", None, &[]).0, 200);

    // A stream that the client drops after a few events is cancelled.
    let long = json!({"prompt": "hello", "max_tokens": 16000, "temperature": 0, "ignore_eos": true, "stream": true});
    let s = open_stream(&server.addr, &long, 3);
    drop(s);
    server.proc.wait_for_stderr(
        "cancelled: the client disconnected",
        Duration::from_secs(30),
    );
    assert_eq!(server.metric("moeshard_requests_cancelled_total"), 1.0);

    // One request runs, one waits, the third is refused with 503; then both clients leave.
    let running = open_stream(&server.addr, &long, 1);
    let waiting = open_stream(&server.addr, &long, 0);
    let t0 = Instant::now();
    while server.metric("moeshard_requests_queued") < 1.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "nothing queued:\n{}",
            server.proc.stderr_text()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let (status, body) = http(
        &server.addr,
        "POST",
        "/v1/completions",
        Some(&long.to_string()),
        &auth,
    );
    assert_eq!(status, 503, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["error"]["type"],
        "server_error"
    );
    drop((running, waiting));
    let t0 = Instant::now();
    while server.metric("moeshard_requests_cancelled_total") < 3.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "not cancelled:\n{}",
            server.proc.stderr_text()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(server.metric("moeshard_requests_rejected_total"), 1.0);
    server.terminate();
}

#[test]
fn api_key_from_a_file_or_the_environment() {
    let model = fixture("qwen3moe", "model-q8_0.gguf");
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("api.key");
    std::fs::write(&key_file, "from-the-file\n").unwrap();
    let key_file = key_file.to_str().unwrap();
    let check = |server: &Server, key: &str| {
        let models = |h: &[(&str, &str)]| http(&server.addr, "GET", "/v1/models", None, h).0;
        assert_eq!(models(&[]), 401);
        assert_eq!(models(&[("Authorization", "Bearer wrong")]), 401);
        assert_eq!(models(&[("Authorization", &format!("Bearer {key}"))]), 200);
        assert_eq!(http(&server.addr, "GET", "/health", None, &[]).0, 200);
    };
    // The flags of the HTTP limits parse and show in the log.
    let flags = [
        "--http-timeout",
        "120",
        "--http-idle-timeout",
        "5",
        "--max-connections",
        "16",
    ];
    let mut args = vec!["--api-key-file", key_file];
    args.extend_from_slice(&flags);
    let server = Server::start_env(&model, &args, &[("MOESHARD_API_KEY", "from-the-env")]);
    check(&server, "from-the-file");
    let log = server.terminate();
    assert!(log.contains("at most 16 connections"), "{log}");
    let server = Server::start_env(&model, &[], &[("MOESHARD_API_KEY", "from-the-env")]);
    check(&server, "from-the-env");
    server.terminate();
    // Both flags at once is a usage error; an empty key file is refused before the model loads.
    let both = Proc::spawn(
        "serve",
        &["serve", "--api-key", "k", "--api-key-file", key_file],
    );
    let (ok, _, stderr) = both.finish(Duration::from_secs(30));
    assert!(!ok && stderr.contains("cannot be used with"), "{stderr}");
    let empty = dir.path().join("empty.key");
    std::fs::write(&empty, "\n").unwrap();
    let p = Proc::spawn(
        "serve",
        &["serve", "--api-key-file", empty.to_str().unwrap()],
    );
    let (ok, _, stderr) = p.finish(Duration::from_secs(30));
    assert!(!ok && stderr.contains("holds no API key"), "{stderr}");
}

/// Batched sessions through latent attention (several sequences' latent caches in one step)
/// and through GLM-4.5-style attention: every stream as when it ran alone.
#[test]
fn concurrent_greedy_streams_match_solo_deepseek2_and_glm4moe() {
    concurrent_matches_solo(&fixture("deepseek2", "model-q8_0.gguf"), 24);
    concurrent_matches_solo(&fixture("glm4moe", "model-q8_0.gguf"), 24);
}

/// DeepSeek V4: eight sessions batched (each with its window rows, compressed rows and
/// compressor inputs), with and without the prompt cache, give the solo texts.
#[test]
fn concurrent_greedy_streams_match_solo_deepseek4() {
    concurrent_matches_solo(&fixture("deepseek4", "model-f32.gguf"), 24);
}

/// GLM-5 sparse attention: batched sessions, each with its own selections over its own
/// latent rows and indexer keys, with and without the prompt cache, give the solo texts.
#[test]
fn concurrent_greedy_streams_match_solo_glm_dsa() {
    concurrent_matches_solo(&fixture("glm-dsa", "model-f32.gguf"), 24);
}

/// GLM-5.3 Flash: batched sessions, each with its own recurrent KDA memory, give the solo texts;
/// and a prompt that shares a long beginning with the cached one (a system prompt) resumes from
/// the recurrent memory at the latest chunk start inside it, with a cold evaluation's text.
#[test]
fn glm5_next_batches_and_reuses_a_shared_prefix_from_a_checkpoint() {
    let model = fixture("glm5-next", "model-f32.gguf");
    concurrent_matches_solo(&model, 24);
    let server = Server::start(&model, &["--parallel", "1", "--prefill-chunk", "32"]);
    let system = "You are a careful assistant. Answer in one short sentence, name your sources, \
                  and say so plainly when you do not know the answer to a question. ";
    let ask = |question: &str, cache: bool| {
        server.post_json(
            "/v1/completions",
            &json!({"prompt": format!("{system}{question}"), "max_tokens": 8,
                    "temperature": 0, "ignore_eos": true, "cache_prompt": cache}),
        )
    };
    let first = ask("Where is the tallest mountain?", true);
    let first_prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let second = ask("Which river is the longest?", true);
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let cold = ask("Which river is the longest?", false);
    assert_eq!(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let shared = cold["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap()
        .min(first_prompt);
    assert!(
        cached > 0 && cached % 32 == 0 && cached < shared,
        "{cached} tokens reused of a shared beginning of at most {shared}: {}",
        second["usage"]
    );
    assert_eq!(second["choices"][0]["text"], cold["choices"][0]["text"]);
    server.terminate();
}

/// The demo model, a small real model whose greedy text repeats enough for drafts to be kept.
fn demo_model() -> std::path::PathBuf {
    repo().join("models/shakespeare-moe.gguf")
}

const SPEC_PROMPTS: [&str; 4] = [
    "ROMEO:",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "KING RICHARD III:\nNow is the winter of our discontent",
];

fn spec_body(prompt: &str, stream: bool) -> Value {
    json!({"prompt": prompt, "max_tokens": 120, "temperature": 0, "ignore_eos": true,
           "stream": stream, "stream_options": {"include_usage": true}})
}

/// A streamed completion's text, how many chunks carried text, and its usage.
fn stream_chunks(addr: &str, body: &Value) -> (String, usize, Value) {
    let (status, text) = http(
        addr,
        "POST",
        "/v1/completions",
        Some(&body.to_string()),
        &[],
    );
    assert_eq!(status, 200, "{text}");
    let data = sse_data(&text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{text}");
    let mut out = String::new();
    let mut chunks = 0;
    let mut usage = Value::Null;
    for d in &data[..data.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        if let Some(t) = v["choices"][0]["text"].as_str()
            && !t.is_empty()
        {
            out.push_str(t);
            chunks += 1;
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    (out, chunks, usage)
}

/// Greedy completions of a server with `spec` flags: alone and 4 at once (batched), streamed and
/// not, each exactly the text a server without speculation gives; drafts are kept (metrics,
/// status, usage) and streamed text arrives token by token, not a verified run at a time.
fn speculative_server_matches_plain(model: &Path, spec: &[&str]) {
    let flags = ["--parallel", "4", "--prefill-chunk", "16"];
    let plain = Server::start(model, &flags);
    let want: Vec<String> = SPEC_PROMPTS
        .iter()
        .map(|p| {
            let r = plain.post_json("/v1/completions", &spec_body(p, false));
            assert!(
                r["usage"]["completion_tokens_details"].is_null(),
                "usage reports drafts without speculation: {r}"
            );
            r["choices"][0]["text"].as_str().unwrap().to_string()
        })
        .collect();
    // Without drafts every token whose text is complete sends a chunk.
    let want_chunks: Vec<usize> = SPEC_PROMPTS
        .iter()
        .map(|p| stream_chunks(&plain.addr, &spec_body(p, true)).1)
        .collect();
    // Each emitted token's log-probabilities come from its own verified row.
    let with_logprobs = |server: &Server| {
        let mut body = spec_body(SPEC_PROMPTS[1], false);
        body["logprobs"] = json!(2);
        server.post_json("/v1/completions", &body)["choices"][0]["logprobs"].clone()
    };
    let want_logprobs = with_logprobs(&plain);
    assert!(
        want_logprobs["token_logprobs"]
            .as_array()
            .is_some_and(|l| l.len() == 120),
        "{want_logprobs}"
    );
    plain.terminate();
    assert!(want.iter().all(|w| !w.is_empty()), "{want:?}");

    let mut args = flags.to_vec();
    args.extend_from_slice(spec);
    let server = Server::start(model, &args);
    assert_eq!(
        with_logprobs(&server),
        want_logprobs,
        "{spec:?}: log-probabilities differ"
    );
    for ((p, w), &want_chunks) in SPEC_PROMPTS.iter().zip(&want).zip(&want_chunks) {
        let r = server.post_json("/v1/completions", &spec_body(p, false));
        assert_eq!(r["choices"][0]["text"], w.as_str(), "{spec:?}, {p:?}: {r}");
        let details = &r["usage"]["completion_tokens_details"];
        assert!(
            details["accepted_prediction_tokens"].is_u64()
                && details["rejected_prediction_tokens"].is_u64(),
            "{spec:?}: no draft counts in the usage: {r}"
        );
        let (text, chunks, usage) = stream_chunks(&server.addr, &spec_body(p, true));
        assert_eq!(&text, w, "{spec:?}, {p:?}: the stream differs");
        // Each kept draft sends its own chunk, as it would without drafts; sent a step at a
        // time, the stream would have fewer chunks than that.
        let accepted = &usage["completion_tokens_details"]["accepted_prediction_tokens"];
        assert_eq!(
            chunks, want_chunks,
            "{spec:?}, {p:?}: {chunks} chunks (the plain stream had {want_chunks}; {accepted} \
             drafts kept): text is not streamed as each token is accepted"
        );
    }
    // `n: 2`: the second choice is forked from the first one's session and drafts in its own
    // slot; greedy, both are the plain text.
    let mut body = spec_body(SPEC_PROMPTS[0], false);
    body["n"] = json!(2);
    let r = server.post_json("/v1/completions", &body);
    for k in 0..2 {
        assert_eq!(
            r["choices"][k]["text"],
            want[0].as_str(),
            "{spec:?}: choice {k} of n: 2 differs: {r}"
        );
    }
    for stream in [false, true] {
        let barrier = Arc::new(Barrier::new(SPEC_PROMPTS.len()));
        let threads: Vec<_> = SPEC_PROMPTS
            .iter()
            .map(|p| {
                let (addr, body, barrier) = (
                    server.addr.clone(),
                    spec_body(p, stream),
                    Arc::clone(&barrier),
                );
                std::thread::spawn(move || {
                    barrier.wait();
                    if stream {
                        stream_chunks(&addr, &body).0
                    } else {
                        let (status, text) = http(
                            &addr,
                            "POST",
                            "/v1/completions",
                            Some(&body.to_string()),
                            &[],
                        );
                        assert_eq!(status, 200, "{text}");
                        let v: Value = serde_json::from_str(&text).unwrap();
                        v["choices"][0]["text"].as_str().unwrap().to_string()
                    }
                })
            })
            .collect();
        for (i, (t, w)) in threads.into_iter().zip(&want).enumerate() {
            assert_eq!(
                &t.join().unwrap(),
                w,
                "{spec:?}: prompt {i} differs when batched (stream {stream})"
            );
        }
    }
    let max_batch = server.metric("moeshard_batch_size_max");
    assert!(
        max_batch >= 2.0,
        "{spec:?}: the requests were not batched together (largest step: {max_batch})"
    );
    let drafted = server.metric("moeshard_speculative_drafted_tokens_total");
    let accepted = server.metric("moeshard_speculative_accepted_tokens_total");
    assert!(
        accepted > 0.0 && drafted >= accepted,
        "{spec:?}: drafted {drafted}, accepted {accepted}"
    );
    let (_, status) = http(&server.addr, "GET", "/v1/status", None, &[]);
    let status: Value = serde_json::from_str(&status).unwrap();
    assert_eq!(
        status["server"]["speculative_accepted_tokens_total"].as_f64(),
        Some(accepted),
        "{status}"
    );
    eprintln!("{spec:?}: drafted {drafted}, accepted {accepted}");
    let log = server.terminate();
    assert!(log.contains("speculative:"), "{log}");
}

#[test]
fn speculative_prompt_lookup_serves_the_plain_greedy_text() {
    speculative_server_matches_plain(
        &demo_model(),
        &["--speculative", "prompt-lookup", "--draft-max", "6"],
    );
}

#[test]
fn speculative_draft_model_serves_the_plain_greedy_text() {
    let dir = tempfile::tempdir().unwrap();
    let draft = dir.path().join("draft-q4_0.gguf");
    let draft = draft.to_str().unwrap();
    common::run_ok(&[
        "quantize",
        "--type",
        "q4_0",
        demo_model().to_str().unwrap(),
        draft,
    ]);
    speculative_server_matches_plain(&demo_model(), &["--draft-model", draft]);
}

/// Sliding-window attention (the gpt-oss fixture's window is 8 positions, shorter than the
/// longest drafts): rejected drafts are cut off windowed caches too, alone and batched, and the
/// texts stay the plain ones.
#[test]
fn speculative_server_on_a_sliding_window_model() {
    speculative_server_matches_plain(
        &fixture("gpt-oss", "model-f32.gguf"),
        &["--speculative", "prompt-lookup", "--draft-max", "16"],
    );
}

/// Structured output with drafts: the grammar masks every verified position, so greedy text is
/// the plain server's and sampled text still matches the grammar.
#[test]
fn speculative_server_keeps_structured_output() {
    let model = fixture("qwen3moe", "model-q8_0.gguf");
    let regex = "(la |di |da )+";
    let body = |temperature: f64, seed: u64| {
        json!({"prompt": "Sing: ", "max_tokens": 60, "temperature": temperature, "seed": seed,
               "regex": regex})
    };
    let plain = Server::start(&model, &[]);
    let want = plain.post_json("/v1/completions", &body(0.0, 0));
    plain.terminate();
    let server = Server::start(&model, &["--speculative", "prompt-lookup"]);
    let got = server.post_json("/v1/completions", &body(0.0, 0));
    assert_eq!(
        got["choices"][0]["text"], want["choices"][0]["text"],
        "{got}"
    );
    for seed in 1..4 {
        let r = server.post_json("/v1/completions", &body(1.0, seed));
        let text = r["choices"][0]["text"].as_str().unwrap();
        // Whole words, the last one possibly cut by the token limit.
        let words: Vec<&str> = text.split_inclusive(' ').collect();
        let syllables = ["la ", "di ", "da "];
        let ok = words.split_last().is_some_and(|(last, rest)| {
            rest.iter().all(|w| syllables.contains(w))
                && syllables.iter().any(|s| s.starts_with(last))
        });
        assert!(ok, "seed {seed}: {text:?} does not match {regex}");
    }
    let accepted = server.metric("moeshard_speculative_accepted_tokens_total");
    assert!(accepted > 0.0, "no draft kept under the grammar");
    server.terminate();
}
