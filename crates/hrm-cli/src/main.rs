//! `hrm`: the one binary of the HRM stack.
//!
//! It owns argument parsing, logging set-up and the wiring of the library crates into
//! subcommands; the work itself lives in those crates.

mod bench;
mod generate;
mod hub;
mod serve;
mod train;
mod worker;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use hrm_model::DeviceRequest;

#[derive(Parser)]
#[command(
    name = "hrm",
    version,
    about = "Hierarchical-reasoning language models: inference, volunteer training, benchmarks"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the HTTP inference service (v1 contract; see docs/api.md).
    Serve(Box<hrm_serve::ServeArgs>),
    /// Serve the manual-test page on its own, pointed at a running `hrm serve`.
    Ui(serve::UiArgs),
    /// Generate completions for prompts with a local checkpoint.
    Generate(generate::GenerateArgs),
    /// Score continuations given contexts (sum of token log-probabilities).
    Score(generate::ScoreArgs),
    /// Train a model on a corpus (single process; the centralised baseline).
    Train(Box<train::TrainArgs>),
    /// Tokenizer tools.
    #[command(subcommand)]
    Tokenizer(train::TokenizerCommand),
    /// The volunteer training network's aggregation server (see docs/hub-api.md).
    #[command(subcommand)]
    Hub(hub::HubCommand),
    /// The volunteer client: train the network's model on this machine (see docs/worker.md).
    Worker(Box<worker::WorkerArgs>),
    /// Benchmarks (not tests): model throughput next to transformers.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

/// Where the model comes from and where it runs; shared by every subcommand that loads one.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Checkpoint: a Hugging Face directory (hrm_text, hrm_text_moe, llama) or a .gguf file.
    #[arg(long, env = "HRM_MODEL_PATH")]
    pub model_path: PathBuf,
    /// tokenizer.json to use instead of the one beside the checkpoint (or inside the GGUF).
    #[arg(long, env = "HRM_TOKENIZER_PATH")]
    pub tokenizer_path: Option<PathBuf>,
    /// cpu, cuda or mps; auto-detected when not given.
    #[arg(long, env = "HRM_DEVICE", default_value = "auto")]
    pub device: DeviceRequest,
    /// Context window in tokens; defaults to the model's max_position_embeddings.
    #[arg(long)]
    pub context_window: Option<usize>,
}

impl ModelArgs {
    pub fn load_engine(&self) -> anyhow::Result<hrm_model::Engine> {
        let device = hrm_model::select_device(self.device)?;
        let loaded = hrm_model::load_model(
            &self.model_path,
            self.tokenizer_path.as_deref(),
            &device,
            candle_core::DType::F32,
        )?;
        tracing::info!(
            model = %loaded.name,
            family = loaded.model.info().family.as_str(),
            format = %loaded.format,
            device = %hrm_model::device::device_label(&device),
            "model loaded"
        );
        Ok(hrm_model::Engine::new(loaded, self.context_window)?)
    }
}

fn init_logging(default_level: &str) {
    // HRM_LOG takes a full tracing filter (e.g. "info,hrm_serve=debug") and wins over the level.
    let filter = tracing_subscriber::EnvFilter::try_from_env("HRM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    // Colour codes only on a terminal: logs sent to a file or a pipe stay plain text.
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
}

/// What the allocator keeps of the memory a subcommand frees (glibc only; see [`tune_malloc`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FreedMemory {
    /// glibc's own rules (the hub, the tools, the benchmark clients).
    Returned,
    /// Inference: blocks under 32 MiB always come from the heap, and up to 1 GiB of freed heap
    /// is kept for the next pass.
    KeptUpTo1GiB,
    /// Training: no block from `mmap`, no heap ever trimmed.
    AllKept,
}

impl FreedMemory {
    fn for_command(command: &Command) -> Self {
        use bench::BenchCommand as Bench;
        match command {
            Command::Train(_) | Command::Worker(_) | Command::Bench(Bench::TrainRun(_)) => {
                Self::AllKept
            }
            Command::Serve(_)
            | Command::Generate(_)
            | Command::Score(_)
            | Command::Bench(Bench::ModelRun(_) | Bench::Perplexity(_)) => Self::KeptUpTo1GiB,
            _ => Self::Returned,
        }
    }
}

/// glibc's allocator settings for this process.
///
/// glibc gives threads their own heap arenas (up to eight per core) and keeps what each arena
/// once held. The model work of every subcommand moves between threads of several pools (the
/// async runtime's blocking threads, candle's thread team, the scheduler), so a long-running hub
/// came to hold many arenas' worth of freed memory: in the network benchmark its peak RSS fell
/// from 2.6-3.5 GB to 1.2-1.4 GB with two arenas (docs/performance.md). An operator's own
/// `MALLOC_ARENA_MAX` wins.
///
/// Training also keeps the memory it frees. Every step allocates and frees the same large
/// buffers (a micro-batch's logits and their gradient are 33 MB each at `hrm bench train`'s
/// shapes); glibc serves blocks over 32 MB with a fresh `mmap` and gives freed memory at the top
/// of a heap back to the system, so each step faulted all those pages in again: 460,000 page
/// faults in a 3-step `hrm bench train-run` of sample-llama on an Intel Xeon (family 6 model
/// 167), whose profile had 23% of its samples in the kernel (page faults, TLB shootdowns,
/// memory-cgroup charging). No `mmap` and no trimming take that to 120,000, a third less system
/// time and 0.96× the wall time there; the HRM-Text configs' steps are unchanged
/// (docs/performance.md). An operator's own `MALLOC_MMAP_MAX_` or `MALLOC_TRIM_THRESHOLD_` wins.
///
/// Inference keeps less, because a server runs for weeks on requests of every size. glibc's
/// sliding rule (each freed `mmap` block raises the threshold to its size, and the trim
/// threshold to twice that) left a batch-8 prefill of `models/sample` faulting its activations
/// in again on every pass: 48,500 page faults a `hrm bench model` run, where a fixed 32 MiB
/// threshold (glibc's ceiling) and a 1 GiB trim threshold take 29,800, and that prefill ran
/// 1.14× as fast in one series of alternations with the same binary (1.02× in another; the
/// GGUF's passes within ±8%), on a 2-core AMD EPYC of family 25 model 1 (docs/performance.md).
/// Blocks over 32 MiB still come from `mmap` and go back on `free`. An operator's own
/// `MALLOC_MMAP_THRESHOLD_` or `MALLOC_TRIM_THRESHOLD_` wins.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune_malloc(freed: FreedMemory) {
    let unset = |name: &str| std::env::var_os(name).is_none();
    // SAFETY: mallopt only sets an allocator parameter; it runs before any other thread.
    let set = |param, value| unsafe { libc::mallopt(param, value) };
    if unset("MALLOC_ARENA_MAX") {
        set(libc::M_ARENA_MAX, 2);
    }
    match freed {
        FreedMemory::AllKept if unset("MALLOC_MMAP_MAX_") && unset("MALLOC_TRIM_THRESHOLD_") => {
            set(libc::M_MMAP_MAX, 0);
            set(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
        }
        FreedMemory::KeptUpTo1GiB
            if unset("MALLOC_MMAP_THRESHOLD_") && unset("MALLOC_TRIM_THRESHOLD_") =>
        {
            set(libc::M_MMAP_THRESHOLD, 32 << 20);
            set(libc::M_TRIM_THRESHOLD, 1 << 30);
        }
        _ => {}
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_malloc(_freed: FreedMemory) {}

/// The matches of the subcommand at `path`, which clap has already checked is the one given.
fn subcommand<'a>(matches: &'a ArgMatches, path: &[&str]) -> &'a ArgMatches {
    path.iter().fold(matches, |m, name| {
        m.subcommand_matches(name)
            .expect("the parsed command is on this path")
    })
}

fn main() -> ExitCode {
    // The matches travel with the arguments: they tell a flag from a default when the settings
    // file is layered in.
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    tune_malloc(FreedMemory::for_command(&cli.command));
    hrm_wire::install_tls_provider();
    let result = match cli.command {
        Command::Serve(args) => serve::run(*args, subcommand(&matches, &["serve"])),
        // The worker sets up its own logging: to a file under the terminal interface.
        Command::Worker(args) => worker::run(*args, subcommand(&matches, &["worker"])),
        command => {
            init_logging("info,sqlx=warn");
            match command {
                Command::Ui(args) => serve::run_ui(args),
                Command::Generate(args) => generate::run_generate(args),
                Command::Score(args) => generate::run_score(args),
                Command::Train(args) => train::run_train(*args),
                Command::Tokenizer(cmd) => train::run_tokenizer(cmd),
                Command::Hub(cmd) => hub::run(cmd, subcommand(&matches, &["hub"])),
                Command::Bench(cmd) => bench::run(cmd),
                Command::Serve(_) | Command::Worker(_) => unreachable!("handled above"),
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// clap's own checks of every subcommand (unique names, groups that exist), which it runs
    /// lazily, only for the subcommand a debug build is given.
    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn each_subcommand_keeps_the_freed_memory_its_work_reuses() {
        let freed = |line: &str| {
            let cli = Cli::try_parse_from(line.split_whitespace()).expect("valid arguments");
            FreedMemory::for_command(&cli.command)
        };
        let kept = FreedMemory::KeptUpTo1GiB;
        assert_eq!(freed("hrm serve --model-path m"), kept);
        assert_eq!(
            freed("hrm score --model-path m --context a --continuation b"),
            kept
        );
        let train_run = "hrm bench train-run --config c --batch-size 2 --micro-batch 1 \
                         --seq-len 8 --steps 1";
        assert_eq!(freed(train_run), FreedMemory::AllKept);
        assert_eq!(freed("hrm hub versions"), FreedMemory::Returned);
    }
}
