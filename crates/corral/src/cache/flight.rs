//! The second layer of the miss path: the key's flight in this process.
//! A request that missed joins it and leads (its fill runs in a task of
//! its own, so a client that disconnects never cancels it for the
//! others) or follows (waits for the leader's outcome, at most the
//! route's lock timeout, then does what `on_timeout` says); a full wait
//! list, a leader held past `lock_age` and a fill nobody wants any more
//! end here. The fill itself runs in `driver`, the layer below.

use corral_core::model::miss::{Miss, Next, WaitEnd};
use corral_core::{Detail, Forward, Join, PassReason, Permit, Role, WaitResult};
use http::StatusCode;
use tokio::sync::oneshot;

use crate::cache::fill::{Ended, FillOutcome, FillRequest};
use crate::cache::respond::{self, Answer};
use crate::cache::{driver, outcome, synthetic};
use crate::config::OnTimeout;

/// A request that missed, on its way into the key's flight.
pub struct Joining {
    /// The fill it would lead; its variant is the flight's key.
    pub fill: FillRequest,
    /// Through the flight; otherwise alone (coalescing off, or the
    /// caller's view of the URI is hit-for-pass).
    pub coalesce: bool,
}

/// What a request's time in the flight came to.
pub enum Flown {
    Answer(Answer),
    /// Look the key up again: the leader taught a Vary set, or left.
    LookAgain,
}

/// Leads, follows or fetches alone, as the flight and `miss` say.
pub async fn fly(joining: Joining, miss: &mut Miss, head: bool) -> Flown {
    let Joining { mut fill, coalesce } = joining;
    if !coalesce {
        return Flown::Answer(lead(fill, None, head).await);
    }
    // A GET's fill of the key under way answers a HEAD too, with no
    // request of its own: it follows that flight, as it did before HEADs
    // were sent as HEAD.
    if fill.by_head && fill.flight().flights.under_way(fill.variant.digest) {
        fill.by_head = false;
    }
    let join = Join {
        max_waiters: fill.flight().coalesce.max_waiters,
        after_retirement: miss.after_retirement(),
    };
    match fill.flight().flights.join(fill.flight_key(), join) {
        Role::Leader(permit) => {
            // The flight this request would have followed may have ended
            // between its lookup and this join (a rate limit or a rule
            // read awaited in between): its copy answers, not a second
            // fetch. Once per request, so a copy that keeps vanishing
            // cannot hold it here.
            if miss.recheck() && fill.filled_meanwhile() {
                drop(permit);
                return Flown::LookAgain;
            }
            permit.name(fill.primary.shown());
            Flown::Answer(lead(fill, Some(permit), head).await)
        }
        Role::Follower(waiter) => follow(fill, waiter, miss, head).await,
        Role::Full => {
            let outcome = synthetic::wait_list_full(&fill);
            Flown::Answer(answer(&fill, &outcome, true, head))
        }
    }
}

/// Waits on the leader's fill. Under `on_timeout: fetch`, a follower that
/// times out hands the key to one waiter (itself, if first to look
/// again), and the flight that waiter leads is waited on to its end: its
/// exchange is bounded by the route's `timeouts.total`, and fetching
/// beside it would be the stampede.
async fn follow(
    fill: FillRequest,
    waiter: corral_core::Waiter<FillOutcome>,
    miss: &mut Miss,
    head: bool,
) -> Flown {
    let coalesce = fill.flight().coalesce;
    let retire_on_timeout = coalesce.on_timeout == OnTimeout::Fetch;
    let patience = if retire_on_timeout && miss.after_retirement() {
        fill.origin().total + coalesce.lock_timeout
    } else {
        coalesce.lock_timeout
    };
    let waited = waiter.wait_with(patience, coalesce.lock_age, retire_on_timeout);
    let end = match waited.await {
        WaitResult::Done(outcome) => wait_end(&fill, outcome),
        WaitResult::Dangling => WaitEnd::Dangling,
        WaitResult::Retired => WaitEnd::Retired,
        WaitResult::TimedOut => WaitEnd::TimedOut,
    };
    match miss.waited(end) {
        Next::Answer(outcome) => Flown::Answer(answer(&fill, &outcome, true, head)),
        Next::LookAgain => Flown::LookAgain,
        Next::OnLockTimeout if retire_on_timeout => {
            let outcome = synthetic::gave_up(&fill);
            Flown::Answer(answer(&fill, &outcome, true, head))
        }
        Next::OnLockTimeout => Flown::Answer(on_lock_timeout(fill, head).await),
        Next::FetchAlone => Flown::Answer(lead(fill, None, head).await),
    }
}

/// The leader's outcome, as the follower's decision needs it: whether it
/// is for this request's variant.
fn wait_end(fill: &FillRequest, outcome: FillOutcome) -> WaitEnd<FillOutcome> {
    let request = &fill.head.headers;
    match &outcome {
        FillOutcome::Stored { entry, .. } | FillOutcome::FromL2 { entry, .. } => WaitEnd::Stored {
            fits: entry.matches_vary(request),
            outcome,
        },
        // A stream that began to pass through without being stored can
        // no longer be read from its first byte: look again (and fetch
        // alone, the key now being hit-for-pass).
        FillOutcome::Streaming { head, body, .. } => WaitEnd::Stored {
            fits: head.matches_vary(request) && body.joinable(),
            outcome,
        },
        // A coding the leader's caller did not accept is that caller's
        // failure alone: look again (and fetch, if need be) for this one.
        FillOutcome::Shared {
            detail: Some(Detail::Upstream(corral_core::UpstreamFailure::Coding)),
            ..
        } => WaitEnd::Rekeyed,
        FillOutcome::Shared { response, .. } => WaitEnd::Shared {
            fits: response.matches_vary(request),
            outcome,
        },
        // A hung fetch's callers were answered from the stale copy (the
        // driver's fallback), and so is whoever joins while the fetch runs
        // on, but only while stale-if-error allows the copy: past that,
        // this caller gives up on the flight as on a lock timeout.
        FillOutcome::Stale {
            entry,
            detail: Detail::StaleIfError,
            ..
        } if !entry.usable_on_error(fill.now()) => WaitEnd::TimedOut,
        FillOutcome::Stale { .. } => WaitEnd::Shared {
            fits: true,
            outcome,
        },
        // The answer named another No-Vary-Search rule than the key's:
        // the path knows it now, and this request's key under it may be
        // the leader's, stored by the next flight, or its own.
        FillOutcome::Pass {
            reason: PassReason::RuleChanged,
        } => WaitEnd::Rekeyed,
        FillOutcome::Pass { reason } => {
            tracing::debug!(route = %fill.route_name(), key = %fill.primary.loggable(), reason = reason.as_str(), "uncacheable: fetching alone");
            WaitEnd::Pass
        }
    }
}

fn answer(fill: &FillRequest, outcome: &FillOutcome, collapsed: bool, head: bool) -> Answer {
    let now = fill.now();
    outcome::from_outcome(outcome, collapsed, now, head, &fill.head.headers)
}

/// Runs the fill in its own task and waits for it.
async fn lead(fill: FillRequest, permit: Option<Permit<FillOutcome>>, head: bool) -> Answer {
    let request_headers = fill.head.headers.clone();
    let clock = fill.clock();
    let (tx, rx) = oneshot::channel();
    tokio::spawn(driver::run(fill, permit, Some(tx)));
    match rx.await {
        Ok(Ended::Outcome(o)) => {
            outcome::from_outcome(&o, false, clock.now(), head, &request_headers)
        }
        Ok(Ended::Stream(_, answer)) if head => answer.without_body(),
        Ok(Ended::Stream(_, answer)) => answer,
        Err(_) => respond::error(
            StatusCode::BAD_GATEWAY,
            Forward::Miss,
            Detail::FillFailed,
            None,
        ),
    }
}

/// The route's `on_timeout` for a follower that waited its lock timeout.
async fn on_lock_timeout(fill: FillRequest, head: bool) -> Answer {
    match synthetic::on_lock_timeout(&fill) {
        Some(outcome) => answer(&fill, &outcome, false, head),
        None => lead(fill, None, head).await,
    }
}
