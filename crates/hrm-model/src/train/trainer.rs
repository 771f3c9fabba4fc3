//! The training objective and one optimiser step over accumulated micro-batches.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use serde::Serialize;

use super::{AdamW, AdamWConfig, LrSchedule, build_with_weights, trainable_vars};
use crate::ModelSpec;
use crate::{CausalLm, Error, ForwardBatch, Logits, Result};

/// The parts of the training objective of one batch.
pub struct Loss {
    /// What is differentiated: `cross_entropy + aux_coef * aux`.
    pub total: Tensor,
    pub cross_entropy: Tensor,
    pub aux: Option<Tensor>,
}

/// Next-token cross-entropy over equal-length rows (each row predicts its tokens 1..n from
/// 0..n-1), plus the weighted load-balancing loss for mixture-of-experts models.
pub fn lm_loss(model: &dyn CausalLm, rows: &[Vec<u32>], aux_coef: f64) -> Result<Loss> {
    let len = rows.first().map_or(0, Vec::len);
    if len < 2 || rows.iter().any(|r| r.len() != len) {
        return Err(Error::InvalidInput(
            "training rows need equal lengths of at least 2 tokens".into(),
        ));
    }
    let inputs: Vec<Vec<u32>> = rows.iter().map(|r| r[..len - 1].to_vec()).collect();
    let labels: Vec<u32> = rows.iter().flat_map(|r| r[1..].iter().copied()).collect();
    let info = model.info();
    let blocks = vec![0; rows.len()];
    // A dense head is applied inside the loss, so that the logits never become a graph node.
    let head = model.lm_head_weight();
    let wanted = if head.is_some() {
        Logits::Hidden
    } else {
        Logits::All
    };
    let mut batch = ForwardBatch::full_pass(&inputs, &blocks, wanted, info)?;
    let out = model.forward(&mut batch)?;
    let cross_entropy = match head {
        Some(weight) => crate::fused::head_cross_entropy(
            &out.logits.to_dtype(DType::F32)?,
            &weight.to_dtype(DType::F32)?,
            &labels,
        )?,
        None => {
            let logits = out.logits.flatten_to(1)?.to_dtype(DType::F32)?;
            crate::fused::cross_entropy(&logits, &labels)?
        }
    };
    let total = match &out.aux_loss {
        Some(aux) if aux_coef > 0.0 => (&cross_entropy + (aux.to_dtype(DType::F32)? * aux_coef)?)?,
        _ => cross_entropy.clone(),
    };
    Ok(Loss {
        total,
        cross_entropy,
        aux: out.aux_loss,
    })
}

/// Mean cross-entropy of `model` over `rows`, in micro-batches of `micro_batch` rows.
pub fn evaluate(model: &dyn CausalLm, rows: &[Vec<u32>], micro_batch: usize) -> Result<f64> {
    let mut total = 0.0;
    let mut count = 0usize;
    for chunk in rows.chunks(micro_batch.max(1)) {
        let loss = lm_loss(model, chunk, 0.0)?;
        let n = chunk.iter().map(|r| r.len() - 1).sum::<usize>();
        total += f64::from(loss.cross_entropy.to_scalar::<f32>()?) * n as f64;
        count += n;
    }
    Ok(total / count.max(1) as f64)
}

/// What one optimiser step did.
#[derive(Clone, Debug, Serialize)]
pub struct StepReport {
    pub loss: f32,
    pub cross_entropy: f32,
    pub aux: Option<f32>,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    pub lr: f64,
    pub tokens: usize,
}

/// A model being trained: its variables, the optimiser and the schedule.
pub struct Trainer {
    pub spec: ModelSpec,
    pub varmap: VarMap,
    pub model: Box<dyn CausalLm>,
    pub optimizer: AdamW,
    pub schedule: LrSchedule,
    /// Global gradient norm limit (0 disables clipping).
    pub grad_clip: f64,
}

impl Trainer {
    /// A freshly initialised model.
    pub fn new(
        spec: ModelSpec,
        seed: u64,
        schedule: LrSchedule,
        optimizer: AdamWConfig,
        grad_clip: f64,
        device: &Device,
    ) -> Result<Self> {
        let varmap = VarMap::new();
        let model = spec.build(&varmap, DType::F32, device)?;
        spec.initialise(&varmap, seed)?;
        Self::assemble(spec, varmap, model, schedule, optimizer, grad_clip)
    }

    fn assemble(
        spec: ModelSpec,
        varmap: VarMap,
        model: Box<dyn CausalLm>,
        schedule: LrSchedule,
        optimizer: AdamWConfig,
        grad_clip: f64,
    ) -> Result<Self> {
        let optimizer = AdamW::new(trainable_vars(&varmap), optimizer)?;
        Ok(Self {
            spec,
            varmap,
            model,
            optimizer,
            schedule,
            grad_clip,
        })
    }

    /// A model whose variables start from `weights` (see [`build_with_weights`]).
    pub fn from_weights(
        spec: ModelSpec,
        weights: &HashMap<String, Tensor>,
        schedule: LrSchedule,
        optimizer: AdamWConfig,
        grad_clip: f64,
        device: &Device,
    ) -> Result<Self> {
        let (varmap, model) = build_with_weights(&spec, weights, device)?;
        Self::assemble(spec, varmap, model, schedule, optimizer, grad_clip)
    }

    /// One optimiser step over `micro_batches` (each a list of equal-length rows); gradients are
    /// averaged over the micro-batches, so the step equals one over their union.
    pub fn step(&mut self, micro_batches: &[Vec<Vec<u32>>]) -> Result<StepReport> {
        let params = trainable_vars(&self.varmap);
        let coef = self.spec.aux_loss_coef();
        let BatchGradients {
            mut grads,
            loss,
            cross_entropy,
            aux,
            tokens,
        } = batch_gradients(self.model.as_ref(), &params, micro_batches, coef)?;
        let grad_norm = global_norm(&grads)?;
        if self.grad_clip > 0.0 && f64::from(grad_norm) > self.grad_clip {
            let scale = self.grad_clip / f64::from(grad_norm);
            for g in grads.values_mut() {
                *g = (&*g * scale)?;
            }
        }
        let lr = self.schedule.at(self.optimizer.steps());
        self.optimizer.step(&grads, lr)?;
        Ok(StepReport {
            loss,
            cross_entropy,
            aux,
            grad_norm,
            lr,
            tokens,
        })
    }

    /// Mean cross-entropy over `rows` (no gradients), in micro-batches of `micro_batch` rows.
    pub fn evaluate(&self, rows: &[Vec<u32>], micro_batch: usize) -> Result<f64> {
        evaluate(self.model.as_ref(), rows, micro_batch)
    }
}

/// The gradients of one step and the mean losses of its micro-batches.
pub struct BatchGradients {
    /// By parameter name: the gradient of the objective averaged over the micro-batches.
    pub grads: HashMap<String, Tensor>,
    /// The micro-batches' mean `total`, `cross_entropy` and `aux` losses (see [`Loss`]).
    pub loss: f32,
    pub cross_entropy: f32,
    pub aux: Option<f32>,
    /// Tokens predicted over all the micro-batches.
    pub tokens: usize,
}

/// The gradients for `params` of the objective averaged over `micro_batches`, as
/// [`Trainer::step`] takes them: the fused products sum their weights' gradients in place over
/// every pass (see [`crate::fused::summing_weight_grads`]), and candle's backward pass gives the
/// rest, added up over the micro-batches.
pub fn batch_gradients(
    model: &dyn CausalLm,
    params: &[(String, Var)],
    micro_batches: &[Vec<Vec<u32>>],
    aux_coef: f64,
) -> Result<BatchGradients> {
    let n = micro_batches.len().max(1) as f64;
    let mut grads: HashMap<String, Tensor> = HashMap::new();
    let (sums, mut summed_in_place) = crate::fused::summing_weight_grads(|| -> Result<_> {
        let (mut loss_sum, mut ce_sum, mut aux_sum, mut tokens) = (0f32, 0f32, None::<f32>, 0);
        for rows in micro_batches {
            let loss = lm_loss(model, rows, aux_coef)?;
            let store: GradStore = (&loss.total / n)?.backward()?;
            for (name, var) in params {
                if let Some(g) = store.get(var.as_tensor()) {
                    add_to(&mut grads, name, g.clone())?;
                }
            }
            loss_sum += loss.total.to_scalar::<f32>()?;
            ce_sum += loss.cross_entropy.to_scalar::<f32>()?;
            if let Some(aux) = &loss.aux {
                *aux_sum.get_or_insert(0.0) += aux.to_dtype(DType::F32)?.to_scalar::<f32>()?;
            }
            tokens += rows.iter().map(|r| r.len() - 1).sum::<usize>();
        }
        Ok((loss_sum, ce_sum, aux_sum, tokens))
    });
    let (loss_sum, ce_sum, aux_sum, tokens) = sums?;
    // A weight can take gradients both ways: a tied embedding is looked up (candle) and is the
    // head of the loss (summed in place).
    for (name, var) in params {
        if let Some(g) = summed_in_place.take(var.as_tensor())? {
            add_to(&mut grads, name, g)?;
        }
    }
    let n = n as f32;
    Ok(BatchGradients {
        grads,
        loss: loss_sum / n,
        cross_entropy: ce_sum / n,
        aux: aux_sum.map(|a| a / n),
        tokens,
    })
}

fn add_to(grads: &mut HashMap<String, Tensor>, name: &str, g: Tensor) -> Result<()> {
    let sum = match grads.remove(name) {
        Some(prev) => (prev + g)?,
        None => g,
    };
    grads.insert(name.to_owned(), sum);
    Ok(())
}

fn global_norm(grads: &HashMap<String, Tensor>) -> Result<f32> {
    let mut names: Vec<&String> = grads.keys().collect();
    names.sort();
    let mut sum = 0f64;
    for name in names {
        sum += f64::from(
            grads[name]
                .sqr()?
                .sum_all()?
                .to_dtype(DType::F32)?
                .to_scalar::<f32>()?,
        );
    }
    Ok(sum.sqrt() as f32)
}
