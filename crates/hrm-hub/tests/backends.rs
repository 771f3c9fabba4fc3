//! The hub on its production backends: PostgreSQL, Redis and an S3-compatible server (moto),
//! all real servers. `.ci/run` installs and starts them (`scripts/test-services`); locally
//! they are found at the addresses below or in `HRM_TEST_POSTGRES_URL`, `HRM_TEST_REDIS_URL`
//! and `HRM_TEST_S3_ENDPOINT`.
//!
//! Also: two hub replicas sharing one database, Redis and bucket never lease a batch twice
//! and never aggregate twice; flushing Redis loses nothing.

mod common;

use common::*;
use hrm_hub::blobs::Blobs;
use hrm_hub::db::Db;
use hrm_hub::queue::Queue;
use hrm_wire::AggregateOutcome;
use hrm_wire::update::{Encoding, encode_update};
use object_store::aws::AmazonS3Builder;
use sqlx::Connection;
use std::collections::HashSet;

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

fn unreachable(what: &str, e: impl std::fmt::Display) -> ! {
    panic!(
        "{what} is not reachable ({e}); start the test services with `scripts/test-services` (see README)"
    )
}

/// A fresh database on the test PostgreSQL server; returns its URL.
async fn fresh_postgres() -> String {
    sqlx::any::install_default_drivers();
    let admin = env_or(
        "HRM_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/postgres",
    );
    let mut conn = sqlx::AnyConnection::connect(&admin)
        .await
        .unwrap_or_else(|e| unreachable("PostgreSQL", e));
    let name = format!("hrm_test_{}", uuid::Uuid::new_v4().simple());
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut conn)
        .await
        .unwrap();
    let base = admin
        .rsplit_once('/')
        .map_or(admin.as_str(), |(base, _)| base)
        .to_string();
    format!("{base}/{name}")
}

async fn fresh_redis() -> (String, String) {
    let url = env_or("HRM_TEST_REDIS_URL", "redis://127.0.0.1:6379");
    (url, format!("hrm-test-{}", uuid::Uuid::new_v4().simple()))
}

/// A fresh bucket on the S3 test server.
async fn fresh_bucket() -> (String, String) {
    let endpoint = env_or("HRM_TEST_S3_ENDPOINT", "http://127.0.0.1:5000");
    let bucket = format!("hrm-test-{}", uuid::Uuid::new_v4().simple());
    // object_store cannot create buckets; S3's CreateBucket is a PUT on the bucket.
    hrm_wire::install_tls_provider();
    let created = reqwest::Client::new()
        .put(format!("{endpoint}/{bucket}"))
        .send()
        .await
        .unwrap_or_else(|e| unreachable("the S3 server", e));
    assert!(
        created.status().is_success(),
        "creating bucket: {}",
        created.status()
    );
    (endpoint, bucket)
}

fn s3(endpoint: &str, bucket: &str) -> Blobs {
    let builder = AmazonS3Builder::new()
        .with_endpoint(endpoint)
        .with_allow_http(true)
        .with_bucket_name(bucket)
        .with_region("us-east-1")
        .with_access_key_id("test")
        .with_secret_access_key("test");
    Blobs::s3_with(builder, bucket).unwrap()
}

struct Shared {
    database: String,
    redis: (String, String),
    s3: (String, String),
}

impl Shared {
    async fn new() -> Self {
        Self {
            database: fresh_postgres().await,
            redis: fresh_redis().await,
            s3: fresh_bucket().await,
        }
    }

    async fn replica(&self, policy: hrm_hub::config::Policy, batches: usize) -> TestHub {
        let db = Db::connect(&self.database).await.unwrap();
        let queue = Queue::redis(&self.redis.0, &self.redis.1)
            .await
            .unwrap_or_else(|e| unreachable("Redis", e));
        serve(db, queue, s3(&self.s3.0, &self.s3.1), policy, batches, None).await
    }

    async fn flush_redis(&self) {
        let client = redis::Client::open(self.redis.0.as_str()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}:*", self.redis.1))
            .query_async(&mut conn)
            .await
            .unwrap();
        for key in keys {
            let _: () = redis::cmd("DEL")
                .arg(key)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    }
}

#[tokio::test]
async fn the_network_runs_on_postgres_redis_and_s3() {
    let shared = Shared::new().await;
    let t = shared.replica(policy(&[]), 8).await;
    assert!(t.hub.blobs.is_s3());
    let (_, before) = current_params(&t.hub).await;
    let mut contributions = Vec::new();
    for i in 0..3 {
        let w = SimWorker::join(&t.url, &format!("pg{i}")).await;
        let (batch, _, update) = w.contribute(&honest).await;
        // Batch data comes straight from S3 through a presigned URL.
        assert!(
            batch.data_url.starts_with(&shared.s3.0),
            "{}",
            batch.data_url
        );
        let samples =
            hrm_wire::samples::decode_samples(&w.client.download(&batch.data_url).await.unwrap())
                .unwrap();
        assert_eq!(samples.len() as i64, batch.num_samples);
        contributions.push((update, batch.num_samples));
    }
    // Redis loses everything: the database still knows what is pending.
    shared.flush_redis().await;
    for i in 3..5 {
        let w = SimWorker::join(&t.url, &format!("pg{i}")).await;
        let (batch, _, update) = w.contribute(&honest).await;
        contributions.push((update, batch.num_samples));
    }
    shared.flush_redis().await;
    // What was accepted is what is aggregated: a worker that writes its object again through
    // its presigned URL after acceptance has its update rejected, and pays for it.
    let rewriter = SimWorker::join(&t.url, "rewriter").await;
    let batch = rewriter.lease().await.unwrap();
    let (schema, _) = rewriter.checkpoint(&batch.model_version).await;
    let target = rewriter
        .client
        .upload_target(rewriter.id, batch.batch_id)
        .await
        .unwrap();
    assert!(target.url.starts_with(&shared.s3.0), "{}", target.url);
    let honest_file = encode_update(
        &schema,
        &honest(batch.batch_id, schema.num_parameters()),
        &batch.model_version,
        Encoding::Dense,
    );
    rewriter
        .client
        .put_update(&target, honest_file)
        .await
        .unwrap();
    rewriter
        .client
        .upload_gradients(&hrm_wire::GradientUpload {
            worker_id: rewriter.id,
            batch_id: batch.batch_id,
            model_version: batch.model_version.clone(),
            gradients_url: target.gradients_url.clone(),
            loss: 3.5,
            num_samples: batch.num_samples,
        })
        .await
        .unwrap();
    let poisoned = vec![1.0; schema.num_parameters()];
    let file = encode_update(&schema, &poisoned, &batch.model_version, Encoding::Dense);
    rewriter.client.put_update(&target, file).await.unwrap();
    let outcome = t.admin.aggregate().await.unwrap();
    assert_eq!(
        outcome,
        AggregateOutcome::Success {
            version: "v0.1.1".into(),
            num_updates: 5,
            rejected: 1
        }
    );
    let stats = rewriter.client.worker_stats().await.unwrap();
    assert_eq!(stats.updates_rejected, 1);
    assert!((stats.reputation_score - 0.9).abs() < 1e-9);
    let (_, after) = current_params(&t.hub).await;
    let expected = after_plain_step(&before, &contributions, 1.0);
    assert!(max_abs_diff(&after, &expected) < 1e-6);
    // Uploaded files are gone once aggregated; the checkpoint is in the bucket.
    let current = hrm_hub::versions::current_row(&t.hub)
        .await
        .unwrap()
        .unwrap();
    assert!(
        t.hub
            .blobs
            .size(&current.checkpoint_key)
            .await
            .unwrap()
            .is_some()
    );
    let stats = t.admin.global_stats().await.unwrap();
    assert_eq!(
        (
            stats.batches.completed,
            stats.batches.pending,
            stats.updates_aggregated
        ),
        (5, 3, 5)
    );
}

#[tokio::test]
async fn two_replicas_lease_and_aggregate_exactly_once() {
    let shared = Shared::new().await;
    let a = shared.replica(policy(&[]), 12).await;
    let b = shared.replica(policy(&[]), 12).await;
    for round in 1..=3 {
        // Ten workers lease at once through alternating replicas: no batch twice.
        let mut workers = Vec::new();
        for i in 0..4 {
            let url = if i % 2 == 0 { &a.url } else { &b.url };
            workers.push(SimWorker::join(url, &format!("r{round}w{i}")).await);
        }
        let leases = futures::future::join_all(workers.iter().map(|w| w.lease())).await;
        let ids: HashSet<_> = leases
            .iter()
            .map(|l| l.as_ref().unwrap().batch_id)
            .collect();
        assert_eq!(
            ids.len(),
            workers.len(),
            "round {round}: a batch was leased twice"
        );
        for w in &workers {
            w.contribute(&honest).await;
        }
        // Both replicas try to aggregate at the same moment.
        let (x, y) = tokio::join!(
            hrm_hub::aggregator::aggregate(&a.hub, 1),
            hrm_hub::aggregator::aggregate(&b.hub, 1)
        );
        let outcomes = [x.unwrap(), y.unwrap()];
        let successes: Vec<_> = outcomes
            .iter()
            .filter(|o| matches!(o, Some(AggregateOutcome::Success { .. })))
            .collect();
        assert_eq!(successes.len(), 1, "round {round}: {outcomes:?}");
        assert_eq!(
            successes[0],
            &Some(AggregateOutcome::Success {
                version: format!("v0.1.{round}"),
                num_updates: 4,
                rejected: 0
            })
        );
        for other in outcomes
            .iter()
            .filter(|o| !matches!(o, Some(AggregateOutcome::Success { .. })))
        {
            assert!(
                matches!(other, None | Some(AggregateOutcome::Waiting { pending: 0 })),
                "{other:?}"
            );
        }
    }
    let versions = hrm_hub::versions::all_versions(&a.hub).await.unwrap();
    assert_eq!(versions.len(), 4);
    let statuses = update_statuses(&b.hub).await;
    assert_eq!(statuses.len(), 12);
    assert!(statuses.values().all(|(s, _)| s == "aggregated"));
    let validated: i64 =
        sqlx::query_scalar("SELECT CAST(SUM(validated_batches) AS BIGINT) FROM workers")
            .fetch_one(&a.hub.db.pool)
            .await
            .unwrap();
    assert_eq!(validated, 12);
}
