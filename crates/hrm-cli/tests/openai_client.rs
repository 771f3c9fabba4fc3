//! The clients people drive `hrm serve`'s OpenAI routes with, on the SmolLM2 GGUF, whose chat
//! template is real: OpenAI's official Python package (completions, completions streamed, chat,
//! chat streamed, `n`; `tests/openai/check_client.py`), and lm-evaluation-harness's
//! `local-chat-completions` model on a small generation task (`tests/lm_eval/check_chat.py`).
//! Each is installed from PyPI into its own environment under `target/` on first use.

mod support;

use std::path::PathBuf;
use std::process::Command;
use support::{free_port, python_venv, repo, smollm2_gguf, start};

/// Runs `script BASE_URL GGUF` with `python` against a fresh server on the SmolLM2 GGUF; fails
/// with both sides' output.
async fn check(python: PathBuf, script: &str) {
    let gguf = smollm2_gguf();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let mut command = Command::new(env!("CARGO_BIN_EXE_hrm"));
    command
        .args(["serve", "--host", "127.0.0.1", "--port", &port.to_string()])
        .arg("--model-path")
        .arg(&gguf)
        .args(["--device", "cpu", "--max-batch-size", "8"]);
    let server = start(command, &log, &format!("{base}/readyz")).await;
    let output = Command::new(python)
        .arg(repo().join(script))
        .arg(&base)
        .arg(&gguf)
        .output()
        .unwrap();
    drop(server);
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        output.status.success(),
        "{script} failed:\n{}\n{}\nserver log:\n{log_text}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    eprintln!("{}", String::from_utf8_lossy(&output.stdout));
    assert!(!log_text.contains("panicked"), "{log_text}");
}

#[tokio::test]
async fn the_openai_package_drives_completions_and_chat() {
    let python = python_venv("openai", "tests/openai/requirements.txt", "python");
    check(python, "tests/openai/check_client.py").await;
}

#[tokio::test]
async fn lm_eval_local_chat_completions_records_the_servers_answers() {
    let python = python_venv("lm-eval", "tests/lm_eval/requirements.txt", "python");
    check(python, "tests/lm_eval/check_chat.py").await;
}
