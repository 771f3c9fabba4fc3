//! The HTTP interface under `/api/v1` (every route, body and status in `docs/hub-api.md`), the
//! WebSocket status feed and the dashboard. Handlers are small: they check who is asking and
//! hand over to the module that owns the work.

use crate::Hub;
use crate::workers::{Admin, Worker};
use crate::{aggregator, batches, updates, versions, workers};
use axum::body::{Body, Bytes};
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{ConnectInfo, DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use hrm_http::{ApiError, ApiResult, ErrorBody, JsonBody, PathParam, QueryParams};
use hrm_wire::*;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;
use tower_http::trace::TraceLayer;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

/// Limit of JSON request bodies.
const MAX_JSON_BYTES: usize = 64 * 1024;
/// Largest message a status-feed client may send (it only ever needs to answer pings).
const MAX_WS_MESSAGE_BYTES: usize = 4 * 1024;

/// Every route under `/api/v1` with its OpenAPI description: the document served at
/// `/openapi.json` comes from the same handlers that answer.
fn api() -> OpenApiRouter<Arc<Hub>> {
    // The update body is streamed with its own cap (`updates::put_blob`), checked against the
    // model before a byte is read.
    let (schemas, paths, put_blob_route) = routes!(put_blob);
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(healthz))
        .routes(routes!(challenge))
        .routes(routes!(register))
        .routes(routes!(login))
        .routes(routes!(current_model))
        .routes(routes!(model_versions))
        .routes(routes!(download))
        .routes(routes!(request_batch))
        .routes(routes!(batch_data))
        .routes(routes!(upload_url))
        .routes((
            schemas,
            paths,
            put_blob_route.layer(DefaultBodyLimit::disable()),
        ))
        .routes(routes!(upload))
        .routes(routes!(global_stats))
        .routes(routes!(worker_stats))
        .routes(routes!(leaderboard))
        .routes(routes!(ws_status))
        .routes(routes!(aggregate))
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "hrm hub",
        description = "The training network's hub: registration, batches, uploads of updates, versions and statistics. Errors, limits and the threat model: docs/hub-api.md."
    ),
    modifiers(&BearerKey)
)]
struct ApiDoc;

/// Workers (and the admin) send their key as a bearer token.
struct BearerKey;

impl utoipa::Modify for BearerKey {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        openapi
            .components
            .get_or_insert_with(Default::default)
            .add_security_scheme(
                "worker_key",
                SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
            );
    }
}

/// The OpenAPI document of `hrm hub serve`.
pub fn openapi() -> utoipa::openapi::OpenApi {
    api().into_openapi()
}

/// What every route may answer besides its own results (docs/hub-api.md lists the codes).
#[derive(utoipa::IntoResponses)]
pub enum CommonErrors {
    /// A value breaks a rule, or the path or query is malformed.
    #[response(status = 400)]
    Invalid(ErrorBody<'static>),
    /// The key is missing or unknown.
    #[response(status = 401)]
    Unauthorized(ErrorBody<'static>),
    /// Not this worker's to ask (`worker_mismatch`), or its reputation is too low.
    #[response(status = 403)]
    Forbidden(ErrorBody<'static>),
    /// The body is not JSON of this route's shape, or the update failed a check.
    #[response(status = 422)]
    Unprocessable(ErrorBody<'static>),
    /// Too many requests from this worker or address; `Retry-After` says when to retry.
    #[response(status = 429)]
    RateLimited(ErrorBody<'static>),
}

pub fn router(hub: Arc<Hub>) -> Router {
    let (api, document) = api().split_for_parts();
    let document = Json(document);
    api.route("/", get(dashboard))
        .route(
            "/openapi.json",
            get(move || async move { document.clone() }),
        )
        .fallback(|| async {
            ApiError::not_found("no_route", "no such route; see docs/hub-api.md")
        })
        .layer(DefaultBodyLimit::max(MAX_JSON_BYTES))
        .layer(middleware::from_fn_with_state(hub.clone(), limit_per_ip))
        .layer(TraceLayer::new_for_http())
        .with_state(hub)
}

/// The client's address: the connection's peer, or behind a reverse proxy the last address of
/// `--client-ip-header` (the one the proxy itself added).
pub fn client_ip(hub: &Hub, headers: &HeaderMap, peer: Option<SocketAddr>) -> Option<IpAddr> {
    if let Some(name) = &hub.policy.client_ip_header {
        return headers
            .get(name)?
            .to_str()
            .ok()?
            .rsplit(',')
            .next()?
            .trim()
            .parse()
            .ok();
    }
    peer.map(|p| p.ip())
}

fn peer(req: &Request) -> Option<SocketAddr> {
    req.extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|ConnectInfo(addr)| *addr)
}

/// Every request counts against its IP address; registrations also against their own, much
/// smaller budget, so that identities cannot be minted in bulk from one address.
async fn limit_per_ip(State(hub): State<Arc<Hub>>, req: Request, next: Next) -> Response {
    let Some(ip) = client_ip(&hub, req.headers(), peer(&req)) else {
        return next.run(req).await;
    };
    if let Err(seconds) = hub.ip_limit.check(&ip) {
        return ApiError::too_many(
            "rate_limited",
            "too many requests from this address; retry later",
            seconds,
        )
        .into_response();
    }
    if req.uri().path() == "/api/v1/auth/register"
        && let Err(seconds) = hub.register_limit.check(&ip)
    {
        return ApiError::too_many(
            "too_many_registrations",
            "too many registrations from this address; retry later",
            seconds,
        )
        .into_response();
    }
    next.run(req).await
}

/// Liveness.
#[utoipa::path(get, path = "/healthz", responses((status = 200, description = "`ok`", content_type = "text/plain")))]
async fn healthz() -> &'static str {
    "ok"
}

async fn dashboard() -> Html<&'static str> {
    Html(include_str!("dashboard.html"))
}

/// A registration challenge to prove work on.
#[utoipa::path(get, path = "/api/v1/auth/challenge", responses((status = 200, body = Challenge), CommonErrors))]
async fn challenge(State(hub): State<Arc<Hub>>) -> ApiResult<Json<Challenge>> {
    Ok(Json(hub.challenges().await?.issue()))
}

/// Registers a key (with the proof of work) as a new worker.
#[utoipa::path(post, path = "/api/v1/auth/register", request_body = RegisterRequest, responses(
    (status = 201, body = RegisterResponse),
    (status = 409, description = "`already_registered`, `username_taken`", body = ErrorBody<'static>),
    CommonErrors,
))]
async fn register(
    State(hub): State<Arc<Hub>>,
    JsonBody(request): JsonBody<RegisterRequest>,
) -> ApiResult<(StatusCode, Json<RegisterResponse>)> {
    Ok((
        StatusCode::CREATED,
        Json(workers::register(&hub, request).await?),
    ))
}

/// Confirms the key; what a worker needs to start.
#[utoipa::path(post, path = "/api/v1/auth/login", responses((status = 200, body = LoginResponse), CommonErrors), security(("worker_key" = [])))]
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

/// The current version.
#[utoipa::path(get, path = "/api/v1/model/current", responses(
    (status = 200, body = ModelVersionInfo),
    (status = 404, description = "`no_model`: no version yet", body = ErrorBody<'static>),
    CommonErrors,
))]
async fn current_model(State(hub): State<Arc<Hub>>) -> ApiResult<Json<ModelVersionInfo>> {
    let row = versions::current_row(&hub).await?.ok_or_else(|| {
        ApiError::not_found("no_model", "this hub has no model yet (`hrm hub init`)")
    })?;
    Ok(Json(row.info()))
}

/// Every version, oldest first.
#[utoipa::path(get, path = "/api/v1/model/versions", responses((status = 200, body = Vec<ModelVersionInfo>), CommonErrors))]
async fn model_versions(State(hub): State<Arc<Hub>>) -> ApiResult<Json<Vec<ModelVersionInfo>>> {
    Ok(Json(
        versions::all_versions(&hub)
            .await?
            .iter()
            .map(|r| r.info())
            .collect(),
    ))
}

#[utoipa::path(get, path = "/api/v1/model/download/{version}", params(("version" = String, Path, description = "a version name, `v0.1.3`")), responses(
    (status = 200, description = "the checkpoint (safetensors)", content_type = "application/octet-stream"),
    (status = 206, description = "the `Range` asked for", content_type = "application/octet-stream"),
    (status = 304, description = "`If-None-Match` names this checkpoint's `ETag`"),
    (status = 404, description = "`unknown_version`", body = ErrorBody<'static>),
    (status = 416, description = "a `Range` outside the file"),
    CommonErrors,
), security(("worker_key" = [])))]
/// A checkpoint, with its SHA-256 as a strong `ETag` so workers can cache it, and a single
/// `Range: bytes=start-[end]` so that a cut-off download resumes.
async fn download(
    State(hub): State<Arc<Hub>>,
    _worker: Worker,
    PathParam(version): PathParam<String>,
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
    let total = hub
        .blobs
        .size(&row.checkpoint_key)
        .await?
        .ok_or_else(|| anyhow::anyhow!("checkpoint of {version} is missing from the store"))?;
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
    // The file streams from the store: a download, whole or ranged, never sits in memory.
    Ok(match range {
        None => {
            let (_, stream) = hub.blobs.get_stream(&row.checkpoint_key, None).await?;
            (
                common,
                [(header::CONTENT_LENGTH, HeaderValue::from(total))],
                Body::from_stream(stream),
            )
                .into_response()
        }
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
            let (_, stream) = hub
                .blobs
                .get_stream(&row.checkpoint_key, Some(start..end + 1))
                .await?;
            (
                StatusCode::PARTIAL_CONTENT,
                common,
                [
                    (header::CONTENT_RANGE, content_range),
                    (header::CONTENT_LENGTH, HeaderValue::from(end + 1 - start)),
                ],
                Body::from_stream(stream),
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

/// Leases a batch (the one this worker holds, if any).
#[utoipa::path(post, path = "/api/v1/batch/request", request_body = BatchRequest, responses(
    (status = 200, body = BatchAssignment),
    (status = 204, description = "no batch for now (none pending, or this worker's update waits for its re-verification); `Retry-After`"),
    (status = 503, description = "`no_model`: no version yet", body = ErrorBody<'static>),
    CommonErrors,
), security(("worker_key" = [])))]
async fn request_batch(
    State(hub): State<Arc<Hub>>,
    worker: Worker,
    JsonBody(request): JsonBody<BatchRequest>,
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

/// The leased batch's samples.
#[utoipa::path(get, path = "/api/v1/batch/data/{batch_id}", params(("batch_id" = Uuid, Path)), responses(
    (status = 200, description = "gzip JSON lines, one sample per line", content_type = "application/gzip"),
    (status = 404, description = "`unknown_batch`, `batch_not_leased`", body = ErrorBody<'static>),
    CommonErrors,
), security(("worker_key" = [])))]
async fn batch_data(
    State(hub): State<Arc<Hub>>,
    worker: Worker,
    PathParam(batch_id): PathParam<Uuid>,
) -> ApiResult<Response> {
    let key = batches::data_key(&hub, &worker, batch_id).await?;
    let (size, stream) = hub.blobs.get_stream(&key, None).await?;
    Ok((
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/gzip"),
            ),
            (header::CONTENT_LENGTH, HeaderValue::from(size)),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}

/// Where to PUT the update file of a leased batch.
#[utoipa::path(post, path = "/api/v1/gradients/upload-url", request_body = UploadUrlRequest, responses(
    (status = 200, body = UploadTarget),
    (status = 404, description = "`unknown_batch`, `batch_not_leased`", body = ErrorBody<'static>),
    CommonErrors,
), security(("worker_key" = [])))]
async fn upload_url(
    State(hub): State<Arc<Hub>>,
    worker: Worker,
    JsonBody(request): JsonBody<UploadUrlRequest>,
) -> ApiResult<Json<UploadTarget>> {
    worker.require_id(request.worker_id)?;
    Ok(Json(
        updates::upload_target(&hub, &worker, request.batch_id).await?,
    ))
}

/// The update file of a leased batch; size checked from `Content-Length` before it is read.
#[utoipa::path(put, path = "/api/v1/gradients/blob/{batch_id}", params(("batch_id" = Uuid, Path)), request_body(content = Vec<u8>, content_type = "application/octet-stream"), responses(
    (status = 204, description = "stored"),
    (status = 404, description = "`unknown_batch`, `batch_not_leased`", body = ErrorBody<'static>),
    (status = 413, description = "larger than an update of this model can be", body = ErrorBody<'static>),
    CommonErrors,
), security(("worker_key" = [])))]
async fn put_blob(
    State(hub): State<Arc<Hub>>,
    worker: Worker,
    PathParam(batch_id): PathParam<Uuid>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<StatusCode> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    updates::put_blob(&hub, &worker, batch_id, declared, body).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Reports the update file: the hub checks it and accepts it.
#[utoipa::path(post, path = "/api/v1/gradients/upload", request_body = GradientUpload, responses(
    (status = 200, body = UploadReceipt),
    (status = 404, description = "`unknown_batch`, `unknown_version`", body = ErrorBody<'static>),
    (status = 409, description = "`lease_lost`, `batch_done`, `stale_update`", body = ErrorBody<'static>),
    CommonErrors,
), security(("worker_key" = [])))]
async fn upload(
    State(hub): State<Arc<Hub>>,
    worker: Worker,
    JsonBody(upload): JsonBody<GradientUpload>,
) -> ApiResult<Json<UploadReceipt>> {
    Ok(Json(updates::accept(&hub, &worker, upload).await?))
}

/// The network's progress.
#[utoipa::path(get, path = "/api/v1/stats/global", responses((status = 200, body = GlobalStats), CommonErrors))]
async fn global_stats(State(hub): State<Arc<Hub>>) -> ApiResult<Json<GlobalStats>> {
    Ok(Json(crate::stats::global(&hub).await?))
}

/// This worker's contribution.
#[utoipa::path(get, path = "/api/v1/worker/stats", responses((status = 200, body = WorkerStats), CommonErrors), security(("worker_key" = [])))]
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

/// Workers by validated batches.
#[utoipa::path(get, path = "/api/v1/leaderboard", params(("limit" = Option<i64>, Query, description = "1 to 1000, default 50")), responses((status = 200, body = Vec<LeaderboardEntry>), CommonErrors))]
async fn leaderboard(
    State(hub): State<Arc<Hub>>,
    QueryParams(query): QueryParams<LeaderboardQuery>,
) -> ApiResult<Json<Vec<LeaderboardEntry>>> {
    if !(1..=1000).contains(&query.limit) {
        return Err(
            ApiError::invalid("invalid_limit", "limit must be 1 to 1000").with_param("limit"),
        );
    }
    Ok(Json(workers::leaderboard(&hub, query.limit).await?))
}

/// Runs an aggregation now (the admin key).
#[utoipa::path(post, path = "/api/v1/aggregate", responses(
    (status = 200, body = AggregateOutcome),
    (status = 409, description = "`aggregation_running`", body = ErrorBody<'static>),
    CommonErrors,
), security(("worker_key" = [])))]
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

/// The status feed (WebSocket): a hello, then every event, and a heartbeat.
#[utoipa::path(get, path = "/api/v1/ws/status", responses(
    (status = 101, description = "switching to the WebSocket feed of `StatusEvent`s"),
    (status = 503, description = "`too_many_connections`; `Retry-After`", body = ErrorBody<'static>),
    CommonErrors,
))]
async fn ws_status(State(hub): State<Arc<Hub>>, upgrade: WebSocketUpgrade) -> ApiResult<Response> {
    let slot = hub.ws_slots.clone().try_acquire_owned().map_err(|_| {
        ApiError::unavailable(
            "too_many_connections",
            "the status feed is full; retry later",
        )
        .with_retry_after(30)
    })?;
    Ok(upgrade
        .max_message_size(MAX_WS_MESSAGE_BYTES)
        .max_frame_size(MAX_WS_MESSAGE_BYTES)
        .on_upgrade(move |socket| async move {
            status_feed(hub, socket).await;
            drop(slot);
        }))
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
