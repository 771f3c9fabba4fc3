//! Training-network benchmarks (not tests; `benches/network_bench.py` drives them): a hostile
//! worker that poisons its updates, for robustness runs, and the validation loss of a
//! checkpoint on fixed windows, so that a network run and a centralised run are scored alike.

use anyhow::{Context, Result, bail};
use candle_core::Device;
use clap::{Args, ValueEnum};
use hrm_model::train::{LocalTraining, update_on_cpu};
use hrm_model::train::{
    ModelSpec, build_with_weights, corpus_tokens, evaluate, evaluation_windows,
};
use hrm_wire::samples::decode_samples;
use hrm_wire::update::{Encoding, Schema, encode_update, read_checkpoint};
use hrm_wire::{GradientUpload, Hardware, HubClient};
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Clone, Copy, ValueEnum)]
enum Poison {
    /// Train honestly, then multiply the update by --factor (sign-flipped and amplified by default).
    Scale,
    /// Send Gaussian noise with the honest update's RMS times --factor.
    Random,
}

#[derive(Args)]
pub struct HostileArgs {
    #[arg(long, default_value = "http://127.0.0.1:8090")]
    url: String,
    #[arg(long, value_enum, default_value_t = Poison::Scale)]
    mode: Poison,
    #[arg(long, default_value_t = -10.0, allow_hyphen_values = true)]
    factor: f32,
    /// Stop after this many uploads (or when the hub refuses this worker, or runs dry).
    #[arg(long, default_value_t = 1000)]
    batches: usize,
}

/// A worker that poisons every update it sends; it stops when the hub refuses it.
pub fn run_hostile(args: HostileArgs) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        let client = HubClient::new(&args.url, hrm_worker::config::generate_api_key())?;
        let id = client.register(Some("hostile"), None).await?.worker_id;
        let mut loaded: Option<(String, ModelSpec, Schema, Vec<f32>)> = None;
        let mut idle = 0;
        for sent in 0..args.batches {
            let batch = match client.request_batch(id, Hardware::default()).await {
                Ok(Some(batch)) => batch,
                Ok(None) if idle < 30 => {
                    idle += 1;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
                Ok(None) => break,
                Err(e) => {
                    println!("hostile: the hub refused it after {sent} uploads: {e}");
                    return Ok(());
                }
            };
            idle = 0;
            if loaded
                .as_ref()
                .is_none_or(|(v, ..)| *v != batch.model_version)
            {
                let info = client
                    .versions()
                    .await?
                    .into_iter()
                    .find(|v| v.version == batch.model_version)
                    .context("leased on an unlisted version")?;
                let (schema, params) =
                    read_checkpoint(&client.download(&info.checkpoint_url).await?)?;
                let spec =
                    ModelSpec::from_config_json(&info.config.to_string(), "hub config".as_ref())?;
                loaded = Some((info.version, spec, schema, params));
            }
            let (version, spec, schema, params) = loaded.as_ref().expect("loaded above");
            let samples = decode_samples(&client.download(&batch.data_url).await?)?;
            let honest = update_on_cpu(
                spec,
                schema,
                params,
                &samples,
                &LocalTraining::from_plan(&batch.plan, 8),
            )?;
            let poisoned: Vec<f32> = match args.mode {
                Poison::Scale => honest.flat.iter().map(|v| v * args.factor).collect(),
                Poison::Random => {
                    let rms = (honest.flat.iter().map(|v| f64::from(v * v)).sum::<f64>()
                        / honest.flat.len() as f64)
                        .sqrt();
                    let noise = Normal::new(0.0, rms * f64::from(args.factor.abs()))?;
                    let mut rng = rand::rngs::StdRng::seed_from_u64(sent as u64);
                    (0..honest.flat.len())
                        .map(|_| noise.sample(&mut rng) as f32)
                        .collect()
                }
            };
            let target = client.upload_target(id, batch.batch_id).await?;
            client
                .put_update(
                    &target,
                    encode_update(schema, &poisoned, version, Encoding::Dense),
                )
                .await?;
            let upload = GradientUpload {
                worker_id: id,
                batch_id: batch.batch_id,
                model_version: version.clone(),
                gradients_url: target.gradients_url,
                loss: honest.mean_loss,
                num_samples: batch.num_samples,
            };
            if let Err(e) = client.upload_gradients(&upload).await {
                println!("hostile: upload {sent} refused: {e}");
            }
        }
        let stats = client.worker_stats().await?;
        println!(
            "hostile: {} accepted, {} rejected, reputation {:.2}",
            stats.total_batches, stats.updates_rejected, stats.reputation_score
        );
        Ok(())
    })
}

#[derive(Args)]
pub struct PerplexityArgs {
    /// Checkpoint directory (config.json and model.safetensors).
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    valid: PathBuf,
    #[arg(long, default_value = "models/tokenizer.json")]
    tokenizer: PathBuf,
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    #[arg(long, default_value_t = 64)]
    windows: usize,
}

/// Mean cross-entropy and perplexity on `--windows` evenly spaced windows, as `hrm train` scores.
pub fn run_perplexity(args: PerplexityArgs) -> Result<()> {
    let (tokenizer, eot) = crate::train::corpus_tokenizer(&args.tokenizer)?;
    let tokens = corpus_tokens(&args.valid, &tokenizer, eot)?;
    let windows = evaluation_windows(&tokens, args.windows, args.seq_len + 1);
    if windows.is_empty() {
        bail!("{} is shorter than one window", args.valid.display());
    }
    let spec = ModelSpec::from_config_file(&args.model.join("config.json"))?;
    let weights =
        candle_core::safetensors::load(args.model.join("model.safetensors"), &Device::Cpu)?;
    let (_vars, model) = build_with_weights(&spec, &weights, &Device::Cpu)?;
    let loss = evaluate(model.as_ref(), &windows, 8)?;
    println!(
        "{}",
        serde_json::json!({"valid_loss": loss, "valid_perplexity": loss.exp(), "windows": windows.len()})
    );
    Ok(())
}
