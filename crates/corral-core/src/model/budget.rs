//! A byte budget shared by everything that buffers a response before it
//! is stored (fills, shared errors): what they hold at once is bounded, so
//! many slow fills cannot take memory the cache bound does not see. A fill
//! that cannot get more streams through uncached instead of waiting.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// The budget: bytes in use and the limit.
#[derive(Debug)]
pub struct Budget {
    used: AtomicU64,
    limit: u64,
}

impl Budget {
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(Budget {
            used: AtomicU64::new(0),
            limit,
        })
    }

    /// A hold on nothing yet, to grow as bytes arrive.
    pub fn hold(self: &Arc<Self>) -> Hold {
        Hold {
            budget: Arc::clone(self),
            held: 0,
        }
    }

    /// Bytes held now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }
}

/// Bytes taken from a [`Budget`], given back when dropped.
#[derive(Debug)]
pub struct Hold {
    budget: Arc<Budget>,
    held: u64,
}

impl Hold {
    /// Takes `n` more bytes; false (and nothing taken) when that would pass
    /// the limit.
    pub fn grow(&mut self, n: u64) -> bool {
        let taken = self
            .budget
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n)
                    .filter(|total| *total <= self.budget.limit)
            });
        if taken.is_ok() {
            self.held += n;
        }
        taken.is_ok()
    }

    pub fn held(&self) -> u64 {
        self.held
    }

    /// Gives back everything held now; the hold may grow again.
    pub fn release(&mut self) {
        self.budget.used.fetch_sub(self.held, Ordering::AcqRel);
        self.held = 0;
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.held, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_never_pass_the_limit_and_give_back_on_drop() {
        let b = Budget::new(100);
        let mut a = b.hold();
        let mut c = b.hold();
        assert!(a.grow(60));
        assert!(!c.grow(41), "60 + 41 is over 100");
        assert!(c.grow(40));
        assert_eq!(b.used(), 100);
        assert!(!a.grow(1));
        drop(a);
        assert_eq!(b.used(), 40);
        assert!(c.grow(60));
        drop(c);
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn concurrent_holds_stay_within_the_limit() {
        let b = Budget::new(1000);
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let b = Arc::clone(&b);
                std::thread::spawn(move || {
                    let mut h = b.hold();
                    let mut got = 0;
                    for _ in 0..1000 {
                        if h.grow(1) {
                            got += 1;
                        }
                        assert!(b.used() <= 1000);
                    }
                    (got, h)
                })
            })
            .collect();
        let holds: Vec<_> = threads
            .into_iter()
            .map(|t| t.join().expect("thread"))
            .collect();
        let total: u64 = holds.iter().map(|(g, _)| *g).sum();
        assert_eq!(total, 1000, "exactly the limit was handed out");
        drop(holds);
        assert_eq!(b.used(), 0);
    }
}
