//! A hub and N simulated workers in one process, on the embedded defaults (SQLite, the
//! in-process queue, local files), with faults injected: bad keys, bad files, duplicates,
//! lost leases, stale and poisoned updates, rate limits, rollbacks.

mod common;

use common::*;
use hrm_wire::update::{Encoding, ParamSpec, Schema, encode_update};
use hrm_wire::{AggregateOutcome, HubClient, StatusEvent};
use reqwest::StatusCode;
use sqlx::Row;

fn code(e: &hrm_wire::ClientError) -> (Option<StatusCode>, Option<&str>) {
    (e.status(), e.code())
}

#[tokio::test]
async fn registration_login_and_auth_errors() {
    let t = start(policy(&[]), 2).await;
    let worker = SimWorker::join(&t.url, "ada").await;
    let login = worker.client.login().await.unwrap();
    assert_eq!(login.worker_id, worker.id);
    assert_eq!(login.current_version.as_deref(), Some("v0.1.0"));

    // The same key again, and the same name with another key.
    let again = worker
        .client
        .register(Some("other"), None)
        .await
        .unwrap_err();
    assert_eq!(
        code(&again),
        (Some(StatusCode::CONFLICT), Some("already_registered"))
    );
    let clash = HubClient::new(&t.url, format!("k-{}", uuid::Uuid::new_v4().simple())).unwrap();
    let taken = clash.register(Some("ada"), None).await.unwrap_err();
    assert_eq!(
        code(&taken),
        (Some(StatusCode::CONFLICT), Some("username_taken"))
    );
    // Keys outside 32..=64 printable characters.
    for key in [
        "short",
        &"x".repeat(65),
        "has a space in it 0123456789abcdefghij",
    ] {
        let e = HubClient::new(&t.url, key)
            .unwrap()
            .register(None, None)
            .await
            .unwrap_err();
        assert_eq!(
            code(&e),
            (
                Some(StatusCode::BAD_REQUEST),
                Some("invalid_api_key_format")
            ),
            "{key}"
        );
    }
    // Unknown key; a body naming another worker.
    let stranger = HubClient::new(&t.url, "unknown-key-0123456789abcdef0123456789").unwrap();
    assert_eq!(
        code(&stranger.login().await.unwrap_err()),
        (Some(StatusCode::UNAUTHORIZED), Some("invalid_api_key"))
    );
    let other = SimWorker::join(&t.url, "bob").await;
    let e = worker
        .client
        .request_batch(other.id, Default::default())
        .await
        .unwrap_err();
    assert_eq!(
        code(&e),
        (Some(StatusCode::FORBIDDEN), Some("worker_mismatch"))
    );
    // Aggregation needs the admin key.
    assert_eq!(
        code(&worker.client.aggregate().await.unwrap_err()),
        (Some(StatusCode::UNAUTHORIZED), Some("invalid_api_key"))
    );
    assert_eq!(
        t.admin.aggregate().await.unwrap(),
        AggregateOutcome::Waiting { pending: 0 }
    );

    // Only the digest is stored.
    let stored: Vec<String> = sqlx::query_scalar("SELECT api_key_hash FROM workers")
        .fetch_all(&t.hub.db.pool)
        .await
        .unwrap();
    assert!(
        stored
            .iter()
            .all(|h| h.len() == 64 && h != worker.client.api_key())
    );

    // A malformed body is a JSON error, and nothing is created.
    hrm_wire::install_tls_provider();
    let response = reqwest::Client::new()
        .post(format!("{}/api/v1/auth/register", t.url))
        .header("content-type", "application/json")
        .body("{\"api_key\": 5}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let body: hrm_wire::ErrorBody = response.json().await.unwrap();
    assert_eq!(body.error.code, "invalid_json");
    let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM workers")
        .fetch_one(&t.hub.db.pool)
        .await
        .unwrap();
    assert_eq!(count, 2);
}

#[tokio::test]
async fn workers_train_and_the_hub_publishes_their_weighted_mean() {
    let t = start(policy(&["--eval-windows", "8"]), 6).await;
    let (_, before) = current_params(&t.hub).await;
    let mut contributions = Vec::new();
    for i in 0..5 {
        let worker = SimWorker::join(&t.url, &format!("w{i}")).await;
        let (batch, receipt, update) = worker.contribute(&honest).await;
        assert!(!receipt.duplicate);
        // The batch file holds num_samples windows of seq_len + 1 ids.
        let data = worker.client.download(&batch.data_url).await.unwrap();
        let samples = hrm_wire::samples::decode_samples(&data).unwrap();
        assert_eq!(samples.len() as i64, batch.num_samples);
        assert!(samples.iter().all(|s| s.len() == SEQ_LEN + 1));
        contributions.push((update, batch.num_samples));
    }
    let outcome = t.admin.aggregate().await.unwrap();
    assert_eq!(
        outcome,
        AggregateOutcome::Success {
            version: "v0.1.1".into(),
            num_updates: 5,
            rejected: 0
        }
    );
    let (version, after) = current_params(&t.hub).await;
    assert_eq!(version, "v0.1.1");
    let expected = after_plain_step(&before, &contributions, 1.0);
    assert!(max_abs_diff(&after, &expected) < 1e-6);

    // Metrics recorded with the version; stats and badges counted.
    let current = t.admin.current_model().await.unwrap();
    assert_eq!(current.parent.as_deref(), Some("v0.1.0"));
    assert_eq!(current.metrics["num_updates"], 5);
    assert!(current.metrics["valid_loss"].as_f64().unwrap().is_finite());
    let stats = t.admin.global_stats().await.unwrap();
    assert_eq!(
        (
            stats.updates_aggregated,
            stats.batches.completed,
            stats.batches.pending
        ),
        (5, 5, 1)
    );
    assert_eq!(stats.total_tokens, 5 * (BATCH_SIZE * SEQ_LEN) as i64);
    let board = t.admin.leaderboard().await.unwrap();
    assert_eq!(board.len(), 5);
    assert!(
        board
            .iter()
            .all(|e| e.validated_batches == 1 && e.rank == 1)
    );

    // Nothing more pending: waiting.
    assert_eq!(
        t.admin.aggregate().await.unwrap(),
        AggregateOutcome::Waiting { pending: 0 }
    );
}

#[tokio::test]
async fn the_cosine_outer_schedule_shrinks_steps_as_batches_complete() {
    let t = start(policy(&["--outer-schedule", "cosine"]), 4).await;
    let (_, before) = current_params(&t.hub).await;
    let mut contributions = Vec::new();
    for i in 0..2 {
        let worker = SimWorker::join(&t.url, &format!("w{i}")).await;
        let (batch, _, update) = worker.contribute(&honest).await;
        contributions.push((update, batch.num_samples));
    }
    t.admin.aggregate().await.unwrap();
    // Half the batches completed: the cosine from 1 to 0.1 stands at 0.55.
    let factor = 0.1 + 0.9 * 0.5;
    let current = t.admin.current_model().await.unwrap();
    assert!((current.metrics["outer_lr_factor"].as_f64().unwrap() - factor).abs() < 1e-6);
    let (_, after) = current_params(&t.hub).await;
    let expected = after_plain_step(&before, &contributions, factor as f32);
    assert!(max_abs_diff(&after, &expected) < 1e-6);
}

#[tokio::test]
async fn checkpoints_are_content_addressed_and_cacheable() {
    let t = start(policy(&[]), 1).await;
    let worker = SimWorker::join(&t.url, "cache").await;
    let info = worker.client.current_model().await.unwrap();
    hrm_wire::install_tls_provider();
    let http = reqwest::Client::new();
    let url = format!("{}{}", t.url, info.checkpoint_url);
    let full = http
        .get(&url)
        .bearer_auth(worker.client.api_key())
        .send()
        .await
        .unwrap();
    assert_eq!(full.status(), StatusCode::OK);
    assert_eq!(
        full.headers()["etag"].to_str().unwrap(),
        format!("\"{}\"", info.sha256)
    );
    let bytes = full.bytes().await.unwrap();
    assert_eq!(hrm_wire::update::sha256_hex(&bytes), info.sha256);
    let cached = http
        .get(&url)
        .bearer_auth(worker.client.api_key())
        .header("if-none-match", format!("\"{}\"", info.sha256))
        .send()
        .await
        .unwrap();
    assert_eq!(cached.status(), StatusCode::NOT_MODIFIED);
    let missing = worker
        .client
        .download("/api/v1/model/download/v9.9.9")
        .await
        .unwrap_err();
    assert_eq!(
        code(&missing),
        (Some(StatusCode::NOT_FOUND), Some("unknown_version"))
    );
}

#[tokio::test]
async fn bad_update_files_are_refused_and_change_nothing() {
    let t = start(policy(&[]), 2).await;
    let worker = SimWorker::join(&t.url, "clumsy").await;
    let batch = worker.lease().await.unwrap();
    let (schema, _) = worker.checkpoint("v0.1.0").await;
    let n = schema.num_parameters();

    let mut nan = honest(batch.batch_id, n);
    nan[n / 2] = f32::NAN;
    let mut wrong_shape = schema.clone();
    wrong_shape.params[0].shape = vec![schema.params[0].numel() + 1];
    let mut renamed = schema.clone();
    renamed.params[0] = ParamSpec {
        name: "model.extra".into(),
        shape: schema.params[0].shape.clone(),
    };
    let renamed = Schema::new(renamed.params);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "NaN",
            encode_update(&schema, &nan, "v0.1.0", Encoding::Dense),
        ),
        (
            "shape",
            encode_update(
                &wrong_shape,
                &vec![0.0; wrong_shape.num_parameters()],
                "v0.1.0",
                Encoding::Dense,
            ),
        ),
        (
            "name",
            encode_update(&renamed, &vec![0.0; n], "v0.1.0", Encoding::Dense),
        ),
        (
            "version marker",
            encode_update(&schema, &vec![0.0; n], "v0.0.9", Encoding::Dense),
        ),
        ("not safetensors", b"PK\x03\x04 a pickle in a zip".to_vec()),
    ];
    for (what, file) in cases {
        let e = worker.upload(&batch, "v0.1.0", file).await.unwrap_err();
        assert_eq!(
            code(&e),
            (
                Some(StatusCode::UNPROCESSABLE_ENTITY),
                Some("invalid_update")
            ),
            "{what}: {e}"
        );
    }
    let reputation: f64 = sqlx::query_scalar("SELECT reputation_score FROM workers WHERE id = $1")
        .bind(worker.id.to_string())
        .fetch_one(&t.hub.db.pool)
        .await
        .unwrap();
    assert!(
        (reputation - 0.5).abs() < 1e-9,
        "five invalid files cost 0.1 each: {reputation}"
    );
    assert!(update_statuses(&t.hub).await.is_empty());

    // Too large for any update of this model: refused before it is stored.
    let target = worker
        .client
        .upload_target(worker.id, batch.batch_id)
        .await
        .unwrap();
    let e = worker
        .client
        .put_update(&target, vec![0u8; target.max_bytes as usize + 1])
        .await
        .unwrap_err();
    assert_eq!(
        code(&e),
        (Some(StatusCode::PAYLOAD_TOO_LARGE), Some("body_too_large"))
    );

    // The wrong sample count and a foreign gradients_url are refused too.
    let mut upload = hrm_wire::GradientUpload {
        worker_id: worker.id,
        batch_id: batch.batch_id,
        model_version: "v0.1.0".into(),
        gradients_url: target.gradients_url.clone(),
        loss: 1.0,
        num_samples: batch.num_samples + 1,
    };
    let e = worker.client.upload_gradients(&upload).await.unwrap_err();
    assert_eq!(
        code(&e),
        (Some(StatusCode::BAD_REQUEST), Some("invalid_num_samples"))
    );
    upload.num_samples = batch.num_samples;
    upload.gradients_url = "s3://elsewhere/file.safetensors".into();
    let e = worker.client.upload_gradients(&upload).await.unwrap_err();
    assert_eq!(
        code(&e),
        (Some(StatusCode::BAD_REQUEST), Some("invalid_gradients_url"))
    );

    // A sparse (top-k) file of a good update is accepted.
    let sparse = encode_update(
        &schema,
        &honest(batch.batch_id, n),
        "v0.1.0",
        Encoding::TopK { ratio: 0.1 },
    );
    let receipt = worker.upload(&batch, "v0.1.0", sparse).await.unwrap();
    assert_eq!(receipt.status, "accepted");
}

#[tokio::test]
async fn the_same_batch_counts_once() {
    let t = start(policy(&[]), 2).await;
    let worker = SimWorker::join(&t.url, "twice").await;
    let (batch, first, _) = worker.contribute(&honest).await;
    // The client lost the answer and posts the upload again.
    let again = worker
        .client
        .upload_gradients(&hrm_wire::GradientUpload {
            worker_id: worker.id,
            batch_id: batch.batch_id,
            model_version: "v0.1.0".into(),
            gradients_url: hrm_hub::updates::gradients_url(&t.hub, batch.batch_id, worker.id),
            loss: 3.5,
            num_samples: batch.num_samples,
        })
        .await
        .unwrap();
    assert!(again.duplicate);
    assert_eq!(again.update_id, first.update_id);
    assert_eq!(update_statuses(&t.hub).await.len(), 1);
    let stats = worker.client.worker_stats().await.unwrap();
    assert_eq!(stats.total_batches, 1);
    assert_eq!(
        t.admin.aggregate().await.unwrap(),
        AggregateOutcome::Success {
            version: "v0.1.1".into(),
            num_updates: 1,
            rejected: 0
        }
    );
}

#[tokio::test]
async fn leases_are_single_expire_and_are_reassigned() {
    let t = start(policy(&["--max-attempts", "2"]), 2).await;
    let slow = SimWorker::join(&t.url, "slow").await;
    let fast = SimWorker::join(&t.url, "fast").await;
    let first = slow.lease().await.unwrap();
    // A worker holds one batch at a time: asking again returns the same lease.
    assert_eq!(slow.lease().await.unwrap().batch_id, first.batch_id);
    let second = fast.lease().await.unwrap();
    assert_ne!(second.batch_id, first.batch_id);
    // Both batches leased: a third worker gets 204.
    let idle = SimWorker::join(&t.url, "idle").await;
    assert!(idle.lease().await.is_none());

    // The slow lease runs out (its deadline moved to the past) and the reaper returns it.
    sqlx::query("UPDATE training_batches SET lease_expires_at = 0 WHERE batch_id = $1")
        .bind(first.batch_id.to_string())
        .execute(&t.hub.db.pool)
        .await
        .unwrap();
    assert_eq!(hrm_hub::batches::reap(&t.hub).await.unwrap(), 1);
    let retaken = idle.lease().await.unwrap();
    assert_eq!(retaken.batch_id, first.batch_id);
    // The slow worker's late upload is refused: the batch is someone else's now.
    let (schema, _) = slow.checkpoint("v0.1.0").await;
    let file = encode_update(
        &schema,
        &honest(first.batch_id, schema.num_parameters()),
        "v0.1.0",
        Encoding::Dense,
    );
    let e = slow.upload(&first, "v0.1.0", file).await.unwrap_err();
    assert_eq!(code(&e), (Some(StatusCode::CONFLICT), Some("lease_lost")));
    // A second expiry exhausts its attempts: failed, not requeued.
    sqlx::query("UPDATE training_batches SET lease_expires_at = 0 WHERE batch_id = $1")
        .bind(first.batch_id.to_string())
        .execute(&t.hub.db.pool)
        .await
        .unwrap();
    hrm_hub::batches::reap(&t.hub).await.unwrap();
    let status = batch_status(&t.hub, first.batch_id).await;
    assert_eq!(status, "failed");
}

#[tokio::test]
async fn outliers_go_to_re_verification_and_lose_reputation_only_when_it_disagrees() {
    let t = start(policy(&[]), 8).await;
    let (_, before) = current_params(&t.hub).await;
    let mut honest_updates = Vec::new();
    for i in 0..6 {
        let w = SimWorker::join(&t.url, &format!("h{i}")).await;
        let (batch, _, update) = w.contribute(&honest).await;
        honest_updates.push((update, batch.num_samples));
    }
    let poisoner = SimWorker::join(&t.url, "poisoner").await;
    let (poisoned_batch, poisoned, _) = poisoner
        .contribute(&|b, n| honest(b, n).iter().map(|v| v * 50.0).collect())
        .await;
    let outcome = t.admin.aggregate().await.unwrap();
    assert_eq!(
        outcome,
        AggregateOutcome::Success {
            version: "v0.1.1".into(),
            num_updates: 6,
            rejected: 0
        }
    );
    let (_, after) = current_params(&t.hub).await;
    let expected = after_plain_step(&before, &honest_updates, 1.0);
    assert!(
        max_abs_diff(&after, &expected) < 1e-6,
        "the poisoned update must not move the model"
    );
    // Being far from the others is no proof (attackers could be the others): the update waits
    // for the hub's own recomputation, and costs nothing yet.
    let poisoned_id = poisoned.update_id.to_string();
    assert_eq!(update_statuses(&t.hub).await[&poisoned_id].0, "pending");
    let stats = poisoner.client.worker_stats().await.unwrap();
    assert!((stats.reputation_score - 1.0).abs() < 1e-9);
    // A second aggregation does not apply it while it waits.
    assert!(matches!(
        t.admin.aggregate().await.unwrap(),
        AggregateOutcome::Waiting { pending: 0 }
    ));
    // The recomputation disagrees with the made-up update: now it is rejected and it costs.
    let verdict = hrm_hub::verify::verify_next(&t.hub).await.unwrap().unwrap();
    assert!(!verdict.agreed(), "{verdict:?}");
    assert_eq!(update_statuses(&t.hub).await[&poisoned_id].0, "rejected");
    let stats = poisoner.client.worker_stats().await.unwrap();
    assert!((stats.reputation_score - 0.5).abs() < 1e-9);
    assert_eq!((stats.validated_batches, stats.updates_rejected), (0, 1));
    // Its batch goes back to the queue for someone else.
    let status = batch_status(&t.hub, poisoned_batch.batch_id).await;
    assert_eq!(status, "pending");
}

#[tokio::test]
async fn krum_keeps_the_clustered_update() {
    let t = start(policy(&["--rule", "krum", "--byzantine", "1"]), 8).await;
    let (_, before) = current_params(&t.hub).await;
    let mut updates = Vec::new();
    for i in 0..6 {
        let w = SimWorker::join(&t.url, &format!("k{i}")).await;
        updates.push(w.contribute(&honest).await);
    }
    // Pointing the other way: the outlier screen or Krum must keep it out.
    let liar = SimWorker::join(&t.url, "liar").await;
    let (_, lie, _) = liar
        .contribute(&|b, n| honest(b, n).iter().map(|v| -v).collect())
        .await;
    let outcome = t.admin.aggregate().await.unwrap();
    let AggregateOutcome::Success { num_updates, .. } = outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(num_updates, 1, "Krum applies one update");
    let statuses = update_statuses(&t.hub).await;
    assert_ne!(statuses[&lie.update_id.to_string()].0, "aggregated");
    let chosen: Vec<_> = updates
        .iter()
        .filter(|(_, r, _)| statuses[&r.update_id.to_string()].0 == "aggregated")
        .collect();
    assert_eq!(chosen.len(), 1);
    let (_, after) = current_params(&t.hub).await;
    let expected: Vec<f32> = before
        .iter()
        .zip(&chosen[0].2)
        .map(|(p, d)| p - d)
        .collect();
    assert!(max_abs_diff(&after, &expected) < 1e-6);
}

#[tokio::test]
async fn stale_updates_are_refused_and_rollback_starts_a_new_line() {
    let t = start(policy(&["--max-staleness", "1"]), 8).await;
    let late = SimWorker::join(&t.url, "late").await;
    let late_batch = late.lease().await.unwrap();
    let (schema, _) = late.checkpoint("v0.1.0").await;
    for round in 1..=2 {
        let w = SimWorker::join(&t.url, &format!("r{round}")).await;
        w.contribute(&honest).await;
        let outcome = t.admin.aggregate().await.unwrap();
        assert_eq!(
            outcome,
            AggregateOutcome::Success {
                version: format!("v0.1.{round}"),
                num_updates: 1,
                rejected: 0
            }
        );
    }
    // Computed on v0.1.0, two versions behind with a staleness bound of one.
    let file = encode_update(
        &schema,
        &honest(late_batch.batch_id, schema.num_parameters()),
        "v0.1.0",
        Encoding::Dense,
    );
    let e = late.upload(&late_batch, "v0.1.0", file).await.unwrap_err();
    assert_eq!(code(&e), (Some(StatusCode::CONFLICT), Some("stale_update")));

    // An update on v0.1.2 is pending when the operator rolls back to v0.1.1.
    let w = SimWorker::join(&t.url, "orphan").await;
    let (orphan_batch, orphan, _) = w.contribute(&honest).await;
    hrm_hub::versions::rollback(&t.hub, "v0.1.1").await.unwrap();
    assert_eq!(t.admin.current_model().await.unwrap().version, "v0.1.1");
    let (_, at_rollback) = current_params(&t.hub).await;
    let fresh = SimWorker::join(&t.url, "fresh").await;
    fresh.contribute(&honest).await;
    let outcome = t.admin.aggregate().await.unwrap();
    assert_eq!(
        outcome,
        AggregateOutcome::Success {
            version: "v0.2.1".into(),
            num_updates: 1,
            rejected: 0
        }
    );
    let current = t.admin.current_model().await.unwrap();
    assert_eq!(current.parent.as_deref(), Some("v0.1.1"));
    assert_eq!(
        update_statuses(&t.hub).await[&orphan.update_id.to_string()].0,
        "stale"
    );
    let status = batch_status(&t.hub, orphan_batch.batch_id).await;
    assert_eq!(status, "pending");
    let (_, now) = current_params(&t.hub).await;
    assert!(max_abs_diff(&now, &at_rollback) > 0.0);
    let versions: Vec<String> = t
        .admin
        .versions()
        .await
        .unwrap()
        .into_iter()
        .map(|v| v.version)
        .collect();
    assert_eq!(versions, ["v0.1.0", "v0.1.1", "v0.1.2", "v0.2.1"]);
}

#[tokio::test]
async fn rate_limits_and_reputation_floor() {
    let t = start(
        policy(&["--rate-burst", "3", "--rate-per-second", "0.01"]),
        2,
    )
    .await;
    let worker = SimWorker::join(&t.url, "eager").await;
    for _ in 0..3 {
        worker.client.login().await.unwrap();
    }
    let e = worker.client.login().await.unwrap_err();
    assert_eq!(
        code(&e),
        (Some(StatusCode::TOO_MANY_REQUESTS), Some("rate_limited"))
    );
    // Retry-After says when the next token comes: about 1 / 0.01 per second.
    let wait = e.retry_after().expect("a Retry-After header").as_secs();
    assert!((90..=100).contains(&wait), "Retry-After {wait}");
    // Another worker is not affected.
    let other = SimWorker::join(&t.url, "calm").await;
    other.client.login().await.unwrap();
    sqlx::query("UPDATE workers SET reputation_score = 0.1 WHERE id = $1")
        .bind(other.id.to_string())
        .execute(&t.hub.db.pool)
        .await
        .unwrap();
    let e = other
        .client
        .request_batch(other.id, Default::default())
        .await
        .unwrap_err();
    assert_eq!(
        code(&e),
        (Some(StatusCode::FORBIDDEN), Some("low_reputation"))
    );
}

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn next_event(ws: &mut Socket) -> StatusEvent {
    use futures::StreamExt;
    use tokio_tungstenite::tungstenite::Message;
    loop {
        if let Message::Text(text) = ws.next().await.unwrap().unwrap() {
            return serde_json::from_str(&text).unwrap();
        }
    }
}

#[tokio::test]
async fn status_feed_reports_versions_and_drops_silent_clients() {
    use futures::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let t = start(
        policy(&[
            "--heartbeat-seconds",
            "1",
            "--min-gradients-for-update",
            "2",
        ]),
        2,
    )
    .await;
    let ws_url = format!("{}/api/v1/ws/status", t.url.replace("http://", "ws://"));
    let (mut listener, _) = tokio_tungstenite::connect_async(&ws_url).await.unwrap();
    let hello = next_event(&mut listener).await;
    assert_eq!(
        hello,
        StatusEvent::Hello {
            current_version: Some("v0.1.0".into()),
            heartbeat_seconds: 1
        }
    );
    // The scheduler: with two updates pending (MIN_GRADIENTS_FOR_UPDATE) it aggregates on
    // its own, long before its hourly tick.
    let scheduler = tokio::spawn(hrm_hub::aggregator::run_loop(t.hub.clone()));
    for name in ["feed-a", "feed-b"] {
        SimWorker::join(&t.url, name)
            .await
            .contribute(&honest)
            .await;
    }
    let mut seen_version = false;
    let mut seen_aggregation = false;
    while !(seen_version && seen_aggregation) {
        match tokio::time::timeout(
            std::time::Duration::from_secs(10),
            next_event(&mut listener),
        )
        .await
        .unwrap()
        {
            StatusEvent::Version { version, parent } => {
                assert_eq!(
                    (version.as_str(), parent.as_deref()),
                    ("v0.1.1", Some("v0.1.0"))
                );
                seen_version = true;
            }
            StatusEvent::Aggregation(outcome) => {
                assert_eq!(
                    outcome,
                    AggregateOutcome::Success {
                        version: "v0.1.1".into(),
                        num_updates: 2,
                        rejected: 0
                    }
                );
                seen_aggregation = true;
            }
            StatusEvent::Heartbeat { .. } | StatusEvent::Stats(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    scheduler.abort();
    listener
        .send(Message::Text("still here".into()))
        .await
        .unwrap();

    // A client that never answers (no reads, so no pongs) is closed after three heartbeats.
    let (silent, _) = tokio_tungstenite::connect_async(&ws_url).await.unwrap();
    let (_, mut read) = silent.split();
    let closed = tokio::time::timeout(std::time::Duration::from_secs(15), async {
        // Reading now only drains what the hub sent before it gave up.
        tokio::time::sleep(std::time::Duration::from_millis(4500)).await;
        loop {
            match read.next().await {
                None | Some(Err(_)) | Some(Ok(Message::Close(_))) => return,
                Some(Ok(_)) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the silent client was not dropped");
}

#[tokio::test]
async fn the_dashboard_and_public_routes_need_no_key() {
    let t = start(policy(&[]), 1).await;
    hrm_wire::install_tls_provider();
    let http = reqwest::Client::new();
    let page = http.get(format!("{}/", t.url)).send().await.unwrap();
    assert_eq!(page.status(), StatusCode::OK);
    assert!(page.text().await.unwrap().contains("HRM training network"));
    for path in [
        "/api/v1/stats/global",
        "/api/v1/leaderboard",
        "/api/v1/model/current",
        "/api/v1/model/versions",
    ] {
        assert_eq!(
            http.get(format!("{}{path}", t.url))
                .send()
                .await
                .unwrap()
                .status(),
            StatusCode::OK,
            "{path}"
        );
    }
    let missing = http
        .get(format!("{}/api/v1/nope", t.url))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    let rows = sqlx::query("SELECT COUNT(*) AS n FROM workers")
        .fetch_one(&t.hub.db.pool)
        .await
        .unwrap();
    assert_eq!(rows.get::<i64, _>("n"), 0);
}

#[tokio::test]
async fn re_verification_recomputes_updates_and_moves_reputation() {
    let t = start(policy(&["--verify-fraction", "1"]), 4).await;
    let honest_worker = SimWorker::join(&t.url, "trainer").await;
    honest_worker.contribute_honestly().await;

    // A lazy one uploads something plausible-looking that it never computed.
    let lazy = SimWorker::join(&t.url, "lazy").await;
    lazy.contribute(&honest).await;

    // Top-k uploads are judged on the values they sent: an honest one agrees (against the
    // whole update it would score about 0.5), one pointing the other way does not.
    let top_k = Encoding::TopK { ratio: 0.1 };
    let compressing = SimWorker::join(&t.url, "compressing").await;
    let batch = compressing.lease().await.unwrap();
    let (schema, delta) = compressing.train(&batch).await;
    let file = encode_update(&schema, &delta, &batch.model_version, top_k);
    compressing
        .upload(&batch, &batch.model_version, file)
        .await
        .unwrap();
    let reversing = SimWorker::join(&t.url, "reversing").await;
    let batch = reversing.lease().await.unwrap();
    let (schema, delta) = reversing.train(&batch).await;
    let reversed: Vec<f32> = delta.iter().map(|v| -v).collect();
    let file = encode_update(&schema, &reversed, &batch.model_version, top_k);
    reversing
        .upload(&batch, &batch.model_version, file)
        .await
        .unwrap();

    let cosines: Vec<f64> = verify_all(&t.hub)
        .await
        .iter()
        .map(|v| v.cosine().unwrap())
        .collect();
    assert_eq!(cosines.len(), 4);
    assert!(
        cosines[0] > 0.999,
        "an exact recomputation must agree: {}",
        cosines[0]
    );
    assert!(
        cosines[1] < 0.5,
        "a made-up update must not: {}",
        cosines[1]
    );
    assert!(cosines[2] > 0.999, "honest top-k: {}", cosines[2]);
    assert!(cosines[3] < -0.999, "reversed top-k: {}", cosines[3]);
    for (worker, expected) in [
        (&honest_worker, 1.05),
        (&lazy, 0.5),
        (&compressing, 1.05),
        (&reversing, 0.5),
    ] {
        let reputation = worker.client.worker_stats().await.unwrap().reputation_score;
        assert!((reputation - expected).abs() < 1e-9, "{reputation}");
    }
}

#[tokio::test]
async fn ingest_spreads_every_window_once_across_batches() {
    let dir = tempfile::tempdir().unwrap();
    let (db, queue, blobs) = local_parts(dir.path()).await;
    let hub = hrm_hub::Hub::from_parts(db, queue, blobs, policy(&[]), None);
    // Token i is i, so a window's first token is its position in the corpus.
    let corpus: Vec<u32> = (0..(16 * BATCH_SIZE * SEQ_LEN + 1) as u32).collect();
    let ingest = || {
        hrm_hub::batches::ingest(
            &hub,
            "positions",
            &corpus,
            None,
            BATCH_SIZE,
            SEQ_LEN,
            |_, _| {},
        )
    };
    let first = ingest().await.unwrap();
    assert_eq!(first.new_batches, 16);
    let keys: Vec<String> =
        sqlx::query_scalar("SELECT data_url FROM training_batches ORDER BY seq")
            .fetch_all(&hub.db.pool)
            .await
            .unwrap();
    let mut seen: Vec<u32> = Vec::new();
    for key in &keys {
        let starts: Vec<u32> =
            hrm_wire::samples::decode_samples(&hub.blobs.get(key).await.unwrap())
                .unwrap()
                .iter()
                .map(|w| w[0])
                .collect();
        seen.extend(&starts);
        let spread = starts.iter().max().unwrap() - starts.iter().min().unwrap();
        assert!(
            spread as usize > BATCH_SIZE * SEQ_LEN,
            "one passage per batch: {starts:?}"
        );
    }
    seen.sort();
    let every: Vec<u32> = (0..16 * BATCH_SIZE as u32)
        .map(|i| i * SEQ_LEN as u32)
        .collect();
    assert_eq!(seen, every, "every window exactly once");
    assert_eq!(
        ingest().await.unwrap().new_batches,
        0,
        "the same batches again"
    );
}

/// The published OpenAPI document names every route under `/api/v1` with the wire types'
/// schemas, and every route it names is served.
#[tokio::test]
async fn the_openapi_document_describes_the_served_routes() {
    let t = start(policy(&[]), 1).await;
    hrm_wire::install_tls_provider();
    let client = reqwest::Client::new();
    let doc: serde_json::Value = client
        .get(format!("{}/openapi.json", t.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut routes: Vec<String> = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            routes.push(format!("{method} {path}"));
        }
    }
    routes.sort();
    assert_eq!(
        routes,
        [
            "get /api/v1/auth/challenge",
            "get /api/v1/batch/data/{batch_id}",
            "get /api/v1/leaderboard",
            "get /api/v1/model/current",
            "get /api/v1/model/download/{version}",
            "get /api/v1/model/versions",
            "get /api/v1/stats/global",
            "get /api/v1/worker/stats",
            "get /api/v1/ws/status",
            "get /healthz",
            "post /api/v1/aggregate",
            "post /api/v1/auth/login",
            "post /api/v1/auth/register",
            "post /api/v1/batch/request",
            "post /api/v1/gradients/upload",
            "post /api/v1/gradients/upload-url",
            "put /api/v1/gradients/blob/{batch_id}",
        ]
    );
    let schemas = doc["components"]["schemas"].as_object().unwrap();
    for name in [
        "RegisterRequest",
        "BatchAssignment",
        "GradientUpload",
        "ErrorBody",
    ] {
        assert!(schemas.contains_key(name), "no schema {name}");
    }
    for route in &routes {
        let (method, path) = route.split_once(' ').unwrap();
        let url = format!(
            "{}{}",
            t.url,
            path.replace("{batch_id}", &uuid::Uuid::nil().to_string())
                .replace("{version}", "v0.1.0")
        );
        let method = reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
        let r = client.request(method, url).send().await.unwrap();
        let body: serde_json::Value = r.json().await.unwrap_or_default();
        assert_ne!(body["error"]["code"], "no_route", "{route}");
    }
}
