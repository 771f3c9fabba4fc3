//! The GGUF products (Q4_1 and Q8_0, our repacked kernels) on SmolLM2-135M's shapes, one JSON
//! line per shape and batch (`{"shape": ..., "rows": ..., "seconds": ..., "gb_s": ...}`, the
//! median of `--reps` calls, and the weight bytes it read per second):
//! `cargo bench -p hrm-model --bench quantized -- --reps 200`.
//!
//! The layers' matrices (at most 1.1 MB each) stay in cache between calls, so their rates
//! measure the kernels' arithmetic; the output head (30 MB) streams from memory.
//!
//! A first line times a call to candle's thread team that does nothing
//! (`{"shape": "empty team call", "seconds": ...}`): the hand-off and the wait every product
//! above one thread pays, to set beside the products' times.

mod common;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Module, Tensor};
use hrm_model::layers::Linear;

/// `(name, out, in, format)`.
const SHAPES: [(&str, usize, usize, GgmlDType); 5] = [
    ("qkv", 960, 576, GgmlDType::Q4_1),
    ("o", 576, 576, GgmlDType::Q4_1),
    ("gate_up", 3072, 576, GgmlDType::Q4_1),
    ("down", 576, 1536, GgmlDType::Q4_1),
    ("lm head", 49152, 576, GgmlDType::Q8_0),
];

fn main() {
    let reps = common::reps(200);
    let team = candle_core::utils::barrier_pool();
    let seconds = common::median_seconds(reps, || team.execute(|_| {}));
    println!(
        "{}",
        serde_json::json!({"shape": "empty team call", "threads": team.n_workers() + 1,
                           "seconds": seconds})
    );
    for (name, out, k, format) in SHAPES {
        let w = Tensor::randn(0f32, 1.0, (out, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, format).unwrap();
        let bytes = q.storage_size_in_bytes();
        let linear = Linear::quantized(q).unwrap();
        for rows in [1, 8] {
            let x = Tensor::randn(0f32, 1.0, (rows, 1, k), &Device::Cpu).unwrap();
            let seconds = common::median_seconds(reps, || {
                linear.forward(&x).unwrap();
            });
            println!(
                "{}",
                serde_json::json!({"shape": name, "format": format!("{format:?}"), "rows": rows,
                                   "out": out, "in": k, "seconds": seconds,
                                   "gb_s": bytes as f64 / seconds / 1e9})
            );
        }
    }
}
