//! Arbitrary bytes as an origin response's freshness headers, one field
//! value per line: Cache-Control, Age, Expires, Date, Last-Modified, a
//! second Cache-Control, Vary, Content-Length, Set-Cookie. The first byte
//! picks the status. They go through `CacheControl::parse`, `sanitize_age`
//! and `RoutePolicy::evaluate` (the default policy and a generous one),
//! and a stored decision becomes an entry that is asked where it stands
//! and put through the L2 envelope.
//!
//! Invariants: nothing panics; unreadable Cache-Control bytes forbid
//! storing; a sanitized Age is digits no larger than 2^31; a Store
//! decision was allowed (no no-store, no private, no Vary: *) and has a
//! finite, bounded ttl and capped stale windows.
#![no_main]

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use corral_core::wire::envelope;
use corral_core::semantics::rfc9111::sanitize_age;
use corral_core::{CacheControl, Decision, RoutePolicy, Sharing, StoredResponse, Vary};
use http::header::{
    AGE, CACHE_CONTROL, CONTENT_LENGTH, DATE, EXPIRES, HeaderName, LAST_MODIFIED, SET_COOKIE, VARY,
};
use http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use libfuzzer_sys::fuzz_target;

const FIELDS: [HeaderName; 9] = [
    CACHE_CONTROL,
    AGE,
    EXPIRES,
    DATE,
    LAST_MODIFIED,
    CACHE_CONTROL,
    VARY,
    CONTENT_LENGTH,
    SET_COOKIE,
];

/// Ten years: no ttl is longer (policy.rs's MAX_TTL).
const MAX_TTL: Duration = Duration::from_secs(10 * 365 * 86400);

const STATUSES: [u16; 8] = [200, 203, 204, 206, 301, 404, 500, 299];

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let status = StatusCode::from_u16(STATUSES[usize::from(first) % STATUSES.len()])
        .expect("listed statuses are valid");
    let mut headers = HeaderMap::new();
    for (name, line) in FIELDS.iter().zip(rest.split(|&b| b == b'\n')) {
        if line.is_empty() {
            continue;
        }
        if let Ok(v) = HeaderValue::from_bytes(line) {
            headers.append(name.clone(), v);
        }
    }

    // Cache-Control.
    let cc = CacheControl::parse(&headers);
    assert_eq!(cc, CacheControl::parse(&headers.clone()));
    if headers
        .get_all(CACHE_CONTROL)
        .iter()
        .any(|v| v.to_str().is_err())
    {
        assert!(cc.no_store, "unreadable Cache-Control must forbid storing");
    }

    // Age.
    let mut sanitized = headers.clone();
    sanitize_age(&mut sanitized);
    if let Some(age) = sanitized.get(AGE) {
        let digits = age.to_str().expect("a sanitized Age is text");
        assert!(!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()));
        assert!(digits.parse::<u64>().expect("digits") <= 1 << 31);
        assert_eq!(sanitized.get_all(AGE).iter().count(), 1);
    }
    let mut twice = sanitized.clone();
    sanitize_age(&mut twice);
    assert_eq!(twice, sanitized, "sanitize_age is idempotent");

    // The decision.
    let generous = RoutePolicy {
        default_ttl: Some(Duration::from_secs(300)),
        heuristic_freshness: true,
        swr_default: Duration::from_secs(30),
        sie_default: Duration::from_secs(600),
        ttl_jitter_percent: 20,
        store_set_cookie: true,
        ..RoutePolicy::default()
    };
    let uri = Uri::from_static("http://origin.test/p?q=1");
    let (mut parts, ()) = http::Response::builder()
        .status(status)
        .body(())
        .expect("response")
        .into_parts();
    parts.headers = headers;
    let times = [
        UNIX_EPOCH + Duration::from_secs(1_700_000_000),
        UNIX_EPOCH + Duration::from_secs(4_102_444_800),
        UNIX_EPOCH,
    ];
    for policy in [RoutePolicy::default(), generous] {
        for now in times {
            let decision = policy.evaluate(&Method::GET, &uri, &parts, now);
            let Decision::Store { freshness } = decision else {
                continue;
            };
            assert!(!cc.no_store && !cc.private, "stored against {cc:?}");
            assert_ne!(Vary::parse(&parts.headers), Vary::Star);
            let bound = MAX_TTL.max(policy.default_ttl.unwrap_or_default());
            assert!(freshness.ttl <= bound, "ttl {:?}", freshness.ttl);
            assert!(freshness.swr <= policy.swr_max && freshness.sie <= policy.sie_max);
            if cc.forbids_stale() {
                assert!(freshness.swr.is_zero() && freshness.sie.is_zero());
            }
            assert_eq!(freshness.sharing, Sharing::of(&cc));
            stored(&parts, &freshness, now);
        }
    }
});

/// The entry a fill would store, asked where it stands over its life, and
/// through L2 and back.
fn stored(parts: &http::response::Parts, freshness: &corral_core::Freshness, now: SystemTime) {
    let mut headers = parts.headers.clone();
    sanitize_age(&mut headers);
    let vary = Vary::parse(&headers);
    let entry = StoredResponse::builder(
        parts.status,
        headers,
        Bytes::from_static(b"body"),
        freshness,
        now,
    )
    .fetch_duration(Duration::from_millis(3))
    .vary(vary.clone(), vary.values(&HeaderMap::new()))
    .generation(1)
    .build();
    assert!(entry.headers().get(SET_COOKIE).is_none());
    for later in [0, 1, 59, 3600, 86400 * 400] {
        let t = now + Duration::from_secs(later);
        let _ = entry.state(t);
        let _ = entry.usable_on_error(t);
        let _ = entry.ttl_secs(t);
        let _ = entry.age_secs(t);
        assert!(entry.residency(t) <= corral_core::MAX_RESIDENCY);
    }
    let _ = entry.weight();
    let back = envelope::decode(&envelope::encode(&entry), 2).expect("a stored entry round-trips");
    assert_eq!(back.headers(), entry.headers());
    assert_eq!(back.initial_age(), entry.initial_age());
}
