//! Structured output through real processes: `moeshard serve` answers `response_format`
//! (json_schema, json_object), `json_schema`, `grammar` (Lark) and `regex` with text that
//! matches, streamed or not, and refuses malformed ones with a 400 naming the field; and
//! `moeshard run --json-schema` masks on the coordinator whatever the topology — a pipeline and
//! a tensor-parallel group give the single node's constrained text token for token.
//!
//! The model is the qwen3moe fixture (random weights, real byte-level BPE tokenizer): it writes
//! whatever the grammar lets it, the hard case for a mask.

mod common;

use std::time::Duration;

use common::http::http;
use common::{Proc, fixture};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(180);

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "member": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
        },
        "required": ["name", "age", "member"],
        "additionalProperties": false,
    })
}

fn assert_valid(text: &str, schema: &Value) {
    let value: Value =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"));
    if let Err(e) = jsonschema::validate(schema, &value) {
        panic!("{text} does not validate against {schema}: {e}");
    }
}

fn http_addr(p: &Proc) -> String {
    let line = p.wait_for_stderr("listening on http://", T);
    line.rsplit("http://")
        .next()
        .and_then(|s| s.split_whitespace().next())
        .unwrap()
        .to_string()
}

fn post(addr: &str, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = http(addr, "POST", path, Some(&body.to_string()), &[]);
    let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
    (status, value)
}

#[test]
fn serve_constrains_chat_and_completions_and_refuses_bad_grammars() {
    let m = fixture("qwen3moe", "model-q8_0.gguf");
    let m = m.to_str().unwrap();
    let server = Proc::spawn("serve", &["serve", "-m", m, "--port", "0", "-t", "1"]);
    let addr = http_addr(&server);
    let sampling = json!({"temperature": 1.0, "seed": 3, "max_tokens": 400});
    let with = |extra: Value| {
        let mut body = sampling.clone();
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };

    // OpenAI's json_schema response format, chat.
    let (status, r) = post(
        &addr,
        "/v1/chat/completions",
        &with(json!({
            "messages": [{"role": "user", "content": "Describe a person."}],
            "response_format": {"type": "json_schema",
                "json_schema": {"name": "person", "strict": true, "schema": schema()}},
        })),
    );
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
    assert_valid(
        r["choices"][0]["message"]["content"].as_str().unwrap(),
        &schema(),
    );

    // Streamed: the chunks put together are the same kind of document.
    let body = with(json!({
        "messages": [{"role": "user", "content": "Describe a person."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema()}},
        "stream": true,
        "seed": 4,
    }));
    let (status, text) = http(
        &addr,
        "POST",
        "/v1/chat/completions",
        Some(&body.to_string()),
        &[],
    );
    assert_eq!(status, 200, "{text}");
    let mut content = String::new();
    let mut finish = Value::Null;
    for data in text
        .split("\n\n")
        .filter_map(|ev| ev.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter(|d| *d != "[DONE]")
    {
        let chunk: Value = serde_json::from_str(data).unwrap();
        let choice = &chunk["choices"][0];
        content.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
    }
    assert_eq!(finish, "stop", "{text}");
    assert_valid(&content, &schema());

    // Completions: json_object, llama-server's top-level json_schema, a Lark grammar, a regex.
    let completion = |extra: Value| {
        let mut body = with(extra);
        body["prompt"] = json!("Data: ");
        let (status, r) = post(&addr, "/v1/completions", &body);
        assert_eq!(status, 200, "{r}");
        assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
        r["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let object = completion(json!({"response_format": {"type": "json_object"}}));
    assert!(
        serde_json::from_str::<Value>(&object).is_ok_and(|v| v.is_object()),
        "{object:?}"
    );
    assert_valid(&completion(json!({"json_schema": schema()})), &schema());
    let answer = completion(json!({"grammar": r#"start: "color: " ("red" | "green" | "blue")"#}));
    assert!(
        ["color: red", "color: green", "color: blue"].contains(&answer.as_str()),
        "{answer:?}"
    );
    let date = completion(json!({"regex": "20[0-9]{2}-(0[1-9]|1[0-2])"}));
    assert!(
        date.len() == 7 && date.starts_with("20") && date.as_bytes()[4] == b'-',
        "{date:?}"
    );

    // Refusals: 400 with the field named, before any generation.
    for (extra, param, needle) in [
        (
            json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}}}),
            "response_format",
            "invalid JSON schema",
        ),
        (
            json!({"response_format": {"type": "yaml"}}),
            "response_format",
            "unknown response_format type",
        ),
        (
            json!({"grammar": "root ::= \"a\""}),
            "grammar",
            "invalid Lark grammar",
        ),
        (json!({"regex": "(a"}), "regex", "invalid regex"),
        (
            json!({"regex": "a", "json_schema": {"type": "object"}}),
            "regex",
            "at most one",
        ),
    ] {
        let mut body = with(extra);
        body["prompt"] = json!("Data: ");
        let (status, r) = post(&addr, "/v1/completions", &body);
        assert_eq!(status, 400, "{body}: {r}");
        assert_eq!(r["error"]["param"], param, "{r}");
        let message = r["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{message}");
    }
}

/// `moeshard run --json-schema FILE -p PROMPT` with these extra flags; returns the generated text.
fn run_constrained(schema_file: &str, extra: &[&str], workers: &[Vec<&str>]) -> String {
    let m = fixture("qwen3moe", "model-q8_0.gguf");
    let m = m.to_str().unwrap();
    let prompt = "JSON: ";
    let mut args = vec![
        "run",
        "-m",
        m,
        "-p",
        prompt,
        "-n",
        "400",
        "--temp",
        "1",
        "--seed",
        "11",
        "--threads",
        "1",
        "--kv-type",
        "f32",
        "--no-warm",
        "--json-schema",
        schema_file,
    ];
    args.extend_from_slice(extra);
    let coordinator = Proc::spawn("run", &args);
    let _workers: Vec<Proc> = if workers.is_empty() {
        Vec::new()
    } else {
        let addr = format!("127.0.0.1:{}", coordinator.coordinator_port());
        workers
            .iter()
            .map(|w| {
                let mut a = vec!["worker", "-m", m, "--coordinator", &addr];
                a.extend_from_slice(&["--threads", "1", "--kv-type", "f32", "--no-warm"]);
                a.extend_from_slice(&["--insecure"]);
                a.extend_from_slice(w);
                Proc::spawn("worker", &a)
            })
            .collect()
    };
    let (ok, out, err) = coordinator.finish(T);
    assert!(ok, "run {extra:?} failed:\n{err}");
    assert!(
        err.contains("| Stop"),
        "the grammar did not complete:\n{err}"
    );
    out.strip_prefix(prompt)
        .and_then(|t| t.strip_suffix('\n'))
        .unwrap_or_else(|| panic!("unexpected output {out:?}"))
        .to_string()
}

#[test]
fn run_masks_on_the_coordinator_in_every_topology() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("schema.json");
    std::fs::write(&path, schema().to_string()).unwrap();
    let path = path.to_str().unwrap();

    let single = run_constrained(path, &[], &[]);
    assert_valid(&single, &schema());
    let listen = ["--insecure", "--listen", "127.0.0.1:0"];
    let mut pipeline_args = vec!["--layers", "0:1"];
    pipeline_args.extend_from_slice(&listen);
    let pipeline = run_constrained(path, &pipeline_args, &[vec!["--layers", "2:output"]]);
    assert_eq!(pipeline, single, "a 2-stage pipeline's constrained text");
    let mut tp_args = vec!["--tensor-parallel", "--tp-size", "2"];
    tp_args.extend_from_slice(&listen);
    let tensor_parallel = run_constrained(path, &tp_args, &[vec!["--tensor-parallel"]]);
    assert_eq!(tensor_parallel, single, "a 2-rank group's constrained text");

    // A schema that is not JSON, or not a valid schema, fails before generating.
    std::fs::write(
        dir.path().join("bad.json"),
        r#"{"type": "integer", "minimum": 2, "maximum": 1}"#,
    )
    .unwrap();
    let m = fixture("qwen3moe", "model-q8_0.gguf");
    let bad = dir.path().join("bad.json");
    let out = std::process::Command::new(common::bin())
        .args(["run", "-m", m.to_str().unwrap(), "-p", "x", "--no-warm"])
        .args(["--json-schema", bad.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("invalid JSON schema"),
        "{err}"
    );
}
