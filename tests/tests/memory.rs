//! `cache.memory` bounds what corral holds, measured as what the process
//! really holds (`RunningProxy::held_mib`: resident memory without shared
//! pages, plus every memfd it keeps: sealed bodies are not in its RSS), not
//! taken on trust from its own accounting. The
//! full-size figure (a million keys) is `bench/memory.sh`; this is the
//! same load, smaller, in the normal suite.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use corral_tests::lifecycle::scrape;
use corral_tests::{Client, Config, Origin, Proxy, Reply, Route};

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
        peak = peak.max(proxy.held_mib());
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    for w in workers {
        w.await.expect("load task");
    }
    peak = peak.max(proxy.held_mib());
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
        "held memory peaked at {peak:.1} MiB with cache.memory {MEMORY_MIB} MiB ({stored} entries, L1 counts {l1:.1} MiB)"
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
        peak = peak.max(proxy.held_mib());
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
        "held memory peaked at {peak:.1} MiB: {FILLS} slow fills buffered past cache.fill_memory"
    );
    // A fill that cannot hold more either passes its answer through before
    // anyone reads it (`fill-memory`), or, already streaming it to its
    // readers, passes the rest through (counted).
    let passed = scrape(&proxy).await.sum(
        "corral_streams_passed_through_total",
        &[("reason", "fill-memory")],
    );
    assert!(
        streamed > 0 || passed > 0.0,
        "{FILLS} fills of 6 MiB fit in 8 MiB of fill memory?"
    );
}

/// Slow readers keep the bodies they read alive after L1 evicts them:
/// memory that `cache.memory` does not count and RSS does not show (the
/// sealed bodies are read with sendfile). corral reports it
/// (`corral_sealed_bytes`), the measure here counts it, and it is given
/// back when the readers go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_pinned_by_slow_readers_are_counted_and_given_back() {
    // Larger than a socket's send buffer can take (4 MiB at most), so the
    // reader's answer keeps the body.
    const READERS: usize = 6;
    const BODY: usize = 8 * 1024 * 1024;
    let origin = Origin::new()
        .route(
            "/b",
            Reply::ok("x".repeat(BODY)).header("cache-control", "max-age=600"),
        )
        .start()
        .await;
    let config = Config::single(origin.url())
        .cache("memory", "20MiB")
        .cache("max_object_size", "8MiB")
        .server("send_timeout", "1h");
    let proxy = Proxy::new(config).start().await;
    let start = proxy.held_mib();
    let client = Client::new();
    let mut readers = Vec::new();
    for i in 0..READERS {
        // A fast client fills L1 (20 MiB holds two of these), then a slow
        // reader's request holds the stored body and reads nothing, and
        // the next keys evict its entry. Its request is a hit, or a miss
        // where L1's admission policy (moka's TinyLFU, whose maintenance
        // runs when it will) turned the new 8 MiB entry away for the older
        // ones: that request's fill stores the body in sealed memory the
        // same way, and the reader holds it. The counts below hold either
        // way, so the origin's count is not asserted (on a loaded machine
        // it varied from one run to the next).
        let url = proxy.url(&format!("/b?k={i}"));
        let warm = client.get(&url).await;
        assert_eq!(warm.body.len(), BODY);
        let req = format!("GET /b?k={i} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
        readers.push(corral_tests::send_as_slow_reader(proxy.addr(), req.as_bytes()).await);
    }
    // Every body is still held by its reader, evicted or not.
    corral_tests::eventually(
        corral_tests::DEADLINE,
        "every pinned body counted",
        || async {
            scrape(&proxy).await.sum("corral_sealed_bytes", &[]) >= (READERS * BODY) as f64
        },
    )
    .await;
    let l1 = scrape(&proxy).await.sum("corral_l1_bytes", &[]) / (1024.0 * 1024.0);
    assert!(l1 <= 20.0, "L1 counts {l1:.1} MiB");
    let pinned = proxy.held_mib() - start;
    assert!(
        pinned >= (READERS * BODY) as f64 / (1024.0 * 1024.0) * 0.9,
        "the measure shows {pinned:.1} MiB of {} MiB pinned",
        READERS * BODY / (1024 * 1024)
    );
    // The readers go: what they pinned is given back, down to what L1 holds.
    drop(readers);
    corral_tests::eventually(
        corral_tests::DEADLINE,
        "pinned bodies given back",
        || async { scrape(&proxy).await.sum("corral_sealed_bytes", &[]) <= 20.0 * 1024.0 * 1024.0 },
    )
    .await;
}

/// A kept-alive HTTP/1.1 connection does not keep the buffer one large
/// head needed: corral's own loop (`http/h1.rs`) lets it go once the
/// connection is idle, as hyper's read buffer shrinks back. 200 idle
/// connections, each after one 100 KB head, hold about 40 KiB each
/// (hyper's figure); keeping each buffer held about 120 KiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_do_not_keep_a_large_heads_buffer() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const CONNECTIONS: usize = 200;
    let origin = Origin::new()
        .route("/k", Reply::ok("k").header("cache-control", "max-age=600"))
        .start()
        .await;
    let config = Config::single(origin.url())
        .server("max_header_size", "192KiB")
        .server("header_read_timeout", "1m")
        .server("idle_timeout", "1h");
    let proxy = Proxy::new(config).start().await;
    let mut request = b"GET /k HTTP/1.1\r\nHost: h\r\nX-Big: ".to_vec();
    request.extend(std::iter::repeat_n(b'a', 100_000));
    request.extend_from_slice(b"\r\n\r\n");
    let before = proxy.held_mib();
    let mut idle = Vec::new();
    for _ in 0..CONNECTIONS {
        let mut s = tokio::net::TcpStream::connect(proxy.addr())
            .await
            .expect("connect");
        s.write_all(&request).await.expect("request");
        let mut got = Vec::new();
        let mut chunk = [0u8; 4096];
        while corral_tests::raw::find_head_end(&got).is_none() {
            let n = tokio::time::timeout(corral_tests::DEADLINE, s.read(&mut chunk))
                .await
                .expect("an answer in time")
                .expect("read");
            assert!(n > 0, "closed before its answer");
            got.extend_from_slice(&chunk[..n]);
        }
        assert!(
            got.starts_with(b"HTTP/1.1 200"),
            "{:?}",
            String::from_utf8_lossy(&got)
        );
        idle.push(s);
    }
    let each_kib = (proxy.held_mib() - before) * 1024.0 / CONNECTIONS as f64;
    assert!(
        each_kib < 80.0,
        "each idle connection holds {each_kib:.0} KiB after one 100 KB head"
    );
    assert_eq!(origin.hits("/k"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_do_not_keep_a_large_answers_head() {
    // The twin of the test above, for what corral writes: one answer with
    // a 100 KB head (an origin's field), then every connection idle.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const CONNECTIONS: usize = 200;
    let big = "a".repeat(100_000);
    let origin = Origin::new()
        .route(
            "/big",
            Reply::ok("k")
                .header("cache-control", "max-age=600")
                .header("x-big", &big),
        )
        .start()
        .await;
    let config = Config::single(origin.url())
        .server("header_read_timeout", "1m")
        .server("idle_timeout", "1h");
    let proxy = Proxy::new(config).start().await;
    let request = b"GET /big HTTP/1.1\r\nHost: h\r\n\r\n";
    let before = proxy.held_mib();
    let mut idle = Vec::new();
    for _ in 0..CONNECTIONS {
        let mut s = tokio::net::TcpStream::connect(proxy.addr())
            .await
            .expect("connect");
        s.write_all(request).await.expect("request");
        let mut got = Vec::new();
        let mut chunk = [0u8; 16384];
        while corral_tests::raw::find_head_end(&got).is_none() {
            let n = tokio::time::timeout(corral_tests::DEADLINE, s.read(&mut chunk))
                .await
                .expect("an answer in time")
                .expect("read");
            assert!(n > 0, "closed before its answer");
            got.extend_from_slice(&chunk[..n]);
        }
        assert!(
            got.starts_with(b"HTTP/1.1 200") && got.len() > big.len(),
            "{:?}",
            String::from_utf8_lossy(&got[..got.len().min(200)])
        );
        idle.push(s);
    }
    let each_kib = (proxy.held_mib() - before) * 1024.0 / CONNECTIONS as f64;
    assert!(
        each_kib < 80.0,
        "each idle connection holds {each_kib:.0} KiB after one 100 KB answer head"
    );
    assert_eq!(origin.hits("/big"), 1);
}

/// Readers that never read hold none of the fills' memory (issue 44,
/// finding 6): a cacheable chunked answer that outgrows the object size
/// passes through to its readers, and what it holds for their lag is
/// counted in the pass-through budget, not in `cache.fill_memory`. So
/// waves of connections that request such answers and read nothing
/// cannot keep another route's fills from being stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_that_never_read_never_keep_another_routes_fills_from_being_stored() {
    const ATTACKERS: usize = 4;
    const VICTIMS: usize = 10;
    let origin = Origin::new()
        .route(
            "/big",
            // 8 MiB without a length: past what the kernel's buffers take.
            Reply::trickle(128 * 1024, 64, std::time::Duration::from_millis(1))
                .header("cache-control", "max-age=600"),
        )
        .route(
            "/small",
            Reply::trickle(16 * 1024, 4, std::time::Duration::from_millis(1))
                .header("cache-control", "max-age=600"),
        )
        .start()
        .await;
    let config = Config::new()
        .cache("memory", "16MiB")
        .cache("max_object_size", "256KiB")
        .cache("fill_memory", "1MiB")
        .server("send_timeout", "1h")
        .route(Route::new("big", origin.url()).path_prefix("/big"))
        .route(Route::new("small", origin.url()).path_prefix("/small"));
    let proxy = Proxy::new(config).start().await;
    let mut attackers = Vec::new();
    for i in 0..ATTACKERS {
        let req = format!("GET /big?k={i} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
        attackers.push(corral_tests::send_as_slow_reader(proxy.addr(), req.as_bytes()).await);
    }
    // Every attacker's answer outgrew the object size and passes through
    // to a reader that reads nothing.
    corral_tests::eventually(
        corral_tests::DEADLINE,
        "the attackers' answers pass through",
        || async {
            scrape(&proxy)
                .await
                .sum("corral_streams_passed_through_total", &[("route", "big")])
                >= ATTACKERS as f64
        },
    )
    .await;
    let client = Client::new();
    for k in 0..VICTIMS {
        let url = proxy.url(&format!("/small?k={k}"));
        let first = client.get(&url).await;
        assert_eq!(first.body.len(), 64 * 1024);
        assert!(
            first.cache_status().to_string().contains("stored"),
            "victim {k}: {} (fill memory held: {:?})",
            first.cache_status(),
            scrape(&proxy).await.value("corral_fill_buffer_bytes", &[])
        );
    }
    for k in 0..VICTIMS {
        let again = client.get(&proxy.url(&format!("/small?k={k}"))).await;
        assert!(again.cache_status().is_hit(), "{}", again.cache_status());
    }
    assert_eq!(origin.hits("/small"), VICTIMS);
    drop(attackers);
}
