//! The resources a volunteer lends: CPU threads, memory, and on CUDA a fraction of GPU memory,
//! with overrides for the GPU memory fraction and the largest micro-batch. `batch_size: auto`
//! turns the memory limit into rows per forward pass here.

use anyhow::{Result, bail};
use clap::Args;
use hrm_model::DeviceRequest;
use hrm_model::ModelSpec;

/// The resources setting: one set of limits for everything the worker runs.
#[derive(Debug, Clone, Default, Args)]
pub struct ResourceArgs {
    /// CPU threads for training (default: all cores).
    #[arg(long, env = "HRM_WORKER_THREADS")]
    pub threads: Option<usize>,
    /// Memory training may use, e.g. `4GiB`, `512MiB` (default: half of this machine's memory).
    #[arg(long, env = "HRM_WORKER_MEMORY_LIMIT", value_parser = parse_bytes)]
    pub memory_limit: Option<u64>,
    /// On CUDA, the fraction of the GPU's memory training may use (overrides the memory limit
    /// there; default 0.8).
    #[arg(long, env = "HRM_WORKER_GPU_MEMORY_FRACTION")]
    pub gpu_memory_fraction: Option<f64>,
    /// Upper bound on rows per forward pass, whatever `batch_size` says.
    #[arg(long, env = "HRM_WORKER_MAX_BATCH_SIZE")]
    pub max_batch_size: Option<usize>,
    /// cpu, cuda, cuda:N, mps or auto.
    #[arg(long, env = "HRM_WORKER_DEVICE", default_value = "auto")]
    pub device: DeviceRequest,
}

impl ResourceArgs {
    pub fn validate(&self) -> Result<()> {
        if self.threads == Some(0) {
            bail!("--threads must be at least 1");
        }
        if self.max_batch_size == Some(0) {
            bail!("--max-batch-size must be at least 1");
        }
        if let Some(f) = self.gpu_memory_fraction
            && !(f > 0.0 && f <= 1.0)
        {
            bail!("--gpu-memory-fraction must be in (0, 1], not {f}");
        }
        Ok(())
    }

    /// The byte budget on `device`: a fraction of the GPU's memory on CUDA, the memory limit
    /// (or half of this machine's memory) elsewhere.
    pub fn memory_budget(&self, device: &candle_core::Device) -> Result<u64> {
        if device.is_cuda() {
            return gpu_budget(device, self.gpu_memory_fraction.unwrap_or(0.8));
        }
        Ok(match self.memory_limit {
            Some(limit) => limit,
            None => total_memory()? / 2,
        })
    }
}

#[cfg(feature = "cuda")]
fn gpu_budget(device: &candle_core::Device, fraction: f64) -> Result<u64> {
    let candle_core::Device::Cuda(cuda) = device else {
        unreachable!("checked by the caller")
    };
    // Not built here (no CUDA toolkit on the development machine); see docs/worker.md.
    cuda.cuda_stream().context().bind_to_thread()?;
    let (_free, total) = candle_core::cuda_backend::cudarc::driver::result::mem_get_info()?;
    Ok((total as f64 * fraction) as u64)
}

#[cfg(not(feature = "cuda"))]
fn gpu_budget(_device: &candle_core::Device, _fraction: f64) -> Result<u64> {
    bail!("this build has no CUDA support")
}

/// Parses `4GiB`, `512MiB`, `1.5GB`, `1000000` (bytes).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| c.is_ascii_alphabetic())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a size like 4GiB or 512MiB"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        other => return Err(format!("unknown size unit {other:?} in {text:?}")),
    };
    if value.is_nan() || value <= 0.0 {
        return Err(format!("size {text:?} must be positive"));
    }
    Ok((value * scale) as u64)
}

fn total_memory() -> Result<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .map_err(|e| anyhow::anyhow!("cannot read /proc/meminfo ({e}); set --memory-limit"))?;
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .ok_or_else(|| anyhow::anyhow!("no MemTotal in /proc/meminfo; set --memory-limit"))
}

/// An upper estimate of training memory: weights, gradients, the two AdamW moments, the copy
/// the update is measured from and the loaded checkpoint (six f32 copies of the parameters),
/// plus what one row keeps alive for the backward pass.
pub struct MemoryEstimate {
    pub fixed_bytes: u64,
    pub bytes_per_row: u64,
}

impl MemoryEstimate {
    /// Every f32 the autograd graph holds per token is counted twice (the value and its
    /// gradient); every layer application is counted as if gradients flowed through all of
    /// them, which overestimates HRM-Text's truncated backward pass on purpose.
    pub fn of(spec: &ModelSpec, num_parameters: usize, seq_len: usize) -> Self {
        let (hidden, mlp, heads, applications, vocab) = match spec {
            ModelSpec::HrmText(c) => (
                c.hidden_size,
                c.intermediate_size * c.num_experts_per_tok.unwrap_or(1),
                c.num_attention_heads,
                c.cache_slots(),
                c.vocab_size,
            ),
            ModelSpec::Llama(c) => (
                c.hidden_size,
                c.intermediate_size,
                c.num_attention_heads,
                c.num_hidden_layers,
                c.vocab_size,
            ),
        };
        // Per layer application: norms, projections, attention outputs and gates (~12 hidden
        // widths), the MLP's gate, up, activation and product (4 widths), and one row of
        // attention scores and probabilities per head. Then the logits, log-softmax and loss.
        let per_token = applications * (12 * hidden + 4 * mlp + 2 * heads * seq_len) + 3 * vocab;
        MemoryEstimate {
            fixed_bytes: 6 * 4 * num_parameters as u64,
            bytes_per_row: 2 * 4 * (per_token * seq_len) as u64,
        }
    }

    /// The most rows per forward pass that fit `budget`, at most `cap`; an error when the
    /// weights alone do not fit.
    pub fn rows_within(&self, budget: u64, cap: usize) -> Result<usize> {
        let Some(left) = budget
            .checked_sub(self.fixed_bytes)
            .filter(|left| *left >= self.bytes_per_row)
        else {
            bail!(
                "the model needs about {} MiB to train one row, more than the memory limit of {} MiB; raise --memory-limit",
                (self.fixed_bytes + self.bytes_per_row) >> 20,
                budget >> 20
            );
        };
        Ok(((left / self.bytes_per_row.max(1)) as usize).clamp(1, cap.max(1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_bytes("4GiB").unwrap(), 4 << 30);
        assert_eq!(parse_bytes("512 MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_bytes("1000").unwrap(), 1000);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("3 parsecs").is_err());
        assert!(parse_bytes("0").is_err());
    }

    #[test]
    fn more_memory_gives_more_rows_up_to_the_cap() {
        let estimate = MemoryEstimate {
            fixed_bytes: 1000,
            bytes_per_row: 100,
        };
        assert_eq!(estimate.rows_within(1100, 64).unwrap(), 1);
        assert_eq!(estimate.rows_within(1950, 64).unwrap(), 9);
        assert_eq!(estimate.rows_within(1_000_000, 64).unwrap(), 64);
        let err = estimate.rows_within(1050, 64).unwrap_err().to_string();
        assert!(err.contains("--memory-limit"), "{err}");
    }

    #[test]
    fn the_estimate_grows_with_sequence_length_and_model_size() {
        let config = |hidden: usize| {
            serde_json::json!({
                "model_type": "hrm_text_moe", "vocab_size": 512, "hidden_size": hidden,
                "intermediate_size": 2 * hidden, "num_hidden_layers": 1, "num_attention_heads": 2,
                "max_position_embeddings": 64, "H_cycles": 1, "L_cycles": 1,
                "num_experts": 4, "num_experts_per_tok": 2
            })
            .to_string()
        };
        let spec = |hidden| {
            ModelSpec::from_config_json(&config(hidden), std::path::Path::new("config.json"))
                .unwrap()
        };
        let small = MemoryEstimate::of(&spec(32), 10_000, 16);
        assert!(MemoryEstimate::of(&spec(32), 10_000, 32).bytes_per_row > 2 * small.bytes_per_row);
        assert!(MemoryEstimate::of(&spec(64), 10_000, 16).bytes_per_row > small.bytes_per_row);
        assert_eq!(small.fixed_bytes, 240_000);
    }
}
