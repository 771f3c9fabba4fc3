//! `hrm bench`: measurements, kept apart from the test suite.

pub mod model;
pub mod train;

use std::process::Command;

use anyhow::Context;
use clap::Subcommand;
use serde::de::DeserializeOwned;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Prefill and decode tokens/s and peak RSS at several batch sizes, next to transformers.
    Model(model::ModelBenchArgs),
    /// One measurement in a fresh process (used by `hrm bench model`, so that peak RSS is per run).
    #[command(hide = true)]
    ModelRun(model::RunArgs),
    /// Training tokens/s next to PyTorch on the same config.
    Train(train::TrainBenchArgs),
    /// One training measurement in a fresh process (used by `hrm bench train`).
    #[command(hide = true)]
    TrainRun(train::TrainRunArgs),
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Model(args) => model::run(args),
        BenchCommand::ModelRun(args) => model::run_one(args),
        BenchCommand::Train(args) => train::run(args),
        BenchCommand::TrainRun(args) => train::run_one(args),
    }
}

/// Runs one measurement process and reads the JSON line it prints last.
fn measure<T: DeserializeOwned>(mut cmd: Command) -> anyhow::Result<T> {
    let output = cmd.output().context("starting the measurement process")?;
    anyhow::ensure!(
        output.status.success(),
        "measurement failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .last()
        .context("no output from the measurement")?;
    serde_json::from_str(line).with_context(|| format!("reading {line:?}"))
}
