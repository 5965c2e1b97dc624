//! The bottom layer of the miss path: what a fill keeps of its one exchange with the origin: the request
//! for a fill (the key's target, the fill's own conditionals), the answer
//! against the stale copy (stale-if-error, a 304), the policy's verdict,
//! and the body stored in L1 (streamed to the flight as it arrives, or
//! read whole within the route's and the instance's limits), shared with
//! the waiters, or passed on. The exchange itself is
//! [`origin::exchange`](crate::origin::exchange); the fill's gate, flight
//! and shared tier sit above this and never see a socket.

use std::sync::Arc;
use std::time::SystemTime;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use corral_core::head::RequestBody;
use corral_core::{
    Budget, Decision, Detail, Forward, Freshness, PassReason, StoredResponse, Vary,
    merge_not_modified,
};
use futures_util::StreamExt;
use http::header::{CONTENT_LENGTH, ETAG, LAST_MODIFIED};
use http::header::{
    IF_MATCH, IF_MODIFIED_SINCE, IF_NONE_MATCH, IF_RANGE, IF_UNMODIFIED_SINCE, RANGE,
};
use http::{HeaderMap, Method, Response, StatusCode, response};
use http_body_util::{BodyDataStream, BodyExt};
use tokio::time::Instant;

use crate::cache::fill::{
    Ended, Events, FillEvent, FillOutcome, FillRequest, SharedResponse, failed,
};
use crate::cache::growing::{Growing, Writer};
use crate::cache::respond::Answer;
use crate::origin::exchange::{Answered, Asked, Held, exchange};
use crate::origin::upstream::{DeadlineBody, Framing, OriginBody, UpstreamError};

/// The fill's exchange with the origin, and what is kept of it.
pub(crate) async fn fetch(fill: &FillRequest, events: &Events) -> Ended {
    let stale = fill.stale();
    let stamp = fill.cache.l1.generation_stamp();
    let answered = match ask(fill, stale.as_deref()).await {
        Ok(a) => a,
        Err(e) => return Ended::Outcome(failed(fill, &e)),
    };
    let response_time = fill.cache.clock.now();
    if let Some(stale) = &stale
        && let Some(ended) = against_stale(fill, stale, &answered, response_time, stamp)
    {
        return ended;
    }
    let post = fill.body.is_some();
    match verdict(fill, &answered, response_time) {
        Decision::Store { freshness } => {
            events.send(FillEvent::Committed);
            let keep = Keep::new(fill, &answered, freshness, response_time, stamp);
            store(fill, events, answered, keep).await
        }
        // An error every waiter shares (without the leader's cookies),
        // not a reason to stop coalescing: the next request tries the
        // origin again. So is an answer to a coalesced POST that RFC 9111
        // would let a shared cache keep but for the method: identical
        // in-flight POSTs of one caller share one origin request. A
        // `private` answer is the caller's own, and so is a POST's
        // `no-store` or Set-Cookie one: waiters fetch alone.
        Decision::Pass(reason)
            if (answered.parts.status.is_server_error() || post) && shareable(reason, post) =>
        {
            share(fill, answered, reason).await
        }
        Decision::Pass(reason) => pass(fill, answered, reason),
    }
}

/// Sends the fill's request: the whole representation at the key's target
/// (the client's own conditionals and ranges are answered by corral from
/// the entry), made conditional on the stale copy being refreshed. A
/// coalesced POST is sent as it came (its body is in the key); it is never
/// made conditional and never retried.
async fn ask(
    fill: &FillRequest,
    stale: Option<&StoredResponse>,
) -> Result<Answered, UpstreamError> {
    let held = Held {
        slot: fill.route.upstream.slot().await?,
        descriptor: None,
    };
    let (method, body, framing) = match &fill.body {
        Some(b) => (
            Method::POST,
            Body::from(b.clone()),
            RequestBody::Sized(b.len() as u64),
        ),
        None => (Method::GET, Body::empty(), RequestBody::None),
    };
    let asked = Asked {
        method,
        // What is stored is exactly what was asked for.
        target: fill.primary.uri().target().to_owned(),
        headers: fill_headers(&fill.head.headers, stale.filter(|_| fill.body.is_none())),
        body,
        framing,
        retry: fill.body.is_none(),
        interim: fill.interim.clone(),
        held,
    };
    let transport = fill.cache.transport.as_ref();
    exchange(transport, &fill.route.upstream, &fill.head, asked).await
}

/// The request's headers less its conditionals and ranges, plus the
/// validators of `stale` (the copy a 304 would refresh).
fn fill_headers(request: &HeaderMap, stale: Option<&StoredResponse>) -> HeaderMap {
    let mut headers = request.clone();
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
    headers
}

/// What the answer means for the stale copy in hand: a 5xx while
/// stale-if-error allows serves that copy; a 304 refreshes it. `None`:
/// the answer stands on its own.
fn against_stale(
    fill: &FillRequest,
    stale: &Arc<StoredResponse>,
    answered: &Answered,
    response_time: SystemTime,
    stamp: u64,
) -> Option<Ended> {
    let status = answered.parts.status;
    if status.is_server_error() && stale.usable_on_error(response_time) {
        return Some(Ended::Outcome(FillOutcome::Stale {
            entry: Arc::clone(stale),
            fwd_status: Some(status.as_u16()),
            detail: Detail::StaleIfError,
        }));
    }
    (status == StatusCode::NOT_MODIFIED).then(|| {
        revalidated(
            fill,
            stale,
            &answered.uri,
            &answered.parts,
            response_time,
            stamp,
        )
    })
}

/// The policy's verdict on the answer: an answer framed ambiguously is
/// never stored.
fn verdict(fill: &FillRequest, answered: &Answered, response_time: SystemTime) -> Decision {
    let method = if fill.body.is_some() {
        Method::POST
    } else {
        Method::GET
    };
    match answered.framing {
        Framing::Conflicting => Decision::Pass(PassReason::ConflictingFraming),
        Framing::Plain => {
            fill.route
                .policy
                .evaluate(&method, &answered.uri, &answered.parts, response_time)
        }
    }
}

/// What an entry is built of, besides its headers and body.
struct Keep {
    status: StatusCode,
    freshness: Freshness,
    response_time: SystemTime,
    started: Instant,
    stamp: u64,
    vary: Vary,
    /// This request's values for `vary`.
    vary_values: Vec<String>,
    private: bool,
}

impl Keep {
    fn new(
        fill: &FillRequest,
        answered: &Answered,
        freshness: Freshness,
        response_time: SystemTime,
        stamp: u64,
    ) -> Self {
        let vary = Vary::parse(&answered.parts.headers);
        Keep {
            status: answered.parts.status,
            private: freshness.sharing.keeps_private(fill.identity.as_ref()),
            freshness,
            response_time,
            started: answered.started,
            stamp,
            vary_values: vary.values(&fill.head.headers),
            vary,
        }
    }

    fn entry(&self, fill: &FillRequest, headers: HeaderMap, body: Bytes) -> StoredResponse {
        StoredResponse::builder(
            self.status,
            headers,
            body,
            &self.freshness,
            self.response_time,
        )
        .fetch_duration(self.started.elapsed())
        .vary(self.vary.clone(), self.vary_values.clone())
        .generation(self.stamp)
        .private(self.private)
        .build()
        .with_uri(fill.primary.uri().readable())
    }
}

/// A storable answer: its body streamed to every caller as it arrives
/// when someone waits on it and its length is known and fits, else read
/// whole first; then the entry stored in L1.
async fn store(fill: &FillRequest, events: &Events, answered: Answered, keep: Keep) -> Ended {
    let Answered {
        parts,
        body,
        deadline,
        ..
    } = answered;
    let declared = declared_length(&parts.headers);
    if let Some(n) = declared {
        events.send(FillEvent::Declared(n));
    }
    let total = fill.route.upstream.total;
    let mut hold = fill.cache.fill_memory.hold();
    // Two copies while it streams: the chunks readers share, and the
    // entry being built.
    let streamed =
        streamable(fill, events, declared, &keep.vary).filter(|n| hold.grow(n.saturating_mul(2)));
    // Held until the entry is stored; given back at once otherwise.
    let _hold = streamed.map(|_| hold);
    let (bytes, writer) = match streamed {
        Some(n) => {
            let growing = Growing::new(n);
            let writer = Writer::new(&growing);
            events.send(FillEvent::Streaming(FillOutcome::Streaming {
                head: Arc::new(keep.entry(fill, parts.headers.clone(), Bytes::new())),
                body: Arc::clone(&growing),
                fwd: fill.fwd,
                fwd_status: Some(keep.status.as_u16()),
            }));
            match stream_into(body, &growing, n, deadline, total).await {
                // The writer, dropped, aborts every reader.
                Err(e) => return Ended::Outcome(failed(fill, &e)),
                Ok(bytes) => (bytes, Some(writer)),
            }
        }
        None => match read_body(fill, body, declared, deadline).await {
            Buffered::Full(bytes) => (bytes, None),
            Buffered::Over(reason, rest) => {
                if reason == PassReason::TooLarge {
                    fill.mark_pass();
                }
                return Ended::Stream(reason, pass_response(parts, rest, fill.fwd, reason));
            }
            Buffered::Failed(e) => return Ended::Outcome(failed(fill, &e)),
        },
    };
    let entry = Arc::new(keep.entry(fill, parts.headers, crate::sealed::seal_or_keep(bytes)));
    let l1 = &fill.cache.l1;
    l1.learn_vary(&fill.primary, &keep.vary);
    l1.clear_pass(&fill.pass_scope());
    l1.insert(
        &fill.entry_key(&entry),
        fill.primary.uri(),
        Arc::clone(&entry),
    );
    if let Some(writer) = writer {
        writer.finish(entry.body());
    }
    Ended::Outcome(FillOutcome::Stored {
        entry,
        fwd: fill.fwd,
        fwd_status: Some(keep.status.as_u16()),
    })
}

/// The length to stream a storable answer at, if it streams: someone
/// waits on it, its length is declared and within the route's object
/// size, and it varies on what this URI was already known to vary on (an
/// answer with a new Vary is read whole: the flight's callers were keyed
/// without it, and those of another variant must wait for the stored
/// entry to learn the Vary and coalesce on their own variant, not find
/// the stream is not theirs and fetch alone).
fn streamable(
    fill: &FillRequest,
    events: &Events,
    declared: Option<u64>,
    vary: &Vary,
) -> Option<u64> {
    declared
        .filter(|n| *n > 0 && *n <= fill.route.policy.max_object_size)
        .filter(|_| fill.streams(events))
        .filter(|_| *vary == fill.cache.l1.learned_vary(&fill.primary))
}

/// Reads a fill's body into memory within the route's object size, the
/// instance's fill memory and the exchange's deadline.
async fn read_body(
    fill: &FillRequest,
    body: OriginBody,
    declared: Option<u64>,
    deadline: Instant,
) -> Buffered {
    buffer(
        body,
        declared,
        fill.route.policy.max_object_size,
        &fill.cache.fill_memory,
        deadline,
        fill.route.upstream.total,
    )
    .await
}

/// An answer the flight's waiters share, read whole: split into what every
/// waiter may see and the leader's own headers; passed on to the leader
/// alone when it cannot be shared (Vary: *) or is too large to hold.
async fn share(fill: &FillRequest, answered: Answered, reason: PassReason) -> Ended {
    let Answered {
        parts,
        body,
        deadline,
        ..
    } = answered;
    let declared = declared_length(&parts.headers);
    match read_body(fill, body, declared, deadline).await {
        Buffered::Full(bytes) => {
            let own = parts.clone();
            match SharedResponse::from_origin(parts, bytes.clone(), &fill.head.headers) {
                Some(response) => Ended::Outcome(FillOutcome::Shared {
                    response: Arc::new(response),
                    fwd: fill.fwd,
                    detail: None,
                }),
                None => Ended::Stream(
                    reason,
                    pass_response(own, Body::from(bytes), fill.fwd, reason),
                ),
            }
        }
        Buffered::Over(over, rest) => {
            Ended::Stream(over, pass_response(parts, rest, fill.fwd, over))
        }
        Buffered::Failed(e) => Ended::Outcome(failed(fill, &e)),
    }
}

/// An answer that is neither stored nor shared: marked hit-for-pass
/// (unless only its framing was wrong) and streamed to the leader, read
/// ahead of a slow client so that the exchange ends at the origin's pace.
fn pass(fill: &FillRequest, answered: Answered, reason: PassReason) -> Ended {
    if reason != PassReason::ConflictingFraming {
        fill.mark_pass();
    }
    let total = fill.route.upstream.total;
    let body = Body::new(crate::origin::ahead::read_ahead(
        DeadlineBody::new(answered.body, answered.deadline, total),
        fill.route.policy.max_object_size,
        &fill.cache.ahead_memory,
    ));
    Ended::Stream(
        reason,
        pass_response(answered.parts, body, fill.fwd, reason),
    )
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
            fill.cache
                .l1
                .insert(&key, fill.primary.uri(), Arc::clone(&entry));
            Ended::Outcome(FillOutcome::Stored {
                entry,
                fwd: Forward::Stale,
                fwd_status: Some(StatusCode::NOT_MODIFIED.as_u16()),
            })
        }
        Decision::Pass(reason) => {
            // The body is still right for this request, but the origin no
            // longer lets it be stored or shared.
            let key = fill.entry_key(stale);
            fill.cache.l1.remove(&key);
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
    mut body: OriginBody,
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
    mut body: OriginBody,
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
