//! Logs to stderr through `tracing`: `RUST_LOG` picks what is shown (`MOESHARD_LOG`, the name
//! used before, still works and is deprecated), `--log-format` picks text or one JSON object a
//! line, and text is coloured only when stderr is a terminal (not in files, pipes or CI logs).

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line (timestamp, level, target, fields), for log collectors.
    Json,
}

/// Installs the global subscriber; call once, before anything logs.
pub fn init(format: LogFormat) {
    let (spec, deprecated) = filter_spec(
        std::env::var("RUST_LOG").ok(),
        std::env::var("MOESHARD_LOG").ok(),
    );
    let (filter, invalid) = match EnvFilter::try_new(&spec) {
        Ok(f) => (f, None),
        Err(e) => (EnvFilter::new("info"), Some(e)),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
            .init(),
        LogFormat::Json => builder.json().init(),
    }
    if deprecated {
        tracing::warn!("MOESHARD_LOG is deprecated: set RUST_LOG instead");
    }
    if let Some(e) = invalid {
        tracing::warn!("log filter {spec:?} is invalid ({e}); logging at info");
    }
}

/// The filter directives: `RUST_LOG`, else `MOESHARD_LOG` (flagged as deprecated), else `info`.
fn filter_spec(rust_log: Option<String>, moeshard_log: Option<String>) -> (String, bool) {
    let set = |v: Option<String>| v.filter(|s| !s.trim().is_empty());
    match (set(rust_log), set(moeshard_log)) {
        (Some(s), _) => (s, false),
        (None, Some(s)) => (s, true),
        (None, None) => ("info".into(), false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_log_wins_and_moeshard_log_is_the_deprecated_fallback() {
        let s = |v: &str| Some(v.to_string());
        assert_eq!(
            filter_spec(s("debug"), s("warn")),
            ("debug".to_string(), false)
        );
        assert_eq!(filter_spec(None, s("warn")), ("warn".to_string(), true));
        assert_eq!(filter_spec(s(" "), None), ("info".to_string(), false));
        assert_eq!(filter_spec(None, None), ("info".to_string(), false));
    }
}
