//! Chat templates: rendering a model's `tokenizer.chat_template` (Jinja) into a prompt, the way
//! HF transformers' `apply_chat_template` does.
//!
//! Templates run on `minijinja` configured like transformers' sandboxed Jinja environment:
//! `trim_blocks` and `lstrip_blocks` on, loop controls (`break`/`continue`), Python string and
//! dict methods (`.strip()`, `.split()`, `.items()`…, from `minijinja-contrib`'s pycompat), and
//! transformers' globals: `raise_exception(msg)`, `strftime_now(fmt)` and a `tojson` filter that
//! matches Python's `json.dumps` (no HTML escaping, `", "` / `": "` separators, keys in order).
//!
//! A model without a template gets no implicit fallback: [`ChatTemplate::from_metadata`] returns
//! `None`, and the caller decides, e.g. with [`ChatTemplate::chatml`].

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use gguf::Metadata;
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};

/// GGUF key of the default chat template.
pub const CHAT_TEMPLATE_KEY: &str = "tokenizer.chat_template";
const TOKENS_KEY: &str = "tokenizer.ggml.tokens";
const BOS_ID_KEY: &str = "tokenizer.ggml.bos_token_id";
const EOS_ID_KEY: &str = "tokenizer.ggml.eos_token_id";

/// Name of the template inside its environment (no extension: no auto-escaping).
const TEMPLATE_NAME: &str = "chat_template";

/// The ChatML format (`<|im_start|>role\ncontent<|im_end|>\n`), the explicit fallback for models
/// that ship no template.
pub const CHATML_TEMPLATE: &str = "{%- for message in messages %}\
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{%- endfor %}\
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// Further fields templates may read (`tool_calls`, `reasoning_content`, `name`…).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            extra: serde_json::Map::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("reading chat template metadata `{key}`: {source}")]
    Metadata {
        key: &'static str,
        #[source]
        source: gguf::GgufError,
    },
    #[error("chat template does not compile: {}", .0.display_debug_info())]
    Syntax(#[source] minijinja::Error),
    #[error("chat template rejected the conversation: {0}")]
    Raised(String),
    #[error("rendering the chat template: {}", .0.display_debug_info())]
    Render(#[source] minijinja::Error),
    #[error("template variable `{0}` is set by the renderer and cannot be overridden")]
    ReservedVariable(String),
}

/// Where a [`ChatTemplate`] came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TemplateOrigin {
    /// The model's `tokenizer.chat_template`.
    Model,
    /// The built-in ChatML fallback.
    ChatMl,
    /// Given by the caller.
    Custom,
}

/// A compiled chat template plus the BOS/EOS strings it may reference.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
    origin: TemplateOrigin,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("source_len", &self.source.len())
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// The model's template, with `bos_token`/`eos_token` set to the texts of its BOS/EOS
    /// tokens; `None` when the model has no `tokenizer.chat_template`.
    pub fn from_metadata(metadata: &Metadata) -> Result<Option<ChatTemplate>, ChatTemplateError> {
        let meta_err = |key| move |source| ChatTemplateError::Metadata { key, source };
        let Some(source) = metadata
            .get_str(CHAT_TEMPLATE_KEY)
            .map_err(meta_err(CHAT_TEMPLATE_KEY))?
        else {
            return Ok(None);
        };
        // A missing, negative or out-of-range id leaves the string empty, as llama.cpp does.
        let token_text = |key: &'static str| -> Result<String, ChatTemplateError> {
            let Some(id) = metadata
                .get(key)
                .and_then(|v| v.as_integer())
                .and_then(|i| usize::try_from(i).ok())
            else {
                return Ok(String::new());
            };
            let tokens = metadata
                .str_array(TOKENS_KEY)
                .map_err(meta_err(TOKENS_KEY))?;
            Ok(tokens.get(id).map(str::to_string).unwrap_or_default())
        };
        let bos = token_text(BOS_ID_KEY)?;
        let eos = token_text(EOS_ID_KEY)?;
        let mut template = ChatTemplate::new(source, bos, eos)?;
        template.origin = TemplateOrigin::Model;
        Ok(Some(template))
    }

    /// Compiles a template given as Jinja source.
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<ChatTemplate, ChatTemplateError> {
        let source = source.into();
        let env = build_environment(&source)?;
        Ok(ChatTemplate {
            env,
            source,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            origin: TemplateOrigin::Custom,
        })
    }

    /// The ChatML fallback ([`CHATML_TEMPLATE`]) for a model without a template.
    pub fn chatml(bos_token: impl Into<String>, eos_token: impl Into<String>) -> ChatTemplate {
        let env = build_environment(CHATML_TEMPLATE)
            .expect("the built-in ChatML template compiles (checked by tests)");
        ChatTemplate {
            env,
            source: CHATML_TEMPLATE.to_string(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            origin: TemplateOrigin::ChatMl,
        }
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn origin(&self) -> TemplateOrigin {
        self.origin
    }

    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// Renders `messages` into a prompt. `add_generation_prompt` appends the header that opens
    /// the assistant's turn. `extra` adds template variables (`enable_thinking`, `tools`,
    /// `documents`…); `messages`, `add_generation_prompt`, `bos_token` and `eos_token` are the
    /// renderer's own.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ChatTemplateError> {
        const RESERVED: [&str; 4] = [
            "messages",
            "add_generation_prompt",
            "bos_token",
            "eos_token",
        ];
        if let Some(key) = extra.keys().find(|k| RESERVED.contains(&k.as_str())) {
            return Err(ChatTemplateError::ReservedVariable(key.clone()));
        }
        let mut context = serde_json::Map::new();
        // transformers passes `tools` and `documents` always, `None` when unused.
        context.insert("tools".into(), serde_json::Value::Null);
        context.insert("documents".into(), serde_json::Value::Null);
        for (key, value) in extra {
            context.insert(key.clone(), value.clone());
        }
        context.insert(
            "messages".into(),
            serde_json::to_value(messages).unwrap_or_default(),
        );
        context.insert("add_generation_prompt".into(), add_generation_prompt.into());
        context.insert("bos_token".into(), self.bos_token.clone().into());
        context.insert("eos_token".into(), self.eos_token.clone().into());

        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(ChatTemplateError::Render)?;
        template
            .render(json_to_value(&serde_json::Value::Object(context)))
            .map_err(|error| match raised_message(&error) {
                Some(message) => ChatTemplateError::Raised(message),
                None => ChatTemplateError::Render(error),
            })
    }
}

/// A JSON value as a template value, map keys in their order.
fn json_to_value(value: &serde_json::Value) -> Value {
    use serde_json::Value as Json;
    match value {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::from(i),
            (None, Some(u)) => Value::from(u),
            _ => Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(items) => items.iter().map(json_to_value).collect(),
        Json::Object(map) => {
            Value::from_pairs(map.iter().map(|(k, v)| (k.as_str(), json_to_value(v))))
        }
    }
}

/// Marks errors thrown by the template's own `raise_exception`.
const RAISED_PREFIX: &str = "raise_exception: ";

fn raised_message(error: &minijinja::Error) -> Option<String> {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = current {
        if let Some(mj) = e.downcast_ref::<minijinja::Error>()
            && let Some(message) = mj.detail().and_then(|d| d.strip_prefix(RAISED_PREFIX))
        {
            return Some(message.to_string());
        }
        current = e.source();
    }
    None
}

fn build_environment(source: &str) -> Result<Environment<'static>, ChatTemplateError> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .keep_trailing_newline(false)
        .build()
        .map_err(ChatTemplateError::Syntax)?;
    env.set_syntax(syntax);
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env.add_template_owned(TEMPLATE_NAME, source.to_string())
        .map_err(ChatTemplateError::Syntax)?;
    Ok(env)
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISED_PREFIX}{message}"),
    ))
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, the keyword arguments included.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
            (None, Some(s)) => Some(s.to_string()),
            _ => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ));
            }
        },
    };
    let (item_separator, key_separator) = match separators {
        Some(pair) if !pair.is_none() && !pair.is_undefined() => {
            let item = pair.get_item_by_index(0)?;
            let key = pair.get_item_by_index(1)?;
            (
                item.as_str().unwrap_or(",").to_string(),
                key.as_str().unwrap_or(":").to_string(),
            )
        }
        // Python's default: ", " without indent, "," with it.
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let mut writer = JsonWriter {
        out: String::new(),
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item_separator,
        key_separator,
        sort_keys: sort_keys.unwrap_or(false),
    };
    writer.write(&value, 0)?;
    Ok(Value::from_safe_string(writer.out))
}

struct JsonWriter {
    out: String,
    ensure_ascii: bool,
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

impl JsonWriter {
    fn newline(&mut self, depth: usize) {
        if let Some(indent) = &self.indent {
            self.out.push('\n');
            for _ in 0..depth {
                self.out.push_str(indent);
            }
        }
    }

    fn write(&mut self, value: &Value, depth: usize) -> Result<(), minijinja::Error> {
        match value.kind() {
            ValueKind::Undefined | ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self
                .out
                .push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => self.write_number(value),
            ValueKind::String => self.write_string(value.as_str().unwrap_or_default()),
            ValueKind::Map => {
                let mut keys: Vec<Value> = value.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                self.write_container('{', '}', depth, keys.len(), |w, i| {
                    let key = &keys[i];
                    match key.as_str() {
                        Some(s) => w.write_string(s),
                        None => w.write_string(&key.to_string()),
                    }
                    let separator = w.key_separator.clone();
                    w.out.push_str(&separator);
                    w.write(&value.get_item(key)?, depth + 1)
                })?;
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.write_container('[', ']', depth, items.len(), |w, i| {
                    w.write(&items[i], depth + 1)
                })?;
            }
            _ => self.write_string(&value.to_string()),
        }
        Ok(())
    }

    fn write_container(
        &mut self,
        open: char,
        close: char,
        depth: usize,
        len: usize,
        mut write_item: impl FnMut(&mut JsonWriter, usize) -> Result<(), minijinja::Error>,
    ) -> Result<(), minijinja::Error> {
        self.out.push(open);
        for i in 0..len {
            if i > 0 {
                let separator = self.item_separator.clone();
                self.out.push_str(&separator);
            }
            self.newline(depth + 1);
            write_item(self, i)?;
        }
        if len > 0 {
            self.newline(depth);
        }
        self.out.push(close);
        Ok(())
    }

    fn write_number(&mut self, value: &Value) {
        if value.is_integer() {
            let _ = write!(self.out, "{value}");
            return;
        }
        let float = f64::try_from(value.clone()).unwrap_or(f64::NAN);
        self.out.push_str(&python_float_repr(float));
    }

    fn write_string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{08}' => self.out.push_str("\\b"),
                '\u{0C}' => self.out.push_str("\\f"),
                c if u32::from(c) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(self.out, "\\u{unit:04x}");
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

/// Python's `repr(float)`: shortest round-trip digits, exponent form outside [1e-4, 1e16).
fn python_float_repr(value: f64) -> String {
    if value.is_nan() {
        return "NaN".to_string();
    }
    if value.is_infinite() {
        return if value > 0.0 { "Infinity" } else { "-Infinity" }.to_string();
    }
    let scientific = format!("{value:e}");
    let (mantissa, exponent) = scientific
        .split_once('e')
        .map(|(m, e)| (m.to_string(), e.parse::<i32>().unwrap_or(0)))
        .unwrap_or((scientific.clone(), 0));
    if value != 0.0 && !(-4..16).contains(&exponent) {
        let sign = if exponent < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exponent.abs());
    }
    let plain = format!("{value}");
    if plain.contains('.') {
        plain
    } else {
        format!("{plain}.0")
    }
}

/// transformers' `strftime_now(format)`: the current time (UTC here) formatted with the common
/// `strftime` directives.
fn strftime_now(format: String) -> Result<Value, minijinja::Error> {
    let seconds = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(Value::from(strftime(&format, seconds)))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Formats a Unix time (UTC) with `%Y %y %m %d %e %j %H %I %M %S %p %b %B %h %a %A %F %T %D %%`;
/// other directives are kept as written.
fn strftime(format: &str, unix_seconds: u64) -> String {
    let days = i64::try_from(unix_seconds / 86_400).unwrap_or(0);
    let secs_of_day = unix_seconds % 86_400;
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    // 1970-01-01 was a Thursday (index 3 with Monday = 0).
    let weekday = usize::try_from((days + 3).rem_euclid(7)).unwrap_or(0);
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS[(month - 1) as usize];
    let weekday_name = WEEKDAYS[weekday];
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(directive) = chars.next() else {
            out.push('%');
            break;
        };
        let _ = match directive {
            'Y' => write!(out, "{year}"),
            'y' => write!(out, "{:02}", year.rem_euclid(100)),
            'm' => write!(out, "{month:02}"),
            'd' => write!(out, "{day:02}"),
            'e' => write!(out, "{day:2}"),
            'j' => write!(out, "{day_of_year:03}"),
            'H' => write!(out, "{hour:02}"),
            'I' => write!(out, "{hour12:02}"),
            'M' => write!(out, "{minute:02}"),
            'S' => write!(out, "{second:02}"),
            'p' => write!(out, "{}", if hour < 12 { "AM" } else { "PM" }),
            'b' | 'h' => write!(out, "{}", &month_name[..3]),
            'B' => write!(out, "{month_name}"),
            'a' => write!(out, "{}", &weekday_name[..3]),
            'A' => write!(out, "{weekday_name}"),
            'F' => write!(out, "{year}-{month:02}-{day:02}"),
            'T' => write!(out, "{hour:02}:{minute:02}:{second:02}"),
            'D' => write!(out, "{month:02}/{day:02}/{:02}", year.rem_euclid(100)),
            '%' => write!(out, "%"),
            other => write!(out, "%{other}"),
        };
    }
    out
}

/// (year, month 1–12, day 1–31) of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year.rem_euclid(400);
    let month = i64::from(month);
    let doy = (153 * (if month > 2 { month - 3 } else { month + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, messages: &[ChatMessage]) -> Result<String, ChatTemplateError> {
        ChatTemplate::new(source, "<s>", "</s>")?.render(messages, true, &serde_json::Map::new())
    }

    #[test]
    fn chatml_fallback_renders() {
        let template = ChatTemplate::chatml("", "<|im_end|>");
        let out = template
            .render(
                &[ChatMessage::new("user", "Hi")],
                true,
                &serde_json::Map::new(),
            )
            .expect("renders");
        assert_eq!(
            out,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(template.origin(), TemplateOrigin::ChatMl);
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let source = r#"{{ {"b": [1, 2.5, "x<y>\n"], "a": none, "c": true, "é": 1.0} | tojson }}|{{ {"z": 1, "a": 2} | tojson(sort_keys=true) }}|{{ [1] | tojson(indent=2) }}"#;
        let out = render(source, &[]).expect("renders");
        assert_eq!(
            out,
            "{\"b\": [1, 2.5, \"x<y>\\n\"], \"a\": null, \"c\": true, \"é\": 1.0}|{\"a\": 2, \"z\": 1}|[\n  1\n]"
        );
    }

    #[test]
    fn raise_exception_becomes_a_typed_error() {
        let error = render("{{ raise_exception('no system role') }}", &[]).expect_err("raises");
        assert!(
            matches!(&error, ChatTemplateError::Raised(m) if m == "no system role"),
            "{error}"
        );
    }

    #[test]
    fn python_methods_namespace_and_loop_controls() {
        let source = "{%- set ns = namespace(n=0) %}{%- for m in messages %}{%- if m.role == 'skip' %}{% continue %}{% endif %}{%- set ns.n = ns.n + 1 %}{{ m.content.strip().split(',')[-1].upper() }}{%- endfor %}{{ ns.n }}";
        let messages = [
            ChatMessage::new("user", " a,b "),
            ChatMessage::new("skip", "x"),
            ChatMessage::new("user", "c,d"),
        ];
        assert_eq!(render(source, &messages).expect("renders"), "BD2");
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-07-26 12:34:56 UTC, a Friday.
        let t = 1_721_997_296;
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(
            strftime("%A %B %j %H:%M:%S %p %%", t),
            "Friday July 208 12:34:56 PM %"
        );
        assert_eq!(strftime("%F", 0), "1970-01-01");
    }

    #[test]
    fn python_float_repr_cases() {
        assert_eq!(python_float_repr(1.0), "1.0");
        assert_eq!(python_float_repr(0.1), "0.1");
        assert_eq!(python_float_repr(1e16), "1e+16");
        assert_eq!(python_float_repr(1.5e-5), "1.5e-05");
        assert_eq!(python_float_repr(123456.0), "123456.0");
    }
}
