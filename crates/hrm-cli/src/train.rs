//! `hrm train` (the single-process trainer, the centralised baseline of the volunteer network)
//! and `hrm tokenizer train`.
//!
//! Layout of `--out DIR`:
//! - `config.json`, `model.safetensors`, `tokenizer.json`: the latest Hugging Face export;
//! - `checkpoint/`: f32 weights, optimiser moments and `state.json`, for `--resume`;
//! - `train-log.jsonl`: one line per logged step and per evaluation.
//!
//! Step `s` draws its windows from a generator seeded with `seed + s`, so a resumed run sees
//! exactly the data the uninterrupted run would have seen.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use candle_core::{DType, Device};
use clap::{Args, Subcommand};
use hrm_model::ModelSpec;
use hrm_model::tokenizer::{END_OF_TEXT, train_byte_level_bpe};
use hrm_model::train::{
    AdamWConfig, LrSchedule, ScheduleKind, Trainer, corpus_tokens, evaluation_windows,
    sample_windows, save_pretrained,
};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

#[derive(Args, Serialize, Deserialize, Clone, Debug)]
pub struct TrainArgs {
    /// Architecture: a config.json (model_type hrm_text, hrm_text_moe or llama).
    #[arg(long)]
    pub config: PathBuf,
    /// Training text: a corpus .txt (data/build_corpus.py) or .jsonl.gz batches.
    #[arg(long)]
    pub train: PathBuf,
    /// Held-out text for validation loss and perplexity.
    #[arg(long)]
    pub valid: PathBuf,
    /// tokenizer.json (hrm tokenizer train).
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// Output directory (see the module docs for its layout).
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 2000)]
    pub steps: usize,
    /// Sequences per optimiser step.
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// Sequences per forward/backward pass; gradients are accumulated up to --batch-size.
    #[arg(long, default_value_t = 8)]
    pub micro_batch: usize,
    /// Tokens per training sequence.
    #[arg(long, default_value_t = 128)]
    pub seq_len: usize,
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    #[arg(long, default_value_t = 100)]
    pub warmup: usize,
    #[arg(long, default_value = "cosine")]
    pub schedule: ScheduleKind,
    /// Final learning rate of the cosine schedule, as a fraction of --lr.
    #[arg(long, default_value_t = 0.1)]
    pub min_lr_ratio: f64,
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f64,
    /// Global gradient-norm limit (0 disables clipping).
    #[arg(long, default_value_t = 1.0)]
    pub grad_clip: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Steps between validation runs (and checkpoints).
    #[arg(long, default_value_t = 250)]
    pub eval_every: usize,
    /// Validation windows of --seq-len tokens.
    #[arg(long, default_value_t = 64)]
    pub eval_windows: usize,
    /// Dtype of the exported model.safetensors: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub save_dtype: String,
    /// Continue the run in --out from its last checkpoint (with the same settings).
    #[arg(long)]
    #[serde(skip)]
    pub resume: bool,
    /// Stop after this step, checkpointed, as if interrupted; `--resume` continues the run.
    #[arg(long)]
    #[serde(skip)]
    pub stop_after: Option<usize>,
    /// Print one JSON line per evaluation instead of drawing a progress bar.
    #[arg(long)]
    #[serde(skip)]
    pub headless: bool,
}

#[derive(Subcommand)]
pub enum TokenizerCommand {
    /// Train a byte-level BPE tokenizer on text files.
    Train {
        /// Text files to learn from.
        #[arg(long = "input", required = true)]
        inputs: Vec<PathBuf>,
        #[arg(long, default_value_t = 8192)]
        vocab_size: usize,
        /// Where to write tokenizer.json.
        #[arg(long)]
        out: PathBuf,
    },
}

pub fn run_tokenizer(cmd: TokenizerCommand) -> anyhow::Result<()> {
    match cmd {
        TokenizerCommand::Train {
            inputs,
            vocab_size,
            out,
        } => {
            let started = Instant::now();
            let tokenizer = train_byte_level_bpe(&inputs, vocab_size)?;
            tokenizer
                .save(&out, false)
                .map_err(|e| anyhow::anyhow!("writing {}: {e}", out.display()))?;
            eprintln!(
                "wrote {} ({} tokens) in {:.1}s",
                out.display(),
                tokenizer.get_vocab_size(true),
                started.elapsed().as_secs_f64()
            );
            Ok(())
        }
    }
}

/// What `checkpoint/state.json` records besides the tensors.
#[derive(Serialize, Deserialize)]
struct CheckpointState {
    step: usize,
    args: TrainArgs,
    tokens_seen: u64,
}

fn parse_dtype(s: &str) -> anyhow::Result<DType> {
    Ok(match s {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => anyhow::bail!("--save-dtype {other:?}: expected f32, bf16 or f16"),
    })
}

pub fn run_train(args: TrainArgs) -> anyhow::Result<()> {
    let save_dtype = parse_dtype(&args.save_dtype)?;
    anyhow::ensure!(
        args.micro_batch > 0 && args.batch_size > 0,
        "--batch-size and --micro-batch must be positive"
    );
    anyhow::ensure!(
        args.batch_size.is_multiple_of(args.micro_batch),
        "--batch-size ({}) must be a multiple of --micro-batch ({})",
        args.batch_size,
        args.micro_batch
    );
    let spec = ModelSpec::from_config_file(&args.config)?;
    let (tokenizer, eot) = corpus_tokenizer(&args.tokenizer)?;
    anyhow::ensure!(
        tokenizer.get_vocab_size(true) <= spec.vocab_size(),
        "the tokenizer has {} tokens but the model only {}",
        tokenizer.get_vocab_size(true),
        spec.vocab_size()
    );

    let started = Instant::now();
    let train_tokens = corpus_tokens(&args.train, &tokenizer, eot)?;
    let valid_tokens = corpus_tokens(&args.valid, &tokenizer, eot)?;
    let valid = evaluation_windows(&valid_tokens, args.eval_windows, args.seq_len + 1);
    eprintln!(
        "tokenised {} train and {} valid tokens in {:.1}s",
        train_tokens.len(),
        valid_tokens.len(),
        started.elapsed().as_secs_f64()
    );

    let schedule = LrSchedule {
        peak: args.lr,
        warmup_steps: args.warmup,
        total_steps: args.steps,
        kind: args.schedule,
        min_ratio: args.min_lr_ratio,
    };
    let optimizer = AdamWConfig {
        weight_decay: args.weight_decay,
        ..AdamWConfig::default()
    };
    let mut trainer = Trainer::new(
        spec.clone(),
        args.seed,
        schedule,
        optimizer,
        args.grad_clip,
        &Device::Cpu,
    )?;
    let checkpoint = args.out.join("checkpoint");
    let mut tokens_seen = 0u64;
    if args.resume {
        tokens_seen = restore(&mut trainer, &checkpoint, &args)?;
        eprintln!("resumed at step {}", trainer.optimizer.steps());
    } else {
        anyhow::ensure!(
            !checkpoint.join("state.json").exists(),
            "{} already holds a run; pass --resume to continue it or choose another --out",
            args.out.display()
        );
    }
    std::fs::create_dir_all(&args.out)?;
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(args.out.join("train-log.jsonl"))?;

    let first = trainer.optimizer.steps();
    let bar = progress_bar(args.steps as u64, first as u64, args.headless);
    let run_started = Instant::now();
    let mut run_tokens = 0usize;
    let stop = args.stop_after.unwrap_or(args.steps).min(args.steps);
    for step in first..stop {
        let rows = sample_windows(
            &train_tokens,
            args.batch_size,
            args.seq_len + 1,
            args.seed.wrapping_add(step as u64),
        )?;
        let micro: Vec<Vec<Vec<u32>>> = rows.chunks(args.micro_batch).map(<[_]>::to_vec).collect();
        let report = trainer.step(&micro)?;
        anyhow::ensure!(
            report.loss.is_finite(),
            "the loss diverged at step {step}: {}",
            report.loss
        );
        run_tokens += report.tokens;
        tokens_seen += report.tokens as u64;
        let tok_s = run_tokens as f64 / run_started.elapsed().as_secs_f64();
        bar.set_position(step as u64 + 1);
        bar.set_message(format!(
            "loss {:.3}  lr {:.2e}  {:.0} tok/s",
            report.cross_entropy, report.lr, tok_s
        ));
        if (step + 1) % 10 == 0 {
            let mut line = serde_json::to_value(&report)?;
            line["step"] = (step + 1).into();
            line["tokens_per_s"] = tok_s.into();
            writeln!(log, "{line}")?;
        }
        let last = step + 1 == stop;
        if (step + 1) % args.eval_every == 0 || last {
            let valid_loss = trainer.evaluate(&valid, args.micro_batch)?;
            let line = serde_json::json!({
                "step": step + 1,
                "valid_loss": valid_loss,
                "valid_perplexity": valid_loss.exp(),
                "tokens_seen": tokens_seen,
                "tokens_per_s": tok_s,
            });
            writeln!(log, "{line}")?;
            if args.headless {
                println!("{line}");
            } else {
                bar.println(format!(
                    "step {}: valid loss {valid_loss:.4}, perplexity {:.2}, {tokens_seen} tokens seen",
                    step + 1,
                    valid_loss.exp()
                ));
            }
            save(&trainer, &args, &checkpoint, tokens_seen)?;
            save_pretrained(&args.out, &spec, &trainer.varmap, save_dtype, &tokenizer)?;
        }
    }
    bar.finish_and_clear();
    eprintln!(
        "done: {} steps, {tokens_seen} tokens; model in {}",
        trainer.optimizer.steps(),
        args.out.display()
    );
    Ok(())
}

fn progress_bar(total: u64, position: u64, hidden: bool) -> ProgressBar {
    if hidden {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total).with_position(position);
    bar.set_style(
        ProgressStyle::with_template(
            "{elapsed_precise} [{bar:30}] {pos}/{len} steps  {msg}  ETA {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar
}

/// Writes the checkpoint into a fresh directory and swaps it in, so a crash mid-write leaves
/// the previous checkpoint intact.
fn save(trainer: &Trainer, args: &TrainArgs, dir: &Path, tokens_seen: u64) -> anyhow::Result<()> {
    let tmp = dir.with_extension("tmp");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    trainer.varmap.save(tmp.join("model.safetensors"))?;
    candle_core::safetensors::save(
        &trainer.optimizer.state()?,
        tmp.join("optimizer.safetensors"),
    )?;
    let state = CheckpointState {
        step: trainer.optimizer.steps(),
        args: args.clone(),
        tokens_seen,
    };
    std::fs::write(
        tmp.join("state.json"),
        serde_json::to_string_pretty(&state)?,
    )?;
    let old = dir.with_extension("old");
    let _ = std::fs::remove_dir_all(&old);
    if dir.exists() {
        std::fs::rename(dir, &old)?;
    }
    std::fs::rename(&tmp, dir)?;
    let _ = std::fs::remove_dir_all(&old);
    Ok(())
}

fn restore(trainer: &mut Trainer, dir: &Path, args: &TrainArgs) -> anyhow::Result<u64> {
    let state_path = dir.join("state.json");
    let state: CheckpointState = serde_json::from_str(
        &std::fs::read_to_string(&state_path)
            .with_context(|| format!("no checkpoint at {}", dir.display()))?,
    )?;
    // A resumed run must be the same run: every setting that shapes it has to match.
    let (saved, asked) = (
        serde_json::to_value(&state.args)?,
        serde_json::to_value(args)?,
    );
    if let (Some(saved), Some(asked)) = (saved.as_object(), asked.as_object()) {
        let differing: Vec<&String> = saved
            .keys()
            .filter(|k| saved.get(*k) != asked.get(*k))
            .collect();
        anyhow::ensure!(
            differing.is_empty(),
            "--resume with settings that differ from the checkpoint's: {differing:?}"
        );
    }
    trainer.varmap.load(dir.join("model.safetensors"))?;
    let optimizer =
        candle_core::safetensors::load(dir.join("optimizer.safetensors"), &Device::Cpu)?;
    trainer.optimizer.load_state(&optimizer)?;
    anyhow::ensure!(
        trainer.optimizer.steps() == state.step,
        "checkpoint is inconsistent: state.json says step {}, the optimiser {}",
        state.step,
        trainer.optimizer.steps()
    );
    Ok(state.tokens_seen)
}

/// A tokenizer for corpus text and its end-of-text id, which separates documents.
pub fn corpus_tokenizer(path: &Path) -> anyhow::Result<(tokenizers::Tokenizer, u32)> {
    let tokenizer = tokenizers::Tokenizer::from_file(path)
        .map_err(|e| anyhow::anyhow!("loading {}: {e}", path.display()))?;
    let eot = tokenizer
        .token_to_id(END_OF_TEXT)
        .with_context(|| format!("{} has no {END_OF_TEXT} token", path.display()))?;
    Ok((tokenizer, eot))
}
