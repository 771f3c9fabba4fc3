//! Runs the browser test of the manual-test page (tests/browser/ui.test.mjs) against this build
//! of `hrm`, in Debian's headless Chromium.

mod common;

#[test]
fn the_manual_test_page_works_in_chromium() {
    let stdout = common::run_browser_test("ui.test.mjs", &[("HRM_BIN", env!("CARGO_BIN_EXE_hrm"))]);
    assert!(
        stdout.contains("# pass 3"),
        "expected 3 passing browser tests:\n{stdout}"
    );
}
