//! The hub's settings: command-line flags, each with its environment variable (the
//! specification's `DATABASE_URL`, `REDIS_URL`, `S3_BUCKET`, `AGGREGATION_INTERVAL` and
//! `MIN_GRADIENTS_FOR_UPDATE`, and `HRM_HUB_*` for the rest), over the `hub:` section of a YAML
//! file (`--config`), over the defaults. The file's keys are the flags' names with
//! underscores; `hrm` layers them with `hrm_settings`.

use crate::rules::{OuterOptimizer, OuterSchedule, Rule};
use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use hrm_wire::TrainingPlan;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Duration;

/// Where the hub keeps its state.
#[derive(Args, Debug, Clone, Serialize, Deserialize)]
pub struct StorageArgs {
    /// YAML file whose `hub:` section supplies settings (default: ./hrm.yaml if present).
    #[arg(long, env = "HRM_HUB_CONFIG")]
    pub config: Option<PathBuf>,
    /// Directory of the embedded defaults: `hub.db` (SQLite) and `objects/` (the object store).
    #[arg(long, env = "HRM_HUB_DATA_DIR", default_value = "hub-data")]
    pub data_dir: PathBuf,
    /// `postgres://user@host/db` or `sqlite://path`; default: SQLite in the data directory.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// `redis://host:6379`; default: an in-process queue.
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    pub redis_url: Option<String>,
    /// Redis key prefix, so hubs (or tests) can share one Redis.
    #[arg(long, env = "HRM_HUB_REDIS_PREFIX", default_value = "hrm-hub")]
    pub redis_prefix: String,
    /// S3 bucket for checkpoints, batches and updates (endpoint and credentials from `AWS_*`);
    /// default: files under the data directory.
    #[arg(long, env = "S3_BUCKET")]
    pub s3_bucket: Option<String>,
}

impl StorageArgs {
    pub fn database_url(&self) -> String {
        self.database_url.clone().unwrap_or_else(|| {
            format!(
                "sqlite://{}?mode=rwc",
                self.data_dir.join("hub.db").display()
            )
        })
    }
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RuleName {
    Mean,
    Krum,
    MultiKrum,
    TrimmedMean,
    Median,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OuterScheduleName {
    Constant,
    Cosine,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OuterName {
    Plain,
    Fedadam,
    Nesterov,
}

/// How the hub aggregates, trusts and paces.
#[derive(Args, Debug, Clone, Serialize, Deserialize)]
pub struct PolicyArgs {
    /// Seconds between scheduled aggregations.
    #[arg(long, env = "AGGREGATION_INTERVAL", default_value_t = 60)]
    pub aggregation_interval: u64,
    /// Pending updates that trigger an aggregation (and that `POST /aggregate` waits for).
    #[arg(long, env = "MIN_GRADIENTS_FOR_UPDATE", default_value_t = 10)]
    pub min_gradients_for_update: usize,
    /// Most pending updates read by one aggregation.
    #[arg(long, env = "HRM_HUB_MAX_UPDATES", default_value_t = 100)]
    pub max_updates_per_aggregation: usize,
    /// How updates are combined.
    #[arg(long, env = "HRM_HUB_RULE", value_enum, default_value_t = RuleName::Mean)]
    pub rule: RuleName,
    /// Byzantine updates Krum and Multi-Krum tolerate.
    #[arg(long, env = "HRM_HUB_BYZANTINE", default_value_t = 1)]
    pub byzantine: usize,
    /// Updates Multi-Krum keeps (0: n - f, all but `--byzantine`).
    #[arg(long, env = "HRM_HUB_KRUM_SELECT", default_value_t = 0)]
    pub krum_select: usize,
    /// Fraction trimmed from each end by the trimmed mean.
    #[arg(long, env = "HRM_HUB_TRIM_FRACTION", default_value_t = 0.1)]
    pub trim_fraction: f32,
    /// The outer optimiser that applies the combined update.
    #[arg(long, env = "HRM_HUB_OUTER", value_enum, default_value_t = OuterName::Plain)]
    pub outer: OuterName,
    /// Outer learning rate (default: 1 for plain, 0.7 for nesterov, 0.003 for fedadam).
    #[arg(long, env = "HRM_HUB_OUTER_LR")]
    pub outer_lr: Option<f32>,
    /// How the outer learning rate changes over the ingested batches: constant, or cosine decay
    /// to 0.1 of it as the batches complete.
    #[arg(
        long,
        env = "HRM_HUB_OUTER_SCHEDULE",
        value_enum,
        default_value = "constant"
    )]
    pub outer_schedule: OuterScheduleName,
    /// Momentum of the Nesterov outer optimiser.
    #[arg(long, env = "HRM_HUB_OUTER_MOMENTUM", default_value_t = 0.9)]
    pub outer_momentum: f32,
    /// Updates further than this many robust standard deviations from the others are rejected.
    #[arg(long, env = "HRM_HUB_OUTLIER_SIGMAS", default_value_t = 3.0)]
    pub outlier_sigmas: f64,
    /// Versions an update may lag the current one (bounded staleness).
    #[arg(long, env = "HRM_HUB_MAX_STALENESS", default_value_t = 4)]
    pub max_staleness: i64,
    /// Seconds a worker holds a batch before it goes back to the queue.
    #[arg(long, env = "HRM_HUB_LEASE_SECONDS", default_value_t = 900)]
    pub lease_seconds: u64,
    /// Leases or rejected updates after which a batch is marked failed.
    #[arg(long, env = "HRM_HUB_MAX_ATTEMPTS", default_value_t = 3)]
    pub max_attempts: i64,
    /// Token bucket per worker: burst size.
    #[arg(long, env = "HRM_HUB_RATE_BURST", default_value_t = 60.0)]
    pub rate_burst: f64,
    /// Token bucket per worker: requests per second refilled.
    #[arg(long, env = "HRM_HUB_RATE_PER_SECOND", default_value_t = 5.0)]
    pub rate_per_second: f64,
    /// Workers whose reputation falls below this are refused.
    #[arg(long, env = "HRM_HUB_MIN_REPUTATION", default_value_t = 0.3)]
    pub min_reputation: f64,
    /// Fraction of accepted updates the hub recomputes to check.
    #[arg(long, env = "HRM_HUB_VERIFY_FRACTION", default_value_t = 0.05)]
    pub verify_fraction: f64,
    /// Cosine similarity a recomputed update must reach to count as agreeing.
    #[arg(long, env = "HRM_HUB_VERIFY_MIN_COSINE", default_value_t = 0.9)]
    pub verify_min_cosine: f64,
    /// The same for top-k uploads, on the values they sent: these carry the worker's
    /// error-feedback residual, which the recomputation cannot know.
    #[arg(long, env = "HRM_HUB_VERIFY_MIN_COSINE_SPARSE", default_value_t = 0.5)]
    pub verify_min_cosine_sparse: f64,
    /// Validation windows evaluated for each new version's metrics (0: none).
    #[arg(long, env = "HRM_HUB_EVAL_WINDOWS", default_value_t = 32)]
    pub eval_windows: usize,
    /// Inner AdamW steps a worker takes over one batch.
    #[arg(long, env = "HRM_HUB_INNER_STEPS", default_value_t = 8)]
    pub inner_steps: u32,
    /// Inner learning rate.
    #[arg(long, env = "HRM_HUB_INNER_LR", default_value_t = 1e-3)]
    pub inner_lr: f64,
    /// Inner steps over which the inner learning rate ramps up linearly, on every batch.
    #[arg(long, env = "HRM_HUB_INNER_WARMUP_STEPS", default_value_t = 0)]
    pub inner_warmup_steps: u32,
    /// Seconds between WebSocket heartbeats; a client silent for three of them is dropped.
    #[arg(long, env = "HRM_HUB_HEARTBEAT_SECONDS", default_value_t = 15)]
    pub heartbeat_seconds: u64,
    /// An update's L2 norm must lie within this factor (either way) of the norm of the hub's own
    /// recomputations; 0 turns the norm screen off.
    #[arg(long, env = "HRM_HUB_NORM_BOUND", default_value_t = 4.0)]
    pub norm_bound: f64,
    /// A version is not published when its validation loss exceeds its parent's by more than
    /// this fraction (needs validation windows: `hrm hub ingest --valid`).
    #[arg(long, env = "HRM_HUB_MAX_LOSS_INCREASE", default_value_t = 0.02)]
    pub max_loss_increase: f64,
    /// Agreeing re-verifications in a row a new worker needs to leave probation (0: none).
    #[arg(long, env = "HRM_HUB_PROBATION_AGREEMENTS", default_value_t = 3)]
    pub probation_agreements: i64,
    /// Proof-of-work difficulty of registration, in leading zero bits (0: none).
    #[arg(long, env = "HRM_HUB_CHALLENGE_BITS", default_value_t = 20)]
    pub challenge_bits: u32,
    /// Registrations one IP address may make at once ...
    #[arg(long, env = "HRM_HUB_REGISTER_BURST", default_value_t = 5)]
    pub register_burst: u32,
    /// ... and per hour after that.
    #[arg(long, env = "HRM_HUB_REGISTER_PER_HOUR", default_value_t = 20.0)]
    pub register_per_hour: f64,
    /// Requests one IP address may make at once (all routes) ...
    #[arg(long, env = "HRM_HUB_IP_BURST", default_value_t = 600)]
    pub ip_burst: u32,
    /// ... and per second after that.
    #[arg(long, env = "HRM_HUB_IP_PER_SECOND", default_value_t = 100.0)]
    pub ip_per_second: f64,
    /// Take the client's IP address from this header (the last address in it) instead of the
    /// connection: only behind a reverse proxy that sets it.
    #[arg(long, env = "HRM_HUB_CLIENT_IP_HEADER")]
    pub client_ip_header: Option<String>,
    /// Seconds before a batch that ran out of attempts is offered again.
    #[arg(long, env = "HRM_HUB_FAILED_COOLDOWN", default_value_t = 3600)]
    pub failed_cooldown: u64,
    /// Status-feed WebSocket connections served at once.
    #[arg(long, env = "HRM_HUB_WS_MAX_CONNECTIONS", default_value_t = 1000)]
    pub ws_max_connections: usize,
}

/// Settings derived from [`PolicyArgs`], checked.
#[derive(Debug, Clone)]
pub struct Policy {
    pub aggregation_interval: Duration,
    pub min_gradients: usize,
    pub max_updates: usize,
    pub rule: Rule,
    pub outer: OuterOptimizer,
    pub outer_schedule: OuterSchedule,
    pub outlier_sigmas: f64,
    pub max_staleness: i64,
    pub lease: Duration,
    pub max_attempts: i64,
    pub rate_burst: f64,
    pub rate_per_second: f64,
    pub min_reputation: f64,
    pub verify_fraction: f64,
    pub verify_min_cosine: f64,
    pub verify_min_cosine_sparse: f64,
    pub eval_windows: usize,
    pub plan: TrainingPlan,
    pub heartbeat: Duration,
    /// `None`: the norm screen is off.
    pub norm_bound: Option<f64>,
    pub max_loss_increase: f64,
    pub probation_agreements: i64,
    pub challenge_bits: u32,
    pub register_burst: u32,
    pub register_per_second: f64,
    pub ip_burst: u32,
    pub ip_per_second: f64,
    pub client_ip_header: Option<axum::http::HeaderName>,
    pub failed_cooldown: Duration,
    pub ws_max_connections: usize,
}

impl PolicyArgs {
    pub fn policy(&self) -> Result<Policy> {
        if self.min_gradients_for_update == 0
            || self.max_updates_per_aggregation < self.min_gradients_for_update
        {
            bail!("need 1 <= MIN_GRADIENTS_FOR_UPDATE <= --max-updates-per-aggregation");
        }
        if !(0.0..0.5).contains(&self.trim_fraction) {
            bail!("--trim-fraction must be in [0, 0.5)");
        }
        if self.aggregation_interval == 0 || self.lease_seconds == 0 || self.heartbeat_seconds == 0
        {
            bail!("AGGREGATION_INTERVAL, --lease-seconds and --heartbeat-seconds must be positive");
        }
        if !(0.0..=1.0).contains(&self.verify_fraction)
            || self.rate_burst < 1.0
            || self.rate_per_second <= 0.0
        {
            bail!(
                "--verify-fraction must be in [0, 1], --rate-burst >= 1 and --rate-per-second > 0"
            );
        }
        if self.inner_warmup_steps > self.inner_steps {
            bail!("--inner-warmup-steps must not exceed --inner-steps");
        }
        if !(self.norm_bound == 0.0 || self.norm_bound > 1.0) || !self.norm_bound.is_finite() {
            bail!("--norm-bound must be 0 (off) or above 1");
        }
        if self.max_loss_increase.is_nan() || self.max_loss_increase < 0.0 {
            bail!("--max-loss-increase must be 0 or more");
        }
        if self.challenge_bits > 40 {
            bail!("--challenge-bits above 40 would take a volunteer days");
        }
        if self.register_burst == 0
            || self.ip_burst == 0
            || !self.register_per_hour.is_finite()
            || self.register_per_hour <= 0.0
            || !self.ip_per_second.is_finite()
            || self.ip_per_second <= 0.0
            || self.ws_max_connections == 0
            || self.probation_agreements < 0
        {
            bail!(
                "--register-burst, --register-per-hour, --ip-burst, --ip-per-second and --ws-max-connections must be positive, --probation-agreements 0 or more"
            );
        }
        let client_ip_header = self
            .client_ip_header
            .as_deref()
            .map(axum::http::HeaderName::try_from)
            .transpose()
            .map_err(|e| anyhow::anyhow!("--client-ip-header: {e}"))?;
        let rule = match self.rule {
            RuleName::Mean => Rule::Mean,
            RuleName::Krum => Rule::Krum {
                byzantine: self.byzantine,
            },
            RuleName::MultiKrum => Rule::MultiKrum {
                byzantine: self.byzantine,
                select: self.krum_select,
            },
            RuleName::TrimmedMean => Rule::TrimmedMean {
                trim_fraction: self.trim_fraction,
            },
            RuleName::Median => Rule::Median,
        };
        let outer = match self.outer {
            OuterName::Plain => OuterOptimizer::Plain {
                lr: self.outer_lr.unwrap_or(1.0),
            },
            OuterName::Nesterov => OuterOptimizer::Nesterov {
                lr: self.outer_lr.unwrap_or(0.7),
                momentum: self.outer_momentum,
            },
            OuterName::Fedadam => OuterOptimizer::FedAdam {
                lr: self.outer_lr.unwrap_or(0.003),
                beta1: 0.9,
                beta2: 0.99,
                tau: 1e-3,
            },
        };
        Ok(Policy {
            aggregation_interval: Duration::from_secs(self.aggregation_interval),
            min_gradients: self.min_gradients_for_update,
            max_updates: self.max_updates_per_aggregation,
            rule,
            outer,
            outer_schedule: match self.outer_schedule {
                OuterScheduleName::Constant => OuterSchedule::Constant,
                OuterScheduleName::Cosine => OuterSchedule::Cosine { min_ratio: 0.1 },
            },
            outlier_sigmas: self.outlier_sigmas,
            max_staleness: self.max_staleness,
            lease: Duration::from_secs(self.lease_seconds),
            max_attempts: self.max_attempts.max(1),
            rate_burst: self.rate_burst,
            rate_per_second: self.rate_per_second,
            min_reputation: self.min_reputation,
            verify_fraction: self.verify_fraction,
            verify_min_cosine: self.verify_min_cosine,
            verify_min_cosine_sparse: self.verify_min_cosine_sparse,
            eval_windows: self.eval_windows,
            plan: TrainingPlan {
                inner_steps: self.inner_steps.max(1),
                learning_rate: self.inner_lr,
                warmup_steps: self.inner_warmup_steps,
                weight_decay: 0.1,
                beta1: 0.9,
                beta2: 0.95,
                grad_clip: 1.0,
                seed: 0,
            },
            heartbeat: Duration::from_secs(self.heartbeat_seconds),
            norm_bound: (self.norm_bound > 0.0).then_some(self.norm_bound),
            max_loss_increase: self.max_loss_increase,
            probation_agreements: self.probation_agreements,
            challenge_bits: self.challenge_bits,
            register_burst: self.register_burst,
            register_per_second: self.register_per_hour / 3600.0,
            ip_burst: self.ip_burst,
            ip_per_second: self.ip_per_second,
            client_ip_header,
            failed_cooldown: Duration::from_secs(self.failed_cooldown),
            ws_max_connections: self.ws_max_connections,
        })
    }
}
