//! `hrm bench train`: training tokens/s of our trainer next to PyTorch (transformers' model,
//! `torch.optim.AdamW`) on the same config and batch shape, in one run.
//!
//! Each side runs in its own process: one warm-up step, then `--steps` timed optimiser steps of
//! `--batch-size` sequences of `--seq-len` tokens (random ids), with gradient clipping. For
//! `hrm_text_moe`, transformers has no model class; its column then runs `hrm_text` with
//! transformers' own `MixtralSparseMoeBlock` as each MLP (the same routing, expert layout and
//! load-balancing loss: the same model), or with `--moe-reference dense` the dense `hrm_text` of
//! the same active size (half the expert weights, no routing), and says which.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use candle_core::Device;
use clap::{Args, ValueEnum};
use hrm_model::ModelSpec;
use hrm_model::train::{AdamWConfig, LrSchedule, ScheduleKind, Trainer};
use serde::{Deserialize, Serialize};

use super::model::bench_ids;
use super::{PairedFigure, Sides, side_by_side};

#[derive(Args)]
pub struct TrainBenchArgs {
    /// Model configs to measure (repeatable).
    #[arg(long = "config", required = true)]
    configs: Vec<PathBuf>,
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    #[arg(long, default_value_t = 8)]
    micro_batch: usize,
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Timed optimiser steps (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// What the PyTorch side trains for a mixture-of-experts config: the same model, with
    /// transformers' Mixtral MoE block as each MLP, or a dense model of the same active size.
    #[arg(long, value_enum, default_value_t = MoeReference::Mixtral)]
    moe_reference: MoeReference,
    #[command(flatten)]
    sides: Sides,
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum)]
enum MoeReference {
    Mixtral,
    Dense,
}

#[derive(Args)]
pub struct TrainRunArgs {
    #[arg(long)]
    config: PathBuf,
    #[arg(long)]
    batch_size: usize,
    #[arg(long)]
    micro_batch: usize,
    #[arg(long)]
    seq_len: usize,
    #[arg(long)]
    steps: usize,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct TrainMeasurement {
    pub tokens_per_s: f64,
    #[serde(default)]
    pub note: Option<String>,
}

pub fn run(args: TrainBenchArgs) -> anyhow::Result<()> {
    let mut table = String::from(
        "| config | hrm tok/s | PyTorch tok/s | ratio | note |\n|---|---|---|---|---|\n",
    );
    for config in &args.configs {
        let name = config
            .file_stem()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        eprintln!("measuring training of {name}...");
        let shape = [
            "--config".to_string(),
            config.display().to_string(),
            "--batch-size".into(),
            args.batch_size.to_string(),
            "--micro-batch".into(),
            args.micro_batch.to_string(),
            "--seq-len".into(),
            args.seq_len.to_string(),
            "--steps".into(),
            args.steps.to_string(),
        ];
        let moe_reference = args
            .moe_reference
            .to_possible_value()
            .expect("no reference is skipped");
        let rounds: Vec<(TrainMeasurement, _)> = side_by_side(
            "train-run",
            (
                "transformers_train.py",
                &["--moe-reference", moe_reference.get_name()],
            ),
            &shape,
            &args.sides,
        )
        .with_context(|| format!("measuring {name}"))?;
        let speed = PairedFigure::of(&rounds, |m| m.tokens_per_s);
        let note = rounds
            .into_iter()
            .find_map(|(_, theirs)| theirs.and_then(|t| t.note))
            .unwrap_or_default();
        writeln!(
            table,
            "| {name} | {:.0} | {} | {} | {note} |",
            speed.ours,
            speed.theirs_cell(0),
            speed.ratio_cell(),
        )?;
    }
    writeln!(
        table,
        "\n{} sequences × {} tokens per step ({} per micro-batch), {} timed steps, {} threads, f32; {}.",
        args.batch_size,
        args.seq_len,
        args.micro_batch,
        args.steps,
        args.sides.threads,
        args.sides.note("hrm / PyTorch")
    )?;
    print!("{table}");
    if let Some(out) = &args.out {
        std::fs::write(out, &table)?;
    }
    Ok(())
}

pub fn run_one(args: TrainRunArgs) -> anyhow::Result<()> {
    let spec = ModelSpec::from_config_file(&args.config)?;
    let schedule = LrSchedule {
        peak: 1e-3,
        warmup_steps: 1,
        total_steps: args.steps + 1,
        kind: ScheduleKind::Constant,
        min_ratio: 1.0,
    };
    let mut trainer = Trainer::new(
        spec.clone(),
        0,
        schedule,
        AdamWConfig::default(),
        1.0,
        &Device::Cpu,
    )?;
    let rows = bench_ids(args.batch_size, args.seq_len + 1, spec.vocab_size());
    let micro: Vec<Vec<Vec<u32>>> = rows
        .chunks(args.micro_batch.max(1))
        .map(<[_]>::to_vec)
        .collect();
    trainer.step(&micro)?;
    let started = Instant::now();
    for _ in 0..args.steps {
        trainer.step(&micro)?;
    }
    let tokens = (args.steps * args.batch_size * args.seq_len) as f64;
    let result = TrainMeasurement {
        tokens_per_s: tokens / started.elapsed().as_secs_f64(),
        note: None,
    };
    println!("{}", serde_json::to_string(&result)?);
    Ok(())
}
