//! The fifth layer of the miss path: a fill's one exchange with the
//! origin. The request for a fill (the key's target, the fill's own
//! conditionals), the answer against the stale copy (stale-if-error, a
//! 304), the policy's verdict, and then the answer stored (`store`, the
//! layer below), shared with the waiters, or passed on. The exchange itself is
//! [`origin::exchange`](crate::origin::exchange); the fill's gate, flight
//! and shared tier sit above this and never see a socket.

use std::sync::Arc;
use std::time::SystemTime;

use axum::body::Body;
use corral_core::semantics::head::RequestBody;
use corral_core::{Decision, Detail, Forward, PassReason, StoredResponse, merge_not_modified};
use http::header::{CONTENT_LENGTH, ETAG, LAST_MODIFIED};
use http::header::{
    IF_MATCH, IF_MODIFIED_SINCE, IF_NONE_MATCH, IF_RANGE, IF_UNMODIFIED_SINCE, RANGE,
};
use http::{HeaderMap, Method, StatusCode, response};

use crate::cache::fill::{Ended, Events, FillEvent, FillOutcome, FillRequest, SharedResponse};
use crate::cache::store::{self, Buffered, Keep, declared_length, pass_response};
use crate::cache::synthetic;
use crate::origin::exchange::{Answered, Held, OriginRequest, exchange};
use crate::origin::upstream::{DeadlineBody, Framing, UpstreamError};

/// The fill's exchange with the origin, and what is kept of it (the gate
/// runs the two halves itself).
#[cfg(test)]
pub(crate) async fn fetch(fill: &FillRequest, events: &Events) -> Ended {
    keep(fill, events, ask_origin(fill).await).await
}

/// What the origin said to a fill's request: its answer head, or why none
/// came, with the stale copy the request was made against.
pub(crate) struct Asked {
    stale: Option<Arc<StoredResponse>>,
    stamp: u64,
    answered: Result<Answered, UpstreamError>,
}

impl Asked {
    /// True when the origin answered (whatever the status).
    pub(crate) fn is_answer(&self) -> bool {
        self.answered.is_ok()
    }
}

/// The first half of [`fetch`]: the fill's request, up to the answer's
/// head. The gate times it (a fetch the origin leaves waiting counts toward
/// the route's circuit before its timeout).
pub(crate) async fn ask_origin(fill: &FillRequest) -> Asked {
    let stale = fill.stale();
    let stamp = fill.l1().generation_stamp();
    let answered = ask(fill, stale.as_deref()).await;
    Asked {
        stale,
        stamp,
        answered,
    }
}

/// The second half of [`fetch`]: the answer against the stale copy and the
/// policy, then stored, shared or passed on.
pub(crate) async fn keep(fill: &FillRequest, events: &Events, asked: Asked) -> Ended {
    let Asked {
        stale,
        stamp,
        answered,
    } = asked;
    let answered = match answered {
        Ok(a) => a,
        Err(e) => return Ended::Outcome(synthetic::failed(fill, &e)),
    };
    let response_time = fill.now();
    if let Some(stale) = &stale
        && let Some(ended) = against_stale(fill, stale, &answered, response_time, stamp)
    {
        return ended;
    }
    if fill.by_head
        && let Some(stale) = &stale
    {
        return head_answered(fill, stale, answered, response_time, stamp);
    }
    let post = fill.body.is_some();
    let verdict = verdict(fill, &answered, response_time);
    // Only a passed answer needs the caller's codings checked here; a
    // stored one is checked where its body is read (`store::store`).
    let unaccepted = match &verdict {
        Decision::Pass(_) => {
            crate::cache::compress::unaccepted_coding(&fill.head.headers, &answered.parts.headers)
        }
        Decision::Store { .. } => None,
    };
    match verdict {
        Decision::Store { freshness } => {
            events.send(FillEvent::Committed);
            let keep = Keep::new(fill, &answered, freshness, response_time, stamp);
            store::store(fill, events, answered, keep).await
        }
        // An error every waiter shares (without the leader's cookies),
        // not a reason to stop coalescing: the next request tries the
        // origin again. So is an answer to a coalesced POST that RFC 9111
        // would let a shared cache keep but for the method: identical
        // in-flight POSTs of one caller share one origin request. A
        // `private` answer is the caller's own, and so is a POST's
        // `no-store` or Set-Cookie one: waiters fetch alone. An answer
        // that says nothing of its freshness (most APIs') is not stored,
        // but those who asked for it at the same moment share it: a burst
        // on such a key is one origin request, not one per caller, and the
        // key is not marked hit-for-pass, so the next burst coalesces too.
        Decision::Pass(reason)
            if (answered.parts.status.is_server_error()
                || post
                || reason == PassReason::NoFreshness)
                && shareable(reason, post) =>
        {
            share(fill, answered, reason).await
        }
        Decision::Pass(reason) if let Some(coding) = &unaccepted => {
            pass_decoded(fill, answered, reason, coding).await
        }
        Decision::Pass(reason) => pass(fill, answered, reason),
    }
}

/// [`pass`] for an answer in a coding its caller does not accept: read
/// whole within the route's object size and decoded for it, or refused
/// with a 502 (`upstream-content-coding`) when it does not decode within
/// that size (a bomb), or is in a coding corral does not know. Never
/// passed on encoded.
async fn pass_decoded(
    fill: &FillRequest,
    answered: Answered,
    reason: PassReason,
    coding: &str,
) -> Ended {
    let Answered {
        mut parts,
        body,
        deadline,
        ..
    } = answered;
    let limit = fill.exchange().policy.max_object_size;
    let refused = |what: &str| {
        UpstreamError::Coding(format!(
            "{what}, which its caller does not accept, and does not decode within max_object_size ({limit} bytes)"
        ))
    };
    let declared = declared_length(&parts.headers);
    let bytes = match store::read_body(fill, body, declared, deadline).await {
        Buffered::Full(bytes) => bytes,
        Buffered::Over(..) => {
            let e = refused(&format!("{coding}-encoded and over max_object_size"));
            return Ended::Outcome(synthetic::broke_off(fill, &e, parts.status));
        }
        Buffered::Failed(e) => return Ended::Outcome(synthetic::broke_off(fill, &e, parts.status)),
    };
    if let Err(e) = store::checked(fill, &parts, &bytes).await {
        return Ended::Outcome(synthetic::broke_off(fill, &e, parts.status));
    }
    // Decoded on the CPU pool, not on the serving thread.
    let mut headers = std::mem::take(&mut parts.headers);
    let decoded = fill
        .exchange()
        .cpu
        .run(crate::cache::cpu::Job::Decompress, move || {
            let decoded = crate::cache::compress::decode_passed(&mut headers, &bytes, limit);
            (headers, decoded)
        })
        .await;
    let decoded = match decoded {
        Some((headers, decoded)) => {
            parts.headers = headers;
            decoded
        }
        None => None,
    };
    match decoded {
        Some(decoded) => {
            if !matches!(
                reason,
                PassReason::ConflictingFraming | PassReason::RuleChanged
            ) {
                fill.set_hit_for_pass();
            }
            Ended::Stream(
                reason,
                pass_response(parts, Body::from(decoded), fill.fwd, reason),
            )
        }
        None => {
            let e = refused(&format!("{coding}-encoded"));
            Ended::Outcome(synthetic::broke_off(fill, &e, parts.status))
        }
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
        slot: fill.exchange().upstream.slot().await?,
        descriptor: None,
    };
    let (method, body, framing) = match &fill.body {
        // A coalesced POST, or a QUERY: sent as it came.
        Some(b) => (
            fill.head.method.clone(),
            Body::from(b.clone()),
            RequestBody::Sized(b.len() as u64),
        ),
        // A HEAD's fill of a copy that is no longer fresh (RFC 9111
        // §4.3.5); every other fill asks for the whole representation.
        None if fill.by_head => (Method::HEAD, Body::empty(), RequestBody::None),
        None => (Method::GET, Body::empty(), RequestBody::None),
    };
    let mut headers = fill_headers(&fill.head.headers, stale.filter(|_| fill.body.is_none()));
    // A route that compresses asks for the unencoded answer, in one form
    // whoever asked: one fill for every caller, whatever they accept. A
    // key known to be uncacheable passes with the caller's own field (its
    // answer reaches that caller alone, as the origin encodes it).
    if fill.exchange().compression.is_some() && !fill.is_hit_for_pass() {
        headers.insert(
            http::header::ACCEPT_ENCODING,
            http::HeaderValue::from_static("identity"),
        );
    }
    let asked = OriginRequest {
        method,
        // What is stored is exactly what was asked for.
        target: fill.primary.uri().target(),
        headers,
        body,
        framing,
        retry: fill.body.is_none(),
        interim: fill.interim.clone(),
        held,
    };
    let transport = fill.exchange().transport;
    exchange(transport, fill.exchange().upstream, &fill.head, asked).await
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
            failure: None,
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

/// The origin's answer to a HEAD sent for the stored copy `stale` (RFC
/// 9111 §4.3.5; a 304 and a 5xx within stale-if-error were taken by
/// [`against_stale`]). A 200 that describes the copy (its validators,
/// length, coding and Vary: [`StoredResponse::described_by`]) freshens
/// it with its fields, as a 304 does. One that does not, or a 404 or 410,
/// says the copy is no longer what a GET would get: it is removed from
/// L1, so the next GET fetches it whole. (Its copy in L2 and on the other
/// instances is as stale as this one was, so none serves it as fresh.)
/// Any other status says nothing about the stored representation (a 401
/// or a 400 may be about the request alone): the copy is left as it was.
/// A copy a GET replaced while the HEAD was out is left to that GET's
/// answer. In every case but a freshened copy, the HEAD's answer is
/// shared with the HEADs that wait on this flight and stored nowhere.
fn head_answered(
    fill: &FillRequest,
    stale: &Arc<StoredResponse>,
    answered: Answered,
    response_time: SystemTime,
    stamp: u64,
) -> Ended {
    let status = answered.parts.status;
    if matches!(answered.framing, Framing::Conflicting) {
        return pass(fill, answered, PassReason::ConflictingFraming);
    }
    // A GET may have stored a newer answer while this HEAD was out: the
    // HEAD's answer, sent before it arrived, changes nothing then.
    let key = fill.entry_key(stale);
    let superseded = fill
        .l1()
        .get(key.local.as_bytes(), fill.primary.uri())
        .is_some_and(|held| held.response_time() > stale.response_time());
    if !superseded {
        if status == StatusCode::OK && stale.described_by(&answered.parts.headers) {
            return revalidated(
                fill,
                stale,
                &answered.uri,
                &answered.parts,
                response_time,
                stamp,
            );
        }
        if matches!(
            status,
            StatusCode::OK | StatusCode::NOT_FOUND | StatusCode::GONE
        ) {
            fill.l1().remove(&key);
        }
    }
    let parts = answered.parts;
    match SharedResponse::from_origin(parts.clone(), bytes::Bytes::new(), &fill.head.headers) {
        Some(response) => Ended::Outcome(FillOutcome::Shared {
            response: Arc::new(response),
            fwd: fill.fwd,
            detail: None,
        }),
        // `Vary: *`: the leader's alone.
        None => Ended::Stream(
            PassReason::VaryStar,
            pass_response(parts, Body::empty(), fill.fwd, PassReason::VaryStar),
        ),
    }
}

/// The policy's verdict on the answer: an answer framed ambiguously is
/// never stored.
fn verdict(fill: &FillRequest, answered: &Answered, response_time: SystemTime) -> Decision {
    let method = if fill.body.is_some() {
        fill.head.method.clone()
    } else {
        Method::GET
    };
    match answered.framing {
        Framing::Conflicting => Decision::Pass(PassReason::ConflictingFraming),
        Framing::Plain => {
            match fill.exchange().policy.evaluate(
                &method,
                &answered.uri,
                &answered.parts,
                response_time,
            ) {
                // Stored only under a key made with the answer's own rule.
                Decision::Store { .. }
                    if crate::cache::rules::changed(fill, &answered.parts.headers) =>
                {
                    Decision::Pass(PassReason::RuleChanged)
                }
                decision => decision,
            }
        }
    }
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
    match store::read_body(fill, body, declared, deadline).await {
        Buffered::Full(bytes) => {
            if let Err(e) = store::checked(fill, &parts, &bytes).await {
                return Ended::Outcome(synthetic::broke_off(fill, &e, parts.status));
            }
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
        Buffered::Failed(e) => Ended::Outcome(synthetic::broke_off(fill, &e, parts.status)),
    }
}

/// An answer that is neither stored nor shared: marked hit-for-pass
/// (unless only its framing was wrong) and streamed to the leader, read
/// ahead of a slow client so that the exchange ends at the origin's pace.
fn pass(fill: &FillRequest, answered: Answered, reason: PassReason) -> Ended {
    if !matches!(
        reason,
        PassReason::ConflictingFraming | PassReason::RuleChanged
    ) {
        fill.set_hit_for_pass();
    }
    let total = fill.exchange().upstream.total;
    let body = Body::new(crate::origin::ahead::read_ahead(
        DeadlineBody::new(answered.body, answered.deadline, total),
        fill.exchange().policy.max_object_size,
        fill.exchange().ahead_memory,
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
        PassReason::Private
        | PassReason::ConflictingFraming
        | PassReason::VaryStar
        | PassReason::DictionaryCompressed
        | PassReason::RuleChanged => false,
        PassReason::NoStore | PassReason::SetCookie => !post,
        _ => true,
    }
}

/// A 304 (or a HEAD's 200 that describes the entry) refreshed the stale
/// entry: store the refreshed copy.
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
    match fill
        .exchange()
        .policy
        .evaluate(&Method::GET, uri, &merged_parts, response_time)
    {
        Decision::Store { freshness } => {
            let refreshed =
                stale.revalidated(&merged_parts.headers, &freshness, response_time, stamp);
            // The representations it had, under the refreshed fields:
            // the content did not change, nothing is compressed again.
            let entry = Arc::new(crate::cache::compress::carried(stale, refreshed));
            let key = fill.entry_key(&entry);
            fill.l1()
                .insert(&key, fill.primary.uri(), Arc::clone(&entry));
            Ended::Outcome(FillOutcome::Stored {
                entry,
                fwd: Forward::Stale,
                fwd_status: Some(not_modified.status.as_u16()),
                own: HeaderMap::new(),
            })
        }
        Decision::Pass(reason) => {
            // The body is still right for this request, but the origin no
            // longer lets it be stored or shared.
            let key = fill.entry_key(stale);
            fill.l1().remove(&key);
            fill.set_hit_for_pass();
            let mut parts = merged_parts;
            parts.headers.remove(CONTENT_LENGTH);
            let body = Body::from(stale.body().clone());
            Ended::Stream(reason, pass_response(parts, body, Forward::Stale, reason))
        }
    }
}
