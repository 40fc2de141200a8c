//! gpt-oss' harmony format. The prompt ends in `<|start|>assistant`; the output is one or more
//! messages `[ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY`,
//! each ended by `<|end|>` (then `<|start|>assistant` opens the next) or by the end of the
//! generation (`<|return|>` and `<|call|>` stop it and are not part of the text). The `analysis`
//! channel is reasoning, `final` and `commentary` are content, and a message to
//! `functions.NAME` is a call of tool NAME with BODY as its JSON arguments.

use super::{ChatOutput, OutputOptions, ReasoningFormat, ToolCall, arguments_text, held_back};

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const END: &str = "<|end|>";
/// What may follow a body and must not be streamed as part of it.
const AFTER_BODY: [&str; 4] = [END, START, "<|call|>", "<|return|>"];

pub(super) fn parse(text: &str, partial: bool, opts: &OutputOptions) -> ChatOutput {
    let mut out = ChatOutput::default();
    let segments: Vec<&str> = text.split(START).collect();
    let last = segments.len() - 1;
    for (i, seg) in segments.iter().enumerate() {
        // Only the last message can still be growing.
        let growing = partial && i == last;
        let Some(at) = seg.find(MESSAGE) else {
            if growing && (i > 0 || header_may_follow(seg)) {
                break;
            }
            out.content.push_str(held_back(seg, growing, &AFTER_BODY));
            continue;
        };
        let header = &seg[..at];
        let body = &seg[at + MESSAGE.len()..];
        let (body, ended) = match body.find(END) {
            Some(e) => (&body[..e], true),
            None => (body, false),
        };
        let complete = ended || !growing;
        let recipient = field(header, "to=");
        if let Some(name) = recipient.and_then(|r| r.strip_prefix("functions."))
            && opts.parses_tools()
        {
            if !complete {
                break;
            }
            out.tool_calls.push(ToolCall {
                name: name.to_string(),
                arguments: arguments_text(body),
            });
            continue;
        }
        let visible = held_back(body, growing && !ended, &AFTER_BODY);
        if channel(header) == Some("analysis") {
            if opts.reasoning == ReasoningFormat::None {
                out.content.push_str(CHANNEL);
                out.content.push_str("analysis");
                out.content.push_str(MESSAGE);
                out.content.push_str(visible);
                if ended {
                    out.content.push_str(END);
                }
            } else {
                out.reasoning.push_str(visible);
            }
        } else {
            out.content.push_str(visible);
        }
    }
    out
}

/// Whether a first segment without `<|message|>` is a header still arriving (rather than text
/// written without one).
fn header_may_follow(seg: &str) -> bool {
    let s = seg.trim_start();
    s.is_empty() || s.starts_with(CHANNEL) || CHANNEL.starts_with(s) || s.starts_with("to=")
}

fn channel(header: &str) -> Option<&str> {
    let after = &header[header.find(CHANNEL)? + CHANNEL.len()..];
    after.split([' ', '<']).next()
}

/// The value of `key` (`to=`) in a header: up to the next space or special token.
fn field<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let at = header.find(key)?;
    header[at + key.len()..]
        .split([' ', '<'])
        .next()
        .filter(|v| !v.is_empty())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn tools() -> OutputOptions {
        OutputOptions {
            tools: vec![json!({"type": "function", "function": {"name": "get_weather"}})],
            ..OutputOptions::default()
        }
    }

    #[test]
    fn analysis_then_final() {
        let text = "<|channel|>analysis<|message|>The user says hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello!";
        let out = parse(text, false, &OutputOptions::default());
        assert_eq!(out.reasoning, "The user says hi.");
        assert_eq!(out.content, "Hello!");
        let none = OutputOptions {
            reasoning: ReasoningFormat::None,
            ..OutputOptions::default()
        };
        assert_eq!(
            parse(text, false, &none).content,
            "<|channel|>analysis<|message|>The user says hi.<|end|>Hello!"
        );
    }

    /// What gpt-oss writes to call a tool (its `<|call|>` ends the generation).
    #[test]
    fn commentary_to_a_function() {
        let text = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}";
        let out = parse(text, false, &tools());
        assert_eq!(out.reasoning, "Need the weather.");
        assert_eq!(out.content, "");
        assert_eq!(
            out.tool_calls,
            vec![ToolCall {
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris"}"#.into()
            }]
        );
        // The recipient may come before the channel too.
        let alt = " to=functions.get_weather<|channel|>commentary<|message|>{}";
        assert_eq!(parse(alt, false, &tools()).tool_calls.len(), 1);
        // While generating, the unfinished call is held back and the reasoning streams.
        let partial = parse(&text[..text.len() - 3], true, &tools());
        assert!(partial.tool_calls.is_empty());
        assert_eq!(partial.reasoning, "Need the weather.");
    }

    #[test]
    fn partial_headers_and_bodies_are_held() {
        let o = OutputOptions::default();
        assert_eq!(parse("<|chan", true, &o), ChatOutput::default());
        assert_eq!(
            parse("<|channel|>analysis<|message|>Thinking<|e", true, &o).reasoning,
            "Thinking"
        );
        let two = "<|channel|>analysis<|message|>a<|end|><|start|>assist";
        assert_eq!(parse(two, true, &o).reasoning, "a");
        // A model that writes no header at all (an untrained one) still streams its text.
        assert_eq!(parse("Hello", true, &o).content, "Hello");
    }
}
