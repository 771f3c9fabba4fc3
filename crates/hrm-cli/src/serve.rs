//! `hrm serve`: resolves the settings, then prints them, dry-runs a load, or serves.

use hrm_serve::{ServeArgs, ServeConfig};

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let config = ServeConfig::resolve(&args)?;
    if args.print_config {
        print!("{}", config.to_yaml());
        return Ok(());
    }
    crate::init_logging(&config.log_level);
    if args.dry_run {
        let started = std::time::Instant::now();
        let (engine, device) = hrm_serve::load_engine(&config)?;
        println!(
            "{}",
            serde_json::json!({
                "model": engine.name(),
                "family": engine.info().family.as_str(),
                "format": engine.format(),
                "device": device,
                "parameters": engine.info().num_parameters,
                "context_window": engine.context_window(),
                "vocab_size": engine.tokenizer().vocab_size(),
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
