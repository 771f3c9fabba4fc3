//! Keyed rate limits (GCRA, from the `governor` crate): one bucket per key (an IP address, a
//! worker id), with keys that have been idle long enough to be full again forgotten by
//! [`KeyedLimit::forget_idle`], so that a stream of fresh keys cannot grow memory without bound.

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota};
use std::hash::Hash;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

pub struct KeyedLimit<K: Hash + Eq + Clone> {
    limiter: DefaultKeyedRateLimiter<K>,
    clock: DefaultClock,
}

impl<K: Hash + Eq + Clone> KeyedLimit<K> {
    /// A bucket of `burst` requests per key, refilled at `per_second` (which may be below 1:
    /// 6 per hour is `6.0 / 3600.0`).
    ///
    /// # Panics
    /// If `burst` is 0 or `per_second` is not positive and finite; settings are checked when
    /// they are parsed.
    pub fn new(burst: u32, per_second: f64) -> Self {
        assert!(
            per_second.is_finite() && per_second > 0.0,
            "rate must be positive"
        );
        let quota = Quota::with_period(Duration::from_secs_f64(1.0 / per_second))
            .expect("a positive period")
            .allow_burst(NonZeroU32::new(burst).expect("a burst of at least 1"));
        Self {
            limiter: DefaultKeyedRateLimiter::keyed(quota),
            clock: DefaultClock::default(),
        }
    }

    /// Takes one request from `key`'s bucket; on refusal, the whole seconds until one is free.
    pub fn check(&self, key: &K) -> Result<(), u64> {
        self.limiter.check_key(key).map_err(|not_until| {
            not_until
                .wait_time_from(self.clock.now())
                .as_secs_f64()
                .ceil()
                .max(1.0) as u64
        })
    }

    /// Forgets keys whose buckets are full again (they behave exactly like new keys).
    pub fn forget_idle(&self) {
        self.limiter.retain_recent();
        self.limiter.shrink_to_fit();
    }

    /// Keys currently remembered.
    pub fn len(&self) -> usize {
        self.limiter.len()
    }

    pub fn is_empty(&self) -> bool {
        self.limiter.is_empty()
    }

    /// Runs [`Self::forget_idle`] every `period`, for as long as the limit is in use.
    pub async fn forget_idle_every(self: Arc<Self>, period: Duration) {
        let mut ticker = tokio::time::interval(period);
        loop {
            ticker.tick().await;
            self.forget_idle();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_key_has_its_own_burst_and_idle_keys_are_forgotten() {
        let limit = KeyedLimit::new(3, 1000.0);
        for _ in 0..3 {
            assert_eq!(limit.check(&"a"), Ok(()));
        }
        assert!(limit.check(&"a").is_err());
        assert_eq!(limit.check(&"b"), Ok(()));
        assert_eq!(limit.len(), 2);
        // At 1000 per second both buckets are full again within a few milliseconds.
        std::thread::sleep(Duration::from_millis(20));
        limit.forget_idle();
        assert_eq!(limit.len(), 0);
    }

    #[test]
    fn a_refusal_says_how_long_to_wait() {
        let limit = KeyedLimit::new(1, 1.0 / 60.0);
        assert_eq!(limit.check(&1), Ok(()));
        let wait = limit.check(&1).unwrap_err();
        assert!((59..=60).contains(&wait), "{wait}");
        // A busy key is not forgotten.
        limit.forget_idle();
        assert_eq!(limit.len(), 1);
    }
}
