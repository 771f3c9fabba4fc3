//! `hrm hub`: the aggregation server of the volunteer training network (specification:
//! `shared/spec/training-network.md`, interface: `docs/hub-api.md`).
//!
//! It owns the model registry ([`versions`]), the batch queue and leases ([`batches`]), the
//! validation of uploaded updates ([`updates`]), aggregation ([`aggregator`] over the math in
//! [`rules`]), worker identity, registration challenges and trust ([`workers`], [`challenge`],
//! [`trust`]), re-verification ([`verify`]), the collection of orphan files ([`gc`]) and the
//! live status feed and dashboard ([`routes`]).
//!
//! All workflow state is in database columns ([`db`], with the SQL in [`store`]): every
//! background loop can stop and restart at any moment, and several replicas can share one
//! database, Redis and bucket. Every worker is a stranger: `docs/hub-api.md` ("Threat model")
//! lists each attack, the defence and the test that proves it.

pub mod aggregator;
pub mod batches;
pub mod blobs;
pub mod challenge;
pub mod config;
pub mod db;
pub mod gc;
pub mod queue;
pub mod routes;
pub mod rules;
pub mod stats;
pub mod store;
pub mod trust;
pub mod updates;
pub mod verify;
pub mod versions;
pub mod workers;

use anyhow::Result;
use blobs::Blobs;
use challenge::Challenges;
use config::{Policy, StorageArgs};
use db::Db;
use hrm_http::{ConnectionLimits, KeyedLimit};
use hrm_wire::StatusEvent;
use queue::Queue;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, OnceCell, Semaphore, broadcast};
use uuid::Uuid;

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
    /// Woken when an update waits for its re-verification.
    pub verify_now: Notify,
    /// Requests per worker.
    pub worker_limit: Arc<KeyedLimit<Uuid>>,
    /// Requests per IP address, on every route.
    pub ip_limit: Arc<KeyedLimit<IpAddr>>,
    /// Registrations per IP address.
    pub register_limit: Arc<KeyedLimit<IpAddr>>,
    /// Open status-feed WebSockets.
    pub ws_slots: Arc<Semaphore>,
    /// Registration challenges, under the secret shared through the database.
    challenges: OnceCell<Challenges>,
    /// The current version's parameters, loaded on first use.
    pub model: versions::ModelCache,
    /// Validation losses of versions whose metrics lack one (the first version).
    pub valid_losses: Mutex<HashMap<String, f64>>,
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
        Arc::new(Self {
            db,
            queue,
            blobs,
            events: broadcast::channel(256).0,
            aggregate_now: Notify::new(),
            verify_now: Notify::new(),
            worker_limit: Arc::new(KeyedLimit::new(
                policy.rate_burst as u32,
                policy.rate_per_second,
            )),
            ip_limit: Arc::new(KeyedLimit::new(policy.ip_burst, policy.ip_per_second)),
            register_limit: Arc::new(KeyedLimit::new(
                policy.register_burst,
                policy.register_per_second,
            )),
            ws_slots: Arc::new(Semaphore::new(policy.ws_max_connections)),
            challenges: OnceCell::new(),
            policy,
            model: versions::ModelCache::default(),
            valid_losses: Mutex::new(HashMap::new()),
            admin_key_hash: admin_key.map(workers::key_digest),
            fault: std::sync::Mutex::new(None),
            announced: std::sync::Mutex::new(None),
        })
    }

    /// The registration challenges (the secret is made once, by whichever replica asks first).
    pub async fn challenges(&self) -> Result<&Challenges> {
        self.challenges
            .get_or_try_init(|| async {
                let secret =
                    store::versions::challenge_secret(&self.db.pool, &Challenges::fresh_secret())
                        .await?;
                Ok(Challenges::new(&secret, self.policy.challenge_bits))
            })
            .await
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

/// How often idle rate-limit keys are forgotten.
const FORGET_IDLE_KEYS: Duration = Duration::from_secs(60);

/// Serves the hub on `listener` with its background loops (aggregation schedule, lease
/// reaper, stats feed, re-verification, orphan collection) until `shutdown` resolves, then
/// drains within the connection limits' deadline.
pub async fn serve(
    hub: Arc<Hub>,
    listener: tokio::net::TcpListener,
    limits: &ConnectionLimits,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    if hub.policy.eval_windows > 0 && batches::validation_windows(&hub).await?.is_none() {
        tracing::warn!(
            "no validation windows (`hrm hub ingest --valid`): versions are published without the validation-loss check"
        );
    }
    let loops = [
        tokio::spawn(aggregator::run_loop(hub.clone())),
        tokio::spawn(batches::run_reaper(hub.clone(), Duration::from_secs(10))),
        tokio::spawn(stats::run_loop(hub.clone(), stats::STATS_INTERVAL)),
        tokio::spawn(verify::run_loop(hub.clone())),
        tokio::spawn(gc::run_loop(
            hub.clone(),
            hub.policy.lease.min(Duration::from_secs(600)),
        )),
        tokio::spawn(hub.worker_limit.clone().forget_idle_every(FORGET_IDLE_KEYS)),
        tokio::spawn(hub.ip_limit.clone().forget_idle_every(FORGET_IDLE_KEYS)),
        tokio::spawn(
            hub.register_limit
                .clone()
                .forget_idle_every(FORGET_IDLE_KEYS),
        ),
    ];
    let result = hrm_http::serve(listener, routes::router(hub), limits, shutdown).await;
    for task in loops {
        task.abort();
    }
    result
}
