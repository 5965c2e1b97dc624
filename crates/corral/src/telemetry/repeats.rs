//! Warnings that repeat: the first of a kind (a message, a route, a
//! detail) is logged at once, and the rest are counted and logged as one
//! summary line per interval (`repeated`: how many more like it,
//! `over_s`: over how long). The interval doubles while the kind keeps
//! coming, up to [`LONGEST`], and a kind quiet for a whole interval is
//! forgotten, so its next occurrence is logged at once again. An origin
//! outage then writes a handful of lines, not one per request, and a Redis
//! that stays down does not write one every second for ever. It must never
//! be keyed on anything unbounded (a cache key, a path): the kinds it
//! remembers are bounded by [`MAX_KINDS`], past which they share one.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// The first summary comes this long after the first line.
pub const FIRST: Duration = Duration::from_secs(5);
/// The longest interval between summaries.
pub const LONGEST: Duration = Duration::from_secs(300);
/// Kinds remembered at once; more share one kind ([`Subject::Other`]).
const MAX_KINDS: usize = 256;

/// What a warning is about, as its lines name it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Subject {
    /// A route and the upstream it asks (`route=`, `upstream=`).
    Route { name: String, upstream: String },
    /// A Redis server (`redis=`, host and port).
    Redis(String),
    /// Past [`MAX_KINDS`]: every other kind of the message.
    Other,
}

/// What makes two warnings alike.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Kind {
    pub message: &'static str,
    pub subject: Subject,
    pub detail: String,
}

#[derive(Debug)]
struct Count {
    /// Occurrences not logged since the last line.
    more: u64,
    /// When the current interval started and how long it is.
    since: Instant,
    every: Duration,
}

/// One summary line: `more` warnings like `kind` over `over`.
#[derive(Debug, PartialEq, Eq)]
pub struct Summary {
    pub kind: Kind,
    pub more: u64,
    pub over: Duration,
}

/// The counts, with time passed in (the process's one runs on a thread of
/// its own with the wall clock; the tests pass their own instants).
#[derive(Debug, Default)]
pub struct Repeats {
    kinds: HashMap<Kind, Count>,
}

impl Repeats {
    /// Counts one occurrence of `kind` at `now`; true when it is to be
    /// logged in full now (the first of its kind for a while).
    pub fn note(&mut self, mut kind: Kind, now: Instant) -> bool {
        if !self.kinds.contains_key(&kind) && self.kinds.len() >= MAX_KINDS {
            kind = Kind {
                message: kind.message,
                subject: Subject::Other,
                detail: String::new(),
            };
        }
        match self.kinds.get_mut(&kind) {
            Some(c) => {
                c.more += 1;
                false
            }
            None => {
                self.kinds.insert(
                    kind,
                    Count {
                        more: 0,
                        since: now,
                        every: FIRST,
                    },
                );
                true
            }
        }
    }

    /// The summaries due at `now`: every kind whose interval has passed
    /// with occurrences in it (its next interval twice as long), and every
    /// kind quiet for its whole interval forgotten.
    pub fn due(&mut self, now: Instant) -> Vec<Summary> {
        let mut out = Vec::new();
        self.kinds.retain(|kind, c| {
            let over = now.saturating_duration_since(c.since);
            if over < c.every {
                return true;
            }
            if c.more == 0 {
                return false;
            }
            out.push(Summary {
                kind: kind.clone(),
                more: std::mem::take(&mut c.more),
                over,
            });
            c.since = now;
            c.every = (c.every * 2).min(LONGEST);
            true
        });
        out
    }

    /// Every count not yet logged, at once (on the way out); the kinds
    /// are forgotten.
    pub fn drain(&mut self, now: Instant) -> Vec<Summary> {
        self.kinds
            .drain()
            .filter(|(_, c)| c.more > 0)
            .map(|(kind, c)| Summary {
                kind,
                more: c.more,
                over: now.saturating_duration_since(c.since),
            })
            .collect()
    }

    /// Forgets the kinds of `message` about `detail` (the state they
    /// reported ended: the next one is news again), returning what was not
    /// logged of them.
    pub fn forget(&mut self, message: &str, subject: &Subject, now: Instant) -> Vec<Summary> {
        let mut out = Vec::new();
        self.kinds.retain(|kind, c| {
            if kind.message != message || kind.subject != *subject {
                return true;
            }
            if c.more > 0 {
                out.push(Summary {
                    kind: kind.clone(),
                    more: c.more,
                    over: now.saturating_duration_since(c.since),
                });
            }
            false
        });
        out
    }
}

/// The process's counts, and its thread logging summaries once a second.
fn process() -> &'static Mutex<Repeats> {
    static PROCESS: OnceLock<Mutex<Repeats>> = OnceLock::new();
    PROCESS.get_or_init(|| {
        let _ = std::thread::Builder::new()
            .name("corral-repeats".into())
            .spawn(|| {
                loop {
                    std::thread::sleep(Duration::from_secs(1));
                    let due = lock().due(Instant::now());
                    log(&due);
                }
            });
        Mutex::new(Repeats::default())
    })
}

fn lock() -> std::sync::MutexGuard<'static, Repeats> {
    // A panic while counting leaves counts, not broken invariants.
    process().lock().unwrap_or_else(PoisonError::into_inner)
}

/// True when this occurrence of `message` (about `subject`, of `detail`)
/// is to be logged in full; otherwise it was counted for a summary line.
pub fn first(message: &'static str, subject: Subject, detail: &str) -> bool {
    lock().note(
        Kind {
            message,
            subject,
            detail: detail.to_owned(),
        },
        Instant::now(),
    )
}

/// [`first`] for a warning about a route and its upstream.
pub fn first_for_route(message: &'static str, route: &str, upstream: &str, detail: &str) -> bool {
    let subject = Subject::Route {
        name: route.to_owned(),
        upstream: upstream.to_owned(),
    };
    first(message, subject, detail)
}

/// The state `message` reported about `subject` ended: what was not
/// logged of it is logged now, and its next occurrence is logged in full.
pub fn ended(message: &str, subject: &Subject) {
    let left = lock().forget(message, subject, Instant::now());
    log(&left);
}

/// Logs every count not yet logged (on the way out).
pub fn flush() {
    let left = lock().drain(Instant::now());
    log(&left);
}

/// The summary lines: the message of the kind, what it is about, and
/// `repeated` (not logged) over `over_s` seconds.
fn log(summaries: &[Summary]) {
    for s in summaries {
        let (message, detail, more, over_s) = (
            s.kind.message,
            s.kind.detail.as_str(),
            s.more,
            s.over.as_secs(),
        );
        match &s.kind.subject {
            Subject::Route { name, upstream } => tracing::warn!(
                route = %name,
                upstream = %upstream,
                detail,
                repeated = more,
                over_s,
                "{message}"
            ),
            Subject::Redis(redis) => {
                tracing::warn!(redis = %redis, repeated = more, over_s, "{message}");
            }
            Subject::Other => {
                tracing::warn!(repeated = more, over_s, "{message} (other routes)");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(route: &str, detail: &str) -> Kind {
        Kind {
            message: "fill failed",
            subject: Subject::Route {
                name: route.to_owned(),
                upstream: "10.0.0.1:80".to_owned(),
            },
            detail: detail.to_owned(),
        }
    }

    #[test]
    fn the_first_is_logged_and_the_rest_summed_per_growing_interval() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut r = Repeats::default();
        assert!(r.note(kind("api", "circuit-open"), at(0)));
        // Another route or detail is news of its own.
        assert!(r.note(kind("web", "circuit-open"), at(0)));
        assert!(r.note(kind("api", "backoff"), at(0)));
        for _ in 0..99 {
            assert!(!r.note(kind("api", "circuit-open"), at(1)));
        }
        assert_eq!(r.due(at(4)), []);
        let due = r.due(at(5));
        assert_eq!(
            due,
            [Summary {
                kind: kind("api", "circuit-open"),
                more: 99,
                over: FIRST,
            }]
        );
        // The quiet kinds were forgotten: their next one is news again.
        assert!(r.note(kind("web", "circuit-open"), at(6)));
        // The next interval is twice as long.
        assert!(!r.note(kind("api", "circuit-open"), at(7)));
        assert_eq!(r.due(at(14)), []);
        assert_eq!(r.due(at(15)).len(), 1);
        // A quiet interval forgets it.
        assert_eq!(r.due(at(35)), []);
        assert!(r.note(kind("api", "circuit-open"), at(36)));
    }

    #[test]
    fn intervals_grow_to_the_longest_and_no_further() {
        let t0 = Instant::now();
        let mut r = Repeats::default();
        let mut now = t0;
        assert!(r.note(kind("api", "x"), now));
        let mut gaps = Vec::new();
        let mut last = t0;
        for _ in 0..(3 * 3600) {
            now += Duration::from_secs(1);
            r.note(kind("api", "x"), now);
            if !r.due(now).is_empty() {
                gaps.push((now - last).as_secs());
                last = now;
            }
        }
        assert_eq!(&gaps[..7], [5, 10, 20, 40, 80, 160, 300]);
        assert!(gaps[7..].iter().all(|&g| g == 300), "{gaps:?}");
    }

    #[test]
    fn kinds_are_bounded_and_nothing_counted_is_lost() {
        let t0 = Instant::now();
        let mut r = Repeats::default();
        let mut logged = 0u64;
        for i in 0..1000 {
            logged += u64::from(r.note(kind(&format!("r{i}"), "x"), t0));
        }
        // Every kind it had room for, and the one the rest share.
        assert_eq!(logged, MAX_KINDS as u64 + 1);
        assert_eq!(r.kinds.len(), MAX_KINDS + 1);
        let left: u64 = r.drain(t0).iter().map(|s| s.more).sum();
        assert_eq!(logged + left, 1000);
    }

    #[test]
    fn an_ended_state_logs_what_is_left_and_is_news_again() {
        let t0 = Instant::now();
        let mut r = Repeats::default();
        let at = |a: &str| Subject::Redis(a.to_owned());
        let redis = || Kind {
            message: "cannot connect to Redis",
            subject: at("127.0.0.1:6379"),
            detail: String::new(),
        };
        assert!(r.note(redis(), t0));
        assert!(!r.note(redis(), t0));
        assert_eq!(
            r.forget("cannot connect to Redis", &at("10.0.0.1:6379"), t0),
            []
        );
        assert!(!r.note(redis(), t0));
        let left = r.forget("cannot connect to Redis", &at("127.0.0.1:6379"), t0);
        assert_eq!(left.iter().map(|s| s.more).sum::<u64>(), 2);
        assert!(r.note(redis(), t0));
    }
}
