//! `hrm bench model`: prefill and decode throughput and peak memory of our engine, side by side
//! with transformers on the same weights, in one run.
//!
//! Every measurement runs in a fresh child process (ours: `hrm bench model-run`; transformers:
//! `benches/transformers_model.py`), so peak RSS belongs to that run alone. Both sides get the
//! same token ids, prefill the whole batch at once, then decode greedily, one token per sequence
//! per step, with a KV cache, for the same number of steps (EOS does not stop the run). After one
//! warm-up pass each side times `--passes` passes, each from a fresh cache, and reports the
//! median prefill and the median decode: a single timed batch-8 prefill of `models/sample` moved
//! between 6,600 and 9,000 tok/s from run to run on a shared 2-core VM (an Intel Xeon of family
//! 6 model 207, AVX-512).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use candle_core::{DType, Device, Tensor};
use clap::Args;
use hrm_model::{ForwardBatch, Logits, SeqCache};
use serde::{Deserialize, Serialize};

use super::{PairedFigure, Sides, median, side_by_side};

#[derive(Args)]
pub struct ModelBenchArgs {
    /// Checkpoints to measure (repeatable): HF directories or .gguf files.
    #[arg(long = "model", required = true)]
    models: Vec<PathBuf>,
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    batch_sizes: Vec<usize>,
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 32)]
    decode_tokens: usize,
    /// Timed passes in each process, after one warm-up: each side reports the median.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    passes: u32,
    #[command(flatten)]
    sides: Sides,
    /// Also write the Markdown table here.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
pub struct RunArgs {
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    batch: usize,
    #[arg(long)]
    prompt_tokens: usize,
    #[arg(long)]
    decode_tokens: usize,
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    passes: u32,
}

/// One measurement; the same JSON comes from `benches/transformers_model.py`.
#[derive(Debug, Serialize, Deserialize)]
pub struct Measurement {
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
    pub peak_rss_mb: f64,
}

pub fn run(args: ModelBenchArgs) -> anyhow::Result<()> {
    let mut table = String::new();
    writeln!(
        table,
        "| model | batch | prefill tok/s hrm | transformers | ratio | decode tok/s hrm | transformers | ratio | peak RSS MB hrm | transformers |"
    )?;
    writeln!(table, "|---|---|---|---|---|---|---|---|---|---|")?;
    for model in &args.models {
        let name = model
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        for &batch in &args.batch_sizes {
            eprintln!("measuring {name} at batch {batch}...");
            let shape = [
                "--model".to_string(),
                model.display().to_string(),
                "--batch".into(),
                batch.to_string(),
                "--prompt-tokens".into(),
                args.prompt_tokens.to_string(),
                "--decode-tokens".into(),
                args.decode_tokens.to_string(),
                "--passes".into(),
                args.passes.to_string(),
            ];
            let rounds: Vec<(Measurement, _)> = side_by_side(
                "model-run",
                ("transformers_model.py", &["run"]),
                &shape,
                &args.sides,
            )
            .with_context(|| format!("measuring {name}"))?;
            let prefill = PairedFigure::of(&rounds, |m| m.prefill_tokens_per_s);
            let decode = PairedFigure::of(&rounds, |m| m.decode_tokens_per_s);
            let rss = PairedFigure::of(&rounds, |m| m.peak_rss_mb);
            writeln!(
                table,
                "| {name} | {batch} | {:.1} | {} | {} | {:.1} | {} | {} | {:.0} | {} |",
                prefill.ours,
                prefill.theirs_cell(1),
                prefill.ratio_cell(),
                decode.ours,
                decode.theirs_cell(1),
                decode.ratio_cell(),
                rss.ours,
                rss.theirs_cell(1),
            )?;
        }
    }
    writeln!(
        table,
        "\n{} prompt tokens per sequence, {} decode steps, {} CPU threads, f32 activations; each \
         side's figures the medians of {} timed passes in each process; {}.",
        args.prompt_tokens,
        args.decode_tokens,
        args.sides.threads,
        args.passes,
        args.sides.note("hrm / transformers")
    )?;
    print!("{table}");
    if let Some(out) = &args.out {
        std::fs::write(out, &table).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

/// The token ids both sides feed: a fixed pseudo-random walk over the vocabulary, so that
/// neither side can exploit repetition.
pub fn bench_ids(batch: usize, len: usize, vocab: usize) -> Vec<Vec<u32>> {
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    (0..batch)
        .map(|_| {
            (0..len)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((state >> 33) % vocab as u64) as u32
                })
                .collect()
        })
        .collect()
}

pub fn run_one(args: RunArgs) -> anyhow::Result<()> {
    let loaded = hrm_model::load_model(&args.model, None, &Device::Cpu, DType::F32)?;
    let model = loaded.model;
    let info = model.info().clone();
    let vocab = info.vocab_size.min(loaded.tokenizer.vocab_size());
    let prompts = bench_ids(args.batch, args.prompt_tokens, vocab);
    let block = if info.prefix_lm {
        args.prompt_tokens
    } else {
        0
    };
    let blocks = vec![block; args.batch];

    let decode = |steps: usize| -> anyhow::Result<(f64, f64)> {
        let mut caches: Vec<SeqCache> = (0..args.batch)
            .map(|_| SeqCache::for_model(&info).with_decode_room(steps))
            .collect();
        let started = Instant::now();
        let mut batch = ForwardBatch::new(
            &prompts,
            &blocks,
            caches.iter_mut().collect(),
            Logits::Last,
            &info.device,
            info.dtype,
        )?;
        let mut next = greedy_tokens(model.forward(&mut batch)?.logits)?;
        drop(batch);
        let prefill = started.elapsed().as_secs_f64();
        let started = Instant::now();
        for _ in 0..steps {
            let rows: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
            let zeros = vec![0; args.batch];
            let mut batch = ForwardBatch::new(
                &rows,
                &zeros,
                caches.iter_mut().collect(),
                Logits::Last,
                &info.device,
                info.dtype,
            )?;
            next = greedy_tokens(model.forward(&mut batch)?.logits)?;
        }
        Ok((prefill, started.elapsed().as_secs_f64()))
    };
    decode(2)?; // warm-up: allocator and thread pool
    let passes = (0..args.passes)
        .map(|_| decode(args.decode_tokens))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let (prefill, decode): (Vec<f64>, Vec<f64>) = passes.into_iter().unzip();
    let (prefill_s, decode_s) = (median(&prefill), median(&decode));
    let result = Measurement {
        prefill_tokens_per_s: (args.batch * args.prompt_tokens) as f64 / prefill_s,
        decode_tokens_per_s: (args.batch * args.decode_tokens) as f64 / decode_s,
        peak_rss_mb: peak_rss_mb()?,
    };
    println!("{}", serde_json::to_string(&result)?);
    Ok(())
}

/// Each sequence's next token from the last position's logits (`[batch, 1, vocab]`), chosen as
/// `hrm serve` chooses a greedy one.
fn greedy_tokens(logits: Tensor) -> anyhow::Result<Vec<u32>> {
    let logits = logits.squeeze(1)?;
    (0..logits.dim(0)?)
        .map(|i| Ok(hrm_model::largest_logit(&logits.get(i)?)?))
        .collect()
}

fn peak_rss_mb() -> anyhow::Result<f64> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmHWM in /proc/self/status")?;
    Ok(kb / 1024.0)
}
