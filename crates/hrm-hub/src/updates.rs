//! Accepting a worker's update: where to put the file (a presigned S3 PUT, or the hub's own
//! `PUT /api/v1/gradients/blob/{batch_id}` with the local store), then every check before the
//! update joins the queue: the lease, the batch's sample count, the staleness of the version it
//! was computed on, the size limit, and the file itself (safetensors, names, shapes, dtypes, no
//! NaN or Inf, the version marker, not empty). Uploads are idempotent: a batch counts once.
//!
//! Bytes from a worker are bounded before they are read: the hub's upload route checks the
//! lease and the declared size from the headers, then streams the body to storage with a cap;
//! a file in S3 is read with a ranged GET of at most the limit. The size and SHA-256 recorded
//! here are what the aggregator and re-verification check the file against later.

use crate::Hub;
use crate::blobs::{Bounded, Streamed};
use crate::db::{now_ms, to_datetime};
use crate::queue::UPDATES;
use crate::rules::l2_norm;
use crate::store;
use crate::trust::{REPUTATION_INVALID, verify_probability};
use crate::versions;
use crate::workers::Worker;
use axum::body::Body;
use hrm_http::{ApiError, ApiResult};
use hrm_wire::update::{decode_update, sha256_hex};
use hrm_wire::{GradientUpload, UploadReceipt, UploadTarget};
use rand::Rng;
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

async fn batch_row(hub: &Hub, batch: Uuid) -> ApiResult<store::batches::BatchRow> {
    store::batches::get(&hub.db.pool, &batch.to_string())
        .await?
        .ok_or_else(|| ApiError::not_found("unknown_batch", format!("no batch {batch}")))
}

/// The lease must still be this worker's (an expired lease counts until someone else takes
/// the batch).
fn require_holder(row: &store::batches::BatchRow, worker: &Worker) -> ApiResult<()> {
    let mine = row.assigned_to.as_deref() == Some(worker.id.to_string().as_str());
    if row.status != "assigned" || !mine {
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
    let row = batch_row(hub, batch).await?;
    require_holder(&row, worker)?;
    let max_bytes = size_limit(hub).await?;
    let key = update_key(batch, worker.id);
    let expires_in = Duration::from_millis((row.lease_expires_at - now_ms()).max(60_000) as u64);
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

/// The local store's upload route: the lease and the declared size are checked before a byte
/// of the body is read; the body is then streamed to storage and cut off at the limit.
pub async fn put_blob(
    hub: &Hub,
    worker: &Worker,
    batch: Uuid,
    declared_len: Option<u64>,
    body: Body,
) -> ApiResult<()> {
    let row = batch_row(hub, batch).await?;
    require_holder(&row, worker)?;
    let limit = size_limit(hub).await?;
    if declared_len.is_some_and(|len| len > limit) {
        return Err(ApiError::too_large(Some(limit)));
    }
    match hub
        .blobs
        .put_stream(
            &update_key(batch, worker.id),
            body.into_data_stream(),
            limit,
        )
        .await?
    {
        Streamed::Stored { .. } => Ok(()),
        Streamed::TooLarge => Err(ApiError::too_large(Some(limit))),
        Streamed::Broken(why) => Err(ApiError::invalid(
            "body_unreadable",
            format!("the upload could not be read to its end: {why}"),
        )),
    }
}

fn duplicate_receipt(worker: &Worker, existing: (String, String)) -> ApiResult<UploadReceipt> {
    let (update_id, owner) = existing;
    if owner != worker.id.to_string() {
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

/// Refuses an upload whose file fails a check: the file goes, and the worker loses reputation
/// (a file is the worker's own doing).
async fn refuse_file(
    hub: &Hub,
    worker: &Worker,
    key: &str,
    error: ApiError,
) -> ApiResult<UploadReceipt> {
    store::workers::adjust_reputation(&hub.db.pool, &worker.id.to_string(), REPUTATION_INVALID)
        .await?;
    hub.blobs.delete(key).await?;
    Err(error)
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
        )
        .with_param("loss"));
    }
    let batch_id = upload.batch_id.to_string();
    if let Some(existing) = store::updates::live_for_batch(&hub.db.pool, &batch_id).await? {
        return duplicate_receipt(worker, existing);
    }
    let row = batch_row(hub, upload.batch_id).await?;
    require_holder(&row, worker)?;
    if upload.num_samples != row.num_samples {
        return Err(ApiError::invalid(
            "invalid_num_samples",
            format!(
                "num_samples must be the batch's {} samples, not {}",
                row.num_samples, upload.num_samples
            ),
        )
        .with_param("num_samples"));
    }
    let expected_url = gradients_url(hub, upload.batch_id, worker.id);
    if upload.gradients_url != expected_url {
        return Err(ApiError::invalid(
            "invalid_gradients_url",
            format!("gradients_url must be {expected_url}, as returned by /gradients/upload-url"),
        )
        .with_param("gradients_url"));
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
        )
        .with_param("model_version"));
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
    let bytes = match hub.blobs.get_bounded(&key, limit).await? {
        None => {
            return Err(ApiError::invalid(
                "missing_upload",
                "no update file at gradients_url; PUT it to the upload URL first",
            ));
        }
        Some(Bounded::TooLarge(_)) => {
            hub.blobs.delete(&key).await?;
            return Err(ApiError::too_large(Some(limit)));
        }
        Some(Bounded::Fits(bytes)) => bytes,
    };
    let model = hub.model.get(hub, &head).await?;
    let values = match decode_update(&bytes, &model.schema, &upload.model_version) {
        Ok(values) => values,
        Err(e) => {
            return refuse_file(
                hub,
                worker,
                &key,
                ApiError::unprocessable("invalid_update", e.to_string()),
            )
            .await;
        }
    };
    let norm = l2_norm(&values);
    drop(values);
    if norm == 0.0 {
        // Nothing to aggregate, and no work shown: no credit, no penalty.
        hub.blobs.delete(&key).await?;
        return Err(ApiError::unprocessable(
            "empty_update",
            "the update changes nothing (no values, or all zero); it earns nothing",
        ));
    }
    let (norm_reference, _) = store::versions::norm_reference(&hub.db.pool).await?;
    let probation = worker.agreements < hub.policy.probation_agreements;
    let verify = rand::rng().random_bool(verify_probability(
        worker.agreements,
        hub.policy.probation_agreements,
        hub.policy.verify_fraction,
    ));
    // Before the hub has recomputed an update of its own, the norm screen has nothing to
    // judge by (and the aggregator waits): one recomputation gives the reference.
    let needs_reference = hub.policy.norm_bound.is_some()
        && norm_reference.is_none()
        && store::updates::queued_count(&hub.db.pool).await? == 0;
    let gated = verify && probation;
    let verify = verify || needs_reference;
    let update_id = Uuid::new_v4();
    let sha256 = sha256_hex(&bytes);
    let mut tx = hub.db.pool.begin().await.map_err(anyhow::Error::from)?;
    // The batch row first: it is the write that decides between racing uploads.
    if !store::batches::complete(&mut *tx, &batch_id, &worker.id.to_string(), &sha256).await? {
        tx.rollback().await.map_err(anyhow::Error::from)?;
        return match store::updates::live_for_batch(&hub.db.pool, &batch_id).await? {
            Some(existing) => duplicate_receipt(worker, existing),
            None => Err(ApiError::conflict(
                "lease_lost",
                "the lease on this batch ended during the upload",
            )),
        };
    }
    store::updates::insert(
        &mut *tx,
        store::updates::NewUpdate {
            update_id: &update_id.to_string(),
            worker_id: &worker.id.to_string(),
            batch_id: &batch_id,
            model_version: &upload.model_version,
            key: &key,
            loss: upload.loss,
            num_samples: upload.num_samples,
            num_tokens: row.num_tokens,
            size_bytes: bytes.len() as i64,
            sha256: &sha256,
            norm,
            verify,
            gated,
        },
    )
    .await?;
    store::workers::count_upload(&mut *tx, &worker.id.to_string(), row.num_tokens).await?;
    tx.commit().await.map_err(anyhow::Error::from)?;
    if let Err(e) = hub.queue.push(UPDATES, &[update_id.to_string()]).await {
        tracing::warn!(error = %e, "could not queue the update; the aggregator finds it in the database");
    }
    if verify {
        hub.verify_now.notify_one();
    }
    if !gated
        && store::updates::eligible_count(&hub.db.pool).await? >= hub.policy.min_gradients as i64
    {
        hub.aggregate_now.notify_one();
    }
    Ok(UploadReceipt {
        update_id,
        status: "accepted".into(),
        duplicate: false,
    })
}

/// The operator releases held updates: back to pending, for the next aggregation.
pub async fn release_held(hub: &Hub) -> anyhow::Result<u64> {
    let count = store::updates::release_held(&hub.db.pool).await?;
    hub.aggregate_now.notify_one();
    Ok(count)
}

/// The operator rejects held updates (no reputation is lost: nothing proved them wrong); their
/// batches are redone.
pub async fn reject_held(hub: &Hub) -> anyhow::Result<usize> {
    let mut tx = hub.db.pool.begin().await?;
    let batches = store::updates::reject_held(&mut *tx).await?;
    for batch in &batches {
        store::batches::redo(&mut *tx, batch, hub.policy.max_attempts).await?;
    }
    tx.commit().await?;
    Ok(batches.len())
}
