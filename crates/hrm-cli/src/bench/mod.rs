//! `hrm bench`: measurements, kept apart from the test suite.

pub mod ab;
mod charts;
pub mod hub;
pub mod model;
pub mod network;
pub mod train;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::Context;
use clap::Subcommand;
use serde::de::DeserializeOwned;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// One workload against several servers (hrm, OpenAI-compatible, TGI): latency, TTFT,
    /// throughput, errors and agreement, as a Markdown report.
    Ab(Box<ab::AbArgs>),
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
    /// Simulated workers (no training) against a running hub: requests/s, p50/p99, errors.
    HubLoad(hub::LoadArgs),
    /// Time of each aggregation rule next to the memory-bandwidth bound of reading the updates.
    Aggregate(hub::AggregateArgs),
    /// A worker that poisons its updates (scaled or random), for robustness runs.
    HostileWorker(network::HostileArgs),
    /// Validation loss of a checkpoint on evenly spaced windows, as `hrm train` scores it.
    Perplexity(network::PerplexityArgs),
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Ab(args) => ab::run(*args),
        BenchCommand::Model(args) => model::run(args),
        BenchCommand::ModelRun(args) => model::run_one(args),
        BenchCommand::Train(args) => train::run(args),
        BenchCommand::TrainRun(args) => train::run_one(args),
        BenchCommand::HubLoad(args) => hub::run_load(args),
        BenchCommand::Aggregate(args) => hub::run_aggregate(args),
        BenchCommand::HostileWorker(args) => network::run_hostile(args),
        BenchCommand::Perplexity(args) => network::run_perplexity(args),
    }
}

/// Where the reference side of a benchmark runs.
pub struct SidesConfig<'a> {
    /// The script under `benches/`.
    pub script: &'a str,
    pub threads: usize,
    /// The Python with torch and transformers; without it only our side runs.
    pub python: Option<&'a Path>,
}

/// Runs the same measurement in two fresh processes, `hrm bench <subcommand> <shape>` and
/// `python benches/<script> <script_args> <shape> --threads N`, and reads both results.
pub fn side_by_side<T: DeserializeOwned>(
    subcommand: &str,
    script_args: &[&str],
    shape: &[String],
    sides: &SidesConfig<'_>,
) -> anyhow::Result<(T, Option<T>)> {
    let mut ours = Command::new(std::env::current_exe()?);
    ours.args(["bench", subcommand])
        .args(shape)
        .env("RAYON_NUM_THREADS", sides.threads.to_string());
    let ours = measure(ours).context("our side")?;
    let theirs = match sides.python {
        Some(python) => {
            let script = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../benches")
                .join(sides.script);
            let mut cmd = Command::new(python);
            cmd.arg(script)
                .args(script_args)
                .args(shape)
                .args(["--threads", &sides.threads.to_string()]);
            Some(measure(cmd).context("the transformers side")?)
        }
        None => None,
    };
    Ok((ours, theirs))
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

/// Request latencies, kept in microseconds to three significant figures, read as percentiles in
/// milliseconds. Latencies beyond an hour count as an hour.
pub struct Latencies(hdrhistogram::Histogram<u64>);

/// The longest latency kept as measured, in microseconds: an hour.
const LONGEST_LATENCY_US: u64 = 3_600_000_000;

impl Latencies {
    pub fn of(durations: impl IntoIterator<Item = Duration>) -> Self {
        // Fixed bounds: an auto-resizing histogram does not grow on `saturating_record`, so
        // every latency would saturate at its initial top of two microseconds.
        let mut histogram = hdrhistogram::Histogram::new_with_bounds(1, LONGEST_LATENCY_US, 3)
            .expect("an hour in microseconds at three significant figures is a valid range");
        for duration in durations {
            histogram.saturating_record(u64::try_from(duration.as_micros()).unwrap_or(u64::MAX));
        }
        Self(histogram)
    }

    pub fn len(&self) -> u64 {
        self.0.len()
    }

    /// The latency at `quantile` (0 to 1) in milliseconds; none without samples.
    pub fn percentile_ms(&self, quantile: f64) -> Option<f64> {
        (self.len() > 0).then(|| self.0.value_at_quantile(quantile) as f64 / 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_read_back_as_measured() {
        let latencies = Latencies::of([10, 20, 30, 40_000].map(Duration::from_millis));
        let median = latencies.percentile_ms(0.5).unwrap();
        assert!((median - 20.0).abs() < 0.05, "median {median} ms");
        let slowest = latencies.percentile_ms(1.0).unwrap();
        assert!((slowest - 40_000.0).abs() < 40.0, "slowest {slowest} ms");
        let beyond = Latencies::of([Duration::from_secs(7200)]);
        let capped = beyond.percentile_ms(0.5).unwrap();
        assert!(
            (capped - 3_600_000.0).abs() < 3_600.0,
            "capped at an hour: {capped} ms"
        );
        assert!(Latencies::of([]).percentile_ms(0.5).is_none());
    }
}
