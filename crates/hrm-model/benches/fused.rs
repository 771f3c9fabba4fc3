//! The fused CPU kernels against the same work as candle tensor ops, alternating, in one
//! process: the AdamW step on 7.3M parameters (the size of the bundled samples), RMSNorm's
//! forward and backward passes on a training batch's activations (2048 tokens x 256), and
//! softmax's on its attention scores (8 sequences x 4 heads x 128 x 128), SwiGLU's on the MLP's
//! gate and up halves (2048 tokens x 768), RoPE's on queries (8 x 4 heads x 128 x 64) and the
//! cross-entropy's on the logits (1016 tokens x 8192): `cargo bench -p hrm-model --bench fused`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use candle_core::{D, DType, Device, Tensor, Var};
use hrm_model::fused::{RmsNormOp, RopeOp, SoftmaxOp, cross_entropy, swiglu};
use hrm_model::layers::{RopeLayout, rope_composed};
use hrm_model::train::{AdamW, AdamWConfig};

const SHAPES: [&[usize]; 4] = [&[2048, 1024], &[1024, 1024], &[4096, 512], &[1024]];
const STEPS: u32 = 5;

fn optimiser() -> AdamW {
    let params = SHAPES
        .iter()
        .enumerate()
        .map(|(i, &shape)| {
            let values = Tensor::ones(shape, DType::F32, &Device::Cpu).unwrap();
            (format!("p{i}"), Var::from_tensor(&values).unwrap())
        })
        .collect();
    AdamW::new(params, AdamWConfig::default()).unwrap()
}

fn timed(mut step: impl FnMut()) -> Duration {
    let started = Instant::now();
    for _ in 0..STEPS {
        step();
    }
    started.elapsed() / STEPS
}

/// Seven rounds of `ours` against `theirs`; prints each and the median speed-up.
fn compare(what: &str, mut ours: impl FnMut(), mut theirs: impl FnMut()) {
    let mut ratios = Vec::new();
    for round in 0..7 {
        let fused = timed(&mut ours);
        let composed = timed(&mut theirs);
        let ratio = composed.as_secs_f64() / fused.as_secs_f64();
        println!("{what} round {round}: fused {fused:.2?}, tensor ops {composed:.2?}: {ratio:.2}x");
        ratios.push(ratio);
    }
    ratios.sort_by(f64::total_cmp);
    println!("{what}: median speed-up {:.2}x", ratios[ratios.len() / 2]);
}

fn main() {
    let grads: HashMap<String, Tensor> = SHAPES
        .iter()
        .enumerate()
        .map(|(i, &shape)| {
            let values = (Tensor::ones(shape, DType::F32, &Device::Cpu).unwrap() * 0.5).unwrap();
            (format!("p{i}"), values)
        })
        .collect();
    let (mut fused, mut composed) = (optimiser(), optimiser());
    compare(
        "AdamW step",
        || fused.step(&grads, 1e-3).unwrap(),
        || composed.step_composed(&grads, 1e-3).unwrap(),
    );

    let (x, rms_backward) = input_and_loss(&[2048, 256], &[2048, 256]);
    compare(
        "RMSNorm forward and backward",
        || rms_backward(x.as_tensor().apply_op1(RmsNormOp { eps: 1e-6 }).unwrap()),
        || {
            let xs = x.as_tensor();
            let ms = xs.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
            rms_backward(
                xs.broadcast_div(&(ms + 1e-6).unwrap().sqrt().unwrap())
                    .unwrap(),
            )
        },
    );

    let (scores, softmax_backward) = input_and_loss(&[8, 4, 128, 128], &[8, 4, 128, 128]);
    compare(
        "softmax forward and backward",
        || softmax_backward(scores.as_tensor().apply_op1(SoftmaxOp).unwrap()),
        || softmax_backward(candle_nn::ops::softmax(scores.as_tensor(), D::Minus1).unwrap()),
    );

    let (gate_up, swiglu_backward) = input_and_loss(&[2048, 1536], &[2048, 768]);
    compare(
        "SwiGLU forward and backward",
        || swiglu_backward(swiglu(gate_up.as_tensor()).unwrap()),
        || {
            let both = gate_up.as_tensor();
            let gate = both.narrow(D::Minus1, 0, 768).unwrap();
            let up = both.narrow(D::Minus1, 768, 768).unwrap();
            swiglu_backward((gate.silu().unwrap() * up).unwrap())
        },
    );

    let (queries, rope_backward) = input_and_loss(&[8, 4, 128, 64], &[8, 4, 128, 64]);
    let angles = Tensor::randn(0f32, 10.0, (8, 128, 32), &Device::Cpu).unwrap();
    let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
    compare(
        "RoPE forward and backward",
        || {
            let op = RopeOp {
                layout: RopeLayout::Halves,
            };
            rope_backward(queries.as_tensor().apply_op3(&cos, &sin, op).unwrap())
        },
        || {
            let q = queries.as_tensor();
            rope_backward(rope_composed(q, &cos, &sin, RopeLayout::Halves).unwrap())
        },
    );

    let logits =
        Var::from_tensor(&Tensor::randn(0f32, 3.0, (1016, 8192), &Device::Cpu).unwrap()).unwrap();
    let labels: Vec<u32> = (0..1016).map(|i| (i * 7919 % 8192) as u32).collect();
    let label_tensor = Tensor::from_slice(&labels, 1016, &Device::Cpu).unwrap();
    compare(
        "cross-entropy forward and backward",
        || {
            let loss = cross_entropy(logits.as_tensor(), &labels).unwrap();
            loss.backward().unwrap();
        },
        || {
            let loss = candle_nn::loss::cross_entropy(logits.as_tensor(), &label_tensor).unwrap();
            loss.backward().unwrap();
        },
    );
}

/// A random input of `shape` to differentiate, and a backward pass from `sum(y · w)` for an
/// output `y` of `out_shape`: a loss that weighs every output differently.
fn input_and_loss(shape: &[usize], out_shape: &[usize]) -> (Var, impl Fn(Tensor)) {
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap()).unwrap();
    let weights = Tensor::randn(0f32, 1.0, out_shape, &Device::Cpu).unwrap();
    let backward = move |y: Tensor| {
        let loss = (y * &weights).unwrap().sum_all().unwrap();
        loss.backward().unwrap();
    };
    (x, backward)
}
