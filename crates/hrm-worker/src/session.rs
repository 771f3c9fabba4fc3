//! The worker loop of the specification: connect, lease a batch, make sure its model version
//! is loaded, train locally (TRAINING), upload the update (UPLOADING), repeat until stopped or
//! until `training.max_batches_per_session`.
//!
//! Faults: each request is tried `training.retry_attempts` times (transport errors, 5xx and
//! 429 only; pauses double from 0.5 s, and last at least the hub's `Retry-After`) with
//! `training.timeout_seconds` per try; a step that still fails is logged, the state stays as it
//! was, the connection is dropped and the loop waits the retry delay (30 s by default) before it
//! reconnects and leases the next batch. The batch in flight is lost:
//! its lease expires on the hub and another worker gets it.
//!
//! Stop: the flag is read between batches only, so the batch in progress is trained and
//! uploaded; then the model is unloaded and the state is IDLE.

use crate::cache::CheckpointCache;
use crate::compress::UpdateEncoder;
use crate::config::{BatchSize, WorkerConfig};
use crate::resources::{MemoryEstimate, ResourceArgs};
use crate::status::{BatchProgress, Status, WorkerState};
use anyhow::{Context, Result, anyhow, bail};
use backon::{ExponentialBuilder, Retryable as _};
use candle_core::{Device, Tensor};
use hrm_model::ModelSpec;
use hrm_model::train::{LocalTraining, TrainedUpdate, to_tensors, train_on_batch};
use hrm_wire::samples::decode_samples;
use hrm_wire::update::{Schema, read_checkpoint};
use hrm_wire::{
    BatchAssignment, ClientError, GradientUpload, Hardware, HubClient, ModelVersionInfo,
};
use reqwest::StatusCode;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use uuid::Uuid;

/// Rows per forward pass that `batch_size: auto` never exceeds without `--max-batch-size`.
const AUTO_ROWS_CAP: usize = 64;

/// Everything the loop is configured with.
#[derive(Debug, Clone)]
pub struct Settings {
    pub config: WorkerConfig,
    pub username: Option<String>,
    /// Pause after a failed step (the specification's 30 seconds).
    pub retry_delay: Duration,
    pub resources: ResourceArgs,
    pub cache_dir: PathBuf,
}

/// Why a session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionEnd {
    Stopped,
    MaxBatches,
}

/// A model version in memory, ready to train.
struct LoadedModel {
    version: String,
    spec: ModelSpec,
    schema: Arc<Schema>,
    weights: Arc<HashMap<String, Tensor>>,
}

enum StepOutcome {
    Uploaded,
    /// The hub has no batch to lease now.
    NoBatch,
    /// The hub did not take the update (a stale version, a lost lease); no retry helps.
    BatchLost,
}

pub struct Worker {
    settings: Settings,
    client: HubClient,
    status: Status,
    cache: CheckpointCache,
    device: Device,
    encoder: UpdateEncoder,
    worker_id: Option<Uuid>,
    model: Option<LoadedModel>,
}

impl Worker {
    pub fn new(settings: Settings, device: Device, status: Status) -> Result<Self> {
        settings.config.validate()?;
        settings.resources.validate()?;
        hrm_wire::install_tls_provider();
        let http = reqwest::Client::builder()
            .timeout(settings.config.timeout())
            .connect_timeout(settings.config.timeout().min(Duration::from_secs(10)))
            .build()?;
        let client = HubClient::new(
            &settings.config.server.url,
            settings.config.server.api_key.clone(),
        )?
        .with_http_client(http);
        let encoder = UpdateEncoder::new(
            settings.config.uploads.compress_gradients,
            settings.config.uploads.compression_ratio,
        );
        Ok(Self {
            cache: CheckpointCache::new(&settings.cache_dir)?,
            settings,
            client,
            status,
            device,
            encoder,
            worker_id: None,
            model: None,
        })
    }

    pub fn client(&self) -> &HubClient {
        &self.client
    }

    /// Runs one session: from IDLE through batches until `stop` turns true (the batch in
    /// progress is finished and uploaded first) or the session's batch limit is reached.
    pub async fn run_session(&mut self, mut stop: watch::Receiver<bool>) -> SessionEnd {
        let limit = self.settings.config.training.max_batches_per_session;
        self.status.update(|v| {
            v.running = true;
            v.stopping = false;
            v.session = Default::default();
        });
        self.status.info(format!(
            "training started (up to {limit} batches this session)"
        ));
        let mut uploaded = 0;
        let end = loop {
            if *stop.borrow() {
                break SessionEnd::Stopped;
            }
            if uploaded >= limit {
                break SessionEnd::MaxBatches;
            }
            let pause = match self.step().await {
                Ok(StepOutcome::Uploaded) => {
                    uploaded += 1;
                    None
                }
                Ok(StepOutcome::BatchLost) => None,
                Ok(StepOutcome::NoBatch) => {
                    self.status.set_activity("waiting for a batch");
                    Some(self.settings.retry_delay)
                }
                Err(e) => {
                    self.status.error(format!(
                        "{e:#}; retrying in {:.0?}",
                        self.settings.retry_delay
                    ));
                    self.status.update(|v| {
                        v.connected = false;
                        if v.batch.take().is_some() {
                            v.session.lost_batches += 1;
                        }
                    });
                    self.status.set_activity("waiting to retry");
                    self.worker_id = None;
                    Some(self.settings.retry_delay)
                }
            };
            if let Some(pause) = pause
                && wait_or_stop(&mut stop, pause).await
            {
                break SessionEnd::Stopped;
            }
        };
        // Unload: the weights go now, the cached file stays for the next session.
        self.model = None;
        self.status.update(|v| {
            v.running = false;
            v.stopping = false;
            v.model_version = None;
            v.batch = None;
            v.activity = "stopped".into();
        });
        self.status.set_state(WorkerState::Idle);
        self.status.info(match end {
            SessionEnd::Stopped => format!("stopped after {uploaded} batches; model unloaded"),
            SessionEnd::MaxBatches => {
                format!("reached max_batches_per_session ({limit}); model unloaded")
            }
        });
        end
    }

    async fn step(&mut self) -> Result<StepOutcome> {
        let worker_id = self.connect().await?;
        self.status.set_activity("requesting a batch");
        let hardware = self.hardware();
        let leased = self
            .retrying("batch request", || {
                self.client.request_batch(worker_id, hardware.clone())
            })
            .await?;
        let Some(batch) = leased else {
            return Ok(StepOutcome::NoBatch);
        };
        self.status.info(format!(
            "leased batch {} ({} samples, model {})",
            batch.batch_id, batch.num_samples, batch.model_version
        ));
        self.ensure_model(&batch.model_version).await?;
        self.status.set_activity("downloading the batch");
        let data = self
            .retrying("batch download", || self.client.download(&batch.data_url))
            .await?;
        let samples = decode_samples(&data).context("reading the batch file")?;
        if samples.is_empty() {
            bail!("batch {} has no samples", batch.batch_id);
        }
        let trained = self.train(&batch, samples).await?;
        self.upload(worker_id, &batch, trained).await
    }

    /// Logs in, registering this key first if the hub does not know it.
    async fn connect(&mut self) -> Result<Uuid> {
        if let Some(id) = self.worker_id {
            return Ok(id);
        }
        self.status.set_activity("connecting");
        let login = match self.retrying("login", || self.client.login()).await {
            Err(e) if e.status() == Some(StatusCode::UNAUTHORIZED) => {
                self.status
                    .info("this API key is new to the hub; registering");
                let hardware = serde_json::to_value(self.hardware())?;
                let username = self.settings.username.clone();
                match self
                    .retrying("register", || {
                        self.client
                            .register(username.as_deref(), Some(hardware.clone()))
                    })
                    .await
                {
                    Err(e) if e.code() != Some("already_registered") => return Err(e.into()),
                    _ => {}
                }
                self.retrying("login", || self.client.login()).await?
            }
            other => other?,
        };
        self.status.info(format!(
            "connected to {} as {} (reputation {:.2})",
            self.settings.config.server.url,
            login.username.as_deref().unwrap_or("an anonymous worker"),
            login.reputation_score
        ));
        self.status.update(|v| {
            v.connected = true;
            v.worker_id = Some(login.worker_id);
            v.username = login.username.clone();
            v.network_version = login.current_version.clone();
        });
        self.worker_id = Some(login.worker_id);
        Ok(login.worker_id)
    }

    fn hardware(&self) -> Hardware {
        Hardware {
            gpu: self
                .device
                .is_cuda()
                .then(|| hrm_model::device::device_label(&self.device)),
            vram_gb: None,
            batch_size: self.status.lock().micro_batch.map(|rows| rows as u32),
        }
    }

    /// Loads `version` unless it is the one in memory: from the cache, or downloaded.
    async fn ensure_model(&mut self, version: &str) -> Result<()> {
        if self.model.as_ref().is_some_and(|m| m.version == version) {
            return Ok(());
        }
        self.model = None;
        self.status.update(|v| v.model_version = None);
        let info = self.version_info(version).await?;
        let (bytes, cached) = self
            .retrying("checkpoint download", || {
                let status = self.status.clone();
                let label = info.version.clone();
                self.cache.fetch(&self.client, &info, move |done, total| {
                    status.set_activity(match total {
                        Some(total) if total > 0 => format!(
                            "downloading {label} ({:.0}%)",
                            100.0 * done as f64 / total as f64
                        ),
                        _ => format!("downloading {label} ({} KiB)", done >> 10),
                    })
                })
            })
            .await
            .with_context(|| format!("fetching the checkpoint of {version}"))?;
        let spec = ModelSpec::from_config_json(
            &info.config.to_string(),
            std::path::Path::new("the hub's config.json"),
        )?;
        let device = self.device.clone();
        let (schema, weights) = tokio::task::spawn_blocking(move || -> Result<_> {
            let (schema, flat) = read_checkpoint(&bytes)?;
            let weights = to_tensors(&schema, &flat, &device)?;
            Ok((schema, weights))
        })
        .await??;
        self.status.info(format!(
            "loaded {version} ({} parameters{})",
            schema.num_parameters(),
            if cached { ", from the cache" } else { "" }
        ));
        self.status
            .update(|v| v.model_version = Some(version.to_string()));
        self.model = Some(LoadedModel {
            version: version.to_string(),
            spec,
            schema: Arc::new(schema),
            weights: Arc::new(weights),
        });
        Ok(())
    }

    async fn version_info(&self, version: &str) -> Result<ModelVersionInfo> {
        let current = self
            .retrying("model lookup", || self.client.current_model())
            .await?;
        if current.version == version {
            return Ok(current);
        }
        self.retrying("version list", || self.client.versions())
            .await?
            .into_iter()
            .find(|v| v.version == version)
            .ok_or_else(|| anyhow!("the hub does not list version {version}"))
    }

    /// Rows per forward pass for this model and sequence length.
    fn micro_batch(&self, model: &LoadedModel, seq_len: usize) -> Result<usize> {
        let cap = self.settings.resources.max_batch_size;
        Ok(match self.settings.config.training.batch_size {
            BatchSize::Rows(rows) => rows.min(cap.unwrap_or(usize::MAX)),
            BatchSize::Auto => {
                let budget = self.settings.resources.memory_budget(&self.device)?;
                MemoryEstimate::of(&model.spec, model.schema.num_parameters(), seq_len)
                    .rows_within(budget, cap.unwrap_or(AUTO_ROWS_CAP))?
            }
        })
    }

    async fn train(
        &mut self,
        batch: &BatchAssignment,
        samples: Vec<Vec<u32>>,
    ) -> Result<TrainedUpdate> {
        let model = self.model.as_ref().expect("ensure_model ran");
        let seq_len = samples
            .iter()
            .map(Vec::len)
            .max()
            .unwrap_or(1)
            .saturating_sub(1);
        let micro_batch = self.micro_batch(model, seq_len)?;
        let plan = LocalTraining::from_plan(&batch.plan, micro_batch);
        let per_step = samples.len().div_ceil(plan.inner_steps.max(1));
        let steps = samples.len().div_ceil(per_step.max(1));
        self.status.update(|v| {
            v.micro_batch = Some(micro_batch);
            v.batch = Some(BatchProgress {
                batch_id: batch.batch_id,
                model_version: batch.model_version.clone(),
                samples: samples.len(),
                step: 0,
                steps,
            });
        });
        self.status.set_activity(format!(
            "training batch {} ({micro_batch} rows per pass)",
            batch.batch_id
        ));
        self.status.set_state(WorkerState::Training);
        let (spec, schema, weights) = (
            model.spec.clone(),
            model.schema.clone(),
            model.weights.clone(),
        );
        let device = self.device.clone();
        let status = self.status.clone();
        let started = Instant::now();
        let trained = tokio::task::spawn_blocking(move || {
            let mut tokens = 0usize;
            train_on_batch(
                &spec,
                &schema,
                &weights,
                &samples,
                &plan,
                &device,
                |step, report| {
                    tokens += report.tokens;
                    let rate = tokens as f64 / started.elapsed().as_secs_f64().max(1e-9);
                    status.update(|v| {
                        if let Some(batch) = v.batch.as_mut() {
                            batch.step = step + 1;
                        }
                        v.last_loss = Some(f64::from(report.loss));
                        v.tokens_per_second = Some(rate);
                        v.session.tokens += report.tokens as u64;
                    });
                },
            )
        })
        .await??;
        self.status.info(format!(
            "trained batch {}: loss {:.4}, {} tokens in {:.1}s ({:.0} tokens/s)",
            batch.batch_id,
            trained.mean_loss,
            trained.tokens,
            started.elapsed().as_secs_f64(),
            trained.tokens as f64 / started.elapsed().as_secs_f64().max(1e-9)
        ));
        Ok(trained)
    }

    async fn upload(
        &mut self,
        worker_id: Uuid,
        batch: &BatchAssignment,
        trained: TrainedUpdate,
    ) -> Result<StepOutcome> {
        self.status.set_state(WorkerState::Uploading);
        self.status.set_activity("uploading the update");
        let schema = self.model.as_ref().expect("loaded").schema.clone();
        let encoded = self
            .encoder
            .encode(&schema, &trained.flat, &batch.model_version)?;
        let size = encoded.bytes.len() as u64;
        let result = async {
            let target = self
                .retrying("upload URL", || {
                    self.client.upload_target(worker_id, batch.batch_id)
                })
                .await?;
            if size > target.max_bytes {
                bail!(
                    "the update is {size} bytes, over the hub's limit of {}",
                    target.max_bytes
                );
            }
            self.retrying("update upload", || {
                self.client.put_update(&target, encoded.bytes.clone())
            })
            .await?;
            let upload = GradientUpload {
                worker_id,
                batch_id: batch.batch_id,
                model_version: batch.model_version.clone(),
                gradients_url: target.gradients_url.clone(),
                loss: trained.mean_loss,
                num_samples: batch.num_samples,
            };
            Ok(self
                .retrying("upload receipt", || self.client.upload_gradients(&upload))
                .await?)
        }
        .await;
        let receipt = match result {
            Ok(receipt) => receipt,
            Err(e) => {
                let code = e.downcast_ref::<ClientError>().and_then(ClientError::code);
                match code {
                    Some("stale_update") => {
                        self.status.warn(format!(
                            "the hub moved past {}; downloading the current version",
                            batch.model_version
                        ));
                        self.model = None;
                    }
                    Some("lease_lost" | "batch_done") => {
                        self.status.warn(format!(
                            "batch {} went to another worker: {e:#}",
                            batch.batch_id
                        ));
                    }
                    _ => return Err(e),
                }
                self.status.update(|v| {
                    v.session.lost_batches += 1;
                    v.batch = None;
                });
                return Ok(StepOutcome::BatchLost);
            }
        };
        self.encoder.accept(encoded);
        self.status.update(|v| {
            v.session.batches += 1;
            v.session.upload_bytes += size;
            v.batch = None;
        });
        self.status.info(format!(
            "uploaded batch {} ({} KiB{}){}",
            batch.batch_id,
            size >> 10,
            if self.settings.config.uploads.compress_gradients {
                ", top-k"
            } else {
                ""
            },
            if receipt.duplicate {
                "; the hub already had it"
            } else {
                ""
            }
        ));
        crate::network::refresh_contribution(&self.client, &self.status).await;
        Ok(StepOutcome::Uploaded)
    }

    async fn retrying<T, E, F, Fut>(&self, what: &str, call: F) -> Result<T, E>
    where
        E: Retryable + std::fmt::Display,
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, E>>,
    {
        let attempts = self.settings.config.training.retry_attempts.max(1);
        let backoff = ExponentialBuilder::default()
            .with_min_delay(FIRST_RETRY_DELAY)
            .with_max_times(attempts as usize - 1);
        let mut next_attempt = 1;
        call.retry(backoff)
            .sleep(tokio::time::sleep)
            .when(|e: &E| e.transient())
            // The hub's Retry-After (its rate limit) wins over our own backoff, up to a cap, so
            // that a confused hub cannot park the worker for days.
            .adjust(|e: &E, backoff| {
                backoff.map(|ours| {
                    e.retry_after()
                        .map_or(ours, |asked| asked.min(MAX_RETRY_AFTER).max(ours))
                })
            })
            .notify(|e: &E, pause| {
                next_attempt += 1;
                self.status.warn(format!(
                    "{what} failed ({e:#}); try {next_attempt} of {attempts} in {:.1}s",
                    pause.as_secs_f64()
                ));
            })
            .await
    }
}

/// The pause before the second try; each later pause doubles it.
const FIRST_RETRY_DELAY: Duration = Duration::from_millis(500);

/// The longest `Retry-After` the worker honours.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(300);

/// Errors another try may cure: the network, the hub's own failures, its rate limit.
trait Retryable {
    fn transient(&self) -> bool;
    fn retry_after(&self) -> Option<Duration>;
}

impl Retryable for ClientError {
    fn transient(&self) -> bool {
        match self {
            ClientError::Transport(_) => true,
            ClientError::Api { status, .. } => {
                status.is_server_error() || *status == StatusCode::TOO_MANY_REQUESTS
            }
            ClientError::Url(_) | ClientError::Proof(_) => false,
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        ClientError::retry_after(self)
    }
}

/// A download streamed to disk: transient when the hub's answer was, or the stream broke.
impl Retryable for anyhow::Error {
    fn transient(&self) -> bool {
        self.chain().any(|cause| {
            cause
                .downcast_ref::<ClientError>()
                .is_some_and(Retryable::transient)
                || cause.is::<reqwest::Error>()
        })
    }

    fn retry_after(&self) -> Option<Duration> {
        self.chain()
            .find_map(|cause| cause.downcast_ref::<ClientError>()?.retry_after())
    }
}

/// Waits `pause` unless stop is asked for first; true when it was.
async fn wait_or_stop(stop: &mut watch::Receiver<bool>, pause: Duration) -> bool {
    if *stop.borrow() {
        return true;
    }
    tokio::select! {
        _ = tokio::time::sleep(pause) => false,
        changed = stop.wait_for(|stop| *stop) => changed.is_ok(),
    }
}
