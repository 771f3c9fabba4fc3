//! `workers`: identities (the SHA-256 of their key, never the key), counters, reputation in
//! [0, `REPUTATION_MAX`] and `agreements`, the re-verifications in a row that agreed.

use crate::db::now_ms;
use crate::trust::REPUTATION_MAX;
use anyhow::Result;
use sqlx::{Any, Executor, Row};

#[derive(Debug, Clone)]
pub struct WorkerRow {
    pub id: String,
    pub api_key_hash: String,
    pub username: Option<String>,
    pub reputation_score: f64,
    pub total_batches: i64,
    pub validated_batches: i64,
    pub total_tokens: i64,
    pub agreements: i64,
    pub created_at: i64,
    pub last_seen: Option<i64>,
}

const COLUMNS: &str = "id, api_key_hash, username, reputation_score, total_batches, validated_batches, total_tokens, agreements, created_at, last_seen";

fn parse(row: &sqlx::any::AnyRow) -> sqlx::Result<WorkerRow> {
    Ok(WorkerRow {
        id: row.try_get("id")?,
        api_key_hash: row.try_get("api_key_hash")?,
        username: row.try_get("username")?,
        reputation_score: row.try_get("reputation_score")?,
        total_batches: row.try_get("total_batches")?,
        validated_batches: row.try_get("validated_batches")?,
        total_tokens: row.try_get("total_tokens")?,
        agreements: row.try_get("agreements")?,
        created_at: row.try_get("created_at")?,
        last_seen: row.try_get("last_seen")?,
    })
}

/// Inserts a worker; false when the key (or the username) is taken.
pub async fn insert<'e>(
    db: impl Executor<'e, Database = Any>,
    id: &str,
    key_hash: &str,
    username: Option<&str>,
    hardware: &str,
    created: i64,
) -> Result<bool> {
    Ok(sqlx::query(
        "INSERT INTO workers (id, api_key_hash, username, hardware_info, created_at, last_seen) \
         VALUES ($1, $2, $3, $4, $5, $5) ON CONFLICT DO NOTHING",
    )
    .bind(id)
    .bind(key_hash)
    .bind(username)
    .bind(hardware)
    .bind(created)
    .execute(db)
    .await?
    .rows_affected()
        == 1)
}

pub async fn by_key_hash<'e>(
    db: impl Executor<'e, Database = Any>,
    key_hash: &str,
) -> Result<Option<WorkerRow>> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM workers WHERE api_key_hash = $1"
    )))
    .bind(key_hash)
    .fetch_optional(db)
    .await?;
    Ok(row.as_ref().map(parse).transpose()?)
}

pub async fn by_id<'e>(
    db: impl Executor<'e, Database = Any>,
    id: &str,
) -> Result<Option<WorkerRow>> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM workers WHERE id = $1"
    )))
    .bind(id)
    .fetch_optional(db)
    .await?;
    Ok(row.as_ref().map(parse).transpose()?)
}

pub async fn touch<'e>(db: impl Executor<'e, Database = Any>, id: &str) -> Result<()> {
    sqlx::query("UPDATE workers SET last_seen = $1 WHERE id = $2")
        .bind(now_ms())
        .bind(id)
        .execute(db)
        .await?;
    Ok(())
}

/// Adds `delta` to a worker's reputation, within [0, REPUTATION_MAX].
pub async fn adjust_reputation<'e>(
    db: impl Executor<'e, Database = Any>,
    id: &str,
    delta: f64,
) -> Result<()> {
    sqlx::query(
        "UPDATE workers SET reputation_score = \
         CASE WHEN reputation_score + $1 > $2 THEN $2 \
              WHEN reputation_score + $1 < 0 THEN 0 ELSE reputation_score + $1 END \
         WHERE id = $3",
    )
    .bind(delta)
    .bind(REPUTATION_MAX)
    .bind(id)
    .execute(db)
    .await?;
    Ok(())
}

/// One more agreeing re-verification in a row, or (on disagreement) back to none.
pub async fn record_agreement<'e>(
    db: impl Executor<'e, Database = Any>,
    id: &str,
    agreed: bool,
) -> Result<()> {
    sqlx::query(
        "UPDATE workers SET agreements = CASE WHEN $1 THEN agreements + 1 ELSE 0 END WHERE id = $2",
    )
    .bind(agreed)
    .bind(id)
    .execute(db)
    .await?;
    Ok(())
}

/// An accepted upload: one more batch and its tokens.
pub async fn count_upload<'e>(
    db: impl Executor<'e, Database = Any>,
    id: &str,
    tokens: i64,
) -> Result<()> {
    sqlx::query(
        "UPDATE workers SET total_batches = total_batches + 1, total_tokens = total_tokens + $1 WHERE id = $2",
    )
    .bind(tokens)
    .bind(id)
    .execute(db)
    .await?;
    Ok(())
}

/// Moves the validated-batch count (aggregated +1, disagreeing re-verification −1).
pub async fn add_validated<'e>(
    db: impl Executor<'e, Database = Any>,
    id: &str,
    delta: i64,
) -> Result<()> {
    sqlx::query(
        "UPDATE workers SET validated_batches = CASE WHEN validated_batches + $1 < 0 THEN 0 ELSE validated_batches + $1 END WHERE id = $2",
    )
    .bind(delta)
    .bind(id)
    .execute(db)
    .await?;
    Ok(())
}

/// Workers with more validated batches than `validated` (for a rank).
pub async fn count_ahead<'e>(db: impl Executor<'e, Database = Any>, validated: i64) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT COUNT(*) FROM workers WHERE validated_batches > $1")
            .bind(validated)
            .fetch_one(db)
            .await?,
    )
}

/// The top `limit` workers by validated batches.
pub async fn top<'e>(db: impl Executor<'e, Database = Any>, limit: i64) -> Result<Vec<WorkerRow>> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM workers WHERE validated_batches > 0 \
         ORDER BY validated_batches DESC, total_tokens DESC, created_at LIMIT $1"
    )))
    .bind(limit)
    .fetch_all(db)
    .await?;
    rows.iter().map(|r| parse(r).map_err(Into::into)).collect()
}

/// `agreements` of each worker named, for the probation weights of a round.
pub async fn agreements<'e>(db: impl Executor<'e, Database = Any>, id: &str) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT agreements FROM workers WHERE id = $1")
            .bind(id)
            .fetch_one(db)
            .await?,
    )
}
