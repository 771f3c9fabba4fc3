//! `hrm bench`: measurements, kept apart from the test suite.

pub mod model;

use clap::Subcommand;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Prefill and decode tokens/s and peak RSS at several batch sizes, next to transformers.
    Model(model::ModelBenchArgs),
    /// One measurement in a fresh process (used by `hrm bench model`, so that peak RSS is per run).
    #[command(hide = true)]
    ModelRun(model::RunArgs),
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Model(args) => model::run(args),
        BenchCommand::ModelRun(args) => model::run_one(args),
    }
}
