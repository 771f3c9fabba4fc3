//! Training batches: ingestion of a corpus into pre-chunked gzip JSON-lines files, and leases.
//!
//! Status moves `pending → assigned` when a worker leases a batch, `assigned → completed` when
//! its update is accepted, and `assigned → pending` when the lease expires. A completed batch
//! goes back to `pending` when its update is rejected or goes stale before aggregation. A batch
//! that has been through `--max-attempts` leases without being aggregated becomes `failed`.

use crate::Hub;
use crate::db::{now_ms, to_datetime};
use crate::error::{ApiError, ApiResult};
use crate::queue::BATCHES;
use crate::versions;
use crate::workers::Worker;
use anyhow::{Context, Result};
use bytes::Bytes;
use hrm_wire::samples::{decode_samples, encode_samples};
use hrm_wire::{BatchAssignment, TrainingPlan};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use sha2::{Digest, Sha256};
use sqlx::{AssertSqlSafe, Row};
use std::time::Duration;
use uuid::Uuid;

/// The batch sizes the hub pre-chunks, from the specification.
pub const BATCH_SIZES: [usize; 3] = [256, 512, 1024];

/// Key of the held-out validation windows the aggregator scores new versions on.
pub const VALIDATION_KEY: &str = "validation/windows.jsonl.gz";

/// Candidates tried per lease before falling back to the database.
const QUEUE_TRIES: usize = 16;
/// Pending batch ids moved from the database into an empty queue at once.
const REFILL: i64 = 1024;

/// What an ingest did.
#[derive(Debug, Clone, PartialEq)]
pub struct IngestReport {
    pub batches: usize,
    pub new_batches: usize,
    pub samples: usize,
    pub validation_windows: usize,
}

/// Cuts `tokens` into windows of `seq_len + 1` tokens (consecutive windows share one token, as
/// inputs and shifted targets need), shuffles them, and stores them as batches of
/// `batch_size`; a final short batch is kept with its own size. Batch ids come from the content, so ingesting the same
/// corpus again adds nothing.
pub async fn ingest(
    hub: &Hub,
    dataset: &str,
    tokens: &[u32],
    valid_tokens: Option<&[u32]>,
    batch_size: usize,
    seq_len: usize,
    mut progress: impl FnMut(usize, usize),
) -> Result<IngestReport> {
    anyhow::ensure!(
        !dataset.is_empty() && dataset.len() <= 128,
        "dataset names are 1 to 128 characters"
    );
    anyhow::ensure!(
        batch_size > 0 && seq_len > 0,
        "batch size and sequence length must be positive"
    );
    let mut windows: Vec<Vec<u32>> = (0..tokens.len().saturating_sub(seq_len))
        .step_by(seq_len)
        .map(|start| tokens[start..start + seq_len + 1].to_vec())
        .collect();
    // Each batch samples the whole corpus, as a centralised run's random windows do; in corpus
    // order every batch would hold one passage and the model would drift toward whatever book
    // it saw last. The seed comes from the dataset name, so ingesting again gives the same
    // batches.
    let seed = u64::from_le_bytes(
        Sha256::digest(dataset.as_bytes())[..8]
            .try_into()
            .expect("8 bytes"),
    );
    windows.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    let chunks: Vec<&[Vec<u32>]> = windows.chunks(batch_size).collect();
    let mut seq: i64 = sqlx::query_scalar("SELECT COALESCE(MAX(seq), 0) FROM training_batches")
        .fetch_one(&hub.db.pool)
        .await?;
    let mut new_ids = Vec::new();
    for (i, chunk) in chunks.iter().enumerate() {
        let file = encode_samples(chunk)?;
        let mut hasher = Sha256::new();
        hasher.update(dataset.as_bytes());
        hasher.update(&file);
        let digest: [u8; 32] = hasher.finalize().into();
        let id = uuid::Builder::from_custom_bytes(digest[..16].try_into().expect("16 bytes"))
            .into_uuid();
        let key = format!("batches/{dataset}/{id}.jsonl.gz");
        // The file first: a crash before the row leaves an unreferenced file, never a row
        // without its file.
        hub.blobs.put(&key, Bytes::from(file)).await?;
        seq += 1;
        let inserted = sqlx::query(
            "INSERT INTO training_batches (batch_id, seq, dataset_name, data_url, num_samples, seq_len, num_tokens) \
             VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT DO NOTHING",
        )
        .bind(id.to_string())
        .bind(seq)
        .bind(dataset)
        .bind(&key)
        .bind(chunk.len() as i64)
        .bind(seq_len as i64)
        .bind((chunk.len() * seq_len) as i64)
        .execute(&hub.db.pool)
        .await?
        .rows_affected();
        if inserted == 1 {
            new_ids.push(id.to_string());
        }
        progress(i + 1, chunks.len());
    }
    hub.queue.push(BATCHES, &new_ids).await?;
    let mut validation_windows = 0;
    if let Some(valid) = valid_tokens {
        let windows: Vec<Vec<u32>> = (0..valid.len().saturating_sub(seq_len))
            .step_by(seq_len)
            .map(|start| valid[start..start + seq_len + 1].to_vec())
            .collect();
        validation_windows = windows.len();
        hub.blobs
            .put(VALIDATION_KEY, Bytes::from(encode_samples(&windows)?))
            .await?;
    }
    Ok(IngestReport {
        batches: chunks.len(),
        new_batches: new_ids.len(),
        samples: windows.len(),
        validation_windows,
    })
}

/// A `training_batches` row, as leases need it.
struct BatchRow {
    batch_id: String,
    data_key: String,
    num_samples: i64,
    seq_len: i64,
    lease_expires_at: i64,
}

fn parse_batch(row: &sqlx::any::AnyRow) -> sqlx::Result<BatchRow> {
    Ok(BatchRow {
        batch_id: row.try_get("batch_id")?,
        data_key: row.try_get("data_url")?,
        num_samples: row.try_get("num_samples")?,
        seq_len: row.try_get("seq_len")?,
        lease_expires_at: row
            .try_get::<Option<i64>, _>("lease_expires_at")?
            .unwrap_or(0),
    })
}

const BATCH_COLUMNS: &str = "batch_id, data_url, num_samples, seq_len, lease_expires_at";

/// Moves one pending batch to `assigned` for `worker`; false when someone else got it first.
async fn claim(hub: &Hub, batch_id: &str, worker: &Worker) -> Result<bool> {
    let now = now_ms();
    let claimed = sqlx::query(
        "UPDATE training_batches SET status = 'assigned', assigned_to = $1, assigned_at = $2, lease_expires_at = $3 \
         WHERE batch_id = $4 AND status = 'pending'",
    )
    .bind(worker.id.to_string())
    .bind(now)
    .bind(now + hub.policy.lease.as_millis() as i64)
    .bind(batch_id)
    .execute(&hub.db.pool)
    .await?
    .rows_affected();
    Ok(claimed == 1)
}

async fn live_lease(hub: &Hub, worker: &Worker) -> Result<Option<BatchRow>> {
    let row = sqlx::query(AssertSqlSafe(format!(
        "SELECT {BATCH_COLUMNS} FROM training_batches WHERE assigned_to = $1 AND status = 'assigned' AND lease_expires_at > $2"
    )))
    .bind(worker.id.to_string())
    .bind(now_ms())
    .fetch_optional(&hub.db.pool)
    .await?;
    Ok(row.as_ref().map(parse_batch).transpose()?)
}

/// Leases a batch to `worker`: the one it already holds (a worker holds at most one, so a
/// reconnecting worker gets its batch back and no one can hoard), else the oldest pending one.
/// `None` when nothing is pending.
pub async fn lease(hub: &Hub, worker: &Worker) -> ApiResult<Option<BatchAssignment>> {
    worker.require_trusted(hub)?;
    let Some(version) = versions::current_version(hub).await? else {
        return Err(ApiError::unavailable(
            "no_model",
            "this hub has no model yet (`hrm hub init`)",
        ));
    };
    if let Some(row) = live_lease(hub, worker).await? {
        return Ok(Some(assignment(hub, row, version).await?));
    }
    let mut claimed = None;
    for _ in 0..QUEUE_TRIES {
        // A queue failure (Redis down) falls through to the database.
        let Ok(Some(id)) = hub.queue.pop(BATCHES).await else {
            break;
        };
        if claim(hub, &id, worker).await? {
            claimed = Some(id);
            break;
        }
    }
    if claimed.is_none() {
        let ids: Vec<String> = sqlx::query_scalar(
            "SELECT batch_id FROM training_batches WHERE status = 'pending' ORDER BY seq LIMIT $1",
        )
        .bind(REFILL)
        .fetch_all(&hub.db.pool)
        .await?;
        for (i, id) in ids.iter().enumerate() {
            if claim(hub, id, worker).await? {
                claimed = Some(id.clone());
                if let Err(e) = hub.queue.push(BATCHES, &ids[i + 1..]).await {
                    tracing::warn!(error = %e, "could not refill the batch queue; leasing from the database");
                }
                break;
            }
        }
    }
    let Some(id) = claimed else { return Ok(None) };
    let row = sqlx::query(AssertSqlSafe(format!(
        "SELECT {BATCH_COLUMNS} FROM training_batches WHERE batch_id = $1"
    )))
    .bind(&id)
    .fetch_one(&hub.db.pool)
    .await?;
    Ok(Some(assignment(hub, parse_batch(&row)?, version).await?))
}

/// The seed of a batch's training plan: from its id, so every computation of it agrees.
pub fn plan_seed(batch_id: &str) -> u64 {
    let digest = Sha256::digest(batch_id.as_bytes());
    u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"))
}

pub fn plan_for(hub: &Hub, batch_id: &str) -> TrainingPlan {
    TrainingPlan {
        seed: plan_seed(batch_id),
        ..hub.policy.plan.clone()
    }
}

async fn assignment(hub: &Hub, row: BatchRow, version: String) -> Result<BatchAssignment> {
    let remaining = (row.lease_expires_at - now_ms()).max(1000) as u64;
    let data_url = match hub
        .blobs
        .presign(
            object_store::signer::Method::GET,
            &row.data_key,
            Duration::from_millis(remaining),
        )
        .await?
    {
        Some(url) => url,
        None => format!("/api/v1/batch/data/{}", row.batch_id),
    };
    Ok(BatchAssignment {
        batch_id: Uuid::parse_str(&row.batch_id).context("corrupt batch id")?,
        model_version: version,
        data_url,
        num_samples: row.num_samples,
        seq_len: row.seq_len,
        lease_expires_at: to_datetime(row.lease_expires_at),
        plan: plan_for(hub, &row.batch_id),
    })
}

/// The batch file of a batch the worker holds (the local store's stand-in for a presigned GET).
pub async fn data(hub: &Hub, worker: &Worker, batch_id: Uuid) -> ApiResult<Bytes> {
    let key: Option<String> = sqlx::query_scalar(
        "SELECT data_url FROM training_batches WHERE batch_id = $1 AND assigned_to = $2 AND status IN ('assigned', 'completed')",
    )
    .bind(batch_id.to_string())
    .bind(worker.id.to_string())
    .fetch_optional(&hub.db.pool)
    .await?;
    let key = key.ok_or_else(|| {
        ApiError::not_found(
            "batch_not_leased",
            "this worker holds no lease on that batch",
        )
    })?;
    Ok(hub.blobs.get(&key).await?)
}

/// The fraction of all ingested batches that are completed (0 when none were ingested).
pub async fn completed_fraction(hub: &Hub) -> Result<f64> {
    let row = sqlx::query(
        "SELECT COUNT(*) AS total, CAST(COALESCE(SUM(CASE WHEN status = 'completed' THEN 1 ELSE 0 END), 0) AS BIGINT) AS done \
         FROM training_batches",
    )
    .fetch_one(&hub.db.pool)
    .await?;
    let (total, done): (i64, i64) = (row.try_get("total")?, row.try_get("done")?);
    Ok(if total > 0 {
        done as f64 / total as f64
    } else {
        0.0
    })
}

/// Returns expired leases to the queue (or fails batches out of attempts). Safe to run on
/// every replica at once: each row moves once.
pub async fn reap_expired_leases(hub: &Hub) -> Result<usize> {
    let rows = sqlx::query(
        "UPDATE training_batches SET \
           status = CASE WHEN attempts + 1 >= $1 THEN 'failed' ELSE 'pending' END, \
           attempts = attempts + 1, assigned_to = NULL, assigned_at = NULL, lease_expires_at = NULL \
         WHERE status = 'assigned' AND lease_expires_at < $2 RETURNING batch_id, status",
    )
    .bind(hub.policy.max_attempts)
    .bind(now_ms())
    .fetch_all(&hub.db.pool)
    .await?;
    let mut requeued = Vec::new();
    for row in &rows {
        if row.try_get::<String, _>("status")? == "pending" {
            requeued.push(row.try_get::<String, _>("batch_id")?);
        }
    }
    if let Err(e) = hub.queue.push(BATCHES, &requeued).await {
        tracing::warn!(error = %e, "could not requeue expired batches; they are leased from the database");
    }
    Ok(rows.len())
}

/// The validation windows stored by `ingest`, if any.
pub async fn validation_windows(hub: &Hub) -> Result<Option<Vec<Vec<u32>>>> {
    if hub.blobs.size(VALIDATION_KEY).await?.is_none() {
        return Ok(None);
    }
    Ok(Some(decode_samples(&hub.blobs.get(VALIDATION_KEY).await?)?))
}

/// Background loop: returns expired leases every `interval`.
pub async fn run_reaper(hub: std::sync::Arc<Hub>, interval: Duration) {
    let mut ticker = tokio::time::interval(interval);
    loop {
        ticker.tick().await;
        match reap_expired_leases(&hub).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(batches = n, "expired leases returned"),
            Err(e) => tracing::warn!(error = format!("{e:#}"), "could not return expired leases"),
        }
    }
}
