//! The bottom layer of the miss path: a storable answer's body read and
//! the entry stored in L1. The body streams to every caller as it arrives
//! when someone waits on it and its length is known and fits; otherwise it
//! is read whole, within the route's object size, the instance's fill
//! memory and the exchange's deadline (and passed on, not stored, when it
//! does not fit).

use std::sync::Arc;
use std::time::SystemTime;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use corral_core::{Budget, Freshness, PassReason, PrimaryKey, StoredResponse, VariantKey, Vary};
use corral_core::{Detail, Forward};
use futures_util::{FutureExt, StreamExt};
use http::header::{CONTENT_LENGTH, CONTENT_LOCATION, LOCATION};
use http::{HeaderMap, Response, StatusCode, Uri, response};
use http_body_util::{BodyDataStream, BodyExt};
use tokio::time::Instant;

use crate::cache::cpu::Job;
use crate::cache::fanout::{self, Fanout};
use crate::cache::fill::{Ended, Events, FillEvent, FillOutcome, FillRequest};
use crate::cache::respond::Answer;
use crate::cache::shared_body::{SharedBody, Writer};
use crate::cache::{compress, synthetic};
use crate::origin::exchange::Answered;
use crate::origin::upstream::{BodyError, DeadlineBody, OriginBody, UpstreamError};

/// The GET keys a stored QUERY answer is also stored under (RFC 10008):
/// the URI its `Content-Location` names (RFC 9110 §8.7: the content
/// is that resource's representation), else the one its `Location` names
/// (a GET of it repeats the query), when it is on the same host and path
/// as the QUERY (so the same route, and the same resource owner) and
/// differs in its query (in the form the GET is keyed on): never the
/// QUERY's own target. Only a shareable answer: one private to the
/// QUERY's caller, whose identity a GET may read differently (a QUERY is
/// keyed on its whole Cookie field), is never a GET's.
pub(crate) fn aliases(fill: &FillRequest, entry: &StoredResponse) -> Vec<(PrimaryKey, VariantKey)> {
    let head = &fill.head;
    if !head.is_query() || entry.private() || !entry.status().is_success() {
        return Vec::new();
    }
    let headers = entry.headers();
    let Some(named) = [CONTENT_LOCATION, LOCATION]
        .iter()
        .find_map(|name| headers.get(name))
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<Uri>().ok())
    else {
        return Vec::new();
    };
    let same_host = named.authority().is_none_or(|a| {
        corral_core::semantics::head::parse_authority(a.as_str().as_bytes()).as_deref()
            == Some(head.host.as_str())
    });
    let same_path =
        corral_core::semantics::path::normalize(named.path()).is_ok_and(|p| p == head.path);
    if !same_host
        || !same_path
        || named
            .scheme()
            .is_some_and(|s| (s == &http::uri::Scheme::HTTPS) != head.tls)
    {
        return Vec::new();
    }
    let params = fill.cache_params();
    let uri =
        crate::cache::rules::get_key(fill.l1(), fill.route_name(), params, head, named.query());
    // The QUERY's own target is the resource the query was sent to, not a
    // representation of it: an answer naming it would let any caller's
    // query content replace that URI's GET for everyone.
    let plain = head.query.as_deref();
    if uri == crate::cache::rules::get_key(fill.l1(), fill.route_name(), params, head, plain) {
        return Vec::new();
    }
    let primary = PrimaryKey::get(fill.route_name(), uri, head.tls);
    let key = primary.variant(None, entry.vary_values());
    vec![(primary, key)]
}

/// What an entry is built of, besides its headers and body.
pub(crate) struct Keep {
    status: StatusCode,
    freshness: Freshness,
    response_time: SystemTime,
    started: Instant,
    stamp: u64,
    vary: Vary,
    /// This request's values for `vary`.
    vary_values: Vec<String>,
    private: bool,
    /// The fields the answer's `no-cache="..."` names: the stored copy
    /// leaves them out (RFC 9111 §5.2.2.4), the caller whose fetch it was
    /// gets them.
    own: HeaderMap,
}

impl Keep {
    pub(crate) fn new(
        fill: &FillRequest,
        answered: &Answered,
        freshness: Freshness,
        response_time: SystemTime,
        stamp: u64,
    ) -> Self {
        let mut vary = Vary::parse(&answered.parts.headers);
        // A route that compresses asked for the unencoded answer whoever
        // asked, and picks the coding per caller itself: the callers'
        // Accept-Encoding selects no variant. An origin that encoded its
        // answer anyway keeps its Vary.
        let unencoded = !compress::has_coding(&answered.parts.headers);
        if fill.store().compression.is_some()
            && unencoded
            && let Vary::Headers(names) = &mut vary
        {
            names.retain(|n| n != http::header::ACCEPT_ENCODING);
            if names.is_empty() {
                vary = Vary::None;
            }
        }
        let mut own = HeaderMap::new();
        for name in corral_core::CacheControl::parse(&answered.parts.headers).no_cache_fields {
            for value in answered.parts.headers.get_all(&name) {
                own.append(name.clone(), value.clone());
            }
        }
        Keep {
            own,
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

    /// The outcome of `entry`, stored.
    fn stored(&self, fill: &FillRequest, entry: Arc<StoredResponse>) -> Ended {
        Ended::Outcome(FillOutcome::Stored {
            entry,
            fwd: fill.fwd,
            fwd_status: Some(self.status.as_u16()),
            own: self.own.clone(),
        })
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
pub(crate) async fn store(
    fill: &FillRequest,
    events: &Events,
    answered: Answered,
    keep: Keep,
) -> Ended {
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
    let mut hold = fill.store().fill_memory.hold();
    // Two copies while it streams: the chunks readers share, and the entry
    // being built. A body without a declared length takes its hold as it comes.
    let incremental = incremental(&parts.headers);
    // On a route that compresses, an answer the origin encoded anyway
    // reaches only callers that accept its coding: never streamed to all.
    // Nor is one in a coding this fill's caller does not accept, which is
    // decoded for it (and whoever else accepts none) once it is whole.
    let unaccepted = compress::unaccepted_coding(&fill.head.headers, &parts.headers);
    let encoded = compress::has_coding(&parts.headers)
        && (fill.store().compression.is_some() || unaccepted.is_some());
    let streamed = streamable(fill, events, declared, &keep.vary, incremental)
        .filter(|_| !encoded)
        .filter(|n| n.is_none_or(|n| hold.grow(n.saturating_mul(2))));
    let (bytes, writer, coded) = match streamed {
        Some(n) => {
            let growing = SharedBody::new(n);
            let writer = Writer::new(&growing);
            let route = fill.route_name();
            let mut outlets = Fanout::new(
                &growing,
                &stream_codings(fill, &parts, n, &mut hold),
                n.map(fanout::worst),
                route,
                fill.store().cpu,
            );
            events.send(FillEvent::Streaming(streaming(
                fill, &keep, &parts, &outlets, &growing,
            )));
            let streamed =
                stream_body(fill, events, body, &mut outlets, n, &mut hold, deadline).await;
            match streamed {
                // The writers, dropped, abort every reader.
                Err(e) => return Ended::Outcome(synthetic::broke_off(fill, &e, parts.status)),
                Ok(Some(bytes)) => (bytes, Some(writer), outlets.close().await),
                // Passed through to its readers whole; nothing to store,
                // and the next caller fetches alone.
                Ok(None) => {
                    outlets.passed(writer);
                    fill.set_hit_for_pass();
                    return Ended::Outcome(FillOutcome::Pass {
                        reason: PassReason::TooLarge,
                    });
                }
            }
        }
        None => {
            // Given back at once: the buffered read takes its own.
            drop(hold);
            match read_whole(fill, &parts, body, declared, deadline).await {
                Ok(bytes) => (bytes, None, Vec::new()),
                Err(ended) => return *ended,
            }
        }
    };
    // A body that is not what its digest says is never stored, and the
    // writer, dropped, aborts every reader (the last chunk was held back).
    if let Err(e) = checked(fill, &parts, &bytes).await {
        return Ended::Outcome(synthetic::broke_off(fill, &e, parts.status));
    }
    let entry = keep.entry(fill, parts.headers, sealed(fill, bytes).await);
    let ready = coded.iter().map(|c| (c.coding, c.whole.clone())).collect();
    let entry = match representations(fill, entry, unaccepted, ready).await {
        Ok(entry) => entry,
        Err(ended) => return *ended,
    };
    insert(fill, &keep.vary, &entry);
    if let Some(writer) = writer {
        writer.finish(entry.body());
    }
    for c in coded {
        c.end();
    }
    keep.stored(fill, entry)
}

/// A streamed body read into its readers: of declared length `n`, or of
/// unknown length until it outgrows the store (`Ok(None)`: passed through).
async fn stream_body(
    fill: &FillRequest,
    events: &Events,
    body: OriginBody,
    outlets: &mut Fanout<'_>,
    n: Option<u64>,
    hold: &mut corral_core::Hold,
    deadline: Instant,
) -> Result<Option<Bytes>, UpstreamError> {
    let total = fill.origin().total;
    match n {
        Some(n) => stream_into(body, outlets, n, deadline, total)
            .await
            .map(Some),
        None => {
            let room = Room {
                limit: fill.store().policy.max_object_size,
                hold,
                lag: fill.store().ahead_memory,
                events,
                route: fill.route_name(),
            };
            stream_unknown(body, outlets, room, deadline, total).await
        }
    }
}

/// The body read whole; `Err`: what the fill ends with instead (an
/// answer too large to store passed through to its caller, or a body that
/// broke off).
async fn read_whole(
    fill: &FillRequest,
    parts: &http::response::Parts,
    body: OriginBody,
    declared: Option<u64>,
    deadline: Instant,
) -> Result<Bytes, Box<Ended>> {
    match read_body(fill, body, declared, deadline).await {
        Buffered::Full(bytes) => Ok(bytes),
        Buffered::Over(reason, rest) => {
            if reason == PassReason::TooLarge {
                fill.set_hit_for_pass();
            }
            Err(Box::new(Ended::Stream(
                reason,
                pass_response(parts.clone(), rest, fill.fwd, reason),
            )))
        }
        Buffered::Failed(e) => Err(Box::new(Ended::Outcome(synthetic::broke_off(
            fill,
            &e,
            parts.status,
        )))),
    }
}

/// Puts `entry` in L1 under its key, with the Vary set and the
/// No-Vary-Search rule it taught; the URI is cacheable again for this
/// caller; a QUERY's answer that names the GET of its result also answers
/// it.
fn insert(fill: &FillRequest, vary: &Vary, entry: &Arc<StoredResponse>) {
    let l1 = &fill.l1();
    l1.learn_vary(&fill.primary, vary);
    crate::cache::rules::learn(fill, entry.headers());
    fill.clear_hit_for_pass();
    l1.insert(
        &fill.entry_key(entry),
        fill.primary.uri(),
        Arc::clone(entry),
    );
    for (primary, key) in aliases(fill, entry) {
        l1.learn_vary(&primary, entry.vary());
        l1.insert(&key, primary.uri(), Arc::clone(entry));
    }
}

/// The stored entry in the representations its callers may read: each
/// configured coding where the route compresses; decoded beside the
/// origin's coding where this fill's caller does not accept it
/// (`unaccepted`). `Err`: what the fill ends with instead, when the
/// origin's coding cannot be undone within the object size: a 502 for a
/// caller that does not accept it (never the encoded bytes), the encoded
/// answer passed to its caller alone otherwise.
async fn representations(
    fill: &FillRequest,
    entry: StoredResponse,
    unaccepted: Option<String>,
    ready: Vec<(corral_core::Coding, Bytes)>,
) -> Result<Arc<StoredResponse>, Box<Ended>> {
    let limit = fill.store().policy.max_object_size;
    let config = fill.store().compression;
    let status = entry.status();
    let encoded = match (&unaccepted, config) {
        (Some(_), None) => {
            let backup = entry.clone();
            fill.store()
                .cpu
                .run(Job::Decompress, move || {
                    compress::decode_for_callers(entry, limit)
                })
                .await
                .unwrap_or_else(|| Err(Box::new(backup)))
        }
        _ => encoded(fill, entry, ready).await,
    };
    match encoded {
        Ok(entry) => Ok(Arc::new(entry)),
        // In a coding its caller does not accept, and past what corral
        // can undo (a bomb, a coding it does not know, a dictionary the
        // caller never offered): refused, never passed on encoded.
        Err(_) if unaccepted.is_some() => {
            let coding = unaccepted.unwrap_or_default();
            let e = UpstreamError::Coding(format!(
                "{coding}-encoded, which its caller does not accept, and does not decode within max_object_size ({limit} bytes)"
            ));
            Err(Box::new(Ended::Outcome(synthetic::broke_off(
                fill, &e, status,
            ))))
        }
        // Encoded by the origin past what corral can undo: only its
        // caller gets it.
        Err(entry) => {
            fill.set_hit_for_pass();
            let reason = PassReason::Undecodable;
            let mut head = Response::new(());
            *head.status_mut() = entry.status();
            *head.headers_mut() = entry.headers().clone();
            let (parts, ()) = head.into_parts();
            let body = Body::from(entry.body().clone());
            Err(Box::new(Ended::Stream(
                reason,
                pass_response(parts, body, fill.fwd, reason),
            )))
        }
    }
}

/// An entry read from L2, as this instance keeps it: an answer the origin
/// encoded is decoded on the CPU pool (waiting for a slot if need be: its
/// callers need it), as when it was fetched here; `None` when it does not
/// decode within the route's object size (it is fetched again rather than
/// served). An unencoded one is kept so, its codings made when a caller
/// first asks for one (`cache::demand`), not all at once here.
pub(crate) async fn from_l2(fill: &FillRequest, read: StoredResponse) -> Option<StoredResponse> {
    let config = fill.store().compression.cloned();
    let Some(config) = config.filter(|_| compress::has_coding(read.headers())) else {
        return Some(compress::deferred(fill.store().compression, read));
    };
    let limit = fill.store().policy.max_object_size;
    let name = fill.route_name().to_owned();
    let decode = move || compress::encode(Some(&config), &name, read, limit).ok();
    fill.store()
        .cpu
        .run(Job::Decompress, decode)
        .await
        .flatten()
}

/// `entry` in the route's codings, made on the CPU pool: those its caller
/// asked for (any, when it accepts one; none for a HEAD or a caller that
/// accepts none), unless the pool is full; the others are made when a
/// caller first asks (`cache::demand`). An answer the origin encoded is
/// decoded (waiting for a slot if need be: its callers need it).
async fn encoded(
    fill: &FillRequest,
    entry: StoredResponse,
    ready: Vec<(corral_core::Coding, Bytes)>,
) -> Result<StoredResponse, Box<StoredResponse>> {
    let Some(config) = fill.store().compression.cloned() else {
        return Ok(entry);
    };
    let limit = fill.store().policy.max_object_size;
    let name = fill.route_name().to_owned();
    let cpu = &fill.store().cpu;
    let all_ready = config
        .encodings
        .iter()
        .all(|c| ready.iter().any(|(r, _)| r == c));
    if compress::has_coding(entry.headers()) {
        let backup = entry.clone();
        let decode = move || compress::encode_with(Some(&config), &name, entry, limit, ready);
        return cpu
            .run(Job::Decompress, decode)
            .await
            .unwrap_or_else(|| Err(Box::new(backup)));
    }
    // Nothing left to compress: no job.
    if all_ready {
        return compress::encode_with(Some(&config), &name, entry, limit, ready);
    }
    if compress::asked(Some(&config), &fill.head) {
        let backup = entry.clone();
        let (c, r) = (config.clone(), ready.clone());
        let made = cpu
            .try_run(Job::Compress, move || {
                compress::encode_with(Some(&c), &name, entry, limit, r)
            })
            .await;
        if let Some(made) = made {
            return made;
        }
        return Ok(deferred(&config, fill.route_name(), backup, ready));
    }
    Ok(deferred(&config, fill.route_name(), entry, ready))
}

/// `entry` stored with the codings made as it streamed (`ready`), the
/// others made on demand.
fn deferred(
    config: &crate::config::CompressionConfig,
    route: &str,
    entry: StoredResponse,
    ready: Vec<(corral_core::Coding, Bytes)>,
) -> StoredResponse {
    let mut entry = compress::deferred(Some(config), entry);
    if entry.codings_pending() {
        for (coding, packed) in ready {
            crate::telemetry::metrics::compressed(
                route,
                coding.as_str(),
                entry.body().len(),
                packed.len(),
            );
            entry = compress::with_coding(config, &entry, coding, packed);
        }
    }
    crate::telemetry::metrics::variants_per_key(route, 1 + entry.encoded().len());
    entry
}

/// Bodies at least this long are copied into sealed memory on the CPU
/// pool; a shorter copy costs less than the hand-off.
const COPY_ON_POOL: usize = 256 * 1024;

/// `bytes` copied into sealed memory when long enough to be kept there
/// (on the CPU pool when long: see [`COPY_ON_POOL`]).
async fn sealed(fill: &FillRequest, bytes: Bytes) -> Bytes {
    if bytes.len() < COPY_ON_POOL {
        return crate::sealed::seal_or_keep(bytes);
    }
    let copy = bytes.clone();
    fill.store()
        .cpu
        .run(Job::Copy, move || crate::sealed::seal_or_keep(copy))
        .await
        .unwrap_or(bytes)
}

/// The codings a streamed answer is compressed in as it arrives (see
/// `cache::fanout`): none unless the route compresses it, and, for a
/// body of declared length, none unless the fill memory can hold the
/// worst each may take (then its callers read it unencoded, as when the
/// route does not compress).
fn stream_codings(
    fill: &FillRequest,
    parts: &response::Parts,
    declared: Option<u64>,
    hold: &mut corral_core::Hold,
) -> Vec<corral_core::Coding> {
    let config = fill.store().compression;
    // A HEAD, or a caller that accepts no coding, has none made for it.
    if !compress::asked(config, &fill.head) {
        return Vec::new();
    }
    let codings = compress::stream_codings(config, parts.status, &parts.headers, declared);
    let Some(n) = declared else {
        return codings;
    };
    // Its coded chunks and the whole copy stored, per coding.
    let worst = fanout::worst(n).saturating_mul(2);
    if codings.is_empty() || !hold.grow(worst.saturating_mul(codings.len() as u64)) {
        return Vec::new();
    }
    codings
}

/// The outcome a streamed answer's callers read: its head (with each
/// coding's, when it is compressed as it arrives) and its bodies.
fn streaming(
    fill: &FillRequest,
    keep: &Keep,
    parts: &response::Parts,
    outlets: &Fanout<'_>,
    growing: &Arc<SharedBody>,
) -> FillOutcome {
    let bodies = outlets.bodies();
    let mut head = keep.entry(fill, parts.headers.clone(), Bytes::new());
    if !bodies.is_empty() {
        let identity = compress::identity_headers(&parts.headers);
        let coded = bodies
            .iter()
            .map(|&(c, _)| {
                let headers = compress::encoded_headers(&identity, c);
                (c, Arc::new(head.representation(headers, Bytes::new())))
            })
            .collect();
        head = head
            .representation(identity, Bytes::new())
            .with_encoded(coded);
    }
    FillOutcome::Streaming {
        head: Arc::new(head),
        body: Arc::clone(growing),
        coded: bodies,
        fwd: fill.fwd,
        fwd_status: Some(keep.status.as_u16()),
        own: keep.own.clone(),
        relayed: false,
    }
}

/// `body` checked against the digests its answer claims (RFC 9530), before
/// it is stored or shared as complete; a mismatch is counted and is the
/// origin's error, like a body cut short.
/// The digests are computed on the CPU pool.
pub(crate) async fn checked(
    fill: &FillRequest,
    parts: &http::response::Parts,
    body: &Bytes,
) -> Result<(), UpstreamError> {
    let whole = parts.status != http::StatusCode::PARTIAL_CONTENT;
    let expected = corral_core::wire::digest::expected(&parts.headers, whole);
    if expected.is_empty() {
        return Ok(());
    }
    let body = body.clone();
    let verified = fill
        .store()
        .cpu
        .run(Job::Digest, move || {
            corral_core::wire::digest::verify(&expected, &body)
        })
        .await;
    let Some(verified) = verified else {
        return Err(UpstreamError::Exchange("the digest check failed".into()));
    };
    verified.map_err(|m| {
        crate::telemetry::metrics::digest_mismatch(fill.route_name(), m.field);
        tracing::warn!(route = %fill.route_name(), key = %fill.primary.loggable(), "{m}");
        UpstreamError::Digest(m)
    })
}

/// How a storable answer streams, if it does (`Some(None)`: without a
/// declared length): someone waits on it, its declared length (if any)
/// is within the route's object size, and it varies on what this URI was
/// already known to vary on (an answer with a new Vary is read whole: the
/// flight's callers were keyed without it, and those of another variant
/// must wait for the stored entry to learn the Vary and coalesce on their
/// own variant, not find the stream is not theirs and fetch alone). An
/// `Incremental: ?1` answer (draft-ietf-httpbis-incremental) streams even
/// when a stale copy could answer if it failed: its readers must never
/// wait for its end.
fn streamable(
    fill: &FillRequest,
    events: &Events,
    declared: Option<u64>,
    vary: &Vary,
    incremental: bool,
) -> Option<Option<u64>> {
    let fits = declared.is_none_or(|n| n > 0 && n <= fill.store().policy.max_object_size);
    (fits
        && (fill.streams(events) || (incremental && events.streams))
        && *vary == fill.l1().learned_vary(&fill.primary))
    .then_some(declared)
}

/// `Incremental: ?1`: each part of the answer is meant to reach the
/// client as it arrives.
fn incremental(headers: &HeaderMap) -> bool {
    headers
        .get("incremental")
        .is_some_and(|v| v.as_bytes().trim_ascii() == b"?1")
}

/// How long a body passing through waits for a reader that holds the
/// others back (more than the object size behind) before cutting it off.
const PASS_THROUGH_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);

/// What a body without a declared length may take while it streams.
struct Room<'a> {
    /// The route's object size: past it, nothing is stored.
    limit: u64,
    /// The fill's hold on `cache.fill_memory`.
    hold: &'a mut corral_core::Hold,
    /// What passed-through bodies may hold for their readers at once
    /// (the read-ahead budget): a reader's lag is counted here, never in
    /// the fills' memory.
    lag: &'a Arc<Budget>,
    events: &'a Events,
    /// For the metrics.
    route: &'a str,
}

/// Reads a body without a declared length, handing each chunk to the
/// readers of `shared_body` as it arrives and building the entry's copy
/// alongside. No reader can take it for complete before the fill says so
/// (`Writer::finish`, once the entry is stored): with no length to reach,
/// its end is that word alone. `Ok(None)`
/// when it outgrew the route's object size or the fill memory: then the
/// copy is dropped, the body is passed through to the readers already
/// reading (at most the object size of it held for them: see
/// `SharedBody::pass_through`), and everyone else is told to fetch alone.
async fn stream_unknown(
    mut body: OriginBody,
    outlets: &mut Fanout<'_>,
    room: Room<'_>,
    deadline: Instant,
    total: std::time::Duration,
) -> Result<Option<Bytes>, UpstreamError> {
    let Room {
        limit,
        hold,
        lag,
        events,
        route,
    } = room;
    let mut whole = Some(BytesMut::new());
    // Once passing through: what is held for the readers.
    let mut lagging: Option<corral_core::Hold> = None;
    loop {
        // Passing through: read on from the origin only while what the
        // readers have yet to read is within the bound.
        if whole.is_none() {
            match tokio::time::timeout_at(deadline, outlets.room(PASS_THROUGH_PATIENCE)).await {
                Err(_) => return Err(UpstreamError::TotalTimeout(total)),
                Ok(0) => {}
                Ok(cut) => crate::telemetry::metrics::stream_readers_cut(route, cut),
            }
        }
        let data = match next_frame(&mut body, outlets, deadline).await {
            Err(_) => return Err(UpstreamError::TotalTimeout(total)),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(UpstreamError::Exchange(e)),
            Ok(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) if !data.is_empty() => data,
                _ => continue, // trailers are not stored
            },
        };
        let n = data.len() as u64;
        let copy_len = whole.as_ref().map_or(0, |c| c.len() as u64);
        outlets.push(data.clone(), false);
        let coded = outlets.take_produced();
        if let Some(copy) = &mut whole {
            let fits = copy_len + n <= limit;
            // The chunk and its copy; each coding's chunks and their copy.
            if fits && hold.grow(n.saturating_add(coded).saturating_mul(2)) {
                copy.extend_from_slice(&data);
            } else {
                // Not to be stored: from now on the body only passes
                // through, holding for its readers no more than half what
                // the fill held (the copies it no longer builds were the
                // other half). That is the readers' lag, paced by the
                // slowest: counted in the pass-through budget, and the
                // fill memory, which fills being stored share, is given
                // back now. Readers who never read so hold no fill's room
                // (with no pass-through room left, one chunk at a time is
                // held for them).
                whole = None;
                let mut held_for_readers = lag.hold();
                let bound = hold.held() / 2;
                let bound = if held_for_readers.grow(bound) {
                    bound
                } else {
                    0
                };
                lagging = Some(held_for_readers);
                hold.release();
                outlets.pass_through(bound);
                let reason = if fits { "fill-memory" } else { "too-large" };
                crate::telemetry::metrics::stream_passed_through(route, reason);
                events.send(FillEvent::Overflowed);
            }
        }
    }
    drop(lagging);
    Ok(whole.map(BytesMut::freeze))
}

/// Reads a fill's body into memory within the route's object size, the
/// instance's fill memory and the exchange's deadline.
pub(crate) async fn read_body(
    fill: &FillRequest,
    body: OriginBody,
    declared: Option<u64>,
    deadline: Instant,
) -> Buffered {
    buffer(
        body,
        declared,
        fill.store().policy.max_object_size,
        fill.store().fill_memory,
        deadline,
        fill.origin().total,
    )
    .await
}

/// Reads a body of exactly `n` bytes, handing each chunk to the readers
/// of `shared_body` as it arrives and building the entry's copy alongside.
async fn stream_into(
    mut body: OriginBody,
    outlets: &mut Fanout<'_>,
    n: u64,
    deadline: Instant,
    total: std::time::Duration,
) -> Result<Bytes, UpstreamError> {
    let mut whole = BytesMut::with_capacity(usize::try_from(n).unwrap_or(0));
    loop {
        match next_frame(&mut body, outlets, deadline).await {
            Err(_) => return Err(UpstreamError::TotalTimeout(total)),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(UpstreamError::Exchange(e)),
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
                outlets.push(data, last);
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

/// The body's next frame, within the deadline. When none is ready (the
/// origin paused), the codings being made push out what they hold first.
async fn next_frame(
    body: &mut OriginBody,
    outlets: &mut Fanout<'_>,
    deadline: Instant,
) -> Result<Option<Result<http_body::Frame<Bytes>, BodyError>>, tokio::time::error::Elapsed> {
    let next = body.frame();
    tokio::pin!(next);
    if outlets.coding() {
        if let Some(frame) = (&mut next).now_or_never() {
            return Ok(frame);
        }
        outlets.flush();
    }
    tokio::time::timeout_at(deadline, next).await
}

pub(crate) enum Buffered {
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
            Ok(Some(Err(e))) => return Buffered::Failed(UpstreamError::Exchange(e)),
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

/// The Content-Length the origin declared, if any.
pub(crate) fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

pub(crate) fn pass_response(
    parts: response::Parts,
    body: Body,
    fwd: Forward,
    reason: PassReason,
) -> Answer {
    let st = corral_core::CacheStatus::forward(fwd)
        .with_fwd_status(parts.status.as_u16())
        .with_detail(Detail::Pass(reason));
    Answer::new(
        Response::from_parts(parts, body),
        &st,
        http::Version::HTTP_11,
    )
}
