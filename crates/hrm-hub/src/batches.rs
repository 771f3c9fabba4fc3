//! Training batches: ingestion of a corpus into pre-chunked gzip JSON-lines files, leases, and
//! the reaper that returns expired leases and cooled-down failed batches (the status
//! transitions are in [`store::batches`]).

use crate::Hub;
use crate::db::{now_ms, to_datetime};
use crate::queue::BATCHES;
use crate::store;
use crate::versions;
use crate::workers::Worker;
use anyhow::{Context, Result};
use bytes::Bytes;
use hrm_http::{ApiError, ApiResult};
use hrm_wire::samples::{decode_samples, encode_samples};
use hrm_wire::{BatchAssignment, TrainingPlan};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use sha2::{Digest, Sha256};
use std::time::Duration;
use uuid::Uuid;

/// The batch sizes the hub pre-chunks, from the specification.
pub const BATCH_SIZES: [usize; 3] = [256, 512, 1024];

/// Key of the held-out validation windows the aggregator scores new versions on.
pub const VALIDATION_KEY: &str = "validation/windows.jsonl.gz";

/// Candidates tried per lease before falling back to the database.
const QUEUE_TRIES: usize = 16;
/// Pending batch ids moved from the database into an empty queue at once.
const REFILL: i64 = 1024;

/// What an ingest did.
#[derive(Debug, Clone, PartialEq)]
pub struct IngestReport {
    pub batches: usize,
    pub new_batches: usize,
    pub samples: usize,
    pub validation_windows: usize,
}

/// Cuts `tokens` into windows of `seq_len + 1` tokens (consecutive windows share one token, as
/// inputs and shifted targets need), shuffles them, and stores them as batches of
/// `batch_size`; a final short batch is kept with its own size. Batch ids come from the content, so ingesting the same
/// corpus again adds nothing.
pub async fn ingest(
    hub: &Hub,
    dataset: &str,
    tokens: &[u32],
    valid_tokens: Option<&[u32]>,
    batch_size: usize,
    seq_len: usize,
    mut progress: impl FnMut(usize, usize),
) -> Result<IngestReport> {
    anyhow::ensure!(
        !dataset.is_empty() && dataset.len() <= 128,
        "dataset names are 1 to 128 characters"
    );
    anyhow::ensure!(
        batch_size > 0 && seq_len > 0,
        "batch size and sequence length must be positive"
    );
    let mut windows: Vec<Vec<u32>> = (0..tokens.len().saturating_sub(seq_len))
        .step_by(seq_len)
        .map(|start| tokens[start..start + seq_len + 1].to_vec())
        .collect();
    // Each batch samples the whole corpus, as a centralised run's random windows do; in corpus
    // order every batch would hold one passage and the model would drift toward whatever book
    // it saw last. The seed comes from the dataset name, so ingesting again gives the same
    // batches.
    let seed = u64::from_le_bytes(
        Sha256::digest(dataset.as_bytes())[..8]
            .try_into()
            .expect("8 bytes"),
    );
    windows.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    let chunks: Vec<&[Vec<u32>]> = windows.chunks(batch_size).collect();
    let mut seq = store::batches::max_seq(&hub.db.pool).await?;
    let mut new_ids = Vec::new();
    for (i, chunk) in chunks.iter().enumerate() {
        let file = encode_samples(chunk)?;
        let mut hasher = Sha256::new();
        hasher.update(dataset.as_bytes());
        hasher.update(&file);
        let digest: [u8; 32] = hasher.finalize().into();
        let id = uuid::Builder::from_custom_bytes(digest[..16].try_into().expect("16 bytes"))
            .into_uuid();
        let key = format!("batches/{dataset}/{id}.jsonl.gz");
        // The file first: a crash before the row leaves an unreferenced file, never a row
        // without its file.
        hub.blobs.put(&key, Bytes::from(file)).await?;
        seq += 1;
        let inserted = store::batches::insert(
            &hub.db.pool,
            store::batches::NewBatch {
                batch_id: &id.to_string(),
                seq,
                dataset,
                data_key: &key,
                num_samples: chunk.len() as i64,
                seq_len: seq_len as i64,
            },
        )
        .await?;
        if inserted {
            new_ids.push(id.to_string());
        }
        progress(i + 1, chunks.len());
    }
    hub.queue.push(BATCHES, &new_ids).await?;
    let mut validation_windows = 0;
    if let Some(valid) = valid_tokens {
        let windows: Vec<Vec<u32>> = (0..valid.len().saturating_sub(seq_len))
            .step_by(seq_len)
            .map(|start| valid[start..start + seq_len + 1].to_vec())
            .collect();
        validation_windows = windows.len();
        hub.blobs
            .put(VALIDATION_KEY, Bytes::from(encode_samples(&windows)?))
            .await?;
    }
    Ok(IngestReport {
        batches: chunks.len(),
        new_batches: new_ids.len(),
        samples: windows.len(),
        validation_windows,
    })
}

/// Leases a batch to `worker`: the one it already holds (a worker holds at most one, enforced
/// by the database, so a reconnecting worker gets its batch back and no one can hoard), else
/// the oldest pending one. `None` when nothing is pending, or while a worker in probation has
/// an update waiting for its re-verification.
pub async fn lease(hub: &Hub, worker: &Worker) -> ApiResult<Option<BatchAssignment>> {
    worker.require_trusted(hub)?;
    let Some(version) = versions::current_version(hub).await? else {
        return Err(ApiError::unavailable(
            "no_model",
            "this hub has no model yet (`hrm hub init`)",
        ));
    };
    let me = worker.id.to_string();
    // An expired lease of this worker's own goes back before it takes another.
    let (requeued, _) =
        store::batches::release_expired(&hub.db.pool, hub.policy.max_attempts, Some(&me)).await?;
    requeue(hub, &requeued).await;
    // A worker in probation waits for the verdict on the update it is waiting on before it
    // gets another batch: the hub recomputes one update of each newcomer at a time, and a
    // newcomer's further work would only go stale behind that recomputation.
    if worker.agreements < hub.policy.probation_agreements
        && store::batches::held_by(&hub.db.pool, &me).await?.is_none()
        && store::updates::awaits_verdict(&hub.db.pool, &me).await?
    {
        return Ok(None);
    }
    let expires_at = now_ms() + hub.policy.lease.as_millis() as i64;
    let mut claimed = None;
    'search: {
        for _ in 0..QUEUE_TRIES {
            // A queue failure (Redis down) falls through to the database.
            let Ok(Some(id)) = hub.queue.pop(BATCHES).await else {
                break;
            };
            match store::batches::claim(&hub.db.pool, &id, &me, expires_at).await? {
                store::batches::Claim::Claimed => {
                    claimed = Some(id);
                    break 'search;
                }
                store::batches::Claim::Taken => {}
                store::batches::Claim::AlreadyHolding => {
                    // The id goes back for someone else.
                    requeue(hub, &[id]).await;
                    break 'search;
                }
            }
        }
        let ids = store::batches::pending_ids(&hub.db.pool, REFILL).await?;
        for (i, id) in ids.iter().enumerate() {
            match store::batches::claim(&hub.db.pool, id, &me, expires_at).await? {
                store::batches::Claim::Claimed => {
                    claimed = Some(id.clone());
                    requeue(hub, &ids[i + 1..]).await;
                    break 'search;
                }
                store::batches::Claim::Taken => {}
                store::batches::Claim::AlreadyHolding => break 'search,
            }
        }
    }
    // What this worker holds now: the batch just claimed, or the one a concurrent request of
    // its own claimed first.
    let row = match claimed {
        Some(id) => store::batches::get(&hub.db.pool, &id).await?,
        None => store::batches::held_by(&hub.db.pool, &me).await?,
    };
    match row {
        Some(row) => Ok(Some(assignment(hub, row, version).await?)),
        None => Ok(None),
    }
}

/// Puts batch ids back on the queue (the database stays the truth if this fails).
async fn requeue(hub: &Hub, ids: &[String]) {
    if let Err(e) = hub.queue.push(BATCHES, ids).await {
        tracing::warn!(error = %e, "could not queue batches; they are leased from the database");
    }
}

/// The seed of a batch's training plan: from its id, so every computation of it agrees.
pub fn plan_seed(batch_id: &str) -> u64 {
    let digest = Sha256::digest(batch_id.as_bytes());
    u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"))
}

pub fn plan_for(hub: &Hub, batch_id: &str) -> TrainingPlan {
    TrainingPlan {
        seed: plan_seed(batch_id),
        ..hub.policy.plan.clone()
    }
}

async fn assignment(
    hub: &Hub,
    row: store::batches::BatchRow,
    version: String,
) -> Result<BatchAssignment> {
    let remaining = (row.lease_expires_at - now_ms()).max(1000) as u64;
    let data_url = match hub
        .blobs
        .presign(
            object_store::signer::Method::GET,
            &row.data_key,
            Duration::from_millis(remaining),
        )
        .await?
    {
        Some(url) => url,
        None => format!("/api/v1/batch/data/{}", row.batch_id),
    };
    Ok(BatchAssignment {
        batch_id: Uuid::parse_str(&row.batch_id).context("corrupt batch id")?,
        model_version: version,
        data_url,
        num_samples: row.num_samples,
        seq_len: row.seq_len,
        lease_expires_at: to_datetime(row.lease_expires_at),
        plan: plan_for(hub, &row.batch_id),
    })
}

/// The object key of the batch file of a batch the worker holds (the local store's stand-in
/// for a presigned GET).
pub async fn data_key(hub: &Hub, worker: &Worker, batch_id: Uuid) -> ApiResult<String> {
    store::batches::data_key_for_holder(&hub.db.pool, &batch_id.to_string(), &worker.id.to_string())
        .await?
        .ok_or_else(|| {
            ApiError::not_found(
                "batch_not_leased",
                "this worker holds no lease on that batch",
            )
        })
}

/// The fraction of all ingested batches that are completed (0 when none were ingested).
pub async fn completed_fraction(hub: &Hub) -> Result<f64> {
    let (total, done) = store::batches::completion(&hub.db.pool).await?;
    Ok(if total > 0 {
        done as f64 / total as f64
    } else {
        0.0
    })
}

/// Returns expired leases to the queue (or fails batches out of attempts), and failed batches
/// whose cool-down is over. Safe to run on every replica at once: each row moves once.
pub async fn reap(hub: &Hub) -> Result<usize> {
    let (mut requeued, moved) =
        store::batches::release_expired(&hub.db.pool, hub.policy.max_attempts, None).await?;
    let cooled = now_ms() - hub.policy.failed_cooldown.as_millis() as i64;
    let revived = store::batches::requeue_failed(&hub.db.pool, cooled, None).await?;
    if !revived.is_empty() {
        tracing::info!(
            batches = revived.len(),
            "failed batches offered again after their cool-down"
        );
    }
    let count = moved + revived.len();
    requeued.extend(revived);
    requeue(hub, &requeued).await;
    Ok(count)
}

/// The operator's requeue: one failed batch, or every failed one. Returns how many.
pub async fn requeue_failed(hub: &Hub, batch_id: Option<Uuid>) -> Result<usize> {
    let ids = store::batches::requeue_failed(
        &hub.db.pool,
        i64::MAX,
        batch_id.map(|id| id.to_string()).as_deref(),
    )
    .await?;
    requeue(hub, &ids).await;
    Ok(ids.len())
}

/// The validation windows stored by `ingest`, if any.
pub async fn validation_windows(hub: &Hub) -> Result<Option<Vec<Vec<u32>>>> {
    if hub.blobs.size(VALIDATION_KEY).await?.is_none() {
        return Ok(None);
    }
    Ok(Some(decode_samples(&hub.blobs.get(VALIDATION_KEY).await?)?))
}

/// Background loop: returns expired leases and cooled-down failed batches every `interval`.
pub async fn run_reaper(hub: std::sync::Arc<Hub>, interval: Duration) {
    let mut ticker = tokio::time::interval(interval);
    loop {
        ticker.tick().await;
        match reap(&hub).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(batches = n, "batches returned to the queue"),
            Err(e) => tracing::warn!(error = format!("{e:#}"), "could not return batches"),
        }
    }
}
