//! Finds out what a checkpoint path holds and loads model and tokenizer from it.
//!
//! Accepted: a Hugging Face directory (`config.json`, `model.safetensors` or a sharded
//! `model.safetensors.index.json`, `tokenizer.json`) of `model_type` `hrm_text`, `hrm_text_moe` or
//! `llama`; or a llama.cpp `.gguf` file (or a directory holding exactly one). Pickle checkpoints
//! (`.bin`, `.pt`) are refused: they can run code when loaded.

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device};
use candle_nn::VarBuilder;

use crate::config::ModelSpec;
use crate::hrm_text::HrmText;
use crate::llama::Llama;
use crate::tokenizer::TextTokenizer;
use crate::{CausalLm, Error, Result};

/// A model ready to run, with its tokenizer.
pub struct LoadedModel {
    pub model: Box<dyn CausalLm>,
    pub tokenizer: TextTokenizer,
    /// A short name for the model: the checkpoint directory's or file's name.
    pub name: String,
    /// `safetensors` or `gguf`, and for GGUF the quantisation of its matrices.
    pub format: String,
}

/// Loads the checkpoint at `path`. `tokenizer_path` overrides the tokenizer found beside it.
pub fn load_model(
    path: &Path,
    tokenizer_path: Option<&Path>,
    device: &Device,
    dtype: DType,
) -> Result<LoadedModel> {
    if !path.exists() {
        return Err(Error::io(
            path,
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
        ));
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
        .unwrap_or_else(|| "model".into());
    if let Some(gguf) = gguf_path(path)? {
        return load_gguf(&gguf, tokenizer_path, device, name);
    }
    let config_path = path.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
    // The weights first: a pickle checkpoint is refused as such, whatever its config says.
    let weights = safetensors_files(path)?;
    let spec = ModelSpec::from_config_json(&text, &config_path)?;
    let tokenizer_file = tokenizer_path
        .map(Path::to_path_buf)
        .unwrap_or_else(|| path.join("tokenizer.json"));
    // SAFETY: the files are mapped read-only; nothing in this process writes to them, and a
    // concurrent writer outside the process is outside what a model server can defend against.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&weights, dtype, device)? };
    let num_parameters = count_parameters(&weights)?;
    let (model, tokenizer): (Box<dyn CausalLm>, _) = match spec {
        ModelSpec::HrmText(config) => {
            let tokenizer = TextTokenizer::from_file(
                &tokenizer_file,
                config.eos_token_ids(),
                config.bos_token_id,
            )?;
            let mut model = HrmText::new(config, vb)?;
            model.set_num_parameters(num_parameters);
            (Box::new(model), tokenizer)
        }
        ModelSpec::Llama(config) => {
            let tokenizer =
                TextTokenizer::from_file(&tokenizer_file, config.eos_token_ids(), None)?;
            let mut model = Llama::new(&config, vb)?;
            model.set_num_parameters(num_parameters);
            (Box::new(model), tokenizer)
        }
    };
    Ok(LoadedModel {
        model,
        tokenizer,
        name,
        format: "safetensors".into(),
    })
}

fn gguf_path(path: &Path) -> Result<Option<PathBuf>> {
    if path.is_file() {
        return match path.extension().and_then(|e| e.to_str()) {
            Some("gguf") => Ok(Some(path.to_path_buf())),
            Some("bin" | "pt" | "pth" | "ckpt" | "pkl") => Err(pickle_refused(path)),
            _ => Err(Error::Unsupported {
                path: path.into(),
                message: "expected a checkpoint directory or a .gguf file".into(),
            }),
        };
    }
    if path.join("config.json").exists() {
        return Ok(None);
    }
    let ggufs: Vec<PathBuf> = list_dir(path)?
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    match ggufs.as_slice() {
        [one] => Ok(Some(one.clone())),
        [] => Err(Error::Unsupported {
            path: path.into(),
            message: "no config.json and no .gguf file in this directory".into(),
        }),
        _ => Err(Error::Unsupported {
            path: path.into(),
            message: "several .gguf files in this directory; name one".into(),
        }),
    }
}

fn list_dir(path: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(path).map_err(|e| Error::io(path, e))?;
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    Ok(paths)
}

fn pickle_refused(path: &Path) -> Error {
    Error::Unsupported {
        path: path.into(),
        message:
            "pickle checkpoints can run code when loaded and are refused; convert to safetensors"
                .into(),
    }
}

/// `model.safetensors`, or every shard named by `model.safetensors.index.json`.
fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index_path = dir.join("model.safetensors.index.json");
    if index_path.exists() {
        let text = std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
        let index: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Config {
            path: index_path.clone(),
            message: e.to_string(),
        })?;
        let map = index["weight_map"]
            .as_object()
            .ok_or_else(|| Error::Config {
                path: index_path.clone(),
                message: "no weight_map".into(),
            })?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(|v| v.as_str().map(String::from))
            .collect();
        files.sort();
        files.dedup();
        return files
            .into_iter()
            .map(|f| {
                let shard = dir.join(&f);
                // A shard name must stay inside the checkpoint directory.
                if Path::new(&f).components().count() != 1 || !shard.exists() {
                    return Err(Error::Config {
                        path: index_path.clone(),
                        message: format!("shard {f:?} is missing or outside the directory"),
                    });
                }
                Ok(shard)
            })
            .collect();
    }
    if [
        "pytorch_model.bin",
        "model.pt",
        "pytorch_model.bin.index.json",
    ]
    .iter()
    .any(|f| dir.join(f).exists())
    {
        return Err(pickle_refused(dir));
    }
    Err(Error::Unsupported {
        path: dir.into(),
        message: "no model.safetensors or model.safetensors.index.json".into(),
    })
}

fn count_parameters(files: &[PathBuf]) -> Result<usize> {
    // SAFETY: as in `load_model`, read-only mappings of files this process does not write.
    let tensors = unsafe { candle_core::safetensors::MmapedSafetensors::multi(files)? };
    Ok(tensors
        .tensors()
        .iter()
        .map(|(_, view)| view.shape().iter().product::<usize>())
        .sum())
}

fn load_gguf(
    path: &Path,
    tokenizer_path: Option<&Path>,
    device: &Device,
    name: String,
) -> Result<LoadedModel> {
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let content = gguf_file::Content::read(&mut file).map_err(|e| e.with_path(path))?;
    let (mut model, _config) = Llama::from_gguf(&content, &mut file, device)?;
    model.set_num_parameters(
        content
            .tensor_infos
            .values()
            .map(|t| t.shape.elem_count())
            .sum(),
    );
    let tokenizer = match tokenizer_path {
        Some(p) => TextTokenizer::from_file(p, Vec::new(), None)?,
        None => TextTokenizer::from_gguf(&content)?,
    };
    let mut kinds: Vec<String> = content
        .tensor_infos
        .values()
        .filter(|t| t.shape.dims().len() == 2)
        .map(|t| format!("{:?}", t.ggml_dtype))
        .collect();
    kinds.sort();
    kinds.dedup();
    Ok(LoadedModel {
        model: Box::new(model),
        tokenizer,
        name,
        format: format!("gguf ({})", kinds.join(", ")),
    })
}
