//! Every rule a request must meet, in one place, each with its own error naming the field.
//!
//! Bodies that are not JSON of the right shape are rejected earlier, by the JSON extractor,
//! with 422; what reaches these functions has the right types, and the rules here answer 400.

use hrm_model::GenerateParams;
use serde::Deserialize;

use crate::error::ApiError;

/// Limits the rules enforce; from the server configuration.
#[derive(Clone, Debug)]
pub struct Limits {
    /// `max_tokens` above this is capped to it (the spec's "server maximum").
    pub max_new_tokens: usize,
    /// Prompts (or prompt/continuation pairs) in one request.
    pub max_prompts: usize,
    pub max_stop_strings: usize,
    pub max_stop_len: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_new_tokens: 1024,
            max_prompts: 256,
            max_stop_strings: 16,
            max_stop_len: 256,
        }
    }
}

pub const DEFAULT_MAX_TOKENS: i64 = 128;
pub const DEFAULT_TEMPERATURE: f64 = 0.7;
pub const DEFAULT_TOP_P: f64 = 1.0;

/// Body of `POST /generate` (and `/generate_stream`).
#[derive(Debug, Deserialize)]
pub struct GenerateRequest {
    pub prompts: Vec<String>,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub stop: Option<Vec<String>>,
}

/// Body of `POST /loglikelihood`.
#[derive(Debug, Deserialize)]
pub struct LoglikelihoodRequest {
    pub prompts: Vec<String>,
    pub continuations: Vec<String>,
}

pub fn prompts(field: &str, prompts: &[String], limits: &Limits) -> Result<(), ApiError> {
    if prompts.is_empty() {
        return Err(ApiError::invalid(
            field,
            format!("{field} must contain at least one prompt"),
        ));
    }
    if prompts.len() > limits.max_prompts {
        return Err(ApiError::invalid(
            field,
            format!(
                "{field} has {} entries; at most {} are allowed per request",
                prompts.len(),
                limits.max_prompts
            ),
        ));
    }
    if let Some(i) = prompts.iter().position(String::is_empty) {
        return Err(ApiError::invalid(field, format!("{field}[{i}] is empty")));
    }
    Ok(())
}

/// `max_tokens`: a non-negative integer, default 128, capped at the server maximum.
pub fn max_tokens(value: Option<i64>, limits: &Limits) -> Result<usize, ApiError> {
    let value = value.unwrap_or(DEFAULT_MAX_TOKENS);
    if value < 0 {
        return Err(ApiError::invalid(
            "max_tokens",
            format!("max_tokens must be 0 or more, got {value}"),
        ));
    }
    Ok((value as usize).min(limits.max_new_tokens))
}

/// `temperature`: 0 to 2 inclusive (0 is greedy).
pub fn temperature(value: Option<f64>) -> Result<f64, ApiError> {
    let value = value.unwrap_or(DEFAULT_TEMPERATURE);
    if !(0.0..=2.0).contains(&value) {
        return Err(ApiError::invalid(
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
        return Err(ApiError::invalid(
            "top_p",
            format!("top_p must be above 0 and at most 1, got {value}"),
        ));
    }
    Ok(value)
}

pub fn stop(value: Option<Vec<String>>, limits: &Limits) -> Result<Vec<String>, ApiError> {
    let stop = value.unwrap_or_default();
    if stop.len() > limits.max_stop_strings {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "stop has {} strings; at most {} are allowed",
                stop.len(),
                limits.max_stop_strings
            ),
        ));
    }
    if let Some(i) = stop.iter().position(String::is_empty) {
        return Err(ApiError::invalid("stop", format!("stop[{i}] is empty")));
    }
    if let Some(i) = stop
        .iter()
        .position(|s| s.chars().count() > limits.max_stop_len)
    {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "stop[{i}] is longer than {} characters",
                limits.max_stop_len
            ),
        ));
    }
    Ok(stop)
}

impl GenerateRequest {
    /// Checks every field and returns the decoding settings.
    pub fn validate(self, limits: &Limits) -> Result<(Vec<String>, GenerateParams), ApiError> {
        prompts("prompts", &self.prompts, limits)?;
        let params = GenerateParams {
            max_tokens: max_tokens(self.max_tokens, limits)?,
            temperature: temperature(self.temperature)?,
            top_p: top_p(self.top_p)?,
            seed: self.seed,
            stop: stop(self.stop, limits)?,
        };
        Ok((self.prompts, params))
    }
}

impl LoglikelihoodRequest {
    /// Checks the pairs and returns them.
    pub fn validate(self, limits: &Limits) -> Result<Vec<(String, String)>, ApiError> {
        prompts("prompts", &self.prompts, limits)?;
        if self.continuations.len() != self.prompts.len() {
            return Err(ApiError::invalid(
                "continuations",
                format!(
                    "continuations has {} entries but prompts has {}; they must be the same length",
                    self.continuations.len(),
                    self.prompts.len()
                ),
            ));
        }
        if let Some(i) = self.continuations.iter().position(String::is_empty) {
            return Err(ApiError::invalid(
                "continuations",
                format!("continuations[{i}] is empty"),
            ));
        }
        Ok(self.prompts.into_iter().zip(self.continuations).collect())
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

    #[test]
    fn defaults_follow_the_spec() {
        let (_, p) = request(r#"{"prompts":["hi"]}"#)
            .validate(&Limits::default())
            .unwrap();
        assert_eq!((p.max_tokens, p.temperature, p.top_p), (128, 0.7, 1.0));
        assert!(p.seed.is_none() && p.stop.is_empty());
    }

    #[test]
    fn max_tokens_is_capped_at_the_server_maximum() {
        let limits = Limits {
            max_new_tokens: 256,
            ..Limits::default()
        };
        let (_, p) = request(r#"{"prompts":["hi"],"max_tokens":5000}"#)
            .validate(&limits)
            .unwrap();
        assert_eq!(p.max_tokens, 256);
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
}
