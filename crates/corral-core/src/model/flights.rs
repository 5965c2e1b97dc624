//! In-process coalescing: one flight per key. The first request leads and
//! holds a `Permit`; the others wait on the flight's outcome. Every waiter
//! sees the outcome exactly once, and a leader that is dropped without
//! finishing (its task panicked or was cancelled) wakes every waiter with
//! `Dangling`, so nobody hangs (the model: pingora-cache's lock.rs).
//! The registry lock is a plain mutex held only for map edits, never across
//! an await.
//!
//! Two bounds: a flight takes at most `max_waiters` followers (the next
//! caller is told the list is full, so a stampede never grows memory
//! without limit), and a flight whose leader has held the key for
//! `lock_age` without an answer is retired: its followers wake, the first
//! of them to join again leads a new flight and the others follow that one
//! (Pingora's age timeout). A follower may also retire the flight when its
//! own wait times out ([`Waiter::wait_with`]), for the same hand-over. A
//! flight that replaced a retired one is not retired again, so a slow
//! origin sees two requests, not one per period.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::watch;

use crate::model::key::Digest;

/// How a flight ended.
#[derive(Debug, Clone)]
pub enum FlightEnd<T> {
    Done(T),
    /// The leader went away without an outcome.
    Dangling,
    /// The leader held the key past `lock_age`: a new flight may start.
    Retired,
}

struct Slot<T> {
    tx: watch::Sender<Option<FlightEnd<T>>>,
    followers: AtomicUsize,
    started: tokio::time::Instant,
    /// False for a flight that replaced a retired one.
    ages: bool,
    /// What the flight is for, as an operator may see it ([`Permit::name`]).
    name: std::sync::OnceLock<Box<str>>,
}

/// A flight under way, as the operator's views show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlightView {
    /// Its [`Permit::name`], or `""` if its leader gave none.
    pub name: String,
    /// Followers waiting on it now.
    pub waiting: usize,
    /// How long it has been under way.
    pub age: Duration,
}

type Registry<T> = Arc<Mutex<HashMap<Digest, Arc<Slot<T>>>>>;

/// The flights under way in this process.
pub struct Flights<T> {
    map: Registry<T>,
}

impl<T> Default for Flights<T> {
    fn default() -> Self {
        Flights {
            map: Arc::new(Mutex::new(HashMap::new())),
        }
    }
}

/// What `join` made of the caller.
pub enum Role<T> {
    Leader(Permit<T>),
    Follower(Waiter<T>),
    /// The flight already has `max_waiters` followers waiting.
    Full,
}

/// How a caller joins.
#[derive(Debug, Clone, Copy)]
pub struct Join {
    /// Followers a flight takes before the next caller gets [`Role::Full`].
    pub max_waiters: usize,
    /// The caller was woken by a retired flight: a flight it starts is
    /// not retired again.
    pub after_retirement: bool,
}

impl Join {
    /// No bound, a first join.
    pub const UNBOUNDED: Join = Join {
        max_waiters: usize::MAX,
        after_retirement: false,
    };
}

/// What a follower's wait came to.
#[derive(Debug)]
pub enum WaitResult<T> {
    Done(T),
    /// The leader went away; the caller may try to lead.
    Dangling,
    /// The lock timeout passed first.
    TimedOut,
    /// The flight was retired (`lock_age`): join again.
    Retired,
}

impl<T: Clone + Send + Sync + 'static> Flights<T> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Leads the flight for `key`, or follows the one under way.
    pub fn join(&self, key: Digest, how: Join) -> Role<T> {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = map.get(&key) {
            if slot.tx.receiver_count() >= how.max_waiters {
                return Role::Full;
            }
            slot.followers.fetch_add(1, Ordering::Relaxed);
            return Role::Follower(Waiter {
                rx: slot.tx.subscribe(),
                key,
                slot: Arc::clone(slot),
                map: Arc::clone(&self.map),
            });
        }
        let (tx, _) = watch::channel(None);
        let slot = Arc::new(Slot {
            tx,
            followers: AtomicUsize::new(0),
            started: tokio::time::Instant::now(),
            ages: !how.after_retirement,
            name: std::sync::OnceLock::new(),
        });
        map.insert(key, Arc::clone(&slot));
        Role::Leader(Permit {
            key,
            slot,
            map: Arc::clone(&self.map),
            finished: false,
        })
    }

    /// True while a flight for `key` is under way.
    pub fn under_way(&self, key: Digest) -> bool {
        self.map
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(&key)
    }

    /// Flights under way.
    pub fn len(&self) -> usize {
        self.map
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `n` flights with the most followers waiting now, most first.
    pub fn busiest(&self, n: usize) -> Vec<FlightView> {
        let mut all: Vec<FlightView> = self
            .map
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .map(|slot| FlightView {
                name: slot.name.get().map(|n| n.to_string()).unwrap_or_default(),
                waiting: slot.tx.receiver_count(),
                age: slot.started.elapsed(),
            })
            .collect();
        all.sort_by(|a, b| b.waiting.cmp(&a.waiting).then(b.age.cmp(&a.age)));
        all.truncate(n);
        all
    }
}

/// The leader's obligation to end its flight.
pub struct Permit<T> {
    key: Digest,
    slot: Arc<Slot<T>>,
    map: Registry<T>,
    finished: bool,
}

impl<T> Permit<T> {
    /// Names the flight for the operator's views ([`Flights::busiest`]):
    /// never a secret (a key without its query, say). The first name
    /// given stays.
    pub fn name(&self, name: &str) {
        let _ = self.slot.name.set(name.into());
    }

    /// Followers so far.
    pub fn followers(&self) -> usize {
        self.slot.followers.load(Ordering::Relaxed)
    }

    /// Followers still waiting: one that gave up (lock timeout) or whose
    /// client went away no longer counts.
    pub fn waiting(&self) -> usize {
        self.slot.tx.receiver_count()
    }

    /// Resolves once no follower waits (at once if none does); one may
    /// join again afterwards.
    pub async fn unwatched(&self) {
        self.slot.tx.closed().await;
    }

    /// Hands `outcome` to every follower now (and to whoever joins until
    /// the flight ends), without ending the flight: a streamed answer is
    /// read by each while the fill still runs.
    pub fn publish(&self, outcome: T) {
        self.slot.tx.send_replace(Some(FlightEnd::Done(outcome)));
    }

    /// Ends the flight with `outcome`, waking every follower.
    pub fn complete(mut self, outcome: T) {
        self.end(FlightEnd::Done(outcome));
    }

    fn end(&mut self, end: FlightEnd<T>) {
        if self.finished {
            return;
        }
        self.finished = true;
        // Leave the registry first: a request arriving after this point
        // starts a new flight (and normally finds the stored answer).
        {
            let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
            if map
                .get(&self.key)
                .is_some_and(|s| Arc::ptr_eq(s, &self.slot))
            {
                map.remove(&self.key);
            }
        }
        self.slot.tx.send_replace(Some(end));
    }
}

impl<T> Drop for Permit<T> {
    fn drop(&mut self) {
        self.end(FlightEnd::Dangling);
    }
}

/// A follower's handle on a flight.
pub struct Waiter<T> {
    rx: watch::Receiver<Option<FlightEnd<T>>>,
    key: Digest,
    slot: Arc<Slot<T>>,
    map: Registry<T>,
}

impl<T: Clone> Waiter<T> {
    /// Waits for the outcome, at most `timeout`; with `lock_age`, the
    /// flight is retired once its leader has held it that long.
    pub async fn wait(self, timeout: Duration, lock_age: Option<Duration>) -> WaitResult<T> {
        self.wait_with(timeout, lock_age, false).await
    }

    /// [`Waiter::wait`]; with `retire_on_timeout`, a wait that times out
    /// retires the flight (unless it replaced a retired one) and ends
    /// `Retired` rather than `TimedOut`: one waiter leads again, the others
    /// follow it.
    pub async fn wait_with(
        mut self,
        timeout: Duration,
        lock_age: Option<Duration>,
        retire_on_timeout: bool,
    ) -> WaitResult<T> {
        let timed_out = tokio::time::Instant::now() + timeout;
        let retire_at = lock_age
            .filter(|_| self.slot.ages)
            .map(|age| self.slot.started + age)
            .filter(|at| *at < timed_out);
        let got = tokio::time::timeout_at(
            retire_at.unwrap_or(timed_out),
            self.rx.wait_for(Option::is_some),
        )
        .await
        .map(|r| {
            r.map(|v| match &*v {
                Some(FlightEnd::Done(t)) => WaitResult::Done(t.clone()),
                Some(FlightEnd::Retired) => WaitResult::Retired,
                _ => WaitResult::Dangling,
            })
        });
        match got {
            Err(_) if retire_at.is_some() || (retire_on_timeout && self.slot.ages) => {
                self.retire();
                WaitResult::Retired
            }
            Err(_) => WaitResult::TimedOut,
            Ok(Err(_)) => WaitResult::Dangling,
            Ok(Ok(result)) => result,
        }
    }

    /// Takes the flight out of the registry (if it is still the key's) and
    /// wakes its followers with `Retired`; the leader runs on and ends it
    /// for nobody.
    fn retire(&self) {
        {
            let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
            if map
                .get(&self.key)
                .is_some_and(|s| Arc::ptr_eq(s, &self.slot))
            {
                map.remove(&self.key);
            }
        }
        self.slot.tx.send_if_modified(|end| {
            if end.is_none() {
                *end = Some(FlightEnd::Retired);
                true
            } else {
                false
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> Digest {
        Digest([n; 32])
    }

    #[tokio::test]
    async fn the_busiest_flights_are_those_with_the_most_waiting() {
        let f: Flights<u32> = Flights::new();
        let (mut leaders, mut waiting) = (Vec::new(), Vec::new());
        for (k, followers) in [(1u8, 3usize), (2, 7), (3, 0)] {
            let Role::Leader(permit) = f.join(key(k), Join::UNBOUNDED) else {
                panic!("first must lead")
            };
            permit.name(&format!("api example.test/k{k}"));
            permit.name("a second name is ignored");
            for _ in 0..followers {
                let Role::Follower(w) = f.join(key(k), Join::UNBOUNDED) else {
                    panic!("others must follow")
                };
                waiting.push(w);
            }
            leaders.push(permit);
        }
        let busiest = f.busiest(2);
        let seen: Vec<(&str, usize)> = busiest
            .iter()
            .map(|v| (v.name.as_str(), v.waiting))
            .collect();
        assert_eq!(
            seen,
            [("api example.test/k2", 7), ("api example.test/k1", 3)]
        );
        // One gives up: it no longer counts.
        waiting.pop();
        assert_eq!(f.busiest(1)[0].waiting, 6);
    }

    #[tokio::test]
    async fn one_leader_many_followers_all_see_the_outcome_once() {
        let f: Arc<Flights<u32>> = Arc::new(Flights::new());
        let Role::Leader(permit) = f.join(key(1), Join::UNBOUNDED) else {
            panic!("first must lead")
        };
        let mut waits = Vec::new();
        for _ in 0..100 {
            let Role::Follower(w) = f.join(key(1), Join::UNBOUNDED) else {
                panic!("others must follow")
            };
            waits.push(tokio::spawn(w.wait(Duration::from_secs(5), None)));
        }
        assert_eq!(permit.followers(), 100);
        assert!(matches!(f.join(key(2), Join::UNBOUNDED), Role::Leader(_)));
        permit.complete(7);
        for w in waits {
            assert!(matches!(w.await.expect("join"), WaitResult::Done(7)));
        }
        assert!(f.is_empty());
        assert!(matches!(f.join(key(1), Join::UNBOUNDED), Role::Leader(_)));
    }

    #[tokio::test(start_paused = true)]
    async fn unwatched_resolves_when_the_last_follower_stops_waiting() {
        let f: Flights<u32> = Flights::new();
        let Role::Leader(permit) = f.join(key(5), Join::UNBOUNDED) else {
            panic!()
        };
        // Nobody waits: at once.
        permit.unwatched().await;
        let Role::Follower(a) = f.join(key(5), Join::UNBOUNDED) else {
            panic!()
        };
        let watched = tokio::time::timeout(Duration::from_secs(60), permit.unwatched()).await;
        assert!(watched.is_err(), "a follower still waits");
        let waiting = tokio::spawn(a.wait(Duration::from_secs(1), None));
        // The follower's wait times out: nobody waits any more.
        tokio::time::timeout(Duration::from_secs(60), permit.unwatched())
            .await
            .expect("woken when the follower left");
        assert!(matches!(waiting.await.expect("join"), WaitResult::TimedOut));
    }

    #[tokio::test(start_paused = true)]
    async fn followers_that_stop_waiting_are_no_longer_counted() {
        let f: Flights<u32> = Flights::new();
        let Role::Leader(permit) = f.join(key(4), Join::UNBOUNDED) else {
            panic!()
        };
        let Role::Follower(a) = f.join(key(4), Join::UNBOUNDED) else {
            panic!()
        };
        let Role::Follower(b) = f.join(key(4), Join::UNBOUNDED) else {
            panic!()
        };
        assert_eq!(permit.waiting(), 2);
        drop(a);
        assert_eq!(permit.waiting(), 1);
        assert!(matches!(
            b.wait(Duration::from_millis(10), None).await,
            WaitResult::TimedOut
        ));
        assert_eq!(permit.waiting(), 0);
        assert_eq!(permit.followers(), 2);
    }

    #[tokio::test]
    async fn a_dropped_leader_wakes_followers_as_dangling() {
        let f: Flights<u32> = Flights::new();
        let Role::Leader(permit) = f.join(key(1), Join::UNBOUNDED) else {
            panic!()
        };
        let Role::Follower(w) = f.join(key(1), Join::UNBOUNDED) else {
            panic!()
        };
        let h = tokio::spawn(w.wait(Duration::from_secs(5), None));
        drop(permit);
        assert!(matches!(h.await.expect("join"), WaitResult::Dangling));
        assert!(f.is_empty());
    }

    #[tokio::test]
    async fn a_panicking_leader_task_cannot_leave_waiters_hanging() {
        let f: Flights<u32> = Flights::new();
        let Role::Leader(permit) = f.join(key(3), Join::UNBOUNDED) else {
            panic!()
        };
        let Role::Follower(w) = f.join(key(3), Join::UNBOUNDED) else {
            panic!()
        };
        let leader = tokio::spawn(async move {
            let _p = permit;
            panic!("fill failed");
        });
        assert!(leader.await.is_err());
        assert!(matches!(
            w.wait(Duration::from_secs(5), None).await,
            WaitResult::Dangling
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn followers_give_up_after_the_lock_timeout() {
        let f: Flights<u32> = Flights::new();
        let Role::Leader(_permit) = f.join(key(1), Join::UNBOUNDED) else {
            panic!()
        };
        let Role::Follower(w) = f.join(key(1), Join::UNBOUNDED) else {
            panic!()
        };
        assert!(matches!(
            w.wait(Duration::from_millis(50), None).await,
            WaitResult::TimedOut
        ));
    }

    #[tokio::test]
    async fn a_follower_joining_after_completion_still_sees_it() {
        let f: Flights<u32> = Flights::new();
        let Role::Leader(permit) = f.join(key(1), Join::UNBOUNDED) else {
            panic!()
        };
        let Role::Follower(w) = f.join(key(1), Join::UNBOUNDED) else {
            panic!()
        };
        permit.complete(9);
        assert!(matches!(
            w.wait(Duration::from_secs(1), None).await,
            WaitResult::Done(9)
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_wait_list_turns_callers_away() {
        let f: Flights<u32> = Flights::new();
        let bounded = Join {
            max_waiters: 3,
            after_retirement: false,
        };
        let Role::Leader(permit) = f.join(key(1), bounded) else {
            panic!("first must lead")
        };
        let mut waiters = Vec::new();
        for _ in 0..3 {
            let Role::Follower(w) = f.join(key(1), bounded) else {
                panic!("room for three")
            };
            waiters.push(w);
        }
        assert!(matches!(f.join(key(1), bounded), Role::Full));
        // A waiter that leaves makes room again.
        drop(waiters.pop());
        assert!(matches!(f.join(key(1), bounded), Role::Follower(_)));
        permit.complete(1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_flight_held_past_lock_age_is_retired_once() {
        let f: Arc<Flights<u32>> = Arc::new(Flights::new());
        let Role::Leader(first) = f.join(key(1), Join::UNBOUNDED) else {
            panic!("first must lead")
        };
        let mut waits = Vec::new();
        for _ in 0..10 {
            let Role::Follower(w) = f.join(key(1), Join::UNBOUNDED) else {
                panic!("others follow")
            };
            waits.push(tokio::spawn(
                w.wait(Duration::from_secs(30), Some(Duration::from_secs(1))),
            ));
        }
        let started = tokio::time::Instant::now();
        for w in waits {
            assert!(matches!(w.await.expect("join"), WaitResult::Retired));
        }
        assert_eq!(started.elapsed(), Duration::from_secs(1));
        // The key is free: the first to join again leads, the others
        // follow, and that flight is not retired again.
        let again = Join {
            max_waiters: usize::MAX,
            after_retirement: true,
        };
        let Role::Leader(second) = f.join(key(1), again) else {
            panic!("a new flight")
        };
        let Role::Follower(w) = f.join(key(1), again) else {
            panic!("follows the new flight")
        };
        let h = tokio::spawn(w.wait(Duration::from_secs(30), Some(Duration::from_secs(1))));
        tokio::time::sleep(Duration::from_secs(5)).await;
        second.complete(2);
        assert!(matches!(h.await.expect("join"), WaitResult::Done(2)));
        // The first leader ends its retired flight for nobody, and does
        // not disturb the key.
        first.complete(1);
        assert!(f.is_empty());
    }
}
