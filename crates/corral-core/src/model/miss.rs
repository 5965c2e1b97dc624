//! The decisions of the cache path, as named states and typed
//! transitions: what a lookup leads to, and what a caller that waited on
//! another request's fill does next. Pure: the server measures (entry
//! state, back-off, the XFetch roll, the flight's end) and acts; every
//! transition is unit-tested here without sockets or clocks.

use crate::model::entry::EntryState;

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

/// What a lookup leads to; `E` is the copy found, which every answer
/// without a fetch holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup<E> {
    /// A fresh copy answers; `refresh`: one early refresh starts.
    Hit { refresh: bool, entry: E },
    /// A copy inside stale-while-revalidate answers; one refresh starts.
    StaleWhileRevalidate(E),
    /// The origin failed for this key moments ago: a stale copy answers
    /// and nothing is fetched until the back-off ends.
    StaleInBackoff(E),
    /// Nothing usable: fetch. `coalesce`: through the key's flight;
    /// otherwise alone (coalescing off, or the caller's view of the URI is
    /// hit-for-pass). `stale`: the copy found, to revalidate or to serve
    /// if the origin fails.
    Fetch { coalesce: bool, stale: Option<E> },
}

/// How a follower's wait on another request's fill ended; `T` is the
/// leader's outcome, which only an end that can answer carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitEnd<T> {
    /// The leader stored an entry; `fits`: it is this request's variant.
    Stored { fits: bool, outcome: T },
    /// The leader's answer is shared as is (an error, or stale);
    /// `fits`: it is this request's variant.
    Shared { fits: bool, outcome: T },
    /// The leader found the answer uncacheable.
    Pass,
    /// The leader's answer changed how the key is made (a new
    /// No-Vary-Search rule): look again with the key made anew.
    Rekeyed,
    /// The leader went away without an answer.
    Dangling,
    /// The leader held the key past `lock_age`: the flight was retired.
    Retired,
    /// `lock_timeout` passed.
    TimedOut,
}

/// What a follower does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next<T> {
    /// Answer with the leader's outcome.
    Answer(T),
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
    rechecked: bool,
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

    /// True the first time it is asked: a request that becomes a
    /// flight's leader looks once more for a copy stored since its lookup
    /// before it fetches, and only once.
    pub fn recheck(&mut self) -> bool {
        !std::mem::replace(&mut self.rechecked, true)
    }

    /// What a lookup leads to: `found` is the usable copy, if any, with
    /// what was measured of it; `pass` (asked only when a fetch follows)
    /// whether the caller's view of the URI is hit-for-pass.
    pub fn lookup<E>(
        &self,
        found: Option<(Found, E)>,
        backoff: bool,
        coalesce: bool,
        pass: impl FnOnce() -> bool,
    ) -> Lookup<E> {
        let stale = match found {
            None => None,
            Some((found, entry)) => match found.state {
                EntryState::Fresh => {
                    return Lookup::Hit {
                        refresh: found.early_refresh && !backoff,
                        entry,
                    };
                }
                EntryState::StaleWhileRevalidate if !backoff => {
                    return Lookup::StaleWhileRevalidate(entry);
                }
                EntryState::StaleWhileRevalidate | EntryState::StaleIfError if backoff => {
                    return Lookup::StaleInBackoff(entry);
                }
                _ => Some(entry),
            },
        };
        Lookup::Fetch {
            coalesce: coalesce && !pass(),
            stale,
        }
    }

    /// What a follower does after its wait ended with `end`.
    pub fn waited<T>(&mut self, end: WaitEnd<T>) -> Next<T> {
        match end {
            WaitEnd::Stored {
                fits: true,
                outcome,
            }
            | WaitEnd::Shared {
                fits: true,
                outcome,
            } => Next::Answer(outcome),
            WaitEnd::Stored { fits: false, .. } | WaitEnd::Rekeyed => {
                if self.attempt < VARY_RETRIES {
                    self.attempt += 1;
                    Next::LookAgain
                } else {
                    Next::FetchAlone
                }
            }
            // An error for another variant is not this caller's.
            WaitEnd::Shared { fits: false, .. } | WaitEnd::Pass => Next::FetchAlone,
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

    fn found(state: EntryState, early_refresh: bool) -> Option<(Found, ())> {
        Some((
            Found {
                state,
                early_refresh,
            },
            (),
        ))
    }

    #[test]
    fn a_leader_looks_once_more_and_only_once() {
        let mut m = Miss::new();
        assert!(m.recheck());
        assert!(!m.recheck());
        assert!(!m.recheck());
    }

    #[test]
    fn every_lookup_transition() {
        let m = Miss::new();
        use EntryState::*;
        // A fresh copy answers; it refreshes early only when the roll says
        // so and the origin is not in back-off.
        assert_eq!(
            m.lookup(found(Fresh, false), false, true, || false),
            Lookup::Hit {
                refresh: false,
                entry: ()
            }
        );
        assert_eq!(
            m.lookup(found(Fresh, true), false, true, || false),
            Lookup::Hit {
                refresh: true,
                entry: ()
            }
        );
        assert_eq!(
            m.lookup(found(Fresh, true), true, true, || false),
            Lookup::Hit {
                refresh: false,
                entry: ()
            }
        );
        assert_eq!(
            m.lookup(found(StaleWhileRevalidate, false), false, true, || false),
            Lookup::StaleWhileRevalidate(())
        );
        for state in [StaleWhileRevalidate, StaleIfError] {
            assert_eq!(
                m.lookup(found(state, false), true, true, || false),
                Lookup::StaleInBackoff(())
            );
        }
        // Past every window (or only stale-if-error, which needs an error
        // first): fetch, coalesced unless off or known uncacheable. With a
        // back-off the fill's gate answers.
        for f in [None, found(StaleIfError, false), found(Expired, false)] {
            let stale = f.map(|_| ());
            assert_eq!(
                m.lookup(f, false, true, || false),
                Lookup::Fetch {
                    coalesce: true,
                    stale
                }
            );
            assert_eq!(
                m.lookup(f, false, false, || false),
                Lookup::Fetch {
                    coalesce: false,
                    stale
                }
            );
            assert_eq!(
                m.lookup(f, false, true, || true),
                Lookup::Fetch {
                    coalesce: false,
                    stale
                }
            );
        }
        assert_eq!(
            m.lookup(found(Expired, false), true, true, || false),
            Lookup::Fetch {
                coalesce: true,
                stale: Some(())
            }
        );
    }

    #[test]
    fn every_wait_transition() {
        let mut m = Miss::new();
        assert_eq!(
            m.waited(WaitEnd::Stored {
                fits: true,
                outcome: 1
            }),
            Next::Answer(1)
        );
        assert_eq!(
            m.waited(WaitEnd::Shared {
                fits: true,
                outcome: 2
            }),
            Next::Answer(2)
        );
        assert_eq!(
            m.waited(WaitEnd::Shared {
                fits: false,
                outcome: 3
            }),
            Next::FetchAlone
        );
        assert_eq!(m.waited(WaitEnd::<u8>::Pass), Next::FetchAlone);
        assert_eq!(m.waited(WaitEnd::<u8>::TimedOut), Next::OnLockTimeout);
        // Another variant: look again VARY_RETRIES times, then alone.
        for _ in 0..VARY_RETRIES {
            assert_eq!(
                m.waited(WaitEnd::Stored {
                    fits: false,
                    outcome: 4
                }),
                Next::LookAgain
            );
        }
        assert_eq!(
            m.waited(WaitEnd::Stored {
                fits: false,
                outcome: 4
            }),
            Next::FetchAlone
        );
        // A leader that vanished: try to lead, a bounded number of times.
        let mut m = Miss::new();
        for _ in 0..VARY_RETRIES + 2 {
            assert_eq!(m.waited(WaitEnd::<u8>::Dangling), Next::LookAgain);
        }
        assert_eq!(m.waited(WaitEnd::<u8>::Dangling), Next::FetchAlone);
        // A retired flight: join again, and what is joined then is not
        // retired again.
        let mut m = Miss::new();
        assert!(!m.after_retirement());
        assert_eq!(m.waited(WaitEnd::<u8>::Retired), Next::LookAgain);
        assert!(m.after_retirement());
    }
}
