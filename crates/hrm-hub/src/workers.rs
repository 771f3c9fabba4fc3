//! Worker identity: registration with a client-generated key (only its SHA-256 is stored) paid
//! for with a proof of work, the bearer-key extractor every authenticated route uses (with the
//! per-worker rate limit), and the worker's stats and the leaderboard.

use crate::Hub;
use crate::challenge::Refusal;
use crate::db::{now_ms, to_datetime};
use crate::store;
use axum::extract::FromRequestParts;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use hrm_http::{ApiError, ApiResult};
use hrm_wire::{LeaderboardEntry, RegisterRequest, RegisterResponse, WorkerStats, badges_for};
use sha2::{Digest, Sha256};
use std::sync::Arc;
use subtle::ConstantTimeEq;
use uuid::Uuid;

pub const MIN_KEY_CHARS: usize = 32;
pub const MAX_KEY_CHARS: usize = 64;
pub const MAX_USERNAME_CHARS: usize = 64;
const MAX_HARDWARE_BYTES: usize = 4096;

/// `last_seen` is written at most this often per worker, to keep reads from becoming writes.
const LAST_SEEN_RESOLUTION_MS: i64 = 30_000;

pub fn key_digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// An authenticated worker, as the extractor found it.
#[derive(Debug, Clone)]
pub struct Worker {
    pub id: Uuid,
    pub username: Option<String>,
    pub reputation_score: f64,
    pub total_batches: i64,
    /// Agreeing re-verifications in a row (probation while below `--probation-agreements`).
    pub agreements: i64,
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

fn unauthorized() -> ApiError {
    ApiError::unauthorized("missing or unknown API key in the `Authorization: Bearer` header")
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
        )
        .with_param("api_key"));
    }
    Ok(())
}

/// Registers a worker. The caller has already charged the registration to its IP address.
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
            )
            .with_param("username"));
        }
    }
    let hardware = request
        .hardware_info
        .unwrap_or_else(|| serde_json::json!({}));
    if !hardware.is_object() || hardware.to_string().len() > MAX_HARDWARE_BYTES {
        return Err(ApiError::invalid(
            "invalid_hardware_info",
            format!("hardware_info must be a JSON object of at most {MAX_HARDWARE_BYTES} bytes"),
        )
        .with_param("hardware_info"));
    }
    let challenges = hub.challenges().await?;
    challenges
        .check(request.proof.as_ref(), &request.api_key)
        .map_err(|refusal| {
            let code = if refusal == Refusal::Missing {
                "proof_required"
            } else {
                "invalid_proof"
            };
            ApiError::invalid(code, refusal.message(challenges.bits)).with_param("proof")
        })?;
    let id = Uuid::new_v4();
    let created = now_ms();
    let key_hash = hex::encode(key_digest(&request.api_key));
    let inserted = store::workers::insert(
        &hub.db.pool,
        &id.to_string(),
        &key_hash,
        request.username.as_deref(),
        &hardware.to_string(),
        created,
    )
    .await?;
    if !inserted {
        // Which unique column clashed decides the message; neither reveals another worker.
        let key_taken = store::workers::by_key_hash(&hub.db.pool, &key_hash)
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
    let digest = hex::encode(key_digest(key));
    let Some(row) = store::workers::by_key_hash(&hub.db.pool, &digest).await? else {
        return Ok(None);
    };
    // The lookup already matched; the constant-time comparison keeps it so if the query
    // ever changes to a prefix or case-insensitive match.
    if !bool::from(row.api_key_hash.as_bytes().ct_eq(digest.as_bytes())) {
        return Ok(None);
    }
    let id = Uuid::parse_str(&row.id)
        .map_err(|e| anyhow::anyhow!("corrupt worker id {}: {e}", row.id))?;
    if row
        .last_seen
        .is_none_or(|t| now_ms() - t > LAST_SEEN_RESOLUTION_MS)
    {
        store::workers::touch(&hub.db.pool, &row.id).await?;
    }
    Ok(Some(Worker {
        id,
        username: row.username,
        reputation_score: row.reputation_score,
        total_batches: row.total_batches,
        agreements: row.agreements,
    }))
}

impl FromRequestParts<Arc<Hub>> for Worker {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, hub: &Arc<Hub>) -> ApiResult<Self> {
        let key = bearer(parts).ok_or_else(unauthorized)?;
        let worker = find_by_key(hub, key).await?.ok_or_else(unauthorized)?;
        hub.worker_limit.check(&worker.id).map_err(|seconds| {
            ApiError::too_many(
                "rate_limited",
                "too many requests from this worker; retry later",
                seconds,
            )
        })?;
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
            )
            .with_param("worker_id"));
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
        let key = bearer(parts).ok_or_else(unauthorized)?;
        if bool::from(key_digest(key).ct_eq(&expected)) {
            Ok(Admin)
        } else {
            Err(unauthorized())
        }
    }
}

pub async fn stats(hub: &Hub, worker: &Worker) -> ApiResult<WorkerStats> {
    let id = worker.id.to_string();
    let row = store::workers::by_id(&hub.db.pool, &id)
        .await?
        .ok_or_else(unauthorized)?;
    let (pending, rejected) = store::updates::counts_for_worker(&hub.db.pool, &id).await?;
    let rank = store::workers::count_ahead(&hub.db.pool, row.validated_batches).await? + 1;
    Ok(WorkerStats {
        worker_id: worker.id,
        username: row.username,
        total_batches: row.total_batches,
        validated_batches: row.validated_batches,
        total_tokens: row.total_tokens,
        reputation_score: row.reputation_score,
        updates_pending: pending,
        updates_rejected: rejected,
        badges: badges_for(row.validated_batches),
        rank: (row.validated_batches > 0).then_some(rank),
        created_at: to_datetime(row.created_at),
        last_seen: row.last_seen.map(to_datetime),
    })
}

/// The top `limit` workers by validated batches (ties share a rank).
pub async fn leaderboard(hub: &Hub, limit: i64) -> ApiResult<Vec<LeaderboardEntry>> {
    let rows = store::workers::top(&hub.db.pool, limit).await?;
    let mut entries: Vec<LeaderboardEntry> = Vec::with_capacity(rows.len());
    for (i, row) in rows.into_iter().enumerate() {
        let rank = match entries.last() {
            Some(prev) if prev.validated_batches == row.validated_batches => prev.rank,
            _ => i as i64 + 1,
        };
        entries.push(LeaderboardEntry {
            rank,
            worker_id: Uuid::parse_str(&row.id)
                .map_err(|e| anyhow::anyhow!("corrupt worker id {}: {e}", row.id))?,
            username: row.username,
            validated_batches: row.validated_batches,
            total_tokens: row.total_tokens,
            reputation_score: row.reputation_score,
            badges: badges_for(row.validated_batches),
        });
    }
    Ok(entries)
}
