//! `hrm hub`: runs the aggregation server and its operator commands (init, ingest, rollback,
//! versions). Every subcommand opens the same storage, so they can run beside a live hub.

use anyhow::{Context, Result};
use clap::{ArgMatches, Args, Subcommand};
use hrm_hub::Hub;
use hrm_hub::config::{PolicyArgs, StorageArgs};
use hrm_settings::SettingsFile;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Subcommand)]
pub enum HubCommand {
    /// Serve the hub's /api/v1 interface, the status feed and the dashboard.
    Serve(Box<ServeArgs>),
    /// Publish the first model version from a Hugging Face checkpoint directory.
    Init(InitArgs),
    /// Cut a corpus into pre-chunked batches (gzip JSON lines) and queue them.
    Ingest(IngestArgs),
    /// Make an earlier version current again.
    Rollback(RollbackArgs),
    /// List the model versions and their metrics.
    Versions(StorageOnly),
    /// Offer failed batches (out of attempts) again now, without waiting for their cool-down.
    Requeue(RequeueArgs),
    /// List the updates of rounds held because they raised the validation loss, and release
    /// them (to the next aggregation) or reject them (their batches are redone).
    Held(HeldArgs),
}

#[derive(Args)]
pub struct RequeueArgs {
    /// One failed batch (default: every failed batch).
    #[arg(long)]
    batch: Option<uuid::Uuid>,
    #[command(flatten)]
    storage: StorageArgs,
}

#[derive(Args)]
#[group(id = "decision", multiple = false)]
pub struct HeldArgs {
    /// Put them back to pending: the next aggregation applies them (the validation-loss check
    /// still runs).
    #[arg(long)]
    release: bool,
    /// Reject them, without a reputation penalty; their batches are redone.
    #[arg(long)]
    reject: bool,
    #[command(flatten)]
    storage: StorageArgs,
}

#[derive(Args, Serialize, Deserialize)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, env = "HRM_HUB_ADDR", default_value = "127.0.0.1:8090")]
    addr: String,
    /// File holding the admin key that may call POST /api/v1/aggregate (or HRM_HUB_ADMIN_KEY).
    #[arg(long, env = "HRM_HUB_ADMIN_KEY_FILE")]
    admin_key_file: Option<PathBuf>,
    #[command(flatten)]
    #[serde(flatten)]
    storage: StorageArgs,
    #[command(flatten)]
    #[serde(flatten)]
    policy: PolicyArgs,
    #[command(flatten)]
    #[serde(flatten)]
    connections: hrm_http::ConnectionArgs,
}

/// The `hub:` section of `--config`, or of ./hrm.yaml when it exists.
fn settings_file(storage: &StorageArgs) -> Result<Option<SettingsFile>> {
    SettingsFile::find(
        storage.config.as_deref(),
        Path::new("hrm.yaml"),
        Some("hub"),
    )
}

/// The file may not name itself.
const NEVER_FROM_FILE: &[&str] = &["config"];

impl ServeArgs {
    /// The flags over the file's `hub:` section.
    fn layered(self, matches: &ArgMatches) -> Result<Self> {
        let file = settings_file(&self.storage)?;
        hrm_settings::layered(self, matches, file.as_ref(), NEVER_FROM_FILE)
    }
}

/// An operator command's storage flags over the file's: the file's other keys are `hub serve`'s.
fn layered_storage(storage: StorageArgs, matches: &ArgMatches) -> Result<StorageArgs> {
    let serve_keys = ServeArgs::augment_args(clap::Command::new("serve"))
        .get_arguments()
        .map(|arg| arg.get_id().to_string())
        .collect::<Vec<_>>();
    let file = settings_file(&storage)?.map(|file| file.shared_with(serve_keys));
    hrm_settings::layered(storage, matches, file.as_ref(), NEVER_FROM_FILE)
}

#[derive(Args)]
pub struct StorageOnly {
    #[command(flatten)]
    storage: StorageArgs,
}

#[derive(Args)]
#[group(id = "source", required = true, multiple = false, args = ["model", "model_config"])]
pub struct InitArgs {
    /// Checkpoint directory (config.json and model.safetensors), e.g. models/sample-moe.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Start from scratch: an architecture config.json, initialised as `hrm train` does
    /// (`--config` is the settings file, as for every hub command).
    #[arg(long)]
    model_config: Option<PathBuf>,
    /// Seed of the initialisation with --model-config (the same seed as `hrm train --seed` gives
    /// the same weights).
    #[arg(long, default_value_t = 0, requires = "model_config")]
    seed: u64,
    #[command(flatten)]
    storage: StorageArgs,
}

#[derive(Args)]
pub struct IngestArgs {
    /// Training text (.txt, or .jsonl / .jsonl.gz with a "text" field).
    #[arg(long)]
    corpus: PathBuf,
    /// Held-out text whose windows score each new version.
    #[arg(long)]
    valid: Option<PathBuf>,
    #[arg(long, default_value = "models/tokenizer.json")]
    tokenizer: PathBuf,
    /// Name recorded with the batches.
    #[arg(long, default_value = "default")]
    dataset: String,
    /// Samples per batch: 256, 512 or 1024 (pre-chunked sizes), or any size with --custom-size.
    #[arg(long, default_value_t = 512)]
    batch_size: usize,
    /// Allow a batch size other than 256, 512 and 1024.
    #[arg(long)]
    custom_size: bool,
    /// Tokens per sample (each sample holds seq_len + 1 ids).
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    #[command(flatten)]
    storage: StorageArgs,
}

#[derive(Args)]
pub struct RollbackArgs {
    /// The version to make current, e.g. v0.1.5.
    version: String,
    #[command(flatten)]
    storage: StorageArgs,
}

/// Operator commands need no aggregation policy; the defaults are checked and unused.
fn default_policy() -> Result<hrm_hub::config::Policy> {
    use clap::Parser;
    #[derive(Parser)]
    struct Defaults {
        #[command(flatten)]
        policy: PolicyArgs,
    }
    Defaults::parse_from(["hrm"]).policy.policy()
}

async fn open(storage: StorageArgs, matches: &ArgMatches) -> Result<Arc<Hub>> {
    let storage = layered_storage(storage, matches)?;
    Hub::open(&storage, default_policy()?, None).await
}

pub fn run(command: HubCommand, matches: &ArgMatches) -> Result<()> {
    let (_, matches) = matches
        .subcommand()
        .expect("clap requires a hub subcommand");
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        match command {
            HubCommand::Serve(args) => serve(*args, matches).await,
            HubCommand::Init(args) => {
                let hub = open(args.storage, matches).await?;
                let info = match (&args.model, &args.model_config) {
                    (Some(model), _) => hrm_hub::versions::init(&hub, model).await?,
                    (None, Some(config)) => {
                        hrm_hub::versions::init_fresh(&hub, config, args.seed).await?
                    }
                    (None, None) => unreachable!("clap requires one of them"),
                };
                println!(
                    "published {} ({} parameters, sha256 {})",
                    info.version, info.num_parameters, info.sha256
                );
                Ok(())
            }
            HubCommand::Ingest(args) => ingest(args, matches).await,
            HubCommand::Rollback(args) => {
                let hub = open(args.storage, matches).await?;
                let info = hrm_hub::versions::rollback(&hub, &args.version).await?;
                println!("current version is now {}", info.version);
                Ok(())
            }
            HubCommand::Requeue(args) => {
                let hub = open(args.storage, matches).await?;
                let count = hrm_hub::batches::requeue_failed(&hub, args.batch).await?;
                println!("{count} failed batches are pending again");
                Ok(())
            }
            HubCommand::Held(args) => held(args, matches).await,
            HubCommand::Versions(args) => {
                let hub = open(args.storage, matches).await?;
                let current = hrm_hub::versions::current_version(&hub).await?;
                for row in hrm_hub::versions::all_versions(&hub).await? {
                    let mark = if current.as_deref() == Some(row.version.as_str()) {
                        "*"
                    } else {
                        " "
                    };
                    println!(
                        "{mark} {:<12} parent {:<12} {}",
                        row.version,
                        row.parent.as_deref().unwrap_or("-"),
                        row.metrics
                    );
                }
                Ok(())
            }
        }
    })
}

async fn serve(args: ServeArgs, matches: &ArgMatches) -> Result<()> {
    let args = args.layered(matches)?;
    let admin_key = match (&args.admin_key_file, std::env::var("HRM_HUB_ADMIN_KEY")) {
        (Some(path), _) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?
                .trim()
                .to_string(),
        ),
        (None, Ok(key)) if !key.is_empty() => Some(key),
        _ => None,
    };
    let policy = args.policy.policy()?;
    let limits = args.connections.limits()?;
    let hub = Hub::open(&args.storage, policy, admin_key.as_deref()).await?;
    let listener = tokio::net::TcpListener::bind(&args.addr)
        .await
        .with_context(|| format!("binding {}", args.addr))?;
    tracing::info!(
        addr = %listener.local_addr()?,
        database = hub.db.backend.name(),
        queue = hub.queue.description(),
        objects = hub.blobs.description(),
        admin = admin_key.is_some(),
        "hub listening"
    );
    if hrm_hub::versions::current_version(&hub).await?.is_none() {
        tracing::warn!(
            "no model yet: run `hrm hub init --model DIR` with the same storage settings"
        );
    }
    hrm_hub::serve(hub, listener, &limits, hrm_http::shutdown_signal()).await
}

async fn held(args: HeldArgs, matches: &ArgMatches) -> Result<()> {
    let hub = open(args.storage, matches).await?;
    let held = hrm_hub::store::updates::held(&hub.db.pool).await?;
    for u in &held {
        println!(
            "{} worker {} batch {} on {}: {}",
            u.update_id,
            u.worker_id,
            u.batch_id,
            u.model_version,
            u.reason.as_deref().unwrap_or("-")
        );
    }
    if args.release {
        let count = hrm_hub::updates::release_held(&hub).await?;
        println!("{count} held updates are pending again");
    } else if args.reject {
        let count = hrm_hub::updates::reject_held(&hub).await?;
        println!("{count} held updates rejected; their batches will be redone");
    } else {
        println!(
            "{} held updates (--release or --reject to decide)",
            held.len()
        );
    }
    Ok(())
}

async fn ingest(args: IngestArgs, matches: &ArgMatches) -> Result<()> {
    if !args.custom_size && !hrm_hub::batches::BATCH_SIZES.contains(&args.batch_size) {
        anyhow::bail!("--batch-size must be 256, 512 or 1024 (or pass --custom-size)");
    }
    let (tokenizer, eot) = crate::train::corpus_tokenizer(&args.tokenizer)?;
    let tokens = hrm_model::train::corpus_tokens(&args.corpus, &tokenizer, eot)?;
    let valid = match &args.valid {
        Some(path) => Some(hrm_model::train::corpus_tokens(path, &tokenizer, eot)?),
        None => None,
    };
    let hub = open(args.storage, matches).await?;
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} batches {elapsed} (ETA {eta})",
        )
        .expect("template"),
    );
    let report = hrm_hub::batches::ingest(
        &hub,
        &args.dataset,
        &tokens,
        valid.as_deref(),
        args.batch_size,
        args.seq_len,
        |done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        },
    )
    .await?;
    bar.finish_and_clear();
    println!(
        "{} batches ({} new) of up to {} samples, {} samples in all; {} validation windows",
        report.batches,
        report.new_batches,
        args.batch_size,
        report.samples,
        report.validation_windows
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, FromArgMatches, Parser};

    #[derive(Parser)]
    struct Hrm {
        #[command(subcommand)]
        hub: HubCommand,
    }

    /// `hrm hub ARGV`: the command and its own matches.
    fn parse(argv: &[&str]) -> (HubCommand, ArgMatches) {
        let matches = Hrm::command().get_matches_from(std::iter::once("hub").chain(argv.to_vec()));
        let hub = Hrm::from_arg_matches(&matches).unwrap().hub;
        (hub, matches.subcommand().unwrap().1.clone())
    }

    fn yaml(dir: &Path, text: &str) -> String {
        let path = dir.join("hrm.yaml");
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    }

    #[test]
    fn hub_serve_reads_its_section_under_its_flags() {
        let dir = tempfile::tempdir().unwrap();
        let path = yaml(
            dir.path(),
            "serve:\n  port: 1\nhub:\n  rule: trimmed-mean\n  trim_fraction: 0.2\n  lease_seconds: 5\n  data_dir: /srv/hub\n  header_timeout: 9\n",
        );
        let (HubCommand::Serve(args), matches) =
            parse(&["serve", "--config", &path, "--lease-seconds", "7"])
        else {
            unreachable!()
        };
        let args = args.layered(&matches).unwrap();
        assert_eq!(args.storage.data_dir, PathBuf::from("/srv/hub"));
        assert_eq!(args.connections.header_timeout, Some(9));
        let policy = args.policy.policy().unwrap();
        assert_eq!(
            policy.lease,
            std::time::Duration::from_secs(7),
            "the flag wins"
        );
        assert_eq!(
            policy.rule,
            hrm_hub::rules::Rule::TrimmedMean { trim_fraction: 0.2 }
        );
        assert_eq!(policy.min_gradients, 10, "a default the file leaves alone");
    }

    #[test]
    fn operator_commands_read_the_storage_and_leave_the_serve_keys() {
        let dir = tempfile::tempdir().unwrap();
        let path = yaml(dir.path(), "hub:\n  rule: median\n  data_dir: /srv/hub\n");
        let (HubCommand::Versions(args), matches) = parse(&["versions", "--config", &path]) else {
            unreachable!()
        };
        let storage = layered_storage(args.storage, &matches).unwrap();
        assert_eq!(storage.data_dir, PathBuf::from("/srv/hub"));
        let path = yaml(dir.path(), "hub:\n  data_dri: /srv/hub\n");
        let (HubCommand::Versions(args), matches) = parse(&["versions", "--config", &path]) else {
            unreachable!()
        };
        let err = layered_storage(args.storage, &matches)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`data_dri`"), "{err}");
    }
}
