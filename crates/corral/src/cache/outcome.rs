//! The answers to a fill's outcome: what the leader and each waiter of a
//! flight get (`stored` for the caller whose fetch it was, `collapsed` for
//! the others; a shared error with the leader's own headers for the leader
//! alone; another instance's entry from L2 as a hit).

use std::time::SystemTime;

use axum::body::Body;
use corral_core::{CacheStatus, Detail, Forward, StoredResponse};
use http::{HeaderMap, Response, StatusCode, Version};

use crate::cache::fill::{FillOutcome, SharedResponse};
use crate::cache::respond::{Answer, error, from_entry, from_streaming};

/// A shared (error) answer; the leader alone (`own`) also gets the
/// per-caller headers its own request produced.
fn from_shared(shared: &SharedResponse, status: &CacheStatus, head: bool, own: bool) -> Answer {
    let mut headers = shared.headers.clone();
    if own {
        for (name, value) in &shared.own_headers {
            headers.append(name, value.clone());
        }
    }
    let body = if head {
        Body::empty()
    } else {
        Body::from(shared.body.clone())
    };
    let mut res = Response::new(body);
    *res.status_mut() = shared.status;
    *res.headers_mut() = headers;
    Answer::new(res, status, Version::HTTP_11)
}

/// `answer` with the fields only the caller whose fetch it was gets
/// (`collapsed`: another caller, who gets none of them).
fn with_own(mut answer: Answer, own: &HeaderMap, collapsed: bool) -> Answer {
    if !collapsed {
        for (name, value) in own {
            answer.response.headers_mut().append(name, value.clone());
        }
    }
    answer
}

/// The answer for a finished fill; `collapsed` for followers.
pub fn from_outcome(
    outcome: &FillOutcome,
    collapsed: bool,
    now: SystemTime,
    head: bool,
    request: &HeaderMap,
) -> Answer {
    match outcome {
        FillOutcome::FromL2 { entry, waited } => {
            // Filled by another instance, read from L2: fresh is a hit, or,
            // read after waiting on that instance's fetch, collapsed onto
            // it; within stale-while-revalidate it is a stale answer, and
            // the fill that read it starts the refresh.
            let st = if entry.state(now) == corral_core::EntryState::StaleWhileRevalidate {
                crate::telemetry::metrics::stale(Detail::StaleWhileRevalidate);
                CacheStatus::forward(Forward::Stale)
                    .with_ttl(entry.ttl_secs(now))
                    .with_detail(Detail::StaleWhileRevalidate)
            } else if let Some(fwd) = waited {
                let mut st = CacheStatus::forward(*fwd)
                    .with_ttl(entry.ttl_secs(now))
                    .with_detail(Detail::L2);
                st.collapsed = true;
                st
            } else {
                CacheStatus::hit(entry.ttl_secs(now)).with_detail(Detail::L2)
            };
            from_entry(entry, &st, now, head, request)
        }
        FillOutcome::Stored {
            entry,
            fwd,
            fwd_status,
            own,
        } => {
            let st = fetched(*fwd, *fwd_status, entry, now, collapsed);
            with_own(from_entry(entry, &st, now, head, request), own, collapsed)
        }
        FillOutcome::Shared {
            response,
            fwd,
            detail,
        } => {
            let mut st = CacheStatus::forward(*fwd);
            st.fwd_status = response.upstream_status;
            st.detail = *detail;
            st.collapsed = collapsed;
            from_shared(response, &st, head, !collapsed)
        }
        FillOutcome::Stale {
            entry,
            fwd_status,
            detail,
            ..
        } => {
            crate::telemetry::metrics::stale(*detail);
            let mut st = CacheStatus::forward(Forward::Stale)
                .with_detail(*detail)
                .with_ttl(entry.ttl_secs(now));
            st.fwd_status = *fwd_status;
            st.collapsed = collapsed;
            from_entry(entry, &st, now, head, request)
        }
        FillOutcome::Streaming {
            head: entry,
            body,
            coded,
            fwd,
            fwd_status,
            own,
            relayed,
        } => {
            // Relayed from another instance's fetch through Redis:
            // collapsed onto it, as when its entry is read from L2.
            let mut st = fetched(*fwd, *fwd_status, entry, now, collapsed || *relayed);
            if *relayed {
                st.detail = Some(Detail::L2);
            }
            let answer = from_streaming(entry, body, coded, &st, now, head, request);
            with_own(answer, own, collapsed)
        }
        FillOutcome::Pass { .. } => error(
            StatusCode::BAD_GATEWAY,
            Forward::Miss,
            Detail::FillPassed,
            None,
        ),
    }
}

/// The Cache-Status of an answer this flight fetched and stores: `stored`
/// for the caller whose fetch it was, `collapsed` for the others.
fn fetched(
    fwd: Forward,
    fwd_status: Option<u16>,
    entry: &StoredResponse,
    now: SystemTime,
    collapsed: bool,
) -> CacheStatus {
    let mut st = CacheStatus::forward(fwd).with_ttl(entry.ttl_secs(now));
    st.fwd_status = fwd_status;
    st.stored = !collapsed;
    st.collapsed = collapsed;
    st
}
