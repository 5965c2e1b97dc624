//! In-process coalescing: one flight per key. The first request leads and
//! holds a `Permit`; the others wait on the flight's outcome. Every waiter
//! sees the outcome exactly once, and a leader that is dropped without
//! finishing (its task panicked or was cancelled) wakes every waiter with
//! `Dangling`, so nobody hangs (the model: pingora-cache's lock.rs).
//! The registry lock is a plain mutex held only for map edits, never across
//! an await.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::watch;

use crate::key::Digest;

/// How a flight ended.
#[derive(Debug, Clone)]
pub enum FlightEnd<T> {
    Done(T),
    /// The leader went away without an outcome.
    Dangling,
}

struct Slot<T> {
    tx: watch::Sender<Option<FlightEnd<T>>>,
    followers: AtomicUsize,
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
}

/// What a follower's wait came to.
#[derive(Debug)]
pub enum WaitResult<T> {
    Done(T),
    /// The leader went away; the caller may try to lead.
    Dangling,
    /// The lock timeout passed first.
    TimedOut,
}

impl<T: Clone + Send + Sync + 'static> Flights<T> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Leads the flight for `key`, or follows the one under way.
    pub fn join(&self, key: Digest) -> Role<T> {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = map.get(&key) {
            slot.followers.fetch_add(1, Ordering::Relaxed);
            return Role::Follower(Waiter {
                rx: slot.tx.subscribe(),
            });
        }
        let (tx, _) = watch::channel(None);
        let slot = Arc::new(Slot {
            tx,
            followers: AtomicUsize::new(0),
        });
        map.insert(key, Arc::clone(&slot));
        Role::Leader(Permit {
            key,
            slot,
            map: Arc::clone(&self.map),
            finished: false,
        })
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
}

/// The leader's obligation to end its flight.
pub struct Permit<T> {
    key: Digest,
    slot: Arc<Slot<T>>,
    map: Registry<T>,
    finished: bool,
}

impl<T> Permit<T> {
    /// Followers so far.
    pub fn followers(&self) -> usize {
        self.slot.followers.load(Ordering::Relaxed)
    }

    /// Followers still waiting: one that gave up (lock timeout) or whose
    /// client went away no longer counts.
    pub fn waiting(&self) -> usize {
        self.slot.tx.receiver_count()
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
}

impl<T: Clone> Waiter<T> {
    /// Waits for the outcome, at most `timeout`.
    pub async fn wait(mut self, timeout: Duration) -> WaitResult<T> {
        let got = tokio::time::timeout(timeout, self.rx.wait_for(Option::is_some)).await;
        match got {
            Err(_) => WaitResult::TimedOut,
            Ok(Err(_)) => WaitResult::Dangling,
            Ok(Ok(v)) => match &*v {
                Some(FlightEnd::Done(t)) => WaitResult::Done(t.clone()),
                _ => WaitResult::Dangling,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> Digest {
        Digest([n; 32])
    }

    #[tokio::test]
    async fn one_leader_many_followers_all_see_the_outcome_once() {
        let f: Arc<Flights<u32>> = Arc::new(Flights::new());
        let Role::Leader(permit) = f.join(key(1)) else {
            panic!("first must lead")
        };
        let mut waits = Vec::new();
        for _ in 0..100 {
            let Role::Follower(w) = f.join(key(1)) else {
                panic!("others must follow")
            };
            waits.push(tokio::spawn(w.wait(Duration::from_secs(5))));
        }
        assert_eq!(permit.followers(), 100);
        assert!(matches!(f.join(key(2)), Role::Leader(_)));
        permit.complete(7);
        for w in waits {
            assert!(matches!(w.await.expect("join"), WaitResult::Done(7)));
        }
        assert!(f.is_empty());
        assert!(matches!(f.join(key(1)), Role::Leader(_)));
    }

    #[tokio::test(start_paused = true)]
    async fn followers_that_stop_waiting_are_no_longer_counted() {
        let f: Flights<u32> = Flights::new();
        let Role::Leader(permit) = f.join(key(4)) else {
            panic!()
        };
        let Role::Follower(a) = f.join(key(4)) else {
            panic!()
        };
        let Role::Follower(b) = f.join(key(4)) else {
            panic!()
        };
        assert_eq!(permit.waiting(), 2);
        drop(a);
        assert_eq!(permit.waiting(), 1);
        assert!(matches!(
            b.wait(Duration::from_millis(10)).await,
            WaitResult::TimedOut
        ));
        assert_eq!(permit.waiting(), 0);
        assert_eq!(permit.followers(), 2);
    }

    #[tokio::test]
    async fn a_dropped_leader_wakes_followers_as_dangling() {
        let f: Flights<u32> = Flights::new();
        let Role::Leader(permit) = f.join(key(1)) else {
            panic!()
        };
        let Role::Follower(w) = f.join(key(1)) else {
            panic!()
        };
        let h = tokio::spawn(w.wait(Duration::from_secs(5)));
        drop(permit);
        assert!(matches!(h.await.expect("join"), WaitResult::Dangling));
        assert!(f.is_empty());
    }

    #[tokio::test]
    async fn a_panicking_leader_task_cannot_leave_waiters_hanging() {
        let f: Flights<u32> = Flights::new();
        let Role::Leader(permit) = f.join(key(3)) else {
            panic!()
        };
        let Role::Follower(w) = f.join(key(3)) else {
            panic!()
        };
        let leader = tokio::spawn(async move {
            let _p = permit;
            panic!("fill failed");
        });
        assert!(leader.await.is_err());
        assert!(matches!(
            w.wait(Duration::from_secs(5)).await,
            WaitResult::Dangling
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn followers_give_up_after_the_lock_timeout() {
        let f: Flights<u32> = Flights::new();
        let Role::Leader(_permit) = f.join(key(1)) else {
            panic!()
        };
        let Role::Follower(w) = f.join(key(1)) else {
            panic!()
        };
        assert!(matches!(
            w.wait(Duration::from_millis(50)).await,
            WaitResult::TimedOut
        ));
    }

    #[tokio::test]
    async fn a_follower_joining_after_completion_still_sees_it() {
        let f: Flights<u32> = Flights::new();
        let Role::Leader(permit) = f.join(key(1)) else {
            panic!()
        };
        let Role::Follower(w) = f.join(key(1)) else {
            panic!()
        };
        permit.complete(9);
        assert!(matches!(
            w.wait(Duration::from_secs(1)).await,
            WaitResult::Done(9)
        ));
    }
}
