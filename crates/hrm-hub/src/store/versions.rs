//! `model_versions` (one row per published checkpoint) and `hub_state` (the single row with the
//! current version, the version-name counters, the norm reference and the challenge secret).

use anyhow::{Context, Result};
use sqlx::{Any, AssertSqlSafe, Executor, Row};

/// A `model_versions` row.
#[derive(Debug, Clone)]
pub struct VersionRow {
    pub version: String,
    pub checkpoint_key: String,
    pub sha256: String,
    pub num_parameters: i64,
    pub parent: Option<String>,
    pub step: i64,
    pub optimizer_key: Option<String>,
    pub config: serde_json::Value,
    pub metrics: serde_json::Value,
    pub created_at: i64,
}

const COLUMNS: &str = "version, checkpoint_url, sha256, num_parameters, parent, step, optimizer_url, config, metrics, created_at";

fn parse(row: &sqlx::any::AnyRow) -> Result<VersionRow> {
    let json = |column: &str| -> Result<serde_json::Value> {
        let text: String = row.try_get(column)?;
        serde_json::from_str(&text).with_context(|| format!("corrupt {column} JSON"))
    };
    Ok(VersionRow {
        version: row.try_get("version")?,
        checkpoint_key: row.try_get("checkpoint_url")?,
        sha256: row.try_get("sha256")?,
        num_parameters: row.try_get("num_parameters")?,
        parent: row.try_get("parent")?,
        step: row.try_get("step")?,
        optimizer_key: row.try_get("optimizer_url")?,
        config: json("config")?,
        metrics: json("metrics")?,
        created_at: row.try_get("created_at")?,
    })
}

pub async fn get<'e>(
    db: impl Executor<'e, Database = Any>,
    version: &str,
) -> Result<Option<VersionRow>> {
    let row = sqlx::query(AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM model_versions WHERE version = $1"
    )))
    .bind(version)
    .fetch_optional(db)
    .await?;
    row.as_ref().map(parse).transpose()
}

/// Every version, oldest first.
pub async fn all<'e>(db: impl Executor<'e, Database = Any>) -> Result<Vec<VersionRow>> {
    let rows = sqlx::query(AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM model_versions ORDER BY created_at, version"
    )))
    .fetch_all(db)
    .await?;
    rows.iter().map(parse).collect()
}

pub async fn parent_of<'e>(
    db: impl Executor<'e, Database = Any>,
    version: &str,
) -> Result<Option<String>> {
    Ok(
        sqlx::query_scalar("SELECT parent FROM model_versions WHERE version = $1")
            .bind(version)
            .fetch_one(db)
            .await?,
    )
}

pub async fn insert<'e>(db: impl Executor<'e, Database = Any>, row: &VersionRow) -> Result<()> {
    sqlx::query(
        "INSERT INTO model_versions (version, checkpoint_url, sha256, num_parameters, parent, step, optimizer_url, config, metrics, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    )
    .bind(&row.version)
    .bind(&row.checkpoint_key)
    .bind(&row.sha256)
    .bind(row.num_parameters)
    .bind(row.parent.clone())
    .bind(row.step)
    .bind(row.optimizer_key.clone())
    .bind(row.config.to_string())
    .bind(row.metrics.to_string())
    .bind(row.created_at)
    .execute(db)
    .await?;
    Ok(())
}

pub async fn current<'e>(db: impl Executor<'e, Database = Any>) -> Result<Option<String>> {
    Ok(
        sqlx::query_scalar("SELECT current_version FROM hub_state WHERE id = 1")
            .fetch_one(db)
            .await?,
    )
}

/// `(branch, patch)`: the version line and the last number on it.
pub async fn counters<'e>(db: impl Executor<'e, Database = Any>) -> Result<(i64, i64)> {
    let row = sqlx::query("SELECT branch, patch FROM hub_state WHERE id = 1")
        .fetch_one(db)
        .await?;
    Ok((row.try_get("branch")?, row.try_get("patch")?))
}

/// Makes `version` current if `base` still is (a compare-and-set), counting one more on the
/// line; false when someone else moved the current version first.
pub async fn advance<'e>(
    db: impl Executor<'e, Database = Any>,
    base: &str,
    version: &str,
    now: i64,
) -> Result<bool> {
    Ok(sqlx::query(
        "UPDATE hub_state SET current_version = $1, patch = patch + 1, last_aggregation_at = $2 WHERE id = 1 AND current_version = $3",
    )
    .bind(version)
    .bind(now)
    .bind(base)
    .execute(db)
    .await?
    .rows_affected()
        == 1)
}

/// Sets the first version; false when the hub already has one.
pub async fn start<'e>(db: impl Executor<'e, Database = Any>, version: &str) -> Result<bool> {
    Ok(sqlx::query(
        "UPDATE hub_state SET current_version = $1, branch = 1, patch = 0 WHERE id = 1 AND current_version IS NULL",
    )
    .bind(version)
    .execute(db)
    .await?
    .rows_affected()
        == 1)
}

/// Makes `version` current on a new line.
pub async fn roll_back_to<'e>(db: impl Executor<'e, Database = Any>, version: &str) -> Result<()> {
    sqlx::query(
        "UPDATE hub_state SET current_version = $1, branch = branch + 1, patch = 0 WHERE id = 1",
    )
    .bind(version)
    .execute(db)
    .await?;
    Ok(())
}

/// The norm reference and how many recomputations it rests on.
pub async fn norm_reference<'e>(
    db: impl Executor<'e, Database = Any>,
) -> Result<(Option<f64>, i64)> {
    let row = sqlx::query("SELECT norm_reference, norm_samples FROM hub_state WHERE id = 1")
        .fetch_one(db)
        .await?;
    Ok((row.try_get("norm_reference")?, row.try_get("norm_samples")?))
}

/// Stores a new norm reference resting on one more sample, if the reference still rests on
/// `samples` (a compare-and-set: of two replicas racing, one sample is dropped, nothing mixed).
pub async fn set_norm_reference<'e>(
    db: impl Executor<'e, Database = Any>,
    reference: f64,
    samples: i64,
) -> Result<bool> {
    Ok(sqlx::query(
        "UPDATE hub_state SET norm_reference = $1, norm_samples = norm_samples + 1 WHERE id = 1 AND norm_samples = $2",
    )
    .bind(reference)
    .bind(samples)
    .execute(db)
    .await?
    .rows_affected()
        == 1)
}

/// The secret registration challenges are signed with, made once by whichever replica asks
/// first.
pub async fn challenge_secret<'e, E>(db: E, fresh: &str) -> Result<String>
where
    E: Executor<'e, Database = Any> + Copy,
{
    sqlx::query(
        "UPDATE hub_state SET challenge_secret = $1 WHERE id = 1 AND challenge_secret IS NULL",
    )
    .bind(fresh)
    .execute(db)
    .await?;
    Ok(
        sqlx::query_scalar("SELECT challenge_secret FROM hub_state WHERE id = 1")
            .fetch_one(db)
            .await?,
    )
}
