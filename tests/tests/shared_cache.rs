//! Shared cache: several corral instances and one Redis. A cold key reaches
//! the origin once across all of them (waiters woken by the fill notice),
//! what one instance fetched the others serve, leases are released only by
//! their owner and taken over when it dies, purges reach every instance, and
//! Redis failing (down at start, dying, frozen, holding garbage) never fails a
//! client request.

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::future::join_all;
use http::Method;
use tokio::time::Instant;

use corral_tests::shared::{
    cacheable, post_on_a_purges_b, spawn_bursts, wait_for_key, wait_no_lease, wait_shared_again,
};
use corral_tests::{
    Answer, Client, Config, DEADLINE, Origin, Proxy, Redis, Reply, Route, RunningOrigin,
    assert_every_answer, tally,
};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// How long the breaker stays open in the scenarios that break Redis; kept
/// short so that recovery fits in a test.
const BREAKER_OPEN_FOR: Duration = Duration::from_secs(1);

/// One route `api` for every path to `origin`, sharing `redis`. The Redis
/// deadline is raised from the 50 ms default: these machines are two shared
/// cores under a 1000-connection burst, and what is under test here is the
/// protocol, not the deadline (the frozen-Redis test sets its own).
fn shared(origin: &RunningOrigin, redis: &Redis) -> Config {
    Config::new()
        .route(Route::new("api", origin.url()))
        .redis(&redis.url())
        .redis_field("op_timeout", "250ms")
}

/// `shared` with a breaker that opens after 5 failures for [`BREAKER_OPEN_FOR`].
fn shared_with_short_breaker(origin: &RunningOrigin, redis: &Redis) -> Config {
    shared(origin, redis).redis_field(
        "breaker",
        &format!(
            "{{ failures: 5, open_for: {}ms }}",
            BREAKER_OPEN_FOR.as_millis()
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lab_thousand_requests_on_five_instances_reach_origin_once() {
    const INSTANCES: usize = 5;
    const PER_INSTANCE: usize = 200;
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route("/warm", Reply::ok("warm").delay(ms(300)))
        .route("/cold", cacheable("the one answer").delay(ms(300)))
        .start()
        .await;
    // Warm-up goes through an uncached route so that it opens connections
    // and nothing else: no key, no lease, no L2 entry.
    let config = shared(&origin, &redis).route(
        Route::new("warm", origin.url())
            .path_prefix("/warm")
            .cache("enabled", "false"),
    );
    let proxies = Proxy::new(config).instances(INSTANCES).start_all().await;
    let client = Client::new();
    // 200 connections per instance, opened before the burst so that it
    // measures coalescing and not how fast 1000 handshakes fit in 300ms.
    let warm_urls: Vec<String> = proxies.iter().map(|p| p.url("/warm")).collect();
    join_all(warm_urls.iter().map(|url| client.warm(PER_INSTANCE, url))).await;

    let per_proxy = spawn_bursts(&client, &proxies, PER_INSTANCE, "/cold")
        .await
        .expect("burst task");

    let answers: Vec<&Answer> = per_proxy.iter().flatten().collect();
    assert_eq!(answers.len(), INSTANCES * PER_INSTANCE);
    assert_eq!(
        origin.hits("/cold"),
        1,
        "answers: {:#?}",
        tally(answers.iter().copied())
    );
    assert_every_answer(answers.iter().copied(), 200, "the one answer");
    wait_no_lease(&redis, ms(2000)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_serves_what_another_fetched_from_the_shared_cache() {
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route("/doc", cacheable("fetched by A"))
        .start()
        .await;
    let proxies = Proxy::new(shared(&origin, &redis))
        .instances(2)
        .start_all()
        .await;
    let (a, b) = (&proxies[0], &proxies[1]);
    let client = Client::new();

    let first = client.get(&a.url("/doc")).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.text(), "fetched by A");
    assert!(first.cache_status().stored(), "{}", first.cache_status());

    let second = client.get(&b.url("/doc")).await;
    assert_eq!(second.status, 200);
    assert_eq!(second.text(), "fetched by A");
    let status = second.cache_status();
    assert!(
        status.is_hit(),
        "B answered from the shared cache: {status}"
    );
    assert!(status.fwd().is_none(), "{status}");
    assert_eq!(origin.hits("/doc"), 1, "B: {status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_the_leader_instance_dies_mid_fetch_a_waiter_takes_the_lease_over() {
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route("/slow", cacheable("slow answer").delay(ms(1500)))
        .start()
        .await;
    let config = Config::new()
        .route(Route::new("api", origin.url()).coalesce("lock_timeout", "5s"))
        .redis(&redis.url())
        .redis_field("lease_ttl", "1s");
    let mut proxies = Proxy::new(config).instances(5).start_all().await;
    let client = Client::new();

    let leader = {
        let (client, url) = (client.clone(), proxies[0].url("/slow"));
        tokio::spawn(async move { client.try_send(Method::GET, &url, &[], None).await })
    };
    origin.wait_hits("/slow", 1, DEADLINE).await;
    let lease = wait_for_key(&redis, "*:lease:*", DEADLINE).await;
    let followers = spawn_bursts(&client, &proxies[1..], 20, "/slow");
    // A dies holding the lease: nothing releases it, it has to expire.
    proxies[0].kill();
    let leader = leader.await.expect("leader task");
    assert!(
        leader.is_err(),
        "the killed instance cannot have answered: {leader:?}"
    );

    let per_proxy = followers.await.expect("burst task");
    let answers: Vec<&Answer> = per_proxy.iter().flatten().collect();
    assert_every_answer(answers.iter().copied(), 200, "slow answer");
    assert!(
        origin.hits("/slow") <= 2,
        "origin saw {} requests after the leader died (lease {lease}); answers: {:#?}",
        origin.hits("/slow"),
        tally(answers.iter().copied())
    );
    wait_no_lease(&redis, ms(2000)).await;
}

/// The leader dies in front of an origin slower than `lock_timeout` minus
/// `lease_ttl` (times scaled down from 3 s / 5 s / 2 s): the waiters on the
/// other instances do not give up at `lock_timeout` and fetch one each;
/// they wait while a live lease stands, one takes the dead leader's over
/// when it lapses, and every caller gets that one fetch's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_killed_in_front_of_a_slow_origin_costs_one_takeover_not_a_stampede() {
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route("/slow", cacheable("slow answer").delay(ms(2000)))
        .start()
        .await;
    // lease_ttl far past anything the test waits: only the 300 ms lease
    // window can hand the dead leader's lease on in time, before every
    // waiter's own bound (lock_timeout plus the exchange's total) sent
    // each instance to the origin.
    let config = Config::new()
        .route(Route::new("api", origin.url()).coalesce("lock_timeout", "1500ms"))
        .redis(&redis.url())
        .redis_field("lease_ttl", "60s")
        .redis_field("lease_window", "300ms");
    let mut proxies = Proxy::new(config).instances(5).start_all().await;
    let client = Client::new();

    let leader = {
        let (client, url) = (client.clone(), proxies[0].url("/slow"));
        tokio::spawn(async move { client.try_send(Method::GET, &url, &[], None).await })
    };
    origin.wait_hits("/slow", 1, DEADLINE).await;
    let lease = wait_for_key(&redis, "*:lease:*", DEADLINE).await;
    // The lease lives a window past its last renewal, not lease_ttl.
    let pttl = redis.pttl(&lease).await;
    assert!(
        (0..=300).contains(&pttl),
        "the lease {lease} has {pttl} ms to live"
    );
    let followers = spawn_bursts(&client, &proxies[1..], 10, "/slow");
    proxies[0].kill();
    assert!(leader.await.expect("leader task").is_err());

    let per_proxy = followers.await.expect("burst task");
    let answers: Vec<&Answer> = per_proxy.iter().flatten().collect();
    assert_eq!(answers.len(), 40);
    assert_every_answer(answers.iter().copied(), 200, "slow answer");
    assert_eq!(
        origin.hits("/slow"),
        2,
        "the dead leader's and one takeover's; answers: {:#?}",
        tally(answers.iter().copied())
    );
    wait_no_lease(&redis, ms(3000)).await;
}

/// Redis's command counts by name (`INFO commandstats`: what a script runs
/// is counted too).
async fn command_counts(redis: &Redis) -> BTreeMap<String, u64> {
    let info: String = redis
        .command(redis::cmd("INFO").arg("commandstats"), "INFO commandstats")
        .await;
    info.lines()
        .filter_map(|line| {
            let (name, stats) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = stats.split(',').find_map(|f| f.strip_prefix("calls="))?;
            Some((name.to_owned(), calls.parse().ok()?))
        })
        .collect()
}

/// The counts once the fill's leader has announced its end (its PUBLISH,
/// the last command it sends): its store and release are in them, and the
/// next fill's count starts clean.
async fn counts_after_notice(
    redis: &Redis,
    before: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let now = command_counts(redis).await;
        if now.get("publish") > before.get("publish") {
            return now;
        }
        assert!(
            Instant::now() < deadline,
            "no fill notice was published: {now:?}"
        );
        tokio::time::sleep(ms(10)).await;
    }
}

/// The commands Redis ran between two counts, less the test's own (INFO
/// and its connection's handshake) and the instances' heartbeats (every
/// 2 s each: a script and the five commands it runs, one of them the only
/// ZADD of a fill).
fn fill_cost(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> u64 {
    let ran =
        |name: &str| after.get(name).copied().unwrap_or(0) - before.get(name).copied().unwrap_or(0);
    let own = ["info", "hello", "client|setinfo", "select"];
    let all: u64 = after
        .keys()
        .filter(|k| !own.contains(&k.as_str()))
        .map(|k| ran(k))
        .sum();
    all - 6 * ran("zadd")
}

/// What grows with the fleet is a constant per waiting instance: the
/// lease attempt with the first read (one script and its MGET), and one
/// read when the leader's notice wakes it. The notice subscription is the
/// instance's, long-lived (no SUBSCRIBE / UNSUBSCRIBE per fill), and
/// nobody polls while an 800 ms origin answers. The same fill is counted
/// with `INFO commandstats` on one instance and on five: the four waiting
/// instances add at most 3 commands each (their waiting cost 10 or more
/// each, mostly MGET polls, before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_instance_costs_redis_at_most_three_commands_per_fill() {
    const INSTANCES: usize = 5;
    let redis = Redis::start().await;
    let mut origin = Origin::new()
        .route("/alone", cacheable("alone").delay(ms(800)))
        .route("/fleet", cacheable("fleet").delay(ms(800)));
    for i in 0..INSTANCES {
        origin = origin.route(&format!("/warm{i}"), cacheable("warm"));
    }
    let origin = origin.start().await;
    // A lease window of 3 s: the leader renews every 1 s, so none of its
    // renewals (a script, its GET and PEXPIRE, and an Alive notice) falls
    // within the 800 ms fill. With the default 1 s the fill holds two or
    // three of them, as the origin's timing falls, not the fleet's size,
    // and the comparison below would count that difference.
    let config = shared(&origin, &redis).redis_field("lease_window", "3s");
    let proxies = Proxy::new(config).instances(INSTANCES).start_all().await;
    let client = Client::new();
    // Each instance leads one fill first, so that every script a fill runs
    // is loaded everywhere: what is counted below is the fills alone.
    for (i, proxy) in proxies.iter().enumerate() {
        let warm = client.get(&proxy.url(&format!("/warm{i}"))).await;
        assert_eq!(warm.status, 200, "{}", warm.cache_status());
    }

    let before = command_counts(&redis).await;
    let one = client.burst(20, &proxies[0].url("/alone"), &[]).await;
    let between = counts_after_notice(&redis, &before).await;
    let alone = fill_cost(&before, &between);
    let before = between;
    let per_proxy = spawn_bursts(&client, &proxies, 20, "/fleet")
        .await
        .expect("burst task");
    let after = counts_after_notice(&redis, &before).await;
    let fleet = fill_cost(&before, &after);

    assert_every_answer(one.iter(), 200, "alone");
    let answers: Vec<&Answer> = per_proxy.iter().flatten().collect();
    assert_eq!(answers.len(), 20 * INSTANCES);
    assert_every_answer(answers.iter().copied(), 200, "fleet");
    assert_eq!(origin.hits("/alone"), 1);
    assert_eq!(
        origin.hits("/fleet"),
        1,
        "{:#?}",
        tally(answers.iter().copied())
    );
    let waiting = (INSTANCES - 1) as u64;
    println!("one instance: {alone} commands; {INSTANCES} instances: {fleet}");
    assert!(
        fleet <= alone + 3 * waiting,
        "one instance's fill cost {alone} commands, the same fill on {INSTANCES} cost {fleet}: \
         {:.1} per waiting instance; commands counted: {:?}",
        (fleet as f64 - alone as f64) / waiting as f64,
        after
            .iter()
            .map(|(k, v)| (k, v - before.get(k).copied().unwrap_or(0)))
            .filter(|(_, d)| *d > 0)
            .collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_lease_was_taken_over_does_not_release_the_new_owners_lease() {
    const OTHER_TOKEN: &[u8] = b"token-of-another-leader";
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route("/slow", cacheable("slow answer").delay(ms(2000)))
        .start()
        .await;
    let config = shared(&origin, &redis).redis_field("lease_ttl", "1s");
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();

    let pending = {
        let (client, url) = (client.clone(), proxy.url("/slow"));
        tokio::spawn(async move { client.get(&url).await })
    };
    origin.wait_hits("/slow", 1, DEADLINE).await;
    let lease = wait_for_key(&redis, "*:lease:*", DEADLINE).await;
    let own_token = redis.get_raw(&lease).await;
    // As if A's lease had expired and another instance had taken it.
    redis.set_raw(&lease, OTHER_TOKEN).await;

    let answer = pending.await.expect("request task");
    assert_eq!(answer.status, 200, "{}", answer.cache_status());
    assert_eq!(answer.text(), "slow answer");
    // The release (and any late watchdog extension) comes right after the
    // fill, with no event to wait on: watch the lease for a while instead.
    let watch_until = Instant::now() + ms(500);
    while Instant::now() < watch_until {
        let now = redis.get_raw(&lease).await;
        assert_eq!(
            now.as_deref(),
            Some(OTHER_TOKEN),
            "A released or rewrote a lease it no longer owned ({lease}, A's token was {:?})",
            own_token.as_deref().map(String::from_utf8_lossy)
        );
        tokio::time::sleep(ms(10)).await;
    }
    assert_eq!(origin.hits("/slow"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_dying_mid_burst_costs_at_most_one_fetch_per_instance_and_no_errors() {
    let mut redis = Redis::start().await;
    let origin = Origin::new()
        .route("/cold", cacheable("still served").delay(ms(300)))
        .start()
        .await;
    let proxies = Proxy::new(shared_with_short_breaker(&origin, &redis))
        .instances(5)
        .start_all()
        .await;
    let client = Client::new();

    let bursts = spawn_bursts(&client, &proxies, 40, "/cold");
    origin.wait_hits("/cold", 1, DEADLINE).await;
    redis.kill();

    let per_proxy = bursts.await.expect("burst task");
    let answers: Vec<&Answer> = per_proxy.iter().flatten().collect();
    assert_every_answer(answers.iter().copied(), 200, "still served");
    assert!(
        origin.hits("/cold") <= 5,
        "origin saw {} requests; answers: {:#?}",
        origin.hits("/cold"),
        tally(answers.iter().copied())
    );

    // A fresh Redis on the same port: entries are shared again, and so are
    // purges, which need each instance's subscriber to have come back.
    redis.restart().await;
    let (a, b) = (&proxies[0], &proxies[1]);
    let path = wait_shared_again(&origin, &client, a, b, BREAKER_OPEN_FOR + ms(4000)).await;
    post_on_a_purges_b(&origin, &client, a, b, &path, "purged after the restart").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_delays_no_answer_and_is_used_again_once_it_thaws() {
    const ANSWER_WITHIN: Duration = Duration::from_secs(5);
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route("/frozen", cacheable("served without redis"))
        .start()
        .await;
    let proxies =
        Proxy::new(shared_with_short_breaker(&origin, &redis).redis_field("op_timeout", "50ms"))
            .instances(2)
            .start_all()
            .await;
    let client = Client::new();

    redis.pause();
    let urls: Vec<String> = proxies.iter().map(|p| p.url("/frozen")).collect();
    let answers = join_all(urls.iter().map(|url| {
        let client = client.clone();
        async move {
            let started = Instant::now();
            let answers = tokio::time::timeout(ANSWER_WITHIN, client.burst(10, url, &[]))
                .await
                .unwrap_or_else(|_| {
                    panic!("GETs of {url} not all answered within {ANSWER_WITHIN:?} while Redis was frozen")
                });
            (answers, started.elapsed())
        }
    }))
    .await;
    redis.resume();

    for (url, (answers, took)) in urls.iter().zip(&answers) {
        for answer in answers {
            assert_eq!(
                answer.status,
                200,
                "{url} (took {took:?}): {:#?}",
                tally(answers)
            );
            assert_eq!(answer.text(), "served without redis");
        }
    }

    wait_shared_again(
        &origin,
        &client,
        &proxies[0],
        &proxies[1],
        BREAKER_OPEN_FOR + ms(4000),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_on_one_instance_invalidates_the_stored_get_on_every_instance() {
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route("/item", cacheable("item v1"))
        .route_method(Method::POST, "/item", Reply::status(201, "created"))
        .start()
        .await;
    let proxies = Proxy::new(shared(&origin, &redis))
        .instances(2)
        .start_all()
        .await;
    let (a, b) = (&proxies[0], &proxies[1]);
    let client = Client::new();

    assert_eq!(client.get(&a.url("/item")).await.text(), "item v1");
    assert_eq!(client.get(&b.url("/item")).await.text(), "item v1");
    let held = client.get(&b.url("/item")).await;
    assert!(held.cache_status().is_hit(), "{}", held.cache_status());
    assert_eq!(origin.hits("/item"), 1, "stored once, shared by B");

    let seen = post_on_a_purges_b(&origin, &client, a, b, "/item", "item v2").await;
    assert_eq!(
        origin.hits("/item"),
        3,
        "the GET, the POST, and B's GET after it; B saw {seen:#?}"
    );
    let after_on_a = client.get(&a.url("/item")).await;
    assert_eq!(
        after_on_a.text(),
        "item v2",
        "{}",
        after_on_a.cache_status()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_shared_entry_is_a_miss_not_an_error() {
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route("/doc", cacheable("the real document"))
        .start()
        .await;
    let proxies = Proxy::new(shared(&origin, &redis))
        .instances(4)
        .start_all()
        .await;
    let client = Client::new();

    let filled = client.get(&proxies[0].url("/doc")).await;
    assert_eq!(filled.text(), "the real document");
    let entry = wait_for_key(&redis, "*:e:*", DEADLINE).await;
    wait_no_lease(&redis, ms(2000)).await;
    let real = redis.get_raw(&entry).await.expect("the entry written by A");
    // An authentication tag (32 bytes), then a CRL version-1 envelope.
    assert_eq!(
        envelope_at(&real),
        32,
        "an L2 entry is a tag and a CRL version-1 envelope; {entry} starts with {:?}",
        String::from_utf8_lossy(&real[..real.len().min(40)])
    );

    // Each corruption is read by an instance with no copy of its own.
    let corruptions: [(&str, Vec<u8>); 3] = [
        ("garbage", b"this is not an envelope".to_vec()),
        (
            "an unknown version",
            [&b"CRL\xfe"[..], &real[36..]].concat(),
        ),
        ("a truncated envelope", real[..real.len() / 2].to_vec()),
    ];
    for ((what, bytes), proxy) in corruptions.iter().zip(&proxies[1..]) {
        redis.set_raw(&entry, bytes).await;
        let answer = client.get(&proxy.url("/doc")).await;
        assert_eq!(
            answer.status,
            200,
            "with {what} in {entry}: {}",
            answer.cache_status()
        );
        assert_eq!(answer.text(), "the real document", "with {what} in {entry}");
        wait_no_lease(&redis, ms(2000)).await;
    }
    assert!(
        origin.hits("/doc") <= 4,
        "one fill plus at most one refetch per corruption, saw {}",
        origin.hits("/doc")
    );
}

/// Where the envelope starts in a value read from L2: after the
/// authentication tag, if the instances write one.
fn envelope_at(value: &[u8]) -> usize {
    value
        .windows(4)
        .position(|w| w == b"CRL\x01")
        .expect("an L2 entry holds a CRL version-1 envelope")
}

/// A third party that can write to Redis but has no key rewrites an entry:
/// a well-formed envelope with forged content, under the stale tag, with
/// no tag and with a made-up tag. No instance serves it: each read is a
/// miss that asks the origin again, and the client gets the real answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_forged_in_redis_is_not_served_by_another_instance() {
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route("/doc", cacheable("the real document"))
        .start()
        .await;
    let proxies = Proxy::new(shared(&origin, &redis))
        .instances(4)
        .start_all()
        .await;
    let client = Client::new();

    let filled = client.get(&proxies[0].url("/doc")).await;
    assert_eq!(filled.text(), "the real document");
    let entry = wait_for_key(&redis, "*:e:*", DEADLINE).await;
    wait_no_lease(&redis, ms(2000)).await;
    assert_eq!(origin.hits("/doc"), 1);

    let forge = |real: &[u8]| {
        let at = envelope_at(real);
        // Same length, so every length field of the envelope stays right.
        let body_at = real
            .windows(17)
            .rposition(|w| w == b"the real document")
            .expect("the body in the envelope");
        let mut forged = real[at..].to_vec();
        forged[body_at - at..body_at - at + 17].copy_from_slice(b"the fake document");
        (real[..at].to_vec(), forged)
    };
    // How each forgery is put together from (tag, forged envelope).
    type Assemble = fn(Vec<u8>, Vec<u8>) -> Vec<u8>;
    let forgeries: [(&str, Assemble); 3] = [
        ("under the real entry's tag", |tag, env| [tag, env].concat()),
        ("with no tag", |_, env| env),
        ("under a made-up tag", |_, env| {
            [vec![0x5a; 32], env].concat()
        }),
    ];
    for (n, ((what, make), proxy)) in forgeries.iter().zip(&proxies[1..]).enumerate() {
        // Each time from the entry a real fill wrote, so the forgery is one
        // edit away from something valid.
        let real = redis.get_raw(&entry).await.expect("the entry a fill wrote");
        let (tag, envelope) = forge(&real);
        redis.set_raw(&entry, &make(tag, envelope)).await;
        let answer = client.get(&proxy.url("/doc")).await;
        assert_eq!(
            answer.text(),
            "the real document",
            "an entry forged {what} was served ({})",
            answer.cache_status()
        );
        assert_eq!(
            answer.status,
            200,
            "forged {what}: {}",
            answer.cache_status()
        );
        assert_eq!(
            origin.hits("/doc"),
            2 + n,
            "an entry forged {what} is a miss: the origin is asked again"
        );
        wait_no_lease(&redis, ms(2000)).await;
    }
    let metrics = client.get(&proxies[1].admin_url("/metrics")).await.text();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("corral_redis_unauthenticated_records_total{kind=\"entry\"} ")),
        "refused entries are counted:\n{metrics}"
    );
}

/// The instance names in `/stats?fleet=1` of `proxy`, and the body's size.
async fn fleet_names(client: &Client, proxy: &corral_tests::RunningProxy) -> (Vec<String>, usize) {
    let body = client.get(&proxy.admin_url("/stats?fleet=1")).await.text();
    let fleet: serde_json::Value = serde_json::from_str(&body).expect("the fleet view is JSON");
    let mut names: Vec<String> = fleet["instances"]
        .as_array()
        .expect("instances")
        .iter()
        .map(|i| i["instance"].as_str().expect("a name").to_owned())
        .collect();
    names.sort();
    (names, body.len())
}

/// Heartbeats planted in Redis by a third party (one of 16 MiB, one
/// well-formed but unsealed, one real heartbeat copied under another name)
/// are skipped: the fleet view lists the real instances only and stays the
/// size of their summaries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_heartbeats_neither_appear_in_nor_bloat_the_fleet_view() {
    let redis = Redis::start().await;
    let origin = Origin::new().route("/a", cacheable("a")).start().await;
    let proxies = Proxy::new(shared(&origin, &redis))
        .instances(2)
        .start_all()
        .await;
    let client = Client::new();
    let deadline = Instant::now() + DEADLINE;
    let (real, honest_size) = loop {
        let (names, size) = fleet_names(&client, &proxies[0]).await;
        if names.len() == 2 {
            break (names, size);
        }
        assert!(
            Instant::now() < deadline,
            "the fleet never listed both: {names:?}"
        );
        tokio::time::sleep(ms(200)).await;
    };
    let roll = wait_for_key(&redis, "*{fleet}:members", DEADLINE).await;
    let prefix = roll.trim_end_matches("members");
    let beat = redis
        .get_raw(&format!("{prefix}i:{}", real[0]))
        .await
        .expect("a live heartbeat");
    let json_at = beat
        .iter()
        .position(|&b| b == b'{')
        .expect("a JSON summary");
    let unsealed = String::from_utf8_lossy(&beat[json_at..]).replace(&real[0], "evil-unsealed");
    let planted: [(&str, Vec<u8>); 3] = [
        ("evil-huge", vec![b'x'; 16 << 20]),
        ("evil-unsealed", unsealed.into_bytes()),
        ("evil-copied", beat.clone()),
    ];
    for (name, value) in &planted {
        redis.set_raw(&format!("{prefix}i:{name}"), value).await;
        let _: i64 = redis
            .command(
                ::redis::cmd("ZADD").arg(&roll).arg(u64::MAX / 2).arg(*name),
                "ZADD",
            )
            .await;
    }
    for proxy in &proxies {
        let started = Instant::now();
        let (names, size) = fleet_names(&client, proxy).await;
        assert_eq!(names, real, "only the real instances are listed");
        assert!(
            size < honest_size * 2 + 4096,
            "the fleet view grew from {honest_size} to {size} bytes"
        );
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the fleet view took {:?}",
            started.elapsed()
        );
    }
    let metrics = client.get(&proxies[0].admin_url("/metrics")).await.text();
    assert!(
        metrics
            .lines()
            .any(|l| l
                .starts_with("corral_redis_unauthenticated_records_total{kind=\"heartbeat\"} ")),
        "skipped heartbeats are counted:\n{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_on_other_instances_are_woken_by_the_fill_notice_not_a_poll() {
    // The safety-net poll of a waiter backs off to a few hundred ms; a waiter
    // woken by the fill notice answers within milliseconds of the leader.
    const WOKEN_WITHIN: Duration = Duration::from_millis(100);
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route("/slow", cacheable("worth the wait").delay(ms(1500)))
        .start()
        .await;
    let proxies = Proxy::new(shared(&origin, &redis))
        .instances(5)
        .start_all()
        .await;
    let client = Client::new();

    let leader = {
        let (client, url) = (client.clone(), proxies[0].url("/slow"));
        tokio::spawn(async move {
            let answer = client.get(&url).await;
            (answer, Instant::now())
        })
    };
    origin.wait_hits("/slow", 1, DEADLINE).await;
    let urls: Vec<String> = proxies[1..].iter().map(|p| p.url("/slow")).collect();
    let followers = join_all(urls.iter().map(|url| {
        let client = client.clone();
        async move {
            let answers = client.burst(5, url, &[]).await;
            (answers, Instant::now())
        }
    }))
    .await;
    let (leader, leader_done) = leader.await.expect("leader task");

    assert_eq!(leader.text(), "worth the wait");
    let mut lags = Vec::new();
    for (answers, done) in &followers {
        for answer in answers {
            assert_eq!(answer.status, 200, "{:#?}", tally(answers));
            assert_eq!(answer.text(), "worth the wait");
        }
        lags.push(done.saturating_duration_since(leader_done));
    }
    assert_eq!(origin.hits("/slow"), 1);
    assert!(
        lags.iter().all(|lag| *lag <= WOKEN_WITHIN),
        "instances B..E answered {lags:?} after the leader's answer, more than {WOKEN_WITHIN:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_start_and_serve_while_redis_is_down_and_share_once_it_is_up() {
    let mut redis = Redis::start().await;
    redis.kill();
    let origin = Origin::new()
        .route("/early", cacheable("served before redis"))
        .start()
        .await;
    let proxies = Proxy::new(shared_with_short_breaker(&origin, &redis))
        .without_waiting_for_redis()
        .instances(2)
        .start_all()
        .await;
    let client = Client::new();

    for proxy in &proxies {
        let answer = client.get(&proxy.url("/early")).await;
        assert_eq!(answer.status, 200, "{}", answer.cache_status());
        assert_eq!(answer.text(), "served before redis");
    }

    redis.restart().await;
    wait_shared_again(
        &origin,
        &client,
        &proxies[0],
        &proxies[1],
        BREAKER_OPEN_FOR + ms(4000),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_redis_key_starts_with_the_configured_prefix() {
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route("/doc", cacheable("prefixed"))
        .route(
            "/varied",
            cacheable("varied").header("vary", "accept-encoding"),
        )
        .start()
        .await;
    let config = shared(&origin, &redis).redis_field("key_prefix", "\"team-a:\"");
    let proxies = Proxy::new(config).instances(2).start_all().await;
    let client = Client::new();

    for path in ["/doc", "/varied"] {
        client.get(&proxies[0].url(path)).await;
        let shared = client.get(&proxies[1].url(path)).await;
        assert!(
            shared.cache_status().is_hit(),
            "{path}: {}",
            shared.cache_status()
        );
    }
    let keys = redis.keys("*").await;
    assert!(
        keys.iter().any(|k| k.contains(":e:")),
        "entries are stored: {keys:?}"
    );
    assert!(
        keys.iter().all(|k| k.starts_with("team-a:{")),
        "keys outside the prefix: {keys:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_larger_than_l2_max_object_size_stays_out_of_redis() {
    let big = "x".repeat(64 * 1024);
    let redis = Redis::start().await;
    let origin = Origin::new().route("/big", cacheable(&big)).start().await;
    let config = shared(&origin, &redis).redis_field("l2_max_object_size", "16KiB");
    let proxies = Proxy::new(config).instances(2).start_all().await;
    let client = Client::new();

    let first = client.get(&proxies[0].url("/big")).await;
    assert_eq!(first.body.len(), big.len());
    let again_on_a = client.get(&proxies[0].url("/big")).await;
    assert!(
        again_on_a.cache_status().is_hit(),
        "A keeps it in L1: {}",
        again_on_a.cache_status()
    );
    wait_no_lease(&redis, ms(2000)).await;
    let on_b = client.get(&proxies[1].url("/big")).await;
    assert_eq!(on_b.status, 200);
    assert_eq!(on_b.body.len(), big.len());
    assert!(
        !on_b.cache_status().is_hit(),
        "B cannot have it from Redis: {}",
        on_b.cache_status()
    );
    assert_eq!(origin.hits("/big"), 2);
    assert!(
        redis.keys("*:e:*").await.is_empty(),
        "no entry in Redis: {:?}",
        redis.keys("*").await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_error_does_not_queue_the_instances_one_behind_another() {
    const INSTANCES: usize = 5;
    const DELAY: Duration = Duration::from_millis(500);
    // A leader's own fetch plus one more round for everyone told "no entry
    // is coming" is 2 × DELAY; instances that each wait for the previous
    // one's lease before fetching take INSTANCES × DELAY.
    let bound = DELAY * 7 / 2;
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route("/fail", Reply::status(500, "kaput").delay(DELAY))
        .start()
        .await;
    let proxies = Proxy::new(shared(&origin, &redis))
        .instances(INSTANCES)
        .start_all()
        .await;
    let client = Client::new();

    let urls: Vec<String> = proxies.iter().map(|p| p.url("/fail")).collect();
    let started = Instant::now();
    let per_proxy = join_all(urls.iter().map(|url| {
        let client = client.clone();
        async move {
            let answers = client.burst(10, url, &[]).await;
            (answers, started.elapsed())
        }
    }))
    .await;

    let answers: Vec<&Answer> = per_proxy.iter().flat_map(|(a, _)| a).collect();
    // The leader's waiters share its 500; the other instances, told it
    // failed, read its back-off and leave the origin alone (503 backoff).
    for a in &answers {
        let shared = a.status == 500 && a.text() == "kaput";
        let backed_off = a.status == 503 && a.cache_status().detail() == Some("backoff");
        assert!(
            shared || backed_off,
            "{:#?}",
            tally(answers.iter().copied())
        );
    }
    assert!(
        origin.hits("/fail") <= INSTANCES,
        "at most one fetch per instance, saw {}: {:#?}",
        origin.hits("/fail"),
        tally(answers.iter().copied())
    );
    let finished: Vec<Duration> = per_proxy.iter().map(|(_, took)| *took).collect();
    assert!(
        finished.iter().all(|took| *took < bound),
        "instances answered after {finished:?} (origin delay {DELAY:?}, bound {bound:?}): \
         they queued behind each other's lease for an answer none could store"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_coalescing_disabled_redis_coalesces_nothing_but_still_caches() {
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route("/cold", cacheable("cold").delay(ms(300)))
        .start()
        .await;
    let config = Config::new()
        .route(Route::new("api", origin.url()).coalesce("enabled", "false"))
        .redis(&redis.url())
        .redis_field("op_timeout", "250ms");
    let proxies = Proxy::new(config).instances(2).start_all().await;
    let client = Client::new();

    // Coalescing off means off in both tiers: ten concurrent misses are ten
    // origin requests, with Redis as without it.
    let answers = client.burst(10, &proxies[0].url("/cold"), &[]).await;
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
    let leases = corral_tests::lifecycle::scrape(&proxies[0])
        .await
        .sum("corral_lease_total", &[]);
    assert_eq!(
        leases, 0.0,
        "no fill that does not coalesce takes the lease"
    );

    // Redis is still a cache: the other instance serves what was stored.
    // Without a lease nothing tells B that a fill is under way, and the
    // write to Redis may land after the answers went out, so wait for the
    // entry before asking B.
    wait_for_key(&redis, "*:e:*", DEADLINE).await;
    let b = client.get(&proxies[1].url("/cold")).await;
    assert_eq!(b.text(), "cold");
    assert!(b.cache_status().is_hit(), "{}", b.cache_status());
    assert_eq!(origin.hits("/cold"), 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_held_past_lock_age_is_taken_over_by_a_waiting_instance() {
    let redis = Redis::start().await;
    // The first fetch hangs for 20 s; any later one answers at once.
    let origin = Origin::new()
        .route("/stuck", cacheable("late").delay(Duration::from_secs(20)))
        .start()
        .await;
    let config = |o: &RunningOrigin| {
        Config::new()
            .route(
                Route::new("api", o.url())
                    .coalesce("lock_timeout", "15s")
                    .coalesce("lock_age", "1s"),
            )
            .redis(&redis.url())
            .redis_field("op_timeout", "250ms")
    };
    let proxies = Proxy::new(config(&origin)).instances(2).start_all().await;
    let (a, b) = (&proxies[0], &proxies[1]);
    let client = Client::new();
    let stuck = {
        let (client, url) = (client.clone(), a.url("/stuck"));
        tokio::spawn(async move { client.get(&url).await })
    };
    origin.wait_hits("/stuck", 1, DEADLINE).await;
    wait_for_key(&redis, "*:lease:*", DEADLINE).await;
    origin.set_route("/stuck", cacheable("prompt"));
    let started = Instant::now();
    let answer = client.get(&b.url("/stuck")).await;
    assert_eq!(
        (answer.status.as_u16(), answer.text()),
        (200, "prompt".to_owned())
    );
    // B waited for the lease to reach 1 s, then took it over: not the
    // 20 s fetch, not the 15 s lock timeout.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(origin.hits("/stuck"), 2);
    stuck.abort();
}

/// No-Vary-Search across instances: A learns the path's rule from the
/// origin and records it in Redis; B, which never saw an answer of the
/// path, reads it there on its first miss. A thousand concurrent
/// requests on both, in 50 query strings that differ only in the
/// parameters the rule names (and their order), are one flight for the
/// fleet: the origin is asked once (for one of those URLs, whole).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_vary_search_makes_fifty_utm_variants_one_fetch_for_the_fleet() {
    const PER_INSTANCE: usize = 500;
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route("/warm", Reply::ok("warm").delay(ms(300)))
        .route(
            "/search",
            // An application that reads only `q`, and says so.
            Reply::from_request(|req| {
                let q = req
                    .query()
                    .unwrap_or_default()
                    .split('&')
                    .find(|p| p.starts_with("q="))
                    .unwrap_or_default()
                    .to_owned();
                format!("query:{q}")
            })
            .header("cache-control", "max-age=60")
            .header(
                "no-vary-search",
                r#"key-order, params=("utm_source" "utm_medium" "fbclid")"#,
            )
            .delay(ms(300)),
        )
        .start()
        .await;
    let config = Config::new()
        .route(
            Route::new("api", origin.url())
                .path_prefix("/search")
                .cache("no_vary_search", "true"),
        )
        .route(
            Route::new("warm", origin.url())
                .path_prefix("/warm")
                .cache("enabled", "false"),
        )
        .redis(&redis.url())
        .redis_field("op_timeout", "250ms");
    let proxies = Proxy::new(config).instances(2).start_all().await;
    let (a, b) = (&proxies[0], &proxies[1]);
    let client = Client::new();

    // A learns the rule from one answer of the path.
    let taught = client.get(&a.url("/search?q=teach")).await;
    assert_eq!(taught.text(), "query:q=teach");
    let record = wait_for_key(&redis, "*:nvs", ms(2000)).await;
    // After its authentication tag (64 hex digits).
    let recorded = redis.get_raw(&record).await.expect("the rule record");
    assert_eq!(
        recorded.get(64..),
        Some(&br#"key-order, params=("fbclid" "utm_medium" "utm_source")"#[..]),
        "the rule as recorded for every instance"
    );

    let warm_urls: Vec<String> = proxies.iter().map(|p| p.url("/warm")).collect();
    join_all(warm_urls.iter().map(|url| client.warm(PER_INSTANCE, url))).await;

    // 50 query strings: one `q`, utm values and orders that vary.
    let variant = |i: usize| match i % 3 {
        0 => format!("/search?utm_source=s{i}&q=shoes"),
        1 => format!("/search?q=shoes&utm_medium=m{i}&utm_source=s{i}"),
        _ => format!("/search?fbclid=f{i}&q=shoes&utm_medium=m{i}"),
    };
    let tasks: Vec<_> = (0..2 * PER_INSTANCE)
        .map(|i| {
            let url = [a, b][i % 2].url(&variant(i % 50));
            let client = client.clone();
            tokio::spawn(async move { client.get(&url).await })
        })
        .collect();
    let mut answers = Vec::with_capacity(tasks.len());
    for task in tasks {
        answers.push(task.await.expect("request task"));
    }
    assert_every_answer(answers.iter(), 200, "query:q=shoes");
    assert_eq!(
        origin.hits("/search"),
        2,
        "the teaching request, then one for the thousand: {:#?}",
        tally(answers.iter())
    );
    let asked: Vec<String> = origin
        .requests("/search")
        .iter()
        .map(|r| r.query().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(asked[0], "q=teach");
    // One of the thousand URLs, asked whole.
    assert!(
        (0..50).any(|i| variant(i) == format!("/search?{}", asked[1])),
        "{asked:?}"
    );

    // A parameter the rule does not name still matters, on both.
    for (proxy, q) in [(a, "boots"), (b, "sandals")] {
        let other = client
            .get(&proxy.url(&format!("/search?q={q}&utm_source=x")))
            .await;
        assert_eq!(other.text(), format!("query:q={q}"));
    }
    assert_eq!(origin.hits("/search"), 4);
    wait_no_lease(&redis, ms(2000)).await;
}

/// A caller that waited on another instance's fetch was collapsed onto
/// it, and says so: `collapsed` with `detail=l2` in Cache-Status, and in
/// `corral_requests_total{cache="collapsed"}` (it was counted as a hit).
/// A caller that arrives once the entry is stored is still a hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_on_another_instances_fetch_is_counted_as_collapsed() {
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route("/slow", cacheable("one answer").delay(ms(800)))
        .start()
        .await;
    let proxies = Proxy::new(shared(&origin, &redis))
        .instances(2)
        .start_all()
        .await;
    let (a, b) = (&proxies[0], &proxies[1]);
    let client = Client::new();
    let a_url = a.url("/slow");
    let (led, waited) = tokio::join!(client.get(&a_url), async {
        corral_tests::eventually(DEADLINE, "A's fetch under way", || async {
            origin.hits("/slow") == 1
        })
        .await;
        client.get(&b.url("/slow")).await
    });
    assert_eq!(led.text(), "one answer");
    assert_eq!(waited.text(), "one answer");
    let st = waited.cache_status();
    assert!(st.collapsed() && !st.is_hit(), "{st}");
    assert_eq!(st.detail(), Some("l2"), "{st}");
    let scraped = corral_tests::lifecycle::scrape(b).await;
    let count = |cache: &str| {
        scraped.sum(
            "corral_requests_total",
            &[("route", "api"), ("cache", cache)],
        )
    };
    assert_eq!((count("collapsed"), count("hit")), (1.0, 0.0));
    // On a third instance's view: the entry is stored, a plain hit.
    let later = client.get(&b.url("/slow")).await;
    assert!(later.cache_status().is_hit(), "{}", later.cache_status());
    assert_eq!(origin.hits("/slow"), 1);
}
