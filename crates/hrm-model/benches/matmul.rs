//! candle's f32 matrix multiply on the shapes our models run, as one JSON line per shape
//! (`{"shape": ..., "seconds": ...}`, the median of `--reps` calls), for
//! `benches/gemm_compare.py` to set beside OpenBLAS (numpy) and PyTorch's CPU matmul:
//! `cargo bench -p hrm-model --bench matmul --features avx512-gemm -- --reps 20`. Without
//! `--features avx512-gemm` gemm has only its AVX2 kernels, also on an AVX-512 CPU; the `hrm`
//! binary turns the feature on by default.
//!
//! The shapes are those of `models/sample` (hidden 256, MLP 768, vocabulary 8192, 4 heads of 64)
//! training on micro-batches of 8 x 127 tokens, their backward products, and batch-8 decode.

mod common;

use candle_core::{Device, Tensor};

/// `(name, batch, m, k, n)`: `batch` products of `[m, k] x [k, n]`.
const SHAPES: [(&str, usize, usize, usize, usize); 10] = [
    ("train qkv+gate", 1, 1016, 256, 1024),
    ("train gate_up", 1, 1016, 256, 1536),
    ("train down", 1, 1016, 768, 256),
    ("train lm head", 1, 1016, 256, 8192),
    ("train d(lm head) weight", 1, 8192, 1016, 256),
    ("train d(gate_up) weight", 1, 1536, 1016, 256),
    ("train attention scores", 32, 127, 64, 127),
    ("train attention values", 32, 127, 127, 64),
    ("decode b8 gate_up", 1, 8, 256, 1536),
    ("decode b8 lm head", 1, 8, 256, 8192),
];

fn main() {
    let reps = common::reps(20);
    for (name, batch, m, k, n) in SHAPES {
        let a = Tensor::randn(0f32, 1.0, (batch, m, k), &Device::Cpu).unwrap();
        let b = Tensor::randn(0f32, 1.0, (batch, k, n), &Device::Cpu).unwrap();
        let seconds = common::median_seconds(reps, || {
            a.matmul(&b).unwrap();
        });
        println!(
            "{}",
            serde_json::json!({"shape": name, "batch": batch, "m": m, "k": k, "n": n,
                               "seconds": seconds})
        );
    }
}
