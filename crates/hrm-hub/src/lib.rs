//! `hrm hub`: the aggregation server of the volunteer training network (specification:
//! `shared/spec/training-network.md`, interface: `docs/hub-api.md`).
//!
//! It owns the model registry ([`versions`]), the batch queue and leases ([`batches`]), the
//! validation of uploaded updates ([`updates`]), aggregation ([`aggregator`] over the math in
//! [`rules`]), worker identity and trust ([`workers`], [`trust`]), re-verification
//! ([`verify`]) and the live status feed and dashboard ([`routes`]).
//!
//! All workflow state is in database columns ([`db`]): every background loop can stop and
//! restart at any moment, and several replicas can share one database, Redis and bucket.

pub mod aggregator;
pub mod batches;
pub mod blobs;
pub mod config;
pub mod db;
pub mod error;
pub mod queue;
pub mod routes;
pub mod rules;
pub mod stats;
pub mod trust;
pub mod updates;
pub mod verify;
pub mod versions;
pub mod workers;

use anyhow::Result;
use blobs::Blobs;
use config::{Policy, StorageArgs};
use db::Db;
use hrm_wire::StatusEvent;
use queue::Queue;
use std::sync::Arc;
use tokio::sync::{Notify, broadcast};
use trust::RateLimiter;

/// Everything a request handler or background loop needs, passed explicitly.
pub struct Hub {
    pub db: Db,
    pub queue: Queue,
    pub blobs: Blobs,
    pub policy: Policy,
    /// Status events for the WebSocket feed.
    pub events: broadcast::Sender<StatusEvent>,
    /// Woken when enough updates are pending to aggregate.
    pub aggregate_now: Notify,
    pub limiter: RateLimiter,
    /// The current version's parameters, loaded on first use.
    pub model: versions::ModelCache,
    /// SHA-256 of the admin key that may trigger aggregation (`HRM_HUB_ADMIN_KEY`).
    pub admin_key_hash: Option<[u8; 32]>,
    /// Test hook: makes the aggregator fail at one of its steps.
    pub fault: std::sync::Mutex<Option<aggregator::Step>>,
    /// The last version announced on the status feed.
    announced: std::sync::Mutex<Option<String>>,
}

impl Hub {
    /// Opens the storage named by `storage` (creating the embedded defaults when needed).
    pub async fn open(
        storage: &StorageArgs,
        policy: Policy,
        admin_key: Option<&str>,
    ) -> Result<Arc<Self>> {
        std::fs::create_dir_all(&storage.data_dir)?;
        let db = Db::connect(&storage.database_url()).await?;
        let queue = match &storage.redis_url {
            Some(url) => Queue::redis(url, &storage.redis_prefix).await?,
            None => Queue::memory(),
        };
        let blobs = match &storage.s3_bucket {
            Some(bucket) => Blobs::s3(bucket)?,
            None => Blobs::local(&storage.data_dir.join("objects"))?,
        };
        Ok(Self::from_parts(db, queue, blobs, policy, admin_key))
    }

    /// A hub over storage opened by the caller.
    pub fn from_parts(
        db: Db,
        queue: Queue,
        blobs: Blobs,
        policy: Policy,
        admin_key: Option<&str>,
    ) -> Arc<Self> {
        let limiter = RateLimiter::new(policy.rate_burst, policy.rate_per_second);
        Arc::new(Self {
            db,
            queue,
            blobs,
            policy,
            events: broadcast::channel(256).0,
            aggregate_now: Notify::new(),
            limiter,
            model: versions::ModelCache::default(),
            admin_key_hash: admin_key.map(workers::key_digest),
            fault: std::sync::Mutex::new(None),
            announced: std::sync::Mutex::new(None),
        })
    }

    /// Sends a status event to every WebSocket client of this replica.
    pub fn publish(&self, event: StatusEvent) {
        // No subscribers is not an error.
        let _ = self.events.send(event);
    }

    /// Publishes a version event unless this replica already announced `version` last (the
    /// aggregator, a rollback and the stats loop all report what they see).
    pub fn announce_version(&self, version: &str, parent: Option<String>) {
        let mut last = self.announced.lock().expect("announced lock");
        if last.as_deref() != Some(version) {
            *last = Some(version.to_string());
            self.publish(StatusEvent::Version {
                version: version.to_string(),
                parent,
            });
        }
    }

    /// Records the version current at start-up, which clients learn from their hello.
    pub fn remember_version(&self, version: &str) {
        self.announced
            .lock()
            .expect("announced lock")
            .get_or_insert_with(|| version.to_string());
    }
}

/// Serves the hub on `listener` with its background loops (aggregation schedule, lease
/// reaper, stats feed, re-verification) until `shutdown` resolves.
pub async fn serve(
    hub: Arc<Hub>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let loops = [
        tokio::spawn(aggregator::run_loop(hub.clone())),
        tokio::spawn(batches::run_reaper(
            hub.clone(),
            std::time::Duration::from_secs(10),
        )),
        tokio::spawn(stats::run_loop(hub.clone(), stats::STATS_INTERVAL)),
        tokio::spawn(verify::run_loop(hub.clone())),
    ];
    let result = axum::serve(listener, routes::router(hub))
        .with_graceful_shutdown(shutdown)
        .await;
    for task in loops {
        task.abort();
    }
    Ok(result?)
}
