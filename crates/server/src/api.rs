//! The OpenAI wire types the server speaks (requests as clients send them, responses and
//! stream chunks as the official clients parse them) and the OpenAI error shape with its status
//! code. Only serde lives here: no engine, no HTTP framework.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// An error as OpenAI returns it: `{"error": {"message", "type", "param", "code"}}` plus an
/// HTTP status.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    pub fn invalid_param(param: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param),
            ..ApiError::invalid(message)
        }
    }

    pub fn unauthorized() -> ApiError {
        ApiError {
            status: 401,
            message: "Incorrect API key provided.".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn model_not_found(model: &str) -> ApiError {
        ApiError {
            status: 404,
            message: format!("The model `{model}` does not exist."),
            kind: "invalid_request_error",
            param: Some("model"),
            code: Some("model_not_found"),
        }
    }

    pub fn not_found(what: &str) -> ApiError {
        ApiError {
            status: 404,
            message: format!("{what} not found"),
            kind: "invalid_request_error",
            param: None,
            code: Some("not_found"),
        }
    }

    /// The queue is full or the server is shutting down: clients should retry later.
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError {
            status: 503,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("server_overloaded"),
        }
    }

    /// A request that did not get its response within the request timeout.
    pub fn timeout(limit: std::time::Duration) -> ApiError {
        ApiError {
            status: 408,
            message: format!(
                "the request did not complete within {:.1} s (--http-timeout); stream long generations (\"stream\": true)",
                limit.as_secs_f64()
            ),
            kind: "server_error",
            param: None,
            code: Some("timeout"),
        }
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: 500,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    pub fn body(&self) -> Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

/// `"text"` or `["a", "b"]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum StringOrList {
    One(String),
    Many(Vec<String>),
}

impl StringOrList {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StringOrList::One(s) => vec![s],
            StringOrList::Many(v) => v,
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling and length fields shared by both endpoints (OpenAI's, plus llama.cpp's `top_k`,
/// `min_p`, `repeat_penalty` and `cache_prompt` extensions).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Sampling {
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<StringOrList>,
    pub n: Option<i64>,
    /// Reuse a cached prefix (default true); false always prefills from scratch.
    pub cache_prompt: Option<bool>,
    /// Generate up to `max_tokens` even past end-of-generation tokens (benchmarks).
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(flatten)]
    pub structured: Structured,
}

/// Structured output (`crate::structured`), at most one of these: OpenAI's `response_format`
/// (`{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"schema": ...}}`),
/// llama-server's top-level `json_schema`, `grammar` (Lark syntax, not llama-server's GBNF)
/// and `regex`. Kept as JSON values so that a malformed one gets an error naming its field.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Structured {
    pub response_format: Option<Value>,
    pub json_schema: Option<Value>,
    pub grammar: Option<Value>,
    pub regex: Option<Value>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    /// A string, an array of `{"type": "text", "text": ...}` parts, or null.
    #[serde(default)]
    pub content: Value,
    /// The participant's name (templates that use it render it).
    pub name: Option<String>,
    /// An assistant message's calls: `[{"id", "type": "function", "function": {"name",
    /// "arguments": "<JSON text>"}}]`.
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
    /// An assistant message's reasoning, for templates that render past reasoning.
    pub reasoning_content: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessageIn>,
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub logprobs: Option<bool>,
    /// Alternatives per generated token (0–20), with `logprobs: true`.
    pub top_logprobs: Option<i64>,
    /// Function-calling tools: `[{"type": "function", "function": {"name", "description",
    /// "parameters"}}]`, passed to the chat template.
    pub tools: Option<Vec<Value>>,
    /// `"auto"` (default) or `"none"`; `"required"` and a named function are refused (no
    /// constrained decoding enforces them).
    pub tool_choice: Option<Value>,
    /// False: only the first tool call the model writes is returned.
    pub parallel_tool_calls: Option<bool>,
    /// Extra template variables (`{"enable_thinking": false}`, …), as vLLM and llama-server
    /// take them.
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// Shorthands for the template variables of the same name (Qwen3, gpt-oss).
    pub enable_thinking: Option<bool>,
    pub reasoning_effort: Option<String>,
    /// `none` or `deepseek` (`auto`): this request's `--reasoning-format`.
    pub reasoning_format: Option<String>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// `POST /tokenize` (llama-server's shape).
#[derive(Clone, Debug, Deserialize)]
pub struct TokenizeRequest {
    pub content: String,
    /// Add BOS (when the model adds one); default false.
    #[serde(default)]
    pub add_special: bool,
    /// Return `[{"id", "piece"}]` instead of ids.
    #[serde(default)]
    pub with_pieces: bool,
}

/// `POST /detokenize`.
#[derive(Clone, Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub tokens: Vec<i64>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub echo: bool,
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
    pub logprobs: Option<i64>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

/// Speculative decoding's drafts, in the fields OpenAI reports its predicted outputs with:
/// drafted tokens the model kept, and those it did not.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct CompletionTokensDetails {
    pub accepted_prediction_tokens: usize,
    pub rejected_prediction_tokens: usize,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
    /// Only where the server drafts (`serve --speculative`/`--draft-model`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion_tokens_details: Option<CompletionTokensDetails>,
}

impl Usage {
    pub fn new(prompt: usize, cached: usize, completion: usize) -> Usage {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: cached,
            },
            completion_tokens_details: None,
        }
    }

    /// With the drafts' counts, when anything was drafted.
    pub fn with_drafts(mut self, drafted: usize, accepted: usize) -> Usage {
        if drafted > 0 {
            self.completion_tokens_details = Some(CompletionTokensDetails {
                accepted_prediction_tokens: accepted,
                rejected_prediction_tokens: drafted.saturating_sub(accepted),
            });
        }
        self
    }
}

/// Turns a message's `content` into text: strings as they are, text parts concatenated.
pub fn content_text(content: &Value) -> Result<String, ApiError> {
    match content {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => out.push_str(t),
                    (kind, _) => {
                        return Err(ApiError::invalid_param(
                            "messages",
                            format!(
                                "content parts of type {} are not supported (text only)",
                                kind.unwrap_or("?")
                            ),
                        ));
                    }
                }
            }
            Ok(out)
        }
        _ => Err(ApiError::invalid_param(
            "messages",
            "message content must be a string or an array of text parts",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_request_parses_the_openai_shapes() {
        let r: ChatRequest = serde_json::from_str(
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]},
                {"role":"assistant","content":null}],
                "max_tokens":5,"stop":"\n","stream":true,"stream_options":{"include_usage":true},
                "temperature":0,"seed":-3,"unknown_field":1}"#,
        )
        .unwrap();
        assert_eq!(r.sampling.max_tokens, Some(5));
        assert_eq!(r.sampling.stop.unwrap().into_vec(), vec!["\n"]);
        assert!(r.stream && r.stream_options.unwrap().include_usage);
        assert_eq!(content_text(&r.messages[0].content).unwrap(), "hi");
        assert_eq!(content_text(&r.messages[1].content).unwrap(), "");
        assert!(content_text(&serde_json::json!([{"type": "image_url"}])).is_err());
    }

    #[test]
    fn completion_prompt_forms() {
        for (body, ok) in [
            (r#"{"prompt":"a"}"#, true),
            (r#"{"prompt":["a"]}"#, true),
            (r#"{"prompt":[1,2,3]}"#, true),
            (r#"{"prompt":[[1,2]]}"#, true),
            (r#"{"prompt":{"x":1}}"#, false),
        ] {
            assert_eq!(
                serde_json::from_str::<CompletionRequest>(body).is_ok(),
                ok,
                "{body}"
            );
        }
    }

    #[test]
    fn error_body_has_the_openai_shape() {
        let b = ApiError::model_not_found("x").body();
        assert_eq!(b["error"]["code"], "model_not_found");
        assert_eq!(b["error"]["param"], "model");
        assert_eq!(b["error"]["type"], "invalid_request_error");
    }
}
