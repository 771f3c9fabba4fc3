//! The hub's own model computations: the validation loss recorded with every new version, and
//! random re-verification, which recomputes a sample of accepted updates exactly as the worker
//! was told to (same version, batch, plan and seed) and compares them by cosine similarity.
//! Agreement raises the worker's reputation; disagreement costs it and un-counts the batch.

use crate::Hub;
use crate::batches::{decode_samples, validation_windows};
use crate::rules::cosine_similarity;
use crate::trust::{REPUTATION_DISAGREED, REPUTATION_VERIFIED};
use crate::versions::{self, LoadedVersion};
use crate::workers::adjust_reputation;
use anyhow::{Context, Result, anyhow};
use candle_core::{Device, Tensor};
use hrm_model::train::{LocalTraining, ModelSpec, build_with_weights, evaluate, local_update};
use hrm_wire::TrainingPlan;
use hrm_wire::update::{Schema, decode_update, read_checkpoint};
use sqlx::Row;
use std::collections::HashMap;
use std::path::Path;

/// Rows per forward pass in the hub's computations.
const MICRO_BATCH: usize = 8;

/// The flat parameters as named tensors.
pub fn to_tensors(schema: &Schema, flat: &[f32]) -> Result<HashMap<String, Tensor>> {
    let mut tensors = HashMap::new();
    let mut offset = 0;
    for spec in &schema.params {
        let part = &flat[offset..offset + spec.numel()];
        offset += spec.numel();
        tensors.insert(
            spec.name.clone(),
            Tensor::from_slice(part, spec.shape.as_slice(), &Device::Cpu)?,
        );
    }
    Ok(tensors)
}

/// Tensors back to one flat vector in schema order.
pub fn to_flat(schema: &Schema, tensors: &HashMap<String, Tensor>) -> Result<Vec<f32>> {
    let mut flat = Vec::with_capacity(schema.num_parameters());
    for spec in &schema.params {
        let t = tensors
            .get(&spec.name)
            .ok_or_else(|| anyhow!("no tensor {}", spec.name))?;
        flat.extend(
            t.flatten_all()?
                .to_dtype(candle_core::DType::F32)?
                .to_vec1::<f32>()?,
        );
    }
    Ok(flat)
}

fn spec_of(config: &serde_json::Value) -> Result<ModelSpec> {
    Ok(ModelSpec::from_config_json(
        &config.to_string(),
        Path::new("model_versions.config"),
    )?)
}

/// The plan a worker receives, as the model crate's training takes it.
pub fn local_training(plan: &TrainingPlan, micro_batch: usize) -> LocalTraining {
    LocalTraining {
        inner_steps: plan.inner_steps as usize,
        learning_rate: plan.learning_rate,
        weight_decay: plan.weight_decay,
        beta1: plan.beta1,
        beta2: plan.beta2,
        grad_clip: plan.grad_clip,
        seed: plan.seed,
        micro_batch,
    }
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
    let weights = to_tensors(&model.schema, &model.params)?;
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
    let uploaded = decode_update(&hub.blobs.get(&key).await?, &schema, &version)
        .map_err(|e| anyhow!("update {update_id}: {e}"))?;
    let samples = decode_samples(&hub.blobs.get(&data_key).await?)?;
    let spec = spec_of(&version_row.config)?;
    let plan = local_training(&crate::batches::plan_for(hub, &batch_id), MICRO_BATCH);
    let recomputed = tokio::task::spawn_blocking(move || -> Result<Vec<f32>> {
        let weights = to_tensors(&schema, &params)?;
        let update = local_update(&spec, &weights, &samples, &plan, &Device::Cpu, |_, _| {})?;
        to_flat(&schema, &update.delta)
    })
    .await?
    .context("recomputing an update")?;
    let cosine = cosine_similarity(&uploaded, &recomputed);
    let agreed = cosine >= hub.policy.verify_min_cosine;
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
