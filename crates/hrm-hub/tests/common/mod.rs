//! The hub tests' harness: a hub on an ephemeral port over real storage (SQLite and files by
//! default; PostgreSQL, Redis and an S3 server in `backends.rs`), a tiny MoE model, a small
//! ingested corpus, and simulated workers that speak the wire protocol through `HubClient`.

#![allow(dead_code)]

use candle_core::{DType, Device};
use candle_nn::VarMap;
use clap::Parser;
use hrm_hub::Hub;
use hrm_hub::blobs::Blobs;
use hrm_hub::config::{Policy, PolicyArgs};
use hrm_hub::db::Db;
use hrm_hub::queue::Queue;
use hrm_model::ModelSpec;
use hrm_model::train::sorted_vars;
use hrm_wire::update::{Encoding, Schema, encode_update, read_checkpoint};
use hrm_wire::{BatchAssignment, GradientUpload, Hardware, HubClient, UploadReceipt};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use uuid::Uuid;

pub const ADMIN_KEY: &str = "test-admin-key-0123456789abcdef0123456789";
pub const VOCAB: u32 = 64;
pub const SEQ_LEN: usize = 8;
pub const BATCH_SIZE: usize = 4;

pub fn tiny_config() -> serde_json::Value {
    serde_json::json!({
        "model_type": "hrm_text_moe",
        "vocab_size": VOCAB,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 64,
        "H_cycles": 1,
        "L_cycles": 1,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "prefix_lm": false,
        "tie_word_embeddings": false,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "router_aux_loss_coef": 0.01
    })
}

/// Writes a seeded tiny MoE checkpoint (config.json, model.safetensors) into `dir`.
pub fn write_tiny_model(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let config = tiny_config();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let spec = ModelSpec::from_config_file(&dir.join("config.json")).unwrap();
    let varmap = VarMap::new();
    spec.build(&varmap, DType::F32, &Device::Cpu).unwrap();
    spec.initialise(&varmap, 7).unwrap();
    let tensors: HashMap<String, candle_core::Tensor> = sorted_vars(&varmap)
        .into_iter()
        .map(|(name, var)| (name, var.as_tensor().clone()))
        .collect();
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    dir.to_path_buf()
}

/// Deterministic token ids in the tiny vocabulary.
pub fn tokens(count: usize, seed: u32) -> Vec<u32> {
    (0..count as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97) >> 7) % VOCAB)
        .collect()
}

/// Policy flags over test defaults: aggregation only when asked (an hour apart), one update
/// enough, no re-verification, no validation windows, and none of the defences against
/// hostile workers that need honest training (probation, the norm screen) or cost time (the
/// registration proof of work), unless the test says so: `tests/hostile.rs` runs with them.
pub fn policy(extra: &[&str]) -> Policy {
    #[derive(Parser)]
    #[command(args_override_self = true)]
    struct Args {
        #[command(flatten)]
        policy: PolicyArgs,
    }
    let mut argv = vec![
        "hub",
        "--aggregation-interval",
        "3600",
        "--min-gradients-for-update",
        "1",
        "--verify-fraction",
        "0",
        "--eval-windows",
        "0",
        "--rate-burst",
        "1000",
        "--rate-per-second",
        "1000",
        "--probation-agreements",
        "0",
        "--norm-bound",
        "0",
        "--challenge-bits",
        "0",
        "--register-burst",
        "1000",
    ];
    argv.extend_from_slice(extra);
    Args::try_parse_from(argv).unwrap().policy.policy().unwrap()
}

/// The hub's defaults, but aggregating only when the test asks and on one update, with no
/// random re-verification (probation's is deterministic for new workers) and a cheaper proof
/// of work: every defence against hostile workers is on.
pub fn defended_policy(extra: &[&str]) -> Policy {
    #[derive(Parser)]
    #[command(args_override_self = true)]
    struct Args {
        #[command(flatten)]
        policy: PolicyArgs,
    }
    let mut argv = vec![
        "hub",
        "--aggregation-interval",
        "3600",
        "--min-gradients-for-update",
        "1",
        "--verify-fraction",
        "0",
        "--challenge-bits",
        "8",
        // Every simulated worker registers from 127.0.0.1.
        "--register-burst",
        "1000",
    ];
    argv.extend_from_slice(extra);
    Args::try_parse_from(argv).unwrap().policy.policy().unwrap()
}

pub struct TestHub {
    pub hub: Arc<Hub>,
    pub url: String,
    pub admin: HubClient,
    pub dir: Option<tempfile::TempDir>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for TestHub {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// SQLite, the in-process queue and local files, in a fresh directory.
pub async fn local_parts(dir: &Path) -> (Db, Queue, Blobs) {
    let db = Db::connect(&format!(
        "sqlite://{}?mode=rwc",
        dir.join("hub.db").display()
    ))
    .await
    .unwrap();
    (
        db,
        Queue::memory(),
        Blobs::local(&dir.join("objects")).unwrap(),
    )
}

/// Starts a hub over the given parts and serves its routes (no background loops); initialises the model and ingests
/// `batches` batches (plus validation windows) unless the storage already has them.
pub async fn serve(
    db: Db,
    queue: Queue,
    blobs: Blobs,
    policy: Policy,
    batches: usize,
    dir: Option<tempfile::TempDir>,
) -> TestHub {
    let hub = Hub::from_parts(db, queue, blobs, policy, Some(ADMIN_KEY));
    if hrm_hub::versions::current_version(&hub)
        .await
        .unwrap()
        .is_none()
    {
        let model_dir = tempfile::tempdir().unwrap();
        hrm_hub::versions::init(&hub, &write_tiny_model(model_dir.path()))
            .await
            .unwrap();
        let corpus = tokens(batches * BATCH_SIZE * SEQ_LEN + 1, 1);
        let valid = tokens(10 * SEQ_LEN + 1, 2);
        hrm_hub::batches::ingest(
            &hub,
            "test",
            &corpus,
            Some(&valid),
            BATCH_SIZE,
            SEQ_LEN,
            |_, _| {},
        )
        .await
        .unwrap();
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    // The routes only: tests drive aggregation and the other loops themselves, so that
    // nothing runs behind their back.
    let router = hrm_hub::routes::router(hub.clone());
    let server = tokio::spawn(async move {
        hrm_http::serve(
            listener,
            router,
            &hrm_http::ConnectionLimits::default(),
            std::future::pending(),
        )
        .await
        .unwrap()
    });
    TestHub {
        hub,
        admin: HubClient::new(&url, ADMIN_KEY).unwrap(),
        url,
        dir,
        server,
    }
}

/// A hub on the embedded defaults.
pub async fn start(policy: Policy, batches: usize) -> TestHub {
    let dir = tempfile::tempdir().unwrap();
    let (db, queue, blobs) = local_parts(dir.path()).await;
    serve(db, queue, blobs, policy, batches, Some(dir)).await
}

/// A volunteer that registers with a fresh key and computes made-up updates.
pub struct SimWorker {
    pub client: HubClient,
    pub id: Uuid,
}

/// How a simulated worker's update is made from the batch id and the parameter count.
pub type MakeUpdate = dyn Fn(Uuid, usize) -> Vec<f32> + Send + Sync;

/// An honest update: a shared direction plus a batch-specific wiggle of a tenth of its size.
pub fn honest(batch: Uuid, len: usize) -> Vec<f32> {
    let salt = batch.as_u128() as u32;
    (0..len)
        .map(|i| {
            let shared = ((i as f32) * 0.37).sin() * 1e-3;
            let own =
                (((i as u32).wrapping_mul(2_246_822_519) ^ salt) % 1000) as f32 / 1000.0 - 0.5;
            shared + own * 2e-4
        })
        .collect()
}

impl SimWorker {
    pub async fn join(url: &str, name: &str) -> Self {
        let key = format!("sim-{}-{}", name, Uuid::new_v4().simple());
        let client = HubClient::new(url, key).unwrap();
        let registered = client
            .register(Some(name), Some(serde_json::json!({"cpu": "sim"})))
            .await
            .unwrap();
        Self {
            client,
            id: registered.worker_id,
        }
    }

    pub async fn lease(&self) -> Option<BatchAssignment> {
        self.client
            .request_batch(self.id, Hardware::default())
            .await
            .unwrap()
    }

    /// The schema and parameters of `version`, downloaded.
    pub async fn checkpoint(&self, version: &str) -> (Schema, Vec<f32>) {
        let bytes = self
            .client
            .download(&format!("/api/v1/model/download/{version}"))
            .await
            .unwrap();
        read_checkpoint(&bytes).unwrap()
    }

    /// The update an honest worker computes for `batch`: the plan's local training, on the CPU,
    /// as `hrm worker` and the hub's re-verification run it.
    pub async fn train(&self, batch: &BatchAssignment) -> (Schema, Vec<f32>) {
        use hrm_model::train::{LocalTraining, update_on_cpu};
        let spec =
            ModelSpec::from_config_json(&tiny_config().to_string(), Path::new("config.json"))
                .unwrap();
        let (schema, params) = self.checkpoint(&batch.model_version).await;
        let samples = hrm_wire::samples::decode_samples(
            &self.client.download(&batch.data_url).await.unwrap(),
        )
        .unwrap();
        let plan = LocalTraining::from_plan(&batch.plan, 2);
        let delta = update_on_cpu(&spec, &schema, &params, &samples, &plan)
            .unwrap()
            .flat;
        assert!(delta.iter().any(|v| *v != 0.0));
        (schema, delta)
    }

    /// Leases a batch, trains it honestly and uploads the update (dense).
    pub async fn contribute_honestly(&self) -> (BatchAssignment, UploadReceipt, Vec<f32>) {
        let batch = self.lease().await.expect("a batch is pending");
        let (schema, update) = self.train(&batch).await;
        let file = encode_update(&schema, &update, &batch.model_version, Encoding::Dense);
        let receipt = self
            .upload(&batch, &batch.model_version, file)
            .await
            .unwrap();
        (batch, receipt, update)
    }

    /// Uploads `update` for the leased batch as computed on `version`.
    pub async fn upload(
        &self,
        batch: &BatchAssignment,
        version: &str,
        file: Vec<u8>,
    ) -> Result<UploadReceipt, hrm_wire::ClientError> {
        let target = self.client.upload_target(self.id, batch.batch_id).await?;
        self.client.put_update(&target, file).await?;
        self.client
            .upload_gradients(&GradientUpload {
                worker_id: self.id,
                batch_id: batch.batch_id,
                model_version: version.to_string(),
                gradients_url: target.gradients_url,
                loss: 3.5,
                num_samples: batch.num_samples,
            })
            .await
    }

    /// Leases a batch, makes an update with `make`, uploads it; returns the batch, the receipt
    /// and the update.
    pub async fn contribute(
        &self,
        make: &MakeUpdate,
    ) -> (BatchAssignment, UploadReceipt, Vec<f32>) {
        let batch = self.lease().await.expect("a batch is pending");
        let (schema, _) = self.checkpoint(&batch.model_version).await;
        let update = make(batch.batch_id, schema.num_parameters());
        let file = encode_update(&schema, &update, &batch.model_version, Encoding::Dense);
        let receipt = self
            .upload(&batch, &batch.model_version, file)
            .await
            .unwrap();
        (batch, receipt, update)
    }
}

/// Parameters of the current version, read from the hub's store.
pub async fn current_params(hub: &Hub) -> (String, Vec<f32>) {
    let row = hrm_hub::versions::current_row(hub).await.unwrap().unwrap();
    let bytes = hub.blobs.get(&row.checkpoint_key).await.unwrap();
    (row.version, read_checkpoint(&bytes).unwrap().1)
}

/// Runs every queued re-verification; returns the verdicts in order.
pub async fn verify_all(hub: &Hub) -> Vec<hrm_hub::verify::Verdict> {
    let mut verdicts = Vec::new();
    while let Some(verdict) = hrm_hub::verify::verify_next(hub).await.unwrap() {
        verdicts.push(verdict);
    }
    verdicts
}

/// A worker's reputation, read from the database.
pub async fn reputation(hub: &Hub, worker: Uuid) -> f64 {
    sqlx::query_scalar("SELECT reputation_score FROM workers WHERE id = $1")
        .bind(worker.to_string())
        .fetch_one(&hub.db.pool)
        .await
        .unwrap()
}

/// `status` of every gradient update, keyed by update id.
pub async fn update_statuses(hub: &Hub) -> HashMap<String, (String, Option<String>)> {
    use sqlx::Row;
    sqlx::query("SELECT update_id, status, aggregated_into FROM gradient_updates")
        .fetch_all(&hub.db.pool)
        .await
        .unwrap()
        .iter()
        .map(|r| {
            (
                r.get::<String, _>("update_id"),
                (
                    r.get::<String, _>("status"),
                    r.get::<Option<String>, _>("aggregated_into"),
                ),
            )
        })
        .collect()
}

/// Weighted mean of updates, the straightforward way.
pub fn weighted_mean(updates: &[(Vec<f32>, i64)]) -> Vec<f32> {
    let total: f64 = updates.iter().map(|(_, n)| *n as f64).sum();
    (0..updates[0].0.len())
        .map(|i| {
            (updates
                .iter()
                .map(|(u, n)| f64::from(u[i]) * *n as f64)
                .sum::<f64>()
                / total) as f32
        })
        .collect()
}

/// The parameters a plain outer step of `lr` over the contributions' weighted mean leaves.
pub fn after_plain_step(before: &[f32], contributions: &[(Vec<f32>, i64)], lr: f32) -> Vec<f32> {
    before
        .iter()
        .zip(weighted_mean(contributions))
        .map(|(p, d)| p - lr * d)
        .collect()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// A batch's `status` column.
pub async fn batch_status(hub: &Hub, batch: Uuid) -> String {
    sqlx::query_scalar("SELECT status FROM training_batches WHERE batch_id = $1")
        .bind(batch.to_string())
        .fetch_one(&hub.db.pool)
        .await
        .unwrap()
}
