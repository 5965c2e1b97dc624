//! What the shared-cache scenarios do over and over, whatever Redis
//! deployment is behind the instances: bursts on every instance, waits for
//! Redis keys to come and go, and the checks that instances share entries
//! and purges.

use std::time::Duration;

use futures_util::future::join_all;
use http::Method;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::client::{Answer, Client};
use crate::origin::RunningOrigin;
use crate::proxy::RunningProxy;
use crate::redis_deployments::Keyspace;
use crate::reply::Reply;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A 200 every cache may keep for a minute.
pub fn cacheable(body: &str) -> Reply {
    Reply::ok(body.to_owned()).header("cache-control", "max-age=60")
}

/// `n` concurrent GETs of `path` on every proxy, all in flight at once, run
/// in a task so the test can act (kill something) while they wait. The
/// answers come back per proxy, in proxy order; a transport error fails it.
pub fn spawn_bursts(
    client: &Client,
    proxies: &[RunningProxy],
    n: usize,
    path: &str,
) -> JoinHandle<Vec<Vec<Answer>>> {
    let client = client.clone();
    let urls: Vec<String> = proxies.iter().map(|p| p.url(path)).collect();
    tokio::spawn(async move { join_all(urls.iter().map(|url| client.burst(n, url, &[]))).await })
}

/// Waits until a key matching `pattern` exists and returns the first one.
///
/// Redis keys appear without an event the test can wait on, so this checks
/// every 10ms; the failure lists every key present.
pub async fn wait_for_key(redis: &impl Keyspace, pattern: &str, within: Duration) -> String {
    let deadline = Instant::now() + within;
    loop {
        if let Some(key) = redis.keys(pattern).await.into_iter().next() {
            return key;
        }
        assert!(
            Instant::now() < deadline,
            "no Redis key matching {pattern:?} after {within:?}; keys: {:?}",
            redis.keys("*").await
        );
        tokio::time::sleep(ms(10)).await;
    }
}

/// Waits until no lease key is left (the owner releases it right after the
/// fill); the failure names the leases still there and their TTLs.
pub async fn wait_no_lease(redis: &impl Keyspace, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let leases = redis.keys("*:lease:*").await;
        if leases.is_empty() {
            return;
        }
        if Instant::now() >= deadline {
            let mut left = Vec::new();
            for key in &leases {
                left.push(format!("{key} (pttl {}ms)", redis.pttl(key).await));
            }
            panic!("lease keys still in Redis after {within:?}: {left:?}");
        }
        tokio::time::sleep(ms(10)).await;
    }
}

/// After Redis came back, fetches a new key through `a` then `b` until `b`
/// serves it from the shared cache with one origin request, and returns the
/// path that made it. The breaker may still be open for its `open_for`
/// and nothing observable marks it closing, hence the retries (each on a
/// fresh key) until `within`.
pub async fn wait_shared_again(
    origin: &RunningOrigin,
    client: &Client,
    a: &RunningProxy,
    b: &RunningProxy,
    within: Duration,
) -> String {
    let deadline = Instant::now() + within;
    let mut tries = Vec::new();
    let mut attempt = 0usize;
    loop {
        let path = format!("/again-{attempt}");
        let body = format!("again {attempt}");
        origin.set_route(&path, cacheable(&body));
        let first = client.get(&a.url(&path)).await;
        let second = client.get(&b.url(&path)).await;
        for answer in [&first, &second] {
            assert_eq!(answer.status, 200, "{path}: {}", answer.cache_status());
            assert_eq!(answer.text(), body, "{path}");
        }
        let hits = origin.hits(&path);
        if hits == 1 && second.cache_status().is_hit() {
            return path;
        }
        tries.push(format!(
            "{path}: origin hits {hits}, A {}, B {}",
            first.cache_status(),
            second.cache_status()
        ));
        assert!(
            Instant::now() < deadline,
            "instances did not share through Redis again within {within:?}: {tries:#?}"
        );
        tokio::time::sleep(ms(100)).await;
        attempt += 1;
    }
}

/// POSTs `path` on `a` (the origin answers 201 and from then on serves
/// `new_body`), then GETs `path` on `b` until `b` serves `new_body`, and
/// returns what `b` answered meanwhile.
///
/// `b` learns of the POST by a broadcast it handles on its own time, so it is
/// allowed a moment; a `b` that still serves the old body after that kept a
/// purged copy (in its L1, or in Redis when the L2 entry was not deleted).
pub async fn post_on_a_purges_b(
    origin: &RunningOrigin,
    client: &Client,
    a: &RunningProxy,
    b: &RunningProxy,
    path: &str,
    new_body: &str,
) -> Vec<String> {
    const PROPAGATION: Duration = Duration::from_secs(2);
    origin.set_route(path, cacheable(new_body));
    origin.set_route_method(Method::POST, path, Reply::status(201, "created"));
    let before = origin.hits(path);
    let post = client
        .send(Method::POST, &a.url(path), &[], Some("new".into()))
        .await;
    assert_eq!(post.status, 201, "POST {path} on A");
    assert_eq!(origin.hits(path), before + 1, "the POST reached the origin");

    let url = b.url(path);
    let deadline = Instant::now() + PROPAGATION;
    let mut seen = Vec::new();
    loop {
        let answer = client.get(&url).await;
        seen.push(format!("{} | {}", answer.text(), answer.cache_status()));
        if answer.text() == new_body {
            return seen;
        }
        assert!(
            Instant::now() < deadline,
            "B still served the purged {path} {PROPAGATION:?} after the POST on A: {seen:#?}"
        );
        tokio::time::sleep(ms(20)).await;
    }
}

/// Asks every proxy for `path` until each answers it as a stale copy served
/// while it revalidates (`detail=stale-while-revalidate`); every answer
/// must be `body`.
pub async fn wait_stale_everywhere(
    client: &Client,
    proxies: &[RunningProxy],
    path: &str,
    body: &str,
) {
    crate::eventually(
        crate::DEADLINE,
        &format!("{path} answered stale on every instance"),
        || async {
            let mut stale = 0;
            for p in proxies {
                let answer = client.get(&p.url(path)).await;
                assert_eq!(answer.text(), body, "{path}");
                stale +=
                    usize::from(answer.cache_status().detail() == Some("stale-while-revalidate"));
            }
            stale == proxies.len()
        },
    )
    .await;
}
