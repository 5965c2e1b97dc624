//! A fill: the one fetch that answers a coalesced miss (or refreshes an
//! entry in the background). It runs in its own task that owns everything
//! it needs, so a client that disconnects never cancels it for the others.
//! It stores what may be stored, then ends the flight once for every
//! waiter: with the stored entry, a shared error, a stale entry
//! (stale-if-error) or "pass" (uncacheable: every waiter fetches alone).

use std::sync::Arc;
use std::time::SystemTime;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use corral_core::flight::Permit;
use corral_core::{
    Decision, Forward, Identity, PassReason, PrimaryKey, StoredResponse, VariantKey, Vary,
    merge_not_modified,
};
use futures_util::StreamExt;
use http::header::{ETAG, LAST_MODIFIED};
use http::header::{
    IF_MATCH, IF_MODIFIED_SINCE, IF_NONE_MATCH, IF_RANGE, IF_UNMODIFIED_SINCE, RANGE,
};
use http::{HeaderMap, Method, Response, StatusCode, request, response};
use http_body_util::{BodyDataStream, BodyExt};
use hyper::body::Incoming;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::app::App;
use crate::hop_by_hop;
use crate::request::{RequestCtx, upstream_request};
use crate::respond;
use crate::routes::Route;
use crate::shared_flight;
use crate::upstream::{DeadlineBody, UpstreamError};

/// After the origin failed and a stale copy answered, the key's origin is
/// left alone this long: stale answers meanwhile cost it nothing.
const STALE_IF_ERROR_BACKOFF: std::time::Duration = std::time::Duration::from_secs(1);

/// A buffered response that every waiter of a flight receives (an error).
#[derive(Debug)]
pub struct SharedResponse {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The upstream's status, when the upstream answered at all.
    pub upstream_status: Option<u16>,
}

impl SharedResponse {
    /// corral's own error answer, for every waiter.
    pub fn corral_error(status: StatusCode, detail: &'static str) -> Self {
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        SharedResponse {
            status,
            headers,
            body: respond::error_body(status, detail),
            upstream_status: None,
        }
    }
}

/// How a fill ended, as every waiter sees it.
#[derive(Debug, Clone)]
pub enum FillOutcome {
    /// `fwd: None` when another instance's fill was read from L2.
    Stored {
        entry: Arc<StoredResponse>,
        fwd: Option<Forward>,
        fwd_status: Option<u16>,
    },
    Shared {
        response: Arc<SharedResponse>,
        fwd: Forward,
        detail: Option<&'static str>,
    },
    Stale {
        entry: Arc<StoredResponse>,
        fwd_status: Option<u16>,
        detail: &'static str,
    },
    Pass {
        reason: PassReason,
    },
}

/// What the leading client receives: the shared outcome, or (on pass) the
/// upstream response itself, streamed.
pub enum LeaderOutcome {
    Outcome(FillOutcome),
    Stream(Response<Body>),
}

/// Everything a fill needs, owned.
pub struct FillRequest {
    pub app: Arc<App>,
    pub route: Arc<Route>,
    pub ctx: Arc<RequestCtx>,
    pub primary: PrimaryKey,
    pub identity: Option<Identity>,
    /// The flight's key: the variant this request selects.
    pub variant: VariantKey,
    pub stale: Option<Arc<StoredResponse>>,
    pub fwd: Forward,
}

impl FillRequest {
    /// Where `entry` is stored: keyed to the caller when it is private to
    /// them, under the Vary values it was produced for.
    pub fn entry_key(&self, entry: &StoredResponse) -> VariantKey {
        let identity = if entry.private {
            self.identity.as_ref()
        } else {
            None
        };
        self.primary.variant(identity, &entry.vary_values)
    }
}

/// Runs a fill to its end. `permit` is `None` for an uncoalesced fetch;
/// `leader` is `None` for a background refresh.
pub async fn run(
    fill: FillRequest,
    permit: Option<Permit<FillOutcome>>,
    leader: Option<oneshot::Sender<LeaderOutcome>>,
) {
    let mut permit = permit;
    let result = match &fill.app.l2 {
        Some(l2) => match shared_flight::fill(&fill, l2).await {
            Ended::PassKnown => {
                // Another instance found the key uncacheable: release this
                // instance's waiters now, so that they fetch alongside the
                // leader instead of after it.
                fill.app
                    .l1
                    .mark_pass(fill.primary.digest(), fill.route.policy.hit_for_pass);
                if let Some(p) = permit.take() {
                    crate::metrics::flight_waiters(fill.primary.loggable(), p.followers());
                    p.complete(FillOutcome::Pass {
                        reason: PassReason::HitForPass,
                    });
                }
                fetch_and_store(&fill).await
            }
            ended => ended,
        },
        None => fetch_and_store(&fill).await,
    };
    let outcome = match result {
        Ended::Outcome(o) => o,
        Ended::PassKnown => return,
        Ended::Stream(reason, response) => {
            if let Some(p) = permit {
                crate::metrics::flight_waiters(fill.primary.loggable(), p.followers());
                p.complete(FillOutcome::Pass { reason });
            }
            if let Some(tx) = leader {
                // A leader that went away drops the body, closing the
                // upstream connection: nobody else wanted it.
                let _ = tx.send(LeaderOutcome::Stream(response));
            }
            return;
        }
    };
    match &outcome {
        FillOutcome::Stale {
            detail: "stale-if-error",
            ..
        } => fill
            .app
            .l1
            .back_off(fill.variant.digest, STALE_IF_ERROR_BACKOFF),
        FillOutcome::Stored { .. } => fill.app.l1.clear_backoff(&fill.variant.digest),
        _ => {}
    }
    if let FillOutcome::Shared {
        detail: Some(d), ..
    } = &outcome
    {
        tracing::warn!(route = %fill.route.name, key = %fill.primary.loggable(), detail = d, "fill failed");
    }
    if let Some(p) = permit {
        crate::metrics::flight_waiters(fill.primary.loggable(), p.followers());
        p.complete(outcome.clone());
    }
    if let Some(tx) = leader {
        let _ = tx.send(LeaderOutcome::Outcome(outcome));
    }
}

pub(crate) enum Ended {
    Outcome(FillOutcome),
    /// The shared pass marker is set: nothing to coalesce across instances.
    PassKnown,
    Stream(PassReason, Response<Body>),
}

/// Fetches from the origin and stores in L1: the whole fill when there is
/// no Redis, the leader's part when there is.
pub(crate) async fn fetch_and_store(fill: &FillRequest) -> Ended {
    let FillRequest {
        app,
        route,
        ctx,
        stale,
        fwd,
        ..
    } = fill;
    let fwd = *fwd;
    let stamp = app.l1.generation_stamp();
    let started = Instant::now();
    let deadline = started + route.upstream.total;

    // The fill asks for the whole representation: the client's own
    // conditionals and ranges are answered by corral from the entry.
    let mut headers = ctx.headers.clone();
    for h in [
        IF_NONE_MATCH,
        IF_MODIFIED_SINCE,
        IF_MATCH,
        IF_UNMODIFIED_SINCE,
        IF_RANGE,
        RANGE,
    ] {
        headers.remove(h);
    }
    if let Some(stale) = stale {
        if let Some(etag) = stale.headers.get(ETAG) {
            headers.insert(IF_NONE_MATCH, etag.clone());
        }
        if let Some(lm) = stale.headers.get(LAST_MODIFIED) {
            headers.insert(IF_MODIFIED_SINCE, lm.clone());
        }
    }
    let req = match upstream_request(route, ctx, Method::GET, headers, Body::empty()) {
        Ok(r) => r,
        Err(e) => return Ended::Outcome(failed(fill, &e)),
    };
    let req_parts = request_parts(&req);
    let res = match route.upstream.send(req, true, deadline).await {
        Ok(r) => r,
        Err(e) => return Ended::Outcome(failed(fill, &e)),
    };
    let response_time = SystemTime::now();
    let (mut parts, body) = res.into_parts();
    hop_by_hop::strip(&mut parts.headers);
    corral_core::policy::sanitize_age(&mut parts.headers);
    let status = parts.status;

    if let Some(stale) = stale {
        if status.is_server_error() && stale.usable_on_error(response_time) {
            return Ended::Outcome(FillOutcome::Stale {
                entry: Arc::clone(stale),
                fwd_status: Some(status.as_u16()),
                detail: "stale-if-error",
            });
        }
        if status == StatusCode::NOT_MODIFIED {
            return revalidated(fill, stale, &req_parts, &parts, response_time, stamp);
        }
    }

    let read_body = |body| {
        buffer(
            body,
            route.policy.max_object_size,
            deadline,
            route.upstream.total,
        )
    };
    match route
        .policy
        .evaluate(&req_parts, &parts, response_time, &route.identity)
    {
        Decision::Store { freshness, policy } => match read_body(body).await {
            Buffered::Full(bytes) => {
                let vary = Vary::parse(&parts.headers);
                let vary_values = vary.values(&ctx.headers);
                let private = fill.identity.is_some() && !freshness.shareable;
                let entry = Arc::new(
                    StoredResponse::new(
                        status,
                        parts.headers,
                        corral_core::sealed::seal_or_keep(bytes),
                        *policy,
                        &freshness,
                        response_time,
                        started.elapsed(),
                        vary.clone(),
                        vary_values,
                        stamp,
                        private,
                    )
                    .with_uri(fill.primary.uri().readable()),
                );
                let key = fill.entry_key(&entry);
                app.l1.learn_vary(&fill.primary, &vary);
                app.l1.clear_pass(&fill.primary.digest());
                app.l1.insert(&key, fill.primary.uri(), Arc::clone(&entry));
                Ended::Outcome(FillOutcome::Stored {
                    entry,
                    fwd: Some(fwd),
                    fwd_status: Some(status.as_u16()),
                })
            }
            Buffered::TooLarge(rest) => {
                app.l1
                    .mark_pass(fill.primary.digest(), route.policy.hit_for_pass);
                Ended::Stream(
                    PassReason::TooLarge,
                    pass_response(parts, rest, fwd, PassReason::TooLarge),
                )
            }
            Buffered::Failed(e) => Ended::Outcome(failed(fill, &e)),
        },
        Decision::Pass(_) if status.is_server_error() => {
            // An error every waiter shares, not a reason to stop coalescing:
            // the next request tries the origin again.
            match read_body(body).await {
                Buffered::Full(bytes) => Ended::Outcome(FillOutcome::Shared {
                    response: Arc::new(SharedResponse {
                        status,
                        headers: parts.headers,
                        body: bytes,
                        upstream_status: Some(status.as_u16()),
                    }),
                    fwd,
                    detail: None,
                }),
                Buffered::TooLarge(rest) => Ended::Stream(
                    PassReason::TooLarge,
                    pass_response(parts, rest, fwd, PassReason::TooLarge),
                ),
                Buffered::Failed(e) => Ended::Outcome(failed(fill, &e)),
            }
        }
        Decision::Pass(reason) => {
            app.l1
                .mark_pass(fill.primary.digest(), route.policy.hit_for_pass);
            let body = Body::new(DeadlineBody::new(body, deadline, route.upstream.total));
            Ended::Stream(reason, pass_response(parts, body, fwd, reason))
        }
    }
}

/// A 304 refreshed the stale entry: store the refreshed copy.
fn revalidated(
    fill: &FillRequest,
    stale: &Arc<StoredResponse>,
    req_parts: &request::Parts,
    not_modified: &response::Parts,
    response_time: SystemTime,
    stamp: u64,
) -> Ended {
    let merged = merge_not_modified(&stale.headers, &not_modified.headers);
    let mut merged_parts = not_modified.clone();
    merged_parts.status = stale.status;
    merged_parts.headers = merged.clone();
    let route = &fill.route;
    match route
        .policy
        .evaluate(req_parts, &merged_parts, response_time, &route.identity)
    {
        Decision::Store { freshness, policy } => {
            let entry =
                Arc::new(stale.revalidated(merged, *policy, &freshness, response_time, stamp));
            let key = fill.entry_key(&entry);
            fill.app
                .l1
                .insert(&key, fill.primary.uri(), Arc::clone(&entry));
            Ended::Outcome(FillOutcome::Stored {
                entry,
                fwd: Some(Forward::Stale),
                fwd_status: Some(StatusCode::NOT_MODIFIED.as_u16()),
            })
        }
        Decision::Pass(reason) => {
            // The body is still right for this request, but the origin no
            // longer lets it be stored or shared.
            let key = fill.entry_key(stale);
            fill.app.l1.remove(&key);
            fill.app
                .l1
                .mark_pass(fill.primary.digest(), route.policy.hit_for_pass);
            let mut parts = merged_parts;
            parts.headers.remove(http::header::CONTENT_LENGTH);
            let body = Body::from(stale.body.clone());
            Ended::Stream(reason, pass_response(parts, body, Forward::Stale, reason))
        }
    }
}

/// The failure every waiter shares, or the stale entry if stale-if-error
/// allows it.
fn failed(fill: &FillRequest, e: &UpstreamError) -> FillOutcome {
    if let Some(stale) = &fill.stale
        && stale.usable_on_error(SystemTime::now())
    {
        return FillOutcome::Stale {
            entry: Arc::clone(stale),
            fwd_status: None,
            detail: "stale-if-error",
        };
    }
    tracing::warn!(route = %fill.route.name, upstream = %fill.route.authority, error = %e, "upstream failed");
    FillOutcome::Shared {
        response: Arc::new(SharedResponse::corral_error(e.status(), e.detail())),
        fwd: fill.fwd,
        detail: Some(e.detail()),
    }
}

fn pass_response(
    mut parts: response::Parts,
    body: Body,
    fwd: Forward,
    reason: PassReason,
) -> Response<Body> {
    let mut st = corral_core::CacheStatus::forward(fwd)
        .with_fwd_status(parts.status.as_u16())
        .with_detail(reason.as_str());
    st.stored = false;
    respond::decorate(&mut parts.headers, &st, http::Version::HTTP_11);
    Response::from_parts(parts, body)
}

fn request_parts(req: &http::Request<Body>) -> request::Parts {
    let mut b = http::Request::builder()
        .method(req.method().clone())
        .uri(req.uri().clone());
    if let Some(h) = b.headers_mut() {
        *h = req.headers().clone();
    }
    match b.body(()) {
        Ok(r) => r.into_parts().0,
        Err(_) => http::Request::new(()).into_parts().0,
    }
}

enum Buffered {
    Full(Bytes),
    /// Over the limit: what was read, followed by the rest, as one body.
    TooLarge(Body),
    Failed(UpstreamError),
}

/// Reads a body into memory, up to `limit` bytes and the deadline.
async fn buffer(
    mut body: Incoming,
    limit: u64,
    deadline: Instant,
    total: std::time::Duration,
) -> Buffered {
    let mut buf = BytesMut::new();
    loop {
        match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return Buffered::Failed(UpstreamError::TotalTimeout(total)),
            Ok(None) => return Buffered::Full(buf.freeze()),
            Ok(Some(Err(e))) => return Buffered::Failed(UpstreamError::Exchange(e.to_string())),
            Ok(Some(Ok(frame))) => {
                let Ok(data) = frame.into_data() else {
                    continue; // trailers are not stored
                };
                if (buf.len() + data.len()) as u64 > limit {
                    buf.extend_from_slice(&data);
                    let head = futures_util::stream::once(std::future::ready(Ok::<
                        Bytes,
                        Box<dyn std::error::Error + Send + Sync>,
                    >(
                        buf.freeze()
                    )));
                    let rest = BodyDataStream::new(DeadlineBody::new(body, deadline, total));
                    return Buffered::TooLarge(Body::from_stream(head.chain(rest)));
                }
                buf.extend_from_slice(&data);
            }
        }
    }
}
