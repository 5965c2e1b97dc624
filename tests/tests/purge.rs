//! The purge API: refused without the bearer token; by URL, prefix and tag,
//! hard and soft; across instances through Redis; and `corral purge`.

use std::time::Duration;

use http::Method;
use tokio::time::Instant;

use corral_tests::{
    Client, Config, DEADLINE, Origin, Proxy, Redis, Reply, Route, RunningOrigin, RunningProxy,
};

const TOKEN: &str = "purge-token-for-the-tests-0123";

fn cacheable(body: &str) -> Reply {
    Reply::ok(body.to_owned()).header("cache-control", "max-age=60")
}

fn config(origin: &RunningOrigin) -> Config {
    Config::new()
        .route(Route::new("api", origin.url()))
        .server("purge_token", &format!("\"{TOKEN}\""))
}

/// POST /purge on `proxy`'s admin listener with `query`.
async fn purge(client: &Client, proxy: &RunningProxy, query: &str, token: &str) -> (u16, String) {
    let auth = format!("Bearer {token}");
    let answer = client
        .send(
            Method::POST,
            &proxy.admin_url(&format!("/purge?{query}")),
            &[("authorization", auth.as_str())],
            None,
        )
        .await;
    (answer.status.as_u16(), answer.text())
}

fn enc(s: &str) -> String {
    s.replace('%', "%25")
        .replace('&', "%26")
        .replace('?', "%3F")
        .replace('=', "%3D")
        .replace(':', "%3A")
        .replace('/', "%2F")
}

/// GETs `path` on `proxy` until the origin has seen `hits` requests for it
/// (a purge broadcast is handled on the other instance's own time).
async fn until_refetched(
    client: &Client,
    proxy: &RunningProxy,
    origin: &RunningOrigin,
    path: &str,
    hits: usize,
) {
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut seen = Vec::new();
    while origin.hits(path) < hits {
        let a = client.get(&proxy.url(path)).await;
        assert_eq!(a.status, 200);
        seen.push(a.cache_status().to_string());
        assert!(
            Instant::now() < deadline,
            "{path} was still served from cache after the purge: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purging_without_the_right_token_is_refused_and_purges_nothing() {
    let origin = Origin::new().route("/a", cacheable("a")).start().await;
    let proxy = Proxy::new(config(&origin)).start().await;
    let client = Client::new();
    client.get(&proxy.url("/a")).await;
    let q = format!("url={}", enc(&proxy.url("/a")));
    assert_eq!(
        purge(&client, &proxy, &q, "wrong-token-wrong-token")
            .await
            .0,
        401
    );
    let no_auth = client
        .send(
            Method::POST,
            &proxy.admin_url(&format!("/purge?{q}")),
            &[],
            None,
        )
        .await;
    assert_eq!(no_auth.status, 401);
    assert!(client.get(&proxy.url("/a")).await.cache_status().is_hit());
    assert_eq!(origin.hits("/a"), 1);

    // Without any token configured, purging is disabled.
    let bare = Proxy::new(Config::single(origin.url())).start().await;
    let (status, body) = purge(&client, &bare, &q, TOKEN).await;
    assert_eq!(status, 403, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn url_prefix_and_tag_purges_remove_exactly_what_they_name() {
    let origin = Origin::new()
        .route("/v1/a", cacheable("a"))
        .route(
            "/v1/b",
            cacheable("b").header("surrogate-key", "blue green"),
        )
        .route("/v2/c", cacheable("c").header("surrogate-key", "green"))
        .route("/v2/d", cacheable("d"))
        .start()
        .await;
    let proxy = Proxy::new(config(&origin)).start().await;
    let client = Client::new();
    for p in ["/v1/a", "/v1/b", "/v2/c", "/v2/d"] {
        client.get(&proxy.url(p)).await;
    }

    let (status, body) = purge(
        &client,
        &proxy,
        &format!("prefix={}", enc(&proxy.url("/v1/"))),
        TOKEN,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"mode\":\"hard\""), "{body}");
    for p in ["/v1/a", "/v1/b"] {
        assert!(
            !client.get(&proxy.url(p)).await.cache_status().is_hit(),
            "{p} survived the prefix purge"
        );
        assert_eq!(origin.hits(p), 2);
    }
    for p in ["/v2/c", "/v2/d"] {
        assert!(
            client.get(&proxy.url(p)).await.cache_status().is_hit(),
            "{p} is outside the prefix"
        );
    }

    let (status, _) = purge(&client, &proxy, "tag=green", TOKEN).await;
    assert_eq!(status, 200);
    assert!(
        !client
            .get(&proxy.url("/v2/c"))
            .await
            .cache_status()
            .is_hit()
    );
    assert!(
        !client
            .get(&proxy.url("/v1/b"))
            .await
            .cache_status()
            .is_hit()
    );
    assert!(
        client
            .get(&proxy.url("/v2/d"))
            .await
            .cache_status()
            .is_hit(),
        "untagged answers stay"
    );
    assert_eq!(
        (
            origin.hits("/v2/c"),
            origin.hits("/v1/b"),
            origin.hits("/v2/d")
        ),
        (2, 3, 1)
    );

    let (status, _) = purge(
        &client,
        &proxy,
        &format!("url={}", enc(&proxy.url("/v2/d"))),
        TOKEN,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(client.get(&proxy.url("/v2/d")).await.text(), "d");
    assert_eq!(origin.hits("/v2/d"), 2);

    let (status, body) = purge(&client, &proxy, "prefix=x&tag=y", TOKEN).await;
    assert_eq!(status, 400, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_soft_purge_serves_stale_while_one_refresh_runs() {
    let origin = Origin::new()
        .route(
            "/s",
            Reply::ok("old").header("cache-control", "max-age=60, stale-while-revalidate=30"),
        )
        .start()
        .await;
    let proxy = Proxy::new(config(&origin)).start().await;
    let client = Client::new();
    client.get(&proxy.url("/s")).await;
    origin.set_route(
        "/s",
        Reply::ok("new").header("cache-control", "max-age=60, stale-while-revalidate=30"),
    );

    let (status, body) = purge(
        &client,
        &proxy,
        &format!("url={}&soft=true", enc(&proxy.url("/s"))),
        TOKEN,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let stale = client.get(&proxy.url("/s")).await;
    assert_eq!(
        stale.text(),
        "old",
        "a soft purge keeps serving the old copy meanwhile"
    );
    assert!(
        stale.cache_status().to_string().contains("fwd=stale"),
        "{}",
        stale.cache_status()
    );
    origin.wait_hits("/s", 2, DEADLINE).await;
    corral_tests::eventually(DEADLINE, "the refreshed copy is served", || {
        let client = client.clone();
        let url = proxy.url("/s");
        async move { client.get(&url).await.text() == "new" }
    })
    .await;
    assert_eq!(origin.hits("/s"), 2, "one refresh, not one per request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_on_one_instance_is_seen_by_the_others() {
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route("/x/1", cacheable("one"))
        .route("/x/2", cacheable("two").header("cache-tag", "t1, t2"))
        .start()
        .await;
    let proxies = Proxy::new(config(&origin).redis(&redis.url()))
        .instances(2)
        .start_all()
        .await;
    let (a, b) = (&proxies[0], &proxies[1]);
    let client = Client::new();
    for p in ["/x/1", "/x/2"] {
        client.get(&a.url(p)).await;
        assert!(
            client.get(&b.url(p)).await.cache_status().is_hit(),
            "B shares A's fill of {p}"
        );
    }

    let (status, body) = purge(&client, a, &format!("url={}", enc(&a.url("/x/1"))), TOKEN).await;
    assert_eq!(status, 200);
    assert!(body.contains("\"scope\":\"cluster\""), "{body}");
    until_refetched(&client, b, &origin, "/x/1", 2).await;

    let (status, _) = purge(&client, a, "tag=t2", TOKEN).await;
    assert_eq!(status, 200);
    until_refetched(&client, b, &origin, "/x/2", 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_purge_subcommand_calls_the_admin_api() {
    let origin = Origin::new().route("/cli", cacheable("cli")).start().await;
    let proxy = Proxy::new(config(&origin)).start().await;
    let client = Client::new();
    client.get(&proxy.url("/cli")).await;
    let run = |token: &str| {
        std::process::Command::new(corral_tests::paths::corral_bin())
            .args([
                "purge",
                "--admin",
                &proxy.admin_url(""),
                "--url",
                &proxy.url("/cli"),
            ])
            .env("CORRAL_PURGE_TOKEN", token)
            .output()
            .expect("run corral purge")
    };
    let refused = run("not-the-token-not-the-token");
    assert!(!refused.status.success());
    assert!(client.get(&proxy.url("/cli")).await.cache_status().is_hit());
    let done = run(TOKEN);
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    assert!(String::from_utf8_lossy(&done.stdout).contains("\"purged\""));
    assert!(!client.get(&proxy.url("/cli")).await.cache_status().is_hit());
    assert_eq!(origin.hits("/cli"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_without_a_valid_host_is_refused_and_purges_nothing() {
    let origin = Origin::new().route("/k", cacheable("k")).start().await;
    let proxy = Proxy::new(config(&origin)).start().await;
    let client = Client::new();
    client.get(&proxy.url("/k")).await;
    for prefix in [":", "http://:80/", "http://", "%20/"] {
        let (status, body) =
            purge(&client, &proxy, &format!("prefix={}", enc(prefix)), TOKEN).await;
        assert_eq!(status, 400, "prefix {prefix:?}: {body}");
    }
    let (status, body) = purge(
        &client,
        &proxy,
        &format!("url={}", enc("http://:80/k")),
        TOKEN,
    )
    .await;
    assert_eq!(status, 400, "{body}");
    let again = client.get(&proxy.url("/k")).await;
    assert!(again.cache_status().is_hit(), "{}", again.cache_status());
    assert_eq!(origin.hits("/k"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_purge_token_in_the_environment_is_refused_at_start() {
    let dir = corral_tests::temp::TempDir::new("short-token").expect("scratch dir");
    let path = dir.path().join("corral.yaml");
    let yaml = corral_tests::config::with_listeners(
        &Config::single("http://127.0.0.1:9").to_yaml(),
        "127.0.0.1:0".parse().expect("addr"),
        "127.0.0.1:0".parse().expect("addr"),
    );
    std::fs::write(&path, yaml).expect("write config");
    let out = tokio::time::timeout(
        DEADLINE,
        tokio::process::Command::new(corral_tests::paths::corral_bin())
            .arg("serve")
            .arg("--config")
            .arg(&path)
            .env("CORRAL_PURGE_TOKEN", "short")
            .output(),
    )
    .await
    .expect("corral exits at once")
    .expect("run corral");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("CORRAL_PURGE_TOKEN must be at least 16 characters"),
        "{stderr}"
    );
}
