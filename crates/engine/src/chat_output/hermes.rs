//! Hermes-style tool calls (Qwen3, Qwen2.5, Hermes 2/3): each call a JSON object
//! `{"name": …, "arguments": {…}}` between `<tool_call>` and `</tool_call>`.

use serde_json::Value;

use super::{ChatOutput, ToolCall, held_back, push_content};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

pub(super) fn parse(text: &str, partial: bool) -> ChatOutput {
    let mut out = ChatOutput::default();
    let mut rest = text;
    loop {
        let Some(start) = rest.find(OPEN) else {
            push_content(&mut out.content, held_back(rest, partial, &[OPEN]));
            break;
        };
        push_content(&mut out.content, &rest[..start]);
        let body = &rest[start + OPEN.len()..];
        let Some(end) = body.find(CLOSE) else {
            // Not closed: complete later (partial), or the model stopped inside it.
            if !partial {
                match call(body) {
                    Some(c) => out.tool_calls.push(c),
                    None => out.content.push_str(&rest[start..]),
                }
            }
            break;
        };
        match call(&body[..end]) {
            Some(c) => out.tool_calls.push(c),
            None => out
                .content
                .push_str(&rest[start..start + OPEN.len() + end + CLOSE.len()]),
        }
        rest = &body[end + CLOSE.len()..];
    }
    // Trimmed in partial parses too, so that what a stream sent is always a prefix.
    let trimmed = out.content.trim_end().len();
    out.content.truncate(trimmed);
    out
}

/// A call's JSON; Hermes 2 wrote `parameters` where Qwen writes `arguments`.
fn call(json: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(json.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = v
        .get("arguments")
        .or_else(|| v.get("parameters"))
        .cloned()
        .unwrap_or_else(|| Value::Object(Default::default()));
    let arguments = match args {
        // Some models write the arguments as a JSON string already.
        Value::String(s) => super::arguments_text(&s),
        other => other.to_string(),
    };
    Some(ToolCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::chat_output::tool_call as tc;

    /// What Qwen3 writes after its reasoning when it calls two tools.
    #[test]
    fn qwen3_parallel_calls() {
        let text = "Let me check both cities.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Tokyo\"}}\n</tool_call>";
        let out = parse(text, false);
        assert_eq!(out.content, "Let me check both cities.");
        assert_eq!(
            out.tool_calls,
            vec![
                tc("get_weather", r#"{"city":"Paris","unit":"celsius"}"#),
                tc("get_weather", r#"{"city":"Tokyo"}"#)
            ]
        );
    }

    #[test]
    fn partial_holds_back_an_unfinished_call() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"argu";
        assert_eq!(parse(text, true), ChatOutput::default());
        assert_eq!(parse("Sure<tool_", true).content, "Sure");
        // The same text complete gives the call.
        let done = parse(
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
            true,
        );
        assert_eq!(done.tool_calls, vec![tc("f", "{}")]);
    }

    #[test]
    fn broken_json_stays_content() {
        let text = "<tool_call>\n{\"name\": oops}\n</tool_call>";
        let out = parse(text, false);
        assert!(out.tool_calls.is_empty());
        assert_eq!(out.content, text);
    }

    #[test]
    fn an_unclosed_call_at_the_end_is_still_read() {
        let text = "<tool_call>\n{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}";
        assert_eq!(parse(text, false).tool_calls, vec![tc("f", r#"{"x":1}"#)]);
    }
}
