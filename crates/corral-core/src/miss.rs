//! The decisions of the cache path, as named states and typed
//! transitions: what a lookup leads to, and what a caller that waited on
//! another request's fill does next. Pure: the server measures (entry
//! state, back-off, the XFetch roll, the flight's end) and acts; every
//! transition is unit-tested here without sockets or clocks.

use crate::entry::EntryState;

/// How many times a follower whose Vary values did not match the leader's
/// answer (or whose leader vanished) looks again before fetching alone.
pub const VARY_RETRIES: usize = 2;

/// What the lookup found, as the decision needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found {
    pub state: EntryState,
    /// The XFetch roll for a fresh copy: refresh it early.
    pub early_refresh: bool,
}

/// What a lookup leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// A fresh copy answers; `refresh`: one early refresh starts.
    Hit { refresh: bool },
    /// A copy inside stale-while-revalidate answers; one refresh starts.
    StaleWhileRevalidate,
    /// The origin failed for this key moments ago: a stale copy answers
    /// and nothing is fetched until the back-off ends.
    StaleInBackoff,
    /// Nothing usable: fetch. `coalesce`: through the key's flight;
    /// otherwise alone (coalescing off, or the caller's view of the URI is
    /// hit-for-pass).
    Fetch { coalesce: bool },
}

/// How a follower's wait on another request's fill ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitEnd {
    /// The leader stored an entry; `fits`: it is this request's variant.
    Stored { fits: bool },
    /// The leader's answer is shared as is (an error, or stale);
    /// `fits`: it is this request's variant.
    Shared { fits: bool },
    /// The leader found the answer uncacheable.
    Pass,
    /// The leader went away without an answer.
    Dangling,
    /// The leader held the key past `lock_age`: the flight was retired.
    Retired,
    /// `lock_timeout` passed.
    TimedOut,
}

/// What a follower does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Answer with the leader's outcome.
    Answer,
    /// Look up again (the leader taught a Vary set, or left: try to lead).
    LookAgain,
    /// Fetch alone, without joining a flight.
    FetchAlone,
    /// Do what the route's `on_timeout` says.
    OnLockTimeout,
}

/// One request's way through the cache path.
#[derive(Debug, Default)]
pub struct Miss {
    attempt: usize,
    retired: bool,
}

impl Miss {
    pub fn new() -> Self {
        Miss::default()
    }

    /// True once a flight this request waited on was retired: a flight it
    /// starts now is not retired again.
    pub fn after_retirement(&self) -> bool {
        self.retired
    }

    /// What a lookup leads to: `found` is the usable copy, if any; `pass`
    /// (asked only when a fetch follows) whether the caller's view of the
    /// URI is hit-for-pass.
    pub fn lookup(
        &self,
        found: Option<Found>,
        backoff: bool,
        coalesce: bool,
        pass: impl FnOnce() -> bool,
    ) -> Lookup {
        if let Some(found) = found {
            match found.state {
                EntryState::Fresh => {
                    return Lookup::Hit {
                        refresh: found.early_refresh && !backoff,
                    };
                }
                EntryState::StaleWhileRevalidate if !backoff => {
                    return Lookup::StaleWhileRevalidate;
                }
                EntryState::StaleWhileRevalidate | EntryState::StaleIfError if backoff => {
                    return Lookup::StaleInBackoff;
                }
                _ => {}
            }
        }
        Lookup::Fetch {
            coalesce: coalesce && !pass(),
        }
    }

    /// What a follower does after its wait ended with `end`.
    pub fn waited(&mut self, end: WaitEnd) -> Next {
        match end {
            WaitEnd::Stored { fits: true } | WaitEnd::Shared { fits: true } => Next::Answer,
            WaitEnd::Stored { fits: false } => {
                if self.attempt < VARY_RETRIES {
                    self.attempt += 1;
                    Next::LookAgain
                } else {
                    Next::FetchAlone
                }
            }
            // An error for another variant is not this caller's.
            WaitEnd::Shared { fits: false } | WaitEnd::Pass => Next::FetchAlone,
            WaitEnd::Retired => {
                // Join again: one of the waiters leads the next flight.
                self.retired = true;
                self.attempt += 1;
                if self.attempt > VARY_RETRIES + 2 {
                    Next::FetchAlone
                } else {
                    Next::LookAgain
                }
            }
            WaitEnd::Dangling => {
                self.attempt += 1;
                if self.attempt > VARY_RETRIES + 2 {
                    Next::FetchAlone
                } else {
                    Next::LookAgain
                }
            }
            WaitEnd::TimedOut => Next::OnLockTimeout,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(state: EntryState, early_refresh: bool) -> Option<Found> {
        Some(Found {
            state,
            early_refresh,
        })
    }

    #[test]
    fn every_lookup_transition() {
        let m = Miss::new();
        use EntryState::*;
        // A fresh copy answers; it refreshes early only when the roll says
        // so and the origin is not in back-off.
        assert_eq!(
            m.lookup(found(Fresh, false), false, true, || false),
            Lookup::Hit { refresh: false }
        );
        assert_eq!(
            m.lookup(found(Fresh, true), false, true, || false),
            Lookup::Hit { refresh: true }
        );
        assert_eq!(
            m.lookup(found(Fresh, true), true, true, || false),
            Lookup::Hit { refresh: false }
        );
        assert_eq!(
            m.lookup(found(StaleWhileRevalidate, false), false, true, || false),
            Lookup::StaleWhileRevalidate
        );
        for state in [StaleWhileRevalidate, StaleIfError] {
            assert_eq!(
                m.lookup(found(state, false), true, true, || false),
                Lookup::StaleInBackoff
            );
        }
        // Past every window (or only stale-if-error, which needs an error
        // first): fetch, coalesced unless off or known uncacheable. With a
        // back-off the fill's gate answers.
        for f in [None, found(StaleIfError, false), found(Expired, false)] {
            assert_eq!(
                m.lookup(f, false, true, || false),
                Lookup::Fetch { coalesce: true }
            );
            assert_eq!(
                m.lookup(f, false, false, || false),
                Lookup::Fetch { coalesce: false }
            );
            assert_eq!(
                m.lookup(f, false, true, || true),
                Lookup::Fetch { coalesce: false }
            );
        }
        assert_eq!(
            m.lookup(found(Expired, false), true, true, || false),
            Lookup::Fetch { coalesce: true }
        );
    }

    #[test]
    fn every_wait_transition() {
        let mut m = Miss::new();
        assert_eq!(m.waited(WaitEnd::Stored { fits: true }), Next::Answer);
        assert_eq!(m.waited(WaitEnd::Shared { fits: true }), Next::Answer);
        assert_eq!(m.waited(WaitEnd::Shared { fits: false }), Next::FetchAlone);
        assert_eq!(m.waited(WaitEnd::Pass), Next::FetchAlone);
        assert_eq!(m.waited(WaitEnd::TimedOut), Next::OnLockTimeout);
        // Another variant: look again VARY_RETRIES times, then alone.
        for _ in 0..VARY_RETRIES {
            assert_eq!(m.waited(WaitEnd::Stored { fits: false }), Next::LookAgain);
        }
        assert_eq!(m.waited(WaitEnd::Stored { fits: false }), Next::FetchAlone);
        // A leader that vanished: try to lead, a bounded number of times.
        let mut m = Miss::new();
        for _ in 0..VARY_RETRIES + 2 {
            assert_eq!(m.waited(WaitEnd::Dangling), Next::LookAgain);
        }
        assert_eq!(m.waited(WaitEnd::Dangling), Next::FetchAlone);
        // A retired flight: join again, and what is joined then is not
        // retired again.
        let mut m = Miss::new();
        assert!(!m.after_retirement());
        assert_eq!(m.waited(WaitEnd::Retired), Next::LookAgain);
        assert!(m.after_retirement());
    }
}
