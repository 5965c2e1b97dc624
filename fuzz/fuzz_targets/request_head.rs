//! Arbitrary bytes as a client's HTTP/1.x request head, read as hyper
//! would (httparse, then `http` types), then through everything corral
//! builds from it: `RequestHead::parse`, the URI, primary and variant keys,
//! and the caller's identity. The same bytes also go straight to
//! `parse_authority`.
//!
//! Invariants: nothing panics; a valid head has a lowercase host with no
//! `/`, `?`, `#`, `@` and no `:` outside brackets, a path that starts with
//! `/` (or is `*`), none of the headers a client may not pass on, and a key
//! whose target() is exactly that path plus the parameters not ignored
//! (ordered by name, repeated ones in the order sent): a valid request
//! target that does not depend on how the host was spelled.
#![no_main]

use std::net::{IpAddr, Ipv4Addr};

use corral_core::semantics::head::{BadHead, RequestBody, RequestHead, parse_authority};
use corral_core::{IdentityRules, PrimaryKey, QueryFilter, UriKey, Vary};
use http::header::{AUTHORIZATION, CONNECTION, CONTENT_LENGTH, HeaderName, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderValue, Method, Uri, Version};
use libfuzzer_sys::fuzz_target;

/// Headers that must never survive `RequestHead::parse` (hop-by-hop,
/// framing, Host, proxy-control); method overrides only on GET and HEAD.
const NEVER_PASSED: [&str; 26] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "expect",
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
];
const METHOD_OVERRIDE: [&str; 3] = [
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
];

fuzz_target!(|data: &[u8]| {
    authority(data);
    let Some((method, uri, version, headers)) = read_head(data) else {
        return;
    };
    check(method.clone(), uri.clone(), version, headers.clone());
    // The same request as HTTP/2 would carry it (hyper gives the target
    // the scheme and authority of the pseudo-headers).
    check(method, uri, Version::HTTP_2, headers);
});

/// What the origin should be asked for: the path, then the parameters
/// that are not ignored, ordered by name (those of one name in the order
/// sent), or no query at all when none is left.
fn expected_target(path: &str, query: Option<&str>) -> String {
    let name = |p: &str| p.split_once('=').map_or(p, |(n, _)| n).to_owned();
    let mut kept: Vec<&str> = query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
        .filter(|p| {
            let n = name(p);
            !(n.starts_with("utm_") || n == "fbclid")
        })
        .collect();
    kept.sort_by_key(|p| name(p));
    if kept.is_empty() {
        path.to_owned()
    } else {
        format!("{path}?{}", kept.join("&"))
    }
}

/// The host of a `Host` value: lowercase, no port, nothing that could
/// make `host/path` ambiguous; and parsing it again changes nothing.
fn authority(raw: &[u8]) {
    if let Some(host) = parse_authority(raw) {
        check_host(&host);
        assert_eq!(
            parse_authority(host.as_bytes()).as_deref(),
            Some(host.as_str()),
            "a parsed host parses to itself"
        );
    }
}

fn check_host(host: &str) {
    for c in ['/', '?', '#', '@'] {
        assert!(!host.contains(c), "host {host:?} holds {c:?}");
    }
    let outside = match host.strip_prefix('[') {
        Some(rest) => {
            let close = rest.find(']').expect("a bracketed host closes");
            assert_eq!(close + 2, host.len(), "nothing after ] in {host:?}");
            ""
        }
        None => host,
    };
    assert!(!outside.contains(':'), "host {host:?} holds a port");
    assert_eq!(host, host.to_ascii_lowercase(), "host is lowercase");
}

type Head = (Method, Uri, Version, HeaderMap);

/// The head as hyper's HTTP/1 server would hand it over, or `None` where
/// hyper would refuse it.
fn read_head(data: &[u8]) -> Option<Head> {
    let mut slots = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut slots);
    let httparse::Status::Complete(_) = req.parse(data).ok()? else {
        return None;
    };
    let method = Method::from_bytes(req.method?.as_bytes()).ok()?;
    let uri: Uri = req.path?.parse().ok()?;
    let version = match req.version? {
        0 => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    let mut headers = HeaderMap::new();
    for h in req.headers.iter() {
        let name = HeaderName::from_bytes(h.name.as_bytes()).ok()?;
        let value = HeaderValue::from_bytes(h.value).ok()?;
        headers.append(name, value);
    }
    Some((method, uri, version, headers))
}

fn check(method: Method, uri: Uri, version: Version, headers: HeaderMap) {
    let body = if headers.contains_key(TRANSFER_ENCODING) {
        RequestBody::Streamed
    } else {
        match headers
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse().ok())
        {
            Some(n) => RequestBody::Sized(n),
            None => RequestBody::None,
        }
    };
    let mut b = http::Request::builder()
        .method(method.clone())
        .uri(uri)
        .version(version);
    if let Some(h) = b.headers_mut() {
        *h = headers.clone();
    }
    let Ok(req) = b.body(()) else { return };
    let (mut parts, ()) = req.into_parts();
    let head = match RequestHead::parse(&mut parts, IpAddr::V4(Ipv4Addr::LOCALHOST), body) {
        Ok(head) => head,
        Err(e) => {
            assert!(!e.detail().is_empty());
            if version == Version::HTTP_11 && e == BadHead::MissingHost {
                assert!(!headers.contains_key("host"));
            }
            return;
        }
    };

    // The host and path.
    check_host(&head.host);
    assert!(
        head.path.starts_with('/') || head.path == "*",
        "path {:?}",
        head.path
    );
    assert_eq!(head.method, method);
    assert!(head.path_and_query().starts_with(&head.path));

    // Nothing a client may not pass on survives.
    let connection_named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for name in head.headers.keys() {
        let n = name.as_str();
        assert!(!NEVER_PASSED.contains(&n), "{n} passed on");
        assert!(
            !connection_named.contains(name),
            "{n} named by Connection passed on"
        );
        if head.is_cacheable_method() {
            assert!(!METHOD_OVERRIDE.contains(&n), "{n} passed on a GET");
        }
    }
    for (name, value) in head.headers.iter() {
        // End-to-end headers are passed on unchanged and in order.
        let sent: Vec<&HeaderValue> = headers.get_all(name).iter().collect();
        let kept: Vec<&HeaderValue> = head.headers.get_all(name).iter().collect();
        assert_eq!(sent, kept, "{name} changed");
        assert!(sent.contains(&value));
    }

    // The keys.
    let filter = QueryFilter::new(&["utm_*", "fbclid"]);
    let key = UriKey::new(&head.host, &head.path, head.query.as_deref(), &filter);
    let target = key.target();
    assert!(
        target.starts_with(&head.path),
        "target {target:?} for path {:?}",
        head.path
    );
    assert_eq!(key.readable(), format!("{}{target}", head.host));
    assert_eq!(
        target,
        expected_target(&head.path, head.query.as_deref()),
        "the origin is not asked for what the client requested"
    );
    if head.path != "*" {
        let parsed: http::uri::PathAndQuery =
            target.parse().expect("target() is a valid request target");
        assert_eq!(parsed.path(), head.path);
    }
    let again = UriKey::new(&head.host, &head.path, head.query.as_deref(), &filter);
    assert!(again == key, "keys are deterministic");
    if !head.host.is_empty() {
        let spelled = format!("{}:8080", head.host.to_ascii_uppercase());
        let respelled = UriKey::new(&spelled, &head.path, head.query.as_deref(), &filter);
        assert_eq!(
            respelled.digest(),
            key.digest(),
            "host spelling changed the key"
        );
    }

    // Identity and variants.
    let rules = IdentityRules::new(vec![AUTHORIZATION], vec!["session".into(), "sid_v2".into()]);
    let identity = rules.identify(&head.headers);
    if head.headers.contains_key(AUTHORIZATION) {
        assert!(identity.is_some(), "Authorization but anonymous");
    }
    assert_eq!(identity, rules.identify(&head.headers.clone()));
    let primary = PrimaryKey::new("route", key);
    let vary = Vary::Headers(vec![
        HeaderName::from_static("accept-encoding"),
        HeaderName::from_static("accept-language"),
        HeaderName::from_static("cookie"),
    ]);
    let values = vary.values(&head.headers);
    assert_eq!(values.len(), 3);
    let shared = primary.variant(None, &values);
    assert!(!shared.private);
    if let Some(id) = identity.as_ref() {
        let own = primary.variant(Some(id), &values);
        assert!(own.private);
        assert_ne!(own.digest, shared.digest);
        assert_ne!(primary.pass_scope(Some(id)), primary.pass_scope(None));
    }
}
