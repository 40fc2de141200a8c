//! Turning a request's events into a response: one JSON body (chat.completion or
//! text_completion), or an SSE stream of chunks ending in `data: [DONE]`, with keep-alive
//! comments while nothing is produced (queue, long prefill). Dropping the stream (client gone)
//! drops the event receiver, which is how the scheduler learns to cancel.
//!
//! A chat reply's text is read by its [`OutputReader`] into content, `reasoning_content` and
//! `tool_calls`; a stream sends what each new partial reading adds (a tool call once it is
//! complete). Every choice of an `n > 1` request has its own text and reading.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use engine::chat_output::{ChatOutput, ToolCall};
use engine::generate::FinishReason;
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::api::{ApiError, Usage};
use crate::chat::OutputReader;
use crate::job::{Event, Outcome, TokenLogprob};

fn finish_reason(f: FinishReason, called_tools: bool) -> &'static str {
    match f {
        FinishReason::Stop | FinishReason::Cancelled if called_tools => "tool_calls",
        FinishReason::Stop | FinishReason::Cancelled => "stop",
        FinishReason::Length | FinishReason::ContextFull => "length",
    }
}

#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Kind {
    Chat,
    Completion,
}

/// What a response needs besides the events.
pub(crate) struct Reply {
    pub kind: Kind,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub fingerprint: String,
    pub include_usage: bool,
    /// Text before the generation (`echo`).
    pub prefix: String,
    /// Choices (`n`).
    pub n: usize,
    /// Chat: how the text is read (reasoning, tool calls).
    pub reader: Option<OutputReader>,
    /// Log-probabilities were asked for.
    pub logprobs: bool,
}

/// One choice's progress.
#[derive(Default)]
struct Choice {
    text: String,
    /// Non-streamed replies: every token's; streams send them as they come.
    logprobs: Vec<TokenLogprob>,
    /// Streams: how much of the reading was sent.
    sent_content: usize,
    sent_reasoning: usize,
    sent_calls: usize,
    /// Completions: characters before the next token (`text_offset`).
    offset: usize,
    outcome: Option<Outcome>,
}

/// What `now` adds to the `*sent` bytes already sent of it.
fn added<'a>(sent: &mut usize, now: &'a str) -> Option<&'a str> {
    let delta = now.get(*sent..).filter(|d| !d.is_empty())?;
    *sent = now.len();
    Some(delta)
}

/// Logprobs clamp impossible tokens to −9999, as OpenAI does (JSON has no −∞).
fn finite(lp: f32) -> f32 {
    lp.max(-9999.0)
}

fn chat_logprob(bytes: &[u8], logprob: f32) -> Value {
    json!({"token": String::from_utf8_lossy(bytes), "logprob": finite(logprob), "bytes": bytes})
}

/// `choices[].logprobs` of a chat reply: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
fn chat_logprobs(lps: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = lps
        .iter()
        .map(|t| {
            let mut v = chat_logprob(&t.bytes, t.logprob);
            v["top_logprobs"] = t.top.iter().map(|(b, l)| chat_logprob(b, *l)).collect();
            v
        })
        .collect();
    json!({ "content": content })
}

/// The legacy completions shape: `{tokens, token_logprobs, top_logprobs, text_offset}`, the
/// offsets in characters of the whole text (the echoed prompt included).
fn completion_logprobs(lps: &[TokenLogprob], offset: &mut usize) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top = Vec::new();
    let mut offsets = Vec::new();
    for t in lps {
        let token = String::from_utf8_lossy(&t.bytes).into_owned();
        offsets.push(*offset);
        *offset += token.chars().count();
        tokens.push(token);
        token_logprobs.push(finite(t.logprob));
        let alternatives: serde_json::Map<String, Value> = t
            .top
            .iter()
            .map(|(b, l)| (String::from_utf8_lossy(b).into_owned(), json!(finite(*l))))
            .collect();
        top.push(Value::Object(alternatives));
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets})
}

impl Reply {
    fn read(&self, text: &str, partial: bool) -> ChatOutput {
        match &self.reader {
            Some(r) => r.read(text, partial),
            None => ChatOutput {
                content: text.to_string(),
                ..ChatOutput::default()
            },
        }
    }

    fn tool_call(&self, choice: usize, index: usize, call: &ToolCall) -> Value {
        let suffix = self.id.split_once('-').map_or(self.id.as_str(), |(_, s)| s);
        json!({
            "id": format!("call_{suffix}_{choice}_{index}"),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        })
    }

    fn envelope(&self, object: &str, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id, "object": object, "created": self.created,
            "model": self.model, "system_fingerprint": self.fingerprint,
            "choices": choices,
        })
    }

    /// A stream chunk of one choice.
    fn chunk(&self, index: usize, body: Value, finish: Option<&str>, logprobs: Value) -> Value {
        let (object, mut choice) = match self.kind {
            Kind::Chat => (
                "chat.completion.chunk",
                json!({"index": index, "delta": body}),
            ),
            Kind::Completion => ("text_completion", json!({"index": index, "text": body})),
        };
        choice["logprobs"] = logprobs;
        choice["finish_reason"] = json!(finish);
        let mut v = self.envelope(object, vec![choice]);
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    fn usage(choices: &[Choice]) -> Usage {
        let first = choices.first().and_then(|c| c.outcome.as_ref());
        let outcomes = || choices.iter().filter_map(|c| c.outcome.as_ref());
        Usage::new(
            first.map_or(0, |o| o.prompt_tokens),
            first.map_or(0, |o| o.cached_tokens),
            outcomes().map(|o| o.completion_tokens).sum(),
        )
        .with_drafts(
            outcomes().map(|o| o.drafted_tokens).sum(),
            outcomes().map(|o| o.accepted_tokens).sum(),
        )
    }

    fn full(&self, choices: &mut [Choice]) -> Value {
        let mut out = Vec::with_capacity(choices.len());
        for (k, c) in choices.iter_mut().enumerate() {
            let finish = c.outcome.as_ref().map_or(FinishReason::Stop, |o| o.finish);
            let v = match self.kind {
                Kind::Chat => {
                    let read = self.read(&c.text, false);
                    let calls: Vec<Value> = read
                        .tool_calls
                        .iter()
                        .enumerate()
                        .map(|(j, t)| self.tool_call(k, j, t))
                        .collect();
                    let mut message = json!({"role": "assistant", "content": read.content});
                    if read.content.is_empty() && !calls.is_empty() {
                        message["content"] = Value::Null;
                    }
                    if !read.reasoning.is_empty() {
                        message["reasoning_content"] = json!(read.reasoning);
                    }
                    if !calls.is_empty() {
                        message["tool_calls"] = Value::Array(calls);
                    }
                    json!({
                        "index": k, "message": message,
                        "logprobs": if self.logprobs { chat_logprobs(&c.logprobs) } else { Value::Null },
                        "finish_reason": finish_reason(finish, !read.tool_calls.is_empty()),
                    })
                }
                Kind::Completion => {
                    c.offset = self.prefix.chars().count();
                    let logprobs = if self.logprobs {
                        completion_logprobs(&c.logprobs, &mut c.offset)
                    } else {
                        Value::Null
                    };
                    json!({
                        "index": k, "text": self.prefix.clone() + &c.text,
                        "logprobs": logprobs, "finish_reason": finish_reason(finish, false),
                    })
                }
            };
            out.push(v);
        }
        let object = match self.kind {
            Kind::Chat => "chat.completion",
            Kind::Completion => "text_completion",
        };
        let mut v = self.envelope(object, out);
        v["usage"] = json!(Reply::usage(choices));
        v
    }

    /// The chunks a choice's new text (and its tokens' logprobs) adds to a stream; at the end
    /// (`partial` false) what the final reading adds.
    fn stream_chunks(
        &self,
        k: usize,
        c: &mut Choice,
        logprobs: &[TokenLogprob],
        partial: bool,
    ) -> Vec<Value> {
        let mut bodies = Vec::new();
        let mut lp = Value::Null;
        match self.kind {
            Kind::Chat => {
                let read = self.read(&c.text, partial);
                if let Some(d) = added(&mut c.sent_reasoning, &read.reasoning) {
                    bodies.push(json!({ "reasoning_content": d }));
                }
                if let Some(d) = added(&mut c.sent_content, &read.content) {
                    bodies.push(json!({ "content": d }));
                }
                for (j, t) in read.tool_calls.iter().enumerate().skip(c.sent_calls) {
                    let mut call = self.tool_call(k, j, t);
                    call["index"] = json!(j);
                    bodies.push(json!({ "tool_calls": [call] }));
                }
                c.sent_calls = c.sent_calls.max(read.tool_calls.len());
                if self.logprobs && !logprobs.is_empty() {
                    lp = chat_logprobs(logprobs);
                    if bodies.is_empty() {
                        bodies.push(json!({}));
                    }
                }
            }
            Kind::Completion => {
                if let Some(d) = added(&mut c.sent_content, &c.text) {
                    bodies.push(json!(d));
                }
                if self.logprobs && !logprobs.is_empty() {
                    lp = completion_logprobs(logprobs, &mut c.offset);
                    if bodies.is_empty() {
                        bodies.push(json!(""));
                    }
                }
            }
        }
        bodies
            .into_iter()
            .enumerate()
            .map(|(i, b)| {
                let lp = if i == 0 { lp.clone() } else { Value::Null };
                self.chunk(k, b, None, lp)
            })
            .collect()
    }
}

async fn collect(reply: Reply, mut rx: UnboundedReceiver<Event>) -> Response {
    let mut choices: Vec<Choice> = (0..reply.n).map(|_| Choice::default()).collect();
    let mut done = 0;
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Text {
                choice,
                text,
                logprobs,
            } => {
                if let Some(c) = choices.get_mut(choice) {
                    c.text.push_str(&text);
                    c.logprobs.extend(logprobs);
                }
            }
            Event::Done { choice, outcome } => {
                if let Some(c) = choices.get_mut(choice) {
                    c.outcome = Some(outcome);
                    done += 1;
                }
                if done == reply.n {
                    return axum::Json(reply.full(&mut choices)).into_response();
                }
            }
            Event::Error(e) => return e.into_response(),
        }
    }
    ApiError::internal("the scheduler stopped before the request finished").into_response()
}

struct StreamState {
    reply: Reply,
    rx: UnboundedReceiver<Event>,
    choices: Vec<Choice>,
    finished: usize,
    pending: VecDeque<SseEvent>,
    done: bool,
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

impl StreamState {
    fn on_event(&mut self, ev: Option<Event>) {
        let r = &self.reply;
        match ev {
            Some(Event::Text {
                choice,
                text,
                logprobs,
            }) => {
                let Some(c) = self.choices.get_mut(choice) else {
                    return;
                };
                c.text.push_str(&text);
                for chunk in r.stream_chunks(choice, c, &logprobs, true) {
                    self.pending.push_back(data(&chunk));
                }
            }
            Some(Event::Done { choice, outcome }) => {
                let Some(c) = self.choices.get_mut(choice) else {
                    return;
                };
                for chunk in r.stream_chunks(choice, c, &[], false) {
                    self.pending.push_back(data(&chunk));
                }
                let finish = finish_reason(outcome.finish, c.sent_calls > 0);
                c.outcome = Some(outcome);
                let body = match r.kind {
                    Kind::Chat => json!({}),
                    Kind::Completion => json!(""),
                };
                self.pending
                    .push_back(data(&r.chunk(choice, body, Some(finish), Value::Null)));
                self.finished += 1;
                if self.finished < r.n {
                    return;
                }
                if r.include_usage {
                    let mut u = r.envelope(
                        match r.kind {
                            Kind::Chat => "chat.completion.chunk",
                            Kind::Completion => "text_completion",
                        },
                        Vec::new(),
                    );
                    u["usage"] = json!(Reply::usage(&self.choices));
                    self.pending.push_back(data(&u));
                }
                self.pending.push_back(SseEvent::default().data("[DONE]"));
                self.done = true;
            }
            Some(Event::Error(e)) => {
                self.pending.push_back(data(&e.body()));
                self.done = true;
            }
            None => {
                let e = ApiError::internal("the scheduler stopped before the request finished");
                self.pending.push_back(data(&e.body()));
                self.done = true;
            }
        }
    }
}

fn stream(reply: Reply, rx: UnboundedReceiver<Event>, keepalive: Duration) -> Response {
    let mut pending = VecDeque::new();
    let mut choices: Vec<Choice> = (0..reply.n).map(|_| Choice::default()).collect();
    for (k, c) in choices.iter_mut().enumerate() {
        c.offset = reply.prefix.chars().count();
        match reply.kind {
            Kind::Chat => {
                let delta = json!({"role": "assistant", "content": reply.prefix});
                pending.push_back(data(&reply.chunk(k, delta, None, Value::Null)));
            }
            Kind::Completion if !reply.prefix.is_empty() => {
                pending.push_back(data(&reply.chunk(
                    k,
                    json!(reply.prefix),
                    None,
                    Value::Null,
                )));
            }
            Kind::Completion => {}
        }
    }
    let state = StreamState {
        reply,
        rx,
        choices,
        finished: 0,
        pending,
        done: false,
    };
    let events = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(ev) = s.pending.pop_front() {
                return Some((Ok::<_, Infallible>(ev), s));
            }
            if s.done {
                return None;
            }
            let ev = s.rx.recv().await;
            s.on_event(ev);
        }
    });
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(keepalive).text("keepalive"))
        .into_response()
}

pub(crate) async fn respond(
    reply: Reply,
    stream_mode: bool,
    rx: UnboundedReceiver<Event>,
    keepalive: Duration,
) -> Response {
    if stream_mode {
        stream(reply, rx, keepalive)
    } else {
        collect(reply, rx).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(text: &str, logprob: f32) -> TokenLogprob {
        TokenLogprob {
            bytes: text.as_bytes().to_vec(),
            logprob,
            top: vec![(text.as_bytes().to_vec(), logprob), (b"x".to_vec(), -3.0)],
        }
    }

    #[test]
    fn logprob_shapes() {
        let lps = [token("Hé", -0.5), token("llo", f32::NEG_INFINITY)];
        let chat = chat_logprobs(&lps);
        assert_eq!(chat["content"][0]["token"], "Hé");
        assert_eq!(chat["content"][0]["bytes"], json!([72, 195, 169]));
        assert_eq!(chat["content"][1]["logprob"], -9999.0);
        assert_eq!(chat["content"][0]["top_logprobs"][1]["token"], "x");
        let mut offset = 3;
        let legacy = completion_logprobs(&lps, &mut offset);
        assert_eq!(legacy["tokens"], json!(["Hé", "llo"]));
        assert_eq!(legacy["text_offset"], json!([3, 5]));
        assert_eq!(legacy["top_logprobs"][0]["x"], -3.0);
        assert_eq!(offset, 8);
    }

    #[test]
    fn stream_deltas_only_add() {
        let mut sent = 0;
        assert_eq!(added(&mut sent, "Hel"), Some("Hel"));
        assert_eq!(added(&mut sent, "Hel"), None);
        assert_eq!(added(&mut sent, "Hello"), Some("lo"));
        assert_eq!(sent, 5);
    }
}
