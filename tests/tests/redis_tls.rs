//! `rediss://`: the shared cache over TLS to a real redis-server started
//! with `--tls-port` and certificates the harness makes, with and without
//! a client certificate; a wrong CA or a missing client certificate never
//! becomes a client error (corral serves alone, as with Redis down). And a
//! six-node Cluster reached over TLS only, as managed services run it, and
//! a Sentinel deployment over TLS followed through a failover.

use std::time::Duration;

use corral_tests::shared::wait_shared_again;
use corral_tests::temp::TempDir;
use corral_tests::tls::Pki;
use corral_tests::{
    Client, Config, DEADLINE, Keyspace, Origin, Proxy, Redis, RedisCluster, RedisSentinels, Reply,
    Route, RunningOrigin, RunningProxy, eventually,
};

fn cacheable() -> Reply {
    Reply::ok("shared over tls").header("cache-control", "max-age=60")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_a_private_ca_shares_the_cache_and_a_client_certificate_when_required() {
    let dir = TempDir::new("corral-redis-tls").expect("temp dir");
    let pki = Pki::new(dir.path(), "ca");
    let clients = Pki::new(dir.path(), "clients");
    let server = pki.issue("redis", &["localhost"], false);
    let me = clients.issue("corral", &["corral.internal"], false);
    let redis =
        Redis::start_tls(&server.cert, &server.key, &clients.ca_file("clients"), true).await;
    let origin = Origin::new().route("/c", cacheable()).start().await;
    let config = |tls: &str| {
        Config::new()
            .route(Route::new("api", origin.url()))
            .redis(&redis.tls_url())
            .redis_field("tls", tls)
    };
    let with_cert = format!(
        "{{ ca_file: {}, client_cert: {}, client_key: {} }}",
        pki.ca_file("ca").display(),
        me.cert.display(),
        me.key.display()
    );
    // Start waits for /readyz to say Redis is connected: over TLS.
    let proxies = Proxy::new(config(&with_cert))
        .instances(2)
        .start_all()
        .await;
    let client = Client::new();
    let first = client.get(&proxies[0].url("/c")).await;
    assert_eq!(first.text(), "shared over tls");
    eventually(DEADLINE, "the entry is in Redis", || {
        let redis = &redis;
        async move { !redis.keys("corral:*:e:*").await.is_empty() }
    })
    .await;
    second_reads_what_the_first_stored(&client, &proxies[1], &origin).await;

    // Without the client certificate (or trusting another CA) corral never
    // gets in: it serves alone, says so, and no client sees an error.
    let other = Pki::new(dir.path(), "other");
    for tls in [
        format!("{{ ca_file: {} }}", pki.ca_file("ca").display()),
        format!(
            "{{ ca_file: {}, client_cert: {}, client_key: {} }}",
            other.ca_file("other").display(),
            me.cert.display(),
            me.key.display()
        ),
    ] {
        let lone = Proxy::new(config(&tls))
            .without_waiting_for_redis()
            .start()
            .await;
        let a = client.get(&lone.url("/c")).await;
        assert_eq!(
            (a.status.as_u16(), a.text().as_str()),
            (200, "shared over tls")
        );
        let readyz = client.get(&lone.admin_url("/readyz")).await.text();
        assert!(readyz.contains("\"redis\":\"connecting\""), "{readyz}");
        eventually(Duration::from_secs(10), "a log line says Redis cannot be reached", || {
            let log = lone.log();
            async move { log.contains("cannot connect to Redis yet") || log.contains("Redis error") }
        })
        .await;
    }
}

/// `/c`, fetched through one instance, is read from Redis by `second`:
/// one origin request for both.
async fn second_reads_what_the_first_stored(
    client: &Client,
    second: &RunningProxy,
    origin: &RunningOrigin,
) {
    let answer = client.get(&second.url("/c")).await;
    assert_eq!(answer.text(), "shared over tls");
    assert_eq!(
        answer.cache_status().detail(),
        Some("l2"),
        "filled from Redis by the other instance"
    );
    assert_eq!(origin.hits("/c"), 1);
}

/// One route to `origin`, Redis given by `servers` (`cluster: […]` or
/// `sentinel: {…}`) and reached over TLS trusting `pki`'s CA alone.
fn trusting_ca(origin: &RunningOrigin, pki: &Pki, servers: (&str, String)) -> Config {
    Config::new()
        .route(Route::new("api", origin.url()))
        .redis_field(servers.0, &servers.1)
        .redis_field(
            "tls",
            &format!("{{ ca_file: {} }}", pki.ca_file("ca").display()),
        )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_reached_over_tls_shares_the_cache() {
    let dir = TempDir::new("corral-cluster-tls").expect("temp dir");
    let pki = Pki::new(dir.path(), "ca");
    let server = pki.issue("redis", &["127.0.0.1", "localhost"], false);
    let cluster = RedisCluster::start_tls(&server.cert, &server.key, &pki.ca_file("ca")).await;
    let origin = Origin::new().route("/c", cacheable()).start().await;
    let config = trusting_ca(
        &origin,
        &pki,
        ("cluster", format!("[{}]", cluster.tls_seeds().join(", "))),
    );
    let proxies = Proxy::new(config).instances(2).start_all().await;
    let client = Client::new();
    let first = client.get(&proxies[0].url("/c")).await;
    assert_eq!(first.text(), "shared over tls");
    eventually(DEADLINE, "the entry is in the cluster", || {
        let cluster = &cluster;
        async move { cluster.keys("corral:*:e:*").await.len() == 1 }
    })
    .await;
    second_reads_what_the_first_stored(&client, &proxies[1], &origin).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_over_tls_names_a_tls_master_and_corral_follows_its_failover() {
    let dir = TempDir::new("corral-sentinel-tls").expect("temp dir");
    let pki = Pki::new(dir.path(), "ca");
    let server = pki.issue("redis", &["127.0.0.1", "localhost"], false);
    let mut deployment =
        RedisSentinels::start_tls(&server.cert, &server.key, &pki.ca_file("ca")).await;
    let origin = Origin::new().route("/c", cacheable()).start().await;
    let sentinel = format!(
        "{{ master: {}, nodes: [{}] }}",
        corral_tests::redis_deployments::SENTINEL_MASTER,
        deployment.nodes().join(", ")
    );
    assert!(sentinel.contains("rediss://"), "{sentinel}");
    let config = trusting_ca(&origin, &pki, ("sentinel", sentinel))
        .redis_field("breaker", "{ failures: 5, open_for: 1s }");
    let proxies = Proxy::new(config).instances(2).start_all().await;
    let client = Client::new();
    let first = client.get(&proxies[0].url("/c")).await;
    assert_eq!(first.text(), "shared over tls");
    let second = client.get(&proxies[1].url("/c")).await;
    assert_eq!(second.cache_status().detail(), Some("l2"));
    assert_eq!(deployment.master.keys("corral:*:e:*").await.len(), 1);

    deployment.fail_over(Duration::from_secs(15)).await;
    wait_shared_again(
        &origin,
        &client,
        &proxies[0],
        &proxies[1],
        Duration::from_secs(12),
    )
    .await;
    assert!(
        deployment.replica.keys("corral:*:e:*").await.len() >= 2,
        "the promoted master holds what was shared after the failover"
    );
}
