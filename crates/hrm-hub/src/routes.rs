//! The HTTP interface under `/api/v1` (every route, body and status in `docs/hub-api.md`), the
//! WebSocket status feed and the dashboard. Handlers are small: they check who is asking and
//! hand over to the module that owns the work.

use crate::Hub;
use crate::error::{ApiError, ApiResult};
use crate::workers::{Admin, Worker};
use crate::{aggregator, batches, updates, versions, workers};
use axum::body::Bytes;
use axum::extract::rejection::JsonRejection;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{DefaultBodyLimit, FromRequest, Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use hrm_wire::*;
use std::sync::Arc;
use std::time::Instant;
use tower_http::trace::TraceLayer;
use uuid::Uuid;

/// JSON bodies whose parse errors come back in the hub's error shape.
pub struct Body<T>(pub T);

impl<T: serde::de::DeserializeOwned, S: Send + Sync> FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> ApiResult<Self> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(value)) => Ok(Body(value)),
            Err(JsonRejection::BytesRejection(_)) => {
                Err(ApiError::too_large(MAX_JSON_BYTES as u64))
            }
            Err(e) => Err(ApiError::invalid("invalid_json", e.body_text())),
        }
    }
}

/// Limit of JSON request bodies.
const MAX_JSON_BYTES: usize = 64 * 1024;

pub fn router(hub: Arc<Hub>) -> Router {
    // The update upload route takes model-sized bodies; its own limit is checked against the
    // model in `updates::put_blob`, this one only stops bodies beyond any model.
    let blob_limit = DefaultBodyLimit::max(4 << 30);
    Router::new()
        .route("/", get(dashboard))
        .route("/healthz", get(|| async { "ok" }))
        .route("/api/v1/auth/register", post(register))
        .route("/api/v1/auth/login", post(login))
        .route("/api/v1/model/current", get(current_model))
        .route("/api/v1/model/versions", get(model_versions))
        .route("/api/v1/model/download/{version}", get(download))
        .route("/api/v1/batch/request", post(request_batch))
        .route("/api/v1/batch/data/{batch_id}", get(batch_data))
        .route("/api/v1/gradients/upload-url", post(upload_url))
        .route(
            "/api/v1/gradients/blob/{batch_id}",
            put(put_blob).layer(blob_limit),
        )
        .route("/api/v1/gradients/upload", post(upload))
        .route("/api/v1/stats/global", get(global_stats))
        .route("/api/v1/worker/stats", get(worker_stats))
        .route("/api/v1/leaderboard", get(leaderboard))
        .route("/api/v1/ws/status", get(ws_status))
        .route("/api/v1/aggregate", post(aggregate))
        .fallback(|| async {
            ApiError::not_found("no_route", "no such route; see docs/hub-api.md")
        })
        .layer(DefaultBodyLimit::max(MAX_JSON_BYTES))
        .layer(TraceLayer::new_for_http())
        .with_state(hub)
}

async fn dashboard() -> Html<&'static str> {
    Html(include_str!("dashboard.html"))
}

async fn register(
    State(hub): State<Arc<Hub>>,
    Body(request): Body<RegisterRequest>,
) -> ApiResult<(StatusCode, Json<RegisterResponse>)> {
    Ok((
        StatusCode::CREATED,
        Json(workers::register(&hub, request).await?),
    ))
}

async fn login(State(hub): State<Arc<Hub>>, worker: Worker) -> ApiResult<Json<LoginResponse>> {
    Ok(Json(LoginResponse {
        worker_id: worker.id,
        username: worker.username,
        reputation_score: worker.reputation_score,
        total_batches: worker.total_batches,
        current_version: versions::current_version(&hub).await?,
        server_time: chrono::Utc::now(),
    }))
}

async fn current_model(State(hub): State<Arc<Hub>>) -> ApiResult<Json<ModelVersionInfo>> {
    let row = versions::current_row(&hub).await?.ok_or_else(|| {
        ApiError::not_found("no_model", "this hub has no model yet (`hrm hub init`)")
    })?;
    Ok(Json(row.info()))
}

async fn model_versions(State(hub): State<Arc<Hub>>) -> ApiResult<Json<Vec<ModelVersionInfo>>> {
    Ok(Json(
        versions::all_versions(&hub)
            .await?
            .iter()
            .map(|r| r.info())
            .collect(),
    ))
}

/// A checkpoint, with its SHA-256 as a strong `ETag` so workers can cache it, and a single
/// `Range: bytes=start-[end]` so that a cut-off download resumes.
async fn download(
    State(hub): State<Arc<Hub>>,
    _worker: Worker,
    Path(version): Path<String>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let row = versions::version_row(&hub, &version)
        .await?
        .ok_or_else(|| ApiError::not_found("unknown_version", format!("no version {version}")))?;
    let etag = format!("\"{}\"", row.sha256);
    let cached = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == etag));
    let etag_header = HeaderValue::from_str(&etag).map_err(anyhow::Error::from)?;
    if cached {
        return Ok((StatusCode::NOT_MODIFIED, [(header::ETAG, etag_header)]).into_response());
    }
    let bytes = hub.blobs.get(&row.checkpoint_key).await?;
    let total = bytes.len() as u64;
    let common = [
        (header::ETAG, etag_header),
        (
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/octet-stream"),
        ),
        (
            header::CACHE_CONTROL,
            HeaderValue::from_static("public, max-age=31536000, immutable"),
        ),
        (header::ACCEPT_RANGES, HeaderValue::from_static("bytes")),
    ];
    let range = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(parse_byte_range);
    Ok(match range {
        None => (common, bytes).into_response(),
        Some((start, end)) => {
            let end = end.unwrap_or(u64::MAX).min(total.saturating_sub(1));
            if start >= total || start > end {
                let unsatisfied = HeaderValue::from_str(&format!("bytes */{total}"))
                    .map_err(anyhow::Error::from)?;
                return Ok((
                    StatusCode::RANGE_NOT_SATISFIABLE,
                    [(header::CONTENT_RANGE, unsatisfied)],
                )
                    .into_response());
            }
            let content_range = HeaderValue::from_str(&format!("bytes {start}-{end}/{total}"))
                .map_err(anyhow::Error::from)?;
            (
                StatusCode::PARTIAL_CONTENT,
                common,
                [(header::CONTENT_RANGE, content_range)],
                bytes.slice(start as usize..=end as usize),
            )
                .into_response()
        }
    })
}

/// `bytes=start-` or `bytes=start-end`; other forms (suffixes, several ranges) are answered
/// with the whole file, as HTTP allows.
fn parse_byte_range(value: &str) -> Option<(u64, Option<u64>)> {
    let (start, end) = value.strip_prefix("bytes=")?.trim().split_once('-')?;
    let start = start.trim().parse().ok()?;
    let end = match end.trim() {
        "" => None,
        end => Some(end.parse().ok()?),
    };
    Some((start, end))
}

async fn request_batch(
    State(hub): State<Arc<Hub>>,
    worker: Worker,
    Body(request): Body<BatchRequest>,
) -> ApiResult<Response> {
    worker.require_id(request.worker_id)?;
    Ok(match batches::lease(&hub, &worker).await? {
        Some(assignment) => Json(assignment).into_response(),
        None => (
            StatusCode::NO_CONTENT,
            [(header::RETRY_AFTER, HeaderValue::from(30))],
        )
            .into_response(),
    })
}

async fn batch_data(
    State(hub): State<Arc<Hub>>,
    worker: Worker,
    Path(batch_id): Path<Uuid>,
) -> ApiResult<Response> {
    let bytes = batches::data(&hub, &worker, batch_id).await?;
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/gzip"),
        )],
        bytes,
    )
        .into_response())
}

async fn upload_url(
    State(hub): State<Arc<Hub>>,
    worker: Worker,
    Body(request): Body<UploadUrlRequest>,
) -> ApiResult<Json<UploadTarget>> {
    worker.require_id(request.worker_id)?;
    Ok(Json(
        updates::upload_target(&hub, &worker, request.batch_id).await?,
    ))
}

async fn put_blob(
    State(hub): State<Arc<Hub>>,
    worker: Worker,
    Path(batch_id): Path<Uuid>,
    body: Bytes,
) -> ApiResult<StatusCode> {
    updates::put_blob(&hub, &worker, batch_id, body).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn upload(
    State(hub): State<Arc<Hub>>,
    worker: Worker,
    Body(upload): Body<GradientUpload>,
) -> ApiResult<Json<UploadReceipt>> {
    Ok(Json(updates::accept(&hub, &worker, upload).await?))
}

async fn global_stats(State(hub): State<Arc<Hub>>) -> ApiResult<Json<GlobalStats>> {
    Ok(Json(crate::stats::global(&hub).await?))
}

async fn worker_stats(State(hub): State<Arc<Hub>>, worker: Worker) -> ApiResult<Json<WorkerStats>> {
    Ok(Json(workers::stats(&hub, &worker).await?))
}

#[derive(serde::Deserialize)]
struct LeaderboardQuery {
    #[serde(default = "default_leaderboard_limit")]
    limit: i64,
}

fn default_leaderboard_limit() -> i64 {
    50
}

async fn leaderboard(
    State(hub): State<Arc<Hub>>,
    Query(query): Query<LeaderboardQuery>,
) -> ApiResult<Json<Vec<LeaderboardEntry>>> {
    if !(1..=1000).contains(&query.limit) {
        return Err(ApiError::invalid(
            "invalid_limit",
            "limit must be 1 to 1000",
        ));
    }
    Ok(Json(workers::leaderboard(&hub, query.limit).await?))
}

async fn aggregate(
    State(hub): State<Arc<Hub>>,
    _admin: Admin,
) -> ApiResult<Json<AggregateOutcome>> {
    match aggregator::aggregate(&hub, hub.policy.min_gradients).await? {
        Some(outcome) => Ok(Json(outcome)),
        None => Err(ApiError::conflict(
            "aggregation_running",
            "an aggregation is already running; retry when it ends",
        )),
    }
}

async fn ws_status(State(hub): State<Arc<Hub>>, upgrade: WebSocketUpgrade) -> Response {
    upgrade.on_upgrade(move |socket| status_feed(hub, socket))
}

fn event_message(event: &StatusEvent) -> Message {
    Message::Text(
        serde_json::to_string(event)
            .expect("events serialise")
            .into(),
    )
}

/// Sends the hello, then every event, and a heartbeat (a JSON message and a ping) every
/// `--heartbeat-seconds`. A client that sends nothing (not even the pong every WebSocket
/// client answers a ping with) for three heartbeats is dropped.
async fn status_feed(hub: Arc<Hub>, mut socket: WebSocket) {
    let mut events = hub.events.subscribe();
    let heartbeat = hub.policy.heartbeat;
    let hello = StatusEvent::Hello {
        current_version: versions::current_version(&hub).await.ok().flatten(),
        heartbeat_seconds: heartbeat.as_secs(),
    };
    if socket.send(event_message(&hello)).await.is_err() {
        return;
    }
    let mut ticker = tokio::time::interval(heartbeat);
    ticker.tick().await;
    let mut last_heard = Instant::now();
    loop {
        tokio::select! {
            event = events.recv() => match event {
                Ok(event) => if socket.send(event_message(&event)).await.is_err() { return },
                // A slow client missed events; it gets the next ones.
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            },
            incoming = socket.recv() => match incoming {
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                Some(Ok(_)) => last_heard = Instant::now(),
            },
            _ = ticker.tick() => {
                if last_heard.elapsed() > heartbeat * 3 {
                    let _ = socket.send(Message::Close(None)).await;
                    return;
                }
                let beat = StatusEvent::Heartbeat { server_time: chrono::Utc::now() };
                if socket.send(event_message(&beat)).await.is_err()
                    || socket.send(Message::Ping(Bytes::new())).await.is_err()
                {
                    return;
                }
            }
        }
    }
}
