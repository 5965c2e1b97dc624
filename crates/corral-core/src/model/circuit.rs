//! A route's origin circuit: when most of a route's fetches fail, the route
//! stops sending its origin anything but one probe per `open_for`, and
//! corral answers from what it has (stale copies) or with a quick error.
//! It is the route-wide companion of the per-key back-off, counted over a
//! window of fetches (an error rate, not a run of failures: a busy route
//! with a few good keys still counts as failing). It only counts and
//! decides; it never performs a fetch, and its lock is never held across an
//! await.
//!
//! The circuit is shared by every caller of the route, so what opens it
//! must be evidence about the origin, not about one client's requests
//! ([`Evidence`]): an origin that cannot be reached counts whoever asked;
//! a failed answer (a timeout, a 502/503/504) counts once per caller in a
//! window, so one client's requests cannot outvote everyone else's; and an
//! answer the application made (a 500 on a field it chokes on) shows a
//! live origin, so it counts as healthy.

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

/// What one fetch says about the origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Evidence {
    /// The origin answered (a 500 included: the application is up).
    Healthy,
    /// The origin could not be used, whatever was asked: no connection
    /// (refused, timed out, TLS failed).
    Unreachable,
    /// A failure the request itself may have provoked (a timeout, a
    /// 502/503/504 answer), for this caller ([`crate::callers::client_addr::caller_group`]).
    Failed { caller: u64 },
}

/// Callers whose failures a window remembers; beyond it a window's
/// failures are counted without a caller (the window is busy enough that
/// one caller's share is small).
const CALLERS_PER_WINDOW: usize = 64;

#[derive(Debug, Clone, Copy)]
enum Phase {
    Closed,
    Open { until: Instant },
    Probing { since: Instant },
}

/// Since when a circuit has been open, and how many probes failed since:
/// told once, when it closes, rather than a line per failed probe.
#[derive(Debug, Clone, Copy)]
struct Outage {
    since: Instant,
    failed_probes: u32,
}

#[derive(Debug)]
struct State {
    phase: Phase,
    window_start: Instant,
    fetches: u32,
    failures: u32,
    /// The callers whose [`Evidence::Failed`] this window counted.
    failed_callers: Vec<u64>,
    outage: Option<Outage>,
}

/// One route's circuit.
#[derive(Debug)]
pub struct Circuit {
    settings: CircuitSettings,
    state: Mutex<State>,
    /// The route and the upstream its lines name.
    route: String,
    upstream: String,
}

impl State {
    /// A new window from `now`.
    fn reset(&mut self, now: Instant) {
        self.window_start = now;
        self.fetches = 0;
        self.failures = 0;
        self.failed_callers.clear();
    }
}

impl Circuit {
    pub fn new(settings: CircuitSettings) -> Self {
        Self::named(settings, "", "")
    }

    /// A circuit whose log lines name its route and upstream.
    pub fn named(settings: CircuitSettings, route: &str, upstream: &str) -> Self {
        Circuit {
            settings,
            route: route.to_owned(),
            upstream: upstream.to_owned(),
            state: Mutex::new(State {
                phase: Phase::Closed,
                window_start: Instant::now(),
                fetches: 0,
                failures: 0,
                failed_callers: Vec::new(),
                outage: None,
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

    /// Reports what a fetch said about the origin.
    pub fn record(&self, evidence: Evidence) {
        if !self.settings.enabled {
            return;
        }
        let now = Instant::now();
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let ok = evidence == Evidence::Healthy;
        match s.phase {
            Phase::Probing { .. } => {
                if ok {
                    s.phase = Phase::Closed;
                    s.reset(now);
                    let outage = s.outage.take();
                    tracing::info!(
                        route = %self.route,
                        upstream = %self.upstream,
                        open_s = outage.map_or(0, |o| now.saturating_duration_since(o.since).as_secs()),
                        failed_probes = outage.map_or(0, |o| o.failed_probes),
                        "origin circuit closed: the probe succeeded"
                    );
                } else {
                    // Still open: counted for the line that closes it, not
                    // a line per probe.
                    if let Some(o) = &mut s.outage {
                        o.failed_probes += 1;
                    }
                    s.phase = Phase::Open {
                        until: now + self.settings.open_for,
                    };
                }
            }
            // Late results of fetches started before it opened.
            Phase::Open { .. } => {}
            Phase::Closed => {
                if now >= s.window_start + self.settings.window {
                    s.reset(now);
                }
                if let Evidence::Failed { caller } = evidence {
                    // One caller's failures are one piece of evidence a
                    // window: its further ones count neither way.
                    if s.failed_callers.contains(&caller) {
                        return;
                    }
                    if s.failed_callers.len() < CALLERS_PER_WINDOW {
                        s.failed_callers.push(caller);
                    }
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
                        route = %self.route,
                        upstream = %self.upstream,
                        failures = s.failures,
                        fetches = s.fetches,
                        callers = s.failed_callers.len(),
                        open_for = ?self.settings.open_for,
                        "origin circuit opened: most fetches fail"
                    );
                    s.phase = Phase::Open {
                        until: now + self.settings.open_for,
                    };
                    s.outage = Some(Outage {
                        since: now,
                        failed_probes: 0,
                    });
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

    impl Circuit {
        /// The tests' shorthand: healthy, or unreachable.
        fn record_ok(&self, ok: bool) {
            self.record(if ok {
                Evidence::Healthy
            } else {
                Evidence::Unreachable
            });
        }
    }

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
            c.record_ok(false);
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
            c.record_ok(ok);
            assert_eq!(c.is_open(), open);
        }
        assert_eq!(c.allow(), Admission::Refuse);
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(c.allow(), Admission::Probe);
        assert_eq!(c.allow(), Admission::Refuse, "one probe at a time");
        c.record_ok(false);
        assert_eq!(c.allow(), Admission::Refuse, "a failed probe re-opens it");
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(c.allow(), Admission::Probe);
        c.record_ok(true);
        assert!(!c.is_open());
        assert_eq!(c.allow(), Admission::Go);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_probe_is_replaced_and_old_windows_are_forgotten() {
        let c = circuit();
        for _ in 0..4 {
            c.record_ok(false);
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
        c.record_ok(true);
        // Failures spread over windows never add up.
        for _ in 0..3 {
            c.record_ok(false);
            tokio::time::advance(Duration::from_secs(4)).await;
        }
        assert!(!c.is_open());
    }

    #[tokio::test(start_paused = true)]
    async fn one_callers_failures_are_one_piece_of_evidence_a_window() {
        let c = circuit();
        let attacker = 7;
        for _ in 0..25 {
            c.record(Evidence::Failed { caller: attacker });
        }
        assert!(!c.is_open(), "25 failures of one caller count once");
        // The victims' fetches go on and keep it closed.
        for _ in 0..5 {
            assert_eq!(c.allow(), Admission::Go);
            c.record(Evidence::Healthy);
        }
        assert!(!c.is_open());
        // Failures from distinct callers are the origin's: 3 of 4 opens.
        let c = circuit();
        c.record(Evidence::Healthy);
        for caller in 1..=3 {
            c.record(Evidence::Failed { caller });
        }
        assert!(c.is_open());
        // A new window forgets who failed.
        let c = circuit();
        c.record(Evidence::Failed { caller: attacker });
        tokio::time::advance(Duration::from_secs(10)).await;
        for _ in 0..3 {
            c.record(Evidence::Failed { caller: attacker });
        }
        c.record(Evidence::Healthy);
        c.record(Evidence::Healthy);
        c.record(Evidence::Healthy);
        assert!(!c.is_open(), "1 failure of 4 in the new window");
    }

    #[tokio::test(start_paused = true)]
    async fn an_unreachable_origin_counts_whoever_asked() {
        let c = circuit();
        for _ in 0..4 {
            c.record(Evidence::Unreachable);
        }
        assert!(c.is_open());
    }
}
