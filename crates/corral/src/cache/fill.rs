//! The fill's vocabulary, shared by every layer of the miss path: what a
//! fill is given ([`FillRequest`]: the request, its keys, the copy being
//! refreshed), what it produces ([`FillOutcome`], which every waiter of a
//! flight receives, and [`Ended`], which adds what only the leader can
//! take), and the events a fill's layers send up ([`FillEvent`]). The
//! outcomes corral makes itself are `synthetic`.

use std::sync::Arc;

use bytes::Bytes;
use corral_core::semantics::head::RequestHead;
use corral_core::{Budget, Clock, Flights, L1};
use corral_core::{
    Detail, Digest, Forward, Identity, PassReason, PrimaryKey, StoredResponse, VariantKey, Vary,
};
use http::header::{HeaderName, SET_COOKIE};
use http::{HeaderMap, StatusCode, response};

use crate::cache::respond::{self, Answer};
use crate::cluster::tier::SharedTier;
use crate::origin::exchange::Transport;
use crate::routes::Route;

/// What the miss path owns and every request's fill shares: the running
/// process lends it nothing else, so nothing under `cache/` names the
/// process's state.
pub struct Cache {
    pub l1: Arc<L1>,
    pub flights: Flights<FillOutcome>,
    /// Redis as the miss path reaches it.
    pub tier: Option<Arc<dyn SharedTier>>,
    /// What fills reach the origin over.
    pub transport: Arc<dyn Transport>,
    /// Where freshness, back-off and stale windows read "now".
    pub clock: Arc<dyn Clock>,
    /// What fills may buffer at once (`cache.fill_memory`).
    pub fill_memory: Arc<Budget>,
    /// What passed-through bodies may be read ahead of their clients at
    /// once (as much as `cache.fill_memory`, a budget of its own).
    pub ahead_memory: Arc<Budget>,
    /// Fills under way in this instance (`cache.max_fills`).
    pub fills: Arc<tokio::sync::Semaphore>,
    /// The pace of unverified entries' revalidations (`redis.resync_rate`).
    pub resync: crate::cache::resync::Pacer,
    /// Where compression, decoding, digest checks and large copies run
    /// (`server.cpu_threads`).
    pub cpu: crate::cache::cpu::CpuPool,
    /// The codings being made on demand now.
    pub making: crate::cache::cpu::Making,
}

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
    /// `received`: the status the origin answered with, where corral
    /// refused that answer.
    pub fn corral_error(status: StatusCode, detail: Detail, received: Option<u16>) -> Self {
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        headers.insert(
            corral_core::PROXY_STATUS.clone(),
            corral_core::proxy_status(detail, received),
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
    /// Fetched and stored in L1.
    Stored {
        entry: Arc<StoredResponse>,
        fwd: Forward,
        fwd_status: Option<u16>,
        /// Fields for the caller whose fetch it was alone: those the
        /// answer's `no-cache="..."` names, which the entry leaves out.
        own: HeaderMap,
    },
    /// Another instance's fill, read from L2 (and stored in L1).
    FromL2 {
        entry: Arc<StoredResponse>,
        /// Found after waiting on that instance's fetch (its lease): the
        /// caller was collapsed onto it, not answered from a stored copy.
        /// `fwd`: why this caller's fetch was needed.
        waited: Option<Forward>,
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
        /// How the exchange failed, when it failed without an answer: what
        /// the circuit and the back-off judge the origin by.
        failure: Option<corral_core::UpstreamFailure>,
    },
    Pass {
        reason: PassReason,
    },
    /// The answer is being stored and its body is still arriving: every
    /// caller reads it as it grows. `head` is the entry to be, without its
    /// body.
    Streaming {
        head: Arc<StoredResponse>,
        body: Arc<crate::cache::shared_body::SharedBody>,
        /// The body in each coding `head` has a representation for,
        /// compressed as it arrives (see `cache::fanout`).
        coded: Vec<(
            corral_core::Coding,
            Arc<crate::cache::shared_body::SharedBody>,
        )>,
        fwd: Forward,
        fwd_status: Option<u16>,
        /// As [`FillOutcome::Stored`]'s.
        own: HeaderMap,
    },
}

/// Everything a fill needs, owned.
pub struct FillRequest {
    pub cache: Arc<Cache>,
    pub route: Arc<Route>,
    pub head: Arc<RequestHead>,
    pub primary: PrimaryKey,
    pub identity: Option<Identity>,
    /// The flight's key: the variant this request selects.
    pub variant: VariantKey,
    /// The copy being refreshed or revalidated, or served if the origin
    /// fails: from L1, or (offered by the shared tier, which alone changes
    /// it, before the layers below read it) from L2.
    stale: Option<Arc<StoredResponse>>,
    pub fwd: Forward,
    /// A coalesced POST's body (its digest is in `primary`); `None` for
    /// GET and HEAD.
    pub body: Option<Bytes>,
    /// Where the origin's interim (1xx) answers go: the caller who made
    /// this fill, when its client can take them; never a background
    /// refresh.
    pub interim: Option<crate::origin::interim::Sender>,
}

/// What the layers under a fill's driver tell the layers above as it
/// happens, on one channel ([`Events`]): the driver's loop (and the shared
/// tier's lead, which sees them first) is a match over this.
#[derive(Debug)]
pub enum FillEvent {
    /// The fill must run to its end whoever waits: its answer is being
    /// stored, or other instances wait on its lease.
    Committed,
    /// A storable answer's head declared this length (the shared tier's
    /// leader tells the other instances at once when it is too large for
    /// L2).
    Declared(u64),
    /// The answer streams: every waiter and the leader read it as it
    /// arrives, before the fill has ended.
    Streaming(FillOutcome),
    /// Another instance found the key uncacheable (the shared pass
    /// marker): the flight's waiters fetch on their own, now.
    PassKnown,
    /// A streamed answer without a declared length outgrew what can be
    /// stored: its readers read on, and everyone else (latecomers to the
    /// flight, the waiting instances) fetches alone, now.
    Overflowed,
}

/// The sending end of a fill's events, handed down the layers.
#[derive(Debug, Clone)]
pub struct Events {
    tx: tokio::sync::mpsc::UnboundedSender<FillEvent>,
    /// Someone reads a [`FillEvent::Streaming`] outcome: the fill's first
    /// fetch (a refetch answers its leader when it is done).
    pub streams: bool,
}

impl Events {
    /// A channel of events; `streams` as [`Events::streams`].
    pub fn channel(streams: bool) -> (Events, tokio::sync::mpsc::UnboundedReceiver<FillEvent>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (Events { tx, streams }, rx)
    }

    /// The same channel, for a fetch nobody reads early.
    pub fn without_streaming(&self) -> Events {
        Events {
            tx: self.tx.clone(),
            streams: false,
        }
    }

    /// Tells the layers above; nobody listening is no error.
    pub fn send(&self, event: FillEvent) {
        let _ = self.tx.send(event);
    }
}

/// The copy in L1 a request may have: the caller's own (`identity`'s),
/// else the shared one when the caller may have it (RFC 9111 §3.5: an
/// identified caller only gets what the origin marked shareable with
/// callers like it); either only where its Vary values match `request`.
/// `values` are the request's values of the Vary set learned for
/// `primary`. The keys are made on the stack: a hit hashes nothing.
pub fn copy_for(
    l1: &L1,
    primary: &PrimaryKey,
    identity: Option<&Identity>,
    values: &[String],
    request: &HeaderMap,
) -> Option<Arc<StoredResponse>> {
    let uri = primary.uri();
    if let Some(id) = identity
        && let Some(e) = l1.get(primary.local_bytes(Some(id), values).as_slice(), uri)
        && e.matches_vary(request)
    {
        return Some(e);
    }
    let e = l1.get(primary.local_bytes(None, values).as_slice(), uri)?;
    if !e.sharing().admits(identity) || !e.matches_vary(request) {
        return None;
    }
    Some(e)
}

impl FillRequest {
    /// True when L1 holds a fresh copy of this fill's variant that its
    /// caller may have: one stored since the caller looked (a flight it
    /// would have followed ended between its lookup and its join).
    pub fn filled_meanwhile(&self) -> bool {
        let l1 = &self.cache.l1;
        let request = &self.head.headers;
        let values = l1.learned_vary(&self.primary).values(request);
        copy_for(l1, &self.primary, self.identity.as_ref(), &values, request)
            .is_some_and(|e| e.state(self.cache.clock.now()) == corral_core::EntryState::Fresh)
    }

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
            cache: Arc::clone(&self.cache),
            route: Arc::clone(&self.route),
            head: Arc::clone(&self.head),
            primary: self.primary.clone(),
            identity: self.identity,
            variant: self.variant.clone(),
            stale: Some(entry),
            fwd: Forward::Stale,
            body: self.body.clone(),
            interim: None,
        }
    }

    /// The fill for `head`'s request of `variant` on `route`, refreshing
    /// (or serving on error) `stale`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cache: Arc<Cache>,
        route: Arc<Route>,
        head: Arc<RequestHead>,
        (primary, identity, variant): (PrimaryKey, Option<Identity>, VariantKey),
        stale: Option<Arc<StoredResponse>>,
        fwd: Forward,
        body: Option<Bytes>,
        interim: Option<crate::origin::interim::Sender>,
    ) -> Self {
        FillRequest {
            cache,
            route,
            head,
            primary,
            identity,
            variant,
            stale,
            fwd,
            body,
            interim,
        }
    }

    /// The stale copy in hand, if any.
    pub fn stale(&self) -> Option<Arc<StoredResponse>> {
        self.stale.clone()
    }

    /// Takes `entry` (read from L2) as the copy to serve if the origin
    /// fails, unless the one in hand is at least as recent.
    pub fn offer_stale(&mut self, entry: Arc<StoredResponse>) {
        let newer = self
            .stale
            .as_ref()
            .is_none_or(|held| entry.response_time() > held.response_time());
        if newer {
            self.stale = Some(entry);
        }
    }

    /// True when someone reads this fill's answer as it arrives (`events`)
    /// and a failure mid-body would have nothing better to give them. With
    /// a stale copy that an origin error may serve (stale-if-error), the
    /// body is read whole first: once a streamed head has gone out, a body
    /// that breaks off can only fail, never fall back to that copy.
    pub fn streams(&self, events: &Events) -> bool {
        events.streams
            && !self
                .stale
                .as_ref()
                .is_some_and(|s| s.usable_on_error(self.cache.clock.now()))
    }

    /// Where this caller's hit-for-pass marker lives.
    pub fn pass_scope(&self) -> Digest {
        self.primary.pass_scope(self.pass_class().as_ref())
    }

    /// The class of caller its hit-for-pass marker and back-off are kept
    /// for ([`corral_core::model::identity::pass_class`]).
    pub fn pass_class(&self) -> Option<Identity> {
        corral_core::pass_class(self.identity.as_ref(), &self.head.headers)
    }

    /// Marks this caller's view of the URI uncacheable for a while.
    pub(crate) fn set_hit_for_pass(&self) {
        self.cache
            .l1
            .mark_pass(self.pass_scope(), self.route.policy.hit_for_pass);
    }

    /// True while this caller's view of the URI is marked uncacheable.
    pub(crate) fn is_hit_for_pass(&self) -> bool {
        is_pass(&self.cache, &self.pass_scope())
    }

    /// The URI is cacheable again for this caller: its answer was stored.
    pub(crate) fn clear_hit_for_pass(&self) {
        self.cache.l1.clear_pass(&self.pass_scope());
    }
}

/// True while the callers of `scope` are hit-for-pass on their URI. The
/// marker in L1 is read and written here alone (its copy in Redis, by
/// `records`).
pub(crate) fn is_pass(cache: &Cache, scope: &Digest) -> bool {
    cache.l1.is_pass(scope)
}

/// What a fill produced: the outcome every waiter shares, or (an answer
/// that is neither stored nor shared) the origin's answer itself, streamed
/// to the leader alone while the waiters fetch their own. The leading
/// client receives this; each waiter, the [`FillOutcome`].
pub enum Ended {
    Outcome(FillOutcome),
    Stream(PassReason, Answer),
}
