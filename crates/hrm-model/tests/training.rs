//! Training: gradients against transformers, the objective falling, determinism, gradient
//! accumulation, and resuming from saved optimiser state.

mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use common::{assert_within_scale, expected, fixture, max_abs_diff};
use hrm_model::ModelSpec;
use hrm_model::train::{
    AdamWConfig, LrSchedule, ScheduleKind, Trainer, batch_gradients, lm_loss, sorted_vars,
    trainable_vars,
};

fn schedule(total: usize) -> LrSchedule {
    LrSchedule {
        peak: 3e-3,
        warmup_steps: 2,
        total_steps: total,
        kind: ScheduleKind::Cosine,
        min_ratio: 0.1,
    }
}

fn trainer(name: &str, seed: u64) -> Trainer {
    let spec = ModelSpec::from_config_file(&fixture(name).join("config.json")).unwrap();
    Trainer::new(
        spec,
        seed,
        schedule(100),
        AdamWConfig::default(),
        1.0,
        &Device::Cpu,
    )
    .unwrap()
}

fn weights(varmap: &VarMap) -> Vec<(String, Tensor)> {
    sorted_vars(varmap)
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().copy().unwrap()))
        .collect()
}

fn max_weight_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> f32 {
    a.iter()
        .zip(b)
        .map(|((na, ta), (nb, tb))| {
            assert_eq!(na, nb);
            max_abs_diff(ta, tb)
        })
        .fold(0.0, f32::max)
}

/// Windows of a fixed text, tokenised with the fixture tokenizer.
fn corpus_rows(count: usize, len: usize, offset: usize) -> Vec<Vec<u32>> {
    let tok = tokenizers::Tokenizer::from_file(fixture("hrm-text").join("tokenizer.json")).unwrap();
    let text = "It was a dark and stormy night; the rain fell in torrents. The quick brown fox jumps over \
                the lazy dog. Call me Ishmael. To be, or not to be, that is the question. "
        .repeat(8);
    let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
    (0..count)
        .map(|i| ids[offset + i * 7..offset + i * 7 + len].to_vec())
        .collect()
}

#[test]
fn gradients_match_transformers() {
    for name in ["hrm-text", "llama-tied"] {
        let spec = ModelSpec::from_config_file(&fixture(name).join("config.json")).unwrap();
        let mut varmap = VarMap::new();
        let model = spec.build(&varmap, DType::F32, &Device::Cpu).unwrap();
        varmap
            .load(fixture(name).join("model.safetensors"))
            .unwrap();
        let reference: HashMap<String, Tensor> = candle_core::safetensors::load(
            fixture(name).join("gradients.safetensors"),
            &Device::Cpu,
        )
        .unwrap();

        let rows = vec![expected(name).input_ids];
        let loss = lm_loss(model.as_ref(), &rows, 0.0).unwrap();
        let ours = loss.total.to_scalar::<f32>().unwrap();
        let theirs = reference["loss"].to_vec1::<f32>().unwrap()[0];
        assert!(
            (ours - theirs).abs() < 1e-5,
            "{name}: loss {ours} vs transformers {theirs}"
        );

        let params = trainable_vars(&varmap);
        assert_eq!(
            params.len(),
            reference.len() - 1,
            "{name}: parameter sets differ"
        );
        // Both ways the gradients are taken: candle's backward pass alone, and the trainer's,
        // where the fused products sum their weights' gradients in place.
        let store = loss.total.backward().unwrap();
        let by_candle: HashMap<String, Tensor> = params
            .iter()
            .filter_map(|(param, var)| Some((param.clone(), store.get(var.as_tensor())?.clone())))
            .collect();
        let trainers = batch_gradients(model.as_ref(), &params, &[rows], 0.0).unwrap();
        assert!(
            (trainers.loss - theirs).abs() < 1e-5,
            "{name}: the trainer's loss {} vs transformers {theirs}",
            trainers.loss
        );
        for (way, grads) in [("candle", &by_candle), ("trainer", &trainers.grads)] {
            for (param, _) in &params {
                let want = reference
                    .get(param)
                    .unwrap_or_else(|| panic!("{name}: transformers has no {param}"));
                let got = grads
                    .get(param)
                    .unwrap_or_else(|| panic!("{name}, {way}: no gradient for {param}"));
                assert_within_scale(got, want, 1e-4, &format!("{name}, {way}: {param} gradient"));
            }
        }
    }
}

#[test]
fn the_loss_falls_for_every_family() {
    let rows = corpus_rows(8, 24, 0);
    for (name, moe) in [
        ("hrm-text", false),
        ("hrm-text", true),
        ("llama-gqa", false),
    ] {
        let mut spec = ModelSpec::from_config_file(&fixture(name).join("config.json")).unwrap();
        if moe && let ModelSpec::HrmText(c) = &mut spec {
            c.model_type = "hrm_text_moe".into();
            c.num_experts = Some(4);
            c.num_experts_per_tok = Some(2);
            c.router_aux_loss_coef = Some(0.01);
        }
        let mut trainer = Trainer::new(
            spec,
            3,
            schedule(30),
            AdamWConfig::default(),
            1.0,
            &Device::Cpu,
        )
        .unwrap();
        let before = trainer.evaluate(&rows, 8).unwrap();
        let mut last = None;
        for _ in 0..30 {
            last = Some(trainer.step(std::slice::from_ref(&rows)).unwrap());
        }
        let after = trainer.evaluate(&rows, 8).unwrap();
        let report = last.unwrap();
        assert_eq!(
            report.aux.is_some(),
            moe,
            "{name}: aux loss reported iff MoE"
        );
        assert!(
            after < 0.5 * before,
            "{name} (moe: {moe}): loss {before:.3} -> {after:.3}"
        );
    }
}

#[test]
fn training_is_deterministic_for_a_seed() {
    let rows = corpus_rows(4, 16, 3);
    let run = |seed| {
        let mut t = trainer("hrm-text", seed);
        for _ in 0..3 {
            t.step(std::slice::from_ref(&rows)).unwrap();
        }
        weights(&t.varmap)
    };
    let a = run(11);
    assert_eq!(max_weight_diff(&a, &run(11)), 0.0);
    assert!(max_weight_diff(&a, &run(12)) > 1e-3);
}

#[test]
fn micro_batches_accumulate_to_the_full_batch() {
    let rows = corpus_rows(4, 16, 5);
    let mut whole = trainer("llama-gqa", 5);
    let mut split = trainer("llama-gqa", 5);
    let a = whole.step(std::slice::from_ref(&rows)).unwrap();
    let b = split
        .step(&[rows[..2].to_vec(), rows[2..].to_vec()])
        .unwrap();
    assert!((a.loss - b.loss).abs() < 1e-5 && (a.grad_norm - b.grad_norm).abs() < 1e-4);
    assert_eq!(a.tokens, b.tokens);
    // Adam's first step moves each weight by about lr * g / (|g| + eps): rounding in a gradient
    // near eps shows up as up to ~1e-5 here, while a wrong accumulation flips whole updates
    // (2 * lr = 3e-3).
    let diff = max_weight_diff(&weights(&whole.varmap), &weights(&split.varmap));
    assert!(
        diff < 1e-5,
        "accumulated step differs from the full batch by {diff}"
    );
}

#[test]
fn resuming_from_saved_state_continues_the_same_run() {
    let rows = corpus_rows(4, 16, 9);
    let mut straight = trainer("hrm-text", 21);
    for _ in 0..3 {
        straight.step(std::slice::from_ref(&rows)).unwrap();
    }

    let mut first = trainer("hrm-text", 21);
    for _ in 0..2 {
        first.step(std::slice::from_ref(&rows)).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    first
        .varmap
        .save(dir.path().join("model.safetensors"))
        .unwrap();
    candle_core::safetensors::save(
        &first.optimizer.state().unwrap(),
        dir.path().join("optimizer.safetensors"),
    )
    .unwrap();

    let mut resumed = trainer("hrm-text", 999);
    resumed
        .varmap
        .load(dir.path().join("model.safetensors"))
        .unwrap();
    let state =
        candle_core::safetensors::load(dir.path().join("optimizer.safetensors"), &Device::Cpu)
            .unwrap();
    resumed.optimizer.load_state(&state).unwrap();
    assert_eq!(resumed.optimizer.steps(), 2);
    resumed.step(std::slice::from_ref(&rows)).unwrap();
    assert_eq!(
        max_weight_diff(&weights(&straight.varmap), &weights(&resumed.varmap)),
        0.0
    );
}

#[test]
fn the_schedule_warms_up_then_decays() {
    let s = schedule(102);
    assert!((s.at(0) - 1.5e-3).abs() < 1e-12 && (s.at(1) - 3e-3).abs() < 1e-12);
    assert!((s.at(2) - 3e-3).abs() < 1e-9, "peak right after warm-up");
    assert!(
        (s.at(52) - (3e-4 + 2.7e-3 * 0.5)).abs() < 1e-9,
        "half-way down the cosine"
    );
    assert!((s.at(102) - 3e-4).abs() < 1e-12 && (s.at(500) - 3e-4).abs() < 1e-12);
    let constant = LrSchedule {
        kind: ScheduleKind::Constant,
        ..s
    };
    assert_eq!(constant.at(80), 3e-3);
}
