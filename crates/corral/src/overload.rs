//! Overload: what corral does when it is offered more than it can serve
//! (`server.overload`, 90% by default, `off` to turn it off).
//!
//! **The signal** is the share of time the threads that serve clients were
//! busy: tokio's busy time per worker, summed over every serving runtime
//! (one with `shared`, one per worker with `per_core`) and sampled every
//! [`TICK`]. Under HTTP/1.1 an overloaded server's queue is outside it:
//! each connection has one request in flight and the rest wait in the
//! clients and in the kernel, so corral's own run queue stays short and
//! its lag says little. Busy time does see it: a thread that never parks
//! is busy whether it runs or waits for a core (a noisy neighbour, a
//! cgroup quota). CPU work a fill hands to the CPU pool (`cache::cpu`:
//! compression, decoding, digest checks, large copies) runs on tokio's
//! blocking threads, which this signal does not read: a large compressed
//! fill cannot make corral shed connections.
//!
//! **Shedding** starts once that share has stayed at or above the
//! threshold for [`ENTER_AFTER`] ticks (a second) and stops once it has
//! stayed below for [`LEAVE_AFTER`] (half a second). Like Envoy's overload
//! manager, corral then turns away new work, never work it has taken on,
//! and only work that does not pay for itself:
//! - **Passed-through requests** (what is never stored: other methods,
//!   hit-for-pass keys, uncached routes) get 503 with `Retry-After: 1`
//!   and `Proxy-Status`, and the origin is not asked.
//! - **New connections**: one accepted while shedding answers each of its
//!   requests with the same 503 and `Connection: close` (HTTP/2: a
//!   GOAWAY), without routing them, so the clients already served keep
//!   their pace and a load balancer can send the new ones elsewhere.
//! - **Fills go on.** A miss that would be stored is what turns the next
//!   requests into hits: `bench/overload.sh` measured that shedding them
//!   under a hit-bound overload served 19% fewer answers (47,278 against
//!   58,042 req/s, one in ten a miss on a new key), because the shed keys
//!   stayed misses, and gained no latency (a lone client's miss took 8 ms
//!   when fetched). Hits, stale answers and waiters are served as before;
//!   the origin keeps its own bounds (`upstream_concurrency`, back-off,
//!   the circuit).
//!
//! Passes are turned away in `http::proxy`, connections where they are
//! accepted (`http::connection`); both are answered by
//! `http::refusal::overloaded`. The admin listener never sheds.
//! `corral_overloaded`, `corral_overload_busy_ratio` and
//! `corral_overload_shed_total{what}` (pass, connection)
//! show it; entering and leaving are logged.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// How often the busy share is sampled.
pub const TICK: Duration = Duration::from_millis(250);
/// Ticks at or above the threshold before shedding starts.
pub const ENTER_AFTER: u32 = 4;
/// Ticks below the threshold before it stops.
pub const LEAVE_AFTER: u32 = 2;

/// True while corral sheds.
static SHEDDING: AtomicBool = AtomicBool::new(false);

/// The runtimes whose threads serve clients.
static SERVING: Mutex<Vec<tokio::runtime::Handle>> = Mutex::new(Vec::new());

/// True while corral sheds new work (one relaxed load).
pub fn shedding() -> bool {
    SHEDDING.load(Ordering::Relaxed)
}

/// Counts the calling runtime's threads as serving clients.
pub fn serving_here() {
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        SERVING
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(handle);
    }
}

/// Whether to shed, from one busy share per tick.
#[derive(Debug, Clone)]
pub struct Judge {
    threshold: f64,
    /// Ticks in a row on the other side of the threshold.
    run: u32,
    overloaded: bool,
}

impl Judge {
    pub fn new(threshold: f64) -> Self {
        Judge {
            threshold,
            run: 0,
            overloaded: false,
        }
    }

    /// One tick's busy share (0 to 1); the new state when it changes.
    pub fn observe(&mut self, busy: f64) -> Option<bool> {
        let over = busy >= self.threshold;
        if over == self.overloaded {
            self.run = 0;
            return None;
        }
        self.run += 1;
        let needed = if self.overloaded {
            LEAVE_AFTER
        } else {
            ENTER_AFTER
        };
        if self.run < needed {
            return None;
        }
        self.run = 0;
        self.overloaded = over;
        Some(over)
    }
}

/// The busy share over the last [`ENTER_AFTER`] ticks (a second), not
/// one tick's: tokio adds a worker's busy time to its total only when the
/// worker parks or every so many task polls, so a worker that never parks
/// (one connection's pipelined requests answered in one poll after
/// another) shows a tick of nothing, then several ticks' busy time at once.
/// Over a second those even out; one tick alone read 0% three ticks in
/// four for a worker busy throughout, and never shed.
#[derive(Debug, Default)]
struct Window {
    /// (busy seconds, capacity seconds) per tick, oldest first.
    ticks: std::collections::VecDeque<(f64, f64)>,
}

impl Window {
    /// Adds one tick and gives the share over the window (0 to 1).
    fn share(&mut self, busy: f64, capacity: f64) -> f64 {
        if self.ticks.len() == ENTER_AFTER as usize {
            self.ticks.pop_front();
        }
        self.ticks.push_back((busy, capacity));
        let (busy, capacity) = self
            .ticks
            .iter()
            .fold((0.0, 0.0), |(b, c), (tb, tc)| (b + tb, c + tc));
        if capacity <= 0.0 {
            return 0.0;
        }
        (busy / capacity).clamp(0.0, 1.0)
    }
}

/// Busy time of every serving thread so far, and how many there are.
fn busy_so_far() -> (Duration, usize) {
    let serving = SERVING.lock().unwrap_or_else(PoisonError::into_inner);
    let mut busy = Duration::ZERO;
    let mut workers = 0;
    for handle in serving.iter() {
        let metrics = handle.metrics();
        for worker in 0..metrics.num_workers() {
            busy += metrics.worker_total_busy_duration(worker);
            workers += 1;
        }
    }
    (busy, workers)
}

/// Samples the busy share every [`TICK`] (`corral_overload_busy_ratio`)
/// and sheds past `threshold` (a share from 0 to 1); `None`: never sheds.
pub fn spawn(threshold: Option<f64>) {
    crate::telemetry::metrics::overloaded(false);
    tokio::spawn(async move {
        let mut judge = threshold.map(Judge::new);
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last: Option<(tokio::time::Instant, Duration, usize)> = None;
        let mut window = Window::default();
        let mut shed_since: Option<tokio::time::Instant> = None;
        loop {
            tick.tick().await;
            let now = tokio::time::Instant::now();
            let (busy, workers) = busy_so_far();
            let before = last.replace((now, busy, workers));
            // The first sample, or a worker that joined since: a baseline.
            let Some((then, busy_then, workers_then)) = before else {
                continue;
            };
            if workers_then != workers || workers == 0 {
                window = Window::default();
                continue;
            }
            let capacity = now.duration_since(then).as_secs_f64() * workers as f64;
            if capacity <= 0.0 {
                continue;
            }
            let share = window.share(busy.saturating_sub(busy_then).as_secs_f64(), capacity);
            crate::telemetry::metrics::overload_busy(share);
            let Some(judge) = judge.as_mut() else {
                continue;
            };
            match judge.observe(share) {
                Some(true) => {
                    SHEDDING.store(true, Ordering::Relaxed);
                    crate::telemetry::metrics::overloaded(true);
                    shed_since = Some(now);
                    tracing::warn!(
                        busy = format!("{:.0}%", share * 100.0),
                        threshold = format!("{:.0}%", judge.threshold * 100.0),
                        "overloaded: the serving threads stayed busy past server.overload; passed-through requests and new connections get 503 until they are not"
                    );
                }
                Some(false) => {
                    SHEDDING.store(false, Ordering::Relaxed);
                    crate::telemetry::metrics::overloaded(false);
                    let lasted = shed_since.take().map(|s| now.duration_since(s));
                    tracing::warn!(lasted = ?lasted, "no longer overloaded: new work is taken on again");
                }
                None => {}
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn busy_time_reported_in_lumps_reads_as_the_busy_it_was() {
        // A worker busy throughout whose busy time reaches tokio's total
        // once every fourth tick (as measured under a pipelined load).
        let mut window = Window::default();
        let mut judge = Judge::new(0.5);
        let mut entered = None;
        for tick in 0..16 {
            let busy = if tick % 4 == 3 { 1.0 } else { 0.0 };
            let share = window.share(busy, 0.25);
            if tick >= 3 {
                assert!(share >= 0.99, "tick {tick}: {share}");
            }
            if judge.observe(share) == Some(true) {
                entered.get_or_insert(tick);
            }
        }
        assert!(entered.is_some(), "never shed");
        // An idle second reads as idle.
        for _ in 0..4 {
            window.share(0.0, 0.25);
        }
        assert_eq!(window.share(0.0, 0.25), 0.0);
    }

    #[test]
    fn sheds_after_a_busy_second_and_stops_after_a_quiet_half_second() {
        let mut j = Judge::new(0.9);
        // Three busy ticks and a quiet one: not yet, and the count starts over.
        for busy in [0.95, 1.0, 0.92] {
            assert_eq!(j.observe(busy), None);
        }
        assert_eq!(j.observe(0.5), None);
        for _ in 0..ENTER_AFTER - 1 {
            assert_eq!(j.observe(0.9), None);
        }
        assert_eq!(j.observe(0.99), Some(true));
        // Still busy: no change; one quiet tick is not enough.
        assert_eq!(j.observe(1.0), None);
        assert_eq!(j.observe(0.2), None);
        assert_eq!(j.observe(0.95), None);
        assert_eq!(j.observe(0.2), None);
        assert_eq!(j.observe(0.89), Some(false));
    }

    proptest! {
        /// Whatever the shares, the state changes only after a full run
        /// on the other side of the threshold, and always to that side.
        #[test]
        fn changes_only_after_a_full_run(shares in proptest::collection::vec(0.0f64..=1.0, 0..200)) {
            let mut j = Judge::new(0.8);
            let mut state = false;
            let mut run = 0u32;
            for share in shares {
                let over = share >= 0.8;
                run = if over == state { 0 } else { run + 1 };
                let needed = if state { LEAVE_AFTER } else { ENTER_AFTER };
                let changed = j.observe(share);
                if run >= needed {
                    prop_assert_eq!(changed, Some(over));
                    state = over;
                    run = 0;
                } else {
                    prop_assert_eq!(changed, None);
                }
            }
        }
    }
}
