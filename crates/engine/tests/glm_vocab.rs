//! The GLM fixtures' tokenizer (`glm4moe`, `glm-dsa`, `glm5-next`), read from their GGUFs the
//! way the engine reads it: the `glm4` pre-tokenizer and GLM's special tokens. GLM's tokenizer
//! starts every text with `[gMASK]<sop>` (the fixtures' ids, from transformers); llama.cpp adds
//! `[gMASK]` as its BOS but not `<sop>` (`tools/fixtures/models/README.md`).

use std::path::{Path, PathBuf};

use engine::tokenizer::Tokenizer;

fn fixture(family: &str, file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures")
        .join(family)
        .join(file)
}

#[test]
fn glm4_pre_tokenizer_and_special_tokens_match_transformers() {
    for family in ["glm4moe", "glm-dsa", "glm5-next"] {
        let model = gguf::GgufModel::open(fixture(family, "model-f32.gguf")).unwrap();
        let meta = model.metadata();
        assert_eq!(
            meta.get_str("tokenizer.ggml.pre").unwrap(),
            Some("glm4"),
            "{family}"
        );
        let tok = Tokenizer::from_metadata(meta).unwrap();
        let path = fixture(family, "prompt_tokens.json");
        let prompt: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let text = prompt["text"].as_str().unwrap();
        let want: Vec<u32> = prompt["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let (gmask, sop) = (tok.token_id("[gMASK]"), tok.token_id("<sop>"));
        assert_eq!((gmask, sop), (Some(want[0]), Some(want[1])), "{family}");
        // The special tokens written out in the text, as a chat template renders them.
        assert_eq!(
            tok.encode(&format!("[gMASK]<sop>{text}"), false, true),
            want,
            "{family}: prompt tokens"
        );
        // Our own BOS handling: llama.cpp's, `[gMASK]` before the text.
        let mut with_bos = vec![want[0]];
        with_bos.extend_from_slice(&want[2..]);
        assert_eq!(tok.encode(text, true, false), with_bos, "{family}: BOS");
        for special in ["<|user|>", "<|assistant|>", "<|system|>", "<|endoftext|>"] {
            let id = tok.token_id(special);
            assert!(id.is_some(), "{family}: {special}");
            assert_eq!(
                tok.encode(special, false, true),
                vec![id.unwrap()],
                "{family}: {special} is one token"
            );
        }
    }
}
