//! The tokenizer against llama.cpp's vocabulary goldens (`models/ggml-vocab-*.gguf` with their
//! `.inp` / `.out` pairs, from the llama.cpp sources shipped in llama-cpp-python's sdist), plus
//! round trips and special-token parsing on the same vocabularies.
//!
//! The goldens are fetched by `python3 tools/fetch_test_data.py llama-cpp-python` into
//! `$MOESHARD_CACHE` (default `<repo>/.cache`). llama.cpp produces the `.out` ids with
//! `tokenize(text, add_special = false, parse_special = false)`.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use engine::tokenizer::{StreamDecoder, TokenId, Tokenizer};

/// Separator between test inputs in a `.inp` file (llama.cpp's `test-tokenizer-0`).
const INPUT_SEPARATOR: &str = "\n__ggml_vocab_test__\n";

fn cache_dir() -> PathBuf {
    std::env::var_os("MOESHARD_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.cache"))
}

fn vocab_path(name: &str) -> PathBuf {
    let path = cache_dir()
        .join("llama-cpp-python/models")
        .join(format!("ggml-vocab-{name}.gguf"));
    assert!(
        path.exists(),
        "{} is missing: run `python3 tools/fetch_test_data.py llama-cpp-python` first",
        path.display()
    );
    path
}

fn load(name: &str) -> Tokenizer {
    let path = vocab_path(name);
    let model =
        gguf::GgufModel::open(&path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    Tokenizer::from_metadata(model.metadata())
        .unwrap_or_else(|e| panic!("tokenizer of {}: {e}", path.display()))
}

/// Tokenizers are costly to build; each test binary builds each vocabulary once.
fn tokenizer(name: &str) -> &'static Tokenizer {
    static CACHE: OnceLock<std::sync::Mutex<Vec<(String, &'static Tokenizer)>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut entries = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, t)) = entries.iter().find(|(n, _)| n == name) {
        return t;
    }
    let t: &'static Tokenizer = Box::leak(Box::new(load(name)));
    entries.push((name.to_string(), t));
    t
}

struct Golden {
    input: String,
    expected: Vec<TokenId>,
}

fn goldens(name: &str) -> Vec<Golden> {
    let base = vocab_path(name);
    let read = |ext: &str| {
        let path = base.with_extension(format!("gguf.{ext}"));
        std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; run `python3 tools/fetch_test_data.py llama-cpp-python`",
                path.display()
            )
        })
    };
    let raw_inputs = read("inp");
    let raw_outputs = read("out");
    // Split like test-tokenizer-0.cpp: on the separator, no trailing empty input.
    let mut inputs = Vec::new();
    let mut pos = 0;
    while pos < raw_inputs.len() {
        match raw_inputs[pos..].find(INPUT_SEPARATOR) {
            Some(offset) => {
                inputs.push(raw_inputs[pos..pos + offset].to_string());
                pos += offset + INPUT_SEPARATOR.len();
            }
            None => {
                inputs.push(raw_inputs[pos..].to_string());
                break;
            }
        }
    }
    let outputs: Vec<Vec<TokenId>> = raw_outputs
        .lines()
        .map(|line| {
            line.split_whitespace()
                .map(|id| id.parse().unwrap_or_else(|e| panic!("bad id {id:?}: {e}")))
                .collect()
        })
        .collect();
    assert_eq!(
        inputs.len(),
        outputs.len(),
        "{name}: .inp and .out disagree on the number of tests"
    );
    inputs
        .into_iter()
        .zip(outputs)
        .map(|(input, expected)| Golden { input, expected })
        .collect()
}

/// Runs every golden pair of a vocabulary; fails listing each mismatch.
fn check_goldens(name: &str) {
    let tokenizer = tokenizer(name);
    let goldens = goldens(name);
    assert!(!goldens.is_empty(), "{name}: no goldens");
    let mut failures = Vec::new();
    for golden in &goldens {
        let got = tokenizer.encode(&golden.input, false, false);
        if got != golden.expected {
            failures.push(format!(
                "  input {:?}\n    expected {:?}\n    got      {:?}",
                golden.input, golden.expected, got
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{name}: {} of {} goldens differ:\n{}",
        failures.len(),
        goldens.len(),
        failures.join("\n")
    );
    eprintln!(
        "{name}: {} of {} goldens match",
        goldens.len(),
        goldens.len()
    );
}

macro_rules! golden_tests {
    ($($test:ident => $vocab:literal,)*) => {$(
        #[test]
        fn $test() {
            check_goldens($vocab);
        }
    )*};
}

golden_tests! {
    goldens_qwen2 => "qwen2",
    goldens_qwen35 => "qwen35",
    goldens_llama_bpe => "llama-bpe",
    goldens_gpt_2 => "gpt-2",
    goldens_llama_spm => "llama-spm",
    goldens_deepseek_llm => "deepseek-llm",
    goldens_deepseek_coder => "deepseek-coder",
    goldens_falcon => "falcon",
    goldens_mpt => "mpt",
    goldens_starcoder => "starcoder",
    goldens_refact => "refact",
    goldens_command_r => "command-r",
    goldens_phi_3 => "phi-3",
    goldens_gemma_4 => "gemma-4",
}

/// Texts that every byte-level vocabulary must reproduce exactly after a round trip.
const ROUND_TRIP_TEXTS: &[&str] = &[
    "",
    " ",
    "Hello world",
    " Hello world",
    "Hello\n\n\tworld  !",
    "ied 4 ½ months",
    "Führer straße café naïve",
    "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 3333 33333",
    "Этот текст на русском. 这是中文。 これは日本語です。 한국어 텍스트",
    "   leading and trailing   ",
    "\r\n\r\nwindows\r\nlines\n",
    "x = [1, 2, 3]; y = {'a': 1}  # code",
    "<s> </s> <|im_start|> look like specials but are parsed as text",
];

fn check_round_trips(name: &str) {
    let tokenizer = tokenizer(name);
    let mut inputs: Vec<String> = ROUND_TRIP_TEXTS.iter().map(|s| s.to_string()).collect();
    inputs.extend(goldens(name).into_iter().map(|g| g.input));
    for text in &inputs {
        let ids = tokenizer.encode(text, false, false);
        let decoded = tokenizer.decode(&ids);
        assert_eq!(&decoded, text, "{name}: round trip of {text:?} via {ids:?}");

        // Streaming gives the same text, one token at a time.
        let mut stream = StreamDecoder::new();
        let mut streamed: String = ids.iter().map(|&id| stream.push(tokenizer, id)).collect();
        streamed.push_str(&stream.finish());
        // The stream is the plain concatenation of the pieces (it keeps the SentencePiece
        // prefix space that `decode` removes).
        let pieces: Vec<u8> = ids
            .iter()
            .flat_map(|&id| tokenizer.token_to_piece(id).to_vec())
            .collect();
        let expected = String::from_utf8_lossy(&pieces);
        assert_eq!(streamed, expected, "{name}: streaming {text:?}");
    }
}

macro_rules! round_trip_tests {
    ($($test:ident => $vocab:literal,)*) => {$(
        #[test]
        fn $test() {
            check_round_trips($vocab);
        }
    )*};
}

round_trip_tests! {
    round_trip_qwen2 => "qwen2",
    round_trip_llama_bpe => "llama-bpe",
    round_trip_gpt_2 => "gpt-2",
    round_trip_llama_spm => "llama-spm",
    round_trip_deepseek_llm => "deepseek-llm",
}

#[test]
fn special_tokens_are_parsed_only_when_asked() {
    let qwen = tokenizer("qwen2");
    let im_start = qwen
        .token_id("<|im_start|>")
        .expect("qwen2 has <|im_start|>");
    let im_end = qwen.token_id("<|im_end|>").expect("qwen2 has <|im_end|>");
    let text = "<|im_start|>user\nHi<|im_end|>";

    let parsed = qwen.encode(text, false, true);
    assert_eq!(parsed.first(), Some(&im_start));
    assert_eq!(parsed.last(), Some(&im_end));
    assert_eq!(
        parsed[1..parsed.len() - 1],
        qwen.encode("user\nHi", false, false)[..]
    );

    let plain = qwen.encode(text, false, false);
    assert!(!plain.contains(&im_start) && !plain.contains(&im_end));
    assert_eq!(qwen.decode(&plain), text);
    assert_eq!(qwen.decode(&parsed), text);
    assert_eq!(qwen.decode_skip_special(&parsed), "user\nHi");
}

#[test]
fn llama3_special_tokens_and_bos() {
    let llama = tokenizer("llama-bpe");
    let bos = llama.bos().expect("llama3 has a BOS token");
    assert_eq!(llama.token_text(bos), Some("<|begin_of_text|>"));
    assert!(llama.add_bos(), "llama3 adds BOS by default");
    let ids = llama.encode("<|start_header_id|>user<|end_header_id|>", true, true);
    assert_eq!(ids[0], bos);
    assert_eq!(llama.token_text(ids[1]), Some("<|start_header_id|>"));
    assert_eq!(
        llama.token_text(*ids.last().unwrap()),
        Some("<|end_header_id|>")
    );
    let eot = llama.token_id("<|eot_id|>").expect("<|eot_id|>");
    assert!(llama.is_eog(eot));
    assert!(llama.is_eog(llama.eos().expect("eos")));
    assert!(!llama.is_eog(bos));
}

#[test]
fn sentencepiece_bos_and_space_prefix() {
    let spm = tokenizer("llama-spm");
    let ids = spm.encode("Hello world", true, false);
    assert_eq!(ids[0], spm.bos().expect("bos"));
    assert_eq!(ids[1..], spm.encode("Hello world", false, false)[..]);
    assert_eq!(spm.decode_skip_special(&ids), "Hello world");
    // A special token in the text is followed by a fresh space prefix, as llama.cpp does it.
    let with_eos = spm.encode("a</s>b", false, true);
    assert_eq!(with_eos[1], spm.eos().expect("eos"));
    assert_eq!(spm.decode(&with_eos), "a</s> b");
}

#[test]
fn eog_tokens_of_qwen2() {
    let qwen = tokenizer("qwen2");
    for text in ["<|endoftext|>", "<|im_end|>"] {
        let id = qwen.token_id(text).expect(text);
        assert!(qwen.is_eog(id), "{text} ends generation");
    }
    assert!(!qwen.is_eog(qwen.token_id("<|im_start|>").expect("im_start")));
    assert!(qwen.eog_tokens().windows(2).all(|w| w[0] < w[1]));
}

#[test]
fn encoding_100_kb_is_fast() {
    let paragraph = "The quick brown fox jumps over the lazy dog. Ünïcödé, 数字 12345, code: fn main() { println!(\"hi\"); }\n";
    let text = paragraph.repeat(100_000 / paragraph.len() + 1);
    for name in ["qwen2", "llama-bpe", "llama-spm", "gemma-4"] {
        let tokenizer = tokenizer(name);
        let started = Instant::now();
        let ids = tokenizer.encode(&text, false, true);
        let elapsed = started.elapsed();
        assert!(!ids.is_empty());
        eprintln!(
            "{name}: encoded {} bytes into {} tokens in {elapsed:?}",
            text.len(),
            ids.len()
        );
        assert!(
            elapsed.as_secs_f64() < 1.0,
            "{name}: encoding 100 KB took {elapsed:?}"
        );
    }
    let qwen = tokenizer("qwen2");
    assert_eq!(qwen.decode(&qwen.encode(&text, false, true)), text);
}

#[test]
fn unknown_pre_tokenizer_is_named_in_the_error() {
    let path = vocab_path("gpt-2");
    let model = gguf::GgufModel::open(&path).expect("open gpt-2 vocab");
    let mut metadata = model.metadata().clone();
    metadata.insert("tokenizer.ggml.pre", "no-such-pre");
    let error = Tokenizer::from_metadata(&metadata).expect_err("unknown pre must fail");
    let message = error.to_string();
    assert!(message.contains("no-such-pre"), "{message}");
}

#[test]
fn tokenizer_can_be_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<StreamDecoder>();
}
