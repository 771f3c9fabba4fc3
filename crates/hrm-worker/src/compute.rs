//! The one computation of the network: train a checkpoint on a batch as the hub's plan says
//! and return the pseudo-gradient (weights before minus weights after) in schema order.
//! Workers run it for every batch; the hub runs the same function to re-verify a sample of
//! them, so that an honest worker's upload and the hub's recomputation cannot drift apart.

use anyhow::{Result, anyhow};
use candle_core::{DType, Device, Tensor};
use hrm_model::train::{LocalTraining, ModelSpec, StepReport, local_update};
use hrm_wire::TrainingPlan;
use hrm_wire::update::Schema;
use std::collections::HashMap;

/// The plan a worker receives, as the model crate's training takes it.
pub fn local_training(plan: &TrainingPlan, micro_batch: usize) -> LocalTraining {
    LocalTraining {
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

/// Flat parameters (schema order) as named tensors on `device`.
pub fn to_tensors(
    schema: &Schema,
    flat: &[f32],
    device: &Device,
) -> Result<HashMap<String, Tensor>> {
    if flat.len() != schema.num_parameters() {
        return Err(anyhow!(
            "{} values for a schema of {} parameters",
            flat.len(),
            schema.num_parameters()
        ));
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
            .ok_or_else(|| anyhow!("no tensor {}", spec.name))?;
        flat.extend(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
    }
    Ok(flat)
}

/// What one batch of local training produced.
pub struct TrainedUpdate {
    /// Weights before minus weights after, schema order.
    pub flat: Vec<f32>,
    pub mean_loss: f64,
    pub tokens: usize,
}

/// Trains `weights` on `samples` as `plan` says; `on_step(step, report)` after each step.
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
