//! The fused AdamW step against the same step as candle tensor ops, on 7.3M parameters (the
//! size of the bundled samples), alternating, in one process:
//! `cargo bench -p hrm-model --bench adamw`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor, Var};
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
    let mut ratios = Vec::new();
    for round in 0..7 {
        let f = timed(|| fused.step(&grads, 1e-3).unwrap());
        let c = timed(|| composed.step_composed(&grads, 1e-3).unwrap());
        let ratio = c.as_secs_f64() / f.as_secs_f64();
        println!("round {round}: fused {f:.1?}, tensor ops {c:.1?}: {ratio:.2}x");
        ratios.push(ratio);
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "median speed-up of the fused step: {:.2}x",
        ratios[ratios.len() / 2]
    );
}
