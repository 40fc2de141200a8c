//! Randomized cross-check of the tokenizer against llama.cpp's own `llama-tokenize` on the
//! vocabulary goldens' GGUF files, with and without special-token parsing.
//!
//! Needs a llama.cpp build (`tools/llama_cpp/build.sh` puts one in `<cache>/llama.cpp-build`), so
//! it is ignored by default:
//!
//! ```text
//! LLAMA_TOKENIZE=.cache/llama.cpp-build/bin/llama-tokenize \
//!     cargo test -p engine --test tokenizer_vs_llama_cpp -- --ignored
//! ```
//! (`FUZZ_CASES` sets the number of texts per vocabulary, 20 by default.)

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

#[test]
#[ignore = "needs llama.cpp's llama-tokenize (set LLAMA_TOKENIZE)"]
fn random_texts_match_llama_cpp() {
    let binary = PathBuf::from(
        std::env::var_os("LLAMA_TOKENIZE").expect("set LLAMA_TOKENIZE to llama-tokenize's path"),
    );
    let cases: usize = std::env::var("FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let vocabs = [
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
    let mut mismatches = Vec::new();
    let mut compared = 0;
    for name in vocabs {
        let path = cache_dir()
            .join("llama-cpp-python/models")
            .join(format!("ggml-vocab-{name}.gguf"));
        let model = gguf::GgufModel::open(&path).expect("open vocab");
        let tokenizer = Tokenizer::from_metadata(model.metadata()).expect("tokenizer");
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ name.len() as u64);
        for _ in 0..cases {
            let text = random_text(&mut rng);
            for parse_special in [false, true] {
                let expected = llama_cpp_ids(&binary, &path, &text, parse_special);
                let got = tokenizer.encode(&text, false, parse_special);
                compared += 1;
                if got != expected {
                    mismatches.push(format!(
                        "{name} parse_special={parse_special} {text:?}\n  llama.cpp {expected:?}\n  ours      {got:?}"
                    ));
                }
            }
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {compared} differ:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
    eprintln!("{compared} tokenizations match llama.cpp");
}
