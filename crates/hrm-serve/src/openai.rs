//! OpenAI-compatible routes for evaluation tools and OpenAI's clients: `POST /v1/completions`,
//! `POST /v1/chat/completions`, `GET /v1/models`, and the remote-tokenizer routes
//! `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.
//!
//! Both completion routes go through the one validation path and the scheduler like
//! `/generate`: the same limits, backpressure and cancellation. `n` samples of a prompt are `n`
//! sequences, batched. With `stream`, the answer is server-sent events in OpenAI's chunk format,
//! ending with `data: [DONE]`.
//!
//! Per-token log-probabilities (`logprobs`, `echo`) come from one teacher-forced pass over the
//! prompt and the generated tokens, the same forward pass that generated them.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::Json;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use hrm_http::{ApiError, JsonBody};
use hrm_model::engine::ScoreRow;
use hrm_model::{Engine, FinishReason, TokenLogprob};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::routes::{ModelRouteErrors, Usage, budgeted_ids, generate_all, ready, scheduler_gone};
use crate::scheduler::GenEvent;
use crate::validation::{ChatRequest, CompletionRequest, Generation};
use crate::{AppState, Ready};

/// OpenAI's completions: several prompts (text or token ids), `n` samples each, `echo` and
/// `logprobs`, streamed or not.
#[utoipa::path(post, path = "/v1/completions", request_body = CompletionRequest, responses(
    (status = 200, description = "OpenAI's `text_completion` object; with `stream`, server-sent events of `text_completion` chunks ending with `data: [DONE]`", content_type = "application/json"),
    (status = 404, description = "`model` names another model (`model_not_found`)", body = hrm_http::ErrorBody<'static>),
    ModelRouteErrors,
), security((), ("bearer" = [])))]
pub async fn completions(
    State(state): State<AppState>,
    JsonBody(request): JsonBody<CompletionRequest>,
) -> Result<Response, ApiError> {
    let model = request.fields.model.clone();
    let mut request = request.validate(&state.limits)?;
    let (ready, prompts) = admit(&state, model.as_deref(), &mut request).await?;
    let chunks = Chunks::new(&ready.engine, Route::Completion);
    if let Some(stream) = &request.stream {
        let opening = if request.echo {
            let engine = ready.engine.clone();
            let texts = prompts.clone();
            tokio::task::spawn_blocking(move || {
                texts
                    .iter()
                    .map(|p| engine.tokenizer().decode(p).unwrap_or_default())
                    .collect()
            })
            .await
            .map_err(ApiError::internal)?
        } else {
            Vec::new()
        };
        let include_usage = stream.include_usage;
        return chunks
            .stream(ready, prompts, request.params, opening, include_usage)
            .await;
    }
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
    let engine = ready.engine.clone();
    let echo = request.echo;
    tokio::task::spawn_blocking(move || {
        let choices = generations
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let prompt_text = if echo {
                    engine.tokenizer().decode(&prompts[i]).unwrap_or_default()
                } else {
                    String::new()
                };
                let logprobs = scores.as_ref().map(|s| {
                    let offset = if echo {
                        0
                    } else {
                        engine
                            .tokenizer()
                            .decode(&prompts[i])
                            .map(|t| t.len())
                            .unwrap_or(0)
                    };
                    logprobs_object(&engine, &s[i], offset)
                });
                json!({
                    "index": i,
                    "text": format!("{prompt_text}{}", g.text),
                    "logprobs": logprobs,
                    "finish_reason": g.finish_reason,
                })
            })
            .collect();
        Json(chunks.whole(choices, &Usage::of(&generations))).into_response()
    })
    .await
    .map_err(ApiError::internal)
}

/// OpenAI's chat completions: the conversation rendered with the model's chat template, `n`
/// answers, `logprobs` of the answer's tokens, streamed or not.
#[utoipa::path(post, path = "/v1/chat/completions", request_body = ChatRequest, responses(
    (status = 200, description = "OpenAI's `chat.completion` object; with `stream`, server-sent events of `chat.completion.chunk` chunks ending with `data: [DONE]`", content_type = "application/json"),
    (status = 404, description = "`model` names another model (`model_not_found`)", body = hrm_http::ErrorBody<'static>),
    ModelRouteErrors,
), security((), ("bearer" = [])))]
pub async fn chat_completions(
    State(state): State<AppState>,
    JsonBody(request): JsonBody<ChatRequest>,
) -> Result<Response, ApiError> {
    let model = request.fields.model.clone();
    let mut request = request.validate(&state.limits)?;
    let (ready, prompts) = admit(&state, model.as_deref(), &mut request).await?;
    let chunks = Chunks::new(&ready.engine, Route::Chat);
    if let Some(stream) = &request.stream {
        let include_usage = stream.include_usage;
        return chunks
            .stream(ready, prompts, request.params, Vec::new(), include_usage)
            .await;
    }
    let generations = generate_all(ready, prompts.clone(), request.params).await?;
    let scores = match request.logprobs {
        Some(top_n) => Some(score_choices(ready, &prompts, &generations, false, top_n).await?),
        None => None,
    };
    let engine = ready.engine.clone();
    tokio::task::spawn_blocking(move || {
        let choices = generations
            .iter()
            .enumerate()
            .map(|(i, g)| {
                json!({
                    "index": i,
                    "message": {"role": "assistant", "content": g.text},
                    "logprobs": scores.as_ref().map(|s| chat_logprobs(&engine, &s[i])),
                    "finish_reason": g.finish_reason,
                })
            })
            .collect();
        Json(chunks.whole(choices, &Usage::of(&generations))).into_response()
    })
    .await
    .map_err(ApiError::internal)
}

/// The loaded model, 404 unless the request's `model` is absent or names it, and the request's
/// prompts as token ids (`n` copies of each) within its budget.
async fn admit<'s>(
    state: &'s AppState,
    model: Option<&str>,
    request: &mut Generation,
) -> Result<(&'s Ready, Vec<Vec<u32>>), ApiError> {
    let ready = ready(state)?;
    let served = ready.engine.name();
    if let Some(model) = model
        && model != served
    {
        return Err(ApiError::not_found(
            "model_not_found",
            format!(
                "model {model:?} is not served here; this server serves {served:?} (GET /v1/models)"
            ),
        )
        .with_param("model"));
    }
    let prompts = budgeted_ids(state, ready, request).await?;
    Ok((ready, prompts))
}

#[derive(Clone, Copy)]
enum Route {
    Completion,
    Chat,
}

/// The envelope of one answer: the same id, time and model on every chunk of a stream.
struct Chunks {
    route: Route,
    id: String,
    created: u64,
    model: String,
}

impl Chunks {
    fn new(engine: &Engine, route: Route) -> Self {
        let prefix = match route {
            Route::Completion => "cmpl",
            Route::Chat => "chatcmpl",
        };
        Self {
            route,
            id: format!("{prefix}-{}", uuid::Uuid::new_v4().simple()),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: engine.name().to_string(),
        }
    }

    /// The whole answer in one body.
    fn whole(&self, choices: Vec<Value>, usage: &Usage) -> Value {
        let object = match self.route {
            Route::Completion => "text_completion",
            Route::Chat => "chat.completion",
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        })
    }

    /// One streamed chunk; with `include_usage`, every chunk has a `usage` field, null but on
    /// the last.
    fn chunk(&self, choices: Vec<Value>, usage: Option<Option<&Usage>>) -> Event {
        let object = match self.route {
            Route::Completion => "text_completion",
            Route::Chat => "chat.completion.chunk",
        };
        let mut body = json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let Some(usage) = usage {
            body["usage"] = json!(usage);
        }
        Event::default().data(body.to_string())
    }

    /// A choice's piece of text (chat: a `delta`, the first one with the role).
    fn piece(&self, index: usize, text: &str, first: bool) -> Value {
        match self.route {
            Route::Completion => {
                json!({"index": index, "text": text, "logprobs": null, "finish_reason": null})
            }
            Route::Chat if first => {
                json!({"index": index, "delta": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": null})
            }
            Route::Chat => {
                json!({"index": index, "delta": {"content": text}, "logprobs": null, "finish_reason": null})
            }
        }
    }

    fn finish(&self, index: usize, reason: FinishReason) -> Value {
        match self.route {
            Route::Completion => {
                json!({"index": index, "text": "", "logprobs": null, "finish_reason": reason})
            }
            Route::Chat => {
                json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": reason})
            }
        }
    }

    /// Server-sent events of the generation of `prompts`, a choice each: `opening[i]` first for
    /// choice `i` (echoed prompts), then its text as it is decoded and a chunk with its finish
    /// reason; then, with `include_usage`, a chunk with no choices and the usage; then
    /// `data: [DONE]`.
    /// A fault ends the stream with `data: {"error": ...}` (as vLLM does) and `[DONE]`. Dropping
    /// the stream, when the client leaves, cancels the generation.
    async fn stream(
        self,
        ready: &Ready,
        prompts: Vec<Vec<u32>>,
        params: hrm_model::GenerateParams,
        opening: Vec<String>,
        include_usage: bool,
    ) -> Result<Response, ApiError> {
        let count = prompts.len();
        let events = ready.scheduler.generate(prompts, params, true).await?;
        let mut progress = Progress {
            chunks: self,
            events,
            pending: VecDeque::new(),
            started: vec![false; count],
            usage: Usage::default(),
            remaining: count,
            include_usage,
            finished: false,
        };
        for (i, text) in opening.iter().enumerate() {
            progress.piece(i, text);
        }
        let stream = futures::stream::unfold(progress, |mut p| async move {
            loop {
                if let Some(event) = p.pending.pop_front() {
                    return Some((Ok::<_, Infallible>(event), p));
                }
                if p.finished {
                    return None;
                }
                match p.events.recv().await {
                    Some(GenEvent::Token { prompt, text }) => p.piece(prompt, &text),
                    Some(GenEvent::Done { prompt, generation }) => p.done(prompt, &generation),
                    Some(GenEvent::Failed(message)) => p.fail(&ApiError::internal(message)),
                    None => p.fail(&scheduler_gone()),
                }
            }
        });
        Ok(Sse::new(stream)
            .keep_alive(KeepAlive::default())
            .into_response())
    }
}

/// A stream's state between chunks.
struct Progress {
    chunks: Chunks,
    events: UnboundedReceiver<GenEvent>,
    pending: VecDeque<Event>,
    /// Whether choice `i` has sent a chunk (chat's first one carries the role).
    started: Vec<bool>,
    usage: Usage,
    remaining: usize,
    include_usage: bool,
    finished: bool,
}

impl Progress {
    fn push(&mut self, choices: Vec<Value>) {
        let usage = self.include_usage.then_some(None);
        let chunk = self.chunks.chunk(choices, usage);
        self.pending.push_back(chunk);
    }

    fn piece(&mut self, index: usize, text: &str) {
        let first = !std::mem::replace(&mut self.started[index], true);
        let piece = self.chunks.piece(index, text, first);
        self.push(vec![piece]);
    }

    fn done(&mut self, index: usize, generation: &hrm_model::Generation) {
        if !self.started[index] {
            self.piece(index, "");
        }
        let finish = self.chunks.finish(index, generation.finish_reason);
        self.push(vec![finish]);
        self.usage.prompt_tokens += generation.prompt_tokens;
        self.usage.completion_tokens += generation.completion_tokens;
        self.remaining -= 1;
        if self.remaining == 0 {
            self.usage.total_tokens = self.usage.prompt_tokens + self.usage.completion_tokens;
            if self.include_usage {
                let last = self.chunks.chunk(Vec::new(), Some(Some(&self.usage)));
                self.pending.push_back(last);
            }
            self.end();
        }
    }

    fn fail(&mut self, e: &ApiError) {
        let body = serde_json::to_string(&e.body()).unwrap_or_default();
        self.pending.push_back(Event::default().data(body));
        self.end();
    }

    fn end(&mut self) {
        self.pending.push_back(Event::default().data("[DONE]"));
        self.finished = true;
    }
}

/// The `logprobs` of a chat choice: OpenAI's `{"content": [{token, logprob, bytes,
/// top_logprobs}]}`.
fn chat_logprobs(engine: &Engine, scores: &ChoiceScores) -> Value {
    let entry = |id: u32, logprob: f32| {
        let text = engine
            .tokenizer()
            .decode_verbatim(&[id])
            .unwrap_or_default();
        json!({"token": text, "logprob": logprob, "bytes": text.as_bytes()})
    };
    let content: Vec<Value> = scores
        .iter()
        .filter_map(|(id, score)| score.as_ref().map(|s| (*id, s)))
        .map(|(id, s)| {
            let mut e = entry(id, s.logprob);
            e["top_logprobs"] = s.top.iter().map(|(t, lp)| entry(*t, *lp)).collect();
            e
        })
        .collect();
    json!({ "content": content })
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
    /// A choice: its tokens, its prompt's length, and the rows that score its echoed prompt and
    /// its generated tokens. The `n` samples of a prompt sit side by side and share one echo row.
    struct Plan {
        tokens: Vec<u32>,
        prompt_len: usize,
        echo_row: Option<usize>,
        generated_row: Option<usize>,
    }
    let mut plans: Vec<Plan> = Vec::new();
    for (i, (prompt, g)) in prompts.iter().zip(generations).enumerate() {
        let tokens: Vec<u32> = prompt.iter().chain(&g.token_ids).copied().collect();
        let echo_row = if !echo || prompt.len() < 2 {
            None
        } else if i > 0 && prompts[i - 1] == *prompt {
            plans[i - 1].echo_row
        } else {
            rows.push(ScoreRow {
                tokens: prompt.clone(),
                score_from: 1,
                block: 0,
            });
            Some(rows.len() - 1)
        };
        let generated_row = (!g.token_ids.is_empty()).then(|| {
            rows.push(ScoreRow {
                block: if prefix_lm { prompt.len() } else { 0 },
                tokens: tokens.clone(),
                score_from: prompt.len(),
            });
            rows.len() - 1
        });
        plans.push(Plan {
            tokens,
            prompt_len: prompt.len(),
            echo_row,
            generated_row,
        });
    }
    let scored = ready.scheduler.score(rows, top_n).await?;
    Ok(plans
        .into_iter()
        .map(|plan| {
            let from = if echo { 1 } else { plan.prompt_len };
            let mut out: ChoiceScores = Vec::new();
            if echo && !plan.tokens.is_empty() {
                out.push((plan.tokens[0], None));
            }
            let scores = [plan.echo_row, plan.generated_row]
                .into_iter()
                .flatten()
                .flat_map(|row| scored[row].iter().cloned());
            out.extend(plan.tokens.iter().skip(from).copied().zip(scores.map(Some)));
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
