//! The hub's own model computations: the validation loss recorded with every new version, and
//! random re-verification, which recomputes a sample of accepted updates exactly as the worker
//! was told to (same version, batch, plan and seed) and compares them by cosine similarity
//! (for top-k uploads, on the values sent).
//! Agreement raises the worker's reputation; disagreement costs it and un-counts the batch.
//! The recomputation is the workers' own code (`hrm_model::train::update_on_cpu`), so an honest upload and
//! the hub's check of it cannot drift apart.

use crate::Hub;
use crate::batches::validation_windows;
use crate::rules::cosine_similarity;
use crate::trust::{REPUTATION_DISAGREED, REPUTATION_VERIFIED};
use crate::versions::{self, LoadedVersion};
use crate::workers::adjust_reputation;
use anyhow::{Context, Result, anyhow};
use candle_core::Device;
use hrm_model::train::{LocalTraining, to_tensors, update_on_cpu};
use hrm_model::train::{ModelSpec, build_with_weights, evaluate};
use hrm_wire::samples::decode_samples;
use hrm_wire::update::{decode_update, is_top_k, read_checkpoint};
use sqlx::Row;
use std::path::Path;

/// Rows per forward pass in the hub's computations.
const MICRO_BATCH: usize = 8;

fn spec_of(config: &serde_json::Value) -> Result<ModelSpec> {
    Ok(ModelSpec::from_config_json(
        &config.to_string(),
        Path::new("model_versions.config"),
    )?)
}

/// Mean cross-entropy of `model` on the first `--eval-windows` validation windows, or `None`
/// when there are none (no `--valid` at ingest, or evaluation turned off).
pub async fn validation_loss(hub: &Hub, model: &LoadedVersion) -> Result<Option<f64>> {
    if hub.policy.eval_windows == 0 {
        return Ok(None);
    }
    let Some(mut windows) = validation_windows(hub).await? else {
        return Ok(None);
    };
    windows.truncate(hub.policy.eval_windows);
    let spec = spec_of(&model.config)?;
    let weights = to_tensors(&model.schema, &model.params, &Device::Cpu)?;
    let loss = tokio::task::spawn_blocking(move || -> Result<f64> {
        let (_vars, lm) = build_with_weights(&spec, &weights, &Device::Cpu)?;
        Ok(evaluate(lm.as_ref(), &windows, MICRO_BATCH)?)
    })
    .await??;
    Ok(Some(loss))
}

/// Recomputes one queued update; returns its cosine similarity with the uploaded one, or
/// `None` when no update is queued for verification.
pub async fn verify_next(hub: &Hub) -> Result<Option<f64>> {
    let row = sqlx::query(
        "SELECT u.update_id, u.worker_id, u.batch_id, u.model_version, u.gradient_url, u.status, b.data_url \
         FROM gradient_updates u JOIN training_batches b ON b.batch_id = u.batch_id \
         WHERE u.verification = 'queued' ORDER BY u.uploaded_at LIMIT 1",
    )
    .fetch_optional(&hub.db.pool)
    .await?;
    let Some(row) = row else { return Ok(None) };
    let update_id: String = row.try_get("update_id")?;
    match recompute(hub, &row).await {
        Ok(cosine) => Ok(Some(cosine)),
        Err(e) => {
            // Parked, so that one unverifiable update cannot stall the others.
            sqlx::query("UPDATE gradient_updates SET verification = 'error' WHERE update_id = $1")
                .bind(&update_id)
                .execute(&hub.db.pool)
                .await?;
            Err(e.context(format!("re-verifying update {update_id}")))
        }
    }
}

/// The cosine similarity of a top-k upload with the recomputed update, on the values the worker
/// sent. A top-k file holds a tenth of the values, so against the whole update even an honest
/// one scores about the square root of its share; and what it sent includes its error-feedback
/// residual from earlier batches, which the hub cannot know, hence a threshold of its own.
fn cosine_on_sent_values(uploaded: &[f32], recomputed: &[f32]) -> f64 {
    let (sent, expected): (Vec<f32>, Vec<f32>) = uploaded
        .iter()
        .zip(recomputed)
        .filter(|(sent, _)| **sent != 0.0)
        .map(|(sent, expected)| (*sent, *expected))
        .unzip();
    cosine_similarity(&sent, &expected)
}

async fn recompute(hub: &Hub, row: &sqlx::any::AnyRow) -> Result<f64> {
    let update_id: String = row.try_get("update_id")?;
    let worker_id: String = row.try_get("worker_id")?;
    let batch_id: String = row.try_get("batch_id")?;
    let version: String = row.try_get("model_version")?;
    let key: String = row.try_get("gradient_url")?;
    let data_key: String = row.try_get("data_url")?;

    let version_row = versions::version_row(hub, &version)
        .await?
        .ok_or_else(|| anyhow!("no version {version}"))?;
    let checkpoint = hub.blobs.get(&version_row.checkpoint_key).await?;
    let (schema, params) =
        read_checkpoint(&checkpoint).map_err(|e| anyhow!("checkpoint {version}: {e}"))?;
    let file = hub.blobs.get(&key).await?;
    let sparse = is_top_k(&file).map_err(|e| anyhow!("update {update_id}: {e}"))?;
    let uploaded =
        decode_update(&file, &schema, &version).map_err(|e| anyhow!("update {update_id}: {e}"))?;
    let samples = decode_samples(&hub.blobs.get(&data_key).await?)?;
    let spec = spec_of(&version_row.config)?;
    let plan = LocalTraining::from_plan(&crate::batches::plan_for(hub, &batch_id), MICRO_BATCH);
    let recomputed = tokio::task::spawn_blocking(move || -> Result<Vec<f32>> {
        Ok(update_on_cpu(&spec, &schema, &params, &samples, &plan)?.flat)
    })
    .await?
    .context("recomputing an update")?;
    let (cosine, threshold) = if sparse {
        (
            cosine_on_sent_values(&uploaded, &recomputed),
            hub.policy.verify_min_cosine_sparse,
        )
    } else {
        (
            cosine_similarity(&uploaded, &recomputed),
            hub.policy.verify_min_cosine,
        )
    };
    let agreed = cosine >= threshold;
    let mut tx = hub.db.pool.begin().await?;
    let changed = sqlx::query(
        "UPDATE gradient_updates SET verification = $1, verification_cosine = $2 WHERE update_id = $3 AND verification = 'queued'",
    )
    .bind(if agreed { "agreed" } else { "disagreed" })
    .bind(cosine)
    .bind(&update_id)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if changed == 1 {
        adjust_reputation(
            &mut *tx,
            &worker_id,
            if agreed {
                REPUTATION_VERIFIED
            } else {
                REPUTATION_DISAGREED
            },
        )
        .await?;
        let status: String = row.try_get("status")?;
        if !agreed && status == "aggregated" {
            // The batch stops counting toward the worker's badges.
            sqlx::query("UPDATE workers SET validated_batches = validated_batches - 1 WHERE id = $1 AND validated_batches > 0")
                .bind(&worker_id)
                .execute(&mut *tx)
                .await?;
        }
    }
    tx.commit().await?;
    // The aggregator leaves the files of queued updates; once verified and no longer pending
    // (read now: the aggregator may have run meanwhile), the file goes.
    let status: String =
        sqlx::query_scalar("SELECT status FROM gradient_updates WHERE update_id = $1")
            .bind(&update_id)
            .fetch_one(&hub.db.pool)
            .await?;
    if status != "pending" {
        hub.blobs.delete(&key).await?;
    }
    tracing::info!(update = update_id, cosine, agreed, "re-verified an update");
    Ok(cosine)
}

/// Background loop: verifies queued updates one at a time.
pub async fn run_loop(hub: std::sync::Arc<Hub>) {
    loop {
        match verify_next(&hub).await {
            Ok(Some(_)) => continue,
            Ok(None) => {}
            Err(e) => tracing::warn!(
                error = format!("{e:#}"),
                "re-verification failed; it will be retried"
            ),
        }
        tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    }
}
