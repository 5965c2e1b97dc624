//! Faults beyond kill and freeze (issue 27): instances whose wall clocks
//! disagree, a Redis that restarts empty under the fleet, a Redis that is
//! full. Real `redis-server` processes, real corral processes.

use std::time::Duration;

use corral_tests::clock_skew::libfaketime;
use corral_tests::shared::cacheable;
use corral_tests::{Client, Config, DEADLINE, Origin, Proxy, Redis, Route};

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
