//! The fourth layer of the miss path: the gate in front of the origin.
//! Every origin request of the cache path passes here, so here is where a
//! failing origin is left alone (a key in back-off, a route whose circuit
//! is open: the stale copy or a 503, without a request), where every
//! fetch's verdict feeds the back-off and the circuit, and where a fill
//! takes its slots of the route's and the instance's fill limits. Below
//! it is the exchange (`exchange`).

use std::sync::Arc;

use corral_core::{Admission, Detail, Evidence, Suspicion, UpstreamFailure};

use crate::cache::fill::{Ended, Events, FillOutcome, FillRequest};
use crate::cache::{exchange, synthetic};

/// A slot of the route's and of the instance's fill limits, waited for at
/// most the route's lock timeout (the flight is registered meanwhile, so
/// followers queue behind it instead of adding fills).
async fn take_slots(
    fill: &FillRequest,
) -> Option<(
    tokio::sync::OwnedSemaphorePermit,
    tokio::sync::OwnedSemaphorePermit,
)> {
    let take = async {
        let route = Arc::clone(fill.gate().route_slots)
            .acquire_owned()
            .await
            .ok()?;
        let instance = Arc::clone(fill.gate().instance_slots)
            .acquire_owned()
            .await
            .ok()?;
        Some((route, instance))
    };
    tokio::time::timeout(fill.gate().lock_timeout, take)
        .await
        .ok()
        .flatten()
}

/// No fill slot within the lock timeout: the stale copy, or a 503,
/// without asking the origin.
fn fill_limit(fill: &FillRequest) -> FillOutcome {
    crate::telemetry::metrics::fill_refused(fill.route_name());
    if crate::telemetry::repeats::first_for_route(
        "fill limit reached: not fetching",
        fill.route_name(),
        fill.origin().authority.as_str(),
        "fill-limit",
    ) {
        tracing::warn!(route = %fill.route_name(), key = %fill.primary.loggable(), "fill limit reached: not fetching");
    }
    synthetic::fill_limit(fill)
}

/// Fetches from the origin and stores in L1: the whole fill when there is
/// no Redis, the leader's part when there is. Every origin request of the
/// cache path goes through here, so here is where a failing origin is
/// left alone: a key in back-off, or a route whose circuit is open, gets
/// the stale copy or an error without a request, and every fetch's result
/// feeds both.
pub(crate) async fn fetch(fill: &FillRequest, events: &Events) -> Ended {
    let now = fill.now();
    if let Some(backoff) = fill.l1().active_backoff(|| fill.pass_scope(), now) {
        return Ended::Outcome(skipped(fill, Skipped::Backoff(backoff.remaining(now))));
    }
    // The route's and the instance's fill slots, taken only now that this
    // instance fetches (after the lease is won, with Redis): a fill that
    // waits on another instance's lease holds none.
    let Some(_slots) = take_slots(fill).await else {
        return Ended::Outcome(fill_limit(fill));
    };
    let admission = fill.gate().circuit.allow();
    if admission == Admission::Refuse {
        return Ended::Outcome(skipped(
            fill,
            Skipped::CircuitOpen(fill.gate().circuit.retry_after()),
        ));
    }
    let (asked, hung) = watched(fill).await;
    let ended = exchange::keep(fill, events, asked).await;
    if let Some(verdict) = origin_verdict(&ended)
        && judge(fill, verdict, hung.is_some())
    {
        share_backoff(fill).await;
    }
    ended
}

/// Asks the origin, and counts the fetch toward the route's circuit as a
/// failure of its caller once it has waited the circuit's `hang_after`
/// (twice the route's slowest recent answer, at least `stale_after`) with
/// no answer: an origin that takes connections and never answers opens the
/// circuit in seconds, not at `response_headers`. The count is taken back
/// when the answer comes. The suspicion returned is of a fetch that got
/// no answer: its failure is counted already.
async fn watched(fill: &FillRequest) -> (exchange::Asked, Option<Suspicion>) {
    let circuit = &fill.gate().circuit;
    let started = tokio::time::Instant::now();
    let mut asking = std::pin::pin!(exchange::ask_origin(fill));
    let mut suspicion = None;
    let asked = match circuit.hang_after(fill.origin().stale_after) {
        None => asking.await,
        Some(after) => match tokio::time::timeout(after, &mut asking).await {
            Ok(asked) => asked,
            Err(_) => {
                crate::telemetry::metrics::origin_hung(fill.route_name());
                let caller = corral_core::callers::client_addr::caller_group(fill.head.client);
                suspicion = circuit.suspect(caller);
                asking.await
            }
        },
    };
    if asked.is_answer() {
        circuit.answered_in(started.elapsed());
        if let Some(s) = suspicion.take() {
            circuit.answered(s);
        }
    }
    (asked, suspicion)
}

/// Adopts another instance's record of the key's failures: the longer
/// period and the longer run of failures in a row count (a failure that
/// has not started a period yet still counts toward `backoff.after`).
pub(crate) fn adopt_backoff(fill: &FillRequest, theirs: corral_core::Backoff) {
    let scope = fill.pass_scope();
    let l1 = &fill.l1();
    let merged = match l1.last_backoff(&scope) {
        None => Some(theirs),
        Some(ours) if theirs.until > ours.until || theirs.failures > ours.failures => {
            Some(corral_core::Backoff {
                until: theirs.until.max(ours.until),
                failures: theirs.failures.max(ours.failures),
                // The caller counted last in the longer run.
                caller: if theirs.failures >= ours.failures {
                    theirs.caller
                } else {
                    ours.caller
                },
            })
        }
        Some(_) => None,
    };
    if let Some(merged) = merged {
        l1.set_backoff(
            scope,
            merged,
            fill.gate().backoff.memory(),
            fill.primary.shown(),
        );
    }
}

/// Whether the key is in back-off now: the fill's gate will answer
/// without a request.
pub(crate) fn backing_off(fill: &FillRequest) -> bool {
    let now = fill.now();
    fill.l1()
        .active_backoff(|| fill.pass_scope(), now)
        .is_some()
}

/// The key's back-off, or this caller's own (see [`judge`]), active at
/// `now`: either leaves a caller to the stale copy. Its own never stops a
/// fetch, which would fail the callers who joined its flight with it.
/// `scope`: where the key's back-off of this class of caller is kept.
#[inline]
pub(crate) fn caller_backoff(
    l1: &corral_core::L1,
    scope: impl Fn() -> corral_core::Digest,
    client: std::net::IpAddr,
    now: std::time::SystemTime,
) -> Option<corral_core::Backoff> {
    // The caller's group is worked out only when some key has backed off
    // (the closures run only then): a hit of a key that never failed
    // costs two loads here.
    let caller = || corral_core::callers::client_addr::caller_group(client);
    l1.active_backoff(&scope, now)
        .or_else(|| l1.active_backoff(|| scope().for_caller(caller()), now))
}

/// Writes the key's back-off record this fetch moved to L2, for the other
/// instances, whatever path the fetch took (a leader's, a follower's after
/// its leader failed, one alone), and before any notice of its end: the
/// waiting instances read it on a failure notice. Written whether or not a
/// period has started, so that every instance counts the same failures in
/// a row; never a record this fetch did not move, which is no newer than
/// what was read and would overwrite another instance's newer one.
async fn share_backoff(fill: &FillRequest) {
    let Some(tier) = fill.gate().tier.map(|t| t.as_ref()) else {
        return;
    };
    let Some(backoff) = fill.l1().last_backoff(&fill.pass_scope()) else {
        return;
    };
    let keys = tier.keys(
        &fill.primary,
        fill.variant.digest,
        fill.pass_class().as_ref(),
    );
    let now = fill.now();
    let _ = tier
        .write_backoff(&keys, &backoff, fill.gate().backoff.memory(), now)
        .await;
}

/// Feeds a fetch's verdict to the route's circuit and the key's back-off.
/// Both are shared by every caller, so each takes only the evidence that
/// is not one client's to make (see `Verdict`). True when the key's
/// shared record moved. `hung`: the circuit counted this fetch's failure
/// while it waited (see [`watched`]).
fn judge(fill: &FillRequest, verdict: Verdict, hung: bool) -> bool {
    let caller = corral_core::callers::client_addr::caller_group(fill.head.client);
    if !hung {
        fill.gate().circuit.record(match verdict {
            Verdict::Healthy | Verdict::AppError => Evidence::Healthy,
            Verdict::OriginFault => Evidence::Unreachable,
            Verdict::Failed => Evidence::Failed { caller },
        });
    }
    let scope = fill.pass_scope();
    let own = scope.for_caller(caller);
    let l1 = &fill.l1();
    let previous = l1.last_backoff(&scope);
    let policy = fill.gate().backoff;
    let now = fill.now();
    let backoff = match verdict {
        Verdict::Healthy => {
            l1.clear_backoff(&scope);
            l1.clear_backoff(&own);
            return false;
        }
        Verdict::OriginFault => Some(policy.after_failure(previous, now)),
        Verdict::Failed | Verdict::AppError => {
            // The caller's own failures in a row back its own requests off
            // (to the stale copy: a failing origin still gets quieter when
            // one client hammers it), whatever the others get.
            let mine = policy.after_failure(l1.last_backoff(&own), now);
            l1.set_own_backoff(own, mine, policy.memory());
            policy.after_failure_of(previous, caller, now)
        }
    };
    let Some(backoff) = backoff else {
        return false;
    };
    tracing::debug!(
        route = %fill.route_name(),
        upstream = %fill.origin().authority,
        key = %fill.primary.loggable(),
        failures = backoff.failures,
        "origin failed: backing off"
    );
    l1.set_backoff(scope, backoff, policy.memory(), fill.primary.shown());
    true
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
    crate::telemetry::metrics::origin_skipped(fill.route_name(), detail);
    synthetic::stale_on_error(fill, detail)
        .unwrap_or_else(|| synthetic::unavailable(fill, detail, retry))
}

/// What a fetch says about the origin, for the penalties every caller
/// shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// An answer that is not a 5xx.
    Healthy,
    /// The origin's failure, whoever asked: no connection could be made,
    /// or an answer it had begun (a head that was not a 5xx) broke off or
    /// failed its own digest.
    OriginFault,
    /// A 502, 503 or 504, a timeout or a broken exchange: the origin's,
    /// or the request's (a field that makes the application hang or its
    /// gateway fail), so counted once per caller.
    Failed,
    /// Another 5xx: the application is up and failed this request, which
    /// may be the request's doing. It never counts toward the circuit,
    /// and backs the key off only when two callers see it.
    AppError,
}

/// The verdict on an answer of `status` from the origin.
fn status_verdict(status: http::StatusCode) -> Verdict {
    match status.as_u16() {
        502..=504 => Verdict::Failed,
        _ if status.is_server_error() => Verdict::AppError,
        _ => Verdict::Healthy,
    }
}

/// The verdict of a fetch, or `None` when no request reached the origin
/// (another instance's fill; corral's own queue was full; a request that
/// could not be built).
fn origin_verdict(ended: &Ended) -> Option<Verdict> {
    match ended {
        // A coding the caller does not accept: its own choice, whatever
        // status the origin began with.
        Ended::Outcome(
            FillOutcome::Stale {
                failure: Some(UpstreamFailure::Coding),
                ..
            }
            | FillOutcome::Shared {
                detail: Some(Detail::Upstream(UpstreamFailure::Coding)),
                ..
            },
        ) => Some(Verdict::Healthy),
        Ended::Stream(_, answer) => Some(status_verdict(answer.response.status())),
        // A 5xx the origin made cacheable is still a failing origin.
        Ended::Outcome(FillOutcome::Stored { entry, .. }) => Some(status_verdict(entry.status())),
        // Another instance's fill, read from L2: no request of this one.
        Ended::Outcome(FillOutcome::FromL2 { .. }) => None,
        Ended::Outcome(FillOutcome::Pass { .. } | FillOutcome::Streaming { .. }) => {
            Some(Verdict::Healthy)
        }
        Ended::Outcome(FillOutcome::Stale {
            detail: Detail::StaleIfError,
            fwd_status,
            failure,
            ..
        }) => match (
            failure,
            fwd_status.and_then(|s| http::StatusCode::from_u16(s).ok()),
        ) {
            // An answer the origin began and broke.
            (Some(_), Some(status)) if !status.is_server_error() => Some(Verdict::OriginFault),
            (Some(failure), _) => failure_verdict(*failure),
            (None, Some(status)) => Some(status_verdict(status)),
            (None, None) => Some(Verdict::Failed),
        },
        Ended::Outcome(FillOutcome::Stale { .. }) => None,
        Ended::Outcome(FillOutcome::Shared {
            detail: Some(Detail::UpstreamBusy),
            ..
        }) => None,
        Ended::Outcome(FillOutcome::Shared {
            detail: Some(Detail::Upstream(failure)),
            response,
            ..
        }) => match response.upstream_status {
            // The origin began an answer and broke it: not a thing the
            // request's fields decide.
            Some(status) if status < 500 => Some(Verdict::OriginFault),
            _ => failure_verdict(*failure),
        },
        Ended::Outcome(FillOutcome::Shared { response, .. }) => {
            Some(status_verdict(response.status))
        }
    }
}

/// The verdict on an exchange that failed before an answer.
fn failure_verdict(failure: UpstreamFailure) -> Option<Verdict> {
    match failure {
        UpstreamFailure::Connect
        | UpstreamFailure::ConnectRefused
        | UpstreamFailure::ConnectTimeout
        | UpstreamFailure::Tls
        | UpstreamFailure::TlsCertificate
        | UpstreamFailure::TlsAlert
        // A body that does not match the origin's own digest.
        | UpstreamFailure::Digest => Some(Verdict::OriginFault),
        // The origin answered; the caller's Accept-Encoding, which one
        // client chooses, made its coding a failure for that caller.
        UpstreamFailure::Coding => Some(Verdict::Healthy),
        UpstreamFailure::Timeout
        | UpstreamFailure::TotalTimeout
        | UpstreamFailure::Exchange
        | UpstreamFailure::Protocol => Some(Verdict::Failed),
        // Nothing was sent: the client's request could not be made one.
        UpstreamFailure::Request => None,
    }
}
