//! `hrm hub` as an operator runs it: init, ingest, serve, versions, rollback, through the
//! binary. The hub process is killed with SIGKILL while it holds accepted updates and must
//! lose none of them; the dashboard is then checked in headless Chromium.

mod common;

use hrm_wire::update::{Encoding, encode_update, read_checkpoint};
use hrm_wire::{AggregateOutcome, GradientUpload, Hardware, HubClient};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

const ADMIN_KEY: &str = "cli-test-admin-key-0123456789abcdef012345";

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hrm-text-prefix")
}

fn hrm(args: &[&str], data: &Path) -> Output {
    let output = Command::new(env!("CARGO_BIN_EXE_hrm"))
        .args(args)
        .arg("--data-dir")
        .arg(data)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "hrm {args:?} failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

struct Server {
    child: Child,
    url: String,
}

impl Server {
    async fn start(data: &Path, extra: &[&str]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(env!("CARGO_BIN_EXE_hrm"))
            .args(["hub", "serve", "--addr", &format!("127.0.0.1:{port}")])
            .arg("--data-dir")
            .arg(data)
            .args(["--aggregation-interval", "3600", "--verify-fraction", "0"])
            // The simulated clients send made-up updates: no probation, no norm screen.
            .args(["--probation-agreements", "0", "--norm-bound", "0"])
            .args(extra)
            .env("HRM_HUB_ADMIN_KEY", ADMIN_KEY)
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let url = format!("http://127.0.0.1:{port}");
        // Waiting for the process to bind its port; a dead process fails the test.
        let mut server = Self { child, url };
        hrm_wire::install_tls_provider();
        for _ in 0..600 {
            if reqwest::get(format!("{}/healthz", server.url))
                .await
                .is_ok()
            {
                return server;
            }
            assert!(
                server.child.try_wait().unwrap().is_none(),
                "hrm hub serve exited"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        server.kill();
        panic!("hrm hub serve did not start");
    }

    fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

/// Registers a worker and uploads one made-up (but well-formed) update for its batch.
async fn contribute(url: &str, name: &str) -> uuid::Uuid {
    let client =
        HubClient::new(url, format!("cli-{name}-{}", uuid::Uuid::new_v4().simple())).unwrap();
    let worker = client.register(Some(name), None).await.unwrap().worker_id;
    let batch = client
        .request_batch(worker, Hardware::default())
        .await
        .unwrap()
        .unwrap();
    let checkpoint = client
        .download(&format!("/api/v1/model/download/{}", batch.model_version))
        .await
        .unwrap();
    let (schema, params) = read_checkpoint(&checkpoint).unwrap();
    let update: Vec<f32> = params
        .iter()
        .enumerate()
        .map(|(i, p)| p * 1e-3 + (i % 7) as f32 * 1e-5)
        .collect();
    let target = client.upload_target(worker, batch.batch_id).await.unwrap();
    client
        .put_update(
            &target,
            encode_update(&schema, &update, &batch.model_version, Encoding::Dense),
        )
        .await
        .unwrap();
    let receipt = client
        .upload_gradients(&GradientUpload {
            worker_id: worker,
            batch_id: batch.batch_id,
            model_version: batch.model_version,
            gradients_url: target.gradients_url,
            loss: 2.0,
            num_samples: batch.num_samples,
        })
        .await
        .unwrap();
    receipt.update_id
}

fn prepare(data: &Path) {
    let corpus = data.join("corpus.txt");
    let text: String = (0..400)
        .map(|i| format!("Paragraph {i} of the hub test, with a few words in it.\n\n"))
        .collect();
    std::fs::write(&corpus, text).unwrap();
    let valid = data.join("valid.txt");
    std::fs::write(
        &valid,
        "A held-out paragraph for the validation loss.\n\nAnd another one.\n",
    )
    .unwrap();
    let init = hrm(
        &["hub", "init", "--model", fixture().to_str().unwrap()],
        data,
    );
    assert!(
        stdout(&init).contains("published v0.1.0"),
        "{}",
        stdout(&init)
    );
    let tokenizer = fixture().join("tokenizer.json");
    let ingest_args = [
        "hub",
        "ingest",
        "--corpus",
        corpus.to_str().unwrap(),
        "--valid",
        valid.to_str().unwrap(),
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--batch-size",
        "8",
        "--custom-size",
        "--seq-len",
        "16",
    ];
    let first = stdout(&hrm(&ingest_args, data));
    assert!(first.contains(" new)"), "{first}");
    // Ingesting the same corpus again adds nothing.
    let again = stdout(&hrm(&ingest_args, data));
    assert!(again.contains("(0 new)"), "{again}");
    // The sizes outside 256/512/1024 need --custom-size.
    let refused = Command::new(env!("CARGO_BIN_EXE_hrm"))
        .args([
            "hub",
            "ingest",
            "--corpus",
            corpus.to_str().unwrap(),
            "--batch-size",
            "100",
            "--data-dir",
        ])
        .arg(data)
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--batch-size must be 256, 512 or 1024")
    );
}

#[tokio::test]
async fn a_killed_hub_loses_no_accepted_update_and_rolls_back() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    prepare(data);

    let mut server = Server::start(data, &["--min-gradients-for-update", "100"]).await;
    let mut accepted = Vec::new();
    for name in ["ann", "ben", "cat"] {
        accepted.push(contribute(&server.url, name).await);
    }
    server.kill();

    let mut server = Server::start(data, &["--min-gradients-for-update", "3"]).await;
    let admin = HubClient::new(&server.url, ADMIN_KEY).unwrap();
    assert_eq!(admin.global_stats().await.unwrap().updates_pending, 3);
    let outcome = admin.aggregate().await.unwrap();
    assert_eq!(
        outcome,
        AggregateOutcome::Success {
            version: "v0.1.1".into(),
            num_updates: 3,
            rejected: 0
        }
    );
    server.kill();

    let versions = stdout(&hrm(&["hub", "versions"], data));
    assert!(versions.contains("* v0.1.1"), "{versions}");
    assert!(versions.contains("valid_loss"), "{versions}");
    let rolled = stdout(&hrm(&["hub", "rollback", "v0.1.0"], data));
    assert!(rolled.contains("current version is now v0.1.0"), "{rolled}");
    let versions = stdout(&hrm(&["hub", "versions"], data));
    assert!(versions.contains("* v0.1.0"), "{versions}");
    // Every update the killed hub accepted was aggregated exactly once.
    let server = Server::start(data, &[]).await;
    let stats = HubClient::new(&server.url, ADMIN_KEY)
        .unwrap()
        .global_stats()
        .await
        .unwrap();
    assert_eq!(
        (
            stats.updates_aggregated,
            stats.updates_pending,
            stats.current_version.as_deref()
        ),
        (3, 0, Some("v0.1.0"))
    );
    assert_eq!(accepted.len(), 3);
    let mut server = server;
    server.kill();
}

#[tokio::test]
async fn the_dashboard_works_in_chromium() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    prepare(data);
    let mut server = Server::start(data, &["--min-gradients-for-update", "2"]).await;
    let admin = HubClient::new(&server.url, ADMIN_KEY).unwrap();
    for round in 0..2 {
        contribute(&server.url, &format!("dash{round}a")).await;
        contribute(&server.url, &format!("dash{round}b")).await;
        // The scheduler may have aggregated on its own already; either way a version follows.
        match admin.aggregate().await {
            Ok(_) => {}
            Err(e) => assert_eq!(e.code(), Some("aggregation_running"), "{e}"),
        }
    }
    // Both rounds' versions are published before the page is looked at.
    for _ in 0..600 {
        if admin.versions().await.unwrap().len() == 3 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(admin.versions().await.unwrap().len(), 3);
    // A veteran past the first badge threshold (set in the database: a thousand real
    // batches would take minutes).
    let db = hrm_hub::db::Db::connect(&format!("sqlite://{}", data.join("hub.db").display()))
        .await
        .unwrap();
    sqlx::query("UPDATE workers SET validated_batches = 1200 WHERE username = 'dash0a'")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut envs = vec![("HRM_HUB_URL", server.url.as_str())];
    let screenshot = std::env::var("HRM_SCREENSHOT").unwrap_or_default();
    if !screenshot.is_empty() {
        envs.push(("HRM_SCREENSHOT", screenshot.as_str()));
    }
    let out = common::run_browser_test("dashboard.test.mjs", &envs);
    assert!(
        out.contains("# pass 4"),
        "expected 4 passing dashboard tests:\n{out}"
    );
    server.kill();
}
