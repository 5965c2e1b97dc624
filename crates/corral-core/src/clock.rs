//! The wall clock that freshness, back-off and stale windows are read
//! from. The server reads the system clock; tests read [`PausedClock`],
//! which moves only when tokio's paused time is advanced, so a test of
//! staleness advances time instead of sleeping through it.

use std::fmt::Debug;
use std::time::SystemTime;

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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
