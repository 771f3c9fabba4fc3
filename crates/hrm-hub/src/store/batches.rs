//! `training_batches`: one row per pre-chunked batch and its lease.
//!
//! Status moves `pending → assigned` (a lease), `assigned → completed` (its update accepted),
//! `assigned → pending` (the lease expired), `completed → pending` (its update was rejected or
//! went stale), and any of those to `failed` after `--max-attempts`; `failed → pending` after
//! `--failed-cooldown` or by the operator. A unique index allows one `assigned` row per worker.

use crate::db::now_ms;
use anyhow::{Context, Result};
use sqlx::{Any, AssertSqlSafe, Executor, Row};

/// A batch row, as leases and uploads need it.
#[derive(Debug, Clone)]
pub struct BatchRow {
    pub batch_id: String,
    pub status: String,
    pub assigned_to: Option<String>,
    pub data_key: String,
    pub num_samples: i64,
    pub num_tokens: i64,
    pub seq_len: i64,
    pub lease_expires_at: i64,
}

const COLUMNS: &str =
    "batch_id, status, assigned_to, data_url, num_samples, num_tokens, seq_len, lease_expires_at";

fn parse(row: &sqlx::any::AnyRow) -> sqlx::Result<BatchRow> {
    Ok(BatchRow {
        batch_id: row.try_get("batch_id")?,
        status: row.try_get("status")?,
        assigned_to: row.try_get("assigned_to")?,
        data_key: row.try_get("data_url")?,
        num_samples: row.try_get("num_samples")?,
        num_tokens: row.try_get("num_tokens")?,
        seq_len: row.try_get("seq_len")?,
        lease_expires_at: row
            .try_get::<Option<i64>, _>("lease_expires_at")?
            .unwrap_or(0),
    })
}

/// A new batch for ingestion; false when the same content was ingested before.
pub struct NewBatch<'a> {
    pub batch_id: &'a str,
    pub seq: i64,
    pub dataset: &'a str,
    pub data_key: &'a str,
    pub num_samples: i64,
    pub seq_len: i64,
}

pub async fn insert<'e>(db: impl Executor<'e, Database = Any>, b: NewBatch<'_>) -> Result<bool> {
    let inserted = sqlx::query(
        "INSERT INTO training_batches (batch_id, seq, dataset_name, data_url, num_samples, seq_len, num_tokens) \
         VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT DO NOTHING",
    )
    .bind(b.batch_id)
    .bind(b.seq)
    .bind(b.dataset)
    .bind(b.data_key)
    .bind(b.num_samples)
    .bind(b.seq_len)
    .bind(b.num_samples * b.seq_len)
    .execute(db)
    .await?
    .rows_affected();
    Ok(inserted == 1)
}

pub async fn max_seq<'e>(db: impl Executor<'e, Database = Any>) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT COALESCE(MAX(seq), 0) FROM training_batches")
            .fetch_one(db)
            .await?,
    )
}

pub async fn get<'e>(
    db: impl Executor<'e, Database = Any>,
    batch_id: &str,
) -> Result<Option<BatchRow>> {
    let row = sqlx::query(AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM training_batches WHERE batch_id = $1"
    )))
    .bind(batch_id)
    .fetch_optional(db)
    .await?;
    Ok(row.as_ref().map(parse).transpose()?)
}

/// The batch `worker` holds, expired or not (at most one, by the unique index).
pub async fn held_by<'e>(
    db: impl Executor<'e, Database = Any>,
    worker: &str,
) -> Result<Option<BatchRow>> {
    let row = sqlx::query(AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM training_batches WHERE assigned_to = $1 AND status = 'assigned'"
    )))
    .bind(worker)
    .fetch_optional(db)
    .await?;
    Ok(row.as_ref().map(parse).transpose()?)
}

/// Why a claim did not take a batch.
#[derive(Debug, PartialEq)]
pub enum Claim {
    Claimed,
    /// Someone else took it first (or it is no longer pending).
    Taken,
    /// The worker already holds a batch (the unique index refused a second).
    AlreadyHolding,
}

/// Moves one pending batch to `assigned` for `worker` until `expires_at`.
pub async fn claim<'e>(
    db: impl Executor<'e, Database = Any>,
    batch_id: &str,
    worker: &str,
    expires_at: i64,
) -> Result<Claim> {
    let result = sqlx::query(
        "UPDATE training_batches SET status = 'assigned', assigned_to = $1, assigned_at = $2, lease_expires_at = $3 \
         WHERE batch_id = $4 AND status = 'pending'",
    )
    .bind(worker)
    .bind(now_ms())
    .bind(expires_at)
    .bind(batch_id)
    .execute(db)
    .await;
    match result {
        Ok(done) if done.rows_affected() == 1 => Ok(Claim::Claimed),
        Ok(_) => Ok(Claim::Taken),
        Err(sqlx::Error::Database(e)) if e.is_unique_violation() => Ok(Claim::AlreadyHolding),
        Err(e) => Err(e.into()),
    }
}

/// Pending batch ids, oldest first.
pub async fn pending_ids<'e>(
    db: impl Executor<'e, Database = Any>,
    limit: i64,
) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT batch_id FROM training_batches WHERE status = 'pending' ORDER BY seq LIMIT $1",
    )
    .bind(limit)
    .fetch_all(db)
    .await?)
}

/// The object key of a batch `worker` holds or held to completion (the batch file route).
pub async fn data_key_for_holder<'e>(
    db: impl Executor<'e, Database = Any>,
    batch_id: &str,
    worker: &str,
) -> Result<Option<String>> {
    Ok(sqlx::query_scalar(
        "SELECT data_url FROM training_batches WHERE batch_id = $1 AND assigned_to = $2 AND status IN ('assigned', 'completed')",
    )
    .bind(batch_id)
    .bind(worker)
    .fetch_optional(db)
    .await?)
}

/// `assigned → completed` when `worker` still holds it; false otherwise.
pub async fn complete<'e>(
    db: impl Executor<'e, Database = Any>,
    batch_id: &str,
    worker: &str,
    result_hash: &str,
) -> Result<bool> {
    Ok(sqlx::query(
        "UPDATE training_batches SET status = 'completed', completed_at = $1, result_hash = $2 \
         WHERE batch_id = $3 AND status = 'assigned' AND assigned_to = $4",
    )
    .bind(now_ms())
    .bind(result_hash)
    .bind(batch_id)
    .bind(worker)
    .execute(db)
    .await?
    .rows_affected()
        == 1)
}

/// The `status` expression that sends a batch back, or to `failed` once out of attempts.
const BACK_OR_FAILED: &str = "status = CASE WHEN attempts + 1 >= $1 THEN 'failed' ELSE 'pending' END, \
     failed_at = CASE WHEN attempts + 1 >= $1 THEN $2 ELSE NULL END, \
     attempts = attempts + 1, assigned_to = NULL, assigned_at = NULL, lease_expires_at = NULL, completed_at = NULL";

/// A completed batch whose update was rejected or went stale goes back to be redone.
pub async fn redo<'e>(
    db: impl Executor<'e, Database = Any>,
    batch_id: &str,
    max_attempts: i64,
) -> Result<()> {
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE training_batches SET {BACK_OR_FAILED} WHERE batch_id = $3 AND status = 'completed'"
    )))
    .bind(max_attempts)
    .bind(now_ms())
    .bind(batch_id)
    .execute(db)
    .await?;
    Ok(())
}

/// Returns leases expired before `now` (all of them, or only `worker`'s); gives the ids that
/// went back to `pending` and the count of all moved.
pub async fn release_expired<'e>(
    db: impl Executor<'e, Database = Any>,
    max_attempts: i64,
    worker: Option<&str>,
) -> Result<(Vec<String>, usize)> {
    let now = now_ms();
    let rows = sqlx::query(AssertSqlSafe(format!(
        "UPDATE training_batches SET {BACK_OR_FAILED} \
         WHERE status = 'assigned' AND lease_expires_at < $2 AND ($3 IS NULL OR assigned_to = $3) \
         RETURNING batch_id, status"
    )))
    .bind(max_attempts)
    .bind(now)
    .bind(worker)
    .fetch_all(db)
    .await?;
    let mut requeued = Vec::new();
    for row in &rows {
        if row.try_get::<String, _>("status")? == "pending" {
            requeued.push(row.try_get("batch_id")?);
        }
    }
    Ok((requeued, rows.len()))
}

/// Failed batches back to `pending` with fresh attempts: those failed before `failed_before`,
/// or the one named. Returns their ids.
pub async fn requeue_failed<'e>(
    db: impl Executor<'e, Database = Any>,
    failed_before: i64,
    batch_id: Option<&str>,
) -> Result<Vec<String>> {
    let rows = sqlx::query(
        "UPDATE training_batches SET status = 'pending', attempts = 0, failed_at = NULL \
         WHERE status = 'failed' AND ($1 IS NULL OR batch_id = $1) AND ($1 IS NOT NULL OR failed_at < $2) \
         RETURNING batch_id",
    )
    .bind(batch_id)
    .bind(failed_before)
    .fetch_all(db)
    .await?;
    rows.iter()
        .map(|r| r.try_get("batch_id").context("requeued batch id"))
        .collect()
}

/// `(total, completed)` batches.
pub async fn completion<'e>(db: impl Executor<'e, Database = Any>) -> Result<(i64, i64)> {
    let row = sqlx::query(
        "SELECT COUNT(*) AS total, CAST(COALESCE(SUM(CASE WHEN status = 'completed' THEN 1 ELSE 0 END), 0) AS BIGINT) AS done \
         FROM training_batches",
    )
    .fetch_one(db)
    .await?;
    Ok((row.try_get("total")?, row.try_get("done")?))
}

/// Batch ids with a live lease, and to whom: uploads in progress.
pub async fn leases<'e>(db: impl Executor<'e, Database = Any>) -> Result<Vec<(String, String)>> {
    let rows =
        sqlx::query("SELECT batch_id, assigned_to FROM training_batches WHERE status = 'assigned'")
            .fetch_all(db)
            .await?;
    rows.iter()
        .map(|r| Ok((r.try_get("batch_id")?, r.try_get("assigned_to")?)))
        .collect()
}

/// The batch ids and their data keys (re-verification reads the batch file).
pub async fn data_key<'e>(db: impl Executor<'e, Database = Any>, batch_id: &str) -> Result<String> {
    Ok(
        sqlx::query_scalar("SELECT data_url FROM training_batches WHERE batch_id = $1")
            .bind(batch_id)
            .fetch_one(db)
            .await?,
    )
}
