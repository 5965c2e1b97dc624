//! A route's origin circuit: when most of a route's fetches fail, the route
//! stops sending its origin anything but one probe per `open_for`, and
//! corral answers from what it has (stale copies) or with a quick error.
//! It is the route-wide companion of the per-key back-off, counted over a
//! window of fetches (an error rate, not a run of failures: a busy route
//! with a few good keys still counts as failing). It only counts and
//! decides; it never performs a fetch, and its lock is never held across an
//! await.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// How a circuit decides.
#[derive(Debug, Clone, Copy)]
pub struct CircuitSettings {
    pub enabled: bool,
    /// Percentage of failed fetches in a window that opens it.
    pub error_rate: u8,
    /// A window with fewer fetches never opens it.
    pub min_fetches: u32,
    pub window: Duration,
    pub open_for: Duration,
}

/// Whether a fetch may go to the origin now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    Go,
    /// The circuit is open and this fetch is its probe: its result closes
    /// or re-opens it.
    Probe,
    /// The circuit is open: do not fetch.
    Refuse,
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    Closed,
    Open { until: Instant },
    Probing { since: Instant },
}

#[derive(Debug)]
struct State {
    phase: Phase,
    window_start: Instant,
    fetches: u32,
    failures: u32,
}

/// One route's circuit.
#[derive(Debug)]
pub struct Circuit {
    settings: CircuitSettings,
    state: Mutex<State>,
}

impl Circuit {
    pub fn new(settings: CircuitSettings) -> Self {
        Circuit {
            settings,
            state: Mutex::new(State {
                phase: Phase::Closed,
                window_start: Instant::now(),
                fetches: 0,
                failures: 0,
            }),
        }
    }

    /// Asks to send a fetch to the origin.
    pub fn allow(&self) -> Admission {
        if !self.settings.enabled {
            return Admission::Go;
        }
        let now = Instant::now();
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        match s.phase {
            Phase::Closed => Admission::Go,
            Phase::Open { until } if now < until => Admission::Refuse,
            // A probe that never reported (its fetch was cancelled) does
            // not keep the circuit shut: another goes after `open_for`.
            Phase::Probing { since } if now < since + self.settings.open_for => Admission::Refuse,
            Phase::Open { .. } | Phase::Probing { .. } => {
                s.phase = Phase::Probing { since: now };
                Admission::Probe
            }
        }
    }

    /// Reports how a fetch went (`ok`: the origin answered without a 5xx).
    pub fn record(&self, ok: bool) {
        if !self.settings.enabled {
            return;
        }
        let now = Instant::now();
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        match s.phase {
            Phase::Probing { .. } => {
                if ok {
                    s.phase = Phase::Closed;
                    s.window_start = now;
                    s.fetches = 0;
                    s.failures = 0;
                    tracing::info!("origin circuit closed: the probe succeeded");
                } else {
                    s.phase = Phase::Open {
                        until: now + self.settings.open_for,
                    };
                }
            }
            // Late results of fetches started before it opened.
            Phase::Open { .. } => {}
            Phase::Closed => {
                if now >= s.window_start + self.settings.window {
                    s.window_start = now;
                    s.fetches = 0;
                    s.failures = 0;
                }
                s.fetches += 1;
                if !ok {
                    s.failures += 1;
                }
                let rate = u64::from(self.settings.error_rate);
                if s.fetches >= self.settings.min_fetches
                    && u64::from(s.failures) * 100 >= rate * u64::from(s.fetches)
                {
                    tracing::warn!(
                        failures = s.failures,
                        fetches = s.fetches,
                        open_for = ?self.settings.open_for,
                        "origin circuit opened: most fetches fail"
                    );
                    s.phase = Phase::Open {
                        until: now + self.settings.open_for,
                    };
                }
            }
        }
    }

    /// True while fetches are refused (open, or waiting on its probe).
    pub fn is_open(&self) -> bool {
        !matches!(
            self.state
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .phase,
            Phase::Closed
        )
    }

    /// How long until the next probe may go, for a Retry-After.
    pub fn retry_after(&self) -> Duration {
        let now = Instant::now();
        match self
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .phase
        {
            Phase::Closed => Duration::ZERO,
            Phase::Open { until } => until.saturating_duration_since(now),
            Phase::Probing { since } => {
                (since + self.settings.open_for).saturating_duration_since(now)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn circuit() -> Circuit {
        Circuit::new(CircuitSettings {
            enabled: true,
            error_rate: 50,
            min_fetches: 4,
            window: Duration::from_secs(10),
            open_for: Duration::from_secs(5),
        })
    }

    #[tokio::test(start_paused = true)]
    async fn opens_on_the_error_rate_then_probes_once_per_period() {
        let c = circuit();
        for _ in 0..3 {
            c.record(false);
        }
        assert!(!c.is_open(), "3 fetches are below min_fetches");
        let c = circuit();
        for (ok, open) in [
            (true, false),
            (true, false),
            (true, false),
            (false, false), // 1 of 4
            (false, false), // 2 of 5
            (false, true),  // 3 of 6: 50%
        ] {
            assert_eq!(c.allow(), Admission::Go);
            c.record(ok);
            assert_eq!(c.is_open(), open);
        }
        assert_eq!(c.allow(), Admission::Refuse);
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(c.allow(), Admission::Probe);
        assert_eq!(c.allow(), Admission::Refuse, "one probe at a time");
        c.record(false);
        assert_eq!(c.allow(), Admission::Refuse, "a failed probe re-opens it");
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(c.allow(), Admission::Probe);
        c.record(true);
        assert!(!c.is_open());
        assert_eq!(c.allow(), Admission::Go);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_probe_is_replaced_and_old_windows_are_forgotten() {
        let c = circuit();
        for _ in 0..4 {
            c.record(false);
        }
        assert!(c.is_open());
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(c.allow(), Admission::Probe);
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(
            c.allow(),
            Admission::Probe,
            "the first probe never reported"
        );
        c.record(true);
        // Failures spread over windows never add up.
        for _ in 0..3 {
            c.record(false);
            tokio::time::advance(Duration::from_secs(4)).await;
        }
        assert!(!c.is_open());
    }
}
