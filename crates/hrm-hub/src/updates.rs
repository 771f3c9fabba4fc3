//! Accepting a worker's update: where to put the file (a presigned S3 PUT, or the hub's own
//! `PUT /api/v1/gradients/blob/{batch_id}` with the local store), then every check before the
//! update joins the queue: the lease, the batch's sample count, the staleness of the version it
//! was computed on, the size limit, and the file itself (safetensors, names, shapes, dtypes, no
//! NaN or Inf, the version marker). Uploads are idempotent: a batch counts once.

use crate::Hub;
use crate::db::{now_ms, to_datetime};
use crate::error::{ApiError, ApiResult};
use crate::queue::UPDATES;
use crate::trust::REPUTATION_INVALID;
use crate::versions::{self, sha256_hex};
use crate::workers::{Worker, adjust_reputation};
use bytes::Bytes;
use hrm_wire::update::decode_update;
use hrm_wire::{GradientUpload, UploadReceipt, UploadTarget};
use rand::Rng;
use sqlx::Row;
use std::collections::BTreeMap;
use std::time::Duration;
use uuid::Uuid;

/// The object key of `worker`'s update for `batch`.
pub fn update_key(batch: Uuid, worker: Uuid) -> String {
    format!("updates/{batch}/{worker}.safetensors")
}

/// The `gradients_url` of an update: its object key behind a scheme naming the store.
pub fn gradients_url(hub: &Hub, batch: Uuid, worker: Uuid) -> String {
    let scheme = if hub.blobs.is_s3() { "s3" } else { "local" };
    format!("{scheme}:{}", update_key(batch, worker))
}

/// The size limit of an update file: the model in f32, plus room for the header and for
/// sparse files' indices.
pub fn max_update_bytes(num_parameters: usize) -> u64 {
    num_parameters as u64 * 8 + (1 << 20)
}

struct Lease {
    status: String,
    assigned_to: Option<String>,
    num_samples: i64,
    num_tokens: i64,
    lease_expires_at: i64,
}

async fn batch_lease(hub: &Hub, batch: Uuid) -> ApiResult<Lease> {
    let row = sqlx::query(
        "SELECT status, assigned_to, num_samples, num_tokens, lease_expires_at FROM training_batches WHERE batch_id = $1",
    )
    .bind(batch.to_string())
    .fetch_optional(&hub.db.pool)
    .await?
    .ok_or_else(|| ApiError::not_found("unknown_batch", format!("no batch {batch}")))?;
    Ok(Lease {
        status: row.try_get("status")?,
        assigned_to: row.try_get("assigned_to")?,
        num_samples: row.try_get("num_samples")?,
        num_tokens: row.try_get("num_tokens")?,
        lease_expires_at: row
            .try_get::<Option<i64>, _>("lease_expires_at")?
            .unwrap_or(0),
    })
}

/// The lease must still be this worker's (an expired lease counts until someone else takes
/// the batch).
fn require_holder(lease: &Lease, worker: &Worker) -> ApiResult<()> {
    let mine = lease.assigned_to.as_deref() == Some(worker.id.to_string().as_str());
    if lease.status != "assigned" || !mine {
        return Err(ApiError::conflict(
            "lease_lost",
            "this worker does not hold that batch (its lease expired and it went back to the queue); request a new batch",
        ));
    }
    Ok(())
}

async fn size_limit(hub: &Hub) -> ApiResult<u64> {
    let current = versions::current_row(hub)
        .await?
        .ok_or_else(|| ApiError::unavailable("no_model", "this hub has no model yet"))?;
    Ok(max_update_bytes(current.num_parameters as usize))
}

pub async fn upload_target(hub: &Hub, worker: &Worker, batch: Uuid) -> ApiResult<UploadTarget> {
    let lease = batch_lease(hub, batch).await?;
    require_holder(&lease, worker)?;
    let max_bytes = size_limit(hub).await?;
    let key = update_key(batch, worker.id);
    let expires_in = Duration::from_millis((lease.lease_expires_at - now_ms()).max(60_000) as u64);
    let presigned = hub
        .blobs
        .presign(object_store::signer::Method::PUT, &key, expires_in)
        .await?;
    let url = presigned.unwrap_or_else(|| format!("/api/v1/gradients/blob/{batch}"));
    Ok(UploadTarget {
        method: "PUT".into(),
        url,
        headers: BTreeMap::new(),
        max_bytes,
        expires_at: to_datetime(now_ms() + expires_in.as_millis() as i64),
        gradients_url: gradients_url(hub, batch, worker.id),
    })
}

/// The local store's upload route: writes the body as the update file of a held batch.
pub async fn put_blob(hub: &Hub, worker: &Worker, batch: Uuid, body: Bytes) -> ApiResult<()> {
    let lease = batch_lease(hub, batch).await?;
    require_holder(&lease, worker)?;
    let limit = size_limit(hub).await?;
    if body.len() as u64 > limit {
        return Err(ApiError::too_large(limit));
    }
    hub.blobs.put(&update_key(batch, worker.id), body).await?;
    Ok(())
}

/// The live update of a batch, if any: `(update_id, worker_id)`.
async fn existing_update(hub: &Hub, batch: Uuid) -> ApiResult<Option<(String, String)>> {
    let row = sqlx::query(
        "SELECT update_id, worker_id FROM gradient_updates WHERE batch_id = $1 AND status <> 'rejected' AND status <> 'stale'",
    )
    .bind(batch.to_string())
    .fetch_optional(&hub.db.pool)
    .await?;
    Ok(match row {
        Some(row) => Some((row.try_get("update_id")?, row.try_get("worker_id")?)),
        None => None,
    })
}

fn duplicate_receipt(hub_worker: &Worker, existing: (String, String)) -> ApiResult<UploadReceipt> {
    let (update_id, owner) = existing;
    if owner != hub_worker.id.to_string() {
        return Err(ApiError::conflict(
            "batch_done",
            "another worker's update for this batch was already accepted",
        ));
    }
    Ok(UploadReceipt {
        update_id: Uuid::parse_str(&update_id)
            .map_err(|e| anyhow::anyhow!("corrupt update id: {e}"))?,
        status: "accepted".into(),
        duplicate: true,
    })
}

pub async fn accept(
    hub: &Hub,
    worker: &Worker,
    upload: GradientUpload,
) -> ApiResult<UploadReceipt> {
    worker.require_id(upload.worker_id)?;
    worker.require_trusted(hub)?;
    if !upload.loss.is_finite() || upload.loss < 0.0 {
        return Err(ApiError::invalid(
            "invalid_loss",
            "loss must be a finite, non-negative number",
        ));
    }
    if let Some(existing) = existing_update(hub, upload.batch_id).await? {
        return duplicate_receipt(worker, existing);
    }
    let lease = batch_lease(hub, upload.batch_id).await?;
    require_holder(&lease, worker)?;
    if upload.num_samples != lease.num_samples {
        return Err(ApiError::invalid(
            "invalid_num_samples",
            format!(
                "num_samples must be the batch's {} samples, not {}",
                lease.num_samples, upload.num_samples
            ),
        ));
    }
    let expected_url = gradients_url(hub, upload.batch_id, worker.id);
    if upload.gradients_url != expected_url {
        return Err(ApiError::invalid(
            "invalid_gradients_url",
            format!("gradients_url must be {expected_url}, as returned by /gradients/upload-url"),
        ));
    }
    let head = versions::current_version(hub)
        .await?
        .ok_or_else(|| ApiError::unavailable("no_model", "this hub has no model yet"))?;
    if versions::version_row(hub, &upload.model_version)
        .await?
        .is_none()
    {
        return Err(ApiError::invalid(
            "unknown_version",
            format!("no version {}", upload.model_version),
        ));
    }
    if versions::lag(hub, &head, &upload.model_version, hub.policy.max_staleness)
        .await?
        .is_none()
    {
        return Err(ApiError::conflict(
            "stale_update",
            format!(
                "the update was computed on {} but the current version is {head}, more than {} versions ahead on its line; download {head} and train again",
                upload.model_version, hub.policy.max_staleness
            ),
        ));
    }
    let key = update_key(upload.batch_id, worker.id);
    let limit = size_limit(hub).await?;
    match hub.blobs.size(&key).await? {
        None => {
            return Err(ApiError::invalid(
                "missing_upload",
                "no update file at gradients_url; PUT it to the upload URL first",
            ));
        }
        Some(size) if size > limit => {
            hub.blobs.delete(&key).await?;
            return Err(ApiError::too_large(limit));
        }
        Some(_) => {}
    }
    let bytes = hub.blobs.get(&key).await?;
    let model = hub.model.get(hub, &head).await?;
    if let Err(e) = decode_update(&bytes, &model.schema, &upload.model_version) {
        adjust_reputation(&hub.db.pool, &worker.id.to_string(), REPUTATION_INVALID).await?;
        hub.blobs.delete(&key).await?;
        return Err(ApiError::invalid_update(e.to_string()));
    }
    let update_id = Uuid::new_v4();
    let verify = rand::rng().random_bool(hub.policy.verify_fraction);
    let now = now_ms();
    let mut tx = hub.db.pool.begin().await?;
    // The batch row first: it is the write that decides between racing uploads.
    let completed = sqlx::query(
        "UPDATE training_batches SET status = 'completed', completed_at = $1, result_hash = $2 \
         WHERE batch_id = $3 AND status = 'assigned' AND assigned_to = $4",
    )
    .bind(now)
    .bind(sha256_hex(&bytes))
    .bind(upload.batch_id.to_string())
    .bind(worker.id.to_string())
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if completed != 1 {
        tx.rollback().await?;
        return match existing_update(hub, upload.batch_id).await? {
            Some(existing) => duplicate_receipt(worker, existing),
            None => Err(ApiError::conflict(
                "lease_lost",
                "the lease on this batch ended during the upload",
            )),
        };
    }
    sqlx::query(
        "INSERT INTO gradient_updates (update_id, worker_id, batch_id, model_version, gradient_url, loss, num_samples, num_tokens, uploaded_at, verification) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    )
    .bind(update_id.to_string())
    .bind(worker.id.to_string())
    .bind(upload.batch_id.to_string())
    .bind(&upload.model_version)
    .bind(&key)
    .bind(upload.loss)
    .bind(upload.num_samples)
    .bind(lease.num_tokens)
    .bind(now)
    .bind(verify.then_some("queued"))
    .execute(&mut *tx)
    .await?;
    sqlx::query("UPDATE workers SET total_batches = total_batches + 1, total_tokens = total_tokens + $1 WHERE id = $2")
        .bind(lease.num_tokens)
        .bind(worker.id.to_string())
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    if let Err(e) = hub.queue.push(UPDATES, &[update_id.to_string()]).await {
        tracing::warn!(error = %e, "could not queue the update; the aggregator finds it in the database");
    }
    let pending = pending_count(hub).await?;
    if pending >= hub.policy.min_gradients as i64 {
        hub.aggregate_now.notify_one();
    }
    Ok(UploadReceipt {
        update_id,
        status: "accepted".into(),
        duplicate: false,
    })
}

pub async fn pending_count(hub: &Hub) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT COUNT(*) FROM gradient_updates WHERE status = 'pending'")
            .fetch_one(&hub.db.pool)
            .await?,
    )
}
