//! The fourth layer of the miss path: the gate in front of the origin.
//! Every origin request of the cache path passes here, so here is where a
//! failing origin is left alone (a key in back-off, a route whose circuit
//! is open: the stale copy or a 503, without a request), where every
//! fetch's verdict feeds the back-off and the circuit, and where a fill
//! takes its slots of the route's and the instance's fill limits. Below
//! it is the exchange (`exchange`).

use std::sync::Arc;

use corral_core::{Admission, Detail};

use crate::cache::fill::{Ended, Events, FillOutcome, FillRequest};
use crate::cache::{exchange, made};

/// A slot of the route's and of the instance's fill limits, waited for at
/// most the route's lock timeout (the flight is registered meanwhile, so
/// followers queue behind it instead of adding fills).
pub(crate) async fn take_slots(
    fill: &FillRequest,
) -> Option<(
    tokio::sync::OwnedSemaphorePermit,
    tokio::sync::OwnedSemaphorePermit,
)> {
    let take = async {
        let route = Arc::clone(&fill.route.fills).acquire_owned().await.ok()?;
        let instance = Arc::clone(&fill.cache.fills).acquire_owned().await.ok()?;
        Some((route, instance))
    };
    tokio::time::timeout(fill.route.lock_timeout, take)
        .await
        .ok()
        .flatten()
}

/// Fetches from the origin and stores in L1: the whole fill when there is
/// no Redis, the leader's part when there is. Every origin request of the
/// cache path goes through here, so here is where a failing origin is
/// left alone: a key in back-off, or a route whose circuit is open, gets
/// the stale copy or an error without a request, and every fetch's result
/// feeds both.
pub(crate) async fn fetch(fill: &FillRequest, events: &Events) -> Ended {
    let now = fill.cache.clock.now();
    if let Some(backoff) = fill.cache.l1.active_backoff(|| fill.pass_scope(), now) {
        return Ended::Outcome(skipped(fill, Skipped::Backoff(backoff.remaining(now))));
    }
    let admission = fill.route.circuit.allow();
    if admission == Admission::Refuse {
        return Ended::Outcome(skipped(
            fill,
            Skipped::CircuitOpen(fill.route.circuit.retry_after()),
        ));
    }
    let ended = exchange::fetch(fill, events).await;
    if let Some(ok) = origin_verdict(&ended) {
        fill.route.circuit.record(ok);
        let scope = fill.pass_scope();
        if ok {
            fill.cache.l1.clear_backoff(&scope);
        } else {
            let policy = fill.route.backoff;
            let backoff =
                policy.after_failure(fill.cache.l1.last_backoff(&scope), fill.cache.clock.now());
            tracing::debug!(key = %fill.primary.loggable(), failures = backoff.failures, "origin failed: backing off");
            let name = fill.primary.shown();
            fill.cache
                .l1
                .set_backoff(scope, backoff, policy.memory(), name);
        }
    }
    ended
}

/// Why an origin request was not made.
enum Skipped {
    /// The key is in back-off for this much longer.
    Backoff(std::time::Duration),
    /// The route's circuit is open; a probe may go in this long.
    CircuitOpen(std::time::Duration),
}

/// What callers get when the origin is left alone: the stale copy while
/// stale-if-error (or stale-while-revalidate) allows it, else a 503 that
/// says when to come back.
fn skipped(fill: &FillRequest, why: Skipped) -> FillOutcome {
    let (detail, retry) = match why {
        Skipped::Backoff(d) => (Detail::Backoff, d),
        Skipped::CircuitOpen(d) => (Detail::CircuitOpen, d),
    };
    crate::telemetry::metrics::origin_skipped(&fill.route.name, detail);
    made::stale_on_error(fill, detail).unwrap_or_else(|| made::unavailable(fill, detail, retry))
}

/// Whether a fetch reached a healthy origin (`Some(true)`), a failing one
/// (`Some(false)`: a 5xx, a refused connection, a timeout), or was no
/// fetch at all.
fn origin_verdict(ended: &Ended) -> Option<bool> {
    match ended {
        Ended::Stream(_, answer) => Some(!answer.response.status().is_server_error()),
        // A 5xx the origin made cacheable is still a failing origin.
        Ended::Outcome(FillOutcome::Stored { entry, .. }) => {
            Some(!entry.status().is_server_error())
        }
        // Another instance's fill, read from L2: no request of this one.
        Ended::Outcome(FillOutcome::FromL2 { .. }) => None,
        Ended::Outcome(FillOutcome::Pass { .. } | FillOutcome::Streaming { .. }) => Some(true),
        Ended::Outcome(FillOutcome::Stale { detail, .. }) => {
            (*detail == Detail::StaleIfError).then_some(false)
        }
        Ended::Outcome(FillOutcome::Shared {
            detail: Some(Detail::UpstreamBusy),
            ..
        }) => None,
        Ended::Outcome(FillOutcome::Shared { response, .. }) => {
            Some(!response.status.is_server_error())
        }
    }
}
