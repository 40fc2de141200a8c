//! The gpt-oss fixture's tokenizer and chat template, read from its GGUF the way the engine
//! reads them: a BPE vocabulary with the o200k (`gpt-4o`) pre-tokenizer and the harmony
//! special tokens, and llama.cpp's `openai-gpt-oss-120b` template. Both against transformers
//! on the same files (`tools/fixtures/models/generate.py` writes `prompt_tokens.json` and
//! `chat.json`).

use std::path::{Path, PathBuf};

use engine::chat_template::{ChatMessage, ChatTemplate};
use engine::tokenizer::Tokenizer;

fn fixture(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures/gpt-oss")
        .join(file)
}

fn json(file: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixture(file)).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn o200k_pre_tokenizer_and_harmony_template_match_transformers() {
    let model = gguf::GgufModel::open(fixture("model-f32.gguf")).unwrap();
    let meta = model.metadata();
    assert_eq!(meta.get_str("tokenizer.ggml.pre").unwrap(), Some("gpt-4o"));
    let tok = Tokenizer::from_metadata(meta).unwrap();
    let prompt = json("prompt_tokens.json");
    assert_eq!(
        tok.encode(prompt["text"].as_str().unwrap(), true, false),
        ids(&prompt["tokens"]),
        "prompt tokens"
    );
    assert_eq!(tok.eos(), tok.token_id("<|return|>"));

    let chat = json("chat.json");
    let messages: Vec<ChatMessage> = serde_json::from_value(chat["messages"].clone()).unwrap();
    let template = ChatTemplate::from_metadata(meta)
        .unwrap()
        .expect("template");
    let rendered = template
        .render(&messages, true, &serde_json::Map::new())
        .unwrap();
    // The template writes today's date; transformers' rendering was stored with a fixed one.
    let label = "Current date: ";
    let at = rendered.find(label).expect("harmony writes the date") + label.len();
    let rendered = format!(
        "{}{}{}",
        &rendered[..at],
        chat["date"].as_str().unwrap(),
        &rendered[at + 10..]
    );
    assert_eq!(rendered, chat["text"].as_str().unwrap(), "rendered prompt");
    assert_eq!(
        tok.encode(&rendered, false, true),
        ids(&chat["tokens"]),
        "prompt tokens with the harmony special tokens"
    );
}
