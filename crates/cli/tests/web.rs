//! The built-in web page in headless Chromium (`tools/web-tests/run.sh`, Selenium driving
//! Debian's chromium-driver): `moeshard serve` on the demo model built into the binary, the
//! page loaded, its cluster view checked against `/v1/status`, a chat message sent and the
//! streamed reply rendered exactly as the API's non-streamed reply. The script installs
//! Chromium when it is missing and it may (root with apt-get, as in CI) and fails otherwise;
//! `MOESHARD_SKIP_BROWSER=1` skips this test on a machine without a browser (never set in CI).

mod common;

use std::process::Command;
use std::time::Duration;

use common::{Proc, repo};

#[test]
fn built_in_page_chats_and_shows_the_cluster_in_chromium() {
    if std::env::var_os("MOESHARD_SKIP_BROWSER").is_some_and(|v| v == "1") {
        eprintln!("MOESHARD_SKIP_BROWSER=1: the browser test of the web page is skipped");
        return;
    }
    let server = Proc::spawn("serve", &["serve", "--port", "0", "-t", "1"]);
    let line = server.wait_for_stderr("listening on http://", Duration::from_secs(120));
    let addr = line
        .rsplit("http://")
        .next()
        .and_then(|a| a.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string();
    let script = repo().join("tools/web-tests/run.sh");
    let mut cmd = Command::new("bash");
    cmd.arg(&script).arg(format!("http://{addr}"));
    // Where to save the page's screenshot (docs/web.png is made this way).
    if let Some(dir) = std::env::var_os("MOESHARD_SCREENSHOT_DIR") {
        cmd.arg(dir);
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "the browser test of the web page failed ({}):\n{text}\nserver log:\n{}",
        out.status,
        server.stderr_text()
    );
    eprintln!("{text}");
}
