//! When the origin fails, corral gets quieter, not louder: a failing key is
//! left alone for a back-off that grows while failures continue (shared by
//! every instance through Redis), a route whose fetches mostly fail opens
//! its circuit, and the copy Redis holds answers stale-if-error on an
//! instance that has none of its own.

use std::time::Duration;

use corral_tests::lifecycle::{Json, lines_with_message, occurrences, scrape};
use corral_tests::{Client, Config, DEADLINE, Origin, OriginMode, Proxy, Redis, Reply, Route};
use futures_util::future::join_all;
use tokio::time::Instant;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn shared(origin_url: &str, redis: &Redis) -> Config {
    Config::new()
        .route(Route::new("api", origin_url))
        .redis(&redis.url())
        .redis_field("op_timeout", "250ms")
}

/// Sends `n` GETs of `url` one after another over `within`, evenly spaced.
async fn paced(client: &Client, url: &str, n: u32, within: Duration) -> Vec<corral_tests::Answer> {
    let start = Instant::now();
    let mut answers = Vec::new();
    for i in 0..n {
        tokio::time::sleep_until(start + within * i / n).await;
        answers.push(client.get(url).await);
    }
    answers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_refresh_inside_stale_while_revalidate_backs_off() {
    let origin = Origin::new()
        .route(
            "/swr",
            Reply::ok("kept").header("cache-control", "max-age=1, stale-while-revalidate=30"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url()))
        .with_test_clock()
        .start()
        .await;
    let client = Client::new();
    let url = proxy.url("/swr");
    assert_eq!(client.get(&url).await.text(), "kept");
    origin.set_mode(OriginMode::InternalError);
    // Into the stale-while-revalidate window.
    proxy.advance_clock(ms(1100)).await;

    let before = origin.hits("/swr");
    let answers = paced(&client, &url, 200, Duration::from_secs(2)).await;
    assert!(
        answers
            .iter()
            .all(|a| a.status == 200 && a.text() == "kept")
    );
    let asked = origin.hits("/swr") - before;
    // The first failure is retried by the next request; the second backs
    // the key off for a second, the third for two: two seconds of requests
    // reach the origin at most three times (574c533: 73-77).
    assert!(
        (1..=3).contains(&asked),
        "{asked} refreshes reached the failing origin in 2 s"
    );
    let backed_off = answers
        .iter()
        .filter(|a| a.cache_status().detail() == Some("backoff"))
        .count();
    assert!(backed_off >= 150, "{backed_off} answers said backoff");
    let metrics = scrape(&proxy).await;
    assert!(metrics.sum("corral_origin_skipped_total", &[("reason", "backoff")]) >= 150.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_key_reaches_the_failing_origin_once_per_back_off_across_instances() {
    const INSTANCES: usize = 3;
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route(
            "/k",
            Reply::ok("fine").header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let proxies = Proxy::new(shared(&origin.url(), &redis))
        .instances(INSTANCES)
        .start_all()
        .await;
    origin.set_mode(OriginMode::InternalError);
    // One caller per instance: the failures of one caller alone never back
    // a key off for the others (hostile_twins.rs), those of several do.
    let clients: Vec<Client> = (0..INSTANCES as u8)
        .map(|i| Client::from_address(std::net::Ipv4Addr::new(127, 0, 0, 11 + i)))
        .collect();
    // 2.5 s of requests on every instance at once, a cold key, the origin
    // down: one caller's failure retried, the second caller's starts a
    // back-off of about 1 s, then 2 s (the count of failures, and whose it
    // was, is shared through Redis): at most 5 origin requests in all,
    // however many instances ask; one more when two instances read the
    // count before either wrote it.
    let started = Instant::now();
    let urls: Vec<String> = proxies.iter().map(|p| p.url("/k")).collect();
    let answers = join_all(
        urls.iter()
            .zip(&clients)
            .map(|(url, client)| paced(client, url, 50, ms(2500))),
    )
    .await;
    let elapsed = started.elapsed();
    let asked = origin.hits("/k");
    assert!(
        (1..=6).contains(&asked),
        "{asked} requests reached the failing origin from {INSTANCES} instances in {elapsed:?}"
    );
    for a in answers.iter().flatten() {
        assert!(
            a.status == 500 || (a.status == 503 && a.cache_status().detail() == Some("backoff")),
            "{} {}",
            a.status,
            a.cache_status()
        );
    }
    // Errors are counted as errors, shared or not.
    let metrics = scrape(&proxies[0]).await;
    assert!(
        metrics.sum("corral_requests_total", &[("cache", "error")]) >= 40.0,
        "{}",
        metrics.text()
    );
    assert_eq!(
        metrics.sum("corral_requests_total", &[("cache", "pass")]),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_without_a_copy_serves_the_redis_copy_when_the_origin_fails() {
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route(
            "/e",
            Reply::ok("from redis").header("cache-control", "max-age=1, stale-if-error=60"),
        )
        .start()
        .await;
    let proxies = Proxy::new(shared(&origin.url(), &redis))
        .instances(2)
        .with_test_clock()
        .start_all()
        .await;
    let client = Client::new();
    assert_eq!(client.get(&proxies[0].url("/e")).await.text(), "from redis");
    origin.set_mode(OriginMode::InternalError);
    for proxy in &proxies {
        proxy.advance_clock(ms(1100)).await;
    }

    // Instance B never held it; the origin fails; Redis has the copy.
    let b = client.get(&proxies[1].url("/e")).await;
    assert_eq!(b.status, 200, "{}", b.cache_status());
    assert_eq!(b.text(), "from redis");
    assert_eq!(b.cache_status().fwd(), Some("stale"));
    assert_eq!(b.cache_status().detail(), Some("stale-if-error"));
    let metrics = scrape(&proxies[1]).await;
    assert_eq!(
        metrics.sum("corral_stale_answers_total", &[("reason", "error")]),
        1.0
    );
    assert_eq!(origin.hits("/e"), 2, "one fill, one failed fetch");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_copy_from_redis_is_labelled_stale_and_refreshed_once() {
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route(
            "/r",
            Reply::ok("v1").header("cache-control", "max-age=1, stale-while-revalidate=30"),
        )
        .start()
        .await;
    let proxies = Proxy::new(shared(&origin.url(), &redis))
        .instances(2)
        .with_test_clock()
        .start_all()
        .await;
    let client = Client::new();
    assert_eq!(client.get(&proxies[0].url("/r")).await.text(), "v1");
    origin.set_route("/r", Reply::ok("v2").header("cache-control", "max-age=60"));
    for proxy in &proxies {
        proxy.advance_clock(ms(1100)).await;
    }

    let b = client.get(&proxies[1].url("/r")).await;
    assert_eq!(b.text(), "v1");
    assert_eq!(
        b.cache_status().fwd(),
        Some("stale"),
        "{}",
        b.cache_status()
    );
    assert_eq!(b.cache_status().detail(), Some("stale-while-revalidate"));
    let metrics = scrape(&proxies[1]).await;
    assert_eq!(
        metrics.sum("corral_stale_answers_total", &[("reason", "revalidate")]),
        1.0
    );
    // The refresh it started reaches the origin once and stores v2.
    origin.wait_hits("/r", 2, DEADLINE).await;
    let deadline = Instant::now() + DEADLINE;
    loop {
        let again = client.get(&proxies[1].url("/r")).await;
        if again.text() == "v2" {
            break;
        }
        assert!(Instant::now() < deadline, "the refresh never landed");
        tokio::time::sleep(ms(20)).await;
    }
    assert_eq!(origin.hits("/r"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_whose_fetches_mostly_fail_opens_its_circuit_then_probes() {
    let origin = Origin::new()
        .route("/c", Reply::ok("up").header("cache-control", "max-age=60"))
        .start()
        .await;
    let route = Route::new("api", origin.url()).cache("hit_for_pass", "0s");
    let config = Config::new().route(route).to_yaml().replace(
        "    upstream:",
        "    circuit: { error_rate: 50%, min_fetches: 5, window: 10s, open_for: 1s }\n    upstream:",
    );
    let proxy = Proxy::new(config).start().await;
    // The origin is down behind its own gateway: 503s, seen by five
    // callers. (A 500 shows a live application and never opens it; one
    // caller's failures count once: see hostile_twins.rs.)
    origin.set_mode(OriginMode::Unavailable);
    let client = Client::new();
    // Distinct keys: no per-key back-off in the way, only the route's rate.
    for i in 0..5u8 {
        let caller = Client::from_address(std::net::Ipv4Addr::new(127, 0, 0, 20 + i));
        let a = caller.get(&proxy.url(&format!("/c?k={i}"))).await;
        assert_eq!(a.status, 503);
        assert_eq!(a.cache_status().detail(), None, "the origin's own 503");
    }
    for i in 5..25 {
        let a = client.get(&proxy.url(&format!("/c?k={i}"))).await;
        assert_eq!(a.status, 503);
        assert_eq!(a.cache_status().detail(), Some("circuit-open"));
        assert_eq!(
            a.header("proxy-status"),
            Some("corral; error=destination_unavailable; details=\"circuit-open\"")
        );
    }
    assert_eq!(origin.hits("/c"), 5, "the open circuit sends nothing");
    let metrics = scrape(&proxy).await;
    assert_eq!(
        metrics.value("corral_origin_circuit_open", &[("route", "api")]),
        Some(1.0)
    );

    // The origin recovers; after open_for one probe goes, and closes it.
    origin.set_mode(OriginMode::Script);
    let deadline = Instant::now() + DEADLINE;
    let mut i = 100;
    loop {
        i += 1;
        let a = client.get(&proxy.url(&format!("/c?k={i}"))).await;
        if a.status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "no probe ever went");
        tokio::time::sleep(ms(50)).await;
    }
    for j in 0..5 {
        let a = client.get(&proxy.url(&format!("/c?k=after{j}"))).await;
        assert_eq!(a.text(), "up");
    }
}

/// The circuit of `route_with`'s tests: five fetches a window decide.
const HANG_CIRCUIT: &str = "{ error_rate: 50%, min_fetches: 5, window: 10s, open_for: 60s }";

/// A route whose fetches count as hung after 300 ms (when its origin's
/// answers take a few milliseconds) and time out after 30 s.
fn hang_config(origin_url: &str) -> String {
    Config::new()
        .route(Route::new("api", origin_url).cache("hit_for_pass", "0s"))
        .to_yaml()
        .replace(
            "    upstream:",
            &format!(
                "    circuit: {HANG_CIRCUIT}\n    timeouts: {{ stale_after: 300ms, response_headers: 30s }}\n    upstream:"
            ),
        )
}

async fn circuit_open(proxy: &corral_tests::RunningProxy) -> bool {
    scrape(proxy)
        .await
        .value("corral_origin_circuit_open", &[("route", "api")])
        == Some(1.0)
}

/// True when the route's fetches counted as hung are `n`.
async fn hung_fetches(proxy: &corral_tests::RunningProxy, n: f64) -> bool {
    scrape(proxy)
        .await
        .value("corral_origin_hung_fetches_total", &[("route", "api")])
        == Some(n)
}

/// Callers 127.0.0.`first`.. each asking a key of their own, left waiting.
fn hanging_callers(
    proxy: &corral_tests::RunningProxy,
    first: u8,
    n: u8,
) -> Vec<tokio::task::JoinHandle<corral_tests::Answer>> {
    (0..n)
        .map(|i| {
            let caller = Client::from_address(std::net::Ipv4Addr::new(127, 0, 0, first + i));
            let url = proxy.url(&format!("/h?k={first}-{i}"));
            tokio::spawn(async move { caller.get(&url).await })
        })
        .collect()
}

/// An origin that takes connections and never answers opens the route's
/// circuit once five callers' fetches have waited twice its usual answer
/// time (at least `stale_after`), long before `response_headers` (30 s)
/// would count them: the next key gets a quick 503 instead of a 30 s wait,
/// and the origin no request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetches_an_origin_never_answers_open_the_circuit_before_they_time_out() {
    let origin = Origin::new()
        .route("/h", Reply::ok("up").header("cache-control", "max-age=60"))
        .start()
        .await;
    let proxy = Proxy::new(hang_config(&origin.url())).start().await;
    let client = Client::new();
    assert_eq!(client.get(&proxy.url("/h?k=warm")).await.text(), "up");
    origin.set_route("/h", Reply::ok("late").delay(Duration::from_secs(60)));

    let started = Instant::now();
    let hung = hanging_callers(&proxy, 30, 5);
    corral_tests::eventually(Duration::from_secs(5), "the circuit opens", || {
        circuit_open(&proxy)
    })
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "opened by the hangs, not by timeouts"
    );
    let next = Client::from_address(std::net::Ipv4Addr::new(127, 0, 0, 40))
        .get(&proxy.url("/h?k=next"))
        .await;
    assert_eq!(next.status, 503);
    assert_eq!(next.cache_status().detail(), Some("circuit-open"));
    assert_eq!(
        origin.hits("/h"),
        6,
        "the warm-up and the five hung fetches"
    );
    corral_tests::eventually(DEADLINE, "the five fetches count as hung", || {
        hung_fetches(&proxy, 5.0)
    })
    .await;
    let opened = || lines_with_message(&proxy.log(), "origin circuit opened: most fetches fail");
    corral_tests::eventually(DEADLINE, "the opening is logged", || {
        let n = opened().len();
        async move { n > 0 }
    })
    .await;
    let lines = opened();
    assert_eq!(lines.len(), 1, "{lines:?}");
    // The warm-up's answer and four hung fetches: 80% of five opened it,
    // and the fifth found it open.
    assert_eq!(
        lines[0].get("hung").and_then(Json::as_f64),
        Some(4.0),
        "{:?}",
        lines[0]
    );
    for h in hung {
        h.abort();
    }
}

/// The twin on the honest side: an origin that is slow (1 s a head, when
/// `stale_after` is 300 ms) but answers is never taken for a hung one. Its
/// fetches wait twice its slowest answer before they could count, and each
/// is answered: the circuit stays closed and every caller gets the page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_origin_that_answers_never_opens_the_circuit() {
    let origin = Origin::new()
        .route(
            "/h",
            Reply::ok("slow")
                .header("cache-control", "max-age=60")
                .delay(Duration::from_secs(1)),
        )
        .start()
        .await;
    let proxy = Proxy::new(hang_config(&origin.url())).start().await;
    assert_eq!(
        Client::new().get(&proxy.url("/h?k=warm")).await.text(),
        "slow"
    );
    for round in 0..2u8 {
        let answers = join_all(hanging_callers(&proxy, 30 + round * 10, 6)).await;
        for a in answers {
            let a = a.expect("a caller's task");
            assert_eq!((a.status.as_u16(), a.text()), (200, "slow".to_owned()));
        }
        assert!(!circuit_open(&proxy).await, "round {round}");
    }
    assert_eq!(origin.hits("/h"), 13);
    assert!(
        lines_with_message(&proxy.log(), "origin circuit opened: most fetches fail").is_empty()
    );
}

/// The hostile twin: one client whose requests make the application hang
/// (a URL it chokes on) counts once a window, however many it sends, so it
/// cannot open the circuit every caller shares: the victim's fetch still
/// reaches the origin and gets its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_clients_hung_requests_never_open_the_circuit() {
    let origin = Origin::new()
        .route(
            "/page",
            Reply::ok("page").header("cache-control", "max-age=60"),
        )
        .route("/h", Reply::ok("up").header("cache-control", "max-age=60"))
        .start()
        .await;
    let proxy = Proxy::new(hang_config(&origin.url())).start().await;
    let attacker = Client::from_address(std::net::Ipv4Addr::new(127, 0, 0, 66));
    assert_eq!(attacker.get(&proxy.url("/h?k=warm")).await.text(), "up");
    origin.set_route("/h", Reply::ok("late").delay(Duration::from_secs(60)));
    let hung: Vec<_> = (0..20)
        .map(|i| {
            let (attacker, url) = (attacker.clone(), proxy.url(&format!("/h?k=a{i}")));
            tokio::spawn(async move { attacker.get(&url).await })
        })
        .collect();
    corral_tests::eventually(DEADLINE, "the attacker's fetches reach the origin", || {
        let n = origin.hits("/h");
        async move { n == 21 }
    })
    .await;
    corral_tests::eventually(DEADLINE, "the 20 fetches count as hung", || {
        hung_fetches(&proxy, 20.0)
    })
    .await;
    assert!(!circuit_open(&proxy).await, "one caller's hangs count once");
    let victim = Client::from_address(std::net::Ipv4Addr::new(127, 0, 0, 77))
        .get(&proxy.url("/page"))
        .await;
    assert_eq!(
        (victim.status.as_u16(), victim.text()),
        (200, "page".to_owned())
    );
    assert_eq!(origin.hits("/page"), 1);
    for h in hung {
        h.abort();
    }
}

/// An origin outage under load writes a handful of lines, not one per
/// request: the first failure of each kind (route and detail) is logged
/// at once, the rest as summary lines whose `repeated` counts sum to every
/// request that failed. Every circuit line names the route and its
/// upstream; the line that closes it says how long it was open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_outage_writes_a_few_counted_lines_naming_the_route_and_upstream() {
    const REQUESTS: u64 = 300;
    let mut origin = Origin::new()
        .route("/o", Reply::ok("up").header("cache-control", "max-age=60"))
        .start()
        .await;
    let addr = origin.addr();
    let route = Route::new("api", origin.url()).cache("hit_for_pass", "0s");
    let config = Config::new().route(route).to_yaml().replace(
        "    upstream:",
        "    circuit: { error_rate: 50%, min_fetches: 5, window: 10s, open_for: 1s }\n    upstream:",
    );
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();
    origin.stop().await;
    // Distinct keys, so each request is a fill of its own.
    for i in 0..REQUESTS {
        let a = client.get(&proxy.url(&format!("/o?k={i}"))).await;
        assert!(a.status.is_server_error(), "{a:?}");
    }
    // Every failure is accounted for once the summaries are written.
    let upstream = addr.to_string();
    let deadline = Instant::now() + Duration::from_secs(20);
    let fill_failed = loop {
        let lines = lines_with_message(&proxy.log(), "fill failed");
        if occurrences(&lines) >= REQUESTS {
            break lines;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {REQUESTS} failures logged\n{}",
            occurrences(&lines),
            proxy.report()
        );
        tokio::time::sleep(ms(100)).await;
    };
    assert_eq!(occurrences(&fill_failed), REQUESTS, "{}", proxy.report());
    // One line at once per kind (the origin's refusals, then the open
    // circuit's), and a summary for each: not one per request.
    assert!(fill_failed.len() <= 6, "{}", proxy.report());
    let text = |f: &std::collections::BTreeMap<String, Json>, k: &str| {
        f.get(k).and_then(Json::as_str).map(str::to_owned)
    };
    for line in &fill_failed {
        assert_eq!(text(line, "route").as_deref(), Some("api"), "{line:?}");
        assert_eq!(text(line, "upstream"), Some(upstream.clone()), "{line:?}");
    }
    // The origin was asked (and failed) only until the circuit opened,
    // plus its probes: the rest were the circuit's.
    let metrics = scrape(&proxy).await;
    let skipped = metrics.sum("corral_origin_skipped_total", &[("reason", "circuit-open")]) as u64;
    assert!(skipped >= REQUESTS - 20, "{skipped} skipped");
    let upstream_failed = lines_with_message(&proxy.log(), "upstream failed");
    assert_eq!(occurrences(&upstream_failed), REQUESTS - skipped);
    assert!(upstream_failed.len() <= 4, "{}", proxy.report());
    let opened = lines_with_message(&proxy.log(), "origin circuit opened: most fetches fail");
    assert_eq!(opened.len(), 1, "{}", proxy.report());
    assert_eq!(text(&opened[0], "route").as_deref(), Some("api"));
    assert_eq!(text(&opened[0], "upstream"), Some(upstream.clone()));

    // The origin is back: a probe closes the circuit, and its line says so.
    let _origin = Origin::new()
        .route("/o", Reply::ok("up").header("cache-control", "max-age=60"))
        .start_at(addr)
        .await;
    let deadline = Instant::now() + DEADLINE;
    let mut i = 0;
    while client.get(&proxy.url(&format!("/o?back={i}"))).await.status != 200 {
        assert!(Instant::now() < deadline, "the circuit never closed");
        i += 1;
        tokio::time::sleep(ms(50)).await;
    }
    let closed = loop {
        let lines = lines_with_message(&proxy.log(), "origin circuit closed: the probe succeeded");
        if !lines.is_empty() {
            break lines;
        }
        assert!(Instant::now() < deadline, "{}", proxy.report());
        tokio::time::sleep(ms(20)).await;
    };
    assert_eq!(text(&closed[0], "route").as_deref(), Some("api"));
    assert_eq!(text(&closed[0], "upstream"), Some(upstream));
    assert!(closed[0].get("open_s").and_then(Json::as_f64).is_some());
    assert!(
        closed[0]
            .get("failed_probes")
            .and_then(Json::as_f64)
            .is_some()
    );
}
