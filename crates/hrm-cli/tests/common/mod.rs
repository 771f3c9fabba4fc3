//! Shared by the CLI tests that drive a browser: runs one `tests/browser/*.test.mjs` file
//! with `node --test` in Debian's headless Chromium. Installs playwright-core from npm when it
//! is missing; a missing Chromium or Node.js is an error that says what to install, never a
//! silent skip.

use std::path::PathBuf;
use std::process::Command;

/// Runs `file` and returns node's TAP output; panics with the output when a test fails.
pub fn run_browser_test(file: &str, envs: &[(&str, &str)]) -> String {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/browser");
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    assert!(
        PathBuf::from(&chromium).exists(),
        "{chromium} not found: install Debian's chromium (apt-get install chromium chromium-driver) or set CHROMIUM"
    );
    if !dir.join("node_modules/playwright-core").exists() {
        let status = Command::new("npm")
            .args(["ci", "--silent", "--no-audit", "--no-fund"])
            .current_dir(&dir)
            .status()
            .expect("npm (Node.js) is needed for the browser tests");
        assert!(status.success(), "npm ci failed in {}", dir.display());
    }
    let output = Command::new("node")
        .args(["--test", file])
        .current_dir(&dir)
        .env("CHROMIUM", &chromium)
        .envs(envs.iter().copied())
        .output()
        .expect("node (Node.js) is needed for the browser tests");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "browser test {file} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}
