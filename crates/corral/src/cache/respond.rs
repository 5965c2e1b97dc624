//! Building answers: from a stored entry (with `Age`, conditional 304s and
//! HEAD), from a shared error, and corral's own error pages. Every answer
//! gets `Via` and exactly one `Cache-Status`, and travels as an [`Answer`]
//! with its typed label, so nothing reads the outcome back from the header.

use std::sync::Arc;
use std::time::SystemTime;

use axum::body::Body;
use bytes::Bytes;
use corral_core::semantics::head::RequestId;
use corral_core::semantics::range;
use corral_core::{CacheLabel, CacheStatus, Coding, Detail, Forward, StoredResponse};
use http::header::{
    AGE, CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE, DATE, ETAG, IF_MODIFIED_SINCE, IF_NONE_MATCH,
    IF_RANGE, LAST_MODIFIED, RANGE, VIA,
};
use http::{HeaderMap, HeaderValue, Response, StatusCode, Version};

use crate::cache::shared_body::SharedBody;
use crate::origin::request::via_value;

pub use corral_core::CACHE_STATUS;

/// A response on its way to the client, with what the cache did for it.
pub struct Answer {
    pub response: Response<Body>,
    /// The metric label and access-log `cache` field, from the same
    /// [`CacheStatus`] as the header.
    pub label: CacheLabel,
    /// What the `Cache-Status` header says, as the typed value it was
    /// written from.
    pub status: CacheStatus,
    /// A hit whose head an HTTP/1.1 connection copies from the entry
    /// ([`hit`]): then `response` holds only the status, and this is the
    /// answer.
    pub wire: Option<Box<Wire>>,
}

/// A whole answer from a stored entry, as an HTTP/1.1 connection writes
/// it: the entry's [`WireHead`](corral_core::model::entry::WireHead), then `Age`,
/// `Cache-Status` and `Content-Length`, `Date` where the head has none, and
/// the body. Made only where nothing is added to the answer after the
/// cache (see [`hit`]).
pub struct Wire {
    entry: Arc<StoredResponse>,
    age: u64,
    cache_status: HeaderValue,
    /// The request's `X-Request-Id`, echoed.
    request_id: Option<RequestId>,
}

impl Wire {
    /// Echoes the request's id on this answer.
    pub fn set_request_id(&mut self, id: RequestId) {
        self.request_id = Some(id);
    }
    /// The id echoed, or "".
    pub fn request_id(&self) -> &str {
        self.request_id.as_ref().map_or("", RequestId::as_str)
    }
    /// The id echoed, as the bytes of its field value.
    pub fn request_id_bytes(&self) -> Option<&[u8]> {
        self.request_id.as_ref().map(RequestId::as_bytes)
    }
    /// The status line and the entry's fields, each line ended.
    pub fn head(&self) -> &[u8] {
        self.entry.wire_head().map_or(&[], |w| &w.bytes)
    }
    /// The head has the origin's `Date`.
    pub fn dated(&self) -> bool {
        self.entry.wire_head().is_some_and(|w| w.dated)
    }
    pub fn age(&self) -> u64 {
        self.age
    }
    pub fn cache_status(&self) -> &HeaderValue {
        &self.cache_status
    }
    pub fn status(&self) -> StatusCode {
        self.entry.status()
    }
    pub fn body(&self) -> &Bytes {
        self.entry.body()
    }

    /// The same answer as a response with its header map, for a
    /// connection that encodes heads itself (hyper's).
    pub fn into_response(self) -> Response<Body> {
        let mut headers = self.entry.answer_head().clone();
        headers.insert(AGE, age_value(self.age));
        corral_core::put_own_cache_status(&mut headers, self.cache_status, true);
        if let Some(id) = self.request_id {
            headers.insert(
                corral_core::semantics::head::X_REQUEST_ID.clone(),
                id.to_value(),
            );
        }
        let mut res = Response::new(Body::from(self.entry.body().clone()));
        *res.status_mut() = self.entry.status();
        *res.headers_mut() = headers;
        res
    }
}

impl Answer {
    /// `response` with the headers every answer carries: `Via` and
    /// `status` as corral's `Cache-Status` member, after those of the
    /// caches before it (the exchange removed any in corral's name).
    pub fn new(mut response: Response<Body>, status: &CacheStatus, version: Version) -> Answer {
        let headers = response.headers_mut();
        headers.append(VIA, via_value(version));
        corral_core::put_own_cache_status(headers, status.to_header_value(), false);
        let label = status.label(response.status());
        Answer {
            response,
            label,
            status: status.clone(),
            wire: None,
        }
    }

    /// `response`, made from an entry's [`StoredResponse::answer_head`]
    /// (`Via` in place already), with `status` as corral's `Cache-Status`
    /// member (the head's last line, a placeholder until now).
    fn from_entry_head(mut response: Response<Body>, status: &CacheStatus) -> Answer {
        corral_core::put_own_cache_status(response.headers_mut(), status.to_header_value(), true);
        let label = status.label(response.status());
        Answer {
            response,
            label,
            status: status.clone(),
            wire: None,
        }
    }

    /// The same answer without its body (for HEAD): a [`Wire`] becomes
    /// the response it stands for, so no body is written from it.
    pub fn without_body(self) -> Answer {
        let response = match self.wire {
            Some(w) => w.into_response(),
            None => self.response,
        };
        let (parts, _) = response.into_parts();
        Answer {
            response: Response::from_parts(parts, Body::empty()),
            label: self.label,
            status: self.status,
            wire: None,
        }
    }
}

/// An answer from a stored entry.
pub fn from_entry(
    entry: &StoredResponse,
    status: &CacheStatus,
    now: SystemTime,
    head: bool,
    request: &HeaderMap,
) -> Answer {
    answer(entry, None, status, now, head, request)
}

/// A hit's answer from `entry`: with `wire`, and when the answer is the
/// whole entry (a GET, not conditional, not a range, a head the wire can
/// carry), as a [`Wire`], with no header map copied; otherwise as
/// [`from_entry`] makes it.
pub fn hit(
    entry: Arc<StoredResponse>,
    status: &CacheStatus,
    now: SystemTime,
    head: bool,
    request: &HeaderMap,
    wire: bool,
) -> Answer {
    // The compressed representation the caller accepts, if it has some.
    let entry = match entry.pick(request) {
        Some(encoded) => Arc::clone(encoded),
        None => entry,
    };
    if !wire || head || entry.wire_head().is_none() {
        return answer(&entry, None, status, now, head, request);
    }
    let asked = Preconditions::of(request);
    if asked.range.is_some() || (asked.if_none_match || asked.if_modified_since.is_some()) {
        return answer(&entry, None, status, now, head, request);
    }
    let mut response = Response::new(Body::empty());
    *response.status_mut() = entry.status();
    Answer {
        label: status.label(entry.status()),
        status: status.clone(),
        wire: Some(Box::new(Wire {
            age: entry.age_secs(now),
            cache_status: status.to_header_value(),
            entry,
            request_id: None,
        })),
        response,
    }
}

/// An answer from an entry whose body is still arriving: the same head
/// and conditionals as a stored one; the body read as it grows (a Range is
/// answered with the whole 200, as RFC 9110 §14 allows), in the coding
/// of `coded` the caller accepts, if it accepts one whose first bytes are
/// still there to read.
pub(crate) fn from_streaming(
    entry: &StoredResponse,
    body: &Arc<SharedBody>,
    coded: &[(Coding, Arc<SharedBody>)],
    status: &CacheStatus,
    now: SystemTime,
    head: bool,
    request: &HeaderMap,
) -> Answer {
    let offered: Vec<Coding> = coded
        .iter()
        .filter(|(_, g)| g.joinable())
        .map(|(c, _)| *c)
        .collect();
    let chosen = (!offered.is_empty())
        .then(|| corral_core::choose_coding(request, &offered))
        .flatten()
        .and_then(|c| {
            let head = entry.encoded().iter().find(|(e, _)| *e == c)?;
            let body = coded.iter().find(|(e, _)| *e == c)?;
            Some((&*head.1, &body.1))
        });
    match chosen {
        Some((entry, body)) => answer(entry, Some(body), status, now, head, request),
        None => answer(entry, Some(body), status, now, head, request),
    }
}

/// `entry`'s answer to `request`, its body the stored one or, while it
/// still arrives, `shared_body`.
fn answer(
    entry: &StoredResponse,
    growing: Option<&Arc<SharedBody>>,
    status: &CacheStatus,
    now: SystemTime,
    head: bool,
    request: &HeaderMap,
) -> Answer {
    // A stored body in the compressed representation the caller accepts,
    // if it has some (one still arriving is sent as it comes).
    let entry = match growing {
        None => entry.pick(request).map_or(entry, |e| &**e),
        Some(_) => entry,
    };
    // A copy of the entry's answer head, which has Age, Via and
    // Cache-Status in place already: two values replaced, nothing grown.
    let mut headers = entry.answer_head().clone();
    headers.insert(AGE, age_value(entry.age_secs(now)));
    // One pass over the request's headers for what may change the answer
    // (a hit pays for no lookup it does not need).
    let asked = Preconditions::of(request);
    let not_modified = entry.status() == StatusCode::OK && not_modified(entry, request, &asked);
    let (code, body) = if not_modified {
        headers.remove(CONTENT_LENGTH);
        (StatusCode::NOT_MODIFIED, Body::empty())
    } else if let Some(growing) = growing {
        // The head was built without its body: the length is the one
        // being streamed, or none (chunked on HTTP/1.1).
        match growing.len() {
            Some(len) => headers.insert(CONTENT_LENGTH, HeaderValue::from(len)),
            None => headers.remove(CONTENT_LENGTH),
        };
        let body = if head {
            Body::empty()
        } else {
            Body::new(growing.reader())
        };
        (entry.status(), body)
    } else if head {
        (entry.status(), Body::empty())
    } else if let (StatusCode::OK, Some(range)) = (entry.status(), asked.range) {
        // A complete response answers a Range request itself (RFC 9110
        // §14): the fill always fetched the whole representation.
        ranged(entry, range, asked.if_range, &mut headers)
    } else {
        (entry.status(), Body::from(entry.body().clone()))
    };
    let mut res = Response::new(body);
    *res.status_mut() = code;
    *res.headers_mut() = headers;
    Answer::from_entry_head(res, status)
}

/// `Age: secs`, made without an allocation below 10,000 seconds.
fn age_value(secs: u64) -> HeaderValue {
    corral_core::semantics::h1::small_decimal(secs)
        .and_then(|d| HeaderValue::from_maybe_shared(Bytes::from_static(d)).ok())
        .unwrap_or_else(|| HeaderValue::from(secs))
}

/// The request headers that make an answer from an entry conditional or
/// partial.
#[derive(Default)]
struct Preconditions<'a> {
    if_none_match: bool,
    if_modified_since: Option<&'a HeaderValue>,
    range: Option<&'a HeaderValue>,
    if_range: Option<&'a HeaderValue>,
}

impl<'a> Preconditions<'a> {
    fn of(request: &'a HeaderMap) -> Self {
        let mut asked = Preconditions::default();
        for (name, value) in request {
            if name == IF_NONE_MATCH {
                asked.if_none_match = true;
            } else if name == IF_MODIFIED_SINCE {
                asked.if_modified_since.get_or_insert(value);
            } else if name == RANGE {
                asked.range.get_or_insert(value);
            } else if name == IF_RANGE {
                asked.if_range.get_or_insert(value);
            }
        }
        asked
    }
}

/// The answer to a GET with `range` for a stored 200: the part it selects
/// (206), a 416, or the whole body; `headers` gets the framing to match.
fn ranged(
    entry: &StoredResponse,
    range: &HeaderValue,
    if_range: Option<&HeaderValue>,
    headers: &mut HeaderMap,
) -> (StatusCode, Body) {
    let body = entry.body();
    let len = body.len() as u64;
    let validators = range::Validators {
        etag: entry.headers().get(ETAG),
        last_modified: entry.headers().get(LAST_MODIFIED),
        date: entry.headers().get(DATE),
    };
    match range::select(Some(range), if_range, len, validators) {
        range::Selected::Full => (StatusCode::OK, Body::from(body.clone())),
        range::Selected::Part { first, last } => {
            headers.remove(CONTENT_LENGTH);
            headers.insert(
                CONTENT_RANGE,
                HeaderValue::from_str(&format!("bytes {first}-{last}/{len}"))
                    .unwrap_or(HeaderValue::from_static("bytes */0")),
            );
            let (from, to) = (
                usize::try_from(first).unwrap_or(usize::MAX),
                usize::try_from(last).unwrap_or(usize::MAX),
            );
            (
                StatusCode::PARTIAL_CONTENT,
                Body::from(body.slice(from..=to)),
            )
        }
        range::Selected::Unsatisfiable => {
            headers.remove(CONTENT_LENGTH);
            headers.insert(
                CONTENT_RANGE,
                HeaderValue::from_str(&format!("bytes */{len}"))
                    .unwrap_or(HeaderValue::from_static("bytes */0")),
            );
            (StatusCode::RANGE_NOT_SATISFIABLE, Body::empty())
        }
    }
}

/// RFC 9110 §13.2.2 for a stored 200: If-None-Match when the request has
/// it, else If-Modified-Since against the entry's Last-Modified (or, per
/// RFC 9111 §4.3.2, its Date, or when it was received).
fn not_modified(entry: &StoredResponse, request: &HeaderMap, asked: &Preconditions<'_>) -> bool {
    if asked.if_none_match {
        return etag_matches(request, entry.headers().get(ETAG));
    }
    let Some(since) = asked
        .if_modified_since
        .and_then(|v| v.to_str().ok())
        .and_then(corral_core::semantics::rfc9111::parse_http_date)
    else {
        return false;
    };
    let modified = [LAST_MODIFIED, DATE]
        .iter()
        .find_map(|h| {
            entry
                .headers()
                .get(h)
                .and_then(|v| v.to_str().ok())
                .and_then(corral_core::semantics::rfc9111::parse_http_date)
        })
        .unwrap_or_else(|| entry.response_time());
    modified <= since
}

/// RFC 9110 §13.1.2: weak comparison of If-None-Match against the entry's ETag.
fn etag_matches(request: &HeaderMap, etag: Option<&HeaderValue>) -> bool {
    let Some(etag) = etag.and_then(|e| e.to_str().ok()) else {
        return false;
    };
    let etag = etag.trim().trim_start_matches("W/");
    request
        .get_all(IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .any(|t| t == "*" || t.trim_start_matches("W/") == etag)
}

/// corral's own short error answer.
pub fn error(code: StatusCode, fwd: Forward, detail: Detail, fwd_status: Option<u16>) -> Answer {
    let mut st = CacheStatus::forward(fwd).with_detail(detail);
    st.fwd_status = fwd_status;
    let mut res = Response::new(Body::from(error_body(code, detail)));
    *res.status_mut() = code;
    res.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    res.headers_mut().insert(
        corral_core::PROXY_STATUS.clone(),
        corral_core::proxy_status(detail, fwd_status),
    );
    Answer::new(res, &st, Version::HTTP_11)
}

/// The short text body of corral's own errors.
pub fn error_body(code: StatusCode, detail: Detail) -> Bytes {
    let reason = code.canonical_reason().unwrap_or("error");
    Bytes::from(format!(
        "{} {reason} ({})\n",
        code.as_u16(),
        detail.as_str()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wire_hit_without_its_body_is_the_head_it_stands_for() {
        let mut headers = HeaderMap::new();
        headers.insert(ETAG, HeaderValue::from_static("\"v\""));
        let freshness = corral_core::Freshness {
            ttl: std::time::Duration::from_secs(60),
            swr: std::time::Duration::ZERO,
            sie: std::time::Duration::ZERO,
            sharing: corral_core::Sharing::Everyone,
        };
        let now = SystemTime::now();
        let entry = StoredResponse::builder(
            StatusCode::OK,
            headers,
            Bytes::from_static(b"body"),
            &freshness,
            now,
        )
        .build();
        let status = CacheStatus::hit(60);
        let wire = hit(
            Arc::new(entry.clone()),
            &status,
            now,
            false,
            &HeaderMap::new(),
            true,
        );
        assert!(wire.wire.is_some());
        // Not asked for, conditional or HEAD: a response, as before.
        for (head, wire_ok, request) in [
            (false, false, HeaderMap::new()),
            (true, true, HeaderMap::new()),
            (false, true, {
                let mut h = HeaderMap::new();
                h.insert(IF_NONE_MATCH, HeaderValue::from_static("\"v\""));
                h
            }),
        ] {
            let a = hit(
                Arc::new(entry.clone()),
                &status,
                now,
                head,
                &request,
                wire_ok,
            );
            assert!(a.wire.is_none(), "{head} {wire_ok}");
        }
        let bare = wire.without_body();
        assert!(bare.wire.is_none());
        let h = bare.response.headers();
        assert_eq!(h.get(ETAG), Some(&HeaderValue::from_static("\"v\"")));
        assert_eq!(h.get(AGE), Some(&HeaderValue::from_static("0")));
        assert!(h.get(&CACHE_STATUS).is_some());
        assert!(http_body::Body::is_end_stream(bare.response.body()));
    }

    #[test]
    fn if_none_match_uses_weak_comparison() {
        let mut h = HeaderMap::new();
        h.insert(IF_NONE_MATCH, HeaderValue::from_static("\"a\", W/\"b\""));
        assert!(etag_matches(&h, Some(&HeaderValue::from_static("\"b\""))));
        assert!(etag_matches(&h, Some(&HeaderValue::from_static("W/\"a\""))));
        assert!(!etag_matches(&h, Some(&HeaderValue::from_static("\"c\""))));
        assert!(!etag_matches(
            &HeaderMap::new(),
            Some(&HeaderValue::from_static("\"a\""))
        ));
    }
}
