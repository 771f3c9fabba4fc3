//! Continuous batching: one scheduler thread owns the decode loop; HTTP handlers hand it work
//! through a bounded FIFO queue and read results (and streamed tokens) from a channel per request.
//!
//! Between decode steps the scheduler takes in new work, drops the sequences of clients that went
//! away (their result channel is closed), admits waiting prompts up to `max_batch_size`, and runs
//! one [`Engine::step`]. A request with more prompts than the batch size simply waits for seats,
//! so memory stays within what `max_batch_size` sequences need. Scoring work runs between steps
//! as one teacher-forced pass.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use hrm_model::engine::{ScoreRow, Sequence};
use hrm_model::{Engine, GenerateParams, Generation, TokenLogprob};
use tokio::sync::{mpsc, oneshot};

use crate::error::ApiError;

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
}

/// Sizes of the scheduler.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Sequences decoded together.
    pub max_batch_size: usize,
    /// Requests that may wait in the queue.
    pub queue_capacity: usize,
    /// With backpressure, a full queue answers 429 at once; without, the request waits.
    pub backpressure: bool,
}

/// The handlers' side of the scheduler. Cheap to clone.
#[derive(Clone)]
pub struct Scheduler {
    queue: mpsc::Sender<Envelope>,
    depth: Arc<AtomicUsize>,
    config: SchedulerConfig,
}

impl Scheduler {
    /// Starts the scheduler thread. It ends when every `Scheduler` clone is dropped and its
    /// work is done.
    pub fn start(engine: Arc<Engine>, config: SchedulerConfig) -> Self {
        let (queue, rx) = mpsc::channel(config.queue_capacity.max(1));
        let depth = Arc::new(AtomicUsize::new(0));
        let loop_depth = depth.clone();
        std::thread::Builder::new()
            .name("hrm-scheduler".into())
            .spawn(move || Loop::new(engine, config, rx, loop_depth).run())
            .expect("spawning the scheduler thread");
        Self {
            queue,
            depth,
            config,
        }
    }

    /// Requests waiting in the queue (not yet taken by the scheduler).
    pub fn queue_depth(&self) -> usize {
        self.depth.load(Ordering::Relaxed)
    }

    async fn submit(&self, work: Work) -> Result<(), ApiError> {
        let envelope = Envelope {
            work,
            enqueued: Instant::now(),
        };
        self.depth.fetch_add(1, Ordering::Relaxed);
        let sent = if self.config.backpressure {
            self.queue.try_send(envelope).map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => {
                    ApiError::queue_full(self.config.queue_capacity)
                }
                mpsc::error::TrySendError::Closed(_) => {
                    ApiError::internal("the scheduler has stopped")
                }
            })
        } else {
            self.queue
                .send(envelope)
                .await
                .map_err(|_| ApiError::internal("the scheduler has stopped"))
        };
        if sent.is_err() {
            self.depth.fetch_sub(1, Ordering::Relaxed);
        }
        metrics::gauge!("hrm_queue_depth").set(self.queue_depth() as f64);
        sent
    }

    /// Queues prompts for generation; events arrive on the returned channel, with `Token`
    /// events only when `stream` is set.
    pub async fn generate(
        &self,
        prompts: Vec<Vec<u32>>,
        params: GenerateParams,
        stream: bool,
    ) -> Result<mpsc::UnboundedReceiver<GenEvent>, ApiError> {
        let (events, rx) = mpsc::unbounded_channel();
        self.submit(Work::Generate {
            prompts,
            params,
            events,
            stream,
        })
        .await?;
        Ok(rx)
    }

    /// Scores rows (teacher-forced log-probabilities, `top_n` alternatives per position).
    pub async fn score(
        &self,
        rows: Vec<ScoreRow>,
        top_n: usize,
    ) -> Result<Vec<Vec<TokenLogprob>>, ApiError> {
        let (reply, rx) = oneshot::channel();
        self.submit(Work::Score { rows, top_n, reply }).await?;
        rx.await
            .map_err(|_| ApiError::internal("the scheduler dropped the request"))?
            .map_err(ApiError::internal)
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

struct Loop {
    engine: Arc<Engine>,
    config: SchedulerConfig,
    rx: mpsc::Receiver<Envelope>,
    depth: Arc<AtomicUsize>,
    jobs: HashMap<u64, mpsc::UnboundedSender<GenEvent>>,
    waiting: VecDeque<Waiting>,
    active: Vec<Running>,
    next_job: u64,
}

impl Loop {
    fn new(
        engine: Arc<Engine>,
        config: SchedulerConfig,
        rx: mpsc::Receiver<Envelope>,
        depth: Arc<AtomicUsize>,
    ) -> Self {
        Self {
            engine,
            config,
            rx,
            depth,
            jobs: HashMap::new(),
            waiting: VecDeque::new(),
            active: Vec::new(),
            next_job: 0,
        }
    }

    fn run(mut self) {
        loop {
            if self.active.is_empty() && self.waiting.is_empty() {
                match self.rx.blocking_recv() {
                    Some(envelope) => self.take(envelope),
                    None => return,
                }
            }
            // Take queued work only while prompts would not have to wait for seats anyway:
            // the rest stays in the bounded queue, which is what backpressure measures.
            while self.waiting.len() < self.config.max_batch_size.max(1) {
                let Ok(envelope) = self.rx.try_recv() else {
                    break;
                };
                self.take(envelope);
            }
            self.drop_abandoned();
            self.admit();
            if !self.active.is_empty() {
                self.step();
            }
        }
    }

    fn take(&mut self, envelope: Envelope) {
        self.depth.fetch_sub(1, Ordering::Relaxed);
        metrics::gauge!("hrm_queue_depth").set(self.depth.load(Ordering::Relaxed) as f64);
        match envelope.work {
            Work::Score { rows, top_n, reply } => {
                metrics::histogram!("hrm_queue_seconds")
                    .record(envelope.enqueued.elapsed().as_secs_f64());
                let result = self
                    .engine
                    .token_logprobs(&rows, top_n, self.config.max_batch_size)
                    .map_err(|e| e.to_string());
                let _ = reply.send(result);
            }
            Work::Generate {
                prompts,
                params,
                events,
                stream,
            } => {
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
                self.jobs.insert(job, events);
            }
        }
    }

    /// Forgets the work of clients that went away.
    fn drop_abandoned(&mut self) {
        let gone: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, events)| events.is_closed())
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

    fn step(&mut self) {
        metrics::histogram!("hrm_batch_size").record(self.active.len() as f64);
        let mut seqs: Vec<&mut Sequence> = self.active.iter_mut().map(|r| &mut r.seq).collect();
        if let Err(e) = self.engine.step(&mut seqs) {
            tracing::error!(error = %e, "decode step failed; failing the batch");
            for r in self.active.drain(..) {
                if let Some(events) = self.jobs.remove(&r.job) {
                    let _ = events.send(GenEvent::Failed(format!("generation failed: {e}")));
                }
            }
            return;
        }
        let now = Instant::now();
        let mut finished = Vec::new();
        for (i, r) in self.active.iter_mut().enumerate() {
            let Some(events) = self.jobs.get(&r.job) else {
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
                let _ = events.send(GenEvent::Token {
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
            metrics::counter!("hrm_generated_tokens_total")
                .increment(generation.completion_tokens as u64);
            metrics::counter!("hrm_prompt_tokens_total").increment(generation.prompt_tokens as u64);
            if let Some(events) = self.jobs.get(&r.job) {
                let _ = events.send(GenEvent::Done {
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
