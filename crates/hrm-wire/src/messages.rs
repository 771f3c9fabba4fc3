//! Request and response bodies of the hub's `/api/v1` interface. Field names follow the
//! specification's resource tables; `docs/hub-api.md` shows every body with an example.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use uuid::Uuid;

/// `POST /api/v1/auth/register`. The key is made by the client (32 to 64 characters); the hub
/// keeps only its SHA-256.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RegisterRequest {
    pub api_key: String,
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub hardware_info: Option<serde_json::Value>,
    /// The proof of work for a challenge from `GET /api/v1/auth/challenge` (required unless the
    /// hub's difficulty is 0).
    #[serde(default)]
    pub proof: Option<crate::pow::Proof>,
}

/// `GET /api/v1/auth/challenge`: what registration must prove work on.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Challenge {
    pub challenge: String,
    /// Leading zero bits the proof's hash needs (0: no work needed).
    pub bits: u32,
    pub expires_at: DateTime<Utc>,
}

#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RegisterResponse {
    pub worker_id: Uuid,
    pub username: Option<String>,
    pub created_at: DateTime<Utc>,
}

/// `POST /api/v1/auth/login`: the key in the `Authorization: Bearer` header is the credential on
/// every call, so login returns no session token; it confirms the key and reports the state the
/// client needs to start.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoginResponse {
    pub worker_id: Uuid,
    pub username: Option<String>,
    pub reputation_score: f64,
    pub total_batches: i64,
    pub current_version: Option<String>,
    pub server_time: DateTime<Utc>,
}

/// `GET /api/v1/model/current` and one entry of `GET /api/v1/model/versions`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ModelVersionInfo {
    pub version: String,
    /// Relative to the hub's base URL unless the object store hands out absolute URLs.
    pub checkpoint_url: String,
    /// SHA-256 of the checkpoint file, hex; also its HTTP `ETag`.
    pub sha256: String,
    pub num_parameters: i64,
    pub parent: Option<String>,
    pub created_at: DateTime<Utc>,
    /// `valid_loss`, `valid_perplexity`, `num_updates`, `rule`, … as recorded at publication.
    pub metrics: serde_json::Value,
    /// The model's `config.json`.
    pub config: serde_json::Value,
}

/// What the worker reports about itself when it asks for work.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Hardware {
    #[serde(default)]
    pub gpu: Option<String>,
    #[serde(default)]
    pub vram_gb: Option<f64>,
    #[serde(default)]
    pub batch_size: Option<u32>,
}

/// `POST /api/v1/batch/request`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchRequest {
    pub worker_id: Uuid,
    #[serde(default)]
    pub hardware: Hardware,
}

/// How a worker trains on a batch, fixed by the hub so that any two computations of the same
/// batch on the same version agree (the hub recomputes a sample of them to check).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainingPlan {
    /// Inner AdamW steps over the batch; each takes `num_samples / inner_steps` samples.
    pub inner_steps: u32,
    pub learning_rate: f64,
    /// Inner steps over which the learning rate ramps linearly up to `learning_rate`. A fresh
    /// AdamW's first steps are sign steps of full size on every parameter; the ramp damps them.
    /// Absent from older hubs' plans, which meant no ramp.
    #[serde(default)]
    pub warmup_steps: u32,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub grad_clip: f64,
    /// Seeds the order of samples within the batch.
    pub seed: u64,
}

/// The answer to a batch request when a batch was leased (`200`). When none is available the hub
/// answers `204 No Content` with a `Retry-After` header.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchAssignment {
    pub batch_id: Uuid,
    pub model_version: String,
    pub data_url: String,
    pub num_samples: i64,
    pub seq_len: i64,
    pub lease_expires_at: DateTime<Utc>,
    pub plan: TrainingPlan,
}

/// One JSON line of a batch file: `seq_len + 1` token ids (inputs and shifted targets).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Sample {
    pub input_ids: Vec<u32>,
}

/// `POST /api/v1/gradients/upload-url`: where to PUT the update file of a leased batch.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UploadUrlRequest {
    pub worker_id: Uuid,
    pub batch_id: Uuid,
}

#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UploadTarget {
    pub method: String,
    /// Presigned S3 URL, or the hub's own `PUT /api/v1/gradients/blob/{batch_id}` route.
    pub url: String,
    /// Headers the PUT must carry (the hub route needs the bearer key, S3 none).
    pub headers: BTreeMap<String, String>,
    pub max_bytes: u64,
    pub expires_at: DateTime<Utc>,
    /// The value to send as `gradients_url` once the PUT has succeeded.
    pub gradients_url: String,
}

/// `POST /api/v1/gradients/upload`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GradientUpload {
    pub worker_id: Uuid,
    pub batch_id: Uuid,
    pub model_version: String,
    pub gradients_url: String,
    pub loss: f64,
    pub num_samples: i64,
}

#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct UploadReceipt {
    pub update_id: Uuid,
    /// `accepted`.
    pub status: String,
    /// True when this batch's update had already been accepted: it still counts once.
    pub duplicate: bool,
}

/// `POST /api/v1/aggregate` (and the `aggregation` status event).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum AggregateOutcome {
    Waiting {
        pending: i64,
    },
    Success {
        version: String,
        num_updates: i64,
        /// Updates refused by the screens.
        rejected: i64,
    },
    /// Publishing would have raised the validation loss beyond the tolerance although every
    /// update in the round was re-verified: nothing was published, the updates are held for the
    /// operator (`hrm hub held`).
    Held {
        held: i64,
        valid_loss: f64,
        parent_valid_loss: f64,
    },
}

#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct BatchCounts {
    pub pending: i64,
    pub assigned: i64,
    pub completed: i64,
    pub failed: i64,
}

/// `GET /api/v1/stats/global`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GlobalStats {
    pub current_version: Option<String>,
    pub num_versions: i64,
    pub workers_total: i64,
    /// Workers seen in the last five minutes.
    pub workers_active: i64,
    pub batches: BatchCounts,
    pub updates_pending: i64,
    pub updates_aggregated: i64,
    pub updates_rejected: i64,
    /// Updates waiting for their re-verification before they may be aggregated.
    #[serde(default)]
    pub updates_awaiting_verification: i64,
    /// Updates of a round held for the operator (`hrm hub held`).
    #[serde(default)]
    pub updates_held: i64,
    pub total_tokens: i64,
    pub last_aggregation_at: Option<DateTime<Utc>>,
}

/// `GET /api/v1/worker/stats`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WorkerStats {
    pub worker_id: Uuid,
    pub username: Option<String>,
    /// Batches whose update the hub accepted.
    pub total_batches: i64,
    /// Accepted batches that were aggregated or passed re-verification: these count for badges.
    pub validated_batches: i64,
    pub total_tokens: i64,
    pub reputation_score: f64,
    pub updates_pending: i64,
    pub updates_rejected: i64,
    pub badges: Vec<String>,
    pub rank: Option<i64>,
    pub created_at: DateTime<Utc>,
    pub last_seen: Option<DateTime<Utc>>,
}

/// One row of `GET /api/v1/leaderboard`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LeaderboardEntry {
    pub rank: i64,
    pub worker_id: Uuid,
    pub username: Option<String>,
    pub validated_batches: i64,
    pub total_tokens: i64,
    pub reputation_score: f64,
    pub badges: Vec<String>,
}

/// Badge thresholds in validated batches, from the specification.
pub const BADGES: [(i64, &str); 3] = [(1_000, "1K"), (10_000, "10K"), (100_000, "100K")];

/// The badges earned with `validated_batches`.
pub fn badges_for(validated_batches: i64) -> Vec<String> {
    BADGES
        .iter()
        .filter(|(threshold, _)| validated_batches >= *threshold)
        .map(|(_, name)| name.to_string())
        .collect()
}

/// Messages of the `/api/v1/ws/status` feed.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StatusEvent {
    /// First message on connect.
    Hello {
        current_version: Option<String>,
        heartbeat_seconds: u64,
    },
    /// A new current version: published by an aggregation or set by a rollback.
    Version {
        version: String,
        parent: Option<String>,
    },
    Aggregation(AggregateOutcome),
    Stats(GlobalStats),
    Heartbeat {
        server_time: DateTime<Utc>,
    },
}

/// The one error body of the hub: `{"error": {"message", "type", "param", "code"}}` (the
/// client's reading of what `hrm_http::ApiError` writes).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub param: Option<String>,
    pub code: String,
}
