//! An installed `moeshard` (what `cargo install --path crates/cli` puts in `~/.cargo/bin`) runs
//! its default model with no checkout around: the demo model is built into the binary. The
//! binary is copied into an empty directory and run from another one, with a fresh `HOME` and
//! no `MOESHARD_DEFAULT_MODEL`; its greedy continuation must be the stored one and its log must
//! name the built-in model (not a file).

use std::path::Path;
use std::process::Command;

#[test]
fn installed_binary_runs_the_built_in_demo_model_from_any_directory() {
    let expected = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/demo/run_romeo_greedy.txt"),
    )
    .unwrap();
    let bin_dir = tempfile::tempdir().unwrap();
    let cwd = tempfile::tempdir().unwrap();
    let installed = bin_dir.path().join("moeshard");
    std::fs::copy(env!("CARGO_BIN_EXE_moeshard"), &installed).unwrap();
    let out = Command::new(&installed)
        .args(["run", "-t", "1", "-p", "ROMEO:", "-n", "8", "--temp", "0"])
        .current_dir(cwd.path())
        .env_clear()
        .env("HOME", cwd.path())
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("loaded the built-in demo model shakespeare-moe"),
        "{stderr}"
    );
    let got = String::from_utf8(out.stdout).unwrap();
    let got = got.trim_end();
    assert!(got.len() > "ROMEO:".len() + 4, "{got:?}");
    assert!(
        expected.starts_with(got),
        "{got:?} is not a prefix of the stored greedy continuation {expected:?}"
    );
}
