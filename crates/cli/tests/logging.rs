//! Logs: `--log-format json` gives one JSON object a line, text has no colour codes when stderr
//! is not a terminal, `RUST_LOG` filters, and `MOESHARD_LOG` still works with a deprecation
//! warning.

use std::process::Command;

/// stderr of a one-token `moeshard run` on the built-in model with these flags and variables.
fn stderr_of(flags: &[&str], env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_moeshard"));
    cmd.args(["run", "-t", "1", "-p", "ROMEO:", "-n", "1", "--temp", "0"])
        .args(flags)
        .env_remove("RUST_LOG")
        .env_remove("MOESHARD_LOG")
        .env_remove("MOESHARD_DEFAULT_MODEL")
        .envs(env.iter().copied());
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(out.status.success(), "{stderr}");
    stderr
}

#[test]
fn json_lines_text_without_colour_and_the_filter_variables() {
    let json = stderr_of(&["--log-format", "json"], &[("RUST_LOG", "info")]);
    let records: Vec<serde_json::Value> = json
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let loaded = records
        .iter()
        .find(|r| {
            r["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("loaded the built-in demo model"))
        })
        .unwrap_or_else(|| panic!("no load record in {json}"));
    assert_eq!(loaded["level"], "INFO");
    assert!(loaded["timestamp"].is_string(), "{loaded}");

    let text = stderr_of(&[], &[("RUST_LOG", "info")]);
    assert!(text.contains("loaded the built-in demo model"), "{text}");
    assert!(
        !text.contains('\x1b'),
        "colour codes in piped logs: {text:?}"
    );

    let quiet = stderr_of(&[], &[("RUST_LOG", "warn")]);
    assert!(!quiet.contains("loaded the built-in"), "{quiet}");

    let old = stderr_of(&[], &[("MOESHARD_LOG", "info")]);
    assert!(old.contains("MOESHARD_LOG is deprecated"), "{old}");
    assert!(old.contains("loaded the built-in demo model"), "{old}");
}
