//! `hrm serve` settings precedence (flags, then environment, then YAML, then defaults) and
//! `--dry-run`, through the real binary.

use std::path::PathBuf;
use std::process::Command;

fn hrm(args: &[&str], envs: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hrm"));
    cmd.args(args);
    for var in [
        "HRM_MAX_BATCH_SIZE",
        "HRM_MODEL_PATH",
        "HRM_SERVE_CONFIG",
        "HRM_DEVICE",
        "HRM_MAX_NEW_TOKENS",
    ] {
        cmd.env_remove(var);
    }
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn effective(args: &[&str], envs: &[(&str, &str)]) -> serde_json::Value {
    let out = hrm(&[&["serve", "--print-config"], args].concat(), envs);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let yaml: serde_json::Value = serde_norway::from_slice(&out.stdout).unwrap();
    yaml["serve"].clone()
}

#[test]
fn flags_then_environment_then_yaml_then_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("hrm.yaml");
    std::fs::write(
        &file,
        "serve:\n  max_batch_size: 4\n  max_new_tokens: 300\n  port: 9001\n",
    )
    .unwrap();
    let file = file.to_str().unwrap();

    let c = effective(&["--config", file], &[]);
    assert_eq!(
        (c["max_batch_size"].as_u64(), c["port"].as_u64()),
        (Some(4), Some(9001)),
        "YAML over defaults"
    );
    assert_eq!(c["max_queued_tokens"], 1 << 20, "default");

    let c = effective(&["--config", file], &[("HRM_MAX_BATCH_SIZE", "7")]);
    assert_eq!(c["max_batch_size"], 7, "environment over YAML");
    assert_eq!(c["max_new_tokens"], 300);

    let c = effective(
        &["--config", file, "--max-batch-size", "9"],
        &[("HRM_MAX_BATCH_SIZE", "7")],
    );
    assert_eq!(c["max_batch_size"], 9, "flag over environment");

    let c = effective(&[], &[("HRM_SERVE_CONFIG", file)]);
    assert_eq!(c["port"], 9001, "HRM_SERVE_CONFIG names the file");
}

/// One shell may set the variables of `hrm worker` and `hrm serve` at once: each program reads
/// its own, and `--print-config` says which ones it read and which it left alone.
#[test]
fn another_programs_variables_change_nothing() {
    let envs = [
        ("HRM_WORKER_MAX_BATCH_SIZE", "3"),
        ("HRM_WORKER_API_KEY", "worker-secret-key-0123456789abcdef"),
        ("HRM_SERVE_MAX_QUEUED_TOKENS", "5000"),
    ];
    let c = effective(&[], &envs);
    assert_eq!(c["max_batch_size"], 16);
    assert_eq!(c["max_queued_tokens"], 5000);
    assert!(c["api_key"].is_null(), "{c}");
    let out = hrm(&["serve", "--print-config"], &envs);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("# read from the environment: HRM_SERVE_MAX_QUEUED_TOKENS"),
        "{text}"
    );
    assert!(
        text.contains("# not read by hrm serve: HRM_WORKER_API_KEY, HRM_WORKER_MAX_BATCH_SIZE"),
        "{text}"
    );
    assert!(
        !text.contains("worker-secret"),
        "a value was printed: {text}"
    );
}

#[test]
fn dry_run_loads_and_reports_or_fails_plainly() {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hrm-text");
    let out = hrm(
        &[
            "serve",
            "--dry-run",
            "--device",
            "cpu",
            "--model-path",
            fixture.to_str().unwrap(),
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["family"], "hrm_text");
    assert_eq!(report["device"], "cpu");

    let out = hrm(
        &["serve", "--dry-run", "--model-path", "/no/such/model"],
        &[],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/no/such/model"), "{err}");
}

/// The first lines `hrm serve` logs until it says it is listening, with `args`.
fn startup_log(args: &[&str]) -> String {
    use std::io::{BufRead, BufReader};
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hrm-text");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hrm"))
        .args(["serve", "--device", "cpu", "--port", &port, "--model-path"])
        .arg(&fixture)
        .args(args)
        .env_remove("HRM_SERVE_API_KEY")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut log = String::new();
    for line in BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        log.push_str(&line);
        log.push('\n');
        if line.contains("listening") {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    log
}

/// Listening beyond loopback with no key is allowed, but never silently.
#[test]
fn an_open_address_without_a_key_is_warned_about() {
    let warning = "NON-LOOPBACK ADDRESS WITH NO API KEY";
    assert!(startup_log(&["--host", "0.0.0.0"]).contains(warning));
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, "a-serving-key-0123456789\n").unwrap();
    let keyed = startup_log(&["--host", "0.0.0.0", "--api-key-file", key.to_str().unwrap()]);
    assert!(!keyed.contains(warning), "{keyed}");
    assert!(!startup_log(&["--host", "127.0.0.1"]).contains(warning));
}
