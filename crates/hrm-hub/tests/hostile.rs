//! The attacks of the threat model (docs/hub-api.md, "Threat model"), each against a hub with
//! its defences on, in one process: a hub over real storage and simulated workers, honest ones
//! training for real (the tiny MoE, on the CPU) and hostile ones sending what an attacker
//! would. The background loops are not running: each test drives re-verification and
//! aggregation itself, so every step is deterministic.

mod common;

use common::*;
use futures::future::join_all;
use hrm_wire::update::{Encoding, encode_update};
use hrm_wire::{AggregateOutcome, Hardware};
use reqwest::StatusCode;
use std::collections::HashSet;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Aggregates whatever may be aggregated (the scheduler's tick).
async fn aggregate_now(t: &TestHub) -> AggregateOutcome {
    hrm_hub::aggregator::aggregate(&t.hub, 1)
        .await
        .unwrap()
        .expect("no other aggregator")
}

/// Why an update is where it is (`gradient_updates.reason`).
async fn reason_of(t: &TestHub, receipt: &hrm_wire::UploadReceipt) -> String {
    sqlx::query_scalar::<_, Option<String>>(
        "SELECT reason FROM gradient_updates WHERE update_id = $1",
    )
    .bind(receipt.update_id.to_string())
    .fetch_one(&t.hub.db.pool)
    .await
    .unwrap()
    .unwrap_or_default()
}

fn is_waiting(outcome: &AggregateOutcome) -> bool {
    matches!(outcome, AggregateOutcome::Waiting { .. })
}

async fn status_of(t: &TestHub, receipt: &hrm_wire::UploadReceipt) -> String {
    update_statuses(&t.hub).await[&receipt.update_id.to_string()]
        .0
        .clone()
}

#[tokio::test]
async fn a_huge_update_leaves_the_model_unchanged_on_default_settings() {
    use clap::Parser;
    #[derive(Parser)]
    struct Defaults {
        #[command(flatten)]
        policy: hrm_hub::config::PolicyArgs,
    }
    let defaults = Defaults::parse_from(["hub"]).policy.policy().unwrap();
    let t = start(defaults, 4).await;
    let (_, before) = current_params(&t.hub).await;
    // Registration costs the default 20 bits of work; the attacker pays it.
    let attacker = SimWorker::join(&t.url, "attacker").await;
    let (attacked_batch, receipt, _) = attacker.contribute(&|_, n| vec![1e30; n]).await;
    // Accepted as a file (it is finite), but a new worker's update waits for the hub's
    // recomputation before it may reach the model.
    assert!(is_waiting(&aggregate_now(&t).await));
    let verdicts = verify_all(&t.hub).await;
    assert_eq!(verdicts.len(), 1);
    assert!(!verdicts[0].agreed(), "{verdicts:?}");
    assert_eq!(status_of(&t, &receipt).await, "rejected");
    assert!((reputation(&t.hub, attacker.id).await - 0.5).abs() < 1e-9);
    assert_eq!(
        batch_status(&t.hub, attacked_batch.batch_id).await,
        "pending"
    );
    assert!(is_waiting(&aggregate_now(&t).await));
    let (version, unchanged) = current_params(&t.hub).await;
    assert_eq!(version, "v0.1.0");
    assert_eq!(unchanged, before);

    // An honest newcomer's update agrees with the recomputation, and only it moves the model.
    let honest = SimWorker::join(&t.url, "honest").await;
    let (batch, _, update) = honest.contribute_honestly().await;
    assert!(verify_all(&t.hub).await[0].agreed());
    assert!(matches!(
        aggregate_now(&t).await,
        AggregateOutcome::Success { num_updates: 1, .. }
    ));
    let (_, after) = current_params(&t.hub).await;
    let expected = after_plain_step(&before, &[(update, batch.num_samples)], 1.0);
    assert!(max_abs_diff(&after, &expected) < 1e-6);
}

#[tokio::test]
async fn forty_concurrent_lease_requests_hold_one_batch() {
    let t = start(policy(&[]), 8).await;
    let worker = SimWorker::join(&t.url, "hoarder").await;
    let answers =
        join_all((0..40).map(|_| worker.client.request_batch(worker.id, Hardware::default())))
            .await;
    let batches: HashSet<uuid::Uuid> = answers
        .into_iter()
        .map(|a| a.unwrap().expect("a batch").batch_id)
        .collect();
    assert_eq!(batches.len(), 1, "{batches:?}");
    let held: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM training_batches WHERE assigned_to = $1 AND status = 'assigned'",
    )
    .bind(worker.id.to_string())
    .fetch_one(&t.hub.db.pool)
    .await
    .unwrap();
    assert_eq!(held, 1);
    // The other batches are still there for others.
    let other = SimWorker::join(&t.url, "other").await;
    assert!(!batches.contains(&other.lease().await.unwrap().batch_id));
}

/// A newcomer's updates wait for the hub's recomputation; were it given more batches meanwhile,
/// every identity could queue recomputations without limit, and an honest newcomer's further
/// work would go stale behind them.
#[tokio::test]
async fn a_newcomer_gets_its_next_batch_once_its_update_is_verified() {
    let t = start(defended_policy(&[]), 4).await;
    let newcomer = SimWorker::join(&t.url, "newcomer").await;
    let (_, receipt, _) = newcomer.contribute_honestly().await;
    assert_eq!(status_of(&t, &receipt).await, "pending");
    for _ in 0..3 {
        assert!(
            newcomer.lease().await.is_none(),
            "a second batch while the first waits"
        );
    }
    // Others are not held up by it.
    let other = SimWorker::join(&t.url, "other").await;
    assert!(other.lease().await.is_some());
    assert!(verify_all(&t.hub).await.iter().all(|v| v.agreed()));
    assert!(newcomer.lease().await.is_some());
}

#[tokio::test]
async fn sybils_cannot_capture_krum_and_cost_honest_workers_nothing() {
    let t = start(defended_policy(&["--rule", "krum", "--byzantine", "1"]), 12).await;
    let (_, before) = current_params(&t.hub).await;
    let mut honest = Vec::new();
    for i in 0..4 {
        let w = SimWorker::join(&t.url, &format!("honest-{i}")).await;
        w.contribute_honestly().await;
        honest.push(w);
    }
    // Five fresh identities send the same +1000 update.
    let mut sybils = Vec::new();
    for i in 0..5 {
        let w = SimWorker::join(&t.url, &format!("sybil-{i}")).await;
        w.contribute(&|_, n| vec![1000.0; n]).await;
        sybils.push(w);
    }
    // Every new identity's first update is recomputed before it counts.
    let verdicts = verify_all(&t.hub).await;
    assert_eq!(verdicts.len(), 9);
    assert_eq!(verdicts.iter().filter(|v| v.agreed()).count(), 4);
    // Krum over the 4 honest updates alone: too few to tolerate one byzantine (n > 2f + 2).
    assert!(is_waiting(&aggregate_now(&t).await));
    let fifth = SimWorker::join(&t.url, "honest-4").await;
    fifth.contribute_honestly().await;
    verify_all(&t.hub).await;
    honest.push(fifth);
    assert!(matches!(
        aggregate_now(&t).await,
        AggregateOutcome::Success { num_updates: 1, .. }
    ));
    let (_, after) = current_params(&t.hub).await;
    assert!(
        max_abs_diff(&after, &before) < 1.0,
        "no weight moved by the Sybils' 1000"
    );
    for w in &honest {
        assert!(
            reputation(&t.hub, w.id).await >= 1.0,
            "an honest worker lost reputation"
        );
    }
    for w in &sybils {
        assert!((reputation(&t.hub, w.id).await - 0.5).abs() < 1e-9);
    }
}

#[tokio::test]
async fn colluders_with_a_history_are_caught_by_their_copies_under_krum() {
    // No probation: the colluders behave as identities that earned their history.
    let t = start(
        defended_policy(&[
            "--rule",
            "krum",
            "--byzantine",
            "1",
            "--probation-agreements",
            "0",
        ]),
        12,
    )
    .await;
    // The first update is recomputed: the hub gets its norm reference.
    let mut honest = Vec::new();
    for i in 0..3 {
        let w = SimWorker::join(&t.url, &format!("honest-{i}")).await;
        w.contribute_honestly().await;
        honest.push(w);
    }
    assert!(verify_all(&t.hub).await.iter().all(|v| v.agreed()));
    // Three colluders send one vector of honest size: the reverse of an honest update.
    let colluder = SimWorker::join(&t.url, "colluder-0").await;
    let batch = colluder.lease().await.unwrap();
    let (schema, honest_update) = colluder.train(&batch).await;
    let fake: Vec<f32> = honest_update.iter().map(|v| -v).collect();
    let mut colluders = vec![];
    for i in 0..3 {
        let w = if i == 0 {
            SimWorker {
                client: colluder.client.clone(),
                id: colluder.id,
            }
        } else {
            SimWorker::join(&t.url, &format!("colluder-{i}")).await
        };
        let batch = w.lease().await.unwrap();
        let file = encode_update(&schema, &fake, &batch.model_version, Encoding::Dense);
        let receipt = w.upload(&batch, &batch.model_version, file).await.unwrap();
        colluders.push((w, receipt));
    }
    // Six updates, three of them copies: Krum would pick a copy (score 0). The copies go to
    // re-verification instead, and three honest updates alone are too few for Krum.
    assert!(is_waiting(&aggregate_now(&t).await));
    for (_, receipt) in &colluders {
        assert_eq!(status_of(&t, receipt).await, "pending");
        assert!(reason_of(&t, receipt).await.contains("nearly identical"));
    }
    let verdicts = verify_all(&t.hub).await;
    assert_eq!(verdicts.len(), 3);
    assert!(verdicts.iter().all(|v| !v.agreed()));
    for (w, _) in &colluders {
        assert!((reputation(&t.hub, w.id).await - 0.5).abs() < 1e-9);
    }
    for i in 3..5 {
        let w = SimWorker::join(&t.url, &format!("honest-{i}")).await;
        w.contribute_honestly().await;
        honest.push(w);
    }
    assert!(matches!(
        aggregate_now(&t).await,
        AggregateOutcome::Success { .. }
    ));
    for w in &honest {
        assert!(reputation(&t.hub, w.id).await >= 1.0);
    }
}

#[tokio::test]
async fn honest_workers_outvoted_by_colluders_are_verified_not_punished() {
    let t = start(
        defended_policy(&["--rule", "median", "--probation-agreements", "0"]),
        12,
    )
    .await;
    // A first round gives the hub its norm reference.
    let seeder = SimWorker::join(&t.url, "seeder").await;
    seeder.contribute_honestly().await;
    verify_all(&t.hub).await;
    assert!(matches!(
        aggregate_now(&t).await,
        AggregateOutcome::Success { .. }
    ));
    // Two honest updates and three copies of one reversed update, all on the new version: the
    // copies are the median, and against it the honest updates look like outliers.
    let mut honest = Vec::new();
    for i in 0..2 {
        let w = SimWorker::join(&t.url, &format!("honest-{i}")).await;
        let (_, receipt, _) = w.contribute_honestly().await;
        honest.push((w, receipt));
    }
    let mut colluders = Vec::new();
    let mut fake = None;
    for i in 0..3 {
        let w = SimWorker::join(&t.url, &format!("colluder-{i}")).await;
        let batch = w.lease().await.unwrap();
        let (schema, update) = w.train(&batch).await;
        let fake = fake.get_or_insert_with(|| update.iter().map(|v| -v).collect::<Vec<f32>>());
        let file = encode_update(&schema, fake, &batch.model_version, Encoding::Dense);
        w.upload(&batch, &batch.model_version, file).await.unwrap();
        colluders.push(w);
    }
    // Nothing is applied: the honest ones are flagged by the screen, the copies as copies,
    // and all five wait for the hub's recomputation, which costs the honest ones nothing.
    assert!(is_waiting(&aggregate_now(&t).await));
    for (w, receipt) in &honest {
        assert!((reputation(&t.hub, w.id).await - 1.0).abs() < 1e-9);
        assert!(reason_of(&t, receipt).await.contains("outlier"));
    }
    let verdicts = verify_all(&t.hub).await;
    assert_eq!(verdicts.iter().filter(|v| v.agreed()).count(), 2);
    assert!(matches!(
        aggregate_now(&t).await,
        AggregateOutcome::Success { num_updates: 2, .. }
    ));
    for (w, _) in &honest {
        assert!(reputation(&t.hub, w.id).await > 1.0);
    }
    for w in &colluders {
        assert!((reputation(&t.hub, w.id).await - 0.5).abs() < 1e-9);
    }
}

/// Sends a request's head and returns the status line of the answer, without sending a body.
async fn status_before_body(url: &str, head: &str) -> String {
    let mut conn = TcpStream::connect(url.trim_start_matches("http://"))
        .await
        .unwrap();
    conn.write_all(head.as_bytes()).await.unwrap();
    let mut answer = vec![0u8; 256];
    let n = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut answer))
        .await
        .expect("the hub answers before any body is sent")
        .unwrap();
    String::from_utf8_lossy(&answer[..n])
        .lines()
        .next()
        .unwrap_or("")
        .to_string()
}

#[tokio::test]
async fn uploads_are_bounded_before_they_are_read() {
    let t = start(policy(&[]), 4).await;
    let worker = SimWorker::join(&t.url, "uploader").await;
    let batch = worker.lease().await.unwrap();
    let target = worker
        .client
        .upload_target(worker.id, batch.batch_id)
        .await
        .unwrap();
    let path = format!("/api/v1/gradients/blob/{}", batch.batch_id);
    let head = |key: &str, length: &str| {
        format!(
            "PUT {path} HTTP/1.1\r\nHost: hub\r\nAuthorization: Bearer {key}\r\n{length}\r\n\r\n"
        )
    };
    // Three gigabytes announced: refused on the headers.
    let three_gb = "Content-Length: 3000000000";
    let line = status_before_body(&t.url, &head(worker.client.api_key(), three_gb)).await;
    assert!(line.contains("413"), "{line}");
    // Without the lease, or without a key, nothing is read either.
    let other = SimWorker::join(&t.url, "other").await;
    let line = status_before_body(&t.url, &head(other.client.api_key(), three_gb)).await;
    assert!(line.contains("409"), "{line}");
    let line = status_before_body(&t.url, &head("not-a-key", three_gb)).await;
    assert!(line.contains("401"), "{line}");

    // A chunked body that never says its size is cut off at the limit, and nothing is stored.
    let mut conn = TcpStream::connect(t.url.trim_start_matches("http://"))
        .await
        .unwrap();
    conn.write_all(
        head(worker.client.api_key(), "Transfer-Encoding: chunked")
            .trim_end_matches("\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    conn.write_all(b"\r\n\r\n").await.unwrap();
    let chunk = vec![b'x'; 1 << 16];
    let mut sent = 0u64;
    while sent <= target.max_bytes {
        let framed = [format!("{:x}\r\n", chunk.len()).as_bytes(), &chunk, b"\r\n"].concat();
        if conn.write_all(&framed).await.is_err() {
            break;
        }
        sent += chunk.len() as u64;
    }
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    let key = hrm_hub::updates::update_key(batch.batch_id, worker.id);
    assert_eq!(t.hub.blobs.size(&key).await.unwrap(), None);

    // An honest upload still goes through.
    let (schema, _) = worker.checkpoint(&batch.model_version).await;
    let update = honest(batch.batch_id, schema.num_parameters());
    let file = encode_update(&schema, &update, &batch.model_version, Encoding::Dense);
    worker
        .upload(&batch, &batch.model_version, file)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_missing_or_changed_file_rejects_that_update_alone() {
    let t = start(policy(&[]), 6).await;
    let mut workers = Vec::new();
    let mut receipts = Vec::new();
    for name in ["kept", "lost", "changed"] {
        let w = SimWorker::join(&t.url, name).await;
        let (batch, receipt, _) = w.contribute(&honest).await;
        receipts.push((batch, receipt));
        workers.push(w);
    }
    let key = |i: usize| hrm_hub::updates::update_key(receipts[i].0.batch_id, workers[i].id);
    t.hub.blobs.delete(&key(1)).await.unwrap();
    // Another valid file in its place (an S3 object written again through its URL).
    let (schema, _) = workers[2].checkpoint("v0.1.0").await;
    let other = vec![0.5; schema.num_parameters()];
    let file = encode_update(&schema, &other, "v0.1.0", Encoding::Dense);
    t.hub.blobs.put(&key(2), file.into()).await.unwrap();

    assert_eq!(
        aggregate_now(&t).await,
        AggregateOutcome::Success {
            version: "v0.1.1".into(),
            num_updates: 1,
            rejected: 2
        }
    );
    assert_eq!(status_of(&t, &receipts[0].1).await, "aggregated");
    assert_eq!(status_of(&t, &receipts[1].1).await, "rejected");
    assert_eq!(status_of(&t, &receipts[2].1).await, "rejected");
    // A lost file is the hub's loss; a changed one is the worker's doing.
    assert!((reputation(&t.hub, workers[1].id).await - 1.0).abs() < 1e-9);
    assert!((reputation(&t.hub, workers[2].id).await - 0.9).abs() < 1e-9);
    for (batch, _) in &receipts[1..] {
        assert_eq!(batch_status(&t.hub, batch.batch_id).await, "pending");
    }
}

async fn expire_lease(t: &TestHub, batch: uuid::Uuid) {
    sqlx::query("UPDATE training_batches SET lease_expires_at = 0 WHERE batch_id = $1")
        .bind(batch.to_string())
        .execute(&t.hub.db.pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn failed_batches_come_back_after_their_cool_down_or_on_request() {
    let t = start(policy(&["--max-attempts", "1"]), 2).await;
    let worker = SimWorker::join(&t.url, "flaky").await;
    let batch = worker.lease().await.unwrap();
    expire_lease(&t, batch.batch_id).await;
    hrm_hub::batches::reap(&t.hub).await.unwrap();
    assert_eq!(batch_status(&t.hub, batch.batch_id).await, "failed");
    // Still cooling down.
    hrm_hub::batches::reap(&t.hub).await.unwrap();
    assert_eq!(batch_status(&t.hub, batch.batch_id).await, "failed");
    // The cool-down (an hour by default) is over.
    sqlx::query("UPDATE training_batches SET failed_at = failed_at - 3601000 WHERE batch_id = $1")
        .bind(batch.batch_id.to_string())
        .execute(&t.hub.db.pool)
        .await
        .unwrap();
    hrm_hub::batches::reap(&t.hub).await.unwrap();
    assert_eq!(batch_status(&t.hub, batch.batch_id).await, "pending");

    // Failed again; the operator brings it back at once.
    let batch = worker.lease().await.unwrap();
    expire_lease(&t, batch.batch_id).await;
    hrm_hub::batches::reap(&t.hub).await.unwrap();
    assert_eq!(batch_status(&t.hub, batch.batch_id).await, "failed");
    assert_eq!(
        hrm_hub::batches::requeue_failed(&t.hub, None)
            .await
            .unwrap(),
        1
    );
    assert_eq!(batch_status(&t.hub, batch.batch_id).await, "pending");
}

#[tokio::test]
async fn orphan_update_files_are_collected() {
    let t = start(policy(&[]), 6).await;
    let put_only = |w: &SimWorker, batch: &hrm_wire::BatchAssignment| {
        let (client, id, batch_id, version) = (
            w.client.clone(),
            w.id,
            batch.batch_id,
            batch.model_version.clone(),
        );
        async move {
            let target = client.upload_target(id, batch_id).await.unwrap();
            let bytes = client
                .download(&format!("/api/v1/model/download/{version}"))
                .await
                .unwrap();
            let (schema, _) = hrm_wire::update::read_checkpoint(&bytes).unwrap();
            let file = encode_update(
                &schema,
                &honest(batch_id, schema.num_parameters()),
                &version,
                Encoding::Dense,
            );
            client.put_update(&target, file).await.unwrap();
        }
    };
    // Put, then the lease was lost: an orphan.
    let lost = SimWorker::join(&t.url, "lost").await;
    let lost_batch = lost.lease().await.unwrap();
    put_only(&lost, &lost_batch).await;
    expire_lease(&t, lost_batch.batch_id).await;
    hrm_hub::batches::reap(&t.hub).await.unwrap();
    // Reported and pending: kept.
    let reported = SimWorker::join(&t.url, "reported").await;
    let (reported_batch, ..) = reported.contribute(&honest).await;
    // Put, still holding the lease (about to report): kept.
    let uploading = SimWorker::join(&t.url, "uploading").await;
    let uploading_batch = uploading.lease().await.unwrap();
    put_only(&uploading, &uploading_batch).await;

    let later = chrono::Utc::now() + chrono::Duration::hours(1);
    assert_eq!(
        hrm_hub::gc::collect_orphans(&t.hub, later).await.unwrap(),
        1
    );
    let exists = |batch: uuid::Uuid, worker: uuid::Uuid| {
        let hub = t.hub.clone();
        async move {
            hub.blobs
                .size(&hrm_hub::updates::update_key(batch, worker))
                .await
                .unwrap()
                .is_some()
        }
    };
    assert!(!exists(lost_batch.batch_id, lost.id).await);
    assert!(exists(reported_batch.batch_id, reported.id).await);
    assert!(exists(uploading_batch.batch_id, uploading.id).await);
    // Files younger than the cut-off are never touched.
    let earlier = chrono::Utc::now() - chrono::Duration::hours(1);
    put_only(&lost, &lost.lease().await.unwrap()).await;
    assert_eq!(
        hrm_hub::gc::collect_orphans(&t.hub, earlier).await.unwrap(),
        0
    );
}

#[tokio::test]
async fn empty_or_all_zero_updates_earn_nothing() {
    let t = start(policy(&[]), 4).await;
    let free_rider = SimWorker::join(&t.url, "free-rider").await;
    let batch = free_rider.lease().await.unwrap();
    let (schema, _) = free_rider.checkpoint(&batch.model_version).await;
    let zeros = vec![0.0; schema.num_parameters()];
    for encoding in [Encoding::Dense, Encoding::TopK { ratio: 0.001 }] {
        let file = encode_update(&schema, &zeros, &batch.model_version, encoding);
        let e = free_rider
            .upload(&batch, &batch.model_version, file)
            .await
            .unwrap_err();
        assert_eq!(e.status(), Some(StatusCode::UNPROCESSABLE_ENTITY), "{e}");
        assert_eq!(e.code(), Some("empty_update"));
    }
    let stats = free_rider.client.worker_stats().await.unwrap();
    assert_eq!((stats.total_batches, stats.total_tokens), (0, 0));
    assert!((stats.reputation_score - 1.0).abs() < 1e-9);
    assert_eq!(batch_status(&t.hub, batch.batch_id).await, "assigned");
}

#[tokio::test]
async fn a_round_that_raises_the_validation_loss_is_not_published() {
    let t = start(
        defended_policy(&["--probation-agreements", "0", "--inner-lr", "1e-2"]),
        8,
    )
    .await;
    // The first round gives the hub its norm reference (and v0.1.1 a validation loss).
    let seeder = SimWorker::join(&t.url, "seeder").await;
    seeder.contribute_honestly().await;
    verify_all(&t.hub).await;
    assert!(matches!(
        aggregate_now(&t).await,
        AggregateOutcome::Success { .. }
    ));
    let (v1, before) = current_params(&t.hub).await;
    // A worker with a history sends the reverse of its honest update, scaled to just inside
    // the norm bound; an honest worker's update is in the same round.
    let attacker = SimWorker::join(&t.url, "reverser").await;
    let batch = attacker.lease().await.unwrap();
    let (schema, update) = attacker.train(&batch).await;
    let reversed: Vec<f32> = update.iter().map(|v| -3.5 * v).collect();
    let file = encode_update(&schema, &reversed, &batch.model_version, Encoding::Dense);
    let attack = attacker
        .upload(&batch, &batch.model_version, file)
        .await
        .unwrap();
    let honest_worker = SimWorker::join(&t.url, "honest").await;
    let (honest_batch, honest_receipt, honest_update) = honest_worker.contribute_honestly().await;
    // Published together, the validation loss would rise: nothing is published, and both
    // unverified updates go to re-verification.
    assert!(is_waiting(&aggregate_now(&t).await));
    assert_eq!(current_params(&t.hub).await.0, v1);
    for receipt in [&attack, &honest_receipt] {
        assert!(
            reason_of(&t, receipt)
                .await
                .contains("raised the validation loss")
        );
    }
    let verdicts = verify_all(&t.hub).await;
    assert_eq!(verdicts.len(), 2);
    assert_eq!(status_of(&t, &attack).await, "rejected");
    assert!((reputation(&t.hub, attacker.id).await - 0.5).abs() < 1e-9);
    // The verified honest update alone is published.
    assert!(matches!(
        aggregate_now(&t).await,
        AggregateOutcome::Success { num_updates: 1, .. }
    ));
    assert_eq!(status_of(&t, &honest_receipt).await, "aggregated");
    let (_, after) = current_params(&t.hub).await;
    let expected = after_plain_step(&before, &[(honest_update, honest_batch.num_samples)], 1.0);
    assert!(max_abs_diff(&after, &expected) < 1e-6);
}

#[tokio::test]
async fn a_round_of_verified_updates_that_raises_the_loss_is_held_for_the_operator() {
    // A learning rate that makes honest training diverge: every update is verified, and the
    // round still raises the validation loss.
    let t = start(
        defended_policy(&[
            "--probation-agreements",
            "0",
            "--norm-bound",
            "0",
            "--verify-fraction",
            "1",
            "--inner-lr",
            "5",
        ]),
        4,
    )
    .await;
    let worker = SimWorker::join(&t.url, "diverging").await;
    let (batch, receipt, _) = worker.contribute_honestly().await;
    assert!(verify_all(&t.hub).await[0].agreed());
    let outcome = aggregate_now(&t).await;
    let AggregateOutcome::Held {
        held,
        valid_loss,
        parent_valid_loss,
    } = outcome
    else {
        panic!("expected a held round, got {outcome:?}");
    };
    assert_eq!(held, 1);
    assert!(valid_loss > parent_valid_loss * 1.02);
    assert_eq!(current_params(&t.hub).await.0, "v0.1.0");
    assert_eq!(status_of(&t, &receipt).await, "held");
    let stats = t.admin.global_stats().await.unwrap();
    assert_eq!(stats.updates_held, 1);
    // The operator rejects it: no reputation lost (nothing proved it wrong), the batch redone.
    assert_eq!(hrm_hub::updates::reject_held(&t.hub).await.unwrap(), 1);
    assert_eq!(status_of(&t, &receipt).await, "rejected");
    assert_eq!(batch_status(&t.hub, batch.batch_id).await, "pending");
    assert!(reputation(&t.hub, worker.id).await >= 1.0);
}

#[tokio::test]
async fn multi_krum_aggregates_n_minus_f_by_default() {
    let t = start(policy(&["--rule", "multi-krum", "--byzantine", "1"]), 6).await;
    for i in 0..5 {
        SimWorker::join(&t.url, &format!("w{i}"))
            .await
            .contribute(&honest)
            .await;
    }
    assert!(matches!(
        aggregate_now(&t).await,
        AggregateOutcome::Success { num_updates: 4, .. }
    ));
}

#[tokio::test]
async fn registration_costs_work_and_is_limited_per_address() {
    let t = start(defended_policy(&["--register-burst", "3"]), 2).await;
    hrm_wire::install_tls_provider();
    let http = reqwest::Client::new();
    let register = |body: serde_json::Value| {
        let http = http.clone();
        let url = format!("{}/api/v1/auth/register", t.url);
        async move { http.post(url).json(&body).send().await.unwrap() }
    };
    let key = "sybil-key-0123456789abcdef0123456789abcdef";
    let answer = register(serde_json::json!({"api_key": key})).await;
    assert_eq!(answer.status(), StatusCode::BAD_REQUEST);
    let body: hrm_wire::ErrorBody = answer.json().await.unwrap();
    assert_eq!(body.error.code, "proof_required");
    // A nonce that does not solve the challenge.
    let challenge: hrm_wire::Challenge = http
        .get(format!("{}/api/v1/auth/challenge", t.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(challenge.bits, 8);
    let wrong = (0u64..)
        .find(|&n| !hrm_wire::pow::verify(&challenge.challenge, key, n, 8))
        .unwrap();
    let answer = register(serde_json::json!({
        "api_key": key,
        "proof": {"challenge": challenge.challenge, "nonce": wrong}
    }))
    .await;
    let body: hrm_wire::ErrorBody = answer.json().await.unwrap();
    assert_eq!(body.error.code, "invalid_proof");
    // A real client solves it (the third registration from this address) ...
    SimWorker::join(&t.url, "paid").await;
    // ... and the fourth from the same address is refused, with a time to come back.
    let answer = register(serde_json::json!({"api_key": key})).await;
    assert_eq!(answer.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(answer.headers().contains_key("retry-after"));
    let body: hrm_wire::ErrorBody = answer.json().await.unwrap();
    assert_eq!(body.error.code, "too_many_registrations");
}

#[tokio::test]
async fn the_status_feed_caps_connections_and_message_size() {
    use futures::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let t = start(policy(&["--ws-max-connections", "1"]), 2).await;
    let ws_url = format!("{}/api/v1/ws/status", t.url.replace("http://", "ws://"));
    let (mut first, _) = tokio_tungstenite::connect_async(&ws_url).await.unwrap();
    assert!(matches!(first.next().await, Some(Ok(Message::Text(_)))));
    let refused = tokio_tungstenite::connect_async(&ws_url).await.unwrap_err();
    match refused {
        tokio_tungstenite::tungstenite::Error::Http(response) => {
            assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE)
        }
        other => panic!("expected a 503, got {other}"),
    }
    // A client message far beyond what a status client needs ends the connection.
    first
        .send(Message::Text("x".repeat(64 * 1024).into()))
        .await
        .unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match first.next().await {
                None | Some(Err(_)) | Some(Ok(Message::Close(_))) => return,
                Some(Ok(_)) => {}
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the oversized message did not end the feed");
    // Its slot is free again.
    let (mut second, _) = tokio_tungstenite::connect_async(&ws_url).await.unwrap();
    assert!(matches!(second.next().await, Some(Ok(Message::Text(_)))));
}

#[tokio::test]
async fn internal_errors_are_logged_not_sent() {
    let t = start(policy(&[]), 2).await;
    let worker = SimWorker::join(&t.url, "curious").await;
    let row = hrm_hub::versions::current_row(&t.hub)
        .await
        .unwrap()
        .unwrap();
    t.hub.blobs.delete(&row.checkpoint_key).await.unwrap();
    let e = worker
        .client
        .download("/api/v1/model/download/v0.1.0")
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(StatusCode::INTERNAL_SERVER_ERROR));
    assert_eq!(e.code(), Some("internal_error"));
    let message = e.to_string();
    assert!(
        !message.contains("checkpoints/") && !message.contains("objects"),
        "{message}"
    );
}
