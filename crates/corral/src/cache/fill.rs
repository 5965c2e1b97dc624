//! A fill: the one fetch that answers a coalesced miss (or refreshes an
//! entry in the background). It runs in its own task that owns everything
//! it needs, so a client that disconnects never cancels it for the others.
//! It stores what may be stored, then ends the flight once for every
//! waiter: with the stored entry, a shared error, a stale entry
//! (stale-if-error) or "pass" (uncacheable: every waiter fetches alone).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use corral_core::Permit;
use corral_core::head::RequestHead;
use corral_core::{
    Admission, Detail, Digest, EntryState, Forward, Identity, PassReason, PrimaryKey,
    StoredResponse, VariantKey, Vary,
};
use http::header::{HeaderName, SET_COOKIE};
use http::{HeaderMap, StatusCode, response};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::app::App;
use crate::cache::respond::{self, Answer};
use crate::cache::shared_flight;
use crate::config::OnTimeout;
use crate::origin::upstream::UpstreamError;
use crate::routes::Route;

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
    pub(crate) fn from_origin(
        parts: response::Parts,
        body: Bytes,
        request: &HeaderMap,
    ) -> Option<Self> {
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
            headers: corral_core::compact(&parts.headers, &PER_CALLER),
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
    /// The answer is being stored and its body is still arriving: every
    /// caller reads it as it grows. `head` is the entry to be, without its
    /// body.
    Streaming {
        head: Arc<StoredResponse>,
        body: Arc<crate::cache::growing::Growing>,
        fwd: Forward,
        fwd_status: Option<u16>,
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
    /// A coalesced POST's body (its digest is in `primary`); `None` for
    /// GET and HEAD.
    pub body: Option<Bytes>,
    /// Where the fetch hands a streamed answer to the flight and the
    /// leader before its body has arrived (set by `run` for a fill someone
    /// waits on).
    pub early: std::sync::Mutex<Option<oneshot::Sender<FillOutcome>>>,
    /// The length a storable answer's head declared, announced as soon as
    /// the fetch reads it (the shared tier's leader tells the other
    /// instances at once when it is too large for L2).
    pub declared: Declared,
    /// Where the origin's interim (1xx) answers go: the caller who made
    /// this fill, when its client can take them; never a background
    /// refresh.
    pub interim: Option<crate::origin::interim::Sender>,
}

/// See [`FillRequest::declared`].
#[derive(Debug)]
pub struct Declared(tokio::sync::watch::Sender<Option<u64>>);

impl Default for Declared {
    fn default() -> Self {
        Declared(tokio::sync::watch::channel(None).0)
    }
}

impl Declared {
    pub fn announce(&self, len: u64) {
        self.0.send_replace(Some(len));
    }

    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<Option<u64>> {
        self.0.subscribe()
    }
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
            body: self.body.clone(),
            early: Default::default(),
            declared: Default::default(),
            interim: None,
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

    /// True when someone waits on this fill's answer as it arrives and a
    /// failure mid-body would have nothing better to give them. With a
    /// stale copy that an origin error may serve (stale-if-error), the
    /// body is read whole first: once a streamed head has gone out, a
    /// body that breaks off can only fail, never fall back to that copy.
    pub fn streams(&self) -> bool {
        let waited_on = self
            .early
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some();
        waited_on
            && !self
                .stale()
                .is_some_and(|s| s.usable_on_error(self.app.clock.now()))
    }

    /// Hands `outcome` to the flight and the leader now; false when nobody
    /// takes it.
    pub fn publish_early(&self, outcome: FillOutcome) -> bool {
        let tx = self
            .early
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        tx.is_some_and(|tx| tx.send(outcome).is_ok())
    }

    /// Where this caller's hit-for-pass marker lives.
    pub fn pass_scope(&self) -> Digest {
        self.primary.pass_scope(self.identity.as_ref())
    }

    /// Marks this caller's view of the URI uncacheable for a while.
    pub(crate) fn mark_pass(&self) {
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
    let (early_tx, mut early_rx) = oneshot::channel();
    *fill
        .early
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(early_tx);
    let mut streaming = false;
    let fetching = fetch(&fill, coalesced);
    tokio::pin!(fetching);
    let first = loop {
        tokio::select! {
            r = &mut fetching => break r,
            Ok(outcome) = &mut early_rx, if !streaming => {
                // The answer streams: every waiter and the leader read it
                // as it arrives; the flight stays open for latecomers until
                // the body is stored.
                streaming = true;
                if let Some(p) = &permit {
                    p.publish(outcome.clone());
                }
                if let Some(tx) = leader.take() {
                    let _ = tx.send(LeaderOutcome::Outcome(outcome));
                }
            }
            () = abandoned(&mut leader, permit.as_ref(), &fill), if cancellable => {
                crate::telemetry::metrics::fill_cancelled(&fill.route.name);
                return;
            }
        }
    };
    // Nobody reads a second fetch early (the PassKnown refetch below
    // answers its leader when it is done).
    drop(
        fill.early
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take(),
    );
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
        } if entry.state(fill.app.clock.now()) == EntryState::StaleWhileRevalidate => {
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
    match &fill.app.tier {
        Some(tier) if coalesced => shared_flight::fill(fill, tier.as_ref()).await,
        Some(tier) => shared_flight::fill_alone(fill, tier.as_ref()).await,
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
/// with, or `None` to fetch without waiting any more. (A follower in this
/// process under `fetch` never gets here on its first timeout: its flight
/// is handed to one waiter instead; see [`gave_up`].)
pub fn on_lock_timeout(fill: &FillRequest) -> Option<FillOutcome> {
    match fill.route.on_timeout {
        OnTimeout::Fetch | OnTimeout::FetchEach => None,
        OnTimeout::Stale => fill.stale().map(|entry| FillOutcome::Stale {
            entry,
            fwd_status: None,
            detail: Detail::LockTimeout,
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
fn fill_limit(fill: &FillRequest) -> FillOutcome {
    stale_on_error(fill, Detail::FillLimit)
        .unwrap_or_else(|| unavailable(fill, Detail::FillLimit, Duration::from_secs(1)))
}

/// What a caller turned away from a full wait list gets: the stale copy
/// if it may still be served, else a 503 saying to come back in a second.
pub fn wait_list_full(fill: &FillRequest) -> FillOutcome {
    crate::telemetry::metrics::wait_list_full(&fill.route.name);
    stale_on_error(fill, Detail::WaitListFull)
        .unwrap_or_else(|| unavailable(fill, Detail::WaitListFull, Duration::from_secs(1)))
}

/// The stale copy in hand, labelled `detail`, if stale-if-error still
/// allows serving it.
fn stale_on_error(fill: &FillRequest, detail: Detail) -> Option<FillOutcome> {
    let entry = fill
        .stale()
        .filter(|s| s.usable_on_error(fill.app.clock.now()))?;
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

/// What a fetch came to, before the flight hands it out.
pub enum Ended {
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
    let now = fill.app.clock.now();
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
    let ended = crate::cache::fetch::fetch(fill).await;
    if let Some(ok) = origin_verdict(&ended) {
        fill.route.circuit.record(ok);
        let scope = fill.pass_scope();
        if ok {
            fill.app.l1.clear_backoff(&scope);
        } else {
            let policy = fill.route.backoff;
            let backoff =
                policy.after_failure(fill.app.l1.last_backoff(&scope), fill.app.clock.now());
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
        // A 5xx the origin made cacheable is still a failing origin.
        Ended::Outcome(FillOutcome::Stored { entry, .. }) => {
            Some(!entry.status().is_server_error())
        }
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

/// The failure every waiter shares, or the stale entry if stale-if-error
/// allows it.
pub(crate) fn failed(fill: &FillRequest, e: &UpstreamError) -> FillOutcome {
    if let UpstreamError::Busy(_) = e {
        // corral's own queue was full: the origin was not asked, so this
        // is no verdict on it (see `origin_verdict`).
        crate::telemetry::metrics::origin_skipped(&fill.route.name, "upstream-busy");
        return stale_on_error(fill, Detail::UpstreamBusy)
            .unwrap_or_else(|| unavailable(fill, Detail::UpstreamBusy, Duration::from_secs(1)));
    }
    if let Some(stale) = stale_on_error(fill, Detail::StaleIfError) {
        return stale;
    }
    tracing::warn!(route = %fill.route.name, upstream = %fill.route.upstream.authority, error = %e, "upstream failed");
    FillOutcome::Shared {
        response: Arc::new(SharedResponse::corral_error(
            e.status(),
            Detail::Upstream(e.detail()),
        )),
        fwd: fill.fwd,
        detail: Some(Detail::Upstream(e.detail())),
    }
}
