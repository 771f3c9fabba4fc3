//! `gradient_updates`: one row per accepted upload.
//!
//! `status`: `pending` → `aggregated` (in version `aggregated_into`), `discarded` (not chosen by
//! Krum), `rejected` (failed a screen or its re-verification), `stale` (computed on a version
//! too far behind), or `held` (its round would have raised the validation loss although every
//! update in it was re-verified; the operator decides). `verification`: null, `queued`,
//! `agreed`, `disagreed`, `error`. A `gated` update waits for an agreeing re-verification before
//! it may be aggregated.

use crate::db::now_ms;
use anyhow::{Context, Result};
use sqlx::{Any, AssertSqlSafe, Executor, Row};

/// A pending update, as the aggregator reads it.
#[derive(Debug, Clone)]
pub struct PendingUpdate {
    pub update_id: String,
    pub worker_id: String,
    pub batch_id: String,
    pub model_version: String,
    pub key: String,
    pub num_samples: i64,
    pub loss: f64,
    /// SHA-256 of the file at acceptance (null for rows accepted before it was recorded).
    pub sha256: Option<String>,
    pub verification: Option<String>,
}

const PENDING_COLUMNS: &str = "update_id, worker_id, batch_id, model_version, gradient_url, num_samples, loss, sha256, verification";

fn parse_pending(row: &sqlx::any::AnyRow) -> sqlx::Result<PendingUpdate> {
    Ok(PendingUpdate {
        update_id: row.try_get("update_id")?,
        worker_id: row.try_get("worker_id")?,
        batch_id: row.try_get("batch_id")?,
        model_version: row.try_get("model_version")?,
        key: row.try_get("gradient_url")?,
        num_samples: row.try_get("num_samples")?,
        loss: row.try_get("loss")?,
        sha256: row.try_get("sha256")?,
        verification: row.try_get("verification")?,
    })
}

/// Pending updates that may be aggregated now (not waiting for their re-verification), in
/// upload order: those named by `ids` if given, else the first `limit`.
pub async fn eligible<'e>(
    db: impl Executor<'e, Database = Any>,
    ids: Option<&[String]>,
    limit: usize,
) -> Result<Vec<PendingUpdate>> {
    let eligible = "status = 'pending' AND (gated = FALSE OR verification = 'agreed')";
    let rows = match ids {
        Some(ids) => {
            let placeholders: Vec<String> = (1..=ids.len()).map(|i| format!("${i}")).collect();
            let sql = format!(
                "SELECT {PENDING_COLUMNS} FROM gradient_updates WHERE {eligible} AND update_id IN ({}) ORDER BY uploaded_at",
                placeholders.join(", ")
            );
            let mut query = sqlx::query(AssertSqlSafe(sql));
            for id in ids {
                query = query.bind(id);
            }
            query.fetch_all(db).await?
        }
        None => {
            sqlx::query(AssertSqlSafe(format!(
                "SELECT {PENDING_COLUMNS} FROM gradient_updates WHERE {eligible} ORDER BY uploaded_at LIMIT $1"
            )))
            .bind(limit as i64)
            .fetch_all(db)
            .await?
        }
    };
    rows.iter()
        .map(|r| parse_pending(r).map_err(Into::into))
        .collect()
}

/// Ids of every pending update (eligible or waiting), in upload order.
pub async fn pending_ids<'e>(db: impl Executor<'e, Database = Any>) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT update_id FROM gradient_updates WHERE status = 'pending' ORDER BY uploaded_at",
    )
    .fetch_all(db)
    .await?)
}

/// Pending updates that may be aggregated now.
pub async fn eligible_count<'e>(db: impl Executor<'e, Database = Any>) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT COUNT(*) FROM gradient_updates WHERE status = 'pending' AND (gated = FALSE OR verification = 'agreed')",
    )
    .fetch_one(db)
    .await?)
}

/// The live (not rejected or stale) update of a batch: `(update_id, worker_id)`.
pub async fn live_for_batch<'e>(
    db: impl Executor<'e, Database = Any>,
    batch_id: &str,
) -> Result<Option<(String, String)>> {
    let row = sqlx::query(
        "SELECT update_id, worker_id FROM gradient_updates WHERE batch_id = $1 AND status <> 'rejected' AND status <> 'stale'",
    )
    .bind(batch_id)
    .fetch_optional(db)
    .await?;
    Ok(match row {
        Some(row) => Some((row.try_get("update_id")?, row.try_get("worker_id")?)),
        None => None,
    })
}

/// An accepted upload.
pub struct NewUpdate<'a> {
    pub update_id: &'a str,
    pub worker_id: &'a str,
    pub batch_id: &'a str,
    pub model_version: &'a str,
    pub key: &'a str,
    pub loss: f64,
    pub num_samples: i64,
    pub num_tokens: i64,
    pub size_bytes: i64,
    pub sha256: &'a str,
    pub norm: f64,
    /// Re-verify it (`verification = 'queued'`).
    pub verify: bool,
    /// And hold it back until the re-verification agrees.
    pub gated: bool,
}

pub async fn insert<'e>(db: impl Executor<'e, Database = Any>, u: NewUpdate<'_>) -> Result<()> {
    sqlx::query(
        "INSERT INTO gradient_updates (update_id, worker_id, batch_id, model_version, gradient_url, loss, num_samples, num_tokens, uploaded_at, verification, size_bytes, sha256, norm, gated) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
    )
    .bind(u.update_id)
    .bind(u.worker_id)
    .bind(u.batch_id)
    .bind(u.model_version)
    .bind(u.key)
    .bind(u.loss)
    .bind(u.num_samples)
    .bind(u.num_tokens)
    .bind(now_ms())
    .bind(u.verify.then_some("queued"))
    .bind(u.size_bytes)
    .bind(u.sha256)
    .bind(u.norm)
    .bind(u.gated)
    .execute(db)
    .await?;
    Ok(())
}

/// Records a verdict on a pending update; false when it was no longer pending.
pub async fn set_verdict<'e>(
    db: impl Executor<'e, Database = Any>,
    update_id: &str,
    status: &str,
    version: Option<&str>,
    reason: Option<&str>,
) -> Result<bool> {
    Ok(sqlx::query(
        "UPDATE gradient_updates SET status = $1, aggregated = $2, aggregated_into = $3, reason = $4 \
         WHERE update_id = $5 AND status = 'pending'",
    )
    .bind(status)
    .bind(matches!(status, "aggregated" | "discarded"))
    .bind(version)
    .bind(reason)
    .bind(update_id)
    .execute(db)
    .await?
    .rows_affected()
        == 1)
}

/// Holds a pending update back until a re-verification agrees with it (`reason` says why).
pub async fn gate_for_verification<'e>(
    db: impl Executor<'e, Database = Any>,
    update_id: &str,
    reason: &str,
) -> Result<bool> {
    Ok(sqlx::query(
        "UPDATE gradient_updates SET gated = TRUE, reason = $1, \
         verification = CASE WHEN verification = 'agreed' THEN verification ELSE 'queued' END \
         WHERE update_id = $2 AND status = 'pending'",
    )
    .bind(reason)
    .bind(update_id)
    .execute(db)
    .await?
    .rows_affected()
        == 1)
}

/// A queued re-verification: the update and the batch file it was computed on.
#[derive(Debug, Clone)]
pub struct QueuedVerification {
    pub update_id: String,
    pub worker_id: String,
    pub batch_id: String,
    pub model_version: String,
    pub key: String,
    pub status: String,
    pub gated: bool,
    pub sha256: Option<String>,
    pub data_key: String,
}

/// The next update to re-verify: gated ones first (they hold up aggregation), oldest first.
pub async fn next_queued<'e>(
    db: impl Executor<'e, Database = Any>,
) -> Result<Option<QueuedVerification>> {
    let row = sqlx::query(
        "SELECT u.update_id, u.worker_id, u.batch_id, u.model_version, u.gradient_url, u.status, \
         CASE WHEN u.gated THEN 1 ELSE 0 END AS gated, u.sha256, b.data_url \
         FROM gradient_updates u JOIN training_batches b ON b.batch_id = u.batch_id \
         WHERE u.verification = 'queued' ORDER BY u.gated DESC, u.uploaded_at LIMIT 1",
    )
    .fetch_optional(db)
    .await?;
    let Some(row) = row else { return Ok(None) };
    Ok(Some(QueuedVerification {
        update_id: row.try_get("update_id")?,
        worker_id: row.try_get("worker_id")?,
        batch_id: row.try_get("batch_id")?,
        model_version: row.try_get("model_version")?,
        key: row.try_get("gradient_url")?,
        status: row.try_get("status")?,
        // Read as a number: sqlx's Any driver cannot decode SQLite's BOOLEAN.
        gated: row.try_get::<i64, _>("gated")? != 0,
        sha256: row.try_get("sha256")?,
        data_key: row.try_get("data_url")?,
    }))
}

/// Re-verifications waiting to run.
pub async fn queued_count<'e>(db: impl Executor<'e, Database = Any>) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT COUNT(*) FROM gradient_updates WHERE verification = 'queued'")
            .fetch_one(db)
            .await?,
    )
}

/// Queues a pending update for re-verification (without holding it back).
pub async fn queue_verification<'e>(
    db: impl Executor<'e, Database = Any>,
    update_id: &str,
) -> Result<()> {
    sqlx::query(
        "UPDATE gradient_updates SET verification = 'queued' WHERE update_id = $1 AND verification IS NULL",
    )
    .bind(update_id)
    .execute(db)
    .await?;
    Ok(())
}

/// Records a re-verification's result; false when it was not queued any more.
pub async fn record_verification<'e>(
    db: impl Executor<'e, Database = Any>,
    update_id: &str,
    verdict: &str,
    cosine: Option<f64>,
) -> Result<bool> {
    Ok(sqlx::query(
        "UPDATE gradient_updates SET verification = $1, verification_cosine = $2 WHERE update_id = $3 AND verification = 'queued'",
    )
    .bind(verdict)
    .bind(cosine)
    .bind(update_id)
    .execute(db)
    .await?
    .rows_affected()
        == 1)
}

pub async fn status_of<'e>(
    db: impl Executor<'e, Database = Any>,
    update_id: &str,
) -> Result<String> {
    Ok(
        sqlx::query_scalar("SELECT status FROM gradient_updates WHERE update_id = $1")
            .bind(update_id)
            .fetch_one(db)
            .await?,
    )
}

/// Object keys still needed: files of pending and held updates and of queued re-verifications.
pub async fn live_keys<'e>(db: impl Executor<'e, Database = Any>) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT gradient_url FROM gradient_updates WHERE status IN ('pending', 'held') OR verification = 'queued'",
    )
    .fetch_all(db)
    .await?)
}

/// Whether a re-verification still needs this update's file.
pub async fn awaits_verification<'e>(
    db: impl Executor<'e, Database = Any>,
    update_id: &str,
) -> Result<bool> {
    let verification: Option<Option<String>> =
        sqlx::query_scalar("SELECT verification FROM gradient_updates WHERE update_id = $1")
            .bind(update_id)
            .fetch_optional(db)
            .await?;
    Ok(matches!(verification, Some(Some(v)) if v == "queued"))
}

/// Whether `worker_id` has a pending update that waits for its re-verification.
pub async fn awaits_verdict<'e>(
    db: impl Executor<'e, Database = Any>,
    worker_id: &str,
) -> Result<bool> {
    let waiting: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM gradient_updates \
         WHERE worker_id = $1 AND gated = TRUE AND verification = 'queued' AND status = 'pending'",
    )
    .bind(worker_id)
    .fetch_one(db)
    .await?;
    Ok(waiting > 0)
}

/// A held update, for the operator.
#[derive(Debug, Clone)]
pub struct HeldUpdate {
    pub update_id: String,
    pub worker_id: String,
    pub batch_id: String,
    pub model_version: String,
    pub reason: Option<String>,
}

pub async fn held<'e>(db: impl Executor<'e, Database = Any>) -> Result<Vec<HeldUpdate>> {
    let rows = sqlx::query(
        "SELECT update_id, worker_id, batch_id, model_version, reason FROM gradient_updates WHERE status = 'held' ORDER BY uploaded_at",
    )
    .fetch_all(db)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(HeldUpdate {
                update_id: r.try_get("update_id")?,
                worker_id: r.try_get("worker_id")?,
                batch_id: r.try_get("batch_id")?,
                model_version: r.try_get("model_version")?,
                reason: r.try_get("reason")?,
            })
        })
        .collect()
}

/// Held updates back to `pending` (they take part in the next aggregation, ungated).
pub async fn release_held<'e>(db: impl Executor<'e, Database = Any>) -> Result<u64> {
    Ok(sqlx::query(
        "UPDATE gradient_updates SET status = 'pending', gated = FALSE, reason = NULL WHERE status = 'held'",
    )
    .execute(db)
    .await?
    .rows_affected())
}

/// Held updates to `rejected`; returns their batch ids (to be redone).
pub async fn reject_held<'e>(db: impl Executor<'e, Database = Any>) -> Result<Vec<String>> {
    let rows = sqlx::query(
        "UPDATE gradient_updates SET status = 'rejected', reason = 'rejected by the operator after a held round' \
         WHERE status = 'held' RETURNING batch_id",
    )
    .fetch_all(db)
    .await?;
    rows.iter()
        .map(|r| r.try_get("batch_id").context("held update's batch"))
        .collect()
}

/// Counts per status for one worker: `(pending, rejected)`.
pub async fn counts_for_worker<'e>(
    db: impl Executor<'e, Database = Any>,
    worker_id: &str,
) -> Result<(i64, i64)> {
    let row = sqlx::query(
        "SELECT CAST(COALESCE(SUM(CASE WHEN status = 'pending' THEN 1 ELSE 0 END), 0) AS BIGINT) AS pending, \
         CAST(COALESCE(SUM(CASE WHEN status = 'rejected' THEN 1 ELSE 0 END), 0) AS BIGINT) AS rejected \
         FROM gradient_updates WHERE worker_id = $1",
    )
    .bind(worker_id)
    .fetch_one(db)
    .await?;
    Ok((row.try_get("pending")?, row.try_get("rejected")?))
}
