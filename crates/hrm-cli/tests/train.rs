//! `hrm train` end to end on the tiny fixture architecture: progress log, evaluation, Hugging Face
//! export, and a resumed run that matches an uninterrupted one bit for bit.

use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn corpus(dir: &Path) -> (PathBuf, PathBuf) {
    let text = "It was a dark and stormy night; the rain fell in torrents.\nThe quick brown fox jumps over the lazy dog.\n\n\
                Call me Ishmael. Some years ago, never mind how long precisely.\n\n";
    let (train, valid) = (dir.join("train.txt"), dir.join("valid.txt"));
    std::fs::write(&train, text.repeat(20)).unwrap();
    std::fs::write(&valid, text.repeat(3)).unwrap();
    (train, valid)
}

fn train(dir: &Path, out: &str, steps: usize, extra: &[&str]) -> std::process::Output {
    let (train, valid) = corpus(dir);
    Command::new(env!("CARGO_BIN_EXE_hrm"))
        .arg("train")
        .args([
            "--config",
            fixture("hrm-text").join("config.json").to_str().unwrap(),
        ])
        .args([
            "--tokenizer",
            fixture("hrm-text").join("tokenizer.json").to_str().unwrap(),
        ])
        .args([
            "--train",
            train.to_str().unwrap(),
            "--valid",
            valid.to_str().unwrap(),
        ])
        .args(["--out", dir.join(out).to_str().unwrap()])
        .args(["--steps", "6", "--stop-after", &steps.to_string()])
        .args([
            "--batch-size",
            "4",
            "--micro-batch",
            "2",
            "--seq-len",
            "16",
            "--warmup",
            "2",
        ])
        .args(["--eval-every", "2", "--eval-windows", "4", "--headless"])
        .args(extra)
        .output()
        .unwrap()
}

fn ok(output: std::process::Output) -> String {
    assert!(
        output.status.success(),
        "hrm train failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn trains_exports_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let evals = ok(train(dir.path(), "straight", 6, &[]));
    let lines: Vec<serde_json::Value> = evals
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3, "an evaluation every 2 steps: {evals}");
    assert!(
        lines
            .iter()
            .all(|l| l["valid_perplexity"].as_f64().unwrap() > 1.0)
    );
    let first = lines[0]["valid_loss"].as_f64().unwrap();
    let last = lines[2]["valid_loss"].as_f64().unwrap();
    assert!(
        last < first,
        "validation loss did not fall: {first} -> {last}"
    );

    // The export is a Hugging Face checkpoint that our loader (and transformers) reads.
    let export = dir.path().join("straight");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(export.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["num_layers_per_stack"], 2);
    assert_eq!(
        config["num_hidden_layers"], 12,
        "transformers' inflated KV-slot count"
    );
    assert_eq!(config["architectures"][0], "HrmTextForCausalLM");
    let loaded = hrm_model::load_model(
        &export,
        None,
        &candle_core::Device::Cpu,
        candle_core::DType::F32,
    )
    .unwrap();
    assert_eq!(loaded.model.info().num_parameters, 221_248);

    // Four steps, stop, resume for the last two: the same weights as six straight steps.
    ok(train(dir.path(), "resumed", 4, &[]));
    let again = train(dir.path(), "resumed", 6, &[]);
    assert!(
        !again.status.success(),
        "a second run into the same --out must ask for --resume"
    );
    assert!(String::from_utf8_lossy(&again.stderr).contains("--resume"));
    let changed = train(dir.path(), "resumed", 6, &["--resume", "--lr", "0.1"]);
    assert!(
        String::from_utf8_lossy(&changed.stderr).contains("\"lr\""),
        "a changed setting is refused"
    );
    ok(train(dir.path(), "resumed", 6, &["--resume"]));
    let a = std::fs::read(dir.path().join("straight/checkpoint/model.safetensors")).unwrap();
    let b = std::fs::read(dir.path().join("resumed/checkpoint/model.safetensors")).unwrap();
    assert!(
        a == b,
        "the resumed run diverged from the uninterrupted one"
    );
}

#[test]
fn bad_arguments_get_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_hrm"))
        .args([
            "train", "--config", "c.json", "--train", "t.txt", "--valid", "v.txt",
        ])
        .args([
            "--tokenizer",
            "tok.json",
            "--out",
            "o",
            "--batch-size",
            "5",
            "--micro-batch",
            "2",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--batch-size (5) must be a multiple of --micro-batch (2)"),
        "{err}"
    );
}

/// `hrm bench train` and `hrm bench model` on the fixture, our side only (the reference side
/// needs torch, which CI does not install): each runs its measurement processes for every
/// round and reports one row per config or batch, with positive figures and the rounds named.
#[test]
fn benches_report_one_row_over_their_rounds() {
    let bench = |args: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_hrm"))
            .arg("bench")
            .args(args)
            .env_remove("HRM_REFERENCE_PYTHON")
            .output()
            .unwrap();
        ok(output)
    };
    // The rows under the table's header.
    let rows = |table: &str| -> Vec<Vec<String>> {
        table
            .lines()
            .skip_while(|l| !l.starts_with("|---"))
            .skip(1)
            .take_while(|l| l.starts_with("| "))
            .map(|l| l.split('|').map(|c| c.trim().to_string()).collect())
            .collect()
    };
    let model_dir = fixture("hrm-text");
    let config = model_dir.join("config.json");
    let trained = bench(&[
        "train",
        "--config",
        config.to_str().unwrap(),
        "--batch-size",
        "2",
        "--micro-batch",
        "1",
        "--seq-len",
        "8",
        "--steps",
        "1",
        "--rounds",
        "2",
    ]);
    let train_rows = rows(&trained);
    assert_eq!(train_rows.len(), 1, "{trained}");
    let tokens_per_s: f64 = train_rows[0][2].parse().unwrap();
    assert!(tokens_per_s > 0.0, "{trained}");
    assert_eq!(train_rows[0][3], "–", "no reference side ran: {trained}");
    assert!(trained.contains("the median of 2 rounds"), "{trained}");

    let served = bench(&[
        "model",
        "--model",
        model_dir.to_str().unwrap(),
        "--batch-sizes",
        "1,2",
        "--prompt-tokens",
        "4",
        "--decode-tokens",
        "2",
        "--rounds",
        "3",
    ]);
    let model_rows = rows(&served);
    assert_eq!(model_rows.len(), 2, "one row per batch size: {served}");
    for row in &model_rows {
        for figure in [&row[3], &row[6], &row[9]] {
            assert!(figure.parse::<f64>().unwrap() > 0.0, "{served}");
        }
    }
    assert!(served.contains("the median of 3 rounds"), "{served}");
}
