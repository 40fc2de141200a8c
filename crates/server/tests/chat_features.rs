//! Tool calls and reasoning through the whole server (HTTP, template, scheduler, the reply's
//! reading, JSON and SSE), on fixture models whose chat templates are the real ones: gpt-oss'
//! harmony template (in the fixture GGUF), and the Qwen3 and DeepSeek V3.1 templates given as
//! the server's template (as `--chat-template-file` does).
//!
//! The fixtures are tiny random models that never write a tool call by themselves, so the model
//! here is the fixture behind [`Scripted`], a test executor that raises one token's logit in
//! every row the fixture computes: the next token of a script (a realistic output of that
//! family, tokenized by the fixture's own tokenizer, ending in its end-of-turn token). Sampling,
//! detokenizing and everything after it are the production path.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use engine::chat_template::ChatTemplate;
use engine::tokenizer::Tokenizer;
use engine::{Engine, EvalRequest, EvalResult, Executor, LocalExecutor, ModelInfo, Snapshot};
use model::{Compute, KvType, Model};
use serde_json::{Value, json};
use server::{RunningServer, ServerConfig};

fn repo_path(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

/// The fixture model, whose every computed logits row is steered to the script's next token.
struct Scripted {
    inner: LocalExecutor,
    script: Vec<u32>,
    /// Each session's tokens, to know where in the script it is.
    history: HashMap<u64, Vec<u32>>,
}

impl Scripted {
    /// The script token after the longest script prefix the history ends with.
    fn next(&self, history: &[u32]) -> u32 {
        let longest = (0..self.script.len())
            .rev()
            .find(|&k| history.ends_with(&self.script[..k]))
            .unwrap_or(0);
        self.script[longest]
    }
}

impl Executor for Scripted {
    fn info(&self) -> &ModelInfo {
        self.inner.info()
    }
    fn eval(&mut self, batch: &[EvalRequest]) -> engine::Result<Vec<EvalResult>> {
        let mut results = self.inner.eval(batch)?;
        for (req, result) in batch.iter().zip(&mut results) {
            let history = self.history.entry(req.session).or_default();
            history.extend_from_slice(req.tokens);
            let Some(last) = result.n_rows.checked_sub(1) else {
                continue;
            };
            let next = self.next(&self.history[&req.session]);
            let n_vocab = result.n_vocab;
            let row = &mut result.logits[last * n_vocab..(last + 1) * n_vocab];
            let max = row.iter().copied().fold(f32::MIN, f32::max);
            row[next as usize] = max + 30.0;
        }
        Ok(results)
    }
    fn truncate(&mut self, session: u64, n: usize) -> engine::Result<()> {
        self.inner.truncate(session, n)?;
        self.history.entry(session).or_default().truncate(n);
        Ok(())
    }
    fn rewind_point(&self, session: u64, n: usize) -> usize {
        self.inner.rewind_point(session, n)
    }
    fn session_len(&self, session: u64) -> usize {
        self.inner.session_len(session)
    }
    fn destroy(&mut self, session: u64) {
        self.history.remove(&session);
        self.inner.destroy(session)
    }
    fn snapshot(&mut self, session: u64) -> engine::Result<Snapshot> {
        self.inner.snapshot(session)
    }
    fn restore(&mut self, session: u64, s: &Snapshot) -> engine::Result<()> {
        self.inner.restore(session, s)?;
        self.history.insert(session, s.tokens.clone());
        Ok(())
    }
    fn describe(&self) -> String {
        "scripted fixture".into()
    }
}

/// A server over `fixture` (a directory of crates/model/tests/fixtures) with the template of
/// `template_file` (else the GGUF's), whose model writes `output` and then `end_token`.
fn serve(
    fixture: &str,
    template_file: Option<&str>,
    output: &str,
    end_token: &str,
) -> RunningServer {
    let model_path = repo_path(&format!(
        "crates/model/tests/fixtures/{fixture}/model-q8_0.gguf"
    ));
    let model = Arc::new(Model::load(&model_path).expect("fixture loads"));
    let meta = model.files().metadata();
    let tokenizer = Tokenizer::from_metadata(meta).expect("tokenizer");
    let template = match template_file {
        Some(f) => {
            let source = std::fs::read_to_string(repo_path(f)).expect("template file");
            ChatTemplate::new(source, "", "<|im_end|>").expect("template compiles")
        }
        None => ChatTemplate::from_metadata(meta)
            .expect("template metadata")
            .expect("the fixture has a template"),
    };
    let end = tokenizer.token_id(end_token).expect("end token");
    assert!(tokenizer.is_eog(end), "{end_token} ends a turn");
    let mut script = tokenizer.encode(output, false, true);
    assert_eq!(tokenizer.decode(&script), output, "the script round-trips");
    script.push(end);
    let exec = Scripted {
        inner: LocalExecutor::new(model, Compute::new(1), KvType::F16, 2048),
        script,
        history: HashMap::new(),
    };
    let cfg = ServerConfig {
        port: 0,
        parallel: 2,
        ..ServerConfig::default()
    };
    server::start(cfg, Engine::new(Box::new(exec)), tokenizer, template, false)
        .expect("server starts")
}

/// One request with `Connection: close`: status, body (chunked transfer decoded).
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120)))
        .expect("timeout");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("send");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head");
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    let mut rest = &raw[split + 4..];
    if !head.contains("transfer-encoding: chunked") {
        return (status, String::from_utf8_lossy(rest).into_owned());
    }
    let mut out = Vec::new();
    loop {
        let eol = rest.windows(2).position(|w| w == b"\r\n").expect("chunk");
        let size = usize::from_str_radix(std::str::from_utf8(&rest[..eol]).unwrap().trim(), 16)
            .expect("chunk size");
        rest = &rest[eol + 2..];
        if size == 0 {
            break;
        }
        out.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
    (status, String::from_utf8_lossy(&out).into_owned())
}

fn post(addr: SocketAddr, path: &str, body: &Value) -> Value {
    let (status, text) = http(addr, "POST", path, &body.to_string());
    assert_eq!(status, 200, "{path}: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// The `data:` events of an SSE body, `[DONE]` checked and left out.
fn sse(addr: SocketAddr, body: &Value) -> Vec<Value> {
    let (status, text) = http(addr, "POST", "/v1/chat/completions", &body.to_string());
    assert_eq!(status, 200, "{text}");
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect()
}

/// A stream's chunks folded the way OpenAI clients fold them: per choice, content and
/// reasoning concatenated, tool calls assembled by index, the last finish reason.
#[derive(Debug, Default, PartialEq)]
struct Folded {
    content: String,
    reasoning: String,
    calls: Vec<(String, String, String)>,
    finish: String,
}

fn fold(chunks: &[Value]) -> Vec<Folded> {
    let mut out: Vec<Folded> = Vec::new();
    for c in chunks {
        for choice in c["choices"].as_array().expect("choices") {
            let i = choice["index"].as_u64().expect("index") as usize;
            if out.len() <= i {
                out.resize_with(i + 1, Folded::default);
            }
            let f = &mut out[i];
            let d = &choice["delta"];
            f.content += d["content"].as_str().unwrap_or("");
            f.reasoning += d["reasoning_content"].as_str().unwrap_or("");
            for call in d["tool_calls"].as_array().into_iter().flatten() {
                let j = call["index"].as_u64().expect("tool call index") as usize;
                if f.calls.len() <= j {
                    f.calls.resize(j + 1, Default::default());
                }
                let (id, name, args) = &mut f.calls[j];
                *id += call["id"].as_str().unwrap_or("");
                *name += call["function"]["name"].as_str().unwrap_or("");
                *args += call["function"]["arguments"].as_str().unwrap_or("");
            }
            if let Some(r) = choice["finish_reason"].as_str() {
                f.finish = r.to_string();
            }
        }
    }
    out
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    }})
}

fn ask(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [weather_tool()],
        "temperature": 0,
        "max_tokens": 200,
    });
    for (k, v) in extra.as_object().expect("object") {
        body[k] = v.clone();
    }
    body
}

/// The call every scenario's model makes, as both reply shapes carry it.
fn check_call(message: &Value) {
    let calls = message["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls.len(), 1, "{message}");
    assert_eq!(calls[0]["type"], "function");
    assert!(
        calls[0]["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("call_"))
    );
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().expect("text"))
            .expect("arguments are JSON text");
    assert_eq!(args, json!({"city": "Paris"}));
}

/// Non-streamed and streamed replies of a model that reasons and then calls the tool.
fn check_reasoned_call(addr: SocketAddr, reasoning: &str) {
    let r = post(addr, "/v1/chat/completions", &ask(json!({})));
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
    assert_eq!(choice["message"]["content"], Value::Null, "{r}");
    assert_eq!(choice["message"]["reasoning_content"], reasoning, "{r}");
    check_call(&choice["message"]);

    let chunks = sse(addr, &ask(json!({"stream": true})));
    let folded = fold(&chunks);
    assert_eq!(folded.len(), 1);
    assert_eq!(folded[0].finish, "tool_calls");
    assert_eq!(folded[0].reasoning, reasoning);
    assert_eq!(folded[0].content, "");
    let call_chunks = chunks
        .iter()
        .filter(|c| !c["choices"][0]["delta"]["tool_calls"].is_null())
        .count();
    assert_eq!(call_chunks, 1, "a complete call is streamed once");
    let (id, name, args) = &folded[0].calls[0];
    let streamed = json!({"tool_calls": [{"id": id, "type": "function",
        "function": {"name": name, "arguments": args}}]});
    check_call(&streamed);

    // n = 2: both choices (the second forked from the first's prompt) call the tool.
    let r = post(addr, "/v1/chat/completions", &ask(json!({"n": 2})));
    let choices = r["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 2);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        check_call(&c["message"]);
    }
}

const HARMONY_CALL: &str = "<|channel|>analysis<|message|>The user wants the weather in Paris; call get_weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}";

#[test]
fn gpt_oss_harmony_tool_call_with_reasoning() {
    let server = serve("gpt-oss", None, HARMONY_CALL, "<|call|>");
    let addr = server.addr();
    let prompt = post(addr, "/apply-template", &ask(json!({})))["prompt"]
        .as_str()
        .expect("prompt")
        .to_string();
    assert!(prompt.contains("namespace functions {"), "{prompt}");
    assert!(prompt.contains("type get_weather = "), "{prompt}");
    assert!(prompt.ends_with("<|start|>assistant"), "{prompt}");
    check_reasoned_call(
        addr,
        "The user wants the weather in Paris; call get_weather.",
    );

    // The call and its result go back to the template in the shape harmony expects.
    let round_trip = json!({"tools": [weather_tool()], "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]});
    let prompt = post(addr, "/apply-template", &round_trip)["prompt"]
        .as_str()
        .expect("prompt")
        .to_string();
    assert!(
        prompt.contains("<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|>"),
        "{prompt}"
    );
    assert!(
        prompt.contains(
            "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\"18 C\"<|end|>"
        ),
        "{prompt}"
    );

    // reasoning_format none leaves the analysis message in the content.
    let r = post(
        addr,
        "/v1/chat/completions",
        &ask(json!({"reasoning_format": "none"})),
    );
    let content = r["choices"][0]["message"]["content"]
        .as_str()
        .expect("text");
    assert!(
        content.starts_with("<|channel|>analysis<|message|>The user wants"),
        "{r}"
    );
    assert!(r["choices"][0]["message"]["reasoning_content"].is_null());
}

#[test]
fn gpt_oss_final_answer_and_reasoning_effort() {
    let output = "<|channel|>analysis<|message|>Greet back.<|end|><|start|>assistant<|channel|>final<|message|>Hello there!";
    let server = serve("gpt-oss", None, output, "<|return|>");
    let addr = server.addr();
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "temperature": 0,
                      "reasoning_effort": "high"});
    let prompt = post(addr, "/apply-template", &body)["prompt"]
        .as_str()
        .expect("prompt")
        .to_string();
    assert!(prompt.contains("Reasoning: high"), "{prompt}");
    let r = post(addr, "/v1/chat/completions", &body);
    let m = &r["choices"][0]["message"];
    assert_eq!(m["content"], "Hello there!", "{r}");
    assert_eq!(m["reasoning_content"], "Greet back.");
    assert!(m["tool_calls"].is_null());
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let folded = fold(&sse(addr, &stream_body));
    assert_eq!(folded[0].content, "Hello there!");
    assert_eq!(folded[0].reasoning, "Greet back.");
    assert_eq!(folded[0].finish, "stop");
}

const QWEN3_CALL: &str = "<think>\nThe user wants the weather in Paris.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

#[test]
fn qwen3_tool_call_with_reasoning() {
    let server = serve(
        "qwen3moe",
        Some("crates/engine/tests/data/chat/qwen3.jinja"),
        QWEN3_CALL,
        "<|im_end|>",
    );
    let addr = server.addr();
    let prompt = post(addr, "/apply-template", &ask(json!({})))["prompt"]
        .as_str()
        .expect("prompt")
        .to_string();
    assert!(
        prompt
            .contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\""),
        "{prompt}"
    );
    check_reasoned_call(addr, "The user wants the weather in Paris.");
    // Without tools in the request the same text is content (after the reasoning).
    let mut no_tools = ask(json!({}));
    no_tools.as_object_mut().expect("object").remove("tools");
    let r = post(addr, "/v1/chat/completions", &no_tools);
    let content = r["choices"][0]["message"]["content"]
        .as_str()
        .expect("text");
    assert!(content.starts_with("<tool_call>"), "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
}

#[test]
fn deepseek_v3_1_tool_call_after_forced_thinking() {
    // The V3.1 template opens `<think>` in the prompt when thinking is on.
    let output = "Paris weather needed.</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    let server = serve(
        "deepseek2",
        Some("crates/engine/tests/data/chat/deepseek-v3.1.jinja"),
        output,
        "<|end_of_text|>",
    );
    let addr = server.addr();
    let thinking = json!({"chat_template_kwargs": {"thinking": true}});
    let prompt = post(addr, "/apply-template", &ask(thinking.clone()))["prompt"]
        .as_str()
        .expect("prompt")
        .to_string();
    assert!(prompt.ends_with("<｜Assistant｜><think>"), "{prompt}");
    let r = post(addr, "/v1/chat/completions", &ask(thinking.clone()));
    let m = &r["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], "Paris weather needed.", "{r}");
    check_call(m);
    assert_eq!(r["choices"][0]["finish_reason"], "tool_calls");
    let mut stream = ask(thinking);
    stream["stream"] = json!(true);
    let folded = fold(&sse(addr, &stream));
    assert_eq!(folded[0].reasoning, "Paris weather needed.");
    assert_eq!(folded[0].calls.len(), 1);
    assert_eq!(folded[0].finish, "tool_calls");
}

#[test]
fn logprobs_of_a_steered_model_and_bad_requests() {
    let server = serve("gpt-oss", None, HARMONY_CALL, "<|call|>");
    let addr = server.addr();
    let r = post(
        addr,
        "/v1/chat/completions",
        &ask(json!({"logprobs": true, "top_logprobs": 2})),
    );
    let content = r["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("logprobs");
    // Every token but the final `<|call|>` (which ends the turn and is not text).
    let completion = r["usage"]["completion_tokens"].as_u64().expect("usage") as usize;
    assert_eq!(content.len(), completion - 1);
    for t in content {
        // The steered token has nearly all the probability.
        assert!(t["logprob"].as_f64().expect("logprob") > -1e-3, "{t}");
        assert_eq!(t["top_logprobs"][0]["token"], t["token"]);
        assert_eq!(t["top_logprobs"].as_array().map(Vec::len), Some(2));
    }
    for (body, param) in [
        (ask(json!({"tool_choice": "required"})), "tool_choice"),
        (ask(json!({"tools": [{"type": "function"}]})), "tools"),
        (ask(json!({"top_logprobs": 2})), "top_logprobs"),
        (ask(json!({"reasoning_format": "xml"})), "reasoning_format"),
        (ask(json!({"n": 0})), "n"),
    ] {
        let (status, text) = http(addr, "POST", "/v1/chat/completions", &body.to_string());
        assert_eq!(status, 400, "{text}");
        let v: Value = serde_json::from_str(&text).expect("JSON error");
        assert_eq!(v["error"]["param"], param, "{text}");
    }
}
