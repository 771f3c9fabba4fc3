//! OpenAI-compatible routes for evaluation tools (lm-evaluation-harness `local-completions`):
//! `POST /v1/completions`, `GET /v1/models`, and the remote-tokenizer routes `POST /tokenize`,
//! `POST /detokenize`, `GET /tokenizer_info`.
//!
//! Per-token log-probabilities (`logprobs`, `echo`) come from one teacher-forced pass over the
//! prompt and the generated tokens, the same forward pass that generated them.

use axum::Json;
use axum::extract::State;
use hrm_http::{ApiError, JsonBody};
use hrm_model::engine::ScoreRow;
use hrm_model::{Engine, FinishReason, TokenLogprob};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::routes::{ModelRouteErrors, Usage, budgeted_ids, generate_all, ready};
use crate::validation::CompletionRequest;
use crate::{AppState, Ready};

/// OpenAI's completions: several prompts (text or token ids), `echo` and `logprobs`.
#[utoipa::path(post, path = "/v1/completions", request_body = CompletionRequest, responses(
    (status = 200, description = "OpenAI's `text_completion` object", content_type = "application/json"),
    (status = 404, description = "`model` names another model (`model_not_found`)", body = hrm_http::ErrorBody<'static>),
    ModelRouteErrors,
), security((), ("bearer" = [])))]
pub async fn completions(
    State(state): State<AppState>,
    JsonBody(request): JsonBody<CompletionRequest>,
) -> Result<Json<Value>, ApiError> {
    let model = request.model.clone();
    let mut request = request.validate(&state.limits)?;
    let ready = ready(&state)?;
    let engine = &ready.engine;
    if let Some(model) = &model
        && model != engine.name()
    {
        return Err(ApiError::not_found(
            "model_not_found",
            format!(
                "model {model:?} is not served here; this server serves {:?} (GET /v1/models)",
                engine.name()
            ),
        )
        .with_param("model"));
    }
    let prompts = budgeted_ids(&state, ready, &mut request).await?;
    let params = request.params;
    let generations = if params.max_tokens == 0 {
        prompts
            .iter()
            .map(|p| hrm_model::Generation {
                text: String::new(),
                token_ids: Vec::new(),
                prompt_tokens: p.len(),
                completion_tokens: 0,
                finish_reason: FinishReason::Length,
            })
            .collect()
    } else {
        generate_all(ready, prompts.clone(), params).await?
    };

    let scores = match request.logprobs {
        Some(top_n) => {
            Some(score_choices(ready, &prompts, &generations, request.echo, top_n).await?)
        }
        None => None,
    };
    // Decoding the prompts and every log-probability's token text is tokenizer work, bounded by
    // --max-logprob-entries but still too much for an async worker.
    let engine = engine.clone();
    let echo = request.echo;
    tokio::task::spawn_blocking(move || {
        Json(completion_body(
            &engine,
            &prompts,
            &generations,
            scores.as_deref(),
            echo,
        ))
    })
    .await
    .map_err(ApiError::internal)
}

/// OpenAI's `text_completion` object.
fn completion_body(
    engine: &Engine,
    prompts: &[Vec<u32>],
    generations: &[hrm_model::Generation],
    scores: Option<&[ChoiceScores]>,
    echo: bool,
) -> Value {
    let choices: Vec<Value> = generations
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let prompt_text = if echo {
                engine.tokenizer().decode(&prompts[i]).unwrap_or_default()
            } else {
                String::new()
            };
            let logprobs = scores.map(|s| {
                let offset = if echo {
                    0
                } else {
                    engine
                        .tokenizer()
                        .decode(&prompts[i])
                        .map(|t| t.len())
                        .unwrap_or(0)
                };
                logprobs_object(engine, &s[i], offset)
            });
            json!({
                "index": i,
                "text": format!("{prompt_text}{}", g.text),
                "logprobs": logprobs,
                "finish_reason": g.finish_reason,
            })
        })
        .collect();
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    json!({
        "id": format!("cmpl-{}", uuid::Uuid::new_v4().simple()),
        "object": "text_completion",
        "created": created,
        "model": engine.name(),
        "choices": choices,
        "usage": Usage::of(generations),
    })
}

/// One entry per returned token: `(token, logprob or None for the very first echoed token, top)`.
type ChoiceScores = Vec<(u32, Option<TokenLogprob>)>;

/// Scores each choice's tokens. Echoed prompt tokens are scored causally, each seeing only the
/// tokens before it: a prefix-LM model's bidirectional prompt block would let every prompt token
/// see itself, and evaluation tools (lm-eval scores a continuation through echo) would read
/// leaked log-probabilities. Generated tokens are scored as they were generated, after the
/// prompt block.
async fn score_choices(
    ready: &Ready,
    prompts: &[Vec<u32>],
    generations: &[hrm_model::Generation],
    echo: bool,
    top_n: usize,
) -> Result<Vec<ChoiceScores>, ApiError> {
    let prefix_lm = ready.engine.info().prefix_lm;
    let mut rows = Vec::new();
    // Per choice: its tokens, its prompt's length and how many adjacent rows score it.
    let mut plans = Vec::new();
    for (prompt, g) in prompts.iter().zip(generations) {
        let tokens: Vec<u32> = prompt.iter().chain(&g.token_ids).copied().collect();
        let first_row = rows.len();
        if echo && prompt.len() > 1 {
            rows.push(ScoreRow {
                tokens: prompt.clone(),
                score_from: 1,
                block: 0,
            });
        }
        if !g.token_ids.is_empty() {
            rows.push(ScoreRow {
                block: if prefix_lm { prompt.len() } else { 0 },
                tokens: tokens.clone(),
                score_from: prompt.len(),
            });
        }
        plans.push((tokens, prompt.len(), rows.len() - first_row));
    }
    let mut scored = ready.scheduler.score(rows, top_n).await?.into_iter();
    Ok(plans
        .into_iter()
        .map(|(tokens, prompt_len, row_count)| {
            let from = if echo { 1 } else { prompt_len };
            let mut out: ChoiceScores = Vec::new();
            if echo && !tokens.is_empty() {
                out.push((tokens[0], None));
            }
            let scores = (&mut scored).take(row_count).flatten();
            out.extend(tokens.iter().skip(from).copied().zip(scores.map(Some)));
            out
        })
        .collect())
}

fn logprobs_object(engine: &Engine, scores: &ChoiceScores, start_offset: usize) -> Value {
    let text_of = |id: u32| {
        engine
            .tokenizer()
            .decode_verbatim(&[id])
            .unwrap_or_default()
    };
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top_logprobs = Vec::new();
    let mut text_offset = Vec::new();
    let mut offset = start_offset;
    for (id, score) in scores {
        let text = text_of(*id);
        text_offset.push(offset);
        offset += text.len();
        tokens.push(text);
        match score {
            None => {
                token_logprobs.push(Value::Null);
                top_logprobs.push(Value::Null);
            }
            Some(s) => {
                token_logprobs.push(json!(s.logprob));
                let top: serde_json::Map<String, Value> = s
                    .top
                    .iter()
                    .map(|(t, lp)| (text_of(*t), json!(lp)))
                    .collect();
                top_logprobs.push(Value::Object(top));
            }
        }
    }
    json!({
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    })
}

/// The one model served.
#[utoipa::path(get, path = "/v1/models", responses(
    (status = 200, description = "OpenAI's model list", content_type = "application/json"),
    ModelRouteErrors,
), security((), ("bearer" = [])))]
pub async fn models(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let ready = ready(&state)?;
    Ok(Json(json!({
        "object": "list",
        "data": [{
            "id": ready.engine.name(),
            "object": "model",
            "owned_by": "hrm",
            "family": ready.engine.info().family.as_str(),
            "prefix_lm": ready.engine.info().prefix_lm,
            "max_model_len": ready.engine.context_window(),
        }],
    })))
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct TokenizeRequest {
    pub prompt: String,
    #[serde(default = "default_true")]
    pub add_special_tokens: bool,
}

fn default_true() -> bool {
    true
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct DetokenizeRequest {
    pub tokens: Vec<u32>,
}

/// Token ids of a text (lm-evaluation-harness's remote tokenizer).
#[utoipa::path(post, path = "/tokenize", request_body = TokenizeRequest, responses(
    (status = 200, description = "`tokens`, `count`, `max_model_len`", content_type = "application/json"),
    ModelRouteErrors,
), security((), ("bearer" = [])))]
pub async fn tokenize(
    State(state): State<AppState>,
    JsonBody(request): JsonBody<TokenizeRequest>,
) -> Result<Json<Value>, ApiError> {
    let engine = ready(&state)?.engine.clone();
    let tokenizing = engine.clone();
    let tokens = tokio::task::spawn_blocking(move || {
        tokenizing
            .tokenizer()
            .encode(&request.prompt, request.add_special_tokens)
    })
    .await
    .map_err(ApiError::internal)?
    .map_err(|e| ApiError::internal(format!("tokenising: {e}")))?;
    Ok(Json(json!({
        "tokens": tokens,
        "count": tokens.len(),
        "max_model_len": engine.context_window(),
    })))
}

/// The text of token ids.
#[utoipa::path(post, path = "/detokenize", request_body = DetokenizeRequest, responses(
    (status = 200, description = "`prompt`", content_type = "application/json"),
    ModelRouteErrors,
), security((), ("bearer" = [])))]
pub async fn detokenize(
    State(state): State<AppState>,
    JsonBody(request): JsonBody<DetokenizeRequest>,
) -> Result<Json<Value>, ApiError> {
    let engine = ready(&state)?.engine.clone();
    let vocab = engine.info().vocab_size;
    if let Some(bad) = request.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid_param(
            "tokens",
            format!("token id {bad} is outside the vocabulary of {vocab}"),
        ));
    }
    let prompt = tokio::task::spawn_blocking(move || engine.tokenizer().decode(&request.tokens))
        .await
        .map_err(ApiError::internal)?
        .map_err(|e| ApiError::internal(format!("detokenising: {e}")))?;
    Ok(Json(json!({ "prompt": prompt })))
}

/// What lm-evaluation-harness needs to know of the tokenizer.
#[utoipa::path(get, path = "/tokenizer_info", responses(
    (status = 200, description = "special tokens, vocabulary size, context length", content_type = "application/json"),
    ModelRouteErrors,
), security((), ("bearer" = [])))]
pub async fn tokenizer_info(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let engine = &ready(&state)?.engine;
    let tok = engine.tokenizer();
    let bos = tok.bos_id().and_then(|id| tok.id_to_token(id));
    Ok(Json(json!({
        "eos_token": tok.eos_token(),
        "eos_token_id": tok.eos_ids().first(),
        "bos_token": bos,
        "pad_token": tok.eos_token(),
        "vocab_size": tok.vocab_size(),
        "model_max_length": engine.context_window(),
        "tokenizer_class": "PreTrainedTokenizerFast",
    })))
}
