//! The hub's own model computations: the validation loss recorded with every new version, and
//! re-verification, which recomputes an accepted update exactly as the worker was told to (same
//! version, batch, plan and seed) and compares them by cosine similarity (for top-k uploads, on
//! the values sent). Updates are queued for it at random (always for workers in probation,
//! then less often: see [`crate::trust`]), and when a screen flags them.
//! Agreement raises the worker's reputation and its run of agreements; disagreement costs
//! reputation, ends the run, rejects a pending update and un-counts an aggregated one. Every
//! recomputation also feeds the norm reference: the size of an honest update, which no upload
//! can move.
//! The recomputation is the workers' own code (`hrm_model::train::update_on_cpu`), so an honest upload and
//! the hub's check of it cannot drift apart.

use crate::Hub;
use crate::batches::validation_windows;
use crate::blobs::Bounded;
use crate::rules::{cosine_similarity, l2_norm};
use crate::store::{self, updates::QueuedVerification};
use crate::trust::{REPUTATION_DISAGREED, REPUTATION_VERIFIED, next_norm_reference};
use crate::updates::max_update_bytes;
use crate::versions::{self, LoadedVersion};
use anyhow::{Context, Result, anyhow, bail};
use candle_core::Device;
use hrm_model::ModelSpec;
use hrm_model::train::{LocalTraining, to_tensors, update_on_cpu};
use hrm_model::train::{build_with_weights, evaluate};
use hrm_wire::samples::decode_samples;
use hrm_wire::update::sha256_hex;
use hrm_wire::update::{decode_update, is_top_k, read_checkpoint};
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

/// What a re-verification found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    Agreed {
        cosine: f64,
    },
    Disagreed {
        cosine: f64,
    },
    /// The file is not what was accepted (written again through its upload URL).
    Changed,
}

impl Verdict {
    pub fn agreed(&self) -> bool {
        matches!(self, Verdict::Agreed { .. })
    }

    pub fn cosine(&self) -> Option<f64> {
        match self {
            Verdict::Agreed { cosine } | Verdict::Disagreed { cosine } => Some(*cosine),
            Verdict::Changed => None,
        }
    }
}

/// Re-verifies the next queued update (gated ones first); `None` when none is queued.
pub async fn verify_next(hub: &Hub) -> Result<Option<Verdict>> {
    let Some(queued) = store::updates::next_queued(&hub.db.pool).await? else {
        return Ok(None);
    };
    match recompute(hub, &queued).await {
        Ok((verdict, recomputed_norm)) => {
            record(hub, &queued, verdict).await?;
            add_norm_sample(hub, recomputed_norm).await?;
            Ok(Some(verdict))
        }
        Err(e) => {
            let e = e.context(format!("re-verifying update {}", queued.update_id));
            // Parked, so that one unverifiable update cannot stall the others; one that waits
            // for its verification goes back to be redone (the fault is not the worker's).
            let mut tx = hub.db.pool.begin().await?;
            store::updates::record_verification(&mut *tx, &queued.update_id, "error", None).await?;
            if queued.gated
                && store::updates::set_verdict(
                    &mut *tx,
                    &queued.update_id,
                    "rejected",
                    None,
                    Some(&format!("could not be re-verified: {e:#}")),
                )
                .await?
            {
                store::batches::redo(&mut *tx, &queued.batch_id, hub.policy.max_attempts).await?;
            }
            tx.commit().await?;
            Err(e)
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

/// Recomputes the update; gives the verdict and the recomputed update's norm.
async fn recompute(hub: &Hub, queued: &QueuedVerification) -> Result<(Verdict, f64)> {
    let version = &queued.model_version;
    let version_row = versions::version_row(hub, version)
        .await?
        .ok_or_else(|| anyhow!("no version {version}"))?;
    let checkpoint = hub.blobs.get(&version_row.checkpoint_key).await?;
    let (schema, params) =
        read_checkpoint(&checkpoint).map_err(|e| anyhow!("checkpoint {version}: {e}"))?;
    let limit = max_update_bytes(schema.num_parameters());
    let file = match hub.blobs.get_bounded(&queued.key, limit).await? {
        Some(Bounded::Fits(file)) => file,
        Some(Bounded::TooLarge(_)) => return Ok((Verdict::Changed, f64::NAN)),
        None => bail!("the update file is missing"),
    };
    if queued
        .sha256
        .as_ref()
        .is_some_and(|accepted| *accepted != sha256_hex(&file))
    {
        return Ok((Verdict::Changed, f64::NAN));
    }
    let update_id = &queued.update_id;
    let sparse = is_top_k(&file).map_err(|e| anyhow!("update {update_id}: {e}"))?;
    let uploaded =
        decode_update(&file, &schema, version).map_err(|e| anyhow!("update {update_id}: {e}"))?;
    let samples = decode_samples(&hub.blobs.get(&queued.data_key).await?)?;
    let spec = spec_of(&version_row.config)?;
    let plan = LocalTraining::from_plan(
        &crate::batches::plan_for(hub, &queued.batch_id),
        MICRO_BATCH,
    );
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
    let verdict = if cosine >= threshold {
        Verdict::Agreed { cosine }
    } else {
        Verdict::Disagreed { cosine }
    };
    tracing::info!(update = %update_id, cosine, agreed = verdict.agreed(), "re-verified an update");
    Ok((verdict, l2_norm(&recomputed)))
}

/// Records a verdict: the worker's reputation and agreement run, and for a disagreement the
/// update itself (a pending one is rejected and its batch redone; an aggregated one stops
/// counting toward the worker's badges).
async fn record(hub: &Hub, queued: &QueuedVerification, verdict: Verdict) -> Result<()> {
    let agreed = verdict.agreed();
    let mut tx = hub.db.pool.begin().await?;
    let label = if agreed { "agreed" } else { "disagreed" };
    if store::updates::record_verification(&mut *tx, &queued.update_id, label, verdict.cosine())
        .await?
    {
        let worker = &queued.worker_id;
        store::workers::record_agreement(&mut *tx, worker, agreed).await?;
        store::workers::adjust_reputation(
            &mut *tx,
            worker,
            if agreed {
                REPUTATION_VERIFIED
            } else {
                REPUTATION_DISAGREED
            },
        )
        .await?;
        if !agreed {
            let reason = match verdict {
                Verdict::Changed => "the update file changed after it was accepted".to_string(),
                _ => format!(
                    "re-verification disagreed (cosine {:.3})",
                    verdict.cosine().unwrap_or(f64::NAN)
                ),
            };
            let status = store::updates::status_of(&mut *tx, &queued.update_id).await?;
            if status == "aggregated" {
                store::workers::add_validated(&mut *tx, worker, -1).await?;
            } else if store::updates::set_verdict(
                &mut *tx,
                &queued.update_id,
                "rejected",
                None,
                Some(&reason),
            )
            .await?
            {
                store::batches::redo(&mut *tx, &queued.batch_id, hub.policy.max_attempts).await?;
            }
        }
    }
    tx.commit().await?;
    // The aggregator leaves the files of queued updates; once verified and no longer pending
    // (read now: the aggregator may have run meanwhile), the file goes.
    let status = store::updates::status_of(&hub.db.pool, &queued.update_id).await?;
    if status != "pending" && status != "held" {
        hub.blobs.delete(&queued.key).await?;
    }
    if agreed && queued.gated && status == "pending" {
        hub.aggregate_now.notify_one();
    }
    Ok(())
}

/// Folds a recomputed norm into the norm reference.
async fn add_norm_sample(hub: &Hub, norm: f64) -> Result<()> {
    let (reference, samples) = store::versions::norm_reference(&hub.db.pool).await?;
    if let Some(next) = next_norm_reference(reference, samples, norm) {
        store::versions::set_norm_reference(&hub.db.pool, next, samples).await?;
    }
    Ok(())
}

/// Background loop: verifies queued updates one at a time, woken by new gated uploads and
/// every few seconds.
pub async fn run_loop(hub: std::sync::Arc<Hub>) {
    loop {
        match verify_next(&hub).await {
            Ok(Some(_)) => continue,
            Ok(None) => {}
            Err(e) => tracing::warn!(
                error = format!("{e:#}"),
                "re-verification failed; the update is parked"
            ),
        }
        tokio::select! {
            _ = hub.verify_now.notified() => {}
            _ = tokio::time::sleep(std::time::Duration::from_secs(5)) => {}
        }
    }
}
