//! Training goes through the same forward pass as inference. candle's fused RMSNorm, RoPE and
//! softmax kernels have no backward pass, so the layers switch to composed ops when gradients are
//! tracked; this test fails if any parameter is left without a gradient.

mod common;

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use common::fixture;
use hrm_model::hrm_text::{HrmText, HrmTextConfig};
use hrm_model::llama::{Llama, LlamaConfig};
use hrm_model::{CausalLm, ForwardBatch, Logits, ModelConfig};

fn assert_every_parameter_learns(model: &dyn CausalLm, varmap: &VarMap, what: &str) {
    let rows = vec![
        vec![3u32, 14, 15, 92, 65, 35, 89, 79],
        vec![26, 53, 58, 97, 93, 23, 84, 62],
    ];
    let mut batch = ForwardBatch::new(
        &rows,
        &[4, 0],
        Vec::new(),
        Logits::All,
        &Device::Cpu,
        DType::F32,
    )
    .unwrap();
    let out = model.forward(&mut batch).unwrap();
    let logits = out.logits;
    let mut loss = candle_nn::loss::cross_entropy(
        &logits.flatten_to(1).unwrap(),
        &logits.argmin(2).unwrap().flatten_all().unwrap(),
    )
    .unwrap();
    if let Some(aux) = out.aux_loss {
        loss = (loss + aux).unwrap();
    }
    let grads = loss.backward().unwrap();
    let data = varmap.data().lock().unwrap();
    assert!(data.len() > 5, "{what}: only {} parameters", data.len());
    for (name, var) in data.iter() {
        if name == "model.z_L_init" {
            assert!(
                grads.get(var.as_tensor()).is_none(),
                "{what}: z_L_init is frozen, as in transformers"
            );
            continue;
        }
        let grad = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("{what}: {name} receives no gradient"));
        let norm = grad
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(
            norm > 0.0 && norm.is_finite(),
            "{what}: {name} has gradient norm {norm}"
        );
    }
}

#[test]
fn every_hrm_text_parameter_receives_a_gradient() {
    for moe in [false, true] {
        let mut config =
            HrmTextConfig::from_file(&fixture("hrm-text-prefix").join("config.json")).unwrap();
        if moe {
            config.model_type = "hrm_text_moe".into();
            config.num_experts = Some(4);
            config.num_experts_per_tok = Some(2);
        }
        let varmap = VarMap::new();
        let model = HrmText::new(
            config,
            VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
        )
        .unwrap();
        // z_L_init starts at zero; give it a value so the pass does not hide a path behind zeros.
        varmap
            .data()
            .lock()
            .unwrap()
            .get("model.z_L_init")
            .unwrap()
            .set(&candle_core::Tensor::randn(0f32, 1.0, 64, &Device::Cpu).unwrap())
            .unwrap();
        assert_every_parameter_learns(
            &model,
            &varmap,
            if moe { "hrm_text_moe" } else { "hrm_text" },
        );
    }
}

#[test]
fn every_llama_parameter_receives_a_gradient() {
    let config = LlamaConfig::from_file(&fixture("llama-gqa").join("config.json")).unwrap();
    let varmap = VarMap::new();
    let model = Llama::new(
        &config,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )
    .unwrap();
    assert_every_parameter_learns(&model, &varmap, "llama");
}
