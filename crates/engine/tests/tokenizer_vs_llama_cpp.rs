//! Randomized cross-check of the tokenizer against llama.cpp's own `llama-tokenize` on the
//! vocabulary goldens' GGUF files, with and without special-token parsing.
//!
//! llama.cpp's answers for the deterministic random texts are stored in
//! `tests/data/tokenizer_fuzz_llama_cpp.json`, so CI checks them without a llama.cpp build. With
//! a build (`tools/llama_cpp/build.sh` puts one in `<cache>/llama.cpp-build`) the test asks
//! llama.cpp directly, and `UPDATE_GOLDENS=1` rewrites the file:
//!
//! ```text
//! LLAMA_TOKENIZE=$PWD/.cache/llama.cpp-build/bin/llama-tokenize UPDATE_GOLDENS=1 \
//!     cargo test -p engine --test tokenizer_vs_llama_cpp
//! ```
//! (`FUZZ_CASES` sets the number of texts per vocabulary when regenerating, 20 by default.)

use std::path::{Path, PathBuf};
use std::process::Command;

use engine::tokenizer::{TokenId, Tokenizer};

fn cache_dir() -> PathBuf {
    std::env::var_os("MOESHARD_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.cache"))
}

/// Deterministic xorshift64* generator (no dependency, same texts on every run).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

const PIECES: &[&str] = &[
    "Hello",
    " world",
    "the",
    " The",
    "I'm",
    " you're",
    " it's",
    "'S",
    "'ll",
    "'VE",
    "don't",
    " 1",
    "12",
    "123",
    "1234567",
    " 3.14",
    "٣٤",
    "½",
    "Ⅻ",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n ",
    "\u{a0}",
    "\u{3000}",
    "\u{2009}",
    "\u{85}",
    ".",
    ",",
    "!",
    "?",
    "...",
    "—",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    "<",
    ">",
    "/",
    "\\",
    "$",
    "+",
    "=",
    "^",
    "~",
    "|",
    "`",
    "@",
    "#",
    "%",
    "&",
    "*",
    "_",
    "-",
    "\"",
    "'",
    "é",
    "ñ",
    "ß",
    "Ü",
    "ç",
    "e\u{301}",
    "\u{301}",
    "Привет",
    " мир",
    "Ελληνικά",
    "עברית",
    "العربية",
    "हिन्दी",
    "ไทย",
    "中文",
    "日本語",
    "ひらがな",
    "カタカナ",
    "한국어",
    "🦙",
    "🚀",
    "😶‍🌫️",
    "👍🏽",
    "\u{378}",
    "\u{e000}",
    "\u{200b}",
    "\u{fe0f}",
    "𝔘𝔫𝔦",
    "ﬁ",
    "Ω",
    "K",
    "ΐ",
    "<s>",
    "</s>",
    "<unk>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|begin_of_text|>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<|assistant|>",
    "<|end|>",
    "<|user|>",
    "<think>",
    "▁",
    "Ġ",
    "fn main() {",
    "    return x;",
    "x += 1",
    "</div>",
    "http://a.b/c?d=e",
];

fn random_text(rng: &mut Rng) -> String {
    let n = 1 + rng.below(24);
    (0..n).map(|_| rng.pick(PIECES)).collect()
}

fn llama_cpp_ids(binary: &Path, vocab: &Path, text: &str, parse_special: bool) -> Vec<TokenId> {
    let dir = std::env::temp_dir().join(format!("moeshard-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let input = dir.join("input.txt");
    std::fs::write(&input, text).expect("write input");
    let mut command = Command::new(binary);
    command.arg("-m").arg(vocab).arg("-f").arg(&input).args([
        "--ids",
        "--no-bos",
        "--no-escape",
        "--log-disable",
    ]);
    if !parse_special {
        command.arg("--no-parse-special");
    }
    if let Some(lib_dir) = binary.parent() {
        command.env("LD_LIBRARY_PATH", lib_dir);
    }
    let output = command.output().expect("run llama-tokenize");
    assert!(
        output.status.success(),
        "llama-tokenize failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let list = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('['))
        .unwrap_or_else(|| panic!("no id list in llama-tokenize output: {stdout}"));
    list.trim_matches(|c| c == '[' || c == ']')
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse().expect("token id"))
        .collect()
}

const VOCABS: &[&str] = &[
    "qwen2",
    "qwen35",
    "llama-bpe",
    "gpt-2",
    "llama-spm",
    "deepseek-llm",
    "deepseek-coder",
    "falcon",
    "starcoder",
    "command-r",
    "phi-3",
    "gemma-4",
    "mpt",
    "refact",
];

fn goldens_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer_fuzz_llama_cpp.json")
}

/// `(vocab, text, parse_special, llama.cpp's ids)` for every case: from `llama-tokenize` when
/// `LLAMA_TOKENIZE` is set (rewriting the goldens with `UPDATE_GOLDENS=1`), else the goldens.
fn expected_cases() -> Vec<(String, String, bool, Vec<TokenId>)> {
    let Some(binary) = std::env::var_os("LLAMA_TOKENIZE").map(PathBuf::from) else {
        let text = std::fs::read_to_string(goldens_path()).expect("read the goldens");
        let v: serde_json::Value = serde_json::from_str(&text).expect("goldens are JSON");
        return v
            .as_array()
            .expect("a list of cases")
            .iter()
            .map(|c| {
                (
                    c["vocab"].as_str().expect("vocab").to_string(),
                    c["text"].as_str().expect("text").to_string(),
                    c["parse_special"].as_bool().expect("parse_special"),
                    c["ids"]
                        .as_array()
                        .expect("ids")
                        .iter()
                        .map(|i| i.as_u64().expect("id") as TokenId)
                        .collect(),
                )
            })
            .collect();
    };
    let cases: usize = std::env::var("FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let mut out = Vec::new();
    for name in VOCABS {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ name.len() as u64);
        for _ in 0..cases {
            let text = random_text(&mut rng);
            for parse_special in [false, true] {
                let ids = llama_cpp_ids(&binary, &vocab_path(name), &text, parse_special);
                out.push((name.to_string(), text.clone(), parse_special, ids));
            }
        }
    }
    if std::env::var_os("UPDATE_GOLDENS").is_some() {
        let json: Vec<serde_json::Value> = out
            .iter()
            .map(|(vocab, text, parse_special, ids)| {
                serde_json::json!({"vocab": vocab, "text": text, "parse_special": parse_special, "ids": ids})
            })
            .collect();
        std::fs::write(
            goldens_path(),
            serde_json::to_string_pretty(&json).expect("serialize") + "\n",
        )
        .expect("write the goldens");
    }
    out
}

fn vocab_path(name: &str) -> PathBuf {
    cache_dir()
        .join("llama-cpp-python/models")
        .join(format!("ggml-vocab-{name}.gguf"))
}

#[test]
fn random_texts_match_llama_cpp() {
    let cases = expected_cases();
    assert!(
        cases.len() >= 2 * VOCABS.len(),
        "only {} cases",
        cases.len()
    );
    let mut tokenizers = std::collections::HashMap::new();
    let mut mismatches = Vec::new();
    for (name, text, parse_special, expected) in &cases {
        let tokenizer = tokenizers.entry(name.clone()).or_insert_with(|| {
            let model = gguf::GgufModel::open(vocab_path(name)).expect("open vocab");
            Tokenizer::from_metadata(model.metadata()).expect("tokenizer")
        });
        let got = tokenizer.encode(text, false, *parse_special);
        if &got != expected {
            mismatches.push(format!(
                "{name} parse_special={parse_special} {text:?}\n  llama.cpp {expected:?}\n  ours      {got:?}"
            ));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} differ:\n{}",
        mismatches.len(),
        cases.len(),
        mismatches.join("\n")
    );
    eprintln!("{} tokenizations match llama.cpp", cases.len());
}
