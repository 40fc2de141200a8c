//! A chat request as its template sees it, and how its output will be read: messages in the
//! shape HF templates expect (assistant `tool_calls` with their arguments as objects, `tool`
//! messages with `tool_call_id`, `name`, past reasoning), the template variables (`tools`,
//! `chat_template_kwargs`, `enable_thinking`, `reasoning_effort`), and the [`OutputReader`]
//! that splits the generated text into content, reasoning and tool calls.

use engine::chat_output::{self, ChatFormat, ChatOutput, OutputOptions, ReasoningFormat};
use engine::chat_template::{ChatMessage, ChatTemplate};
use serde_json::{Map, Value};

use crate::api::{self, ApiError, ChatMessageIn, ChatRequest};

/// A rendered conversation and the reader of its reply.
pub struct RenderedChat {
    pub prompt: String,
    pub reader: OutputReader,
}

/// Reads one request's generated text: its model family's syntax and this request's options.
#[derive(Clone, Debug)]
pub struct OutputReader {
    format: ChatFormat,
    opts: OutputOptions,
    parallel_tool_calls: bool,
}

impl OutputReader {
    /// The output so far (`partial`) or all of it.
    pub fn read(&self, text: &str, partial: bool) -> ChatOutput {
        let mut out = chat_output::parse(self.format, text, partial, &self.opts);
        if !self.parallel_tool_calls {
            out.tool_calls.truncate(1);
        }
        out
    }
}

/// Renders `req`'s conversation with `template`; `default_reasoning` applies unless the request
/// names its own `reasoning_format`.
pub fn render(
    template: &ChatTemplate,
    req: &ChatRequest,
    default_reasoning: ReasoningFormat,
) -> Result<RenderedChat, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "messages must not be empty",
        ));
    }
    let messages = req
        .messages
        .iter()
        .map(message)
        .collect::<Result<Vec<_>, _>>()?;
    let tools = tools(req)?;
    let mut vars = Map::new();
    if !tools.is_empty() {
        vars.insert("tools".into(), Value::Array(tools.clone()));
    }
    if let Some(v) = req.enable_thinking {
        vars.insert("enable_thinking".into(), v.into());
    }
    if let Some(v) = &req.reasoning_effort {
        vars.insert("reasoning_effort".into(), v.clone().into());
    }
    for (k, v) in req.chat_template_kwargs.iter().flatten() {
        vars.insert(k.clone(), v.clone());
    }
    let prompt = template
        .render(&messages, true, &vars)
        .map_err(|e| ApiError::invalid_param("messages", e.to_string()))?;
    let reasoning = match &req.reasoning_format {
        Some(name) => name
            .parse()
            .map_err(|e: String| ApiError::invalid_param("reasoning_format", e))?,
        None => default_reasoning,
    };
    let reader = OutputReader {
        format: ChatFormat::detect(template.source()),
        opts: OutputOptions {
            reasoning,
            thinking_open: prompt.trim_end().ends_with("<think>"),
            tools,
        },
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
    };
    Ok(RenderedChat { prompt, reader })
}

/// The tools the template gets: none with `tool_choice: "none"`; each checked to be a function
/// with a name.
fn tools(req: &ChatRequest) -> Result<Vec<Value>, ApiError> {
    match &req.tool_choice {
        None => {}
        Some(Value::String(s)) if s == "auto" => {}
        Some(Value::String(s)) if s == "none" => return Ok(Vec::new()),
        Some(other) => {
            return Err(ApiError::invalid_param(
                "tool_choice",
                format!(
                    "tool_choice {other} is not supported: only \"auto\" and \"none\" (nothing forces the model to call a tool)"
                ),
            ));
        }
    }
    let tools = req.tools.clone().unwrap_or_default();
    for (i, t) in tools.iter().enumerate() {
        let named = t.get("type").and_then(Value::as_str) == Some("function")
            && t.get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .is_some_and(|n| !n.is_empty());
        if !named {
            return Err(ApiError::invalid_param(
                "tools",
                format!(
                    "tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": …}}}}"
                ),
            ));
        }
    }
    Ok(tools)
}

/// One message as templates read it.
fn message(m: &ChatMessageIn) -> Result<ChatMessage, ApiError> {
    let role = if m.role == "developer" {
        "system"
    } else {
        m.role.as_str()
    };
    let mut out = ChatMessage::new(role, api::content_text(&m.content)?);
    if let Some(name) = &m.name {
        out.extra.insert("name".into(), name.clone().into());
    }
    if let Some(id) = &m.tool_call_id {
        out.extra.insert("tool_call_id".into(), id.clone().into());
    }
    if let Some(r) = &m.reasoning_content {
        out.extra
            .insert("reasoning_content".into(), r.clone().into());
        // The harmony template reads past reasoning from `thinking`.
        out.extra.insert("thinking".into(), r.clone().into());
    }
    if let Some(calls) = &m.tool_calls {
        let calls = calls
            .iter()
            .map(template_tool_call)
            .collect::<Result<Vec<_>, _>>()?;
        out.extra.insert("tool_calls".into(), Value::Array(calls));
    }
    Ok(out)
}

/// An OpenAI tool call with its `arguments` JSON text turned into the object templates expect
/// (they iterate over it or write it with `tojson`); arguments that are not JSON stay text.
fn template_tool_call(call: &Value) -> Result<Value, ApiError> {
    let bad = || {
        ApiError::invalid_param(
            "messages",
            "each tool call must be {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}",
        )
    };
    let mut call = call.as_object().ok_or_else(bad)?.clone();
    let function = call
        .get_mut("function")
        .and_then(Value::as_object_mut)
        .ok_or_else(bad)?;
    if !function.get("name").is_some_and(Value::is_string) {
        return Err(bad());
    }
    if let Some(Value::String(text)) = function.get("arguments")
        && let Ok(parsed) = serde_json::from_str::<Value>(text)
    {
        function.insert("arguments".into(), parsed);
    }
    Ok(Value::Object(call))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn request(body: Value) -> ChatRequest {
        serde_json::from_value(body).expect("request")
    }

    #[test]
    fn tool_round_trip_reaches_the_template_in_hf_shape() {
        let req = request(json!({"messages": [
            {"role": "user", "content": "Weather in Paris?", "name": "ann"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}
        ]}));
        let m: Vec<ChatMessage> = req.messages.iter().map(|m| message(m).unwrap()).collect();
        assert_eq!(m[0].extra["name"], "ann");
        assert_eq!(
            m[1].extra["tool_calls"][0]["function"]["arguments"],
            json!({"city": "Paris"})
        );
        assert_eq!(m[1].content, "");
        assert_eq!(m[2].extra["tool_call_id"], "call_1");
    }

    #[test]
    fn tool_choice_and_tool_shapes_are_checked() {
        let tool = json!({"type": "function", "function": {"name": "f"}});
        let with = |extra: Value| {
            let mut body = json!({"messages": [{"role": "user", "content": "x"}], "tools": [tool]});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            tools(&request(body))
        };
        assert_eq!(with(json!({})).unwrap().len(), 1);
        assert!(with(json!({"tool_choice": "none"})).unwrap().is_empty());
        let e = with(json!({"tool_choice": "required"})).unwrap_err();
        assert_eq!(e.param, Some("tool_choice"));
        let e = with(json!({"tools": [{"type": "function"}]})).unwrap_err();
        assert_eq!(e.param, Some("tools"));
    }
}
