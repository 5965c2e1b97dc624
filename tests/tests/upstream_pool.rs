//! `upstreams: [..]`: load spread over several servers, a dead one left
//! out with no client error for idempotent requests, and taken back when
//! it returns (passive health, as nginx's max_fails / fail_timeout).

use std::time::Duration;

use corral_tests::lifecycle::scrape;
use corral_tests::{Client, Config, Origin, Proxy, Reply, Route, RunningOrigin, eventually};

async fn origin(name: &'static str) -> RunningOrigin {
    Origin::new().route("/p", Reply::ok(name)).start().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_spreads_the_load_leaves_a_dead_server_out_and_takes_it_back() {
    let (a, mut b, c) = (origin("a").await, origin("b").await, origin("c").await);
    let b_addr = b.addr();
    let proxy = Proxy::new(
        Config::new().route(
            Route::new("api", a.url())
                .upstreams(&[a.url(), b.url(), c.url()])
                .cache("enabled", "false")
                .field("health", "{ max_fails: 1, fail_timeout: 1s }"),
        ),
    )
    .start()
    .await;
    let client = Client::new();
    let url = proxy.url("/p");
    for _ in 0..30 {
        assert_eq!(client.get(&url).await.status, 200);
    }
    assert_eq!(
        (a.hits("/p"), b.hits("/p"), c.hits("/p")),
        (10, 10, 10),
        "round robin"
    );

    b.stop().await;
    for _ in 0..30 {
        let got = client.get(&url).await;
        assert_eq!(got.status, 200, "a GET is retried on another server");
        assert_ne!(got.text(), "b");
    }
    assert_eq!(b.hits("/p"), 10);
    assert_eq!(a.hits("/p") + c.hits("/p"), 50);
    let server = b_addr.to_string();
    let up = |m: &corral_tests::lifecycle::Scrape| {
        m.value(
            "corral_upstream_server_up",
            &[("route", "api"), ("server", &server)],
        )
    };
    assert_eq!(up(&scrape(&proxy).await), Some(0.0), "left out");

    // Back on the same address: after fail_timeout a request tries it,
    // and it is in the rotation again.
    let b = Origin::new()
        .route("/p", Reply::ok("b"))
        .start_at(b_addr)
        .await;
    eventually(
        Duration::from_secs(10),
        "the returned server answers again",
        || {
            let client = client.clone();
            let url = url.clone();
            async move { client.get(&url).await.text() == "b" }
        },
    )
    .await;
    assert_eq!(up(&scrape(&proxy).await), Some(1.0));
    let before = b.hits("/p");
    for _ in 0..9 {
        client.get(&url).await;
    }
    assert_eq!(b.hits("/p") - before, 3, "a third of the load again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_active_check_leaves_a_failing_server_out_before_any_client_meets_it() {
    let b = Origin::new()
        .route("/p", Reply::ok("b"))
        .route("/healthz", Reply::status(503, "draining"))
        .start()
        .await;
    let a = Origin::new()
        .route("/p", Reply::ok("a"))
        .route("/healthz", Reply::ok("ok"))
        .start()
        .await;
    let proxy = Proxy::new(
        Config::new().route(
            Route::new("api", a.url())
                .upstreams(&[a.url(), b.url()])
                .cache("enabled", "false")
                .field(
                    "health",
                    "{ max_fails: 1, fail_timeout: 30s, check_path: /healthz, check_interval: 100ms }",
                ),
        ),
    )
    .start()
    .await;
    // The second check of b comes after the first one's verdict is in.
    b.wait_hits("/healthz", 2, Duration::from_secs(10)).await;
    let client = Client::new();
    for _ in 0..10 {
        assert_eq!(client.get(&proxy.url("/p")).await.text(), "a");
    }
    assert_eq!(b.hits("/p"), 0);
}

#[tokio::test]
async fn pool_mistakes_name_their_line_and_field() {
    let render = |c: Config| {
        c.render(
            "127.0.0.1:18080".parse().expect("addr"),
            "127.0.0.1:18081".parse().expect("addr"),
        )
    };
    let pool = |servers: &[&str]| {
        Route::new("api", "http://127.0.0.1:9")
            .upstreams(&servers.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
    };
    let cases = [
        (
            pool(&["http://127.0.0.1:1", "https://127.0.0.1:2"]),
            "routes[0].upstreams[1]",
            "one scheme",
        ),
        (
            pool(&["http://127.0.0.1:1", "http://127.0.0.1:1"]),
            "routes[0].upstreams[1]",
            "twice",
        ),
        (
            pool(&["http://127.0.0.1:1"]).field("balance", "random"),
            "routes[0].balance",
            "round_robin",
        ),
        (
            pool(&["http://127.0.0.1:1"]).field("health", "{ max_fails: 0 }"),
            "routes[0].health.max_fails",
            "",
        ),
    ];
    for (r, field, words) in cases {
        let (status, stderr) = corral_tests::corral_check(&render(Config::new().route(r))).await;
        assert!(!status.success(), "accepted; stderr:\n{stderr}");
        assert!(
            stderr.contains(field) && stderr.contains(words) && stderr.contains("check.yaml:"),
            "expected {field} / {words}: {stderr}"
        );
    }
}
