//! Every rule a request must meet, in one place, each with its own error naming the field.
//! Every route's body goes through here and comes out as a validated type: [`Generation`] for
//! `/generate`, `/generate_stream`, `/v1/completions` and `/v1/chat/completions`, [`Scoring`]
//! for `/loglikelihood`. A limit added here holds on every route.
//!
//! Two stages: the fields ([`GenerateRequest::validate`], [`CompletionRequest::validate`],
//! [`ChatRequest::validate`], [`LoglikelihoodRequest::validate`], answered 400; an OpenAI field
//! this server does not implement is a 400 that names it, never dropped), then, once the
//! prompts are token ids (`n` copies of each), the
//! request's budget ([`Generation::check_budget`], [`Scoring::check_budget`], answered 413):
//! prompt plus generated tokens, and the log-probability entries it would return. Bodies that
//! are not JSON of the right shape are rejected earlier, by the JSON extractor, with 422.

use std::collections::BTreeMap;

use hrm_http::ApiError;
use hrm_model::GenerateParams;
use hrm_model::engine::ScoreRow;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

/// Limits the rules enforce; from the server configuration.
#[derive(Clone, Debug, serde::Serialize, PartialEq)]
pub struct Limits {
    /// `max_tokens` above this is capped to it (the spec's "server maximum").
    pub max_new_tokens: usize,
    /// Prompts (or prompt/continuation pairs) in one request.
    pub max_prompts: usize,
    pub max_stop_strings: usize,
    pub max_stop_len: usize,
    /// Prompt tokens plus the most tokens a request may generate, or the tokens it scores.
    pub max_request_tokens: usize,
    /// Log-probability entries one request may return (positions × (1 + alternatives)).
    pub max_logprob_entries: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_new_tokens: 1024,
            max_prompts: 256,
            max_stop_strings: 16,
            max_stop_len: 256,
            max_request_tokens: 262_144,
            max_logprob_entries: 262_144,
        }
    }
}

pub const DEFAULT_MAX_TOKENS: i64 = 128;
pub const DEFAULT_TEMPERATURE: f64 = 0.7;
pub const DEFAULT_TOP_P: f64 = 1.0;
/// The most alternatives `logprobs` may ask for.
pub const MAX_LOGPROBS: usize = 20;

/// Body of `POST /generate` (and `/generate_stream`).
#[derive(Debug, Deserialize, ToSchema)]
pub struct GenerateRequest {
    /// At least one, none empty; at most 256.
    #[schema(min_items = 1, max_items = 256)]
    pub prompts: Vec<String>,
    /// Default 128, capped at `--max-new-tokens`.
    #[serde(default)]
    #[schema(minimum = 0)]
    pub max_tokens: Option<i64>,
    /// 0 to 2; 0 is greedy. Default 0.7.
    #[serde(default)]
    #[schema(minimum = 0.0, maximum = 2.0)]
    pub temperature: Option<f64>,
    /// Above 0, at most 1. Default 1.
    #[serde(default)]
    #[schema(exclusive_minimum = 0.0, maximum = 1.0)]
    pub top_p: Option<f64>,
    /// Prompt `i` is sampled with seed `seed + i`.
    #[serde(default)]
    pub seed: Option<u64>,
    /// At most 16, none empty, each at most 256 characters.
    #[serde(default)]
    #[schema(max_items = 16)]
    pub stop: Option<Vec<String>>,
}

/// Body of `POST /loglikelihood`.
#[derive(Debug, Deserialize, ToSchema)]
pub struct LoglikelihoodRequest {
    /// At least one, none empty; at most 256.
    #[schema(min_items = 1, max_items = 256)]
    pub prompts: Vec<String>,
    /// As many as `prompts`.
    pub continuations: Vec<String>,
}

/// `prompt` of a completion request: text, texts, token ids, or lists of token ids.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

/// `stop` may be one string or a list.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

/// Body of `POST /v1/completions` (OpenAI's fields that this server implements).
#[derive(Debug, Deserialize, ToSchema)]
pub struct CompletionRequest {
    pub prompt: PromptInput,
    /// Default 16, capped at `--max-new-tokens`.
    #[serde(default)]
    #[schema(minimum = 0)]
    pub max_tokens: Option<i64>,
    /// Alternatives per position, 0 to 20.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 20)]
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub echo: bool,
    #[serde(flatten)]
    pub fields: OpenAiFields,
}

/// Body of `POST /v1/chat/completions` (OpenAI's fields that this server implements).
#[derive(Debug, Deserialize, ToSchema)]
pub struct ChatRequest {
    /// At least one; rendered with the model's chat template.
    #[schema(min_items = 1)]
    pub messages: Vec<ChatMessageInput>,
    /// Default `--max-new-tokens`; `max_completion_tokens` is the same setting's newer name.
    #[serde(default)]
    #[schema(minimum = 0)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    #[schema(minimum = 0)]
    pub max_completion_tokens: Option<i64>,
    /// Log-probabilities of the generated tokens.
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// Alternatives per position, 0 to 20; needs `logprobs`.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 20)]
    pub top_logprobs: Option<i64>,
    #[serde(flatten)]
    pub fields: OpenAiFields,
}

/// The fields both OpenAI routes share.
#[derive(Debug, Deserialize, ToSchema)]
pub struct OpenAiFields {
    /// Must name the served model when given (`GET /v1/models`).
    #[serde(default)]
    pub model: Option<String>,
    /// 0 to 2. Default 1.
    #[serde(default)]
    #[schema(minimum = 0.0, maximum = 2.0)]
    pub temperature: Option<f64>,
    /// Above 0, at most 1. Default 1.
    #[serde(default)]
    #[schema(exclusive_minimum = 0.0, maximum = 1.0)]
    pub top_p: Option<f64>,
    /// Sample `i` of the request (prompt by prompt, `n` per prompt) is drawn with `seed + i`.
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub stop: Option<StopInput>,
    /// Samples per prompt, batched; default 1.
    #[serde(default)]
    #[schema(minimum = 1)]
    pub n: Option<i64>,
    /// Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`.
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Any other field: a neutral value of a field listed in docs/api.md is accepted, anything
    /// else is answered 400 naming it.
    #[serde(flatten)]
    #[schema(ignore)]
    pub other: BTreeMap<String, Value>,
}

/// `stream_options`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// A last chunk, with no choices, carries the request's `usage`.
    #[serde(default)]
    pub include_usage: bool,
}

/// One chat message.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ChatMessageInput {
    /// `system`, `user`, `assistant`, or another role the template knows.
    pub role: String,
    pub content: ChatContent,
    /// Passed to the template.
    #[serde(default)]
    pub name: Option<String>,
    #[serde(flatten)]
    #[schema(ignore)]
    pub other: BTreeMap<String, Value>,
}

/// A message's content: text, or a list of `{"type": "text", "text": ...}` parts.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum ChatContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct ContentPart {
    /// Only `text`.
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

/// A validated chat message, as the template sees it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// Prompts as the client sent them.
#[derive(Debug)]
pub enum Prompts {
    Texts(Vec<String>),
    Ids(Vec<Vec<u32>>),
    /// One conversation, rendered with the model's chat template.
    Chat(Vec<ChatMessage>),
}

impl Prompts {
    pub fn len(&self) -> usize {
        match self {
            Prompts::Texts(t) => t.len(),
            Prompts::Ids(i) => i.len(),
            Prompts::Chat(_) => 1,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A validated generation request, from any generation route.
#[derive(Debug)]
pub struct Generation {
    pub prompts: Prompts,
    pub params: GenerateParams,
    /// Alternatives per position, when log-probabilities are asked for.
    pub logprobs: Option<usize>,
    /// The prompt's tokens come back too (with their log-probabilities).
    pub echo: bool,
    /// Samples per prompt.
    pub n: usize,
    /// Answered as server-sent events.
    pub stream: Option<StreamOptions>,
}

/// A validated scoring request.
#[derive(Debug)]
pub struct Scoring {
    pub pairs: Vec<(String, String)>,
}

fn invalid(field: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid_param(field, message)
}

fn too_large(code: &'static str, param: &str, message: String) -> ApiError {
    ApiError::new(axum::http::StatusCode::PAYLOAD_TOO_LARGE, code, message).with_param(param)
}

pub fn prompts(field: &str, prompts: &[String], limits: &Limits) -> Result<(), ApiError> {
    count(field, prompts.len(), limits)?;
    if let Some(i) = prompts.iter().position(String::is_empty) {
        return Err(invalid(field, format!("{field}[{i}] is empty")));
    }
    Ok(())
}

fn count(field: &str, n: usize, limits: &Limits) -> Result<(), ApiError> {
    if n == 0 {
        return Err(invalid(
            field,
            format!("{field} must contain at least one prompt"),
        ));
    }
    if n > limits.max_prompts {
        return Err(invalid(
            field,
            format!(
                "{field} has {n} entries; at most {} are allowed per request",
                limits.max_prompts
            ),
        ));
    }
    Ok(())
}

/// `max_tokens` (or the `field` that stands for it): a non-negative integer, default
/// `default`, capped at the server maximum.
pub fn max_tokens(
    field: &str,
    value: Option<i64>,
    default: i64,
    limits: &Limits,
) -> Result<usize, ApiError> {
    let value = value.unwrap_or(default);
    if value < 0 {
        return Err(invalid(
            field,
            format!("{field} must be 0 or more, got {value}"),
        ));
    }
    Ok((value as usize).min(limits.max_new_tokens))
}

/// `temperature`: 0 to 2 inclusive (0 is greedy).
pub fn temperature(value: Option<f64>, default: f64) -> Result<f64, ApiError> {
    let value = value.unwrap_or(default);
    if !(0.0..=2.0).contains(&value) {
        return Err(invalid(
            "temperature",
            format!("temperature must be between 0 and 2 inclusive, got {value}"),
        ));
    }
    Ok(value)
}

/// `top_p`: above 0, up to 1 inclusive.
pub fn top_p(value: Option<f64>) -> Result<f64, ApiError> {
    let value = value.unwrap_or(DEFAULT_TOP_P);
    if !(value > 0.0 && value <= 1.0) {
        return Err(invalid(
            "top_p",
            format!("top_p must be above 0 and at most 1, got {value}"),
        ));
    }
    Ok(value)
}

pub fn stop(value: Option<Vec<String>>, limits: &Limits) -> Result<Vec<String>, ApiError> {
    let stop = value.unwrap_or_default();
    if stop.len() > limits.max_stop_strings {
        return Err(invalid(
            "stop",
            format!(
                "stop has {} strings; at most {} are allowed",
                stop.len(),
                limits.max_stop_strings
            ),
        ));
    }
    if let Some(i) = stop.iter().position(String::is_empty) {
        return Err(invalid("stop", format!("stop[{i}] is empty")));
    }
    if let Some(i) = stop
        .iter()
        .position(|s| s.chars().count() > limits.max_stop_len)
    {
        return Err(invalid(
            "stop",
            format!(
                "stop[{i}] is longer than {} characters",
                limits.max_stop_len
            ),
        ));
    }
    Ok(stop)
}

/// `logprobs` (or the `field` that stands for it): 0 to [`MAX_LOGPROBS`] alternatives.
pub fn logprobs(field: &str, value: Option<i64>) -> Result<Option<usize>, ApiError> {
    match value {
        None => Ok(None),
        Some(n) if (0..=MAX_LOGPROBS as i64).contains(&n) => Ok(Some(n as usize)),
        Some(n) => Err(invalid(
            field,
            format!("{field} must be between 0 and {MAX_LOGPROBS}, got {n}"),
        )),
    }
}

impl GenerateRequest {
    /// Checks every field.
    pub fn validate(self, limits: &Limits) -> Result<Generation, ApiError> {
        prompts("prompts", &self.prompts, limits)?;
        let params = GenerateParams {
            max_tokens: max_tokens("max_tokens", self.max_tokens, DEFAULT_MAX_TOKENS, limits)?,
            temperature: temperature(self.temperature, DEFAULT_TEMPERATURE)?,
            top_p: top_p(self.top_p)?,
            seed: self.seed,
            stop: stop(self.stop, limits)?,
        };
        Ok(Generation {
            prompts: Prompts::Texts(self.prompts),
            params,
            logprobs: None,
            echo: false,
            n: 1,
            stream: None,
        })
    }
}

impl CompletionRequest {
    /// Checks every field, with OpenAI's defaults for this route (16 tokens, temperature 1).
    /// The model name is checked by the handler, which knows the model.
    pub fn validate(self, limits: &Limits) -> Result<Generation, ApiError> {
        self.fields.supported(COMPLETION_NEUTRAL)?;
        let prompts = match self.prompt {
            PromptInput::Text(text) => Prompts::Texts(vec![text]),
            PromptInput::Texts(texts) => Prompts::Texts(texts),
            PromptInput::Ids(ids) => Prompts::Ids(vec![ids]),
            PromptInput::IdLists(lists) => Prompts::Ids(lists),
        };
        count("prompt", prompts.len(), limits)?;
        let logprobs = logprobs("logprobs", self.logprobs)?;
        let max_tokens = max_tokens("max_tokens", self.max_tokens, 16, limits)?;
        self.fields
            .into_generation(prompts, max_tokens, logprobs, self.echo, limits)
    }
}

impl ChatRequest {
    /// Checks every field, with OpenAI's defaults for this route (up to `--max-new-tokens`,
    /// temperature 1). The model name is checked by the handler, which knows the model.
    pub fn validate(self, limits: &Limits) -> Result<Generation, ApiError> {
        self.fields.supported(CHAT_NEUTRAL)?;
        if self.messages.is_empty() {
            return Err(invalid(
                "messages",
                "messages must contain at least one message",
            ));
        }
        let messages = self
            .messages
            .into_iter()
            .enumerate()
            .map(|(i, m)| m.validate(i))
            .collect::<Result<Vec<_>, _>>()?;
        let logprobs = match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (false, None) => None,
            (false, Some(_)) => {
                return Err(invalid("top_logprobs", "top_logprobs needs logprobs: true"));
            }
            (true, top) => logprobs("top_logprobs", Some(top.unwrap_or(0)))?,
        };
        let (field, value) = match (self.max_tokens, self.max_completion_tokens) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "max_completion_tokens",
                    "give max_tokens or max_completion_tokens, not both",
                ));
            }
            (None, Some(n)) => ("max_completion_tokens", Some(n)),
            (value, None) => ("max_tokens", value),
        };
        let max_tokens = max_tokens(field, value, limits.max_new_tokens as i64, limits)?;
        self.fields
            .into_generation(Prompts::Chat(messages), max_tokens, logprobs, false, limits)
    }
}

impl ChatMessageInput {
    fn validate(self, i: usize) -> Result<ChatMessage, ApiError> {
        if let Some(field) = self.other.keys().next() {
            return Err(ApiError::invalid(
                "unsupported_field",
                format!("messages[{i}].{field} is not supported by this server (tools and function calls are not)"),
            )
            .with_param(format!("messages[{i}].{field}")));
        }
        if self.role.is_empty() {
            return Err(invalid(
                &format!("messages[{i}].role"),
                format!("messages[{i}].role is empty"),
            ));
        }
        let content = match self.content {
            ChatContent::Text(text) => text,
            ChatContent::Parts(parts) => {
                let mut text = String::new();
                for (j, part) in parts.into_iter().enumerate() {
                    match (part.kind.as_str(), part.text) {
                        ("text", Some(t)) => {
                            if !text.is_empty() {
                                text.push('\n');
                            }
                            text.push_str(&t);
                        }
                        ("text", None) => {
                            return Err(invalid(
                                &format!("messages[{i}].content[{j}].text"),
                                format!("messages[{i}].content[{j}] is a text part without text"),
                            ));
                        }
                        (kind, _) => {
                            return Err(ApiError::invalid(
                                "unsupported_field",
                                format!("content parts of type {kind:?} are not supported; only \"text\""),
                            )
                            .with_param(format!("messages[{i}].content[{j}].type")));
                        }
                    }
                }
                text
            }
        };
        Ok(ChatMessage {
            role: self.role,
            content,
            name: self.name,
        })
    }
}

impl OpenAiFields {
    /// 400 `unsupported_field` for the first other field that is not implemented with the
    /// value given; `null` counts as absent.
    fn supported(&self, neutral: &[(&str, Neutral)]) -> Result<(), ApiError> {
        for (field, value) in &self.other {
            if value.is_null() {
                continue;
            }
            let error = |message: String| {
                Err(ApiError::invalid("unsupported_field", message).with_param(field.as_str()))
            };
            match neutral.iter().find(|(name, _)| name == field) {
                Some((_, rule)) if rule.holds(value, self.n) => {}
                Some((_, rule)) => {
                    return error(format!(
                        "{field} is not supported by this server; only {} is accepted (docs/api.md)",
                        rule.expected()
                    ));
                }
                None => {
                    return error(format!(
                        "{field} is not a field this server implements (docs/api.md lists them)"
                    ));
                }
            }
        }
        Ok(())
    }

    fn into_generation(
        self,
        prompts: Prompts,
        max_tokens: usize,
        logprobs: Option<usize>,
        echo: bool,
        limits: &Limits,
    ) -> Result<Generation, ApiError> {
        let n = samples(self.n, prompts.len(), limits)?;
        if self.stream && logprobs.is_some() {
            return Err(invalid(
                "logprobs",
                "logprobs cannot be streamed by this server; ask without stream",
            ));
        }
        if self.stream_options.is_some() && !self.stream {
            return Err(invalid(
                "stream_options",
                "stream_options needs stream: true",
            ));
        }
        let params = GenerateParams {
            max_tokens,
            temperature: temperature(self.temperature, 1.0)?,
            top_p: top_p(self.top_p)?,
            seed: self.seed,
            stop: stop(
                self.stop.map(|s| match s {
                    StopInput::One(s) => vec![s],
                    StopInput::Many(v) => v,
                }),
                limits,
            )?,
        };
        Ok(Generation {
            prompts,
            params,
            logprobs,
            echo,
            n,
            stream: self.stream.then(|| {
                self.stream_options.unwrap_or(StreamOptions {
                    include_usage: false,
                })
            }),
        })
    }
}

/// `n`: at least 1, and at most `--max-prompts` samples in the whole request.
fn samples(value: Option<i64>, prompts: usize, limits: &Limits) -> Result<usize, ApiError> {
    let n = value.unwrap_or(1);
    if n < 1 {
        return Err(invalid("n", format!("n must be at least 1, got {n}")));
    }
    if (n as u64).saturating_mul(prompts as u64) > limits.max_prompts as u64 {
        return Err(invalid(
            "n",
            format!(
                "n = {n} samples of {prompts} prompt(s) is more than the {} sequences allowed per request",
                limits.max_prompts
            ),
        ));
    }
    Ok(n as usize)
}

/// OpenAI fields this server does not implement, each with the value that leaves the answer
/// unchanged: the field is accepted with that value and refused with any other. `best_of` is
/// neutral when it equals `n` (checked apart); `user` is only the client's label.
const COMPLETION_NEUTRAL: &[(&str, Neutral)] = &[
    ("best_of", Neutral::EqualsN),
    ("suffix", Neutral::EmptyText),
    ("logit_bias", Neutral::EmptyMap),
    ("presence_penalty", Neutral::Zero),
    ("frequency_penalty", Neutral::Zero),
    ("user", Neutral::Any),
];
const CHAT_NEUTRAL: &[(&str, Neutral)] = &[
    ("logit_bias", Neutral::EmptyMap),
    ("presence_penalty", Neutral::Zero),
    ("frequency_penalty", Neutral::Zero),
    ("user", Neutral::Any),
    ("tools", Neutral::EmptyList),
    ("tool_choice", Neutral::NoneText),
    ("parallel_tool_calls", Neutral::Any),
    ("response_format", Neutral::TextFormat),
];

#[derive(Clone, Copy, Debug)]
enum Neutral {
    EqualsN,
    EmptyText,
    EmptyMap,
    EmptyList,
    Zero,
    NoneText,
    TextFormat,
    Any,
}

impl Neutral {
    fn holds(self, value: &Value, n: Option<i64>) -> bool {
        match self {
            Neutral::EqualsN => value.as_i64() == Some(n.unwrap_or(1)),
            Neutral::EmptyText => value.as_str() == Some(""),
            Neutral::EmptyMap => value.as_object().is_some_and(|m| m.is_empty()),
            Neutral::EmptyList => value.as_array().is_some_and(|a| a.is_empty()),
            Neutral::Zero => value.as_f64() == Some(0.0),
            Neutral::NoneText => value.as_str() == Some("none"),
            Neutral::TextFormat => value["type"] == "text",
            Neutral::Any => true,
        }
    }

    fn expected(self) -> &'static str {
        match self {
            Neutral::EqualsN => "equal to n",
            Neutral::EmptyText => "\"\"",
            Neutral::EmptyMap => "{}",
            Neutral::EmptyList => "[]",
            Neutral::Zero => "0",
            Neutral::NoneText => "\"none\"",
            Neutral::TextFormat => "{\"type\": \"text\"}",
            Neutral::Any => "anything",
        }
    }
}

impl Generation {
    /// The request's budget, once its prompts are token ids: every id in the vocabulary,
    /// prompt plus generated tokens within `--max-request-tokens`, and the log-probability
    /// entries it would return within `--max-logprob-entries`.
    pub fn check_budget(
        &self,
        ids: &[Vec<u32>],
        vocab: usize,
        limits: &Limits,
    ) -> Result<(), ApiError> {
        for (i, row) in ids.iter().enumerate() {
            if let Some(bad) = row.iter().find(|&&t| t as usize >= vocab) {
                return Err(invalid(
                    "prompt",
                    format!("prompt[{i}] has token id {bad}, outside the vocabulary of {vocab}"),
                ));
            }
            // A token is scored given the ones before it: the first needs a prompt token.
            if (self.echo || self.logprobs.is_some()) && row.is_empty() {
                return Err(invalid(
                    "prompt",
                    format!("prompt[{i}] is empty; echo and logprobs need prompt tokens"),
                ));
            }
        }
        let prompt_tokens: usize = ids.iter().map(Vec::len).sum();
        let tokens = prompt_tokens + ids.len() * self.params.max_tokens;
        if tokens > limits.max_request_tokens {
            return Err(too_large(
                "too_many_tokens",
                "prompt",
                format!(
                    "the request needs {prompt_tokens} prompt tokens plus up to {} generated, {tokens} in all; this server's limit per request is {} (--max-request-tokens)",
                    ids.len() * self.params.max_tokens,
                    limits.max_request_tokens
                ),
            ));
        }
        if let Some(top_n) = self.logprobs {
            let positions =
                ids.len() * self.params.max_tokens + if self.echo { prompt_tokens } else { 0 };
            let entries = positions * (1 + top_n);
            if entries > limits.max_logprob_entries {
                return Err(too_large(
                    "too_many_logprobs",
                    "logprobs",
                    format!(
                        "the request would return {entries} log-probabilities ({positions} positions × {} each); this server's limit per request is {} (--max-logprob-entries)",
                        1 + top_n,
                        limits.max_logprob_entries
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl LoglikelihoodRequest {
    /// Checks the pairs.
    pub fn validate(self, limits: &Limits) -> Result<Scoring, ApiError> {
        prompts("prompts", &self.prompts, limits)?;
        if self.continuations.len() != self.prompts.len() {
            return Err(invalid(
                "continuations",
                format!(
                    "continuations has {} entries but prompts has {}; they must be the same length",
                    self.continuations.len(),
                    self.prompts.len()
                ),
            ));
        }
        if let Some(i) = self.continuations.iter().position(String::is_empty) {
            return Err(invalid(
                "continuations",
                format!("continuations[{i}] is empty"),
            ));
        }
        Ok(Scoring {
            pairs: self.prompts.into_iter().zip(self.continuations).collect(),
        })
    }
}

impl Scoring {
    /// The tokens it scores, within `--max-request-tokens`.
    pub fn check_budget(rows: &[ScoreRow], limits: &Limits) -> Result<(), ApiError> {
        let tokens: usize = rows.iter().map(|r| r.tokens.len()).sum();
        if tokens > limits.max_request_tokens {
            return Err(too_large(
                "too_many_tokens",
                "prompts",
                format!(
                    "the request scores {tokens} tokens; this server's limit per request is {} (--max-request-tokens)",
                    limits.max_request_tokens
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(json: &str) -> GenerateRequest {
        serde_json::from_str(json).unwrap()
    }

    fn error(json: &str) -> ApiError {
        request(json).validate(&Limits::default()).unwrap_err()
    }

    fn completion(json: &str) -> Result<Generation, ApiError> {
        serde_json::from_str::<CompletionRequest>(json)
            .unwrap()
            .validate(&Limits::default())
    }

    #[test]
    fn defaults_follow_the_spec() {
        let g = request(r#"{"prompts":["hi"]}"#)
            .validate(&Limits::default())
            .unwrap();
        let p = g.params;
        assert_eq!((p.max_tokens, p.temperature, p.top_p), (128, 0.7, 1.0));
        assert!(p.seed.is_none() && p.stop.is_empty());
        // /v1/completions keeps OpenAI's.
        let p = completion(r#"{"prompt":"hi"}"#).unwrap().params;
        assert_eq!((p.max_tokens, p.temperature), (16, 1.0));
    }

    #[test]
    fn max_tokens_is_capped_at_the_server_maximum() {
        let limits = Limits {
            max_new_tokens: 256,
            ..Limits::default()
        };
        let g = request(r#"{"prompts":["hi"],"max_tokens":5000}"#)
            .validate(&limits)
            .unwrap();
        assert_eq!(g.params.max_tokens, 256);
    }

    #[test]
    fn each_rule_names_its_field() {
        for (json, field, words) in [
            (r#"{"prompts":[]}"#, "prompts", "at least one"),
            (r#"{"prompts":["a",""]}"#, "prompts", "prompts[1] is empty"),
            (
                r#"{"prompts":["a"],"max_tokens":-1}"#,
                "max_tokens",
                "0 or more",
            ),
            (
                r#"{"prompts":["a"],"temperature":2.5}"#,
                "temperature",
                "between 0 and 2",
            ),
            (
                r#"{"prompts":["a"],"temperature":-0.1}"#,
                "temperature",
                "between 0 and 2",
            ),
            (r#"{"prompts":["a"],"top_p":0}"#, "top_p", "above 0"),
            (r#"{"prompts":["a"],"top_p":1.5}"#, "top_p", "at most 1"),
            (
                r#"{"prompts":["a"],"stop":[""]}"#,
                "stop",
                "stop[0] is empty",
            ),
        ] {
            let e = error(json);
            assert_eq!(e.status, 400, "{json}");
            assert_eq!(e.param.as_deref(), Some(field), "{json}");
            assert!(e.message.contains(words), "{json}: {}", e.message);
        }
        // The completions route meets the same rules.
        for (json, field) in [
            (r#"{"prompt":[]}"#, "prompt"),
            (r#"{"prompt":"a","temperature":3}"#, "temperature"),
            (r#"{"prompt":"a","stop":[""]}"#, "stop"),
            (r#"{"prompt":"a","logprobs":21}"#, "logprobs"),
        ] {
            let e = completion(json).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{json}");
        }
    }

    #[test]
    fn boundaries_are_inclusive_where_the_spec_says() {
        for json in [
            r#"{"prompts":["a"],"temperature":0}"#,
            r#"{"prompts":["a"],"temperature":2}"#,
            r#"{"prompts":["a"],"top_p":1}"#,
            r#"{"prompts":["a"],"max_tokens":0}"#,
        ] {
            assert!(request(json).validate(&Limits::default()).is_ok(), "{json}");
        }
    }

    #[test]
    fn loglikelihood_lengths_must_match() {
        let r: LoglikelihoodRequest =
            serde_json::from_str(r#"{"prompts":["a","b"],"continuations":["c"]}"#).unwrap();
        let e = r.validate(&Limits::default()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("continuations"));
        assert!(e.message.contains("has 1 entries but prompts has 2"));
    }

    #[test]
    fn budgets_bound_tokens_and_logprob_entries() {
        let limits = Limits::default();
        // 256 prompts of 1024 ids with echo and 20 alternatives: 5.5M entries from a small body.
        let g = completion(r#"{"prompt":[[1]],"max_tokens":1,"echo":true,"logprobs":20}"#).unwrap();
        let ids = vec![vec![1u32; 1024]; 256];
        let e = g.check_budget(&ids, 100, &limits).unwrap_err();
        assert_eq!((e.status.as_u16(), e.code), (413, "too_many_tokens"));
        let ids = vec![vec![1u32; 1024]; 200];
        let e = g.check_budget(&ids, 100, &limits).unwrap_err();
        assert_eq!((e.status.as_u16(), e.code), (413, "too_many_logprobs"));
        assert!(e.message.contains("4305000"), "{}", e.message);
        let ids = vec![vec![1u32; 100]; 4];
        assert!(g.check_budget(&ids, 100, &limits).is_ok());
        // Scoring needs a token before the first one scored: an empty prompt is refused
        // (found by the fuzzer, as a 500).
        let scored = completion(r#"{"prompt":"","logprobs":0}"#).unwrap();
        let e = scored.check_budget(&[vec![]], 100, &limits).unwrap_err();
        assert_eq!(
            (e.status.as_u16(), e.param.as_deref()),
            (400, Some("prompt"))
        );
        let plain = completion(r#"{"prompt":""}"#).unwrap();
        assert!(plain.check_budget(&[vec![]], 100, &limits).is_ok());
        // Ids outside the vocabulary name the prompt.
        let e = g.check_budget(&[vec![100]], 100, &limits).unwrap_err();
        assert!(
            e.message.contains("prompt[0] has token id 100"),
            "{}",
            e.message
        );
    }
}
