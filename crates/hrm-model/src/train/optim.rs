//! AdamW with saveable state, and the learning-rate schedule.

use std::collections::HashMap;

use candle_core::{Device, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Learning-rate schedule: linear warm-up, then constant or cosine decay to `min_ratio * peak`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LrSchedule {
    pub peak: f64,
    pub warmup_steps: usize,
    pub total_steps: usize,
    pub kind: ScheduleKind,
    /// Floor of the cosine decay, as a fraction of `peak`.
    pub min_ratio: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    Cosine,
    Constant,
}

impl std::str::FromStr for ScheduleKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cosine" => Ok(Self::Cosine),
            "constant" => Ok(Self::Constant),
            other => Err(Error::InvalidInput(format!(
                "schedule {other:?}: expected cosine or constant"
            ))),
        }
    }
}

impl LrSchedule {
    /// Learning rate of step `step` (0-based).
    pub fn at(&self, step: usize) -> f64 {
        if step < self.warmup_steps {
            return self.peak * (step + 1) as f64 / self.warmup_steps as f64;
        }
        match self.kind {
            ScheduleKind::Constant => self.peak,
            ScheduleKind::Cosine => {
                let span = self.total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
                let progress = ((step - self.warmup_steps) as f64 / span).min(1.0);
                let floor = self.peak * self.min_ratio;
                floor + (self.peak - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}

/// AdamW hyper-parameters.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Decoupled weight decay, applied to matrices only (not to norm weights).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

/// Adam with decoupled weight decay, with state that can be saved and restored.
pub struct AdamW {
    params: Vec<(String, Var)>,
    first: Vec<Tensor>,
    second: Vec<Tensor>,
    steps: usize,
    config: AdamWConfig,
}

impl AdamW {
    pub fn new(params: Vec<(String, Var)>, config: AdamWConfig) -> Result<Self> {
        let zeros = |v: &Var| v.as_tensor().zeros_like();
        let first = params
            .iter()
            .map(|(_, v)| zeros(v))
            .collect::<candle_core::Result<_>>()?;
        let second = params
            .iter()
            .map(|(_, v)| zeros(v))
            .collect::<candle_core::Result<_>>()?;
        Ok(Self {
            params,
            first,
            second,
            steps: 0,
            config,
        })
    }

    /// Optimiser steps taken so far.
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// One update with learning rate `lr`; parameters without a gradient are left alone.
    pub fn step(&mut self, grads: &HashMap<String, Tensor>, lr: f64) -> Result<()> {
        self.steps += 1;
        let c = &self.config;
        let bias1 = 1.0 - c.beta1.powi(self.steps as i32);
        let bias2 = 1.0 - c.beta2.powi(self.steps as i32);
        for (i, (name, var)) in self.params.iter().enumerate() {
            let Some(g) = grads.get(name) else { continue };
            let m = ((&self.first[i] * c.beta1)? + (g * (1.0 - c.beta1))?)?;
            let v = ((&self.second[i] * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
            let update = ((&m / bias1)? / ((&v / bias2)?.sqrt()? + c.eps)?)?;
            let theta = var.as_tensor();
            let decayed = if theta.rank() >= 2 && c.weight_decay > 0.0 {
                (theta * (1.0 - lr * c.weight_decay))?
            } else {
                theta.clone()
            };
            var.set(&(decayed - (update * lr)?)?)?;
            self.first[i] = m;
            self.second[i] = v;
        }
        Ok(())
    }

    /// The moments and the step count, for a checkpoint.
    pub fn state(&self) -> Result<HashMap<String, Tensor>> {
        let mut state = HashMap::new();
        for (i, (name, _)) in self.params.iter().enumerate() {
            state.insert(format!("m.{name}"), self.first[i].clone());
            state.insert(format!("v.{name}"), self.second[i].clone());
        }
        let device = self
            .params
            .first()
            .map(|(_, v)| v.device().clone())
            .unwrap_or(Device::Cpu);
        state.insert("steps".into(), Tensor::new(&[self.steps as u32], &device)?);
        Ok(state)
    }

    pub fn load_state(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        let missing = |k: &str| Error::InvalidInput(format!("optimiser state has no {k}"));
        for (i, (name, var)) in self.params.iter().enumerate() {
            let m = state
                .get(&format!("m.{name}"))
                .ok_or_else(|| missing(name))?;
            let v = state
                .get(&format!("v.{name}"))
                .ok_or_else(|| missing(name))?;
            self.first[i] = m.to_dtype(var.dtype())?.to_device(var.device())?;
            self.second[i] = v.to_dtype(var.dtype())?.to_device(var.device())?;
        }
        let steps = state.get("steps").ok_or_else(|| missing("steps"))?;
        self.steps = steps.to_vec1::<u32>()?[0] as usize;
        Ok(())
    }
}
