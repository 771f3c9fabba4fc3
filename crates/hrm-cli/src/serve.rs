//! `hrm serve` (resolves the settings, then prints them, dry-runs a load, or serves) and
//! `hrm ui` (the manual-test page on its own).

use clap::{ArgMatches, Args};
use hrm_serve::{ServeArgs, ServeConfig};

pub fn run(args: ServeArgs, matches: &ArgMatches) -> anyhow::Result<()> {
    let (print_config, dry_run) = (args.print_config, args.dry_run);
    let config = ServeConfig::resolve(args, matches)?;
    if print_config {
        print!("{}{}", environment_note(), config.to_yaml());
        return Ok(());
    }
    crate::init_logging(&config.log_level);
    if dry_run {
        let started = std::time::Instant::now();
        let loaded = hrm_serve::load_engine(&config)?;
        let engine = &loaded.engine;
        println!(
            "{}",
            serde_json::json!({
                "model": engine.name(),
                "family": engine.info().family.as_str(),
                "format": engine.format(),
                "device": loaded.device,
                "parameters": engine.info().num_parameters,
                // What one decode step must read: with the measured memory bandwidth, the bound
                // on batch-1 decode speed.
                "weight_bytes_per_token": engine.info().weight_bytes,
                "context_window": engine.context_window(),
                "vocab_size": engine.tokenizer().vocab_size(),
                "chat_template": loaded.chat_template.as_ref().map(|t| &t.source),
                "load_seconds": started.elapsed().as_secs_f64(),
            })
        );
        return Ok(());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(hrm_serve::serve(config))
}

/// YAML comments naming the `HRM_*` variables set in the environment: those `hrm serve` read,
/// and those it left alone (another program's, such as `hrm worker`'s `HRM_WORKER_*`). Names
/// only: values may be secrets.
fn environment_note() -> String {
    use clap::CommandFactory;
    #[derive(clap::Parser)]
    struct Serve {
        #[command(flatten)]
        args: ServeArgs,
    }
    let ours: Vec<String> = Serve::command()
        .get_arguments()
        .filter_map(|arg| arg.get_env()?.to_str().map(str::to_string))
        .collect();
    let mut set: Vec<String> = std::env::vars_os()
        .filter_map(|(name, _)| name.into_string().ok())
        .filter(|name| name.starts_with("HRM_"))
        .collect();
    set.sort();
    let (read, ignored): (Vec<String>, Vec<String>) =
        // HRM_LOG is every program's log filter.
        set.into_iter().partition(|name| ours.contains(name) || name == "HRM_LOG");
    let mut note = String::new();
    if !read.is_empty() {
        note += &format!("# read from the environment: {}\n", read.join(", "));
    }
    if !ignored.is_empty() {
        note += &format!("# not read by hrm serve: {}\n", ignored.join(", "));
    }
    note
}

#[derive(Args)]
pub struct UiArgs {
    /// The `hrm serve` the page calls (it needs `--enable-cors --cors-origins` for this page's origin).
    #[arg(long)]
    server_url: String,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8001)]
    port: u16,
}

pub fn run_ui(args: UiArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr).await?;
        tracing::info!(%addr, server = %args.server_url, "serving the manual-test page at /ui");
        axum::serve(listener, hrm_serve::ui::standalone(&args.server_url))
            .with_graceful_shutdown(hrm_http::shutdown_signal())
            .await?;
        Ok(())
    })
}
