//! Helpers shared by the model crate's integration tests.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use hrm_model::{LoadedModel, load_model};

/// `tests/fixtures/NAME` at the repository root.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

pub fn load(name: &str) -> LoadedModel {
    load_model(&fixture(name), None, &Device::Cpu, DType::F32)
        .unwrap_or_else(|e| panic!("loading {name}: {e}"))
}

/// What transformers computed for a fixture (see tests/reference/make_fixtures.py).
pub struct Expected {
    pub input_ids: Vec<u32>,
    pub prompt_len: usize,
    pub logits_full: Tensor,
    pub logits_stepwise: Tensor,
}

pub fn expected(name: &str) -> Expected {
    let tensors: HashMap<String, Tensor> =
        candle_core::safetensors::load(fixture(name).join("expected.safetensors"), &Device::Cpu)
            .unwrap();
    let ids: Vec<i64> = tensors["input_ids"]
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let prompt_len: Vec<i64> = tensors["prompt_len"].to_vec1().unwrap();
    Expected {
        input_ids: ids.into_iter().map(|i| i as u32).collect(),
        prompt_len: prompt_len[0] as usize,
        logits_full: tensors["logits_full"].squeeze(0).unwrap(),
        logits_stepwise: tensors["logits_stepwise"].squeeze(0).unwrap(),
    }
}

/// Largest absolute elementwise difference.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Largest absolute element: the scale a gradient's tolerance is relative to.
pub fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Asserts that `got` is within `tolerance` of `want`, relative to `want`'s largest element (at
/// least 1e-3, so that a vanishing gradient is not held to nothing): how gradients are held to a
/// reference's.
pub fn assert_within_scale(got: &Tensor, want: &Tensor, tolerance: f32, what: &str) {
    let scale = max_abs(want);
    let diff = max_abs_diff(got, want);
    assert!(
        diff <= tolerance * scale.max(1e-3),
        "{what}: differs by {diff} (scale {scale})"
    );
}
