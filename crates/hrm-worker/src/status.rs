//! What the worker is doing, as one shared value: the loop writes it, the terminal UI draws
//! it, and every activity line also goes to the log (the `--headless` output).

use hrm_wire::{GlobalStats, LeaderboardEntry, WorkerStats};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;
use uuid::Uuid;

/// The client states of the specification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerState {
    Idle,
    Training,
    Uploading,
}

impl std::fmt::Display for WorkerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WorkerState::Idle => "IDLE",
            WorkerState::Training => "TRAINING",
            WorkerState::Uploading => "UPLOADING",
        })
    }
}

/// The batch being trained.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchProgress {
    pub batch_id: Uuid,
    pub model_version: String,
    pub samples: usize,
    pub step: usize,
    pub steps: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Info,
    Warn,
    Error,
}

#[derive(Debug, Clone)]
pub struct LogLine {
    pub at: SystemTime,
    pub level: Level,
    pub message: String,
}

/// Lines kept for the activity log.
const LOG_LINES: usize = 200;

#[derive(Debug, Clone)]
pub struct View {
    pub state: WorkerState,
    /// A session is running (the start/stop control is on).
    pub running: bool,
    /// Stop was asked for; the current batch is finishing.
    pub stopping: bool,
    /// What the loop is waiting on, for humans: "downloading v0.1.3 (40%)".
    pub activity: String,
    pub hub_url: String,
    pub worker_id: Option<Uuid>,
    pub username: Option<String>,
    pub connected: bool,
    /// The version loaded in memory, if any.
    pub model_version: Option<String>,
    /// The hub's current version, from its status feed.
    pub network_version: Option<String>,
    pub batch: Option<BatchProgress>,
    pub last_loss: Option<f64>,
    pub tokens_per_second: Option<f64>,
    /// Rows per forward pass in use.
    pub micro_batch: Option<usize>,
    pub session: SessionTotals,
    pub log: VecDeque<LogLine>,
    pub contribution: Option<WorkerStats>,
    pub network: Option<GlobalStats>,
    pub leaderboard: Vec<LeaderboardEntry>,
}

/// Counters of the current (or last) session.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SessionTotals {
    pub batches: u64,
    pub tokens: u64,
    pub upload_bytes: u64,
    pub lost_batches: u64,
}

/// The shared view; cheap to clone.
#[derive(Clone)]
pub struct Status(Arc<Mutex<View>>);

impl Status {
    pub fn new(hub_url: &str) -> Self {
        Status(Arc::new(Mutex::new(View {
            state: WorkerState::Idle,
            running: false,
            stopping: false,
            activity: "stopped".into(),
            hub_url: hub_url.to_string(),
            worker_id: None,
            username: None,
            connected: false,
            model_version: None,
            network_version: None,
            batch: None,
            last_loss: None,
            tokens_per_second: None,
            micro_batch: None,
            session: SessionTotals::default(),
            log: VecDeque::new(),
            contribution: None,
            network: None,
            leaderboard: Vec::new(),
        })))
    }

    pub fn lock(&self) -> MutexGuard<'_, View> {
        // A panic while holding the lock leaves plain data behind; drawing it is still fine.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn snapshot(&self) -> View {
        self.lock().clone()
    }

    pub fn update(&self, change: impl FnOnce(&mut View)) {
        change(&mut self.lock());
    }

    pub fn set_state(&self, state: WorkerState) {
        let mut view = self.lock();
        if view.state != state {
            tracing::info!(state = %state, "state");
            view.state = state;
        }
    }

    pub fn set_activity(&self, activity: impl Into<String>) {
        self.lock().activity = activity.into();
    }

    pub fn info(&self, message: impl Into<String>) {
        self.push(Level::Info, message.into());
    }

    pub fn warn(&self, message: impl Into<String>) {
        self.push(Level::Warn, message.into());
    }

    pub fn error(&self, message: impl Into<String>) {
        self.push(Level::Error, message.into());
    }

    fn push(&self, level: Level, message: String) {
        match level {
            Level::Info => tracing::info!("{message}"),
            Level::Warn => tracing::warn!("{message}"),
            Level::Error => tracing::error!("{message}"),
        }
        let mut view = self.lock();
        if view.log.len() == LOG_LINES {
            view.log.pop_front();
        }
        view.log.push_back(LogLine {
            at: SystemTime::now(),
            level,
            message,
        });
    }
}
