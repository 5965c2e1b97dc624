//! The one exchange with an origin, for a cache fill and a passed-through
//! request alike: the upstream request built from the validated head
//! (`request`), the origin's interim answers routed to the caller, the
//! send over a [`Transport`], and the answer's head made fit to pass on
//! (`sanitize_response`). What the answer means (store, share, pass) is
//! the caller's business; this layer never sees the cache.
//!
//! [`Transport`] is the seam under it: the network ([`Network`], through
//! the route's pooled [`Upstream`]) in the server, a script in unit tests,
//! so that everything above (the fill's verdict, storing, stale-if-error,
//! the flight) runs as it does in production.

use std::sync::Arc;

use axum::body::Body;
use corral_core::semantics::head::{RequestBody, RequestHead};
use futures_util::future::BoxFuture;
use http::{HeaderMap, Method, Request, Response, Uri, response};
use tokio::time::Instant;

use crate::origin::descriptors::Permit;
use crate::origin::interim;
use crate::origin::request::upstream_request;
use crate::origin::slots::Slot;
use crate::origin::upstream::{Framing, OriginBody, Upstream, UpstreamError, sanitize_response};

/// Sends a built request upstream and waits for the answer's head.
pub trait Transport: Send + Sync {
    /// See [`Upstream::send`]: `retryable` requests are sent once more
    /// after a failure on an established connection; `slot` and
    /// `descriptor` are held by the answer's body until it ends.
    fn send<'a>(
        &'a self,
        upstream: &'a Upstream,
        req: Request<Body>,
        retryable: bool,
        deadline: Instant,
        held: Held,
    ) -> BoxFuture<'a, Result<Response<OriginBody>, UpstreamError>>;
}

/// What an exchange holds until its answer's body ends: the route's
/// `upstream_concurrency` slot and the upstream socket counted for a
/// passed-through request.
#[derive(Default)]
pub struct Held {
    pub slot: Option<Slot>,
    pub descriptor: Option<Arc<Permit>>,
}

/// The server's transport: the route's pooled client.
pub struct Network;

impl Transport for Network {
    fn send<'a>(
        &'a self,
        upstream: &'a Upstream,
        req: Request<Body>,
        retryable: bool,
        deadline: Instant,
        held: Held,
    ) -> BoxFuture<'a, Result<Response<OriginBody>, UpstreamError>> {
        Box::pin(upstream.send(req, retryable, deadline, held.slot, held.descriptor))
    }
}

/// What is asked of the origin.
pub struct OriginRequest<'a> {
    pub method: Method,
    /// Path and query.
    pub target: &'a str,
    /// The end-to-end headers to send (the head's, possibly edited).
    pub headers: HeaderMap,
    pub body: Body,
    pub framing: RequestBody,
    /// Idempotent and body-less: may be sent twice.
    pub retry: bool,
    /// Where the origin's 1xx answers go.
    pub interim: Option<interim::Sender>,
    pub held: Held,
}

/// The origin's answer, its head fit to pass on.
pub struct Answered {
    pub parts: response::Parts,
    pub body: OriginBody,
    pub framing: Framing,
    /// The URI the request went to (the policy reads its query).
    pub uri: Uri,
    /// When the request was sent, and when the whole exchange (body
    /// included) must be over: `started` + the route's `timeouts.total`.
    pub started: Instant,
    pub deadline: Instant,
}

/// One exchange: `asked` sent for `head` to `upstream` over `transport`.
pub async fn exchange(
    transport: &dyn Transport,
    upstream: &Upstream,
    head: &RequestHead,
    asked: OriginRequest<'_>,
) -> Result<Answered, UpstreamError> {
    let started = Instant::now();
    let deadline = started + upstream.total;
    let mut req = upstream_request(
        upstream,
        head,
        asked.method,
        asked.target,
        asked.headers,
        asked.body,
        asked.framing,
    )?;
    interim::forward_to(asked.interim, &mut req);
    let uri = req.uri().clone();
    let res = transport
        .send(upstream, req, asked.retry, deadline, asked.held)
        .await;
    if let Some(visit) = &head.visit {
        visit.record(upstream.authority.as_str(), started.elapsed());
    }
    let res = res?;
    let (mut parts, body) = res.into_parts();
    let framing = sanitize_response(&mut parts)?;
    // The answer's id is the request's, which corral sets on every answer;
    // an origin's echo would be stored and served to the next caller
    // beside that caller's own.
    parts
        .headers
        .remove(&corral_core::semantics::head::X_REQUEST_ID);
    Ok(Answered {
        parts,
        body,
        framing,
        uri,
        started,
        deadline,
    })
}
