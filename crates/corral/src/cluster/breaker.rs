//! A circuit breaker for Redis calls: after enough consecutive failures it
//! stops calls for a while, then lets a single probe decide whether to resume.
//! It only counts and decides; it never performs, retries or waits for a call,
//! and its lock is never held across an `.await`.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// Longer open periods are cut to this, so adding one to an instant cannot overflow.
const MAX_OPEN_FOR: Duration = Duration::from_secs(365 * 86_400);

/// Where the breaker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls go through; consecutive failures are counted.
    Closed,
    /// Calls are refused until the open period ends.
    Open,
    /// One probe call is out; its result closes or re-opens the breaker.
    HalfOpen,
}

/// Consecutive-failure circuit breaker, shared by every Redis caller.
///
/// Results are not tied to the `allow()` that admitted them: a success
/// reported while half-open closes the breaker, a failure re-opens it,
/// whichever call it came from. Results reported while open are ignored, so
/// late answers from calls started before it opened do not extend the open
/// period.
#[derive(Debug)]
pub struct Breaker {
    failures: u32,
    open_for: Duration,
    inner: Mutex<Inner>,
    /// What it guards, for its log lines: `redis`, or a cluster primary's
    /// address.
    name: String,
}

#[derive(Debug)]
struct Inner {
    phase: Phase,
    opened: u64,
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    Closed {
        failures: u32,
    },
    Open {
        until: Instant,
    },
    /// A probe was let through at `since`. If it never reports (its caller
    /// was cancelled), another probe is allowed `open_for` later, so the
    /// breaker cannot stay half-open forever.
    HalfOpen {
        since: Instant,
    },
}

/// A state change to log once the lock is released.
enum Change {
    Opened { after_failures: Option<u32> },
    Closed,
}

impl Breaker {
    /// Opens after `failures` consecutive failures (at least 1 is used) and
    /// stays open for `open_for` (at most a year) before letting a probe through.
    #[cfg(test)]
    pub fn new(failures: u32, open_for: Duration) -> Self {
        Self::named(failures, open_for, "redis")
    }

    /// A breaker whose log lines name what it guards.
    pub fn named(failures: u32, open_for: Duration, name: &str) -> Self {
        Breaker {
            failures: failures.max(1),
            open_for: open_for.min(MAX_OPEN_FOR),
            inner: Mutex::new(Inner {
                phase: Phase::Closed { failures: 0 },
                opened: 0,
            }),
            name: name.to_owned(),
        }
    }

    /// Whether a call may be made now. While half-open, exactly one caller
    /// gets `true`: the probe, which must report `success()` or `failure()`.
    pub fn allow(&self) -> bool {
        let now = Instant::now();
        let mut inner = self.lock();
        match inner.phase {
            Phase::Closed { .. } => true,
            Phase::Open { until } if now >= until => {
                inner.phase = Phase::HalfOpen { since: now };
                true
            }
            Phase::Open { .. } => false,
            Phase::HalfOpen { since } if now >= since + self.open_for => {
                inner.phase = Phase::HalfOpen { since: now };
                true
            }
            Phase::HalfOpen { .. } => false,
        }
    }

    /// Reports a call that succeeded.
    pub fn success(&self) {
        let change = {
            let mut inner = self.lock();
            match inner.phase {
                Phase::Closed { .. } => {
                    inner.phase = Phase::Closed { failures: 0 };
                    None
                }
                Phase::HalfOpen { .. } => {
                    inner.phase = Phase::Closed { failures: 0 };
                    Some(Change::Closed)
                }
                Phase::Open { .. } => None,
            }
        };
        self.log(change);
    }

    /// A check of its own, outside the guarded calls, found Redis
    /// answering again (the subscriber reconnected and read the
    /// invalidation log): an open breaker closes now instead of at the end
    /// of its period, so the instances share through Redis again within
    /// the reconnect, not `open_for` later.
    pub fn answered_again(&self) {
        let change = {
            let mut inner = self.lock();
            match inner.phase {
                Phase::Closed { .. } => None,
                Phase::Open { .. } | Phase::HalfOpen { .. } => {
                    inner.phase = Phase::Closed { failures: 0 };
                    Some(Change::Closed)
                }
            }
        };
        self.log(change);
    }

    /// Reports a call that failed (error or timeout).
    pub fn failure(&self) {
        let now = Instant::now();
        let change = {
            let mut inner = self.lock();
            let change = match inner.phase {
                Phase::Closed { failures } => {
                    let failures = failures.saturating_add(1);
                    if failures >= self.failures {
                        Some(Change::Opened {
                            after_failures: Some(failures),
                        })
                    } else {
                        inner.phase = Phase::Closed { failures };
                        None
                    }
                }
                Phase::HalfOpen { .. } => Some(Change::Opened {
                    after_failures: None,
                }),
                Phase::Open { .. } => None,
            };
            if change.is_some() {
                inner.phase = Phase::Open {
                    until: now + self.open_for,
                };
                inner.opened = inner.opened.saturating_add(1);
            }
            change
        };
        self.log(change);
    }

    /// The current state. An open breaker whose period has passed still
    /// reads `Open` until `allow()` lets the probe through.
    pub fn state(&self) -> BreakerState {
        match self.lock().phase {
            Phase::Closed { .. } => BreakerState::Closed,
            Phase::Open { .. } => BreakerState::Open,
            Phase::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    /// What it guards, as its log lines name it.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn subject(&self) -> crate::telemetry::repeats::Subject {
        crate::telemetry::repeats::Subject::Redis(self.name.clone())
    }

    /// Total times it opened (for metrics/logs).
    pub fn opened_count(&self) -> u64 {
        self.lock().opened
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Nothing can panic while the lock is held, and the state stays
        // consistent even if something did: keep going rather than propagate.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn log(&self, change: Option<Change>) {
        let open_for_ms = u64::try_from(self.open_for.as_millis()).unwrap_or(u64::MAX);
        match change {
            Some(Change::Opened {
                after_failures: Some(failures),
            }) => tracing::warn!(
                failures,
                open_for_ms,
                redis = %self.name,
                "redis circuit breaker opened after consecutive failures"
            ),
            // A Redis that stays down fails a probe every `open_for`: the
            // first is logged, the rest counted (`telemetry::repeats`).
            Some(Change::Opened {
                after_failures: None,
            }) if crate::telemetry::repeats::first(REOPENED, self.subject(), "") => {
                tracing::warn!(open_for_ms, redis = %self.name, "{REOPENED}");
            }

            Some(Change::Closed) => {
                crate::telemetry::repeats::ended(REOPENED, &self.subject());
                tracing::info!(redis = %self.name, "redis circuit breaker closed: the probe succeeded");
            }
            // A probe failed again, already counted; or nothing changed.
            Some(Change::Opened { .. }) | None => {}
        }
    }
}

const REOPENED: &str = "redis circuit breaker re-opened: the probe failed";

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    const OPEN_FOR: Duration = Duration::from_secs(2);

    fn opened(failures: u32) -> Breaker {
        let breaker = Breaker::new(failures, OPEN_FOR);
        for _ in 0..failures {
            breaker.failure();
        }
        assert_eq!(breaker.state(), BreakerState::Open);
        breaker
    }

    #[tokio::test(start_paused = true)]
    async fn redis_answering_again_closes_an_open_breaker_at_once() {
        let breaker = opened(2);
        assert!(!breaker.allow());
        breaker.answered_again();
        assert_eq!(breaker.state(), BreakerState::Closed);
        assert!(breaker.allow());
        // Closed with no failures counted: it takes `failures` again.
        breaker.failure();
        assert_eq!(breaker.state(), BreakerState::Closed);
        breaker.failure();
        assert_eq!(breaker.state(), BreakerState::Open);
        assert_eq!(breaker.opened_count(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_n_consecutive_failures_and_not_before() {
        let breaker = Breaker::new(3, OPEN_FOR);
        for _ in 0..2 {
            assert!(breaker.allow());
            breaker.failure();
            assert_eq!(breaker.state(), BreakerState::Closed);
        }
        assert!(breaker.allow());
        breaker.failure();
        assert_eq!(breaker.state(), BreakerState::Open);
        assert!(!breaker.allow());
        assert_eq!(breaker.opened_count(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_success_resets_the_failure_count() {
        let breaker = Breaker::new(3, OPEN_FOR);
        breaker.failure();
        breaker.failure();
        breaker.success();
        breaker.failure();
        breaker.failure();
        assert_eq!(breaker.state(), BreakerState::Closed);
        breaker.failure();
        assert_eq!(breaker.state(), BreakerState::Open);
    }

    #[tokio::test(start_paused = true)]
    async fn open_rejects_until_open_for_passes() {
        let breaker = opened(2);
        tokio::time::advance(OPEN_FOR - Duration::from_millis(1)).await;
        assert!(!breaker.allow());
        assert_eq!(breaker.state(), BreakerState::Open);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(breaker.allow());
        assert_eq!(breaker.state(), BreakerState::HalfOpen);
    }

    #[tokio::test(start_paused = true)]
    async fn half_open_lets_exactly_one_probe_through_concurrent_callers() {
        let breaker = Arc::new(opened(1));
        tokio::time::advance(OPEN_FOR).await;
        let callers: Vec<_> = (0..16)
            .map(|_| {
                let breaker = Arc::clone(&breaker);
                tokio::spawn(async move { breaker.allow() })
            })
            .collect();
        let mut admitted = 0;
        for caller in callers {
            if caller.await.expect("caller task") {
                admitted += 1;
            }
        }
        assert_eq!(admitted, 1);
        assert_eq!(breaker.state(), BreakerState::HalfOpen);
    }

    /// Real parallelism: threads racing on a paused clock, so the probe
    /// can neither report nor time out while they race.
    #[test]
    fn half_open_admits_one_probe_across_threads() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("runtime");
        let breaker = {
            let _guard = runtime.enter();
            opened(1)
        };
        runtime.block_on(tokio::time::advance(OPEN_FOR));
        let admitted: usize = std::thread::scope(|scope| {
            let threads: Vec<_> = (0..8)
                .map(|_| {
                    let breaker = &breaker;
                    let handle = runtime.handle().clone();
                    scope.spawn(move || {
                        let _guard = handle.enter();
                        (0..1000).filter(|_| breaker.allow()).count()
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().expect("thread")).sum()
        });
        assert_eq!(admitted, 1);
        assert_eq!(breaker.state(), BreakerState::HalfOpen);
    }

    #[tokio::test(start_paused = true)]
    async fn probe_success_closes() {
        let breaker = opened(2);
        tokio::time::advance(OPEN_FOR).await;
        assert!(breaker.allow());
        breaker.success();
        assert_eq!(breaker.state(), BreakerState::Closed);
        assert!(breaker.allow());
        // The failure count starts over.
        breaker.failure();
        assert_eq!(breaker.state(), BreakerState::Closed);
        assert_eq!(breaker.opened_count(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn probe_failure_reopens_for_another_period() {
        let breaker = opened(2);
        tokio::time::advance(OPEN_FOR).await;
        assert!(breaker.allow());
        breaker.failure();
        assert_eq!(breaker.state(), BreakerState::Open);
        assert_eq!(breaker.opened_count(), 2);
        tokio::time::advance(OPEN_FOR - Duration::from_millis(1)).await;
        assert!(!breaker.allow());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(breaker.allow());
    }

    #[tokio::test(start_paused = true)]
    async fn results_reported_while_open_change_nothing() {
        let breaker = opened(1);
        tokio::time::advance(OPEN_FOR / 2).await;
        breaker.failure();
        breaker.success();
        assert_eq!(breaker.state(), BreakerState::Open);
        assert_eq!(breaker.opened_count(), 1);
        // The late failure did not push the end of the open period back.
        tokio::time::advance(OPEN_FOR / 2).await;
        assert!(breaker.allow());
    }

    #[tokio::test(start_paused = true)]
    async fn an_abandoned_probe_is_replaced_after_open_for() {
        let breaker = opened(1);
        tokio::time::advance(OPEN_FOR).await;
        assert!(breaker.allow());
        // The probe's caller never reports.
        tokio::time::advance(OPEN_FOR - Duration::from_millis(1)).await;
        assert!(!breaker.allow());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(breaker.allow());
        assert!(!breaker.allow());
    }
}
