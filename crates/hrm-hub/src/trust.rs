//! Worker trust: the per-worker token bucket and the reputation rules.
//!
//! Reputation starts at 1.0 and moves with what the hub learns about a worker's updates; the
//! steps below are the whole policy (documented in `docs/hub-api.md`). A worker below the
//! configured minimum is refused work.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;
use uuid::Uuid;

/// An update that was aggregated.
pub const REPUTATION_AGGREGATED: f64 = 0.01;
/// A recomputation agreed with the worker's update.
pub const REPUTATION_VERIFIED: f64 = 0.05;
/// An upload that failed validation (bad shapes, NaN, wrong version marker).
pub const REPUTATION_INVALID: f64 = -0.1;
/// An update the outlier screen rejected.
pub const REPUTATION_OUTLIER: f64 = -0.2;
/// A recomputation disagreed with the worker's update.
pub const REPUTATION_DISAGREED: f64 = -0.5;
/// Reputation never rises above this.
pub const REPUTATION_MAX: f64 = 2.0;

/// Token buckets per worker, kept in this replica's memory (with several replicas behind a
/// load balancer each enforces the limit on the traffic it sees).
pub struct RateLimiter {
    burst: f64,
    per_second: f64,
    buckets: Mutex<HashMap<Uuid, (f64, Instant)>>,
}

impl RateLimiter {
    pub fn new(burst: f64, per_second: f64) -> Self {
        Self {
            burst,
            per_second,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one token; on refusal returns the seconds until one is available.
    pub fn check(&self, worker: Uuid) -> Result<(), u64> {
        self.check_at(worker, Instant::now())
    }

    fn check_at(&self, worker: Uuid, now: Instant) -> Result<(), u64> {
        let mut buckets = self.buckets.lock().expect("rate limiter lock");
        let (tokens, last) = buckets.entry(worker).or_insert((self.burst, now));
        let elapsed = now.saturating_duration_since(*last).as_secs_f64();
        *tokens = (*tokens + elapsed * self.per_second).min(self.burst);
        *last = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            Ok(())
        } else {
            Err(((1.0 - *tokens) / self.per_second).ceil() as u64)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn bucket_allows_the_burst_then_refills_at_the_rate() {
        let limiter = RateLimiter::new(3.0, 2.0);
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let t0 = Instant::now();
        for _ in 0..3 {
            assert_eq!(limiter.check_at(a, t0), Ok(()));
        }
        assert_eq!(limiter.check_at(a, t0), Err(1));
        // Another worker has its own bucket.
        assert_eq!(limiter.check_at(b, t0), Ok(()));
        // Half a second at 2 tokens/s refills one token, not more.
        let t1 = t0 + Duration::from_millis(500);
        assert_eq!(limiter.check_at(a, t1), Ok(()));
        assert!(limiter.check_at(a, t1).is_err());
        // A long pause refills no more than the burst.
        let t2 = t1 + Duration::from_secs(60);
        for _ in 0..3 {
            assert_eq!(limiter.check_at(a, t2), Ok(()));
        }
        assert!(limiter.check_at(a, t2).is_err());
    }
}
