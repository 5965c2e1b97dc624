//! The outcomes corral makes itself, for a fill whose origin is not asked
//! or fails: the stale copy while stale-if-error allows it, else an error
//! every waiter shares (504 past the lock timeout, 503 with Retry-After
//! when a limit or a back-off turns the fill away, the upstream's failure
//! as 502 or 504).

use std::sync::Arc;
use std::time::Duration;

use corral_core::Detail;
use http::StatusCode;

use crate::cache::fill::{FillOutcome, FillRequest, SharedResponse};
use crate::config::OnTimeout;
use crate::origin::upstream::UpstreamError;

/// The route's `on_timeout` for a wait on another request's fill (local or
/// on another instance) that ran past `lock_timeout`: the outcome to answer
/// with, or `None` to fetch without waiting any more. (A follower in this
/// process under `fetch` never gets here on its first timeout: its flight
/// is handed to one waiter instead; see [`gave_up`].)
pub fn on_lock_timeout(fill: &FillRequest) -> Option<FillOutcome> {
    match fill.coalesce_params().on_timeout {
        OnTimeout::Fetch | OnTimeout::FetchEach => None,
        OnTimeout::Stale => fill.stale().map(|entry| FillOutcome::Stale {
            entry,
            fwd_status: None,
            detail: Detail::LockTimeout,
            failure: None,
        }),
        OnTimeout::Error => Some(lock_timeout_error(fill)),
    }
}

/// The 504 every waiter past its lock timeout shares.
fn lock_timeout_error(fill: &FillRequest) -> FillOutcome {
    FillOutcome::Shared {
        response: Arc::new(SharedResponse::corral_error(
            StatusCode::GATEWAY_TIMEOUT,
            Detail::LockTimeout,
            None,
        )),
        fwd: fill.fwd,
        detail: Some(Detail::LockTimeout),
    }
}

/// A follower under `on_timeout: fetch` whose wait on the flight one waiter
/// led after a lock timeout outlived even that flight's exchange deadline:
/// the stale copy if stale-if-error allows it, else 504. Never a fetch of
/// its own: that would be the stampede.
pub fn gave_up(fill: &FillRequest) -> FillOutcome {
    stale_on_error(fill, Detail::LockTimeout).unwrap_or_else(|| lock_timeout_error(fill))
}

/// What waiters get when no fill slot came in time: the stale copy if it
/// may still be served, else a 503 for every one of them.
pub(crate) fn fill_limit(fill: &FillRequest) -> FillOutcome {
    stale_on_error(fill, Detail::FillLimit)
        .unwrap_or_else(|| unavailable(fill, Detail::FillLimit, Duration::from_secs(1)))
}

/// What a caller turned away from a full wait list gets: the stale copy
/// if it may still be served, else a 503 saying to come back in a second.
pub fn wait_list_full(fill: &FillRequest) -> FillOutcome {
    crate::telemetry::metrics::wait_list_full(fill.route_name());
    stale_on_error(fill, Detail::WaitListFull)
        .unwrap_or_else(|| unavailable(fill, Detail::WaitListFull, Duration::from_secs(1)))
}

/// The stale copy in hand, labelled `detail`, if stale-if-error still
/// allows serving it.
pub(crate) fn stale_on_error(fill: &FillRequest, detail: Detail) -> Option<FillOutcome> {
    let entry = fill.stale().filter(|s| s.usable_on_error(fill.now()))?;
    Some(FillOutcome::Stale {
        entry,
        fwd_status: None,
        detail,
        failure: None,
    })
}

/// corral's own 503 for every caller, saying when to come back.
pub(crate) fn unavailable(
    fill: &FillRequest,
    detail: Detail,
    retry_after: Duration,
) -> FillOutcome {
    let mut response = SharedResponse::corral_error(StatusCode::SERVICE_UNAVAILABLE, detail, None);
    response.headers.insert(
        http::header::RETRY_AFTER,
        http::HeaderValue::from(retry_after.as_secs_f64().ceil().max(1.0) as u64),
    );
    FillOutcome::Shared {
        response: Arc::new(response),
        fwd: fill.fwd,
        detail: Some(detail),
    }
}

/// The failure every waiter shares, or the stale entry if stale-if-error
/// allows it.
pub(crate) fn failed(fill: &FillRequest, e: &UpstreamError) -> FillOutcome {
    failed_after(fill, e, None)
}

/// [`failed`] for an answer whose head (`status`) came and whose body then
/// failed (broke off, ran past the deadline, or failed its digest): the
/// status is kept as the origin's (`fwd-status`), and tells the gate that
/// the origin began an answer, which no field of the request decides.
pub(crate) fn broke_off(fill: &FillRequest, e: &UpstreamError, status: StatusCode) -> FillOutcome {
    failed_after(fill, e, Some(status.as_u16()))
}

fn failed_after(fill: &FillRequest, e: &UpstreamError, head: Option<u16>) -> FillOutcome {
    if let UpstreamError::Busy(_) = e {
        // corral's own queue was full: the origin was not asked, so this
        // is no verdict on it (see `origin_verdict`).
        crate::telemetry::metrics::origin_skipped(fill.route_name(), Detail::UpstreamBusy);
        return stale_on_error(fill, Detail::UpstreamBusy)
            .unwrap_or_else(|| unavailable(fill, Detail::UpstreamBusy, Duration::from_secs(1)));
    }
    if let Some(mut stale) = stale_on_error(fill, Detail::StaleIfError) {
        if let (
            FillOutcome::Stale {
                failure,
                fwd_status,
                ..
            },
            Detail::Upstream(f),
        ) = (&mut stale, e.detail())
        {
            *failure = Some(f);
            *fwd_status = head;
        }
        return stale;
    }
    if crate::telemetry::repeats::first_for_route(
        "upstream failed",
        fill.route_name(),
        fill.origin().authority.as_str(),
        e.detail().as_str(),
    ) {
        tracing::warn!(route = %fill.route_name(), upstream = %fill.origin().authority, error = %e, "upstream failed");
    }
    // RFC 9209 §2.1.3: the status the origin sent, wherever it sent one
    // (a body that broke off or failed its digest came with a head).
    let received = e.received_status().or(head);
    let mut response = SharedResponse::corral_error(e.status(), e.detail(), received);
    response.upstream_status = head;
    FillOutcome::Shared {
        response: Arc::new(response),
        fwd: fill.fwd,
        detail: Some(e.detail()),
    }
}
