//! The volunteer network's one computation: train a checkpoint on a batch as the hub's plan
//! says and return the pseudo-gradient (weights before minus weights after) in the flat layout
//! of the network's files. Workers run it for every batch; the hub runs the same function to
//! re-verify a sample of them, so an honest worker's upload and the hub's recomputation cannot
//! drift apart.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use hrm_wire::TrainingPlan;
use hrm_wire::update::Schema;
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::{AdamWConfig, LrSchedule, ScheduleKind, StepReport, Trainer, sorted_vars};
use crate::ModelSpec;
use crate::{Error, Result};

/// How a volunteer trains on one batch, as the hub prescribes it: fresh AdamW state, a
/// constant learning rate, `inner_steps` steps over a seeded shuffle of the batch.
#[derive(Clone, Debug, PartialEq)]
pub struct LocalTraining {
    pub inner_steps: usize,
    pub learning_rate: f64,
    /// Steps of linear warmup up to `learning_rate`.
    pub warmup_steps: usize,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub grad_clip: f64,
    pub seed: u64,
    /// Rows per forward pass; gradients are accumulated, so it changes memory, not the result.
    pub micro_batch: usize,
}

/// The outcome of [`local_update`].
pub struct LocalUpdate {
    /// Per variable, start weights minus end weights (a pseudo-gradient: it points uphill).
    pub delta: HashMap<String, Tensor>,
    /// Mean training loss over the inner steps.
    pub mean_loss: f64,
    pub tokens: usize,
}

/// Trains a copy of `weights` on `samples` as `plan` says and returns the change.
/// `on_step(step, report)` is called after each inner step.
pub fn local_update(
    spec: &ModelSpec,
    weights: &HashMap<String, Tensor>,
    samples: &[Vec<u32>],
    plan: &LocalTraining,
    device: &Device,
    mut on_step: impl FnMut(usize, &StepReport),
) -> Result<LocalUpdate> {
    use rand::seq::SliceRandom;
    if samples.is_empty() || plan.inner_steps == 0 {
        return Err(Error::InvalidInput(
            "a local update needs samples and at least one step".into(),
        ));
    }
    let schedule = LrSchedule {
        peak: plan.learning_rate,
        warmup_steps: plan.warmup_steps,
        total_steps: plan.inner_steps,
        kind: ScheduleKind::Constant,
        min_ratio: 1.0,
    };
    let optimizer = AdamWConfig {
        beta1: plan.beta1,
        beta2: plan.beta2,
        weight_decay: plan.weight_decay,
        ..AdamWConfig::default()
    };
    let mut trainer = Trainer::from_weights(
        spec.clone(),
        weights,
        schedule,
        optimizer,
        plan.grad_clip,
        device,
    )?;
    let mut start = HashMap::new();
    for (name, var) in sorted_vars(&trainer.varmap) {
        start.insert(name, var.as_tensor().copy()?);
    }
    let mut order: Vec<usize> = (0..samples.len()).collect();
    order.shuffle(&mut StdRng::seed_from_u64(plan.seed));
    let per_step = samples.len().div_ceil(plan.inner_steps);
    let (mut loss_sum, mut steps, mut tokens) = (0.0, 0usize, 0usize);
    for (step, group) in order.chunks(per_step).enumerate() {
        let rows: Vec<Vec<u32>> = group.iter().map(|&i| samples[i].clone()).collect();
        let micro: Vec<Vec<Vec<u32>>> = rows
            .chunks(plan.micro_batch.max(1))
            .map(<[_]>::to_vec)
            .collect();
        let report = trainer.step(&micro)?;
        loss_sum += f64::from(report.loss);
        tokens += report.tokens;
        steps += 1;
        on_step(step, &report);
    }
    let mut delta = HashMap::new();
    for (name, var) in sorted_vars(&trainer.varmap) {
        delta.insert(name.clone(), (&start[&name] - var.as_tensor())?);
    }
    Ok(LocalUpdate {
        delta,
        mean_loss: loss_sum / steps as f64,
        tokens,
    })
}

impl LocalTraining {
    /// The hub's plan, with `micro_batch` rows per forward pass.
    pub fn from_plan(plan: &TrainingPlan, micro_batch: usize) -> Self {
        Self {
            inner_steps: plan.inner_steps as usize,
            learning_rate: plan.learning_rate,
            warmup_steps: plan.warmup_steps as usize,
            weight_decay: plan.weight_decay,
            beta1: plan.beta1,
            beta2: plan.beta2,
            grad_clip: plan.grad_clip,
            seed: plan.seed,
            micro_batch,
        }
    }
}

/// Flat parameters (schema order) as named tensors on `device`.
pub fn to_tensors(
    schema: &Schema,
    flat: &[f32],
    device: &Device,
) -> Result<HashMap<String, Tensor>> {
    if flat.len() != schema.num_parameters() {
        return Err(Error::InvalidInput(format!(
            "{} values for a schema of {} parameters",
            flat.len(),
            schema.num_parameters()
        )));
    }
    schema
        .offsets()
        .map(|(spec, range)| {
            Ok((
                spec.name.clone(),
                Tensor::from_slice(&flat[range], spec.shape.as_slice(), device)?,
            ))
        })
        .collect()
}

/// Named tensors back to one flat f32 vector in schema order.
pub fn to_flat(schema: &Schema, tensors: &HashMap<String, Tensor>) -> Result<Vec<f32>> {
    let mut flat = Vec::with_capacity(schema.num_parameters());
    for spec in &schema.params {
        let t = tensors
            .get(&spec.name)
            .ok_or_else(|| Error::InvalidInput(format!("no tensor {}", spec.name)))?;
        flat.extend(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
    }
    Ok(flat)
}

/// What one batch of local training produced, flat.
pub struct TrainedUpdate {
    /// Weights before minus weights after, schema order.
    pub flat: Vec<f32>,
    pub mean_loss: f64,
    pub tokens: usize,
}

/// [`local_update`] in the flat layout of `schema`; `on_step(step, report)` after each step.
pub fn train_on_batch(
    spec: &ModelSpec,
    schema: &Schema,
    weights: &HashMap<String, Tensor>,
    samples: &[Vec<u32>],
    plan: &LocalTraining,
    device: &Device,
    on_step: impl FnMut(usize, &StepReport),
) -> Result<TrainedUpdate> {
    let update = local_update(spec, weights, samples, plan, device, on_step)?;
    Ok(TrainedUpdate {
        flat: to_flat(schema, &update.delta)?,
        mean_loss: update.mean_loss,
        tokens: update.tokens,
    })
}

/// [`train_on_batch`] from flat weights on the CPU, without progress: the recomputation the hub
/// re-verifies with, and what test and benchmark clients send.
pub fn update_on_cpu(
    spec: &ModelSpec,
    schema: &Schema,
    flat: &[f32],
    samples: &[Vec<u32>],
    plan: &LocalTraining,
) -> Result<TrainedUpdate> {
    let weights = to_tensors(schema, flat, &Device::Cpu)?;
    train_on_batch(
        spec,
        schema,
        &weights,
        samples,
        plan,
        &Device::Cpu,
        |_, _| {},
    )
}
