//! Runs the browser test of the manual-test page (tests/browser/ui.test.mjs) against this build of
//! `hrm`, in Debian's headless Chromium. Installs playwright-core from npm when it is missing; a
//! missing Chromium or Node.js is an error that says what to install, never a silent skip.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn the_manual_test_page_works_in_chromium() {
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
            .expect("npm (Node.js) is needed for the browser test");
        assert!(status.success(), "npm ci failed in {}", dir.display());
    }
    let output = Command::new("node")
        .arg("--test")
        .current_dir(&dir)
        .env("HRM_BIN", env!("CARGO_BIN_EXE_hrm"))
        .env("CHROMIUM", &chromium)
        .output()
        .expect("node (Node.js) is needed for the browser test");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "browser test failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.contains("# pass 3"),
        "expected 3 passing browser tests:\n{stdout}"
    );
}
