//! Faults beyond kill and freeze (issue 27): instances whose wall clocks
//! disagree, a Redis that restarts empty under the fleet, a Redis that is
//! full. Real `redis-server` processes, real corral processes.

use std::time::Duration;

use futures_util::future::join_all;
use http::Method;
use tokio::time::Instant;

use corral_tests::clock_skew::libfaketime;
use corral_tests::fault_proxy::{Fault, FaultProxy, Noise};
use corral_tests::shared::{cacheable, spawn_bursts};
use corral_tests::{
    Answer, Client, Config, DEADLINE, Origin, Proxy, Redis, Reply, Route, RunningOrigin,
    RunningProxy, eventually, lifecycle,
};

/// Instance A's clock is true, B's runs 30 s ahead and C's 30 s behind.
/// A takes the leases; B and C wait on them with `lock_age: 3s`. A lease's
/// age is read on Redis's clock, so the skews change nothing:
/// - a leader that answers in 1 s is waited for (one origin request), not
///   taken over at once by B, which would think it 30 s old;
/// - a stuck leader is taken over after 3 s by C too, which would think
///   it not held at all and wait out `lock_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_ages_on_redis_clock_whatever_the_instances_clocks_say() {
    let Some(lib) = libfaketime() else { return };
    let redis = Redis::start().await;
    let stuck = cacheable("late").delay(Duration::from_secs(30));
    let origin = Origin::new()
        .route("/fast-b", cacheable("fast").delay(Duration::from_secs(1)))
        .route("/fast-c", cacheable("fast").delay(Duration::from_secs(1)))
        .route("/stuck-b", stuck.clone())
        .route("/stuck-c", stuck)
        .start()
        .await;
    let config = Config::new()
        .route(
            Route::new("api", origin.url())
                .coalesce("lock_timeout", "9s")
                .coalesce("lock_age", "3s")
                .coalesce("on_timeout", "error"),
        )
        .redis(&redis.url())
        .redis_field("op_timeout", "250ms");
    let a = Proxy::new(config.clone()).start().await;
    let b = Proxy::new(config.clone())
        .wall_clock_offset(&lib, "+30s")
        .start()
        .await;
    let c = Proxy::new(config)
        .wall_clock_offset(&lib, "-30s")
        .start()
        .await;
    let client = Client::new();

    // A leads every key: its lease is taken before its fetch starts.
    let leaders: Vec<_> = ["/fast-b", "/fast-c", "/stuck-b", "/stuck-c"]
        .into_iter()
        .map(|path| {
            let (client, url) = (client.clone(), a.url(path));
            tokio::spawn(async move { client.get(&url).await })
        })
        .collect();
    for path in ["/fast-b", "/fast-c", "/stuck-b", "/stuck-c"] {
        origin.wait_hits(path, 1, DEADLINE).await;
    }
    // A second fetch of a stuck key answers at once.
    origin.set_route("/stuck-b", cacheable("prompt"));
    origin.set_route("/stuck-c", cacheable("prompt"));

    let waiters = [
        (b.url("/fast-b"), "fast"),
        (c.url("/fast-c"), "fast"),
        (b.url("/stuck-b"), "prompt"),
        (c.url("/stuck-c"), "prompt"),
    ]
    .into_iter()
    .map(|(url, want)| {
        let client = client.clone();
        tokio::spawn(async move { (client.get(&url).await, want, url) })
    })
    .collect::<Vec<_>>();
    for w in waiters {
        let (answer, want, url) = w.await.expect("waiter task");
        assert_eq!(
            (answer.status.as_u16(), answer.text().as_str()),
            (200, want),
            "{url}: {}",
            answer.cache_status()
        );
    }
    // The quick leaders were waited for, not taken over; the stuck ones
    // were taken over, once.
    assert_eq!(origin.hits("/fast-b"), 1, "B took over a 1 s old lease");
    assert_eq!(origin.hits("/fast-c"), 1);
    assert_eq!(origin.hits("/stuck-b"), 2);
    assert_eq!(origin.hits("/stuck-c"), 2, "C never saw the lease age");
    for l in leaders {
        l.abort();
    }
}

/// The instance names `proxy`'s fleet view lists.
async fn fleet_names(client: &Client, proxy: &RunningProxy) -> Vec<String> {
    let body = client.get(&proxy.admin_url("/stats?fleet=1")).await.text();
    let fleet: serde_json::Value = serde_json::from_str(&body).expect("the fleet view is JSON");
    let mut names: Vec<String> = fleet["instances"]
        .as_array()
        .expect("instances")
        .iter()
        .map(|i| i["instance"].as_str().expect("a name").to_owned())
        .collect();
    names.sort();
    names
}

const PURGE_TOKEN: &str = "skew-purge-token";

/// A's wall clock is true, B's runs 30 s ahead and C's 30 s behind; what
/// they share is on Redis's clock, so nothing changes what another serves:
/// - every fleet view lists all three (heartbeats scored on Redis's clock;
///   B's used to drop A and C from the roll, and C's lapsed on arrival);
/// - an entry any of them stored is a fresh hit on the other two (A's read
///   as 30 s old on B, C's as expired on A and B);
/// - `Age` is the time since the origin answered, on every instance (B's
///   entries used to read `Age: 0` for 35 s elsewhere);
/// - a prefix purge from C removes the answers on all three (its ban used
///   to date from 30 s before what they held).
///
/// Real time has to pass for an age to show, and libfaketime's clocks
/// cannot be paused: the test waits 2.5 s once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skewed_instance_changes_nothing_another_serves() {
    let Some(lib) = libfaketime() else { return };
    let redis = Redis::start().await;
    let short = |body: &str| Reply::ok(body.to_owned()).header("cache-control", "max-age=5");
    let origin = Origin::new()
        .route("/by-a", short("a"))
        .route("/by-b", short("b"))
        .route("/by-c", short("c"))
        .route("/p/1", cacheable("before the purge"))
        .start()
        .await;
    let config = Config::new()
        .route(Route::new("api", origin.url()))
        .redis(&redis.url())
        .server("purge_token", &format!("\"{PURGE_TOKEN}\""));
    let a = Proxy::new(config.clone()).start().await;
    let b = Proxy::new(config.clone())
        .wall_clock_offset(&lib, "+30s")
        .start()
        .await;
    let c = Proxy::new(config)
        .wall_clock_offset(&lib, "-30s")
        .start()
        .await;
    let all = [("A", &a), ("B", &b), ("C", &c)];
    let client = Client::new();

    // Every instance lists the three (heartbeats come every 2 s).
    for (name, proxy) in all {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let names = fleet_names(&client, proxy).await;
            if names.len() == 3 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{name}'s fleet view never listed the three instances: {names:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    // What each stores is a fresh hit on the others, fetched once.
    let writers = [("/by-a", "a", &a), ("/by-b", "b", &b), ("/by-c", "c", &c)];
    for (path, body, writer) in writers {
        let first = client.get(&writer.url(path)).await;
        assert!(
            first.cache_status().stored(),
            "{path}: {}",
            first.cache_status()
        );
        for (name, reader) in all {
            let got = client.get(&reader.url(path)).await;
            assert_eq!((got.status.as_u16(), got.text()), (200, body.to_owned()));
            assert!(
                got.cache_status().is_hit(),
                "{path} stored by {body}, read on {name}: {}",
                got.cache_status()
            );
        }
        assert_eq!(origin.hits(path), 1, "{path}");
    }

    // Age is the time since the origin answered, wherever it is read.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for (path, body, _) in writers {
        for (name, reader) in all {
            let got = client.get(&reader.url(path)).await;
            assert!(
                got.cache_status().is_hit(),
                "{path} on {name}: {}",
                got.cache_status()
            );
            let age: u64 = got
                .header("age")
                .and_then(|a| a.parse().ok())
                .expect("an Age on a hit");
            assert!(
                (2..=3).contains(&age),
                "{path} (stored by {body}) on {name}: Age {age} 2.5 s after the origin answered"
            );
        }
    }

    // A prefix purge from C, 30 s behind, removes the answer everywhere.
    for (name, proxy) in all {
        let got = client.get(&proxy.url("/p/1")).await;
        assert_eq!(got.text(), "before the purge", "{name}");
    }
    assert_eq!(origin.hits("/p/1"), 1);
    origin.set_route("/p/1", cacheable("after the purge"));
    let prefix = c.url("/p/").replace(':', "%3A").replace('/', "%2F");
    let auth = format!("Bearer {PURGE_TOKEN}");
    let purged = client
        .send(
            Method::POST,
            &c.admin_url(&format!("/purge?prefix={prefix}")),
            &[("authorization", auth.as_str())],
            None,
        )
        .await;
    assert_eq!(purged.status, 200, "{}", purged.text());
    for (name, proxy) in all {
        // The ban reaches the others by broadcast, on their own time.
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let got = client.get(&proxy.url("/p/1")).await;
            if got.text() == "after the purge" {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{name} still serves what C purged: {}",
                got.cache_status()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn keys(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("/k{i}")).collect()
}

async fn counter(proxy: &RunningProxy, name: &str, labels: &[(&str, &str)]) -> f64 {
    lifecycle::scrape(proxy).await.sum(name, labels)
}

/// `LOCK_TIMEOUT` of the stampede scenarios: no answer may wait past it.
const LOCK_TIMEOUT: Duration = Duration::from_secs(3);

/// A stampede of 20 requests per instance on `path`: every answer is a 200
/// with the whole body `want`, none gave up at `LOCK_TIMEOUT`, and all came
/// within it (and the origin's time). Returns the origin requests `path`
/// has had.
async fn checked_stampede(
    client: &Client,
    proxies: &[RunningProxy],
    origin: &RunningOrigin,
    path: &str,
    want: &str,
    label: &str,
) -> usize {
    let started = Instant::now();
    let per_proxy = spawn_bursts(client, proxies, 20, path)
        .await
        .expect("burst task");
    let took = started.elapsed();
    for answer in per_proxy.iter().flatten() {
        let cs = answer.cache_status();
        assert_eq!(answer.status, 200, "{label} {path}: {cs}");
        assert!(answer.text() == want, "{label} {path}: a wrong body ({cs})");
        assert_ne!(cs.detail(), Some("lock-timeout"), "{label} {path}");
    }
    assert!(
        took < LOCK_TIMEOUT + Duration::from_secs(2),
        "{label} {path}: the stampede took {took:?}"
    );
    origin.hits(path)
}

/// A Redis restart used to drop every instance's L1 at once (the
/// subscriber could not know what it had missed), so the whole fleet went
/// cold together. Now the instances find the invalidation log gone with
/// Redis's data, keep what they hold and serve it, and revalidate it in
/// the background at `resync_rate`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_keeps_every_instances_l1_and_revalidates_it_paced() {
    const KEYS: usize = 30;
    let mut redis = Redis::start().await;
    let mut origin = Origin::new();
    for path in keys(KEYS) {
        origin = origin.route(&path, cacheable(&format!("body of {path}")));
    }
    let origin = origin.start().await;
    let config = Config::new()
        .route(Route::new("api", origin.url()))
        .redis(&redis.url())
        .redis_field("op_timeout", "250ms")
        .redis_field("resync_rate", "1");
    let proxies = Proxy::new(config).instances(2).start_all().await;
    let client = Client::new();
    for path in keys(KEYS) {
        for p in &proxies {
            assert_eq!(client.get(&p.url(&path)).await.status, 200);
        }
    }
    let warm: usize = keys(KEYS).iter().map(|p| origin.hits(p)).sum();
    assert_eq!(warm, KEYS, "one fill per key, shared through L2");

    redis.kill();
    redis.restart().await;
    for p in &proxies {
        eventually(DEADLINE, "the instance found the log lost", || async {
            counter(p, "corral_invalidation_log_total", &[("outcome", "lost")]).await >= 1.0
        })
        .await;
    }
    let started = Instant::now();
    for path in keys(KEYS) {
        for p in &proxies {
            let answer = client.get(&p.url(&path)).await;
            assert_eq!(
                (answer.status.as_u16(), answer.text()),
                (200, format!("body of {path}"))
            );
            assert!(
                answer.cache_status().is_hit(),
                "{path} after the restart: {}",
                answer.cache_status()
            );
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let after: usize = keys(KEYS).iter().map(|p| origin.hits(p)).sum();
    let mut refreshes = 0.0;
    for p in &proxies {
        let r = counter(p, "corral_resync_refreshes_total", &[]).await;
        // A burst of one, then one a second.
        assert!(r <= 2.0 + secs, "{r} revalidations in {secs:.1} s");
        refreshes += r;
    }
    assert!(
        (after - warm) as f64 <= refreshes,
        "{} origin requests after the restart, {refreshes} revalidations",
        after - warm
    );

    // And the unverified entries do get revalidated as they are asked for.
    let a = &proxies[0];
    eventually(Duration::from_secs(20), "/k0 revalidated", || async {
        client.get(&a.url("/k0")).await;
        origin.hits("/k0") >= 2
    })
    .await;
}

/// An invalidation published while an instance is cut off from Redis
/// (its subscriber too) is replayed from the log when it reconnects:
/// that URI is dropped, and nothing else is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidation_missed_while_cut_off_is_replayed_from_the_log() {
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route("/x", cacheable("x v1"))
        .route("/y", cacheable("y v1"))
        .start()
        .await;
    let cut = FaultProxy::start(redis.addr()).await;
    let config = |url: &str| {
        Config::new()
            .route(Route::new("api", origin.url()))
            .redis(url)
            .redis_field("op_timeout", "250ms")
            .redis_field("breaker", "{ failures: 3, open_for: 500ms }")
    };
    let a = Proxy::new(config(&redis.url())).start().await;
    let b = Proxy::new(config(&format!("redis://{}/0", cut.addr())))
        .start()
        .await;
    let client = Client::new();
    for path in ["/x", "/y"] {
        for p in [&a, &b] {
            assert_eq!(client.get(&p.url(path)).await.status, 200);
        }
    }
    assert_eq!((origin.hits("/x"), origin.hits("/y")), (1, 1));

    cut.set(Fault::Cut);
    origin.set_route("/x", cacheable("x v2"));
    origin.set_route_method(Method::POST, "/x", Reply::status(201, "created"));
    let post = client
        .send(Method::POST, &a.url("/x"), &[], Some("new".into()))
        .await;
    assert_eq!(post.status, 201);
    // B, cut off, still serves what it holds.
    assert_eq!(client.get(&b.url("/x")).await.text(), "x v1");
    cut.set(Fault::None);
    eventually(DEADLINE, "B replayed the log", || async {
        counter(
            &b,
            "corral_invalidation_log_total",
            &[("outcome", "replayed")],
        )
        .await
            >= 1.0
    })
    .await;

    let x = client.get(&b.url("/x")).await;
    assert_eq!(x.text(), "x v2", "{}", x.cache_status());
    let y = client.get(&b.url("/y")).await;
    assert_eq!(y.text(), "y v1");
    // From B's L1: not read back from L2, which a dropped L1 would do.
    assert!(
        y.cache_status().is_hit() && y.cache_status().detail() != Some("l2"),
        "{}",
        y.cache_status()
    );
    assert_eq!(origin.hits("/y"), 1, "B kept what no invalidation named");
    assert_eq!(
        counter(&b, "corral_invalidation_log_total", &[("outcome", "lost")]).await,
        0.0
    );
}

/// Writes values to `redis` until it refuses them as full (`OOM`): 64 KiB
/// ones, then smaller and smaller, since a refused write's own arguments
/// counted against `maxmemory` and leave that much room once dropped.
/// The connection is handed back: closing it would free its buffers.
async fn fill_up(redis: &Redis) -> ::redis::aio::MultiplexedConnection {
    let client = ::redis::Client::open(redis.url()).expect("a client for the test's Redis");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("a connection to the test's Redis");
    let mut i = 0;
    for size in [64 * 1024, 4096, 256, 16] {
        let junk = vec![b'x'; size];
        loop {
            i += 1;
            assert!(i < 100_000, "Redis took all that junk: is maxmemory set?");
            let r: ::redis::RedisResult<()> = ::redis::cmd("SET")
                .arg(format!("junk:{i}"))
                .arg(&junk)
                .query_async(&mut conn)
                .await;
            if let Err(e) = r {
                assert_eq!(e.code(), Some("OOM"), "{e}");
                break;
            }
        }
    }
    conn
}

/// A full Redis (maxmemory, noeviction) refuses writes with OOM. That is
/// no failing Redis: it used to open the breaker after a few refused
/// entry writes, and then reads were skipped too. Now refusals are
/// counted as `kind="oom"`, logged once, entry writes pause, and reads go
/// on: what another instance stored before is still read from L2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_refuses_writes_and_reads_go_on() {
    let redis = Redis::start_args(
        ["--maxmemory", "8mb", "--maxmemory-policy", "noeviction"]
            .map(String::from)
            .to_vec(),
    )
    .await;
    // Bodies of 16 KiB: twenty of them could not fit in what a dropped
    // client's buffers leave free.
    let body = "f".repeat(16 * 1024);
    let mut origin = Origin::new().route("/before", cacheable("stored before"));
    for path in keys(20) {
        origin = origin.route(&path, cacheable(&body));
    }
    let origin = origin.start().await;
    let config = Config::new()
        .route(Route::new("api", origin.url()))
        .redis(&redis.url())
        .redis_field("op_timeout", "250ms")
        .redis_field("breaker", "{ failures: 3, open_for: 1s }");
    let proxies = Proxy::new(config).instances(2).start_all().await;
    let (a, b) = (&proxies[0], &proxies[1]);
    let client = Client::new();
    assert_eq!(client.get(&b.url("/before")).await.status, 200);
    let _held = fill_up(&redis).await;

    // Twenty concurrent fills on A whose writes Redis refuses (the lease,
    // the entry): each answered.
    let urls: Vec<String> = keys(20).iter().map(|path| a.url(path)).collect();
    let answers = join_all(urls.iter().map(|url| client.get(url))).await;
    for answer in answers {
        assert_eq!((answer.status.as_u16(), answer.text()), (200, body.clone()));
    }
    // A still reads L2: B's entry from before is served from there.
    let before = client.get(&a.url("/before")).await;
    assert_eq!(before.text(), "stored before");
    assert_eq!(
        before.cache_status().detail(),
        Some("l2"),
        "{}",
        before.cache_status()
    );
    assert_eq!(origin.hits("/before"), 1);
    let scrape = lifecycle::scrape(a).await;
    assert!(scrape.sum("corral_redis_errors_total", &[("kind", "oom")]) >= 1.0);
    assert_eq!(
        scrape.sum("corral_redis_errors_total", &[("kind", "error")]),
        0.0
    );
    assert_eq!(scrape.sum("corral_redis_breaker_opened_total", &[]), 0.0);
    // The log is written behind the answers (a CI run once read it before
    // the line was there): wait for the line, then check that it is one.
    let refused = lifecycle::wait_for_log_lines(a, "Redis refuses writes", 1, DEADLINE).await;
    assert_eq!(refused.len(), 1, "{}", a.log());
}

/// A full Redis still coalesces: the lease scripts run under `allow-oom`
/// and the leader hands its entry off for `lease_ttl`, so a stampede of
/// 20 requests on each of three instances, on a cold key, costs the origin
/// one request, not one per instance, and every caller gets its body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stampede_on_a_full_redis_reaches_the_origin_once() {
    let redis = Redis::start_args(
        ["--maxmemory", "8mb", "--maxmemory-policy", "noeviction"]
            .map(String::from)
            .to_vec(),
    )
    .await;
    let origin = Origin::new()
        .route(
            "/cold",
            cacheable("one answer").delay(Duration::from_millis(500)),
        )
        .start()
        .await;
    let config = Config::new()
        .route(Route::new("api", origin.url()))
        .redis(&redis.url())
        .redis_field("op_timeout", "250ms");
    let proxies = Proxy::new(config).instances(3).start_all().await;
    let client = Client::new();
    let _held = fill_up(&redis).await;

    let per_proxy = spawn_bursts(&client, &proxies, 20, "/cold")
        .await
        .expect("burst task");
    for answer in per_proxy.iter().flatten() {
        assert_eq!(
            (answer.status.as_u16(), answer.text()),
            (200, "one answer".to_owned()),
            "{}",
            answer.cache_status()
        );
    }
    assert_eq!(
        origin.hits("/cold"),
        1,
        "a full Redis took no lease: one origin request per instance"
    );
    // No lease is left behind, and the full Redis was no failing one.
    corral_tests::shared::wait_no_lease(&redis, DEADLINE).await;
    for proxy in &proxies {
        assert_eq!(
            counter(proxy, "corral_redis_errors_total", &[("kind", "error")]).await,
            0.0
        );
    }
}

/// Three instances behind one noisy link to Redis, one profile at a time
/// (latency with jitter, a bandwidth cap, 3% of chunks reset, 5% of new
/// connections silent): a stampede of 20 requests per instance on each of
/// three cold keys. Every answer is the origin's whole body, no client
/// sees an error, no waiter gives up at `lock_timeout`, and each key
/// reaches the origin at most once per fill plus once per instance that
/// found Redis unreachable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_noise_between_corral_and_redis_every_answer_is_right_and_bounded() {
    const INSTANCES: usize = 3;
    let redis = Redis::start().await;
    let link = FaultProxy::start(redis.addr()).await;
    let profiles = [
        (
            "latency",
            Noise {
                latency: Duration::from_millis(2),
                jitter: Duration::from_millis(20),
                ..Noise::default()
            },
        ),
        (
            "bandwidth",
            Noise {
                bandwidth: 256 * 1024,
                ..Noise::default()
            },
        ),
        (
            "resets",
            Noise {
                reset: 0.03,
                ..Noise::default()
            },
        ),
        (
            "silent",
            Noise {
                silent: 0.05,
                ..Noise::default()
            },
        ),
    ];
    let mut origin = Origin::new();
    for (name, _) in &profiles {
        for k in 0..3 {
            let path = format!("/{name}/{k}");
            let body = format!("{path} ").repeat(500);
            origin = origin.route(&path, cacheable(&body).delay(Duration::from_millis(150)));
        }
    }
    let origin = origin.start().await;
    let config = Config::new()
        .route(
            Route::new("api", origin.url())
                .coalesce("lock_timeout", &format!("{}s", LOCK_TIMEOUT.as_secs())),
        )
        .redis(&format!("redis://{}/0", link.addr()))
        .redis_field("op_timeout", "250ms")
        .redis_field("connect_timeout", "500ms")
        .redis_field("breaker", "{ failures: 5, open_for: 500ms }");
    let proxies = Proxy::new(config).instances(INSTANCES).start_all().await;
    let client = Client::new();

    for (name, noise) in profiles {
        link.noise(noise);
        for k in 0..3 {
            let path = format!("/{name}/{k}");
            let want = format!("{path} ").repeat(500);
            let hits = checked_stampede(&client, &proxies, &origin, &path, &want, name).await;
            assert!(
                (1..=1 + INSTANCES).contains(&hits),
                "{name} {path}: {hits} origin requests"
            );
        }
        link.noise(Noise::default());
    }
    assert!(link.resets() > 0, "the reset profile reset nothing");
}

/// The origin behind a noisy link: latency with jitter and a bandwidth cap
/// slow it down, and 3% of chunks reset its connection mid-answer. A
/// client may get an error for a fetch the origin's link broke, but never
/// a 200 with a body that is not the origin's whole body, and nothing
/// truncated is stored: once the link is clean, every key answers whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_noisy_origin_link_never_yields_or_stores_a_truncated_body() {
    let redis = Redis::start().await;
    let big = |k: usize| format!("{k:06} ").repeat(16 * 1024 / 7);
    let mut origin = Origin::new();
    for k in 0..12 {
        origin = origin.route(&format!("/o/{k}"), cacheable(&big(k)));
    }
    let origin = origin.start().await;
    let link = FaultProxy::start(origin.addr()).await;
    let config = Config::new()
        .route(Route::new("api", format!("http://{}", link.addr())))
        .redis(&redis.url())
        .redis_field("op_timeout", "250ms");
    let proxies = Proxy::new(config).instances(2).start_all().await;
    let client = Client::new();
    link.noise(Noise {
        latency: Duration::from_millis(1),
        jitter: Duration::from_millis(10),
        bandwidth: 1024 * 1024,
        reset: 0.03,
        ..Noise::default()
    });
    let mut errors = 0;
    for k in 0..12 {
        let path = format!("/o/{k}");
        for answer in spawn_bursts(&client, &proxies, 10, &path)
            .await
            .expect("burst task")
            .iter()
            .flatten()
        {
            if answer.status == 200 {
                assert!(answer.text() == big(k), "{path}: a 200 with a wrong body");
            } else {
                assert!(
                    [502, 503, 504].contains(&answer.status.as_u16()),
                    "{path}: {}",
                    answer.status
                );
                errors += 1;
            }
        }
    }
    link.noise(Noise::default());
    for k in 0..12 {
        for p in &proxies {
            let answer = client.get(&p.url(&format!("/o/{k}"))).await;
            assert_eq!(answer.status, 200);
            assert!(answer.text() == big(k), "/o/{k}: stored truncated");
        }
    }
    eprintln!(
        "{errors} error answers, {} connections reset",
        link.resets()
    );
}

/// Managed Redis evicts (`allkeys-lru`, `volatile-lru`) rather than
/// refusing. Under a writer that keeps it at `maxmemory` and evicting,
/// corral's records may vanish at any moment: every answer is still the
/// origin's body, no waiter is left past `lock_timeout`, and a key costs
/// at most what it costs with Redis unreachable (one fill per instance).
/// (Redis's LRU clock ticks once a second, so under a writer that turns
/// the whole keyspace over several times a second, an entry is evicted
/// before the other instances read it, and each fetches its own.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_eviction_every_answer_is_right_and_no_waiter_is_left() {
    for policy in ["allkeys-lru", "volatile-lru"] {
        let redis = Redis::start_args(
            ["--maxmemory", "4mb", "--maxmemory-policy", policy]
                .map(String::from)
                .to_vec(),
        )
        .await;
        let mut origin = Origin::new();
        for k in 0..6 {
            origin = origin.route(
                &format!("/e/{k}"),
                cacheable(&format!("evicted {k} ").repeat(200)).delay(Duration::from_millis(300)),
            );
        }
        let origin = origin.start().await;
        let config = Config::new()
            .route(
                Route::new("api", origin.url())
                    .coalesce("lock_timeout", &format!("{}s", LOCK_TIMEOUT.as_secs())),
            )
            .redis(&redis.url())
            .redis_field("op_timeout", "250ms");
        let proxies = Proxy::new(config).instances(3).start_all().await;
        let client = Client::new();
        // The pressure: 32 KiB values with a TTL (volatile-lru evicts only
        // those; allkeys-lru any key).
        let pressure = {
            let url = redis.url();
            tokio::spawn(async move {
                let client = ::redis::Client::open(url).expect("a client");
                let mut conn = client
                    .get_multiplexed_async_connection()
                    .await
                    .expect("a connection");
                let junk = vec![b'j'; 32 * 1024];
                for i in 0u64.. {
                    let _: ::redis::RedisResult<()> = ::redis::cmd("SET")
                        .arg(format!("junk:{i}"))
                        .arg(&junk)
                        .arg("EX")
                        .arg(600)
                        .query_async(&mut conn)
                        .await;
                    // 2 MB/s: Redis stays at maxmemory, evicting,
                    // without the writer crowding out corral's commands.
                    tokio::time::sleep(Duration::from_millis(16)).await;
                }
            })
        };
        for k in 0..6 {
            let path = format!("/e/{k}");
            let want = format!("evicted {k} ").repeat(200);
            let hits = checked_stampede(&client, &proxies, &origin, &path, &want, policy).await;
            assert!(
                (1..=3).contains(&hits),
                "{policy} {path}: {hits} origin requests"
            );
        }
        pressure.abort();
        let evicted: String = redis
            .command(::redis::cmd("INFO").arg("stats"), "INFO stats")
            .await;
        let evicted = evicted
            .lines()
            .find_map(|l| l.strip_prefix("evicted_keys:"))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .unwrap_or(0);
        assert!(evicted > 0, "{policy}: Redis evicted nothing");
    }
}

/// What an eviction does to one lease, exactly: it vanishes while its
/// holder fetches (here deleted, as the eviction would). The instances
/// waiting on it may take the key over once: one extra origin request at
/// most, every waiter answered with the body, none past `lock_timeout`.
/// MGETs Redis ran so far (`INFO commandstats`; a script's count too).
async fn mget_calls(redis: &Redis) -> u64 {
    let info: String = redis
        .command(
            ::redis::cmd("INFO").arg("commandstats"),
            "INFO commandstats",
        )
        .await;
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_mget:calls="))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_lease_costs_at_most_one_extra_fill() {
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route("/lease", cacheable("held").delay(Duration::from_secs(1)))
        .start()
        .await;
    let config = Config::new()
        .route(Route::new("api", origin.url()).coalesce("lock_timeout", "5s"))
        .redis(&redis.url())
        .redis_field("op_timeout", "250ms");
    let proxies = Proxy::new(config).instances(3).start_all().await;
    let client = Client::new();
    let leader = {
        let (client, url) = (client.clone(), proxies[0].url("/lease"));
        tokio::spawn(async move { client.get(&url).await })
    };
    origin.wait_hits("/lease", 1, DEADLINE).await;
    let lease = corral_tests::shared::wait_for_key(&redis, "*:lease:*", DEADLINE).await;
    let mgets_before = mget_calls(&redis).await;
    let waiters = spawn_bursts(&client, &proxies[1..], 10, "/lease");
    // Once both waiting instances follow the lease (each has read it held,
    // in the script that reads with an MGET), it vanishes.
    eventually(DEADLINE, "both instances follow the lease", || async {
        mget_calls(&redis).await >= mgets_before + 2
    })
    .await;
    let deleted: i64 = redis
        .command(::redis::cmd("DEL").arg(&lease), "DEL the lease")
        .await;
    assert_eq!(deleted, 1, "the lease was there");
    let answers = waiters.await.expect("waiters");
    let leader = leader.await.expect("leader");
    for answer in answers.iter().flatten().chain([&leader]) {
        let cs = answer.cache_status();
        assert_eq!(
            (answer.status.as_u16(), answer.text()),
            (200, "held".to_owned()),
            "{cs}"
        );
        assert_ne!(cs.detail(), Some("lock-timeout"));
    }
    let hits = origin.hits("/lease");
    assert!((1..=2).contains(&hits), "{hits} origin requests");
}

/// One route to `origin`, sharing `redis`, with a breaker that opens after
/// two failures and stays open a minute (unless something closes it).
fn long_breaker(origin: &RunningOrigin, redis: &Redis) -> Config {
    Config::new()
        .route(Route::new("api", origin.url()))
        .redis(&redis.url())
        .redis_field("op_timeout", "250ms")
        .redis_field("breaker", "{ failures: 2, open_for: 60s }")
}

/// With Redis down, misses on `path` (a new query each) until every
/// instance's breaker is open.
async fn open_breakers(client: &Client, proxies: &[RunningProxy], path: &str) {
    let n = std::sync::atomic::AtomicUsize::new(0);
    for p in proxies {
        eventually(DEADLINE, "the breaker opened", || async {
            let i = n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let answer = client.get(&p.url(&format!("{path}?miss={i}"))).await;
            assert_eq!(answer.status, 200);
            counter(p, "corral_redis_breaker_open", &[]).await == 1.0
        })
        .await;
    }
}

/// After a Redis restart the instances share through it again as soon as
/// their subscribers are back, not once their breakers' `open_for` has
/// passed: the subscriber's reconnect (and its read of the log) is proof
/// that Redis answers. Here `open_for` is 60 s; sharing is back within 10.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_closes_when_the_subscriber_finds_redis_back() {
    let mut redis = Redis::start().await;
    let origin = Origin::new()
        .route("/down", cacheable("down"))
        .start()
        .await;
    let proxies = Proxy::new(long_breaker(&origin, &redis))
        .instances(2)
        .start_all()
        .await;
    let client = Client::new();
    redis.kill();
    open_breakers(&client, &proxies, "/down").await;
    redis.restart().await;
    corral_tests::shared::wait_shared_again(
        &origin,
        &client,
        &proxies[0],
        &proxies[1],
        Duration::from_secs(10),
    )
    .await;
}

/// While Redis cannot be used (the breaker open), a refresh would be each
/// instance's own, and a Redis restart under load became a surge of them.
/// Within the stale-while-revalidate window the origin allows, the stale
/// copy is served and its refresh waits for Redis: once it is back, one
/// refresh for the fleet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_redis_is_unavailable_stale_while_revalidate_waits_for_it() {
    let mut redis = Redis::start().await;
    let origin = Origin::new()
        .route(
            "/swr",
            Reply::ok("swr").header("cache-control", "max-age=1, stale-while-revalidate=60"),
        )
        .route("/miss", cacheable("miss"))
        .start()
        .await;
    let proxies = Proxy::new(long_breaker(&origin, &redis))
        .instances(2)
        .start_all()
        .await;
    let client = Client::new();
    for p in &proxies {
        assert_eq!(client.get(&p.url("/swr")).await.text(), "swr");
    }
    assert_eq!(origin.hits("/swr"), 1);
    redis.kill();
    open_breakers(&client, &proxies, "/miss").await;
    // Stale now (max-age=1): served, the refresh deferred.
    corral_tests::shared::wait_stale_everywhere(&client, &proxies, "/swr", "swr").await;
    for _ in 0..5 {
        for p in &proxies {
            assert_eq!(client.get(&p.url("/swr")).await.text(), "swr");
        }
    }
    assert_eq!(origin.hits("/swr"), 1, "no instance refreshed alone");
    for p in &proxies {
        assert!(counter(p, "corral_refreshes_deferred_total", &[]).await >= 1.0);
    }
    // Redis back: the next stale answer refreshes, for the fleet.
    redis.restart().await;
    eventually(Duration::from_secs(10), "/swr refreshed", || async {
        client.get(&proxies[0].url("/swr")).await;
        origin.hits("/swr") >= 2
    })
    .await;
}

/// `corral_redis_connected` tells the truth in an outage: it was 1 for
/// 95 s after Redis died, since the connection object outlives the
/// server. It now says whether Redis answers (the heartbeat asks every
/// 2 s): 0 soon after Redis is killed, 1 again once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_connected_goes_to_zero_when_redis_dies_and_back_when_it_returns() {
    let mut redis = Redis::start().await;
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
    let connected = || async {
        lifecycle::scrape(&proxy)
            .await
            .value("corral_redis_connected", &[])
    };
    eventually(DEADLINE, "connected at first", || async {
        connected().await == Some(1.0)
    })
    .await;
    redis.kill();
    eventually(DEADLINE, "0 once Redis is gone", || async {
        connected().await == Some(0.0)
    })
    .await;
    redis.restart().await;
    eventually(DEADLINE, "1 once Redis is back", || async {
        connected().await == Some(1.0)
    })
    .await;
}

/// The lines about Redis an instance writes while Redis is away, as
/// fields: `message`'s lines only.
fn redis_lines(
    proxy: &RunningProxy,
    message: &str,
) -> Vec<std::collections::BTreeMap<String, lifecycle::Json>> {
    lifecycle::lines_with_message(&proxy.log(), message)
}

fn field<'a>(
    line: &'a std::collections::BTreeMap<String, lifecycle::Json>,
    name: &str,
) -> Option<&'a str> {
    line.get(name).and_then(lifecycle::Json::as_str)
}

/// A Redis that stays down fails the breaker's probe every `open_for`:
/// the first failure is logged, the rest come as one summary line per
/// growing interval (`repeated`), not a line a second for ever. Every
/// breaker line names the Redis it guards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_stays_down_is_logged_once_then_summed_and_named() {
    const REOPENED: &str = "redis circuit breaker re-opened: the probe failed";
    let mut redis = Redis::start().await;
    let origin = Origin::new()
        .route("/down", cacheable("down"))
        .start()
        .await;
    let config = Config::new()
        .route(Route::new("api", origin.url()))
        .redis(&redis.url())
        .redis_field("op_timeout", "250ms")
        .redis_field("breaker", "{ failures: 2, open_for: 200ms }");
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();
    redis.kill();
    // Misses keep probing Redis until a summary of the failed probes is
    // written (5 s after the first).
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut i = 0;
    let reopened = loop {
        let lines = redis_lines(&proxy, REOPENED);
        if lines.iter().any(|l| l.contains_key("repeated")) {
            break lines;
        }
        assert!(Instant::now() < deadline, "no summary\n{}", proxy.report());
        i += 1;
        let _ = client.get(&proxy.url(&format!("/down?miss={i}"))).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let own_lines = reopened
        .iter()
        .filter(|l| !l.contains_key("repeated"))
        .count();
    assert_eq!(own_lines, 1, "{}", proxy.report());
    assert!(lifecycle::occurrences(&reopened) > 5, "{}", proxy.report());
    let address = redis.addr().to_string();
    let opened = redis_lines(
        &proxy,
        "redis circuit breaker opened after consecutive failures",
    );
    assert_eq!(opened.len(), 1, "{}", proxy.report());
    for line in opened.iter().chain(&reopened) {
        assert_eq!(field(line, "redis"), Some(address.as_str()), "{line:?}");
    }
}

/// An instance started while Redis cannot be reached says so once, then
/// counts its retries (every half second) in summary lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_redis_at_start_is_logged_once_then_summed() {
    const CANNOT: &str = "cannot connect to Redis yet; serving without it";
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = closed.local_addr().expect("addr").to_string();
    drop(closed);
    let origin = Origin::new().route("/a", cacheable("a")).start().await;
    let config = Config::new()
        .route(Route::new("api", origin.url()))
        .redis(&format!("redis://{address}"));
    let proxy = Proxy::new(config).without_waiting_for_redis().start().await;
    let lines =
        lifecycle::wait_for_log_lines(&proxy, "\"repeated\"", 1, Duration::from_secs(20)).await;
    assert!(
        lines.iter().any(|l| l.contains(CANNOT)),
        "{}",
        proxy.report()
    );
    let all = redis_lines(&proxy, CANNOT);
    assert_eq!(
        all.iter().filter(|l| !l.contains_key("repeated")).count(),
        1,
        "{}",
        proxy.report()
    );
    assert!(lifecycle::occurrences(&all) >= 5, "{}", proxy.report());
    for line in &all {
        assert_eq!(field(line, "redis"), Some(address.as_str()), "{line:?}");
    }
}

/// One key filled by a leader instance (a 800 ms origin) while another
/// instance, reaching Redis through a proxy, waits on it; the replies to
/// the waiter's next `stalls` MGETs (its reads of the answer: its first
/// read is a script) are held back for `hold`, past its `op_timeout`
/// (250 ms). Its second read comes a third of the window (500 ms) after a
/// timeout. Returns both callers' answers, the origin's count and the
/// waiter's Redis timeouts.
async fn a_waiter_with_stalled_reads(stalls: usize, hold: Duration) -> ([Answer; 2], usize, f64) {
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route(
            "/stalled",
            cacheable("the leader's answer").delay(Duration::from_millis(800)),
        )
        .start()
        .await;
    let link = FaultProxy::start(redis.addr()).await;
    let config = |url: &str| {
        Config::new()
            .route(Route::new("api", origin.url()).coalesce("lock_timeout", "5s"))
            .redis(url)
            .redis_field("op_timeout", "250ms")
            .redis_field("lease_window", "1500ms")
            .redis_field("breaker", "{ failures: 5, open_for: 1s }")
    };
    let leader = Proxy::new(config(&redis.url())).start().await;
    let waiter = Proxy::new(config(&format!("redis://{}/0", link.addr())))
        .start()
        .await;
    let client = Client::new();
    let first = {
        let (client, url) = (client.clone(), leader.url("/stalled"));
        tokio::spawn(async move { client.get(&url).await })
    };
    origin.wait_hits("/stalled", 1, DEADLINE).await;
    link.stall(b"$4\r\nMGET\r\n", stalls, hold);
    let second = client.get(&waiter.url("/stalled")).await;
    let first = first.await.expect("the leader's caller");
    for answer in [&first, &second] {
        assert_eq!(
            (answer.status.as_u16(), answer.text()),
            (200, "the leader's answer".to_owned()),
            "{}",
            answer.cache_status()
        );
    }
    assert_eq!(link.stalls_left(), 0, "the waiter's reads were held back");
    let timeouts = counter(&waiter, "corral_redis_errors_total", &[("kind", "timeout")]).await;
    ([first, second], origin.hits("/stalled"), timeouts)
}

/// A waiting instance whose read after the leader's notice times out
/// (Redis slow, not gone: here the proxy holds back the reply to that one
/// read) reads once more instead of fetching alone: the origin is asked
/// once, and both instances' callers get the leader's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiters_read_that_times_out_is_retried_not_sent_to_the_origin() {
    let ([_, second], hits, timeouts) =
        a_waiter_with_stalled_reads(1, Duration::from_millis(600)).await;
    assert!(timeouts >= 1.0, "the held-back read timed out");
    assert_eq!(hits, 1, "{}", second.cache_status());
}

/// The retry is once: a waiting instance whose two reads both time out
/// fetches on its own (two origin requests), and its caller is answered,
/// not held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_reads_keep_timing_out_fetches_alone() {
    let ([_, second], hits, timeouts) =
        a_waiter_with_stalled_reads(2, Duration::from_secs(2)).await;
    assert!(timeouts >= 2.0, "both reads timed out");
    assert_eq!(hits, 2, "{}", second.cache_status());
}
