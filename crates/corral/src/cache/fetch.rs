//! The one exchange a fill has with the origin, and what is kept of it:
//! the upstream request (the key's target, the fill's own conditionals),
//! the policy's verdict on the answer, the body read into memory within
//! the route's and the instance's limits, and the entry stored in L1 (or
//! refreshed by a 304). This is the real [`Origin`]; the fill's gate,
//! flight and shared tier sit above it and never see a socket.

use std::sync::Arc;
use std::time::SystemTime;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use corral_core::head::RequestBody;
use corral_core::{
    Budget, Decision, Detail, Forward, PassReason, StoredResponse, Vary, merge_not_modified,
};
use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use http::header::{CONTENT_LENGTH, ETAG, LAST_MODIFIED};
use http::header::{
    IF_MATCH, IF_MODIFIED_SINCE, IF_NONE_MATCH, IF_RANGE, IF_UNMODIFIED_SINCE, RANGE,
};
use http::{HeaderMap, Method, Response, StatusCode, response};
use http_body_util::{BodyDataStream, BodyExt};
use tokio::time::Instant;

use crate::cache::fill::{Ended, FillOutcome, FillRequest, Origin, SharedResponse, failed};
use crate::cache::growing::{Growing, Writer};
use crate::cache::respond::Answer;
use crate::origin::request::upstream_request;
use crate::origin::upstream::{DeadlineBody, Framing, UpstreamError, sanitize_response};

/// The route's upstream, reached over HTTP.
pub struct UpstreamOrigin;

impl Origin for UpstreamOrigin {
    fn fetch<'a>(&'a self, fill: &'a FillRequest) -> BoxFuture<'a, Ended> {
        Box::pin(fetch_origin(fill))
    }
}

/// The exchange itself.
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
    let slot = match route.upstream.slot().await {
        Ok(s) => s,
        Err(e) => return Ended::Outcome(failed(fill, &e)),
    };
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
    // A coalesced POST is sent as it came (its body is in the key); it is
    // never made conditional and never retried.
    let (method, request_body, framing) = match &fill.body {
        Some(b) => (
            Method::POST,
            Body::from(b.clone()),
            RequestBody::Sized(b.len() as u64),
        ),
        None => (Method::GET, Body::empty(), RequestBody::None),
    };
    if let Some(stale) = stale.filter(|_| fill.body.is_none()) {
        if let Some(etag) = stale.headers().get(ETAG) {
            headers.insert(IF_NONE_MATCH, etag.clone());
        }
        if let Some(lm) = stale.headers().get(LAST_MODIFIED) {
            headers.insert(IF_MODIFIED_SINCE, lm.clone());
        }
    }
    // The target is the key's: what is stored is exactly what was asked for.
    let target = fill.primary.uri().target();
    let mut req = match upstream_request(
        route,
        head,
        method.clone(),
        target,
        headers,
        request_body,
        framing,
    ) {
        Ok(r) => r,
        Err(e) => return Ended::Outcome(failed(fill, &e)),
    };
    crate::origin::interim::forward_to(fill.interim.clone(), &mut req);
    let uri = req.uri().clone();
    let retry = fill.body.is_none();
    let res = match route.upstream.send(req, retry, deadline, slot, None).await {
        Ok(r) => r,
        Err(e) => return Ended::Outcome(failed(fill, &e)),
    };
    let response_time = app.clock.now();
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
        Framing::Plain => route.policy.evaluate(&method, &uri, &parts, response_time),
    };
    if matches!(decision, Decision::Store { .. }) {
        fill.committed
            .store(true, std::sync::atomic::Ordering::Release);
    }
    match decision {
        Decision::Store { freshness } => {
            if let Some(n) = declared {
                fill.declared.announce(n);
            }
            let vary = Vary::parse(&parts.headers);
            // Streamed to every caller as it arrives when someone waits on
            // it and its length is known and fits; else read whole first.
            // An answer that varies on what this URI was not yet known to
            // vary on is read whole too: the flight's callers were keyed
            // without it, and those of another variant must wait for the
            // stored entry to learn the Vary and coalesce on their own
            // variant, not find the stream is not theirs and fetch alone.
            let streamable = declared
                .filter(|n| *n > 0 && *n <= route.policy.max_object_size)
                .filter(|_| fill.streams())
                .filter(|_| vary == app.l1.learned_vary(&fill.primary));
            let mut hold = app.fill_memory.hold();
            // Two copies while it streams: the chunks readers share, and
            // the entry being built.
            let stream_len = streamable.filter(|n| hold.grow(n.saturating_mul(2)));
            let vary_values = vary.values(&head.headers);
            let private = freshness.sharing.keeps_private(fill.identity.as_ref());
            let entry_of = |headers: HeaderMap, body: Bytes| {
                StoredResponse::builder(status, headers, body, &freshness, response_time)
                    .fetch_duration(started.elapsed())
                    .vary(vary.clone(), vary_values.clone())
                    .generation(stamp)
                    .private(private)
                    .build()
                    .with_uri(fill.primary.uri().readable())
            };
            let (bytes, writer) = if let Some(n) = stream_len {
                let growing = Growing::new(n);
                let writer = Writer::new(&growing);
                fill.publish_early(FillOutcome::Streaming {
                    head: Arc::new(entry_of(parts.headers.clone(), Bytes::new())),
                    body: Arc::clone(&growing),
                    fwd,
                    fwd_status: Some(status.as_u16()),
                });
                match stream_into(body, &growing, n, deadline, route.upstream.total).await {
                    // The writer, dropped, aborts every reader.
                    Err(e) => return Ended::Outcome(failed(fill, &e)),
                    Ok(bytes) => (bytes, Some(writer)),
                }
            } else {
                drop(hold);
                match read_body(body, declared).await {
                    Buffered::Full(bytes) => (bytes, None),
                    Buffered::Over(reason, rest) => {
                        if reason == PassReason::TooLarge {
                            fill.mark_pass();
                        }
                        return Ended::Stream(reason, pass_response(parts, rest, fwd, reason));
                    }
                    Buffered::Failed(e) => return Ended::Outcome(failed(fill, &e)),
                }
            };
            let entry = Arc::new(entry_of(parts.headers, crate::sealed::seal_or_keep(bytes)));
            let key = fill.entry_key(&entry);
            app.l1.learn_vary(&fill.primary, &vary);
            app.l1.clear_pass(&fill.pass_scope());
            app.l1.insert(&key, fill.primary.uri(), Arc::clone(&entry));
            if let Some(writer) = writer {
                writer.finish(entry.body());
            }
            Ended::Outcome(FillOutcome::Stored {
                entry,
                fwd: Some(fwd),
                fwd_status: Some(status.as_u16()),
            })
        }
        Decision::Pass(reason)
            if (status.is_server_error() || fill.body.is_some())
                && shareable(reason, fill.body.is_some()) =>
        {
            // An error every waiter shares (without the leader's cookies),
            // not a reason to stop coalescing: the next request tries the
            // origin again. So is an answer to a coalesced POST that RFC
            // 9111 would let a shared cache keep but for the method:
            // identical in-flight POSTs of one caller share one origin
            // request. A `private` answer is the caller's own, and so is a
            // POST's `no-store` or Set-Cookie one: waiters fetch alone.
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
            let body = Body::new(crate::origin::ahead::read_ahead(
                DeadlineBody::new(body, deadline, route.upstream.total),
                route.policy.max_object_size,
                &app.ahead_memory,
            ));
            Ended::Stream(reason, pass_response(parts, body, fwd, reason))
        }
    }
}

/// True when an answer with this pass reason may be fanned out to a
/// flight's waiters: not one the origin made `private` (the caller's own),
/// not one framed ambiguously; for a coalesced `post`, not one that says
/// `no-store` or sets a cookie either. (A GET's shared 5xx loses its
/// Set-Cookie in [`SharedResponse::from_origin`]; a POST's answer is the
/// point of the request, and a cookie set with it belongs to its caller.)
fn shareable(reason: PassReason, post: bool) -> bool {
    match reason {
        PassReason::Private | PassReason::ConflictingFraming | PassReason::VaryStar => false,
        PassReason::NoStore | PassReason::SetCookie => !post,
        _ => true,
    }
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

/// Reads a body of exactly `n` bytes, handing each chunk to the readers
/// of `growing` as it arrives and building the entry's copy alongside.
async fn stream_into(
    mut body: crate::origin::upstream::OriginBody,
    growing: &Growing,
    n: u64,
    deadline: Instant,
    total: std::time::Duration,
) -> Result<Bytes, UpstreamError> {
    let mut whole = BytesMut::with_capacity(usize::try_from(n).unwrap_or(0));
    loop {
        match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return Err(UpstreamError::TotalTimeout(total)),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(UpstreamError::Exchange(e.to_string())),
            Ok(Some(Ok(frame))) => {
                let Ok(data) = frame.into_data() else {
                    continue; // trailers are not stored
                };
                if (whole.len() + data.len()) as u64 > n {
                    return Err(UpstreamError::Exchange(
                        "the body ran past its Content-Length".into(),
                    ));
                }
                // The last chunk is held back: `Writer::finish` adds it once
                // the entry is stored, so a caller that has every byte can
                // count on the next request being a hit.
                let last = (whole.len() + data.len()) as u64 == n;
                whole.extend_from_slice(&data);
                if !last {
                    growing.push(data);
                }
            }
        }
    }
    if whole.len() as u64 != n {
        return Err(UpstreamError::Exchange(
            "the body ended before its Content-Length".into(),
        ));
    }
    Ok(whole.freeze())
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
    mut body: crate::origin::upstream::OriginBody,
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
