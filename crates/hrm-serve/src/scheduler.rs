//! Continuous batching: one scheduler thread owns the model; HTTP handlers hand it work through
//! a channel and read results (and streamed tokens) from a channel per request.
//!
//! Invariants:
//! - **Bounded work.** Every request holds permits for its tokens (prompt plus the most it may
//!   generate, or the rows it scores) from admission until its work ends, however it ends. The
//!   permits are `--max-queued-tokens`: beyond them a request is answered 429 at once
//!   (`--backpressure`, the default) or waits for permits.
//! - **Fair turns.** Scoring is cut into chunks that take about [`CHUNK_SECONDS`] (at most
//!   `--score-chunk-tokens` tokens, at least one row), scored between decode steps, taking
//!   scoring jobs in turn. While sequences decode, scoring gets at most [`SCORE_SHARE`] of the
//!   loop's time: a large scoring job slows generation by a bounded share and never stops it,
//!   and a new request waits at most about one chunk for its first step.
//! - **Nothing for the departed.** Work whose client went away (its result channel closed) is
//!   dropped before each step and each chunk, on every route.
//! - **Faults stay local.** A step that fails is retried sequence by sequence, and only the
//!   sequences that fail again fail their requests. A panic in the loop drops the work in flight
//!   (those requests get 503), marks the service unready while the loop restarts, and ends the
//!   process (exit code 70) if it keeps panicking, so that a supervisor restarts it.

use std::collections::{HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use hrm_model::engine::{ScoreRow, Sequence};
use hrm_model::{Engine, GenerateParams, Generation, TokenLogprob};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

use hrm_http::ApiError;

/// What a generation request hears back, in order: tokens as they come (only when it streams),
/// then one `Done` per prompt (or one `Failed`).
#[derive(Debug)]
pub enum GenEvent {
    /// New text of prompt `prompt` (already cut at stop strings).
    Token {
        prompt: usize,
        text: String,
    },
    Done {
        prompt: usize,
        generation: Generation,
    },
    Failed(String),
}

pub type ScoreResult = Result<Vec<Vec<TokenLogprob>>, String>;

enum Work {
    Generate {
        prompts: Vec<Vec<u32>>,
        params: GenerateParams,
        events: mpsc::UnboundedSender<GenEvent>,
        stream: bool,
    },
    Score {
        rows: Vec<ScoreRow>,
        top_n: usize,
        reply: oneshot::Sender<ScoreResult>,
    },
}

struct Envelope {
    work: Work,
    enqueued: Instant,
    /// The request's share of `--max-queued-tokens`, released when its work ends.
    permit: OwnedSemaphorePermit,
}

/// Sizes of the scheduler.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Sequences decoded together.
    pub max_batch_size: usize,
    /// Tokens of admitted, unfinished work.
    pub max_queued_tokens: usize,
    /// With backpressure, work beyond `max_queued_tokens` answers 429 at once; without, it waits.
    pub backpressure: bool,
    /// Tokens scored between two decode steps.
    pub score_chunk_tokens: usize,
}

/// Faults the tests inject; none in service.
#[derive(Clone, Copy, Debug)]
pub struct Faults {
    /// A step over a sequence whose prompt holds this token id fails.
    pub fail_on_token: Option<u32>,
    /// The loop panics when it takes in a prompt holding this token id.
    pub panic_on_token: Option<u32>,
    /// What happens when the loop keeps panicking: in service, the process exits with status
    /// 70 so that a supervisor restarts it.
    pub give_up: fn(),
}

impl Default for Faults {
    fn default() -> Self {
        Self {
            fail_on_token: None,
            panic_on_token: None,
            give_up: || std::process::exit(70),
        }
    }
}

/// What a scoring chunk should take, so that decoding sequences and new requests wait little.
pub const CHUNK_SECONDS: f64 = 0.1;
/// The share of the loop's time scoring may take while sequences are decoding.
pub const SCORE_SHARE: f64 = 0.5;

/// Panics within this window that end the process.
const MAX_RESTARTS: usize = 3;
const RESTART_WINDOW: Duration = Duration::from_secs(60);

/// What the handlers see of the scheduler's state.
#[derive(Default)]
struct Health {
    /// False while the loop restarts after a panic.
    running: AtomicBool,
    /// Requests sent but not yet taken in by the loop.
    waiting: AtomicUsize,
    /// Tokens processed (prompt, generated, scored), for the Retry-After estimate.
    tokens_done: AtomicU64,
}

/// The handlers' side of the scheduler. Cheap to clone.
#[derive(Clone)]
pub struct Scheduler {
    queue: mpsc::UnboundedSender<Envelope>,
    permits: Arc<Semaphore>,
    health: Arc<Health>,
    started: Instant,
    config: SchedulerConfig,
}

impl Scheduler {
    /// Starts the scheduler thread. It ends when every `Scheduler` clone is dropped and its
    /// work is done.
    pub fn start(engine: Arc<Engine>, config: SchedulerConfig, faults: Faults) -> Self {
        let (queue, rx) = mpsc::unbounded_channel();
        let health = Arc::new(Health::default());
        health.running.store(true, Ordering::SeqCst);
        let thread_health = health.clone();
        std::thread::Builder::new()
            .name("hrm-scheduler".into())
            .spawn(move || supervise(engine, config, faults, rx, thread_health))
            .expect("spawning the scheduler thread");
        Self {
            queue,
            permits: Arc::new(Semaphore::new(config.max_queued_tokens.max(1))),
            health,
            started: Instant::now(),
            config,
        }
    }

    /// Whether the loop is running (false while it restarts after a panic).
    pub fn is_running(&self) -> bool {
        self.health.running.load(Ordering::SeqCst)
    }

    /// Requests not yet taken in by the loop.
    pub fn queue_depth(&self) -> usize {
        self.health.waiting.load(Ordering::Relaxed)
    }

    /// Tokens of admitted work not yet finished.
    pub fn queued_tokens(&self) -> usize {
        self.config
            .max_queued_tokens
            .max(1)
            .saturating_sub(self.permits.available_permits())
    }

    /// Seconds until `tokens` of work are likely done, from the throughput so far.
    fn retry_after(&self, tokens: usize) -> u64 {
        let done = self.health.tokens_done.load(Ordering::Relaxed) as f64;
        let rate = done / self.started.elapsed().as_secs_f64().max(1.0);
        if rate <= 0.0 {
            return 1;
        }
        ((self.queued_tokens() + tokens) as f64 / rate)
            .ceil()
            .clamp(1.0, 60.0) as u64
    }

    async fn submit(&self, work: Work, tokens: usize) -> Result<(), ApiError> {
        if !self.is_running() {
            return Err(restarting());
        }
        // A request larger than the whole budget (only possible when the budget is set below
        // the per-request limit) runs alone.
        let cost = tokens.clamp(1, self.config.max_queued_tokens.max(1)) as u32;
        let permit = if self.config.backpressure {
            self.permits
                .clone()
                .try_acquire_many_owned(cost)
                .map_err(|_| {
                    ApiError::too_many(
                        "queue_full",
                        format!(
                            "the server holds {} tokens of work, its limit is {} (--max-queued-tokens); retry later",
                            self.queued_tokens(),
                            self.config.max_queued_tokens
                        ),
                        self.retry_after(tokens),
                    )
                })?
        } else {
            self.permits
                .clone()
                .acquire_many_owned(cost)
                .await
                .map_err(|_| restarting())?
        };
        self.health.waiting.fetch_add(1, Ordering::Relaxed);
        let envelope = Envelope {
            work,
            enqueued: Instant::now(),
            permit,
        };
        if self.queue.send(envelope).is_err() {
            self.health.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(restarting());
        }
        metrics::gauge!("hrm_queue_depth").set(self.queue_depth() as f64);
        Ok(())
    }

    /// Queues prompts for generation; events arrive on the returned channel, with `Token`
    /// events only when `stream` is set.
    pub async fn generate(
        &self,
        prompts: Vec<Vec<u32>>,
        params: GenerateParams,
        stream: bool,
    ) -> Result<mpsc::UnboundedReceiver<GenEvent>, ApiError> {
        let tokens = prompts.iter().map(|p| p.len() + params.max_tokens).sum();
        let (events, rx) = mpsc::unbounded_channel();
        self.submit(
            Work::Generate {
                prompts,
                params,
                events,
                stream,
            },
            tokens,
        )
        .await?;
        Ok(rx)
    }

    /// Scores rows (teacher-forced log-probabilities, `top_n` alternatives per position). The
    /// work stops when the returned future is dropped.
    pub async fn score(
        &self,
        rows: Vec<ScoreRow>,
        top_n: usize,
    ) -> Result<Vec<Vec<TokenLogprob>>, ApiError> {
        let tokens = rows.iter().map(|r| r.tokens.len()).sum();
        let (reply, rx) = oneshot::channel();
        self.submit(Work::Score { rows, top_n, reply }, tokens)
            .await?;
        rx.await
            .map_err(|_| restarting())?
            .map_err(ApiError::internal)
    }
}

/// 503 for work lost to a restart of the loop.
fn restarting() -> ApiError {
    ApiError::unavailable(
        "scheduler_restarting",
        "the inference loop is restarting after a fault; retry shortly",
    )
    .with_retry_after(1)
}

/// Runs the loop; restarts it after a panic, up to `MAX_RESTARTS` within `RESTART_WINDOW`.
fn supervise(
    engine: Arc<Engine>,
    config: SchedulerConfig,
    faults: Faults,
    mut rx: mpsc::UnboundedReceiver<Envelope>,
    health: Arc<Health>,
) {
    let mut panics: VecDeque<Instant> = VecDeque::new();
    loop {
        let mut state = Loop::new(engine.clone(), config, faults, health.clone());
        match std::panic::catch_unwind(AssertUnwindSafe(|| state.run(&mut rx))) {
            Ok(()) => return,
            Err(_) => {
                health.running.store(false, Ordering::SeqCst);
                metrics::counter!("hrm_scheduler_restarts_total").increment(1);
                // The work in flight goes with the state: its clients hear the channel close.
                drop(state);
                let now = Instant::now();
                panics.push_back(now);
                panics.retain(|t| now.duration_since(*t) < RESTART_WINDOW);
                if panics.len() > MAX_RESTARTS {
                    tracing::error!(
                        panics = panics.len(),
                        "the inference loop keeps panicking; exiting so that a supervisor restarts the service"
                    );
                    (faults.give_up)();
                    return;
                }
                tracing::error!("the inference loop panicked; its requests failed; restarting it");
                health.running.store(true, Ordering::SeqCst);
            }
        }
    }
}

/// A prompt admitted to the batch.
struct Running {
    job: u64,
    prompt: usize,
    seq: Sequence,
    /// Bytes of the output already streamed.
    sent: usize,
    stop: Vec<String>,
    stream: bool,
    started: Instant,
    last_token: Option<Instant>,
}

struct Waiting {
    job: u64,
    stream: bool,
    prompt: usize,
    ids: Vec<u32>,
    params: GenerateParams,
    enqueued: Instant,
}

/// A generation request in the loop: where its events go, and its token permits.
struct GenJob {
    events: mpsc::UnboundedSender<GenEvent>,
    _permit: OwnedSemaphorePermit,
}

/// A scoring request in the loop, scored chunk by chunk.
struct ScoreJob {
    rows: Vec<ScoreRow>,
    top_n: usize,
    done: Vec<Vec<TokenLogprob>>,
    reply: oneshot::Sender<ScoreResult>,
    enqueued: Instant,
    _permit: OwnedSemaphorePermit,
}

struct Loop {
    engine: Arc<Engine>,
    config: SchedulerConfig,
    faults: Faults,
    health: Arc<Health>,
    jobs: HashMap<u64, GenJob>,
    waiting: VecDeque<Waiting>,
    active: Vec<Running>,
    scoring: VecDeque<ScoreJob>,
    /// Seconds of scoring that decode steps have paid for (see [`SCORE_SHARE`]).
    score_credit: f64,
    /// Tokens scored per second, measured; sizes the chunks.
    score_rate: Option<f64>,
    next_job: u64,
}

impl Loop {
    fn new(
        engine: Arc<Engine>,
        config: SchedulerConfig,
        faults: Faults,
        health: Arc<Health>,
    ) -> Self {
        Self {
            engine,
            config,
            faults,
            health,
            jobs: HashMap::new(),
            waiting: VecDeque::new(),
            active: Vec::new(),
            scoring: VecDeque::new(),
            score_credit: 0.0,
            score_rate: None,
            next_job: 0,
        }
    }

    fn idle(&self) -> bool {
        self.active.is_empty() && self.waiting.is_empty() && self.scoring.is_empty()
    }

    fn run(&mut self, rx: &mut mpsc::UnboundedReceiver<Envelope>) {
        loop {
            if self.idle() {
                match rx.blocking_recv() {
                    Some(envelope) => self.take(envelope),
                    None => return,
                }
            }
            while let Ok(envelope) = rx.try_recv() {
                self.take(envelope);
            }
            self.drop_abandoned();
            self.admit();
            // The step first: a request admitted just now waits for at most the chunk that was
            // running when it arrived.
            if !self.active.is_empty() {
                let started = Instant::now();
                self.step();
                if !self.scoring.is_empty() {
                    self.score_credit +=
                        started.elapsed().as_secs_f64() * SCORE_SHARE / (1.0 - SCORE_SHARE);
                }
            }
            if self.active.is_empty() || self.score_credit >= 0.0 {
                self.score_chunk();
            }
            if self.scoring.is_empty() {
                // Credit is not saved up while nothing is scored: it would buy a long burst.
                self.score_credit = 0.0;
            }
        }
    }

    fn take(&mut self, envelope: Envelope) {
        self.health.waiting.fetch_sub(1, Ordering::Relaxed);
        metrics::gauge!("hrm_queue_depth").set(self.health.waiting.load(Ordering::Relaxed) as f64);
        match envelope.work {
            Work::Score { rows, top_n, reply } => self.scoring.push_back(ScoreJob {
                done: Vec::with_capacity(rows.len()),
                rows,
                top_n,
                reply,
                enqueued: envelope.enqueued,
                _permit: envelope.permit,
            }),
            Work::Generate {
                prompts,
                params,
                events,
                stream,
            } => {
                if let Some(token) = self.faults.panic_on_token
                    && prompts.iter().any(|p| p.contains(&token))
                {
                    panic!("injected fault: a prompt holds token {token}");
                }
                let job = self.next_job;
                self.next_job += 1;
                for (prompt, ids) in prompts.into_iter().enumerate() {
                    let mut params = params.clone();
                    params.seed = params.seed.map(|s| s.wrapping_add(prompt as u64));
                    self.waiting.push_back(Waiting {
                        job,
                        stream,
                        prompt,
                        ids,
                        params,
                        enqueued: envelope.enqueued,
                    });
                }
                self.jobs.insert(
                    job,
                    GenJob {
                        events,
                        _permit: envelope.permit,
                    },
                );
            }
        }
    }

    /// Forgets the work of clients that went away.
    fn drop_abandoned(&mut self) {
        let before = self.scoring.len();
        self.scoring.retain(|job| !job.reply.is_closed());
        let scoring_dropped = before - self.scoring.len();
        if scoring_dropped > 0 {
            metrics::counter!("hrm_requests_cancelled_total", "kind" => "score")
                .increment(scoring_dropped as u64);
            tracing::info!(requests = scoring_dropped, "client gone; scoring dropped");
        }
        let gone: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, job)| job.events.is_closed())
            .map(|(&job, _)| job)
            .collect();
        if gone.is_empty() {
            return;
        }
        for job in &gone {
            self.jobs.remove(job);
        }
        let before = self.active.len() + self.waiting.len();
        self.active.retain(|r| !gone.contains(&r.job));
        self.waiting.retain(|w| !gone.contains(&w.job));
        let dropped = before - self.active.len() - self.waiting.len();
        metrics::counter!("hrm_requests_cancelled_total", "kind" => "generate")
            .increment(gone.len() as u64);
        metrics::counter!("hrm_sequences_cancelled_total").increment(dropped as u64);
        tracing::info!(
            requests = gone.len(),
            sequences = dropped,
            "client gone; sequences dropped"
        );
    }

    fn admit(&mut self) {
        while self.active.len() < self.config.max_batch_size.max(1) {
            let Some(w) = self.waiting.pop_front() else {
                break;
            };
            metrics::histogram!("hrm_queue_seconds").record(w.enqueued.elapsed().as_secs_f64());
            let stop = w.params.stop.clone();
            let seq = self.engine.start(w.ids, w.params);
            self.active.push(Running {
                job: w.job,
                prompt: w.prompt,
                seq,
                sent: 0,
                stop,
                stream: w.stream,
                started: Instant::now(),
                last_token: None,
            });
        }
    }

    /// Scores one chunk of the scoring job whose turn it is, then gives the next job its turn.
    fn score_chunk(&mut self) {
        let Some(mut job) = self.scoring.pop_front() else {
            return;
        };
        if job.done.is_empty() {
            metrics::histogram!("hrm_queue_seconds").record(job.enqueued.elapsed().as_secs_f64());
        }
        // Until the speed is known, a small first chunk measures it.
        let budget = self
            .score_rate
            .map_or(256.0, |rate| rate * CHUNK_SECONDS)
            .min(self.config.score_chunk_tokens as f64) as usize;
        let start = job.done.len();
        let mut end = start;
        let mut tokens = 0;
        while end < job.rows.len()
            && end - start < self.config.max_batch_size.max(1)
            && (end == start || tokens + job.rows[end].tokens.len() <= budget)
        {
            tokens += job.rows[end].tokens.len();
            end += 1;
        }
        let started = Instant::now();
        let scored = self.engine.token_logprobs(
            &job.rows[start..end],
            job.top_n,
            self.config.max_batch_size,
        );
        let seconds = started.elapsed().as_secs_f64();
        self.score_credit -= seconds;
        let rate = tokens as f64 / seconds.max(1e-6);
        self.score_rate = Some(self.score_rate.map_or(rate, |r| 0.7 * r + 0.3 * rate));
        match scored {
            Ok(scored) => {
                self.health
                    .tokens_done
                    .fetch_add(tokens as u64, Ordering::Relaxed);
                metrics::counter!("hrm_scored_tokens_total").increment(tokens as u64);
                job.done.extend(scored);
                if job.done.len() == job.rows.len() {
                    let _ = job.reply.send(Ok(job.done));
                } else {
                    self.scoring.push_back(job);
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "scoring failed");
                let _ = job.reply.send(Err(format!("scoring failed: {e}")));
            }
        }
    }

    fn step(&mut self) {
        metrics::histogram!("hrm_batch_size").record(self.active.len() as f64);
        let progress: Vec<(usize, bool)> = self
            .active
            .iter()
            .map(|r| (r.seq.generated().len(), r.seq.is_finished()))
            .collect();
        let mut seqs: Vec<&mut Sequence> = self.active.iter_mut().map(|r| &mut r.seq).collect();
        if let Err(e) = engine_step(&self.engine, &self.faults, &mut seqs) {
            tracing::warn!(error = %e, "a decode step failed; retrying its sequences one by one");
            self.isolate_failures(&progress);
        }
        let now = Instant::now();
        let mut finished = Vec::new();
        for (i, r) in self.active.iter_mut().enumerate() {
            let Some(job) = self.jobs.get(&r.job) else {
                continue;
            };
            let produced = r.seq.generated().len();
            if produced > 0 {
                match r.last_token {
                    None => metrics::histogram!("hrm_time_to_first_token_seconds")
                        .record((now - r.started).as_secs_f64()),
                    Some(last) => metrics::histogram!("hrm_inter_token_seconds")
                        .record((now - last).as_secs_f64()),
                }
                r.last_token = Some(now);
            }
            let text = r.seq.text();
            let ready = if r.stream {
                streamable_len(text, &r.stop, r.seq.is_finished())
            } else {
                0
            };
            if ready > r.sent {
                let _ = job.events.send(GenEvent::Token {
                    prompt: r.prompt,
                    text: text[r.sent..ready].to_string(),
                });
                r.sent = ready;
            }
            if r.seq.is_finished() {
                finished.push(i);
            }
        }
        for i in finished.into_iter().rev() {
            let r = self.active.swap_remove(i);
            let generation = r.seq.into_generation();
            self.health.tokens_done.fetch_add(
                (generation.prompt_tokens + generation.completion_tokens) as u64,
                Ordering::Relaxed,
            );
            metrics::counter!("hrm_generated_tokens_total")
                .increment(generation.completion_tokens as u64);
            metrics::counter!("hrm_prompt_tokens_total").increment(generation.prompt_tokens as u64);
            if let Some(job) = self.jobs.get(&r.job) {
                let _ = job.events.send(GenEvent::Done {
                    prompt: r.prompt,
                    generation,
                });
            }
            let job_done = !self.active.iter().any(|a| a.job == r.job)
                && !self.waiting.iter().any(|w| w.job == r.job);
            if job_done {
                self.jobs.remove(&r.job);
            }
        }
    }

    /// After a failed step: the sequences that did not advance are stepped alone, and those
    /// that fail again fail their requests; the others carry on.
    fn isolate_failures(&mut self, progress: &[(usize, bool)]) {
        let mut failed_jobs = Vec::new();
        for (i, &(generated, finished)) in progress.iter().enumerate() {
            let advanced = {
                let seq = &self.active[i].seq;
                seq.generated().len() != generated || seq.is_finished() != finished
            };
            if advanced {
                continue;
            }
            let mut alone = [&mut self.active[i].seq];
            if let Err(e) = engine_step(&self.engine, &self.faults, &mut alone) {
                failed_jobs.push((self.active[i].job, e.to_string()));
            }
        }
        for (job, message) in failed_jobs {
            tracing::error!(error = %message, "a sequence failed; its request fails alone");
            metrics::counter!("hrm_sequences_failed_total").increment(1);
            self.active.retain(|r| r.job != job);
            self.waiting.retain(|w| w.job != job);
            if let Some(job) = self.jobs.remove(&job) {
                let _ = job
                    .events
                    .send(GenEvent::Failed(format!("generation failed: {message}")));
            }
        }
    }
}

/// One engine step over `seqs`, or the injected failure.
fn engine_step(
    engine: &Engine,
    faults: &Faults,
    seqs: &mut [&mut Sequence],
) -> hrm_model::Result<()> {
    if let Some(token) = faults.fail_on_token
        && seqs.iter().any(|s| s.prompt().contains(&token))
    {
        return Err(hrm_model::Error::InvalidInput(format!(
            "injected fault: a prompt holds token {token}"
        )));
    }
    engine.step(seqs)
}

/// How much of `text` can be streamed without ever being taken back: until the sequence
/// finishes, a tail that could still grow into a stop string, or a character still being
/// decoded (U+FFFD from a partial UTF-8 sequence), is held back.
fn streamable_len(text: &str, stops: &[String], finished: bool) -> usize {
    if finished {
        return text.len();
    }
    let decoded = text.trim_end_matches('\u{FFFD}');
    let held = stops
        .iter()
        .filter_map(|stop| {
            let mut cuts: Vec<usize> = stop.char_indices().skip(1).map(|(i, _)| i).collect();
            cuts.reverse();
            cuts.into_iter()
                .find(|&cut| decoded.ends_with(&stop[..cut]))
        })
        .max()
        .unwrap_or(0);
    decoded.len() - held
}

#[cfg(test)]
mod tests {
    use super::streamable_len;

    #[test]
    fn holds_back_what_a_stop_string_could_take() {
        let stops = vec!["END".to_string()];
        assert_eq!(streamable_len("hello E", &stops, false), 6);
        assert_eq!(streamable_len("hello EN", &stops, false), 6);
        assert_eq!(streamable_len("hello Ex", &stops, false), 8);
        assert_eq!(streamable_len("hello EN", &stops, true), 8);
        assert_eq!(streamable_len("caf\u{FFFD}", &[], false), 3);
    }
}
