//! Where records read from Redis are checked before anything uses them:
//! the fleet's [`PeerAuth`] and what a refusal does (counted in
//! `corral_redis_unauthenticated_records_total`, logged at most once per
//! [`LOG_EVERY`]). A refused record is treated as absent, never served and
//! never an error to a client.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use corral_core::callers::peer_auth::{PeerAuth, PeerAuthError, Record};
use tokio::time::Instant;

/// The most often a refusal is logged: a flood of forged records costs one
/// line per interval, with how many were refused meanwhile.
pub const LOG_EVERY: Duration = Duration::from_secs(10);

/// The fleet's key and the refusals' log throttle.
pub struct Trust {
    auth: PeerAuth,
    last_logged: Mutex<Option<Instant>>,
    unlogged: AtomicU64,
}

impl Trust {
    pub fn new(auth: PeerAuth) -> Self {
        Trust {
            auth,
            last_logged: Mutex::new(None),
            unlogged: AtomicU64::new(0),
        }
    }

    /// Whether records are checked at all (`redis.auth: none` says not).
    pub fn enabled(&self) -> bool {
        matches!(self.auth, PeerAuth::Key(_))
    }

    /// `record` tagged for `kind` under `name`, as other instances check it.
    pub fn seal(&self, kind: Record, name: &str, record: &[u8]) -> Vec<u8> {
        self.auth.seal(kind, name, record)
    }

    /// [`Trust::seal`] for a text record.
    pub fn seal_text(&self, kind: Record, name: &str, record: &str) -> String {
        self.auth.seal_text(kind, name, record)
    }

    /// The record in `sealed` if its tag verifies; else `None`, counted.
    pub fn open<'a>(&self, kind: Record, name: &str, sealed: &'a [u8]) -> Option<&'a [u8]> {
        self.auth
            .open(kind, name, sealed)
            .map_err(|e| self.refused(kind, name, e))
            .ok()
    }

    /// [`Trust::open`] for a text record.
    pub fn open_text<'a>(&self, kind: Record, name: &str, sealed: &'a str) -> Option<&'a str> {
        self.auth
            .open_text(kind, name, sealed)
            .map_err(|e| self.refused(kind, name, e))
            .ok()
    }

    /// A record skipped unread (a heartbeat over its size bound): counted
    /// and logged like one that does not verify.
    pub fn skipped(&self, kind: Record, name: &str, why: &'static str) {
        crate::telemetry::metrics::redis_unauthenticated(kind);
        self.log(kind, name, why);
    }

    fn refused(&self, kind: Record, name: &str, error: PeerAuthError) {
        crate::telemetry::metrics::redis_unauthenticated(kind);
        let why = match error {
            PeerAuthError::Missing => "no authentication tag",
            PeerAuthError::Mismatch => "authentication tag does not verify",
        };
        self.log(kind, name, why);
    }

    /// One warning per [`LOG_EVERY`]; the lock is never held across an
    /// await (there is none here).
    fn log(&self, kind: Record, name: &str, why: &'static str) {
        let now = Instant::now();
        let due = {
            let mut last = self
                .last_logged
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let due = last.is_none_or(|at| now.duration_since(at) >= LOG_EVERY);
            if due {
                *last = Some(now);
            }
            due
        };
        if !due {
            self.unlogged.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let also = self.unlogged.swap(0, Ordering::Relaxed);
        tracing::warn!(
            record = kind.as_str(),
            name,
            why,
            also_refused_since_last_warning = also,
            "a record read from Redis was not written by this fleet (or its key differs): ignored, as if absent"
        );
    }
}
