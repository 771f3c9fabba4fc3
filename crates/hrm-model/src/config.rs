//! What the model configs share: the model families and the one place a `config.json` is
//! mapped to one ([`ModelFamily`], [`ModelSpec`]), the validation trait, the RoPE and
//! end-of-sequence fields of Hugging Face configs, and how their defaults resolve.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::hrm_text::HrmTextConfig;
use crate::llama::LlamaConfig;
use crate::{Error, Result};

/// The architectures this crate runs, named by the `model_type` of their Hugging Face config.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelFamily {
    HrmText,
    HrmTextMoe,
    Llama,
}

impl ModelFamily {
    pub const ALL: [Self; 3] = [Self::HrmText, Self::HrmTextMoe, Self::Llama];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::HrmText => "hrm_text",
            Self::HrmTextMoe => "hrm_text_moe",
            Self::Llama => "llama",
        }
    }

    pub fn from_model_type(model_type: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.as_str() == model_type)
    }
}

/// A model's architecture and its config, as read from `config.json`.
#[derive(Clone, Debug)]
pub enum ModelSpec {
    /// `hrm_text` and `hrm_text_moe`.
    HrmText(HrmTextConfig),
    Llama(LlamaConfig),
}

impl ModelSpec {
    /// Reads a Hugging Face `config.json`.
    pub fn from_config_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_config_json(&text, path)
    }

    /// Parses `config.json` text by its `model_type`; `origin` names it in errors.
    pub fn from_config_json(text: &str, origin: &Path) -> Result<Self> {
        #[derive(Deserialize)]
        struct Probe {
            #[serde(default)]
            model_type: String,
        }
        let probe: Probe = serde_json::from_str(text).map_err(|e| Error::Config {
            path: origin.into(),
            message: e.to_string(),
        })?;
        match ModelFamily::from_model_type(&probe.model_type) {
            Some(ModelFamily::HrmText | ModelFamily::HrmTextMoe) => {
                Ok(Self::HrmText(HrmTextConfig::from_json(text, origin)?))
            }
            Some(ModelFamily::Llama) => Ok(Self::Llama(LlamaConfig::from_json(text, origin)?)),
            None => Err(Error::Unsupported {
                path: origin.into(),
                message: format!(
                    "model_type {:?}; supported: {}",
                    probe.model_type,
                    ModelFamily::ALL.map(ModelFamily::as_str).join(", ")
                ),
            }),
        }
    }

    pub fn family(&self) -> ModelFamily {
        match self {
            Self::HrmText(c) => c.family(),
            Self::Llama(_) => ModelFamily::Llama,
        }
    }

    /// The config as transformers writes it (`num_hidden_layers` inflated for HRM-Text).
    pub fn to_config_json(&self) -> serde_json::Value {
        match self {
            Self::HrmText(c) => {
                let mut c = c.clone();
                c.num_layers_per_stack = Some(c.layers_per_stack());
                c.num_hidden_layers = c.cache_slots();
                let mut json = serde_json::to_value(&c).expect("config serialises");
                let arch = if c.is_moe() {
                    "HrmTextMoeForCausalLM"
                } else {
                    "HrmTextForCausalLM"
                };
                json["architectures"] = serde_json::json!([arch]);
                json
            }
            Self::Llama(c) => {
                let mut json = serde_json::to_value(c).expect("config serialises");
                json["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
                json
            }
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Self::HrmText(c) => c.vocab_size,
            Self::Llama(c) => c.vocab_size,
        }
    }
}

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
