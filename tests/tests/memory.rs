//! `cache.memory` bounds what corral holds, measured as the process's
//! resident memory (RSS), not taken on trust from its own accounting. The
//! full-size figure (a million keys) is `bench/memory.sh`; this is the
//! same load, smaller, in the normal suite.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use corral_tests::lifecycle::scrape;
use corral_tests::{Client, Config, Origin, Proxy, Reply};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_keys_with_kibibyte_headers_stay_within_the_memory_bound() {
    const KEYS: usize = 20_000;
    const MEMORY_MIB: f64 = 8.0;
    let origin = Origin::new()
        .route("/m", Reply::ok("x").header("cache-control", "max-age=600"))
        .start()
        .await;
    let config = Config::single(origin.url()).cache("memory", "8MiB");
    let proxy = Proxy::new(config).start().await;
    let pad = "p".repeat(1000);
    let next = Arc::new(AtomicUsize::new(0));
    let client = Client::new();
    let workers: Vec<_> = (0..16)
        .map(|_| {
            let (client, next, pad) = (client.clone(), Arc::clone(&next), pad.clone());
            let base = proxy.url("/m");
            tokio::spawn(async move {
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= KEYS {
                        return;
                    }
                    let answer = client
                        .get_with(&format!("{base}?id={n}"), &[("x-pad", pad.as_str())])
                        .await;
                    assert_eq!(answer.text(), "x");
                }
            })
        })
        .collect();
    let mut peak: f64 = 0.0;
    while !workers.iter().all(tokio::task::JoinHandle::is_finished) {
        peak = peak.max(proxy.rss_mib());
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    for w in workers {
        w.await.expect("load task");
    }
    peak = peak.max(proxy.rss_mib());
    let metrics = scrape(&proxy).await;
    let stored = metrics.sum("corral_l1_entries", &[]);
    let l1 = metrics.sum("corral_l1_bytes", &[]) / (1024.0 * 1024.0);
    assert_eq!(origin.hits("/m"), KEYS, "every key was a miss once");
    assert!(
        stored < KEYS as f64,
        "8MiB cannot hold {KEYS} entries, yet {stored} are stored"
    );
    assert!(l1 <= MEMORY_MIB, "L1 counts {l1:.1} MiB");
    assert!(
        peak <= MEMORY_MIB + 64.0,
        "RSS peaked at {peak:.1} MiB with cache.memory {MEMORY_MIB} MiB ({stored} entries, L1 counts {l1:.1} MiB)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_fills_of_unknown_length_cannot_buffer_past_fill_memory() {
    const FILLS: usize = 30;
    const CHUNK: usize = 512 * 1024;
    const CHUNKS: usize = 12;
    let origin = Origin::new()
        .route(
            "/big",
            Reply::trickle(CHUNK, CHUNKS, std::time::Duration::from_millis(100))
                .header("cache-control", "max-age=600"),
        )
        .start()
        .await;
    // fill_memory defaults to max(memory / 4, max_object_size): 8 MiB here.
    let config = Config::single(origin.url())
        .cache("memory", "16MiB")
        .cache("max_object_size", "8MiB");
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();
    let fills: Vec<_> = (0..FILLS)
        .map(|i| {
            let client = client.clone();
            let url = proxy.url(&format!("/big?k={i}"));
            tokio::spawn(async move { client.get(&url).await })
        })
        .collect();
    let mut peak: f64 = 0.0;
    while !fills.iter().all(tokio::task::JoinHandle::is_finished) {
        peak = peak.max(proxy.rss_mib());
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let mut streamed = 0;
    for f in fills {
        let answer = f.await.expect("fill task");
        assert_eq!(answer.body.len(), CHUNK * CHUNKS, "every answer is whole");
        if answer.cache_status().detail() == Some("fill-memory") {
            streamed += 1;
        }
    }
    assert!(
        peak <= 16.0 + 8.0 + 64.0,
        "RSS peaked at {peak:.1} MiB: {FILLS} slow fills buffered past cache.fill_memory"
    );
    assert!(
        streamed > 0,
        "{FILLS} fills of 6 MiB fit in 8 MiB of fill memory?"
    );
}
