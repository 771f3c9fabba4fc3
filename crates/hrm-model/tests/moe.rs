//! `hrm_text_moe`: one expert with top-1 is the dense model; routing is dropless (a token's output
//! never depends on its batch); the router and expert gradients agree with finite differences; and
//! the block's output and gradients match transformers' Mixtral block with the same weights.

mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, IndexOp, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use common::{assert_within_scale, expected, fixture, max_abs_diff};
use hrm_model::hrm_text::{HrmText, HrmTextConfig};
use hrm_model::moe::MoeMlp;
use hrm_model::{CausalLm, ForwardBatch, Logits, ModelConfig};

fn logits(model: &dyn CausalLm, rows: &[Vec<u32>]) -> Tensor {
    let info = model.info();
    let blocks = vec![0; rows.len()];
    let mut batch = ForwardBatch::new(
        rows,
        &blocks,
        Vec::new(),
        Logits::All,
        &info.device,
        info.dtype,
    )
    .unwrap();
    model.forward(&mut batch).unwrap().logits
}

fn moe_config(experts: usize, top_k: usize) -> HrmTextConfig {
    let mut config = HrmTextConfig::from_file(&fixture("hrm-text").join("config.json")).unwrap();
    config.model_type = "hrm_text_moe".into();
    config.num_experts = Some(experts);
    config.num_experts_per_tok = Some(top_k);
    config.router_aux_loss_coef = Some(0.01);
    config
}

#[test]
fn one_expert_top_one_is_the_dense_model() {
    let dir = fixture("hrm-text");
    let dense_tensors =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut moe_tensors: HashMap<String, Tensor> = HashMap::new();
    for (name, t) in &dense_tensors {
        if let Some(prefix) = name.strip_suffix("mlp.gate_up_proj.weight") {
            moe_tensors.insert(
                format!("{prefix}mlp.experts.gate_up_proj"),
                t.unsqueeze(0).unwrap(),
            );
            let router = Tensor::randn(0f32, 1.0, (1, t.dim(1).unwrap()), &Device::Cpu).unwrap();
            moe_tensors.insert(format!("{prefix}mlp.router.weight"), router);
        } else if let Some(prefix) = name.strip_suffix("mlp.down_proj.weight") {
            moe_tensors.insert(
                format!("{prefix}mlp.experts.down_proj"),
                t.unsqueeze(0).unwrap(),
            );
        } else {
            moe_tensors.insert(name.clone(), t.clone());
        }
    }
    let vb = VarBuilder::from_tensors(moe_tensors, DType::F32, &Device::Cpu);
    let moe = HrmText::new(moe_config(1, 1), vb).unwrap();
    let dense = common::load("hrm-text");
    let ids = expected("hrm-text").input_ids;
    let out = {
        let info = moe.info();
        let mut batch = ForwardBatch::new(
            std::slice::from_ref(&ids),
            &[0],
            Vec::new(),
            Logits::All,
            &info.device,
            info.dtype,
        )
        .unwrap();
        moe.forward(&mut batch).unwrap()
    };
    let diff = max_abs_diff(&out.logits, &logits(dense.model.as_ref(), &[ids]));
    assert!(
        diff < 1e-5,
        "MoE(1 expert, top-1) differs from dense by {diff}"
    );
    // Routing everything to one expert is maximally unbalanced: the loss is E * 1 * 1 = 1.
    let aux = out
        .aux_loss
        .expect("an MoE pass reports its load-balancing loss");
    assert!((aux.to_scalar::<f32>().unwrap() - 1.0).abs() < 1e-6);
}

#[test]
fn routing_is_dropless_and_batch_independent() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = HrmText::new(moe_config(4, 2), vb).unwrap();
    let a: Vec<u32> = vec![5, 17, 99, 3, 250, 31, 8];
    let b: Vec<u32> = vec![200, 201, 202, 203, 204, 205, 206];
    let c: Vec<u32> = vec![42, 42, 42];
    let alone = logits(&model, std::slice::from_ref(&a)).i(0).unwrap();
    for others in [vec![b.clone()], vec![b.clone(), c.clone()], vec![c.clone()]] {
        let mut rows = vec![a.clone()];
        rows.extend(others);
        let together = logits(&model, &rows).i(0).unwrap();
        let diff = max_abs_diff(&alone, &together);
        assert!(diff < 1e-5, "token outputs depend on the batch: {diff}");
    }
}

/// `sum(out * probe) + 0.3 * aux` for the block, in f64.
fn objective(moe: &MoeMlp, x: &Tensor, probe: &Tensor) -> Tensor {
    let (out, aux) = moe.forward(x).unwrap();
    ((out * probe).unwrap().sum_all().unwrap() + (aux * 0.3).unwrap()).unwrap()
}

#[test]
fn router_and_experts_agree_with_finite_differences() {
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F64, &device);
    let (hidden, intermediate, experts, top_k) = (6, 5, 4, 2);
    let moe = MoeMlp::load(vb.pp("mlp"), hidden, intermediate, experts, top_k).unwrap();
    let x = Var::from_tensor(&Tensor::randn(0f64, 1.0, (2, 3, hidden), &device).unwrap()).unwrap();
    let probe = Tensor::randn(0f64, 1.0, (2, 3, hidden), &device).unwrap();

    let grads = objective(&moe, x.as_tensor(), &probe).backward().unwrap();
    let mut vars: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars.push(("x".into(), x.clone()));
    assert_eq!(vars.len(), 4, "router, gate_up, down and the input");

    let eps = 1e-6;
    for (name, var) in &vars {
        let grad = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        let grad: Vec<f64> = grad.flatten_all().unwrap().to_vec1().unwrap();
        let base: Vec<f64> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        let shape = var.as_tensor().shape().clone();
        let mut checked = 0;
        for i in (0..base.len()).step_by(base.len().div_ceil(12)) {
            let eval = |delta: f64| {
                let mut v = base.clone();
                v[i] += delta;
                var.set(&Tensor::from_vec(v, shape.clone(), &device).unwrap())
                    .unwrap();
                objective(&moe, x.as_tensor(), &probe)
                    .to_scalar::<f64>()
                    .unwrap()
            };
            let numeric = (eval(eps) - eval(-eps)) / (2.0 * eps);
            var.set(&Tensor::from_vec(base.clone(), shape.clone(), &device).unwrap())
                .unwrap();
            let tolerance = 1e-6 * (1.0 + numeric.abs());
            assert!(
                (numeric - grad[i]).abs() < tolerance,
                "{name}[{i}]: autograd {} vs finite difference {numeric}",
                grad[i]
            );
            checked += 1;
        }
        assert!(checked >= 6, "{name}: only {checked} entries checked");
        assert!(
            grad.iter().any(|g| g.abs() > 1e-9),
            "{name}: gradient is all zero"
        );
    }
}

/// The block against transformers' `MixtralSparseMoeBlock` with the same weights
/// (`tests/fixtures/moe-block.safetensors`, from `tests/reference/make_fixtures.py`): output,
/// load-balancing loss, and the gradients of `sum(out * probe) + 0.5 * aux` through the fused
/// gather, grouped matmuls, SwiGLU and weighted scatter.
#[test]
fn block_and_gradients_match_transformers_mixtral() {
    let device = Device::Cpu;
    let reference: HashMap<String, Tensor> =
        candle_core::safetensors::load(fixture("moe-block.safetensors"), &device).unwrap();
    let weights = ["router.weight", "experts.gate_up_proj", "experts.down_proj"];
    let varmap = VarMap::new();
    {
        let mut data = varmap.data().lock().unwrap();
        for name in weights {
            let var = Var::from_tensor(&reference[name]).unwrap();
            data.insert(format!("mlp.{name}"), var);
        }
    }
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &device);
    let (experts, two_intermediate, hidden) = reference["experts.gate_up_proj"].dims3().unwrap();
    let top_k = 2;
    let moe = MoeMlp::load(vb.pp("mlp"), hidden, two_intermediate / 2, experts, top_k).unwrap();
    let x = Var::from_tensor(&reference["x"]).unwrap();

    let (out, aux) = moe.forward(x.as_tensor()).unwrap();
    let diff = max_abs_diff(&out, &reference["out"]);
    assert!(diff < 1e-5, "block output differs from Mixtral's by {diff}");
    // Mixtral counts each token's k choices against 1, where ours counts them against k.
    let mixtral_aux = (aux * top_k as f64).unwrap();
    let theirs = reference["aux"].to_vec1::<f32>().unwrap()[0];
    let ours = mixtral_aux.to_scalar::<f32>().unwrap();
    assert!(
        (ours - theirs).abs() < 1e-5,
        "aux {ours} vs Mixtral {theirs}"
    );

    let objective = ((out * &reference["probe"]).unwrap().sum_all().unwrap()
        + (mixtral_aux * 0.5).unwrap())
    .unwrap();
    let grads = objective.backward().unwrap();
    let mut checked: Vec<(String, Tensor)> = weights
        .iter()
        .map(|name| {
            let var = varmap.data().lock().unwrap()[&format!("mlp.{name}")].clone();
            (name.to_string(), var.as_tensor().clone())
        })
        .collect();
    checked.push(("x".into(), x.as_tensor().clone()));
    for (name, tensor) in checked {
        let want = &reference[&format!("grad.{name}")];
        let got = grads
            .get(&tensor)
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        assert_within_scale(
            got,
            want,
            1e-5,
            &format!("{name}: gradient against Mixtral's"),
        );
    }
}
