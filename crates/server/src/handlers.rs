//! HTTP handlers (axum): parse and validate OpenAI requests, render the chat template and
//! tokenize (off the async workers), submit to the scheduler and answer with its events
//! ([`crate::respond`]). They never touch the engine.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{FromRequest, Path, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use engine::SamplerConfig;
use engine::chat_output::ReasoningFormat;
use engine::chat_template::ChatTemplate;
use engine::tokenizer::Tokenizer;
use engine::{GrammarCompiler, GrammarError};
use serde_json::{Value, json};

use crate::api::{self, ApiError, ChatRequest, CompletionRequest, Prompt, Sampling};
use crate::chat::OutputReader;
use crate::job::{Admission, GenParams, SchedulerHandle};
use crate::metrics::Metrics;
use crate::respond::{Kind, Reply, respond};
use crate::structured;

pub struct AppState {
    pub sched: SchedulerHandle,
    pub metrics: Arc<Metrics>,
    pub requests: RequestContext,
    /// The model's sizes and identity (`/v1/status`).
    pub model_info: engine::ModelInfo,
    pub fingerprint: String,
    pub created: u64,
    pub keepalive: Duration,
    pub next_id: AtomicU64,
    pub shutting_down: AtomicBool,
}

/// What turning a request body into a job needs (no scheduler, no HTTP): the model's name,
/// tokenizer, chat template and sizes.
pub struct RequestContext {
    pub tokenizer: Arc<Tokenizer>,
    pub template: ChatTemplate,
    pub model_id: String,
    pub n_ctx: usize,
    pub n_vocab: usize,
    /// Where reasoning goes unless a request says (`--reasoning-format`).
    pub reasoning: ReasoningFormat,
    /// Structured output's grammars over this tokenizer's vocabulary (or why there are none).
    pub grammars: Result<GrammarCompiler, GrammarError>,
}

/// Choices per request at most (`n`): each takes a slot while it runs.
pub const MAX_CHOICES: i64 = 16;
/// Alternatives per token at most (`top_logprobs`, completions' `logprobs`), OpenAI's limit.
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// A request body parsed, validated and tokenized: what is submitted to the scheduler, and what
/// the reply needs besides the generated text.
#[derive(Clone, Debug)]
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub params: GenParams,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Text the reply's output starts with (a completion's `echo`).
    pub prefix: String,
    /// Chat: how the generated text is read (reasoning, tool calls).
    pub reader: Option<OutputReader>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, axum::Json(self.body())).into_response()
    }
}

pub type Shared = State<Arc<AppState>>;

pub async fn not_found(req: Request) -> Response {
    ApiError::not_found(&format!("{} {}", req.method(), req.uri().path())).into_response()
}

fn model_card(st: &AppState) -> Value {
    let r = &st.requests;
    json!({
        "id": r.model_id,
        "object": "model",
        "created": st.created,
        "owned_by": "moeshard",
        "meta": {"n_ctx": r.n_ctx, "n_vocab": r.n_vocab, "fingerprint": st.fingerprint},
    })
}

pub async fn models(State(st): Shared) -> Response {
    axum::Json(json!({"object": "list", "data": [model_card(&st)]})).into_response()
}

pub async fn model(State(st): Shared, Path(id): Path<String>) -> Response {
    if id != st.requests.model_id {
        return ApiError::model_not_found(&id).into_response();
    }
    axum::Json(model_card(&st)).into_response()
}

/// `200 {"status": "ok", …}`; 503 while shutting down or once the scheduler thread is gone
/// (it panicked or returned: nothing would be served).
pub async fn health(State(st): Shared) -> Response {
    let processing = st.metrics.processing.get() as u64;
    let (status, text) = if !st.sched.is_alive() {
        (StatusCode::SERVICE_UNAVAILABLE, "scheduler_stopped")
    } else if st.shutting_down.load(Ordering::Acquire) {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting_down")
    } else {
        (StatusCode::OK, "ok")
    };
    let body = json!({
        "status": text,
        "slots_processing": processing,
        "slots_idle": (st.metrics.slots.get() as u64).saturating_sub(processing),
        "requests_queued": st.metrics.queued.load(Ordering::Relaxed),
    });
    (status, axum::Json(body)).into_response()
}

pub async fn metrics(State(st): Shared) -> Response {
    let mut r = st.metrics.render().into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
    );
    r
}

pub(crate) fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(format!(
            "We could not parse the JSON body of your request: {e}"
        ))
    })
}

fn check_model(st: &RequestContext, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != st.model_id => Err(ApiError::model_not_found(m)),
        _ => Ok(()),
    }
}

fn random_seed(id: u64) -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ id.rotate_left(32) ^ 0x9e37_79b9_7f4a_7c15
}

/// Sampling and limits from the request; `default_max` applies without `max_tokens`.
fn gen_params(
    st: &RequestContext,
    id: u64,
    s: &Sampling,
    max_tokens: Option<i64>,
    default_max: usize,
    prompt_len: usize,
) -> Result<GenParams, ApiError> {
    if prompt_len == 0 {
        return Err(ApiError::invalid("the prompt is empty"));
    }
    if prompt_len >= st.n_ctx {
        return Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid_param(
                "messages",
                format!(
                    "This model's maximum context length is {} tokens. However, your prompt is {prompt_len} tokens.",
                    st.n_ctx
                ),
            )
        });
    }
    let n = match s.n {
        None => 1,
        Some(n) if (1..=MAX_CHOICES).contains(&n) => n as usize,
        Some(_) => {
            return Err(ApiError::invalid_param(
                "n",
                format!("n must be between 1 and {MAX_CHOICES}"),
            ));
        }
    };
    let max = match max_tokens {
        Some(m) if m < 1 => {
            return Err(ApiError::invalid_param(
                "max_tokens",
                "max_tokens must be at least 1",
            ));
        }
        Some(m) => usize::try_from(m).unwrap_or(usize::MAX),
        None => default_max,
    };
    let mut cfg = SamplerConfig::default();
    if let Some(t) = s.temperature {
        if !(0.0..=2.0).contains(&t) {
            return Err(ApiError::invalid_param(
                "temperature",
                "temperature must be between 0 and 2",
            ));
        }
        cfg.temperature = t;
    }
    if let Some(p) = s.top_p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::invalid_param("top_p", "top_p must be in (0, 1]"));
        }
        cfg.top_p = p;
    }
    if let Some(k) = s.top_k {
        cfg.top_k = usize::try_from(k)
            .map_err(|_| ApiError::invalid_param("top_k", "top_k must be >= 0"))?;
    }
    if let Some(p) = s.min_p {
        if !(0.0..=1.0).contains(&p) {
            return Err(ApiError::invalid_param("min_p", "min_p must be in [0, 1]"));
        }
        cfg.min_p = p;
    }
    let penalty = |v: Option<f32>| v.is_some_and(|v| !(-2.0..=2.0).contains(&v));
    if penalty(s.presence_penalty) {
        return Err(ApiError::invalid_param(
            "presence_penalty",
            "presence_penalty must be between -2 and 2",
        ));
    }
    if penalty(s.frequency_penalty) {
        return Err(ApiError::invalid_param(
            "frequency_penalty",
            "frequency_penalty must be between -2 and 2",
        ));
    }
    cfg.presence_penalty = s.presence_penalty.unwrap_or(0.0);
    cfg.frequency_penalty = s.frequency_penalty.unwrap_or(0.0);
    if let Some(r) = s.repeat_penalty {
        cfg.repeat_penalty = r;
    }
    cfg.seed = s.seed.map_or_else(|| random_seed(id), |v| v as u64);
    let stop = s
        .stop
        .clone()
        .map(api::StringOrList::into_vec)
        .unwrap_or_default();
    if stop.len() > 16 {
        return Err(ApiError::invalid_param("stop", "at most 16 stop sequences"));
    }
    Ok(GenParams {
        max_tokens: max.min(st.n_ctx - prompt_len),
        stop,
        sampler: cfg,
        cache_prompt: s.cache_prompt.unwrap_or(true),
        ignore_eos: s.ignore_eos,
        stream: false,
        n,
        logprobs: None,
        grammar: structured::constraint(&st.grammars, &s.structured)?,
    })
}

/// A `top_logprobs` / `logprobs` count, checked.
fn top_count(param: &'static str, k: i64) -> Result<usize, ApiError> {
    if !(0..=MAX_TOP_LOGPROBS).contains(&k) {
        return Err(ApiError::invalid_param(
            param,
            format!("{param} must be between 0 and {MAX_TOP_LOGPROBS}"),
        ));
    }
    Ok(k as usize)
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Refuses, before tokenizing it, a prompt text too long for the context: `bytes` of text are at
/// least `bytes / max_bytes_per_token` tokens (see [`Tokenizer::max_bytes_per_token`]).
fn check_prompt_bytes(
    st: &RequestContext,
    param: &'static str,
    bytes: usize,
) -> Result<(), ApiError> {
    let per_token = st.tokenizer.max_bytes_per_token();
    if bytes > st.n_ctx.saturating_mul(per_token) {
        return Err(ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid_param(
                param,
                format!(
                    "This model's maximum context length is {} tokens. However, your prompt is {bytes} bytes of text, which is more than {} tokens of at most {per_token} bytes each.",
                    st.n_ctx, st.n_ctx
                ),
            )
        });
    }
    Ok(())
}

/// Tokenizes a rendered conversation (CPU work: off the async workers).
fn chat_tokens(st: &RequestContext, rendered: &str) -> Result<Vec<u32>, ApiError> {
    check_prompt_bytes(st, "messages", rendered.len())?;
    let bos = st.template.bos_token();
    let starts_with_bos = !bos.is_empty() && rendered.starts_with(bos);
    Ok(st.tokenizer.encode(rendered, !starts_with_bos, true))
}

pub async fn chat(State(st): Shared, req: Request) -> Response {
    match admit(&st, req).await {
        Ok((admission, body)) => {
            generate(st, admission, body, Kind::Chat, "chatcmpl", prepare_chat)
                .await
                .unwrap_or_else(IntoResponse::into_response)
        }
        Err(refused) => refused,
    }
}

/// Admission first (a full or stopping server refuses before reading, parsing or tokenizing
/// anything), then the body.
async fn admit(st: &AppState, req: Request) -> Result<(Admission, Bytes), Response> {
    let admission = st.sched.admit().map_err(IntoResponse::into_response)?;
    let body = Bytes::from_request(req, &())
        .await
        .map_err(IntoResponse::into_response)?;
    Ok((admission, body))
}

/// A chat completion request body (`/v1/chat/completions`) as the job it asks for. CPU work
/// (JSON, template, tokenizer): the handler runs it off the async workers.
pub fn prepare_chat(st: &RequestContext, id: u64, body: &[u8]) -> Result<Prepared, ApiError> {
    let req: ChatRequest = parse(body)?;
    check_model(st, req.model.as_deref())?;
    let logprobs = match (req.logprobs, req.top_logprobs) {
        (Some(true), k) => Some(top_count("top_logprobs", k.unwrap_or(0))?),
        (_, Some(_)) => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ));
        }
        _ => None,
    };
    let rendered = crate::chat::render(&st.template, &req, st.reasoning)?;
    let prompt = chat_tokens(st, &rendered.prompt)?;
    let max = req.max_completion_tokens.or(req.sampling.max_tokens);
    let mut params = gen_params(st, id, &req.sampling, max, usize::MAX, prompt.len())?;
    params.stream = req.stream;
    params.logprobs = logprobs;
    Ok(Prepared {
        prompt,
        params,
        include_usage: req.stream_options.as_ref().is_some_and(|o| o.include_usage),
        prefix: String::new(),
        reader: Some(rendered.reader),
    })
}

/// What distinguishes the two generation endpoints.
type Prepare = fn(&RequestContext, u64, &[u8]) -> Result<Prepared, ApiError>;

/// Prepares an admitted request off the async workers (parsing, template, tokenizer), submits
/// it, and answers in the endpoint's shape.
async fn generate(
    st: Arc<AppState>,
    admission: Admission,
    body: Bytes,
    kind: Kind,
    id_prefix: &'static str,
    prepare: Prepare,
) -> Result<Response, ApiError> {
    let id = st.next_id.fetch_add(1, Ordering::Relaxed);
    let st2 = Arc::clone(&st);
    let job = tokio::task::spawn_blocking(move || prepare(&st2.requests, id, &body))
        .await
        .map_err(|e| ApiError::internal(format!("preparing the request: {e}")))??;
    let reply = Reply {
        kind,
        id: format!("{id_prefix}-{id:x}{:x}", st.created),
        created: unix_now(),
        model: st.requests.model_id.clone(),
        fingerprint: st.fingerprint.clone(),
        include_usage: job.include_usage,
        prefix: job.prefix,
        n: job.params.n,
        reader: job.reader,
        logprobs: job.params.logprobs.is_some(),
    };
    let stream = job.params.stream;
    let rx = st.sched.submit(admission, id, job.prompt, job.params)?;
    Ok(respond(reply, stream, rx, st.keepalive).await)
}

pub async fn completions(State(st): Shared, req: Request) -> Response {
    match admit(&st, req).await {
        Ok((admission, body)) => generate(
            st,
            admission,
            body,
            Kind::Completion,
            "cmpl",
            prepare_completion,
        )
        .await
        .unwrap_or_else(IntoResponse::into_response),
        Err(refused) => refused,
    }
}

/// A completion request body (`/v1/completions`) as the job it asks for; CPU work like
/// [`prepare_chat`].
pub fn prepare_completion(st: &RequestContext, id: u64, body: &[u8]) -> Result<Prepared, ApiError> {
    let req: CompletionRequest = parse(body)?;
    check_model(st, req.model.as_deref())?;
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid_param("suffix", "suffix is not supported"));
    }
    if req.best_of.is_some_and(|b| b != 1) {
        return Err(ApiError::invalid_param(
            "best_of",
            "only best_of=1 is supported",
        ));
    }
    let logprobs = req.logprobs.map(|k| top_count("logprobs", k)).transpose()?;
    if logprobs.is_some() && req.echo {
        return Err(ApiError::invalid_param(
            "logprobs",
            "logprobs with echo (the prompt's logprobs) are not supported",
        ));
    }
    // One prompt per request: text (tokenized here) or token ids.
    let (prompt_text, tokens) = match req.prompt {
        Prompt::Text(t) => (Some(t), None),
        Prompt::Texts(mut v) if v.len() == 1 => (v.pop(), None),
        Prompt::Tokens(t) => (None, Some(t)),
        Prompt::TokenLists(mut v) if v.len() == 1 => (None, v.pop()),
        _ => {
            return Err(ApiError::invalid_param(
                "prompt",
                "exactly one prompt per request is supported",
            ));
        }
    };
    let prompt = match (tokens, &prompt_text) {
        (Some(t), _) => {
            if let Some(bad) = t.iter().find(|&&t| t as usize >= st.n_vocab) {
                return Err(ApiError::invalid_param(
                    "prompt",
                    format!("token {bad} is outside the vocabulary"),
                ));
            }
            t
        }
        (None, text) => {
            let text = text.as_deref().unwrap_or_default();
            check_prompt_bytes(st, "prompt", text.len())?;
            st.tokenizer.encode(text, true, true)
        }
    };
    // OpenAI's default for this endpoint.
    let mut params = gen_params(
        st,
        id,
        &req.sampling,
        req.sampling.max_tokens,
        16,
        prompt.len(),
    )?;
    params.stream = req.stream;
    params.logprobs = logprobs;
    let prefix = match (req.echo, prompt_text) {
        (false, _) => String::new(),
        (true, Some(t)) => t,
        (true, None) => st.tokenizer.decode(&prompt),
    };
    Ok(Prepared {
        prompt,
        params,
        include_usage: req.stream_options.as_ref().is_some_and(|o| o.include_usage),
        prefix,
        reader: None,
    })
}
