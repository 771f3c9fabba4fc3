//! Hub benchmarks (not tests): a load of simulated workers against a running hub, and the
//! time each aggregation rule takes next to the memory-bandwidth bound of reading its input.

use super::Latencies;
use anyhow::{Context, Result};
use clap::Args;
use hrm_hub::rules::{self, Rule, Update};
use hrm_wire::update::{Encoding, encode_update, read_checkpoint};
use hrm_wire::{GradientUpload, Hardware, HubClient};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct LoadArgs {
    /// The hub to load (start it with the storage to measure, e.g. PostgreSQL + Redis).
    #[arg(long, default_value = "http://127.0.0.1:8090")]
    url: String,
    /// Simulated workers; each registers, then runs the worker loop without training.
    #[arg(long, default_value_t = 1000)]
    workers: usize,
    /// Loop iterations per worker: lease, upload URL, PUT, upload, worker stats.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Workers in flight at once.
    #[arg(long, default_value_t = 200)]
    concurrency: usize,
}

/// One request's outcome: its route, latency, and whether it failed.
struct Sample {
    route: &'static str,
    latency: Duration,
    ok: bool,
}

async fn timed<T, E: std::fmt::Display>(
    samples: &mut Vec<Sample>,
    route: &'static str,
    call: impl std::future::Future<Output = Result<T, E>>,
) -> Option<T> {
    let start = Instant::now();
    let result = call.await;
    let ok = result.is_ok();
    if let Err(e) = &result {
        eprintln!("{route}: {e}");
    }
    samples.push(Sample {
        route,
        latency: start.elapsed(),
        ok,
    });
    result.ok()
}

async fn simulate(url: String, index: usize, rounds: usize) -> Result<Vec<Sample>> {
    let client = HubClient::new(
        &url,
        format!("bench-worker-{index:06}-{}", uuid::Uuid::new_v4().simple()),
    )?;
    let mut samples = Vec::new();
    let Some(registered) = timed(
        &mut samples,
        "register",
        client.register(
            Some(&format!("bench-{index}-{}", uuid::Uuid::new_v4().simple())),
            None,
        ),
    )
    .await
    else {
        return Ok(samples);
    };
    let worker = registered.worker_id;
    timed(&mut samples, "login", client.login()).await;
    let mut schema_cache = None;
    for _ in 0..rounds {
        let Some(Some(batch)) = timed(
            &mut samples,
            "batch/request",
            client.request_batch(worker, Hardware::default()),
        )
        .await
        else {
            break;
        };
        if schema_cache
            .as_ref()
            .is_none_or(|(v, _)| *v != batch.model_version)
        {
            let bytes = timed(
                &mut samples,
                "model/download",
                client.download(&format!("/api/v1/model/download/{}", batch.model_version)),
            )
            .await;
            let Some(bytes) = bytes else { break };
            let (schema, _) = read_checkpoint(&bytes).context("checkpoint")?;
            schema_cache = Some((batch.model_version.clone(), schema));
        }
        let (_, schema) = schema_cache.as_ref().expect("set above");
        let update: Vec<f32> = (0..schema.num_parameters())
            .map(|i| ((i + index) % 13) as f32 * 1e-6)
            .collect();
        let file = encode_update(schema, &update, &batch.model_version, Encoding::Dense);
        let Some(target) = timed(
            &mut samples,
            "gradients/upload-url",
            client.upload_target(worker, batch.batch_id),
        )
        .await
        else {
            break;
        };
        timed(
            &mut samples,
            "gradients/blob",
            client.put_update(&target, file),
        )
        .await;
        let upload = GradientUpload {
            worker_id: worker,
            batch_id: batch.batch_id,
            model_version: batch.model_version.clone(),
            gradients_url: target.gradients_url,
            loss: 3.0,
            num_samples: batch.num_samples,
        };
        timed(
            &mut samples,
            "gradients/upload",
            client.upload_gradients(&upload),
        )
        .await;
        timed(&mut samples, "worker/stats", client.worker_stats()).await;
    }
    Ok(samples)
}

pub fn run_load(args: LoadArgs) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        let started = Instant::now();
        let limit = Arc::new(tokio::sync::Semaphore::new(args.concurrency.max(1)));
        let mut tasks = Vec::new();
        for index in 0..args.workers {
            let permit = limit.clone().acquire_owned().await?;
            let url = args.url.clone();
            tasks.push(tokio::spawn(async move {
                let result = simulate(url, index, args.rounds).await;
                drop(permit);
                result
            }));
        }
        let mut samples = Vec::new();
        for task in tasks {
            samples.extend(task.await??);
        }
        let elapsed = started.elapsed();
        let errors = samples.iter().filter(|s| !s.ok).count();
        let mut routes: Vec<&str> = samples.iter().map(|s| s.route).collect();
        routes.sort();
        routes.dedup();
        println!(
            "{} workers x {} rounds, {} requests in {:.2}s: {:.0} req/s, {} errors",
            args.workers,
            args.rounds,
            samples.len(),
            elapsed.as_secs_f64(),
            samples.len() as f64 / elapsed.as_secs_f64(),
            errors
        );
        println!(
            "{:<22} {:>8} {:>10} {:>10} {:>7}",
            "route", "requests", "p50 ms", "p99 ms", "errors"
        );
        for route in routes.into_iter().chain(["all"]) {
            let latencies = Latencies::of(
                samples
                    .iter()
                    .filter(|s| route == "all" || s.route == route)
                    .map(|s| s.latency),
            );
            let failed = samples
                .iter()
                .filter(|s| (route == "all" || s.route == route) && !s.ok)
                .count();
            println!(
                "{:<22} {:>8} {:>10.2} {:>10.2} {:>7}",
                route,
                latencies.len(),
                latencies.percentile_ms(0.5).unwrap_or(f64::NAN),
                latencies.percentile_ms(0.99).unwrap_or(f64::NAN),
                failed
            );
        }
        anyhow::ensure!(errors == 0, "{errors} requests failed");
        Ok(())
    })
}

#[derive(Args)]
pub struct AggregateArgs {
    /// Parameters per update.
    #[arg(long, default_value_t = 10_000_000)]
    params: usize,
    /// Updates combined.
    #[arg(long, default_value_t = 100)]
    updates: usize,
}

pub fn run_aggregate(args: AggregateArgs) -> Result<()> {
    // Deterministic pseudo-random updates (xorshift), no two alike.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let data: Vec<Vec<f32>> = (0..args.updates)
        .map(|_| (0..args.params).map(|_| next() * 1e-3).collect())
        .collect();
    let updates: Vec<Update<'_>> = data
        .iter()
        .map(|v| Update {
            values: v,
            num_samples: 512,
        })
        .collect();
    let bytes = (args.params * args.updates * 4) as f64;

    // The bound: one pass that reads every input byte, as fast as this machine reads memory.
    let start = Instant::now();
    let mut sink = 0f32;
    for values in &data {
        sink += values.iter().copied().fold(0f32, |a, b| a.max(b));
    }
    let read_once = start.elapsed();
    std::hint::black_box(sink);
    println!(
        "{} updates x {} parameters = {:.2} GB of f32 input",
        args.updates,
        args.params,
        bytes / 1e9
    );
    println!(
        "{:<14} {:>9} {:>12} {:>14}",
        "rule", "seconds", "GB/s read", "x read bound"
    );
    println!(
        "{:<14} {:>9.3} {:>12.2} {:>14.2}",
        "read once",
        read_once.as_secs_f64(),
        bytes / read_once.as_secs_f64() / 1e9,
        1.0
    );
    let cases: [(&str, Option<Rule>); 6] = [
        ("outlier screen", None),
        ("mean", Some(Rule::Mean)),
        (
            "krum",
            Some(Rule::Krum {
                byzantine: args.updates / 4,
            }),
        ),
        (
            "multi-krum",
            Some(Rule::MultiKrum {
                byzantine: args.updates / 4,
                select: args.updates / 2,
            }),
        ),
        (
            "trimmed-mean",
            Some(Rule::TrimmedMean { trim_fraction: 0.1 }),
        ),
        ("median", Some(Rule::Median)),
    ];
    for (name, rule) in cases {
        let start = Instant::now();
        match rule {
            None => {
                std::hint::black_box(rules::outliers(&updates, 3.0));
            }
            Some(rule) => {
                std::hint::black_box(
                    rules::combine(rule, &updates).map_err(|e| anyhow::anyhow!("{e}"))?,
                );
            }
        }
        let took = start.elapsed().as_secs_f64();
        println!(
            "{:<14} {:>9.3} {:>12.2} {:>14.2}",
            name,
            took,
            bytes / took / 1e9,
            took / read_once.as_secs_f64()
        );
    }
    Ok(())
}
