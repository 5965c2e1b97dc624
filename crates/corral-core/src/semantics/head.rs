//! The client's request head as corral sees it: one validated view
//! ([`RequestHead`]) from which both the cache key and the upstream request
//! are built, so the two can never disagree. Every byte of it came from a
//! client and is treated as hostile: an invalid head is refused (400), never
//! guessed at. What a client may not pass to the origin (hop-by-hop,
//! framing and proxy-control headers) is gone from the view.

use std::net::IpAddr;

use http::header::{CONTENT_LENGTH, EXPECT, HOST, HeaderName};
use http::{HeaderMap, Method, Uri, Version};

use crate::semantics::hop_by_hop;
use crate::semantics::path::BadPath;

/// Why a request head was refused (each is a 400 with this Cache-Status detail).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadHead {
    /// HTTP/1.1 without a Host field (RFC 9112 §3.2).
    MissingHost,
    /// More than one Host field line.
    DuplicateHost,
    /// A Host (or target authority) that is not a valid `host[:port]`.
    InvalidHost,
    /// HTTP/2's `:authority` and `Host` name different hosts (RFC 9113 §8.3.1).
    ConflictingHost,
    /// A request target corral cannot key (not origin-, absolute- or asterisk-form).
    InvalidTarget,
    /// A path that could name one resource to corral and another to the
    /// origin (see [`crate::semantics::path`]).
    Path(BadPath),
}

impl BadHead {
    pub fn detail(self) -> &'static str {
        match self {
            BadHead::MissingHost => "missing-host",
            BadHead::DuplicateHost => "duplicate-host",
            BadHead::InvalidHost => "invalid-host",
            BadHead::ConflictingHost => "conflicting-host",
            BadHead::InvalidTarget => "invalid-target",
            BadHead::Path(p) => p.detail(),
        }
    }
}

/// Whether the client sent a body, and how it is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestBody {
    None,
    /// This many bytes (Content-Length, or HTTP/2's length).
    Sized(u64),
    /// A body of unknown length (chunked, or HTTP/2 without content-length).
    Streamed,
}

/// A client request's head, validated once. Nothing else of the client's
/// head is ever read.
#[derive(Debug, Clone)]
pub struct RequestHead {
    pub method: Method,
    pub version: Version,
    /// The host name, lowercased, without its port: what the key holds and
    /// what `X-Forwarded-Host` carries. Empty only for an HTTP/1.0 request
    /// without Host, or a request whose Host field is present but empty
    /// (RFC 9112 §3.2 allows it when the target has no authority).
    pub host: String,
    /// Starts with `/` (or is `*` for `OPTIONS *`), in its one normal form
    /// ([`crate::semantics::path::normalize`]): what the route is chosen on, what the
    /// key holds and what the origin is asked for.
    pub path: String,
    pub query: Option<String>,
    /// End-to-end headers only: hop-by-hop (and every header `Connection`
    /// names), framing, Host and proxy-control headers removed.
    pub headers: HeaderMap,
    /// The `X-Forwarded-For` corral sends upstream when it is more than the
    /// peer alone (`None`): the chain trusted proxies verified, then the
    /// peer (see [`RequestHead::trust`]). Never an entry a client wrote
    /// unverified.
    pub forwarded_for: Option<String>,
    /// The connection's peer.
    pub peer: IpAddr,
    /// The real client address: the peer unless trusted proxies say.
    pub client: IpAddr,
    pub body: RequestBody,
    /// The request came over TLS: `X-Forwarded-Proto: https`, and a key
    /// of its own (an origin may answer differently per scheme).
    pub tls: bool,
    /// Where the origin was asked on this request's behalf and how long
    /// it took, for its access line: `None` when no access line is
    /// written.
    pub visit: Option<std::sync::Arc<OriginVisit>>,
    /// The request's id ([`X_REQUEST_ID`]), which the origin is sent. One
    /// corral made is not among `headers` (a hit, which asks no origin,
    /// never writes it into them); a client's own, kept, is there as the
    /// client sent it. `None` for a head made without one (only tests
    /// make such).
    pub request_id: Option<RequestId>,
}

/// The field a request's id travels in, to the origin and back.
pub static X_REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");

/// A request's id (see [`X_REQUEST_ID`]): one corral made, kept inline (a
/// hit, which echoes it, allocates nothing for it), or the client's own
/// once checked to be a short token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestId {
    /// 20 lowercase hex digits.
    Made([u8; 20]),
    /// The client's, checked (token characters only).
    Kept(http::HeaderValue),
}

impl RequestId {
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            RequestId::Made(id) => id,
            RequestId::Kept(v) => v.as_bytes(),
        }
    }

    /// The id as text ("" for none that is not: both kinds are ASCII).
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(self.as_bytes()).unwrap_or("")
    }

    /// The id as a field value, for a header map.
    pub fn to_value(&self) -> http::HeaderValue {
        match self {
            RequestId::Made(id) => {
                http::HeaderValue::from_bytes(id).expect("hex digits are a valid field value")
            }
            RequestId::Kept(v) => v.clone(),
        }
    }
}

/// The origin exchange made for one request (the last, when there were
/// several): written by the exchange, read by the access line.
#[derive(Debug, Default)]
pub struct OriginVisit(std::sync::Mutex<Option<(String, std::time::Duration)>>);

impl OriginVisit {
    /// The origin at `upstream` was asked, and answered (or failed) after
    /// `took`.
    pub fn record(&self, upstream: &str, took: std::time::Duration) {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((upstream.to_owned(), took));
    }

    /// The upstream asked and how long it took, if one was.
    pub fn get(&self) -> Option<(String, std::time::Duration)> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// The names [`proxy_control`] matches, as a list the unit tests hold it to.
#[cfg(test)]
const PROXY_CONTROL: [&str; 18] = [
    "forwarded",
    "x-forwarded-host",
    "x-forwarded-proto",
    "x-forwarded-port",
    "x-forwarded-prefix",
    "x-forwarded-server",
    "x-forwarded-scheme",
    "x-forwarded-ssl",
    "x-real-ip",
    "x-original-url",
    "x-rewrite-url",
    "x-original-host",
    "x-host",
    "front-end-https",
    "x-client-ip",
    "true-client-ip",
    "cf-connecting-ip",
    "client-ip",
];

/// Headers that make some frameworks treat a request as another method:
/// on a cacheable request they would store a POST's (or DELETE's) answer
/// under the GET's key, and on an idempotent one they make a retry resend
/// what may be a POST.
pub const METHOD_OVERRIDE: [&str; 3] = [
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
];

impl RequestHead {
    /// Validates the head of a request received from `peer` that carries
    /// `body`. The head's headers are taken out of `parts`.
    pub fn parse(
        parts: &mut http::request::Parts,
        peer: IpAddr,
        body: RequestBody,
    ) -> Result<Self, BadHead> {
        // Takes the Host field out of the headers: nothing is passed on
        // from it but the host the head holds.
        let host = request_host(parts)?;
        let (path, query) = target(&parts.uri)?;
        let mut headers = std::mem::take(&mut parts.headers);
        strip_for_upstream(&mut headers, &parts.method);
        Ok(RequestHead {
            method: parts.method.clone(),
            version: parts.version,
            host,
            path,
            query,
            headers,
            forwarded_for: None,
            peer,
            client: peer,
            body,
            tls: false,
            visit: None,
            request_id: None,
        })
    }

    /// Takes the client address trusted proxies vouched for (resolved
    /// from the request's original headers by
    /// [`crate::callers::client_addr::resolve`]).
    pub fn trust(&mut self, addr: &crate::callers::client_addr::ClientAddr) {
        self.client = addr.client;
        self.forwarded_for = (!addr.hops.is_empty() || addr.client != self.peer)
            .then(|| addr.forwarded_for(self.peer));
    }

    /// QUERY (RFC 10008): safe and idempotent, with the request's content
    /// as part of what is asked: cached and coalesced keyed by it.
    pub fn is_query(&self) -> bool {
        is_query(&self.method)
    }

    /// GET or HEAD: the methods corral caches and coalesces.
    pub fn is_cacheable_method(&self) -> bool {
        self.method == Method::GET || self.method == Method::HEAD
    }

    pub fn path_and_query(&self) -> String {
        match &self.query {
            Some(q) => format!("{}?{q}", self.path),
            None => self.path.clone(),
        }
    }
}

/// The QUERY method (RFC 10008).
pub fn is_query(method: &Method) -> bool {
    method.as_str() == "QUERY"
}

/// Safe (RFC 9110 §9.2.1): GET, HEAD, OPTIONS, TRACE, and QUERY (RFC
/// 10008 §2), which http's `is_safe` does not know. A safe request never
/// invalidates what is stored.
pub fn is_safe(method: &Method) -> bool {
    method.is_safe() || is_query(method)
}

/// Removes everything a client may not pass to the origin: hop-by-hop
/// headers and those `Connection` names, framing (rebuilt for the body
/// corral actually sends), proxy-control headers, and on GET/HEAD method
/// overrides (Host, for which the upstream's is set, [`request_host`] has
/// taken out). One pass over the headers; removals only for names present.
fn strip_for_upstream(headers: &mut HeaderMap, method: &Method) {
    // QUERY is read-only too: a method override must not make a write of it.
    let cacheable = *method == Method::GET || *method == Method::HEAD || is_query(method);
    // One pass of comparisons and `match`es over the names present: this
    // runs for every request, and one that carries nothing to strip but
    // Host (the usual case) allocates nothing and looks up one name.
    let mut doomed: Vec<HeaderName> = Vec::new();
    let mut connection = false;
    for name in headers.keys() {
        let n = name.as_str();
        connection |= *name == http::header::CONNECTION;
        let strip = *name == CONTENT_LENGTH
            || *name == EXPECT
            || hop_by_hop::fixed(n)
            || proxy_control(n)
            || (cacheable && method_override(n));
        if strip {
            doomed.push(name.clone());
        }
    }
    // The fields the Connection field names go too (before it goes).
    if connection {
        hop_by_hop::strip(headers);
    }
    for name in doomed {
        headers.remove(name);
    }
}

/// True for a header a client must never set for the origin: it claims
/// what a trusted proxy saw (scheme, host, port, prefix, client address) or
/// rewrites the target. corral sets its own `X-Forwarded-For`/`-Proto`/
/// `-Host`; the rest would be unkeyed inputs an origin may build its answer
/// (and its links) from, and so a way to poison the shared entry. A
/// `match`, not a scan: it runs for every header of every request.
fn proxy_control(n: &str) -> bool {
    matches!(
        n,
        "forwarded"
            | "x-forwarded-host"
            | "x-forwarded-proto"
            | "x-forwarded-port"
            | "x-forwarded-prefix"
            | "x-forwarded-server"
            | "x-forwarded-scheme"
            | "x-forwarded-ssl"
            | "x-real-ip"
            | "x-original-url"
            | "x-rewrite-url"
            | "x-original-host"
            | "x-host"
            | "front-end-https"
            // Client addresses other proxies and CDNs claim: corral is the
            // proxy that knows the client, and says so in X-Forwarded-For.
            | "x-client-ip"
            | "true-client-ip"
            | "cf-connecting-ip"
            | "client-ip"
    )
}

/// `headers.contains_key(name)`, for the checks every request makes: a
/// request carries a few fields, and comparing their names costs less
/// than hashing `name` and probing (a custom name is hashed byte by
/// byte). Past `CARRIES_SCAN` (8) names, the lookup.
pub fn carries(headers: &HeaderMap, name: &HeaderName) -> bool {
    if headers.keys_len() > CARRIES_SCAN {
        return headers.contains_key(name);
    }
    headers.keys().any(|k| k == name)
}

/// The most field names [`carries`] compares one by one.
const CARRIES_SCAN: usize = 8;

/// True when some field name holds `_` (see [`strip_underscored`]).
pub fn has_underscored(headers: &HeaderMap) -> bool {
    headers
        .keys()
        .any(|n| holds_underscore(n.as_str().as_bytes()))
}

/// `name.contains(&b'_')`, eight bytes at a time: this runs on every
/// field name of every request, and a byte search costs more to set up
/// than a name of a few bytes takes to read.
fn holds_underscore(name: &[u8]) -> bool {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);
    const UNDERSCORES: u64 = u64::from_ne_bytes([b'_'; 8]);
    // A byte of `x` is zero exactly where the word held `_`; the test
    // below is true for a word with a zero byte, and only then.
    let zero_in = |w: u64| {
        let x = w ^ UNDERSCORES;
        x.wrapping_sub(ONES) & !x & HIGHS != 0
    };
    let mut words = name.chunks_exact(8);
    for w in &mut words {
        let mut word = [0u8; 8];
        word.copy_from_slice(w);
        if zero_in(u64::from_ne_bytes(word)) {
            return true;
        }
    }
    // At most seven bytes, read without a branch each (not `contains`,
    // which is the byte search this avoids).
    words
        .remainder()
        .iter()
        .fold(false, |found, &b| found | (b == b'_'))
}

/// Removes request fields whose names hold `_`, as nginx does by default
/// (`underscores_in_headers off`). CGI-style servers (WSGI, Rack, PHP,
/// older gunicorn and Puma) read `X_Forwarded_Host` as `X-Forwarded-Host`,
/// so a field spelled with underscores would pass every list of names
/// corral strips. With `allow` (a route's `underscores_in_headers`) they
/// are passed on, except those that read as a field corral strips or
/// writes in the dashed form (proxy control, hop-by-hop, framing, method
/// overrides, X-Forwarded-For) or
/// as `also` (the account header only an authenticating proxy may set).
/// Callers check [`has_underscored`] first: the usual request has no
/// such name, and then nothing here need run.
pub fn strip_underscored(headers: &mut HeaderMap, allow: bool, also: Option<&HeaderName>) {
    let doomed: Vec<HeaderName> = headers
        .keys()
        .filter(|name| {
            let n = name.as_str();
            if !n.contains('_') {
                return false;
            }
            if !allow {
                return true;
            }
            let dashed = n.replace('_', "-");
            proxy_control(&dashed)
                || method_override(&dashed)
                || hop_by_hop::fixed(&dashed)
                // Those corral writes itself for the origin.
                || matches!(
                    dashed.as_str(),
                    "content-length" | "host" | "expect" | "x-forwarded-for"
                )
                || also.is_some_and(|a| a.as_str() == dashed)
        })
        .cloned()
        .collect();
    for name in doomed {
        headers.remove(name);
    }
}

/// True for a name in [`METHOD_OVERRIDE`].
fn method_override(n: &str) -> bool {
    matches!(
        n,
        "x-http-method-override" | "x-http-method" | "x-method-override"
    )
}

/// The host the request is for: the authority of an absolute-form (or
/// HTTP/2) target, else the Host field. RFC 9112 §3.2: HTTP/1.1 needs
/// exactly one valid Host; an absolute-form target wins over it (§3.2.2).
/// The Host field is taken out of `parts`' headers (found once, through
/// an entry: this runs for every request).
fn request_host(parts: &mut http::request::Parts) -> Result<String, BadHead> {
    let field = match parts.headers.entry(HOST) {
        http::header::Entry::Occupied(hosts) => {
            if hosts.iter().nth(1).is_some() {
                return Err(BadHead::DuplicateHost);
            }
            let (_, v) = hosts.remove_entry();
            Some(parse_authority(v.as_bytes()).ok_or(BadHead::InvalidHost)?)
        }
        http::header::Entry::Vacant(_) => None,
    };
    let from_target = match parts.uri.authority() {
        Some(a) => Some(parse_authority(a.as_str().as_bytes()).ok_or(BadHead::InvalidHost)?),
        None => None,
    };
    match parts.version {
        Version::HTTP_2 | Version::HTTP_3 => match (from_target, field) {
            (Some(t), Some(f)) if t != f => Err(BadHead::ConflictingHost),
            (Some(t), _) => Ok(t),
            (None, Some(f)) => Ok(f),
            (None, None) => Err(BadHead::MissingHost),
        },
        Version::HTTP_09 | Version::HTTP_10 => Ok(from_target.or(field).unwrap_or_default()),
        _ => match (from_target, field) {
            (_, None) => Err(BadHead::MissingHost),
            (Some(t), Some(_)) => Ok(t),
            (None, Some(f)) => Ok(f),
        },
    }
}

/// `host[:port]` as RFC 3986 allows it in a Host field, restricted to what
/// a DNS name, an IPv4 address or a bracketed IPv6 address can be. The host
/// comes back lowercased and without its port. A port, when present, must
/// be digits below 65536 (an empty one is allowed, as the RFC does).
pub fn parse_authority(raw: &[u8]) -> Option<String> {
    if raw.len() > 262 {
        return None;
    }
    let (host, port) = if raw.first() == Some(&b'[') {
        let close = raw.iter().position(|&b| b == b']')?;
        let inner = std::str::from_utf8(&raw[1..close]).ok()?;
        inner.parse::<std::net::Ipv6Addr>().ok()?;
        let rest = &raw[close + 1..];
        let port = match rest.split_first() {
            None => None,
            Some((b':', p)) => Some(p),
            Some(_) => return None,
        };
        (&raw[..=close], port)
    } else {
        match raw.iter().position(|&b| b == b':') {
            Some(i) => (&raw[..i], Some(&raw[i + 1..])),
            None => (raw, None),
        }
    };
    // At most five digits, so the value fits a u32 as it is summed.
    if let Some(port) = port
        && (port.len() > 5
            || !port.iter().all(u8::is_ascii_digit)
            || port.iter().fold(0u32, |n, &d| n * 10 + u32::from(d - b'0')) > 65535)
    {
        return None;
    }
    if host.first() == Some(&b'[') {
        // The IPv6 address parsed above: ASCII.
        let mut s = String::from_utf8(host.to_vec()).ok()?;
        s.make_ascii_lowercase();
        return Some(s);
    }
    if host.len() > 253 {
        return None;
    }
    // Checked and copied lowercased in one pass: every byte is ASCII, so
    // no UTF-8 check of the copy is needed (this runs for every request).
    let mut s = String::with_capacity(host.len());
    for &b in host {
        if !(b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')) {
            return None;
        }
        s.push(char::from(b.to_ascii_lowercase()));
    }
    Some(s)
}

/// The path and query of the target. The path always starts with `/`
/// (an absolute-form target with an empty path means `/`), or is `*`, and
/// is normalized; the query is kept as sent (the key sorts it).
fn target(uri: &Uri) -> Result<(String, Option<String>), BadHead> {
    let path = uri.path();
    let path = if path.is_empty() { "/" } else { path };
    if !path.starts_with('/') && path != "*" {
        return Err(BadHead::InvalidTarget);
    }
    let path = crate::semantics::path::normalize(path).map_err(BadHead::Path)?;
    Ok((path.into_owned(), uri.query().map(str::to_owned)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    proptest::proptest! {
        #[test]
        fn the_word_search_for_underscores_agrees_with_a_byte_search(
            name in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40)
        ) {
            proptest::prop_assert_eq!(holds_underscore(&name), name.contains(&b'_'));
        }
    }

    #[test]
    fn carries_answers_as_contains_key_at_every_size() {
        let asked = [
            HOST,
            http::header::COOKIE,
            http::header::RANGE,
            X_REQUEST_ID.clone(),
            HeaderName::from_static("x-other"),
        ];
        for n in 0..(CARRIES_SCAN + 4) {
            let mut headers = HeaderMap::new();
            for i in 0..n {
                let name = HeaderName::from_bytes(format!("x-field-{i}").as_bytes()).expect("name");
                headers.append(name, HeaderValue::from_static("v"));
            }
            for (i, present) in asked.iter().enumerate() {
                let mut with = headers.clone();
                with.append(present.clone(), HeaderValue::from_static("v"));
                for name in &asked {
                    assert_eq!(
                        carries(&with, name),
                        with.contains_key(name),
                        "{n} {i} {name}"
                    );
                    assert_eq!(
                        carries(&headers, name),
                        headers.contains_key(name),
                        "{n} {name}"
                    );
                }
            }
        }
    }

    #[test]
    fn an_underscore_is_found_at_every_place() {
        for len in 0..24 {
            assert!(!holds_underscore(&vec![b'a'; len]), "{len}");
            // The byte after `_` (0x60) and before it (0x5e) are not it.
            assert!(!holds_underscore(&vec![0x60; len]), "{len}");
            assert!(!holds_underscore(&vec![0x5e; len]), "{len}");
            for at in 0..len {
                let mut name = vec![b'a'; len];
                name[at] = b'_';
                assert!(holds_underscore(&name), "{len} {at}");
            }
        }
    }

    #[test]
    fn the_name_matches_agree_with_the_lists() {
        for n in PROXY_CONTROL {
            assert!(proxy_control(n), "{n}");
            assert!(!method_override(n), "{n}");
        }
        for n in METHOD_OVERRIDE {
            assert!(method_override(n), "{n}");
            assert!(!proxy_control(n), "{n}");
        }
        for n in [
            "accept",
            "x-forwarded-for",
            "host",
            "x-forwarded",
            "forwarde",
            "x-http-methods",
        ] {
            assert!(!proxy_control(n) && !method_override(n), "{n}");
        }
    }

    fn names_after_underscore_strip(
        fields: &[&'static str],
        allow: bool,
        also: Option<&'static str>,
    ) -> Vec<String> {
        let mut headers = HeaderMap::new();
        for f in fields {
            headers.append(
                HeaderName::from_static(f),
                HeaderValue::from_static("evil.example"),
            );
        }
        let also = also.map(HeaderName::from_static);
        strip_underscored(&mut headers, allow, also.as_ref());
        let mut names: Vec<String> = headers.keys().map(|n| n.as_str().to_owned()).collect();
        names.sort();
        names
    }

    #[test]
    fn underscored_names_are_dropped_unless_allowed_and_harmless() {
        let fields = [
            "accept",
            "x_forwarded_host",
            "x_forwarded_for",
            "x_real_ip",
            "x_original_url",
            "x_account_id",
            "x_http_method_override",
            "transfer_encoding",
            "content_length",
            "x_trace_id",
            "x-trace-id",
        ];
        // Off (the default): every name with `_` goes, whatever it reads as.
        assert_eq!(
            names_after_underscore_strip(&fields, false, Some("x-account-id")),
            ["accept", "x-trace-id"]
        );
        // Allowed: only those that read as a field corral strips (or the
        // account header) in their dashed form go.
        assert_eq!(
            names_after_underscore_strip(&fields, true, Some("x-account-id")),
            ["accept", "x-trace-id", "x_trace_id"]
        );
        // Nothing to do: the map is untouched.
        assert_eq!(
            names_after_underscore_strip(&["accept", "x-real-ip"], false, None),
            ["accept", "x-real-ip"]
        );
    }

    fn parts(version: Version, uri: &str, hosts: &[&'static str]) -> http::request::Parts {
        let mut b = http::Request::builder().version(version).uri(uri);
        for h in hosts {
            b = b.header(HOST, *h);
        }
        b.body(()).expect("request").into_parts().0
    }

    fn host_of(version: Version, uri: &str, hosts: &[&'static str]) -> Result<String, BadHead> {
        request_host(&mut parts(version, uri, hosts))
    }

    #[test]
    fn host_rules_follow_rfc_9112() {
        const HTTP_10: Version = Version::HTTP_10;
        const HTTP_11: Version = Version::HTTP_11;
        const HTTP_2: Version = Version::HTTP_2;
        assert_eq!(
            host_of(HTTP_11, "/a", &["Site.Test:8080"]),
            Ok("site.test".into())
        );
        assert_eq!(host_of(HTTP_11, "/a", &[]), Err(BadHead::MissingHost));
        assert_eq!(host_of(HTTP_10, "/a", &[]), Ok(String::new()));
        assert_eq!(
            host_of(HTTP_11, "/a", &["a.test", "b.test"]),
            Err(BadHead::DuplicateHost)
        );
        assert_eq!(
            host_of(HTTP_11, "/a", &["site.test/static"]),
            Err(BadHead::InvalidHost)
        );
        // Absolute form wins over Host.
        assert_eq!(
            host_of(HTTP_11, "http://real.test/a", &["other.test"]),
            Ok("real.test".into())
        );
        assert_eq!(
            host_of(HTTP_2, "http://a.test/x", &["b.test"]),
            Err(BadHead::ConflictingHost)
        );
        assert_eq!(host_of(HTTP_2, "http://a.test/x", &[]), Ok("a.test".into()));
    }

    #[test]
    fn authorities_are_validated_strictly() {
        for ok in [
            "a.test",
            "a.test:80",
            "a.test:",
            "127.0.0.1:1",
            "[::1]",
            "[::1]:8080",
            "",
            "x_y",
            "a.test:65535",
            "a.test:00080",
            "a.test:0",
        ] {
            assert!(parse_authority(ok.as_bytes()).is_some(), "{ok:?}");
        }
        for bad in [
            "a.test/x",
            "a.test:99999",
            "a.test:65536",
            "a.test:123456",
            "[::1]:65536",
            "a.test:8o",
            "u@a.test",
            "a.test:80:80",
            "[::1",
            "[zz]",
            "[::1]x",
            "a test",
            "a.test\u{0}",
            "a.test?x",
            "a.test#x",
            "é.test",
        ] {
            assert!(parse_authority(bad.as_bytes()).is_none(), "{bad:?}");
        }
        assert_eq!(parse_authority(b"[::1]:80").as_deref(), Some("[::1]"));
    }

    #[test]
    fn stripping_removes_hop_by_hop_framing_and_proxy_control_headers() {
        // Through `RequestHead::parse`, which takes Host out first.
        let stripped = |method: Method| {
            let mut b = http::Request::builder().method(method).uri("/");
            for (n, v) in [
                ("connection", "x-secret, close"),
                ("x-secret", "1"),
                ("content-length", "5"),
                ("expect", "100-continue"),
                ("host", "a.test"),
                ("forwarded", "host=evil"),
                ("x-forwarded-host", "evil"),
                ("x-original-url", "/admin"),
                ("x-http-method-override", "DELETE"),
                ("te", "trailers"),
                ("upgrade", "h2c"),
                ("x-real-ip", "192.0.2.1"),
                ("accept", "*/*"),
            ] {
                b = b.header(n, v);
            }
            let (mut parts, ()) = b.body(()).expect("request").into_parts();
            let peer = IpAddr::from([127, 0, 0, 1]);
            RequestHead::parse(&mut parts, peer, RequestBody::None)
                .expect("a valid head")
                .headers
        };
        let get = stripped(Method::GET);
        assert_eq!(
            get.keys().map(HeaderName::as_str).collect::<Vec<_>>(),
            ["accept"]
        );
        let post = stripped(Method::POST);
        assert!(post.contains_key("x-http-method-override"));
        assert_eq!(post.len(), 2);
    }
}
