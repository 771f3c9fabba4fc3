//! The HTTP routes: small handlers over [`AppState`], errors as [`ApiError`].

use std::time::Instant;

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{HeaderName, HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use hrm_model::Generation;
use hrm_model::engine::ScoreRow;
use serde::Serialize;
use serde_json::json;
use tower_http::cors::{AllowOrigin, CorsLayer};
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::{DefaultOnResponse, TraceLayer};
use tracing::Level;

use crate::error::ApiError;
use crate::scheduler::GenEvent;
use crate::validation::{GenerateRequest, LoglikelihoodRequest};
use crate::{AppState, Ready, ServeConfig, openai};

const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

pub fn router(state: AppState, config: &ServeConfig) -> Router {
    let router = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .route("/generate", post(generate))
        .route("/generate_stream", post(generate_stream))
        .route("/loglikelihood", post(loglikelihood))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/models", get(openai::models))
        .route("/tokenize", post(openai::tokenize))
        .route("/detokenize", post(openai::detokenize))
        .route("/tokenizer_info", get(openai::tokenizer_info))
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
        ApiError::unauthorized().into_response()
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
    ApiError::not_found("no such route; see docs/api.md")
}

async fn healthz() -> Json<serde_json::Value> {
    Json(json!({ "status": "ok" }))
}

async fn readyz(State(state): State<AppState>) -> Response {
    match state.ready() {
        Some(ready) => Json(json!({
            "status": "ready",
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

async fn metrics_text(State(state): State<AppState>) -> Response {
    if let Some(ready) = state.ready() {
        metrics::gauge!("hrm_queue_depth").set(ready.scheduler.queue_depth() as f64);
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

fn ready(state: &AppState) -> Result<&Ready, ApiError> {
    state.ready().ok_or_else(ApiError::not_ready)
}

/// `usage` of a response.
#[derive(Serialize, Debug, Default, PartialEq)]
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

#[derive(Serialize)]
struct GenerateResponse {
    completions: Vec<String>,
    usage: Usage,
}

/// Token ids of text prompts.
pub fn encode_prompts(ready: &Ready, prompts: &[String]) -> Result<Vec<Vec<u32>>, ApiError> {
    prompts
        .iter()
        .map(|p| ready.engine.encode_prompt(p))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ApiError::internal(format!("tokenising the prompts: {e}")))
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
            None => return Err(ApiError::internal("the scheduler stopped before finishing")),
        }
    }
    Ok(results.into_iter().flatten().collect())
}

async fn generate(
    State(state): State<AppState>,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let Json(request) = body?;
    let (prompts, params) = request.validate(&state.limits)?;
    let ready = ready(&state)?;
    let generations = generate_all(ready, encode_prompts(ready, &prompts)?, params).await?;
    let usage = Usage::of(&generations);
    let response = GenerateResponse {
        completions: generations.into_iter().map(|g| g.text).collect(),
        usage,
    };
    Ok(Json(
        serde_json::to_value(response).expect("response serialises"),
    ))
}

async fn loglikelihood(
    State(state): State<AppState>,
    body: Result<Json<LoglikelihoodRequest>, JsonRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let Json(request) = body?;
    let pairs = request.validate(&state.limits)?;
    let ready = ready(&state)?;
    let prefix_lm = ready.engine.info().prefix_lm;
    let rows = pairs
        .iter()
        .map(|(context, continuation)| {
            let (ctx, cont) = ready.engine.split_pair(context, continuation)?;
            let score_from = ctx.len();
            Ok(ScoreRow {
                block: if prefix_lm { score_from } else { 0 },
                tokens: ctx.into_iter().chain(cont).collect(),
                score_from,
            })
        })
        .collect::<Result<Vec<_>, hrm_model::Error>>()
        .map_err(|e| ApiError::internal(format!("tokenising: {e}")))?;
    let scored = ready.scheduler.score(rows, 0).await?;
    let ll: Vec<f64> = scored
        .iter()
        .map(|tokens| tokens.iter().map(|t| f64::from(t.logprob)).sum())
        .collect();
    Ok(Json(json!({ "ll": ll })))
}

/// `POST /generate_stream`: the `/generate` body; server-sent events `token`
/// (`{"index", "text"}`, one per newly decoded piece of a prompt's output), then one `done`
/// (`{"completions", "usage"}`), or an `error` in the usual error shape.
pub async fn generate_stream(
    State(state): State<AppState>,
    body: Result<Json<GenerateRequest>, JsonRejection>,
) -> Result<Sse<impl futures::Stream<Item = Result<Event, std::convert::Infallible>>>, ApiError> {
    let Json(request) = body?;
    let (prompts, params) = request.validate(&state.limits)?;
    let ready = ready(&state)?;
    let count = prompts.len();
    let events = ready
        .scheduler
        .generate(encode_prompts(ready, &prompts)?, params, true)
        .await?;
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
                    let e = ApiError::internal(message);
                    Event::default().event("error").json_data(
                        json!({"error": {"message": e.message, "type": e.kind, "param": null, "code": e.code}}),
                    )
                }
                None => return None,
            };
            let event = event
                .unwrap_or_else(|_| Event::default().event("error").data("serialisation failed"));
            return Some((Ok(event), p));
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}
