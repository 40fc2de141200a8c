//! DeepSeek tool calls: a block `<｜tool▁calls▁begin｜> … <｜tool▁calls▁end｜>` of calls
//! `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}<｜tool▁call▁end｜>` (V3.1), or in V3 and R1
//! `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{…}\n```<｜tool▁call▁end｜>`.

use super::{ChatOutput, ToolCall, arguments_text, held_back, push_content};

const CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const CALLS_END: &str = "<｜tool▁calls▁end｜>";
const CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const CALL_END: &str = "<｜tool▁call▁end｜>";
const SEP: &str = "<｜tool▁sep｜>";

pub(super) fn parse(text: &str, partial: bool) -> ChatOutput {
    let mut out = ChatOutput::default();
    let Some(start) = text.find(CALLS_BEGIN) else {
        push_content(&mut out.content, held_back(text, partial, &[CALLS_BEGIN]));
        trim_end(&mut out.content);
        return out;
    };
    push_content(&mut out.content, &text[..start]);
    trim_end(&mut out.content);
    let mut rest = &text[start + CALLS_BEGIN.len()..];
    loop {
        let rest_trimmed = rest.trim_start();
        let Some(body) = rest_trimmed.strip_prefix(CALL_BEGIN) else {
            // The block's end, or text after it.
            let after = rest_trimmed.strip_prefix(CALLS_END).unwrap_or(rest_trimmed);
            let after = held_back(after, partial, &[CALL_BEGIN, CALLS_END]);
            if !after.trim().is_empty() && !after.starts_with(CALL_BEGIN) {
                push_content(&mut out.content, after.trim_end());
            }
            break;
        };
        let end = body.find(CALL_END);
        let call_text = match end {
            Some(e) => &body[..e],
            None if partial => break,
            None => body,
        };
        match call(call_text) {
            Some(c) => out.tool_calls.push(c),
            None if partial && end.is_none() => break,
            None => push_content(&mut out.content, call_text),
        }
        match end {
            Some(e) => rest = &body[e + CALL_END.len()..],
            None => break,
        }
    }
    out
}

fn trim_end(s: &mut String) {
    let n = s.trim_end().len();
    s.truncate(n);
}

fn call(text: &str) -> Option<ToolCall> {
    let (head, tail) = text.split_once(SEP)?;
    let head = head.trim();
    // V3 / R1: the type, then the name and a fenced JSON block.
    if head == "function"
        && let Some((name, fenced)) = tail.split_once('\n')
    {
        let json = fenced
            .trim()
            .strip_prefix("```json")
            .unwrap_or(fenced)
            .trim()
            .strip_suffix("```")
            .unwrap_or(fenced)
            .trim();
        return Some(ToolCall {
            name: name.trim().to_string(),
            arguments: arguments_text(json),
        });
    }
    if head.is_empty() {
        return None;
    }
    Some(ToolCall {
        name: head.to_string(),
        arguments: arguments_text(tail),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::chat_output::tool_call as tc;

    /// DeepSeek V3.1 after its reasoning (the `</think>` is split off before this).
    #[test]
    fn v3_1_two_calls_after_content() {
        let text = "CONTENT<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let out = parse(text, false);
        assert_eq!(out.content, "CONTENT");
        assert_eq!(
            out.tool_calls,
            vec![
                tc("get_time", r#"{"city":"Paris"}"#),
                tc("get_weather", r#"{"city":"Paris"}"#)
            ]
        );
    }

    #[test]
    fn v3_and_r1_fenced_arguments() {
        let text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"location\": \"Tokyo\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let out = parse(text, false);
        assert_eq!(out.content, "");
        assert_eq!(
            out.tool_calls,
            vec![tc("get_weather", r#"{"location":"Tokyo"}"#)]
        );
    }

    #[test]
    fn partial_streams_whole_calls() {
        let first =
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a<｜tool▁sep｜>{}<｜tool▁call▁end｜>";
        let second = format!("{first}<｜tool▁call▁begin｜>b<｜tool▁sep｜>{{\"x\":");
        assert_eq!(parse(first, true).tool_calls, vec![tc("a", "{}")]);
        assert_eq!(parse(&second, true).tool_calls, vec![tc("a", "{}")]);
        assert_eq!(parse("Hi<｜tool▁ca", true).content, "Hi");
    }
}
