//! Training-network benchmarks (not tests; `benches/network_bench.py` drives them): a hostile
//! worker that poisons its updates, for robustness runs, and the validation loss of a
//! checkpoint on fixed windows, so that a network run and a centralised run are scored alike.

use anyhow::{Context, Result, bail};
use candle_core::Device;
use clap::{Args, ValueEnum};
use hrm_model::ModelSpec;
use hrm_model::train::{LocalTraining, update_on_cpu};
use hrm_model::train::{build_with_weights, corpus_tokens, evaluate, evaluation_windows};
use hrm_wire::samples::decode_samples;
use hrm_wire::update::{Encoding, Schema, encode_update, read_checkpoint};
use hrm_wire::{GradientUpload, Hardware, HubClient};
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum Attack {
    /// Train honestly, then multiply the update by --factor (-10: sign-flipped and amplified;
    /// 1e30: overwrite the model).
    Scale,
    /// Train honestly, send the reverse: an update of honest size pointing the wrong way.
    SignFlip,
    /// Gaussian noise with the honest update's RMS times --factor.
    Random,
    /// "A little is enough" (Baruch et al. 2019): the per-coordinate mean of honest updates
    /// shifted by --factor standard deviations, so that every coordinate stays within the
    /// honest spread. Mean and spread come from the updates the identities computed honestly
    /// (this round's, and the last few rounds' when there are fewer than three).
    Little,
    /// Every identity sends one vector: the reverse of the mean honest update, at honest size
    /// (aimed at Krum and the median, which a bloc of copies can capture).
    Collude,
    /// Free riders: an all-zero update, with no work done.
    Zero,
    /// Lease hoarders: 40 lease requests at once per identity, and no upload ever.
    Hoard,
}

#[derive(Args)]
pub struct HostileArgs {
    #[arg(long, default_value = "http://127.0.0.1:8090")]
    url: String,
    #[arg(long, value_enum, default_value_t = Attack::Scale)]
    mode: Attack,
    #[arg(long, default_value_t = -10.0, allow_hyphen_values = true)]
    factor: f32,
    /// Identities the attacker registers (each pays the hub's proof of work; the hub may
    /// refuse some: they are counted). 50 is a Sybil flood.
    #[arg(long, default_value_t = 1)]
    identities: usize,
    /// Stop after this many rounds (or when the hub refuses every identity, or runs dry).
    #[arg(long, default_value_t = 1000)]
    batches: usize,
}

/// One identity of the attacker.
struct Identity {
    client: HubClient,
    id: uuid::Uuid,
    refused: bool,
}

/// The model of one version, as the attacker computes honest updates on it.
struct Model {
    version: String,
    spec: ModelSpec,
    schema: Schema,
    params: Vec<f32>,
}

/// Registers up to `count` identities; the hub may refuse some (per-address limits).
async fn register(url: &str, count: usize) -> Result<(Vec<Identity>, usize)> {
    let mut identities = Vec::new();
    let mut refused = 0;
    for i in 0..count {
        let client = HubClient::new(url, hrm_worker::config::generate_api_key())?;
        match client.register(Some(&format!("hostile-{i}")), None).await {
            Ok(registered) => identities.push(Identity {
                id: registered.worker_id,
                client,
                refused: false,
            }),
            Err(e) => {
                refused += 1;
                println!("hostile: registration {i} refused: {e}");
            }
        }
    }
    Ok((identities, refused))
}

async fn model_of(client: &HubClient, version: &str) -> Result<Model> {
    let info = client
        .versions()
        .await?
        .into_iter()
        .find(|v| v.version == version)
        .context("leased on an unlisted version")?;
    let (schema, params) = read_checkpoint(&client.download(&info.checkpoint_url).await?)?;
    let spec = ModelSpec::from_config_json(&info.config.to_string(), "hub config".as_ref())?;
    Ok(Model {
        version: info.version,
        spec,
        schema,
        params,
    })
}

/// Per coordinate: mean and standard deviation of `updates`.
fn mean_and_spread(updates: &[Vec<f32>]) -> (Vec<f32>, Vec<f32>) {
    let n = updates.len() as f32;
    let len = updates[0].len();
    let mean: Vec<f32> = (0..len)
        .map(|i| updates.iter().map(|u| u[i]).sum::<f32>() / n)
        .collect();
    let spread = (0..len)
        .map(|i| {
            (updates
                .iter()
                .map(|u| (u[i] - mean[i]).powi(2))
                .sum::<f32>()
                / n)
                .sqrt()
        })
        .collect();
    (mean, spread)
}

fn norm(values: &[f32]) -> f64 {
    values
        .iter()
        .map(|v| f64::from(*v).powi(2))
        .sum::<f64>()
        .sqrt()
}

/// A bloc of identities that attack the hub together; it stops when the hub refuses them all.
pub fn run_hostile(args: HostileArgs) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        let (mut identities, refused_registrations) = register(&args.url, args.identities).await?;
        println!(
            "hostile: {} identities registered, {refused_registrations} refused",
            identities.len()
        );
        let mut model: Option<Model> = None;
        let mut history: Vec<Vec<f32>> = Vec::new();
        let (mut uploads, mut idle) = (0usize, 0);
        for round in 0..args.batches {
            if identities.iter().all(|i| i.refused) {
                break;
            }
            // Every identity leases; hoarders ask 40 times at once.
            let mut leased = Vec::new();
            for identity in identities.iter_mut().filter(|i| !i.refused) {
                let asks = if args.mode == Attack::Hoard { 40 } else { 1 };
                let answers = futures::future::join_all(
                    (0..asks).map(|_| identity.client.request_batch(identity.id, Hardware::default())),
                )
                .await;
                let mut batches = std::collections::BTreeSet::new();
                for answer in answers {
                    match answer {
                        Ok(Some(batch)) => {
                            batches.insert(batch.batch_id);
                            leased.push((identity.id, batch));
                        }
                        Ok(None) => {}
                        Err(e) if e.status().is_some_and(|s| s.as_u16() == 403) => {
                            println!("hostile: {} refused by the hub: {e}", identity.id);
                            identity.refused = true;
                        }
                        Err(e) => println!("hostile: lease refused: {e}"),
                    }
                }
                if args.mode == Attack::Hoard {
                    println!("hostile: {} distinct batches held by one identity", batches.len());
                }
            }
            leased.dedup_by_key(|(_, b)| b.batch_id);
            if leased.is_empty() {
                idle += 1;
                if idle > 60 {
                    break;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            idle = 0;
            if args.mode == Attack::Hoard {
                // Held until the leases lapse, then again.
                tokio::time::sleep(Duration::from_secs(5)).await;
                continue;
            }
            let version = leased[0].1.model_version.clone();
            if model.as_ref().is_none_or(|m| m.version != version) {
                model = Some(model_of(&identities[0].client, &version).await?);
            }
            let m = model.as_ref().expect("loaded above");
            // The honest updates the bloc computes, for the attacks that need them.
            let mut honest = Vec::new();
            if !matches!(args.mode, Attack::Zero | Attack::Hoard) {
                for (owner, batch) in &leased {
                    let client = &identities.iter().find(|i| i.id == *owner).expect("owner").client;
                    let samples = decode_samples(&client.download(&batch.data_url).await?)?;
                    honest.push(
                        update_on_cpu(
                            &m.spec,
                            &m.schema,
                            &m.params,
                            &samples,
                            &LocalTraining::from_plan(&batch.plan, 8),
                        )?
                        .flat,
                    );
                }
                history.extend(honest.iter().cloned());
                let keep = history.len().saturating_sub(4.max(honest.len()));
                history.drain(..keep);
            }
            let len = m.schema.num_parameters();
            let bloc = match args.mode {
                Attack::Little => {
                    let (mean, spread) = mean_and_spread(&history);
                    Some(mean.iter().zip(&spread).map(|(m, s)| m - args.factor * s).collect())
                }
                Attack::Collude => {
                    let (mean, _) = mean_and_spread(&honest);
                    let honest_norm = honest.iter().map(|h| norm(h)).sum::<f64>() / honest.len() as f64;
                    let scale = (honest_norm / norm(&mean).max(1e-30)) as f32;
                    Some(mean.iter().map(|v| -v * scale).collect::<Vec<f32>>())
                }
                _ => None,
            };
            for (k, (owner, batch)) in leased.iter().enumerate() {
                let poisoned: Vec<f32> = match args.mode {
                    Attack::Scale => honest[k].iter().map(|v| v * args.factor).collect(),
                    Attack::SignFlip => honest[k].iter().map(|v| -v).collect(),
                    Attack::Random => {
                        let rms = norm(&honest[k]) / (len as f64).sqrt();
                        let noise = Normal::new(0.0, rms * f64::from(args.factor.abs()))?;
                        let mut rng = rand::rngs::StdRng::seed_from_u64((round * 1000 + k) as u64);
                        (0..len).map(|_| noise.sample(&mut rng) as f32).collect()
                    }
                    Attack::Little | Attack::Collude => bloc.clone().expect("computed above"),
                    Attack::Zero => vec![0.0; len],
                    Attack::Hoard => unreachable!("hoarders do not upload"),
                };
                let identity = identities.iter_mut().find(|i| i.id == *owner).expect("owner");
                let target = match identity.client.upload_target(identity.id, batch.batch_id).await {
                    Ok(target) => target,
                    Err(e) => {
                        println!("hostile: upload refused: {e}");
                        continue;
                    }
                };
                identity
                    .client
                    .put_update(&target, encode_update(&m.schema, &poisoned, &m.version, Encoding::Dense))
                    .await?;
                let upload = GradientUpload {
                    worker_id: identity.id,
                    batch_id: batch.batch_id,
                    model_version: m.version.clone(),
                    gradients_url: target.gradients_url,
                    loss: 3.0,
                    num_samples: batch.num_samples,
                };
                match identity.client.upload_gradients(&upload).await {
                    Ok(_) => uploads += 1,
                    Err(e) => println!("hostile: upload refused: {e}"),
                }
            }
        }
        let mut accepted = 0;
        let mut rejected = 0;
        for identity in &identities {
            if let Ok(stats) = identity.client.worker_stats().await {
                accepted += stats.total_batches;
                rejected += stats.updates_rejected;
            }
        }
        println!(
            "hostile: {uploads} uploads sent, {accepted} accepted, {rejected} rejected, {} of {} identities refused by the hub",
            identities.iter().filter(|i| i.refused).count(),
            identities.len()
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
