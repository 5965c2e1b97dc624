//! The upstream client: hyper-util's pooled client (keep-alive, a pool timer,
//! an idle timeout below common upstream keep-alives), per-route connect /
//! response-header / total deadlines, and one retry for idempotent,
//! body-less requests that fail on an established connection.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::{Method, Request, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::time::{Instant, Sleep};

use crate::config::TimeoutsConfig;

/// Idle pooled connections are closed after this: below Node.js's 5 s
/// default keep-alive, the shortest common one, so corral never reuses a
/// connection the upstream is about to close.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// Why an upstream exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The cause is kept whole (its chain is also the message).
    #[error("connecting to the upstream failed: {}", chain(.0.as_ref()))]
    Connect(#[source] BodyError),
    /// What went wrong, and which of the TLS failures it is.
    #[error("the upstream's TLS handshake failed: {0}")]
    Tls(String, corral_core::UpstreamFailure),
    #[error("the upstream sent no response headers within {0:?}")]
    HeaderTimeout(Duration),
    #[error("the upstream exchange exceeded its total deadline of {0:?}")]
    TotalTimeout(Duration),
    #[error("the upstream exchange failed: {}", chain(.0.as_ref()))]
    Exchange(#[source] BodyError),
    #[error("building the upstream request failed: {0}")]
    Request(String),
    #[error("the upstream answered {0}, which corral never asked for")]
    Protocol(http::StatusCode),
    #[error("no upstream_concurrency slot came free within {0:?}")]
    Busy(Duration),
    /// The body arrived whole but not as its `Content-Digest` or
    /// `Repr-Digest` says (RFC 9530).
    #[error("the upstream's body failed its integrity check: {0}")]
    Digest(corral_core::wire::digest::Mismatch),
    /// The body is in a coding its caller does not accept, and corral
    /// could not decode it for that caller.
    #[error("the upstream's body is {0}")]
    Coding(String),
}

impl UpstreamError {
    /// The status corral answers with (502 or 504).
    pub fn status(&self) -> http::StatusCode {
        match self {
            UpstreamError::HeaderTimeout(_) | UpstreamError::TotalTimeout(_) => {
                http::StatusCode::GATEWAY_TIMEOUT
            }
            UpstreamError::Busy(_) => http::StatusCode::SERVICE_UNAVAILABLE,
            _ => http::StatusCode::BAD_GATEWAY,
        }
    }

    /// The status the origin did answer with, when corral refused that
    /// answer (`Proxy-Status`'s `received-status`).
    pub fn received_status(&self) -> Option<u16> {
        match self {
            UpstreamError::Protocol(status) => Some(status.as_u16()),
            _ => None,
        }
    }

    /// The `Cache-Status` detail: how the exchange failed, or that
    /// corral's own queue was full.
    pub fn detail(&self) -> corral_core::Detail {
        use corral_core::{Detail, UpstreamFailure as F};
        Detail::Upstream(match self {
            UpstreamError::Connect(e) => connect_failure(e.as_ref()),
            UpstreamError::Tls(_, kind) => *kind,
            UpstreamError::HeaderTimeout(_) => F::Timeout,
            UpstreamError::TotalTimeout(_) => F::TotalTimeout,
            UpstreamError::Exchange(_) => F::Exchange,
            UpstreamError::Request(_) => F::Request,
            UpstreamError::Protocol(_) => F::Protocol,
            UpstreamError::Digest(_) => F::Digest,
            UpstreamError::Coding(_) => F::Coding,
            UpstreamError::Busy(_) => return Detail::UpstreamBusy,
        })
    }
}

/// How the origin framed its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    Plain,
    /// Both Content-Length and Transfer-Encoding (RFC 9112 §6.3): the
    /// Content-Length was removed and the chunked body is authoritative.
    /// Such an answer is passed on, never stored or shared.
    Conflicting,
}

/// Makes an upstream response head fit to pass on: hop-by-hop headers
/// removed, a Content-Length beside Transfer-Encoding removed (what the
/// client is told must be what it gets), a nonsensical Age dropped, the
/// `Proxy-Status` and `Cache-Status` members claiming corral's name removed. A 101
/// (or any 1xx as a final answer) is an error: corral never asks for an
/// upgrade, so an origin that switches protocols is not speaking HTTP to it.
pub fn sanitize_response(parts: &mut http::response::Parts) -> Result<Framing, UpstreamError> {
    if parts.status.is_informational() {
        return Err(UpstreamError::Protocol(parts.status));
    }
    let chunked = parts.headers.contains_key(http::header::TRANSFER_ENCODING);
    let framing = if chunked && parts.headers.contains_key(http::header::CONTENT_LENGTH) {
        parts.headers.remove(http::header::CONTENT_LENGTH);
        Framing::Conflicting
    } else {
        Framing::Plain
    };
    corral_core::semantics::hop_by_hop::strip(&mut parts.headers);
    corral_core::semantics::rfc9111::sanitize_age(&mut parts.headers);
    // An origin's (or an upstream cache's) member in corral's name would
    // pass for corral's own.
    corral_core::strip_claimed_members(&mut parts.headers);
    Ok(framing)
}

/// A route's connection pool and deadlines.
pub struct Upstream {
    route: String,
    /// The route's upstream as requests name it: its scheme, and the
    /// authority of its first server (the Host corral sends).
    pub scheme: http::uri::Scheme,
    pub authority: http::uri::Authority,
    /// `upstream_http2`: requests go out as h2 streams.
    http2: bool,
    /// The servers (one for `upstream:`), chosen per attempt.
    pub pool: std::sync::Arc<crate::origin::pool::Pool>,
    client: Client<HttpsConnector<HttpConnector>, Body>,
    pub response_headers: Duration,
    pub total: Duration,
    /// `timeouts.stale_after`: how long a fill with a stale-if-error copy
    /// keeps its callers on the origin.
    pub stale_after: Duration,
    /// `upstream_concurrency`: a slot is held from before the request is
    /// sent until its answer's body ends.
    pub slots: Option<std::sync::Arc<crate::origin::slots::UpstreamSlots>>,
    /// How long a request waits for an upstream slot or socket.
    pub queue_timeout: Duration,
}

/// What a route's upstream is made of: its servers, deadlines, TLS and
/// slots, as the route's config gives them.
pub struct UpstreamSpec<'a> {
    pub route: &'a str,
    /// The scheme and the first server's authority (the Host corral sends).
    pub scheme: http::uri::Scheme,
    pub authority: http::uri::Authority,
    pub timeouts: &'a TimeoutsConfig,
    pub pool: std::sync::Arc<crate::origin::pool::Pool>,
    pub tls: Option<&'a crate::config::tls::UpstreamTls>,
    /// `upstream_http2`.
    pub http2: bool,
    /// `upstream_concurrency`'s slots.
    pub slots: Option<std::sync::Arc<crate::origin::slots::UpstreamSlots>>,
    /// `upstream_queue_timeout`.
    pub queue_timeout: Duration,
}

impl Upstream {
    pub fn new(spec: UpstreamSpec<'_>) -> Self {
        let UpstreamSpec {
            route,
            scheme,
            authority,
            timeouts: t,
            pool,
            tls,
            http2,
            slots,
            queue_timeout,
        } = spec;
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(t.connect));
        connector.set_nodelay(true);
        connector.set_keepalive(Some(Duration::from_secs(30)));
        // https routes speak TLS (HTTP/1.1, or h2 alone by ALPN with upstream_http2), with SNI and
        // verification for the upstream's host or `tls.server_name`; an
        // http route's connector passes plain connections through.
        connector.enforce_http(false);
        let builder = hyper_rustls::HttpsConnectorBuilder::new();
        let connector = match tls {
            Some(tls) => {
                if tls.insecure_skip_verify {
                    tracing::warn!(
                        route,
                        "tls.insecure_skip_verify: the upstream's certificate is not checked; anyone on the path can impersonate it"
                    );
                }
                let b = builder.with_tls_config((*tls.config).clone()).https_only();
                let b = match &tls.server_name {
                    Some(name) => b.with_server_name_resolver(
                        hyper_rustls::FixedServerNameResolver::new(name.clone()),
                    ),
                    None => b,
                };
                if http2 {
                    // h2 only (ALPN offers nothing else), so the client knows
                    // before connecting and a burst shares one connection.
                    b.enable_http2().wrap_connector(connector)
                } else {
                    b.enable_http1().wrap_connector(connector)
                }
            }
            None => builder
                .with_tls_config(plain_only())
                .https_or_http()
                .enable_http1()
                .wrap_connector(connector),
        };
        let mut client = Client::builder(TokioExecutor::new());
        client.http2_only(http2);
        let client = client
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .pool_max_idle_per_host(512)
            .build(connector);
        Upstream {
            route: route.to_owned(),
            scheme,
            authority,
            http2,
            pool,
            client,
            response_headers: t.response_headers,
            total: t.total,
            stale_after: t.stale_after,
            slots,
            queue_timeout,
        }
    }

    /// Sends `req` and waits for the response head. `retryable` requests
    /// (idempotent, no body) are sent once more if the first attempt fails
    /// after connecting, the usual sign of a pooled connection the upstream
    /// had just closed. `deadline` bounds the whole exchange; `slot` (see
    /// [`Upstream::slot`]) is held until the answer's body ends.
    pub async fn send(
        &self,
        req: Request<Body>,
        retryable: bool,
        deadline: Instant,
        slot: Option<crate::origin::slots::Slot>,
        descriptor: Option<std::sync::Arc<crate::origin::descriptors::Permit>>,
    ) -> Result<Response<OriginBody>, UpstreamError> {
        let (res, server) = self.send_retrying(req, retryable, deadline).await?;
        let held = (self.pool.servers.len() > 1).then(|| self.pool.hold(server));
        Ok(res.map(|inner| OriginBody {
            inner: Inner::Wire(inner),
            _slot: slot,
            _descriptor: descriptor,
            _server: held,
        }))
    }

    /// Asks every server of the pool for `path` every `interval`, until
    /// the pool is dropped (a reload builds a new one): a 2xx or 3xx brings
    /// a server back, anything else counts as one of its failures.
    pub fn spawn_checks(&self, scheme: http::uri::Scheme, path: String, interval: Duration) {
        let pool = std::sync::Arc::downgrade(&self.pool);
        let client = self.client.clone();
        let within = self.response_headers;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(pool) = pool.upgrade() else { return };
                for (i, server) in pool.servers.iter().enumerate() {
                    let uri = http::Uri::builder()
                        .scheme(scheme.clone())
                        .authority(server.authority.clone())
                        .path_and_query(path.as_str())
                        .build();
                    let Ok(uri) = uri else { continue };
                    let mut req = Request::new(Body::empty());
                    *req.uri_mut() = uri;
                    let ok = matches!(
                        tokio::time::timeout(within, client.request(req)).await,
                        Ok(Ok(res)) if res.status().is_success() || res.status().is_redirection()
                    );
                    if ok {
                        pool.succeeded(i);
                    } else {
                        pool.failed(i);
                    }
                }
            }
        });
    }

    /// Waits for an `upstream_concurrency` slot (none without one); take
    /// it before starting the exchange's deadline: the wait is corral's own
    /// queue, bounded by `upstream_queue_timeout`.
    pub async fn slot(&self) -> Result<Option<crate::origin::slots::Slot>, UpstreamError> {
        match &self.slots {
            None => Ok(None),
            Some(s) => s
                .acquire()
                .await
                .map(Some)
                .map_err(|_| UpstreamError::Busy(s.queue_timeout)),
        }
    }

    async fn send_retrying(
        &self,
        req: Request<Body>,
        retryable: bool,
        deadline: Instant,
    ) -> Result<(Response<Incoming>, usize), UpstreamError> {
        let retry = if retryable {
            clone_bodyless(&req)
        } else {
            None
        };
        let first = self.pool.pick(None);
        let pooled = self.pool.servers.len() > 1;
        let e = match self.send_to(first, req, deadline).await {
            Ok(res) => return Ok((res, first)),
            Err(e) => e,
        };
        // Another server, for what failed before any byte of an answer: a
        // refused connection or TLS handshake, or an exchange that broke
        // (with one server: only the exchange, the sign of a pooled
        // connection it had just closed).
        let before_answer = match e {
            UpstreamError::Exchange(_) => true,
            UpstreamError::Connect(_) | UpstreamError::Tls(..) => pooled,
            _ => false,
        };
        match retry {
            Some(again) if before_answer => {
                let second = self.pool.pick(Some(first));
                tracing::debug!(error = %e, server = %self.pool.servers[second].authority, "retrying an idempotent request once");
                self.send_to(second, again, deadline)
                    .await
                    .map(|res| (res, second))
            }
            _ => Err(e),
        }
    }

    /// One attempt on server `i` of the pool: its authority in the target
    /// (and in Host, where Host was the route's), its health updated.
    async fn send_to(
        &self,
        i: usize,
        mut req: Request<Body>,
        deadline: Instant,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let server = &self.pool.servers[i];
        if i > 0 {
            let mut parts = req.uri().clone().into_parts();
            parts.authority = Some(server.authority.clone());
            if let Ok(uri) = http::Uri::from_parts(parts) {
                *req.uri_mut() = uri;
            }
            let first = self.pool.servers[0].authority.as_str();
            if req
                .headers()
                .get(http::header::HOST)
                .is_some_and(|h| h.as_bytes() == first.as_bytes())
                && let Ok(v) = http::HeaderValue::from_str(server.authority.as_str())
            {
                req.headers_mut().insert(http::header::HOST, v);
            }
        }
        if self.http2 {
            // h2 carries the host as :authority (from the target, which is
            // the same authority); a Host field beside it is a duplicate
            // host to servers such as nginx, which answer 400.
            req.headers_mut().remove(http::header::HOST);
        }
        let _outstanding = self.pool.outstanding(i);
        let r = self.send_once(req, deadline).await;
        match &r {
            Ok(_) => self.pool.succeeded(i),
            Err(
                UpstreamError::Connect(_)
                | UpstreamError::Tls(..)
                | UpstreamError::Exchange(_)
                | UpstreamError::HeaderTimeout(_)
                | UpstreamError::TotalTimeout(_),
            ) => self.pool.failed(i),
            Err(_) => {}
        }
        r
    }

    async fn send_once(
        &self,
        req: Request<Body>,
        deadline: Instant,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let started = Instant::now();
        let head_deadline = (started + self.response_headers).min(deadline);
        let r = tokio::time::timeout_at(head_deadline, self.client.request(req)).await;
        let status = match &r {
            Ok(Ok(res)) => Some(res.status().as_u16()),
            _ => None,
        };
        crate::telemetry::metrics::origin_fetch(&self.route, status, started.elapsed());
        match r {
            Err(_) if head_deadline == deadline => Err(UpstreamError::TotalTimeout(self.total)),
            Err(_) => Err(UpstreamError::HeaderTimeout(self.response_headers)),
            Ok(Ok(res)) => Ok(res),
            Ok(Err(e)) if e.is_connect() => match tls_failure(&e) {
                Some((why, kind)) => Err(UpstreamError::Tls(why, kind)),
                None => Err(UpstreamError::Connect(e.into())),
            },
            // TLS 1.3 servers refuse a client certificate after the
            // handshake, so that shows up here, on the first read.
            Ok(Err(e)) => match tls_failure(&e) {
                Some((why, kind)) => Err(UpstreamError::Tls(why, kind)),
                None => Err(UpstreamError::Exchange(e.into())),
            },
        }
    }
}

fn clone_bodyless(req: &Request<Body>) -> Option<Request<Body>> {
    let idempotent = matches!(
        *req.method(),
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE | Method::TRACE
    );
    if !idempotent || req.body().size_hint().exact() != Some(0) {
        return None;
    }
    // `DELETE` with `X-HTTP-Method-Override: POST` is a POST to many
    // frameworks: never sent twice.
    if corral_core::semantics::head::METHOD_OVERRIDE
        .iter()
        .any(|h| req.headers().contains_key(*h))
    {
        return None;
    }
    let mut b = Request::builder()
        .method(req.method().clone())
        .uri(req.uri().clone())
        .version(req.version());
    if let Some(h) = b.headers_mut() {
        *h = req.headers().clone();
    }
    b.body(Body::empty()).ok()
}

/// A TLS config for an http:// route's connector, which never uses it
/// (plain connections pass through): no roots, so nothing would verify.
fn plain_only() -> rustls::ClientConfig {
    rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map(|b| {
        b.with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth()
    })
    .unwrap_or_else(|_| unreachable_config())
}

#[cold]
fn unreachable_config() -> rustls::ClientConfig {
    // ring's default provider supports the safe default versions.
    rustls::ClientConfig::builder()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth()
}

/// The rustls error behind a connect failure, said plainly: a wrong CA,
/// a name the certificate does not carry, an expired certificate, a
/// client certificate the upstream refused.
fn tls_failure(
    e: &(dyn std::error::Error + 'static),
) -> Option<(String, corral_core::UpstreamFailure)> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        // io::Error's own `source` skips what it wraps (and hyper-rustls
        // wraps tokio-rustls's io::Error in another): look inside.
        let mut inner = err;
        loop {
            if let Some(t) = inner.downcast_ref::<rustls::Error>() {
                use corral_core::UpstreamFailure as F;
                let kind = match t {
                    rustls::Error::InvalidCertificate(_)
                    | rustls::Error::NoCertificatesPresented => F::TlsCertificate,
                    rustls::Error::AlertReceived(_) => F::TlsAlert,
                    _ => F::Tls,
                };
                return Some((t.to_string(), kind));
            }
            match inner
                .downcast_ref::<std::io::Error>()
                .and_then(std::io::Error::get_ref)
            {
                Some(wrapped) => inner = wrapped,
                None => break,
            }
        }
        cur = err.source();
    }
    None
}

/// Which connect failure `e` is: refused, timed out, or another (a name
/// that does not resolve, a network that cannot be reached), read from
/// the first I/O error in its chain.
fn connect_failure(e: &(dyn std::error::Error + 'static)) -> corral_core::UpstreamFailure {
    use corral_core::UpstreamFailure as F;
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            match io.kind() {
                std::io::ErrorKind::ConnectionRefused => return F::ConnectRefused,
                std::io::ErrorKind::TimedOut => return F::ConnectTimeout,
                _ => {}
            }
        }
        cur = err.source();
    }
    F::Connect
}

/// An error and its sources, as one line: what a log line needs.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// What an answer's body errors with.
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// An upstream answer's body, holding the route's concurrency slot (if
/// any) until it ends or is dropped.
pub struct OriginBody {
    inner: Inner,
    _slot: Option<crate::origin::slots::Slot>,
    /// The upstream socket counted for a passed-through exchange.
    _descriptor: Option<std::sync::Arc<crate::origin::descriptors::Permit>>,
    /// Counts the request as outstanding to its server (least_outstanding).
    _server: Option<crate::origin::pool::OwnedOutstanding>,
}

/// Where the bytes come from: the upstream connection, or (a transport
/// other than the network: unit tests script one) any body.
enum Inner {
    Wire(Incoming),
    #[cfg(test)]
    Other(Body),
}

#[cfg(test)]
impl OriginBody {
    /// An answer's body that did not come off an upstream connection (a
    /// scripted [`Transport`](crate::origin::exchange::Transport)'s),
    /// holding `slot` like a real one.
    pub fn other(body: Body, slot: Option<crate::origin::slots::Slot>) -> Self {
        OriginBody {
            inner: Inner::Other(body),
            _slot: slot,
            _descriptor: None,
            _server: None,
        }
    }
}

impl HttpBody for OriginBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let r = match &mut self.inner {
            Inner::Wire(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
            #[cfg(test)]
            Inner::Other(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
        };
        if let Poll::Ready(None | Some(Err(_))) = &r {
            // Ended: the upstream request is no longer outstanding.
            self._slot = None;
            self._server = None;
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Wire(b) => b.is_end_stream(),
            #[cfg(test)]
            Inner::Other(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Wire(b) => b.size_hint(),
            #[cfg(test)]
            Inner::Other(b) => b.size_hint(),
        }
    }
}

/// A response body that fails once the exchange's total deadline passes, so
/// a stalled upstream cannot hold a client forever.
pub struct DeadlineBody {
    inner: OriginBody,
    sleep: Pin<Box<Sleep>>,
    total: Duration,
}

impl DeadlineBody {
    pub fn new(inner: OriginBody, deadline: Instant, total: Duration) -> Self {
        DeadlineBody {
            inner,
            sleep: Box::pin(tokio::time::sleep_until(deadline)),
            total,
        }
    }
}

impl HttpBody for DeadlineBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.sleep.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err(Box::new(UpstreamError::TotalTimeout(self.total)))));
        }
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error with a cause, as hyper's are.
    #[derive(Debug, thiserror::Error)]
    #[error("error trying to connect")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn an_upstream_failure_keeps_its_cause_and_says_the_whole_chain() {
        let cause = Outer(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "connection refused",
        ));
        let e = UpstreamError::Connect(Box::new(cause));
        assert_eq!(
            e.to_string(),
            "connecting to the upstream failed: error trying to connect: connection refused"
        );
        let source = std::error::Error::source(&e).expect("the cause is kept");
        assert!(source.downcast_ref::<Outer>().is_some());
        // Refused, read from the I/O error in the chain: Proxy-Status
        // says `connection_refused`, Cache-Status the connect error.
        let detail = e.detail();
        assert_eq!(
            detail,
            corral_core::Detail::Upstream(corral_core::UpstreamFailure::ConnectRefused)
        );
        assert_eq!(detail.as_str(), "upstream-connect-error");
        assert_eq!(detail.proxy_error(), "connection_refused");
        for (kind, failure) in [
            (
                std::io::ErrorKind::TimedOut,
                corral_core::UpstreamFailure::ConnectTimeout,
            ),
            (
                std::io::ErrorKind::NotFound,
                corral_core::UpstreamFailure::Connect,
            ),
        ] {
            let e = UpstreamError::Connect(Box::new(Outer(std::io::Error::new(kind, "x"))));
            assert_eq!(
                e.detail(),
                corral_core::Detail::Upstream(failure),
                "{kind:?}"
            );
        }
    }
}
