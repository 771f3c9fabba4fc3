//! Checkpoint loading: what is accepted, and the plain errors for what is not.

mod common;

use std::fs;
use std::path::Path;

use candle_core::{DType, Device};
use common::fixture;
use hrm_model::load_model;

fn load_err(path: &Path) -> String {
    match load_model(path, None, &Device::Cpu, DType::F32) {
        Ok(_) => panic!("{} loaded, but should not", path.display()),
        Err(e) => e.to_string(),
    }
}

fn copy_fixture(name: &str, to: &Path) {
    for entry in fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

#[test]
fn sharded_checkpoints_load_through_their_index() {
    let loaded = load_model(&fixture("llama-gqa"), None, &Device::Cpu, DType::F32).unwrap();
    assert_eq!(loaded.model.info().num_parameters, 127_296);
    assert_eq!(loaded.format, "safetensors");
}

#[test]
fn missing_paths_are_named() {
    let err = load_err(Path::new("/nonexistent/model"));
    assert!(
        err.contains("/nonexistent/model") && err.contains("no such file"),
        "{err}"
    );
}

#[test]
fn pickle_checkpoints_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("config.json"), r#"{"model_type":"llama"}"#).unwrap();
    fs::write(dir.path().join("pytorch_model.bin"), b"not really a pickle").unwrap();
    let err = load_err(dir.path());
    assert!(err.contains("pickle"), "{err}");
    let err = load_err(&dir.path().join("pytorch_model.bin"));
    assert!(err.contains("pickle"), "{err}");
}

#[test]
fn unknown_model_types_list_the_supported_ones() {
    let dir = tempfile::tempdir().unwrap();
    copy_fixture("llama-tied", dir.path());
    let config = fs::read_to_string(dir.path().join("config.json")).unwrap();
    fs::write(
        dir.path().join("config.json"),
        config.replace("\"llama\"", "\"gpt2\""),
    )
    .unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains("gpt2") && err.contains("hrm_text, hrm_text_moe, llama"),
        "{err}"
    );
}

#[test]
fn invalid_moe_configs_say_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    copy_fixture("hrm-text", dir.path());
    let path = dir.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    config["model_type"] = "hrm_text_moe".into();
    config["num_experts"] = 2.into();
    config["num_experts_per_tok"] = 3.into();
    fs::write(&path, config.to_string()).unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains("num_experts_per_tok (3)") && err.contains("num_experts (2)"),
        "{err}"
    );
}

#[test]
fn shards_outside_the_directory_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    copy_fixture("llama-gqa", dir.path());
    let path = dir.path().join("model.safetensors.index.json");
    let index = fs::read_to_string(&path).unwrap();
    fs::write(
        &path,
        index.replace(
            "model-00001-of-00004.safetensors",
            "../model-00001-of-00004.safetensors",
        ),
    )
    .unwrap();
    let err = load_err(dir.path());
    assert!(err.contains("outside the directory"), "{err}");
}

#[test]
fn a_directory_without_a_checkpoint_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let err = load_err(dir.path());
    assert!(err.contains("no config.json and no .gguf"), "{err}");
}

#[test]
fn a_missing_tokenizer_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    copy_fixture("llama-tied", dir.path());
    fs::remove_file(dir.path().join("tokenizer.json")).unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains("tokenizer") && err.contains("tokenizer.json"),
        "{err}"
    );
}
