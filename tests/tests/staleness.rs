//! Expiry: stale-while-revalidate, stale-if-error and conditional
//! revalidation. A TTL runs out when the test moves corral's clock
//! (`with_test_clock`), not in a sleep.

use std::time::Duration;

use tokio::time::Instant;

use corral_tests::{Client, Config, DEADLINE, Origin, OriginMode, Proxy, Reply, Route, eventually};

/// Just past a `max-age=1`: how far the tests move the clock.
const PAST_ONE_SECOND: Duration = Duration::from_millis(1200);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_while_revalidate_serves_stale_at_once_and_refreshes_once_in_background() {
    let headers = "max-age=1, stale-while-revalidate=30";
    let origin = Origin::new()
        .route("/swr", Reply::ok("v1").header("cache-control", headers))
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url()))
        .with_test_clock()
        .start()
        .await;
    let client = Client::new();
    let url = proxy.url("/swr");

    assert_eq!(client.get(&url).await.text(), "v1");
    origin.set_route("/swr", Reply::ok("v2").header("cache-control", headers));
    proxy.advance_clock(PAST_ONE_SECOND).await;

    let stale = client.get(&url).await;
    assert_eq!(stale.status, 200);
    assert_eq!(stale.text(), "v1", "the stale body is served at once");
    let status = stale.cache_status();
    assert_eq!(status.fwd(), Some("stale"), "{status}");
    assert_eq!(status.detail(), Some("stale-while-revalidate"), "{status}");
    assert!(stale.header("age").is_some(), "a stale answer carries Age");

    origin.wait_hits("/swr", 2, DEADLINE).await;
    let (client, url) = (&client, &url);
    eventually(
        DEADLINE,
        "the refreshed body is served",
        move || async move { client.get(url).await.text() == "v2" },
    )
    .await;
    assert_eq!(origin.hits("/swr"), 2, "exactly one background refresh");
}

/// Window end of `max-age=1, stale-if-error=2` plus a second of margin, so a
/// cache counting age in whole seconds is past it too.
const PAST_STALE_IF_ERROR: Duration = Duration::from_millis(4100);
const STALE_IF_ERROR: &str = "max-age=1, stale-if-error=2";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_if_error_covers_an_origin_500_within_the_window_only() {
    let origin = Origin::new()
        .route(
            "/sie",
            Reply::ok("v1").header("cache-control", STALE_IF_ERROR),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url()))
        .with_test_clock()
        .start()
        .await;
    let client = Client::new();
    let url = proxy.url("/sie");

    assert_eq!(client.get(&url).await.text(), "v1");
    origin.set_mode(OriginMode::InternalError);

    proxy.advance_clock(PAST_ONE_SECOND).await;
    let stale = client.get(&url).await;
    assert_eq!(stale.status, 200);
    assert_eq!(stale.text(), "v1");
    let status = stale.cache_status();
    assert_eq!(status.fwd(), Some("stale"), "{status}");
    assert_eq!(status.detail(), Some("stale-if-error"), "{status}");
    assert_eq!(origin.hits("/sie"), 2, "the origin was asked and failed");

    proxy
        .advance_clock(PAST_STALE_IF_ERROR - PAST_ONE_SECOND)
        .await;
    let failed = client.get(&url).await;
    assert_eq!(
        failed.status,
        500,
        "past the window the origin's error goes through: {}",
        failed.cache_status()
    );
    assert_ne!(failed.text(), "v1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_max_ratio_ends_a_large_default_stale_window_with_the_freshness_lifetime() {
    // The route would serve any stale answer for an hour when the origin
    // fails (`stale_if_error.default`); `stale_max_ratio: 1` allows no
    // longer stale than fresh: the 1-second object is served stale for
    // at most one more second.
    let origin = Origin::new()
        .route(
            "/ratio",
            Reply::ok("v1").header("cache-control", "max-age=1"),
        )
        .start()
        .await;
    let route = Route::new("api", origin.url())
        .cache("stale_if_error", "{ default: 1h }")
        .cache("stale_max_ratio", "1");
    let proxy = Proxy::new(Config::new().route(route))
        .with_test_clock()
        .start()
        .await;
    let client = Client::new();
    let url = proxy.url("/ratio");

    assert_eq!(client.get(&url).await.text(), "v1");
    origin.set_mode(OriginMode::InternalError);

    proxy.advance_clock(PAST_ONE_SECOND).await;
    let stale = client.get(&url).await;
    assert_eq!(stale.status, 200, "{}", stale.cache_status());
    assert_eq!(stale.text(), "v1");
    assert_eq!(stale.cache_status().detail(), Some("stale-if-error"));

    // Past the relative bound (one second stale) with a second of margin,
    // still 57 minutes inside the configured default.
    proxy
        .advance_clock(Duration::from_millis(3100) - PAST_ONE_SECOND)
        .await;
    let failed = client.get(&url).await;
    assert_eq!(
        failed.status,
        500,
        "past the relative bound the origin's error goes through: {}",
        failed.cache_status()
    );
    assert_ne!(failed.text(), "v1");
    assert_eq!(origin.hits("/ratio"), 3, "the origin was asked each time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_if_error_covers_a_refused_origin_within_the_window_only() {
    let mut origin = Origin::new()
        .route(
            "/sie",
            Reply::ok("v1").header("cache-control", STALE_IF_ERROR),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url()))
        .with_test_clock()
        .start()
        .await;
    let client = Client::new();
    let url = proxy.url("/sie");

    assert_eq!(client.get(&url).await.text(), "v1");
    origin.stop().await;

    proxy.advance_clock(PAST_ONE_SECOND).await;
    let stale = client.get(&url).await;
    assert_eq!(stale.status, 200);
    assert_eq!(stale.text(), "v1");
    let status = stale.cache_status();
    assert_eq!(status.fwd(), Some("stale"), "{status}");
    assert_eq!(status.detail(), Some("stale-if-error"), "{status}");

    proxy
        .advance_clock(PAST_STALE_IF_ERROR - PAST_ONE_SECOND)
        .await;
    let failed = client.get(&url).await;
    assert_eq!(failed.status, 502, "{}", failed.cache_status());
    assert!(
        failed.cache_status().detail().is_some(),
        "the error names what failed: {}",
        failed.cache_status()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_304_to_if_none_match_refreshes_the_entry_and_the_client_gets_the_stored_body() {
    let origin = Origin::new()
        .route(
            "/etag",
            Reply::ok("original")
                .header("cache-control", "max-age=1")
                .header("etag", "\"v1\""),
        )
        .conditional()
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url()))
        .with_test_clock()
        .start()
        .await;
    let client = Client::new();
    let url = proxy.url("/etag");

    assert_eq!(client.get(&url).await.text(), "original");
    // Same validator, new body: only an unconditional request can see it.
    origin.set_route(
        "/etag",
        Reply::ok("changed")
            .header("cache-control", "max-age=1")
            .header("etag", "\"v1\""),
    );
    proxy.advance_clock(PAST_ONE_SECOND).await;

    let revalidated = client.get(&url).await;
    assert_eq!(revalidated.status, 200);
    assert_eq!(revalidated.text(), "original");
    assert_eq!(origin.hits("/etag"), 2);
    let conditional = &origin.requests("/etag")[1];
    assert_eq!(conditional.header("if-none-match"), Some("\"v1\""));
    assert_eq!(origin.answered("/etag"), [200, 304]);

    let fresh = client.get(&url).await;
    assert_eq!(fresh.text(), "original");
    assert!(
        fresh.cache_status().is_hit(),
        "the 304 made the entry fresh again: {}",
        fresh.cache_status()
    );
    assert_eq!(origin.hits("/etag"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_origin_is_asked_once_per_back_off_while_stale_answers_flow() {
    let origin = Origin::new()
        .route(
            "/down",
            Reply::ok("kept").header("cache-control", "max-age=1, stale-if-error=60"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url()))
        .with_test_clock()
        .start()
        .await;
    let client = Client::new();
    let url = proxy.url("/down");
    assert_eq!(client.get(&url).await.text(), "kept");
    origin.set_mode(OriginMode::InternalError);
    proxy.advance_clock(PAST_ONE_SECOND).await;

    let before = origin.hits("/down");
    let started = Instant::now();
    for _ in 0..200 {
        let a = client.get(&url).await;
        assert_eq!(a.status, 200);
        assert_eq!(a.text(), "kept");
        // The request that finds the origin failing says stale-if-error;
        // those while the key backs off say backoff.
        assert!(
            matches!(
                a.cache_status().detail(),
                Some("stale-if-error" | "backoff")
            ),
            "{}",
            a.cache_status()
        );
    }
    let elapsed = started.elapsed();
    let asked = origin.hits("/down") - before;
    // The first failure is retried by the next request, whose failure
    // opens the first back-off (one second, then doubling); 200 stale
    // answers in `elapsed` may span at most this many.
    let allowed = 2 + elapsed.as_secs() as usize;
    // The request that found the origin failing, and the next one's retry.
    assert!(asked >= 2, "{asked}: the first failure was not retried");
    assert!(
        asked <= allowed,
        "{asked} requests reached the failing origin in {elapsed:?} (at most {allowed})"
    );
}

/// An origin that takes connections and does not answer (here for 5 s, a
/// stand-in for one that never does): a fill that has a stale-if-error
/// copy answers its callers from it after `timeouts.stale_after` (2 s by
/// default), not after `response_headers` (15 s), and the fetch goes on:
/// its answer, when it comes, replaces the copy, with no second request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_origin_yields_to_the_stale_copy_and_its_late_answer_replaces_it() {
    let origin = Origin::new()
        .route(
            "/hung",
            Reply::ok("v1").header("cache-control", "max-age=1"),
        )
        .start()
        .await;
    let route = Route::new("api", origin.url()).cache("stale_if_error", "{ default: 60s }");
    let proxy = Proxy::new(Config::new().route(route))
        .with_test_clock()
        .start()
        .await;
    let client = Client::new();
    let url = proxy.url("/hung");

    assert_eq!(client.get(&url).await.text(), "v1");
    origin.set_route(
        "/hung",
        Reply::ok("v2")
            .header("cache-control", "max-age=60")
            .delay(Duration::from_secs(5)),
    );
    proxy.advance_clock(PAST_ONE_SECOND).await;

    // Twenty callers of the expired key: all answered from the copy while
    // the origin still holds the one request the fill made.
    let answers = client.burst(20, &url, &[]).await;
    for answer in &answers {
        assert_eq!(
            (answer.status.as_u16(), answer.text()),
            (200, "v1".to_owned()),
            "{}",
            answer.cache_status()
        );
        assert_eq!(answer.cache_status().detail(), Some("stale-if-error"));
    }
    assert_eq!(origin.hits("/hung"), 2, "one fill for the twenty");

    // The fetch went on: its answer replaces the copy.
    eventually(DEADLINE, "the late answer is served", || {
        let (client, url) = (client.clone(), url.clone());
        async move { client.get(&url).await.text() == "v2" }
    })
    .await;
    assert_eq!(
        origin.hits("/hung"),
        2,
        "the late answer was stored, not fetched again"
    );
}

/// The copy a hung fetch's callers are answered from serves only within
/// its stale-if-error window. A caller who joins the fill after that (the
/// fetch still waiting on the origin) is not handed the copy the fill
/// published earlier: it gets a 504, never a 200 older than the origin
/// allowed. Found by `SOAK_OUTAGE=slow bench/soak.sh`, where such joiners
/// got copies up to 3 s past their window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_fills_stale_copy_is_not_served_past_its_stale_if_error_window() {
    let origin = Origin::new()
        .route(
            "/hung",
            Reply::ok("v1").header("cache-control", "max-age=1, stale-if-error=2"),
        )
        .start()
        .await;
    let route = Route::new("api", origin.url()).field("timeouts", "{ stale_after: 300ms }");
    let proxy = Proxy::new(Config::new().route(route))
        .with_test_clock()
        .start()
        .await;
    let client = Client::new();
    let url = proxy.url("/hung");
    assert_eq!(client.get(&url).await.text(), "v1");
    origin.set_route("/hung", Reply::ok("v2").delay(Duration::from_secs(30)));
    proxy.advance_clock(PAST_ONE_SECOND).await;

    // The fill hangs; its caller is answered from the copy at stale_after.
    let first = client.get(&url).await;
    assert_eq!(
        (first.status.as_u16(), first.text()),
        (200, "v1".to_owned())
    );
    assert_eq!(first.cache_status().detail(), Some("stale-if-error"));
    assert_eq!(origin.hits("/hung"), 2);
    // Within the window, a caller joining the fill gets the copy at once.
    let joined = client.get(&url).await;
    assert_eq!(
        (joined.status.as_u16(), joined.text()),
        (200, "v1".to_owned())
    );
    // Past it (fresh for 1 s, then 2 s of stale-if-error), with the fetch
    // still waiting: no copy.
    proxy
        .advance_clock(PAST_STALE_IF_ERROR - PAST_ONE_SECOND)
        .await;
    let late = client.get(&url).await;
    assert_eq!(late.status, 504, "{} {}", late.cache_status(), late.text());
    assert_ne!(late.text(), "v1");
    assert_eq!(
        origin.hits("/hung"),
        2,
        "the hung fetch is still the only one"
    );
}

/// A hung origin yields to a stale copy the instance did not have itself:
/// one found in Redis (stored by another instance) as the fill read it.
/// Instance B never had the key; when the origin hangs, B's caller is
/// answered from A's copy at `stale_after`, not after `response_headers`
/// (30 s here, longer than the client waits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_origin_yields_to_a_stale_copy_found_in_redis() {
    let origin = Origin::new()
        .route(
            "/hung",
            Reply::ok("v1").header("cache-control", "max-age=1, stale-if-error=60"),
        )
        .start()
        .await;
    let redis = corral_tests::Redis::start().await;
    let config = || {
        let route = Route::new("api", origin.url())
            .field("timeouts", "{ stale_after: 300ms, response_headers: 30s }");
        Config::new().route(route).redis(&redis.url())
    };
    let a = Proxy::new(config()).start().await;
    let b = Proxy::new(config()).with_test_clock().start().await;
    let client = Client::new();
    assert_eq!(client.get(&a.url("/hung")).await.text(), "v1");
    origin.set_route("/hung", Reply::ok("v2").delay(Duration::from_secs(30)));
    b.advance_clock(PAST_ONE_SECOND).await;

    let answer = tokio::time::timeout(DEADLINE, client.get(&b.url("/hung")))
        .await
        .expect("answered before the origin's hang ends");
    assert_eq!(
        (answer.status.as_u16(), answer.text()),
        (200, "v1".to_owned())
    );
    assert_eq!(answer.cache_status().detail(), Some("stale-if-error"));
    assert_eq!(origin.hits("/hung"), 2, "A's fill and B's hung one");
}
