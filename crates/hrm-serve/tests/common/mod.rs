//! A real server on 127.0.0.1 for the integration tests, with the tiny fixture models.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use hrm_model::{DeviceRequest, Engine};
use hrm_serve::ServeConfig;
use hrm_serve::scheduler::Faults;
use serde_json::Value;
use tokio::sync::oneshot;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

pub fn config(model: &str) -> ServeConfig {
    ServeConfig {
        host: "127.0.0.1".into(),
        port: 0,
        model_path: fixture(model),
        tokenizer_path: None,
        chat_template: None,
        device: DeviceRequest::Cpu,
        max_batch_size: 4,
        max_new_tokens: 24,
        context_window: None,
        max_queued_tokens: 1 << 20,
        backpressure: true,
        max_request_tokens: 262_144,
        max_logprob_entries: 262_144,
        score_chunk_tokens: 2048,
        max_body_bytes: 64 * 1024,
        log_level: "info".into(),
        api_key: None,
        metrics_auth: false,
        enable_cors: false,
        cors_origins: Vec::new(),
        ui: false,
        connections: hrm_http::ConnectionLimits::default(),
        config_file: None,
    }
}

pub struct Server {
    pub base: String,
    stop: Option<oneshot::Sender<()>>,
    done: tokio::task::JoinHandle<anyhow::Result<()>>,
    pub client: reqwest::Client,
}

impl Server {
    pub async fn start(config: ServeConfig) -> Self {
        Self::start_with_faults(config, Faults::default()).await
    }

    /// A server whose scheduler fails or panics on prompts holding the given token ids.
    pub async fn start_with_faults(config: ServeConfig, faults: Faults) -> Self {
        hrm_wire::install_tls_provider();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = oneshot::channel::<()>();
        let done = tokio::spawn(hrm_serve::run_with_faults(
            config,
            listener,
            async {
                let _ = stopped.await;
            },
            faults,
        ));
        let server = Self {
            base,
            stop: Some(stop),
            done,
            client: reqwest::Client::new(),
        };
        server.wait_ready().await;
        server
    }

    pub async fn wait_ready(&self) {
        for _ in 0..500 {
            let r = self
                .client
                .get(format!("{}/readyz", self.base))
                .send()
                .await;
            if let Ok(r) = r
                && r.status() == 200
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the server never became ready");
    }

    /// The response to `GET path`.
    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.client
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .unwrap()
    }

    /// The response to `POST path` with a JSON body.
    pub async fn post_response(&self, path: &str, body: &Value) -> reqwest::Response {
        self.client
            .post(format!("{}{path}", self.base))
            .json(body)
            .send()
            .await
            .unwrap()
    }

    /// The status and JSON body of `POST path`.
    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self.post_response(path, &body).await;
        (r.status().as_u16(), r.json().await.unwrap())
    }

    pub async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.done.await.unwrap().unwrap();
    }
}

pub fn reference_engine(model: &str) -> Engine {
    let loaded = hrm_model::load_model(
        &fixture(model),
        None,
        &candle_core::Device::Cpu,
        candle_core::DType::F32,
    )
    .unwrap();
    Engine::new(loaded, None).unwrap()
}

impl Server {
    /// The value of a counter or a histogram's `_count` in `/metrics`, 0 when absent. Each test
    /// binary is its own process, so its metrics are its own.
    /// The `/metrics` page.
    pub async fn metrics_text(&self) -> String {
        self.get("/metrics").await.text().await.unwrap()
    }

    pub async fn metric(&self, name: &str) -> f64 {
        let text = self.metrics_text().await;
        text.lines()
            .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Tokens of admitted, unfinished work on this server (from `/readyz`).
    pub async fn queued_tokens(&self) -> u64 {
        let body: Value = self.get("/readyz").await.json().await.unwrap();
        body["queued_tokens"].as_u64().unwrap_or(0)
    }

    /// Polls `/readyz` until this server holds at least `at_least` tokens of work.
    pub async fn wait_for_queued_tokens(&self, at_least: u64) {
        for _ in 0..2000 {
            if self.queued_tokens().await >= at_least {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("the server never held {at_least} tokens of work");
    }

    /// Polls `/readyz` until this server holds no work.
    pub async fn wait_for_no_queued_tokens(&self) {
        for _ in 0..2000 {
            if self.queued_tokens().await == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("the server still holds work");
    }

    /// Polls `/metrics` until `name` reaches `at_least`.
    pub async fn wait_for_metric(&self, name: &str, at_least: f64) {
        for _ in 0..1000 {
            if self.metric(name).await >= at_least {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("{name} never reached {at_least}");
    }
}
