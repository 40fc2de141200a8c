//! llama-server's tokenizer and template endpoints: `POST /tokenize {content, add_special,
//! with_pieces}` → `{tokens}`, `POST /detokenize {tokens}` → `{content}`, `POST /apply-template
//! {messages, tools, …}` (a chat request) → `{prompt}`. They run off the async workers and never
//! reach the scheduler.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::api::{ApiError, ChatRequest, DetokenizeRequest, TokenizeRequest};
use crate::handlers::{RequestContext, Shared, parse};

/// Runs `work` on the blocking pool and answers with its JSON or its error.
async fn blocking(
    st: Shared,
    body: Bytes,
    work: fn(&RequestContext, &[u8]) -> Result<Value, ApiError>,
) -> Response {
    let State(st) = st;
    match tokio::task::spawn_blocking(move || work(&st.requests, &body)).await {
        Ok(Ok(v)) => axum::Json(v).into_response(),
        Ok(Err(e)) => e.into_response(),
        Err(e) => ApiError::internal(format!("tokenizing: {e}")).into_response(),
    }
}

pub async fn tokenize(st: Shared, body: Bytes) -> Response {
    blocking(st, body, tokenize_body).await
}

pub async fn detokenize(st: Shared, body: Bytes) -> Response {
    blocking(st, body, detokenize_body).await
}

pub async fn apply_template(st: Shared, body: Bytes) -> Response {
    blocking(st, body, apply_template_body).await
}

/// Pieces are strings when they are whole UTF-8, else their bytes (as llama-server does).
pub fn tokenize_body(st: &RequestContext, body: &[u8]) -> Result<Value, ApiError> {
    let req: TokenizeRequest = parse(body)?;
    let ids = st.tokenizer.encode(&req.content, req.add_special, true);
    if !req.with_pieces {
        return Ok(json!({ "tokens": ids }));
    }
    let tokens: Vec<Value> = ids
        .iter()
        .map(|&id| {
            let piece = st.tokenizer.token_to_piece(id);
            let piece = match std::str::from_utf8(piece) {
                Ok(s) => json!(s),
                Err(_) => json!(piece),
            };
            json!({"id": id, "piece": piece})
        })
        .collect();
    Ok(json!({ "tokens": tokens }))
}

pub fn detokenize_body(st: &RequestContext, body: &[u8]) -> Result<Value, ApiError> {
    let req: DetokenizeRequest = parse(body)?;
    let mut ids = Vec::with_capacity(req.tokens.len());
    for t in req.tokens {
        match u32::try_from(t) {
            Ok(id) if (id as usize) < st.n_vocab => ids.push(id),
            _ => {
                return Err(ApiError::invalid_param(
                    "tokens",
                    format!("token {t} is outside the vocabulary (0..{})", st.n_vocab),
                ));
            }
        }
    }
    Ok(json!({ "content": st.tokenizer.decode(&ids) }))
}

pub fn apply_template_body(st: &RequestContext, body: &[u8]) -> Result<Value, ApiError> {
    let req: ChatRequest = parse(body)?;
    let rendered = crate::chat::render(&st.template, &req, st.reasoning)?;
    Ok(json!({ "prompt": rendered.prompt }))
}
