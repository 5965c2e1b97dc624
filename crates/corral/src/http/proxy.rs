//! The front end's one handler: match a route, then send GET/HEAD through
//! the cache and every other method straight through to the upstream. An
//! unsafe method answered 2xx/3xx invalidates the stored GET for its URI
//! and for same-origin Location / Content-Location (RFC 9111 §4.4).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;

use crate::origin::interim::Sender as Interim;
use bytes::{Bytes, BytesMut};
use corral_core::{CacheStatus, Detail, Forward};
use futures_util::StreamExt;
use futures_util::future::Either;
use http::Method;
use http::header::RANGE;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::time::Instant;

use crate::app::App;
use crate::cache::lookup;
use crate::cache::respond::{self, Answer};
use crate::http::connection::Reply;
use crate::http::gate::Gate;
use crate::http::request_id;
use crate::limits::{Phase, Who};
use crate::origin::exchange::{Answered, Held, OriginRequest, exchange};
use crate::origin::upstream::{DeadlineBody, UpstreamError};
use crate::routes::Route;
use crate::telemetry::access_log::{self, AccessLine};
use crate::telemetry::metrics;
use corral_core::semantics::head::{OriginVisit, RequestBody, RequestHead, RequestId};

/// The client listener's handler: every request to [`handle`], called
/// directly by the connection.
#[derive(Clone)]
pub struct Proxy(pub Arc<App>);

impl crate::http::connection::Handler for Proxy {
    fn call(
        &self,
        req: Request<Body>,
        peer: crate::http::connection::Peer,
    ) -> impl std::future::Future<Output = Reply> + Send + 'static {
        match handle(Arc::clone(&self.0), peer, req) {
            Handled::Now(res) => Either::Left(std::future::ready(res)),
            Handled::Later(answer) => Either::Right(answer),
        }
    }
}

/// A request's answer: made without waiting for anything (a hit), or a
/// future of it, boxed where it is made (moved whole into the
/// connection's future, it was copied on the way: 12k instructions of
/// memcpy per hit once).
pub enum Handled {
    Now(Reply),
    Later(Pin<Box<dyn Future<Output = Reply> + Send>>),
}

/// The client listener's answer to `req`. What can be answered without
/// waiting (a request refused, or answered from L1 on a route without
/// limits) is answered at once; the rest becomes a future.
pub fn handle(
    app: Arc<App>,
    peer: crate::http::connection::Peer,
    mut req: Request<Body>,
) -> Handled {
    let started = Instant::now();
    // Read before anything else reads the fields (an unfit one is taken
    // off them); the origin gets it from the head.
    let request_id = request_id::take(req.headers_mut());
    let conn = peer;
    let peer = conn.addr;
    let method = req.method().clone();
    // Who sent it, read from the original headers before anything is
    // stripped: the peer, unless a trusted proxy vouches for another.
    let client = {
        let trust = app.trust();
        let client =
            corral_core::callers::client_addr::resolve(peer.ip(), req.headers(), &trust.proxies);
        count_vouchers(&trust, &client);
        client
    };
    // Copied only for the access line, and only when one is written.
    let logged = access_log::enabled().then(|| {
        let visit = Arc::new(OriginVisit::default());
        // The fetch made for this request finds it on the head.
        req.extensions_mut().insert(Arc::clone(&visit));
        Logged {
            path: req.uri().path().to_owned(),
            host: host_of(&req),
            visit,
        }
    });
    let done = Done {
        started,
        method,
        logged,
        peer,
        request_id,
    };
    match route_now(&app, conn, &client, &done.request_id, req) {
        Step::Answered(route, answer) => Handled::Now(done.finish(route, answer, &client)),
        Step::Missed(route, missed) => Handled::Later(Box::pin(async move {
            let answer = missed.finish(None).await;
            done.finish(Some(route), answer, &client)
        })),
        Step::Routed(routed, interim, upstream) => Handled::Later(Box::pin(async move {
            let (route, answer) = route_request(app, interim, upstream, &client, *routed).await;
            done.finish(route, answer, &client)
        })),
    }
}

/// What the answer's last step needs of its request: the route's fields
/// taken off, the request counted and logged.
struct Done {
    started: Instant,
    method: Method,
    /// What only the access line needs, when one is written.
    logged: Option<Logged>,
    peer: SocketAddr,
    /// Echoed on the answer.
    request_id: RequestId,
}

/// What the access line needs of a request beyond its answer.
struct Logged {
    /// The path, never the query.
    path: String,
    /// The host asked for, without port or user information.
    host: String,
    /// Where the origin was asked for it, if it was.
    visit: Arc<OriginVisit>,
}

/// The host a request names (its target's, else its `Host` field's),
/// without port or user information.
fn host_of(req: &Request<Body>) -> String {
    let host = req.uri().host().or_else(|| {
        let field = req.headers().get(http::header::HOST)?.to_str().ok()?;
        Some(match field.rsplit_once(':') {
            // Not the colons of a bracketed IPv6 address.
            Some((h, port)) if !port.contains(']') => h,
            _ => field,
        })
    });
    host.unwrap_or("").to_ascii_lowercase()
}

impl Done {
    fn finish(
        self,
        route: Option<Arc<Route>>,
        answer: Answer,
        client: &corral_core::callers::client_addr::ClientAddr,
    ) -> Reply {
        let Answer {
            response: mut res,
            label,
            mut wire,
            ..
        } = answer;
        match &mut wire {
            Some(w) => w.set_request_id(self.request_id),
            None => {
                res.headers_mut()
                    .insert(request_id::X_REQUEST_ID.clone(), self.request_id.to_value());
            }
        }
        // A wire answer was made only where the route strips nothing.
        if let Some(r) = &route
            && wire.is_none()
        {
            r.strip_own_fields(res.headers_mut());
        }
        let route_name = route.as_ref().map_or("-", |r| r.name.as_str());
        let cache = label.as_str();
        match &route {
            Some(r) => r.edge.requests.count(&self.method, cache),
            None => metrics::unrouted(&self.method, cache),
        }
        // The access line: never the query (it may carry tokens), never a
        // credential header.
        let Some(logged) = self.logged else {
            return match wire {
                Some(w) => Reply::Wire(w),
                None => Reply::Response(res),
            };
        };
        let bytes = match &wire {
            Some(w) => Some(w.body().len() as u64),
            None => http_body::Body::size_hint(res.body()).exact(),
        };
        let visit = logged.visit.get();
        access_log::log(&AccessLine {
            route: route_name,
            method: self.method.as_str(),
            host: &logged.host,
            path: &logged.path,
            status: res.status().as_u16(),
            cache,
            cache_status: wire
                .as_ref()
                .map_or_else(
                    // corral's member, after any of the caches before it.
                    || {
                        res.headers()
                            .get_all(&respond::CACHE_STATUS)
                            .iter()
                            .next_back()
                    },
                    |w| Some(w.cache_status()),
                )
                .and_then(|v| v.to_str().ok())
                .unwrap_or(""),
            ms: self.started.elapsed().as_secs_f64() * 1000.0,
            peer: self.peer.ip(),
            client: client.client,
            limit: res
                .extensions()
                .get::<crate::http::refusal::LimitedBy>()
                .map(|l| l.0.as_str()),
            bytes,
            upstream: visit.as_ref().map(|(u, _)| u.as_str()),
            upstream_ms: visit.as_ref().map(|(_, took)| took.as_secs_f64() * 1000.0),
            request_id: wire.as_ref().map_or_else(
                || {
                    res.headers()
                        .get(&request_id::X_REQUEST_ID)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                },
                |w| w.request_id(),
            ),
        });
        match wire {
            Some(w) => Reply::Wire(w),
            None => Reply::Response(res),
        }
    }
}

/// How far a request got without waiting.
enum Step {
    /// corral's own answer (refused, no route) or one from L1.
    Answered(Option<Arc<Route>>, Answer),
    /// Through the cache on a route without limits, and L1 could not
    /// answer: the rest of the miss path.
    Missed(Arc<Route>, Box<lookup::Missed>),
    /// Everything else: counted against the route's limits, or not
    /// through the cache.
    Routed(
        Box<Routed>,
        Option<Interim>,
        crate::origin::descriptors::Own,
    ),
}

/// The request routed, and looked up in L1 when nothing has to be
/// awaited before it (no limits count it first).
fn route_now(
    app: &App,
    peer: crate::http::connection::Peer,
    client: &corral_core::callers::client_addr::ClientAddr,
    request_id: &RequestId,
    req: Request<Body>,
) -> Step {
    let crate::http::connection::Peer {
        addr: peer,
        interim,
        tls,
        upstream,
        wire,
    } = peer;
    let routed = match routed(app, peer, tls, client, request_id, req) {
        Ok(r) => r,
        // A head that did not validate, or no route: no route's metrics
        // or fields.
        Err(answer) => return Step::Answered(None, *answer),
    };
    if !(routed.cached && routed.accounts.is_none()) {
        return Step::Routed(Box::new(routed), interim, upstream);
    }
    let Routed { route, head, .. } = routed;
    match lookup::answer_now(
        Arc::clone(&app.cache),
        Arc::clone(&route),
        head,
        None,
        interim,
        wire,
    ) {
        Ok(answer) => Step::Answered(Some(route), answer),
        Err(missed) => Step::Missed(route, missed),
    }
}

/// One count per trust entry that vouched for a hop of this request.
fn count_vouchers(
    trust: &crate::app::Trust,
    client: &corral_core::callers::client_addr::ClientAddr,
) {
    for (n, i) in client.vouchers.iter().enumerate() {
        // Each entry once per request, however many hops it vouched for.
        if client.vouchers[..n].contains(i) {
            continue;
        }
        if let Some(c) = trust.vouched.get(*i) {
            c.increment(1);
        }
    }
}

/// corral's answer to a request it serves no route for whatever its
/// target: a head over `max_header_size` (431), a tunnel (CONNECT) or a
/// protocol upgrade (501), which a reverse proxy does not open.
fn unserved(app: &App, parts: &http::request::Parts) -> Option<Answer> {
    let (status, detail) = if head_size(parts) > app.max_header_size {
        (
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Detail::RequestHeadTooLarge,
        )
    } else if parts.method == Method::CONNECT {
        // Answered here, as nginx does, never asked of the origin.
        (StatusCode::NOT_IMPLEMENTED, Detail::MethodUnsupported)
    } else if wants_upgrade(&parts.headers) {
        // corral does not tunnel: say so, rather than forward a request
        // whose Upgrade it would have to drop.
        (StatusCode::NOT_IMPLEMENTED, Detail::UpgradeUnsupported)
    } else {
        return None;
    };
    Some(respond::error(status, Forward::Bypass, detail, None))
}

/// The request's validated head, its client as the trusted proxies name
/// it; a head that does not validate is a 400 that closes the connection
/// (the stream may be out of step with the client after it).
fn validated(
    parts: &mut http::request::Parts,
    peer: SocketAddr,
    body: &Body,
    tls: bool,
    client: &corral_core::callers::client_addr::ClientAddr,
) -> Result<Box<RequestHead>, Box<Answer>> {
    match RequestHead::parse(parts, peer.ip(), crate::origin::request::body_of(body)) {
        // Boxed and set in place: the head is large, and each move of it
        // a copy (see `lookup::Head`).
        Ok(h) => {
            let mut h = Box::new(h);
            h.tls = tls;
            h.visit = parts.extensions.remove::<Arc<OriginVisit>>();
            h.trust(client);
            Ok(h)
        }
        Err(bad) => {
            let mut res = respond::error(
                StatusCode::BAD_REQUEST,
                Forward::Bypass,
                Detail::BadRequest(bad),
                None,
            );
            res.response.headers_mut().insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("close"),
            );
            Err(Box::new(res))
        }
    }
}

/// Where the route's limits read accounts from, if it has limits. The
/// account header (`callers.account.header`) is an authenticating proxy's
/// to set: from anyone else it is removed here, so neither the key nor the
/// origin ever sees an account the caller named itself.
fn accounts_of(
    app: &App,
    route: &Route,
    head: &mut RequestHead,
    client: &corral_core::callers::client_addr::ClientAddr,
) -> Option<Arc<corral_core::callers::caller::AccountSources>> {
    let trust = app.trust();
    if client.vouchers.is_empty()
        && let Some(name) = &trust.accounts.header
    {
        head.headers.remove(name);
    }
    (!route.edge.limits.is_empty()).then(|| Arc::clone(&trust.accounts))
}

/// A request matched to its route, with what the awaits after it need.
/// Made by a plain function, so the request's parts are never part of
/// `route_request`'s future (which every hit sets up and moves).
struct Routed {
    route: Arc<Route>,
    /// Boxed: see `lookup::Head`.
    head: Box<RequestHead>,
    body: Body,
    accounts: Option<Arc<corral_core::callers::caller::AccountSources>>,
    /// GET or HEAD through the cache.
    cached: bool,
    /// A coalesced POST or a QUERY: its content is read and keyed.
    keyed_content: bool,
}

/// The request validated and routed, or corral's own answer to it.
fn routed(
    app: &App,
    peer: SocketAddr,
    tls: bool,
    client: &corral_core::callers::client_addr::ClientAddr,
    request_id: &RequestId,
    req: Request<Body>,
) -> Result<Routed, Box<Answer>> {
    let (mut parts, body) = req.into_parts();
    if let Some(refused) = unserved(app, &parts) {
        return Err(Box::new(refused));
    }
    let mut head = validated(&mut parts, peer, &body, tls, client)?;
    head.request_id = Some(request_id.clone());
    // The route table of this moment: a reload does not change the route a
    // request in flight started with.
    let Some(route) = app.routes().find(&head.host, &head.path).cloned() else {
        return Err(Box::new(respond::error(
            StatusCode::NOT_FOUND,
            Forward::Bypass,
            Detail::NoRoute,
            None,
        )));
    };
    // Before anything reads the fields (limits, identity, the key): a
    // field spelled with `_` is another's at a CGI-style origin.
    if corral_core::semantics::head::has_underscored(&head.headers) {
        corral_core::semantics::head::strip_underscored(
            &mut head.headers,
            route.edge.underscores_in_headers,
            app.trust().accounts.header.as_ref(),
        );
    }
    let accounts = accounts_of(app, &route, &mut head, client);
    // A route that compresses chooses the coding per caller itself; any
    // other that caches reads Accept-Encoding as gzip or nothing, so the
    // spellings clients send share one variant and one fill (the key's
    // Vary values and the upstream request both come from this head).
    if route.cache.enabled && route.cache.compression.is_none() && head.is_cacheable_method() {
        corral_core::normalize_accept_encoding(&mut head.headers);
    }
    let cached = head.is_cacheable_method()
        && route.cache.enabled
        && head.body == RequestBody::None
        && !(corral_core::semantics::head::carries(&head.headers, &RANGE)
            && lookup::passes(&app.cache, &route, &head));
    let keyed_content = content_limit(&route, &head).is_some();
    Ok(Routed {
        route,
        head,
        body,
        accounts,
        cached,
        keyed_content,
    })
}

/// How much of a request's content is read to key it: a POST on a route
/// that coalesces them (`coalesce.post.max_body`), or a QUERY (RFC 10008)
/// on a route that caches (the same bound, 64 KiB without one); `None`
/// for any other request.
fn content_limit(route: &Route, head: &RequestHead) -> Option<u64> {
    if !route.cache.enabled {
        return None;
    }
    if head.method == Method::POST {
        return route.coalesce.post_max_body;
    }
    head.is_query()
        .then(|| route.coalesce.post_max_body.unwrap_or(QUERY_MAX_BODY))
}

/// A QUERY's content read for its key, on a route that names no
/// `coalesce.post.max_body`.
const QUERY_MAX_BODY: u64 = 64 * 1024;

/// A routed request that `route_now` could not answer without waiting.
async fn route_request(
    app: Arc<App>,
    interim: Option<Interim>,
    upstream: crate::origin::descriptors::Own,
    client: &corral_core::callers::client_addr::ClientAddr,
    routed: Routed,
) -> (Option<Arc<Route>>, Answer) {
    let Routed {
        route,
        head,
        body,
        accounts,
        cached,
        keyed_content,
    } = routed;
    let (mut tallies, gate) = match accounts {
        None => (Vec::new(), None),
        Some(accounts) => {
            let spared = cached || keyed_content;
            match Box::pin(counted(&app, &route, &head, client, &accounts, spared)).await {
                Ok(counted) => counted,
                Err(refused) => return (Some(route), *refused),
            }
        }
    };
    // A Range request goes through the cache (answered from the whole
    // stored response), unless the key is known uncacheable: then the
    // origin answers the range itself, so a large download can resume.
    // Awaited here, not in `route_through`: one level less of futures on
    // the hit path. Every path a hit does not take is boxed below, so the
    // hit's future is small to set up (a 14 KiB future was copied at every
    // request: 12k instructions of memcpy per hit).
    let (route, mut answer) = if cached {
        let res = lookup::serve(
            Arc::clone(&app.cache),
            Arc::clone(&route),
            head,
            None,
            gate.clone().map(|g| g as Arc<dyn lookup::Admit>),
            interim,
        )
        .await;
        (Some(route), res)
    } else {
        Box::pin(route_through(
            app,
            route,
            *head,
            body,
            gate.clone(),
            interim,
            upstream,
        ))
        .await
    };
    if let Some(g) = gate {
        if answer
            .response
            .extensions()
            .get::<crate::http::refusal::LimitedBy>()
            .is_some()
        {
            // A limit that spares hits refused it once the cache could
            // not answer: the limits that count hits give their count
            // back, so it is counted by none, and its answer shows only
            // the limit that refused it.
            Box::pin(g.app.limiter.give_back(&tallies)).await;
            return (route, answer);
        }
        tallies.extend(g.take_tallies());
    }
    crate::limits::annotate(answer.response.headers_mut(), &tallies);
    (route, answer)
}

/// Counts the request against the route's limits before the cache: who
/// is calling (a refused token is a 401 here) and the limits that count
/// every request, hits too; only the cache can spare a request (`spared`:
/// it goes through the cache), elsewhere every limit counts now. The
/// tallies for the RateLimit fields, and the gate of the limits that spare
/// hits, which the cache runs only if it cannot answer.
async fn counted(
    app: &Arc<App>,
    route: &Arc<Route>,
    head: &RequestHead,
    client: &corral_core::callers::client_addr::ClientAddr,
    accounts: &corral_core::callers::caller::AccountSources,
    spared: bool,
) -> Result<(Vec<crate::limits::Tally>, Option<Arc<Gate>>), Box<Answer>> {
    let refused = |r| Box::new(crate::http::refusal::answer(r));
    let who = Who::resolve(&route.edge.limits, accounts, &head.headers, client).map_err(refused)?;
    let phase = if spared {
        Phase::BeforeCache
    } else {
        Phase::All
    };
    let tallies = app
        .limiter
        .check(&route.edge.limits, &who, phase)
        .await
        .map_err(refused)?;
    let gate = (route.edge.limits.spares_hits && spared)
        .then(|| Arc::new(Gate::new(Arc::clone(app), Arc::clone(route), who)));
    Ok((tallies, gate))
}

/// True when identical copies of this POST body may share one origin
/// request: see [`corral_core::wire::graphql::classify`].
fn post_coalescible(head: &RequestHead, body: &[u8]) -> bool {
    let field = |name| head.headers.get(name).map(http::HeaderValue::as_bytes);
    corral_core::wire::graphql::classify(
        field(http::header::CONTENT_TYPE),
        field(http::header::CONTENT_ENCODING),
        body,
    )
    .coalescible()
}

/// A routed request the cache does not answer as a GET: a coalesced POST,
/// or one straight to the upstream.
async fn route_through(
    app: Arc<App>,
    route: Arc<Route>,
    head: RequestHead,
    body: Body,
    gate: Option<Arc<Gate>>,
    interim: Option<Interim>,
    upstream: crate::origin::descriptors::Own,
) -> (Option<Arc<Route>>, Answer) {
    // A POST on a route that coalesces them: a body small enough is read
    // whole and keyed (identical in-flight POSTs of one caller share one
    // origin request); a larger one, one the POST budget cannot hold now,
    // or a GraphQL mutation passes through on its own.
    let mut body = body;
    if let Some(max) = content_limit(&route, &head) {
        // Counted in the POST bodies' own budget and read under their own
        // deadline: stalled bodies hold no fill's memory, and not for long.
        let mut hold = app.post_memory.hold();
        match read_up_to(
            body,
            max,
            head.body,
            route.coalesce.post_read_timeout,
            &mut hold,
        )
        .await
        {
            // A GraphQL write reaches the origin once per request sent,
            // and so does a body corral cannot read (encoded, persisted by
            // hash, malformed). A QUERY is safe by definition (RFC 10008
            // §2).
            Read::Whole(bytes) if !head.is_query() && !post_coalescible(&head, &bytes) => {
                drop(hold);
                if let Some(g) = &gate
                    && let Err(answer) = g.admit().await
                {
                    return (Some(route), answer);
                }
                body = Body::from(bytes);
            }
            Read::Whole(bytes) => {
                // `hold` counts the body until the flight is over.
                // Range is defined for GET only (RFC 9110 §14.2).
                let mut head = Box::new(head);
                head.headers.remove(RANGE);
                let res = lookup::serve(
                    Arc::clone(&app.cache),
                    Arc::clone(&route),
                    head,
                    Some(bytes),
                    gate.map(|g| g as Arc<dyn lookup::Admit>),
                    interim,
                )
                .await;
                drop(hold);
                return (Some(route), res);
            }
            Read::TooLarge(rest) => {
                // Not coalesced after all: the limits that spare hits count
                // it now.
                if let Some(g) = &gate
                    && let Err(answer) = g.admit().await
                {
                    return (Some(route), answer);
                }
                body = rest
            }
            Read::Failed(code) => {
                return (
                    Some(route),
                    respond::error(code, Forward::Bypass, Detail::RequestBody, None),
                );
            }
        }
    }
    let passing = Passing::new(&route, &head, body, interim);
    let res = forward_uncached(&app, passing, &upstream).await;
    (Some(route), res)
}

/// A request body read for a key.
enum Read {
    Whole(Bytes),
    /// Over the limit: what was read, then the rest, as one body.
    TooLarge(Body),
    /// The client's body broke off (400) or took longer than
    /// `coalesce.post.read_timeout` to arrive (408).
    Failed(StatusCode),
}

/// Reads `body` whole if it holds at most `max` bytes, within `budget`,
/// counting what it buffers in `hold` (`cache.post_memory`): a body that
/// budget cannot take passes through like one over `max`.
async fn read_up_to(
    body: Body,
    max: u64,
    framing: RequestBody,
    budget: Duration,
    hold: &mut corral_core::Hold,
) -> Read {
    match framing {
        RequestBody::None => return Read::Whole(Bytes::new()),
        RequestBody::Sized(n) if n > max => return Read::TooLarge(body),
        _ => {}
    }
    let mut body = body;
    let mut buf = BytesMut::new();
    let deadline = Instant::now() + budget;
    loop {
        match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return Read::Failed(StatusCode::REQUEST_TIMEOUT),
            Ok(None) => return Read::Whole(buf.freeze()),
            Ok(Some(Err(_))) => return Read::Failed(StatusCode::BAD_REQUEST),
            Ok(Some(Ok(frame))) => {
                let Ok(data) = frame.into_data() else {
                    continue; // trailers
                };
                buf.extend_from_slice(&data);
                if buf.len() as u64 > max || !hold.grow(data.len() as u64) {
                    let read =
                        futures_util::stream::once(std::future::ready(Ok::<Bytes, axum::Error>(
                            buf.freeze(),
                        )));
                    let rest = http_body_util::BodyDataStream::new(body);
                    return Read::TooLarge(Body::from_stream(read.chain(rest)));
                }
            }
        }
    }
}

/// True when the client asks to switch protocols (WebSocket and the like).
/// `h2c` is the exception: it is an offer that may be ignored, and is.
fn wants_upgrade(headers: &HeaderMap) -> bool {
    if !corral_core::semantics::head::carries(headers, &http::header::UPGRADE) {
        return false;
    }
    headers
        .get_all(http::header::UPGRADE)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(|t| t.trim_ascii())
        .any(|t| !t.is_empty() && !t.eq_ignore_ascii_case(b"h2c"))
}

/// Bytes of the request head as sent (request line and header fields).
fn head_size(parts: &http::request::Parts) -> u64 {
    let target = parts.uri.path_and_query().map_or(1, |pq| pq.as_str().len())
        + parts.uri.authority().map_or(0, |a| a.as_str().len());
    let line = parts.method.as_str().len() + target + 12;
    let fields: usize = parts
        .headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len() + 4)
        .sum();
    (line + fields) as u64
}

/// A request passed through uncached: its route, validated head and body,
/// why it was not cached (`fwd`, and `detail` where a cacheable method was
/// refused), and where the origin's 1xx answers go.
struct Passing<'a> {
    route: &'a Route,
    head: &'a RequestHead,
    body: Body,
    fwd: Forward,
    detail: Option<Detail>,
    interim: Option<Interim>,
}

impl<'a> Passing<'a> {
    /// `head`'s request on `route`, with `body`, passed through.
    fn new(route: &'a Route, head: &'a RequestHead, body: Body, interim: Option<Interim>) -> Self {
        // A GET or HEAD with a body is passed through, body and all, and
        // never cached: its answer may depend on the body, which no key holds.
        let fwd = if route.cache.enabled && !head.is_cacheable_method() {
            Forward::Method
        } else {
            Forward::Bypass
        };
        let detail = (route.cache.enabled && head.is_cacheable_method()).then(|| {
            if head.body == RequestBody::None {
                Detail::Range
            } else {
                Detail::RequestBody
            }
        });
        Passing {
            route,
            head,
            body,
            fwd,
            detail,
            interim,
        }
    }
}

/// Streams a request through to the upstream and the answer back, on an
/// upstream socket counted for it (`own`, the client connection's, or the
/// overflow's).
async fn forward_uncached(
    app: &App,
    passing: Passing<'_>,
    own: &crate::origin::descriptors::Own,
) -> Answer {
    let Passing {
        route,
        head,
        body,
        fwd,
        detail,
        interim,
    } = passing;
    // Work that only costs (it will never be a hit) is what an overloaded
    // corral turns away; fills go on (`overload`).
    if crate::overload::shedding() {
        crate::telemetry::metrics::overload_shed("pass");
        return crate::http::refusal::overloaded(fwd);
    }
    let slot = match route.origin.upstream.slot().await {
        Ok(s) => s,
        Err(e) => return busy(fwd, &e),
    };
    let within = route.origin.upstream.queue_timeout;
    let Some(descriptor) = crate::origin::descriptors::take(own, within).await else {
        tracing::debug!(route = %route.name, "no upstream socket free for a passed-through request: every client connection's own and the overflow are in use");
        return busy(fwd, &UpstreamError::Busy(within));
    };
    let bodyless = head.body == RequestBody::None;
    let descriptor = Arc::new(descriptor);
    let body = if bodyless {
        Body::empty()
    } else {
        // The socket stays busy while the client's body is still sent.
        Body::new(crate::origin::descriptors::Counted::new(
            body,
            Arc::clone(&descriptor),
        ))
    };
    let target = head.path_and_query();
    let asked = OriginRequest {
        method: head.method.clone(),
        target: &target,
        headers: head.headers.clone(),
        body,
        framing: head.body,
        retry: bodyless,
        interim,
        held: Held {
            slot,
            descriptor: Some(descriptor),
        },
    };
    let transport = app.cache.transport.as_ref();
    let Answered {
        parts,
        body,
        deadline,
        ..
    } = match exchange(transport, &route.origin.upstream, head, asked).await {
        Ok(a) => a,
        Err(e @ UpstreamError::Request(_)) => {
            return respond::error(StatusCode::BAD_REQUEST, fwd, e.detail(), None);
        }
        Err(e) => {
            tracing::warn!(route = %route.name, upstream = %route.origin.upstream.authority, error = %e, "upstream failed");
            return respond::error(e.status(), fwd, e.detail(), e.received_status());
        }
    };
    if !corral_core::semantics::head::is_safe(&head.method)
        && (parts.status.is_success() || parts.status.is_redirection())
    {
        crate::cache::invalidate::after_write(
            &app.cache,
            &app.routes(),
            route,
            head,
            &parts.headers,
        )
        .await;
    }
    let mut st = CacheStatus::forward(fwd).with_fwd_status(parts.status.as_u16());
    st.detail = detail;
    // Read ahead of a slow client: the exchange (its slot and socket) ends
    // at the origin's pace.
    let body = Body::new(crate::origin::ahead::read_ahead(
        DeadlineBody::new(body, deadline, route.origin.upstream.total),
        route.cache.policy.max_object_size,
        &app.cache.ahead_memory,
    ));
    Answer::new(Response::from_parts(parts, body), &st, head.version)
}

/// No `upstream_concurrency` slot came free: 503, come back in a second.
fn busy(fwd: Forward, e: &UpstreamError) -> Answer {
    let mut a = respond::error(e.status(), fwd, Detail::UpstreamBusy, None);
    a.response
        .headers_mut()
        .insert(http::header::RETRY_AFTER, http::HeaderValue::from(1u64));
    a
}
