//! A route's upstream servers (`upstreams: [..]`, or the one `upstream:`)
//! and their passive health, as nginx's `upstream { server …; max_fails;
//! fail_timeout; }`: a server that fails `max_fails` times within
//! `fail_timeout` (a refused or failed connection, a TLS failure, an
//! exchange that broke before the answer, a timeout; not a 5xx, which is
//! an answer) is left out for `fail_timeout`, then tried again by the
//! next request (its success brings it back). When every server is out,
//! the one due back first is used rather than none. An optional active
//! check (`health.check_path`) asks each server every `check_interval`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use http::uri::Authority;
use tokio::time::Instant;

use crate::config::Balance;

pub struct Pool {
    route: String,
    pub servers: Vec<Server>,
    balance: Balance,
    max_fails: u32,
    fail_timeout: Duration,
    next: AtomicUsize,
}

pub struct Server {
    pub authority: Authority,
    health: Mutex<Health>,
    outstanding: AtomicUsize,
    up: metrics::Gauge,
}

#[derive(Default)]
struct Health {
    fails: u32,
    since: Option<Instant>,
    down_until: Option<Instant>,
}

/// One request outstanding to a server, until dropped.
pub struct Outstanding<'p>(&'p Server);

impl Drop for Outstanding<'_> {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The same, owned (held by an answer's body).
pub struct OwnedOutstanding(std::sync::Arc<Pool>, usize);

impl Drop for OwnedOutstanding {
    fn drop(&mut self) {
        if let Some(s) = self.0.servers.get(self.1) {
            s.outstanding.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Pool {
    pub fn new(
        route: &str,
        authorities: Vec<Authority>,
        balance: Balance,
        max_fails: u32,
        fail_timeout: Duration,
    ) -> Self {
        Pool {
            route: route.to_owned(),
            servers: authorities
                .into_iter()
                .map(|authority| {
                    let up =
                        crate::telemetry::metrics::upstream_server_up(route, authority.as_str());
                    up.set(1.0);
                    Server {
                        authority,
                        health: Mutex::new(Health::default()),
                        outstanding: AtomicUsize::new(0),
                        up,
                    }
                })
                .collect(),
            balance,
            max_fails: max_fails.max(1),
            fail_timeout,
            next: AtomicUsize::new(0),
        }
    }

    /// The server for the next attempt, other than `exclude` when there
    /// is another.
    pub fn pick(&self, exclude: Option<usize>) -> usize {
        let n = self.servers.len();
        if n <= 1 {
            return 0;
        }
        let now = Instant::now();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let order = (0..n)
            .map(|k| (start + k) % n)
            .filter(|i| Some(*i) != exclude);
        let available = |i: &usize| self.servers[*i].available(now);
        let chosen = match self.balance {
            Balance::RoundRobin => order.clone().find(available),
            Balance::LeastOutstanding => order
                .clone()
                .filter(available)
                .min_by_key(|i| self.servers[*i].outstanding.load(Ordering::Acquire)),
        };
        // Every other server is out: the one due back first.
        chosen.unwrap_or_else(|| {
            order
                .min_by_key(|i| self.servers[*i].down_until())
                .unwrap_or(0)
        })
    }

    /// Counts a request as outstanding to server `i` while the guard lives.
    pub fn outstanding(&self, i: usize) -> Outstanding<'_> {
        let s = &self.servers[i.min(self.servers.len() - 1)];
        s.outstanding.fetch_add(1, Ordering::AcqRel);
        Outstanding(s)
    }

    /// The same, for a guard that outlives this call (the answer's body).
    pub fn hold(self: &std::sync::Arc<Self>, i: usize) -> OwnedOutstanding {
        if let Some(s) = self.servers.get(i) {
            s.outstanding.fetch_add(1, Ordering::AcqRel);
        }
        OwnedOutstanding(std::sync::Arc::clone(self), i)
    }

    /// Server `i` failed a request (or a check).
    pub fn failed(&self, i: usize) {
        let Some(s) = self.servers.get(i) else { return };
        let now = Instant::now();
        let mut h = s.health.lock().unwrap_or_else(PoisonError::into_inner);
        if h.since
            .is_none_or(|t| now.duration_since(t) > self.fail_timeout)
        {
            h.fails = 0;
            h.since = Some(now);
        }
        h.fails += 1;
        if h.fails >= self.max_fails && self.servers.len() > 1 {
            if h.down_until.is_none_or(|t| t <= now) {
                tracing::warn!(route = %self.route, server = %s.authority, fails = h.fails, for_s = self.fail_timeout.as_secs_f64(), "upstream server left out");
            }
            h.down_until = Some(now + self.fail_timeout);
            s.up.set(0.0);
        }
    }

    /// Server `i` answered (or passed a check): it is in again.
    pub fn succeeded(&self, i: usize) {
        let Some(s) = self.servers.get(i) else { return };
        let mut h = s.health.lock().unwrap_or_else(PoisonError::into_inner);
        if h.down_until.is_some() {
            tracing::info!(route = %self.route, server = %s.authority, "upstream server back");
        }
        *h = Health::default();
        s.up.set(1.0);
    }
}

impl Server {
    fn available(&self, now: Instant) -> bool {
        self.health
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .down_until
            .is_none_or(|t| t <= now)
    }

    fn down_until(&self) -> Option<Instant> {
        self.health
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .down_until
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(balance: Balance) -> Pool {
        let a = |s: &'static str| Authority::from_static(s);
        Pool::new(
            "t",
            vec![a("a:1"), a("b:1"), a("c:1")],
            balance,
            2,
            Duration::from_secs(10),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn round_robin_skips_a_server_that_failed_max_fails_times_until_fail_timeout() {
        let p = pool(Balance::RoundRobin);
        let picks: Vec<usize> = (0..6).map(|_| p.pick(None)).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        p.failed(1);
        assert!(
            (0..6).any(|_| p.pick(None) == 1),
            "one failure is not max_fails"
        );
        p.failed(1);
        assert!((0..30).all(|_| p.pick(None) != 1));
        tokio::time::advance(Duration::from_secs(11)).await;
        assert!(
            (0..6).any(|_| p.pick(None) == 1),
            "tried again after fail_timeout"
        );
        p.succeeded(1);
        assert!((0..6).filter(|_| p.pick(None) == 1).count() >= 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_retry_goes_elsewhere_and_all_down_still_picks_one() {
        let p = pool(Balance::RoundRobin);
        for _ in 0..20 {
            let first = p.pick(None);
            assert_ne!(p.pick(Some(first)), first);
        }
        for i in 0..3 {
            p.failed(i);
            p.failed(i);
        }
        assert!(p.pick(None) < 3);
    }

    #[tokio::test(start_paused = true)]
    async fn least_outstanding_prefers_the_idle_server() {
        let p = pool(Balance::LeastOutstanding);
        let _a = p.outstanding(0);
        let _b = p.outstanding(0);
        let _c = p.outstanding(2);
        assert!((0..10).all(|_| p.pick(None) == 1));
    }
}
