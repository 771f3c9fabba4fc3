//! What the model configs share: the validation trait, the RoPE and end-of-sequence fields of
//! Hugging Face configs, and how their defaults resolve.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// A model config that can check itself.
pub trait ModelConfig: serde::de::DeserializeOwned {
    /// Every rule the config must meet before a model is built from it.
    fn validate(&self) -> std::result::Result<(), String>;

    /// Reads and validates a `config.json`.
    fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_json(&text, path)
    }

    /// Parses and validates config JSON; `origin` names it in errors.
    fn from_json(text: &str, origin: &Path) -> Result<Self> {
        let config: Self = serde_json::from_str(text).map_err(|e| Error::Config {
            path: origin.into(),
            message: e.to_string(),
        })?;
        config.validate().map_err(|message| Error::Config {
            path: origin.into(),
            message,
        })?;
        Ok(config)
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RopeParameters {
    pub rope_theta: f64,
    #[serde(default = "default_rope_type")]
    pub rope_type: String,
}

/// `eos_token_id` may be one id or a list.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EosTokenId {
    One(u32),
    Many(Vec<u32>),
}

impl EosTokenId {
    pub fn ids(&self) -> Vec<u32> {
        match self {
            Self::One(id) => vec![*id],
            Self::Many(ids) => ids.clone(),
        }
    }
}

fn default_rope_type() -> String {
    "default".into()
}

/// RoPE base: `rope_parameters.rope_theta` (transformers 5), else the top-level `rope_theta` of
/// older configs, else 10000.
pub fn rope_theta(parameters: &Option<RopeParameters>, legacy: Option<f64>) -> f64 {
    parameters
        .as_ref()
        .map(|r| r.rope_theta)
        .or(legacy)
        .unwrap_or(10_000.0)
}

/// `head_dim` when the config gives it, else `hidden / heads`.
pub fn head_dim(explicit: Option<usize>, hidden: usize, heads: usize) -> usize {
    explicit.unwrap_or(hidden / heads.max(1))
}

/// Checks that `rope_parameters` asks for the plain RoPE this crate implements.
pub fn check_rope(parameters: &Option<RopeParameters>) -> std::result::Result<(), String> {
    match parameters {
        Some(rope) if rope.rope_type != "default" => Err(format!(
            "rope_type {:?} is not supported (only default)",
            rope.rope_type
        )),
        _ => Ok(()),
    }
}

/// The end-of-sequence ids of an `eos_token_id` field.
pub fn eos_ids(field: &Option<EosTokenId>) -> Vec<u32> {
    field.as_ref().map(EosTokenId::ids).unwrap_or_default()
}
