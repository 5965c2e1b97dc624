//! Plain proxying: methods and bodies pass through, hop-by-hop headers stop
//! at the proxy, forwarding headers are added, upstream failures are mapped.

use std::time::{Duration, Instant};

use http::Method;

use corral_tests::ports::closed_port;
use corral_tests::{Client, Config, Origin, Proxy, Reply, Route};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_body_goes_through_to_the_origin_and_back() {
    let origin = Origin::new()
        .route("/echo", Reply::echo_body())
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    // Larger than max_object_size and than any socket buffer.
    let body: Vec<u8> = (0..3 * 1024 * 1024).map(|i| (i % 253) as u8).collect();

    let answer = client
        .send(
            Method::POST,
            &proxy.url("/echo"),
            &[],
            Some(body.clone().into()),
        )
        .await;

    assert_eq!(answer.status, 200);
    assert!(
        answer.body == body,
        "echoed {} of {} bytes",
        answer.body.len(),
        body.len()
    );
    let seen = origin.requests("/echo");
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].method, Method::POST);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_method_is_proxied() {
    let origin = Origin::new()
        .route(
            "/m",
            Reply::from_request(|req| format!("method:{}", req.method)),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();

    let methods = [
        Method::GET,
        Method::POST,
        Method::PUT,
        Method::PATCH,
        Method::DELETE,
        Method::OPTIONS,
    ];
    for method in &methods {
        let answer = client
            .send(method.clone(), &proxy.url("/m"), &[], Some("x".into()))
            .await;
        assert_eq!(answer.status, 200, "{method}");
        assert_eq!(answer.text(), format!("method:{method}"));
    }
    let seen: Vec<Method> = origin
        .requests("/m")
        .into_iter()
        .map(|r| r.method)
        .collect();
    assert_eq!(seen, methods);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_by_hop_headers_are_not_forwarded_either_way() {
    let origin = Origin::new()
        .route(
            "/h",
            Reply::ok("h")
                .header("connection", "x-origin-secret")
                .header("x-origin-secret", "1")
                .header("x-origin-public", "1"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();

    let answer = client
        .get_with(
            &proxy.url("/h"),
            &[
                ("connection", "x-custom"),
                ("x-custom", "1"),
                ("keep-alive", "timeout=5"),
                ("proxy-authorization", "Basic Zm9vOmJhcg=="),
                ("x-end-to-end", "kept"),
            ],
        )
        .await;

    assert_eq!(answer.status, 200);
    let seen = &origin.requests("/h")[0];
    assert_eq!(seen.header("x-end-to-end"), Some("kept"));
    for hop in ["x-custom", "keep-alive", "proxy-authorization"] {
        assert!(
            seen.header(hop).is_none(),
            "{hop} was forwarded: {:?}",
            seen.headers
        );
    }
    assert!(
        seen.header_all("connection")
            .iter()
            .all(|v| !v.to_ascii_lowercase().contains("x-custom")),
        "Connection was forwarded: {:?}",
        seen.headers
    );
    assert_eq!(answer.header("x-origin-public"), Some("1"));
    assert!(
        answer.header("x-origin-secret").is_none(),
        "a header the origin named in Connection reached the client: {:?}",
        answer.headers
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn via_and_x_forwarded_headers_are_added_upstream() {
    let origin = Origin::new().route("/f", Reply::ok("f")).start().await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();

    client.get(&proxy.url("/f")).await;
    client
        .get_with(&proxy.url("/f"), &[("x-forwarded-for", "203.0.113.7")])
        .await;

    let seen = origin.requests("/f");
    assert_eq!(seen.len(), 2);
    let first = &seen[0];
    let via = first.header("via").expect("Via is added");
    assert!(via.contains("1.1"), "Via names the protocol version: {via}");
    assert_eq!(first.header("x-forwarded-for"), Some("127.0.0.1"));
    assert_eq!(first.header("x-forwarded-proto"), Some("http"));
    // The host name alone: the port is not part of the cache key, so it is
    // not forwarded either (an origin building links from it could be
    // poisoned through it).
    assert_eq!(first.header("x-forwarded-host"), Some("127.0.0.1"));

    // The peer is no trusted proxy (none is by default): what it claims in
    // X-Forwarded-For is its own writing, and is not passed on.
    assert_eq!(
        seen[1].header_all("x-forwarded-for"),
        ["127.0.0.1"],
        "an untrusted client's X-Forwarded-For is replaced by its address"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_upstream_with_nothing_stale_is_answered_502_with_a_detail() {
    let (_held, closed) = closed_port().expect("a closed port");
    let proxy = Proxy::new(Config::single(format!("http://{closed}")))
        .start()
        .await;

    let answer = Client::new().get(&proxy.url("/gone")).await;

    assert_eq!(answer.status, 502);
    let status = answer.cache_status();
    assert!(
        status.detail().is_some(),
        "Cache-Status names the failure: {status}"
    );
    // RFC 9209: corral's own 502, and why.
    assert_eq!(
        answer.header("proxy-status"),
        Some("corral; error=connection_refused; details=\"upstream-connect-error\"")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corral_says_which_answers_are_its_own_with_proxy_status() {
    let origin = Origin::new()
        .route("/api/down", Reply::status(503, "origin down"))
        .start()
        .await;
    let config = Config::new().route(Route::new("api", origin.url()).path_prefix("/api"));
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();
    // No route: corral's 404, never the origin's.
    let none = client.get(&proxy.url("/elsewhere")).await;
    assert_eq!(none.status, 404);
    assert_eq!(
        none.header("proxy-status"),
        Some("corral; error=destination_not_found; details=\"no-route\"")
    );
    // The origin's own 503 passes without a Proxy-Status of corral's.
    let down = client.get(&proxy.url("/api/down")).await;
    assert_eq!(
        (down.status.as_u16(), down.text().as_str()),
        (503, "origin down")
    );
    assert_eq!(down.header("proxy-status"), None);
    assert_eq!(origin.hits("/api/down"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_upstream_is_answered_504_after_the_response_headers_timeout() {
    let origin = Origin::new()
        .route("/slow", Reply::ok("late").delay(Duration::from_secs(5)))
        .start()
        .await;
    let config =
        Config::new().route(Route::new("api", origin.url()).timeouts("response_headers", "300ms"));
    let proxy = Proxy::new(config).start().await;

    let started = Instant::now();
    let answer = Client::new().get(&proxy.url("/slow")).await;
    let elapsed = started.elapsed();

    assert_eq!(answer.status, 504, "{}", answer.cache_status());
    assert!(
        answer.cache_status().detail().is_some(),
        "Cache-Status names the failure: {}",
        answer.cache_status()
    );
    assert_eq!(
        answer.header("proxy-status"),
        Some("corral; error=http_response_timeout; details=\"upstream-timeout\"")
    );
    assert!(
        elapsed < Duration::from_secs(3),
        "the timeout answered after {elapsed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_clients_are_served_and_share_the_cache_with_http1_clients() {
    let origin = Origin::new()
        .route(
            "/h2",
            Reply::ok("over h2c").header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let h2 = reqwest::Client::builder()
        .no_proxy()
        .http2_prior_knowledge()
        .build()
        .expect("h2c client");
    let first = h2.get(proxy.url("/h2")).send().await.expect("h2c request");
    assert_eq!(first.version(), reqwest::Version::HTTP_2);
    assert_eq!(first.status(), 200);
    assert_eq!(first.text().await.expect("body"), "over h2c");
    let again = Client::new().get(&proxy.url("/h2")).await;
    assert!(again.cache_status().is_hit(), "{}", again.cache_status());
    assert_eq!(again.text(), "over h2c");
    assert_eq!(origin.hits("/h2"), 1);
}

/// An API answer that says nothing of its freshness, as most do, after
/// `work` at the origin (long enough that a burst's callers all arrive
/// while it runs).
fn api_origin(work: Duration) -> Origin {
    let slow = |body: &'static str| Reply::ok(body).delay(work);
    Origin::new()
        .route("/api", slow("items"))
        .route("/no-store", slow("n").header("cache-control", "no-store"))
        .route("/private", slow("p").header("cache-control", "private"))
        .route("/max-age", slow("m").header("cache-control", "max-age=0"))
}

/// `corral proxy --to` on its defaults protects an API that sends no
/// Cache-Control: 200 callers at once on a cold key are one origin
/// request, and the answer is kept for `--ttl` (10 s by default), so the
/// next caller is a hit. What the origin says still wins: `no-store`,
/// `private` and `max-age=0` are not kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corral_proxy_defaults_make_a_burst_on_an_api_without_cache_control_one_request() {
    let origin = api_origin(Duration::from_millis(300)).start().await;
    let proxy = Proxy::flags(&origin.url(), &[]).start().await;
    let client = Client::new();
    let answers = tokio::time::timeout(
        Duration::from_secs(20),
        client.burst(200, &proxy.url("/api"), &[]),
    )
    .await
    .expect("200 answers within 20 s");
    corral_tests::assert_every_answer(&answers, 200, "items");
    assert_eq!(
        origin.hits("/api"),
        1,
        "{:?}",
        corral_tests::tally(&answers)
    );
    let later = client.get(&proxy.url("/api")).await;
    assert!(later.cache_status().is_hit(), "{}", later.cache_status());
    let ttl: u64 = later
        .cache_status()
        .param("ttl")
        .and_then(|t| t.parse().ok())
        .expect("a hit says its ttl");
    assert!((1..=10).contains(&ttl), "ttl={ttl}");
    assert_eq!(origin.hits("/api"), 1);
    for path in ["/no-store", "/private", "/max-age"] {
        for _ in 0..2 {
            let a = client.get(&proxy.url(path)).await;
            assert_eq!(a.status, 200, "{path}");
            assert!(!a.cache_status().is_hit(), "{path}: {}", a.cache_status());
        }
        assert_eq!(origin.hits(path), 2, "{path}: the origin's word wins");
    }
}

/// `--ttl 0` keeps nothing the origin did not give a lifetime, but a burst
/// on it is still one origin request: the answer is shared with the
/// callers who asked at the same moment. `--no-cache` is a plain proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corral_proxy_ttl_0_still_collapses_a_burst_and_no_cache_passes_everything() {
    // Nothing is kept: every caller of the burst must arrive while the
    // one fetch runs, hence the longer work.
    let origin = api_origin(Duration::from_secs(1)).start().await;
    let proxy = Proxy::flags(&origin.url(), &["--ttl", "0"]).start().await;
    let client = Client::new();
    let answers = tokio::time::timeout(
        Duration::from_secs(20),
        client.burst(200, &proxy.url("/api"), &[]),
    )
    .await
    .expect("200 answers within 20 s");
    corral_tests::assert_every_answer(&answers, 200, "items");
    assert_eq!(
        origin.hits("/api"),
        1,
        "{:?}",
        corral_tests::tally(&answers)
    );
    let later = client.get(&proxy.url("/api")).await;
    assert!(!later.cache_status().is_hit(), "{}", later.cache_status());
    assert_eq!(origin.hits("/api"), 2, "nothing was kept");
    drop(proxy);

    let origin = api_origin(Duration::from_millis(10)).start().await;
    let proxy = Proxy::flags(&origin.url(), &["--no-cache"]).start().await;
    let answers = tokio::time::timeout(
        Duration::from_secs(20),
        client.burst(20, &proxy.url("/api"), &[]),
    )
    .await
    .expect("20 answers within 20 s");
    corral_tests::assert_every_answer(&answers, 200, "items");
    assert_eq!(origin.hits("/api"), 20, "a plain proxy");
}
