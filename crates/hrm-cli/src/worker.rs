//! `hrm worker`: the volunteer client. The terminal interface by default (start and stop with
//! `s`), or `--headless` for servers, which starts at once and prints structured log lines.

use anyhow::{Context, Result};
use clap::{ArgMatches, Args, ValueEnum};
use hrm_worker::config::{ConfigOverrides, default_config_path, load};
use hrm_worker::resources::ResourceArgs;
use hrm_worker::tui::Command;
use hrm_worker::{SessionEnd, Settings, Status, Worker, network};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// The hub address written into a first-run configuration when none is given.
const DEFAULT_HUB_URL: &str = "http://127.0.0.1:8090";

#[derive(Args)]
pub struct WorkerArgs {
    /// Configuration file; written with a new API key on first run
    /// [default: ~/.config/hrm/worker.yaml].
    #[arg(long, env = "HRM_WORKER_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    overrides: ConfigOverrides,
    /// Name on the leaderboard, sent when this key registers.
    #[arg(long, env = "HRM_WORKER_USERNAME")]
    username: Option<String>,
    /// No terminal interface: start at once and print log lines (stop with Ctrl-C or SIGTERM).
    #[arg(long)]
    headless: bool,
    /// Format of the --headless log lines.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Seconds to wait after a failed step before reconnecting.
    #[arg(long, env = "HRM_WORKER_RETRY_DELAY", default_value_t = 30.0)]
    retry_delay: f64,
    /// Where checkpoints are cached by content hash [default: ~/.cache/hrm/checkpoints].
    #[arg(long, env = "HRM_WORKER_CACHE_DIR")]
    cache_dir: Option<PathBuf>,
    #[command(flatten)]
    resources: ResourceArgs,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    /// `time level message key=value…`
    Text,
    /// One JSON object per line.
    Json,
}

pub fn run(args: WorkerArgs, matches: &ArgMatches) -> Result<()> {
    let config_path = args.config.clone().unwrap_or_else(default_config_path);
    init_logging(&args, &config_path)?;
    let first_run_url = args
        .overrides
        .server
        .url
        .as_deref()
        .unwrap_or(DEFAULT_HUB_URL);
    let loaded = load(&config_path, first_run_url, &args.overrides, matches)?;
    if loaded.created {
        tracing::info!(path = %config_path.display(), "first run: wrote the configuration with a new API key (mode 0600)");
    }
    let config = loaded.config;
    config.validate()?;
    args.resources.validate()?;
    if !(args.retry_delay >= 0.0 && args.retry_delay.is_finite()) {
        anyhow::bail!(
            "--retry-delay must be a number of seconds, not {}",
            args.retry_delay
        );
    }
    if let Some(threads) = args.resources.threads {
        // SAFETY: no other thread exists yet (the runtime is built below); candle's CPU
        // kernels read this variable to size their thread pool.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", threads.to_string()) };
    }
    let device = hrm_model::select_device(args.resources.device)?;
    let hub_url = config.server.url.clone();
    let status = Status::new(&hub_url);
    let settings = Settings {
        config,
        username: args.username.clone(),
        retry_delay: Duration::from_secs_f64(args.retry_delay),
        resources: args.resources.clone(),
        cache_dir: args
            .cache_dir
            .clone()
            .unwrap_or_else(hrm_worker::cache::CheckpointCache::default_dir),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let worker = Worker::new(settings, device, status.clone())?;
    let feed = runtime.spawn(network::follow(
        worker.client().clone(),
        hub_url,
        status.clone(),
    ));
    let result = if args.headless {
        runtime.block_on(headless(worker))
    } else {
        interactive(&runtime, worker, &status)
    };
    feed.abort();
    runtime.shutdown_timeout(Duration::from_secs(2));
    result
}

fn init_logging(args: &WorkerArgs, config_path: &std::path::Path) -> Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("HRM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    if args.headless {
        // Colour only on a terminal: redirected logs stay plain for grep and collectors.
        let builder = builder.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
        match args.log_format {
            LogFormat::Text => builder.with_writer(std::io::stderr).init(),
            LogFormat::Json => builder.json().with_writer(std::io::stderr).init(),
        }
    } else {
        // The screen belongs to the interface; the log goes beside the configuration.
        let path = config_path.with_file_name("worker.log");
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening the log {}", path.display()))?;
        builder.with_ansi(false).with_writer(Arc::new(file)).init();
    }
    Ok(())
}

async fn headless(mut worker: Worker) -> Result<()> {
    let (stop, stopped) = watch::channel(false);
    tokio::spawn(async move {
        hrm_http::shutdown_signal().await;
        tracing::info!("stopping after the current batch (signal again to exit now)");
        stop.send_replace(true);
        hrm_http::shutdown_signal().await;
        tracing::warn!("exiting now; the batch in progress is lost");
        std::process::exit(130);
    });
    match worker.run_session(stopped).await {
        SessionEnd::Stopped | SessionEnd::MaxBatches => Ok(()),
    }
}

/// The terminal interface on this thread; sessions run on the runtime, one at a time.
fn interactive(
    runtime: &tokio::runtime::Runtime,
    mut worker: Worker,
    status: &Status,
) -> Result<()> {
    let stop = Arc::new(watch::channel(false).0);
    let (start, mut starts) = mpsc::unbounded_channel::<()>();
    let sessions = {
        let stop = stop.clone();
        runtime.spawn(async move {
            while starts.recv().await.is_some() {
                worker.run_session(stop.subscribe()).await;
            }
        })
    };
    let mut quitting = false;
    hrm_worker::tui::run(status, |command| {
        let running = status.lock().running;
        match command {
            Some(Command::Toggle) if running => {
                stop.send_replace(true);
                status.update(|v| v.stopping = true);
            }
            Some(Command::Toggle) => {
                stop.send_replace(false);
                status.update(|v| v.running = true);
                let _ = start.send(());
            }
            // A second quit leaves at once; the batch in progress is lost.
            Some(Command::Quit) if quitting => return true,
            Some(Command::Quit) => {
                quitting = true;
                stop.send_replace(true);
                status.update(|v| v.stopping = running);
            }
            None => {}
        }
        quitting && !status.lock().running
    })?;
    sessions.abort();
    Ok(())
}
