//! Aggregation: reads up to `--max-updates` pending updates, screens outliers, combines the
//! rest with the configured rule, applies the result with the outer optimiser, writes the new
//! checkpoint, and only then publishes the version and marks its updates in one transaction.
//!
//! Exactly one aggregator runs at a time across replicas (the database lock in [`crate::db`]).
//! A crash before the publishing transaction leaves every update pending and at most an
//! unreferenced checkpoint file; a crash after it leaves only queue entries that the next run
//! discards. Nothing is lost and nothing counts twice: the crash tests abort at every [`Step`].

use crate::Hub;
use crate::db::now_ms;
use crate::queue::UPDATES;
use crate::rules::{self, OuterSchedule, OuterState, RuleError, Update};
use crate::trust::{REPUTATION_AGGREGATED, REPUTATION_OUTLIER};
use crate::versions::{self, LoadedVersion, VersionRow, checkpoint_key, optimizer_key, sha256_hex};
use crate::workers::adjust_reputation;
use anyhow::{Result, anyhow, bail};
use bytes::Bytes;
use hrm_wire::update::{
    ParamSpec, Schema, decode_update, read_checkpoint, read_metadata, write_checkpoint,
};
use hrm_wire::{AggregateOutcome, StatusEvent};
use sqlx::{AssertSqlSafe, Row};
use std::collections::HashMap;
use std::sync::Arc;

/// The points an aggregation passes; the fault hook fails it at one of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The lock is held; nothing read yet.
    Locked,
    /// The updates are read and combined; nothing written.
    Combined,
    /// The new checkpoint and optimiser state are in the object store; not yet published.
    CheckpointWritten,
    /// The version is published and the updates marked; the queue is not yet cleaned.
    Published,
}

pub const STEPS: [Step; 4] = [
    Step::Locked,
    Step::Combined,
    Step::CheckpointWritten,
    Step::Published,
];

fn checkpoint_fault(hub: &Hub, step: Step) -> Result<()> {
    if *hub.fault.lock().expect("fault lock") == Some(step) {
        bail!("injected fault at {step:?}");
    }
    Ok(())
}

/// Runs one aggregation if at least `min_pending` updates are pending. `Ok(None)` when another
/// aggregator holds the lock.
pub async fn aggregate(hub: &Hub, min_pending: usize) -> Result<Option<AggregateOutcome>> {
    let pending = crate::updates::pending_count(hub).await?;
    if pending < min_pending.max(1) as i64 {
        return Ok(Some(AggregateOutcome::Waiting { pending }));
    }
    let Some(lock) = hub.db.try_lock_aggregator().await? else {
        return Ok(None);
    };
    let result = run_locked(hub).await;
    lock.release().await?;
    let outcome = result?;
    hub.publish(StatusEvent::Aggregation(outcome.clone()));
    Ok(Some(outcome))
}

/// A pending `gradient_updates` row.
struct Pending {
    update_id: String,
    worker_id: String,
    batch_id: String,
    model_version: String,
    key: String,
    num_samples: i64,
}

/// What became of each pending update.
#[derive(Default)]
struct Verdicts {
    aggregated: Vec<usize>,
    /// Not chosen by Krum: consumed without penalty.
    discarded: Vec<usize>,
    /// Outliers and unreadable files, with the reason.
    rejected: Vec<(usize, String)>,
    /// Computed on a version too far behind (or on an abandoned line).
    stale: Vec<usize>,
}

const PENDING_COLUMNS: &str =
    "update_id, worker_id, batch_id, model_version, gradient_url, num_samples";

fn parse_pending(row: &sqlx::any::AnyRow) -> sqlx::Result<Pending> {
    Ok(Pending {
        update_id: row.try_get("update_id")?,
        worker_id: row.try_get("worker_id")?,
        batch_id: row.try_get("batch_id")?,
        model_version: row.try_get("model_version")?,
        key: row.try_get("gradient_url")?,
        num_samples: row.try_get("num_samples")?,
    })
}

/// The pending updates to aggregate, in upload order: those the queue names, topped up from
/// the database (and the queue rebuilt) when the queue has fallen behind it.
async fn pending_updates(hub: &Hub) -> Result<Vec<Pending>> {
    let max = hub.policy.max_updates;
    let queued = hub.queue.peek(UPDATES, max).await.unwrap_or_default();
    let mut rows = Vec::new();
    if !queued.is_empty() {
        let placeholders: Vec<String> = (1..=queued.len()).map(|i| format!("${i}")).collect();
        let sql = format!(
            "SELECT {PENDING_COLUMNS} FROM gradient_updates WHERE status = 'pending' AND update_id IN ({}) ORDER BY uploaded_at",
            placeholders.join(", ")
        );
        let mut query = sqlx::query(AssertSqlSafe(sql));
        for id in &queued {
            query = query.bind(id);
        }
        rows = query.fetch_all(&hub.db.pool).await?;
    }
    let pending = crate::updates::pending_count(hub).await?;
    if rows.len() < max && (rows.len() as i64) < pending {
        let all: Vec<String> = sqlx::query_scalar(
            "SELECT update_id FROM gradient_updates WHERE status = 'pending' ORDER BY uploaded_at",
        )
        .fetch_all(&hub.db.pool)
        .await?;
        if let Err(e) = hub.queue.replace(UPDATES, &all).await {
            tracing::warn!(error = %e, "could not rebuild the update queue");
        }
        rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT {PENDING_COLUMNS} FROM gradient_updates WHERE status = 'pending' ORDER BY uploaded_at LIMIT $1"
        )))
        .bind(max as i64)
        .fetch_all(&hub.db.pool)
        .await?;
    }
    rows.iter()
        .map(|r| parse_pending(r).map_err(Into::into))
        .collect()
}

async fn run_locked(hub: &Hub) -> Result<AggregateOutcome> {
    checkpoint_fault(hub, Step::Locked)?;
    let head = versions::current_row(hub)
        .await?
        .ok_or_else(|| anyhow!("the hub has no model yet"))?;
    let model = hub.model.get(hub, &head.version).await?;
    let pending = pending_updates(hub).await?;

    let mut verdicts = Verdicts::default();
    let mut candidates: Vec<(usize, Vec<f32>)> = Vec::new();
    for (i, update) in pending.iter().enumerate() {
        if versions::lag(
            hub,
            &head.version,
            &update.model_version,
            hub.policy.max_staleness,
        )
        .await?
        .is_none()
        {
            verdicts.stale.push(i);
            continue;
        }
        let bytes = hub.blobs.get(&update.key).await?;
        match decode_update(&bytes, &model.schema, &update.model_version) {
            Ok(values) => candidates.push((i, values)),
            Err(e) => verdicts
                .rejected
                .push((i, format!("unreadable at aggregation: {e}"))),
        }
    }
    let views: Vec<Update<'_>> = candidates
        .iter()
        .map(|(i, values)| Update {
            values,
            num_samples: pending[*i].num_samples.max(0) as u64,
        })
        .collect();
    let versions: Vec<&str> = candidates
        .iter()
        .map(|(i, _)| pending[*i].model_version.as_str())
        .collect();
    let outliers = rules::outliers_by_version(&views, &versions, hub.policy.outlier_sigmas);
    let kept: Vec<usize> = (0..views.len()).filter(|&j| !outliers[j]).collect();
    for j in (0..views.len()).filter(|&j| outliers[j]) {
        verdicts.rejected.push((
            candidates[j].0,
            format!("outlier beyond {} sigmas", hub.policy.outlier_sigmas),
        ));
    }
    let kept_views: Vec<Update<'_>> = kept
        .iter()
        .map(|&j| Update {
            values: views[j].values,
            num_samples: views[j].num_samples,
        })
        .collect();
    let combined = match rules::combine(hub.policy.rule, &kept_views) {
        Ok(combined) => Some(combined),
        Err(RuleError::NoUpdates | RuleError::TooFewForKrum { .. }) => None,
        Err(e) => return Err(anyhow!("combining updates: {e}")),
    };
    let Some(combined) = combined else {
        // Nothing to apply: record the verdicts reached so far; the rest stay pending.
        if !verdicts.rejected.is_empty() || !verdicts.stale.is_empty() {
            mark(hub, &pending, &verdicts, None).await?;
        }
        return Ok(AggregateOutcome::Waiting {
            pending: crate::updates::pending_count(hub).await?,
        });
    };
    for (position, &j) in kept.iter().enumerate() {
        if combined.selected.contains(&position) {
            verdicts.aggregated.push(candidates[j].0);
        } else {
            verdicts.discarded.push(candidates[j].0);
        }
    }
    checkpoint_fault(hub, Step::Combined)?;

    let mut params = model.params.clone();
    let mut state = load_outer_state(hub, &head).await?;
    let lr_factor = match hub.policy.outer_schedule {
        OuterSchedule::Constant => 1.0,
        schedule => schedule.factor(crate::batches::completed_fraction(hub).await?),
    };
    hub.policy
        .outer
        .scaled(lr_factor)
        .apply(&mut params, &combined.values, &mut state)
        .map_err(|e| anyhow!("outer optimiser: {e}"))?;
    let version = versions::next_name(hub).await?;
    let checkpoint = Bytes::from(write_checkpoint(
        &model.schema,
        &params,
        HashMap::from([
            ("version".to_string(), version.clone()),
            ("parent".to_string(), head.version.clone()),
        ]),
    ));
    let sha = sha256_hex(&checkpoint);
    hub.blobs.put(&checkpoint_key(&version), checkpoint).await?;
    let optimizer_url = if state == OuterState::default() {
        None
    } else {
        hub.blobs
            .put(
                &optimizer_key(&version),
                Bytes::from(encode_outer_state(&state, params.len())),
            )
            .await?;
        Some(optimizer_key(&version))
    };
    checkpoint_fault(hub, Step::CheckpointWritten)?;

    let loaded = Arc::new(LoadedVersion {
        version: version.clone(),
        schema: model.schema.clone(),
        params,
        config: model.config.clone(),
    });
    let mut metrics = serde_json::json!({
        "num_updates": verdicts.aggregated.len(),
        "rejected": verdicts.rejected.len(),
        "discarded": verdicts.discarded.len(),
        "stale": verdicts.stale.len(),
        "rule": format!("{:?}", hub.policy.rule),
        "outer": hub.policy.outer.name(),
        "outer_lr_factor": lr_factor,
        "train_loss": mean_loss(hub, &pending, &verdicts.aggregated).await?,
    });
    if let Some(valid_loss) = crate::verify::validation_loss(hub, &loaded).await? {
        metrics["valid_loss"] = valid_loss.into();
        metrics["valid_perplexity"] = valid_loss.exp().into();
    }
    let published = VersionRow {
        version: version.clone(),
        checkpoint_key: checkpoint_key(&version),
        sha256: sha,
        num_parameters: loaded.params.len() as i64,
        parent: Some(head.version.clone()),
        step: head.step + 1,
        optimizer_key: optimizer_url,
        config: loaded.config.clone(),
        metrics,
        created_at: now_ms(),
    };
    mark(hub, &pending, &verdicts, Some((&head.version, &published))).await?;
    hub.model.put(loaded);
    checkpoint_fault(hub, Step::Published)?;

    let consumed: Vec<String> = pending.iter().map(|p| p.update_id.clone()).collect();
    if let Err(e) = hub.queue.remove(UPDATES, &consumed).await {
        tracing::warn!(error = %e, "could not clean the update queue; the next aggregation skips the entries");
    }
    cleanup_files(hub, &pending, &verdicts).await;
    hub.announce_version(&version, Some(head.version.clone()));
    tracing::info!(%version, num_updates = verdicts.aggregated.len(), rejected = verdicts.rejected.len(), "published");
    Ok(AggregateOutcome::Success {
        version,
        num_updates: verdicts.aggregated.len() as i64,
        rejected: verdicts.rejected.len() as i64,
    })
}

async fn mean_loss(hub: &Hub, pending: &[Pending], aggregated: &[usize]) -> Result<Option<f64>> {
    let mut sum = 0.0;
    for &i in aggregated {
        let loss: f64 =
            sqlx::query_scalar("SELECT loss FROM gradient_updates WHERE update_id = $1")
                .bind(&pending[i].update_id)
                .fetch_one(&hub.db.pool)
                .await?;
        sum += loss;
    }
    Ok((!aggregated.is_empty()).then(|| sum / aggregated.len() as f64))
}

/// Records the verdicts, and publishes `version` when given, in one transaction. Publishing
/// is a compare-and-set on the current version, so a concurrent rollback or publication makes
/// the whole transaction fail instead of half-applying.
async fn mark(
    hub: &Hub,
    pending: &[Pending],
    verdicts: &Verdicts,
    publish: Option<(&str, &VersionRow)>,
) -> Result<()> {
    let now = now_ms();
    let mut tx = hub.db.pool.begin().await?;
    if let Some((base, row)) = publish {
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
        .execute(&mut *tx)
        .await?;
        let moved = sqlx::query(
            "UPDATE hub_state SET current_version = $1, patch = patch + 1, last_aggregation_at = $2 WHERE id = 1 AND current_version = $3",
        )
        .bind(&row.version)
        .bind(now)
        .bind(base)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if moved != 1 {
            bail!(
                "the current version changed during aggregation (a rollback?); nothing was published"
            );
        }
    }
    let version = publish.map(|(_, row)| row.version.as_str());
    let statuses = verdicts
        .aggregated
        .iter()
        .map(|&i| (i, "aggregated", None))
        .chain(
            verdicts
                .discarded
                .iter()
                .map(|&i| (i, "discarded", Some("not selected by Krum"))),
        )
        .chain(
            verdicts
                .rejected
                .iter()
                .map(|(i, reason)| (*i, "rejected", Some(reason.as_str()))),
        )
        .chain(verdicts.stale.iter().map(|&i| {
            (
                i,
                "stale",
                Some("computed on a version too far behind the current one"),
            )
        }));
    for (i, status, reason) in statuses {
        let changed = sqlx::query(
            "UPDATE gradient_updates SET status = $1, aggregated = $2, aggregated_into = $3, reason = $4 \
             WHERE update_id = $5 AND status = 'pending'",
        )
        .bind(status)
        .bind(matches!(status, "aggregated" | "discarded"))
        .bind(version)
        .bind(reason)
        .bind(&pending[i].update_id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if changed != 1 {
            bail!(
                "update {} was no longer pending; nothing was recorded",
                pending[i].update_id
            );
        }
    }
    for &i in &verdicts.aggregated {
        sqlx::query("UPDATE workers SET validated_batches = validated_batches + 1 WHERE id = $1")
            .bind(&pending[i].worker_id)
            .execute(&mut *tx)
            .await?;
        adjust_reputation(&mut *tx, &pending[i].worker_id, REPUTATION_AGGREGATED).await?;
    }
    for (i, _) in &verdicts.rejected {
        adjust_reputation(&mut *tx, &pending[*i].worker_id, REPUTATION_OUTLIER).await?;
    }
    // The batches of rejected and stale updates are redone by someone else.
    for i in verdicts
        .rejected
        .iter()
        .map(|(i, _)| *i)
        .chain(verdicts.stale.iter().copied())
    {
        sqlx::query(
            "UPDATE training_batches SET status = CASE WHEN attempts + 1 >= $1 THEN 'failed' ELSE 'pending' END, \
             attempts = attempts + 1, assigned_to = NULL, assigned_at = NULL, lease_expires_at = NULL, completed_at = NULL \
             WHERE batch_id = $2 AND status = 'completed'",
        )
        .bind(hub.policy.max_attempts)
        .bind(&pending[i].batch_id)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Update files are kept only while a re-verification may still read them.
async fn cleanup_files(hub: &Hub, pending: &[Pending], verdicts: &Verdicts) {
    let done = verdicts
        .discarded
        .iter()
        .chain(verdicts.stale.iter())
        .chain(verdicts.rejected.iter().map(|(i, _)| i))
        .chain(verdicts.aggregated.iter());
    for &i in done {
        let queued: Result<Option<Option<String>>, _> =
            sqlx::query_scalar("SELECT verification FROM gradient_updates WHERE update_id = $1")
                .bind(&pending[i].update_id)
                .fetch_optional(&hub.db.pool)
                .await;
        if matches!(queued, Ok(Some(Some(ref v))) if v == "queued") {
            continue;
        }
        if let Err(e) = hub.blobs.delete(&pending[i].key).await {
            tracing::warn!(error = %e, key = pending[i].key, "could not delete an update file");
        }
    }
}

fn state_schema(len: usize, names: &[&str]) -> Schema {
    Schema::new(
        names
            .iter()
            .map(|n| ParamSpec {
                name: n.to_string(),
                shape: vec![len],
            })
            .collect(),
    )
}

/// The outer optimiser's state as safetensors: `momentum` and `second_moment` (when used) and
/// the step count in the metadata.
fn encode_outer_state(state: &OuterState, len: usize) -> Vec<u8> {
    let mut names = Vec::new();
    let mut flat = Vec::new();
    // Schema order is by name: momentum before second_moment.
    if !state.momentum.is_empty() {
        names.push("momentum");
        flat.extend_from_slice(&state.momentum);
    }
    if !state.second_moment.is_empty() {
        names.push("second_moment");
        flat.extend_from_slice(&state.second_moment);
    }
    write_checkpoint(
        &state_schema(len, &names),
        &flat,
        HashMap::from([("steps".to_string(), state.steps.to_string())]),
    )
}

async fn load_outer_state(hub: &Hub, head: &VersionRow) -> Result<OuterState> {
    let Some(key) = &head.optimizer_key else {
        return Ok(OuterState::default());
    };
    let bytes = hub.blobs.get(key).await?;
    let metadata = read_metadata(&bytes).map_err(|e| anyhow!("outer optimiser state: {e}"))?;
    let steps = metadata
        .get("steps")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let (schema, flat) =
        read_checkpoint(&bytes).map_err(|e| anyhow!("outer optimiser state: {e}"))?;
    let mut state = OuterState {
        steps,
        ..OuterState::default()
    };
    let mut offset = 0;
    for spec in &schema.params {
        let part = flat[offset..offset + spec.numel()].to_vec();
        offset += spec.numel();
        match spec.name.as_str() {
            "momentum" => state.momentum = part,
            "second_moment" => state.second_moment = part,
            other => bail!("unexpected tensor {other} in the outer optimiser state"),
        }
    }
    Ok(state)
}

/// The scheduled trigger: every `AGGREGATION_INTERVAL`, aggregates whatever is pending; in
/// between, as soon as `MIN_GRADIENTS_FOR_UPDATE` are.
pub async fn run_loop(hub: Arc<Hub>) {
    let mut ticker = tokio::time::interval(hub.policy.aggregation_interval);
    ticker.tick().await;
    loop {
        let min = tokio::select! {
            _ = ticker.tick() => 1,
            _ = hub.aggregate_now.notified() => hub.policy.min_gradients,
        };
        match aggregate(&hub, min).await {
            Ok(Some(AggregateOutcome::Success { version, .. })) => {
                tracing::debug!(%version, "scheduled aggregation")
            }
            Ok(_) => {}
            Err(e) => tracing::error!(
                error = format!("{e:#}"),
                "aggregation failed; its updates stay pending"
            ),
        }
    }
}
