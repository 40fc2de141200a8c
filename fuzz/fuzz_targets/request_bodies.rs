//! The server's request bodies: `server::handlers::prepare_chat` and `prepare_completion` (JSON
//! parsing, validation, chat template, tokenizer — what the handlers run before submitting a
//! job) on the demo model's tokenizer and template, then what the scheduler's slot does with an
//! accepted job's parameters (sampler, stop strings) for a few tokens.
//!
//! The first byte picks the endpoint and the form: the rest of the input as the body itself, or
//! (structure-aware) a body built with `arbitrary` from OpenAI-shaped fields whose values are
//! sometimes of the right type and sometimes any JSON.
#![no_main]

use std::collections::BTreeMap;
use std::sync::OnceLock;

use arbitrary::{Arbitrary, Unstructured};
use engine::Sampler;
use engine::text::TextStream;
use libfuzzer_sys::fuzz_target;
use serde_json::{Map, Value, json};
use server::handlers::{Prepared, RequestContext, prepare_chat, prepare_completion};

const MODEL_ID: &str = "moeshard";
/// Small, so that "prompt too long" is reachable.
const N_CTX: usize = 256;

fn context() -> &'static RequestContext {
    static CTX: OnceLock<RequestContext> = OnceLock::new();
    CTX.get_or_init(|| {
        let tokenizer = moeshard_fuzz::demo_tokenizer();
        RequestContext {
            n_vocab: tokenizer.vocab_size(),
            tokenizer,
            template: moeshard_fuzz::chat_template(),
            model_id: MODEL_ID.into(),
            n_ctx: N_CTX,
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let chat = mode & 1 == 0;
    let body = if mode & 2 == 0 {
        rest.to_vec()
    } else {
        let mut u = Unstructured::new(rest);
        let value = if chat {
            ChatBody::arbitrary(&mut u).map(|b| b.json())
        } else {
            CompletionBody::arbitrary(&mut u).map(|b| b.json())
        };
        let Ok(value) = value else {
            return;
        };
        serde_json::to_vec(&value).unwrap()
    };
    let ctx = context();
    let prepared = if chat {
        prepare_chat(ctx, 1, &body)
    } else {
        prepare_completion(ctx, 1, &body)
    };
    match prepared {
        Ok(job) => run_job(ctx, &job),
        Err(e) => {
            assert!(
                matches!(e.status, 400 | 404),
                "a bad body is the client's error: {e:?}"
            );
            let _ = e.body();
        }
    }
});

/// What a slot does with an accepted job: sampler over the prompt, a few tokens sampled from
/// fixed logits, their text through the stop strings.
fn run_job(ctx: &RequestContext, job: &Prepared) {
    let n = job.prompt.len();
    assert!(n > 0 && n < ctx.n_ctx, "prompt of {n} tokens accepted");
    assert!(job.prompt.iter().all(|&t| (t as usize) < ctx.n_vocab));
    let max = job.params.max_tokens;
    assert!(
        max >= 1 && max <= ctx.n_ctx - n,
        "max_tokens {max} for a prompt of {n}"
    );
    let mut sampler = Sampler::new(job.params.sampler.clone());
    for &t in &job.prompt {
        sampler.accept(t);
    }
    let mut text = TextStream::new(job.params.stop.clone());
    let mut logits: Vec<f32> = (0..ctx.n_vocab)
        .map(|i| ((i * 7919) % 101) as f32 / 10.0)
        .collect();
    for _ in 0..max.min(2) {
        let mut l = logits.clone();
        let tok = sampler.sample(&mut l);
        assert!((tok as usize) < ctx.n_vocab, "sampled {tok}");
        sampler.accept(tok);
        let (_, stopped) = text.push(ctx.tokenizer.token_to_piece(tok));
        if stopped {
            break;
        }
        logits.rotate_left(1);
    }
    let _ = text.finish();
}

/// Any JSON value.
#[derive(Arbitrary, Debug)]
enum J {
    Null,
    Bool(bool),
    Int(i64),
    Num(f64),
    Str(String),
    Arr(Vec<J>),
    Obj(Vec<(String, J)>),
}

impl J {
    fn json(&self) -> Value {
        match self {
            J::Null => Value::Null,
            J::Bool(b) => json!(b),
            J::Int(i) => json!(i),
            J::Num(x) => json!(x),
            J::Str(s) => json!(s),
            J::Arr(v) => Value::Array(v.iter().map(J::json).collect()),
            J::Obj(v) => Value::Object(v.iter().map(|(k, v)| (k.clone(), v.json())).collect()),
        }
    }
}

/// A field: absent, of its type, or any JSON.
#[derive(Arbitrary, Debug)]
enum F<T> {
    Absent,
    Typed(T),
    Any(J),
}

trait ToJson {
    fn json(&self) -> Value;
}

impl<T: ToJson> F<T> {
    fn put(&self, m: &mut Map<String, Value>, key: &str) {
        match self {
            F::Absent => {}
            F::Typed(t) => {
                m.insert(key.into(), t.json());
            }
            F::Any(j) => {
                m.insert(key.into(), j.json());
            }
        }
    }
}

macro_rules! to_json_via_json_macro {
    ($($t:ty),*) => {$(impl ToJson for $t { fn json(&self) -> Value { json!(self) } })*};
}
to_json_via_json_macro!(bool, i64, f32, String, u32);

impl<T: ToJson> ToJson for Vec<T> {
    fn json(&self) -> Value {
        Value::Array(self.iter().map(ToJson::json).collect())
    }
}

/// Integers near the limits that matter more often than uniform `i64`s would be.
#[derive(Arbitrary, Debug)]
enum Int {
    Small(i8),
    Ctx(u16),
    Any(i64),
}

impl ToJson for Int {
    fn json(&self) -> Value {
        match self {
            Int::Small(i) => json!(i),
            Int::Ctx(i) => json!(i),
            Int::Any(i) => json!(i),
        }
    }
}

/// Token ids: mostly inside the demo model's vocabulary.
#[derive(Arbitrary, Debug)]
enum Tok {
    Small(u8),
    Mid(u16),
    Any(u32),
}

impl ToJson for Tok {
    fn json(&self) -> Value {
        match self {
            Tok::Small(t) => json!(t),
            Tok::Mid(t) => json!(t),
            Tok::Any(t) => json!(t),
        }
    }
}

#[derive(Arbitrary, Debug)]
enum ModelName {
    Ours,
    Other(String),
}

impl ToJson for ModelName {
    fn json(&self) -> Value {
        match self {
            ModelName::Ours => json!(MODEL_ID),
            ModelName::Other(s) => json!(s),
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Role {
    System,
    User,
    Assistant,
    Developer,
    Tool,
    Other(String),
}

#[derive(Arbitrary, Debug)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
    Null,
}

#[derive(Arbitrary, Debug)]
struct Part {
    kind: F<PartKind>,
    text: F<String>,
}

#[derive(Arbitrary, Debug)]
enum PartKind {
    Text,
    ImageUrl,
    Other(String),
}

impl ToJson for PartKind {
    fn json(&self) -> Value {
        match self {
            PartKind::Text => json!("text"),
            PartKind::ImageUrl => json!("image_url"),
            PartKind::Other(s) => json!(s),
        }
    }
}

impl ToJson for Part {
    fn json(&self) -> Value {
        let mut m = Map::new();
        self.kind.put(&mut m, "type");
        self.text.put(&mut m, "text");
        Value::Object(m)
    }
}

#[derive(Arbitrary, Debug)]
struct Message {
    role: F<Role>,
    content: F<Content>,
}

impl ToJson for Role {
    fn json(&self) -> Value {
        json!(match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Developer => "developer",
            Role::Tool => "tool",
            Role::Other(s) => s,
        })
    }
}

impl ToJson for Content {
    fn json(&self) -> Value {
        match self {
            Content::Text(s) => json!(s),
            Content::Parts(p) => p.json(),
            Content::Null => Value::Null,
        }
    }
}

impl ToJson for Message {
    fn json(&self) -> Value {
        let mut m = Map::new();
        self.role.put(&mut m, "role");
        self.content.put(&mut m, "content");
        Value::Object(m)
    }
}

#[derive(Arbitrary, Debug)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

impl ToJson for Stop {
    fn json(&self) -> Value {
        match self {
            Stop::One(s) => json!(s),
            Stop::Many(v) => json!(v),
        }
    }
}

#[derive(Arbitrary, Debug)]
struct StreamOptions {
    include_usage: F<bool>,
}

impl ToJson for StreamOptions {
    fn json(&self) -> Value {
        let mut m = Map::new();
        self.include_usage.put(&mut m, "include_usage");
        Value::Object(m)
    }
}

impl ToJson for J {
    fn json(&self) -> Value {
        J::json(self)
    }
}

/// The sampling and length fields both endpoints share.
#[derive(Arbitrary, Debug)]
struct Sampling {
    model: F<ModelName>,
    max_tokens: F<Int>,
    temperature: F<f32>,
    top_p: F<f32>,
    top_k: F<Int>,
    min_p: F<f32>,
    repeat_penalty: F<f32>,
    presence_penalty: F<f32>,
    frequency_penalty: F<f32>,
    seed: F<i64>,
    stop: F<Stop>,
    n: F<Int>,
    cache_prompt: F<bool>,
    ignore_eos: F<bool>,
    stream: F<bool>,
    stream_options: F<StreamOptions>,
    /// Fields no endpoint knows (ignored, as OpenAI's are).
    extra: BTreeMap<String, J>,
}

impl Sampling {
    fn put(&self, m: &mut Map<String, Value>) {
        for (k, v) in &self.extra {
            m.insert(k.clone(), v.json());
        }
        self.model.put(m, "model");
        self.max_tokens.put(m, "max_tokens");
        self.temperature.put(m, "temperature");
        self.top_p.put(m, "top_p");
        self.top_k.put(m, "top_k");
        self.min_p.put(m, "min_p");
        self.repeat_penalty.put(m, "repeat_penalty");
        self.presence_penalty.put(m, "presence_penalty");
        self.frequency_penalty.put(m, "frequency_penalty");
        self.seed.put(m, "seed");
        self.stop.put(m, "stop");
        self.n.put(m, "n");
        self.cache_prompt.put(m, "cache_prompt");
        self.ignore_eos.put(m, "ignore_eos");
        self.stream.put(m, "stream");
        self.stream_options.put(m, "stream_options");
    }
}

#[derive(Arbitrary, Debug)]
struct ChatBody {
    messages: F<Vec<Message>>,
    max_completion_tokens: F<Int>,
    logprobs: F<bool>,
    tools: F<Vec<J>>,
    sampling: Sampling,
}

impl ChatBody {
    fn json(&self) -> Value {
        let mut m = Map::new();
        self.sampling.put(&mut m);
        self.messages.put(&mut m, "messages");
        self.max_completion_tokens
            .put(&mut m, "max_completion_tokens");
        self.logprobs.put(&mut m, "logprobs");
        self.tools.put(&mut m, "tools");
        Value::Object(m)
    }
}

#[derive(Arbitrary, Debug)]
enum PromptIn {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<Tok>),
    TokenLists(Vec<Vec<Tok>>),
}

impl ToJson for PromptIn {
    fn json(&self) -> Value {
        match self {
            PromptIn::Text(s) => json!(s),
            PromptIn::Texts(v) => json!(v),
            PromptIn::Tokens(v) => v.json(),
            PromptIn::TokenLists(v) => v.json(),
        }
    }
}

#[derive(Arbitrary, Debug)]
struct CompletionBody {
    prompt: F<PromptIn>,
    echo: F<bool>,
    suffix: F<String>,
    best_of: F<Int>,
    logprobs: F<Int>,
    sampling: Sampling,
}

impl CompletionBody {
    fn json(&self) -> Value {
        let mut m = Map::new();
        self.sampling.put(&mut m);
        self.prompt.put(&mut m, "prompt");
        self.echo.put(&mut m, "echo");
        self.suffix.put(&mut m, "suffix");
        self.best_of.put(&mut m, "best_of");
        self.logprobs.put(&mut m, "logprobs");
        Value::Object(m)
    }
}
