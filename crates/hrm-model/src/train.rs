//! Training on candle's autograd, through the models' one forward pass.
//!
//! - [`ModelSpec`] is a trainable architecture's config; it builds the model over a `VarMap` and
//!   initialises it from a seed (candle's CPU random generator cannot be seeded, so we draw the
//!   initial weights ourselves).
//! - [`lm_loss`] is next-token cross-entropy, plus `router_aux_loss_coef` times the load-balancing
//!   loss for `hrm_text_moe`. HRM's truncated backpropagation (`L_bp_cycles`) is part of the
//!   forward pass.
//! - [`AdamW`] is decoupled weight decay Adam. It is ours rather than candle-nn's because a run
//!   must checkpoint and resume its moments, which candle-nn's optimiser keeps private.
//! - [`Trainer::step`] accumulates gradients over micro-batches, clips their global norm and
//!   applies one optimiser step at the scheduled learning rate ([`LrSchedule`]).
//!
//! Everything is deterministic for a given seed: initialisation, data order (see the trainer
//! binary) and the arithmetic, which runs in a fixed order on the CPU.

use std::collections::HashMap;
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Normal};
use serde::{Deserialize, Serialize};

use crate::config::ModelConfig;
use crate::hrm_text::{HrmText, HrmTextConfig};
use crate::llama::{Llama, LlamaConfig};
use crate::{CausalLm, Error, ForwardBatch, Logits, Result};

/// A trainable architecture and its config.
#[derive(Clone, Debug)]
pub enum ModelSpec {
    HrmText(HrmTextConfig),
    Llama(LlamaConfig),
}

impl ModelSpec {
    /// Reads a Hugging Face `config.json` (`model_type` hrm_text, hrm_text_moe or llama).
    pub fn from_config_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_config_json(&text, path)
    }

    /// Parses `config.json` text; `origin` names it in errors.
    pub fn from_config_json(text: &str, origin: &Path) -> Result<Self> {
        let path = origin;
        let probe: serde_json::Value = serde_json::from_str(text).map_err(|e| Error::Config {
            path: path.into(),
            message: e.to_string(),
        })?;
        match probe["model_type"].as_str() {
            Some("hrm_text" | "hrm_text_moe") => {
                Ok(Self::HrmText(HrmTextConfig::from_json(text, path)?))
            }
            Some("llama") => Ok(Self::Llama(LlamaConfig::from_json(text, path)?)),
            other => Err(Error::Config {
                path: path.into(),
                message: format!(
                    "model_type {other:?} cannot be trained; use hrm_text, hrm_text_moe or llama"
                ),
            }),
        }
    }

    /// The config as transformers writes it (`num_hidden_layers` inflated for HRM-Text).
    pub fn to_config_json(&self) -> serde_json::Value {
        match self {
            Self::HrmText(c) => {
                let mut c = c.clone();
                c.num_layers_per_stack = Some(c.layers_per_stack());
                c.num_hidden_layers = c.cache_slots();
                let mut json = serde_json::to_value(&c).expect("config serialises");
                let arch = if c.is_moe() {
                    "HrmTextMoeForCausalLM"
                } else {
                    "HrmTextForCausalLM"
                };
                json["architectures"] = serde_json::json!([arch]);
                json
            }
            Self::Llama(c) => {
                let mut json = serde_json::to_value(c).expect("config serialises");
                json["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
                json
            }
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Self::HrmText(c) => c.vocab_size,
            Self::Llama(c) => c.vocab_size,
        }
    }

    fn aux_loss_coef(&self) -> f64 {
        match self {
            Self::HrmText(c) if c.is_moe() => c.router_aux_loss_coef.unwrap_or(0.01),
            _ => 0.0,
        }
    }

    fn initializer_range(&self) -> f64 {
        match self {
            Self::HrmText(c) => c.initializer_range,
            Self::Llama(_) => 0.02,
        }
    }

    /// Builds the model over `varmap` (creating its variables on first use).
    pub fn build(
        &self,
        varmap: &VarMap,
        dtype: DType,
        device: &Device,
    ) -> Result<Box<dyn CausalLm>> {
        let vb = VarBuilder::from_varmap(varmap, dtype, device);
        Ok(match self {
            Self::HrmText(c) => Box::new(HrmText::new(c.clone(), vb)?),
            Self::Llama(c) => Box::new(Llama::new(c, vb)?),
        })
    }

    /// Seeded initialisation as transformers does it: every matrix and embedding from
    /// N(0, initializer_range), norm weights 1, `z_L_init` 0.
    pub fn initialise(&self, varmap: &VarMap, seed: u64) -> Result<()> {
        let normal = Normal::new(0.0, self.initializer_range())
            .map_err(|e| Error::InvalidInput(e.to_string()))?;
        let mut rng = StdRng::seed_from_u64(seed);
        for (name, var) in sorted_vars(varmap) {
            let t = var.as_tensor();
            let values: Vec<f64> = if name.ends_with("z_L_init") {
                vec![0.0; t.elem_count()]
            } else if name.contains("norm") && t.rank() == 1 {
                vec![1.0; t.elem_count()]
            } else {
                (0..t.elem_count())
                    .map(|_| normal.sample(&mut rng))
                    .collect()
            };
            let init = Tensor::from_vec(values, t.shape(), t.device())?.to_dtype(t.dtype())?;
            var.set(&init)?;
        }
        Ok(())
    }
}

/// The model's variables by name, in name order (so every walk over them is deterministic).
pub fn sorted_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    let data = varmap.data().lock().expect("varmap lock");
    let mut vars: Vec<(String, Var)> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars
}

/// Variables the optimiser updates: all but the frozen `z_L_init`.
pub fn trainable_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    sorted_vars(varmap)
        .into_iter()
        .filter(|(name, _)| !name.ends_with("z_L_init"))
        .collect()
}

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
    let mut batch = ForwardBatch::full_pass(&inputs, &blocks, Logits::All, info)?;
    let out = model.forward(&mut batch)?;
    let logits = out.logits.flatten_to(1)?.to_dtype(DType::F32)?;
    let labels = Tensor::from_vec(labels, logits.dim(0)?, &info.device)?;
    let cross_entropy = candle_nn::loss::cross_entropy(&logits, &labels)?;
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
        let n = micro_batches.len().max(1) as f64;
        let coef = self.spec.aux_loss_coef();
        let mut summed: HashMap<String, Tensor> = HashMap::new();
        let (mut loss_sum, mut ce_sum, mut aux_sum, mut tokens) = (0f32, 0f32, None::<f32>, 0);
        for rows in micro_batches {
            let loss = lm_loss(self.model.as_ref(), rows, coef)?;
            let grads: GradStore = (&loss.total / n)?.backward()?;
            for (name, var) in &params {
                if let Some(g) = grads.get(var.as_tensor()) {
                    let acc = match summed.remove(name) {
                        Some(prev) => (prev + g)?,
                        None => g.clone(),
                    };
                    summed.insert(name.clone(), acc);
                }
            }
            loss_sum += loss.total.to_scalar::<f32>()?;
            ce_sum += loss.cross_entropy.to_scalar::<f32>()?;
            if let Some(aux) = &loss.aux {
                *aux_sum.get_or_insert(0.0) += aux.to_dtype(DType::F32)?.to_scalar::<f32>()?;
            }
            tokens += rows.iter().map(|r| r.len() - 1).sum::<usize>();
        }
        let grad_norm = global_norm(&summed)?;
        if self.grad_clip > 0.0 && f64::from(grad_norm) > self.grad_clip {
            let scale = self.grad_clip / f64::from(grad_norm);
            for g in summed.values_mut() {
                *g = (&*g * scale)?;
            }
        }
        let lr = self.schedule.at(self.optimizer.steps());
        self.optimizer.step(&summed, lr)?;
        let n = n as f32;
        Ok(StepReport {
            loss: loss_sum / n,
            cross_entropy: ce_sum / n,
            aux: aux_sum.map(|a| a / n),
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

/// Builds `spec` in f32 with its variables set from `weights` (name to tensor), which must
/// hold every variable with its shape.
pub fn build_with_weights(
    spec: &ModelSpec,
    weights: &HashMap<String, Tensor>,
    device: &Device,
) -> Result<(VarMap, Box<dyn CausalLm>)> {
    let varmap = VarMap::new();
    let model = spec.build(&varmap, DType::F32, device)?;
    for (name, var) in sorted_vars(&varmap) {
        let value = weights
            .get(&name)
            .ok_or_else(|| Error::InvalidInput(format!("weights lack `{name}`")))?;
        if value.dims() != var.as_tensor().dims() {
            return Err(Error::InvalidInput(format!(
                "`{name}` has shape {:?}, the model's is {:?}",
                value.dims(),
                var.as_tensor().dims()
            )));
        }
        var.set(&value.to_dtype(DType::F32)?.to_device(device)?)?;
    }
    Ok((varmap, model))
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

/// Token ids of a training text: a `.txt` corpus (one paragraph per line, documents separated by
/// blank lines, as `data/build_corpus.py` writes) or gzip JSON lines (`.jsonl.gz`, one
/// `{"text": ...}` document per line, the hub's batch format). Paragraphs are joined by newlines;
/// documents are separated by the end-of-text token `eot`.
pub fn corpus_tokens(path: &Path, tokenizer: &tokenizers::Tokenizer, eot: u32) -> Result<Vec<u32>> {
    let documents = read_documents(path)?;
    let encodings = tokenizer
        .encode_batch(documents, false)
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    let mut tokens = Vec::new();
    for enc in encodings {
        tokens.extend_from_slice(enc.get_ids());
        tokens.push(eot);
    }
    Ok(tokens)
}

fn read_documents(path: &Path) -> Result<Vec<String>> {
    let name = path.to_string_lossy();
    if name.ends_with(".jsonl.gz") || name.ends_with(".jsonl") {
        use std::io::{BufRead, BufReader};
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let reader: Box<dyn BufRead> = if name.ends_with(".gz") {
            Box::new(BufReader::new(flate2::read::GzDecoder::new(file)))
        } else {
            Box::new(BufReader::new(file))
        };
        let mut docs = Vec::new();
        for (i, line) in reader.lines().enumerate() {
            let line = line.map_err(|e| Error::io(path, e))?;
            if line.trim().is_empty() {
                continue;
            }
            let value: serde_json::Value = serde_json::from_str(&line)
                .map_err(|e| Error::InvalidInput(format!("{}:{}: {e}", path.display(), i + 1)))?;
            let text = value["text"].as_str().ok_or_else(|| {
                Error::InvalidInput(format!("{}:{}: no \"text\" string", path.display(), i + 1))
            })?;
            docs.push(text.to_string());
        }
        return Ok(docs);
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    Ok(text
        .split("\n\n")
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(String::from)
        .collect())
}

/// `count` random windows of `len` tokens, drawn from a generator seeded with `seed`.
pub fn sample_windows(
    tokens: &[u32],
    count: usize,
    len: usize,
    seed: u64,
) -> Result<Vec<Vec<u32>>> {
    use rand::Rng;
    if tokens.len() <= len {
        return Err(Error::InvalidInput(format!(
            "the corpus has {} tokens, fewer than one window of {len}",
            tokens.len()
        )));
    }
    let mut rng = StdRng::seed_from_u64(seed);
    Ok((0..count)
        .map(|_| {
            let start = rng.random_range(0..=tokens.len() - len);
            tokens[start..start + len].to_vec()
        })
        .collect())
}

/// Up to `count` evenly spaced, non-overlapping windows of `len` tokens (a fixed evaluation set).
pub fn evaluation_windows(tokens: &[u32], count: usize, len: usize) -> Vec<Vec<u32>> {
    let available = tokens.len() / len.max(1);
    let count = count.min(available);
    if count == 0 {
        return Vec::new();
    }
    let stride = available / count;
    (0..count)
        .map(|i| tokens[i * stride * len..(i * stride + 1) * len].to_vec())
        .collect()
}

/// Writes a Hugging Face checkpoint: `config.json`, `model.safetensors` in `dtype`, and the
/// tokenizer (`tokenizer.json`, `tokenizer_config.json`) beside it. `z_L_init` and the MoE
/// router stay in f32, as transformers keeps them.
pub fn save_pretrained(
    dir: &Path,
    spec: &ModelSpec,
    varmap: &VarMap,
    dtype: DType,
    tokenizer: &tokenizers::Tokenizer,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let mut tensors = HashMap::new();
    for (name, var) in sorted_vars(varmap) {
        let keep_f32 = name.ends_with("z_L_init") || name.ends_with("router.weight");
        let t = var.as_tensor().detach();
        tensors.insert(name, if keep_f32 { t } else { t.to_dtype(dtype)? });
    }
    let model_path = dir.join("model.safetensors");
    let tmp = dir.join("model.safetensors.tmp");
    candle_core::safetensors::save(&tensors, &tmp)?;
    std::fs::rename(&tmp, &model_path).map_err(|e| Error::io(&model_path, e))?;

    let mut config = spec.to_config_json();
    config["dtype"] = serde_json::json!(match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    });
    let eot = tokenizer.token_to_id(crate::tokenizer::END_OF_TEXT);
    if let Some(eot) = eot {
        config["eos_token_id"] = eot.into();
        config["pad_token_id"] = eot.into();
    }
    write_json(&dir.join("config.json"), &config)?;
    tokenizer
        .save(dir.join("tokenizer.json"), false)
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": crate::tokenizer::END_OF_TEXT,
            "pad_token": crate::tokenizer::END_OF_TEXT,
            "bos_token": null,
        }),
    )
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).expect("JSON serialises");
    std::fs::write(path, text + "\n").map_err(|e| Error::io(path, e))
}

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
