//! The API key (`--api-key`, `--api-key-file`, `MOESHARD_API_KEY`): `Authorization: Bearer KEY`
//! on `/v1/…`. The comparison takes the same time whatever the client sent: the SHA-256 digests
//! of the key and of the given value are compared in constant time (`subtle`), so neither the
//! key's bytes nor its length show in the response time.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::api::ApiError;

/// A key clients must present; only its digest is kept.
#[derive(Clone)]
pub struct ApiKey([u8; 32]);

impl ApiKey {
    pub fn new(key: &str) -> ApiKey {
        ApiKey(Sha256::digest(key.as_bytes()).into())
    }

    /// Whether `given` is the key, in time independent of both.
    pub fn matches(&self, given: &str) -> bool {
        let d: [u8; 32] = Sha256::digest(given.as_bytes()).into();
        d.ct_eq(&self.0).into()
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(…)")
    }
}

/// Middleware: with a key, `/v1/…` requests without `Authorization: Bearer KEY` get 401;
/// `/health` and `/metrics` stay open.
/// The OpenAI API and llama-server's tokenizer and template endpoints; not `/health` or
/// `/metrics`.
fn needs_key(path: &str) -> bool {
    path.starts_with("/v1/") || ["/tokenize", "/detokenize", "/apply-template"].contains(&path)
}

pub async fn require_key(
    State(key): State<Option<Arc<ApiKey>>>,
    req: Request,
    next: Next,
) -> Response {
    if let Some(key) = &key
        && needs_key(req.uri().path())
    {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| key.matches(g.trim())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_only_the_key() {
        let k = ApiKey::new("sesame");
        assert!(k.matches("sesame"));
        for other in ["", "sesam", "sesame ", "Sesame", "sesamesesame"] {
            assert!(!k.matches(other), "{other:?}");
        }
        assert_eq!(format!("{k:?}"), "ApiKey(…)", "the key is not printed");
    }
}
