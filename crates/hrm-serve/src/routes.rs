//! The HTTP routes: small handlers over [`AppState`], errors as [`ApiError`].

use std::time::Instant;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{HeaderName, HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use hrm_model::Generation;
use hrm_model::engine::ScoreRow;
use serde::Serialize;
use serde_json::json;
use tower_http::cors::{AllowOrigin, CorsLayer};
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::{DefaultOnResponse, TraceLayer};
use tracing::Level;

use crate::scheduler::GenEvent;
use crate::validation::{self, GenerateRequest, LoglikelihoodRequest, Prompts};
use crate::{AppState, Ready, ServeConfig, chat, openai};
use hrm_http::{ApiError, ErrorBody, JsonBody};
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Every route of the API with its OpenAPI description: the document served at
/// `/openapi.json` is generated from the same handlers that answer, so the two cannot drift.
fn api() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(metrics_text))
        .routes(routes!(generate))
        .routes(routes!(generate_stream))
        .routes(routes!(loglikelihood))
        .routes(routes!(openai::completions))
        .routes(routes!(openai::chat_completions))
        .routes(routes!(openai::models))
        .routes(routes!(openai::tokenize))
        .routes(routes!(openai::detokenize))
        .routes(routes!(openai::tokenizer_info))
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "hrm serve",
        description = "Inference for HRM-Text checkpoints, their mixture-of-experts variant and Llama-family baselines. Errors, limits and settings: docs/api.md."
    ),
    modifiers(&BearerKey)
)]
struct ApiDoc;

/// The optional bearer key (`--api-key`): every route but `/healthz`, `/readyz`,
/// `/openapi.json` and, unless `--metrics-auth`, `/metrics`.
struct BearerKey;

impl utoipa::Modify for BearerKey {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        openapi
            .components
            .get_or_insert_with(Default::default)
            .add_security_scheme(
                "bearer",
                SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
            );
    }
}

/// The OpenAPI document of `hrm serve`.
pub fn openapi() -> utoipa::openapi::OpenApi {
    api().into_openapi()
}

/// The errors a model route may answer; `code` says which rule (docs/api.md lists them).
#[derive(utoipa::IntoResponses)]
pub enum ModelRouteErrors {
    /// A field breaks a rule; `param` names it.
    #[response(status = 400)]
    Invalid(ErrorBody<'static>),
    /// The bearer key is missing or wrong (when the server has one).
    #[response(status = 401)]
    Unauthorized(ErrorBody<'static>),
    /// The body, or the work it asks for, is over a limit (`body_too_large`, `too_many_tokens`,
    /// `too_many_logprobs`).
    #[response(status = 413)]
    TooLarge(ErrorBody<'static>),
    /// The body is not JSON of this route's shape.
    #[response(status = 422)]
    Unprocessable(ErrorBody<'static>),
    /// The server holds as much work as it may (`queue_full`); `Retry-After` says when to retry.
    #[response(status = 429)]
    Busy(ErrorBody<'static>),
    /// The model is loading (`not_ready`) or the inference loop restarts after a fault
    /// (`scheduler_restarting`); `Retry-After` says when to retry.
    #[response(status = 503)]
    Unavailable(ErrorBody<'static>),
}

pub fn router(state: AppState, config: &ServeConfig) -> Router {
    let (api, document) = api().split_for_parts();
    let document = Json(document);
    let router = api
        .route("/openapi.json", get(move || async move { document.clone() }))
        .merge(if config.ui { crate::ui::standalone::<AppState>("") } else { Router::new() })
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(config.max_body_bytes))
        .layer(middleware::from_fn_with_state(state.clone(), require_key))
        .layer(middleware::from_fn(record_request))
        .layer(PropagateRequestIdLayer::new(REQUEST_ID))
        .layer(TraceLayer::new_for_http().make_span_with(|req: &Request| {
            // Method, path and request id only: bodies never reach the logs.
            let id = req
                .headers()
                .get(&REQUEST_ID)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-");
            tracing::info_span!("request", id, method = %req.method(), path = %req.uri().path())
        })
        .on_response(DefaultOnResponse::new().level(Level::INFO)))
        .layer(SetRequestIdLayer::new(REQUEST_ID, MakeRequestUuid))
        .with_state(state);
    match cors(config) {
        Some(layer) => router.layer(layer),
        None => router,
    }
}

/// CORS is off unless `--enable-cors`; then only the listed origins are allowed.
fn cors(config: &ServeConfig) -> Option<CorsLayer> {
    if !config.enable_cors {
        return None;
    }
    let layer = CorsLayer::new()
        .allow_methods([Method::GET, Method::POST])
        .allow_headers([header::CONTENT_TYPE, header::AUTHORIZATION]);
    if config.cors_origins.iter().any(|o| o == "*") {
        tracing::warn!("CORS allows any origin (`*`): for development only");
        return Some(layer.allow_origin(AllowOrigin::any()));
    }
    let origins: Vec<HeaderValue> = config
        .cors_origins
        .iter()
        .filter_map(|o| match HeaderValue::from_str(o) {
            Ok(v) => Some(v),
            Err(_) => {
                tracing::warn!(origin = %o, "ignoring an invalid CORS origin");
                None
            }
        })
        .collect();
    if origins.is_empty() {
        tracing::warn!("--enable-cors without --cors-origins: no origin is allowed");
    }
    Some(layer.allow_origin(AllowOrigin::list(origins)))
}

/// 401 unless the route is open or the bearer key matches.
async fn require_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let authorization = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if state.authorised(req.uri().path(), authorization) {
        next.run(req).await
    } else {
        ApiError::unauthorized("missing or invalid bearer token in the Authorization header")
            .into_response()
    }
}

/// Counts requests by route and status and times them.
async fn record_request(req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |p| p.as_str())
        .to_string();
    let started = Instant::now();
    let response = next.run(req).await;
    let status = response.status().as_u16().to_string();
    metrics::counter!("hrm_requests_total", "route" => route.clone(), "status" => status)
        .increment(1);
    metrics::histogram!("hrm_request_seconds", "route" => route)
        .record(started.elapsed().as_secs_f64());
    response
}

async fn not_found() -> ApiError {
    ApiError::not_found("not_found", "no such route; see docs/api.md")
}

/// Liveness: the process answers.
#[utoipa::path(get, path = "/healthz", responses((status = 200, description = "`{\"status\": \"ok\"}`", content_type = "application/json")))]
async fn healthz() -> Json<serde_json::Value> {
    Json(json!({ "status": "ok" }))
}

/// Readiness: the model is loaded and the inference loop runs.
#[utoipa::path(get, path = "/readyz", responses(
    (status = 200, description = "`status` ready, the model, and the work held (`queued_tokens`, `queue_depth`)", content_type = "application/json"),
    (status = 503, description = "`status` loading, or restarting after a fault", content_type = "application/json"),
))]
async fn readyz(State(state): State<AppState>) -> Response {
    match state.ready() {
        Some(ready) if !ready.scheduler.is_running() => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "status": "restarting" })),
        )
            .into_response(),
        Some(ready) => Json(json!({
            "status": "ready",
            "queued_tokens": ready.scheduler.queued_tokens(),
            "queue_depth": ready.scheduler.queue_depth(),
            "model": ready.engine.name(),
            "family": ready.engine.info().family.as_str(),
            "device": ready.device,
        }))
        .into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "status": "loading" })),
        )
            .into_response(),
    }
}

/// Prometheus metrics.
#[utoipa::path(get, path = "/metrics", responses(
    (status = 200, description = "Prometheus text format", content_type = "text/plain"),
    (status = 401, description = "with `--metrics-auth`, a missing or wrong bearer key", body = ErrorBody<'static>),
), security((), ("bearer" = [])))]
async fn metrics_text(State(state): State<AppState>) -> Response {
    if let Some(ready) = state.ready() {
        metrics::gauge!("hrm_queue_depth").set(ready.scheduler.queue_depth() as f64);
        metrics::gauge!("hrm_queued_tokens").set(ready.scheduler.queued_tokens() as f64);
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        state.metrics().render(),
    )
        .into_response()
}

/// The loaded model, or 503 while it loads.
pub fn ready(state: &AppState) -> Result<&Ready, ApiError> {
    state.ready().ok_or_else(|| {
        ApiError::unavailable("not_ready", "the model is still loading; see /readyz")
            .with_retry_after(1)
    })
}

/// `usage` of a response.
#[derive(Serialize, Debug, Default, PartialEq, utoipa::ToSchema)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn of<'a>(generations: impl IntoIterator<Item = &'a Generation>) -> Self {
        let mut usage = Self::default();
        for g in generations {
            usage.prompt_tokens += g.prompt_tokens;
            usage.completion_tokens += g.completion_tokens;
        }
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens;
        usage
    }
}

#[derive(Serialize, utoipa::ToSchema)]
struct GenerateResponse {
    /// One per prompt, in order.
    completions: Vec<String>,
    usage: Usage,
}

#[derive(Serialize, utoipa::ToSchema)]
struct LoglikelihoodResponse {
    /// The log-probability of each continuation given its prompt, in order.
    ll: Vec<f64>,
}

/// Token ids of the prompts, tokenised (and a conversation rendered with the chat template) on
/// a blocking thread: a prompt of several megabytes must not hold an async worker.
pub async fn prompt_ids(ready: &Ready, prompts: Prompts) -> Result<Vec<Vec<u32>>, ApiError> {
    let engine = ready.engine.clone();
    let tokenising =
        |e: hrm_model::Error| ApiError::internal(format!("tokenising the prompts: {e}"));
    match prompts {
        Prompts::Ids(ids) => Ok(ids),
        Prompts::Texts(texts) => tokio::task::spawn_blocking(move || {
            texts
                .iter()
                .map(|p| engine.encode_prompt(p))
                .collect::<Result<Vec<_>, _>>()
        })
        .await
        .map_err(ApiError::internal)?
        .map_err(tokenising),
        Prompts::Chat(messages) => {
            let template = ready.chat_template.clone().ok_or_else(chat::no_template)?;
            tokio::task::spawn_blocking(move || {
                let text = template.render(&messages)?;
                // The template writes the special tokens itself (BOS included), as
                // transformers' `apply_chat_template` expects.
                let ids = engine
                    .tokenizer()
                    .encode(&text, false)
                    .map_err(tokenising)?;
                Ok(vec![ids])
            })
            .await
            .map_err(ApiError::internal)?
        }
    }
}

/// Validated prompts as token ids, `n` copies of each in a row, within the request's budget.
pub async fn budgeted_ids(
    state: &AppState,
    ready: &Ready,
    request: &mut validation::Generation,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let prompts = std::mem::replace(&mut request.prompts, Prompts::Ids(Vec::new()));
    let ids = prompt_ids(ready, prompts).await?;
    let ids: Vec<Vec<u32>> = ids
        .into_iter()
        .flat_map(|p| std::iter::repeat_n(p, request.n))
        .collect();
    request.check_budget(&ids, ready.engine.info().vocab_size, &state.limits)?;
    Ok(ids)
}

/// Runs prompts through the scheduler and waits for every completion, in input order.
pub async fn generate_all(
    ready: &Ready,
    prompts: Vec<Vec<u32>>,
    params: hrm_model::GenerateParams,
) -> Result<Vec<Generation>, ApiError> {
    let count = prompts.len();
    let mut events = ready.scheduler.generate(prompts, params, false).await?;
    let mut results: Vec<Option<Generation>> = vec![None; count];
    let mut remaining = count;
    while remaining > 0 {
        match events.recv().await {
            Some(GenEvent::Done { prompt, generation }) => {
                results[prompt] = Some(generation);
                remaining -= 1;
            }
            Some(GenEvent::Token { .. }) => {}
            Some(GenEvent::Failed(message)) => return Err(ApiError::internal(message)),
            None => return Err(scheduler_gone()),
        }
    }
    Ok(results.into_iter().flatten().collect())
}

/// An `error` event in the usual error shape, for a stream that cannot finish.
fn error_event(e: &ApiError) -> Result<Event, axum::Error> {
    Event::default().event("error").json_data(e.body())
}

/// The scheduler dropped the request: it restarted after a fault.
pub fn scheduler_gone() -> ApiError {
    ApiError::unavailable(
        "scheduler_restarting",
        "the inference loop restarted after a fault before this request finished; retry",
    )
    .with_retry_after(1)
}

/// Completions of every prompt, decoded together.
#[utoipa::path(post, path = "/generate", request_body = GenerateRequest, responses(
    (status = 200, body = GenerateResponse), ModelRouteErrors,
), security((), ("bearer" = [])))]
async fn generate(
    State(state): State<AppState>,
    JsonBody(request): JsonBody<GenerateRequest>,
) -> Result<Json<GenerateResponse>, ApiError> {
    let mut request = request.validate(&state.limits)?;
    let ready = ready(&state)?;
    let ids = budgeted_ids(&state, ready, &mut request).await?;
    let generations = generate_all(ready, ids, request.params).await?;
    let usage = Usage::of(&generations);
    Ok(Json(GenerateResponse {
        completions: generations.into_iter().map(|g| g.text).collect(),
        usage,
    }))
}

/// The log-likelihood of each continuation given its prompt, split as
/// lm-evaluation-harness splits them.
#[utoipa::path(post, path = "/loglikelihood", request_body = LoglikelihoodRequest, responses(
    (status = 200, body = LoglikelihoodResponse), ModelRouteErrors,
), security((), ("bearer" = [])))]
async fn loglikelihood(
    State(state): State<AppState>,
    JsonBody(request): JsonBody<LoglikelihoodRequest>,
) -> Result<Json<LoglikelihoodResponse>, ApiError> {
    let scoring = request.validate(&state.limits)?;
    let ready = ready(&state)?;
    let engine = ready.engine.clone();
    let rows = tokio::task::spawn_blocking(move || {
        let prefix_lm = engine.info().prefix_lm;
        scoring
            .pairs
            .iter()
            .map(|(context, continuation)| {
                let (ctx, cont) = engine.split_pair(context, continuation)?;
                let score_from = ctx.len();
                Ok(ScoreRow {
                    block: if prefix_lm { score_from } else { 0 },
                    tokens: ctx.into_iter().chain(cont).collect(),
                    score_from,
                })
            })
            .collect::<Result<Vec<_>, hrm_model::Error>>()
    })
    .await
    .map_err(ApiError::internal)?
    .map_err(|e| ApiError::internal(format!("tokenising: {e}")))?;
    validation::Scoring::check_budget(&rows, &state.limits)?;
    let scored = ready.scheduler.score(rows, 0).await?;
    let ll: Vec<f64> = scored
        .iter()
        .map(|tokens| tokens.iter().map(|t| f64::from(t.logprob)).sum())
        .collect();
    Ok(Json(LoglikelihoodResponse { ll }))
}

/// `POST /generate_stream`: the `/generate` body; server-sent events `token`
/// (`{"index", "text"}`, one per newly decoded piece of a prompt's output), then one `done`
/// (`{"completions", "usage"}`), or an `error` in the usual error shape.
#[utoipa::path(post, path = "/generate_stream", request_body = GenerateRequest, responses(
    (status = 200, description = "server-sent events: `token` (`{\"index\", \"text\"}`), then `done` (`{\"completions\", \"usage\"}`) or `error`", content_type = "text/event-stream"),
    ModelRouteErrors,
), security((), ("bearer" = [])))]
pub async fn generate_stream(
    State(state): State<AppState>,
    JsonBody(request): JsonBody<GenerateRequest>,
) -> Result<Sse<impl futures::Stream<Item = Result<Event, std::convert::Infallible>>>, ApiError> {
    let mut request = request.validate(&state.limits)?;
    let ready = ready(&state)?;
    let ids = budgeted_ids(&state, ready, &mut request).await?;
    let count = ids.len();
    let events = ready.scheduler.generate(ids, request.params, true).await?;
    struct Progress {
        events: tokio::sync::mpsc::UnboundedReceiver<GenEvent>,
        results: Vec<Option<Generation>>,
        remaining: usize,
        finished: bool,
    }
    let start = Progress {
        events,
        results: vec![None; count],
        remaining: count,
        finished: false,
    };
    let stream = futures::stream::unfold(start, |mut p| async move {
        if p.finished {
            return None;
        }
        loop {
            let event = match p.events.recv().await {
                Some(GenEvent::Token { prompt, text }) => Event::default()
                    .event("token")
                    .json_data(json!({"index": prompt, "text": text})),
                Some(GenEvent::Done { prompt, generation }) => {
                    p.results[prompt] = Some(generation);
                    p.remaining -= 1;
                    if p.remaining > 0 {
                        continue;
                    }
                    p.finished = true;
                    let generations: Vec<Generation> =
                        p.results.iter_mut().filter_map(Option::take).collect();
                    let usage = Usage::of(&generations);
                    let completions: Vec<String> =
                        generations.into_iter().map(|g| g.text).collect();
                    Event::default()
                        .event("done")
                        .json_data(json!({"completions": completions, "usage": usage}))
                }
                Some(GenEvent::Failed(message)) => {
                    p.finished = true;
                    error_event(&ApiError::internal(message))
                }
                None => {
                    p.finished = true;
                    error_event(&scheduler_gone())
                }
            };
            let event = event
                .unwrap_or_else(|_| Event::default().event("error").data("serialisation failed"));
            return Some((Ok(event), p));
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}
