//! `hrm bench`: measurements, kept apart from the test suite.

pub mod ab;
mod charts;
pub mod hub;
pub mod model;
pub mod network;
pub mod train;

use std::path::{Path, PathBuf};
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

/// How both sides of a side-by-side benchmark run: the flags `hrm bench model` and `hrm bench
/// train` share.
#[derive(clap::Args)]
pub struct Sides {
    /// CPU threads for both sides.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// A Python with torch and transformers: runs the reference side. Without it, only ours.
    #[arg(long, env = "HRM_REFERENCE_PYTHON")]
    pub python: Option<PathBuf>,
    /// Measurements of each side per row, alternating which goes first: the table gives each
    /// side's median and the median (and range) of the rounds' own ratios.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..))]
    pub rounds: u16,
}

impl Sides {
    /// The table's footnote on how its figures were taken, `ratio` naming the ratio column.
    pub fn note(&self, ratio: &str) -> String {
        rounds_note(self.rounds.into(), self.python.as_ref().map(|_| ratio))
    }
}

/// Runs the same measurement in fresh processes, `hrm bench <subcommand> <shape>` and `python
/// benches/<script> <script_args> <shape> --threads N`, `sides.rounds` times each, and reads every
/// result: one `(ours, theirs)` pair per round. The side that goes first alternates from round
/// to round, so that a machine whose speed drifts (a VM beside busy neighbours) slows both
/// sides alike, and each pair's ratio compares two runs taken back to back.
pub fn side_by_side<T: DeserializeOwned>(
    subcommand: &str,
    (script, script_args): (&str, &[&str]),
    shape: &[String],
    sides: &Sides,
) -> anyhow::Result<Vec<(T, Option<T>)>> {
    let ours = || {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.args(["bench", subcommand])
            .args(shape)
            .env("RAYON_NUM_THREADS", sides.threads.to_string());
        measure(cmd).context("our side")
    };
    let theirs = || -> anyhow::Result<Option<T>> {
        let Some(python) = &sides.python else {
            return Ok(None);
        };
        let script = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../benches")
            .join(script);
        let mut cmd = Command::new(python);
        cmd.arg(script)
            .args(script_args)
            .args(shape)
            .args(["--threads", &sides.threads.to_string()]);
        measure(cmd).context("the transformers side").map(Some)
    };
    (0..sides.rounds.max(1))
        .map(|round| {
            if round.is_multiple_of(2) {
                let ours = ours()?;
                Ok((ours, theirs()?))
            } else {
                let theirs = theirs()?;
                Ok((ours()?, theirs))
            }
        })
        .collect()
}

/// One figure over a benchmark's rounds: each side's median, and the median and range of the
/// rounds' own ratios (ours ÷ theirs, each pair measured back to back).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PairedFigure {
    pub ours: f64,
    /// `None` when the reference side did not run.
    pub theirs: Option<f64>,
    /// `(median, lowest, highest)` of the per-round ratios.
    pub ratio: Option<(f64, f64, f64)>,
    pub rounds: usize,
}

impl PairedFigure {
    /// The figure `value` picks out of each round of `rounds` (at least one round).
    pub fn of<T>(rounds: &[(T, Option<T>)], value: impl Fn(&T) -> f64) -> Self {
        let ours: Vec<f64> = rounds.iter().map(|(o, _)| value(o)).collect();
        let theirs: Option<Vec<f64>> = rounds.iter().map(|(_, t)| t.as_ref().map(&value)).collect();
        let ratio = theirs.as_ref().map(|theirs| {
            let mut ratios: Vec<f64> = ours.iter().zip(theirs).map(|(o, t)| o / t).collect();
            ratios.sort_by(f64::total_cmp);
            (median(&ratios), ratios[0], ratios[ratios.len() - 1])
        });
        Self {
            ours: median(&ours),
            theirs: theirs.as_deref().map(median),
            ratio,
            rounds: rounds.len(),
        }
    }

    /// The reference side's median with `decimals` places, or a dash.
    pub fn theirs_cell(&self, decimals: usize) -> String {
        self.theirs
            .map_or("–".into(), |t| format!("{t:.decimals$}"))
    }

    /// `1.67×`, and over several rounds the range of the rounds' ratios: `1.67× (1.52–1.80)`.
    pub fn ratio_cell(&self) -> String {
        match self.ratio {
            None => "–".into(),
            Some((median, _, _)) if self.rounds <= 1 => format!("{median:.2}×"),
            Some((median, low, high)) => format!("{median:.2}× ({low:.2}–{high:.2})"),
        }
    }
}

/// The table's footnote on how its figures were taken: `ratio = hrm / transformers`, or over
/// several rounds the medians and ranges; without a reference side (`ratio` is `None`), only
/// ours.
pub fn rounds_note(rounds: usize, ratio: Option<&str>) -> String {
    match (rounds, ratio) {
        (0 | 1, Some(ratio)) => format!("ratio = {ratio}"),
        (0 | 1, None) => "our side only".into(),
        (_, Some(ratio)) => format!(
            "each figure the median of {rounds} rounds, the sides taking turns to go first; \
             ratio = the median of the rounds' own {ratio}, their range in brackets"
        ),
        (_, None) => format!("each figure the median of {rounds} rounds of our side only"),
    }
}

/// The middle value of `values`, in any order (the mean of the middle two for an even count).
pub(super) fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len().is_multiple_of(2) {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    } else {
        sorted[mid]
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

    /// Each side's median, and the ratio taken per round before its median: three rounds where
    /// the machine ran at half speed in the second (both sides alike) and the reference side
    /// alone was slow in the third.
    #[test]
    fn a_paired_figure_takes_each_rounds_ratio_before_the_median() {
        let rounds = [(10.0, Some(5.0)), (5.0, Some(2.5)), (12.0, Some(3.0))];
        let figure = PairedFigure::of(&rounds, |&v| v);
        assert_eq!(figure.ours, 10.0);
        assert_eq!(figure.theirs, Some(3.0));
        // The ratio of the medians would be 3.33; the rounds' own ratios are 2, 2 and 4.
        assert_eq!(figure.ratio, Some((2.0, 2.0, 4.0)));
        assert_eq!(figure.ratio_cell(), "2.00× (2.00–4.00)");
        assert_eq!(figure.theirs_cell(1), "3.0");
        let single = PairedFigure::of(&rounds[2..], |&v| v);
        assert_eq!(single.ratio_cell(), "4.00×");

        let even = PairedFigure::of(&[(4.0, Some(1.0)), (6.0, Some(2.0))], |&v| v);
        assert_eq!((even.ours, even.theirs), (5.0, Some(1.5)));
        assert_eq!(even.ratio, Some((3.5, 3.0, 4.0)));

        let alone = PairedFigure::of(&[(7.0, None::<f64>), (9.0, None)], |&v| v);
        assert_eq!((alone.ours, alone.theirs, alone.ratio), (8.0, None, None));
        assert_eq!(
            (alone.theirs_cell(0), alone.ratio_cell()),
            ("–".into(), "–".into())
        );
        assert_eq!(rounds_note(1, Some("a / b")), "ratio = a / b");
        assert!(rounds_note(3, Some("a / b")).contains("median of 3 rounds"));
        assert!(!rounds_note(2, None).contains("ratio"));
    }
}
