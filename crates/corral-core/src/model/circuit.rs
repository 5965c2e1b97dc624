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
//!
//! A fetch the origin leaves without an answer is counted before its
//! timeout ([`Circuit::suspect`]): once it has waited [`Circuit::hang_after`]
//! (twice the slowest answer of the last two windows, at least the
//! route's `stale_after`), as a failure of its caller. The count is taken
//! back when the answer comes, and an answer to a fetch counted this way
//! closes a circuit its window opened: the origin was slow, not gone.

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
    /// Which window this is: a [`Suspicion`] is taken back only in its own.
    window_id: u64,
    fetches: u32,
    failures: u32,
    /// Of the failures, fetches counted as hung while they waited.
    hung: u32,
    /// The callers whose [`Evidence::Failed`] this window counted.
    failed_callers: Vec<u64>,
    outage: Option<Outage>,
    /// The window whose suspected hangs opened the circuit, if any did.
    opened_on_hangs: Option<u64>,
    /// The slowest answer head of this window and of the one before; `None`
    /// until the origin has answered once.
    slowest: Option<Duration>,
    slowest_before: Option<Duration>,
}

/// A fetch counted as hung while it waited ([`Circuit::suspect`]): handed
/// back with [`Circuit::answered`] when its answer comes, kept when it
/// fails (its failure is already counted).
#[derive(Debug)]
#[must_use = "a suspected fetch that is answered is handed back"]
pub struct Suspicion {
    window: u64,
    caller: u64,
    /// False when the caller's failure was already counted this window:
    /// there is nothing to take back.
    counted: bool,
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
        self.window_id += 1;
        self.fetches = 0;
        self.failures = 0;
        self.hung = 0;
        self.failed_callers.clear();
        if self.slowest.is_some() {
            self.slowest_before = self.slowest.take();
        }
    }

    /// A new window when the current one is over.
    fn roll(&mut self, now: Instant, window: Duration) {
        if now >= self.window_start + window {
            self.reset(now);
        }
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
                window_id: 0,
                fetches: 0,
                failures: 0,
                hung: 0,
                failed_callers: Vec::new(),
                outage: None,
                opened_on_hangs: None,
                slowest: None,
                slowest_before: None,
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
                    self.close(&mut s, now, "origin circuit closed: the probe succeeded");
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
                s.roll(now, self.settings.window);
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
                self.open_if_failing(&mut s, now);
            }
        }
    }

    /// Closes the circuit, in a new window, with one line (`why`) that
    /// says how long it was open and how many probes failed meanwhile.
    fn close(&self, s: &mut State, now: Instant, why: &'static str) {
        s.phase = Phase::Closed;
        s.opened_on_hangs = None;
        s.reset(now);
        let outage = s.outage.take();
        tracing::info!(
            route = %self.route,
            upstream = %self.upstream,
            open_s = outage.map_or(0, |o| now.saturating_duration_since(o.since).as_secs()),
            failed_probes = outage.map_or(0, |o| o.failed_probes),
            "{why}"
        );
    }

    /// Opens the circuit when the window's failures reach the error rate.
    fn open_if_failing(&self, s: &mut State, now: Instant) {
        let rate = u64::from(self.settings.error_rate);
        if s.fetches < self.settings.min_fetches
            || u64::from(s.failures) * 100 < rate * u64::from(s.fetches)
        {
            return;
        }
        tracing::warn!(
            route = %self.route,
            upstream = %self.upstream,
            failures = s.failures,
            hung = s.hung,
            fetches = s.fetches,
            callers = s.failed_callers.len(),
            open_for = ?self.settings.open_for,
            "origin circuit opened: most fetches fail"
        );
        s.phase = Phase::Open {
            until: now + self.settings.open_for,
        };
        s.opened_on_hangs = (s.hung > 0).then_some(s.window_id);
        s.outage = Some(Outage {
            since: now,
            failed_probes: 0,
        });
    }

    /// How long a fetch may wait for its answer before it counts as hung
    /// ([`Circuit::suspect`]): twice the slowest answer of this window and
    /// the one before, and at least `floor`. `None` (not counted before its
    /// end) while the circuit is off or before the origin has answered.
    pub fn hang_after(&self, floor: Duration) -> Option<Duration> {
        if !self.settings.enabled {
            return None;
        }
        let s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let slowest = s.slowest.max(s.slowest_before)?;
        Some(floor.max(slowest.saturating_mul(2)))
    }

    /// An answer head came after `took`: what [`Circuit::hang_after`] is
    /// measured from.
    pub fn answered_in(&self, took: Duration) {
        let now = Instant::now();
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.roll(now, self.settings.window);
        s.slowest = Some(s.slowest.map_or(took, |d| d.max(took)));
    }

    /// Counts a fetch that has waited [`Circuit::hang_after`] with no
    /// answer as a failure of `caller` now, rather than at its timeout.
    /// `None` when nothing was counted: the circuit is not closed (a probe
    /// reports at its end).
    pub fn suspect(&self, caller: u64) -> Option<Suspicion> {
        if !self.settings.enabled {
            return None;
        }
        let now = Instant::now();
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if !matches!(s.phase, Phase::Closed) {
            return None;
        }
        s.roll(now, self.settings.window);
        let counted = !s.failed_callers.contains(&caller);
        if counted {
            if s.failed_callers.len() < CALLERS_PER_WINDOW {
                s.failed_callers.push(caller);
            }
            s.fetches += 1;
            s.failures += 1;
            s.hung += 1;
            self.open_if_failing(&mut s, now);
        }
        Some(Suspicion {
            window: s.window_id,
            caller,
            counted,
        })
    }

    /// The suspected fetch was answered: its failure is taken back (the
    /// fetch then reports like any other, with [`Circuit::record`]), and a
    /// circuit that its window's hangs opened closes: the origin answers.
    pub fn answered(&self, suspicion: Suspicion) {
        if !suspicion.counted {
            return;
        }
        let now = Instant::now();
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        match s.phase {
            Phase::Closed if s.window_id == suspicion.window => {
                s.fetches = s.fetches.saturating_sub(1);
                s.failures = s.failures.saturating_sub(1);
                s.hung = s.hung.saturating_sub(1);
                s.failed_callers.retain(|c| *c != suspicion.caller);
            }
            Phase::Open { .. } | Phase::Probing { .. }
                if s.opened_on_hangs == Some(suspicion.window) =>
            {
                let why = "origin circuit closed: a fetch counted as hung was answered";
                self.close(&mut s, now, why);
            }
            _ => {}
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
    /// Fetches of distinct callers that wait past `hang_after`, as the gate
    /// counts them.
    fn suspects(c: &Circuit, callers: std::ops::RangeInclusive<u64>) -> Vec<Suspicion> {
        callers.filter_map(|caller| c.suspect(caller)).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_fetch_waits_twice_the_slowest_recent_answer_before_it_counts_as_hung() {
        let c = circuit();
        let floor = Duration::from_millis(500);
        assert_eq!(c.hang_after(floor), None, "no answer yet: nothing to go by");
        c.answered_in(Duration::from_millis(10));
        assert_eq!(c.hang_after(floor), Some(floor));
        c.answered_in(Duration::from_secs(2));
        assert_eq!(c.hang_after(floor), Some(Duration::from_secs(4)));
        // The slow answer is remembered for one more window, then dropped.
        tokio::time::advance(Duration::from_secs(10)).await;
        c.answered_in(Duration::from_millis(10));
        assert_eq!(c.hang_after(floor), Some(Duration::from_secs(4)));
        tokio::time::advance(Duration::from_secs(10)).await;
        c.answered_in(Duration::from_millis(10));
        assert_eq!(c.hang_after(floor), Some(floor));
        let off = Circuit::new(CircuitSettings {
            enabled: false,
            ..c.settings
        });
        off.answered_in(Duration::from_millis(10));
        assert_eq!(off.hang_after(floor), None);
    }

    #[tokio::test(start_paused = true)]
    async fn hung_fetches_of_distinct_callers_open_it_before_they_time_out() {
        let c = circuit();
        let held = suspects(&c, 1..=3);
        assert!(!c.is_open(), "3 fetches are below min_fetches");
        let more = suspects(&c, 4..=4);
        assert!(c.is_open(), "4 hung of 4");
        assert_eq!(c.allow(), Admission::Refuse);
        // Their timeouts, later, are not counted twice (the gate records
        // nothing for a fetch it counted as hung), and nothing is taken back.
        drop((held, more));
        assert!(c.is_open());
    }

    #[tokio::test(start_paused = true)]
    async fn one_callers_hung_fetches_are_one_piece_of_evidence_a_window() {
        let c = circuit();
        let attacker: Vec<_> = (0..25).filter_map(|_| c.suspect(7)).collect();
        assert_eq!(attacker.len(), 25);
        c.record(Evidence::Healthy);
        c.record(Evidence::Healthy);
        c.record(Evidence::Healthy);
        assert!(!c.is_open(), "one caller's 25 hangs count once");
        // Answering one of its uncounted fetches takes nothing back.
        let mut attacker = attacker.into_iter();
        for s in attacker.by_ref().skip(1) {
            c.answered(s);
        }
        c.record(Evidence::Failed { caller: 8 });
        assert!(!c.is_open(), "2 failures of 5");
        c.record(Evidence::Failed { caller: 9 });
        assert!(c.is_open(), "3 failures of 6: the first hang still counts");
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_answer_takes_its_hang_back() {
        let c = circuit();
        // Three callers' fetches wait long, then are answered: slow, not
        // gone. Their counts are taken back before anything else reports.
        for s in suspects(&c, 1..=3) {
            c.answered(s);
            c.record(Evidence::Healthy);
        }
        c.record(Evidence::Failed { caller: 4 });
        assert!(!c.is_open(), "1 failure of 4");
        // A count from an earlier window is not taken from this one.
        let old = suspects(&c, 5..=5);
        tokio::time::advance(Duration::from_secs(10)).await;
        for caller in 6..=8 {
            c.record(Evidence::Failed { caller });
        }
        c.answered(old.into_iter().next().expect("a suspicion"));
        c.record(Evidence::Healthy);
        assert!(c.is_open(), "3 failures of 4 in the new window");
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_to_a_fetch_counted_as_hung_closes_the_circuit_it_opened() {
        let c = circuit();
        let mut held = suspects(&c, 1..=4);
        assert!(c.is_open());
        c.answered(held.pop().expect("a suspicion"));
        assert!(!c.is_open(), "the origin answers: it was slow, not gone");
        assert_eq!(c.allow(), Admission::Go);
        // A hang of an earlier window closes nothing it did not open.
        let c = circuit();
        let old = suspects(&c, 1..=1);
        tokio::time::advance(Duration::from_secs(10)).await;
        for _ in 0..4 {
            c.record(Evidence::Unreachable);
        }
        assert!(c.is_open());
        for s in old {
            c.answered(s);
        }
        assert!(c.is_open());
    }
}
