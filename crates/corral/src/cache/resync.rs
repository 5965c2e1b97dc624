//! The pace at which unverified entries are revalidated. An entry is
//! unverified when it may have missed an invalidation: the instance was
//! not subscribed for a while and the invalidation log could not cover
//! the gap (Redis restarted empty). Dropping such entries would send every
//! instance's every hot key to the origin at once, which is what a Redis
//! restart used to do; instead each is served as before and, when asked
//! for, revalidated in the background (a conditional request where it has
//! validators), at most `redis.resync_rate` a second per instance. What
//! the rate leaves for later is revalidated on a later request, or
//! expires by its own freshness.

use std::sync::{Mutex, PoisonError};

use tokio::time::Instant;

/// A token bucket of revalidations: `rate` a second, bursts of `rate`.
#[derive(Debug)]
pub struct Pacer {
    rate: f64,
    state: Mutex<(f64, Instant)>,
}

impl Pacer {
    pub fn new(rate: u32) -> Self {
        let rate = f64::from(rate.max(1));
        Pacer {
            rate,
            state: Mutex::new((rate, Instant::now())),
        }
    }

    /// Takes one revalidation's turn, if one is free now.
    pub fn take(&self) -> bool {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        let (tokens, last) = *s;
        let tokens = (tokens + now.duration_since(last).as_secs_f64() * self.rate).min(self.rate);
        if tokens >= 1.0 {
            *s = (tokens - 1.0, now);
            true
        } else {
            *s = (tokens, now);
            false
        }
    }

    /// Returns a turn that was not used (the key was being refreshed
    /// already).
    pub fn give_back(&self) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.0 = (s.0 + 1.0).min(self.rate);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_pacer_grants_its_rate_a_second_after_a_burst_of_as_many() {
        let p = Pacer::new(5);
        assert_eq!((0..20).filter(|_| p.take()).count(), 5);
        tokio::time::advance(Duration::from_millis(400)).await;
        assert_eq!((0..20).filter(|_| p.take()).count(), 2);
        p.give_back();
        assert!(p.take());
        assert!(!p.take());
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(
            (0..20).filter(|_| p.take()).count(),
            5,
            "bursts stay capped"
        );
    }
}
