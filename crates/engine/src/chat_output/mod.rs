//! What a chat model's raw output means: its reasoning, its answer and its tool calls, read in
//! the syntax of the model family its chat template belongs to (the template's markers decide:
//! [`ChatFormat::detect`]).
//!
//! One function, [`parse`], reads a whole output or, with `partial`, an output still being
//! generated. A partial parse never returns text that a later parse could take back: a possible
//! start of a marker at the end (`<tool_c`) and a tool call not yet closed are held back. So a
//! stream is the difference between successive partial parses (what llama.cpp's server does),
//! and a tool call is streamed once it is complete.
//!
//! | family | reasoning | tool calls | file |
//! |---|---|---|---|
//! | Qwen3, Qwen2.5, Hermes (and templates of no known family) | `<think>…</think>` | `<tool_call>{"name", "arguments"}</tool_call>` | `hermes.rs` |
//! | DeepSeek V3/V3.1/R1 | `<think>…</think>` | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}<｜tool▁call▁end｜>…` | `deepseek.rs` |
//! | GLM-4.5/4.6/4.7 | `<think>…</think>` | `<tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>` | `glm.rs` |
//! | gpt-oss (harmony) | the `analysis` channel | `to=functions.NAME … <|message|>{…}` | `harmony.rs` |

mod deepseek;
mod glm;
mod harmony;
mod hermes;
mod think;

use serde_json::Value;

/// The output syntax of a model family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChatFormat {
    /// `<tool_call>` JSON (Qwen3, Qwen2.5, Hermes); also the fallback for unknown templates.
    Hermes,
    DeepSeek,
    Glm,
    Harmony,
}

impl ChatFormat {
    /// The family whose markers the template source writes.
    pub fn detect(template_source: &str) -> ChatFormat {
        if template_source.contains("<|channel|>") && template_source.contains("<|message|>") {
            ChatFormat::Harmony
        } else if template_source.contains("<｜tool▁calls▁begin｜>") {
            ChatFormat::DeepSeek
        } else if template_source.contains("<arg_key>") {
            ChatFormat::Glm
        } else {
            ChatFormat::Hermes
        }
    }
}

/// Where reasoning text goes (llama-server's `--reasoning-format` names).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// Left in the content as the model wrote it.
    None,
    /// Moved to `reasoning_content`.
    #[default]
    DeepSeek,
}

impl std::str::FromStr for ReasoningFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(ReasoningFormat::None),
            // llama-server's `auto` extracts reasoning the same way.
            "deepseek" | "auto" => Ok(ReasoningFormat::DeepSeek),
            other => Err(format!(
                "unknown reasoning format `{other}` (expected none, deepseek or auto)"
            )),
        }
    }
}

/// How to read one request's output.
#[derive(Clone, Debug, Default)]
pub struct OutputOptions {
    pub reasoning: ReasoningFormat,
    /// The rendered prompt ends in an opened `<think>`: the output starts inside the reasoning.
    pub thinking_open: bool,
    /// The tools the request offered (OpenAI `{"type": "function", "function": {…}}` objects);
    /// tool calls are only looked for when there are some.
    pub tools: Vec<Value>,
}

impl OutputOptions {
    fn parses_tools(&self) -> bool {
        !self.tools.is_empty()
    }

    /// The JSON schema type of parameter `arg` of tool `name`, if the tool declares one.
    fn parameter_type(&self, name: &str, arg: &str) -> Option<&str> {
        self.tools
            .iter()
            .map(|t| t.get("function").unwrap_or(t))
            .find(|f| f.get("name").and_then(Value::as_str) == Some(name))?
            .get("parameters")?
            .get("properties")?
            .get(arg)?
            .get("type")?
            .as_str()
    }
}

/// A tool call as the model wrote it: the function's name and its arguments as JSON text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// A tool call to compare parser output with (every family's tests).
#[cfg(test)]
pub(crate) fn tool_call(name: &str, arguments: &str) -> ToolCall {
    ToolCall {
        name: name.into(),
        arguments: arguments.into(),
    }
}

/// An output split into what it means.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChatOutput {
    pub content: String,
    pub reasoning: String,
    pub tool_calls: Vec<ToolCall>,
}

/// Reads `text`, the model's output so far (`partial`) or all of it.
pub fn parse(format: ChatFormat, text: &str, partial: bool, opts: &OutputOptions) -> ChatOutput {
    if format == ChatFormat::Harmony {
        return harmony::parse(text, partial, opts);
    }
    let (reasoning, rest) = think::split(text, partial, opts);
    let mut out = match (opts.parses_tools(), format) {
        (false, _) => ChatOutput {
            content: held_back(rest, partial, &[]).to_string(),
            ..ChatOutput::default()
        },
        (true, ChatFormat::DeepSeek) => deepseek::parse(rest, partial),
        (true, ChatFormat::Glm) => glm::parse(rest, partial, opts),
        (true, _) => hermes::parse(rest, partial),
    };
    out.reasoning = reasoning;
    out
}

/// `text` without a tail that could be the start of one of `markers` (partial parses only).
fn held_back<'a>(text: &'a str, partial: bool, markers: &[&str]) -> &'a str {
    if !partial {
        return text;
    }
    let cut = markers
        .iter()
        .filter_map(|m| partial_marker_start(text, m))
        .min()
        .unwrap_or(text.len());
    &text[..cut]
}

/// Where a proper prefix of `marker` starts at the end of `text`, if one does.
fn partial_marker_start(text: &str, marker: &str) -> Option<usize> {
    let longest = marker.len().saturating_sub(1).min(text.len());
    (1..=longest)
        .rev()
        .map(|n| text.len() - n)
        .filter(|&start| text.is_char_boundary(start))
        .find(|&start| marker.starts_with(&text[start..]))
}

/// Text between tool calls belongs to the content, without the blank lines around calls.
fn push_content(content: &mut String, text: &str) {
    let text = if content.is_empty() {
        text.trim_start()
    } else {
        text
    };
    content.push_str(text);
}

/// JSON text of a tool call's arguments: written compactly when it is JSON, else as the model
/// wrote it (OpenAI's `arguments` is text, and may be invalid JSON).
fn arguments_text(raw: &str) -> String {
    let raw = raw.trim();
    match serde_json::from_str::<Value>(raw) {
        Ok(v) => v.to_string(),
        Err(_) => raw.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_markers_are_found_at_the_end_only() {
        assert_eq!(partial_marker_start("abc<tool_c", "<tool_call>"), Some(3));
        assert_eq!(partial_marker_start("abc<", "<tool_call>"), Some(3));
        assert_eq!(partial_marker_start("abc<tool_call>", "<tool_call>"), None);
        assert_eq!(partial_marker_start("a<b", "<tool_call>"), None);
        assert_eq!(
            partial_marker_start("é<｜tool", "<｜tool▁calls▁begin｜>"),
            Some(2)
        );
    }

    #[test]
    fn families_are_detected_from_their_templates() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/chat/");
        for (file, want) in [
            ("qwen3.jinja", ChatFormat::Hermes),
            ("deepseek-v3.1.jinja", ChatFormat::DeepSeek),
            ("gpt-oss.jinja", ChatFormat::Harmony),
            ("glm-4.6.jinja", ChatFormat::Glm),
            ("smollm2.jinja", ChatFormat::Hermes),
        ] {
            let source = std::fs::read_to_string(format!("{dir}{file}")).expect("template");
            assert_eq!(ChatFormat::detect(&source), want, "{file}");
        }
    }

    #[test]
    fn reasoning_format_names() {
        assert_eq!("none".parse(), Ok(ReasoningFormat::None));
        assert_eq!("deepseek".parse(), Ok(ReasoningFormat::DeepSeek));
        assert!("x".parse::<ReasoningFormat>().is_err());
    }
}
