//! Coalescing: a cold key reaches the origin once however many clients ask,
//! and what cannot be shared is not serialized behind the lock.

use std::time::{Duration, Instant};

use corral_tests::lifecycle::scrape;
use corral_tests::raw::send_and_hold;
use corral_tests::{
    Answer, Client, Config, DEADLINE, Origin, Proxy, Reply, Route, assert_every_answer, tally,
};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_concurrent_gets_for_a_cold_key_reach_origin_once() {
    let origin = Origin::new()
        .route(
            "/warm",
            Reply::ok("warm")
                .header("cache-control", "no-store")
                .delay(ms(300)),
        )
        .route(
            "/cold",
            Reply::ok("the one answer")
                .header("cache-control", "max-age=60")
                .delay(ms(200)),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    // Open the thousand connections first, so that the burst measures the
    // proxy's coalescing and not how fast 1000 handshakes fit in 200ms.
    client.warm(1000, &proxy.url("/warm")).await;

    let answers = client.burst(1000, &proxy.url("/cold"), &[]).await;

    assert_eq!(origin.hits("/cold"), 1, "answers: {:#?}", tally(&answers));
    assert_every_answer(&answers, 200, "the one answer");
    // One answer led and stored; every other one waited for it (collapsed)
    // or, on a loaded machine, arrived after it was stored (hit). Which of
    // the two is timing; that none went to the origin is not.
    let count = |f: &dyn Fn(&Answer) -> bool| answers.iter().filter(|a| f(a)).count();
    let stored = count(&|a| a.cache_status().stored());
    let collapsed = count(&|a| a.cache_status().collapsed());
    let hits = count(&|a| a.cache_status().is_hit());
    assert_eq!(stored, 1, "answers: {:#?}", tally(&answers));
    assert_eq!(collapsed + hits, 999, "answers: {:#?}", tally(&answers));
    assert!(
        collapsed >= 500,
        "most of the burst waited on the fill: {:#?}",
        tally(&answers)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_client_disconnects_mid_fill_still_fills_for_its_followers() {
    let origin = Origin::new()
        .route(
            "/slow",
            Reply::ok("filled")
                .header("cache-control", "max-age=60")
                .delay(ms(800)),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();

    // The leader is a raw connection so that dropping it closes the socket for sure.
    let request = format!("GET /slow HTTP/1.1\r\nHost: {}\r\n\r\n", proxy.addr());
    let leader = send_and_hold(proxy.addr(), request.as_bytes()).await;
    origin.wait_hits("/slow", 1, DEADLINE).await;
    drop(leader);
    // Nothing observable marks "the proxy noticed the disconnect"; give it a
    // moment so the followers really arrive after the leader is gone.
    tokio::time::sleep(ms(100)).await;

    let answers = client.burst(20, &proxy.url("/slow"), &[]).await;

    assert_every_answer(&answers, 200, "filled");
    assert_eq!(origin.hits("/slow"), 1, "answers: {:#?}", tally(&answers));
    assert_eq!(
        origin.cancelled("/slow"),
        0,
        "the proxy abandoned the origin fetch when the leader's client left"
    );
    let next = client.get(&proxy.url("/slow")).await;
    assert!(
        next.cache_status().is_hit(),
        "the fill was stored: {}",
        next.cache_status()
    );
    assert_eq!(next.text(), "filled");
    assert_eq!(origin.hits("/slow"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncacheable_500_is_shared_by_the_coalesced_burst_and_not_stored() {
    let origin = Origin::new()
        .route("/fail", Reply::status(500, "kaput").delay(ms(200)))
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();

    let answers = client.burst(50, &proxy.url("/fail"), &[]).await;

    assert_eq!(origin.hits("/fail"), 1, "answers: {:#?}", tally(&answers));
    assert_every_answer(&answers, 500, "kaput");

    // One failure is not reused: the next caller asks again (RFC 9111 §3
    // keeps a 5xx without freshness out of the cache). The second failure
    // in a row, seen by another caller, puts the key in back-off for a
    // second: corral answers for the origin. (One caller's failures alone
    // never do: see hostile_twins.rs.)
    let other = Client::from_address(std::net::Ipv4Addr::new(127, 0, 0, 2));
    let retried = other.get(&proxy.url("/fail")).await;
    assert_eq!(
        (retried.status.as_u16(), retried.text()),
        (500, "kaput".to_owned())
    );
    assert_eq!(origin.hits("/fail"), 2);
    // The origin's own 500 carries no Proxy-Status of corral's; corral's
    // 503 says it is corral's (RFC 9209).
    assert_eq!(retried.header("proxy-status"), None);
    let during = client.get(&proxy.url("/fail")).await;
    assert_eq!(during.status, 503);
    assert_eq!(during.cache_status().detail(), Some("backoff"));
    assert_eq!(
        during.header("proxy-status"),
        Some("corral; error=destination_unavailable; details=\"backoff\"")
    );
    assert_eq!(origin.hits("/fail"), 2);
    // Once it ends, the origin is asked again: the 500 was not stored.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let next = client.get(&proxy.url("/fail")).await;
        if next.status == 500 {
            assert_eq!(next.text(), "kaput");
            break;
        }
        assert_eq!(next.cache_status().detail(), Some("backoff"));
        assert!(
            tokio::time::Instant::now() < deadline,
            "the back-off never ended"
        );
        tokio::time::sleep(ms(50)).await;
    }
    assert_eq!(origin.hits("/fail"), 3, "a 500 must not be stored");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_answers_to_bursts_are_fetched_in_parallel_not_serialized() {
    const BURST: usize = 100;
    const DELAY: Duration = Duration::from_millis(200);
    // Serialized fetches would take BURST × DELAY = 20s; a quarter of that
    // is generous and still fails if requests queue one behind another.
    let bound = DELAY * BURST as u32 / 4;
    let origin = Origin::new()
        .route(
            "/me",
            Reply::ok("mine")
                .header("cache-control", "private")
                .delay(DELAY),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();

    for (round, expected_hits) in [(1, BURST), (2, 2 * BURST)] {
        let started = Instant::now();
        let answers = client.burst(BURST, &proxy.url("/me"), &[]).await;
        let elapsed = started.elapsed();

        for answer in &answers {
            assert_eq!(answer.status, 200, "round {round}: {:#?}", tally(&answers));
            assert_eq!(answer.text(), "mine");
            let status = answer.cache_status();
            assert!(
                status.fwd().is_some() && !status.stored(),
                "round {round}: a private answer is forwarded, never stored: {status}"
            );
        }
        assert_eq!(
            origin.hits("/me"),
            expected_hits,
            "round {round}: every client gets its own private answer"
        );
        assert!(
            elapsed < bound,
            "round {round} took {elapsed:?}, at least {bound:?}: private fetches were serialized"
        );
    }
}

/// A leader stuck on a slow origin, and `followers` requests behind it that
/// arrive once the origin has the leader's request.
async fn leader_then_followers(
    config: Config,
    origin: &corral_tests::RunningOrigin,
    followers: usize,
) -> (Answer, Vec<Answer>, Duration) {
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();
    let url = proxy.url("/slow");
    let leader = {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move { client.get(&url).await })
    };
    origin.wait_hits("/slow", 1, DEADLINE).await;
    let started = Instant::now();
    let answers = client.burst(followers, &url, &[]).await;
    let waited = started.elapsed();
    let leader = leader.await.expect("leader task");
    (leader, answers, waited)
}

fn slow_origin() -> Origin {
    Origin::new().route(
        "/slow",
        Reply::ok("slow")
            .header("cache-control", "max-age=60")
            .delay(ms(1500)),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_past_the_lock_timeout_answer_504_when_told_to() {
    let origin = slow_origin().start().await;
    let config = Config::new().route(
        Route::new("api", origin.url())
            .coalesce("lock_timeout", "300ms")
            .coalesce("on_timeout", "error"),
    );

    let (leader, followers, waited) = leader_then_followers(config, &origin, 4).await;

    assert_eq!(leader.status, 200);
    assert_eq!(leader.text(), "slow");
    for answer in &followers {
        assert_eq!(answer.status, 504, "followers: {:#?}", tally(&followers));
        assert_eq!(
            answer.header("proxy-status"),
            Some("corral; error=http_response_timeout; details=\"lock-timeout\"")
        );
    }
    assert!(
        waited < ms(1200),
        "the followers gave up after {waited:?}, not after the 300ms lock timeout"
    );
    assert_eq!(origin.hits("/slow"), 1);
}

/// A fill that waited the route's lock timeout for a slot of its fill
/// limit (`coalesce.max_fills`) is refused at once, as corral's own 503:
/// the origin never saw it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fill_past_the_fill_limit_is_corrals_own_503() {
    let origin = slow_origin().start().await;
    let config = Config::new().route(
        Route::new("api", origin.url())
            .coalesce("lock_timeout", "300ms")
            .coalesce("max_fills", "1"),
    );
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();
    let holder = {
        let (client, url) = (client.clone(), proxy.url("/slow?k=1"));
        tokio::spawn(async move { client.get(&url).await })
    };
    origin.wait_hits("/slow", 1, DEADLINE).await;
    let refused = client.get(&proxy.url("/slow?k=2")).await;
    assert_eq!(refused.status, 503);
    assert_eq!(refused.cache_status().detail(), Some("fill-limit"));
    assert_eq!(
        refused.header("proxy-status"),
        Some("corral; error=connection_limit_reached; details=\"fill-limit\"")
    );
    assert_eq!(holder.await.expect("holder").text(), "slow");
    assert_eq!(
        origin.hits("/slow"),
        1,
        "the refused fill never reached the origin"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_past_the_lock_timeout_fetch_for_themselves_when_told_to() {
    let origin = slow_origin().start().await;
    let config = Config::new().route(
        Route::new("api", origin.url())
            .coalesce("lock_timeout", "300ms")
            .coalesce("on_timeout", "fetch_each"),
    );

    let (leader, followers, _) = leader_then_followers(config, &origin, 4).await;

    assert_eq!(leader.text(), "slow");
    for answer in &followers {
        assert_eq!(answer.status, 200, "followers: {:#?}", tally(&followers));
        assert_eq!(answer.text(), "slow");
    }
    assert_eq!(
        origin.hits("/slow"),
        5,
        "each waiter past the lock timeout went to the origin itself"
    );
}

/// The default `on_timeout: fetch` is no stampede: the first waiter past
/// the lock timeout fetches again, and the others wait on that fetch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_waiters_past_the_lock_timeout_hand_the_key_to_one_of_them() {
    let origin = slow_origin().start().await;
    let config =
        Config::new().route(Route::new("api", origin.url()).coalesce("lock_timeout", "300ms"));

    let (leader, followers, _) = leader_then_followers(config, &origin, 30).await;

    assert_eq!(leader.text(), "slow");
    for answer in &followers {
        assert_eq!(answer.status, 200, "followers: {:#?}", tally(&followers));
        assert_eq!(answer.text(), "slow");
    }
    assert_eq!(origin.hits("/slow"), 2, "the leader and one waiter: not 31");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_coalescing_disabled_every_request_of_a_cold_burst_reaches_the_origin() {
    let origin = Origin::new()
        .route(
            "/cold",
            Reply::ok("cold")
                .header("cache-control", "max-age=60")
                .delay(ms(300)),
        )
        .start()
        .await;
    let config = Config::new().route(Route::new("api", origin.url()).coalesce("enabled", "false"));
    let proxy = Proxy::new(config).start().await;

    let answers = Client::new().burst(10, &proxy.url("/cold"), &[]).await;

    for answer in &answers {
        assert_eq!(answer.status, 200);
        assert_eq!(answer.text(), "cold");
        assert!(
            !answer.cache_status().collapsed(),
            "{}",
            answer.cache_status()
        );
    }
    assert_eq!(origin.hits("/cold"), 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_wait_list_turns_the_rest_away_with_a_503() {
    let origin = Origin::new()
        .route(
            "/warm",
            Reply::ok("warm").header("cache-control", "no-store"),
        )
        .route(
            "/cold",
            Reply::ok("one")
                .header("cache-control", "max-age=60")
                .delay(ms(1500)),
        )
        .start()
        .await;
    // Warming 200 connections is itself a stampede: on its own route.
    let config = Config::new()
        .route(Route::new("warm", origin.url()).path_prefix("/warm"))
        .route(Route::new("api", origin.url()).coalesce("max_waiters", "50"));
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();
    client.warm(200, &proxy.url("/warm")).await;
    let answers = client.burst(200, &proxy.url("/cold"), &[]).await;
    assert_eq!(origin.hits("/cold"), 1);
    let full: Vec<&Answer> = answers.iter().filter(|a| a.status == 503).collect();
    let served = answers
        .iter()
        .filter(|a| a.status == 200 && a.text() == "one")
        .count();
    // One leader and at most 50 waiters were served; every other caller
    // was turned away (a caller arriving after the answer is a hit).
    assert_eq!(full.len() + served, 200, "{:#?}", tally(&answers));
    assert!(full.len() >= 100, "{:#?}", tally(&answers));
    for a in &full {
        assert_eq!(a.cache_status().detail(), Some("wait-list-full"));
        assert_eq!(a.header("retry-after"), Some("1"));
        assert_eq!(
            a.header("proxy-status"),
            Some("corral; error=connection_limit_reached; details=\"wait-list-full\"")
        );
    }
    let scrape = corral_tests::lifecycle::scrape(&proxy).await;
    assert_eq!(
        scrape.value("corral_wait_list_full_total", &[("route", "api")]),
        Some(full.len() as f64)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_age_hands_a_stuck_key_to_one_waiter_not_to_all() {
    let origin = Origin::new()
        .route(
            "/warm",
            Reply::ok("warm").header("cache-control", "no-store"),
        )
        .route(
            "/slow",
            Reply::ok("slow")
                .header("cache-control", "max-age=60")
                .delay(ms(3000)),
        )
        .start()
        .await;
    let config = Config::new().route(
        Route::new("api", origin.url())
            .coalesce("lock_timeout", "10s")
            .coalesce("lock_age", "1s"),
    );
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();
    client.warm(100, &proxy.url("/warm")).await;
    let answers = client.burst(100, &proxy.url("/slow"), &[]).await;
    assert_every_answer(&answers, 200, "slow");
    assert_eq!(origin.hits("/slow"), 2, "the leader, then one waiter");
}

/// `n` POSTs of `body` to `url` at once (with `headers`).
async fn post_burst(
    client: &Client,
    url: &str,
    n: usize,
    body: &'static str,
    headers: &'static [(&'static str, &'static str)],
) -> Vec<Answer> {
    futures_util::future::join_all((0..n).map(|_| {
        client.send(
            http::Method::POST,
            url,
            headers,
            Some(bytes::Bytes::from_static(body.as_bytes())),
        )
    }))
    .await
}

fn post_config(origin: &corral_tests::RunningOrigin, coalesce_post: bool) -> Config {
    let mut route = Route::new("api", origin.url());
    if coalesce_post {
        route = route.coalesce("post", "{ max_body: 1KiB }");
    }
    Config::new().route(route)
}

const JSON: &[(&str, &str)] = &[("content-type", "application/json")];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_posts_in_flight_share_one_origin_request() {
    let origin = Origin::new()
        .route_method(
            http::Method::POST,
            "/graphql",
            Reply::echo_body().delay(ms(500)),
        )
        .start()
        .await;
    let proxy = Proxy::new(post_config(&origin, true)).start().await;
    let client = Client::new();
    let url = proxy.url("/graphql");
    let answers = post_burst(&client, &url, 300, "{\"query\":\"{ me }\"}", JSON).await;
    assert_every_answer(&answers, 200, "{\"query\":\"{ me }\"}");
    assert_eq!(origin.hits("/graphql"), 1, "{:#?}", tally(&answers));
    // Answers are shared in flight, never stored: the next one asks again.
    post_burst(&client, &url, 1, "{\"query\":\"{ me }\"}", JSON).await;
    assert_eq!(origin.hits("/graphql"), 2);
}

/// Bodies read for a key are counted in `cache.post_memory`, so POSTs on
/// many connections cannot buffer without a bound. A body the budget cannot
/// hold passes through, fetched alone, like one over `max_body`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_body_the_post_memory_cannot_hold_passes_through() {
    static BIG: std::sync::LazyLock<&'static str> =
        std::sync::LazyLock::new(|| Box::leak("x".repeat(2048).into_boxed_str()));
    let origin = Origin::new()
        .route_method(http::Method::POST, "/q", Reply::ok("small").delay(ms(300)))
        .start()
        .await;
    let config = Config::new()
        .cache("post_memory", "1KiB")
        .route(Route::new("api", origin.url()).coalesce("post", "{ max_body: 64KiB }"));
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();
    let answers = post_burst(&client, &proxy.url("/q"), 5, *BIG, JSON).await;
    assert_every_answer(&answers, 200, "small");
    assert_eq!(origin.hits("/q"), 5, "{:#?}", tally(&answers));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn posts_that_differ_in_body_type_or_caller_never_share() {
    let origin = Origin::new()
        .route_method(
            http::Method::POST,
            "/graphql",
            Reply::echo_body().delay(ms(500)),
        )
        .start()
        .await;
    let proxy = Proxy::new(post_config(&origin, true)).start().await;
    let client = Client::new();
    let url = proxy.url("/graphql");
    const A: &[(&str, &str)] = &[
        ("content-type", "application/json"),
        ("authorization", "Bearer a"),
    ];
    const B: &[(&str, &str)] = &[
        ("content-type", "application/json"),
        ("authorization", "Bearer b"),
    ];
    const TEXT: &[(&str, &str)] = &[("content-type", "text/plain")];
    let (one, two, three, four) = tokio::join!(
        post_burst(&client, &url, 40, "{q1}", JSON),
        post_burst(&client, &url, 40, "{q2}", JSON),
        post_burst(&client, &url, 40, "{q1}", TEXT),
        async {
            let (a, b) = tokio::join!(
                post_burst(&client, &url, 20, "{q1}", A),
                post_burst(&client, &url, 20, "{q1}", B)
            );
            (a, b)
        }
    );
    assert_every_answer(&one, 200, "{q1}");
    assert_every_answer(&two, 200, "{q2}");
    assert_every_answer(&three, 200, "{q1}");
    assert_every_answer(&four.0, 200, "{q1}");
    assert_every_answer(&four.1, 200, "{q1}");
    // One request per distinct (body, type, caller): five.
    assert_eq!(origin.hits("/graphql"), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_without_the_opt_in_or_a_large_body_never_coalesces_post() {
    let origin = Origin::new()
        .route_method(
            http::Method::POST,
            "/graphql",
            Reply::echo_body().delay(ms(300)),
        )
        .start()
        .await;
    let plain = Proxy::new(post_config(&origin, false)).start().await;
    let client = Client::new();
    let answers = post_burst(&client, &plain.url("/graphql"), 20, "{q}", JSON).await;
    assert_every_answer(&answers, 200, "{q}");
    assert_eq!(origin.hits("/graphql"), 20);
    // Over max_body (1 KiB): passed through, each on its own, intact.
    let opted = Proxy::new(post_config(&origin, true)).start().await;
    let big: &'static str = Box::leak("x".repeat(2000).into_boxed_str());
    let answers = post_burst(&client, &opted.url("/graphql"), 10, big, JSON).await;
    assert_every_answer(&answers, 200, big);
    assert_eq!(origin.hits("/graphql"), 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_answer_is_stored_only_when_the_route_and_the_origin_allow_it() {
    let origin = Origin::new()
        .route_method(
            http::Method::POST,
            "/search",
            Reply::echo_body().header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let client = Client::new();
    let config = Config::new().route(
        Route::new("api", origin.url())
            .coalesce("post", "{ max_body: 1KiB }")
            .cache("post", "true"),
    );
    let proxy = Proxy::new(config).start().await;
    let url = proxy.url("/search");
    post_burst(&client, &url, 1, "{q}", JSON).await;
    let again = post_burst(&client, &url, 1, "{q}", JSON).await;
    assert_eq!(again[0].text(), "{q}");
    assert!(
        again[0].cache_status().is_hit(),
        "{}",
        again[0].cache_status()
    );
    // Another body is another key; a GET of the URI never gets a POST's
    // answer.
    let other = post_burst(&client, &url, 1, "{r}", JSON).await;
    assert_eq!(other[0].text(), "{r}");
    let get = client.get(&url).await;
    assert_ne!(get.text(), "{q}");
    // {q} once, {r} once, and the GET.
    assert_eq!(origin.hits("/search"), 3);
    // Without cache.post the same answer is not stored.
    let plain = Proxy::new(post_config(&origin, true)).start().await;
    post_burst(&client, &plain.url("/search"), 1, "{q}", JSON).await;
    post_burst(&client, &plain.url("/search"), 1, "{q}", JSON).await;
    assert_eq!(origin.hits("/search"), 5);
}

/// Two users whose credential is a cookie nobody named in `identity` send
/// the same GraphQL body at once. Whatever the answer says (private,
/// no-store, a Set-Cookie, nothing at all), neither gets the other's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_posts_of_two_cookie_users_never_share_an_answer() {
    const ALICE: &[(&str, &str)] = &[
        ("content-type", "application/json"),
        ("cookie", "session=alice"),
    ];
    const BOB: &[(&str, &str)] = &[
        ("content-type", "application/json"),
        ("cookie", "session=bob"),
    ];
    let answer = |headers: &[(&str, &str)]| {
        let mut reply = Reply::echo_header("for ", "cookie").delay(ms(400));
        for (n, v) in headers {
            reply = reply.header(n, v);
        }
        reply
    };
    let origin = Origin::new()
        .route_method(http::Method::POST, "/none", answer(&[]))
        .route_method(
            http::Method::POST,
            "/private",
            answer(&[("cache-control", "private, max-age=60")]),
        )
        .route_method(
            http::Method::POST,
            "/no-store",
            answer(&[("cache-control", "no-store")]),
        )
        .route_method(
            http::Method::POST,
            "/set-cookie",
            answer(&[("set-cookie", "csrf=1")]),
        )
        .start()
        .await;
    let proxy = Proxy::new(post_config(&origin, true)).start().await;
    let client = Client::new();
    for path in ["/none", "/private", "/no-store", "/set-cookie"] {
        let url = proxy.url(path);
        let (alice, bob) = tokio::join!(
            post_burst(&client, &url, 5, "{\"query\":\"{ me }\"}", ALICE),
            post_burst(&client, &url, 5, "{\"query\":\"{ me }\"}", BOB),
        );
        assert_every_answer(&alice, 200, "for session=alice");
        assert_every_answer(&bob, 200, "for session=bob");
        // No user's cookie reaches another through a shared answer.
        for a in alice.iter().chain(&bob) {
            let cookie = a.header("set-cookie");
            assert!(
                cookie.is_none() || cookie == Some("csrf=1"),
                "{path}: {cookie:?}"
            );
        }
        let hits = origin.hits(path);
        if path == "/none" {
            // One caller's identical POSTs still share: one each.
            assert_eq!(hits, 2, "{path}: {:#?}", tally(&alice));
        } else {
            // The caller's own answer: every waiter fetched alone.
            assert_eq!(hits, 10, "{path}: {:#?}", tally(&alice));
        }
    }
}

/// A GraphQL mutation is a write: identical ones of one caller each reach
/// the origin, while the same caller's identical queries still share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_graphql_mutations_each_reach_the_origin() {
    let origin = Origin::new()
        .route_method(
            http::Method::POST,
            "/graphql",
            Reply::echo_body().delay(ms(400)),
        )
        .start()
        .await;
    let proxy = Proxy::new(post_config(&origin, true)).start().await;
    let client = Client::new();
    let url = proxy.url("/graphql");
    const MUTATION: &str = "{\"query\":\"mutation { like(post: 1) }\"}";
    const QUERY: &str = "{\"query\":\"{ likes(post: 1) }\"}";
    let (writes, reads) = tokio::join!(
        post_burst(&client, &url, 6, MUTATION, JSON),
        post_burst(&client, &url, 6, QUERY, JSON),
    );
    assert_every_answer(&writes, 200, MUTATION);
    assert_every_answer(&reads, 200, QUERY);
    // Six mutations, one query.
    assert_eq!(origin.hits("/graphql"), 7, "{:#?}", tally(&writes));
}

/// The write check reads the parsed operation, and a body corral cannot
/// read is never coalesced: a mutation spelled with JSON escapes, an
/// Apollo persisted query sent by hash alone, and a gzip-encoded
/// mutation each reach the origin once per request sent, beside the
/// same caller's identical reads, which still share one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_or_disguised_graphql_writes_are_never_coalesced() {
    let mut origin = Origin::new();
    for path in ["/escaped", "/persisted", "/gzipped", "/read"] {
        origin = origin.route_method(http::Method::POST, path, Reply::echo_body().delay(ms(400)));
    }
    let origin = origin.start().await;
    let proxy = Proxy::new(post_config(&origin, true)).start().await;
    let client = Client::new();
    const ESCAPED: &str = r#"{"query":"\u006dutation { like(post: 1) }"}"#;
    const PERSISTED: &str = r#"{"extensions":{"persistedQuery":{"version":1,"sha256Hash":"ecf4edb46db40b5132295c0291d62fb65d6759a9eedfa4d5d612dd5ec54a6b38"}}}"#;
    const READ: &str = r#"{"query":"{ likes(post: 1) }"}"#;
    let gzipped = {
        use std::io::Write;
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        enc.write_all(br#"{"query":"mutation { like(post: 1) }"}"#)
            .expect("gzip");
        bytes::Bytes::from(enc.finish().expect("gzip"))
    };
    let gzip_url = proxy.url("/gzipped");
    let gzip_burst = futures_util::future::join_all((0..6).map(|_| {
        client.send(
            http::Method::POST,
            &gzip_url,
            &[
                ("content-type", "application/json"),
                ("content-encoding", "gzip"),
            ],
            Some(gzipped.clone()),
        )
    }));
    let urls = ["/escaped", "/persisted", "/read"].map(|p| proxy.url(p));
    let (escaped, persisted, gzip, reads) = tokio::join!(
        post_burst(&client, &urls[0], 6, ESCAPED, JSON),
        post_burst(&client, &urls[1], 6, PERSISTED, JSON),
        gzip_burst,
        post_burst(&client, &urls[2], 6, READ, JSON),
    );
    assert_every_answer(&escaped, 200, ESCAPED);
    assert_every_answer(&persisted, 200, PERSISTED);
    assert_every_answer(&reads, 200, READ);
    assert!(gzip.iter().all(|a| a.status == 200 && a.body == gzipped));
    for path in ["/escaped", "/persisted", "/gzipped"] {
        assert_eq!(
            origin.hits(path),
            6,
            "{path}: one origin request per request"
        );
    }
    assert_eq!(origin.hits("/read"), 1, "{:#?}", tally(&reads));
}

/// 63 of a declared 64 KiB, then nothing: a body that stalls.
fn stalled_post() -> Vec<u8> {
    let mut req =
        b"POST /q HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\nContent-Length: 65536\r\n\r\n"
            .to_vec();
    req.extend(std::iter::repeat_n(b'x', 63 * 1024));
    req
}

/// Stalled POST bodies have their own budget (`cache.post_memory`): however
/// many a client holds open, every route's fills are still stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_post_bodies_never_starve_the_fills_of_other_requests() {
    let big: &'static str = Box::leak("b".repeat(32 * 1024).into_boxed_str());
    let origin = Origin::new()
        .route_method(http::Method::POST, "/q", Reply::ok("q"))
        .route("/big", Reply::ok(big).header("cache-control", "max-age=60"))
        .start()
        .await;
    let config = Config::new()
        .cache("max_object_size", "1MiB")
        .cache("fill_memory", "1MiB")
        .route(
            Route::new("api", origin.url())
                .coalesce("post", "{ max_body: 64KiB, read_timeout: 30s }"),
        );
    let proxy = Proxy::new(config).start().await;
    // The POST budget (a sixteenth of fill_memory: 64 KiB) holds the first
    // body; the others then pass through unbuffered. Without a budget of
    // their own the bodies would take 1.2 MiB of the fills' 1 MiB.
    let mut held = vec![send_and_hold(proxy.addr(), &stalled_post()).await];
    corral_tests::eventually(DEADLINE, "the first stalled body is held", || async {
        scrape(&proxy).await.value("corral_post_buffer_bytes", &[]) == Some(63.0 * 1024.0)
    })
    .await;
    for _ in 1..20 {
        held.push(send_and_hold(proxy.addr(), &stalled_post()).await);
    }
    let client = Client::new();
    let first = client.get(&proxy.url("/big")).await;
    assert_eq!(first.text().len(), big.len());
    assert!(
        first.cache_status().to_string().contains("stored"),
        "{}",
        first.cache_status()
    );
    assert!(client.get(&proxy.url("/big")).await.cache_status().is_hit());
    assert_eq!(origin.hits("/big"), 1);
    drop(held);
}

/// A coalesced POST's body must arrive within `coalesce.post.read_timeout`
/// (5 s by default, well below `timeouts.total`): one that stalls is a 408
/// and gives its memory back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_post_body_is_a_408_at_its_read_timeout() {
    let origin = Origin::new()
        .route_method(http::Method::POST, "/q", Reply::ok("q"))
        .start()
        .await;
    let config = Config::new().route(
        Route::new("api", origin.url()).coalesce("post", "{ max_body: 64KiB, read_timeout: 1s }"),
    );
    let proxy = Proxy::new(config).start().await;
    let answer = corral_tests::exchange_full(proxy.addr(), &stalled_post(), DEADLINE).await;
    assert_eq!(answer.status, 408, "{}", answer.head);
    assert!(
        answer
            .header("cache-status")
            .is_some_and(|s| s.contains("detail=request-body")),
        "{}",
        answer.head
    );
    assert_eq!(origin.hits("/q"), 0);
}
