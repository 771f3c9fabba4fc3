//! The hub's live status feed (`/api/v1/ws/status`) as the worker sees it: new versions,
//! aggregation results and network stats go into the shared view, and each stats message
//! also refreshes this worker's contribution and the leaderboard. The feed reconnects on its
//! own; a hub that stays silent for three heartbeats counts as gone.

use crate::status::Status;
use futures::StreamExt;
use hrm_wire::{AggregateOutcome, HubClient, StatusEvent};
use std::time::Duration;
use tokio_tungstenite::tungstenite::Message;

/// Pause before reconnecting the feed.
const RECONNECT: Duration = Duration::from_secs(5);

/// The feed's WebSocket address for a hub base URL.
pub fn feed_url(hub_url: &str) -> String {
    let base = hub_url.trim_end_matches('/');
    let base = if let Some(rest) = base.strip_prefix("https://") {
        format!("wss://{rest}")
    } else if let Some(rest) = base.strip_prefix("http://") {
        format!("ws://{rest}")
    } else {
        base.to_string()
    };
    format!("{base}/api/v1/ws/status")
}

/// Follows the feed until the task is dropped.
pub async fn follow(client: HubClient, hub_url: String, status: Status) {
    refresh(&client, &status).await;
    loop {
        if let Err(e) = follow_once(&client, &feed_url(&hub_url), &status).await {
            tracing::debug!(error = %e, "status feed closed");
        }
        tokio::time::sleep(RECONNECT).await;
    }
}

async fn follow_once(client: &HubClient, url: &str, status: &Status) -> anyhow::Result<()> {
    let (mut socket, _) = tokio_tungstenite::connect_async(url).await?;
    // Until the hello says otherwise, the hub's default heartbeat.
    let mut silence_limit = Duration::from_secs(45);
    loop {
        let message = match tokio::time::timeout(silence_limit, socket.next()).await {
            Err(_) => anyhow::bail!("the hub sent nothing for {silence_limit:?}"),
            Ok(None) => return Ok(()),
            Ok(Some(message)) => message?,
        };
        let Message::Text(text) = message else {
            continue;
        };
        let Ok(event) = serde_json::from_str::<StatusEvent>(&text) else {
            continue;
        };
        match event {
            StatusEvent::Hello {
                current_version,
                heartbeat_seconds,
            } => {
                silence_limit = Duration::from_secs(3 * heartbeat_seconds.max(1));
                status.update(|v| v.network_version = current_version);
            }
            StatusEvent::Version { version, .. } => {
                status.info(format!("the network moved to {version}"));
                status.update(|v| v.network_version = Some(version));
            }
            StatusEvent::Aggregation(AggregateOutcome::Success {
                version,
                num_updates,
                rejected,
            }) => status.info(format!(
                "aggregation: {num_updates} updates into {version} ({rejected} rejected)"
            )),
            StatusEvent::Aggregation(AggregateOutcome::Held {
                held,
                valid_loss,
                parent_valid_loss,
            }) => status.info(format!(
                "aggregation held {held} updates: the validation loss would rise from {parent_valid_loss:.3} to {valid_loss:.3}"
            )),
            StatusEvent::Aggregation(AggregateOutcome::Waiting { .. }) => {}
            StatusEvent::Stats(stats) => {
                status.update(|v| v.network = Some(stats));
                refresh_standing(client, status).await;
            }
            StatusEvent::Heartbeat { .. } => {}
        }
    }
}

/// Network stats, this worker's contribution and the leaderboard over REST; a failure leaves
/// the last values in place. The leaderboard is refreshed on the feed's stats messages (every
/// few seconds), not per batch, so a fast worker does not spend its rate limit on the
/// dashboard.
async fn refresh(client: &HubClient, status: &Status) {
    if let Ok(stats) = client.global_stats().await {
        status.update(|v| v.network = Some(stats));
    }
    refresh_standing(client, status).await;
}

/// This worker's contribution and the leaderboard.
async fn refresh_standing(client: &HubClient, status: &Status) {
    refresh_contribution(client, status).await;
    if let Ok(board) = client.leaderboard().await {
        status.update(|v| v.leaderboard = board);
    }
}

/// This worker's own counts, after each upload.
pub(crate) async fn refresh_contribution(client: &HubClient, status: &Status) {
    if let Ok(mine) = client.worker_stats().await {
        status.update(|v| v.contribution = Some(mine));
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn feed_urls_follow_the_hub_scheme() {
        assert_eq!(
            super::feed_url("http://127.0.0.1:8090/"),
            "ws://127.0.0.1:8090/api/v1/ws/status"
        );
        assert_eq!(
            super::feed_url("https://hub.example"),
            "wss://hub.example/api/v1/ws/status"
        );
    }
}
