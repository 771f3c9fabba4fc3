//! `hrm bench ab`: one workload against several servers, one after the other, and a Markdown
//! report: latency percentiles, time to first token, output tokens/s, requests/s, errors,
//! greedy-output agreement and log-likelihood agreement between targets, with PNG charts of the
//! latency and throughput figures.
//!
//! Each target kind is an adapter from the workload's `/generate`-style fields to the server's
//! own contract, following the specification's normalisation (`max_tokens` is TGI's
//! `max_new_tokens`; `temperature` and `top_p` keep their names):
//! - `hrm=URL`: our `POST /generate_stream` (server-sent events) and `POST /loglikelihood`;
//! - `openai=URL,model=NAME`: `POST /v1/completions` with `stream: true` (a server that answers
//!   with plain JSON instead is read as such, with no time to first token); it scores with
//!   `echo` and `logprobs`, summing the tokens whose `text_offset` lies in the continuation;
//! - `tgi=URL`: `POST /generate_stream` with `inputs` and `parameters`, one input per request;
//!   greedy requests omit `temperature` 0 and `top_p` 1 and send `do_sample: false`; token
//!   counts come from `details`. TGI cannot score text.

use super::{Latencies, charts};
use anyhow::{Context, Result, bail};
use clap::Args;
use eventsource_stream::{Event, Eventsource};
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct AbArgs {
    /// A server to measure: `hrm=URL`, `openai=URL,model=NAME` or `tgi=URL`; add `,name=LABEL`
    /// to tell two of a kind apart. Repeat for each target.
    #[arg(long = "target", required = true, value_parser = parse_target)]
    targets: Vec<Target>,
    /// JSON-lines workload: `{"prompt": "...", "max_tokens": 32, "temperature": 0, "top_p": 1}`;
    /// a line with `"continuation"` is also scored where targets can score.
    #[arg(long)]
    prompts: PathBuf,
    /// Requests in flight at once, per target.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Requests per target (default: one pass over the prompts).
    #[arg(long, conflicts_with = "duration")]
    requests: Option<usize>,
    /// Seconds per target instead of a request count.
    #[arg(long)]
    duration: Option<f64>,
    /// `max_tokens` for lines that do not set it.
    #[arg(long, default_value_t = 32)]
    max_tokens: u32,
    /// Directory for report.md and results.json.
    #[arg(long, default_value = "bench-out/ab")]
    out: PathBuf,
    /// Bearer key sent to every target (or HRM_BENCH_API_KEY).
    #[arg(long, env = "HRM_BENCH_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
enum Kind {
    Hrm,
    OpenAi { model: String },
    Tgi,
}

#[derive(Clone, Debug)]
pub struct Target {
    name: String,
    kind: Kind,
    url: String,
}

fn parse_target(text: &str) -> Result<Target, String> {
    let mut parts = text.split(',');
    let (kind, url) = parts
        .next()
        .and_then(|p| p.split_once('='))
        .ok_or_else(|| format!("{text:?}: expected KIND=URL, e.g. hrm=http://127.0.0.1:8000"))?;
    let mut options = BTreeMap::new();
    for part in parts {
        let (key, value) = part
            .split_once('=')
            .ok_or_else(|| format!("{text:?}: option {part:?} is not KEY=VALUE"))?;
        options.insert(key.trim(), value.trim().to_string());
    }
    let kind = match kind.trim() {
        "hrm" => Kind::Hrm,
        "tgi" => Kind::Tgi,
        "openai" => Kind::OpenAi {
            model: options
                .remove("model")
                .ok_or_else(|| format!("{text:?}: an openai target needs model=NAME"))?,
        },
        other => {
            return Err(format!(
                "unknown target kind {other:?}: use hrm, openai or tgi"
            ));
        }
    };
    let name = options.remove("name").unwrap_or_else(|| match &kind {
        Kind::Hrm => "hrm".into(),
        Kind::Tgi => "tgi".into(),
        Kind::OpenAi { model } => format!("openai:{model}"),
    });
    if let Some(extra) = options.keys().next() {
        return Err(format!("{text:?}: unknown option {extra:?}"));
    }
    reqwest::Url::parse(url).map_err(|e| format!("{text:?}: bad URL: {e}"))?;
    Ok(Target {
        name,
        kind,
        url: url.trim_end_matches('/').to_string(),
    })
}

#[derive(Clone, Debug, Deserialize)]
struct Prompt {
    prompt: String,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    continuation: Option<String>,
}

impl Prompt {
    fn temperature(&self) -> f64 {
        self.temperature.unwrap_or(0.0)
    }
    fn top_p(&self) -> f64 {
        self.top_p.unwrap_or(1.0)
    }
}

/// One request's outcome.
#[derive(Clone, Debug, Default)]
struct Outcome {
    prompt: usize,
    error: Option<String>,
    latency: Duration,
    first_token: Option<Duration>,
    output_tokens: u64,
    text: String,
}

/// The request body a target gets for `prompt` (TGI's quirks included).
fn generate_body(target: &Target, prompt: &Prompt, max_tokens: u32) -> Value {
    match &target.kind {
        Kind::Hrm => json!({
            "prompts": [prompt.prompt], "max_tokens": max_tokens,
            "temperature": prompt.temperature(), "top_p": prompt.top_p(),
        }),
        Kind::OpenAi { model } => json!({
            "model": model, "prompt": prompt.prompt, "max_tokens": max_tokens,
            "temperature": prompt.temperature(), "top_p": prompt.top_p(),
            "stream": true, "stream_options": {"include_usage": true},
        }),
        Kind::Tgi => {
            let mut parameters = json!({"max_new_tokens": max_tokens, "details": true});
            let greedy = prompt.temperature() == 0.0;
            parameters["do_sample"] = (!greedy).into();
            if !greedy {
                parameters["temperature"] = prompt.temperature().into();
            }
            if prompt.top_p() < 1.0 {
                parameters["top_p"] = prompt.top_p().into();
            }
            json!({"inputs": prompt.prompt, "parameters": parameters})
        }
    }
}

fn generate_path(target: &Target) -> &'static str {
    match target.kind {
        Kind::Hrm | Kind::Tgi => "/generate_stream",
        Kind::OpenAi { .. } => "/v1/completions",
    }
}

/// What one event adds to the outcome; true when the stream is complete.
fn read_event(kind: &Kind, event: &str, data: &str, out: &mut Outcome) -> Result<bool> {
    if data == "[DONE]" {
        return Ok(true);
    }
    let value: Value = serde_json::from_str(data).context("an event that is not JSON")?;
    match kind {
        Kind::Hrm => match event {
            "token" => Ok(false),
            "done" => {
                out.text = value["completions"][0].as_str().unwrap_or_default().into();
                out.output_tokens = value["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                Ok(true)
            }
            _ => bail!("{}", value["error"]["message"].as_str().unwrap_or(data)),
        },
        Kind::OpenAi { .. } => {
            if let Some(error) = value.get("error") {
                bail!("{}", error["message"].as_str().unwrap_or(data));
            }
            if let Some(text) = value["choices"][0]["text"].as_str() {
                out.text.push_str(text);
                out.output_tokens += 1;
            }
            if let Some(tokens) = value["usage"]["completion_tokens"].as_u64() {
                out.output_tokens = tokens;
            }
            Ok(false)
        }
        Kind::Tgi => {
            if let Some(error) = value.get("error") {
                bail!("{}", error.as_str().unwrap_or(data));
            }
            out.output_tokens += 1;
            if let Some(text) = value["generated_text"].as_str() {
                out.text = text.to_string();
                if let Some(n) = value["details"]["generated_tokens"].as_u64() {
                    out.output_tokens = n;
                }
                return Ok(true);
            }
            Ok(false)
        }
    }
}

async fn generate(
    http: &reqwest::Client,
    target: &Target,
    prompt: &Prompt,
    max_tokens: u32,
    key: Option<&str>,
) -> Result<Outcome> {
    let started = Instant::now();
    let mut request = http
        .post(format!("{}{}", target.url, generate_path(target)))
        .json(&generate_body(target, prompt, max_tokens));
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await?;
    let status = response.status();
    let mut out = Outcome::default();
    if !status.is_success() {
        let body = read_capped(response).await.unwrap_or_default();
        bail!("{status}: {}", String::from_utf8_lossy(&body));
    }
    let streamed = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    if !streamed {
        // An OpenAI-compatible server without streaming: one JSON answer.
        let value: Value = serde_json::from_slice(&read_capped(response).await?)?;
        out.text = value["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .into();
        out.output_tokens = value["usage"]["completion_tokens"].as_u64().unwrap_or(0);
        out.latency = started.elapsed();
        return Ok(out);
    }
    let mut events = capped(response.bytes_stream(), MAX_RESPONSE_BYTES).eventsource();
    while let Some(event) = events.next().await {
        let Event { event, data, .. } = event.context("reading the event stream")?;
        if out.first_token.is_none() && event != "done" && data != "[DONE]" {
            out.first_token = Some(started.elapsed());
        }
        if read_event(&target.kind, &event, &data, &mut out)? {
            break;
        }
    }
    out.latency = started.elapsed();
    Ok(out)
}

/// The most bytes read from one response: a target that streams without end fails its request
/// instead of filling the benchmark's memory.
const MAX_RESPONSE_BYTES: usize = 64 << 20;

/// `chunks` until `limit` bytes in all, then an error.
fn capped<B: AsRef<[u8]>, E: std::error::Error + Send + Sync + 'static>(
    chunks: impl futures::Stream<Item = Result<B, E>>,
    limit: usize,
) -> impl futures::Stream<Item = Result<B, std::io::Error>> {
    let mut seen = 0usize;
    chunks.map(move |chunk| {
        let chunk = chunk.map_err(std::io::Error::other)?;
        seen += chunk.as_ref().len();
        if seen > limit {
            return Err(std::io::Error::other(format!(
                "the response is longer than {limit} bytes"
            )));
        }
        Ok(chunk)
    })
}

/// A whole response body, at most [`MAX_RESPONSE_BYTES`].
async fn read_capped(response: reqwest::Response) -> Result<Vec<u8>> {
    let mut body = Vec::new();
    let mut chunks = std::pin::pin!(capped(response.bytes_stream(), MAX_RESPONSE_BYTES));
    while let Some(chunk) = chunks.next().await {
        body.extend_from_slice(&chunk?);
    }
    Ok(body)
}

/// Σ log p(continuation | prompt), where the target can score; `None` where it cannot.
async fn loglikelihood(
    http: &reqwest::Client,
    target: &Target,
    prompt: &str,
    continuation: &str,
    key: Option<&str>,
) -> Result<Option<f64>> {
    let (path, body) = match &target.kind {
        Kind::Tgi => return Ok(None),
        Kind::Hrm => (
            "/loglikelihood",
            json!({"prompts": [prompt], "continuations": [continuation]}),
        ),
        Kind::OpenAi { model } => (
            "/v1/completions",
            json!({"model": model, "prompt": format!("{prompt}{continuation}"), "max_tokens": 0,
                   "echo": true, "logprobs": 1, "temperature": 0}),
        ),
    };
    let mut request = http.post(format!("{}{path}", target.url)).json(&body);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await?;
    let status = response.status();
    let value: Value = serde_json::from_slice(&read_capped(response).await?)?;
    if !status.is_success() {
        bail!("{status}: {value}");
    }
    Ok(Some(match target.kind {
        Kind::Hrm => value["ll"][0].as_f64().context("no ll in the answer")?,
        _ => {
            let logprobs = &value["choices"][0]["logprobs"];
            let offsets = logprobs["text_offset"]
                .as_array()
                .context("no text_offset")?;
            let values = logprobs["token_logprobs"]
                .as_array()
                .context("no token_logprobs")?;
            offsets
                .iter()
                .zip(values)
                .filter(|(o, _)| o.as_u64().is_some_and(|o| o as usize >= prompt.len()))
                .map(|(_, v)| v.as_f64().unwrap_or(0.0))
                .sum()
        }
    }))
}

/// The measurements of one target.
struct TargetRun {
    target: Target,
    outcomes: Vec<Outcome>,
    wall: Duration,
    loglikelihoods: BTreeMap<usize, f64>,
}

async fn run_target(
    args: &AbArgs,
    target: &Target,
    prompts: &Arc<Vec<Prompt>>,
    http: &reqwest::Client,
) -> Result<TargetRun> {
    let count = args.requests.unwrap_or(prompts.len());
    let deadline = args
        .duration
        .map(|s| Instant::now() + Duration::from_secs_f64(s));
    let bar = match deadline {
        Some(_) => ProgressBar::new_spinner(),
        None => ProgressBar::new(count as u64),
    };
    bar.set_style(
        ProgressStyle::with_template("{prefix:>16} {elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            .expect("valid template"),
    );
    bar.set_prefix(target.name.clone());
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..args.concurrency.max(1) {
        let (next, prompts, http, target, bar) = (
            next.clone(),
            prompts.clone(),
            http.clone(),
            target.clone(),
            bar.clone(),
        );
        let key = args.api_key.clone();
        let default_max = args.max_tokens;
        tasks.push(tokio::spawn(async move {
            let mut outcomes = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let over = match deadline {
                    Some(d) => Instant::now() >= d,
                    None => i >= count,
                };
                if over {
                    return outcomes;
                }
                let prompt = &prompts[i % prompts.len()];
                let max_tokens = prompt.max_tokens.unwrap_or(default_max);
                let began = Instant::now();
                let mut outcome = generate(&http, &target, prompt, max_tokens, key.as_deref())
                    .await
                    .unwrap_or_else(|e| Outcome {
                        error: Some(format!("{e:#}")),
                        latency: began.elapsed(),
                        ..Default::default()
                    });
                outcome.prompt = i % prompts.len();
                if let Some(e) = &outcome.error {
                    bar.set_message(format!("error: {}", e.chars().take(60).collect::<String>()));
                }
                bar.inc(1);
                outcomes.push(outcome);
            }
        }));
    }
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.extend(task.await?);
    }
    let wall = started.elapsed();
    bar.finish();
    let mut loglikelihoods = BTreeMap::new();
    for (i, prompt) in prompts.iter().enumerate() {
        if let Some(continuation) = &prompt.continuation
            && let Some(ll) = loglikelihood(
                http,
                target,
                &prompt.prompt,
                continuation,
                args.api_key.as_deref(),
            )
            .await
            .with_context(|| format!("scoring line {} on {}", i + 1, target.name))?
        {
            loglikelihoods.insert(i, ll);
        }
    }
    Ok(TargetRun {
        target: target.clone(),
        outcomes,
        wall,
        loglikelihoods,
    })
}

fn ms(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |v| format!("{v:.1}"))
}

/// Per-target figures, as written to results.json and the report.
fn summary(run: &TargetRun) -> Value {
    let ok: Vec<&Outcome> = run.outcomes.iter().filter(|o| o.error.is_none()).collect();
    let latencies = Latencies::of(ok.iter().map(|o| o.latency));
    let firsts = Latencies::of(ok.iter().filter_map(|o| o.first_token));
    let tokens: u64 = ok.iter().map(|o| o.output_tokens).sum();
    let wall = run.wall.as_secs_f64().max(1e-9);
    json!({
        "target": run.target.name, "url": run.target.url,
        "requests": run.outcomes.len(), "errors": run.outcomes.len() - ok.len(),
        "requests_per_s": ok.len() as f64 / wall, "output_tokens_per_s": tokens as f64 / wall,
        "latency_ms": {"p50": latencies.percentile_ms(0.5), "p95": latencies.percentile_ms(0.95), "p99": latencies.percentile_ms(0.99)},
        "ttft_ms": {"p50": firsts.percentile_ms(0.5), "p95": firsts.percentile_ms(0.95)},
        "first_errors": run.outcomes.iter().filter_map(|o| o.error.clone()).take(3).collect::<Vec<_>>(),
    })
}

/// Greedy outputs per prompt (the first successful one of each).
fn greedy_texts<'a>(run: &'a TargetRun, prompts: &[Prompt]) -> BTreeMap<usize, &'a str> {
    let mut texts = BTreeMap::new();
    for o in &run.outcomes {
        if o.error.is_none() && prompts[o.prompt].temperature() == 0.0 {
            texts.entry(o.prompt).or_insert(o.text.as_str());
        }
    }
    texts
}

fn agreement(runs: &[TargetRun], prompts: &[Prompt]) -> Vec<Value> {
    let mut pairs = Vec::new();
    for (i, a) in runs.iter().enumerate() {
        for b in &runs[i + 1..] {
            let (ta, tb) = (greedy_texts(a, prompts), greedy_texts(b, prompts));
            let shared: Vec<usize> = ta.keys().filter(|k| tb.contains_key(k)).copied().collect();
            let same = shared.iter().filter(|k| ta[k] == tb[k]).count();
            let lls: Vec<f64> = a
                .loglikelihoods
                .iter()
                .filter_map(|(k, x)| b.loglikelihoods.get(k).map(|y| (x - y).abs()))
                .collect();
            pairs.push(json!({
                "a": a.target.name, "b": b.target.name,
                "greedy_prompts": shared.len(), "greedy_identical": same,
                "scored": lls.len(),
                "max_abs_ll_diff": lls.iter().copied().fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v)))),
                "mean_abs_ll_diff": (!lls.is_empty()).then(|| lls.iter().sum::<f64>() / lls.len() as f64),
            }));
        }
    }
    pairs
}

/// The report's charts: `latency.png` (time to first token and latency percentiles) and
/// `throughput.png` (output tokens/s and requests/s), one bar per target.
fn write_charts(out: &Path, summaries: &[Value]) -> Result<()> {
    let targets: Vec<String> = summaries
        .iter()
        .map(|s| s["target"].as_str().unwrap_or_default().to_string())
        .collect();
    let metric = |pointer: &str| -> Vec<Option<f64>> {
        summaries
            .iter()
            .map(|s| s.pointer(pointer).and_then(Value::as_f64))
            .collect()
    };
    let panel = |title, pointer| charts::Panel {
        title,
        values: metric(pointer),
    };
    charts::write_bars(
        &out.join("latency.png"),
        &targets,
        &[
            panel("time to first token p50 (ms)", "/ttft_ms/p50"),
            panel("latency p50 (ms)", "/latency_ms/p50"),
            panel("latency p95 (ms)", "/latency_ms/p95"),
            panel("latency p99 (ms)", "/latency_ms/p99"),
        ],
        2,
    )?;
    charts::write_bars(
        &out.join("throughput.png"),
        &targets,
        &[
            panel("output tokens/s", "/output_tokens_per_s"),
            panel("requests/s", "/requests_per_s"),
        ],
        2,
    )
}

fn report(args: &AbArgs, summaries: &[Value], pairs: &[Value]) -> String {
    let mut md = String::new();
    let workload = match (args.requests, args.duration) {
        (_, Some(s)) => format!("{s} s per target"),
        (Some(n), _) => format!("{n} requests per target"),
        _ => "one pass over the prompts per target".into(),
    };
    let _ = writeln!(
        md,
        "# A/B report\n\nWorkload: `{}`, concurrency {}, {workload}; targets measured one after the other.\n",
        args.prompts.display(),
        args.concurrency
    );
    md.push_str("| target | requests | errors | req/s | output tok/s | p50 ms | p95 ms | p99 ms | TTFT p50 ms | TTFT p95 ms |\n|---|---|---|---|---|---|---|---|---|---|\n");
    for s in summaries {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.2} | {:.1} | {} | {} | {} | {} | {} |",
            s["target"].as_str().unwrap_or_default(),
            s["requests"],
            s["errors"],
            s["requests_per_s"].as_f64().unwrap_or(0.0),
            s["output_tokens_per_s"].as_f64().unwrap_or(0.0),
            ms(s["latency_ms"]["p50"].as_f64()),
            ms(s["latency_ms"]["p95"].as_f64()),
            ms(s["latency_ms"]["p99"].as_f64()),
            ms(s["ttft_ms"]["p50"].as_f64()),
            ms(s["ttft_ms"]["p95"].as_f64()),
        );
    }
    md.push_str("\n![latency](latency.png)\n\n![throughput](throughput.png)\n");
    if !pairs.is_empty() {
        md.push_str("\n## Agreement\n\n| targets | greedy outputs identical | scored pairs | max \\|Δ log-likelihood\\| | mean \\|Δ\\| |\n|---|---|---|---|---|\n");
        for p in pairs {
            let diff = |v: &Value| v.as_f64().map_or("n/a".into(), |v| format!("{v:.2e}"));
            let _ = writeln!(
                md,
                "| {} vs {} | {} of {} | {} | {} | {} |",
                p["a"].as_str().unwrap_or_default(),
                p["b"].as_str().unwrap_or_default(),
                p["greedy_identical"],
                p["greedy_prompts"],
                p["scored"],
                diff(&p["max_abs_ll_diff"]),
                diff(&p["mean_abs_ll_diff"]),
            );
        }
    }
    md
}

pub fn run(args: AbArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.prompts)
        .with_context(|| format!("reading {}", args.prompts.display()))?;
    let mut prompts = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        prompts.push(
            serde_json::from_str::<Prompt>(line)
                .with_context(|| format!("{} line {}", args.prompts.display(), i + 1))?,
        );
    }
    if prompts.is_empty() {
        bail!("{} has no prompts", args.prompts.display());
    }
    let prompts = Arc::new(prompts);
    let runtime = tokio::runtime::Runtime::new()?;
    let runs = runtime.block_on(async {
        // A fresh connection per request, for every target alike: servers that close kept-alive
        // connections on their own schedule (llama.cpp's llama-server) otherwise race the pool,
        // and the request lost on a just-closed connection counts as the server's error.
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(600))
            .pool_max_idle_per_host(0)
            .build()?;
        let mut runs = Vec::new();
        for target in &args.targets {
            runs.push(run_target(&args, target, &prompts, &http).await?);
        }
        anyhow::Ok(runs)
    })?;
    let summaries: Vec<Value> = runs.iter().map(summary).collect();
    let pairs = agreement(&runs, &prompts);
    std::fs::create_dir_all(&args.out)?;
    write_charts(&args.out, &summaries)?;
    let md = report(&args, &summaries, &pairs);
    std::fs::write(args.out.join("report.md"), &md)?;
    std::fs::write(
        args.out.join("results.json"),
        serde_json::to_string_pretty(&json!({"targets": summaries, "agreement": pairs}))?,
    )?;
    println!("{md}\nwritten to {}", args.out.join("report.md").display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_with_their_options() {
        let t = parse_target("openai=http://127.0.0.1:8080,model=smol,name=llama.cpp").unwrap();
        assert_eq!(
            t.kind,
            Kind::OpenAi {
                model: "smol".into()
            }
        );
        assert_eq!(t.name, "llama.cpp");
        assert!(
            parse_target("openai=http://x")
                .unwrap_err()
                .contains("model=NAME")
        );
        assert!(
            parse_target("vllm=http://x")
                .unwrap_err()
                .contains("unknown target kind")
        );
        assert!(
            parse_target("hrm=http://x,colour=red")
                .unwrap_err()
                .contains("unknown option")
        );
        assert_eq!(parse_target("tgi=http://x/").unwrap().url, "http://x");
    }

    #[test]
    fn tgi_bodies_follow_its_quirks() {
        let tgi = parse_target("tgi=http://x").unwrap();
        let greedy = Prompt {
            prompt: "Hi".into(),
            max_tokens: None,
            temperature: Some(0.0),
            top_p: Some(1.0),
            continuation: None,
        };
        let body = generate_body(&tgi, &greedy, 16);
        assert_eq!(
            body,
            json!({"inputs": "Hi", "parameters": {"max_new_tokens": 16, "details": true, "do_sample": false}})
        );
        let sampled = Prompt {
            temperature: Some(0.7),
            top_p: Some(0.9),
            ..greedy
        };
        let body = generate_body(&tgi, &sampled, 16);
        assert_eq!(body["parameters"]["temperature"], 0.7);
        assert_eq!(body["parameters"]["top_p"], 0.9);
        assert_eq!(body["parameters"]["do_sample"], true);
    }

    #[tokio::test]
    async fn a_stream_longer_than_the_cap_fails_instead_of_growing() {
        // A hostile target: one event that never ends.
        let endless = futures::stream::iter(
            std::iter::repeat_with(|| Ok::<_, std::io::Error>(b"data: xxxxxxxx".to_vec()))
                .take(100),
        );
        let mut events = std::pin::pin!(capped(endless, 1000).eventsource());
        let err = events.next().await.unwrap().unwrap_err().to_string();
        assert!(err.contains("longer than 1000 bytes"), "{err}");
    }

    #[tokio::test]
    async fn an_event_reads_whole_across_chunks_that_split_a_character() {
        let body = "event: token\ndata: {\"text\":\"é\"}\n\ndata: [DONE]\n\n".as_bytes();
        let split = body.iter().position(|&b| b == 0xC3).unwrap() + 1;
        let chunks = [body[..split].to_vec(), body[split..].to_vec()];
        let events: Vec<Event> = futures::stream::iter(chunks.map(Ok::<_, std::io::Error>))
            .eventsource()
            .map(|event| event.unwrap())
            .collect()
            .await;
        assert_eq!(events.len(), 2);
        assert_eq!(
            (events[0].event.as_str(), events[0].data.as_str()),
            ("token", "{\"text\":\"é\"}")
        );
        assert_eq!(events[1].data, "[DONE]");
    }
}
