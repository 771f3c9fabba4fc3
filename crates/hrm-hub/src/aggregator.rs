//! Aggregation: reads up to `--max-updates` eligible pending updates, screens each one (stale
//! version, file changed since acceptance, unreadable, norm outside the bounds of honest
//! updates), sends the ones the outlier screen or the near-duplicate check flags to
//! re-verification, combines the rest with the configured rule and applies the result with the
//! outer optimiser. Before anything is published, the candidate's validation loss is compared
//! with its parent's: a rise beyond `--max-loss-increase` sends the round's unverified updates
//! to re-verification and recombines without them; if every update in the round was verified,
//! the round is held for the operator. Only then are the checkpoint written and the version and
//! every verdict recorded in one transaction.
//!
//! Exactly one aggregator runs at a time across replicas (the database lock in [`crate::db`]).
//! A crash before the publishing transaction leaves every update pending and at most an
//! unreferenced checkpoint file; a crash after it leaves only queue entries that the next run
//! discards. Nothing is lost and nothing counts twice: the crash tests abort at every [`Step`].
//!
//! One bad update never stops a round: a missing, changed or unreadable file is a verdict on
//! that update alone.

use crate::Hub;
use crate::db::now_ms;
use crate::queue::UPDATES;
use crate::rules::{self, OuterSchedule, OuterState, RuleError, Update, l2_norm};
use crate::store::updates::PendingUpdate;
use crate::store::{self, versions::VersionRow};
use crate::trust::{self, REPUTATION_AGGREGATED, REPUTATION_INVALID};
use crate::versions::{self, LoadedVersion, checkpoint_key, optimizer_key};
use anyhow::{Result, anyhow, bail};
use bytes::Bytes;
use hrm_wire::update::sha256_hex;
use hrm_wire::update::{
    ParamSpec, Schema, decode_update, read_checkpoint, read_metadata, write_checkpoint,
};
use hrm_wire::{AggregateOutcome, StatusEvent};
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

/// Runs one aggregation if at least `min_pending` updates may be aggregated. `Ok(None)` when
/// another aggregator holds the lock.
pub async fn aggregate(hub: &Hub, min_pending: usize) -> Result<Option<AggregateOutcome>> {
    let eligible = store::updates::eligible_count(&hub.db.pool).await?;
    if eligible < min_pending.max(1) as i64 {
        return Ok(Some(AggregateOutcome::Waiting { pending: eligible }));
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

/// A rejection, and whether it is the worker's own doing (and so costs reputation).
struct Rejection {
    index: usize,
    reason: String,
    penalty: bool,
}

/// What became of each pending update.
#[derive(Default)]
struct Verdicts {
    aggregated: Vec<usize>,
    /// Not chosen by Krum: consumed without penalty.
    discarded: Vec<usize>,
    rejected: Vec<Rejection>,
    /// Computed on a version too far behind (or on an abandoned line).
    stale: Vec<usize>,
    /// Back to pending, to be aggregated only once a re-verification agrees, with the reason.
    suspects: Vec<(usize, String)>,
    /// Held for the operator, with the reason.
    held: Vec<(usize, String)>,
}

impl Verdicts {
    fn reject(&mut self, index: usize, reason: impl Into<String>, penalty: bool) {
        self.rejected.push(Rejection {
            index,
            reason: reason.into(),
            penalty,
        });
    }
}

/// The eligible pending updates, in upload order: those the queue names, topped up from the
/// database (and the queue rebuilt) when the queue has fallen behind it.
async fn pending_updates(hub: &Hub) -> Result<Vec<PendingUpdate>> {
    let max = hub.policy.max_updates;
    let pool = &hub.db.pool;
    let queued = hub.queue.peek(UPDATES, max).await.unwrap_or_default();
    let mut rows = if queued.is_empty() {
        Vec::new()
    } else {
        store::updates::eligible(pool, Some(&queued), max).await?
    };
    let eligible = store::updates::eligible_count(pool).await?;
    if rows.len() < max && (rows.len() as i64) < eligible {
        let all = store::updates::pending_ids(pool).await?;
        if let Err(e) = hub.queue.replace(UPDATES, &all).await {
            tracing::warn!(error = %e, "could not rebuild the update queue");
        }
        rows = store::updates::eligible(pool, None, max).await?;
    }
    Ok(rows)
}

/// Why an update's file could not be used.
enum Unusable {
    Missing,
    /// Not the bytes that were accepted (an S3 object written again through its URL).
    Changed,
    Invalid(String),
}

/// The update's values, read with the size limit and checked against what was accepted.
async fn read_update(
    hub: &Hub,
    update: &PendingUpdate,
    schema: &Schema,
) -> Result<std::result::Result<Vec<f32>, Unusable>> {
    let limit = crate::updates::max_update_bytes(schema.num_parameters());
    let bytes = match hub.blobs.get_bounded(&update.key, limit).await? {
        None => return Ok(Err(Unusable::Missing)),
        Some(crate::blobs::Bounded::TooLarge(_)) => return Ok(Err(Unusable::Changed)),
        Some(crate::blobs::Bounded::Fits(bytes)) => bytes,
    };
    if update
        .sha256
        .as_ref()
        .is_some_and(|accepted| *accepted != sha256_hex(&bytes))
    {
        return Ok(Err(Unusable::Changed));
    }
    Ok(decode_update(&bytes, schema, &update.model_version)
        .map_err(|e| Unusable::Invalid(e.to_string())))
}

/// The validation loss of `version`'s parameters: recorded in its metrics, or computed once
/// and remembered.
async fn valid_loss_of(hub: &Hub, row: &VersionRow, loaded: &LoadedVersion) -> Result<Option<f64>> {
    if let Some(loss) = row.metrics.get("valid_loss").and_then(|v| v.as_f64()) {
        return Ok(Some(loss));
    }
    if let Some(loss) = hub
        .valid_losses
        .lock()
        .expect("loss cache")
        .get(&row.version)
    {
        return Ok(Some(*loss));
    }
    let loss = crate::verify::validation_loss(hub, loaded).await?;
    if let Some(loss) = loss {
        hub.valid_losses
            .lock()
            .expect("loss cache")
            .insert(row.version.clone(), loss);
    }
    Ok(loss)
}

async fn run_locked(hub: &Hub) -> Result<AggregateOutcome> {
    checkpoint_fault(hub, Step::Locked)?;
    let policy = &hub.policy;
    let head = versions::current_row(hub)
        .await?
        .ok_or_else(|| anyhow!("the hub has no model yet"))?;
    let model = hub.model.get(hub, &head.version).await?;
    let pending = pending_updates(hub).await?;
    let (norm_reference, _) = store::versions::norm_reference(&hub.db.pool).await?;
    if policy.norm_bound.is_some() && norm_reference.is_none() {
        // Nothing can be screened before the hub has recomputed one update itself: it waits,
        // with one recomputation queued.
        if store::updates::queued_count(&hub.db.pool).await? == 0
            && let Some(first) = pending.first()
        {
            store::updates::queue_verification(&hub.db.pool, &first.update_id).await?;
            hub.verify_now.notify_one();
        }
        return Ok(AggregateOutcome::Waiting {
            pending: pending.len() as i64,
        });
    }

    let mut verdicts = Verdicts::default();
    let mut candidates: Vec<(usize, Vec<f32>)> = Vec::new();
    for (i, update) in pending.iter().enumerate() {
        if versions::lag(
            hub,
            &head.version,
            &update.model_version,
            policy.max_staleness,
        )
        .await?
        .is_none()
        {
            verdicts.stale.push(i);
            continue;
        }
        let values = match read_update(hub, update, &model.schema).await? {
            Ok(values) => values,
            Err(Unusable::Missing) => {
                verdicts.reject(i, "the update file is missing from the store", false);
                continue;
            }
            Err(Unusable::Changed) => {
                verdicts.reject(i, "the update file changed after it was accepted", true);
                continue;
            }
            Err(Unusable::Invalid(e)) => {
                verdicts.reject(i, format!("unreadable at aggregation: {e}"), true);
                continue;
            }
        };
        if let Some(bound) = policy.norm_bound {
            let norm = l2_norm(&values);
            match norm_reference {
                Some(reference) if !trust::norm_within(norm, reference, bound) => {
                    verdicts.reject(
                        i,
                        format!(
                            "norm {norm:.3e} is outside [{:.3e}, {:.3e}], the bounds of honest updates",
                            reference / bound,
                            reference * bound
                        ),
                        true,
                    );
                    continue;
                }
                _ => {}
            }
        }
        candidates.push((i, values));
    }

    // Screens that compare uploads with each other only send them to re-verification: their
    // verdicts could be set by attackers. Updates verified already are evidence themselves.
    let verified = |i: usize| pending[i].verification.as_deref() == Some("agreed");
    let mut flags = {
        let views = as_updates(&candidates, &pending, &[], policy.probation_agreements);
        let versions: Vec<&str> = candidates
            .iter()
            .map(|(i, _)| pending[*i].model_version.as_str())
            .collect();
        let outliers = rules::outliers_by_version(&views, &versions, policy.outlier_sigmas);
        // Robust rules are what identical colluders aim at (n - f - 1 copies score 0 under
        // Krum; a majority of copies is the median); the mean has the outlier screen.
        let copies = if policy.rule != rules::Rule::Mean {
            rules::near_duplicates(&views)
        } else {
            vec![false; views.len()]
        };
        (0..views.len())
            .map(|j| match (outliers[j], copies[j]) {
                (true, _) => Some(format!("outlier beyond {} sigmas", policy.outlier_sigmas)),
                (_, true) => Some("nearly identical to another worker's update".to_string()),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let mut kept: Vec<(usize, Vec<f32>)> = Vec::new();
    for ((i, values), flag) in candidates.into_iter().zip(flags.drain(..)) {
        match flag {
            Some(reason) if !verified(i) => verdicts.suspects.push((i, reason)),
            _ => kept.push((i, values)),
        }
    }
    let mut agreements = HashMap::new();
    for (i, _) in &kept {
        let worker = &pending[*i].worker_id;
        if !agreements.contains_key(worker) {
            let a = store::workers::agreements(&hub.db.pool, worker).await?;
            agreements.insert(worker.clone(), a);
        }
    }

    let parent_loss = valid_loss_of(hub, &head, &model).await?;
    let (params, state, lr_factor, valid_loss) = loop {
        let views = as_updates(
            &kept,
            &pending,
            &agreements_in(&kept, &pending, &agreements),
            policy.probation_agreements,
        );
        let combined = match rules::combine(policy.rule, &views) {
            Ok(combined) => combined,
            Err(RuleError::NoUpdates | RuleError::TooFewForKrum { .. }) => {
                // Nothing to apply: record the verdicts reached so far; the rest stay pending.
                mark(hub, &pending, &verdicts, None).await?;
                return Ok(AggregateOutcome::Waiting {
                    pending: store::updates::eligible_count(&hub.db.pool).await?,
                });
            }
            Err(e) => return Err(anyhow!("combining updates: {e}")),
        };
        checkpoint_fault(hub, Step::Combined)?;
        let mut params = model.params.clone();
        let mut state = load_outer_state(hub, &head).await?;
        let lr_factor = match policy.outer_schedule {
            OuterSchedule::Constant => 1.0,
            schedule => schedule.factor(crate::batches::completed_fraction(hub).await?),
        };
        policy
            .outer
            .scaled(lr_factor)
            .apply(&mut params, &combined.values, &mut state)
            .map_err(|e| anyhow!("outer optimiser: {e}"))?;
        let candidate = LoadedVersion {
            version: String::new(),
            schema: model.schema.clone(),
            params,
            config: model.config.clone(),
        };
        let valid_loss = crate::verify::validation_loss(hub, &candidate).await?;
        let selected: Vec<usize> = combined.selected.iter().map(|&p| kept[p].0).collect();
        if let (Some(loss), Some(parent)) = (valid_loss, parent_loss)
            && loss > parent * (1.0 + policy.max_loss_increase)
        {
            let reason =
                format!("the round raised the validation loss from {parent:.4} to {loss:.4}");
            let unverified: Vec<usize> =
                selected.iter().copied().filter(|&i| !verified(i)).collect();
            if unverified.is_empty() {
                tracing::error!(
                    parent_loss = parent,
                    valid_loss = loss,
                    updates = selected.len(),
                    "every update of the round was re-verified, yet it raises the validation loss beyond --max-loss-increase; held for the operator (`hrm hub held`)"
                );
                verdicts.held = selected.iter().map(|&i| (i, reason.clone())).collect();
                mark(hub, &pending, &verdicts, None).await?;
                return Ok(AggregateOutcome::Held {
                    held: selected.len() as i64,
                    valid_loss: loss,
                    parent_valid_loss: parent,
                });
            }
            tracing::warn!(
                parent_loss = parent,
                valid_loss = loss,
                suspects = unverified.len(),
                "the round would raise the validation loss; its unverified updates go to re-verification"
            );
            for &i in &unverified {
                verdicts.suspects.push((i, reason.clone()));
            }
            kept.retain(|(i, _)| !unverified.contains(i));
            continue;
        }
        for (position, (i, _)) in kept.iter().enumerate() {
            if combined.selected.contains(&position) {
                verdicts.aggregated.push(*i);
            } else {
                verdicts.discarded.push(*i);
            }
        }
        break (candidate.params, state, lr_factor, valid_loss);
    };

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
    let aggregated_losses: Vec<f64> = verdicts
        .aggregated
        .iter()
        .map(|&i| pending[i].loss)
        .collect();
    let mut metrics = serde_json::json!({
        "num_updates": verdicts.aggregated.len(),
        "rejected": verdicts.rejected.len(),
        "discarded": verdicts.discarded.len(),
        "stale": verdicts.stale.len(),
        "sent_to_verification": verdicts.suspects.len(),
        "rule": format!("{:?}", policy.rule),
        "outer": policy.outer.name(),
        "outer_lr_factor": lr_factor,
        "train_loss": (!aggregated_losses.is_empty())
            .then(|| aggregated_losses.iter().sum::<f64>() / aggregated_losses.len() as f64),
    });
    if let Some(valid_loss) = valid_loss {
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
    if !verdicts.suspects.is_empty() {
        hub.verify_now.notify_one();
    }
    tracing::info!(%version, num_updates = verdicts.aggregated.len(), rejected = verdicts.rejected.len(), sent_to_verification = verdicts.suspects.len(), "published");
    Ok(AggregateOutcome::Success {
        version,
        num_updates: verdicts.aggregated.len() as i64,
        rejected: verdicts.rejected.len() as i64,
    })
}

/// The trust of each kept update's worker, in `kept` order.
fn agreements_in(
    kept: &[(usize, Vec<f32>)],
    pending: &[PendingUpdate],
    agreements: &HashMap<String, i64>,
) -> Vec<i64> {
    kept.iter()
        .map(|(i, _)| agreements.get(&pending[*i].worker_id).copied().unwrap_or(0))
        .collect()
}

/// The rules' view of `updates`, weighted by samples and (when `agreements` are given) by the
/// probation bound of [`trust::weight`].
fn as_updates<'a>(
    updates: &'a [(usize, Vec<f32>)],
    pending: &[PendingUpdate],
    agreements: &[i64],
    probation: i64,
) -> Vec<Update<'a>> {
    updates
        .iter()
        .enumerate()
        .map(|(j, (i, values))| Update {
            values,
            num_samples: match agreements.get(j) {
                Some(&a) => trust::weight(pending[*i].num_samples, a, probation),
                None => pending[*i].num_samples.max(0) as u64,
            },
        })
        .collect()
}

/// Records the verdicts, and publishes `version` when given, in one transaction. Publishing
/// is a compare-and-set on the current version, so a concurrent rollback or publication makes
/// the whole transaction fail instead of half-applying.
async fn mark(
    hub: &Hub,
    pending: &[PendingUpdate],
    verdicts: &Verdicts,
    publish: Option<(&str, &VersionRow)>,
) -> Result<()> {
    let mut tx = hub.db.pool.begin().await?;
    if let Some((base, row)) = publish {
        store::versions::insert(&mut *tx, row).await?;
        if !store::versions::advance(&mut *tx, base, &row.version, now_ms()).await? {
            bail!(
                "the current version changed during aggregation (a rollback?); nothing was published"
            );
        }
    }
    let version = publish.map(|(_, row)| row.version.as_str());
    let stale_reason = "computed on a version too far behind the current one";
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
                .map(|r| (r.index, "rejected", Some(r.reason.as_str()))),
        )
        .chain(
            verdicts
                .stale
                .iter()
                .map(|&i| (i, "stale", Some(stale_reason))),
        )
        .chain(
            verdicts
                .held
                .iter()
                .map(|(i, reason)| (*i, "held", Some(reason.as_str()))),
        );
    for (i, status, reason) in statuses {
        let recorded_version = (status == "aggregated" || status == "discarded")
            .then_some(version)
            .flatten();
        if !store::updates::set_verdict(
            &mut *tx,
            &pending[i].update_id,
            status,
            recorded_version,
            reason,
        )
        .await?
        {
            bail!(
                "update {} was no longer pending; nothing was recorded",
                pending[i].update_id
            );
        }
    }
    for (i, reason) in &verdicts.suspects {
        store::updates::gate_for_verification(&mut *tx, &pending[*i].update_id, reason).await?;
    }
    for &i in &verdicts.aggregated {
        store::workers::add_validated(&mut *tx, &pending[i].worker_id, 1).await?;
        store::workers::adjust_reputation(&mut *tx, &pending[i].worker_id, REPUTATION_AGGREGATED)
            .await?;
    }
    for r in verdicts.rejected.iter().filter(|r| r.penalty) {
        store::workers::adjust_reputation(
            &mut *tx,
            &pending[r.index].worker_id,
            REPUTATION_INVALID,
        )
        .await?;
    }
    // The batches of rejected and stale updates are redone by someone else.
    for i in verdicts
        .rejected
        .iter()
        .map(|r| r.index)
        .chain(verdicts.stale.iter().copied())
    {
        store::batches::redo(&mut *tx, &pending[i].batch_id, hub.policy.max_attempts).await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Update files are kept only while a re-verification may still read them.
async fn cleanup_files(hub: &Hub, pending: &[PendingUpdate], verdicts: &Verdicts) {
    let done = verdicts
        .discarded
        .iter()
        .chain(verdicts.stale.iter())
        .chain(verdicts.rejected.iter().map(|r| &r.index))
        .chain(verdicts.aggregated.iter());
    for &i in done {
        if matches!(
            store::updates::awaits_verification(&hub.db.pool, &pending[i].update_id).await,
            Ok(true)
        ) {
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
