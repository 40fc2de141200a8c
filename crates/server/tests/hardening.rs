//! The server on a real socket (127.0.0.1, an ephemeral port), in this process, over a fixture
//! model: `/health` once the scheduler thread is gone, the request and idle timeouts, the
//! connection cap, refusals before tokenizing (prompt text too long for the context, a full
//! queue), and a disk KV entry whose layout the executor refuses. HTTP is spoken over plain
//! `TcpStream`s.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::chat_template::ChatTemplate;
use engine::tokenizer::Tokenizer;
use engine::{Engine, EvalRequest, EvalResult, Executor, LocalExecutor, ModelInfo, Snapshot};
use model::{Compute, KvType, Model};
use serde_json::{Value, json};
use server::{HttpLimits, RunningServer, ServerConfig};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures/qwen3moe/model-q8_0.gguf")
}

/// The fixture's executor, tokenizer and chat template.
fn parts(n_ctx: usize) -> (LocalExecutor, Tokenizer, ChatTemplate) {
    let model = Arc::new(Model::load(fixture()).unwrap());
    let meta = model.files().metadata();
    let tokenizer = Tokenizer::from_metadata(meta).unwrap();
    let template = ChatTemplate::from_metadata(meta)
        .unwrap()
        .unwrap_or_else(|| ChatTemplate::chatml("", ""));
    let exec = LocalExecutor::new(model, Compute::new(1), KvType::F16, n_ctx);
    (exec, tokenizer, template)
}

fn start(cfg: ServerConfig, exec: impl Executor + 'static) -> RunningServer {
    let (_, tokenizer, template) = parts(16);
    let cfg = ServerConfig { port: 0, ..cfg };
    server::start(cfg, Engine::new(Box::new(exec)), tokenizer, template, false).unwrap()
}

/// One request with `Connection: close`: status, body (chunked transfer decoded).
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> (u16, String) {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut rest = &raw[split + 4..];
    if !head.contains("transfer-encoding: chunked") {
        return (status, String::from_utf8_lossy(rest).into_owned());
    }
    let mut out = Vec::new();
    loop {
        let eol = rest.windows(2).position(|w| w == b"\r\n").unwrap();
        let size =
            usize::from_str_radix(std::str::from_utf8(&rest[..eol]).unwrap().trim(), 16).unwrap();
        rest = &rest[eol + 2..];
        if size == 0 {
            break;
        }
        out.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
    (status, String::from_utf8_lossy(&out).into_owned())
}

fn json_of(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

fn metric(addr: SocketAddr, name: &str) -> f64 {
    let (_, text) = http(addr, "GET", "/metrics", "");
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {name}"))
        .parse()
        .unwrap()
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A long greedy generation (the fixture decodes a few thousand tokens a second).
fn long(stream: bool, tokens: usize) -> String {
    json!({"prompt": "hello", "max_tokens": tokens, "temperature": 0, "ignore_eos": true,
           "stream": stream, "cache_prompt": false})
    .to_string()
}

/// An executor whose every evaluation panics: the scheduler thread dies on the first request.
struct PanicOnEval(LocalExecutor);

impl Executor for PanicOnEval {
    fn info(&self) -> &ModelInfo {
        self.0.info()
    }
    fn eval(&mut self, _: &[EvalRequest]) -> engine::Result<Vec<EvalResult>> {
        panic!("injected executor failure");
    }
    fn truncate(&mut self, session: u64, n: usize) -> engine::Result<()> {
        self.0.truncate(session, n)
    }
    fn rewind_point(&self, session: u64, n: usize) -> usize {
        self.0.rewind_point(session, n)
    }
    fn session_len(&self, session: u64) -> usize {
        self.0.session_len(session)
    }
    fn destroy(&mut self, session: u64) {
        self.0.destroy(session)
    }
    fn snapshot(&mut self, session: u64) -> engine::Result<Snapshot> {
        self.0.snapshot(session)
    }
    fn restore(&mut self, session: u64, s: &Snapshot) -> engine::Result<()> {
        self.0.restore(session, s)
    }
    fn describe(&self) -> String {
        "panics".into()
    }
}

#[test]
fn health_reports_503_once_the_scheduler_thread_is_gone() {
    let (exec, ..) = parts(256);
    let server = start(ServerConfig::default(), PanicOnEval(exec));
    let addr = server.addr();
    let (status, body) = http(addr, "GET", "/health", "");
    assert_eq!(
        (status, json_of(&body)["status"].clone()),
        (200, json!("ok"))
    );
    // The scheduler thread panics in its first step; the request in flight gets an error.
    let (status, body) = http(addr, "POST", "/v1/completions", &long(false, 4));
    assert_eq!(status, 500, "{body}");
    wait_until("the health check to notice", || {
        http(addr, "GET", "/health", "").0 == 503
    });
    let (_, body) = http(addr, "GET", "/health", "");
    assert_eq!(json_of(&body)["status"], "scheduler_stopped");
    let (status, body) = http(addr, "POST", "/v1/completions", &long(false, 4));
    assert_eq!(status, 503, "new requests are refused: {body}");
    assert!(
        server.shutdown().is_err(),
        "the panic is reported at shutdown"
    );
}

#[test]
fn the_request_timeout_cuts_a_long_response_but_not_a_flowing_stream() {
    let (exec, ..) = parts(8192);
    let timeout = Duration::from_millis(300);
    let cfg = ServerConfig {
        http: HttpLimits {
            request_timeout: timeout,
            ..HttpLimits::default()
        },
        ..ServerConfig::default()
    };
    let server = start(cfg, exec);
    let addr = server.addr();
    // A non-streamed generation of thousands of tokens: 408, and it is cancelled.
    let t0 = Instant::now();
    let (status, body) = http(addr, "POST", "/v1/completions", &long(false, 8000));
    assert_eq!(status, 408, "{body}");
    assert_eq!(json_of(&body)["error"]["code"], "timeout");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    wait_until("the cancellation", || {
        metric(addr, "moeshard_requests_cancelled_total") == 1.0
    });
    // The same as a stream runs past the timeout to its end.
    let t0 = Instant::now();
    let (status, body) = http(addr, "POST", "/v1/completions", &long(true, 3000));
    let took = t0.elapsed();
    assert_eq!(status, 200, "{body}");
    assert!(
        body.trim_end().ends_with("data: [DONE]"),
        "{}",
        &body[body.len().saturating_sub(300)..]
    );
    assert!(
        took > timeout,
        "the stream should outlast the timeout ({took:?})"
    );
    assert_eq!(metric(addr, "moeshard_requests_succeeded_total"), 1.0);
    server.shutdown().unwrap();
}

#[test]
fn idle_connections_are_closed_and_connections_are_capped() {
    let (exec, ..) = parts(256);
    let idle = Duration::from_millis(700);
    let cfg = ServerConfig {
        http: HttpLimits {
            idle_timeout: idle,
            max_connections: 2,
            ..HttpLimits::default()
        },
        ..ServerConfig::default()
    };
    let server = start(cfg, exec);
    let addr = server.addr();
    // Two connections that send nothing hold both places; a third is answered 503 at once.
    let t0 = Instant::now();
    let mut a = TcpStream::connect(addr).unwrap();
    let mut b = TcpStream::connect(addr).unwrap();
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut raw = Vec::new();
    c.read_to_end(&mut raw).unwrap();
    let (status, body) = parse_response(&raw);
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("too many open connections"), "{body}");
    assert!(
        t0.elapsed() < idle,
        "refused at once, not after the idle timeout"
    );
    // The idle ones are closed by the server after the idle timeout.
    for s in [&mut a, &mut b] {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(s.read(&mut buf).unwrap(), 0, "closed by the server");
    }
    assert!(t0.elapsed() >= idle, "{:?}", t0.elapsed());
    wait_until("the connections to be released", || {
        metric(addr, "moeshard_http_connections") <= 1.0
    });
    assert_eq!(metric(addr, "moeshard_http_connections_refused_total"), 1.0);
    // A keep-alive connection is served, then closed when it stays idle.
    let mut k = TcpStream::connect(addr).unwrap();
    k.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    k.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = k.read(&mut buf).unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&buf[..n])
    );
    let t1 = Instant::now();
    assert_eq!(k.read(&mut buf).unwrap(), 0, "closed once idle");
    assert!(t1.elapsed() >= idle / 2, "{:?}", t1.elapsed());
    server.shutdown().unwrap();
}

#[test]
fn prompts_too_long_and_a_full_queue_are_refused_before_tokenizing() {
    let n_ctx = 64;
    let (exec, tokenizer, _) = parts(n_ctx);
    let limit = n_ctx * tokenizer.max_bytes_per_token();
    let cfg = ServerConfig {
        parallel: 1,
        max_queue: 0,
        ..ServerConfig::default()
    };
    let server = start(cfg, exec);
    let addr = server.addr();
    let text = "a".repeat(limit + 1);
    let (status, body) = http(
        addr,
        "POST",
        "/v1/completions",
        &json!({"prompt": text}).to_string(),
    );
    assert_eq!(status, 400, "{body}");
    let err = &json_of(&body)["error"];
    assert_eq!(
        (err["code"].as_str(), err["param"].as_str()),
        (Some("context_length_exceeded"), Some("prompt"))
    );
    assert!(
        err["message"].as_str().unwrap().contains("bytes of text"),
        "{err}"
    );
    let chat = json!({"messages": [{"role": "user", "content": text}]}).to_string();
    let (status, body) = http(addr, "POST", "/v1/chat/completions", &chat);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("bytes of text"), "{body}");
    // Within the byte bound but over the context once tokenized: the usual refusal.
    let (status, body) = http(
        addr,
        "POST",
        "/v1/completions",
        &json!({"prompt": "a b ".repeat(n_ctx)}).to_string(),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("your prompt is") && !body.contains("bytes of text"),
        "{body}"
    );

    // One slot, no queue: while a stream runs, anything else is refused before its body is
    // even parsed (malformed JSON gets 503, not 400) — a large prompt included.
    let mut running = TcpStream::connect(addr).unwrap();
    let b = long(true, 20_000);
    running
        .write_all(format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}", b.len()).as_bytes())
        .unwrap();
    let mut first = [0u8; 256];
    let n = running.read(&mut first).unwrap();
    assert!(first[..n].starts_with(b"HTTP/1.1 200"));
    let (status, body) = http(addr, "POST", "/v1/completions", "{not json");
    assert_eq!(status, 503, "{body}");
    let big = json!({"prompt": "word ".repeat(limit / 5)}).to_string();
    let t0 = Instant::now();
    let (status, body) = http(addr, "POST", "/v1/completions", &big);
    assert_eq!(status, 503, "{body}");
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    drop(running);
    server.shutdown().unwrap();
}

#[test]
fn a_disk_kv_entry_of_another_layout_is_refused_by_the_executor() {
    let dir = tempfile::tempdir().unwrap();
    let (exec, tokenizer, _) = parts(256);
    let fingerprint = exec.info().fingerprint.clone();
    let prompt = "The quick brown fox jumps over the lazy dog";
    let tokens = tokenizer.encode(prompt, true, true);
    // A readable entry (good checksum) for exactly this prompt, but with twice the kv heads:
    // the executor's layout check must refuse it and the prompt be evaluated instead.
    {
        let mut snap = Snapshot {
            fingerprint: String::new(),
            tokens: tokens.clone(),
            kv_type: KvType::F16,
            n_kv_head: 0,
            head_dim_k: 0,
            head_dim_v: 0,
            layers: Vec::new(),
            last_logits: Vec::new(),
        };
        let mut probe = parts(256).0;
        probe
            .eval(&[EvalRequest {
                session: 1,
                tokens: &tokens,
                logits: model::LogitsWanted::None,
            }])
            .unwrap();
        let good = probe.snapshot(1).unwrap();
        snap.fingerprint = good.fingerprint.clone();
        snap.n_kv_head = good.n_kv_head * 2;
        snap.head_dim_k = good.head_dim_k;
        snap.head_dim_v = good.head_dim_v;
        snap.layers = good
            .layers
            .iter()
            .map(|(k, v)| ([&k[..], k].concat(), [&v[..], v].concat()))
            .collect();
        let mut cache =
            server::disk_cache::DiskCache::open(dir.path(), &fingerprint, 1 << 30).unwrap();
        assert!(cache.save(snap));
        cache.flush();
    }
    let cfg = ServerConfig {
        kv_disk: Some((dir.path().to_path_buf(), 1 << 30)),
        ..ServerConfig::default()
    };
    let server = start(cfg, exec);
    let addr = server.addr();
    let ask = |cache: bool| {
        let (status, body) = http(
            addr,
            "POST",
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "cache_prompt": cache})
                .to_string(),
        );
        assert_eq!(status, 200, "{body}");
        json_of(&body)
    };
    let tried = ask(true);
    assert_eq!(
        tried["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "{tried}"
    );
    assert_eq!(metric(addr, "moeshard_disk_cache_restores_total"), 0.0);
    let cold = ask(false);
    assert_eq!(tried["choices"][0]["text"], cold["choices"][0]["text"]);
    server.shutdown().unwrap();
}
