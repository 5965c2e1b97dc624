//! Operating corral: the metrics text, the access log, readiness, the
//! SIGTERM drain and hot reload, observed the way an operator observes them
//! (admin endpoints, the log, signals, the config file).

use std::time::{Duration, Instant};

use http::Method;

use corral_tests::lifecycle::{
    self, access_lines, admin_get, current_config, log_lines_with, replace_config, scrape,
    send_signal, wait_for_access_lines, wait_for_admin_status, wait_for_exit, wait_for_log,
    wait_for_log_lines,
};
use corral_tests::{
    Client, Config, DEADLINE, Exit, Origin, Proxy, Reply, Route, Signal, eventually,
};

const REQUESTS: &str = "corral_requests_total";
const FETCHES: &str = "corral_origin_fetches_total";
const RELOADED: &str = "configuration reloaded";
const REFUSED: &str = "configuration reload refused";

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_a_known_request_sequence_by_route_method_and_cache_result() {
    let origin = Origin::new()
        .route("/a", Reply::ok("a").header("cache-control", "max-age=60"))
        .route(
            "/private",
            Reply::ok("mine").header("cache-control", "private, max-age=60"),
        )
        .route(
            "/burst",
            Reply::ok("the one answer")
                .header("cache-control", "max-age=60")
                .delay(ms(200)),
        )
        .route(
            "/warm/up",
            Reply::ok("warm")
                .header("cache-control", "no-store")
                .delay(ms(300)),
        )
        .start()
        .await;
    // The warm-up has a route of its own so that its requests stay out of
    // the counts asserted for `api`.
    let config =
        Config::single(origin.url()).route(Route::new("warm", origin.url()).path_prefix("/warm"));
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();

    let miss = client.get(&proxy.url("/a")).await;
    assert!(
        miss.cache_status().stored() && !miss.cache_status().is_hit(),
        "{miss:?}"
    );
    for _ in 0..2 {
        let hit = client.get(&proxy.url("/a")).await;
        assert!(hit.cache_status().is_hit(), "{hit:?}");
    }
    let stored = scrape(&proxy).await;
    let entries = stored.value("corral_l1_entries", &[]);
    assert!(entries >= Some(1.0), "{}", stored.text());
    let bytes = stored.value("corral_l1_bytes", &[]);
    assert!(bytes > Some(0.0), "{}", stored.text());

    let post = client
        .send(Method::POST, &proxy.url("/a"), &[], Some("x".into()))
        .await;
    assert_eq!(post.status, 200, "{post:?}");
    let private = client.get(&proxy.url("/private")).await;
    assert_eq!(private.status, 200, "{private:?}");
    assert!(!private.cache_status().stored(), "{private:?}");

    let m = scrape(&proxy).await;
    let text = m.text();
    let api = |method: &'static str, cache: &'static str| {
        m.value(
            REQUESTS,
            &[("route", "api"), ("method", method), ("cache", cache)],
        )
    };
    assert_eq!(api("GET", "miss"), Some(1.0), "{text}");
    assert_eq!(api("GET", "hit"), Some(2.0), "{text}");
    assert_eq!(api("POST", "pass"), Some(1.0), "{text}");
    assert_eq!(api("GET", "pass"), Some(1.0), "{text}");
    assert_eq!(m.sum(REQUESTS, &[("route", "api")]), 5.0, "{text}");
    let origin_saw = origin.hits("/a") + origin.hits("/private");
    assert_eq!(origin_saw, 3, "GET /a once, POST /a, GET /private");
    assert_eq!(
        m.value(FETCHES, &[("route", "api"), ("status", "200")]),
        Some(origin_saw as f64),
        "{text}"
    );
    assert_eq!(m.sum(FETCHES, &[("route", "api")]), 3.0, "{text}");
    assert_eq!(
        m.value(
            "corral_origin_fetch_duration_seconds_count",
            &[("route", "api")]
        ),
        Some(3.0),
        "{text}"
    );
    assert!(
        !m.matching(
            "corral_origin_fetch_duration_seconds_bucket",
            &[("route", "api"), ("le", "+Inf")]
        )
        .is_empty(),
        "{text}"
    );
    assert_eq!(
        m.value("corral_flights_in_progress", &[]),
        Some(0.0),
        "{text}"
    );
    assert!(!m.has("corral_redis_connected"), "no Redis: {text}");

    // A cold key under a coalesced burst: one fetch, and the flight's
    // followers show up as the key's stampede count.
    client.warm(100, &proxy.url("/warm/up")).await;
    let answers = client.burst(100, &proxy.url("/burst"), &[]).await;
    assert!(
        answers
            .iter()
            .all(|a| a.status == 200 && a.text() == "the one answer"),
        "{answers:?}"
    );
    assert_eq!(origin.hits("/burst"), 1);

    let after = scrape(&proxy).await;
    let text = after.text();
    // The key's stampede count is on /stats; /metrics names no key.
    let key = "api GET 127.0.0.1/burst";
    assert!(!text.contains("/burst"), "a key as a label value: {text}");
    let stats = corral_tests::lifecycle::admin_get(&proxy, "/stats").await;
    let stats: serde_json::Value = serde_json::from_str(&stats.body).expect("JSON");
    let waiters = stats["flights"]["most_waited"]
        .as_array()
        .expect("most_waited")
        .iter()
        .find(|w| w["key"] == key)
        .and_then(|w| w["waiters"].as_f64());
    assert!(
        waiters >= Some(50.0),
        "most waiters of {key}: {waiters:?}\n{stats:#}"
    );
    assert_eq!(
        after.sum(REQUESTS, &[("route", "api"), ("method", "GET")]),
        104.0,
        "the burst adds exactly its 100 requests: {text}"
    );
    let api_after = |cache: &'static str| {
        after.sum(
            REQUESTS,
            &[("route", "api"), ("method", "GET"), ("cache", cache)],
        )
    };
    assert_eq!(api_after("miss"), 2.0, "one leader in the burst: {text}");
    assert_eq!(
        api_after("collapsed") + api_after("hit"),
        2.0 + 99.0,
        "the rest waited or hit: {text}"
    );
    assert_eq!(
        after.value(FETCHES, &[("route", "api"), ("status", "200")]),
        Some((origin_saw + origin.hits("/burst")) as f64),
        "{text}"
    );
    let flights = after.value("corral_flight_waiters_count", &[]);
    assert!(flights >= Some(1.0), "{text}");
    let followers = after.value("corral_flight_waiters_sum", &[]);
    assert!(followers >= waiters, "{text}");
    let entries = after.value("corral_l1_entries", &[]);
    assert!(entries >= Some(1.0), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_has_one_line_per_request_and_never_the_query_or_credentials() {
    const TOKEN: &str = "Q-SECRET-7f3a";
    const BEARER: &str = "AUTH-SECRET-91c2";
    const COOKIE: &str = "COOKIE-SECRET-55d0";
    let origin = Origin::new()
        .route("/a", Reply::ok("a").header("cache-control", "max-age=60"))
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    let with_token = proxy.url(&format!("/a?token={TOKEN}"));
    let bearer = format!("Bearer {BEARER}");
    let cookie = format!("session={COOKIE}");
    let credentials = [
        ("authorization", bearer.as_str()),
        ("cookie", cookie.as_str()),
    ];

    let started = std::time::Instant::now();
    let answers = [
        client.get(&with_token).await,
        client.get(&with_token).await,
        client.get_with(&proxy.url("/a"), &credentials).await,
        client
            .send(Method::POST, &with_token, &credentials, Some("x".into()))
            .await,
        client.get(&proxy.url("/missing")).await,
    ];
    // No request took corral longer than the client waited for all five.
    let waited_ms = started.elapsed().as_secs_f64() * 1000.0;
    let expected = [
        ("GET", "/a", 200, "miss"),
        ("GET", "/a", 200, "hit"),
        ("GET", "/a", 200, "miss"),
        ("POST", "/a", 200, "pass"),
        ("GET", "/missing", 404, "pass"),
    ];

    let lines = wait_for_access_lines(&proxy, expected.len(), DEADLINE).await;
    let report = || format!("{lines:#?}\n{}", proxy.report());
    assert_eq!(lines.len(), expected.len(), "{}", report());
    for ((line, answer), (method, path, status, cache)) in lines.iter().zip(&answers).zip(expected)
    {
        assert_eq!(answer.status, status, "{answer:?}");
        assert_eq!(line.route, "api", "{}", line.raw);
        assert_eq!(line.method, method, "{}", line.raw);
        assert_eq!(line.path, path, "{}", line.raw);
        assert_eq!(line.status, status, "{}", line.raw);
        assert_eq!(line.cache, cache, "{}", line.raw);
        assert_eq!(
            Some(line.cache_status.as_str()),
            answer.header("cache-status"),
            "{}",
            line.raw
        );
        assert!(
            (0.0..=waited_ms).contains(&line.ms),
            "{} (the client waited {waited_ms} ms)",
            line.raw
        );
        assert_eq!(line.peer, "127.0.0.1", "{}", line.raw);
    }
    // The secrets did reach the origin, so their absence from the log is
    // the proxy's doing.
    let seen = origin.requests("/a");
    assert_eq!(seen[0].query(), Some(format!("token={TOKEN}").as_str()));
    assert!(
        seen.iter()
            .any(|r| r.header("authorization") == Some(&bearer))
    );
    let log = proxy.log();
    for secret in [TOKEN, BEARER, COOKIE] {
        assert!(!log.contains(secret), "{secret} is logged:\n{log}");
    }
}

/// The origin is sent the id the answer echoes, exactly once: the one
/// corral made when the client sent none, or in place of what the client
/// sent that was not a short token (never beside it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_origin_gets_the_id_corral_made_in_place_of_the_clients() {
    let origin = Origin::new()
        .route(
            "/made",
            Reply::ok("m").header("cache-control", "max-age=60"),
        )
        .route("/bad", Reply::ok("b").header("cache-control", "max-age=60"))
        .route("/two", Reply::ok("t").header("cache-control", "max-age=60"))
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    let made = client.get(&proxy.url("/made")).await;
    let bad = client
        .get_with(&proxy.url("/bad"), &[("x-request-id", "two words")])
        .await;
    let two = client
        .get_with(
            &proxy.url("/two"),
            &[("x-request-id", "first"), ("x-request-id", "second")],
        )
        .await;
    for (path, answer) in [("/made", &made), ("/bad", &bad), ("/two", &two)] {
        let id = answer.header("x-request-id").expect("an id echoed");
        assert_eq!(id.len(), 20, "a made id on {path}: {id}");
        let seen = origin.requests(path);
        assert_eq!(seen.len(), 1, "{path}");
        assert_eq!(seen[0].header_all("x-request-id"), [id], "{path}");
    }
}

/// An origin's `Vary: X-Request-Id` compares the ids clients sent: two
/// callers with ids of their own never share an answer (the second is
/// asked of the origin with its own id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_varied_on_the_request_id_is_not_shared_between_clients_ids() {
    let origin = Origin::new()
        .route(
            "/v",
            Reply::ok("v")
                .header("cache-control", "max-age=60")
                .header("vary", "x-request-id"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    let url = proxy.url("/v");
    let alice = client.get_with(&url, &[("x-request-id", "alice-1")]).await;
    let bob = client.get_with(&url, &[("x-request-id", "bob-2")]).await;
    let alice_again = client.get_with(&url, &[("x-request-id", "alice-1")]).await;
    assert_eq!(alice.header("x-request-id"), Some("alice-1"));
    assert_eq!(bob.header("x-request-id"), Some("bob-2"));
    // The third was answered from the first's copy: the same id.
    let asked = origin.requests("/v");
    let seen: Vec<Vec<&str>> = asked.iter().map(|r| r.header_all("x-request-id")).collect();
    assert_eq!(seen, [["alice-1"], ["bob-2"]], "{}", proxy.report());
    assert_eq!(alice_again.header("x-request-id"), Some("alice-1"));
}

/// One request can be followed from the client to the origin and back:
/// its `X-Request-Id` (kept when it is a short token, made otherwise)
/// reaches the origin, comes back on the answer and is on its access line,
/// with the host, the bytes answered, and the upstream asked and how long
/// it took when one was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_access_line_names_host_bytes_upstream_and_the_request_id_the_origin_got() {
    let origin = Origin::new()
        .route(
            "/a",
            Reply::ok("hello")
                .header("cache-control", "max-age=60")
                // Echoed by the origin, stored with the answer: never
                // served to another caller.
                .header("x-request-id", "the-origin-echo"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    let url = proxy.url("/a?q=1");
    let answers = [
        // A miss with a good id: kept.
        client
            .get_with(&url, &[("x-request-id", "trace-7f3a.1")])
            .await,
        // A hit (written from the entry's head) without one: made.
        client.get(&url).await,
        // Ids that are not short tokens are replaced.
        client
            .get_with(&url, &[("x-request-id", "two words")])
            .await,
        client
            .get_with(&url, &[("x-request-id", &"a".repeat(129))])
            .await,
    ];
    let lines = wait_for_access_lines(&proxy, answers.len(), DEADLINE).await;
    let report = || format!("{lines:#?}\n{}", proxy.report());
    assert_eq!(lines.len(), answers.len(), "{}", report());
    for a in &answers {
        assert_eq!(a.headers.get_all("x-request-id").iter().count(), 1, "{a:?}");
    }
    let ids: Vec<&str> = answers
        .iter()
        .map(|a| a.header("x-request-id").expect("an id echoed"))
        .collect();
    assert_eq!(ids[0], "trace-7f3a.1");
    for id in &ids[1..] {
        assert_eq!(id.len(), 20, "a made id: {id}");
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
    }
    let mut unique = ids.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), ids.len(), "{ids:?}");
    for (line, id) in lines.iter().zip(&ids) {
        assert_eq!(line.request_id, *id, "{}", line.raw);
        assert_eq!(line.host, "127.0.0.1", "{}", line.raw);
        assert_eq!(line.bytes, Some(5), "{}", line.raw);
        assert!(!line.raw.contains("q=1"), "{}", line.raw);
    }
    // The miss asked the origin, which got the client's id.
    let seen = origin.requests("/a");
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].header_all("x-request-id"), ["trace-7f3a.1"]);
    let origin_addr = origin.addr().to_string();
    assert_eq!(lines[0].cache, "miss", "{}", report());
    assert_eq!(lines[0].upstream.as_deref(), Some(origin_addr.as_str()));
    let took = lines[0].upstream_ms.expect("upstream_ms on a miss");
    assert!(took >= 0.0 && took <= lines[0].ms, "{}", lines[0].raw);
    // The hits asked nobody.
    for line in &lines[1..] {
        assert_eq!(line.cache, "hit", "{}", line.raw);
        assert_eq!(line.upstream, None, "{}", line.raw);
        assert_eq!(line.upstream_ms, None, "{}", line.raw);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_without_losing_an_in_flight_request_and_exits_zero() {
    const DRAIN: Duration = Duration::from_secs(1);
    const IN_FLIGHT: usize = 5;
    let origin = Origin::new()
        .route("/slow", Reply::ok("slow body").delay(ms(1500)))
        .route("/fast", Reply::ok("fast body"))
        .start()
        .await;
    let config = Config::single(origin.url())
        .server("drain_period", "1s")
        .server("shutdown_grace", "5s");
    let mut proxy = Proxy::new(config).start().await;
    let client = Client::new();
    // Distinct keys, so that five requests reach the origin, not one flight.
    let in_flight: Vec<_> = (0..IN_FLIGHT)
        .map(|i| {
            let client = client.clone();
            let url = proxy.url(&format!("/slow?n={i}"));
            tokio::spawn(async move { client.try_send(Method::GET, &url, &[], None).await })
        })
        .collect();
    origin.wait_hits("/slow", IN_FLIGHT, DEADLINE).await;

    let signalled = Instant::now();
    send_signal(&proxy, Signal::Term);
    let lb = wait_for_admin_status(&proxy, "/lb-health", 503, DEADLINE).await;
    let left_lb_after = signalled.elapsed();
    assert_eq!(lb.body.trim(), "draining");
    let ready = admin_get(&proxy, "/readyz").await;
    assert_eq!(ready.status, 503, "{ready:?}");
    assert!(
        ready.body.contains("\"ready\":false") && ready.body.contains("\"draining\":true"),
        "{ready:?}"
    );
    // A new client on a new connection during the drain period is served.
    let newcomer = Client::new()
        .try_send(Method::GET, &proxy.url("/fast"), &[], None)
        .await;
    let newcomer_answered_after = signalled.elapsed();
    assert!(
        left_lb_after < DRAIN && newcomer_answered_after < DRAIN,
        "the checks must fall inside the drain period: /lb-health 503 after \
         {left_lb_after:?}, new request answered after {newcomer_answered_after:?}"
    );
    let newcomer = newcomer.unwrap_or_else(|e| panic!("GET /fast during the drain: {e:#}"));
    assert_eq!(
        (newcomer.status.as_u16(), newcomer.text().as_str()),
        (200, "fast body")
    );

    // After the drain period the listener closes while the slow requests
    // are still at the origin.
    wait_for_log(&proxy, "no longer accepting connections", DEADLINE).await;
    let addr = proxy.addr();
    eventually(DEADLINE, "new connections are refused", || async move {
        tokio::net::TcpStream::connect(addr).await.is_err()
    })
    .await;
    let answered_when_closed = origin.answered("/slow").len();
    assert!(
        answered_when_closed < IN_FLIGHT,
        "the listener closed only after every in-flight request was answered"
    );

    for (i, task) in in_flight.into_iter().enumerate() {
        let answer = task
            .await
            .expect("request task")
            .unwrap_or_else(|e| panic!("in-flight GET /slow?n={i} failed during the drain: {e:#}"));
        assert_eq!(answer.status, 200, "{answer:?}");
        assert_eq!(answer.text(), "slow body");
    }
    let exit = wait_for_exit(&mut proxy, DEADLINE).await;
    let stopped_after = signalled.elapsed();
    assert_eq!(exit, Exit::Code(0), "{}", proxy.report());
    assert!(
        stopped_after >= DRAIN,
        "stopped {stopped_after:?} after SIGTERM"
    );
    assert_eq!(origin.answered("/slow"), [200; IN_FLIGHT]);
    assert_eq!(origin.cancelled("/slow"), 0);

    let lines = access_lines(&proxy.log());
    assert_eq!(lines.len(), IN_FLIGHT + 1, "{lines:#?}");
    assert!(lines.iter().all(|l| l.status == 200), "{lines:#?}");
    for step in [
        "SIGTERM: draining",
        "all client connections drained",
        "corral stopped",
    ] {
        assert_eq!(
            log_lines_with(&proxy, step).len(),
            1,
            "{step}\n{}",
            proxy.report()
        );
    }
    assert!(log_lines_with(&proxy, "shutdown grace elapsed").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_stops_at_once_without_the_drain_period() {
    const DRAIN: Duration = Duration::from_secs(5);
    let origin = Origin::new().route("/a", Reply::ok("a")).start().await;
    let config = Config::single(origin.url()).server("drain_period", "5s");
    let mut proxy = Proxy::new(config).start().await;
    assert_eq!(Client::new().get(&proxy.url("/a")).await.status, 200);

    let signalled = Instant::now();
    send_signal(&proxy, Signal::Int);
    let exit = wait_for_exit(&mut proxy, DEADLINE).await;
    let stopped_after = signalled.elapsed();

    assert_eq!(exit, Exit::Code(0), "{}", proxy.report());
    assert!(
        stopped_after < DRAIN,
        "SIGINT took {stopped_after:?}, as long as the drain period"
    );
    assert!(log_lines_with(&proxy, "SIGTERM: draining").is_empty());
    assert_eq!(log_lines_with(&proxy, "corral stopped").len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_good_config_file_written_in_place_replaces_the_routes() {
    let one = Origin::new()
        .route("/who", Reply::ok("one").header("cache-control", "no-store"))
        .route(
            "/slow",
            Reply::ok("slow from one")
                .header("cache-control", "no-store")
                .delay(ms(2500)),
        )
        .start()
        .await;
    let two = Origin::new()
        .route("/who", Reply::ok("two").header("cache-control", "no-store"))
        .start()
        .await;
    let proxy = Proxy::new(Config::single(one.url())).start().await;
    let client = Client::new();
    assert_eq!(client.get(&proxy.url("/who")).await.text(), "one");
    // A request that is still at the old upstream when the routes change.
    let slow = {
        let client = client.clone();
        let url = proxy.url("/slow");
        tokio::spawn(async move { client.try_send(Method::GET, &url, &[], None).await })
    };
    one.wait_hits("/slow", 1, DEADLINE).await;

    let old = current_config(&proxy);
    assert!(old.contains("memory: 64MiB"), "{old}");
    let new = format!(
        "{}  - name: extra\n    match:\n      path_prefix: /extra\n    upstream: {}\n",
        old.replace(&one.url(), &two.url())
            .replace("memory: 64MiB", "memory: 32MiB"),
        two.url()
    );
    replace_config(&proxy, &new);

    let url = proxy.url("/who");
    let client_ref = &client;
    eventually(DEADLINE, "/who is answered by the second origin", || {
        let url = url.clone();
        async move { client_ref.get(&url).await.text() == "two" }
    })
    .await;
    assert!(
        !slow.is_finished(),
        "the slow request ended before the reload was seen; it proves nothing"
    );
    // Log lines reach stdout within a few milliseconds, not at once.
    let reloaded = wait_for_log_lines(&proxy, RELOADED, 1, DEADLINE).await;
    assert_eq!(reloaded.len(), 1, "{}", proxy.report());
    assert!(reloaded[0].contains("\"routes\":2"), "{}", reloaded[0]);
    let restart =
        wait_for_log_lines(&proxy, "only takes effect after a restart", 1, DEADLINE).await;
    assert!(
        restart.len() == 1 && restart[0].contains("cache.memory"),
        "{restart:#?}\n{}",
        proxy.report()
    );
    let ready = admin_get(&proxy, "/readyz").await;
    assert!(ready.body.contains("\"routes\":2"), "{ready:?}");

    let slow = slow
        .await
        .expect("request task")
        .expect("GET /slow across the reload");
    assert_eq!(
        (slow.status.as_u16(), slow.text().as_str()),
        (200, "slow from one")
    );
    assert_eq!(one.hits("/slow"), 1);
    assert_eq!(client.get(&proxy.url("/who")).await.text(), "two");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_config_file_is_refused_with_its_line_and_field_and_the_old_routes_stay() {
    let one = Origin::new()
        .route("/who", Reply::ok("one").header("cache-control", "no-store"))
        .start()
        .await;
    let two = Origin::new()
        .route("/who", Reply::ok("two").header("cache-control", "no-store"))
        .start()
        .await;
    let proxy = Proxy::new(Config::single(one.url())).start().await;
    let client = Client::new();
    assert_eq!(client.get(&proxy.url("/who")).await.text(), "one");

    // Everything of the good file (the new upstream included) plus one
    // unknown field: none of it may be applied.
    let good = current_config(&proxy).replace(&one.url(), &two.url());
    let mut lines: Vec<&str> = good.lines().collect();
    let after = lines
        .iter()
        .position(|l| l.trim() == "ttl_jitter: 0")
        .expect("the route's cache section");
    lines.insert(after + 1, "      bogus_field: 1");
    let line_number = after + 2;
    let bad = format!("{}\n", lines.join("\n"));
    replace_config(&proxy, &bad);

    let refused = wait_for_log(&proxy, REFUSED, DEADLINE).await;
    let location = format!("corral.yaml:{line_number}:7: routes[0].cache.bogus_field");
    assert!(
        refused.contains(&location),
        "expected {location:?} in {refused}"
    );
    assert!(refused.contains("unknown field"), "{refused}");
    for _ in 0..3 {
        assert_eq!(client.get(&proxy.url("/who")).await.text(), "one");
    }
    assert_eq!(two.hits("/who"), 0);
    let ready = admin_get(&proxy, "/readyz").await;
    assert_eq!(ready.status, 200, "{ready:?}");
    assert!(
        log_lines_with(&proxy, RELOADED).is_empty(),
        "{}",
        proxy.report()
    );

    // A good file and SIGHUP bring the change in.
    replace_config(&proxy, &good);
    send_signal(&proxy, Signal::Hup);
    let url = proxy.url("/who");
    let client_ref = &client;
    eventually(DEADLINE, "/who is answered by the second origin", || {
        let url = url.clone();
        async move { client_ref.get(&url).await.text() == "two" }
    })
    .await;
    // SIGHUP alone reloads, even when the file did not change.
    let before = wait_for_log_lines(&proxy, RELOADED, 1, DEADLINE)
        .await
        .len();
    send_signal(&proxy, Signal::Hup);
    wait_for_log_lines(&proxy, RELOADED, before + 1, DEADLINE).await;
    assert_eq!(client.get(&proxy.url("/who")).await.text(), "two");
    assert_eq!(
        log_lines_with(&proxy, REFUSED).len(),
        1,
        "{}",
        proxy.report()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_reports_routes_and_redis_off_and_health_endpoints_answer() {
    let origin = Origin::new().start().await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;

    let ready = admin_get(&proxy, "/readyz").await;
    assert_eq!(ready.status, 200, "{ready:?}");
    assert_eq!(ready.content_type.as_deref(), Some("application/json"));
    assert_eq!(
        ready.body.trim(),
        r#"{"ready":true,"draining":false,"routes":1,"redis":"off","redis_mode":"off"}"#
    );
    let health = admin_get(&proxy, "/healthz").await;
    assert_eq!((health.status, health.body.trim()), (200, "ok"));
    let lb = admin_get(&proxy, "/lb-health").await;
    assert_eq!((lb.status, lb.body.trim()), (200, "ok"));
    let metrics = admin_get(&proxy, "/metrics").await;
    assert_eq!(metrics.status, 200);
    assert!(
        metrics
            .content_type
            .as_deref()
            .is_some_and(|t| t.starts_with("text/plain")),
        "{metrics:?}"
    );
    lifecycle::Scrape::parse(&metrics.body).expect("readable exposition text");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_stdout_never_holds_a_request() {
    // About 300 bytes of access line per request: 4,000 requests are some
    // 1.2 MB of log, twenty times what the unread stdout pipe holds. A
    // proxy that wrote its log inline would stop answering at the
    // two-hundredth request or so.
    const N: usize = 4000;
    let origin = Origin::new()
        .route(
            "/logged",
            Reply::ok("answer").header("cache-control", "max-age=600"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url()))
        .with_stalled_stdout()
        .start()
        .await;
    let client = Client::new();
    let url = proxy.url("/logged");
    let answered = tokio::time::timeout(DEADLINE * 3, async {
        let mut all = Vec::with_capacity(N);
        for _ in 0..N / 50 {
            all.extend(client.burst(50, &url, &[]).await);
        }
        all
    })
    .await
    .expect("every request answered while stdout is stalled");
    corral_tests::assert_every_answer(&answered, 200, "answer");
    assert_eq!(origin.hits("/logged"), 1);
    let metrics = scrape(&proxy).await;
    assert_eq!(
        metrics.sum(REQUESTS, &[("route", "api")]),
        N as f64,
        "{}",
        metrics.text()
    );
    // 1.2 MB fits in the 8 MiB buffer: nothing dropped yet.
    assert_eq!(
        metrics.value("corral_log_lines_dropped_total", &[]),
        Some(0.0),
        "{}",
        metrics.text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corral_proxy_to_an_origin_caches_with_no_file_and_names_a_bad_flag() {
    let origin = Origin::new()
        .route(
            "/one",
            Reply::ok("from the origin").header("cache-control", "max-age=600"),
        )
        .start()
        .await;
    let addrs = corral_tests::ports::free_addrs(2).expect("free ports");
    let (listen, admin) = (addrs[0], addrs[1]);
    let mut cmd = tokio::process::Command::new(corral_tests::paths::corral_bin());
    cmd.args(["proxy", "--to", &origin.url()])
        .args([
            "--listen",
            &listen.to_string(),
            "--admin",
            &admin.to_string(),
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn().expect("spawn corral proxy");
    let client = Client::new();
    let health = format!("http://{admin}/healthz");
    let (client_ref, health_ref) = (&client, &health);
    eventually(
        DEADLINE,
        "corral proxy answers its health check",
        move || async move {
            client_ref
                .try_send(Method::GET, health_ref, &[], None)
                .await
                .is_ok_and(|a| a.status == 200)
        },
    )
    .await;

    let url = format!("http://{listen}/one");
    let first = client.get(&url).await;
    let second = client.get(&url).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.text(), "from the origin");
    assert_eq!(second.text(), "from the origin");
    assert!(second.cache_status().is_hit(), "{}", second.cache_status());
    assert_eq!(
        origin.hits("/one"),
        1,
        "the second answer came from the cache"
    );
    child.start_kill().expect("stop corral proxy");
    let out = child.wait_with_output().await.expect("corral proxy output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("http://{listen} in front of {}", origin.url()))
            && stdout.contains(&format!("http://{admin}")),
        "it says where it listens: {stdout}"
    );
    // Its log goes to a pipe here, not a terminal: no colour codes.
    assert!(
        !stdout.contains('\u{1b}'),
        "ANSI escapes in a log that is no terminal: {stdout:?}"
    );

    // A bad flag is named as the flag, not as a field of a file the
    // operator never wrote, and nothing starts.
    for (flag, value, said) in [
        (
            "--to",
            "ftp://127.0.0.1:1",
            "corral proxy: --to: unsupported scheme `ftp`",
        ),
        (
            "--listen",
            "nowhere",
            "corral proxy: --listen: `nowhere` is not an IP address",
        ),
        (
            "--redis",
            "http://127.0.0.1:1",
            "corral proxy: --redis: unsupported scheme `http`",
        ),
        (
            "--memory",
            "lots",
            "corral proxy: --memory: `lots` is not a size",
        ),
    ] {
        let mut cmd = tokio::process::Command::new(corral_tests::paths::corral_bin());
        cmd.arg("proxy");
        if flag != "--to" {
            cmd.args(["--to", "http://127.0.0.1:1"]);
        }
        cmd.args([flag, value]);
        let out = corral_tests::command::output_within(&mut cmd, DEADLINE, "corral proxy").await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}: {stderr}");
        assert!(stderr.starts_with(said), "{flag} {value}: {stderr}");
    }
}

/// `/metrics` as Prometheus' conventions and client libraries have it:
/// HELP text on every family, base units (no `_microseconds`),
/// `corral_build_info`, the `process_*` figures, and the counters whose
/// label sets are known present at 0 before their first event (a rate
/// over a counter that appears only later reads as no data in an
/// incident, not as zero).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_carry_help_units_build_info_process_figures_and_zeroes_from_start() {
    let redis = corral_tests::Redis::start().await;
    let origin = Origin::new()
        .route("/a", Reply::ok("a").header("cache-control", "max-age=60"))
        .start()
        .await;
    let proxy = Proxy::new(
        Config::new()
            .route(Route::new("api", origin.url()))
            .redis(&redis.url()),
    )
    .start()
    .await;
    let m = scrape(&proxy).await;
    let text = m.text().to_owned();
    let mut families = 0;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let name = rest.split_whitespace().next().unwrap_or_default();
            families += 1;
            assert!(
                text.contains(&format!("# HELP {name} ")),
                "{name} has no HELP:\n{text}"
            );
        }
    }
    assert!(families >= 30, "{families} families:\n{text}");
    assert!(!text.contains("_microseconds"), "{text}");
    assert_eq!(
        m.value(
            "corral_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        Some(1.0),
        "{text}"
    );
    assert!(
        m.value("process_cpu_seconds_total", &[]).is_some(),
        "{text}"
    );
    for figure in [
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
    ] {
        assert!(
            m.value(figure, &[]).is_some_and(|v| v > 0.0),
            "{figure}:\n{text}"
        );
    }
    // Before any request: the known label sets, at 0.
    for (name, labels) in [
        ("corral_stale_answers_total", &[("reason", "error")][..]),
        (
            "corral_origin_skipped_total",
            &[("route", "api"), ("reason", "backoff")][..],
        ),
        (
            "corral_origin_skipped_total",
            &[("route", "api"), ("reason", "circuit-open")][..],
        ),
        ("corral_fills_refused_total", &[("route", "api")][..]),
        ("corral_wait_list_full_total", &[("route", "api")][..]),
        ("corral_connections_closed_total", &[("reason", "idle")][..]),
        ("corral_lease_total", &[("outcome", "acquired")][..]),
        ("corral_redis_errors_total", &[("kind", "timeout")][..]),
        ("corral_l2_reads_total", &[("result", "hit")][..]),
        ("corral_redis_breaker_opened_total", &[][..]),
    ] {
        assert_eq!(
            m.value(name, labels),
            Some(0.0),
            "{name}{labels:?}:\n{text}"
        );
    }
    assert!(
        text.contains("# TYPE corral_redis_breaker_opened_total counter"),
        "a count is a counter:\n{text}"
    );
}

/// A listener on port 0 is bound by the kernel, and corral says where:
/// `CORRAL_READY_FILE` gets the bound addresses and the instance name
/// (written whole, once every listener is bound), and `/healthz` names the
/// same instance, so whoever started it (the test harness, a supervisor)
/// knows both its ports and that it talks to this process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corral_on_port_zero_reports_what_it_bound_and_health_names_it() {
    let origin = Origin::new()
        .route(
            "/one",
            Reply::ok("one").header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let dir = corral_tests::temp::TempDir::new("ready").expect("scratch dir");
    let ready = dir.path().join("ready.json");
    let mut cmd = tokio::process::Command::new(corral_tests::paths::corral_bin());
    cmd.args(["proxy", "--to", &origin.url()])
        .args(["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
        .env("CORRAL_READY_FILE", &ready)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    let child = cmd.spawn().expect("spawn corral proxy");
    eventually(DEADLINE, "the ready file", || async { ready.exists() }).await;
    let text = std::fs::read_to_string(&ready).expect("the ready file");
    let report: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let addr = |key: &str| -> std::net::SocketAddr {
        report[key]
            .as_str()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{key} in {text}"))
    };
    let (listen, admin) = (addr("listen"), addr("admin"));
    assert!(
        listen.port() != 0 && admin.port() != 0 && listen != admin,
        "{text}"
    );
    assert_eq!(report["listen_tls"], serde_json::Value::Null, "{text}");
    let instance = report["instance"].as_str().expect("instance");
    assert!(
        instance.ends_with(&format!("/{}", child.id().expect("pid"))),
        "{instance}"
    );
    let client = Client::new();
    let health = client.get(&format!("http://{admin}/healthz")).await;
    assert_eq!(health.status, 200);
    assert_eq!(health.header("corral-instance"), Some(instance));
    let one = client.get(&format!("http://{listen}/one")).await;
    assert_eq!(one.text(), "one");
}
