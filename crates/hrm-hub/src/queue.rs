//! The batch and update queues: Redis lists when `REDIS_URL` is set, an in-process queue
//! otherwise. A queue only saves database scans: the database says what is pending, every
//! entry taken from a queue is re-checked against it, and an empty or lost queue is refilled
//! from it. Losing Redis therefore loses nothing.

use anyhow::{Context, Result};
use redis::AsyncCommands;
use redis::aio::ConnectionManager;
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// Pending batch ids, oldest first.
pub const BATCHES: &str = "batches";
/// Accepted update ids waiting for aggregation, in upload order.
pub const UPDATES: &str = "updates";

pub enum Queue {
    Memory(Mutex<HashMap<&'static str, VecDeque<String>>>),
    Redis {
        conn: ConnectionManager,
        /// Key prefix, so several hubs (or tests) can share one Redis.
        prefix: String,
        description: String,
    },
}

impl Queue {
    pub fn memory() -> Self {
        Queue::Memory(Mutex::new(HashMap::new()))
    }

    pub async fn redis(url: &str, prefix: &str) -> Result<Self> {
        let client = redis::Client::open(url)
            .with_context(|| format!("parsing REDIS_URL {}", crate::db::redact(url)))?;
        let conn = client
            .get_connection_manager()
            .await
            .with_context(|| format!("connecting to Redis at {}", crate::db::redact(url)))?;
        Ok(Queue::Redis {
            conn,
            prefix: prefix.to_string(),
            description: format!("Redis at {}", crate::db::redact(url)),
        })
    }

    pub fn description(&self) -> &str {
        match self {
            Queue::Memory(_) => "in-process queue",
            Queue::Redis { description, .. } => description,
        }
    }

    fn key(prefix: &str, name: &str) -> String {
        format!("{prefix}:{name}")
    }

    pub async fn push(&self, name: &'static str, ids: &[String]) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        match self {
            Queue::Memory(queues) => {
                queues
                    .lock()
                    .expect("queue lock")
                    .entry(name)
                    .or_default()
                    .extend(ids.iter().cloned());
            }
            Queue::Redis { conn, prefix, .. } => {
                let _: () = conn.clone().rpush(Self::key(prefix, name), ids).await?;
            }
        }
        Ok(())
    }

    pub async fn pop(&self, name: &'static str) -> Result<Option<String>> {
        Ok(match self {
            Queue::Memory(queues) => queues
                .lock()
                .expect("queue lock")
                .entry(name)
                .or_default()
                .pop_front(),
            Queue::Redis { conn, prefix, .. } => {
                conn.clone().lpop(Self::key(prefix, name), None).await?
            }
        })
    }

    /// The first `count` entries, left in place.
    pub async fn peek(&self, name: &'static str, count: usize) -> Result<Vec<String>> {
        if count == 0 {
            return Ok(Vec::new());
        }
        Ok(match self {
            Queue::Memory(queues) => {
                let queues = queues.lock().expect("queue lock");
                queues
                    .get(name)
                    .map(|q| q.iter().take(count).cloned().collect())
                    .unwrap_or_default()
            }
            Queue::Redis { conn, prefix, .. } => {
                conn.clone()
                    .lrange(Self::key(prefix, name), 0, count as isize - 1)
                    .await?
            }
        })
    }

    pub async fn len(&self, name: &'static str) -> Result<usize> {
        Ok(match self {
            Queue::Memory(queues) => queues
                .lock()
                .expect("queue lock")
                .get(name)
                .map_or(0, VecDeque::len),
            Queue::Redis { conn, prefix, .. } => conn.clone().llen(Self::key(prefix, name)).await?,
        })
    }

    pub async fn remove(&self, name: &'static str, ids: &[String]) -> Result<()> {
        match self {
            Queue::Memory(queues) => {
                let mut queues = queues.lock().expect("queue lock");
                if let Some(queue) = queues.get_mut(name) {
                    queue.retain(|id| !ids.contains(id));
                }
            }
            Queue::Redis { conn, prefix, .. } => {
                let key = Self::key(prefix, name);
                let mut pipe = redis::pipe();
                for id in ids {
                    pipe.lrem(&key, 0, id).ignore();
                }
                let _: () = pipe.query_async(&mut conn.clone()).await?;
            }
        }
        Ok(())
    }

    /// Replaces the queue's content with `ids`, atomically.
    pub async fn replace(&self, name: &'static str, ids: &[String]) -> Result<()> {
        match self {
            Queue::Memory(queues) => {
                queues
                    .lock()
                    .expect("queue lock")
                    .insert(name, ids.iter().cloned().collect());
            }
            Queue::Redis { conn, prefix, .. } => {
                let key = Self::key(prefix, name);
                let mut pipe = redis::pipe();
                pipe.atomic().del(&key).ignore();
                if !ids.is_empty() {
                    pipe.rpush(&key, ids).ignore();
                }
                let _: () = pipe.query_async(&mut conn.clone()).await?;
            }
        }
        Ok(())
    }
}
