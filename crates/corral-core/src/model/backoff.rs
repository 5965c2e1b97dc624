//! Leaving a failing origin alone. When fetches for a key fail (a 5xx, a
//! refused connection, a timeout) `after` times in a row, the key goes into
//! back-off: until it ends, nothing corral does for that key reaches the
//! origin (no fill, no background or early refresh), and callers get the
//! stale copy or an error at once. Each further failure in a row doubles
//! the period, up to a cap, with jitter so that keys failing together do
//! not retry together; the first success ends it. A back-off is a pair of
//! numbers so that instances can share it through Redis.
//!
//! A back-off is shared by every caller of the key, so a failure the
//! request itself may have provoked (a 5xx, a timeout: an application that
//! chokes on a field outside the key) moves it only when it comes from
//! another caller than the failure before it ([`BackoffPolicy::after_failure_of`]):
//! one client's requests never put a key in back-off for everyone. An
//! origin that cannot be reached at all counts whoever asked.
//!
//! `after` is 2 by default: one failed answer is not reused (RFC 9111 §3
//! keeps a 5xx without freshness out of the cache, and a caller after it
//! is owed a fresh attempt), a second in a row is an origin failing. The
//! callers who waited on a failed fetch share its answer whatever `after`
//! says; what the threshold decides is whether the next caller asks again.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rand::Rng;

/// How long back-off periods are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackoffPolicy {
    /// The period after the first failure.
    pub min: Duration,
    /// No period is longer.
    pub max: Duration,
    /// Failures in a row before the first period (at least 1).
    pub after: u32,
}

impl Default for BackoffPolicy {
    fn default() -> Self {
        BackoffPolicy {
            min: Duration::from_secs(1),
            max: Duration::from_secs(30),
            after: 2,
        }
    }
}

impl BackoffPolicy {
    /// The period after `failures` failures in a row: none before `after`
    /// of them, then `min` doubled for each failure past `after`, capped at
    /// `max`, less up to a quarter at random (never below `min`).
    pub fn period(&self, failures: u32) -> Duration {
        let after = self.after.max(1);
        if failures < after {
            return Duration::ZERO;
        }
        let doublings = (failures - after).min(30);
        let full = self
            .min
            .saturating_mul(1u32 << doublings)
            .min(self.max)
            .max(self.min);
        let jitter = rand::rng().random_range(0.0..=0.25);
        full.mul_f64(1.0 - jitter).max(self.min.min(full))
    }

    /// The back-off after one more failure than `previous` had, from `now`:
    /// a failure that is the origin's whoever asked (it cannot be reached).
    pub fn after_failure(&self, previous: Option<Backoff>, now: SystemTime) -> Backoff {
        let failures = previous.map_or(0, |b| b.failures).saturating_add(1);
        let period = self.period(failures);
        Backoff {
            until: if period.is_zero() {
                no_period(now)
            } else {
                now.checked_add(period).unwrap_or(now)
            },
            failures,
            caller: None,
        }
    }

    /// The back-off after a failure of `caller`'s request that the request
    /// itself may have provoked; `None` when it changes nothing. The same
    /// caller's failure again is no new evidence, and a first failure never
    /// starts a period on its own (whatever `after` says): a period needs
    /// failures of two callers.
    pub fn after_failure_of(
        &self,
        previous: Option<Backoff>,
        caller: u64,
        now: SystemTime,
    ) -> Option<Backoff> {
        match previous {
            Some(p) if p.caller == Some(caller) => None,
            None => Some(Backoff {
                until: no_period(now),
                failures: 1,
                caller: Some(caller),
            }),
            Some(p) => Some(Backoff {
                caller: Some(caller),
                ..self.after_failure(Some(p), now)
            }),
        }
    }

    /// How long a back-off record is worth keeping after its period: long
    /// enough that the next failure still counts as one in a row.
    pub fn memory(&self) -> Duration {
        self.max.saturating_mul(2)
    }
}

/// How far before its failure a record of failures that started no
/// period ends. Such a record is read on other instances, each moving it
/// onto its own clock by its own estimate of Redis's (see `ClockShift`):
/// ended at the very moment of the failure, a reader whose estimate is a
/// few milliseconds off would see a period of those milliseconds, and
/// leave the origin alone where it must ask again (a waiting instance
/// right after its leader's first failure).
const NO_PERIOD_BEFORE: Duration = Duration::from_secs(1);

/// The end of a record whose failures started no period: in the past on
/// every instance's clock.
fn no_period(now: SystemTime) -> SystemTime {
    now.checked_sub(NO_PERIOD_BEFORE).unwrap_or(now)
}

/// A key's back-off: origin requests wait until `until`; `failures` in a
/// row led to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub until: SystemTime,
    pub failures: u32,
    /// The caller ([`crate::callers::client_addr::caller_group`]) whose failure was
    /// counted last; `None` when it was the origin's whoever asked.
    pub caller: Option<u64>,
}

impl Backoff {
    /// True while origin requests for the key must wait.
    pub fn active(&self, now: SystemTime) -> bool {
        now < self.until
    }

    /// What is left of the period at `now`.
    pub fn remaining(&self, now: SystemTime) -> Duration {
        self.until.duration_since(now).unwrap_or_default()
    }

    /// The shared form: `until` in unix milliseconds, `:`, failures, and
    /// `:caller` when a caller's failure was counted last.
    pub fn encode(&self) -> String {
        let ms = self
            .until
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        match self.caller {
            Some(c) => format!("{ms}:{}:{c}", self.failures),
            None => format!("{ms}:{}", self.failures),
        }
    }

    /// Reads [`Backoff::encode`]'s form (an instance of before the caller
    /// was kept writes none); `None` for anything else.
    pub fn decode(s: &str) -> Option<Self> {
        let mut parts = s.split(':');
        let ms = parts.next()?;
        let failures = parts.next()?;
        let caller = match parts.next() {
            None => None,
            Some(c) => Some(c.parse().ok()?),
        };
        if parts.next().is_some() {
            return None;
        }
        let until = UNIX_EPOCH.checked_add(Duration::from_millis(ms.parse().ok()?))?;
        Some(Backoff {
            until,
            failures: failures.parse().ok()?,
            caller,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A failure that starts no period (the first of `after: 2`, or a
    /// first failure a caller may have provoked) is not a period on any
    /// other instance either, whose clock reads it a little off: here
    /// 500 ms behind the writer's.
    #[test]
    fn a_failure_that_starts_no_period_is_none_on_a_clock_a_little_behind() {
        let p = BackoffPolicy::default();
        let now = SystemTime::now();
        let behind = now - Duration::from_millis(500);
        let first = p.after_failure(None, now);
        assert_eq!(first.failures, 1);
        assert!(!first.active(now));
        assert!(!first.active(behind), "a period on a clock 500 ms behind");
        let provoked = p.after_failure_of(None, 7, now).expect("counted");
        assert!(!provoked.active(behind));
        // Read back through Redis's form, as another instance does.
        let read = Backoff::decode(&first.encode()).expect("decodes");
        assert!(!read.active(behind));
        // The second starts one, from the failure.
        let second = p.after_failure(Some(first), now);
        assert_eq!(second.failures, 2);
        assert!(second.active(now) && second.active(behind));
    }

    #[test]
    fn periods_double_up_to_the_cap_with_jitter_that_only_shortens() {
        let p = BackoffPolicy {
            min: Duration::from_secs(1),
            max: Duration::from_secs(30),
            after: 1,
        };
        for (failures, full) in [(1, 1), (2, 2), (3, 4), (5, 16), (6, 30), (60, 30)] {
            for _ in 0..50 {
                let d = p.period(failures);
                let full = Duration::from_secs(full);
                assert!(d <= full, "{failures}: {d:?} > {full:?}");
                assert!(
                    d >= full.mul_f64(0.75).max(p.min).min(full),
                    "{failures}: {d:?}"
                );
            }
        }
        assert_eq!(p.period(0), Duration::ZERO);
    }

    #[test]
    fn by_default_the_second_failure_in_a_row_starts_the_back_off() {
        let p = BackoffPolicy::default();
        let now = UNIX_EPOCH + Duration::from_secs(1_000_000);
        let first = p.after_failure(None, now);
        assert_eq!(first.failures, 1);
        assert!(!first.active(now), "the next caller asks again");
        let second = p.after_failure(Some(first), now);
        assert_eq!(second.failures, 2);
        assert!(second.active(now));
        assert!(second.remaining(now) >= Duration::from_millis(750));
        assert!(second.remaining(now) <= Duration::from_secs(1));
        let third = p.after_failure(Some(second), second.until);
        assert!(third.remaining(second.until) >= Duration::from_millis(1500));
    }

    #[test]
    fn each_failure_in_a_row_counts() {
        let p = BackoffPolicy {
            after: 1,
            ..BackoffPolicy::default()
        };
        let now = UNIX_EPOCH + Duration::from_secs(1_000_000);
        let first = p.after_failure(None, now);
        assert_eq!(first.failures, 1);
        assert!(first.active(now) && !first.active(first.until));
        let second = p.after_failure(Some(first), first.until);
        assert_eq!(second.failures, 2);
        assert!(second.remaining(first.until) >= Duration::from_millis(1500));
    }

    #[test]
    fn the_shared_form_round_trips_and_refuses_garbage() {
        let b = Backoff {
            until: UNIX_EPOCH + Duration::from_millis(1_764_000_000_123),
            failures: 4,
            caller: None,
        };
        assert_eq!(Backoff::decode(&b.encode()), Some(b));
        let b = Backoff {
            caller: Some(u64::MAX),
            ..b
        };
        assert_eq!(Backoff::decode(&b.encode()), Some(b));
        for bad in ["", "1", "x:1", "1:x", "1:2:x", "1:2:3:4", "1:2:", ":"] {
            assert_eq!(Backoff::decode(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn one_callers_failures_never_start_a_period_for_everyone() {
        let p = BackoffPolicy {
            after: 1,
            ..BackoffPolicy::default()
        };
        let now = UNIX_EPOCH + Duration::from_secs(1_000_000);
        let first = p.after_failure_of(None, 7, now).expect("counted");
        assert_eq!(first.failures, 1);
        assert!(!first.active(now), "one caller's failure starts no period");
        assert_eq!(
            p.after_failure_of(Some(first), 7, now),
            None,
            "nor do its next ones"
        );
        let second = p.after_failure_of(Some(first), 8, now).expect("counted");
        assert_eq!((second.failures, second.caller), (2, Some(8)));
        assert!(second.active(now), "two callers' failures do");
        // An unreachable origin is anyone's failure.
        let down = p.after_failure(Some(first), now);
        assert!(down.active(now) && down.caller.is_none());
        assert_eq!(
            p.after_failure_of(Some(down), 7, now).map(|b| b.failures),
            Some(3)
        );
    }
}
