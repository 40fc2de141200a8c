//! Turning a request's events into a response: one JSON body (chat.completion or
//! text_completion), or an SSE stream of chunks ending in `data: [DONE]`, with keep-alive
//! comments while nothing is produced (queue, long prefill). Dropping the stream (client gone)
//! drops the event receiver, which is how the scheduler learns to cancel.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use engine::generate::FinishReason;
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::api::{ApiError, Usage};
use crate::job::{Event, Outcome};

fn finish_reason(f: FinishReason) -> &'static str {
    match f {
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
}

impl Reply {
    fn chunk(&self, text: Option<&str>, finish: Option<&str>) -> Value {
        let mut v = match self.kind {
            Kind::Chat => {
                let delta = match text {
                    Some(t) => json!({"content": t}),
                    None => json!({}),
                };
                json!({
                    "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model, "system_fingerprint": self.fingerprint,
                    "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
                })
            }
            Kind::Completion => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": self.fingerprint,
                "choices": [{"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish}],
            }),
        };
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    fn usage(o: &Outcome) -> Usage {
        Usage::new(o.prompt_tokens, o.cached_tokens, o.completion_tokens)
    }

    fn full(&self, text: String, o: &Outcome) -> Value {
        let text = self.prefix.clone() + &text;
        let choice = match self.kind {
            Kind::Chat => json!({
                "index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": null, "finish_reason": finish_reason(o.finish),
            }),
            Kind::Completion => json!({
                "index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason(o.finish),
            }),
        };
        json!({
            "id": self.id,
            "object": if self.kind == Kind::Chat { "chat.completion" } else { "text_completion" },
            "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint,
            "choices": [choice],
            "usage": Reply::usage(o),
        })
    }
}

async fn collect(reply: Reply, mut rx: UnboundedReceiver<Event>) -> Response {
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Text(t) => text.push_str(&t),
            Event::Done(o) => return axum::Json(reply.full(text, &o)).into_response(),
            Event::Error(e) => return e.into_response(),
        }
    }
    ApiError::internal("the scheduler stopped before the request finished").into_response()
}

struct StreamState {
    reply: Reply,
    rx: UnboundedReceiver<Event>,
    pending: VecDeque<SseEvent>,
    done: bool,
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

fn stream(reply: Reply, rx: UnboundedReceiver<Event>, keepalive: Duration) -> Response {
    let mut pending = VecDeque::new();
    match reply.kind {
        Kind::Chat => {
            let mut first = reply.chunk(Some(&reply.prefix), None);
            first["choices"][0]["delta"]["role"] = json!("assistant");
            pending.push_back(data(&first));
        }
        Kind::Completion if !reply.prefix.is_empty() => {
            pending.push_back(data(&reply.chunk(Some(&reply.prefix), None)))
        }
        Kind::Completion => {}
    }
    let state = StreamState {
        reply,
        rx,
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
            match s.rx.recv().await {
                Some(Event::Text(t)) => s.pending.push_back(data(&s.reply.chunk(Some(&t), None))),
                Some(Event::Done(o)) => {
                    s.pending
                        .push_back(data(&s.reply.chunk(None, Some(finish_reason(o.finish)))));
                    if s.reply.include_usage {
                        let mut u = s.reply.chunk(None, None);
                        u["choices"] = json!([]);
                        u["usage"] = json!(Reply::usage(&o));
                        s.pending.push_back(data(&u));
                    }
                    s.pending.push_back(SseEvent::default().data("[DONE]"));
                    s.done = true;
                }
                Some(Event::Error(e)) => {
                    s.pending.push_back(data(&e.body()));
                    s.done = true;
                }
                None => {
                    let e = ApiError::internal("the scheduler stopped before the request finished");
                    s.pending.push_back(data(&e.body()));
                    s.done = true;
                }
            }
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
