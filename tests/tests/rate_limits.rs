//! Rate limits that count the caller (`limits:`), across instances through
//! Redis, and the origin's pacing (`upstream_concurrency`). Every test
//! client is 127.0.0.1: who is "behind one address" is a header from a
//! trusted proxy, and who is untrusted is chosen by the trust list.
//! Rates are per hour so that no request in a test's few seconds is let
//! through by the refill: what passes is exactly the burst.

use std::time::Duration;

use corral_tests::lifecycle::{scrape, wait_for_access_lines};
use corral_tests::temp::TempDir;
use corral_tests::{
    Answer, Client, Config, DEADLINE, Origin, Proxy, Redis, Reply, Route, RunningProxy,
    corral_check, eventually,
};
use futures_util::future::join_all;

const ACCOUNT_HEADER: &str = "{ account: { header: X-Account-Id } }";

fn statuses(answers: &[Answer]) -> Vec<u16> {
    answers.iter().map(|a| a.status.as_u16()).collect()
}

fn count(answers: &[Answer], status: u16) -> usize {
    answers
        .iter()
        .filter(|a| a.status.as_u16() == status)
        .count()
}

/// GETs `url` once per header set, one after another.
async fn one_by_one(client: &Client, url: &str, headers: &[Vec<(String, String)>]) -> Vec<Answer> {
    let mut out = Vec::new();
    for h in headers {
        let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        out.push(client.get_with(url, &h).await);
    }
    out
}

/// GETs `url` once per header set, 50 at a time.
async fn each(client: &Client, url: &str, headers: &[Vec<(String, String)>]) -> Vec<Answer> {
    let mut out = Vec::new();
    for chunk in headers.chunks(50) {
        let answers = join_all(chunk.iter().map(|h| {
            let client = client.clone();
            async move {
                let h: Vec<(&str, &str)> =
                    h.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                client.get_with(url, &h).await
            }
        }))
        .await;
        out.extend(answers);
    }
    out
}

fn account(id: &str) -> Vec<(String, String)> {
    vec![("x-account-id".into(), id.into())]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_over_its_limit_gets_429_with_retry_after_and_ratelimit_fields() {
    let origin = Origin::new().route("/p", Reply::ok("p")).start().await;
    let proxy = Proxy::new(Config::new().route(Route::new("api", origin.url()).field(
        "limits",
        "[{ name: per-ip, key: ip, rate: 5/h, count_hits: true }]",
    )))
    .start()
    .await;
    let client = Client::new();
    let mut answers = Vec::new();
    for _ in 0..7 {
        answers.push(client.get(&proxy.url("/p")).await);
    }
    assert_eq!(statuses(&answers), [200, 200, 200, 200, 200, 429, 429]);
    assert_eq!(
        origin.hits("/p"),
        5,
        "a refused request never reaches the origin"
    );
    // Allowed answers say what is left; the policy is the configured one.
    assert_eq!(
        answers[0].header("ratelimit-policy"),
        Some("\"per-ip\";q=5;w=3600")
    );
    let remaining: Vec<&str> = answers[..5]
        .iter()
        .map(|a| {
            a.header("ratelimit")
                .unwrap_or_default()
                .split(';')
                .nth(1)
                .unwrap_or("")
        })
        .collect();
    assert_eq!(remaining, ["r=4", "r=3", "r=2", "r=1", "r=0"]);
    // The refusal: when to come back (one request every 720 s), in the
    // header, the RateLimit fields and the JSON body.
    let refused = &answers[5];
    let retry: u64 = refused
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .expect("seconds");
    assert!((700..=720).contains(&retry), "Retry-After {retry}");
    assert_eq!(
        refused.header("ratelimit"),
        Some(format!("\"per-ip\";r=0;t={retry}").as_str())
    );
    assert_eq!(
        refused.header("ratelimit-policy"),
        Some("\"per-ip\";q=5;w=3600")
    );
    assert_eq!(refused.header("content-type"), Some("application/json"));
    let body: serde_json::Value = serde_json::from_slice(&refused.body).expect("JSON body");
    assert_eq!(body["error"], "rate_limited");
    assert_eq!(body["limit"], "per-ip");
    assert_eq!(body["retry_after"], retry);
    assert_eq!(refused.cache_status().detail(), Some("rate-limited"));
    assert_eq!(
        refused.header("proxy-status"),
        Some("corral; error=http_request_denied; details=\"rate-limited\"")
    );
    // Counted, and logged with the limit's name.
    let metrics = scrape(&proxy).await;
    let n = |outcome| {
        metrics.value(
            "corral_rate_limit_total",
            &[
                ("route", "api"),
                ("limit", "per-ip"),
                ("outcome", outcome),
                ("counter", "local"),
            ],
        )
    };
    assert_eq!((n("allowed"), n("limited")), (Some(5.0), Some(2.0)));
    let lines = wait_for_access_lines(&proxy, 7, DEADLINE).await;
    let limited: Vec<bool> = lines
        .iter()
        .map(|l| l.raw.contains("\"limit\":\"per-ip\""))
        .collect();
    assert_eq!(limited, [false, false, false, false, false, true, true]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_a_trusted_hop_the_real_address_is_counted_and_logged() {
    let origin = Origin::new().route("/r", Reply::ok("r")).start().await;
    let limits = "[{ name: per-ip, key: ip, rate: 2/h, count_hits: true }]";
    let config = |trusted: &str| {
        Config::new()
            .route(Route::new("api", origin.url()).field("limits", limits))
            .server("trusted_proxies", trusted)
    };
    let proxy = Proxy::new(config("[127.0.0.1/32]")).start().await;
    let client = Client::new();
    let via = |xff: &str| vec![("x-forwarded-for".to_owned(), xff.to_owned())];
    let url = proxy.url("/r");
    // Two clients behind the balancer, each with its own count; a spoofed
    // leftmost entry changes nothing.
    let got = one_by_one(
        &client,
        &url,
        &[
            via("198.51.100.7"),
            via("6.6.6.6, 198.51.100.7"),
            via("198.51.100.8"),
            via("1.1.1.1, 198.51.100.7"),
        ],
    )
    .await;
    assert_eq!(statuses(&got), [200, 200, 200, 429]);
    let lines = wait_for_access_lines(&proxy, 4, DEADLINE).await;
    let refused = &lines[3];
    assert_eq!(
        (refused.status, refused.client.as_str()),
        (429, "198.51.100.7")
    );
    assert!(
        refused.raw.contains("\"limit\":\"per-ip\""),
        "{}",
        refused.raw
    );

    // From an untrusted peer the header is ignored: one address, one count.
    let untrusting = Proxy::new(config("[10.0.0.0/8]")).start().await;
    let got = one_by_one(
        &client,
        &untrusting.url("/r"),
        &[
            via("198.51.100.1"),
            via("198.51.100.2"),
            via("198.51.100.3"),
        ],
    )
    .await;
    assert_eq!(statuses(&got), [200, 200, 429]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_limit_counts_a_caller_across_routes_beside_each_routes_own() {
    global_and_route_limits(None).await;
    // The same through Redis: the refunds are Redis's too.
    let redis = Redis::start().await;
    global_and_route_limits(Some(&redis)).await;
    assert_eq!(
        redis.keys("corral:rl:*").await.len(),
        3,
        "a/per-route, b/per-route, total"
    );
}

async fn global_and_route_limits(redis: Option<&Redis>) {
    let origin = Origin::new()
        .route("/a/x", Reply::ok("a"))
        .route("/b/x", Reply::ok("b"))
        .start()
        .await;
    let own = "[{ name: per-route, key: account, rate: 2/h }]";
    let mut config = Config::new()
        .route(
            Route::new("a", origin.url())
                .path_prefix("/a")
                .field("limits", own),
        )
        .route(
            Route::new("b", origin.url())
                .path_prefix("/b")
                .field("limits", own),
        )
        .top("limits", "[{ name: total, key: account, rate: 3/h }]")
        .top("callers", ACCOUNT_HEADER)
        .server("trusted_proxies", "[127.0.0.1/32]");
    if let Some(r) = redis {
        config = config.redis(&r.url());
    }
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();
    let me = [account("u1")];
    let mut got = Vec::new();
    for path in ["/a/x", "/a/x", "/a/x", "/b/x", "/b/x"] {
        got.extend(one_by_one(&client, &proxy.url(path), &me).await);
    }
    // /a: 2 by its own limit; /b: its own allows 2 but the total 3 is spent.
    assert_eq!(statuses(&got), [200, 200, 429, 200, 429]);
    let body: serde_json::Value = serde_json::from_slice(&got[2].body).expect("JSON");
    assert_eq!(body["limit"], "per-route");
    let body: serde_json::Value = serde_json::from_slice(&got[4].body).expect("JSON");
    assert_eq!(body["limit"], "total");
    assert_eq!(
        got[3].header("ratelimit-policy"),
        Some("\"per-route\";q=2;w=3600, \"total\";q=3;w=3600")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_behind_one_address_are_counted_by_account_and_guests_by_address() {
    let origin = Origin::new()
        // Each allowed request reaches the origin: no concurrent callers
        // share an answer that says no-store.
        .route(
            "/school",
            Reply::ok("ok").header("cache-control", "no-store"),
        )
        .start()
        .await;
    let limit = "[{ name: per-caller, key: account_or_ip, rate: 2/h }]";
    let config = |trusted: &str| {
        Config::new()
            .route(Route::new("api", origin.url()).field("limits", limit))
            .top("callers", ACCOUNT_HEADER)
            .server("trusted_proxies", trusted)
    };
    // The school's proxy (127.0.0.1) is trusted: it names each pupil.
    let proxy = Proxy::new(config("[127.0.0.1/32]")).start().await;
    let client = Client::new();
    let url = proxy.url("/school");
    let pupils: Vec<_> = (0..500).map(|i| account(&format!("pupil-{i}"))).collect();
    let answers = each(&client, &url, &pupils).await;
    assert_eq!(
        count(&answers, 200),
        500,
        "500 accounts behind one address are not one bucket"
    );
    // One pupil's own limit still holds.
    let again = one_by_one(&client, &url, &[account("pupil-7"), account("pupil-7")]).await;
    assert_eq!(statuses(&again), [200, 429]);
    // Guests (no account) are counted by their address.
    let guests = one_by_one(&client, &url, &[vec![], vec![], vec![]]).await;
    assert_eq!(statuses(&guests), [200, 200, 429]);
    assert_eq!(origin.hits("/school"), 503);

    // The same headers from a peer nobody trusts name nobody: one address.
    let untrusting = Proxy::new(config("[10.0.0.0/8]")).start().await;
    let claimed: Vec<_> = (0..4).map(|i| account(&format!("forged-{i}"))).collect();
    let mut forged = Vec::new();
    for h in &claimed {
        forged.extend(each(&client, &untrusting.url("/school"), std::slice::from_ref(h)).await);
    }
    assert_eq!(statuses(&forged), [200, 200, 429, 429]);
    // And the origin never sees an account the caller named itself; from
    // the trusted proxy it does.
    let seen: Vec<Option<String>> = origin
        .requests("/school")
        .iter()
        .map(|r| r.header("x-account-id").map(str::to_owned))
        .collect();
    assert_eq!(seen.len(), 505);
    assert_eq!(
        seen.iter().filter(|h| h.is_some()).count(),
        501,
        "500 pupils and pupil-7 again"
    );
    assert!(
        seen[503..].iter().all(Option::is_none),
        "{:?}",
        &seen[503..]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_hits_are_not_counted_unless_the_limit_says_so() {
    let cacheable = |b: &'static str| Reply::ok(b).header("cache-control", "max-age=60");
    let origin = Origin::new()
        .route("/c", cacheable("c"))
        .route("/d", cacheable("d"))
        .route("/e", cacheable("e"))
        .start()
        .await;
    let proxy = Proxy::new(Config::new().route(
        Route::new("api", origin.url()).field("limits", "[{ name: fetches, key: ip, rate: 2/h }]"),
    ))
    .start()
    .await;
    let client = Client::new();
    let first = client.get(&proxy.url("/c")).await;
    assert_eq!(first.status, 200);
    // One of two used: the whole burst is back in half an hour.
    assert_eq!(first.header("ratelimit"), Some("\"fetches\";r=1;t=1800"));
    for _ in 0..10 {
        let hit = client.get(&proxy.url("/c")).await;
        assert_eq!(
            (hit.status.as_u16(), hit.cache_status().is_hit()),
            (200, true)
        );
        assert_eq!(hit.header("ratelimit"), None, "a hit is not counted");
    }
    assert_eq!(client.get(&proxy.url("/d")).await.status, 200);
    let refused = client.get(&proxy.url("/e")).await;
    assert_eq!(refused.status, 429);
    assert_eq!(
        (origin.hits("/c"), origin.hits("/d"), origin.hits("/e")),
        (1, 1, 0)
    );
    // Hits still answer while fetches are refused.
    assert_eq!(client.get(&proxy.url("/c")).await.status, 200);
}

const SECRET: &[u8] = b"a test secret of at least 32 bytes!!";

fn token(secret: &[u8], sub: &str, exp_from_now: i64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64;
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &serde_json::json!({ "sub": sub, "exp": now + exp_from_now }),
        &jsonwebtoken::EncodingKey::from_secret(secret).expect("key"),
    )
    .expect("token")
}

fn bearer(t: &str) -> Vec<(String, String)> {
    vec![("authorization".into(), format!("Bearer {t}"))]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verified_token_names_the_account_and_a_bad_one_is_never_trusted() {
    let origin = Origin::new().route("/me", Reply::ok("me")).start().await;
    let dir = TempDir::new("corral-jwt").expect("temp dir");
    let secret = dir.path().join("jwt.key");
    std::fs::write(&secret, SECRET).expect("write secret");
    let config = |on_invalid: &str| {
        Config::new()
            .route(Route::new("api", origin.url()).field(
                "limits",
                "[{ name: per-account, key: account_or_ip, rate: 2/h }]",
            ))
            .top(
                "callers",
                &format!(
                    "{{ account: {{ jwt: {{ hs256_secret_file: {}, on_invalid: {on_invalid} }} }} }}",
                    secret.display()
                ),
            )
    };
    let proxy = Proxy::new(config("guest")).start().await;
    let client = Client::new();
    let url = proxy.url("/me");
    let alice = bearer(&token(SECRET, "alice", 600));
    let got = one_by_one(
        &client,
        &url,
        &[alice.clone(), alice.clone(), alice.clone()],
    )
    .await;
    assert_eq!(statuses(&got), [200, 200, 429], "alice's own limit");
    let bob = bearer(&token(SECRET, "bob", 600));
    assert_eq!(statuses(&each(&client, &url, &[bob]).await), [200]);
    // A token signed with another key, or expired, says "alice" but is a
    // guest: counted by address, not charged to (or helped by) alice.
    let forged = bearer(&token(b"somebody else's secret, 32 bytes+", "alice", 600));
    let expired = bearer(&token(SECRET, "alice", -3600));
    let got = one_by_one(
        &client,
        &url,
        &[forged.clone(), expired.clone(), forged.clone()],
    )
    .await;
    assert_eq!(
        statuses(&got),
        [200, 200, 429],
        "the guest bucket of 127.0.0.1"
    );

    // With on_invalid: reject, a bad token is a 401 and never reaches the origin.
    let strict = Proxy::new(config("reject")).start().await;
    let before = origin.hits("/me");
    for bad in [&forged, &expired] {
        let got = each(&client, &strict.url("/me"), std::slice::from_ref(bad)).await;
        assert_eq!(got[0].status, 401);
        assert_eq!(
            got[0].header("www-authenticate"),
            Some("Bearer error=\"invalid_token\"")
        );
        assert_eq!(
            got[0].header("proxy-status"),
            Some("corral; error=http_request_denied; details=\"invalid-token\"")
        );
    }
    assert_eq!(origin.hits("/me"), before);
    let ok = each(
        &client,
        &strict.url("/me"),
        &[bearer(&token(SECRET, "carol", 600))],
    )
    .await;
    assert_eq!(ok[0].status, 200);
}

/// `n` requests for `id`, spread round-robin over `proxies`, all at once.
async fn spread(
    client: &Client,
    proxies: &[RunningProxy],
    path: &str,
    id: &str,
    n: usize,
) -> Vec<Answer> {
    join_all((0..n).map(|i| {
        let client = client.clone();
        let url = proxies[i % proxies.len()].url(path);
        let id = id.to_owned();
        async move { client.get_with(&url, &[("x-account-id", &id)]).await }
    }))
    .await
}

fn shared_config(origin: &corral_tests::RunningOrigin, redis: &Redis, limits: &str) -> Config {
    Config::new()
        .route(Route::new("api", origin.url()).field("limits", limits))
        .top("callers", ACCOUNT_HEADER)
        .server("trusted_proxies", "[127.0.0.1/32]")
        .redis(&redis.url())
        // Raised from the 50 ms default, as in shared_cache.rs: two shared
        // cores under a burst of 100 over five instances; one script call
        // past the deadline counts locally and lets one more through, and
        // what is under test is the shared count, not the deadline.
        .redis_field("op_timeout", "250ms")
        .redis_field("breaker", "{ failures: 2, open_for: 500ms }")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_account_over_five_instances_is_limited_to_the_configured_total() {
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route("/a", Reply::ok("a").header("cache-control", "no-store"))
        .start()
        .await;
    let proxies = Proxy::new(shared_config(
        &origin,
        &redis,
        "[{ name: per-account, key: account, rate: 20/h }]",
    ))
    .instances(5)
    .start_all()
    .await;
    let client = Client::new();
    let answers = spread(&client, &proxies, "/a", "acct-1", 100).await;
    assert_eq!(count(&answers, 200) + count(&answers, 429), 100);
    assert_eq!(count(&answers, 200), 20, "the total over 5 instances");
    assert_eq!(origin.hits("/a"), 20);
    let mut shared = 0.0;
    for p in &proxies {
        shared += scrape(p).await.sum(
            "corral_rate_limit_total",
            &[("limit", "per-account"), ("counter", "shared")],
        );
    }
    assert_eq!(shared, 100.0, "every check was Redis's");
    // Nothing of the account is in the key: only a digest.
    let keys = redis.keys("corral:rl:*").await;
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert!(!keys[0].contains("acct"), "{keys:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_lost_falls_back_to_a_local_share_and_comes_back_to_shared() {
    let mut redis = Redis::start().await;
    let origin = Origin::new()
        .route("/open", Reply::ok("o"))
        .route("/closed", Reply::ok("c"))
        .start()
        .await;
    let config = shared_config(
        &origin,
        &redis,
        "[{ name: open, key: account, rate: 20/h }]",
    )
    .route(
        Route::new("strict", origin.url())
            .path_prefix("/closed")
            .field(
                "limits",
                "[{ name: closed, key: account, rate: 20/h, on_redis_down: refuse }]",
            ),
    )
    .redis_field("instances", "2");
    let proxies = Proxy::new(config).instances(2).start_all().await;
    let client = Client::new();
    assert_eq!(
        count(&spread(&client, &proxies, "/closed", "k", 2).await, 200),
        2
    );

    redis.kill();
    // Each instance counts alone at half the rate and half the burst: 10.
    let mut answers = Vec::new();
    for p in &proxies {
        let mine = spread(&client, std::slice::from_ref(p), "/open", "k", 15).await;
        assert_eq!(count(&mine, 200), 10, "{:?}", statuses(&mine));
        answers.extend(mine);
    }
    assert_eq!(
        count(&answers, 429),
        10,
        "no answer but 200 and 429: {:?}",
        statuses(&answers)
    );
    // A limit that fails closed says the limiter is unavailable: a 503,
    // not the caller's fault.
    let closed = spread(&client, &proxies, "/closed", "k", 4).await;
    assert_eq!(statuses(&closed), [503, 503, 503, 503]);
    assert_eq!(closed[0].header("retry-after"), Some("1"));
    let body: serde_json::Value = serde_json::from_slice(&closed[0].body).expect("JSON");
    assert_eq!(body["error"], "limiter_unavailable");
    assert_eq!(
        closed[0].header("proxy-status"),
        Some("corral; error=proxy_internal_error; details=\"limiter-unavailable\"")
    );

    // Redis back (empty): shared again, the total is the whole 20.
    redis.restart().await;
    let mut probe = 0;
    eventually(
        Duration::from_secs(15),
        "the shared counter is used again",
        || {
            probe += 1;
            let client = client.clone();
            let url = proxies[0].url("/closed");
            let id = format!("probe-{probe}");
            async move { client.get_with(&url, &[("x-account-id", &id)]).await.status == 200 }
        },
    )
    .await;
    eventually(
        Duration::from_secs(15),
        "both instances use Redis again",
        || {
            probe += 1;
            let client = client.clone();
            let url = proxies[1].url("/closed");
            let id = format!("probe-{probe}");
            async move { client.get_with(&url, &[("x-account-id", &id)]).await.status == 200 }
        },
    )
    .await;
    let answers = spread(&client, &proxies, "/open", "fresh", 30).await;
    assert_eq!(count(&answers, 200), 20, "{:?}", statuses(&answers));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_concurrency_holds_over_three_instances() {
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route("/slow", Reply::ok("s").delay(Duration::from_millis(250)))
        .start()
        .await;
    let config = Config::new()
        .route(
            Route::new("api", origin.url())
                .cache("enabled", "false")
                .field("upstream_concurrency", "2")
                .field("upstream_queue_timeout", "30s"),
        )
        .redis(&redis.url())
        // As in shared_config: a slot script past the 50 ms default under
        // this burst would count locally and let a third request through.
        .redis_field("op_timeout", "250ms");
    let proxies = Proxy::new(config).instances(3).start_all().await;
    let client = Client::new();
    let answers = join_all((0..24).map(|i| {
        let client = client.clone();
        let url = proxies[i % 3].url("/slow");
        async move { client.get(&url).await }
    }))
    .await;
    assert_eq!(count(&answers, 200), 24, "{:?}", statuses(&answers));
    assert_eq!(origin.hits("/slow"), 24);
    assert_eq!(
        origin.peak_concurrency(),
        2,
        "never more than 2 at once, and 2 were used"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_upstream_queue_answers_503_and_is_no_origin_failure() {
    let origin = Origin::new()
        .route("/x", Reply::ok("x").delay(Duration::from_millis(1500)))
        .route("/y", Reply::ok("y"))
        .start()
        .await;
    let proxy = Proxy::new(
        Config::new().route(
            Route::new("api", origin.url())
                .field("upstream_concurrency", "1")
                .field("upstream_queue_timeout", "300ms"),
        ),
    )
    .start()
    .await;
    let client = Client::new();
    let slow = {
        let client = client.clone();
        let url = proxy.url("/x");
        tokio::spawn(async move { client.get(&url).await })
    };
    origin.wait_hits("/x", 1, DEADLINE).await;
    let busy = client.get(&proxy.url("/y")).await;
    assert_eq!(busy.status, 503);
    assert_eq!(busy.header("retry-after"), Some("1"));
    assert_eq!(busy.cache_status().detail(), Some("upstream-busy"));
    assert_eq!(
        busy.header("proxy-status"),
        Some("corral; error=connection_limit_reached; details=\"upstream-busy\"")
    );
    assert_eq!(origin.hits("/y"), 0);
    assert_eq!(slow.await.expect("slow GET").status, 200);
    // The origin was never asked, so /y is not in back-off: it is fetched now.
    let again = client.get(&proxy.url("/y")).await;
    assert_eq!((again.status.as_u16(), again.text()), (200, "y".to_owned()));
    assert_eq!(origin.hits("/y"), 1);
    assert_eq!(origin.peak_concurrency(), 1);
}

#[tokio::test]
async fn limit_mistakes_name_their_line_and_field() {
    let render = |c: Config| {
        c.render(
            "127.0.0.1:18080".parse().expect("addr"),
            "127.0.0.1:18081".parse().expect("addr"),
        )
    };
    let route = || Route::new("api", "http://127.0.0.1:9");
    let cases = [
        (
            Config::new()
                .route(route().field("limits", "[{ name: a, key: account, rate: 5/min }]")),
            "routes[0].limits[0].key",
            "callers.account",
        ),
        (
            Config::new()
                .route(route().field("limits", "[{ name: a, key: ip, rate: 5/fortnight }]")),
            "routes[0].limits[0].rate",
            "not a period",
        ),
        (
            Config::new().route(route().field(
                "limits",
                "[{ name: a, key: ip, rate: 5/s }, { name: a, key: ip, rate: 1/s }]",
            )),
            "routes[0].limits[1].name",
            "duplicate",
        ),
        (
            Config::new().route(route()).top(
                "callers",
                "{ account: { jwt: { hs256_secret_file: /nonexistent/key } } }",
            ),
            "callers.account.jwt.hs256_secret_file",
            "cannot read",
        ),
        (
            Config::new().route(route().field("upstream_concurrency", "0")),
            "routes[0].upstream_concurrency",
            "",
        ),
    ];
    for (config, field, words) in cases {
        let (status, stderr) = corral_check(&render(config)).await;
        assert!(!status.success(), "accepted; stderr:\n{stderr}");
        assert!(
            stderr.contains(field) && stderr.contains(words) && stderr.contains("check.yaml:"),
            "expected {field} / {words}: {stderr}"
        );
    }
}

/// Limits are checked one by one, the address first (a caller cannot make
/// one up), and a request already refused writes nothing more: inventing
/// an account per request behind an address over its limit creates no
/// counter in Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_one_limit_refuses_writes_no_counter_for_another() {
    let origin = Origin::new()
        .route("/k", Reply::ok("k").header("cache-control", "no-store"))
        .start()
        .await;
    let redis = Redis::start().await;
    // The account limit is listed first on purpose.
    let limits =
        "[{ name: per-key, key: account, rate: 100/d }, { name: per-ip, key: ip, rate: 10/d }]";
    let proxy = Proxy::new(shared_config(&origin, &redis, limits))
        .start()
        .await;
    let client = Client::new();
    let invented: Vec<_> = (0..60).map(|i| account(&format!("made-up-{i}"))).collect();
    let got = one_by_one(&client, &proxy.url("/k"), &invented).await;
    assert_eq!(count(&got, 200), 10);
    assert_eq!(count(&got, 429), 50);
    for refused in got.iter().filter(|a| a.status == 429) {
        let body: serde_json::Value = serde_json::from_slice(&refused.body).expect("JSON");
        assert_eq!(body["limit"], "per-ip");
    }
    // One counter per allowed account, and the address's: not one per
    // request.
    assert_eq!(redis.keys("corral:rl:*").await.len(), 11);
    assert_eq!(origin.hits("/k"), 10);
}

/// A request that a limit sparing hits refuses (the cache could not
/// answer) is counted by none: the limits that count hits give their count
/// back, and the 429 names only the limit that refused it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_refused_once_the_cache_cannot_answer_is_counted_by_no_limit() {
    let origin = Origin::new()
        .route(
            "/hit",
            Reply::ok("hit").header("cache-control", "max-age=60"),
        )
        .route(
            "/miss",
            Reply::ok("miss").header("cache-control", "no-store"),
        )
        .start()
        .await;
    let limits = "[{ name: all, key: ip, rate: 5/h, count_hits: true }, { name: fetches, key: ip, rate: 2/h }]";
    let proxy =
        Proxy::new(Config::new().route(Route::new("api", origin.url()).field("limits", limits)))
            .start()
            .await;
    let client = Client::new();
    let mut got = Vec::new();
    for path in [
        "/hit", "/miss", "/miss", "/miss", "/miss", "/hit", "/hit", "/hit", "/hit",
    ] {
        got.push(client.get(&proxy.url(path)).await);
    }
    assert_eq!(
        statuses(&got),
        [200, 200, 429, 429, 429, 200, 200, 200, 429]
    );
    for refused in &got[2..5] {
        let body: serde_json::Value = serde_json::from_slice(&refused.body).expect("JSON");
        assert_eq!(body["limit"], "fetches");
        assert_eq!(
            refused.header("ratelimit-policy"),
            Some("\"fetches\";q=2;w=3600"),
            "only the limit that refused it"
        );
        assert!(
            refused
                .header("ratelimit")
                .is_some_and(|v| v.starts_with("\"fetches\";r=0;")),
            "{:?}",
            refused.header("ratelimit")
        );
    }
    // The three 429s were given back to `all`: 5 = 2 + these 3 hits.
    let body: serde_json::Value = serde_json::from_slice(&got[8].body).expect("JSON");
    assert_eq!(body["limit"], "all");
}
