//! The training network end to end, as processes on this machine: `hrm hub serve` and three
//! `hrm worker --headless` train a fresh `hrm_text_moe` from a small text corpus. One worker
//! is killed with SIGKILL in the middle of a batch, and its lease goes to another worker; one
//! hostile client (this test) uploads random updates, which are rejected and cost it
//! reputation. Model versions advance and the validation loss falls; SIGTERM stops the other
//! workers cleanly after their current batch.

use hrm_wire::update::{Encoding, encode_update, read_checkpoint};
use hrm_wire::{GradientUpload, Hardware, HubClient};
use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use support::{Process, free_port};

mod support;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hrm-text-prefix")
}

fn hrm(args: &[&str]) {
    let output = Command::new(env!("CARGO_BIN_EXE_hrm"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "hrm {args:?} failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Sentences from a small grammar: varied, but regular enough to learn in a minute.
fn corpus(paragraphs: usize, seed: u64) -> String {
    let subjects = [
        "the miller",
        "a young clerk",
        "the old queen",
        "my neighbour",
        "the ferryman",
    ];
    let verbs = [
        "walked to",
        "looked at",
        "spoke of",
        "remembered",
        "painted",
    ];
    let objects = [
        "the river",
        "a quiet town",
        "the northern hills",
        "her garden",
        "the harbour",
    ];
    let endings = [
        "at dawn.",
        "in the rain.",
        "before supper.",
        "with great care.",
        "once more.",
    ];
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut pick = |list: &[&'static str]| list[rng.random_range(0..list.len())];
    (0..paragraphs)
        .map(|_| {
            let sentences: Vec<String> = (0..3)
                .map(|_| {
                    format!(
                        "{} {} {} {}",
                        pick(&subjects),
                        pick(&verbs),
                        pick(&objects),
                        pick(&endings)
                    )
                })
                .collect();
            format!("{}\n\n", sentences.join(" "))
        })
        .collect()
}

fn signal(child: &Child, name: &str) {
    let status = Command::new("kill")
        .args([name, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

fn start_worker(dir: &Path, url: &str, name: &str) -> Process {
    let child = Command::new(env!("CARGO_BIN_EXE_hrm"))
        .args(["worker", "--headless", "--server-url", url])
        .arg("--config")
        .arg(dir.join(format!("{name}/worker.yaml")))
        .arg("--cache-dir")
        .arg(dir.join(format!("{name}/cache")))
        .args([
            "--username",
            name,
            "--batch-size",
            "4",
            "--retry-delay",
            "0.5",
        ])
        .args(["--max-batches-per-session", "10000", "--threads", "1"])
        .env("HRM_LOG", "info")
        .stderr(std::fs::File::create(dir.join(format!("{name}.log"))).unwrap())
        .spawn()
        .unwrap();
    Process(child)
}

fn log_of(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default()
}

/// Polls `ready` every 50 ms; fails the test with `what` after `limit`.
async fn until<T>(what: &str, limit: Duration, mut ready: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = ready().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A fresh MoE over the fixture tokenizer's vocabulary, initialised by the hub, and batches cut
/// from a generated corpus.
fn prepare_hub(dir: &Path, data: &Path) {
    let data_arg = data.to_str().unwrap();
    let config = dir.join("moe.json");
    std::fs::write(
        &config,
        serde_json::json!({
            "model_type": "hrm_text_moe", "vocab_size": 320, "hidden_size": 32,
            "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
            "head_dim": 16, "max_position_embeddings": 64, "H_cycles": 1, "L_cycles": 1,
            "prefix_lm": false, "tie_word_embeddings": false, "num_experts": 4,
            "num_experts_per_tok": 2, "router_aux_loss_coef": 0.01
        })
        .to_string(),
    )
    .unwrap();
    std::fs::write(dir.join("train.txt"), corpus(300, 1)).unwrap();
    std::fs::write(dir.join("valid.txt"), corpus(40, 2)).unwrap();
    hrm(&[
        "hub",
        "init",
        "--model-config",
        config.to_str().unwrap(),
        "--data-dir",
        data_arg,
    ]);
    let tokenizer = fixture().join("tokenizer.json");
    hrm(&[
        "hub",
        "ingest",
        "--corpus",
        dir.join("train.txt").to_str().unwrap(),
        "--valid",
        dir.join("valid.txt").to_str().unwrap(),
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--batch-size",
        "16",
        "--custom-size",
        "--seq-len",
        "16",
        "--data-dir",
        data_arg,
    ]);
}

/// `hrm hub serve` aggregating every second once 3 updates are pending, with 3 s leases.
async fn start_hub(dir: &Path, data: &Path) -> (Process, String) {
    let url = format!("http://127.0.0.1:{}", free_port());
    let hub = Process(
        Command::new(env!("CARGO_BIN_EXE_hrm"))
            .args(["hub", "serve", "--addr", url.trim_start_matches("http://")])
            .arg("--data-dir")
            .arg(data)
            .args(["--aggregation-interval", "1"])
            .args(["--min-gradients-for-update", "3", "--lease-seconds", "3"])
            .args([
                "--verify-fraction",
                "0",
                "--eval-windows",
                "16",
                "--inner-lr",
                "0.005",
            ])
            .stderr(std::fs::File::create(dir.join("hub.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    hrm_wire::install_tls_provider();
    until("the hub", Duration::from_secs(60), async || {
        reqwest::get(format!("{url}/healthz"))
            .await
            .ok()
            .map(|_| ())
    })
    .await;
    (hub, url)
}

/// A client that leases batches and answers with noise a thousand times larger than any
/// honest update.
async fn hostile_upload(client: &HubClient, worker: uuid::Uuid, seed: u64) -> bool {
    let Ok(Some(batch)) = client.request_batch(worker, Hardware::default()).await else {
        return false;
    };
    let checkpoint = client
        .download(&format!("/api/v1/model/download/{}", batch.model_version))
        .await
        .unwrap();
    let (schema, _) = read_checkpoint(&checkpoint).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let noise: Vec<f32> = (0..schema.num_parameters())
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let target = client.upload_target(worker, batch.batch_id).await.unwrap();
    client
        .put_update(
            &target,
            encode_update(&schema, &noise, &batch.model_version, Encoding::Dense),
        )
        .await
        .unwrap();
    client
        .upload_gradients(&GradientUpload {
            worker_id: worker,
            batch_id: batch.batch_id,
            model_version: batch.model_version,
            gradients_url: target.gradients_url,
            loss: 1.0,
            num_samples: batch.num_samples,
        })
        .await
        .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_workers_train_the_moe_through_a_kill_and_a_hostile_client() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let data = dir.join("hub");
    prepare_hub(dir, &data);
    let (_hub, url) = start_hub(dir, &data).await;
    let observer = HubClient::new(&url, "observer-key-0123456789abcdef0123456789ab").unwrap();
    let mut workers: Vec<Process> = ["w1", "w2", "w3"]
        .iter()
        .map(|name| start_worker(dir, &url, name))
        .collect();

    // The victim has uploaded once and is training again: kill it in the middle of a batch.
    let victim_batch = until(
        "w3 in the middle of a batch",
        Duration::from_secs(120),
        async || {
            let log = log_of(dir, "w3");
            let after_upload = &log[log.find("uploaded batch")?..];
            let leased = after_upload.rfind("leased batch ")?;
            let training = after_upload.rfind("state=TRAINING")?;
            (training > leased && !after_upload[leased..].contains("uploaded batch"))
                .then(|| after_upload[leased + 13..leased + 49].to_string())
        },
    )
    .await;
    workers.pop(); // dropping the process sends SIGKILL
    assert!(log_of(dir, "w3").contains("state=TRAINING"));

    // The hostile client joins and answers batches with noise.
    observer.register(Some("observer"), None).await.unwrap();
    let hostile =
        HubClient::new(&url, format!("hostile-{}", uuid::Uuid::new_v4().simple())).unwrap();
    let hostile_id = hostile
        .register(Some("hostile"), None)
        .await
        .unwrap()
        .worker_id;
    let mut sent = 0;
    until(
        "a rejected hostile update",
        Duration::from_secs(120),
        async || {
            if sent < 5 && hostile_upload(&hostile, hostile_id, sent).await {
                sent += 1;
            }
            let mine = hostile.worker_stats().await.ok()?;
            (mine.updates_rejected >= 1).then_some(())
        },
    )
    .await;
    let hostile_stats = hostile.worker_stats().await.unwrap();
    assert!(
        hostile_stats.reputation_score < 1.0,
        "reputation {}",
        hostile_stats.reputation_score
    );

    // The victim's lease expires and another worker completes its batch; versions advance.
    let db = sqlx::SqlitePool::connect(&format!(
        "sqlite://{}?mode=ro",
        data.join("hub.db").display()
    ))
    .await
    .unwrap();
    let completed_by: String = until("the victim's batch done by another worker", Duration::from_secs(300), async || {
        let row: Option<(String, String)> = sqlx::query_as(
            "SELECT b.status, w.username FROM training_batches b \
             JOIN gradient_updates u ON u.batch_id = b.batch_id JOIN workers w ON w.id = u.worker_id \
             WHERE b.batch_id = ?1 AND u.status != 'rejected'",
        )
        .bind(&victim_batch)
        .fetch_optional(&db)
        .await
        .unwrap();
        row.filter(|(status, _)| status == "completed").map(|(_, who)| who)
    })
    .await;
    assert_ne!(completed_by, "w3");
    let versions = until(
        "six published versions",
        Duration::from_secs(240),
        async || {
            let versions = observer.versions().await.ok()?;
            (versions.len() >= 7).then_some(versions)
        },
    )
    .await;
    let valid_loss = |i: usize| versions[i].metrics["valid_loss"].as_f64().unwrap();
    let (first, last) = (valid_loss(1), valid_loss(versions.len() - 1));
    assert!(last < first, "validation loss {first} -> {last}");

    // SIGTERM: the current batch is finished and uploaded, the model unloaded, exit 0.
    for worker in &workers {
        signal(&worker.0, "-TERM");
    }
    for (worker, name) in workers.iter_mut().zip(["w1", "w2"]) {
        let status = worker.0.wait().unwrap();
        let log = log_of(dir, name);
        assert!(status.success(), "{name} exited with {status}:\n{log}");
        assert!(log.contains("model unloaded"), "{log}");
        // The batch in hand was trained and handed in; the hub may still have refused it
        // (its lease taken over, or the network moved too far past its version).
        let last = &log[log.rfind("leased batch ").unwrap()..];
        assert!(
            last.contains("trained batch")
                && [
                    "uploaded batch",
                    "went to another worker",
                    "the hub moved past"
                ]
                .iter()
                .any(|outcome| last.contains(outcome)),
            "{name} left its last batch unfinished:\n{log}"
        );
    }
    let board = observer.leaderboard().await.unwrap();
    for name in ["w1", "w2"] {
        assert!(
            board
                .iter()
                .any(|e| e.username.as_deref() == Some(name) && e.validated_batches > 0),
            "{name} is not on the leaderboard: {board:?}"
        );
    }
    // First run wrote each worker's configuration, readable by its owner only.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir.join("w1/worker.yaml"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

fn tmux(args: &[&str]) -> std::process::Output {
    Command::new("tmux")
        .args(args)
        .output()
        .expect("tmux is needed for the terminal-interface test (apt-get install tmux)")
}

/// The real terminal interface in a tmux pane: it opens IDLE, `s` starts training, `q` stops
/// after the current batch and quits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_terminal_interface_starts_and_quits_with_its_control() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let data = dir.join("hub");
    prepare_hub(dir, &data);
    let (_hub, url) = start_hub(dir, &data).await;
    let session = format!("hrm-worker-{}", std::process::id());
    let command = format!(
        "{} worker --server-url {url} --config {} --cache-dir {} --username tui --batch-size 4 --retry-delay 0.5",
        env!("CARGO_BIN_EXE_hrm"),
        dir.join("tui/worker.yaml").display(),
        dir.join("tui/cache").display()
    );
    let started = tmux(&[
        "new-session",
        "-d",
        "-s",
        &session,
        "-x",
        "120",
        "-y",
        "45",
        &command,
    ]);
    assert!(
        started.status.success(),
        "{}",
        String::from_utf8_lossy(&started.stderr)
    );
    struct Kill(String);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = tmux(&["kill-session", "-t", &self.0]);
        }
    }
    let _kill = Kill(session.clone());
    let screen = || {
        String::from_utf8_lossy(&tmux(&["capture-pane", "-p", "-t", &session]).stdout).into_owned()
    };

    // One capture can catch tmux between frames, so the whole idle screen is waited for.
    until("the idle screen", Duration::from_secs(60), async || {
        let s = screen();
        (s.contains("IDLE") && s.contains("[s] start") && s.contains("no batch in progress"))
            .then_some(())
    })
    .await;
    tmux(&["send-keys", "-t", &session, "s"]);
    let training = until(
        "an uploaded batch on screen",
        Duration::from_secs(120),
        async || {
            let s = screen();
            s.contains("uploaded batch").then_some(s)
        },
    )
    .await;
    assert!(training.contains("[s] stop"), "{training}");
    assert!(training.contains("tokens processed"), "{training}");
    tmux(&["send-keys", "-t", &session, "q"]);
    until(
        "the interface to close",
        Duration::from_secs(60),
        async || (!tmux(&["has-session", "-t", &session]).status.success()).then_some(()),
    )
    .await;
    let log = std::fs::read_to_string(dir.join("tui/worker.log")).unwrap();
    assert!(log.contains("model unloaded"), "{log}");
}
