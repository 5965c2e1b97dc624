//! HTTP caching by the RFCs (RFC 9111, RFC 9110's dates and conditionals,
//! RFC 9213's CDN-Cache-Control): one scenario per rule, each asserting what
//! reached the origin and what the client got, over a real corral and a
//! raw origin that answers exactly the bytes written here. Sleeps only let
//! a one-second lifetime run out.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use corral_tests::raw::exchange_bytes;
use corral_tests::raw_origin::response;
use corral_tests::{Client, Config, Proxy, RawOrigin, RawRequest};

/// An HTTP-date `offset` seconds from now.
fn date(offset: i64) -> String {
    let now = SystemTime::now();
    let t = if offset >= 0 {
        now + Duration::from_secs(offset.unsigned_abs())
    } else {
        now - Duration::from_secs(offset.unsigned_abs())
    };
    httpdate::fmt_http_date(t)
}

/// `Sun, 06 Nov 1994 08:49:37 GMT` → `Sunday, 06-Nov-94 08:49:37 GMT`.
fn rfc850(imf: &str) -> String {
    let (day, rest) = imf.split_once(", ").expect("IMF-fixdate");
    let long = match day {
        "Mon" => "Monday",
        "Tue" => "Tuesday",
        "Wed" => "Wednesday",
        "Thu" => "Thursday",
        "Fri" => "Friday",
        "Sat" => "Saturday",
        _ => "Sunday",
    };
    let parts: Vec<&str> = rest.split(' ').collect();
    format!(
        "{long}, {}-{}-{} {} GMT",
        parts[0],
        parts[1],
        &parts[2][2..],
        parts[3]
    )
}

/// `Sun, 06 Nov 1994 08:49:37 GMT` → `Sun Nov  6 08:49:37 1994`.
fn asctime(imf: &str) -> String {
    let (day, rest) = imf.split_once(", ").expect("IMF-fixdate");
    let parts: Vec<&str> = rest.split(' ').collect();
    let d: u32 = parts[0].parse().expect("day");
    format!("{day} {} {d:>2} {} {}", parts[1], parts[3], parts[2])
}

/// Just past a `max-age=1`.
const PAST_ONE_SECOND: Duration = Duration::from_millis(1200);

async fn proxy_for(origin: &RawOrigin) -> corral_tests::RunningProxy {
    Proxy::new(Config::single(origin.url()))
        .with_test_clock()
        .start()
        .await
}

/// How many requests for `target` reached the origin.
fn hits(origin: &RawOrigin, target: &str) -> usize {
    origin
        .requests()
        .iter()
        .filter(|r| r.target() == target)
        .count()
}

/// An origin answering each target with the headers `headers(target)`
/// returns (status first), body `body-of-<target>`.
async fn origin_with(
    f: impl Fn(&RawRequest) -> (u16, Vec<(String, String)>) + Send + Sync + 'static,
) -> RawOrigin {
    RawOrigin::start(move |r| {
        let (status, headers) = f(r);
        if status == 0 {
            return Vec::new();
        }
        let pairs: Vec<(&str, &str)> = headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        response(status, &pairs, &format!("body-of-{}", r.target()))
    })
    .await
}

fn h(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
        .collect()
}

// ---------------------------------------------------------------------------
// Age (§5.1), Expires and HTTP-date (§5.3, RFC 9110 §5.6.7), directive case
// (§5.2)
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_age_list_counts_its_first_member() {
    // Already 7200 s old for a 3600 s lifetime: stale on arrival, so
    // never a hit.
    let origin = origin_with(|_| {
        (
            200,
            h(&[("cache-control", "max-age=3600"), ("age", "7200, 0")]),
        )
    })
    .await;
    let proxy = proxy_for(&origin).await;
    let client = Client::new();
    for _ in 0..2 {
        let a = client.get(&proxy.url("/age")).await;
        assert_eq!(a.status, 200);
        assert!(!a.cache_status().is_hit(), "{}", a.cache_status());
    }
    assert_eq!(hits(&origin, "/age"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expires_is_read_in_all_three_date_formats() {
    let origin = origin_with(|r| {
        let later = date(3600);
        let expires = match r.target() {
            "/imf" => later,
            "/rfc850" => rfc850(&later),
            // §4.2: a cache reads a date's names in any case (failed on
            // aba7387: read as invalid, so already expired).
            "/upper" => later.to_ascii_uppercase(),
            _ => asctime(&later),
        };
        (200, h(&[("date", &date(0)), ("expires", &expires)]))
    })
    .await;
    let proxy = proxy_for(&origin).await;
    let client = Client::new();
    for target in ["/imf", "/rfc850", "/asctime", "/upper"] {
        client.get(&proxy.url(target)).await;
        let again = client.get(&proxy.url(target)).await;
        assert!(
            again.cache_status().is_hit(),
            "{target}: {}",
            again.cache_status()
        );
        assert_eq!(hits(&origin, target), 1, "{target}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expires_with_extra_spaces_is_invalid_so_already_expired() {
    let origin = origin_with(|_| {
        let spaced = date(3600).replacen(' ', "  ", 2);
        (200, h(&[("date", &date(0)), ("expires", &spaced)]))
    })
    .await;
    let proxy = proxy_for(&origin).await;
    let client = Client::new();
    for _ in 0..2 {
        client.get(&proxy.url("/spaced")).await;
    }
    assert_eq!(hits(&origin, "/spaced"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn directive_names_match_in_any_case() {
    let origin = origin_with(|r| match r.target() {
        "/max-age" => (200, h(&[("cache-control", "MaX-aGe=3600")])),
        _ => (
            200,
            h(&[
                ("cache-control", "No-CaChE, max-age=3600"),
                ("etag", "\"v1\""),
            ]),
        ),
    })
    .await;
    let proxy = proxy_for(&origin).await;
    let client = Client::new();
    client.get(&proxy.url("/max-age")).await;
    assert!(
        client
            .get(&proxy.url("/max-age"))
            .await
            .cache_status()
            .is_hit()
    );
    assert_eq!(hits(&origin, "/max-age"), 1);
    // `No-CaChE` is no-cache: the second use goes to the origin.
    client.get(&proxy.url("/no-cache")).await;
    client.get(&proxy.url("/no-cache")).await;
    assert_eq!(hits(&origin, "/no-cache"), 2);
}

// ---------------------------------------------------------------------------
// Which statuses are stored (§3)
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_final_status_with_explicit_freshness_is_stored() {
    let origin = origin_with(|r| {
        let status: u16 = r.target()[1..4].parse().expect("status in the path");
        if r.target().ends_with("/fresh") {
            (status, h(&[("cache-control", "max-age=3600")]))
        } else {
            (status, Vec::new())
        }
    })
    .await;
    let proxy = proxy_for(&origin).await;
    let client = Client::new();
    for status in [299, 400, 499, 503] {
        let target = format!("/{status}/fresh");
        let first = client.get(&proxy.url(&target)).await;
        assert_eq!(first.status.as_u16(), status);
        let again = client.get(&proxy.url(&target)).await;
        assert_eq!(again.status.as_u16(), status);
        assert_eq!(again.text(), format!("body-of-{target}"));
        assert!(
            again.cache_status().is_hit(),
            "{target}: {}",
            again.cache_status()
        );
        assert_eq!(hits(&origin, &target), 1, "{target}");
    }
    // A 5xx without freshness is not stored: the next request asks the
    // origin again (one failure starts no back-off; see origin_failure.rs).
    let first = client.get(&proxy.url("/500/none")).await;
    assert_eq!(first.status, 500);
    let again = client.get(&proxy.url("/500/none")).await;
    assert_eq!(again.status, 500);
    assert!(!again.cache_status().is_hit(), "{}", again.cache_status());
    assert_eq!(hits(&origin, "/500/none"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn must_understand_stores_only_understood_statuses_and_overrides_no_store() {
    // §5.2.2.3. Failed on 4bc6830: the 599 was stored and served as a hit,
    // and the understood 200 was refused for its no-store.
    let origin = origin_with(|r| match r.target() {
        "/599" => (
            599,
            h(&[("cache-control", "max-age=3600, must-understand")]),
        ),
        _ => (
            200,
            h(&[("cache-control", "no-store, must-understand, max-age=3600")]),
        ),
    })
    .await;
    let proxy = proxy_for(&origin).await;
    let client = Client::new();
    for _ in 0..2 {
        let a = client.get(&proxy.url("/599")).await;
        assert_eq!(a.status.as_u16(), 599);
        assert!(!a.cache_status().is_hit(), "{}", a.cache_status());
    }
    assert_eq!(hits(&origin, "/599"), 2, "an unknown status is not stored");
    for _ in 0..2 {
        let a = client.get(&proxy.url("/200")).await;
        assert_eq!(
            (a.status.as_u16(), a.text()),
            (200, "body-of-/200".to_owned())
        );
    }
    assert_eq!(
        hits(&origin, "/200"),
        1,
        "no-store gives way to must-understand"
    );
}

// ---------------------------------------------------------------------------
// no-cache (§5.2.2.4) and conditional requests (RFC 9110 §13)
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_304_updates_every_stored_field_but_the_framing() {
    // §3.2: each field a 304 carries replaces the stored one (the validator
    // and the content coding too: corral keeps the bytes as sent), except
    // Content-Length, which belongs to the stored body.
    let origin = origin_with(|r| {
        let (status, tag) = if r.header("if-none-match").is_some() {
            (304, "b")
        } else {
            (200, "a")
        };
        let etag = format!("\"etag-{tag}\"");
        let coding = format!("x-coding-{tag}");
        let test = format!("test-{tag}");
        (
            status,
            h(&[
                ("cache-control", "max-age=1"),
                ("etag", &etag),
                ("content-encoding", &coding),
                ("test-header", &test),
            ]),
        )
    })
    .await;
    let proxy = proxy_for(&origin).await;
    let client = Client::new();
    client.get(&proxy.url("/u304")).await;
    proxy.advance_clock(PAST_ONE_SECOND).await;
    let a = client.get(&proxy.url("/u304")).await;
    assert_eq!(
        (a.status.as_u16(), a.text()),
        (200, "body-of-/u304".to_owned())
    );
    let seen = origin.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].header("if-none-match"), Some("\"etag-a\""));
    assert_eq!(a.header("test-header"), Some("test-b"));
    assert_eq!(a.header("etag"), Some("\"etag-b\""));
    assert_eq!(a.header("content-encoding"), Some("x-coding-b"));
    assert_eq!(a.header("content-length"), Some("13"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_no_cache_response_is_stored_and_revalidated_before_every_reuse() {
    let origin = origin_with(|r| {
        if r.header("if-none-match") == Some("\"v1\"") {
            (304, h(&[("cache-control", "no-cache"), ("etag", "\"v1\"")]))
        } else {
            (200, h(&[("cache-control", "no-cache"), ("etag", "\"v1\"")]))
        }
    })
    .await;
    let proxy = proxy_for(&origin).await;
    let client = Client::new();
    for _ in 0..3 {
        let a = client.get(&proxy.url("/nc")).await;
        assert_eq!(
            (a.status.as_u16(), a.text()),
            (200, "body-of-/nc".to_owned())
        );
    }
    let seen = origin.requests();
    assert_eq!(seen.len(), 3, "every reuse is revalidated");
    assert_eq!(seen[0].header("if-none-match"), None);
    // The stored copy makes each revalidation conditional.
    assert_eq!(seen[1].header("if-none-match"), Some("\"v1\""));
    assert_eq!(seen[2].header("if-none-match"), Some("\"v1\""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn if_modified_since_is_answered_from_a_fresh_entry() {
    let modified = date(-3600);
    let origin = {
        let modified = modified.clone();
        origin_with(move |_| {
            (
                200,
                h(&[
                    ("cache-control", "max-age=3600"),
                    ("last-modified", &modified),
                ]),
            )
        })
        .await
    };
    let proxy = proxy_for(&origin).await;
    let client = Client::new();
    client.get(&proxy.url("/ims")).await;
    let same = client
        .get_with(&proxy.url("/ims"), &[("if-modified-since", &modified)])
        .await;
    assert_eq!(same.status, 304);
    assert!(same.body.is_empty());
    let older = client
        .get_with(&proxy.url("/ims"), &[("if-modified-since", &date(-7200))])
        .await;
    assert_eq!(older.status, 200);
    // If-None-Match takes precedence over If-Modified-Since.
    let both = client
        .get_with(
            &proxy.url("/ims"),
            &[
                ("if-modified-since", &modified),
                ("if-none-match", "\"other\""),
            ],
        )
        .await;
    assert_eq!(both.status, 200);
    assert_eq!(hits(&origin, "/ims"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conditional_request_revalidated_with_a_304_gets_a_304() {
    let modified = date(-3600);
    let origin = {
        let modified = modified.clone();
        origin_with(move |r| {
            let headers = h(&[("cache-control", "max-age=1"), ("last-modified", &modified)]);
            if r.header("if-modified-since").is_some() {
                (304, headers)
            } else {
                (200, headers)
            }
        })
        .await
    };
    let proxy = proxy_for(&origin).await;
    let client = Client::new();
    client.get(&proxy.url("/reval")).await;
    proxy.advance_clock(PAST_ONE_SECOND).await;
    let a = client
        .get_with(&proxy.url("/reval"), &[("if-modified-since", &modified)])
        .await;
    assert_eq!(a.status, 304, "{}", a.cache_status());
    let seen = origin.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].header("if-modified-since"), Some(modified.as_str()));
}

// ---------------------------------------------------------------------------
// Serving stale when the origin fails (§4.2.4, RFC 5861)
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_that_closes_without_an_answer_is_an_error_stale_if_error_covers() {
    let served = Arc::new(AtomicUsize::new(0));
    let origin = {
        let served = Arc::clone(&served);
        origin_with(move |_| {
            if served.fetch_add(1, Ordering::SeqCst) == 0 {
                (200, h(&[("cache-control", "max-age=1, stale-if-error=60")]))
            } else {
                (0, Vec::new()) // close the connection, no answer
            }
        })
        .await
    };
    let proxy = proxy_for(&origin).await;
    let client = Client::new();
    client.get(&proxy.url("/close")).await;
    proxy.advance_clock(PAST_ONE_SECOND).await;
    let a = client.get(&proxy.url("/close")).await;
    assert_eq!(
        (a.status.as_u16(), a.text()),
        (200, "body-of-/close".to_owned())
    );
    assert_eq!(
        a.cache_status().detail(),
        Some("stale-if-error"),
        "{}",
        a.cache_status()
    );
}

// ---------------------------------------------------------------------------
// Vary (§4.1)
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_language_values_differing_in_case_or_order_select_one_variant() {
    let origin = origin_with(|_| {
        (
            200,
            h(&[
                ("cache-control", "max-age=3600"),
                ("vary", "Accept-Language"),
            ]),
        )
    })
    .await;
    let proxy = proxy_for(&origin).await;
    let client = Client::new();
    client
        .get_with(
            &proxy.url("/lang"),
            &[("accept-language", "en-US, fr;q=0.5")],
        )
        .await;
    let other_case = client
        .get_with(
            &proxy.url("/lang"),
            &[("accept-language", "FR;q=0.5, en-us")],
        )
        .await;
    assert!(
        other_case.cache_status().is_hit(),
        "{}",
        other_case.cache_status()
    );
    let other_language = client
        .get_with(&proxy.url("/lang"), &[("accept-language", "de")])
        .await;
    assert!(!other_language.cache_status().is_hit());
    assert_eq!(hits(&origin, "/lang"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_that_closes_mid_body_is_an_error_stale_if_error_covers() {
    let served = Arc::new(AtomicUsize::new(0));
    let origin = {
        let served = Arc::clone(&served);
        RawOrigin::start(move |r| {
            if served.fetch_add(1, Ordering::SeqCst) == 0 {
                response(
                    200,
                    &[("cache-control", "max-age=1, stale-if-error=60")],
                    &format!("body-of-{}", r.target()),
                )
            } else {
                // Promises 100 bytes, sends 5, closes.
                b"HTTP/1.1 200 OK\r\ncache-control: max-age=1\r\ncontent-length: 100\r\nconnection: close\r\n\r\nhello"
                    .to_vec()
            }
        })
        .await
    };
    let proxy = proxy_for(&origin).await;
    let client = Client::new();
    client.get(&proxy.url("/cut")).await;
    proxy.advance_clock(PAST_ONE_SECOND).await;
    let a = client.get(&proxy.url("/cut")).await;
    assert_eq!(
        (a.status.as_u16(), a.text()),
        (200, "body-of-/cut".to_owned())
    );
    assert_eq!(
        a.cache_status().detail(),
        Some("stale-if-error"),
        "{}",
        a.cache_status()
    );
}

// ---------------------------------------------------------------------------
// Range requests (RFC 9110 §14) from the stored complete response
// ---------------------------------------------------------------------------

/// 26 bytes: `abcdefghijklmnopqrstuvwxyz`.
const ALPHABET: &str = "abcdefghijklmnopqrstuvwxyz";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn range_requests_are_answered_from_the_stored_response() {
    let origin = RawOrigin::start(|_| {
        response(
            200,
            &[("cache-control", "max-age=3600"), ("etag", "\"v1\"")],
            ALPHABET,
        )
    })
    .await;
    let proxy = proxy_for(&origin).await;
    let client = Client::new();
    let url = proxy.url("/file");
    // A cold key: the fill fetches the whole representation; the client
    // gets its range.
    let first = client.get_with(&url, &[("range", "bytes=0-3")]).await;
    assert_eq!(first.status, 206);
    assert_eq!(first.text(), "abcd");
    assert_eq!(first.header("content-range"), Some("bytes 0-3/26"));
    assert_eq!(first.header("content-length"), Some("4"));
    for (range, status, body, content_range) in [
        ("bytes=23-", 206, "xyz", Some("bytes 23-25/26")),
        ("bytes=-2", 206, "yz", Some("bytes 24-25/26")),
        ("bytes=20-100", 206, "uvwxyz", Some("bytes 20-25/26")),
        ("bytes=26-", 416, "", Some("bytes */26")),
        // Several ranges, or another unit: the whole response.
        ("bytes=0-1,3-4", 200, ALPHABET, None),
        ("lines=1-2", 200, ALPHABET, None),
    ] {
        let a = client.get_with(&url, &[("range", range)]).await;
        assert_eq!(a.status.as_u16(), status, "{range}");
        assert_eq!(a.text(), body, "{range}");
        assert_eq!(a.header("content-range"), content_range, "{range}");
        assert!(a.cache_status().is_hit(), "{range}: {}", a.cache_status());
    }
    // If-Range: the range only while the validator still matches.
    let same = client
        .get_with(&url, &[("range", "bytes=0-0"), ("if-range", "\"v1\"")])
        .await;
    assert_eq!((same.status.as_u16(), same.text()), (206, "a".to_owned()));
    let changed = client
        .get_with(&url, &[("range", "bytes=0-0"), ("if-range", "\"v0\"")])
        .await;
    assert_eq!(
        (changed.status.as_u16(), changed.text()),
        (200, ALPHABET.to_owned())
    );
    // One request reached the origin, for the whole representation.
    let seen = origin.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].header("range"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_download_too_large_to_store_resumes_at_the_origin() {
    let body = "x".repeat(4096);
    let origin = {
        let body = body.clone();
        RawOrigin::start(move |r| match r.header("range") {
            Some("bytes=4000-") => {
                let mut out = b"HTTP/1.1 206 Partial Content\r\ncontent-range: bytes 4000-4095/4096\r\ncontent-length: 96\r\n\r\n".to_vec();
                out.extend_from_slice(&body.as_bytes()[4000..]);
                out
            }
            _ => response(200, &[("cache-control", "max-age=3600")], &body),
        })
        .await
    };
    let proxy = Proxy::new(Config::single(origin.url()).cache("max_object_size", "1KiB"))
        .start()
        .await;
    let client = Client::new();
    let url = proxy.url("/big");
    let whole = client.get(&url).await;
    assert_eq!((whole.status.as_u16(), whole.body.len()), (200, 4096));
    // Known too large: the range goes to the origin as asked.
    let rest = client.get_with(&url, &[("range", "bytes=4000-")]).await;
    assert_eq!(rest.status, 206);
    assert_eq!(rest.body.len(), 96);
    assert_eq!(rest.header("content-range"), Some("bytes 4000-4095/4096"));
    let seen = origin.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].header("range"), Some("bytes=4000-"));
}

// ---------------------------------------------------------------------------
// Targeted cache control (RFC 9213)
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdn_cache_control_overrides_cache_control_for_corral_only() {
    let origin = origin_with(|r| match r.target() {
        // Downstream must not store it; corral may, for an hour.
        "/cdn" => (
            200,
            h(&[
                ("cache-control", "no-store"),
                ("cdn-cache-control", "max-age=3600"),
            ]),
        ),
        // Cache-Control would let corral store it; the targeted field
        // says no.
        "/cdn-no" => (
            200,
            h(&[
                ("cache-control", "max-age=3600"),
                ("cdn-cache-control", "no-store"),
            ]),
        ),
        // A value of the wrong type makes the field invalid, so ignored
        // (failed on 4bc6830: the quoted max-age was read as 3600).
        "/cdn-typed" => (
            200,
            h(&[
                ("cache-control", "no-store"),
                ("cdn-cache-control", "max-age=\"3600\""),
            ]),
        ),
        // An invalid targeted field (uppercase key) is ignored.
        _ => (
            200,
            h(&[
                ("cache-control", "no-store"),
                ("cdn-cache-control", "MAX-AGE=3600"),
            ]),
        ),
    })
    .await;
    let proxy = proxy_for(&origin).await;
    let client = Client::new();
    for target in ["/cdn", "/cdn-no", "/cdn-bad", "/cdn-typed"] {
        client.get(&proxy.url(target)).await;
        let again = client.get(&proxy.url(target)).await;
        // Both fields reach the client: CDN-Cache-Control is for every
        // CDN on the way.
        assert!(again.header("cache-control").is_some(), "{target}");
        assert!(again.header("cdn-cache-control").is_some(), "{target}");
    }
    assert_eq!(hits(&origin, "/cdn"), 1);
    assert_eq!(hits(&origin, "/cdn-no"), 2);
    assert_eq!(hits(&origin, "/cdn-bad"), 2);
    assert_eq!(hits(&origin, "/cdn-typed"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_field_that_targets_corral_alone_wins_and_is_not_passed_on() {
    let origin = origin_with(|_| {
        (
            200,
            h(&[
                ("cache-control", "no-store"),
                ("cdn-cache-control", "no-store"),
                ("corral-cache-control", "max-age=3600"),
            ]),
        )
    })
    .await;
    let config = Config::new().route(corral_tests::Route::new("api", origin.url()).cache(
        "targeted_fields",
        "[Corral-Cache-Control, CDN-Cache-Control]",
    ));
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();
    client.get(&proxy.url("/own")).await;
    let again = client.get(&proxy.url("/own")).await;
    assert!(again.cache_status().is_hit(), "{}", again.cache_status());
    assert_eq!(again.header("corral-cache-control"), None);
    assert_eq!(again.header("cache-control"), Some("no-store"));
    assert_eq!(again.header("cdn-cache-control"), Some("no-store"));
    assert_eq!(hits(&origin, "/own"), 1);
}

// ---------------------------------------------------------------------------
// HTTP Cache Groups (RFC 9875)
// ---------------------------------------------------------------------------

/// GETs are cacheable and grouped by their first path segment; a POST to
/// /edit answers 200 naming `invalidate` in Cache-Group-Invalidation; a GET
/// to /sneaky names "articles" too (and must be ignored: a safe method).
async fn grouped_origin() -> RawOrigin {
    RawOrigin::start(|r| {
        let target = r.target().to_owned();
        if r.method() == "POST" {
            return response(
                200,
                &[("cache-group-invalidation", "\"articles\", \"unused\"")],
                "edited",
            );
        }
        let group = if target.starts_with("/articles/") {
            "\"articles\", \"all\""
        } else {
            "\"others\""
        };
        let mut headers = vec![("cache-control", "max-age=3600"), ("cache-groups", group)];
        if target == "/sneaky" {
            headers.push(("cache-group-invalidation", "\"articles\""));
        }
        response(200, &headers, &format!("body-of-{target}"))
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_group_invalidation_on_a_write_retires_the_group() {
    let origin = grouped_origin().await;
    let proxy = proxy_for(&origin).await;
    let client = Client::new();
    let paths = ["/articles/1", "/articles/2", "/others/1"];
    for p in paths {
        client.get(&proxy.url(p)).await;
    }
    // A safe method's Cache-Group-Invalidation is ignored.
    client.get(&proxy.url("/sneaky")).await;
    for p in paths {
        assert!(
            client.get(&proxy.url(p)).await.cache_status().is_hit(),
            "{p}"
        );
    }
    let edited = client
        .send(http::Method::POST, &proxy.url("/edit"), &[], None)
        .await;
    assert_eq!(edited.status, 200);
    for p in paths {
        client.get(&proxy.url(p)).await;
    }
    assert_eq!(hits(&origin, "/articles/1"), 2);
    assert_eq!(hits(&origin, "/articles/2"), 2);
    assert_eq!(hits(&origin, "/others/1"), 1, "another group is kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_group_invalidation_reaches_every_instance() {
    let redis = corral_tests::Redis::start().await;
    let origin = grouped_origin().await;
    let proxies = Proxy::new(Config::single(origin.url()).redis(&redis.url()))
        .instances(2)
        .start_all()
        .await;
    let (a, b) = (&proxies[0], &proxies[1]);
    let client = Client::new();
    client.get(&a.url("/articles/1")).await;
    assert!(
        client
            .get(&b.url("/articles/1"))
            .await
            .cache_status()
            .is_hit()
    );
    client
        .send(http::Method::POST, &a.url("/edit"), &[], None)
        .await;
    let (client, b) = (&client, b);
    corral_tests::eventually(
        corral_tests::DEADLINE,
        "B fetches the invalidated group again",
        move || async move {
            !client
                .get(&b.url("/articles/1"))
                .await
                .cache_status()
                .is_hit()
        },
    )
    .await;
    assert_eq!(hits(&origin, "/articles/1"), 2);
}

// ---------------------------------------------------------------------------
// Interim responses (§3, RFC 9110 §15.2)
// ---------------------------------------------------------------------------

/// An origin that sends `103 Early Hints` before every final answer.
async fn hinting_origin() -> RawOrigin {
    RawOrigin::start(|r| {
        let mut out = b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\nx-interim: yes\r\n\r\n".to_vec();
        out.extend(response(
            200,
            &[("cache-control", "max-age=3600")],
            &format!("body-of-{}", r.target()),
        ));
        out
    })
    .await
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_hints_reach_the_caller_before_the_answer_and_are_never_stored() {
    // Failed on 4bc6830: corral's client dropped the 103.
    let origin = hinting_origin().await;
    let proxy = proxy_for(&origin).await;
    let get = |path: &str, version: &str| {
        format!("GET {path} {version}\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
    };
    let within = Duration::from_secs(10);
    let first =
        text(&exchange_bytes(proxy.addr(), get("/hints", "HTTP/1.1").as_bytes(), within).await);
    let (interim, last) = first
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no head in {first:?}"));
    assert_eq!(
        interim,
        "HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\nx-interim: yes"
    );
    assert!(last.starts_with("HTTP/1.1 200 OK\r\n"), "{first:?}");
    assert!(last.ends_with("body-of-/hints"), "{first:?}");
    // Its fields are the interim answer's only.
    assert!(
        !last.contains("x-interim") && !last.contains("link:"),
        "{first:?}"
    );

    // The stored answer has neither the 103 nor its fields.
    let again =
        text(&exchange_bytes(proxy.addr(), get("/hints", "HTTP/1.1").as_bytes(), within).await);
    assert!(again.starts_with("HTTP/1.1 200 OK\r\n"), "{again:?}");
    assert!(again.contains("; hit"), "{again:?}");
    assert!(
        !again.contains("103") && !again.contains("x-interim"),
        "{again:?}"
    );
    assert_eq!(hits(&origin, "/hints"), 1);

    // An HTTP/1.0 client never gets a 1xx.
    let old =
        text(&exchange_bytes(proxy.addr(), get("/hints10", "HTTP/1.0").as_bytes(), within).await);
    assert!(
        old.starts_with("HTTP/1.0 200 OK\r\n") || old.starts_with("HTTP/1.1 200 OK\r\n"),
        "{old:?}"
    );
    assert!(!old.contains("103"), "{old:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_hints_of_a_pipelined_request_follow_the_answer_before_it() {
    let origin = hinting_origin().await;
    let proxy = proxy_for(&origin).await;
    // Two requests in one write: the second one's 103 must come after
    // every byte of the first answer, never inside it.
    let both = "GET /one HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\nGET /two HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n";
    let got = text(&exchange_bytes(proxy.addr(), both.as_bytes(), Duration::from_secs(10)).await);
    let hint =
        "HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\nx-interim: yes\r\n\r\n";
    let first_body = got
        .find("body-of-/one")
        .unwrap_or_else(|| panic!("{got:?}"));
    let second_hint = got.rfind(hint).unwrap_or_else(|| panic!("{got:?}"));
    let second_head = got
        .rfind("HTTP/1.1 200 OK")
        .unwrap_or_else(|| panic!("{got:?}"));
    assert!(got.starts_with(hint), "{got:?}");
    assert!(
        first_body < second_hint && second_hint < second_head,
        "{got:?}"
    );
    assert!(got.ends_with("body-of-/two"), "{got:?}");
    assert_eq!(got.matches(hint).count(), 2, "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_hints_reach_tls_clients_over_http1_and_h2() {
    use corral_tests::temp::TempDir;
    use corral_tests::tls::{Pki, tls_get};
    let dir = TempDir::new("corral-early-hints-tls").expect("temp dir");
    let pki = Pki::new(dir.path(), "ca");
    let cert = pki.issue("listener", &["corral.test"], false);
    let origin = hinting_origin().await;
    let addr = corral_tests::ports::free_addr_for_config().expect("free port");
    let _proxy = Proxy::new(Config::single(origin.url()).top("listen_tls", &cert.listen_tls(addr)))
        .start()
        .await;
    let ca = pki.ca_file("ca");
    // Cold keys, so that each request reaches the origin.
    let h1 = tls_get(addr, &ca, "corral.test", &[b"http/1.1"], "/tls-h1")
        .await
        .expect("a TLS HTTP/1.1 request");
    assert_eq!(h1.alpn.as_deref(), Some(&b"http/1.1"[..]));
    assert_eq!((h1.status, h1.body.as_str()), (200, "body-of-/tls-h1"));
    assert_eq!(h1.interim, [103], "the 103 goes through TLS too");
    let h2 = tls_get(addr, &ca, "corral.test", &[b"h2"], "/tls-h2")
        .await
        .expect("a TLS h2 request");
    assert_eq!(h2.alpn.as_deref(), Some(&b"h2"[..]));
    assert_eq!((h2.status, h2.body.as_str()), (200, "body-of-/tls-h2"));
    // Failed before corral served HTTP/2 itself: hyper sends no 1xx on h2.
    assert_eq!(h2.interim, [103], "the 103 reaches an h2 client too");
    assert_eq!(hits(&origin, "/tls-h1") + hits(&origin, "/tls-h2"), 2);
}

/// An origin whose answers to `target` come after two `103`s: the first
/// names `target`'s own stylesheet, the second carries hop-by-hop fields
/// (which no client may get, and which HTTP/2 forbids) beside a font.
async fn twice_hinting_origin() -> RawOrigin {
    RawOrigin::start(|r| {
        let target = r.target();
        let mut out = format!(
            "HTTP/1.1 103 Early Hints\r\nlink: <{target}.css>; rel=preload\r\n\r\n\
             HTTP/1.1 103 Early Hints\r\nconnection: x-hop\r\nx-hop: 1\r\nkeep-alive: timeout=5\r\n\
             link: </font.woff2>; rel=preload\r\n\r\n"
        )
        .into_bytes();
        out.extend(response(
            200,
            &[("cache-control", "max-age=3600")],
            &format!("body-of-{target}"),
        ));
        out
    })
    .await
}

fn fields(h: &http::HeaderMap) -> Vec<(String, String)> {
    h.iter()
        .map(|(n, v)| (n.to_string(), v.to_str().unwrap_or("?").to_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_hints_reach_an_h2_client_in_order_before_the_answer_and_are_never_stored() {
    use corral_tests::h2_client::H2Connection;
    // Failed on cb0d223: an h2 client (h2c, prior knowledge) got the 200
    // alone; hyper has no way to send a 1xx on an HTTP/2 stream.
    let origin = twice_hinting_origin().await;
    let proxy = proxy_for(&origin).await;
    let connect = || async {
        let tcp = tokio::net::TcpStream::connect(proxy.addr())
            .await
            .expect("connect");
        H2Connection::open(tcp, "http", "127.0.0.1")
            .await
            .expect("h2 handshake")
    };
    let first = connect().await.get("/page").await.expect("an h2 answer");
    assert_eq!(first.interim_statuses(), [103, 103]);
    assert_eq!(
        fields(&first.interim[0].1),
        [("link".to_owned(), "</page.css>; rel=preload".to_owned())]
    );
    // The hop-by-hop fields stay behind, as on HTTP/1.1.
    assert_eq!(
        fields(&first.interim[1].1),
        [("link".to_owned(), "</font.woff2>; rel=preload".to_owned())]
    );
    assert_eq!(
        (first.status, first.text().as_str()),
        (200, "body-of-/page")
    );
    assert!(!first.headers.contains_key("link"), "{:?}", first.headers);

    // A hit: the stored answer has neither the 103s nor their fields.
    let again = connect().await.get("/page").await.expect("an h2 answer");
    assert!(again.interim.is_empty(), "{:?}", again.interim);
    assert_eq!(
        (again.status, again.text().as_str()),
        (200, "body-of-/page")
    );
    assert!(!again.headers.contains_key("link"), "{:?}", again.headers);
    let status = again
        .headers
        .get("cache-status")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    assert!(status.contains("hit"), "{status:?}");
    assert_eq!(hits(&origin, "/page"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_hints_of_one_h2_stream_never_reach_another_on_the_same_connection() {
    use corral_tests::h2_client::H2Connection;
    // Hostile twin: an attacker and a victim multiplexed on one
    // connection (a shared front proxy's, say). Each stream gets the
    // hints its own origin answer carried, and only those.
    let origin = twice_hinting_origin().await;
    let proxy = proxy_for(&origin).await;
    let tcp = tokio::net::TcpStream::connect(proxy.addr())
        .await
        .expect("connect");
    let conn = H2Connection::open(tcp, "http", "127.0.0.1")
        .await
        .expect("h2 handshake");
    let paths: Vec<String> = (0..8).map(|i| format!("/stream-{i}")).collect();
    let answers = futures_util::future::join_all(paths.iter().map(|p| conn.get(p))).await;
    for (path, got) in paths.iter().zip(answers) {
        let got = got.expect("an h2 answer");
        assert_eq!((got.status, got.text()), (200, format!("body-of-{path}")));
        let links: Vec<String> = got
            .interim
            .iter()
            .flat_map(|(_, h)| h.get_all("link").iter())
            .map(|v| v.to_str().unwrap_or("?").to_owned())
            .collect();
        assert_eq!(
            links,
            [
                format!("<{path}.css>; rel=preload"),
                "</font.woff2>; rel=preload".to_owned()
            ],
            "{path}"
        );
        assert_eq!(hits(&origin, path), 1);
    }
}

// ---------------------------------------------------------------------------
// Compression dictionaries (RFC 9842)
// ---------------------------------------------------------------------------

/// An origin that answers `Content-Encoding: dcb` with a body naming the
/// dictionary the caller offered (`Available-Dictionary`), as a body only
/// that caller could decode; on /varying it also says
/// `Vary: Available-Dictionary`.
async fn dictionary_origin() -> corral_tests::RunningOrigin {
    use corral_tests::{Origin, Reply};
    let dcb = |r: Reply| {
        r.header("cache-control", "max-age=60")
            .header("content-encoding", "dcb")
    };
    Origin::new()
        .route(
            "/plain",
            dcb(Reply::echo_header("for ", "available-dictionary")),
        )
        .route(
            "/varying",
            dcb(Reply::echo_header("for ", "available-dictionary"))
                .header("vary", "Available-Dictionary"),
        )
        .start()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dictionary_compressed_answer_reaches_only_the_caller_whose_dictionary_it_is() {
    let origin = dictionary_origin().await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    let url = proxy.url("/plain");
    let (a, b) = (":YWFh:", ":YmJi:");
    // Without Vary on the dictionary: never stored, never shared.
    for dict in [a, b, a] {
        let got = client
            .get_with(&url, &[("available-dictionary", dict)])
            .await;
        assert_eq!(got.status, 200);
        assert_eq!(got.text(), format!("for {dict}"));
        assert_eq!(got.cache_status().detail(), Some("dictionary-compressed"));
    }
    assert_eq!(origin.hits("/plain"), 3);
    // Nor handed to the waiters of one flight: 20 callers at once, two
    // dictionaries, each gets the body for its own.
    let (ca, cb) = (client.clone(), client.clone());
    let (ua, ub) = (url.clone(), url.clone());
    let (with_a, with_b) = tokio::join!(
        async move { ca.burst(10, &ua, &[("available-dictionary", a)]).await },
        async move { cb.burst(10, &ub, &[("available-dictionary", b)]).await },
    );
    for got in &with_a {
        assert_eq!(got.text(), format!("for {a}"));
    }
    for got in &with_b {
        assert_eq!(got.text(), format!("for {b}"));
    }

    // With Vary on it: one entry per dictionary, and none for a caller
    // that offers none.
    let url = proxy.url("/varying");
    let first = client.get_with(&url, &[("available-dictionary", a)]).await;
    assert_eq!(first.text(), format!("for {a}"));
    let other = client.get_with(&url, &[("available-dictionary", b)]).await;
    assert_eq!(other.text(), format!("for {b}"));
    assert!(!other.cache_status().is_hit(), "{}", other.cache_status());
    let again = client.get_with(&url, &[("available-dictionary", a)]).await;
    assert!(again.cache_status().is_hit(), "{}", again.cache_status());
    assert_eq!(again.text(), format!("for {a}"));
    // A dcb body for a caller that offered no dictionary is one nobody
    // can decode: refused (502), and never stored for the next such one.
    for _ in 0..2 {
        let none = client.get(&url).await;
        assert_eq!(none.status, 502, "{}", none.cache_status());
        assert_eq!(
            none.cache_status().detail(),
            Some("upstream-content-coding")
        );
    }
    assert_eq!(origin.hits("/varying"), 4);
}

// ---------------------------------------------------------------------------
// QUERY (RFC 10008)
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_answers_are_cached_and_coalesced_by_their_content() {
    use bytes::Bytes;
    use corral_tests::{Origin, Reply};
    use http::Method;
    let query = Method::from_bytes(b"QUERY").expect("method");
    let origin = Origin::new()
        .route_method(
            query.clone(),
            "/search",
            Reply::echo_body().header("cache-control", "max-age=60"),
        )
        .route(
            "/page",
            Reply::ok("page").header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    let url = proxy.url("/search");
    let ask = |body: &'static str, headers: &'static [(&'static str, &'static str)]| {
        let (client, url, query) = (client.clone(), url.clone(), query.clone());
        async move {
            client
                .send(
                    query,
                    &url,
                    headers,
                    Some(Bytes::from_static(body.as_bytes())),
                )
                .await
        }
    };
    const JSON: &[(&str, &str)] = &[("content-type", "application/json")];
    const TEXT: &[(&str, &str)] = &[("content-type", "text/plain")];
    let first = ask("{\"q\":1}", JSON).await;
    assert_eq!(
        (first.status.as_u16(), first.text().as_str()),
        (200, "{\"q\":1}")
    );
    let again = ask("{\"q\":1}", JSON).await;
    assert!(again.cache_status().is_hit(), "{}", again.cache_status());
    assert_eq!(again.text(), "{\"q\":1}");
    assert_eq!(origin.hits("/search"), 1);
    // Other content, or the same bytes of another type, is another query.
    assert_eq!(ask("{\"q\":2}", JSON).await.text(), "{\"q\":2}");
    let typed = ask("{\"q\":1}", TEXT).await;
    assert!(!typed.cache_status().is_hit(), "{}", typed.cache_status());
    assert_eq!(origin.hits("/search"), 3);
    // What reached the origin was a QUERY with its content.
    let seen = origin.requests("/search");
    assert!(seen.iter().all(|r| r.method == query));

    // Twenty at once on a new query: one origin request.
    let answers = futures_util::future::join_all((0..20).map(|_| ask("{\"q\":3}", JSON))).await;
    for a in &answers {
        assert_eq!((a.status.as_u16(), a.text().as_str()), (200, "{\"q\":3}"));
    }
    assert_eq!(origin.hits("/search"), 4);

    // A QUERY is safe: a method override does not reach the origin, and
    // a QUERY too large to key (passed through) invalidates nothing.
    let overridden = client
        .send(
            query.clone(),
            &url,
            &[
                ("content-type", "application/json"),
                ("x-http-method-override", "DELETE"),
            ],
            Some(Bytes::from_static(b"{\"q\":4}")),
        )
        .await;
    assert_eq!(overridden.status, 200);
    let last = origin
        .requests("/search")
        .pop()
        .expect("the override's request");
    assert_eq!(last.header("x-http-method-override"), None);
    let page = proxy.url("/page");
    client.get(&page).await;
    let big = Bytes::from(vec![b'a'; 100 * 1024]);
    let passed = client.send(query.clone(), &page, &[], Some(big)).await;
    assert!(!passed.cache_status().is_hit(), "{}", passed.cache_status());
    let still = client.get(&page).await;
    assert!(still.cache_status().is_hit(), "{}", still.cache_status());
    assert_eq!(
        origin.hits("/page"),
        2,
        "the GET once, the large QUERY once"
    );
}

/// RFC 10008 with RFC 9110 §8.7: a stored QUERY answer whose
/// Content-Location (or Location) names a GET of the same path also
/// answers that GET, on this instance and, through Redis, on another.
/// Never an answer private to the QUERY's caller, never another path's
/// URI, never a GET that differs in its query.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_answer_answers_the_get_its_content_location_names() {
    use bytes::Bytes;
    use corral_tests::{Origin, Redis, Reply};
    use http::Method;
    let query = Method::from_bytes(b"QUERY").expect("method");
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route_method(
            query.clone(),
            "/search",
            Reply::echo_body()
                .header("cache-control", "max-age=60")
                .header("content-location", "/search?q=shoes"),
        )
        .route_method(
            query.clone(),
            "/elsewhere",
            Reply::echo_body()
                .header("cache-control", "max-age=60")
                .header("content-location", "/search?q=elsewhere"),
        )
        .route(
            "/search",
            Reply::from_request(|req| format!("get:{}", req.query().unwrap_or_default()))
                .header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let config = Config::single(origin.url()).redis(&redis.url());
    let proxies = Proxy::new(config).instances(2).start_all().await;
    let (a, b) = (&proxies[0], &proxies[1]);
    let client = Client::new();
    let ask = |url: String, headers: &'static [(&'static str, &'static str)]| {
        let (client, query) = (client.clone(), query.clone());
        async move {
            let body = Bytes::from_static(b"{\"q\":\"shoes\"}");
            client.send(query, &url, headers, Some(body)).await
        }
    };
    const JSON: &[(&str, &str)] = &[("content-type", "application/json")];

    let asked = ask(a.url("/search"), JSON).await;
    assert_eq!(asked.text(), "{\"q\":\"shoes\"}");
    assert!(asked.cache_status().stored(), "{}", asked.cache_status());
    // A's fill writes Redis once its body is whole, which may be after its
    // caller has read it: B is asked once the QUERY's entry and its GET
    // alias are there to be read.
    corral_tests::eventually(
        corral_tests::DEADLINE,
        "the QUERY's entry and its GET alias in Redis",
        || async { redis.keys("*:e:*").await.len() >= 2 },
    )
    .await;
    for (proxy, name) in [(a, "A"), (b, "B")] {
        let got = client.get(&proxy.url("/search?q=shoes")).await;
        assert!(
            got.cache_status().is_hit(),
            "{name}: {}",
            got.cache_status()
        );
        assert_eq!(got.text(), "{\"q\":\"shoes\"}", "{name}");
    }
    let gets = || {
        origin
            .requests("/search")
            .iter()
            .filter(|r| r.method == Method::GET)
            .count()
    };
    assert_eq!(gets(), 0, "no GET reached the origin");
    // Another query string is another resource.
    assert_eq!(
        client.get(&a.url("/search?q=boots")).await.text(),
        "get:q=boots"
    );
    assert_eq!(gets(), 1);

    // A QUERY on another path names /search: not its to claim.
    ask(a.url("/elsewhere"), JSON).await;
    let other = client.get(&a.url("/search?q=elsewhere")).await;
    assert_eq!(other.text(), "get:q=elsewhere");
    assert_eq!(gets(), 2);

    // A QUERY answer private to its caller (Authorization, no `public`)
    // is never a GET's: on a fresh pair, the GET goes to the origin.
    let fresh = Proxy::new(Config::single(origin.url())).start().await;
    const AUTHORIZED: &[(&str, &str)] = &[
        ("content-type", "application/json"),
        ("authorization", "Bearer the-querys-own"),
    ];
    let private = ask(fresh.url("/search"), AUTHORIZED).await;
    assert!(
        private.cache_status().stored(),
        "{}",
        private.cache_status()
    );
    let anonymous = client.get(&fresh.url("/search?q=shoes")).await;
    assert_eq!(anonymous.text(), "get:q=shoes");
    assert_eq!(gets(), 3);
}

// ---------------------------------------------------------------------------
// Cache-Status (RFC 9211) and Proxy-Status (RFC 9209): the members of the
// caches and proxies before corral are kept; one in corral's name is not
// theirs to write
// ---------------------------------------------------------------------------

/// The `members` named `name`.
fn named<'a>(members: &'a [String], name: &str) -> Vec<&'a String> {
    members
        .iter()
        .filter(|m| m.split(';').next().map(str::trim) == Some(name))
        .collect()
}

/// An origin behind another cache: `/victim` answers a plain stored 200
/// through it; `/attacker` writes members in `name` into both fields, on
/// a 200 that is stored and on a 503; `/gone` closes without an answer.
async fn claiming_origin(name: &'static str) -> RawOrigin {
    origin_with(move |r| match r.target() {
        "/attacker" => (
            200,
            vec![
                ("cache-control".into(), "max-age=60".into()),
                (
                    "cache-status".into(),
                    format!("{name}; hit; ttl=86400, cdn; hit"),
                ),
                (
                    "proxy-status".into(),
                    format!("{name}; error=http_request_denied"),
                ),
            ],
        ),
        "/attacker-503" => (
            503,
            vec![(
                "proxy-status".into(),
                format!("cdn; error=connection_timeout, {name}; error=destination_unavailable"),
            )],
        ),
        "/gone" => (0, Vec::new()),
        _ => (
            200,
            h(&[
                ("cache-control", "max-age=60"),
                ("cache-status", "cdn; fwd=uri-miss"),
            ]),
        ),
    })
    .await
}

/// Each path twice (a miss, then a hit where stored): the members a client
/// sees, and which of them carry `name`.
async fn assert_only_corrals_members(proxy: &corral_tests::RunningProxy, name: &str) {
    let client = Client::new();
    // The victim first and alone, then after the attacker: the same.
    let alone = client
        .get(&proxy.url("/victim"))
        .await
        .members("cache-status");
    assert_eq!(alone[0], "cdn; fwd=uri-miss", "{alone:?}");
    assert_eq!(alone.len(), 2, "{alone:?}");
    assert!(
        alone[1].starts_with(&format!("{name}; fwd=uri-miss")),
        "{alone:?}"
    );
    for round in ["miss", "hit"] {
        let a = client.get(&proxy.url("/attacker")).await;
        assert_eq!(a.text(), "body-of-/attacker");
        let cache = a.members("cache-status");
        // The upstream cache's own member is kept, in its place; the one
        // in corral's name is gone, and corral's is last.
        assert_eq!(cache[0], "cdn; hit", "{round}: {cache:?}");
        assert_eq!(named(&cache, name).len(), 1, "{round}: {cache:?}");
        assert_eq!(cache.len(), 2, "{round}: {cache:?}");
        let own = &cache[1];
        assert!(!own.contains("86400"), "{round}: {cache:?}");
        match round {
            "miss" => assert!(own.starts_with(&format!("{name}; fwd=uri-miss")), "{own}"),
            _ => assert!(own.starts_with(&format!("{name}; hit")), "{own}"),
        }
        // corral made nothing of this answer: no Proxy-Status in its name.
        assert_eq!(a.members("proxy-status"), Vec::<String>::new(), "{round}");
    }
    let refused = client.get(&proxy.url("/attacker-503")).await;
    assert_eq!(refused.status, 503);
    assert_eq!(
        refused.members("proxy-status"),
        ["cdn; error=connection_timeout"],
        "the origin's 503 is not corral's"
    );
    let victim = client.get(&proxy.url("/victim")).await;
    assert_eq!(victim.members("cache-status")[0], "cdn; fwd=uri-miss");
    assert!(
        victim.members("cache-status")[1].starts_with(&format!("{name}; hit")),
        "{:?}",
        victim.members("cache-status")
    );
    // corral's own error: one member of each field, corral's.
    let own = client.get(&proxy.url("/gone")).await;
    assert_eq!(own.status, 502);
    let proxy_status = own.members("proxy-status");
    assert_eq!(proxy_status.len(), 1, "{proxy_status:?}");
    assert!(
        proxy_status[0].starts_with(&format!("{name}; error=http_response_incomplete")),
        "{proxy_status:?}"
    );
    let cache = own.members("cache-status");
    assert_eq!(cache.len(), 1, "{cache:?}");
    assert!(cache[0].starts_with(&format!("{name}; fwd=")), "{cache:?}");
    assert!(cache[0].contains("detail=upstream-error"), "{cache:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_members_are_kept_and_one_in_corrals_name_is_dropped() {
    let origin = claiming_origin("corral").await;
    let proxy = proxy_for(&origin).await;
    assert_only_corrals_members(&proxy, "corral").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_name_is_configurable_and_guarded_the_same_way() {
    let origin = claiming_origin("edge-7.example").await;
    let proxy = Proxy::new(Config::single(origin.url()).server("proxy_name", "edge-7.example"))
        .start()
        .await;
    assert_only_corrals_members(&proxy, "edge-7.example").await;
    // "corral" is now just another intermediary's name: kept as written.
    let client = Client::new();
    let origin2 = claiming_origin("corral").await;
    let other = Proxy::new(Config::single(origin2.url()).server("proxy_name", "edge-7.example"))
        .start()
        .await;
    let a = client.get(&other.url("/attacker")).await;
    let cache = a.members("cache-status");
    assert_eq!(
        &cache[..2],
        ["corral; hit; ttl=86400", "cdn; hit"],
        "{cache:?}"
    );
    assert!(
        cache[2].starts_with("edge-7.example; fwd=uri-miss"),
        "{cache:?}"
    );
}

// ---------------------------------------------------------------------------
// no-cache="field" (§5.2.2.4)
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qualified_no_cache_is_reused_without_the_fields_it_names() {
    let origin = origin_with(|r| match r.target() {
        "/plain" => (
            200,
            h(&[
                ("cache-control", "max-age=60, no-cache"),
                ("etag", "\"v1\""),
            ]),
        ),
        _ => (
            200,
            h(&[
                (
                    "cache-control",
                    "max-age=60, no-cache=\"X-Secret, x-other\"",
                ),
                ("x-secret", "s3cret"),
                ("x-other", "o"),
                ("x-kept", "yes"),
            ]),
        ),
    })
    .await;
    let proxy = proxy_for(&origin).await;
    let client = Client::new();
    let first = client.get(&proxy.url("/qualified")).await;
    assert!(first.cache_status().stored(), "{}", first.cache_status());
    // The caller whose fetch it was gets the origin's answer whole.
    assert_eq!(first.header("x-secret"), Some("s3cret"));
    assert_eq!(first.header("x-other"), Some("o"));
    let again = client.get(&proxy.url("/qualified")).await;
    assert!(again.cache_status().is_hit(), "{}", again.cache_status());
    assert_eq!(again.text(), "body-of-/qualified");
    assert_eq!(again.header("x-kept"), Some("yes"));
    assert_eq!(
        again.header("x-secret"),
        None,
        "a named field is never reused"
    );
    assert_eq!(again.header("x-other"), None);
    assert_eq!(hits(&origin, "/qualified"), 1);
    // The plain form is still revalidated before every reuse.
    client.get(&proxy.url("/plain")).await;
    let plain = client.get(&proxy.url("/plain")).await;
    assert!(!plain.cache_status().is_hit(), "{}", plain.cache_status());
    assert_eq!(hits(&origin, "/plain"), 2);
}

// ---------------------------------------------------------------------------
// Heuristic freshness (§4.2.2), on by default
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_with_only_last_modified_is_fresh_for_a_tenth_of_its_age_by_default() {
    // Unchanged for ten days: fresh for a day (a tenth, capped at a day).
    let modified = date(-10 * 86400);
    let origin = RawOrigin::start(move |r| {
        let who = r.header("authorization").unwrap_or("nobody").to_owned();
        let mut headers = vec![("last-modified", modified.as_str())];
        if r.target() == "/status-302" {
            headers.push(("location", "/elsewhere"));
            return response(302, &headers, "moved");
        }
        if r.target() == "/dynamic" {
            headers.clear();
        }
        response(200, &headers, &format!("{} for {who}", r.target()))
    })
    .await;
    let proxy = proxy_for(&origin).await;
    let client = Client::new();
    let first = client.get(&proxy.url("/doc")).await;
    assert!(first.cache_status().stored(), "{}", first.cache_status());
    let again = client.get(&proxy.url("/doc")).await;
    assert!(again.cache_status().is_hit(), "{}", again.cache_status());
    assert_eq!(
        again
            .cache_status()
            .param("ttl")
            .map(|t| t.parse::<i64>().unwrap_or(0) > 86_000),
        Some(true)
    );
    assert_eq!(hits(&origin, "/doc"), 1);
    // No Last-Modified (a dynamic answer), or a status that is not
    // heuristically cacheable: nothing stored.
    for path in ["/dynamic", "/status-302"] {
        client.get(&proxy.url(path)).await;
        client.get(&proxy.url(path)).await;
        assert_eq!(hits(&origin, path), 2, "{path}");
    }
    // Hostile twin: a heuristic never makes a caller's answer another's.
    // Each caller with its own credentials gets its own answer.
    let victim = client
        .get_with(&proxy.url("/mine"), &[("authorization", "Bearer victim")])
        .await;
    assert_eq!(victim.text(), "/mine for Bearer victim");
    let attacker = client
        .get_with(&proxy.url("/mine"), &[("authorization", "Bearer attacker")])
        .await;
    assert_eq!(attacker.text(), "/mine for Bearer attacker");
    let anonymous = client.get(&proxy.url("/mine")).await;
    assert_eq!(anonymous.text(), "/mine for nobody");
    let victim_again = client
        .get_with(&proxy.url("/mine"), &[("authorization", "Bearer victim")])
        .await;
    assert_eq!(victim_again.text(), "/mine for Bearer victim");
}
