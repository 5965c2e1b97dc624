//! The RFC 9211 `Cache-Status` field corral adds to every answer: what the
//! cache did with the request, typed. The header, the `cache` label of the
//! metrics and the access line are all derived from one [`CacheStatus`], so
//! no path reads an outcome back out of a string.

use http::{HeaderValue, StatusCode};

use crate::model::policy::PassReason;
use crate::semantics::head::BadHead;

/// The name corral's members carry in `Cache-Status` and `Proxy-Status`
/// unless `server.proxy_name` says otherwise.
pub const DEFAULT_NAME: &str = "corral";

/// The name this process writes, set once at start ([`set_name`]).
static NAME: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

/// The name corral's own `Cache-Status` and `Proxy-Status` members carry:
/// `server.proxy_name`, else [`DEFAULT_NAME`].
pub fn name() -> &'static str {
    NAME.get().copied().unwrap_or(DEFAULT_NAME)
}

/// Sets the name of corral's members for the life of the process; false
/// when it was set already (to another name) or is not an RFC 8941 token.
pub fn set_name(name: &str) -> bool {
    if !is_valid_name(name) {
        return false;
    }
    if let Some(set) = NAME.get() {
        return *set == name;
    }
    let leaked: &'static str = Box::leak(name.to_owned().into_boxed_str());
    NAME.set(leaked).is_ok() || self::name() == name
}

/// A name written as a bare RFC 8941 token (`ALPHA / "*"`, then `tchar`,
/// `:` or `/`), at most 64 bytes: a member's name is then compared as
/// written, with no string form to tell apart.
pub fn is_valid_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    let first_ok = bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'*');
    first_ok
        && name.len() <= 64
        && bytes.all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/".contains(&b))
}

/// The field's name.
pub static CACHE_STATUS: http::HeaderName = http::HeaderName::from_static("cache-status");

/// RFC 9209's field, on every answer corral makes itself.
pub static PROXY_STATUS: http::HeaderName = http::HeaderName::from_static("proxy-status");

/// Removes the members of an origin's (or an upstream cache's)
/// `Proxy-Status` and `Cache-Status` that claim corral's name, so that a
/// client can trust corral's own member (RFC 9209 §2, RFC 9211 §2: a
/// member names the intermediary that wrote it). Other members are kept as
/// written, in order; a field left empty goes.
pub fn strip_claimed_members(headers: &mut http::HeaderMap) {
    strip_claimed(headers, &PROXY_STATUS);
    strip_claimed(headers, &CACHE_STATUS);
}

/// [`strip_claimed_members`] for one field.
fn strip_claimed(headers: &mut http::HeaderMap, field: &http::HeaderName) {
    if !headers.contains_key(field) {
        return;
    }
    let own = name();
    let mut kept: Vec<String> = Vec::new();
    let mut claimed = false;
    for line in headers.get_all(field) {
        let Ok(text) = line.to_str() else {
            // Not text: no member of it can be told apart; none is kept.
            claimed = true;
            continue;
        };
        for member in list_members(text) {
            if member_name(member) == own {
                claimed = true;
            } else if !member.is_empty() {
                kept.push(member.to_owned());
            }
        }
    }
    if !claimed {
        return;
    }
    headers.remove(field);
    if let Ok(v) = HeaderValue::from_str(&kept.join(", "))
        && !kept.is_empty()
    {
        headers.insert(field.clone(), v);
    }
}

/// Puts corral's own member `value` after the members already in
/// `headers` (RFC 9211 §2: a cache appends its member, keeping those of
/// the caches before it). `placeholder_last`: the field's last line is
/// corral's placeholder (an entry's answer head), replaced in place.
pub fn put_own_cache_status(
    headers: &mut http::HeaderMap,
    value: HeaderValue,
    placeholder_last: bool,
) {
    match headers.entry(&CACHE_STATUS) {
        http::header::Entry::Occupied(mut lines) if placeholder_last => {
            if let Some(last) = lines.iter_mut().last() {
                *last = value;
            }
        }
        http::header::Entry::Occupied(mut lines) => lines.append(value),
        http::header::Entry::Vacant(slot) => {
            slot.insert(value);
        }
    }
}

/// The members of a Structured Field list, split at the commas outside
/// quoted strings, trimmed.
fn list_members(text: &str) -> Vec<&str> {
    let mut members = Vec::new();
    let (mut start, mut quoted, mut escaped) = (0, false, false);
    for (i, b) in text.bytes().enumerate() {
        match b {
            _ if escaped => escaped = false,
            b'\\' if quoted => escaped = true,
            b'"' => quoted = !quoted,
            b',' if !quoted => {
                members.push(text[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    members.push(text[start..].trim());
    members
}

/// A member's name: the token, or the string's content, before its
/// parameters.
fn member_name(member: &str) -> &str {
    let name = member.split(';').next().unwrap_or_default().trim();
    name.strip_prefix('"')
        .and_then(|n| n.strip_suffix('"'))
        .unwrap_or(name)
}

/// The `Proxy-Status` of an answer corral made itself for `detail`: its
/// name, the RFC 9209 error type ([`Detail::proxy_error`]), the detail
/// `Cache-Status` gives, and the status the origin answered with when it
/// did (`received-status`). So a client tells corral's 503 from the
/// origin's: the origin's own answers never carry corral's member.
pub fn proxy_status(detail: Detail, received: Option<u16>) -> HeaderValue {
    let mut v = format!(
        "{}; error={}; details=\"{}\"",
        name(),
        detail.proxy_error(),
        detail.as_str()
    );
    if let Some(code) = received {
        v.push_str("; received-status=");
        v.push_str(&code.to_string());
    }
    // Tokens and digits only (every detail is lowercase ASCII and `-`).
    HeaderValue::from_str(&v).unwrap_or_else(|_| HeaderValue::from_static(DEFAULT_NAME))
}

/// Why the request was forwarded (RFC 9211 §2.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forward {
    /// Nothing stored could be used; corral cannot tell which of the two below.
    Miss,
    /// Nothing stored for this URI.
    UriMiss,
    /// The URI is stored, but not the variant this request selects.
    VaryMiss,
    /// A stored response was stale and had to be refreshed.
    Stale,
    /// The request's own semantics prevented using the cache.
    Request,
    /// The request's method is one the cache does not store answers for
    /// (RFC 9211 §2.2: `method`): a POST, PUT, DELETE... passed through.
    Method,
    /// The cache was configured not to handle this request.
    Bypass,
}

impl Forward {
    fn as_str(self) -> &'static str {
        match self {
            Forward::Miss => "miss",
            Forward::UriMiss => "uri-miss",
            Forward::VaryMiss => "vary-miss",
            Forward::Stale => "stale",
            Forward::Request => "request",
            Forward::Method => "method",
            Forward::Bypass => "bypass",
        }
    }
}

/// Why an answer is what it is: the `detail` parameter of `Cache-Status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detail {
    /// A stale copy served inside stale-while-revalidate; one refresh runs.
    StaleWhileRevalidate,
    /// A stale copy served because the origin failed (stale-if-error).
    StaleIfError,
    /// The key is in back-off after origin failures: no fetch was made.
    Backoff,
    /// The route's circuit is open: no fetch was made.
    CircuitOpen,
    /// The wait for another request's fill ran past `lock_timeout`.
    LockTimeout,
    /// No fill slot came free in time (`max_fills`).
    FillLimit,
    /// The key's flight already had `max_waiters` callers waiting.
    WaitListFull,
    /// The fill ended without an answer for this caller.
    FillFailed,
    /// A waiter was handed a pass it could not use.
    FillPassed,
    /// A hit read from the shared tier (Redis).
    L2,
    /// A Range request: passed through, never cached.
    Range,
    /// A GET or HEAD with a body: passed through, never cached.
    RequestBody,
    /// No route matches the request.
    NoRoute,
    /// An Upgrade request: corral does not tunnel.
    UpgradeUnsupported,
    /// CONNECT: corral does not tunnel either.
    MethodUnsupported,
    /// The request head is larger than `max_header_size`.
    RequestHeadTooLarge,
    /// The request head is invalid.
    BadRequest(BadHead),
    /// Why the origin's answer was not stored.
    Pass(PassReason),
    /// The origin could not be used: how it failed.
    Upstream(UpstreamFailure),
    /// A rate limit refused the request (429).
    RateLimited,
    /// A limit that refuses while its shared counter is out of reach
    /// (`on_redis_down: refuse`) refused the request (503).
    LimiterUnavailable,
    /// The bearer token was invalid and the route refuses such callers (401).
    InvalidToken,
    /// No `upstream_concurrency` slot came free within the queue timeout (503).
    UpstreamBusy,
    /// corral was overloaded (`server.overload`): a passed-through
    /// request or a new connection was turned away (503).
    Overloaded,
}

/// How an exchange with the origin failed, as `Cache-Status` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamFailure {
    /// No connection could be made (neither refused nor timed out: a
    /// name that does not resolve, a network that cannot be reached).
    Connect,
    /// The origin refused the connection.
    ConnectRefused,
    /// Opening the connection timed out.
    ConnectTimeout,
    /// The TLS handshake failed (a protocol or a name).
    Tls,
    /// The origin's certificate was refused (or it presented none).
    TlsCertificate,
    /// The origin ended the handshake with an alert.
    TlsAlert,
    /// No response head within `timeouts.response_headers`.
    Timeout,
    /// The whole exchange ran past `timeouts.total`.
    TotalTimeout,
    /// The exchange broke off.
    Exchange,
    /// The request could not be built from the client's.
    Request,
    /// The origin answered what corral never asked for (a 101).
    Protocol,
    /// The body did not match its `Content-Digest` or `Repr-Digest`.
    Digest,
    /// The body is in a content coding its caller does not accept, and
    /// does not decode (within the route's object size, or at all: a
    /// dictionary coding for a caller that offered no dictionary).
    Coding,
}

impl UpstreamFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            UpstreamFailure::Connect
            | UpstreamFailure::ConnectRefused
            | UpstreamFailure::ConnectTimeout => "upstream-connect-error",
            UpstreamFailure::Tls | UpstreamFailure::TlsCertificate | UpstreamFailure::TlsAlert => {
                "upstream-tls-error"
            }
            UpstreamFailure::Timeout => "upstream-timeout",
            UpstreamFailure::TotalTimeout => "upstream-total-timeout",
            UpstreamFailure::Exchange => "upstream-error",
            UpstreamFailure::Request => "bad-upstream-request",
            UpstreamFailure::Protocol => "upstream-protocol-error",
            UpstreamFailure::Digest => "upstream-digest-mismatch",
            UpstreamFailure::Coding => "upstream-content-coding",
        }
    }

    /// The RFC 9209 §2.3 error type (`Cache-Status` names the connect and
    /// TLS failures alike; `Proxy-Status` tells them apart).
    pub fn proxy_error(self) -> &'static str {
        match self {
            UpstreamFailure::Connect => "destination_unavailable",
            UpstreamFailure::ConnectRefused => "connection_refused",
            UpstreamFailure::ConnectTimeout => "connection_timeout",
            UpstreamFailure::Tls => "tls_protocol_error",
            UpstreamFailure::TlsCertificate => "tls_certificate_error",
            UpstreamFailure::TlsAlert => "tls_alert_received",
            UpstreamFailure::Timeout | UpstreamFailure::TotalTimeout => "http_response_timeout",
            UpstreamFailure::Exchange => "http_response_incomplete",
            UpstreamFailure::Request => "proxy_internal_error",
            UpstreamFailure::Protocol => "http_protocol_error",
            // What arrived is not the whole, true body: like a cut one.
            UpstreamFailure::Digest => "http_response_incomplete",
            UpstreamFailure::Coding => "http_response_content_coding",
        }
    }
}

impl Detail {
    pub fn as_str(self) -> &'static str {
        match self {
            Detail::StaleWhileRevalidate => "stale-while-revalidate",
            Detail::StaleIfError => "stale-if-error",
            Detail::Backoff => "backoff",
            Detail::CircuitOpen => "circuit-open",
            Detail::LockTimeout => "lock-timeout",
            Detail::FillLimit => "fill-limit",
            Detail::WaitListFull => "wait-list-full",
            Detail::FillFailed => "fill-failed",
            Detail::FillPassed => "fill-passed",
            Detail::L2 => "l2",
            Detail::Range => "range",
            Detail::RequestBody => "request-body",
            Detail::NoRoute => "no-route",
            Detail::UpgradeUnsupported => "upgrade-unsupported",
            Detail::MethodUnsupported => "method-unsupported",
            Detail::RequestHeadTooLarge => "request-head-too-large",
            Detail::BadRequest(bad) => bad.detail(),
            Detail::Pass(reason) => reason.as_str(),
            Detail::Upstream(failure) => failure.as_str(),
            Detail::RateLimited => "rate-limited",
            Detail::LimiterUnavailable => "limiter-unavailable",
            Detail::InvalidToken => "invalid-token",
            Detail::UpstreamBusy => "upstream-busy",
            Detail::Overloaded => "overloaded",
        }
    }

    /// The RFC 9209 §2.3 error type of corral's own answer for this
    /// reason: what went wrong on the way to the origin, or that corral
    /// refused or could not take the request itself.
    pub fn proxy_error(self) -> &'static str {
        match self {
            Detail::Upstream(f) => f.proxy_error(),
            Detail::NoRoute => "destination_not_found",
            Detail::CircuitOpen | Detail::Backoff => "destination_unavailable",
            Detail::WaitListFull | Detail::FillLimit | Detail::UpstreamBusy => {
                "connection_limit_reached"
            }
            Detail::LockTimeout => "http_response_timeout",
            Detail::RateLimited
            | Detail::InvalidToken
            | Detail::UpgradeUnsupported
            | Detail::MethodUnsupported => "http_request_denied",
            Detail::BadRequest(_) | Detail::RequestHeadTooLarge | Detail::RequestBody => {
                "http_request_error"
            }
            Detail::Overloaded => "proxy_internal_response",
            Detail::LimiterUnavailable
            | Detail::FillFailed
            | Detail::FillPassed
            | Detail::StaleWhileRevalidate
            | Detail::StaleIfError
            | Detail::L2
            | Detail::Range
            | Detail::Pass(_) => "proxy_internal_error",
        }
    }

    /// The `reason` label of `corral_stale_answers_total` when a stale copy
    /// is served for this reason.
    pub fn stale_reason(self) -> &'static str {
        match self {
            Detail::StaleWhileRevalidate => "revalidate",
            Detail::StaleIfError => "error",
            Detail::LockTimeout => "timeout",
            other => other.as_str(),
        }
    }
}

/// What the cache did, as the `cache` label of `corral_requests_total`
/// and the access line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheLabel {
    Hit,
    Miss,
    Stale,
    Collapsed,
    Pass,
    Error,
}

impl CacheLabel {
    pub fn as_str(self) -> &'static str {
        match self {
            CacheLabel::Hit => "hit",
            CacheLabel::Miss => "miss",
            CacheLabel::Stale => "stale",
            CacheLabel::Collapsed => "collapsed",
            CacheLabel::Pass => "pass",
            CacheLabel::Error => "error",
        }
    }
}

/// One `Cache-Status` entry for corral.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheStatus {
    pub hit: bool,
    pub fwd: Option<Forward>,
    pub fwd_status: Option<u16>,
    pub stored: bool,
    pub collapsed: bool,
    /// Remaining freshness in seconds; negative when stale.
    pub ttl: Option<i64>,
    pub detail: Option<Detail>,
}

impl CacheStatus {
    /// A fresh hit.
    pub fn hit(ttl: i64) -> Self {
        CacheStatus {
            hit: true,
            ttl: Some(ttl),
            ..Default::default()
        }
    }

    /// A forwarded request.
    pub fn forward(fwd: Forward) -> Self {
        CacheStatus {
            fwd: Some(fwd),
            ..Default::default()
        }
    }

    pub fn with_fwd_status(mut self, status: u16) -> Self {
        self.fwd_status = Some(status);
        self
    }

    pub fn with_detail(mut self, detail: Detail) -> Self {
        self.detail = Some(detail);
        self
    }

    pub fn with_ttl(mut self, ttl: i64) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// The `cache` label of an answer with this status and HTTP `code`.
    pub fn label(&self, code: StatusCode) -> CacheLabel {
        if self.hit {
            CacheLabel::Hit
        } else if code.is_server_error() {
            // An outage shows on error-rate dashboards, shared or not.
            CacheLabel::Error
        } else if self.collapsed {
            CacheLabel::Collapsed
        } else if (self.fwd == Some(Forward::Stale) && self.fwd_status.is_none())
            || matches!(
                self.detail,
                Some(Detail::StaleWhileRevalidate | Detail::StaleIfError)
            )
        {
            CacheLabel::Stale
        } else if matches!(
            self.fwd,
            Some(Forward::Bypass | Forward::Request | Forward::Method)
        ) || !self.stored
        {
            CacheLabel::Pass
        } else {
            CacheLabel::Miss
        }
    }

    /// The field value, e.g. `corral; fwd=uri-miss; fwd-status=200; stored; ttl=60`.
    pub fn to_header_value(&self) -> HeaderValue {
        // A plain hit's value changes once a second for a hot key: each
        // worker thread keeps the last one it wrote and hands out copies
        // (a reference count), not a new value per answer.
        let plain_hit = *self
            == CacheStatus {
                ttl: self.ttl,
                ..CacheStatus::hit(0)
            };
        match (plain_hit, self.ttl) {
            (true, Some(ttl)) => LAST_HIT.with(|last| {
                let mut last = last.borrow_mut();
                match &*last {
                    Some((t, value)) if *t == ttl => value.clone(),
                    _ => {
                        let value = self.written();
                        *last = Some((ttl, value.clone()));
                        value
                    }
                }
            }),
            _ => self.written(),
        }
    }

    /// The field value, written out.
    fn written(&self) -> HeaderValue {
        // Written on the stack, then copied into one allocation of its
        // exact length, which the value keeps as it is (this runs for
        // every answer, a hit's included). A value past the buffer (none
        // today) is written on the heap.
        let mut buf = [0u8; 128];
        let mut len = 0;
        let fits = self.write(&mut |part| match buf.get_mut(len..len + part.len()) {
            Some(to) => {
                to.copy_from_slice(part);
                len += part.len();
                true
            }
            None => false,
        });
        let value = if fits {
            HeaderValue::from_bytes(&buf[..len])
        } else {
            let mut heap = Vec::new();
            self.write(&mut |part| {
                heap.extend_from_slice(part);
                true
            });
            HeaderValue::from_bytes(&heap)
        };
        // Only ASCII tokens and numbers are written.
        value.unwrap_or_else(|_| HeaderValue::from_static(name()))
    }

    /// Writes the field value's parts to `put` in order, while it takes
    /// them; false when it refused one.
    fn write(&self, put: &mut impl FnMut(&[u8]) -> bool) -> bool {
        let mut ok = put(name().as_bytes());
        if self.hit {
            ok &= put(b"; hit");
        }
        if let Some(fwd) = self.fwd {
            ok &= put(b"; fwd=") && put(fwd.as_str().as_bytes());
        }
        if let Some(status) = self.fwd_status {
            ok &= put(b"; fwd-status=") && put_int(put, i64::from(status));
        }
        if self.stored {
            ok &= put(b"; stored");
        }
        if self.collapsed {
            ok &= put(b"; collapsed");
        }
        if let Some(ttl) = self.ttl {
            ok &= put(b"; ttl=") && put_int(put, ttl);
        }
        if let Some(detail) = self.detail {
            ok &= put(b"; detail=") && put(detail.as_str().as_bytes());
        }
        ok
    }
}

thread_local! {
    /// The last plain hit's value this thread wrote, with its `ttl`.
    static LAST_HIT: std::cell::RefCell<Option<(i64, HeaderValue)>> =
        const { std::cell::RefCell::new(None) };
}

/// `n` in decimal, without the formatting machinery.
fn put_int(put: &mut impl FnMut(&[u8]) -> bool, n: i64) -> bool {
    (n >= 0 || put(b"-"))
        && put(crate::semantics::h1::decimal(
            n.unsigned_abs(),
            &mut [0; 20],
        ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_origins_members_claiming_corrals_name_are_removed() {
        let strip = |lines: &[&'static str]| {
            let mut h = http::HeaderMap::new();
            for l in lines {
                h.append(PROXY_STATUS.clone(), HeaderValue::from_static(l));
            }
            strip_claimed_members(&mut h);
            h.get_all(&PROXY_STATUS)
                .iter()
                .map(|v| v.to_str().unwrap_or_default().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            strip(&["corral; error=http_request_error"]),
            Vec::<String>::new()
        );
        assert_eq!(
            strip(&[
                "gw; error=\"x, corral\"",
                "\"corral\"; error=dns_timeout, cdn"
            ]),
            ["gw; error=\"x, corral\", cdn"]
        );
        assert_eq!(
            strip(&["gw, cdn; details=\"a\\\"b, corral\""]),
            ["gw, cdn; details=\"a\\\"b, corral\""]
        );
        assert_eq!(strip(&[]), Vec::<String>::new());
    }

    use super::*;

    #[test]
    fn a_name_is_a_bare_token() {
        for ok in ["corral", "edge-7.example", "corral/web-3", "cdn:1", "*x"] {
            assert!(is_valid_name(ok), "{ok}");
        }
        for bad in [
            "",
            "7up",
            "two words",
            "a,b",
            "x;y",
            "\"q\"",
            "é",
            &"a".repeat(65),
        ] {
            assert!(!is_valid_name(bad), "{bad}");
        }
    }

    #[test]
    fn corrals_member_goes_after_the_inbound_ones_or_in_its_placeholder() {
        let lines = |h: &http::HeaderMap| -> Vec<String> {
            h.get_all(&CACHE_STATUS)
                .iter()
                .map(|v| v.to_str().unwrap_or_default().to_owned())
                .collect()
        };
        let mut h = http::HeaderMap::new();
        put_own_cache_status(&mut h, HeaderValue::from_static("corral; hit"), false);
        assert_eq!(lines(&h), ["corral; hit"]);
        let mut h = http::HeaderMap::new();
        h.append(CACHE_STATUS.clone(), HeaderValue::from_static("cdn; hit"));
        put_own_cache_status(&mut h, HeaderValue::from_static("corral; fwd=miss"), false);
        assert_eq!(lines(&h), ["cdn; hit", "corral; fwd=miss"]);
        put_own_cache_status(&mut h, HeaderValue::from_static("corral; hit"), true);
        assert_eq!(lines(&h), ["cdn; hit", "corral; hit"]);
    }

    #[test]
    fn every_own_answer_names_a_registered_proxy_error_type() {
        // RFC 9209 §2.3, the types corral may name.
        const REGISTERED: [&str; 17] = [
            "destination_not_found",
            "destination_unavailable",
            "connection_refused",
            "connection_timeout",
            "connection_limit_reached",
            "tls_protocol_error",
            "tls_certificate_error",
            "tls_alert_received",
            "http_request_error",
            "http_request_denied",
            "http_response_incomplete",
            "http_response_content_coding",
            "http_response_timeout",
            "http_protocol_error",
            "proxy_internal_response",
            "proxy_internal_error",
            "proxy_configuration_error",
        ];
        use UpstreamFailure as F;
        let mut details = vec![
            Detail::StaleWhileRevalidate,
            Detail::StaleIfError,
            Detail::Backoff,
            Detail::CircuitOpen,
            Detail::LockTimeout,
            Detail::FillLimit,
            Detail::WaitListFull,
            Detail::FillFailed,
            Detail::FillPassed,
            Detail::L2,
            Detail::Range,
            Detail::RequestBody,
            Detail::NoRoute,
            Detail::UpgradeUnsupported,
            Detail::MethodUnsupported,
            Detail::RequestHeadTooLarge,
            Detail::BadRequest(BadHead::MissingHost),
            Detail::Pass(PassReason::NoStore),
            Detail::RateLimited,
            Detail::LimiterUnavailable,
            Detail::InvalidToken,
            Detail::UpstreamBusy,
            Detail::Overloaded,
        ];
        for f in [
            F::Connect,
            F::ConnectRefused,
            F::ConnectTimeout,
            F::Tls,
            F::TlsCertificate,
            F::TlsAlert,
            F::Timeout,
            F::TotalTimeout,
            F::Exchange,
            F::Request,
            F::Protocol,
            F::Digest,
            F::Coding,
        ] {
            details.push(Detail::Upstream(f));
        }
        for d in details {
            assert!(REGISTERED.contains(&d.proxy_error()), "{d:?}");
            let v = proxy_status(d, None);
            assert_eq!(
                v.to_str().expect("ascii"),
                format!(
                    "corral; error={}; details=\"{}\"",
                    d.proxy_error(),
                    d.as_str()
                )
            );
            assert!(
                d.as_str()
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'),
                "{d:?}: a detail fits an sf-string unescaped"
            );
        }
        assert_eq!(
            proxy_status(Detail::Upstream(F::Protocol), Some(101)),
            "corral; error=http_protocol_error; details=\"upstream-protocol-error\"; received-status=101"
        );
    }

    #[test]
    fn integers_are_written_like_display() {
        for n in [0, 1, 9, 10, 59, 86_399, -1, -6, -10, i64::MAX, i64::MIN] {
            let mut s = Vec::new();
            assert!(put_int(
                &mut |p| {
                    s.extend_from_slice(p);
                    true
                },
                n
            ));
            assert_eq!(s, n.to_string().as_bytes());
        }
    }

    #[test]
    fn a_remembered_hit_value_is_always_the_one_written_for_its_status() {
        // Hits and other statuses interleaved, ttls repeating and changing:
        // every value is what writing it out gives.
        let statuses = [
            CacheStatus::hit(59),
            CacheStatus::hit(59),
            CacheStatus::hit(58),
            CacheStatus::hit(58).with_detail(Detail::L2),
            CacheStatus::forward(Forward::Stale).with_ttl(58),
            CacheStatus::hit(-1),
            CacheStatus::hit(58),
            CacheStatus::hit(59),
        ];
        for st in statuses.iter().cycle().take(40) {
            assert_eq!(st.to_header_value(), st.written(), "{st:?}");
        }
        assert_eq!(CacheStatus::hit(7).to_header_value(), "corral; hit; ttl=7");
    }

    #[test]
    fn a_writer_that_refuses_a_part_is_told() {
        let st = CacheStatus::hit(i64::MIN).with_detail(Detail::StaleIfError);
        let mut whole = Vec::new();
        assert!(st.write(&mut |p| {
            whole.extend_from_slice(p);
            true
        }));
        assert_eq!(st.to_header_value().as_bytes(), &whole[..]);
        let mut room = 10;
        assert!(!st.write(&mut |p| {
            let fits = p.len() <= room;
            room = room.saturating_sub(p.len());
            fits
        }));
    }

    #[test]
    fn formats_parameters_in_rfc9211_order() {
        let mut st = CacheStatus::forward(Forward::UriMiss).with_fwd_status(200);
        st.stored = true;
        st.collapsed = true;
        st.ttl = Some(59);
        assert_eq!(
            st.to_header_value(),
            "corral; fwd=uri-miss; fwd-status=200; stored; collapsed; ttl=59"
        );
        assert_eq!(
            CacheStatus::hit(-3).to_header_value(),
            "corral; hit; ttl=-3"
        );
        assert_eq!(
            CacheStatus::forward(Forward::Stale)
                .with_detail(Detail::StaleIfError)
                .to_header_value(),
            "corral; fwd=stale; detail=stale-if-error"
        );
    }

    #[test]
    fn the_label_follows_the_typed_status() {
        let ok = StatusCode::OK;
        assert_eq!(CacheStatus::hit(5).label(ok), CacheLabel::Hit);
        let mut stored = CacheStatus::forward(Forward::UriMiss).with_fwd_status(200);
        stored.stored = true;
        assert_eq!(stored.label(ok), CacheLabel::Miss);
        assert_eq!(stored.label(StatusCode::BAD_GATEWAY), CacheLabel::Error);
        let mut collapsed = stored.clone();
        collapsed.stored = false;
        collapsed.collapsed = true;
        assert_eq!(collapsed.label(ok), CacheLabel::Collapsed);
        let backoff = CacheStatus::forward(Forward::Stale).with_detail(Detail::Backoff);
        assert_eq!(backoff.label(ok), CacheLabel::Stale);
        let sie = CacheStatus::forward(Forward::Stale)
            .with_fwd_status(500)
            .with_detail(Detail::StaleIfError);
        assert_eq!(sie.label(ok), CacheLabel::Stale);
        let swr_l2 = CacheStatus::forward(Forward::Stale).with_detail(Detail::StaleWhileRevalidate);
        assert_eq!(swr_l2.label(ok), CacheLabel::Stale);
        let pass = CacheStatus::forward(Forward::UriMiss)
            .with_fwd_status(200)
            .with_detail(Detail::Pass(PassReason::Private));
        assert_eq!(pass.label(ok), CacheLabel::Pass);
        assert_eq!(
            CacheStatus::forward(Forward::Bypass).label(ok),
            CacheLabel::Pass
        );
        assert_eq!(Detail::LockTimeout.stale_reason(), "timeout");
        assert_eq!(Detail::StaleIfError.stale_reason(), "error");
        assert_eq!(Detail::StaleWhileRevalidate.stale_reason(), "revalidate");
        assert_eq!(Detail::FillLimit.stale_reason(), "fill-limit");
        assert_eq!(
            Detail::BadRequest(BadHead::MissingHost).as_str(),
            "missing-host"
        );
    }
}
