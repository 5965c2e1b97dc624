//! A fill: the one fetch that answers a coalesced miss (or refreshes an
//! entry in the background). It runs in its own task that owns everything
//! it needs, so a client that disconnects never cancels it for the others.
//! It stores what may be stored, then ends the flight once for every
//! waiter: with the stored entry, a shared error, a stale entry
//! (stale-if-error) or "pass" (uncacheable: every waiter fetches alone).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use corral_core::flight::Permit;
use corral_core::{
    Admission, Budget, Decision, Detail, Digest, EntryState, Forward, Identity, PassReason,
    PrimaryKey, StoredResponse, VariantKey, Vary, merge_not_modified,
};
use futures_util::StreamExt;
use http::header::{CONTENT_LENGTH, ETAG, HeaderName, LAST_MODIFIED, SET_COOKIE};
use http::header::{
    IF_MATCH, IF_MODIFIED_SINCE, IF_NONE_MATCH, IF_RANGE, IF_UNMODIFIED_SINCE, RANGE,
};
use http::{HeaderMap, Method, Response, StatusCode, response};
use http_body_util::{BodyDataStream, BodyExt};
use hyper::body::Incoming;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::app::App;
use crate::cache::respond::{self, Answer};
use crate::cache::shared_flight;
use crate::config::OnTimeout;
use crate::origin::request::upstream_request;
use crate::origin::upstream::{DeadlineBody, Framing, UpstreamError, sanitize_response};
use crate::routes::Route;
use corral_core::head::{RequestBody, RequestHead};

/// Response headers that belong to the caller who asked and never to
/// anyone a shared answer reaches.
static PER_CALLER: [HeaderName; 2] = [SET_COOKIE, HeaderName::from_static("authentication-info")];

/// A buffered response that every waiter of a flight receives (an error).
/// What every waiter gets carries no per-caller header; the leader alone
/// gets those back.
#[derive(Debug)]
pub struct SharedResponse {
    pub status: StatusCode,
    /// The headers every waiter may see (compact copies).
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The upstream's status, when the upstream answered at all.
    pub upstream_status: Option<u16>,
    /// Headers for the leader's client only (`Set-Cookie`).
    pub own_headers: HeaderMap,
    /// The answer's Vary and the leader's values for it: a waiter whose
    /// request selects another variant fetches alone.
    pub vary: Vary,
    pub vary_values: Vec<String>,
}

impl SharedResponse {
    /// corral's own error answer, for every waiter.
    pub fn corral_error(status: StatusCode, detail: Detail) -> Self {
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
            own_headers: HeaderMap::new(),
            vary: Vary::None,
            vary_values: Vec::new(),
        }
    }

    /// An origin's answer to share with the waiters of a flight, split into
    /// what everyone may see and what only the leader may; `None` when it
    /// cannot be shared at all (Vary: *).
    fn from_origin(parts: response::Parts, body: Bytes, request: &HeaderMap) -> Option<Self> {
        let vary = Vary::parse(&parts.headers);
        if vary == Vary::Star {
            return None;
        }
        let mut own_headers = HeaderMap::new();
        for name in &PER_CALLER {
            for v in parts.headers.get_all(name) {
                own_headers.append(name.clone(), v.clone());
            }
        }
        Some(SharedResponse {
            status: parts.status,
            headers: corral_core::entry::compact(&parts.headers, &PER_CALLER),
            body,
            upstream_status: Some(parts.status.as_u16()),
            own_headers,
            vary_values: vary.values(request),
            vary,
        })
    }

    /// True when `request` selects the variant this answer is for.
    pub fn matches_vary(&self, request: &HeaderMap) -> bool {
        self.vary.values(request) == self.vary_values
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
        detail: Option<Detail>,
    },
    Stale {
        entry: Arc<StoredResponse>,
        fwd_status: Option<u16>,
        detail: Detail,
    },
    Pass {
        reason: PassReason,
    },
}

/// What the leading client receives: the shared outcome, or (on pass) the
/// upstream response itself, streamed.
pub enum LeaderOutcome {
    Outcome(FillOutcome),
    Stream(Answer),
}

/// Everything a fill needs, owned.
pub struct FillRequest {
    pub app: Arc<App>,
    pub route: Arc<Route>,
    pub head: Arc<RequestHead>,
    pub primary: PrimaryKey,
    pub identity: Option<Identity>,
    /// The flight's key: the variant this request selects.
    pub variant: VariantKey,
    /// The copy being refreshed or revalidated, or served if the origin
    /// fails: from L1, or (set by the shared tier) from L2.
    pub stale: arc_swap::ArcSwapOption<StoredResponse>,
    pub fwd: Forward,
    /// Set once the fill must run to its end whoever waits: its answer is
    /// being stored, or other instances wait on its lease.
    pub committed: std::sync::atomic::AtomicBool,
}

impl FillRequest {
    /// Where `entry` is stored: keyed to the caller when it is private to
    /// them, under the Vary values it was produced for.
    pub fn entry_key(&self, entry: &StoredResponse) -> VariantKey {
        let identity = if entry.private() {
            self.identity.as_ref()
        } else {
            None
        };
        self.primary.variant(identity, entry.vary_values())
    }

    /// A background refresh of `entry` for the same caller and key.
    pub fn refreshing(&self, entry: Arc<StoredResponse>) -> FillRequest {
        FillRequest {
            app: Arc::clone(&self.app),
            route: Arc::clone(&self.route),
            head: Arc::clone(&self.head),
            primary: self.primary.clone(),
            identity: self.identity,
            variant: self.variant,
            stale: arc_swap::ArcSwapOption::from(Some(entry)),
            fwd: Forward::Stale,
            committed: Default::default(),
        }
    }

    /// The stale copy in hand, if any.
    pub fn stale(&self) -> Option<Arc<StoredResponse>> {
        self.stale.load_full()
    }

    /// Takes `entry` (read from L2) as the copy to serve if the origin
    /// fails, unless the one in hand is at least as recent.
    pub fn offer_stale(&self, entry: Arc<StoredResponse>) {
        let newer = self
            .stale()
            .is_none_or(|held| entry.response_time() > held.response_time());
        if newer {
            self.stale.store(Some(entry));
        }
    }

    /// Where this caller's hit-for-pass marker lives.
    pub fn pass_scope(&self) -> Digest {
        self.primary.pass_scope(self.identity.as_ref())
    }

    /// Marks this caller's view of the URI uncacheable for a while.
    fn mark_pass(&self) {
        self.app
            .l1
            .mark_pass(self.pass_scope(), self.route.policy.hit_for_pass);
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
    let mut leader = leader;
    // A fill for a client that went away, with nobody else waiting and
    // nothing committed yet, is cancelled: nobody would get its answer (an
    // HTTP/2 client resetting each stream it opens must not make corral
    // fetch for nobody). A background refresh has no client and runs on.
    let cancellable = leader.is_some();
    let slots = tokio::select! {
        s = take_slots(&fill) => s,
        () = abandoned(&mut leader, permit.as_ref(), &fill), if cancellable => {
            crate::telemetry::metrics::fill_cancelled(&fill.route.name);
            return;
        }
    };
    let Some(_slots) = slots else {
        crate::telemetry::metrics::fill_refused(&fill.route.name);
        tracing::warn!(route = %fill.route.name, key = %fill.primary.loggable(), "fill limit reached: not fetching");
        finish(&fill, permit, leader, fill_limit(&fill));
        return;
    };
    let coalesced = permit.is_some();
    let first = tokio::select! {
        r = fetch(&fill, coalesced) => r,
        () = abandoned(&mut leader, permit.as_ref(), &fill), if cancellable => {
            crate::telemetry::metrics::fill_cancelled(&fill.route.name);
            return;
        }
    };
    let result = match first {
        Ended::PassKnown => {
            // Another instance found the key uncacheable: release this
            // instance's waiters now, so that they fetch alongside the
            // leader instead of after it.
            fill.mark_pass();
            if let Some(p) = permit.take() {
                crate::telemetry::metrics::flight_waiters(fill.primary.loggable(), p.followers());
                p.complete(FillOutcome::Pass {
                    reason: PassReason::HitForPass,
                });
            }
            fetch_and_store(&fill).await
        }
        ended => ended,
    };
    let outcome = match result {
        Ended::Outcome(o) => o,
        Ended::PassKnown => return,
        Ended::Stream(reason, response) => {
            if let Some(p) = permit {
                crate::telemetry::metrics::flight_waiters(fill.primary.loggable(), p.followers());
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
    if let FillOutcome::Shared {
        detail: Some(d), ..
    } = &outcome
    {
        tracing::warn!(route = %fill.route.name, key = %fill.primary.loggable(), detail = d.as_str(), "fill failed");
    }
    // A copy read from L2 within its stale-while-revalidate window answers
    // stale; one refresh starts once this flight has ended.
    let refresh = match &outcome {
        FillOutcome::Stored {
            entry, fwd: None, ..
        } if entry.state(SystemTime::now()) == EntryState::StaleWhileRevalidate => {
            Some(Arc::clone(entry))
        }
        _ => None,
    };
    finish(&fill, permit, leader, outcome);
    if let Some(entry) = refresh {
        crate::cache::cache_path::refresh_in_background(
            &fill.app,
            fill.variant.digest,
            fill.refreshing(entry),
        );
    }
}

/// The fetch itself, through Redis when it is configured: a local flight's
/// leader (`coalesced`) enters the shared tier and its lease; any other
/// fill uses L2 as a cache only, so that a request that chose not to
/// coalesce (or could not) is not coalesced across instances either.
async fn fetch(fill: &FillRequest, coalesced: bool) -> Ended {
    match &fill.app.l2 {
        Some(l2) if coalesced => shared_flight::fill(fill, l2).await,
        Some(l2) => shared_flight::fill_alone(fill, l2).await,
        None => fetch_and_store(fill).await,
    }
}

/// Gives every waiter and the leader's client the outcome.
fn finish(
    fill: &FillRequest,
    permit: Option<Permit<FillOutcome>>,
    leader: Option<oneshot::Sender<LeaderOutcome>>,
    outcome: FillOutcome,
) {
    if let Some(p) = permit {
        crate::telemetry::metrics::flight_waiters(fill.primary.loggable(), p.followers());
        p.complete(outcome.clone());
    }
    if let Some(tx) = leader {
        let _ = tx.send(LeaderOutcome::Outcome(outcome));
    }
}

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
        let route = Arc::clone(&fill.route.fills).acquire_owned().await.ok()?;
        let instance = Arc::clone(&fill.app.fills).acquire_owned().await.ok()?;
        Some((route, instance))
    };
    tokio::time::timeout(fill.route.lock_timeout, take)
        .await
        .ok()
        .flatten()
}

/// The route's `on_timeout` for a wait on another request's fill (local or
/// on another instance) that ran past `lock_timeout`: the outcome to answer
/// with, or `None` to fetch without waiting any more.
pub fn on_lock_timeout(fill: &FillRequest) -> Option<FillOutcome> {
    match fill.route.on_timeout {
        OnTimeout::Fetch => None,
        OnTimeout::Stale => fill.stale().map(|entry| FillOutcome::Stale {
            entry,
            fwd_status: None,
            detail: Detail::LockTimeout,
        }),
        OnTimeout::Error => Some(FillOutcome::Shared {
            response: Arc::new(SharedResponse::corral_error(
                StatusCode::GATEWAY_TIMEOUT,
                Detail::LockTimeout,
            )),
            fwd: fill.fwd,
            detail: Some(Detail::LockTimeout),
        }),
    }
}

/// What waiters get when no fill slot came in time: the stale copy if it
/// may still be served, else a 503 for every one of them.
fn fill_limit(fill: &FillRequest) -> FillOutcome {
    stale_on_error(fill, Detail::FillLimit)
        .unwrap_or_else(|| unavailable(fill, Detail::FillLimit, Duration::from_secs(1)))
}

/// The stale copy in hand, labelled `detail`, if stale-if-error still
/// allows serving it.
fn stale_on_error(fill: &FillRequest, detail: Detail) -> Option<FillOutcome> {
    let entry = fill
        .stale()
        .filter(|s| s.usable_on_error(SystemTime::now()))?;
    Some(FillOutcome::Stale {
        entry,
        fwd_status: None,
        detail,
    })
}

/// corral's own 503 for every caller, saying when to come back.
fn unavailable(fill: &FillRequest, detail: Detail, retry_after: Duration) -> FillOutcome {
    let mut response = SharedResponse::corral_error(StatusCode::SERVICE_UNAVAILABLE, detail);
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

/// How long a fill nobody waits for runs on before it is cancelled: the
/// herd of a stampede whose first client left arrives within it and still
/// finds the fill under way.
const ABANDON_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// Resolves once nobody has wanted this fill for [`ABANDON_GRACE`]: the
/// leader's client is gone, no follower waits, and the fill has not
/// committed to storing (or to other instances).
async fn abandoned(
    leader: &mut Option<oneshot::Sender<LeaderOutcome>>,
    permit: Option<&Permit<FillOutcome>>,
    fill: &FillRequest,
) {
    let Some(tx) = leader.as_mut() else {
        return std::future::pending().await;
    };
    tx.closed().await;
    let mut since: Option<Instant> = None;
    loop {
        let waiting = permit.map_or(0, Permit::waiting);
        if waiting == 0 && !fill.committed.load(std::sync::atomic::Ordering::Acquire) {
            let since = *since.get_or_insert_with(Instant::now);
            if since.elapsed() >= ABANDON_GRACE {
                return;
            }
        } else {
            since = None;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

pub(crate) enum Ended {
    Outcome(FillOutcome),
    /// The shared pass marker is set: nothing to coalesce across instances.
    PassKnown,
    Stream(PassReason, Answer),
}

/// Fetches from the origin and stores in L1: the whole fill when there is
/// no Redis, the leader's part when there is. Every origin request of the
/// cache path goes through here, so here is where a failing origin is
/// left alone: a key in back-off, or a route whose circuit is open, gets
/// the stale copy or an error without a request, and every fetch's result
/// feeds both.
pub(crate) async fn fetch_and_store(fill: &FillRequest) -> Ended {
    let now = SystemTime::now();
    if let Some(backoff) = fill.app.l1.active_backoff(&fill.pass_scope(), now) {
        return Ended::Outcome(skipped(fill, Skipped::Backoff(backoff.remaining(now))));
    }
    let admission = fill.route.circuit.allow();
    if admission == Admission::Refuse {
        return Ended::Outcome(skipped(
            fill,
            Skipped::CircuitOpen(fill.route.circuit.retry_after()),
        ));
    }
    let ended = fetch_origin(fill).await;
    if let Some(ok) = origin_verdict(&ended) {
        fill.route.circuit.record(ok);
        let scope = fill.pass_scope();
        if ok {
            fill.app.l1.clear_backoff(&scope);
        } else {
            let policy = fill.route.backoff;
            let backoff = policy.after_failure(fill.app.l1.last_backoff(&scope), SystemTime::now());
            tracing::debug!(key = %fill.primary.loggable(), failures = backoff.failures, "origin failed: backing off");
            fill.app.l1.set_backoff(scope, backoff, policy.memory());
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
    crate::telemetry::metrics::origin_skipped(&fill.route.name, detail.as_str());
    stale_on_error(fill, detail).unwrap_or_else(|| unavailable(fill, detail, retry))
}

/// Whether a fetch reached a healthy origin (`Some(true)`), a failing one
/// (`Some(false)`: a 5xx, a refused connection, a timeout), or was no
/// fetch at all.
fn origin_verdict(ended: &Ended) -> Option<bool> {
    match ended {
        Ended::PassKnown => None,
        Ended::Stream(_, answer) => Some(!answer.response.status().is_server_error()),
        Ended::Outcome(FillOutcome::Stored { .. } | FillOutcome::Pass { .. }) => Some(true),
        Ended::Outcome(FillOutcome::Stale { detail, .. }) => {
            (*detail == Detail::StaleIfError).then_some(false)
        }
        Ended::Outcome(FillOutcome::Shared { response, .. }) => {
            Some(!response.status.is_server_error())
        }
    }
}

/// The fetch itself.
async fn fetch_origin(fill: &FillRequest) -> Ended {
    let stale = fill.stale();
    let stale = stale.as_ref();
    let FillRequest {
        app,
        route,
        head,
        fwd,
        ..
    } = fill;
    let fwd = *fwd;
    let stamp = app.l1.generation_stamp();
    let started = Instant::now();
    let deadline = started + route.upstream.total;

    // The fill asks for the whole representation: the client's own
    // conditionals and ranges are answered by corral from the entry.
    let mut headers = head.headers.clone();
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
        if let Some(etag) = stale.headers().get(ETAG) {
            headers.insert(IF_NONE_MATCH, etag.clone());
        }
        if let Some(lm) = stale.headers().get(LAST_MODIFIED) {
            headers.insert(IF_MODIFIED_SINCE, lm.clone());
        }
    }
    // The target is the key's: what is stored is exactly what was asked for.
    let target = fill.primary.uri().target();
    let req = match upstream_request(
        route,
        head,
        Method::GET,
        target,
        headers,
        Body::empty(),
        RequestBody::None,
    ) {
        Ok(r) => r,
        Err(e) => return Ended::Outcome(failed(fill, &e)),
    };
    let uri = req.uri().clone();
    let res = match route.upstream.send(req, true, deadline).await {
        Ok(r) => r,
        Err(e) => return Ended::Outcome(failed(fill, &e)),
    };
    let response_time = SystemTime::now();
    let (mut parts, body) = res.into_parts();
    let framing = match sanitize_response(&mut parts) {
        Ok(f) => f,
        Err(e) => return Ended::Outcome(failed(fill, &e)),
    };
    let status = parts.status;

    if let Some(stale) = stale {
        if status.is_server_error() && stale.usable_on_error(response_time) {
            return Ended::Outcome(FillOutcome::Stale {
                entry: Arc::clone(stale),
                fwd_status: Some(status.as_u16()),
                detail: Detail::StaleIfError,
            });
        }
        if status == StatusCode::NOT_MODIFIED {
            return revalidated(fill, stale, &uri, &parts, response_time, stamp);
        }
    }

    let read_body = |body, declared| {
        buffer(
            body,
            declared,
            route.policy.max_object_size,
            &app.fill_memory,
            deadline,
            route.upstream.total,
        )
    };
    let declared = declared_length(&parts.headers);
    let decision = match framing {
        Framing::Conflicting => Decision::Pass(PassReason::ConflictingFraming),
        Framing::Plain => route
            .policy
            .evaluate(&Method::GET, &uri, &parts, response_time),
    };
    if matches!(decision, Decision::Store { .. }) {
        fill.committed
            .store(true, std::sync::atomic::Ordering::Release);
    }
    match decision {
        Decision::Store { freshness } => match read_body(body, declared).await {
            Buffered::Full(bytes) => {
                let vary = Vary::parse(&parts.headers);
                let vary_values = vary.values(&head.headers);
                let private = freshness.sharing.keeps_private(fill.identity.as_ref());
                let entry = Arc::new(
                    StoredResponse::builder(
                        status,
                        parts.headers,
                        crate::sealed::seal_or_keep(bytes),
                        &freshness,
                        response_time,
                    )
                    .fetch_duration(started.elapsed())
                    .vary(vary.clone(), vary_values)
                    .generation(stamp)
                    .private(private)
                    .build()
                    .with_uri(fill.primary.uri().readable()),
                );
                let key = fill.entry_key(&entry);
                app.l1.learn_vary(&fill.primary, &vary);
                app.l1.clear_pass(&fill.pass_scope());
                app.l1.insert(&key, fill.primary.uri(), Arc::clone(&entry));
                Ended::Outcome(FillOutcome::Stored {
                    entry,
                    fwd: Some(fwd),
                    fwd_status: Some(status.as_u16()),
                })
            }
            Buffered::Over(reason, rest) => {
                if reason == PassReason::TooLarge {
                    fill.mark_pass();
                }
                Ended::Stream(reason, pass_response(parts, rest, fwd, reason))
            }
            Buffered::Failed(e) => Ended::Outcome(failed(fill, &e)),
        },
        Decision::Pass(reason) if status.is_server_error() && shareable_error(reason) => {
            // An error every waiter shares (without the leader's cookies),
            // not a reason to stop coalescing: the next request tries the
            // origin again. A `private` error is the caller's own: waiters
            // fetch alone.
            match read_body(body, declared).await {
                Buffered::Full(bytes) => {
                    let own = parts.clone();
                    match SharedResponse::from_origin(parts, bytes.clone(), &head.headers) {
                        Some(response) => Ended::Outcome(FillOutcome::Shared {
                            response: Arc::new(response),
                            fwd,
                            detail: None,
                        }),
                        None => Ended::Stream(
                            reason,
                            pass_response(own, Body::from(bytes), fwd, reason),
                        ),
                    }
                }
                Buffered::Over(over, rest) => {
                    Ended::Stream(over, pass_response(parts, rest, fwd, over))
                }
                Buffered::Failed(e) => Ended::Outcome(failed(fill, &e)),
            }
        }
        Decision::Pass(reason) => {
            if reason != PassReason::ConflictingFraming {
                fill.mark_pass();
            }
            let body = Body::new(DeadlineBody::new(body, deadline, route.upstream.total));
            Ended::Stream(reason, pass_response(parts, body, fwd, reason))
        }
    }
}

/// True when an error answer with this pass reason may be fanned out to a
/// flight's waiters: not one the origin made `private` (the caller's own),
/// not one framed ambiguously.
fn shareable_error(reason: PassReason) -> bool {
    !matches!(
        reason,
        PassReason::Private | PassReason::ConflictingFraming | PassReason::VaryStar
    )
}

/// The Content-Length the origin declared, if any.
fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// A 304 refreshed the stale entry: store the refreshed copy.
fn revalidated(
    fill: &FillRequest,
    stale: &Arc<StoredResponse>,
    uri: &http::Uri,
    not_modified: &response::Parts,
    response_time: SystemTime,
    stamp: u64,
) -> Ended {
    let merged = merge_not_modified(stale.headers(), &not_modified.headers);
    let mut merged_parts = not_modified.clone();
    merged_parts.status = stale.status();
    merged_parts.headers = merged;
    let route = &fill.route;
    match route
        .policy
        .evaluate(&Method::GET, uri, &merged_parts, response_time)
    {
        Decision::Store { freshness } => {
            let entry = Arc::new(stale.revalidated(
                &merged_parts.headers,
                &freshness,
                response_time,
                stamp,
            ));
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
            fill.mark_pass();
            let mut parts = merged_parts;
            parts.headers.remove(CONTENT_LENGTH);
            let body = Body::from(stale.body().clone());
            Ended::Stream(reason, pass_response(parts, body, Forward::Stale, reason))
        }
    }
}

/// The failure every waiter shares, or the stale entry if stale-if-error
/// allows it.
fn failed(fill: &FillRequest, e: &UpstreamError) -> FillOutcome {
    if let Some(stale) = stale_on_error(fill, Detail::StaleIfError) {
        return stale;
    }
    tracing::warn!(route = %fill.route.name, upstream = %fill.route.authority, error = %e, "upstream failed");
    FillOutcome::Shared {
        response: Arc::new(SharedResponse::corral_error(
            e.status(),
            Detail::Upstream(e.detail()),
        )),
        fwd: fill.fwd,
        detail: Some(Detail::Upstream(e.detail())),
    }
}

fn pass_response(parts: response::Parts, body: Body, fwd: Forward, reason: PassReason) -> Answer {
    let st = corral_core::CacheStatus::forward(fwd)
        .with_fwd_status(parts.status.as_u16())
        .with_detail(Detail::Pass(reason));
    Answer::new(
        Response::from_parts(parts, body),
        &st,
        http::Version::HTTP_11,
    )
}

enum Buffered {
    Full(Bytes),
    /// Not buffered whole (over the size limit, or over the fill memory
    /// budget): what was read, followed by the rest, as one body.
    Over(PassReason, Body),
    Failed(UpstreamError),
}

/// Reads a body into memory, up to `limit` bytes, what `budget` grants and
/// the deadline. `declared` (the origin's Content-Length) sizes the buffer
/// once, so a stored body holds no spare capacity.
async fn buffer(
    mut body: Incoming,
    declared: Option<u64>,
    limit: u64,
    budget: &Arc<Budget>,
    deadline: Instant,
    total: std::time::Duration,
) -> Buffered {
    let mut hold = budget.hold();
    let initial = declared.unwrap_or(0).min(limit).min(1 << 20);
    let mut buf = BytesMut::new();
    if initial > 0 {
        if !hold.grow(initial) {
            return Buffered::Over(
                PassReason::FillMemory,
                Body::new(DeadlineBody::new(body, deadline, total)),
            );
        }
        buf.reserve(usize::try_from(initial).unwrap_or(0));
    }
    loop {
        match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return Buffered::Failed(UpstreamError::TotalTimeout(total)),
            Ok(None) => {
                // A buffer that grew in steps holds up to twice its bytes:
                // keep an exact copy instead.
                let bytes = if buf.capacity() - buf.len() > buf.len() / 8 + 64 {
                    Bytes::copy_from_slice(&buf)
                } else {
                    buf.freeze()
                };
                return Buffered::Full(bytes);
            }
            Ok(Some(Err(e))) => return Buffered::Failed(UpstreamError::Exchange(e.to_string())),
            Ok(Some(Ok(frame))) => {
                let Ok(data) = frame.into_data() else {
                    continue; // trailers are not stored
                };
                let after = (buf.len() + data.len()) as u64;
                let over = if after > limit {
                    Some(PassReason::TooLarge)
                } else if after > hold.held() && !hold.grow(after - hold.held()) {
                    Some(PassReason::FillMemory)
                } else {
                    None
                };
                buf.extend_from_slice(&data);
                if let Some(reason) = over {
                    let head = futures_util::stream::once(std::future::ready(Ok::<
                        Bytes,
                        Box<dyn std::error::Error + Send + Sync>,
                    >(
                        buf.freeze()
                    )));
                    let rest = BodyDataStream::new(DeadlineBody::new(body, deadline, total));
                    return Buffered::Over(reason, Body::from_stream(head.chain(rest)));
                }
            }
        }
    }
}
