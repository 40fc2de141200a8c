//! A request's structured-output fields ([`Structured`]) as the grammar its sampler applies:
//! which field asks for what, and a 400 naming the field when one is malformed or does not
//! compile. The masking itself is the engine's (`engine::grammar`).

use engine::{GrammarCompiler, GrammarError, GrammarSpec, TokenConstraint};
use serde_json::Value;

use crate::api::{ApiError, Structured};

/// The grammar `s` asks for, if any.
pub fn spec(s: &Structured) -> Result<Option<(&'static str, GrammarSpec)>, ApiError> {
    let mut asked = Vec::new();
    if let Some(format) = &s.response_format
        && let Some(spec) = response_format(format)?
    {
        asked.push(("response_format", spec));
    }
    if let Some(schema) = &s.json_schema {
        let schema = schema_object(schema, "json_schema", "json_schema")?;
        asked.push(("json_schema", GrammarSpec::JsonSchema(schema)));
    }
    if let Some(grammar) = &s.grammar {
        asked.push(("grammar", GrammarSpec::Lark(text(grammar, "grammar")?)));
    }
    if let Some(regex) = &s.regex {
        asked.push(("regex", GrammarSpec::Regex(text(regex, "regex")?)));
    }
    if asked.len() > 1 {
        let names: Vec<&str> = asked.iter().map(|(name, _)| *name).collect();
        return Err(ApiError::invalid_param(
            asked[1].0,
            format!(
                "{} each constrain the output: give at most one",
                names.join(" and ")
            ),
        ));
    }
    Ok(asked.pop())
}

/// Compiles what `s` asks for against the model's vocabulary.
pub fn constraint(
    compiler: &Result<GrammarCompiler, GrammarError>,
    s: &Structured,
) -> Result<Option<TokenConstraint>, ApiError> {
    let Some((param, spec)) = spec(s)? else {
        return Ok(None);
    };
    let compiler = compiler
        .as_ref()
        .map_err(|e| ApiError::invalid_param(param, e.to_string()))?;
    compiler
        .compile(&spec)
        .map(Some)
        .map_err(|e| ApiError::invalid_param(param, e.to_string()))
}

/// OpenAI's `response_format`; llama-server's `{"type": "json_object", "schema": {...}}` too.
fn response_format(format: &Value) -> Result<Option<GrammarSpec>, ApiError> {
    let invalid = |message: String| ApiError::invalid_param("response_format", message);
    let kind = format.get("type").and_then(Value::as_str).ok_or_else(|| {
        invalid("response_format must be an object with a string `type`: text, json_object or json_schema".into())
    })?;
    match kind {
        "text" => Ok(None),
        "json_object" => match format.get("schema") {
            Some(schema) => Ok(Some(GrammarSpec::JsonSchema(schema_object(
                schema,
                "response_format",
                "response_format.schema",
            )?))),
            None => Ok(Some(GrammarSpec::JsonObject)),
        },
        "json_schema" => {
            let schema = format
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .ok_or_else(|| {
                    invalid("response_format of type json_schema needs `json_schema.schema`".into())
                })?;
            Ok(Some(GrammarSpec::JsonSchema(schema_object(
                schema,
                "response_format",
                "response_format.json_schema.schema",
            )?)))
        }
        other => Err(invalid(format!(
            "unknown response_format type `{other}`; supported: text, json_object, json_schema"
        ))),
    }
}

/// A JSON schema is an object (or `true`, which allows any value).
fn schema_object(schema: &Value, param: &'static str, field: &str) -> Result<Value, ApiError> {
    match schema {
        Value::Object(_) => Ok(schema.clone()),
        Value::Bool(true) => Ok(serde_json::json!({})),
        _ => Err(ApiError::invalid_param(
            param,
            format!("{field} must be a JSON schema object"),
        )),
    }
}

fn text(v: &Value, field: &'static str) -> Result<String, ApiError> {
    match v {
        Value::String(s) if !s.trim().is_empty() => Ok(s.clone()),
        _ => Err(ApiError::invalid_param(
            field,
            format!("{field} must be a non-empty string"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn structured(body: &str) -> Structured {
        serde_json::from_str(body).unwrap()
    }

    #[test]
    fn each_field_asks_for_its_grammar() {
        let schema =
            serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let cases = [
            (r#"{}"#, None),
            (r#"{"response_format": {"type": "text"}}"#, None),
            (r#"{"response_format": null}"#, None),
            (
                r#"{"response_format": {"type": "json_object"}}"#,
                Some(("response_format", GrammarSpec::JsonObject)),
            ),
            (
                r#"{"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": true,
                    "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}}"#,
                Some(("response_format", GrammarSpec::JsonSchema(schema.clone()))),
            ),
            (
                r#"{"response_format": {"type": "json_object",
                    "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}"#,
                Some(("response_format", GrammarSpec::JsonSchema(schema.clone()))),
            ),
            (
                r#"{"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}"#,
                Some(("json_schema", GrammarSpec::JsonSchema(schema))),
            ),
            (
                r#"{"grammar": "start: \"yes\" | \"no\""}"#,
                Some((
                    "grammar",
                    GrammarSpec::Lark(r#"start: "yes" | "no""#.into()),
                )),
            ),
            (
                r#"{"regex": "[0-9]+"}"#,
                Some(("regex", GrammarSpec::Regex("[0-9]+".into()))),
            ),
        ];
        for (body, want) in cases {
            assert_eq!(spec(&structured(body)).unwrap(), want, "{body}");
        }
    }

    #[test]
    fn malformed_fields_are_refused_by_name() {
        for (body, param, needle) in [
            (
                r#"{"response_format": {"type": "xml"}}"#,
                "response_format",
                "xml",
            ),
            (r#"{"response_format": "json"}"#, "response_format", "type"),
            (
                r#"{"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}"#,
                "response_format",
                "json_schema.schema",
            ),
            (
                r#"{"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}"#,
                "response_format",
                "schema object",
            ),
            (r#"{"grammar": ""}"#, "grammar", "non-empty"),
            (r#"{"regex": 5}"#, "regex", "string"),
            (
                r#"{"grammar": "start: \"a\"", "regex": "a"}"#,
                "regex",
                "grammar and regex",
            ),
        ] {
            let e = spec(&structured(body)).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param, Some(param), "{body}");
            assert!(e.message.contains(needle), "{body}: {}", e.message);
        }
    }
}
