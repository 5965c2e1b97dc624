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

/// How far the clock every instance shares (Redis's) reads ahead of this
/// host's wall clock, in milliseconds (negative: behind). Instants written
/// where other instances read them (an entry's times, a ban's, a
/// back-off's end) are moved onto the shared clock before they are
/// written and back onto this host's when read, so one host's wrong
/// clock never changes what another serves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClockShift(pub i64);

impl ClockShift {
    /// `local` on the shared clock.
    pub fn to_shared(self, local: SystemTime) -> SystemTime {
        moved(local, self.0)
    }

    /// `shared` on this host's clock.
    pub fn to_local(self, shared: SystemTime) -> SystemTime {
        moved(shared, self.0.saturating_neg())
    }
}

fn moved(t: SystemTime, ms: i64) -> SystemTime {
    let by = std::time::Duration::from_millis(ms.unsigned_abs());
    let moved = if ms >= 0 {
        t.checked_add(by)
    } else {
        t.checked_sub(by)
    };
    moved.unwrap_or(t)
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

    #[test]
    fn an_instant_moved_onto_the_shared_clock_comes_back_on_another_hosts() {
        let shared = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        // The writer runs 30 s ahead of Redis, the reader 30 s behind.
        let writer = ClockShift(-30_000);
        let reader = ClockShift(30_000);
        let written = shared + Duration::from_secs(30);
        assert_eq!(writer.to_shared(written), shared);
        assert_eq!(
            reader.to_local(writer.to_shared(written)),
            shared - Duration::from_secs(30)
        );
        assert_eq!(reader.to_shared(reader.to_local(shared)), shared);
    }
}
