//! A stored response and its lifecycle: fresh, stale but usable while one
//! refresh runs (stale-while-revalidate), usable only when the origin fails
//! (stale-if-error), or expired. Bodies are `Bytes`, shared, never copied
//! per hit. An entry owns compact copies of its headers (never slices of a
//! connection's read buffer, which would keep the whole buffer alive), and
//! its [`StoredResponse::weight`] is what it really holds in memory.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header::{
    AGE, CONNECTION, CONTENT_ENCODING, CONTENT_LENGTH, ETAG, HeaderName, LAST_MODIFIED, SET_COOKIE,
    TRAILER, TRANSFER_ENCODING, VIA,
};
use http::{HeaderMap, HeaderValue, StatusCode};

use crate::model::policy::{Freshness, Sharing};
use crate::semantics::coding::{Accepted, Coding};
use crate::semantics::vary::Vary;

/// Entries with a validator are kept this much past their stale windows so
/// they can still be revalidated with a cheap 304.
pub const REVALIDATION_GRACE: Duration = Duration::from_secs(3600);

/// Entries without one are kept this much past their stale windows (as
/// long as Varnish's default grace), so that a HEAD soon after they expire
/// can still freshen them (RFC 9111 §4.3.5) rather than fill them again
/// with a GET. Short: a GET gains nothing from such a copy.
pub const HEAD_GRACE: Duration = Duration::from_secs(10);
/// No entry stays in memory longer than this, whatever the origin allowed.
pub const MAX_RESIDENCY: Duration = Duration::from_secs(7 * 86400);

/// Where an entry stands at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryState {
    Fresh,
    /// Serve it and refresh in the background.
    StaleWhileRevalidate,
    /// Serve it only if the origin fails.
    StaleIfError,
    /// Only good for a conditional revalidation.
    Expired,
}

/// One stored response.
#[derive(Debug, Clone)]
pub struct StoredResponse {
    pub(crate) status: StatusCode,
    /// End-to-end headers as received (hop-by-hop already removed).
    pub(crate) headers: HeaderMap,
    /// `headers` as every answer from this entry starts: with `Age`,
    /// corral's `Via` and `Cache-Status` in their places, the first and
    /// last with values each answer replaces ([`answer_head`]).
    pub(crate) answer_head: HeaderMap,
    /// `answer_head` as HTTP/1.1 writes it, for the answers that copy it
    /// whole ([`wire_head`]).
    pub(crate) wire: Option<WireHead>,
    pub(crate) body: Bytes,
    /// The origin's `Age` when the response arrived (RFC 9111 §4.2.3).
    pub(crate) initial_age: Duration,
    pub(crate) response_time: SystemTime,
    pub(crate) fresh_until: SystemTime,
    pub(crate) swr: Duration,
    pub(crate) sie: Duration,
    /// How long the origin took: the XFetch delta.
    pub(crate) fetch_duration: Duration,
    pub(crate) vary: Vary,
    /// The normalized values of the Vary headers of the request that
    /// produced this response.
    pub(crate) vary_values: Vec<String>,
    /// The L1 invalidation stamp read when the fetch started.
    pub(crate) generation: u64,
    /// Keyed to one caller's credentials.
    pub(crate) private: bool,
    /// RFC 9111 §3.5: which identified callers besides the one who asked
    /// may be served this entry.
    pub(crate) sharing: Sharing,
    /// The readable URI key (`host/path?query`), for prefix purges. Not
    /// part of the L2 envelope: whoever reads an entry knows its URI.
    pub(crate) uri: Arc<str>,
    /// The same answer compressed, one entry per coding (made once, when
    /// it is stored; an answer picks among them: [`StoredResponse::pick`]).
    /// Not part of the L2 envelope: each instance compresses what it
    /// stores.
    pub(crate) encoded: Vec<(Coding, Arc<StoredResponse>)>,
    /// Codings the route makes for this answer are not all made yet: they
    /// are made when a caller first asks for one (see
    /// [`StoredResponse::codings_pending`]).
    pub(crate) pending: bool,
}

impl StoredResponse {
    /// A stored response from what the origin sent and how fresh it is;
    /// the rest (fetch time, Vary, generation, privacy) is set on the
    /// builder and defaults to none.
    pub fn builder(
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
        freshness: &Freshness,
        response_time: SystemTime,
    ) -> StoredResponseBuilder {
        StoredResponseBuilder {
            status,
            headers,
            body,
            freshness: freshness.clone(),
            response_time,
            fetch_duration: Duration::ZERO,
            vary: Vary::None,
            vary_values: Vec::new(),
            generation: 0,
            private: false,
        }
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// This answer in another representation: `headers` and `body` (the
    /// same freshness, Vary and sharing), with a Content-Length of its own.
    pub fn representation(&self, mut headers: HeaderMap, body: Bytes) -> StoredResponse {
        headers.insert(CONTENT_LENGTH, HeaderValue::from(body.len()));
        let answer_head = answer_head(&headers);
        StoredResponse {
            wire: wire_head(self.status, &answer_head),
            answer_head,
            headers,
            body,
            encoded: Vec::new(),
            pending: false,
            ..self.clone()
        }
    }

    /// The same entry, answering callers that accept one of `encoded`'s
    /// codings with that representation (in that order of preference).
    pub fn with_encoded(mut self, encoded: Vec<(Coding, Arc<StoredResponse>)>) -> Self {
        self.encoded = encoded;
        self
    }

    /// The same entry, marked as one whose route makes codings not made
    /// yet (`pending`), or as complete.
    pub fn with_codings_pending(mut self, pending: bool) -> Self {
        self.pending = pending;
        self
    }

    /// True when a coding the route makes for this answer is not made
    /// yet: a caller that asks for one has it made (once) for those who
    /// come after. One load on the hit path.
    #[inline]
    pub fn codings_pending(&self) -> bool {
        self.pending
    }

    /// The compressed representations.
    pub fn encoded(&self) -> &[(Coding, Arc<StoredResponse>)] {
        &self.encoded
    }

    /// The representation to answer `request` with, when it is not this
    /// one: the compressed one the caller accepts best.
    #[inline]
    pub fn pick(&self, request: &HeaderMap) -> Option<&Arc<StoredResponse>> {
        if self.encoded.is_empty() {
            return None;
        }
        Accepted::of(request)?.best(self.encoded.iter().map(|(c, e)| (*c, e)))
    }
    /// End-to-end headers as received (hop-by-hop already removed).
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }
    /// The head an answer from this entry copies: see [`answer_head`].
    pub fn answer_head(&self) -> &HeaderMap {
        &self.answer_head
    }
    /// The answer head's bytes on an HTTP/1.1 connection: see [`wire_head`].
    pub fn wire_head(&self) -> Option<&WireHead> {
        self.wire.as_ref()
    }
    pub fn body(&self) -> &Bytes {
        &self.body
    }
    /// The same entry with its body replaced by `f(body)` (the same bytes
    /// kept elsewhere, e.g. in sealed memory).
    pub fn map_body(mut self, f: impl FnOnce(Bytes) -> Bytes) -> Self {
        self.body = f(std::mem::take(&mut self.body));
        self
    }
    /// The origin's `Age` when the response arrived (RFC 9111 §4.2.3).
    pub fn initial_age(&self) -> Duration {
        self.initial_age
    }
    pub fn response_time(&self) -> SystemTime {
        self.response_time
    }
    pub fn fresh_until(&self) -> SystemTime {
        self.fresh_until
    }
    pub fn swr(&self) -> Duration {
        self.swr
    }
    pub fn sie(&self) -> Duration {
        self.sie
    }
    /// How long the origin took: the XFetch delta.
    pub fn fetch_duration(&self) -> Duration {
        self.fetch_duration
    }
    pub fn vary(&self) -> &Vary {
        &self.vary
    }
    /// The normalized values of the Vary headers of the request that
    /// produced this response.
    pub fn vary_values(&self) -> &[String] {
        &self.vary_values
    }
    /// The L1 invalidation stamp read when the fetch started.
    pub fn generation(&self) -> u64 {
        self.generation
    }
    /// Keyed to one caller's credentials.
    pub fn private(&self) -> bool {
        self.private
    }
    /// RFC 9111 §3.5: which identified callers besides the one who asked
    /// may be served this entry.
    pub fn sharing(&self) -> Sharing {
        self.sharing
    }
    /// The readable URI key (`host/path?query`), for prefix purges.
    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// The same entry, labelled with its URI key.
    pub fn with_uri(mut self, uri: &str) -> Self {
        self.uri = Arc::from(uri);
        self
    }

    pub fn state(&self, now: SystemTime) -> EntryState {
        if now < self.fresh_until {
            return EntryState::Fresh;
        }
        let past = now.duration_since(self.fresh_until).unwrap_or_default();
        if past < self.swr {
            EntryState::StaleWhileRevalidate
        } else if past < self.sie {
            EntryState::StaleIfError
        } else {
            EntryState::Expired
        }
    }

    /// True while stale-if-error still allows serving this entry.
    pub fn usable_on_error(&self, now: SystemTime) -> bool {
        now < later(self.fresh_until, self.sie.max(self.swr))
    }

    /// Remaining freshness in whole seconds, negative once stale.
    pub fn ttl_secs(&self, now: SystemTime) -> i64 {
        match self.fresh_until.duration_since(now) {
            Ok(left) => i64::try_from(left.as_secs()).unwrap_or(i64::MAX),
            Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(i64::MAX),
        }
    }

    /// The `Age` to send (RFC 9111 §4.2.3): the origin's own Age plus the
    /// time since the response arrived.
    pub fn age_secs(&self, now: SystemTime) -> u64 {
        let resident = now.duration_since(self.response_time).unwrap_or_default();
        self.initial_age.saturating_add(resident).as_secs()
    }

    pub fn has_validators(&self) -> bool {
        self.headers.contains_key(ETAG) || self.headers.contains_key(LAST_MODIFIED)
    }

    /// True when `request` selects this variant.
    pub fn matches_vary(&self, request: &HeaderMap) -> bool {
        self.vary.values(request) == self.vary_values
    }

    /// How long L1 keeps this entry from `now`.
    pub fn residency(&self, now: SystemTime) -> Duration {
        let grace = if self.has_validators() {
            REVALIDATION_GRACE
        } else {
            HEAD_GRACE
        };
        later(later(self.fresh_until, self.swr.max(self.sie)), grace)
            .duration_since(now)
            .unwrap_or_default()
            .min(MAX_RESIDENCY)
    }

    /// Bytes this entry costs in L1: everything it holds (the record, its
    /// header table, every header name and value, the body, the Vary values,
    /// the URI label) and what the store spends to keep it.
    pub fn weight(&self) -> u32 {
        // A body this large may be kept in a sealed memory file by the
        // server, which occupies whole pages; counted so either way.
        let body = if self.body.len() >= PAGE_BACKED_BODY {
            self.body.len().div_ceil(4096) * 4096
        } else {
            heap_bytes(self.body.len())
        };
        let vary: usize = self
            .vary_values
            .iter()
            .map(|v| std::mem::size_of::<String>() + heap_bytes(v.len()))
            .sum::<usize>()
            + std::mem::size_of_val(self.vary.names());
        let total = std::mem::size_of::<Self>()
            + STORE_OVERHEAD
            + header_map_bytes(&self.headers)
            + header_map_bytes(&self.answer_head)
            + self.wire.as_ref().map_or(0, |w| heap_bytes(w.bytes.len()))
            + body
            + vary
            + heap_bytes(self.uri.len())
            + self
                .encoded
                .iter()
                .map(|(_, e)| e.weight() as usize)
                .sum::<usize>();
        u32::try_from(total).unwrap_or(u32::MAX)
    }

    /// This entry refreshed by a 304, with `headers` from
    /// [`merge_not_modified`].
    pub fn revalidated(
        &self,
        headers: &HeaderMap,
        freshness: &Freshness,
        response_time: SystemTime,
        generation: u64,
    ) -> Self {
        // The 304's `no-cache="..."` names fields it may carry itself.
        let headers = compact(headers, &no_cache_fields(headers));
        let answer_head = answer_head(&headers);
        StoredResponse {
            initial_age: initial_age(&headers),
            wire: wire_head(self.status, &answer_head),
            answer_head,
            headers,
            response_time,
            fresh_until: later(response_time, freshness.ttl),
            swr: freshness.swr,
            sie: freshness.sie,
            sharing: freshness.sharing,
            generation,
            // Compressed again by whoever stores the refreshed copy.
            encoded: Vec::new(),
            pending: false,
            ..self.clone()
        }
    }
}

/// Builds a [`StoredResponse`]; see [`StoredResponse::builder`].
#[derive(Debug)]
pub struct StoredResponseBuilder {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    freshness: Freshness,
    response_time: SystemTime,
    fetch_duration: Duration,
    vary: Vary,
    vary_values: Vec<String>,
    generation: u64,
    private: bool,
}

impl StoredResponseBuilder {
    pub fn fetch_duration(mut self, d: Duration) -> Self {
        self.fetch_duration = d;
        self
    }
    /// The response's Vary and the request's values for it.
    pub fn vary(mut self, vary: Vary, values: Vec<String>) -> Self {
        self.vary = vary;
        self.vary_values = values;
        self
    }
    pub fn generation(mut self, generation: u64) -> Self {
        self.generation = generation;
        self
    }
    pub fn private(mut self, private: bool) -> Self {
        self.private = private;
        self
    }

    pub fn build(self) -> StoredResponse {
        // A stored copy never hands one caller's cookie to another, nor a
        // field the origin named in `no-cache="..."` (RFC 9111 §5.2.2.4:
        // reused without revalidation only without them).
        let mut drop = vec![SET_COOKIE, TRANSFER_ENCODING];
        drop.extend(no_cache_fields(&self.headers));
        let mut headers = compact(&self.headers, &drop);
        headers.insert(CONTENT_LENGTH, HeaderValue::from(self.body.len()));
        let answer_head = answer_head(&headers);
        StoredResponse {
            status: self.status,
            initial_age: initial_age(&headers),
            wire: wire_head(self.status, &answer_head),
            answer_head,
            headers,
            body: self.body,
            response_time: self.response_time,
            fresh_until: later(self.response_time, self.freshness.ttl),
            swr: self.freshness.swr,
            sie: self.freshness.sie,
            fetch_duration: self.fetch_duration,
            vary: self.vary,
            vary_values: self.vary_values,
            generation: self.generation,
            private: self.private,
            sharing: self.freshness.sharing,
            uri: Arc::from(""),
            encoded: Vec::new(),
            pending: false,
        }
    }
}

/// Bodies at least this long may be kept page-backed (the server's sealed
/// memory files) rather than on the heap, and are weighed in whole pages.
pub const PAGE_BACKED_BODY: usize = 16 * 1024;

/// What the store spends per entry beyond the entry itself: its map slot,
/// access and write order nodes, the expiry timer node, the key and the
/// `Arc` around the entry. Measured (see the `entry_weight_matches_rss`
/// test in `store.rs`), not guessed.
pub const STORE_OVERHEAD: usize = 448;

/// What an allocation of `len` bytes costs the allocator (glibc: a 16-byte
/// granularity and an 8-byte header).
pub fn heap_bytes(len: usize) -> usize {
    if len == 0 {
        0
    } else {
        (len + 8).div_ceil(16) * 16
    }
}

/// What a header map holds: its tables and every name and value.
pub fn header_map_bytes(headers: &HeaderMap) -> usize {
    const BUCKET: usize =
        std::mem::size_of::<HeaderName>() + std::mem::size_of::<HeaderValue>() + 24;
    let fields: usize = headers
        .iter()
        // Standard names are static; counting every name errs on the safe side.
        .map(|(n, v)| heap_bytes(n.as_str().len()) + heap_bytes(v.len()))
        .sum();
    std::mem::size_of::<HeaderMap>() + headers.capacity() * (BUCKET + 8) + fields
}

/// corral's `Via` entry on an answer over HTTP/1.1 (the version every
/// answer from an entry is built as).
pub const VIA_1_1: &str = "1.1 corral";

/// `headers` as an answer from an entry starts: `Age` (replacing the
/// origin's, in its place), corral's `Via` after the origin's, and
/// corral's `Cache-Status` member after those of the caches before it
/// (RFC 9211 §2; none of them in corral's name, which the exchange
/// removed). `Age` and corral's `Cache-Status` line hold placeholders each
/// answer replaces in place. Built once per entry,
/// with the same operations an answer made per hit before, so an answer
/// is a copy of this map with two values replaced: no name hashed into a
/// new slot, no table grown.
pub fn answer_head(headers: &HeaderMap) -> HeaderMap {
    // One slot more than it holds: `HeaderMap::insert` makes room for a
    // new name before it looks for the old one, and a full table would
    // grow at every answer's first insert.
    let mut head = HeaderMap::with_capacity(headers.len() + 4);
    for (name, value) in headers {
        head.append(name.clone(), value.clone());
    }
    head.insert(AGE, HeaderValue::from_static("0"));
    head.append(VIA, HeaderValue::from_static(VIA_1_1));
    head.append(
        crate::CACHE_STATUS.clone(),
        HeaderValue::from_static(crate::semantics::cache_status::name()),
    );
    head
}

/// An entry's answer head as an HTTP/1.1 server writes it: the status
/// line, then every field of [`answer_head`] but the three each answer
/// writes for itself (`Age` and corral's `Cache-Status` line, whose values
/// change, and `Content-Length`, which is the body's), each `name: value`
/// and CRLF,
/// in the map's order. A plain hit on HTTP/1.1 copies these bytes and adds
/// those three fields (and `Date` when `dated` is false), instead of
/// copying the map and encoding it field by field.
#[derive(Debug, Clone)]
pub struct WireHead {
    pub bytes: Bytes,
    /// The head has its own `Date` (the origin's, RFC 9110 §6.6.1).
    pub dated: bool,
}

/// `head` (an entry's [`answer_head`], answered with `status`) as a
/// [`WireHead`]; `None` where a copy of it cannot answer: a status without
/// a body (1xx, 204, 304), or a field that frames the body or governs the
/// connection (`Transfer-Encoding`, `Connection`, `Trailer`), which only
/// the field-by-field encoder handles.
pub fn wire_head(status: StatusCode, head: &HeaderMap) -> Option<WireHead> {
    if status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return None;
    }
    let mut out = Vec::with_capacity(64 + head.len() * 32);
    if status == StatusCode::OK {
        out.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
    } else {
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(status.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(status.canonical_reason().unwrap_or("<none>").as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    let mut dated = false;
    // The caches' members before corral's, which is the last line.
    let mut inbound = head
        .get_all(&crate::CACHE_STATUS)
        .iter()
        .count()
        .saturating_sub(1);
    for (name, value) in head {
        if name == TRANSFER_ENCODING || name == CONNECTION || name == TRAILER {
            return None;
        }
        if name == crate::CACHE_STATUS && inbound > 0 {
            inbound -= 1;
        } else if name == AGE || name == crate::CACHE_STATUS || name == CONTENT_LENGTH {
            continue;
        }
        dated |= name == http::header::DATE;
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    Some(WireHead {
        // Shrunk to fit: the entry's weight counts its length.
        bytes: Bytes::from(out.into_boxed_slice()),
        dated,
    })
}

/// The fields `headers`' Cache-Control names in `no-cache="..."`: a stored
/// copy is reused without them (RFC 9111 §5.2.2.4).
fn no_cache_fields(headers: &HeaderMap) -> Vec<HeaderName> {
    if headers.contains_key(http::header::CACHE_CONTROL) {
        crate::CacheControl::parse(headers).no_cache_fields
    } else {
        Vec::new()
    }
}

/// A copy of `headers` without `drop`, every value in its own allocation
/// and the table sized to fit: nothing in it points into the buffer the
/// headers were read from.
pub fn compact(headers: &HeaderMap, drop: &[HeaderName]) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(headers.keys_len());
    for (name, value) in headers {
        if drop.contains(name) {
            continue;
        }
        let value = HeaderValue::from_bytes(value.as_bytes()).unwrap_or_else(|_| value.clone());
        out.append(name.clone(), value);
    }
    out
}

/// The `Age` the origin sent, in seconds (already sanitized to digits).
fn initial_age(headers: &HeaderMap) -> Duration {
    headers
        .get(AGE)
        .and_then(crate::semantics::rfc9111::first_age)
        .map_or(Duration::ZERO, Duration::from_secs)
}

/// `t + d`, saturating far in the future instead of overflowing: the
/// durations come from origin headers and L2 values.
fn later(t: SystemTime, d: Duration) -> SystemTime {
    t.checked_add(d.min(MAX_RESIDENCY * 1000)).unwrap_or(t)
}

/// Fields a 304 never changes in the stored response (RFC 9111 §3.2):
/// the framing of the stored bytes, and Set-Cookie, which a shared entry
/// never carries. Every other field the 304 carries replaces the stored
/// one, Content-Encoding and ETag included: corral stores the bytes as the
/// origin sent them, so none of the fields is one "the stored response
/// depends upon" in §3.2's sense.
const KEPT_ON_304: [&str; 3] = ["content-length", "transfer-encoding", "set-cookie"];

/// The stored headers updated by a 304's: each field the 304 carries
/// replaces the stored field of that name (RFC 9111 §3.2), except those in
/// [`KEPT_ON_304`].
pub fn merge_not_modified(stored: &HeaderMap, not_modified: &HeaderMap) -> HeaderMap {
    let mut headers = stored.clone();
    let names: Vec<&HeaderName> = not_modified
        .keys()
        .filter(|n| !KEPT_ON_304.contains(&n.as_str()))
        .collect();
    for name in names {
        headers.remove(name);
        for v in not_modified.get_all(name) {
            headers.append(name.clone(), v.clone());
        }
    }
    headers
}

impl StoredResponse {
    /// True when a 200 answer to a HEAD of this entry's URI, with
    /// `head`'s fields, describes this stored GET answer (RFC 9111
    /// §4.3.5): the stored answer is a 200 too, each validator the HEAD answer carries (ETag,
    /// Last-Modified) is the stored one, its Content-Length (if any) is the
    /// stored body's, and it names the same Vary and content coding. Only
    /// then may its fields freshen the entry; otherwise the entry is to be
    /// considered stale. Nothing but what the answer carries is compared:
    /// one with no validator and no length describes any entry, as the
    /// RFC reads.
    pub fn described_by(&self, head: &HeaderMap) -> bool {
        let same = |name: &HeaderName| {
            let theirs: Vec<&HeaderValue> = head.get_all(name).iter().collect();
            theirs.is_empty() || theirs == self.headers.get_all(name).iter().collect::<Vec<_>>()
        };
        let length = match head.get(CONTENT_LENGTH) {
            None => true,
            Some(v) => v
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .is_some_and(|n| n == self.body.len() as u64),
        };
        let coding = head.get_all(CONTENT_ENCODING).iter().collect::<Vec<_>>()
            == self
                .headers
                .get_all(CONTENT_ENCODING)
                .iter()
                .collect::<Vec<_>>();
        self.status == StatusCode::OK
            && same(&ETAG)
            && same(&LAST_MODIFIED)
            && length
            && coding
            && Vary::parse(head) == self.vary
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn entry(ttl: u64, swr: u64, sie: u64) -> StoredResponse {
        let now = SystemTime::now();
        let fr = Freshness {
            ttl: Duration::from_secs(ttl),
            swr: Duration::from_secs(swr),
            sie: Duration::from_secs(sie),
            sharing: Sharing::Everyone,
        };
        let mut h = HeaderMap::new();
        h.insert("etag", HeaderValue::from_static("\"v1\""));
        h.insert("x-a", HeaderValue::from_static("1"));
        h.insert("set-cookie", HeaderValue::from_static("s=1"));
        StoredResponse::builder(StatusCode::OK, h, Bytes::from_static(b"hello"), &fr, now)
            .fetch_duration(Duration::from_millis(10))
            .build()
    }

    #[test]
    fn states_follow_the_windows() {
        let e = entry(10, 5, 20);
        let t = e.response_time;
        assert_eq!(e.state(t), EntryState::Fresh);
        assert_eq!(
            e.state(t + Duration::from_secs(12)),
            EntryState::StaleWhileRevalidate
        );
        assert_eq!(
            e.state(t + Duration::from_secs(20)),
            EntryState::StaleIfError
        );
        assert_eq!(e.state(t + Duration::from_secs(31)), EntryState::Expired);
        assert_eq!(e.ttl_secs(t + Duration::from_secs(13)), -3);
        assert!(e.usable_on_error(t + Duration::from_secs(29)));
        assert!(!e.usable_on_error(t + Duration::from_secs(30)));
    }

    #[test]
    fn stored_copy_drops_set_cookie_and_states_its_length() {
        let e = entry(10, 0, 0);
        assert!(e.headers.get("set-cookie").is_none());
        assert_eq!(
            e.headers.get("content-length").map(|v| v.as_bytes()),
            Some(&b"5"[..])
        );
        // validators keep the entry around for a 304 after it expired.
        assert!(e.residency(e.response_time) > REVALIDATION_GRACE);
    }

    #[test]
    fn revalidation_replaces_named_headers_only() {
        let e = entry(0, 0, 0);
        let mut h304 = HeaderMap::new();
        h304.insert("x-a", HeaderValue::from_static("2"));
        h304.insert("content-length", HeaderValue::from_static("0"));
        // The validator and the content coding are the origin's to update.
        h304.insert("etag", HeaderValue::from_static("\"other\""));
        h304.insert("content-encoding", HeaderValue::from_static("gzip"));
        let fr = Freshness {
            ttl: Duration::from_secs(60),
            swr: Duration::ZERO,
            sie: Duration::ZERO,
            sharing: Sharing::Everyone,
        };
        let later = e.response_time + Duration::from_secs(5);
        let r = e.revalidated(&merge_not_modified(&e.headers, &h304), &fr, later, 3);
        assert_eq!(r.headers.get("x-a").map(|v| v.as_bytes()), Some(&b"2"[..]));
        assert_eq!(
            r.headers.get("content-length").map(|v| v.as_bytes()),
            Some(&b"5"[..])
        );
        assert_eq!(
            r.headers.get("etag").map(|v| v.as_bytes()),
            Some(&b"\"other\""[..])
        );
        assert_eq!(
            r.headers.get("content-encoding").map(|v| v.as_bytes()),
            Some(&b"gzip"[..])
        );
        assert_eq!(r.state(later), EntryState::Fresh);
        assert_eq!(r.body, e.body);
    }

    #[test]
    fn age_is_the_origins_plus_time_resident() {
        let mut e = entry(10, 0, 0);
        assert_eq!(e.age_secs(e.response_time), 0);
        e.initial_age = Duration::from_secs(7);
        assert_eq!(e.age_secs(e.response_time + Duration::from_secs(3)), 10);
        // A clock that went back never makes Age negative.
        assert_eq!(e.age_secs(e.response_time - Duration::from_secs(3)), 7);
    }

    #[test]
    fn stored_headers_do_not_share_the_buffer_they_were_read_from() {
        // One big buffer, as a connection's read buffer; the header value
        // is a slice of it.
        let buffer = Bytes::from(vec![b'v'; 64 * 1024]);
        let mut h = HeaderMap::new();
        h.insert(
            "x-slice",
            HeaderValue::from_maybe_shared(buffer.slice(0..4)).expect("value"),
        );
        let stored = compact(&h, &[]);
        let kept = stored.get("x-slice").expect("kept");
        assert_eq!(kept.as_bytes(), b"vvvv");
        let original = h.get("x-slice").expect("original").as_bytes().as_ptr();
        assert_ne!(kept.as_bytes().as_ptr(), original, "a copy, not a slice");
    }

    #[test]
    fn the_answer_head_is_the_stored_head_with_age_via_and_cache_status_in_place() {
        // From 0 to 20 stored fields, some of them the three an answer
        // sets, some names repeated.
        for n in 0..20 {
            let mut stored = HeaderMap::new();
            for i in 0..n {
                let name = match i % 7 {
                    3 => AGE,
                    5 => VIA,
                    6 => crate::CACHE_STATUS.clone(),
                    _ => HeaderName::from_bytes(format!("x-{}", i % 4).as_bytes()).expect("name"),
                };
                stored.append(name, HeaderValue::from(i));
            }
            let head = answer_head(&stored);
            let values = |map: &HeaderMap, name: &HeaderName| -> Vec<String> {
                map.get_all(name)
                    .iter()
                    .map(|v| v.to_str().expect("ascii").to_owned())
                    .collect()
            };
            // The names in the stored order, the new ones after them.
            let mut names: Vec<HeaderName> = stored.keys().cloned().collect();
            for name in [AGE, VIA, crate::CACHE_STATUS.clone()] {
                if !names.contains(&name) {
                    names.push(name);
                }
            }
            assert_eq!(
                head.keys().cloned().collect::<Vec<_>>(),
                names,
                "{n} fields"
            );
            for name in &names {
                let want = if *name == AGE {
                    vec!["0".to_owned()]
                } else if *name == crate::CACHE_STATUS {
                    let mut v = values(&stored, name);
                    v.push(crate::semantics::cache_status::name().to_owned());
                    v
                } else if *name == VIA {
                    let mut v = values(&stored, name);
                    v.push(VIA_1_1.to_owned());
                    v
                } else {
                    values(&stored, name)
                };
                assert_eq!(values(&head, name), want, "{n} fields: {name}");
            }
            // An answer's copy takes both of its values without growing.
            let mut copy = head.clone();
            let capacity = copy.capacity();
            copy.insert(AGE, HeaderValue::from_static("7"));
            crate::put_own_cache_status(&mut copy, HeaderValue::from_static("corral; hit"), true);
            assert_eq!(copy.capacity(), capacity, "{n} fields: the copy grew");
            assert_eq!(copy.len(), head.len());
        }
    }

    #[test]
    fn the_wire_head_keeps_the_inbound_cache_status_lines_but_not_corrals() {
        let mut stored = HeaderMap::new();
        stored.append(
            crate::CACHE_STATUS.clone(),
            HeaderValue::from_static("cdn; hit"),
        );
        stored.append(
            crate::CACHE_STATUS.clone(),
            HeaderValue::from_static("edge; fwd=miss"),
        );
        let head = answer_head(&stored);
        let wire = wire_head(StatusCode::OK, &head).expect("a wire head");
        let text = std::str::from_utf8(&wire.bytes).expect("ascii");
        assert!(
            text.contains("cache-status: cdn; hit\r\ncache-status: edge; fwd=miss\r\n"),
            "{text}"
        );
        assert_eq!(text.matches("cache-status").count(), 2, "{text}");
        // Without inbound lines, none: corral's is written per answer.
        let bare = wire_head(StatusCode::OK, &answer_head(&HeaderMap::new())).expect("a wire head");
        assert!(
            !std::str::from_utf8(&bare.bytes)
                .expect("ascii")
                .contains("cache-status")
        );
    }

    #[test]
    fn weight_counts_headers_body_and_overhead() {
        let e = entry(10, 0, 0);
        let w = e.weight() as usize;
        assert!(w >= STORE_OVERHEAD + std::mem::size_of::<StoredResponse>() + 5);
        let mut big = e.clone();
        big.headers.insert(
            "x-big",
            HeaderValue::from_bytes(&[b'a'; 1000]).expect("value"),
        );
        assert!(big.weight() as usize >= w + 1000);
    }

    #[test]
    fn a_head_answer_describes_an_entry_only_with_its_validators_and_length() {
        let e = entry(10, 0, 0);
        let head = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (n, v) in pairs {
                h.append(*n, HeaderValue::from_static(v));
            }
            h
        };
        // What it carries is compared; what it leaves out is not.
        assert!(e.described_by(&head(&[])));
        assert!(e.described_by(&head(&[("etag", "\"v1\""), ("x-a", "2")])));
        assert!(e.described_by(&head(&[("content-length", "5")])));
        assert!(!e.described_by(&head(&[("etag", "\"v2\"")])));
        assert!(!e.described_by(&head(&[("content-length", "6")])));
        assert!(!e.described_by(&head(&[("content-length", "five")])));
        // A validator the entry lacks, another coding or Vary: not it.
        assert!(!e.described_by(&head(&[("last-modified", "Sun, 06 Nov 1994 08:49:37 GMT")])));
        assert!(!e.described_by(&head(&[("content-encoding", "gzip")])));
        assert!(!e.described_by(&head(&[("vary", "accept-language")])));
        // Without a validator, kept a short while past its windows for
        // such a HEAD; with one, an hour for a 304.
        let mut bare = e.clone();
        bare.headers.remove(ETAG);
        let t = bare.response_time;
        assert_eq!(bare.residency(t), Duration::from_secs(10) + HEAD_GRACE);
        assert_eq!(e.residency(t), Duration::from_secs(10) + REVALIDATION_GRACE);
        // A stored 404 is not what a HEAD's 200 describes.
        let mut missing = e.clone();
        missing.status = StatusCode::NOT_FOUND;
        assert!(!missing.described_by(&head(&[])));
    }
}
