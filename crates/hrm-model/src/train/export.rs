//! Hugging Face checkpoints written from a training run.

use std::collections::HashMap;
use std::path::Path;

use candle_core::DType;
use candle_nn::VarMap;

use super::sorted_vars;
use crate::ModelSpec;
use crate::{Error, Result};

/// Writes a Hugging Face checkpoint: `config.json`, `model.safetensors` in `dtype`, and the
/// tokenizer (`tokenizer.json`, `tokenizer_config.json`) beside it. `z_L_init` and the MoE
/// router stay in f32, as transformers keeps them.
pub fn save_pretrained(
    dir: &Path,
    spec: &ModelSpec,
    varmap: &VarMap,
    dtype: DType,
    tokenizer: &tokenizers::Tokenizer,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let mut tensors = HashMap::new();
    for (name, var) in sorted_vars(varmap) {
        let keep_f32 = name.ends_with("z_L_init") || name.ends_with("router.weight");
        let t = var.as_tensor().detach();
        tensors.insert(name, if keep_f32 { t } else { t.to_dtype(dtype)? });
    }
    let model_path = dir.join("model.safetensors");
    let tmp = dir.join("model.safetensors.tmp");
    candle_core::safetensors::save(&tensors, &tmp)?;
    std::fs::rename(&tmp, &model_path).map_err(|e| Error::io(&model_path, e))?;

    let mut config = spec.to_config_json();
    config["dtype"] = serde_json::json!(match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    });
    let eot = tokenizer.token_to_id(crate::tokenizer::END_OF_TEXT);
    if let Some(eot) = eot {
        config["eos_token_id"] = eot.into();
        config["pad_token_id"] = eot.into();
    }
    write_json(&dir.join("config.json"), &config)?;
    tokenizer
        .save(dir.join("tokenizer.json"), false)
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": crate::tokenizer::END_OF_TEXT,
            "pad_token": crate::tokenizer::END_OF_TEXT,
            "bos_token": null,
        }),
    )
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).expect("JSON serialises");
    std::fs::write(path, text + "\n").map_err(|e| Error::io(path, e))
}
