//! A small typed client of the hub, used by `hrm worker`, the hub's tests and `hrm bench hub`.

use crate::messages::*;
use bytes::Bytes;
use reqwest::{Method, StatusCode, Url};
use uuid::Uuid;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("bad hub URL: {0}")]
    Url(String),
    #[error("could not compute the registration proof: {0}")]
    Proof(String),
    #[error("cannot reach the hub: {0}")]
    Transport(#[from] reqwest::Error),
    /// The hub answered with its error body.
    #[error("hub answered {status} ({code}): {message}")]
    Api {
        status: StatusCode,
        code: String,
        message: String,
        /// The `Retry-After` header in seconds, when the hub sent one (rate limits, no batch).
        retry_after: Option<u64>,
    },
}

impl ClientError {
    /// The error code of an API error (`stale_update`, `rate_limited`, …).
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Api { code, .. } => Some(code),
            _ => None,
        }
    }

    pub fn status(&self) -> Option<StatusCode> {
        match self {
            ClientError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// How long the hub asked the client to wait before trying again.
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        match self {
            ClientError::Api { retry_after, .. } => retry_after.map(std::time::Duration::from_secs),
            _ => None,
        }
    }
}

/// A worker's (or an operator's) connection to one hub.
#[derive(Debug, Clone)]
pub struct HubClient {
    http: reqwest::Client,
    base: Url,
    api_key: String,
}

/// Makes ring the TLS crypto provider of this process, if none is yet. reqwest is built without
/// a bundled provider (its default, aws-lc, is a C library that takes a minute to compile), so
/// this must run before any HTTP client is built; calling it again does nothing.
pub fn install_tls_provider() {
    // An error means a provider is already installed, which is all this asks for.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

impl HubClient {
    /// `base_url` is the hub's address (`http://127.0.0.1:8090`); `api_key` is sent as
    /// `Authorization: Bearer` on every request.
    pub fn new(base_url: &str, api_key: impl Into<String>) -> Result<Self, ClientError> {
        let mut base = Url::parse(base_url).map_err(|e| ClientError::Url(e.to_string()))?;
        if !base.path().ends_with('/') {
            base.set_path(&format!("{}/", base.path()));
        }
        install_tls_provider();
        Ok(Self {
            http: reqwest::Client::new(),
            base,
            api_key: api_key.into(),
        })
    }

    pub fn with_http_client(mut self, http: reqwest::Client) -> Self {
        self.http = http;
        self
    }

    pub fn api_key(&self) -> &str {
        &self.api_key
    }

    /// Resolves a URL the hub returned: relative ones against the hub, absolute ones as they are.
    pub fn resolve(&self, url: &str) -> Result<Url, ClientError> {
        self.base
            .join(url.trim_start_matches('/'))
            .map_err(|e| ClientError::Url(e.to_string()))
    }

    fn request(&self, method: Method, path: &str) -> Result<reqwest::RequestBuilder, ClientError> {
        Ok(self
            .http
            .request(method, self.resolve(path)?)
            .bearer_auth(&self.api_key))
    }

    async fn send<T: serde::de::DeserializeOwned>(
        builder: reqwest::RequestBuilder,
    ) -> Result<T, ClientError> {
        Ok(checked(builder.send().await?).await?.json().await?)
    }

    pub async fn register(
        &self,
        username: Option<&str>,
        hardware_info: Option<serde_json::Value>,
    ) -> Result<RegisterResponse, ClientError> {
        let challenge: Challenge =
            Self::send(self.request(Method::GET, "api/v1/auth/challenge")?).await?;
        let proof = if challenge.bits == 0 {
            None
        } else {
            // About 2^bits hashes: seconds of one core, off the async runtime's threads.
            let (key, text, bits) = (
                self.api_key.clone(),
                challenge.challenge.clone(),
                challenge.bits,
            );
            let nonce = tokio::task::spawn_blocking(move || crate::pow::solve(&text, &key, bits))
                .await
                .map_err(|e| ClientError::Proof(e.to_string()))?;
            Some(crate::pow::Proof {
                challenge: challenge.challenge,
                nonce,
            })
        };
        let body = RegisterRequest {
            api_key: self.api_key.clone(),
            username: username.map(str::to_string),
            hardware_info,
            proof,
        };
        Self::send(
            self.request(Method::POST, "api/v1/auth/register")?
                .json(&body),
        )
        .await
    }

    pub async fn login(&self) -> Result<LoginResponse, ClientError> {
        Self::send(self.request(Method::POST, "api/v1/auth/login")?).await
    }

    pub async fn current_model(&self) -> Result<ModelVersionInfo, ClientError> {
        Self::send(self.request(Method::GET, "api/v1/model/current")?).await
    }

    pub async fn versions(&self) -> Result<Vec<ModelVersionInfo>, ClientError> {
        Self::send(self.request(Method::GET, "api/v1/model/versions")?).await
    }

    /// Downloads a file the hub named: a checkpoint, or a batch (the hub's route or a
    /// presigned URL, which gets no key).
    pub async fn download(&self, url: &str) -> Result<Bytes, ClientError> {
        Ok(self.download_from(url, 0).await?.bytes().await?)
    }

    /// Starts a download at byte `offset` (a `Range` request when it is not 0). The answer is
    /// `206 Partial Content` when the server resumed, `200` when it sends the whole file.
    pub async fn download_from(
        &self,
        url: &str,
        offset: u64,
    ) -> Result<reqwest::Response, ClientError> {
        let mut builder = if url.starts_with('/') {
            self.request(Method::GET, url)?
        } else {
            self.http.get(self.resolve(url)?)
        };
        if offset > 0 {
            builder = builder.header(reqwest::header::RANGE, format!("bytes={offset}-"));
        }
        checked(builder.send().await?).await
    }

    /// Leases the next batch; `None` when the hub has none to give (`204`).
    pub async fn request_batch(
        &self,
        worker_id: Uuid,
        hardware: Hardware,
    ) -> Result<Option<BatchAssignment>, ClientError> {
        let response = self
            .request(Method::POST, "api/v1/batch/request")?
            .json(&BatchRequest {
                worker_id,
                hardware,
            })
            .send()
            .await?;
        let response = checked(response).await?;
        if response.status() == StatusCode::NO_CONTENT {
            return Ok(None);
        }
        Ok(Some(response.json().await?))
    }

    pub async fn upload_target(
        &self,
        worker_id: Uuid,
        batch_id: Uuid,
    ) -> Result<UploadTarget, ClientError> {
        let body = UploadUrlRequest {
            worker_id,
            batch_id,
        };
        Self::send(
            self.request(Method::POST, "api/v1/gradients/upload-url")?
                .json(&body),
        )
        .await
    }

    /// PUTs an update file where `target` says.
    pub async fn put_update(
        &self,
        target: &UploadTarget,
        bytes: Vec<u8>,
    ) -> Result<(), ClientError> {
        let method = Method::from_bytes(target.method.as_bytes())
            .map_err(|e| ClientError::Url(e.to_string()))?;
        let mut builder = self
            .http
            .request(method, self.resolve(&target.url)?)
            .body(bytes);
        // The hub's own upload route (a relative URL) takes the worker's key; a presigned
        // URL must not see it.
        if target.url.starts_with('/') {
            builder = builder.bearer_auth(&self.api_key);
        }
        for (name, value) in &target.headers {
            builder = builder.header(name, value);
        }
        checked(builder.send().await?).await?;
        Ok(())
    }

    pub async fn upload_gradients(
        &self,
        upload: &GradientUpload,
    ) -> Result<UploadReceipt, ClientError> {
        Self::send(
            self.request(Method::POST, "api/v1/gradients/upload")?
                .json(upload),
        )
        .await
    }

    pub async fn global_stats(&self) -> Result<GlobalStats, ClientError> {
        Self::send(self.request(Method::GET, "api/v1/stats/global")?).await
    }

    pub async fn worker_stats(&self) -> Result<WorkerStats, ClientError> {
        Self::send(self.request(Method::GET, "api/v1/worker/stats")?).await
    }

    pub async fn leaderboard(&self) -> Result<Vec<LeaderboardEntry>, ClientError> {
        Self::send(self.request(Method::GET, "api/v1/leaderboard")?).await
    }

    /// Triggers an aggregation; needs the hub's admin key as this client's key.
    pub async fn aggregate(&self) -> Result<AggregateOutcome, ClientError> {
        Self::send(self.request(Method::POST, "api/v1/aggregate")?).await
    }
}

/// Turns a non-2xx answer into [`ClientError::Api`], reading the hub's error body.
async fn checked(response: reqwest::Response) -> Result<reqwest::Response, ClientError> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let retry_after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok());
    let text = response.text().await.unwrap_or_default();
    let (code, message) = match serde_json::from_str::<ErrorBody>(&text) {
        Ok(body) => (body.error.code, body.error.message),
        Err(_) => ("http_error".to_string(), text),
    };
    Err(ClientError::Api {
        status,
        code,
        message,
        retry_after,
    })
}
