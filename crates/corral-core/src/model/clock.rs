//! The wall clock that freshness, back-off and stale windows are read
//! from. The server reads the system clock; unit tests read
//! [`PausedClock`], which moves only when tokio's paused time is advanced,
//! and end-to-end tests a [`ShiftedClock`] they move forward, so a test of
//! staleness advances time instead of sleeping through it.

use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

/// Where "now" comes from.
pub trait Clock: Send + Sync + Debug {
    fn now(&self) -> SystemTime;
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    #[inline]
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }
}

/// A wall clock that follows tokio's clock from a fixed start: under
/// `tokio::time::pause` it stands still until the test advances it.
#[derive(Debug, Clone, Copy)]
pub struct PausedClock {
    base: SystemTime,
    start: tokio::time::Instant,
}

impl PausedClock {
    /// Starts at the system's time now (build it inside the runtime).
    pub fn new() -> Self {
        PausedClock {
            base: SystemTime::now(),
            start: tokio::time::Instant::now(),
        }
    }
}

impl Default for PausedClock {
    fn default() -> Self {
        PausedClock::new()
    }
}

impl Clock for PausedClock {
    fn now(&self) -> SystemTime {
        self.base + self.start.elapsed()
    }
}

/// The system's wall clock, moved forward by what [`ShiftedClock::advance`]
/// added: the clock a server started for an end-to-end test
/// (`CORRAL_TEST_CLOCK=1`) reads, so that a TTL expires when the test says
/// rather than after a sleep. It never goes back.
#[derive(Debug, Default)]
pub struct ShiftedClock {
    ahead_ms: AtomicU64,
}

impl ShiftedClock {
    /// Moves the clock `by` forward.
    pub fn advance(&self, by: Duration) {
        let ms = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.ahead_ms.fetch_add(ms, Ordering::Relaxed);
    }

    /// How far ahead of the system's clock it is.
    pub fn ahead(&self) -> Duration {
        Duration::from_millis(self.ahead_ms.load(Ordering::Relaxed))
    }
}

impl Clock for ShiftedClock {
    fn now(&self) -> SystemTime {
        let now = SystemTime::now();
        now.checked_add(self.ahead()).unwrap_or(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shifted_clock_runs_ahead_by_what_was_added() {
        let clock = ShiftedClock::default();
        assert_eq!(clock.ahead(), Duration::ZERO);
        clock.advance(Duration::from_millis(1500));
        clock.advance(Duration::from_secs(2));
        assert_eq!(clock.ahead(), Duration::from_millis(3500));
        let ahead = clock
            .now()
            .duration_since(SystemTime::now())
            .expect("ahead of the system clock");
        assert!(ahead > Duration::from_secs(3) && ahead <= Duration::from_millis(3500));
    }

    #[tokio::test(start_paused = true)]
    async fn a_paused_clock_moves_only_with_tokio_time() {
        let clock = PausedClock::new();
        let t0 = clock.now();
        assert_eq!(clock.now(), t0);
        tokio::time::advance(Duration::from_secs(90)).await;
        assert_eq!(
            clock.now().duration_since(t0).expect("time moved forward"),
            Duration::from_secs(90)
        );
    }
}
