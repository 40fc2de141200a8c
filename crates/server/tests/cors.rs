//! CORS with `--cors-origin`: a listed origin's preflight is answered with it, another origin
//! gets no `Access-Control-Allow-Origin` (its browser refuses the answer), and the preflight is
//! answered before the API key is checked (browsers send it without the key).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use engine::chat_template::ChatTemplate;
use engine::tokenizer::Tokenizer;
use engine::{Engine, LocalExecutor};
use model::{Compute, KvType, Model};
use server::ServerConfig;

/// The response head of a preflight from `origin`, lower-cased.
fn preflight(addr: SocketAddr, origin: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let req = format!(
        "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nOrigin: {origin}\r\nAccess-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: authorization, content-type\r\n\r\n"
    );
    s.write_all(req.as_bytes()).expect("send");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    String::from_utf8_lossy(&raw).to_ascii_lowercase()
}

#[test]
fn only_listed_origins_are_allowed_and_preflights_need_no_key() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures/qwen3moe/model-q8_0.gguf");
    let model = Arc::new(Model::load(&path).expect("fixture loads"));
    let tokenizer = Tokenizer::from_metadata(model.files().metadata()).expect("tokenizer");
    let exec = LocalExecutor::new(model, Compute::new(1), KvType::F16, 256);
    let cfg = ServerConfig {
        port: 0,
        api_key: Some("secret".into()),
        cors_origins: vec!["https://app.example".into()],
        ..ServerConfig::default()
    };
    let template = ChatTemplate::chatml("", "");
    let server = server::start(cfg, Engine::new(Box::new(exec)), tokenizer, template, false)
        .expect("server starts");
    let allowed = preflight(server.addr(), "https://app.example");
    assert!(allowed.starts_with("http/1.1 200"), "{allowed}");
    assert!(
        allowed.contains("access-control-allow-origin: https://app.example"),
        "{allowed}"
    );
    let other = preflight(server.addr(), "https://evil.example");
    assert!(!other.contains("access-control-allow-origin"), "{other}");

    let bad = ServerConfig {
        port: 0,
        cors_origins: vec!["not\na header".into()],
        ..ServerConfig::default()
    };
    let (model, tokenizer) = {
        let m = Arc::new(Model::load(&path).expect("fixture loads"));
        let t = Tokenizer::from_metadata(m.files().metadata()).expect("tokenizer");
        (m, t)
    };
    let exec = LocalExecutor::new(model, Compute::new(1), KvType::F16, 256);
    let err = server::start(
        bad,
        Engine::new(Box::new(exec)),
        tokenizer,
        ChatTemplate::chatml("", ""),
        false,
    )
    .err()
    .expect("an invalid origin is refused");
    assert!(err.to_string().contains("--cors-origin"), "{err}");
}
