//! The shared cache on Redis as production deploys it: a six-node Redis (or
//! Valkey) Cluster and a Sentinel deployment. The lab (five instances, a
//! thousand concurrent requests on one cold key) reaches the origin once on
//! each; a primary killed mid-burst costs no client an error, and corral
//! uses the cluster again after the failover (on the very slot that moved);
//! with Sentinel, corral follows the master the sentinels promote; a slot
//! moving between primaries mid-traffic costs no client an error, and a
//! frozen primary opens its own breaker while the other shards stay in use.

use std::time::Duration;

use futures_util::future::join_all;
use tokio::time::Instant;

use corral_tests::lifecycle::scrape;
use corral_tests::shared::{
    cacheable, post_on_a_purges_b, spawn_bursts, wait_for_key, wait_no_lease, wait_shared_again,
};
use corral_tests::{
    Answer, Client, Config, DEADLINE, Keyspace, Origin, Proxy, Redis, RedisCluster, RedisSentinels,
    Reply, Route, RunningOrigin, RunningProxy, assert_every_answer, eventually, tally,
};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

const INSTANCES: usize = 5;
const PER_INSTANCE: usize = 200;
const BREAKER_OPEN_FOR: Duration = Duration::from_secs(1);

/// One route `api` to `origin` and an uncached `warm` route, with the
/// `redis:` fields given (`cluster: […]` or `sentinel: {…}`) and a short
/// breaker. The Redis deadline is raised from the 50 ms default, as in
/// shared_cache.rs: two shared cores under a 1000-connection burst.
fn config(origin: &RunningOrigin, servers: (&str, String)) -> Config {
    Config::new()
        .route(Route::new("api", origin.url()))
        .route(
            Route::new("warm", origin.url())
                .path_prefix("/warm")
                .cache("enabled", "false"),
        )
        .redis_field(servers.0, &servers.1)
        .redis_field("op_timeout", "250ms")
        .redis_field(
            "breaker",
            &format!(
                "{{ failures: 5, open_for: {}ms }}",
                BREAKER_OPEN_FOR.as_millis()
            ),
        )
}

/// The five instances of the lab, started and connected to Redis.
async fn fleet(origin: &RunningOrigin, servers: (&str, String)) -> Vec<RunningProxy> {
    Proxy::new(config(origin, servers))
        .instances(INSTANCES)
        .start_all()
        .await
}

fn yaml_list(items: &[String]) -> String {
    format!("[{}]", items.join(", "))
}

/// The lab: 200 connections per instance opened first (through the
/// uncached route), then 200 concurrent GETs of `path` on each of the five
/// instances. Asserts one origin request and one body for all 1000.
async fn lab(origin: &RunningOrigin, client: &Client, proxies: &[RunningProxy], path: &str) {
    let warm_urls: Vec<String> = proxies.iter().map(|p| p.url("/warm")).collect();
    join_all(warm_urls.iter().map(|url| client.warm(PER_INSTANCE, url))).await;
    let per_proxy = spawn_bursts(client, proxies, PER_INSTANCE, path)
        .await
        .expect("burst task");
    let answers: Vec<&Answer> = per_proxy.iter().flatten().collect();
    assert_eq!(answers.len(), INSTANCES * PER_INSTANCE);
    assert_eq!(
        origin.hits(path),
        1,
        "{path}: answers: {:#?}",
        tally(answers.iter().copied())
    );
    assert_every_answer(answers.iter().copied(), 200, "the one answer");
}

async fn readyz(client: &Client, proxy: &RunningProxy) -> String {
    client.get(&proxy.admin_url("/readyz")).await.text()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lab_on_a_six_node_cluster_reaches_origin_once_with_sharded_notices() {
    let cluster = RedisCluster::start().await;
    let origin = Origin::new()
        .route("/warm", Reply::ok("warm"))
        .route("/cold", cacheable("the one answer").delay(ms(600)))
        .start()
        .await;
    let proxies = fleet(&origin, ("cluster", yaml_list(&cluster.seeds()))).await;
    let client = Client::new();
    assert!(
        readyz(&client, &proxies[0])
            .await
            .contains(r#""redis":"connected","redis_mode":"cluster""#)
    );

    // While the leader fetches, the instances listen on the fleet's 16
    // notice channels, sharded (each on the primary that owns its slot),
    // and on no classic notice channel of any node.
    let watch_channels = async {
        let lease = wait_for_key(&cluster, "*:lease:*", DEADLINE).await;
        let owner = cluster.primary_of(&lease).await;
        let deadline = Instant::now() + DEADLINE;
        loop {
            let mut sharded: Vec<String> = Vec::new();
            for i in 0..6 {
                let on_node: Vec<String> = cluster
                    .node(i)
                    .command(
                        redis::cmd("PUBSUB").arg("SHARDCHANNELS").arg("*notice*"),
                        "PUBSUB SHARDCHANNELS",
                    )
                    .await;
                sharded.extend(on_node);
            }
            sharded.sort();
            sharded.dedup();
            if sharded.len() == 16 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the 16 sharded notice channels are not all subscribed: {sharded:?}"
            );
            tokio::time::sleep(ms(20)).await;
        }
        for i in 0..6 {
            for pattern in ["*notice*", "*:fill:*"] {
                let classic: Vec<String> = cluster
                    .node(i)
                    .command(
                        redis::cmd("PUBSUB").arg("CHANNELS").arg(pattern),
                        "PUBSUB CHANNELS",
                    )
                    .await;
                assert!(
                    classic.is_empty(),
                    "node {i}: classic notice channels {classic:?}"
                );
            }
        }
        (lease, owner)
    };
    let ((), (lease, owner)) =
        tokio::join!(lab(&origin, &client, &proxies, "/cold"), watch_channels);
    wait_no_lease(&cluster, ms(2000)).await;
    let entry = lease.replace(":lease:", ":e:");
    assert_eq!(cluster.keys("*:e:*").await, std::slice::from_ref(&entry));
    assert_eq!(cluster.primary_of(&entry).await, owner, "one slot per key");

    // A purge on one instance reaches another (the invalidation script
    // runs on the key's slot, the notice on the classic channel).
    post_on_a_purges_b(
        &origin,
        &client,
        &proxies[1],
        &proxies[3],
        "/cold",
        "purged on the cluster",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_killed_mid_burst_costs_no_error_and_its_slot_is_used_again_after_failover() {
    let mut cluster = RedisCluster::start().await;
    let origin = Origin::new()
        .route("/cold", cacheable("still served").delay(ms(600)))
        .start()
        .await;
    let proxies = fleet(&origin, ("cluster", yaml_list(&cluster.seeds()))).await;
    let client = Client::new();

    let bursts = spawn_bursts(&client, &proxies, 40, "/cold");
    origin.wait_hits("/cold", 1, DEADLINE).await;
    let lease = wait_for_key(&cluster, "*:lease:*", DEADLINE).await;
    let slot = cluster.slot(&lease).await;
    let primary = cluster.primary_of(&lease).await;
    cluster.kill(primary);

    let per_proxy = bursts.await.expect("burst task");
    let answers: Vec<&Answer> = per_proxy.iter().flatten().collect();
    assert_eq!(answers.len(), INSTANCES * 40);
    assert_every_answer(answers.iter().copied(), 200, "still served");
    assert!(
        origin.hits("/cold") <= INSTANCES,
        "origin saw {} requests; answers: {:#?}",
        origin.hits("/cold"),
        tally(answers.iter().copied())
    );

    let promoted = cluster.wait_failover(slot, primary, ms(15_000)).await;
    // Shared again (the breaker closed, the client found the new map) ...
    let (a, b, c) = (&proxies[0], &proxies[1], &proxies[2]);
    wait_shared_again(&origin, &client, a, b, BREAKER_OPEN_FOR + ms(10_000)).await;
    // ... and on the slot that failed over: a purge of /cold runs there,
    // B refetches and stores it on the promoted replica, C reads it back.
    post_on_a_purges_b(&origin, &client, a, b, "/cold", "after the failover").await;
    let hits = origin.hits("/cold");
    let entry = lease.replace(":lease:", ":e:");
    wait_for_key(cluster.node(promoted), &entry, DEADLINE).await;
    let from_c = client.get(&c.url("/cold")).await;
    assert_eq!(from_c.status, 200);
    assert_eq!(from_c.text(), "after the failover");
    assert!(from_c.cache_status().is_hit(), "{}", from_c.cache_status());
    assert_eq!(origin.hits("/cold"), hits, "C read the promoted replica");
}

/// Fills fresh paths through `proxy` until one lands on `master` (a new
/// entry key there): the instance writes to that master now.
async fn wait_writes_to(
    origin: &RunningOrigin,
    client: &Client,
    proxy: &RunningProxy,
    master: &Redis,
    tag: &str,
    within: Duration,
) {
    let deadline = Instant::now() + within;
    let mut attempt = 0;
    loop {
        let before = master.keys("*:e:*").await.len();
        let path = format!("/follow-{tag}-{attempt}");
        origin.set_route(&path, cacheable("followed"));
        let answer = client.get(&proxy.url(&path)).await;
        assert_eq!(answer.status, 200, "{path}: {}", answer.cache_status());
        let settle = Instant::now() + ms(500);
        while Instant::now() < settle {
            if master.keys("*:e:*").await.len() > before {
                return;
            }
            tokio::time::sleep(ms(20)).await;
        }
        assert!(
            Instant::now() < deadline,
            "instance {tag} wrote nothing to the new master within {within:?}\n{}",
            proxy.log()
        );
        attempt += 1;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corral_follows_the_master_sentinel_promotes_and_the_lab_passes_before_and_after() {
    let mut deployment = RedisSentinels::start().await;
    let origin = Origin::new()
        .route("/warm", Reply::ok("warm"))
        .route("/before", cacheable("the one answer").delay(ms(300)))
        .route("/after", cacheable("the one answer").delay(ms(300)))
        .route("/alone", cacheable("alone"))
        .start()
        .await;
    let sentinel = format!(
        "{{ master: {}, nodes: {} }}",
        corral_tests::redis_deployments::SENTINEL_MASTER,
        yaml_list(&deployment.nodes())
    );
    let proxies = fleet(&origin, ("sentinel", sentinel)).await;
    let client = Client::new();
    assert!(
        readyz(&client, &proxies[0])
            .await
            .contains(r#""redis":"connected","redis_mode":"sentinel""#)
    );

    // A master name the sentinels do not monitor: corral serves alone and
    // says why, and no client sees an error.
    let misnamed = format!(
        "{{ master: not-monitored, nodes: {} }}",
        yaml_list(&deployment.nodes())
    );
    let lone = Proxy::new(config(&origin, ("sentinel", misnamed)))
        .without_waiting_for_redis()
        .start()
        .await;
    let answer = client.get(&lone.url("/alone")).await;
    assert_eq!(answer.status, 200);
    assert!(
        readyz(&client, &lone)
            .await
            .contains(r#""redis":"connecting","redis_mode":"sentinel""#)
    );
    eventually(DEADLINE, "a log line names the unknown master", || {
        let log = lone.log();
        async move {
            log.contains("a sentinel does not monitor this master: check redis.sentinel.master")
        }
    })
    .await;
    drop(lone);

    lab(&origin, &client, &proxies, "/before").await;
    wait_no_lease(&deployment.master, ms(2000)).await;
    assert_eq!(deployment.master.keys("*:e:*").await.len(), 1);

    deployment.fail_over(ms(15_000)).await;
    for (i, proxy) in proxies.iter().enumerate() {
        wait_writes_to(
            &origin,
            &client,
            proxy,
            &deployment.replica,
            &i.to_string(),
            BREAKER_OPEN_FOR + ms(10_000),
        )
        .await;
    }
    // Each instance moved once: to the promoted replica, and not again on
    // every check after it.
    for proxy in &proxies {
        assert_eq!(
            proxy
                .log()
                .matches("Sentinel named another master; following it")
                .count(),
            1,
            "{}",
            proxy.log()
        );
    }

    // The promoted replica has the invalidation log and its epoch: once
    // every instance's subscriber is on it, they have replayed the (empty)
    // gap instead of dropping or unverifying what they held, and /before
    // is still answered from each one's memory.
    eventually(
        DEADLINE,
        "every subscriber on the promoted master",
        || async {
            let (_, n): (String, i64) = deployment
                .replica
                .command(
                    redis::cmd("PUBSUB").arg("NUMSUB").arg("corral:invalidate"),
                    "NUMSUB",
                )
                .await;
            n >= INSTANCES as i64
        },
    )
    .await;
    for proxy in &proxies {
        let answer = client.get(&proxy.url("/before")).await;
        let cs = answer.cache_status();
        assert!(cs.is_hit() && cs.detail() != Some("l2"), "{cs}");
        let lost = corral_tests::lifecycle::scrape(proxy)
            .await
            .sum("corral_invalidation_log_total", &[("outcome", "lost")]);
        assert_eq!(lost, 0.0, "{}", proxy.log());
    }
    assert_eq!(origin.hits("/before"), 1);

    let before = deployment.replica.keys("*:e:*").await.len();
    lab(&origin, &client, &proxies, "/after").await;
    wait_no_lease(&deployment.replica, ms(2000)).await;
    assert_eq!(
        deployment.replica.keys("*:e:*").await.len(),
        before + 1,
        "/after is stored on the promoted master"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_moving_between_primaries_costs_no_client_an_error() {
    let cluster = RedisCluster::start().await;
    let origin = Origin::new()
        .route("/moving", cacheable("moved along"))
        .start()
        .await;
    // Four instances, so that each step reads Redis with an empty L1.
    let proxies = Proxy::new(config(&origin, ("cluster", yaml_list(&cluster.seeds()))))
        .instances(4)
        .start_all()
        .await;
    let client = Client::new();
    let first = client.get(&proxies[0].url("/moving")).await;
    assert_eq!(first.text(), "moved along");
    let entry = wait_for_key(&cluster, "*:e:*", DEADLINE).await;
    let slot = cluster.slot(&entry).await;
    let src = cluster.primary_of(&entry).await;
    let dst = cluster
        .primaries()
        .await
        .into_iter()
        .find(|i| *i != src)
        .expect("another primary");
    let id = |i: usize| {
        let cluster = &cluster;
        async move {
            cluster
                .node(i)
                .command::<String>(redis::cmd("CLUSTER").arg("MYID"), "CLUSTER MYID")
                .await
        }
    };
    let (src_id, dst_id) = (id(src).await, id(dst).await);
    let setslot = |node: usize, state: &'static str, owner: String| {
        let cluster = &cluster;
        async move {
            let _: () = cluster
                .node(node)
                .command(
                    redis::cmd("CLUSTER")
                        .arg("SETSLOT")
                        .arg(slot)
                        .arg(state)
                        .arg(&owner),
                    "CLUSTER SETSLOT",
                )
                .await;
        }
    };
    setslot(dst, "IMPORTING", src_id.clone()).await;
    setslot(src, "MIGRATING", dst_id.clone()).await;

    // Mid-migration, the entry's keys still on the source: served.
    let during = client.get(&proxies[1].url("/moving")).await;
    assert_eq!(
        (during.status.as_u16(), during.text().as_str()),
        (200, "moved along")
    );

    // Every key of the slot moves, then the slot is the destination's.
    let keys: Vec<String> = cluster
        .node(src)
        .command(
            redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(100),
            "CLUSTER GETKEYSINSLOT",
        )
        .await;
    assert!(keys.contains(&entry), "{keys:?}");
    let _: () = cluster
        .node(src)
        .command(
            redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(cluster.node(dst).port())
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(&keys),
            "MIGRATE",
        )
        .await;
    let between = client.get(&proxies[2].url("/moving")).await;
    assert_eq!(
        (between.status.as_u16(), between.text().as_str()),
        (200, "moved along")
    );
    for node in cluster.primaries().await {
        setslot(node, "NODE", dst_id.clone()).await;
    }
    assert_eq!(cluster.primary_of(&entry).await, dst);

    // After the move, an instance with an empty L1 finds the entry on its
    // new primary (the client follows MOVED and refreshes its map).
    let after = client.get(&proxies[3].url("/moving")).await;
    assert_eq!(
        (after.status.as_u16(), after.text().as_str()),
        (200, "moved along")
    );
    assert_eq!(
        after.cache_status().detail(),
        Some("l2"),
        "{}",
        after.cache_status()
    );
    // Mid-migration the probes of that slot's keys were answered TRYAGAIN
    // (some of a URI's keys were missing on the source, or moved): those
    // two requests went to the origin, counted as a resharding, not as a
    // Redis failure for the breaker.
    assert_eq!(origin.hits("/moving"), 3);
    for proxy in &proxies[1..3] {
        let metrics = scrape(proxy).await;
        assert!(
            metrics.sum("corral_redis_errors_total", &[("kind", "tryagain")]) >= 1.0,
            "{}",
            proxy.log()
        );
        assert_eq!(
            metrics.sum("corral_redis_errors_total", &[("kind", "error")]),
            0.0
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_primary_opens_its_own_breaker_and_the_other_shards_stay_in_use() {
    const PATHS: usize = 60;
    let cluster = RedisCluster::start_without_failover().await;
    let origin = Origin::new().start().await;
    let config = config(&origin, ("cluster", yaml_list(&cluster.seeds())))
        .redis_field("breaker", "{ failures: 5, open_for: 60s }");
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();
    let primaries = cluster.primaries().await;
    let frozen = primaries[0];
    cluster.node(frozen).pause();

    // Keys spread over the three shards by their hash: about a third are
    // the frozen primary's.
    for n in 0..PATHS {
        let path = format!("/k-{n}");
        origin.set_route(&path, cacheable(&path));
        let answer = client.get(&proxy.url(&path)).await;
        assert_eq!((answer.status.as_u16(), answer.text()), (200, path));
    }
    let metrics = scrape(&proxy).await;
    let timeouts = metrics.sum("corral_redis_errors_total", &[("kind", "timeout")]);
    let skipped = metrics.sum("corral_redis_errors_total", &[("kind", "breaker_open")]);
    // The frozen primary's breaker opened after 5 timeouts (a few more
    // were already in flight: a request's fill also writes its entry and
    // its notice; and a healthy shard may miss a deadline on a busy
    // machine); its keys were served without Redis from then on,
    // without waiting. One breaker for the whole cluster either opens for
    // every key (and the count below falls) or keeps being reset by the
    // healthy shards while every frozen key waits out op_timeout.
    assert!(
        (5.0..=15.0).contains(&timeouts) && skipped >= 1.0,
        "timeouts {timeouts}, skipped {skipped}\n{}",
        proxy.log()
    );
    assert!(proxy.log().contains("redis circuit breaker opened"));
    // The other two primaries kept being used: the keys that hash to them
    // were stored (about two thirds of the paths).
    let mut stored = 0;
    for &i in &primaries[1..] {
        stored += cluster.node(i).keys("*:e:*").await.len();
    }
    assert!(
        stored >= PATHS / 2,
        "{stored} of {PATHS} stored on the healthy shards"
    );
    let readyz = readyz(&client, &proxy).await;
    assert!(readyz.contains(r#""redis":"connected""#), "{readyz}");
    cluster.node(frozen).resume();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_protected_master_is_reached_through_sentinel_with_its_password() {
    const PASSWORD: &str = "s3cret-for-the-master";
    let deployment = RedisSentinels::start_auth(PASSWORD).await;
    let origin = Origin::new()
        .route("/auth", cacheable("behind a password"))
        .start()
        .await;
    let sentinel = |password: &str| {
        format!(
            "{{ master: {}, nodes: {}{password} }}",
            corral_tests::redis_deployments::SENTINEL_MASTER,
            yaml_list(&deployment.nodes())
        )
    };
    let with = format!(", password: {PASSWORD}");
    let proxies = Proxy::new(config(&origin, ("sentinel", sentinel(&with))))
        .instances(2)
        .start_all()
        .await;
    let client = Client::new();
    let first = client.get(&proxies[0].url("/auth")).await;
    assert_eq!(first.text(), "behind a password");
    wait_for_key(&deployment.master, "*:e:*", DEADLINE).await;
    let second = client.get(&proxies[1].url("/auth")).await;
    assert_eq!(
        second.cache_status().detail(),
        Some("l2"),
        "{}",
        second.cache_status()
    );
    assert_eq!(origin.hits("/auth"), 1);

    // Without it: the master refuses, corral serves alone and says why.
    let lone = Proxy::new(config(&origin, ("sentinel", sentinel(""))))
        .without_waiting_for_redis()
        .start()
        .await;
    let alone = client.get(&lone.url("/auth")).await;
    assert_eq!(
        (alone.status.as_u16(), alone.text().as_str()),
        (200, "behind a password")
    );
    assert!(
        readyz(&client, &lone)
            .await
            .contains(r#""redis":"connecting""#)
    );
    eventually(DEADLINE, "a log line says why Redis is not used", || {
        let log = lone.log();
        async move { log.contains("cannot connect to Redis yet") && log.contains("NOAUTH") }
    })
    .await;
}

/// On a Cluster too, while the primary that holds a URI's records cannot
/// be used (its breaker open), a stale-while-revalidate answer's refresh
/// waits for it instead of every instance refreshing on its own: a
/// failover under load was a surge of such refreshes. The primary is
/// frozen (no failover); misses whose keys it holds open its breaker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_stale_answer_waits_for_its_primary() {
    let cluster = RedisCluster::start_without_failover().await;
    let origin = Origin::new()
        .route(
            "/swr",
            Reply::ok("swr").header("cache-control", "max-age=1, stale-while-revalidate=60"),
        )
        .start()
        .await;
    let config = config(&origin, ("cluster", yaml_list(&cluster.seeds())))
        .redis_field("breaker", "{ failures: 2, open_for: 60s }");
    let proxies = Proxy::new(config).instances(2).start_all().await;
    let client = Client::new();
    for p in &proxies {
        assert_eq!(client.get(&p.url("/swr")).await.text(), "swr");
    }
    assert_eq!(origin.hits("/swr"), 1);
    let entry = wait_for_key(&cluster, "*:e:*", DEADLINE).await;
    let holder = cluster.primary_of(&entry).await;
    cluster.node(holder).pause();
    // Misses on new keys until the frozen primary's breaker is open on
    // both: only its keys time out, so two timeouts in a row are its.
    let n = std::sync::atomic::AtomicUsize::new(0);
    for p in &proxies {
        eventually(
            Duration::from_secs(30),
            "the frozen primary's breaker open",
            || async {
                let i = n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let path = format!("/miss-{i}");
                origin.set_route(&path, cacheable("miss"));
                assert_eq!(client.get(&p.url(&path)).await.status, 200);
                scrape(p).await.sum("corral_redis_breaker_open", &[]) == 1.0
            },
        )
        .await;
    }
    corral_tests::shared::wait_stale_everywhere(&client, &proxies, "/swr", "swr").await;
    for p in &proxies {
        assert_eq!(client.get(&p.url("/swr")).await.text(), "swr");
        assert!(scrape(p).await.sum("corral_refreshes_deferred_total", &[]) >= 1.0);
    }
    assert_eq!(origin.hits("/swr"), 1, "no instance refreshed alone");
    cluster.node(holder).resume();
}
