//! The life of one accepted connection, from accept to close, for the
//! client and the admin listener alike. Every connection has a deadline at
//! every moment: the first request head must arrive within
//! `header_read_timeout` of the accept (HTTP/1 or the HTTP/2 preface and a
//! request, so a socket that sends nothing, or only the preface, is closed),
//! on HTTP/1 every later head within `header_read_timeout` of the last
//! answer, a connection with no request in progress closes after
//! `idle_timeout`,
//! a write the client does not read for `send_timeout` closes it, and a
//! connection whose requests are mostly abandoned by the client (HTTP/2
//! rapid reset) is closed. On the client listener connections are counted
//! by a semaphore permit taken before accept, so past the limit corral stops
//! accepting and the kernel queues: nothing is refused, nothing spins. A
//! listener that must stay reachable to some callers whatever others do
//! (the admin and health listeners, which health probes read) instead
//! accepts at once and closes what is past its limit or past its peer's
//! share (`per_peer`), so no connection waits behind silent ones.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use bytes::Bytes;
use corral_core::wire::proxy_protocol::{self, Header, Parsed};
use http::{Request, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::time::Instant;
use tower::ServiceExt;

use crate::cache::respond::Wire;
use crate::http::client_stream::{ClientStream, Writes};
use crate::http::on_wake::OnWake;
use crate::http::peer_cap::{PeerCap, PeerSlot};

/// Abandoned requests a connection may have before its abandon rate counts.
const ABANDON_FLOOR: usize = 64;
/// How long a connection told to close (idle, drain) may take to finish.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// The deadlines and the limit of one listener.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub send_timeout: Duration,
    /// Bytes a second a client must take while writes wait on it; 0: none.
    pub min_send_rate: u64,
    pub max_connections: usize,
    /// Each connection opens with a PROXY protocol header, read (within
    /// `header_read_timeout`) before HTTP; its address is the peer.
    pub proxy_protocol: bool,
    /// A connection accepted while corral is overloaded is only told to
    /// come back later (`overload`); the admin listener never is.
    pub shed_when_overloaded: bool,
    /// HTTP/1.1's GET and HEAD without a body are served by `h1`, reading
    /// up to this many bytes of a head, until the first request it does
    /// not take hands the connection to hyper; 0: hyper serves it all.
    pub h1_buffer: usize,
    /// Connections one peer address may hold open at once; past it a new
    /// one is closed at once. 0: no cap (the client listener).
    pub per_peer: usize,
    /// Past `max_connections` a new connection is closed at once, not left
    /// queued by the kernel behind the ones being served.
    pub refuse_when_full: bool,
}

/// What one connection is doing, shared by its requests, its socket and its
/// watchdog. Times are milliseconds since the connection was accepted.
#[derive(Debug)]
pub struct Activity {
    opened: Instant,
    in_flight: AtomicUsize,
    started: AtomicUsize,
    abandoned: AtomicUsize,
    /// When the connection last had no request in progress.
    idle_since: AtomicU64,
    /// When a write began waiting for the client to read; `u64::MAX` when
    /// no write waits.
    write_blocked_since: AtomicU64,
    /// Bytes written to the client so far.
    written: AtomicU64,
    /// Writes that had to wait for the client, so far.
    stalls: AtomicU64,
    /// Wakes the watchdog when the connection turns abusive.
    alarm: tokio::sync::Notify,
    /// A request came over HTTP/2 (before one did, the connection is
    /// taken as HTTP/1).
    http2: std::sync::atomic::AtomicBool,
    /// Told to close between requests (`h1`'s graceful shutdown).
    stopping: std::sync::atomic::AtomicBool,
}

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Activity {
            opened: Instant::now(),
            in_flight: AtomicUsize::new(0),
            started: AtomicUsize::new(0),
            abandoned: AtomicUsize::new(0),
            idle_since: AtomicU64::new(0),
            write_blocked_since: AtomicU64::new(u64::MAX),
            written: AtomicU64::new(0),
            stalls: AtomicU64::new(0),
            alarm: tokio::sync::Notify::new(),
            http2: std::sync::atomic::AtomicBool::new(false),
            stopping: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// When the connection, with no request in progress, is closed: the
    /// first request head must arrive within `header_read_timeout` of the
    /// accept; on HTTP/1 each next head within `header_read_timeout` of
    /// the last answer (and never later than `idle_timeout`); an HTTP/2
    /// connection may idle for `idle_timeout`. The watchdog keeps these
    /// deadlines rather than hyper's header timer, which allocated and
    /// registered a timer for every request (about 900 instructions of a
    /// hit).
    fn quiet_deadline(&self, limits: &Limits) -> Instant {
        if self.started.load(Ordering::Relaxed) == 0 {
            return self.opened + limits.header_read_timeout;
        }
        let idle = self.at(self.idle_since.load(Ordering::Acquire));
        if self.http2.load(Ordering::Relaxed) {
            idle + limits.idle_timeout
        } else {
            idle + limits.idle_timeout.min(limits.header_read_timeout)
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX - 1)
    }

    fn at(&self, ms: u64) -> Instant {
        self.opened + Duration::from_millis(ms)
    }

    fn begin(self: &Arc<Self>) -> RequestGuard {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.started.fetch_add(1, Ordering::Relaxed);
        RequestGuard {
            activity: Arc::clone(self),
            answered: false,
        }
    }

    /// True when most requests on this connection were dropped by the
    /// client before their answer: a client opening and cancelling
    /// requests (HTTP/2 rapid reset) to make corral fetch for nobody.
    fn abusive(&self) -> bool {
        let abandoned = self.abandoned.load(Ordering::Relaxed);
        abandoned >= ABANDON_FLOOR && abandoned * 2 > self.started.load(Ordering::Relaxed)
    }
}

impl Writes for Activity {
    /// A write could not complete: the client is not reading. The
    /// watchdog is woken so that its next deadline becomes `send_timeout`
    /// from now: it may be asleep until the idle deadline, because a
    /// response whose body is all in hyper's buffer counts as answered.
    fn write_blocked(&self) {
        self.stalls.fetch_add(1, Ordering::Relaxed);
        if self.write_blocked_since.load(Ordering::Relaxed) == u64::MAX {
            self.write_blocked_since
                .store(self.now_ms(), Ordering::Relaxed);
            self.alarm.notify_one();
        }
    }

    /// A write of `n` bytes went through.
    fn write_done(&self, n: usize) {
        self.written.fetch_add(n as u64, Ordering::Relaxed);
        if self.write_blocked_since.load(Ordering::Relaxed) != u64::MAX {
            self.write_blocked_since.store(u64::MAX, Ordering::Relaxed);
        }
    }
}

/// The client's reading pace, measured by the watchdog in windows of
/// `send_timeout` (Varnish's and nginx's `send_timeout` bound one write;
/// this bounds how long a client that reads a little at a time can keep
/// an answer, and the body it pins, in progress).
#[derive(Debug, Default)]
struct Pace {
    /// The window under way: when it began, and the bytes written and the
    /// stalled writes counted then.
    window: Option<(Instant, u64, u64)>,
}

impl Pace {
    fn window_end(&self, limits: &Limits) -> Option<Instant> {
        self.window.map(|(start, _, _)| start + limits.send_timeout)
    }

    /// True when, over the last whole window, writes waited on the client
    /// and it took fewer than `min_send_rate` bytes a second, while an
    /// answer was still in progress. A window starts once a write waits.
    fn too_slow(&mut self, activity: &Activity, limits: &Limits, now: Instant) -> bool {
        if limits.min_send_rate == 0 {
            return false;
        }
        let written = activity.written.load(Ordering::Relaxed);
        let stalls = activity.stalls.load(Ordering::Relaxed);
        let busy = activity.in_flight.load(Ordering::Acquire) > 0
            || activity.write_blocked_since.load(Ordering::Relaxed) != u64::MAX;
        let Some((start, from, stalled)) = self.window else {
            if busy && stalls > 0 {
                self.window = Some((now, written, stalls));
            }
            return false;
        };
        if now < start + limits.send_timeout {
            return false;
        }
        let owed = limits.min_send_rate as f64 * limits.send_timeout.as_secs_f64();
        let slow = busy && stalls > stalled && ((written - from) as f64) < owed;
        self.window = busy.then_some((now, written, stalls));
        slow
    }
}

/// One request in progress; its end (answer sent, or the client gone)
/// makes the connection idle again when it was the last.
struct RequestGuard {
    activity: Arc<Activity>,
    answered: bool,
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if !self.answered {
            self.activity.abandoned.fetch_add(1, Ordering::Relaxed);
            if self.activity.abusive() {
                self.activity.alarm.notify_one();
            }
        }
        if self.activity.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            let now = self.activity.now_ms();
            self.activity.idle_since.store(now, Ordering::Release);
        }
    }
}

/// A response body that keeps its request counted as in progress until the
/// body has been sent (or dropped).
pub struct TrackedBody {
    inner: Inner,
    _guard: RequestGuard,
}

enum Inner {
    Body(Body),
    /// A hit the HTTP/1.1 loop writes from the entry's head bytes; as a
    /// body, the entry's, once (`true`: sent).
    Wire(Box<Wire>, bool),
}

impl TrackedBody {
    /// The hit to write from its entry's head bytes, if this is one.
    pub fn wire(&self) -> Option<&Wire> {
        match &self.inner {
            Inner::Wire(w, _) => Some(w),
            Inner::Body(_) => None,
        }
    }
}

impl HttpBody for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match &mut self.inner {
            Inner::Body(b) => Pin::new(b).poll_frame(cx),
            Inner::Wire(w, sent) => {
                if std::mem::replace(sent, true) || w.body().is_empty() {
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Ok(Frame::data(w.body().clone()))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Body(b) => b.is_end_stream(),
            Inner::Wire(w, sent) => *sent || w.body().is_empty(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Body(b) => b.size_hint(),
            Inner::Wire(w, sent) => {
                SizeHint::with_exact(if *sent { 0 } else { w.body().len() as u64 })
            }
        }
    }
}

/// A handler's answer: a response, or (to a [`Peer`] that takes it) a hit
/// written from its entry's head bytes.
pub enum Reply {
    Response(Response<Body>),
    Wire(Box<Wire>),
}

/// Who sent a request, for its handler: the connection's peer, and the
/// channel for the origin's interim answers when the client can take them.
#[derive(Clone, Debug)]
pub struct Peer {
    pub addr: SocketAddr,
    pub interim: Option<crate::origin::interim::Sender>,
    /// The request came over `listen_tls`.
    pub tls: bool,
    /// The connection's own upstream socket (see `origin::descriptors`).
    pub upstream: crate::origin::descriptors::Own,
    /// The connection writes a [`Reply::Wire`] itself (the HTTP/1.1 loop);
    /// to any other, a handler answers with a response.
    pub wire: bool,
}

/// What a listener hands each request to, with who sent it. The client
/// listener calls the proxy's one handler directly (no router: it has one
/// route, and routing, the extension map and axum's futures cost every
/// hit about a thousand instructions); the admin listener keeps an axum
/// `Router`, which reads the peer as `ConnectInfo<Peer>`.
pub trait Handler: Clone + Send + Sync + 'static {
    fn call(&self, req: Request<Body>, peer: Peer) -> impl Future<Output = Reply> + Send + 'static;
}

impl Handler for Router {
    fn call(
        &self,
        mut req: Request<Body>,
        peer: Peer,
    ) -> impl Future<Output = Reply> + Send + 'static {
        req.extensions_mut().insert(ConnectInfo(peer));
        let router = self.clone();
        async move {
            match router.oneshot(req).await {
                Ok(res) => Reply::Response(res),
                Err(never) => match never {},
            }
        }
    }
}

/// The handler as a hyper service that counts each request on `activity`.
#[derive(Clone)]
struct Tracked<H> {
    handler: H,
    activity: Arc<Activity>,
    peer: SocketAddr,
    /// The connection's interim channel (see `interim.rs`).
    interim: Arc<crate::origin::interim::Shared>,
    /// The connection is TLS (`listen_tls`).
    tls: bool,
    upstream: crate::origin::descriptors::Own,
    /// Accepted while overloaded: every request gets the 503 of
    /// `refusal::overloaded_connection`, and the connection closes after it.
    shed: bool,
}

impl<H: Handler> Tracked<H> {
    /// The handler's answer to `req`, counted on the connection as the
    /// request `guard` began, which it keeps until its body is sent.
    /// `wire`: the connection writes a [`Reply::Wire`] itself.
    /// `interim`: where the origin's 1xx answers go, if the client takes
    /// them.
    fn answered(
        &self,
        req: Request<Body>,
        mut guard: RequestGuard,
        wire: bool,
        interim: Option<crate::origin::interim::Sender>,
    ) -> impl Future<Output = Response<TrackedBody>> + Send + 'static {
        let answer = self.handler.call(
            req,
            Peer {
                addr: self.peer,
                interim: interim.clone(),
                tls: self.tls,
                upstream: self.upstream.clone(),
                wire,
            },
        );
        async move {
            if let Some(interim) = &interim {
                interim.begin().await;
            }
            let res = answer.await;
            if let Some(interim) = interim {
                interim.finish().await;
            }
            guard.answered = true;
            match res {
                Reply::Wire(w) if wire => {
                    let status = w.status();
                    let mut res = Response::new(TrackedBody {
                        inner: Inner::Wire(w, false),
                        _guard: guard,
                    });
                    *res.status_mut() = status;
                    res
                }
                // Not asked for: the same answer with its header map.
                Reply::Wire(w) => w.into_response().map(|inner| TrackedBody {
                    inner: Inner::Body(inner),
                    _guard: guard,
                }),
                Reply::Response(res) => res.map(|inner| TrackedBody {
                    inner: Inner::Body(inner),
                    _guard: guard,
                }),
            }
        }
    }
}

impl<H: Handler> Tracked<H> {
    /// The interim channel of an HTTP/1 request: 1xx answers go to
    /// HTTP/1.1 clients only (RFC 9110 §15.2).
    fn http1_interim(&self, req: &Request<Body>) -> Option<crate::origin::interim::Sender> {
        (req.version() == http::Version::HTTP_11)
            .then(|| crate::origin::interim::Sender::open(&self.interim))
    }

    /// Counts a request on the connection: its guard, or, on a connection
    /// accepted while overloaded, the answer it gets instead (not routed,
    /// not read: it costs its parse and the short answer; HTTP/1 closes
    /// after it, the watchdog sends an HTTP/2 connection its GOAWAY).
    fn start(&self, version: http::Version) -> Result<RequestGuard, Box<Response<TrackedBody>>> {
        let mut guard = self.activity.begin();
        let http2 = version == http::Version::HTTP_2;
        if http2 {
            self.activity.http2.store(true, Ordering::Relaxed);
        }
        if !self.shed {
            return Ok(guard);
        }
        let res = crate::http::refusal::overloaded_connection(!http2);
        guard.answered = true;
        self.activity.alarm.notify_one();
        Err(Box::new(res.map(|inner| TrackedBody {
            inner: Inner::Body(inner),
            _guard: guard,
        })))
    }
}

impl<H: Handler> crate::http::http2::Streams for Tracked<H> {
    type Body = TrackedBody;

    fn answer(
        &self,
        req: Request<Body>,
        interim: crate::origin::interim::Sender,
    ) -> impl Future<Output = Response<TrackedBody>> + Send + 'static {
        let answer = self
            .start(http::Version::HTTP_2)
            .map(|guard| self.answered(req, guard, false, Some(interim)));
        async move {
            match answer {
                Ok(answer) => answer.await,
                Err(shed) => *shed,
            }
        }
    }
}

impl<H: Handler> crate::http::h1::Answers for Tracked<H> {
    type Body = TrackedBody;

    fn answer(
        &self,
        req: Request<Body>,
    ) -> impl Future<Output = Response<TrackedBody>> + Send + 'static {
        let interim = self.http1_interim(&req);
        self.answered(req, self.activity.begin(), true, interim)
    }

    fn wire(body: &TrackedBody) -> Option<&Wire> {
        body.wire()
    }

    fn stopping(&self) -> &std::sync::atomic::AtomicBool {
        &self.activity.stopping
    }
}

impl<H: Handler> hyper::service::Service<Request<Incoming>> for Tracked<H> {
    type Response = Response<TrackedBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let guard = match self.start(req.version()) {
            Ok(guard) => guard,
            Err(shed) => return Box::pin(async move { Ok(*shed) }),
        };
        let req = req.map(Body::new);
        let interim = self.http1_interim(&req);
        let answer = self.answered(req, guard, false, interim);
        Box::pin(async move { Ok(answer.await) })
    }
}

/// How a listener serves HTTP/1.1 (hyper, past `h1`'s loop) and HTTP/2
/// (`http2`, told apart by the client's preface).
#[derive(Clone)]
pub struct Protocols {
    http1: auto::Builder<TokioExecutor>,
    http2: crate::http::http2::Settings,
}

/// The HTTP/1.1 and HTTP/2 settings every connection of a listener gets.
pub fn protocols(limits: &Limits, max_header_size: u64, buffer: u64) -> Protocols {
    // hyper never sees an HTTP/2 preface: `serve_http` sends those to
    // `http2`, so hyper is told not to look for one.
    let mut builder = auto::Builder::new(TokioExecutor::new()).http1_only();
    builder
        .http1()
        .timer(TokioTimer::new())
        // Every head's deadline is the watchdog's (`quiet_deadline`).
        .header_read_timeout(None)
        .max_buf_size(usize::try_from(buffer).unwrap_or(usize::MAX))
        .keep_alive(true);
    Protocols {
        http1: builder,
        http2: crate::http::http2::Settings::new(limits.idle_timeout, max_header_size),
    }
}

/// The connection slots of every listener serving, by listener name:
/// what the operator's views count against `max_connections`.
static LISTENERS: std::sync::Mutex<Vec<(&'static str, std::sync::Weak<Semaphore>, usize)>> =
    std::sync::Mutex::new(Vec::new());

fn register(name: &'static str, slots: &Arc<Semaphore>, max: usize) {
    let mut all = LISTENERS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    all.retain(|(_, s, _)| s.strong_count() > 0);
    if !all.iter().any(|(_, s, _)| s.as_ptr() == Arc::as_ptr(slots)) {
        all.push((name, Arc::downgrade(slots), max));
    }
}

/// Connections open now and the most allowed, per listener name (the
/// listeners that share one limit counted once).
pub fn open_connections() -> Vec<(&'static str, usize, usize)> {
    let all = LISTENERS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut out: Vec<(&'static str, usize, usize)> = Vec::new();
    for (name, slots, max) in all.iter() {
        let Some(slots) = slots.upgrade() else {
            continue;
        };
        let used = max.saturating_sub(slots.available_permits());
        match out.iter_mut().find(|(n, _, _)| n == name) {
            Some(row) => {
                row.1 += used;
                row.2 += max;
            }
            None => out.push((name, used, *max)),
        }
    }
    out
}

/// Accepts on `listener` until `shutdown` turns true, serving each
/// connection with `handler` under `limits`; then tells every open
/// connection to finish and waits up to `grace` for them.
pub async fn serve<H: Handler>(
    name: &'static str,
    listener: TcpListener,
    handler: H,
    protocols: Protocols,
    limits: Limits,
    shutdown: watch::Receiver<bool>,
    grace: Duration,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let serving = Serving {
        protocols,
        limits,
        shutdown,
        grace,
        slots,
    };
    serve_on(name, listener, handler, serving, None).await;
}

/// How one listener's connections are served: the protocols it speaks, the
/// deadlines and limits, the shutdown signal and its grace, and the
/// connection slots (shared by the listeners of one limit).
#[derive(Clone)]
pub struct Serving {
    pub protocols: Protocols,
    pub limits: Limits,
    pub shutdown: watch::Receiver<bool>,
    pub grace: Duration,
    pub slots: Arc<Semaphore>,
}

/// [`serve`] with the connection slots given (shared by the listeners of
/// one limit) and, with `tls`, a TLS handshake (within
/// `header_read_timeout`) before HTTP.
pub async fn serve_on<H: Handler>(
    name: &'static str,
    listener: TcpListener,
    handler: H,
    serving: Serving,
    tls: Option<Arc<crate::http::tls::ListenerTls>>,
) {
    #[rustfmt::skip]
    let Serving { protocols, limits, mut shutdown, grace, slots } = serving;
    let protocols = Arc::new(protocols);
    register(name, &slots, limits.max_connections);
    let peers = (limits.per_peer > 0).then(|| PeerCap::new(limits.per_peer));
    loop {
        let (stream, peer, queued) =
            match accept(name, &listener, &slots, &limits, &mut shutdown).await {
                Accepted::Connection(stream, peer, queued) => (stream, peer, queued),
                Accepted::Failed => continue,
                Accepted::Shutdown => break,
            };
        let _ = stream.set_nodelay(true);
        crate::telemetry::metrics::connection_accepted();
        let Some((permit, peer_slot)) = admit(name, queued, &slots, peers.as_ref(), peer) else {
            // Dropping the stream closes it: its caller learns at once.
            continue;
        };
        let shed = limits.shed_when_overloaded && crate::overload::shedding();
        if shed {
            crate::telemetry::metrics::overload_shed("connection");
        }
        let activity = Activity::new();
        let handler = handler.clone();
        let protocols = Arc::clone(&protocols);
        let shutdown = shutdown.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let mut stream = stream;
            let Some((peer, prefix)) = client_of(name, &mut stream, peer, &limits).await else {
                drop(permit);
                return;
            };
            let interim = crate::origin::interim::Shared::new();
            let service = Tracked {
                handler,
                activity: Arc::clone(&activity),
                peer,
                interim: Arc::clone(&interim),
                tls: tls.is_some(),
                upstream: crate::origin::descriptors::Own::new(),
                shed,
            };
            let client = crate::http::client_stream::Rewind::new(
                prefix,
                ClientStream::new(stream, Arc::clone(&activity)),
            );
            match tls {
                None => {
                    let io = crate::origin::interim::InterimIo::new(client, interim);
                    serve_http(io, service, &protocols, &activity, &limits, shutdown).await;
                }
                Some(tls) => {
                    let accepted = tokio::time::timeout(
                        limits.header_read_timeout,
                        tls.acceptor().accept(client),
                    )
                    .await;
                    match accepted {
                        Ok(Ok(stream)) => {
                            let io = crate::origin::interim::InterimIo::new(stream, interim);
                            serve_http(io, service, &protocols, &activity, &limits, shutdown).await;
                        }
                        Ok(Err(e)) => {
                            crate::telemetry::metrics::connection_closed("tls-handshake");
                            tracing::debug!(listener = name, %peer, error = %e, "TLS handshake failed");
                        }
                        Err(_) => {
                            crate::telemetry::metrics::connection_closed("tls-handshake");
                            tracing::debug!(listener = name, %peer, "no TLS handshake within header_read_timeout");
                        }
                    }
                }
            }
            drop(permit);
            drop(peer_slot);
            tracing::trace!(listener = name, %peer, "connection closed");
        });
    }
    drop(listener);
    // Every connection holds a permit until it closes: all permits back
    // means all connections drained.
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    tokio::select! {
        _ = slots.acquire_many(all) => tracing::info!("all {name} connections drained"),
        _ = tokio::time::sleep(grace) => {
            tracing::warn!(listener = name, grace = ?grace, "shutdown grace elapsed with connections still open");
        }
    }
}

/// What [`accept`] got.
enum Accepted {
    /// A connection, and the slot taken for it before accept (queueing
    /// listeners).
    Connection(
        tokio::net::TcpStream,
        SocketAddr,
        Option<tokio::sync::OwnedSemaphorePermit>,
    ),
    /// Accept failed (out of descriptors and the like), after a short
    /// pause rather than a spin.
    Failed,
    Shutdown,
}

/// The next connection. Queueing listeners take their slot before accept,
/// so past the limit the kernel holds new connections; refusing ones take
/// it after, and close what finds none (see `admit`).
async fn accept(
    name: &'static str,
    listener: &TcpListener,
    slots: &Arc<Semaphore>,
    limits: &Limits,
    shutdown: &mut watch::Receiver<bool>,
) -> Accepted {
    let queued = if limits.refuse_when_full {
        None
    } else {
        tokio::select! {
            p = Arc::clone(slots).acquire_owned() => match p {
                Ok(p) => Some(p),
                Err(_) => return Accepted::Shutdown,
            },
            _ = shutdown.changed() => return Accepted::Shutdown,
        }
    };
    tokio::select! {
        accepted = listener.accept() => match accepted {
            Ok((stream, peer)) => Accepted::Connection(stream, peer, queued),
            Err(e) => {
                tracing::warn!(listener = name, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
                Accepted::Failed
            }
        },
        _ = shutdown.changed() => Accepted::Shutdown,
    }
}

/// The client a connection from `peer` speaks for, and the bytes read
/// past its PROXY protocol header: the header's source on a listener
/// with `proxy_protocol` (read within `header_read_timeout`), else the
/// peer itself. `None`: no valid header; the connection is to be closed.
async fn client_of(
    name: &'static str,
    stream: &mut tokio::net::TcpStream,
    peer: SocketAddr,
    limits: &Limits,
) -> Option<(SocketAddr, Bytes)> {
    if !limits.proxy_protocol {
        return Some((peer, Bytes::new()));
    }
    let header = tokio::time::timeout(limits.header_read_timeout, read_proxy_header(stream))
        .await
        .unwrap_or(Err("no complete header within header_read_timeout"));
    match header {
        Ok((Header::Proxied(client), rest)) => Some((client, rest)),
        Ok((Header::Local, rest)) => Some((peer, rest)),
        Err(why) => {
            crate::telemetry::metrics::connection_closed("proxy-protocol");
            tracing::debug!(listener = name, %peer, why, "closing a connection without a valid PROXY protocol header");
            None
        }
    }
}

/// The listener slot and the peer's share an accepted connection from
/// `peer` is served under: the slot taken before accept (`queued`), else
/// one free now; and a place in the peer's share where shares are capped.
/// `None`: the connection is closed at once, counted by why.
fn admit(
    name: &'static str,
    queued: Option<tokio::sync::OwnedSemaphorePermit>,
    slots: &Arc<Semaphore>,
    peers: Option<&Arc<PeerCap>>,
    peer: SocketAddr,
) -> Option<(tokio::sync::OwnedSemaphorePermit, Option<PeerSlot>)> {
    // The peer's share first, so a caller past its share does not take
    // a slot from the listener, not even for a moment.
    let peer_slot = match peers {
        None => None,
        Some(peers) => match peers.admit(peer.ip()) {
            Some(s) => Some(s),
            None => {
                crate::telemetry::metrics::connection_closed("peer-limit");
                tracing::debug!(listener = name, %peer, "closing a connection past its address's share");
                return None;
            }
        },
    };
    let permit = match queued {
        Some(p) => p,
        None => match Arc::clone(slots).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                crate::telemetry::metrics::connection_closed("listener-full");
                tracing::debug!(listener = name, %peer, "closing a connection past the listener's limit");
                return None;
            }
        },
    };
    Some((permit, peer_slot))
}

/// Reads a PROXY protocol header off `stream`: what it says, and the bytes
/// read past it (the start of the HTTP request).
async fn read_proxy_header(stream: &mut TcpStream) -> Result<(Header, Bytes), &'static str> {
    use tokio::io::AsyncReadExt;
    let mut buf = bytes::BytesMut::with_capacity(512);
    loop {
        match proxy_protocol::parse(&buf) {
            Parsed::Done(header, n) => return Ok((header, buf.split_off(n).freeze())),
            Parsed::Invalid(why) => return Err(why),
            Parsed::Incomplete => {}
        }
        buf.reserve(512);
        match stream.read_buf(&mut buf).await {
            Ok(0) => return Err("closed before a complete header"),
            Ok(_) => {}
            Err(_) => return Err("the connection failed before a complete header"),
        }
    }
}

/// One connection's HTTP: its HTTP/1.1 GETs and HEADs by `h1` while they
/// come (unless the listener has no `h1_buffer` or the connection is shed),
/// then the rest, from the first byte `h1` did not answer, by `http2`
/// when it is HTTP/2's preface (TLS with ALPN h2, or h2c with prior
/// knowledge), else by hyper; each under the connection's deadlines.
async fn serve_http<I, H: Handler>(
    io: I,
    service: Tracked<H>,
    protocols: &Protocols,
    activity: &Activity,
    limits: &Limits,
    shutdown: watch::Receiver<bool>,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let shed = service.shed;
    let io = if limits.h1_buffer > 0 && !shed {
        let fast = H1 {
            serving: Box::pin(crate::http::h1::serve(
                io,
                service.clone(),
                limits.h1_buffer,
            )),
            stopping: Arc::clone(&service.activity),
        };
        match watch_over(fast, activity, limits, shutdown.clone(), shed).await {
            Some(Ok(crate::http::h1::LoopEnd::Handoff(io))) => io,
            Some(Ok(crate::http::h1::LoopEnd::Closed)) | None => return,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "connection ended with an error");
                return;
            }
        }
    } else {
        crate::http::client_stream::Rewind::new(Bytes::new(), io)
    };
    let sniff = Sniff {
        io: Some(io),
        stop: false,
    };
    let (io, http2) = match watch_over(sniff, activity, limits, shutdown.clone(), shed).await {
        Some(Some(Ok(found))) => found,
        Some(Some(Err(e))) => {
            tracing::debug!(error = %e, "connection ended with an error");
            return;
        }
        Some(None) | None => return,
    };
    if http2 {
        let conn = crate::http::http2::Connection::new(io, service, &protocols.http2);
        if let Some(Err(e)) = watch_over(conn, activity, limits, shutdown, shed).await {
            tracing::debug!(error = %e, "HTTP/2 connection ended with an error");
        }
        return;
    }
    let conn = protocols.http1.serve_connection(TokioIo::new(io), service);
    if let Some(Err(e)) = watch_over(conn, activity, limits, shutdown, shed).await {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}

/// Reads a connection's next bytes until they are, or cannot be, HTTP/2's
/// preface: the stream with them still to read, and whether they are.
/// `None` once told to stop.
struct Sniff<I> {
    io: Option<crate::http::client_stream::Rewind<I>>,
    stop: bool,
}

type Sniffed<I> = std::io::Result<(crate::http::client_stream::Rewind<I>, bool)>;

impl<I: tokio::io::AsyncRead + Unpin> Future for Sniff<I> {
    type Output = Option<Sniffed<I>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if self.stop {
            return Poll::Ready(None);
        }
        let Some(io) = self.io.as_mut() else {
            return Poll::Ready(None);
        };
        let found = std::task::ready!(io.poll_starts_with(cx, crate::http::http2::PREFACE));
        Poll::Ready(self.io.take().map(|io| found.map(|h2| (io, h2))))
    }
}

impl<I: tokio::io::AsyncRead + Unpin> Served for Sniff<I> {
    fn graceful_shutdown(mut self: Pin<&mut Self>) {
        // No request has begun: nothing to finish.
        self.stop = true;
    }
}

impl<I, H: Handler> Served for crate::http::http2::Connection<I, Tracked<H>>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    fn graceful_shutdown(mut self: Pin<&mut Self>) {
        crate::http::http2::Connection::graceful_shutdown(&mut self);
    }
}

/// A connection being served, as its watchdog drives it.
trait Served: Future {
    /// Finish the requests in progress, take no more, then end.
    fn graceful_shutdown(self: Pin<&mut Self>);
}

impl<I, H: Handler> Served for auto::Connection<'_, I, Tracked<H>, TokioExecutor>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    fn graceful_shutdown(self: Pin<&mut Self>) {
        auto::Connection::graceful_shutdown(self);
    }
}

/// `h1`'s loop over a connection, told to stop through its activity.
struct H1<F> {
    serving: Pin<Box<F>>,
    stopping: Arc<Activity>,
}

impl<F: Future> Future for H1<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        self.serving.as_mut().poll(cx)
    }
}

impl<F: Future> Served for H1<F> {
    fn graceful_shutdown(self: Pin<&mut Self>) {
        // Read at every poll of the loop, and the watchdog polls it next.
        self.stopping.stopping.store(true, Ordering::Relaxed);
    }
}

/// Drives one connection under its deadlines: its end, or `None` when the
/// watchdog ended it.
async fn watch_over<C: Served>(
    conn: C,
    activity: &Activity,
    limits: &Limits,
    mut shutdown: watch::Receiver<bool>,
    shed: bool,
) -> Option<C::Output> {
    let mut conn = std::pin::pin!(conn);
    // Once told to close, the connection has this long to finish.
    let mut closing: Option<Instant> = None;
    let mut pace = Pace::default();
    let busy_recheck = (limits.send_timeout / 4).max(Duration::from_millis(250));
    loop {
        let now = Instant::now();
        let in_flight = activity.in_flight.load(Ordering::Acquire);
        let blocked = activity.write_blocked_since.load(Ordering::Relaxed);
        let mut next = if in_flight > 0 {
            now + busy_recheck
        } else {
            activity.quiet_deadline(limits)
        };
        if blocked != u64::MAX {
            next = next.min(activity.at(blocked) + limits.send_timeout);
        }
        if let Some(hard) = closing {
            next = next.min(hard);
        }
        if let Some(end) = pace.window_end(limits) {
            next = next.min(end);
        }
        // The deadline and the signals are polled only when they woke the
        // task, not at each of the connection's reads and writes.
        let deadline = std::pin::pin!(tokio::time::sleep_until(next));
        let alarm = std::pin::pin!(activity.alarm.notified());
        let stop = std::pin::pin!(shutdown.changed());
        tokio::select! {
            r = conn.as_mut() => return Some(r),
            _ = OnWake::new(deadline) => {}
            _ = OnWake::new(alarm), if closing.is_none() => {}
            _ = OnWake::new(stop), if closing.is_none() => {
                conn.as_mut().graceful_shutdown();
                closing = Some(Instant::now() + CLOSE_GRACE.max(limits.header_read_timeout));
                continue;
            }
        }
        let now = Instant::now();
        if closing.is_some_and(|hard| now >= hard) {
            return None; // dropping the connection closes it
        }
        let blocked = activity.write_blocked_since.load(Ordering::Relaxed);
        if blocked != u64::MAX && now >= activity.at(blocked) + limits.send_timeout {
            crate::telemetry::metrics::connection_closed("send-timeout");
            tracing::debug!("closing a connection whose client read nothing for send_timeout");
            return None;
        }
        if pace.too_slow(activity, limits, now) {
            crate::telemetry::metrics::connection_closed("slow-reader");
            tracing::debug!("closing a connection whose client reads slower than min_send_rate");
            return None;
        }
        if closing.is_none() {
            let idle = activity.in_flight.load(Ordering::Acquire) == 0;
            let first = activity.started.load(Ordering::Relaxed) == 0;
            let expired = now >= activity.quiet_deadline(limits);
            let reason = if activity.abusive() {
                tracing::warn!("closing a connection whose client abandons most of its requests");
                Some("abandoned-requests")
            } else if shed && !first {
                Some("overload")
            } else if idle && expired {
                let reason = if first { "no-request" } else { "idle" };
                // No request in progress, and on HTTP/1 possibly a head
                // trickling in, which a graceful shutdown would wait
                // for: closed at once, as hyper's header timer did. An
                // HTTP/2 connection between requests gets its GOAWAY.
                if first || !activity.http2.load(Ordering::Relaxed) {
                    crate::telemetry::metrics::connection_closed(reason);
                    return None;
                }
                Some(reason)
            } else {
                None
            };
            if let Some(reason) = reason {
                crate::telemetry::metrics::connection_closed(reason);
                conn.as_mut().graceful_shutdown();
                closing = Some(now + CLOSE_GRACE);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(min_send_rate: u64) -> Limits {
        Limits {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            send_timeout: Duration::from_secs(10),
            min_send_rate,
            max_connections: 16,
            proxy_protocol: false,
            shed_when_overloaded: false,
            h1_buffer: 0,
            per_peer: 0,
            refuse_when_full: false,
        }
    }

    /// The client takes `bytes` over the next window, with writes waiting
    /// on it throughout.
    fn window(activity: &Activity, bytes: usize) {
        activity.write_blocked();
        activity.write_done(bytes);
        activity.write_blocked();
    }

    #[test]
    fn every_http1_head_has_header_read_timeout_and_http2_idles_for_idle_timeout() {
        let mut l = limits(0);
        l.header_read_timeout = Duration::from_secs(10);
        l.idle_timeout = Duration::from_secs(60);
        let a = Activity::new();
        // The first head, from the accept.
        assert_eq!(a.quiet_deadline(&l), a.opened + l.header_read_timeout);
        // Answered at 5 s: the next HTTP/1 head within 10 s of that.
        a.started.fetch_add(1, Ordering::Relaxed);
        a.idle_since.store(5000, Ordering::Release);
        assert_eq!(a.quiet_deadline(&l), a.at(5000) + l.header_read_timeout);
        // idle_timeout below header_read_timeout still bounds it.
        let mut short = l;
        short.idle_timeout = Duration::from_secs(2);
        assert_eq!(a.quiet_deadline(&short), a.at(5000) + short.idle_timeout);
        // HTTP/2 between requests: idle_timeout.
        a.http2.store(true, Ordering::Relaxed);
        assert_eq!(a.quiet_deadline(&l), a.at(5000) + l.idle_timeout);
    }

    #[test]
    fn a_client_below_min_send_rate_over_a_whole_window_is_too_slow() {
        let l = limits(4096);
        let a = Activity::new();
        a.in_flight.fetch_add(1, Ordering::AcqRel);
        let t0 = Instant::now();
        let mut pace = Pace::default();
        // The first stall opens a window; nothing is judged before its end.
        a.write_blocked();
        assert!(!pace.too_slow(&a, &l, t0));
        assert_eq!(pace.window_end(&l), Some(t0 + l.send_timeout));
        window(&a, 1024);
        assert!(!pace.too_slow(&a, &l, t0 + Duration::from_secs(5)));
        // 40 KiB in 10 s is 4 KiB/s: enough. The next window is opened.
        window(&a, 39 * 1024);
        assert!(!pace.too_slow(&a, &l, t0 + l.send_timeout));
        // 4 KiB every 2 s (the attack): 20 KiB in 10 s, too slow.
        window(&a, 20 * 1024);
        assert!(pace.too_slow(&a, &l, t0 + 2 * l.send_timeout));
    }

    #[test]
    fn a_slow_origin_a_finished_answer_or_no_minimum_is_never_too_slow() {
        let t0 = Instant::now();
        // No write waited on the client in the window: the origin is slow.
        let a = Activity::new();
        a.in_flight.fetch_add(1, Ordering::AcqRel);
        let mut pace = Pace::default();
        a.write_blocked();
        a.write_done(10);
        assert!(!pace.too_slow(&a, &limits(4096), t0));
        assert!(!pace.too_slow(&a, &limits(4096), t0 + Duration::from_secs(10)));
        // The answer is done (nothing in flight, no write waiting).
        let a = Activity::new();
        let mut pace = Pace::default();
        a.in_flight.fetch_add(1, Ordering::AcqRel);
        a.write_blocked();
        assert!(!pace.too_slow(&a, &limits(4096), t0));
        a.write_done(10);
        a.in_flight.fetch_sub(1, Ordering::AcqRel);
        assert!(!pace.too_slow(&a, &limits(4096), t0 + Duration::from_secs(10)));
        // min_send_rate: 0.
        let a = Activity::new();
        a.in_flight.fetch_add(1, Ordering::AcqRel);
        let mut pace = Pace::default();
        a.write_blocked();
        assert!(!pace.too_slow(&a, &limits(0), t0));
        window(&a, 1);
        assert!(!pace.too_slow(&a, &limits(0), t0 + Duration::from_secs(10)));
    }
}
