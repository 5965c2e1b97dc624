//! Paths: routing, the key and the upstream target read one normal form of
//! the path, so a path spelled to choose one route cannot reach another
//! resource at an origin that normalizes (web cache deception, per-route
//! limits and `cache.enabled: false` bypassed). Requests are written raw:
//! an HTTP client library would resolve the dot segments itself.

use corral_tests::raw_origin::response;
use corral_tests::{
    Config, DEADLINE, Proxy, RawOrigin, RawResponse, Route, RunningProxy, exchange_full,
};

/// An origin that answers with the target it received and the caller's
/// cookie, with no Cache-Control (a page meant for its caller alone).
async fn origin() -> RawOrigin {
    RawOrigin::start(|r| {
        let body = format!(
            "{} cookie={}",
            r.target(),
            r.header("cookie").unwrap_or("-")
        );
        response(200, &[], &body)
    })
    .await
}

async fn get(proxy: &RunningProxy, target: &str, cookie: Option<&str>) -> RawResponse {
    let cookie = cookie.map_or(String::new(), |c| format!("Cookie: {c}\r\n"));
    let req =
        format!("GET {target} HTTP/1.1\r\nHost: site.test\r\n{cookie}Connection: close\r\n\r\n");
    exchange_full(proxy.addr(), req.as_bytes(), DEADLINE).await
}

/// `/static/` is cached for a minute whatever the origin says; `/api/`
/// allows 5 requests a minute per address; `/account` is never cached.
fn routes(origin: &RawOrigin) -> Config {
    Config::new()
        .route(
            Route::new("static", origin.url())
                .path_prefix("/static/")
                .cache("default_ttl", "60s"),
        )
        .route(
            Route::new("api", origin.url())
                .path_prefix("/api/")
                .field("limits", "[{ name: per-ip, key: ip, rate: 5/min }]"),
        )
        .route(
            Route::new("account", origin.url())
                .path_prefix("/account")
                .cache("enabled", "false"),
        )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dot_segments_choose_the_route_the_origin_serves_and_its_limit_counts_them() {
    let origin = origin().await;
    let proxy = Proxy::new(routes(&origin)).start().await;
    let spellings = [
        "/static/../api/login",
        "/static/%2e%2e/api/login",
        "/static/%2E%2E/api/login",
        "/static/.%2e/api/login",
        "/static/./../api/login",
        "/static//../api/login",
        "/static/x/../../api/login",
        "/api/./login",
    ];
    let mut statuses = Vec::new();
    for target in spellings {
        let answer = get(&proxy, target, None).await;
        if answer.status == 200 {
            assert_eq!(
                String::from_utf8_lossy(&answer.body),
                "/api/login cookie=-",
                "{target}"
            );
        }
        statuses.push(answer.status);
    }
    // The `/api/` limit saw all eight: five allowed, three refused.
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429, 429, 429]);
    let targets: Vec<String> = origin
        .requests()
        .iter()
        .map(|r| r.target().to_owned())
        .collect();
    assert_eq!(
        targets,
        vec!["/api/login"; 5],
        "the normal form is forwarded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_page_reached_through_a_cached_prefix_is_never_stored_for_others() {
    let origin = origin().await;
    let proxy = Proxy::new(routes(&origin)).start().await;
    // An <img src="/static/%2e%2e/account"> on any page makes the victim's
    // browser send this with its cookie.
    let victim = get(&proxy, "/static/%2e%2e/account", Some("session=victim")).await;
    assert_eq!(victim.status, 200, "{}", victim.head);
    assert_eq!(
        String::from_utf8_lossy(&victim.body),
        "/account cookie=session=victim"
    );
    let attacker = get(&proxy, "/static/%2e%2e/account", None).await;
    assert_eq!(attacker.status, 200, "{}", attacker.head);
    assert_eq!(String::from_utf8_lossy(&attacker.body), "/account cookie=-");
    assert!(
        !attacker
            .header("cache-status")
            .is_some_and(|s| s.contains("hit")),
        "{}",
        attacker.head
    );
    assert_eq!(origin.requests().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_an_origin_could_read_two_ways_is_refused_and_never_forwarded() {
    let origin = origin().await;
    let proxy = Proxy::new(routes(&origin)).start().await;
    for (target, detail) in [
        ("/static/..%2faccount", "encoded-separator"),
        ("/static/..%2Faccount", "encoded-separator"),
        ("/static/..%5caccount", "encoded-separator"),
        ("/static/..\\account", "encoded-separator"),
        ("/static/..;/account", "invalid-path"),
        ("/static/%00", "invalid-path"),
        ("/static/%zz", "invalid-path"),
        ("/static/%c0%ae%c0%ae/account", "invalid-path"),
        ("/static/../../etc/passwd", "path-above-root"),
        ("/%2e%2e/account", "path-above-root"),
    ] {
        let answer = get(&proxy, target, Some("session=victim")).await;
        assert_eq!(answer.status, 400, "{target}: {}", answer.head);
        assert_eq!(
            answer.header("proxy-status"),
            Some(format!("corral; error=http_request_error; details=\"{detail}\"").as_str()),
            "{target}"
        );
        let status = answer.header("cache-status").unwrap_or_default();
        assert!(
            status.contains(&format!("detail={detail}")),
            "{target}: {status}"
        );
    }
    assert!(origin.requests().is_empty(), "{:?}", origin.requests());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spellings_of_one_path_share_one_entry() {
    let origin = origin().await;
    let proxy = Proxy::new(routes(&origin)).start().await;
    let first = get(&proxy, "/static/app.js", None).await;
    assert_eq!(
        String::from_utf8_lossy(&first.body),
        "/static/app.js cookie=-"
    );
    for target in [
        "/static/%61pp.js",
        "/static/./app.js",
        "//static///app.js",
        "/static/x/../app.js",
    ] {
        let again = get(&proxy, target, None).await;
        assert_eq!(again.status, 200, "{target}");
        assert!(
            again
                .header("cache-status")
                .is_some_and(|s| s.contains("hit")),
            "{target}: {}",
            again.head
        );
    }
    assert_eq!(origin.requests().len(), 1);
}
