//! Collects orphan update files: files PUT but never reported with `/gradients/upload`, or left
//! when a lease was lost. A file under `updates/{batch}/{worker}` is kept while an update row
//! still needs it (pending, held, or waiting for re-verification) or while that worker holds
//! the batch (an upload in progress); otherwise it goes once it is older than the lease, so a
//! slow upload is never collected under its writer.

use crate::Hub;
use crate::store;
use anyhow::Result;
use std::collections::HashSet;
use std::sync::Arc;

/// Deletes orphan update files written before `written_before`; returns how many.
pub async fn collect_orphans(
    hub: &Hub,
    written_before: chrono::DateTime<chrono::Utc>,
) -> Result<usize> {
    let live: HashSet<String> = store::updates::live_keys(&hub.db.pool)
        .await?
        .into_iter()
        .collect();
    let uploading: HashSet<String> = store::batches::leases(&hub.db.pool)
        .await?
        .into_iter()
        .map(|(batch, worker)| format!("updates/{batch}/{worker}.safetensors"))
        .collect();
    let mut deleted = 0;
    for (key, written) in hub.blobs.list("updates").await? {
        if written < written_before && !live.contains(&key) && !uploading.contains(&key) {
            hub.blobs.delete(&key).await?;
            deleted += 1;
        }
    }
    Ok(deleted)
}

/// Background loop: collects orphans every `interval`.
pub async fn run_loop(hub: Arc<Hub>, interval: std::time::Duration) {
    let mut ticker = tokio::time::interval(interval);
    loop {
        ticker.tick().await;
        let old_enough = chrono::Utc::now()
            - chrono::Duration::from_std(hub.policy.lease).unwrap_or(chrono::Duration::hours(1));
        match collect_orphans(&hub, old_enough).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(files = n, "orphan update files collected"),
            Err(e) => tracing::warn!(error = format!("{e:#}"), "could not collect orphan files"),
        }
    }
}
