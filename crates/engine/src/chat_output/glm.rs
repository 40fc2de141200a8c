//! GLM-4.5/4.6/4.7 tool calls: `<tool_call>NAME` then pairs
//! `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` (newlines between them in 4.5/4.6),
//! then `</tool_call>`. The template writes string values as they are and others as JSON, so a
//! value is a string where the tool's schema says so, else JSON if it parses as JSON.

use serde_json::{Map, Value};

use super::{ChatOutput, OutputOptions, ToolCall, held_back, push_content};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const KEY_OPEN: &str = "<arg_key>";
const KEY_CLOSE: &str = "</arg_key>";
const VALUE_OPEN: &str = "<arg_value>";
const VALUE_CLOSE: &str = "</arg_value>";

pub(super) fn parse(text: &str, partial: bool, opts: &OutputOptions) -> ChatOutput {
    let mut out = ChatOutput::default();
    let mut rest = text;
    loop {
        let Some(start) = rest.find(OPEN) else {
            push_content(&mut out.content, held_back(rest, partial, &[OPEN]));
            break;
        };
        push_content(&mut out.content, &rest[..start]);
        let body = &rest[start + OPEN.len()..];
        let end = body.find(CLOSE);
        if end.is_none() && partial {
            break;
        }
        let inner = &body[..end.unwrap_or(body.len())];
        match call(inner, opts) {
            Some(c) => out.tool_calls.push(c),
            None => out
                .content
                .push_str(&rest[start..start + OPEN.len() + inner.len()]),
        }
        match end {
            Some(e) => rest = &body[e + CLOSE.len()..],
            None => break,
        }
    }
    let trimmed = out.content.trim_end().len();
    out.content.truncate(trimmed);
    out
}

fn call(inner: &str, opts: &OutputOptions) -> Option<ToolCall> {
    let name_end = inner.find(KEY_OPEN).unwrap_or(inner.len());
    let name = inner[..name_end].trim();
    if name.is_empty() || name.contains('<') {
        return None;
    }
    let mut args = Map::new();
    let mut rest = &inner[name_end..];
    while let Some(k) = rest.find(KEY_OPEN) {
        let after_key = &rest[k + KEY_OPEN.len()..];
        let (key, after) = after_key.split_once(KEY_CLOSE)?;
        let after = after.trim_start().strip_prefix(VALUE_OPEN)?;
        let (value, after) = after.split_once(VALUE_CLOSE)?;
        let key = key.trim();
        let value = match opts.parameter_type(name, key) {
            Some("string") => Value::String(value.to_string()),
            _ => serde_json::from_str(value.trim())
                .unwrap_or_else(|_| Value::String(value.to_string())),
        };
        args.insert(key.to_string(), value);
        rest = after;
    }
    Some(ToolCall {
        name: name.to_string(),
        arguments: Value::Object(args).to_string(),
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn opts() -> OutputOptions {
        OutputOptions {
            tools: vec![json!({"type": "function", "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {
                    "city": {"type": "string"}, "days": {"type": "integer"}, "code": {"type": "string"}
                }}
            }})],
            ..OutputOptions::default()
        }
    }

    /// GLM-4.6 after `</think>`: content, then a call with a string, a number and a string that
    /// looks like a number.
    #[test]
    fn glm_4_6_call_with_typed_values() {
        let text = "I'll look it up.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>code</arg_key>\n<arg_value>75</arg_value>\n</tool_call>";
        let out = parse(text, false, &opts());
        assert_eq!(out.content, "I'll look it up.");
        assert_eq!(
            out.tool_calls,
            vec![ToolCall {
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris","days":3,"code":"75"}"#.into()
            }]
        );
    }

    /// GLM-4.7 writes no newlines; a call without arguments is `<tool_call>name</tool_call>`.
    #[test]
    fn glm_4_7_compact_calls() {
        let text = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call><tool_call>now</tool_call>";
        let out = parse(text, false, &opts());
        assert_eq!(out.tool_calls.len(), 2);
        assert_eq!(out.tool_calls[0].arguments, r#"{"city":"Rome"}"#);
        assert_eq!(out.tool_calls[1].name, "now");
        assert_eq!(out.tool_calls[1].arguments, "{}");
        let partial = parse(&text[..40], true, &opts());
        assert!(partial.tool_calls.is_empty() && partial.content.is_empty());
    }
}
