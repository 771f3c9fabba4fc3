//! Network statistics, and the loop that publishes them on the status feed and notices
//! versions made current elsewhere (another replica's aggregation, a rollback).

use crate::Hub;
use crate::db::{now_ms, to_datetime};
use anyhow::Result;
use hrm_wire::{BatchCounts, GlobalStats, StatusEvent};
use sqlx::Row;
use std::sync::Arc;
use std::time::Duration;

/// How often the stats loop runs.
pub const STATS_INTERVAL: Duration = Duration::from_secs(10);

/// Workers seen within this window count as active.
const ACTIVE_WINDOW_MS: i64 = 5 * 60 * 1000;

pub async fn global(hub: &Hub) -> Result<GlobalStats> {
    let mut batches = BatchCounts::default();
    for row in sqlx::query("SELECT status, COUNT(*) AS n FROM training_batches GROUP BY status")
        .fetch_all(&hub.db.pool)
        .await?
    {
        let n: i64 = row.try_get("n")?;
        match row.try_get::<String, _>("status")?.as_str() {
            "pending" => batches.pending = n,
            "assigned" => batches.assigned = n,
            "completed" => batches.completed = n,
            "failed" => batches.failed = n,
            _ => {}
        }
    }
    let mut updates = (0i64, 0i64, 0i64, 0i64);
    for row in sqlx::query("SELECT status, COUNT(*) AS n FROM gradient_updates GROUP BY status")
        .fetch_all(&hub.db.pool)
        .await?
    {
        let n: i64 = row.try_get("n")?;
        match row.try_get::<String, _>("status")?.as_str() {
            "pending" => updates.0 += n,
            "aggregated" => updates.1 += n,
            "rejected" => updates.2 += n,
            "held" => updates.3 += n,
            _ => {}
        }
    }
    let workers = sqlx::query(
        "SELECT COUNT(*) AS total, CAST(COALESCE(SUM(CASE WHEN last_seen > $1 THEN 1 ELSE 0 END), 0) AS BIGINT) AS active, \
         CAST(COALESCE(SUM(total_tokens), 0) AS BIGINT) AS tokens FROM workers",
    )
    .bind(now_ms() - ACTIVE_WINDOW_MS)
    .fetch_one(&hub.db.pool)
    .await?;
    let state = sqlx::query(
        "SELECT current_version, last_aggregation_at, (SELECT COUNT(*) FROM model_versions) AS versions FROM hub_state WHERE id = 1",
    )
    .fetch_one(&hub.db.pool)
    .await?;
    Ok(GlobalStats {
        current_version: state.try_get("current_version")?,
        num_versions: state.try_get("versions")?,
        workers_total: workers.try_get("total")?,
        workers_active: workers.try_get("active")?,
        batches,
        updates_pending: updates.0,
        updates_aggregated: updates.1,
        updates_rejected: updates.2,
        updates_awaiting_verification: sqlx::query_scalar(
            "SELECT COUNT(*) FROM gradient_updates WHERE status = 'pending' AND gated = TRUE AND verification = 'queued'",
        )
        .fetch_one(&hub.db.pool)
        .await?,
        updates_held: updates.3,
        total_tokens: workers.try_get("tokens")?,
        last_aggregation_at: state
            .try_get::<Option<i64>, _>("last_aggregation_at")?
            .map(to_datetime),
    })
}

/// Publishes stats every `interval` and a version event when the current version changes.
pub async fn run_loop(hub: Arc<Hub>, interval: Duration) {
    if let Ok(Some(version)) = crate::versions::current_version(&hub).await {
        hub.remember_version(&version);
    }
    let mut ticker = tokio::time::interval(interval);
    loop {
        ticker.tick().await;
        match global(&hub).await {
            Ok(stats) => {
                if let Some(version) = &stats.current_version {
                    let parent = crate::versions::version_row(&hub, version)
                        .await
                        .ok()
                        .flatten()
                        .and_then(|r| r.parent);
                    hub.announce_version(version, parent);
                }
                hub.publish(StatusEvent::Stats(stats));
            }
            Err(e) => tracing::warn!(error = format!("{e:#}"), "could not read network stats"),
        }
    }
}
