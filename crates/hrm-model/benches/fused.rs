//! The fused CPU kernels against the same work as candle tensor ops, alternating, in one
//! process: the AdamW step on 7.3M parameters (the size of the bundled samples), RMSNorm's
//! forward and backward passes on a training batch's activations (2048 tokens x 256), and
//! softmax's on its attention scores (8 sequences x 4 heads x 128 x 128):
//! `cargo bench -p hrm-model --bench fused`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use candle_core::{D, DType, Device, Tensor, Var};
use hrm_model::fused::{RmsNormOp, SoftmaxOp};
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

    let x =
        Var::from_tensor(&Tensor::randn(0f32, 1.0, (2048, 256), &Device::Cpu).unwrap()).unwrap();
    let weights = Tensor::randn(0f32, 1.0, (2048, 256), &Device::Cpu).unwrap();
    let forward_backward = |y: Tensor| {
        let loss = (y * &weights).unwrap().sum_all().unwrap();
        loss.backward().unwrap();
    };
    compare(
        "RMSNorm forward and backward",
        || forward_backward(x.as_tensor().apply_op1(RmsNormOp { eps: 1e-6 }).unwrap()),
        || {
            let xs = x.as_tensor();
            let ms = xs.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
            forward_backward(
                xs.broadcast_div(&(ms + 1e-6).unwrap().sqrt().unwrap())
                    .unwrap(),
            )
        },
    );

    let shape = (8, 4, 128, 128);
    let scores = Var::from_tensor(&Tensor::randn(0f32, 3.0, shape, &Device::Cpu).unwrap()).unwrap();
    let weights = Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap();
    let forward_backward = |y: Tensor| {
        let loss = (y * &weights).unwrap().sum_all().unwrap();
        loss.backward().unwrap();
    };
    compare(
        "softmax forward and backward",
        || forward_backward(scores.as_tensor().apply_op1(SoftmaxOp).unwrap()),
        || forward_backward(candle_nn::ops::softmax(scores.as_tensor(), D::Minus1).unwrap()),
    );
}
