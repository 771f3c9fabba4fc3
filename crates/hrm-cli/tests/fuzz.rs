//! Schemathesis against both servers, from the OpenAPI documents they publish: every route,
//! a fixed number of generated requests per route and a fixed seed. A response of 500 or
//! more fails the run (the test servers are loaded and idle, so not even the documented 503s
//! are expected), and so does a panic in either server's log.
//!
//! Schemathesis comes from PyPI (`tests/fuzz/requirements.txt`); when it is not installed, it
//! is installed into `target/schemathesis` (`SCHEMATHESIS` names another `st` executable).

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use support::{free_port, python_venv, repo, start};

/// Requests per route and phase.
const EXAMPLES: &str = "50";
const SEED: &str = "20261124";

/// The `st` executable: `SCHEMATHESIS`, else one installed into `target/schemathesis`.
fn schemathesis() -> PathBuf {
    match std::env::var_os("SCHEMATHESIS") {
        Some(st) => st.into(),
        None => python_venv("schemathesis", "tests/fuzz/requirements.txt", "st"),
    }
}

fn hrm() -> Command {
    Command::new(env!("CARGO_BIN_EXE_hrm"))
}

/// Runs schemathesis on `base`'s `/openapi.json`; panics with its report on a failure.
fn fuzz(base: &str, headers: &[&str]) {
    let mut command = Command::new(schemathesis());
    command
        .arg("run")
        .arg(format!("{base}/openapi.json"))
        .args(["--checks", "not_a_server_error"])
        .args(["--max-examples", EXAMPLES, "--seed", SEED])
        .args(["--workers", "1", "--request-timeout", "60"])
        .args(["--suppress-health-check", "all", "--warnings", "off"])
        .current_dir(std::env::temp_dir());
    for header in headers {
        command.args(["-H", header]);
    }
    let output = command.output().expect("running schemathesis");
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "schemathesis found failures on {base}:\n{report}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(report.contains("passed"), "{report}");
}

fn assert_no_panic(log: &Path) {
    let text = std::fs::read_to_string(log).unwrap();
    assert!(
        !text.contains("panicked"),
        "a panic in {}:\n{text}",
        log.display()
    );
}

#[tokio::test]
async fn the_inference_service_survives_schemathesis() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let port = free_port();
    let mut command = hrm();
    command
        .args(["serve", "--host", "127.0.0.1", "--port", &port.to_string()])
        .arg("--model-path")
        .arg(repo().join("tests/fixtures/hrm-text"))
        .args(["--device", "cpu", "--max-new-tokens", "8"]);
    let base = format!("http://127.0.0.1:{port}");
    let server = start(command, &log, &format!("{base}/readyz")).await;
    fuzz(&base, &[]);
    drop(server);
    assert_no_panic(&log);
}

#[tokio::test]
async fn the_hub_survives_schemathesis() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("hub");
    let model = repo().join("tests/fixtures/hrm-text-prefix");
    let corpus = dir.path().join("corpus.txt");
    let text: String = (0..200)
        .map(|i| format!("Paragraph {i} of the fuzz test, with a few words in it.\n\n"))
        .collect();
    std::fs::write(&corpus, text).unwrap();
    let valid = dir.path().join("valid.txt");
    std::fs::write(&valid, "A held-out paragraph.\n\nAnd another one.\n").unwrap();
    for args in [
        vec!["hub", "init", "--model", model.to_str().unwrap()],
        vec![
            "hub",
            "ingest",
            "--corpus",
            corpus.to_str().unwrap(),
            "--valid",
            valid.to_str().unwrap(),
            "--tokenizer",
            model.join("tokenizer.json").to_str().unwrap(),
            "--batch-size",
            "8",
            "--custom-size",
            "--seq-len",
            "16",
        ],
    ] {
        let output = hrm()
            .args(&args)
            .arg("--data-dir")
            .arg(&data)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let log = dir.path().join("hub.log");
    let port = free_port();
    let mut command = hrm();
    command
        .args(["hub", "serve", "--addr", &format!("127.0.0.1:{port}")])
        .arg("--data-dir")
        .arg(&data)
        // The fuzzer is one client sending thousands of requests: the limits would answer most
        // of them 429 before they reach the handlers, and registration may cost no work.
        .args([
            "--challenge-bits",
            "0",
            "--rate-burst",
            "100000",
            "--rate-per-second",
            "100000",
        ])
        .args(["--ip-burst", "100000", "--ip-per-second", "100000"])
        .args([
            "--register-burst",
            "100000",
            "--register-per-hour",
            "100000",
        ]);
    let base = format!("http://127.0.0.1:{port}");
    let server = start(command, &log, &format!("{base}/healthz")).await;
    // A registered worker's key, so that the routes behind it are reached too.
    let key = "fuzz-worker-key-0123456789abcdef0123456789";
    hrm_wire::install_tls_provider();
    let registered = reqwest::Client::new()
        .post(format!("{base}/api/v1/auth/register"))
        .json(&serde_json::json!({"api_key": key, "username": "fuzzer"}))
        .send()
        .await
        .unwrap();
    assert_eq!(registered.status(), 201);
    fuzz(&base, &[&format!("Authorization: Bearer {key}")]);
    drop(server);
    assert_no_panic(&log);
}
