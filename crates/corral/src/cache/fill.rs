//! The fill's vocabulary, shared by every layer of the miss path: what a
//! fill is given ([`FillRequest`]: the [`Job`] the lookup hands down, and
//! each layer's parts, borrowed from a cache and a route no layer reaches
//! whole), what it produces ([`FillOutcome`], which every waiter of a
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
use crate::origin::upstream::Upstream;
use crate::routes::{CacheParams, CoalesceParams, Route};

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
        /// Relayed from another instance's fetch as it arrives
        /// (`cache::relay`): every caller here was collapsed onto it.
        relayed: bool,
    },
}

/// Everything a fill needs, owned: the job (keys, head, body, why, the
/// stale copy) and, out of every layer's reach, the cache and the route.
/// A layer is handed only its parts ([`FlightParts`], [`SharedParts`],
/// [`GateParts`], [`ExchangeParts`], [`StoreParts`]), borrowed from
/// them: nothing under `cache/` reaches the whole `Cache` or `Route`
/// through a fill, and `tests/tests/layers.rs` checks which file asks for
/// which parts. Below the lookup it is only ever borrowed shared (`&`):
/// the one thing a layer adds to it, a stale copy found in L2, goes in
/// through [`FillRequest::offer_stale`], which the driver hears.
pub struct FillRequest {
    cache: Arc<Cache>,
    route: Arc<Route>,
    pub head: Arc<RequestHead>,
    pub primary: PrimaryKey,
    pub identity: Option<Identity>,
    /// The flight's key: the variant this request selects.
    pub variant: VariantKey,
    /// The copy being refreshed or revalidated, or served if the origin
    /// fails: from L1, or (offered by the shared tier, which alone changes
    /// it, before the layers below read it) from L2. A channel, so that the
    /// driver hears an offer while the fill runs.
    stale: tokio::sync::watch::Sender<Option<Arc<StoredResponse>>>,
    pub fwd: Forward,
    /// A coalesced POST's body (its digest is in `primary`); `None` for
    /// GET and HEAD.
    pub body: Option<Bytes>,
    /// Where the origin's interim (1xx) answers go: the caller who made
    /// this fill, when its client can take them; never a background
    /// refresh.
    pub interim: Option<crate::origin::interim::Sender>,
    /// A HEAD's fill of a stored copy that is no longer fresh: the origin
    /// is asked with HEAD, and its answer freshens the copy or retires it
    /// (RFC 9111 §4.3.5); nothing it gets is ever stored as a body. It has
    /// a flight of its own ([`FillRequest::flight_key`]); across instances
    /// it takes the variant's lease, whose waiters read only what it
    /// stored in L2 (the copy it freshened).
    pub by_head: bool,
}

/// The keys a fill is made under: the request's primary key, its
/// caller's identity (if any), and the variant its flight is keyed on.
pub struct FillKeys {
    pub primary: PrimaryKey,
    pub identity: Option<Identity>,
    pub variant: VariantKey,
}

/// What a fill is asked to do, as the lookup hands it down: the request
/// (its validated head and, for a coalesced POST, its body), its keys, why
/// it is forwarded, the copy being refreshed (or served if the origin
/// fails), and where the origin's interim answers go.
pub struct Job {
    pub head: Arc<RequestHead>,
    pub keys: FillKeys,
    pub stale: Option<Arc<StoredResponse>>,
    pub fwd: Forward,
    pub body: Option<Bytes>,
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

    /// True once nobody listens any more (the fill has ended).
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
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

/// The flight's parts: the flights registry and the route's coalescing.
pub struct FlightParts<'a> {
    pub flights: &'a Flights<FillOutcome>,
    pub coalesce: &'a CoalesceParams,
}

/// The shared tier's parts: Redis, and how long the route's callers wait.
pub struct SharedParts<'a> {
    pub tier: Option<&'a Arc<dyn SharedTier>>,
    pub coalesce: &'a CoalesceParams,
}

/// The gate's parts: the route's back-off and circuit, the fill slots
/// (the route's and the instance's) and how long a fill waits for them,
/// and Redis, where the back-off is shared.
pub struct GateParts<'a> {
    pub backoff: corral_core::BackoffPolicy,
    pub circuit: &'a corral_core::Circuit,
    pub route_slots: &'a Arc<tokio::sync::Semaphore>,
    pub instance_slots: &'a Arc<tokio::sync::Semaphore>,
    pub lock_timeout: std::time::Duration,
    pub tier: Option<&'a Arc<dyn SharedTier>>,
}

/// The exchange's parts: the transport, the upstream, the route's caching
/// policy and compression, the budget of bodies passed on to their
/// callers ahead of them, and the CPU pool a passed answer is decoded on.
pub struct ExchangeParts<'a> {
    pub transport: &'a dyn Transport,
    pub upstream: &'a Upstream,
    pub policy: &'a corral_core::RoutePolicy,
    pub compression: Option<&'a crate::config::CompressionConfig>,
    pub ahead_memory: &'a Arc<Budget>,
    /// Where a passed-through answer is decoded.
    pub cpu: &'a crate::cache::cpu::CpuPool,
}

/// The store's parts: the fill memory budget (and the read-ahead one, for
/// a body that turns out too large to keep), the CPU pool codings are
/// made on, the route's caching policy and compression.
pub struct StoreParts<'a> {
    pub fill_memory: &'a Arc<Budget>,
    pub ahead_memory: &'a Arc<Budget>,
    pub cpu: &'a crate::cache::cpu::CpuPool,
    pub policy: &'a corral_core::RoutePolicy,
    pub compression: Option<&'a crate::config::CompressionConfig>,
}

/// The relay's parts, owned: a waiting instance's relay outlives the
/// fill's borrow (its callers read on), with Redis, and the cache whose L1
/// screens the relayed head by the bans in force and whose fill memory
/// holds the relayed body.
pub struct RelayParts {
    pub tier: Option<Arc<dyn SharedTier>>,
    pub cache: Arc<Cache>,
}

impl FillRequest {
    /// The relay's parts.
    pub fn relay(&self) -> RelayParts {
        RelayParts {
            tier: self.cache.tier.clone(),
            cache: Arc::clone(&self.cache),
        }
    }

    /// The flight's parts.
    pub fn flight(&self) -> FlightParts<'_> {
        FlightParts {
            flights: &self.cache.flights,
            coalesce: &self.route.coalesce,
        }
    }

    /// The shared tier's parts.
    pub fn shared(&self) -> SharedParts<'_> {
        SharedParts {
            tier: self.cache.tier.as_ref(),
            coalesce: &self.route.coalesce,
        }
    }

    /// The gate's parts.
    pub fn gate(&self) -> GateParts<'_> {
        GateParts {
            backoff: self.route.origin.backoff,
            circuit: &self.route.origin.circuit,
            route_slots: &self.route.origin.fills,
            instance_slots: &self.cache.fills,
            lock_timeout: self.route.coalesce.lock_timeout,
            tier: self.cache.tier.as_ref(),
        }
    }

    /// The exchange's parts.
    pub fn exchange(&self) -> ExchangeParts<'_> {
        ExchangeParts {
            transport: self.cache.transport.as_ref(),
            upstream: &self.route.origin.upstream,
            policy: &self.route.cache.policy,
            compression: self.route.cache.compression.as_ref(),
            ahead_memory: &self.cache.ahead_memory,
            cpu: &self.cache.cpu,
        }
    }

    /// The store's parts.
    pub fn store(&self) -> StoreParts<'_> {
        StoreParts {
            fill_memory: &self.cache.fill_memory,
            ahead_memory: &self.cache.ahead_memory,
            cpu: &self.cache.cpu,
            policy: &self.route.cache.policy,
            compression: self.route.cache.compression.as_ref(),
        }
    }

    /// L1: every layer reads it; the records in it that have an owner
    /// (back-off, hit-for-pass) are reached through their owner.
    pub fn l1(&self) -> &L1 {
        &self.cache.l1
    }

    /// "Now", as freshness, back-off and stale windows read it.
    pub fn now(&self) -> std::time::SystemTime {
        self.cache.clock.now()
    }

    /// The clock "now" is read from, for a task that outlives a borrow.
    pub fn clock(&self) -> Arc<dyn Clock> {
        Arc::clone(&self.cache.clock)
    }

    /// The route's name, for logs and metrics.
    pub fn route_name(&self) -> &str {
        &self.route.name
    }

    /// The route's origin as logs name it, and its deadlines.
    pub fn origin(&self) -> &Upstream {
        &self.route.origin.upstream
    }

    /// How the route's callers wait on one another.
    pub fn coalesce_params(&self) -> &CoalesceParams {
        &self.route.coalesce
    }

    /// The route's cache params, for the rules keys are made with.
    pub fn cache_params(&self) -> &CacheParams {
        &self.route.cache
    }

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
            stale: tokio::sync::watch::Sender::new(Some(entry)),
            fwd: Forward::Stale,
            body: self.body.clone(),
            interim: None,
            by_head: false,
        }
    }

    /// The fill of `job` on `route`.
    pub fn new(cache: Arc<Cache>, route: Arc<Route>, job: Job) -> Self {
        let Job {
            head,
            keys:
                FillKeys {
                    primary,
                    identity,
                    variant,
                },
            stale,
            fwd,
            body,
            interim,
        } = job;
        FillRequest {
            cache,
            route,
            head,
            primary,
            identity,
            variant,
            stale: tokio::sync::watch::Sender::new(stale),
            fwd,
            body,
            interim,
            by_head: false,
        }
    }

    /// The fill of a HEAD (`head`): one of a copy that is no longer fresh
    /// asks the origin with HEAD (RFC 9111 §4.3.5); one that has no copy
    /// fills it with a GET, as a GET would, so that a burst of HEADs and
    /// GETs on a cold key is one origin request.
    pub fn for_head(mut self, head: bool) -> Self {
        self.by_head = head && self.stale.borrow().is_some() && self.body.is_none();
        self
    }

    /// The key of this fill's flight: the variant's, or for a fill
    /// [`by_head`](FillRequest::by_head) one of its own, so that a GET
    /// never follows (and never gets) a HEAD's answer.
    pub fn flight_key(&self) -> Digest {
        if self.by_head {
            self.variant.digest.head_probe()
        } else {
            self.variant.digest
        }
    }

    /// The stale copy in hand, if any.
    pub fn stale(&self) -> Option<Arc<StoredResponse>> {
        self.stale.borrow().clone()
    }

    /// Takes `entry` (read from L2) as the copy to serve if the origin
    /// fails, unless the one in hand is at least as recent. The fill's
    /// driver hears it ([`FillRequest::stale_offers`]): a hung fetch's
    /// callers are answered from it too.
    pub fn offer_stale(&self, entry: Arc<StoredResponse>) {
        self.stale.send_if_modified(|held| {
            let newer = held
                .as_ref()
                .is_none_or(|held| entry.response_time() > held.response_time());
            if newer {
                *held = Some(entry);
            }
            newer
        });
    }

    /// Tells of every copy [`FillRequest::offer_stale`] takes from now on.
    pub fn stale_offers(&self) -> tokio::sync::watch::Receiver<Option<Arc<StoredResponse>>> {
        self.stale.subscribe()
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
                .borrow()
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
            .mark_pass(self.pass_scope(), self.route.cache.policy.hit_for_pass);
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
