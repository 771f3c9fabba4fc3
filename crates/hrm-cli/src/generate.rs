//! `hrm generate` and `hrm score`: one-shot use of the engine from the command line.

use clap::Args;
use hrm_model::GenerateParams;

use crate::ModelArgs;

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompts; each gets its own completion.
    #[arg(required = true)]
    prompts: Vec<String>,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 decodes greedily.
    #[arg(long, default_value_t = 0.7)]
    temperature: f64,
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    #[arg(long)]
    seed: Option<u64>,
    /// Stop string (repeatable); the output ends before it.
    #[arg(long)]
    stop: Vec<String>,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 8)]
    max_batch_size: usize,
}

#[derive(Args)]
pub struct ScoreArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The context the continuation is scored against.
    #[arg(long)]
    context: String,
    /// Continuations to score (repeatable).
    #[arg(long, required = true)]
    continuation: Vec<String>,
}

pub fn run_generate(args: GenerateArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        (0.0..=2.0).contains(&args.temperature),
        "--temperature must be between 0 and 2, got {}",
        args.temperature
    );
    anyhow::ensure!(
        args.top_p > 0.0 && args.top_p <= 1.0,
        "--top-p must be above 0 and at most 1, got {}",
        args.top_p
    );
    let engine = args.model.load_engine()?;
    let params = GenerateParams {
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        seed: args.seed,
        stop: args.stop,
    };
    let started = std::time::Instant::now();
    let outputs = engine.generate(&args.prompts, &params, args.max_batch_size)?;
    let generated: usize = outputs.iter().map(|o| o.completion_tokens).sum();
    for (prompt, out) in args.prompts.iter().zip(&outputs) {
        println!(
            "{}",
            serde_json::json!({
                "prompt": prompt,
                "completion": out.text,
                "prompt_tokens": out.prompt_tokens,
                "completion_tokens": out.completion_tokens,
                "finish_reason": out.finish_reason,
            })
        );
    }
    let secs = started.elapsed().as_secs_f64();
    tracing::info!(
        generated,
        seconds = secs,
        tokens_per_second = generated as f64 / secs,
        "done"
    );
    Ok(())
}

pub fn run_score(args: ScoreArgs) -> anyhow::Result<()> {
    let engine = args.model.load_engine()?;
    let pairs: Vec<(String, String)> = args
        .continuation
        .iter()
        .map(|c| (args.context.clone(), c.clone()))
        .collect();
    for ((_, continuation), scored) in pairs.iter().zip(engine.loglikelihood(&pairs, 8)?) {
        println!(
            "{}",
            serde_json::json!({
                "continuation": continuation,
                "logprob": scored.logprob,
                "is_greedy": scored.is_greedy,
                "tokens": scored.tokens.len(),
            })
        );
    }
    Ok(())
}
