//! `hrm serve`: the HTTP inference service (specification: `shared/spec/inference-service.md`).
//!
//! This crate owns the v1 contract (`/generate`, `/loglikelihood`, `/healthz`, `/readyz`,
//! `/metrics`), the OpenAI-compatible routes ([`openai`], with chat templates in [`chat`]),
//! request validation ([`validation`]: one path for every route), settings
//! ([`config`]) and the continuous-batching [`scheduler`] that drives `hrm_model::Engine`. The
//! error body, the connection hygiene and the drain on SIGTERM come from `hrm-http`, shared with
//! `hrm hub`.
//!
//! The listener comes up first and `/readyz` answers 503 `{"status":"loading"}` while the model
//! loads in the background; a failed load ends the process with an error. `/readyz` also
//! answers 503 while the scheduler restarts after a fault.

pub mod chat;
pub mod config;
pub mod openai;
pub mod routes;
pub mod scheduler;
pub mod ui;
pub mod validation;

use std::sync::{Arc, OnceLock};

use anyhow::Context;
use axum::Router;
use chat::ChatTemplate;
use hrm_model::Engine;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

pub use config::{ServeArgs, ServeConfig};
use scheduler::{Faults, Scheduler, SchedulerConfig};
use validation::Limits;

/// What every handler can reach. The model parts are set once loading finishes.
#[derive(Clone)]
pub struct AppState {
    ready: Arc<OnceLock<Ready>>,
    pub limits: Limits,
    metrics: PrometheusHandle,
    /// SHA-256 of the bearer key when auth is on: requests are checked by comparing digests in
    /// constant time, so neither the key nor its length leaks through timing.
    key_digest: Option<[u8; 32]>,
    metrics_auth: bool,
}

/// The loaded model and the scheduler in front of it.
#[derive(Clone)]
pub struct Ready {
    pub engine: Arc<Engine>,
    pub scheduler: Scheduler,
    /// `cpu`, `cuda:0`, ...
    pub device: String,
    /// For `/v1/chat/completions`; none for models without one.
    pub chat_template: Option<Arc<ChatTemplate>>,
}

/// A model loaded for serving.
pub struct Loaded {
    pub engine: Engine,
    /// `cpu`, `cuda:0`, ...
    pub device: String,
    pub chat_template: Option<ChatTemplate>,
}

impl AppState {
    pub fn new(config: &ServeConfig) -> Self {
        Self {
            ready: Arc::new(OnceLock::new()),
            limits: config.limits(),
            metrics: metrics_handle(),
            key_digest: config.api_key.as_deref().map(digest),
            metrics_auth: config.metrics_auth,
        }
    }

    /// Whether `path` may be used with the request's `Authorization` header value.
    pub fn authorised(&self, path: &str, authorization: Option<&str>) -> bool {
        use subtle::ConstantTimeEq;
        let Some(expected) = &self.key_digest else {
            return true;
        };
        // The page itself holds no data; the calls it makes carry the key.
        let open = matches!(path, "/healthz" | "/readyz" | "/openapi.json" | "/" | "/ui")
            || (path == "/metrics" && !self.metrics_auth);
        if open {
            return true;
        }
        let Some(token) = authorization.and_then(|v| v.strip_prefix("Bearer ")) else {
            return false;
        };
        digest(token.trim()).ct_eq(expected).into()
    }

    pub fn ready(&self) -> Option<&Ready> {
        self.ready.get()
    }

    /// Marks the service ready with a loaded engine and its scheduler.
    pub fn set_ready(&self, ready: Ready) {
        let _ = self.ready.set(ready);
    }

    pub fn metrics(&self) -> &PrometheusHandle {
        &self.metrics
    }
}

fn digest(key: &str) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(key.as_bytes()).into()
}

/// One Prometheus recorder per process (the `metrics` facade has one global recorder).
fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let buckets = [
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0,
            ];
            let recorder = PrometheusBuilder::new()
                .set_buckets(&buckets)
                .expect("valid buckets")
                .build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed (tests build several states); the handle
            // still renders what this recorder saw.
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}

/// Loads the model named by `config` into an engine, with its chat template.
pub fn load_engine(config: &ServeConfig) -> anyhow::Result<Loaded> {
    let device = hrm_model::select_device(config.device)?;
    let label = hrm_model::device::device_label(&device);
    let loaded = hrm_model::load_model(
        &config.model_path,
        config.tokenizer_path.as_deref(),
        &device,
        candle_core::DType::F32,
    )
    .with_context(|| format!("loading the model from {}", config.model_path.display()))?;
    let engine = Engine::new(loaded, config.context_window)?;
    let chat_template =
        ChatTemplate::for_model(config.chat_template.as_deref(), engine.tokenizer())?;
    Ok(Loaded {
        engine,
        device: label,
        chat_template,
    })
}

/// Marks `state` ready with the loaded model, starting its scheduler.
pub fn attach_engine(state: &AppState, loaded: Loaded, config: &ServeConfig, faults: Faults) {
    let engine = Arc::new(loaded.engine);
    let scheduler = Scheduler::start(
        engine.clone(),
        SchedulerConfig {
            max_batch_size: config.max_batch_size,
            max_queued_tokens: config.max_queued_tokens,
            backpressure: config.backpressure,
            score_chunk_tokens: config.score_chunk_tokens,
        },
        faults,
    );
    state.set_ready(Ready {
        engine,
        scheduler,
        device: loaded.device,
        chat_template: loaded.chat_template.map(Arc::new),
    });
}

/// Runs the service until SIGINT or SIGTERM, then drains in-flight requests and returns.
pub async fn serve(config: ServeConfig) -> anyhow::Result<()> {
    let addr = format!("{}:{}", config.host, config.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    run(config, listener, hrm_http::shutdown_signal()).await
}

/// Serves on `listener` until `shutdown` completes, then stops accepting, lets every in-flight
/// request finish, and returns. The model loads in the background meanwhile; a failed load
/// ends the run with its error.
pub async fn run(
    config: ServeConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    run_with_faults(config, listener, shutdown, Faults::default()).await
}

/// [`run`], with faults injected into the scheduler (tests only).
pub async fn run_with_faults(
    config: ServeConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    faults: Faults,
) -> anyhow::Result<()> {
    let state = AppState::new(&config);
    let limits = config.connections;
    let local = listener.local_addr()?;
    if config.api_key.is_none() && !local.ip().is_loopback() {
        tracing::warn!(
            addr = %local,
            "LISTENING ON A NON-LOOPBACK ADDRESS WITH NO API KEY: anyone who can reach this port can use the model. Set --api-key-file (or HRM_SERVE_API_KEY), or --host 127.0.0.1"
        );
    }
    let app: Router = routes::router(state.clone(), &config);
    tracing::info!(addr = %listener.local_addr()?, model = %config.model_path.display(), "listening; loading the model");

    let started = std::time::Instant::now();
    let load_config = config.clone();
    let loading = tokio::task::spawn_blocking(move || load_engine(&load_config));
    let (failed_tx, mut failed_rx) = tokio::sync::oneshot::channel::<anyhow::Error>();
    let load_state = state.clone();
    tokio::spawn(async move {
        match loading.await {
            Ok(Ok(loaded)) => {
                let engine = &loaded.engine;
                tracing::info!(
                    model = engine.name(),
                    family = engine.info().family.as_str(),
                    format = engine.format(),
                    device = %loaded.device,
                    context_window = engine.context_window(),
                    chat_template = loaded.chat_template.as_ref().map_or("none", |t| t.source.as_str()),
                    seconds = started.elapsed().as_secs_f64(),
                    "model loaded; ready"
                );
                attach_engine(&load_state, loaded, &config, faults);
            }
            Ok(Err(e)) => {
                let _ = failed_tx.send(e);
            }
            Err(e) => {
                let _ = failed_tx.send(anyhow::anyhow!("the loading task failed: {e}"));
            }
        }
    });

    let server = hrm_http::serve(listener, app, &limits, async {
        shutdown.await;
        tracing::info!("shutdown requested; draining in-flight requests");
    });
    tokio::select! {
        result = server => result.context("serving HTTP")?,
        Ok(error) = &mut failed_rx => return Err(error),
    }
    tracing::info!("drained; bye");
    Ok(())
}
