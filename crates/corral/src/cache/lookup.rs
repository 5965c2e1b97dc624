//! The top layer of the miss path: GET and HEAD (and a POST the route
//! coalesces) looked up under their keys in L1. `miss::Miss` decides: a
//! fresh copy answers, a stale one answers while one background refresh
//! runs, and anything else goes to the key's flight (the layer below,
//! `flight`), after the rate limits that spare hits have counted it. This
//! module measures what the decisions need and answers from a stored copy.

use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use corral_core::model::miss::{Found, Lookup, Miss};
use corral_core::semantics::head::RequestHead;
use corral_core::{
    CacheStatus, Detail, Digest, EntryState, Forward, Identity, PathRule, PathScope, PrimaryKey,
    StoredResponse, UriKey, Vary, model::xfetch,
};
use futures_util::future::BoxFuture;
use http::Method;

use crate::cache::fill::{self, Cache, FillKeys, FillRequest, Job, copy_for};
use crate::cache::flight::{self, Flown, Joining};
use crate::cache::respond::{self, Answer};
use crate::cache::rules;
use crate::cache::{driver, gate, shared};
use crate::origin::interim;
use crate::routes::Route;

/// What a request must pass once the cache cannot answer it, before it
/// fetches or waits for a fetch: the rate limits that spare hits. Its
/// refusal is the answer.
pub trait Admit: Send + Sync {
    fn admit(&self) -> BoxFuture<'_, Result<(), Answer>>;
}

/// True when this caller's view of the URI is hit-for-pass: the last
/// answer could not be stored.
pub fn passes(cache: &Cache, route: &Route, ctx: &RequestHead) -> bool {
    fill::is_pass(cache, &Keys::of(cache, route, ctx, None).pass_scope(ctx))
}

/// GET and HEAD through the cache; with `body`, a POST the route
/// coalesces (the body, with its Content-Type, is part of the key).
pub async fn serve(
    cache: Arc<Cache>,
    route: Arc<Route>,
    ctx: Box<RequestHead>,
    body: Option<Bytes>,
    gate: Option<Arc<dyn Admit>>,
    interim: Option<interim::Sender>,
) -> Answer {
    match answer_now(cache, route, ctx, body, interim, false) {
        Ok(answer) => answer,
        Err(missed) => missed.finish(gate).await,
    }
}

/// The request looked up in L1, with nothing awaited: the answer from
/// a stored copy (a hit, or stale while one refresh runs), or what the
/// rest of the miss path needs ([`Missed::finish`]). A hit so never sets
/// up, or moves, the futures of the layers below. With `wire`, the caller
/// writes a hit's head as HTTP/1.1 and adds nothing to it: a whole hit
/// may then be a [`respond::Wire`].
pub fn answer_now(
    cache: Arc<Cache>,
    route: Arc<Route>,
    ctx: Box<RequestHead>,
    body: Option<Bytes>,
    interim: Option<interim::Sender>,
    wire: bool,
) -> Result<Answer, Box<Missed>> {
    let mut asked = MissRequest {
        keys: Keys::of(&cache, &route, &ctx, body.as_ref()),
        ctx: Head::Own(ctx),
        cache,
        route,
        body,
        interim,
        wire,
    };
    let miss = Miss::new();
    match look(&mut asked, &miss) {
        Looked::Answered(answer) => Ok(answer),
        Looked::Missed(joining) => Err(Box::new(Missed {
            asked,
            miss,
            joining: *joining,
        })),
    }
}

/// A request the cache could not answer from L1 at its first look.
pub struct Missed {
    asked: MissRequest,
    miss: Miss,
    joining: Joining,
}

impl Missed {
    /// The rest of the miss path: the rate limits that spare hits (`gate`),
    /// then the key's flight, looking again when the flight says to.
    pub async fn finish(self, mut gate: Option<Arc<dyn Admit>>) -> Answer {
        let Missed {
            mut asked,
            mut miss,
            mut joining,
        } = self;
        let head = asked.ctx.get().method == Method::HEAD;
        // An answer after a wait is built whole (it is not the hot path).
        asked.wire = false;
        // Another instance may know the path's No-Vary-Search rule: with
        // it, this request may be a hit, or join the flight of the key
        // the rule makes rather than fetch a key of its own.
        if asked.read_rule().await {
            joining = match look(&mut asked, &miss) {
                Looked::Answered(answer) => return answer,
                Looked::Missed(joining) => *joining,
            };
        }
        loop {
            // The cache cannot answer: the rate limits that spare hits
            // count this request now, once, before it fetches or waits
            // for a fetch.
            if let Some(g) = gate.take()
                && let Err(refused) = g.admit().await
            {
                return refused;
            }
            // Boxed: the flight's state is set up only where it is used.
            match Box::pin(flight::fly(joining, &mut miss, head)).await {
                Flown::Answer(answer) => return answer,
                // The leader taught a Vary set or a No-Vary-Search rule,
                // or left: look again, with keys made anew.
                Flown::LookAgain => asked.rekey(),
            }
            joining = match look(&mut asked, &miss) {
                Looked::Answered(answer) => return answer,
                Looked::Missed(joining) => *joining,
            };
        }
    }
}

/// One request through the miss path: what a fill for it is made of.
struct MissRequest {
    cache: Arc<Cache>,
    route: Arc<Route>,
    ctx: Head,
    keys: Keys,
    body: Option<Bytes>,
    interim: Option<interim::Sender>,
    /// A hit may be answered as a [`respond::Wire`].
    wire: bool,
}

impl MissRequest {
    /// Reads the path's No-Vary-Search rule from Redis when this
    /// instance knows none, and makes the keys again with it; true when
    /// they changed.
    async fn read_rule(&mut self) -> bool {
        let Some((scope, PathRule::Unknown)) = &self.keys.rule else {
            return false;
        };
        if rules::read(&self.cache, scope).await == PathRule::Unknown {
            return false;
        }
        let keys = Keys::of(&self.cache, &self.route, self.ctx.get(), self.body.as_ref());
        let changed = keys.primary != self.keys.primary;
        self.keys = keys;
        changed
    }
}

impl MissRequest {
    /// Makes the keys again where the path's No-Vary-Search rule, as L1
    /// knows it, is not the one they were made with.
    fn rekey(&mut self) {
        let Some((scope, known)) = &self.keys.rule else {
            return;
        };
        if self.cache.l1.path_rule(scope) != *known {
            self.keys = Keys::of(&self.cache, &self.route, self.ctx.get(), self.body.as_ref());
        }
    }
}

/// The request's head: its own while only this request reads it, moved
/// into one `Arc` when a fill first needs to share it (a hit never does).
/// Boxed from its validation on (`proxy::validated`): moved whole, it was
/// copied seven times on the way to a hit's lookup.
enum Head {
    Own(Box<RequestHead>),
    Shared(Arc<RequestHead>),
}

impl Head {
    fn get(&self) -> &RequestHead {
        match self {
            Head::Own(h) => h,
            Head::Shared(h) => h,
        }
    }

    /// The head as a fill holds it; shared from now on.
    fn share(&mut self) -> Arc<RequestHead> {
        let shared = match self {
            Head::Shared(h) => return Arc::clone(h),
            // Every field named, so a new one cannot be left behind.
            Head::Own(own) => {
                let RequestHead {
                    method,
                    version,
                    host,
                    path,
                    query,
                    headers,
                    forwarded_for,
                    peer,
                    client,
                    body,
                    tls,
                    visit,
                    request_id,
                } = &mut **own;
                Arc::new(RequestHead {
                    method: method.clone(),
                    version: *version,
                    host: std::mem::take(host),
                    path: std::mem::take(path),
                    query: query.take(),
                    headers: std::mem::take(headers),
                    forwarded_for: forwarded_for.take(),
                    peer: *peer,
                    client: *client,
                    body: *body,
                    tls: *tls,
                    visit: visit.take(),
                    request_id: request_id.take(),
                })
            }
        };
        *self = Head::Shared(Arc::clone(&shared));
        shared
    }
}

/// The keys a request is looked up and filled under.
struct Keys {
    primary: PrimaryKey,
    identity: Option<Identity>,
    /// On a route that learns No-Vary-Search rules, a GET's path and what
    /// L1 knew of its rule when the key was made.
    rule: Option<(PathScope, PathRule)>,
}

impl Keys {
    fn of(cache: &Cache, route: &Route, ctx: &RequestHead, body: Option<&Bytes>) -> Self {
        let rule = match body {
            None => rules::known(cache, route, ctx),
            Some(_) => None,
        };
        // The key and (in the fill) the upstream request both come from
        // this one validated head.
        let nvs = rule.as_ref().and_then(|(_, r)| r.rule());
        let filter = &route.cache.query_filter;
        // Each arm makes the keys where they are returned: made as a pair
        // and then moved in, the key was copied once more on every hit.
        match body {
            Some(b) => Keys {
                primary: PrimaryKey::with_content(
                    ctx.method.as_str(),
                    &route.name,
                    UriKey::with_rule(&ctx.host, &ctx.path, ctx.query.as_deref(), filter, nvs),
                    ctx.tls,
                    Some(&body_kind(ctx)),
                    b,
                ),
                // Keyed on the whole Cookie field unless the route names its
                // identity cookies: see `IdentityRules::identify_post`.
                identity: route.cache.identity.identify_post(&ctx.headers),
                rule,
            },
            None => Keys {
                primary: PrimaryKey::get_with_rule(
                    &route.name,
                    ctx.tls,
                    &ctx.host,
                    &ctx.path,
                    ctx.query.as_deref(),
                    filter,
                    nvs,
                ),
                identity: route.cache.identity.identify(&ctx.headers),
                rule,
            },
        }
    }

    /// Where this caller's (`ctx`'s) hit-for-pass marker and back-off
    /// live: hashed only when asked for, which a hit is not.
    fn pass_scope(&self, ctx: &RequestHead) -> Digest {
        let class = corral_core::pass_class(self.identity.as_ref(), &ctx.headers);
        self.primary.pass_scope(class.as_ref())
    }
}

/// What a POST's body means depends on its type and its coding.
fn body_kind(ctx: &RequestHead) -> Vec<u8> {
    let mut kind = Vec::new();
    for h in [http::header::CONTENT_TYPE, http::header::CONTENT_ENCODING] {
        for v in ctx.headers.get_all(&h) {
            kind.extend_from_slice(v.as_bytes());
            kind.push(b'\n');
        }
        kind.push(0);
    }
    kind
}

/// What a lookup came to.
enum Looked {
    Answered(Answer),
    /// Boxed: a hit's result is not made the size of a fill's.
    Missed(Box<Joining>),
}

/// Looks the request up in L1 and answers from the copy found, or says
/// how to join the key's flight.
fn look(asked: &mut MissRequest, miss: &Miss) -> Looked {
    // Only the head is changed (shared by a fill); the rest is read.
    let MissRequest {
        ref cache,
        ref route,
        ctx: ref mut head,
        ref keys,
        ref body,
        ref interim,
        wire,
    } = *asked;
    let ctx = head.get();
    let now = cache.clock.now();
    // While the origin is failing for this key, nothing here asks it.
    // The class of caller its penalties are kept for: read before `ctx`
    // is shared with a fill below.
    let class = corral_core::pass_class(keys.identity.as_ref(), &ctx.headers);
    let scope = || keys.primary.pass_scope(class.as_ref());
    let backoff = gate::caller_backoff(&cache.l1, scope, ctx.client, now);
    let vary = cache.l1.learned_vary(&keys.primary);
    let values = vary.values(&ctx.headers);
    // Looked up by their local keys, made on the stack; the variant's
    // shared name is hashed only for a fill.
    let found = copy_for(
        &cache.l1,
        &keys.primary,
        keys.identity.as_ref(),
        &values,
        &ctx.headers,
    );
    let fwd = match (&found, &vary) {
        (Some(_), _) => Forward::Stale,
        (None, Vary::Headers(_)) => Forward::VaryMiss,
        (None, _) => Forward::UriMiss,
    };
    let method_is_head = ctx.method == Method::HEAD;
    let mut fill = |stale| {
        let variant = keys.primary.variant(keys.identity.as_ref(), &values);
        let job = Job {
            head: head.share(),
            keys: FillKeys {
                primary: keys.primary.clone(),
                identity: keys.identity,
                variant,
            },
            stale,
            fwd,
            body: body.clone(),
            interim: interim.clone(),
        };
        FillRequest::new(Arc::clone(cache), Arc::clone(route), job)
    };
    let seen = found.map(|entry| (found_state(cache, route, &entry, now), entry));
    let is_pass = || fill::is_pass(cache, &scope());
    // Redis cannot be used for this key now: a background refresh would
    // be this instance's alone (asked only where a refresh would start).
    let redis_unavailable = || shared::unavailable(cache, &keys.primary);
    let (st, entry) = match miss.lookup(seen, backoff.is_some(), route.coalesce.enabled, is_pass) {
        Lookup::Fetch { coalesce, stale } => {
            let fill = fill(stale).for_head(method_is_head);
            return Looked::Missed(Box::new(Joining { fill, coalesce }));
        }
        Lookup::Hit { refresh, entry } => {
            if refresh {
                refresh_early(cache, &entry, &mut fill, redis_unavailable);
            }
            (CacheStatus::hit(entry.ttl_secs(now)), entry)
        }
        Lookup::StaleWhileRevalidate(entry) => {
            crate::telemetry::metrics::stale(Detail::StaleWhileRevalidate);
            // With Redis unavailable the refresh would be this instance's
            // alone, and every instance would make its own: within the
            // window the origin allows, the stale copy waits for Redis.
            if redis_unavailable() {
                crate::telemetry::metrics::refresh_deferred();
            } else {
                let _ = driver::refresh(fill(Some(Arc::clone(&entry))));
            }
            (stale(&entry, now, Detail::StaleWhileRevalidate), entry)
        }
        Lookup::StaleInBackoff(entry) => {
            // The origin failed for this key moments ago: leave it alone
            // until the back-off ends.
            crate::telemetry::metrics::stale(Detail::Backoff);
            crate::telemetry::metrics::origin_skipped(&route.name, Detail::Backoff);
            (stale(&entry, now, Detail::Backoff), entry)
        }
    };
    let request = &head.get().headers;
    demand_coding(cache, route, keys, &entry, request, method_is_head);
    // The route's own targeted fields are taken off each answer by the
    // proxy: an entry that has one is answered with its header map.
    let wire = wire && !route.strips_own_fields_of(entry.headers());
    Looked::Answered(respond::hit(entry, &st, now, method_is_head, request, wire))
}

/// An entry whose codings are made on demand: a GET that prefers one it
/// lacks has it made in the background (`cache::demand`). One load on
/// the hit path when none is pending.
#[inline]
fn demand_coding(
    cache: &Arc<Cache>,
    route: &Route,
    keys: &Keys,
    entry: &Arc<corral_core::StoredResponse>,
    request: &http::HeaderMap,
    head: bool,
) {
    if !entry.codings_pending() || head {
        return;
    }
    let identity = if entry.private() {
        keys.identity.as_ref()
    } else {
        None
    };
    let at = crate::cache::demand::Stored {
        key: keys.primary.variant(identity, entry.vary_values()),
        uri: keys.primary.uri().clone(),
    };
    let config = route.cache.compression.as_ref();
    let primary = &keys.primary;
    crate::cache::demand::demand(cache, &route.name, config, at, primary, entry, request);
}

/// What the lookup makes of a stored copy: its state now, and whether a
/// fresh one is refreshed early (XFetch, or an unverified entry: the
/// invalidation log was lost, so it is refreshed like an early refresh,
/// paced by `resync`).
fn found_state(cache: &Cache, route: &Route, entry: &StoredResponse, now: SystemTime) -> Found {
    let state = entry.state(now);
    let early_refresh = state == EntryState::Fresh
        && (cache.l1.unverified(entry)
            || xfetch::roll(
                now,
                entry.fresh_until(),
                entry.fetch_duration(),
                route.cache.policy.early_refresh_beta,
            ));
    Found {
        state,
        early_refresh,
    }
}

/// Starts a hit's early refresh; an unverified entry's only where Redis
/// can be used and the resync pace allows.
fn refresh_early(
    cache: &Arc<Cache>,
    entry: &Arc<StoredResponse>,
    fill: &mut impl FnMut(Option<Arc<StoredResponse>>) -> FillRequest,
    redis_unavailable: impl Fn() -> bool,
) {
    if !cache.l1.unverified(entry) {
        let _ = driver::refresh(fill(Some(Arc::clone(entry))));
    } else if !redis_unavailable() && cache.resync.take() {
        if driver::refresh(fill(Some(Arc::clone(entry)))) {
            crate::telemetry::metrics::resync_refresh();
        } else {
            cache.resync.give_back();
        }
    }
}

/// The Cache-Status of a stale copy served for `detail`'s reason.
fn stale(entry: &StoredResponse, now: SystemTime, detail: Detail) -> CacheStatus {
    CacheStatus::forward(Forward::Stale)
        .with_ttl(entry.ttl_secs(now))
        .with_detail(detail)
}
