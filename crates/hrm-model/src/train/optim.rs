//! AdamW with saveable state, and the learning-rate schedule.

use std::collections::HashMap;

use std::sync::{Mutex, PoisonError};

use candle_core::{CpuStorage, DType, Device, InplaceOp2, Layout, Tensor, Var};

use crate::fused::{values, values_mut};
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
    moments: Vec<Moments>,
    steps: usize,
    config: AdamWConfig,
}

/// One parameter's two running means (`m`, `v`).
///
/// For a parameter held on the CPU in f32 they are plain buffers, so that one pass updates both
/// and the parameter ([`FusedStep`]): candle lends an in-place op only one tensor to write.
/// Elsewhere they are tensors of the parameter's shape, updated by tensor ops.
enum Moments {
    Host { first: Vec<f32>, second: Vec<f32> },
    Tensors { first: Tensor, second: Tensor },
}

impl Moments {
    /// Zeros for `theta`.
    fn zeros(theta: &Tensor) -> Result<Self> {
        if host_f32(theta) {
            let n = theta.elem_count();
            return Ok(Self::Host {
                first: vec![0.0; n],
                second: vec![0.0; n],
            });
        }
        Ok(Self::Tensors {
            first: theta.zeros_like()?,
            second: theta.zeros_like()?,
        })
    }

    /// Both as tensors of `theta`'s shape, dtype and device (for host buffers, copies).
    fn as_tensors(&self, theta: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok(match self {
            Self::Host { first, second } => {
                let tensor =
                    |values: &[f32]| Tensor::from_slice(values, theta.shape(), theta.device());
                (tensor(first)?, tensor(second)?)
            }
            Self::Tensors { first, second } => (first.clone(), second.clone()),
        })
    }

    /// Copies of both, as tensors of `theta`'s shape, dtype and device: a checkpoint's, which
    /// later steps must not change.
    fn copies(&self, theta: &Tensor) -> Result<(Tensor, Tensor)> {
        match self {
            // `as_tensors` already copies host buffers.
            Self::Host { .. } => self.as_tensors(theta),
            Self::Tensors { first, second } => Ok((first.copy()?, second.copy()?)),
        }
    }

    /// The moments a composed step computed, kept as before.
    fn set(&mut self, m: Tensor, v: Tensor) -> Result<()> {
        match self {
            Self::Host { first, second } => {
                let values = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
                *first = values(&m)?;
                *second = values(&v)?;
            }
            Self::Tensors { first, second } => (*first, *second) = (m, v),
        }
        Ok(())
    }

    /// `first` and `second` (tensors of any float dtype, `theta`'s shape) as the moments of
    /// `theta`, kept as [`Moments::zeros`] would keep them.
    fn from_tensors(theta: &Tensor, first: &Tensor, second: &Tensor) -> Result<Self> {
        for moment in [first, second] {
            if moment.shape() != theta.shape() {
                return Err(Error::InvalidInput(format!(
                    "optimiser state of shape {:?} for a parameter of shape {:?}",
                    moment.dims(),
                    theta.dims()
                )));
            }
        }
        let like_theta = |t: &Tensor| t.to_dtype(theta.dtype())?.to_device(theta.device())?.copy();
        if host_f32(theta) {
            let values = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
            return Ok(Self::Host {
                first: values(first)?,
                second: values(second)?,
            });
        }
        Ok(Self::Tensors {
            first: like_theta(first)?,
            second: like_theta(second)?,
        })
    }
}

/// Whether a tensor is held on the CPU in f32, contiguous: what the fused step reads and writes.
fn host_f32(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32 && t.is_contiguous()
}

impl AdamW {
    pub fn new(params: Vec<(String, Var)>, config: AdamWConfig) -> Result<Self> {
        let moments = params
            .iter()
            .map(|(_, v)| Moments::zeros(v.as_tensor()))
            .collect::<Result<_>>()?;
        Ok(Self {
            params,
            moments,
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
        self.step_with(grads, lr, true)
    }

    /// The same update through candle's tensor ops only, as devices other than the CPU run it:
    /// the reference the fused step is tested and measured against.
    pub fn step_composed(&mut self, grads: &HashMap<String, Tensor>, lr: f64) -> Result<()> {
        self.step_with(grads, lr, false)
    }

    fn step_with(&mut self, grads: &HashMap<String, Tensor>, lr: f64, fuse: bool) -> Result<()> {
        self.steps += 1;
        let c = &self.config;
        let bias1 = 1.0 - c.beta1.powi(self.steps as i32);
        let bias2 = 1.0 - c.beta2.powi(self.steps as i32);
        for (i, (name, var)) in self.params.iter().enumerate() {
            let Some(g) = grads.get(name) else { continue };
            let theta = var.as_tensor();
            let decay = if theta.rank() >= 2 && c.weight_decay > 0.0 {
                Some(1.0 - lr * c.weight_decay)
            } else {
                None
            };
            let step = ParamStep {
                beta1: c.beta1,
                beta2: c.beta2,
                bias1,
                bias2,
                eps: c.eps,
                lr,
                decay,
            };
            match &mut self.moments[i] {
                Moments::Host { first, second } if fuse && host_f32(theta) && host_f32(g) => {
                    let fused = FusedStep {
                        step,
                        moments: Mutex::new((first, second)),
                    };
                    theta.inplace_op2(g, &fused)?;
                }
                moments => {
                    let (m, v) = moments.as_tensors(theta)?;
                    let (m, v) = step.composed(var, g, &m, &v)?;
                    moments.set(m, v)?;
                }
            }
        }
        Ok(())
    }

    /// The moments and the step count, for a checkpoint.
    pub fn state(&self) -> Result<HashMap<String, Tensor>> {
        let mut state = HashMap::new();
        for ((name, var), moments) in self.params.iter().zip(&self.moments) {
            let (m, v) = moments.copies(var.as_tensor())?;
            state.insert(format!("m.{name}"), m);
            state.insert(format!("v.{name}"), v);
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
        for ((name, var), moments) in self.params.iter().zip(&mut self.moments) {
            let m = state
                .get(&format!("m.{name}"))
                .ok_or_else(|| missing(name))?;
            let v = state
                .get(&format!("v.{name}"))
                .ok_or_else(|| missing(name))?;
            // Copies: the fused step updates the moments in place.
            *moments = Moments::from_tensors(var.as_tensor(), m, v)?;
        }
        let steps = state.get("steps").ok_or_else(|| missing("steps"))?;
        self.steps = steps.to_vec1::<u32>()?[0] as usize;
        Ok(())
    }
}

/// One parameter's AdamW update, with the step's constants.
///
/// On the CPU in f32 it runs fused ([`FusedStep`]): one pass over the parameter, its gradient
/// and its moments updates all three in place, with no temporary tensors, in chunks over
/// candle's thread team. Elsewhere it runs as candle tensor ops ([`ParamStep::composed`]). The
/// two are the same f32 arithmetic in the same order (candle's `tensor * x` is `t * x + 0`,
/// `tensor / x` is `t * (1 / x) + 0`), so they agree bit for bit; a test holds them to that.
#[derive(Clone, Copy, Debug)]
struct ParamStep {
    beta1: f64,
    beta2: f64,
    bias1: f64,
    bias2: f64,
    eps: f64,
    lr: f64,
    /// `1 - lr * weight_decay`, for matrices; none for vectors.
    decay: Option<f64>,
}

impl ParamStep {
    /// The update as tensor ops: new moments, and the parameter set.
    fn composed(&self, var: &Var, g: &Tensor, m: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let m = ((m * self.beta1)? + (g * (1.0 - self.beta1))?)?;
        let v = ((v * self.beta2)? + (g.sqr()? * (1.0 - self.beta2))?)?;
        let update = ((&m / self.bias1)? / ((&v / self.bias2)?.sqrt()? + self.eps)?)?;
        let theta = var.as_tensor();
        let decayed = match self.decay {
            Some(decay) => (theta * decay)?,
            None => theta.clone(),
        };
        var.set(&(decayed - (update * self.lr)?)?)?;
        Ok((m, v))
    }

    /// The same update of matching runs of values, in place.
    fn apply(&self, (theta, m, v): (&mut [f32], &mut [f32], &mut [f32]), g: &[f32]) {
        let (keep1, take1) = (self.beta1 as f32, (1.0 - self.beta1) as f32);
        let (keep2, take2) = (self.beta2 as f32, (1.0 - self.beta2) as f32);
        let (unbias1, unbias2) = ((1.0 / self.bias1) as f32, (1.0 / self.bias2) as f32);
        let (eps, lr) = (self.eps as f32, self.lr as f32);
        let decay = self.decay.map(|d| d as f32);
        for (((theta, m), v), &g) in theta.iter_mut().zip(m).zip(v).zip(g) {
            *m = (*m * keep1 + 0.0) + (g * take1 + 0.0);
            *v = (*v * keep2 + 0.0) + (g * g * take2 + 0.0);
            let update = (*m * unbias1 + 0.0) / ((*v * unbias2 + 0.0).sqrt() * 1.0 + eps);
            let decayed = match decay {
                Some(decay) => *theta * decay + 0.0,
                None => *theta,
            };
            *theta = decayed - (update * lr + 0.0);
        }
    }
}

/// Values per parallel task: 256 KiB of each operand, enough to outweigh the hand-off.
const CHUNK: usize = 1 << 16;

/// A [`ParamStep`] as candle's in-place op on the parameter, with the gradient as its operand
/// and the parameter's moments (host buffers of its length) updated in the same pass.
struct FusedStep<'a> {
    step: ParamStep,
    moments: Mutex<(&'a mut Vec<f32>, &'a mut Vec<f32>)>,
}

impl InplaceOp2 for FusedStep<'_> {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn cpu_fwd(
        &self,
        theta: &mut CpuStorage,
        theta_layout: &Layout,
        g: &CpuStorage,
        g_layout: &Layout,
    ) -> candle_core::Result<()> {
        let g = values(g, g_layout)?;
        let theta = values_mut(theta, theta_layout)?;
        let mut moments = self.moments.lock().unwrap_or_else(PoisonError::into_inner);
        let (m, v) = &mut *moments;
        if [g.len(), m.len(), v.len()] != [theta.len(); 3] {
            candle_core::bail!(
                "AdamW: a parameter of {} values with a gradient of {} and moments of {} and {}",
                theta.len(),
                g.len(),
                m.len(),
                v.len()
            )
        }
        let mut runs: Vec<_> = theta
            .chunks_mut(CHUNK)
            .zip(m.chunks_mut(CHUNK))
            .zip(v.chunks_mut(CHUNK))
            .map(|((theta, m), v)| (theta, m, v))
            .collect();
        crate::team::chunks_in_parallel(&mut runs, 1, |i, run| {
            for (theta, m, v) in run {
                self.step.apply((theta, m, v), &g[i * CHUNK..]);
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn random(shape: &[usize], rng: &mut StdRng) -> Tensor {
        let n = shape.iter().product();
        // Some exact zeros: the sign of a zero is where a careless fusion would differ.
        let values: Vec<f32> = (0..n)
            .map(|i| {
                if i % 7 == 0 {
                    0.0
                } else {
                    rng.random_range(-1.0..1.0)
                }
            })
            .collect();
        Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .into_iter()
            .map(f32::to_bits)
            .collect()
    }

    #[test]
    fn the_fused_step_is_the_composed_step_bit_for_bit() {
        let mut rng = StdRng::seed_from_u64(5);
        // The last shape spans more than one run of the team, each run its own part of the gradient.
        for shape in [vec![33, 17], vec![65], vec![3, CHUNK / 2 + 5]] {
            let start = random(&shape, &mut rng);
            let fused = Var::from_tensor(&start.copy().unwrap()).unwrap();
            let composed = Var::from_tensor(&start.copy().unwrap()).unwrap();
            let mut optimisers = [&fused, &composed].map(|var| {
                AdamW::new(vec![("w".into(), var.clone())], AdamWConfig::default()).unwrap()
            });
            for step in 0..4 {
                let grads = HashMap::from([("w".to_string(), random(&shape, &mut rng))]);
                let lr = 1e-3 * (step + 1) as f64;
                assert!(matches!(optimisers[0].moments[0], Moments::Host { .. }));
                optimisers[0].step(&grads, lr).unwrap();
                optimisers[1].step_composed(&grads, lr).unwrap();
            }
            assert_eq!(
                bits(fused.as_tensor()),
                bits(composed.as_tensor()),
                "{shape:?}"
            );
            let [a, b] = optimisers.each_ref().map(|o| o.state().unwrap());
            assert_eq!(bits(&a["m.w"]), bits(&b["m.w"]), "first moment");
            assert_eq!(bits(&a["v.w"]), bits(&b["v.w"]), "second moment");
            assert_ne!(
                bits(fused.as_tensor()),
                bits(&start),
                "the step moved the weights"
            );
        }
    }

    #[test]
    fn a_saved_state_does_not_move_with_later_steps() {
        let var =
            Var::from_tensor(&Tensor::ones((4, 4), DType::F32, &Device::Cpu).unwrap()).unwrap();
        let mut opt = AdamW::new(vec![("w".into(), var)], AdamWConfig::default()).unwrap();
        let grads = HashMap::from([(
            "w".to_string(),
            Tensor::ones((4, 4), DType::F32, &Device::Cpu).unwrap(),
        )]);
        opt.step(&grads, 1e-2).unwrap();
        let saved = bits(&opt.state().unwrap()["m.w"]);
        opt.step(&grads, 1e-2).unwrap();
        assert_eq!(bits(&opt.state().unwrap()["m.w"]).len(), saved.len());
        assert_ne!(bits(&opt.state().unwrap()["m.w"]), saved);
        let state = opt.state().unwrap();
        let before = bits(&state["m.w"]);
        opt.step(&grads, 1e-2).unwrap();
        assert_eq!(bits(&state["m.w"]), before, "the saved moments are a copy");
    }
}
