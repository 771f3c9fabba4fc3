//! Worker identity: registration with a client-generated key (only its SHA-256 is stored),
//! the bearer-key extractor every authenticated route uses (with the rate limit and the
//! reputation floor), and the worker's stats and the leaderboard.

use crate::Hub;
use crate::db::{now_ms, to_datetime};
use crate::error::{ApiError, ApiResult};
use axum::extract::FromRequestParts;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use hrm_wire::{LeaderboardEntry, RegisterRequest, RegisterResponse, WorkerStats, badges_for};
use sha2::{Digest, Sha256};
use sqlx::Row;
use std::sync::Arc;
use subtle::ConstantTimeEq;
use uuid::Uuid;

pub const MIN_KEY_CHARS: usize = 32;
pub const MAX_KEY_CHARS: usize = 64;
pub const MAX_USERNAME_CHARS: usize = 64;

/// `last_seen` is written at most this often per worker, to keep reads from becoming writes.
const LAST_SEEN_RESOLUTION_MS: i64 = 30_000;

pub fn key_digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An authenticated worker, as the extractor found it.
#[derive(Debug, Clone)]
pub struct Worker {
    pub id: Uuid,
    pub username: Option<String>,
    pub reputation_score: f64,
    pub total_batches: i64,
}

fn bearer(parts: &Parts) -> Option<&str> {
    parts
        .headers
        .get(AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

/// Checks the key length and alphabet: printable ASCII without spaces.
fn check_key(key: &str) -> ApiResult<()> {
    let chars = key.chars().count();
    if !(MIN_KEY_CHARS..=MAX_KEY_CHARS).contains(&chars)
        || !key.chars().all(|c| c.is_ascii_graphic())
    {
        return Err(ApiError::invalid(
            "invalid_api_key_format",
            format!(
                "api_key must be {MIN_KEY_CHARS} to {MAX_KEY_CHARS} printable ASCII characters without spaces"
            ),
        ));
    }
    Ok(())
}

pub async fn register(hub: &Hub, request: RegisterRequest) -> ApiResult<RegisterResponse> {
    check_key(&request.api_key)?;
    if let Some(name) = &request.username {
        let ok = !name.trim().is_empty()
            && name.chars().count() <= MAX_USERNAME_CHARS
            && !name.chars().any(char::is_control);
        if !ok {
            return Err(ApiError::invalid(
                "invalid_username",
                format!(
                    "username must be 1 to {MAX_USERNAME_CHARS} characters without control characters"
                ),
            ));
        }
    }
    let hardware = request
        .hardware_info
        .unwrap_or_else(|| serde_json::json!({}));
    if !hardware.is_object() || hardware.to_string().len() > 4096 {
        return Err(ApiError::invalid(
            "invalid_hardware_info",
            "hardware_info must be a JSON object of at most 4096 bytes",
        ));
    }
    let id = Uuid::new_v4();
    let created = now_ms();
    let inserted = sqlx::query(
        "INSERT INTO workers (id, api_key_hash, username, hardware_info, created_at, last_seen) \
         VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
    )
    .bind(id.to_string())
    .bind(hex(&key_digest(&request.api_key)))
    .bind(request.username.clone())
    .bind(hardware.to_string())
    .bind(created)
    .bind(created)
    .execute(&hub.db.pool)
    .await?
    .rows_affected();
    if inserted == 0 {
        // Which unique column clashed decides the message; neither reveals another worker.
        let key_taken = sqlx::query("SELECT 1 FROM workers WHERE api_key_hash = $1")
            .bind(hex(&key_digest(&request.api_key)))
            .fetch_optional(&hub.db.pool)
            .await?
            .is_some();
        return Err(if key_taken {
            ApiError::conflict(
                "already_registered",
                "this API key is already registered; log in with it",
            )
        } else {
            ApiError::conflict("username_taken", "this username is taken")
        });
    }
    Ok(RegisterResponse {
        worker_id: id,
        username: request.username,
        created_at: to_datetime(created),
    })
}

/// Looks the worker up by its key's digest; `None` for an unknown key.
pub async fn find_by_key(hub: &Hub, key: &str) -> ApiResult<Option<Worker>> {
    let digest = key_digest(key);
    let row = sqlx::query(
        "SELECT id, api_key_hash, username, reputation_score, total_batches, last_seen \
         FROM workers WHERE api_key_hash = $1",
    )
    .bind(hex(&digest))
    .fetch_optional(&hub.db.pool)
    .await?;
    let Some(row) = row else { return Ok(None) };
    let stored: String = row.try_get("api_key_hash")?;
    // The lookup already matched; the constant-time comparison keeps it so if the query
    // ever changes to a prefix or case-insensitive match.
    if !bool::from(stored.as_bytes().ct_eq(hex(&digest).as_bytes())) {
        return Ok(None);
    }
    let id: String = row.try_get("id")?;
    let id = Uuid::parse_str(&id).map_err(|e| anyhow::anyhow!("corrupt worker id {id}: {e}"))?;
    let last_seen: Option<i64> = row.try_get("last_seen")?;
    let now = now_ms();
    if last_seen.is_none_or(|t| now - t > LAST_SEEN_RESOLUTION_MS) {
        sqlx::query("UPDATE workers SET last_seen = $1 WHERE id = $2")
            .bind(now)
            .bind(id.to_string())
            .execute(&hub.db.pool)
            .await?;
    }
    Ok(Some(Worker {
        id,
        username: row.try_get("username")?,
        reputation_score: row.try_get("reputation_score")?,
        total_batches: row.try_get("total_batches")?,
    }))
}

impl FromRequestParts<Arc<Hub>> for Worker {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, hub: &Arc<Hub>) -> ApiResult<Self> {
        let key = bearer(parts).ok_or_else(ApiError::unauthorized)?;
        let worker = find_by_key(hub, key)
            .await?
            .ok_or_else(ApiError::unauthorized)?;
        hub.limiter
            .check(worker.id)
            .map_err(ApiError::rate_limited)?;
        Ok(worker)
    }
}

impl Worker {
    /// Refuses workers whose reputation fell below the floor.
    pub fn require_trusted(&self, hub: &Hub) -> ApiResult<()> {
        if self.reputation_score < hub.policy.min_reputation {
            return Err(ApiError::forbidden(
                "low_reputation",
                format!(
                    "reputation {:.2} is below this hub's minimum of {:.2}",
                    self.reputation_score, hub.policy.min_reputation
                ),
            ));
        }
        Ok(())
    }

    /// The worker named in a request body must be the one whose key is used.
    pub fn require_id(&self, claimed: Uuid) -> ApiResult<()> {
        if claimed != self.id {
            return Err(ApiError::forbidden(
                "worker_mismatch",
                "worker_id does not belong to this API key",
            ));
        }
        Ok(())
    }
}

/// The operator's key (for `POST /api/v1/aggregate`), compared in constant time.
pub struct Admin;

impl FromRequestParts<Arc<Hub>> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, hub: &Arc<Hub>) -> ApiResult<Self> {
        let Some(expected) = hub.admin_key_hash else {
            return Err(ApiError::forbidden(
                "admin_disabled",
                "this hub has no admin key (HRM_HUB_ADMIN_KEY); aggregation runs on its schedule only",
            ));
        };
        let key = bearer(parts).ok_or_else(ApiError::unauthorized)?;
        if bool::from(key_digest(key).ct_eq(&expected)) {
            Ok(Admin)
        } else {
            Err(ApiError::unauthorized())
        }
    }
}

/// Adds `delta` to a worker's reputation, within [0, REPUTATION_MAX].
pub async fn adjust_reputation<'e, E>(executor: E, worker: &str, delta: f64) -> sqlx::Result<()>
where
    E: sqlx::Executor<'e, Database = sqlx::Any>,
{
    sqlx::query(
        "UPDATE workers SET reputation_score = \
         CASE WHEN reputation_score + $1 > $2 THEN $2 \
              WHEN reputation_score + $1 < 0 THEN 0 ELSE reputation_score + $1 END \
         WHERE id = $3",
    )
    .bind(delta)
    .bind(crate::trust::REPUTATION_MAX)
    .bind(worker)
    .execute(executor)
    .await?;
    Ok(())
}

pub async fn stats(hub: &Hub, worker: &Worker) -> ApiResult<WorkerStats> {
    let id = worker.id.to_string();
    let row = sqlx::query(
        "SELECT username, total_batches, validated_batches, total_tokens, reputation_score, created_at, last_seen, \
         (SELECT COUNT(*) FROM gradient_updates WHERE worker_id = $1 AND status = 'pending') AS pending, \
         (SELECT COUNT(*) FROM gradient_updates WHERE worker_id = $1 AND status = 'rejected') AS rejected \
         FROM workers WHERE id = $1",
    )
    .bind(&id)
    .fetch_one(&hub.db.pool)
    .await?;
    let validated: i64 = row.try_get("validated_batches")?;
    let rank: i64 =
        sqlx::query_scalar("SELECT COUNT(*) + 1 FROM workers WHERE validated_batches > $1")
            .bind(validated)
            .fetch_one(&hub.db.pool)
            .await?;
    Ok(WorkerStats {
        worker_id: worker.id,
        username: row.try_get("username")?,
        total_batches: row.try_get("total_batches")?,
        validated_batches: validated,
        total_tokens: row.try_get("total_tokens")?,
        reputation_score: row.try_get("reputation_score")?,
        updates_pending: row.try_get("pending")?,
        updates_rejected: row.try_get("rejected")?,
        badges: badges_for(validated),
        rank: (validated > 0).then_some(rank),
        created_at: to_datetime(row.try_get("created_at")?),
        last_seen: row.try_get::<Option<i64>, _>("last_seen")?.map(to_datetime),
    })
}

/// The top `limit` workers by validated batches (ties share a rank).
pub async fn leaderboard(hub: &Hub, limit: i64) -> ApiResult<Vec<LeaderboardEntry>> {
    let rows = sqlx::query(
        "SELECT id, username, validated_batches, total_tokens, reputation_score FROM workers \
         WHERE validated_batches > 0 ORDER BY validated_batches DESC, total_tokens DESC, created_at LIMIT $1",
    )
    .bind(limit)
    .fetch_all(&hub.db.pool)
    .await?;
    let mut entries: Vec<LeaderboardEntry> = Vec::with_capacity(rows.len());
    for (i, row) in rows.iter().enumerate() {
        let validated: i64 = row.try_get("validated_batches")?;
        let rank = match entries.last() {
            Some(prev) if prev.validated_batches == validated => prev.rank,
            _ => i as i64 + 1,
        };
        let id: String = row.try_get("id")?;
        entries.push(LeaderboardEntry {
            rank,
            worker_id: Uuid::parse_str(&id)
                .map_err(|e| anyhow::anyhow!("corrupt worker id {id}: {e}"))?,
            username: row.try_get("username")?,
            validated_batches: validated,
            total_tokens: row.try_get("total_tokens")?,
            reputation_score: row.try_get("reputation_score")?,
            badges: badges_for(validated),
        });
    }
    Ok(entries)
}
