//! Structured output end to end on a real (tiny, random-weight) model with a real tokenizer:
//! the qwen3moe fixture (byte-level BPE, 336 tokens; 4 layers of width 256, so a token costs
//! little even in a debug build). A random model is the hard case for a grammar — it goes
//! wherever the mask lets it — so every output that ends must parse and validate against its
//! schema, and one that does not end must be one cut by `max_tokens`.
//!
//! The vocabulary conversion is checked on llama.cpp's SentencePiece (byte fallback) and GPT-2
//! vocabularies as well (`$MOESHARD_CACHE`, as `tokenizer_goldens.rs`).

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use engine::generate::{FinishReason, GenerateOptions, generate};
use engine::grammar::token_bytes;
use engine::local::LocalExecutor;
use engine::tokenizer::Tokenizer;
use engine::{
    Engine, GrammarCompiler, GrammarError, GrammarSpec, Sampler, SamplerConfig, TokenConstraint,
};
use model::{Compute, KvType, Model};
use proptest::prelude::*;
use serde_json::{Value, json};

const N_CTX: usize = 1024;
/// Enough for every schema the strategy below makes to complete under almost any draw (the
/// largest need about 150 tokens when each step adds one byte); whitespace between tokens is
/// free-form (llguidance's default), so a few runs may still be cut.
const MAX_TOKENS: usize = 400;

struct Fixture {
    model: Arc<Model>,
    tokenizer: Tokenizer,
    grammars: GrammarCompiler,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../model/tests/fixtures/qwen3moe/model-q8_0.gguf");
        let model = Model::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let tokenizer = Tokenizer::from_metadata(model.files().metadata()).unwrap();
        let grammars = GrammarCompiler::new(&tokenizer).unwrap();
        Fixture {
            model: Arc::new(model),
            tokenizer,
            grammars,
        }
    })
}

struct Output {
    text: String,
    finish: FinishReason,
    tokens: Vec<u32>,
}

fn run(grammar: TokenConstraint, sampler: SamplerConfig, max_tokens: usize) -> Output {
    let f = fixture();
    let exec = LocalExecutor::new(Arc::clone(&f.model), Compute::new(1), KvType::F32, N_CTX);
    let mut engine = Engine::new(Box::new(exec));
    let mut session = engine.new_session();
    let prompt = f.tokenizer.encode("Answer in JSON: ", true, false);
    let mut sampler = Sampler::new(sampler).with_grammar(Some(grammar));
    let opts = GenerateOptions {
        max_tokens,
        ..Default::default()
    };
    let mut text = String::new();
    let stats = generate(
        &mut engine,
        &mut session,
        &f.tokenizer,
        &mut sampler,
        &prompt,
        &opts,
        &mut |t| {
            text.push_str(t);
            true
        },
    )
    .unwrap();
    Output {
        text,
        finish: stats.finish,
        tokens: stats.tokens,
    }
}

fn sampling(seed: u64, temperature: f32) -> SamplerConfig {
    SamplerConfig {
        temperature,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed,
        ..SamplerConfig::default()
    }
}

/// A completed output is valid JSON for `schema`; an incomplete one used every token it had.
/// Either way no whitespace run is longer than the 22 characters allowed between two JSON
/// tokens (the strategy's strings are shorter).
fn check(schema: &Value, out: &Output, max_tokens: usize) -> Result<(), TestCaseError> {
    let longest_blank = out
        .text
        .split(|c: char| !c.is_ascii_whitespace())
        .map(str::len)
        .max()
        .unwrap_or(0);
    prop_assert!(
        longest_blank <= 22,
        "{longest_blank} blanks in {:?}",
        out.text
    );
    match out.finish {
        FinishReason::Stop => {
            let eog = out.tokens.last().copied();
            prop_assert!(
                eog.is_some_and(|t| fixture().tokenizer.is_eog(t)),
                "ended by an end-of-generation token"
            );
            let value: Value = serde_json::from_str(&out.text)
                .map_err(|e| TestCaseError::fail(format!("{:?} does not parse: {e}", out.text)))?;
            if let Err(e) = jsonschema::validate(schema, &value) {
                return Err(TestCaseError::fail(format!(
                    "{} does not validate against {schema}: {e}",
                    out.text
                )));
            }
        }
        FinishReason::Length => prop_assert_eq!(out.tokens.len(), max_tokens),
        other => prop_assert!(false, "unexpected finish {other:?} for {:?}", out.text),
    }
    Ok(())
}

/// A short string of letters and digits (enum members, property names).
fn word() -> impl Strategy<Value = String> {
    "[a-z][a-z0-9_]{0,5}"
}

fn scalar_schema() -> impl Strategy<Value = Value> {
    prop_oneof![
        (0usize..6, 0usize..6).prop_map(|(a, b)| {
            let (min, max) = (a.min(b), a.max(b));
            json!({"type": "string", "minLength": min, "maxLength": max})
        }),
        (-1000i64..1000, 0i64..1000)
            .prop_map(|(lo, span)| json!({"type": "integer", "minimum": lo, "maximum": lo + span})),
        Just(json!({"type": "boolean"})),
        prop::collection::vec(word(), 1..4).prop_map(|words| json!({"enum": words})),
        prop::collection::vec(-50i64..50, 1..4).prop_map(|ints| json!({"enum": ints})),
    ]
}

fn leaf_schema() -> impl Strategy<Value = Value> {
    prop_oneof![
        3 => scalar_schema(),
        1 => (scalar_schema(), 0usize..3, 0usize..3).prop_map(|(items, a, b)| {
            json!({"type": "array", "items": items, "minItems": a.min(b), "maxItems": a.max(b)})
        }),
    ]
}

/// An object of 1–3 properties from `value`, some of them required, nothing else allowed.
fn object_schema(value: impl Strategy<Value = Value>) -> impl Strategy<Value = Value> {
    prop::collection::btree_map(word(), (value, any::<bool>()), 1..4).prop_map(|props| {
        let required: Vec<&String> = props
            .iter()
            .filter(|(_, (_, req))| *req)
            .map(|(k, _)| k)
            .collect();
        let properties: serde_json::Map<String, Value> = props
            .iter()
            .map(|(k, (v, _))| (k.clone(), v.clone()))
            .collect();
        json!({
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": false,
        })
    })
}

/// Objects whose properties are scalars, arrays of scalars or objects of those (one level).
fn schema() -> impl Strategy<Value = Value> {
    object_schema(prop_oneof![
        3 => leaf_schema(),
        1 => object_schema(leaf_schema()),
    ])
}

proptest! {
    // Each case is one generation of up to MAX_TOKENS steps of a tiny model: well under a
    // second each with the test profile.
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn every_completed_output_validates_against_its_schema(
        schema in schema(),
        seed in any::<u64>(),
        temperature in prop_oneof![Just(0.0f32), 0.5f32..1.5],
    ) {
        let grammar = fixture()
            .grammars
            .compile(&GrammarSpec::JsonSchema(schema.clone()))
            .map_err(|e| TestCaseError::fail(format!("{schema}: {e}")))?;
        let out = run(grammar, sampling(seed, temperature), MAX_TOKENS);
        eprintln!("{:?} after {} tokens: {}", out.finish, out.tokens.len(), out.text);
        check(&schema, &out, MAX_TOKENS)?;
    }
}

#[test]
fn a_bounded_schema_completes_and_validates_under_many_seeds() {
    // Every part bounded: each of these generations must end by itself, well within the limit.
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 4},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        },
        "required": ["name", "age", "ok", "tags"],
        "additionalProperties": false,
        "x-guidance": {"whitespace_flexible": false},
    });
    for seed in 0..6 {
        let grammar = fixture()
            .grammars
            .compile(&GrammarSpec::JsonSchema(schema.clone()))
            .unwrap();
        let out = run(grammar, sampling(seed, 1.0), MAX_TOKENS);
        assert_eq!(
            out.finish,
            FinishReason::Stop,
            "seed {seed}: {:?}",
            out.text
        );
        let value: Value = serde_json::from_str(&out.text).unwrap();
        jsonschema::validate(&schema, &value)
            .unwrap_or_else(|e| panic!("seed {seed}: {} invalid: {e}", out.text));
    }
}

#[test]
fn json_object_mode_gives_an_object() {
    let mut completed = 0;
    for seed in 0..4 {
        let grammar = fixture()
            .grammars
            .compile(&GrammarSpec::JsonObject)
            .unwrap();
        let out = run(grammar, sampling(seed, 1.0), MAX_TOKENS);
        if out.finish == FinishReason::Stop {
            // Syntax only: any JSON number is allowed, and serde_json refuses to turn one like
            // `5E676608` into an f64 (the JSON grammar has no bound; Python reads it as inf).
            serde_json::from_str::<serde::de::IgnoredAny>(&out.text)
                .unwrap_or_else(|e| panic!("seed {seed}: {:?}: {e}", out.text));
            assert!(
                out.text.trim_start().starts_with('{'),
                "seed {seed}: {}",
                out.text
            );
            completed += 1;
        } else {
            assert_eq!(out.finish, FinishReason::Length);
        }
    }
    // `{}` is always one step away, so a random model closes its object in most runs.
    assert!(completed > 0, "no run completed its object");
}

#[test]
fn regex_and_lark_outputs_match_and_the_limit_cuts_mid_grammar() {
    let f = fixture();
    let regex = f
        .grammars
        .compile(&GrammarSpec::Regex("[0-9]{3}-[a-c]{2}".into()))
        .unwrap();
    let out = run(regex, SamplerConfig::greedy(), 64);
    assert_eq!(out.finish, FinishReason::Stop);
    let b = out.text.as_bytes();
    assert!(
        b.len() == 6
            && b[..3].iter().all(u8::is_ascii_digit)
            && b[3] == b'-'
            && b[4..].iter().all(|c| (b'a'..=b'c').contains(c)),
        "{:?}",
        out.text
    );

    let lark = r#"start: "answer: " ("yes" | "no")"#;
    for seed in 0..3 {
        let grammar = f.grammars.compile(&GrammarSpec::Lark(lark.into())).unwrap();
        let out = run(grammar, sampling(seed, 1.0), 64);
        assert_eq!(out.finish, FinishReason::Stop);
        assert!(
            ["answer: yes", "answer: no"].contains(&out.text.as_str()),
            "{:?}",
            out.text
        );
    }

    // Cut by the token limit: the output is a strict prefix of a match, finish "length".
    let grammar = f
        .grammars
        .compile(&GrammarSpec::Regex("x{40}".into()))
        .unwrap();
    let out = run(grammar, SamplerConfig::greedy(), 3);
    assert_eq!(out.finish, FinishReason::Length);
    assert!(
        !out.text.is_empty() && out.text.len() < 40 && out.text.bytes().all(|c| c == b'x'),
        "{:?}",
        out.text
    );
}

#[test]
fn a_completed_grammar_allows_only_end_of_generation() {
    let f = fixture();
    let mut grammar = f
        .grammars
        .compile(&GrammarSpec::Regex("ab".into()))
        .unwrap();
    for piece in [&b"a"[..], b"b"] {
        let id = (0..f.tokenizer.vocab_size() as u32)
            .find(|&id| f.tokenizer.token_to_piece(id) == piece && !f.tokenizer.is_control(id))
            .expect("the fixture has single-letter tokens");
        grammar.commit(id).unwrap();
    }
    let mut logits = vec![0.0f32; f.model.hp.n_vocab];
    grammar.mask(&mut logits).unwrap();
    let allowed: Vec<u32> = (0..logits.len() as u32)
        .filter(|&id| logits[id as usize].is_finite())
        .collect();
    assert!(!allowed.is_empty());
    assert!(
        allowed.iter().all(|&id| f.tokenizer.is_eog(id)),
        "only end-of-generation tokens, got {allowed:?}"
    );
}

#[test]
fn invalid_schemas_grammars_and_regexes_are_refused_at_compile_time() {
    let g = &fixture().grammars;
    for (spec, needle) in [
        (
            GrammarSpec::Lark("start: undefined_rule".into()),
            "Lark grammar",
        ),
        (GrammarSpec::Lark("this is not lark".into()), "Lark grammar"),
        (GrammarSpec::Regex("(unclosed".into()), "regex"),
        (
            GrammarSpec::JsonSchema(json!({"type": "no-such-type"})),
            "JSON schema",
        ),
        (
            GrammarSpec::JsonSchema(json!({"type": "integer", "minimum": 5, "maximum": 1})),
            "JSON schema",
        ),
    ] {
        match g.compile(&spec) {
            Err(e @ GrammarError::Invalid { .. }) => {
                assert!(e.to_string().contains(needle), "{spec:?}: {e}")
            }
            Err(e) => panic!("{spec:?}: wrong error kind: {e}"),
            Ok(_) => panic!("{spec:?} compiled"),
        }
    }
}

fn cache_vocab(name: &str) -> Tokenizer {
    let cache = std::env::var_os("MOESHARD_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.cache"));
    let path = cache
        .join("llama-cpp-python/models")
        .join(format!("ggml-vocab-{name}.gguf"));
    assert!(
        path.exists(),
        "{} is missing: run `python3 tools/fetch_test_data.py llama-cpp-python` first",
        path.display()
    );
    let model = gguf::GgufModel::open(&path).unwrap();
    Tokenizer::from_metadata(model.metadata()).unwrap()
}

fn id(t: &Tokenizer, text: &str) -> usize {
    t.token_id(text)
        .unwrap_or_else(|| panic!("no token {text:?}")) as usize
}

#[test]
fn vocabulary_bytes_follow_the_tokenizer() {
    // SentencePiece with byte fallback: `<0x41>` is the byte, `▁` a space, `<s>` special.
    let spm = cache_vocab("llama-spm");
    let words = token_bytes(&spm);
    assert_eq!(words.len(), spm.vocab_size());
    assert_eq!(words[id(&spm, "<0x41>")], b"A");
    assert_eq!(words[id(&spm, "<0x0A>")], b"\n");
    assert_eq!(words[id(&spm, "▁the")], b" the");
    assert_eq!(words[id(&spm, "<s>")], b"\xff<s>");
    assert_eq!(words[id(&spm, "</s>")], b"\xff</s>");
    assert!(GrammarCompiler::new(&spm).is_ok());

    // GPT-2 byte-level BPE: `Ġ` is a space, `Ċ` a newline, `<|endoftext|>` special (EOS).
    let gpt2 = cache_vocab("gpt-2");
    let words = token_bytes(&gpt2);
    assert_eq!(words[id(&gpt2, "Ġthe")], b" the");
    assert_eq!(words[id(&gpt2, "Ċ")], b"\n");
    assert_eq!(words[id(&gpt2, "<|endoftext|>")], b"\xff<|endoftext|>");

    // Every non-special token of the fixture is exactly the text it detokenizes to.
    let f = fixture();
    for (id, word) in token_bytes(&f.tokenizer).iter().enumerate() {
        let id = id as u32;
        let piece = f.tokenizer.token_to_piece(id);
        if f.tokenizer.is_control(id) || f.tokenizer.is_eog(id) {
            assert_eq!(word[0], 0xff, "token {id} is special");
            assert_eq!(&word[1..], piece);
        } else {
            assert_eq!(word.as_slice(), piece, "token {id}");
        }
    }
}
