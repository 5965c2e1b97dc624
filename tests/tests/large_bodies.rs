//! Large cached bodies: kept in sealed memory files and sent with sendfile.
//! Every byte a client receives must be the origin's byte in order, over
//! HTTP/1.1 (pipelined, read slowly), HTTP/2 and from the shared cache; the
//! descriptors behind evicted bodies must be released.

use std::net::SocketAddr;
use std::time::Duration;

use futures_util::future::join_all;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use corral_tests::lifecycle::scrape;
use corral_tests::raw::find_head_end;
use corral_tests::{Client, Config, DEADLINE, Origin, Proxy, Redis, Reply, Route, eventually};

/// A body in which no two nearby positions hold the same run of bytes, so a
/// shifted, repeated or dropped block shows.
fn pattern(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x >> 24) as u8
        })
        .collect()
}

fn cacheable(body: Vec<u8>) -> Reply {
    Reply::ok(body).header("cache-control", "max-age=600")
}

async fn sealed_bodies(proxy: &corral_tests::RunningProxy) -> f64 {
    let m = scrape(proxy).await;
    m.value("corral_sealed_bodies", &[])
        .unwrap_or_else(|| panic!("no corral_sealed_bodies in {}", m.text()))
}

/// Where two bodies first differ, for a readable failure.
fn first_difference(got: &[u8], want: &[u8]) -> String {
    match got.iter().zip(want).position(|(a, b)| a != b) {
        Some(i) => format!("first difference at byte {i} of {}", want.len()),
        None => format!("{} bytes received, {} expected", got.len(), want.len()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_hits_are_byte_exact_at_every_size() {
    // Around the sealing threshold (16 KiB), and well past socket buffers.
    let sizes = [
        16 * 1024 - 1,
        16 * 1024,
        16 * 1024 + 1,
        65_536,
        300_001,
        3 * 1024 * 1024 + 7,
    ];
    let mut origin = Origin::new();
    for (i, &len) in sizes.iter().enumerate() {
        origin = origin.route(&format!("/b{i}"), cacheable(pattern(len, i as u32)));
    }
    let origin = origin.start().await;
    let proxy = Proxy::new(Config::single(origin.url()).cache("max_object_size", "8MiB"))
        .start()
        .await;
    let client = Client::new();

    for (i, &len) in sizes.iter().enumerate() {
        let path = format!("/b{i}");
        let want = pattern(len, i as u32);
        let miss = client.get(&proxy.url(&path)).await;
        assert!(
            miss.body == want,
            "miss {path}: {}",
            first_difference(&miss.body, &want)
        );
        // Twenty concurrent hits on one connection pool.
        let url = proxy.url(&path);
        let hits = join_all((0..20).map(|_| client.get(&url))).await;
        for hit in &hits {
            assert_eq!(hit.status, 200, "{path}");
            assert!(hit.cache_status().is_hit(), "{path}: {:?}", hit.headers);
            assert_eq!(
                hit.header("content-length"),
                Some(len.to_string().as_str()),
                "{path}"
            );
            assert!(
                hit.body == want,
                "hit {path}: {}",
                first_difference(&hit.body, &want)
            );
        }
        let head = client.head(&proxy.url(&path)).await;
        assert_eq!(head.status, 200);
        assert!(head.body.is_empty(), "HEAD {path} had a body");
        assert_eq!(origin.hits(&path), 1, "{path}");
    }
    // The five bodies from 16 KiB up are sealed; the one below is not.
    assert_eq!(sealed_bodies(&proxy).await, 5.0);
}

/// Reads one HTTP/1.1 response with a Content-Length off `stream`.
async fn read_response(stream: &mut TcpStream, buf: &mut Vec<u8>) -> (String, Vec<u8>) {
    let head_end = loop {
        if let Some(end) = find_head_end(buf) {
            break end;
        }
        let mut chunk = [0u8; 16 * 1024];
        let n = stream.read(&mut chunk).await.expect("read head");
        assert!(
            n > 0,
            "closed before a response head: {:?}",
            String::from_utf8_lossy(buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .unwrap_or_else(|| panic!("no content-length in {head}"));
    while buf.len() < head_end + len {
        let mut chunk = vec![0u8; 256 * 1024];
        let n = stream.read(&mut chunk).await.expect("read body");
        assert!(
            n > 0,
            "closed after {} of {len} body bytes",
            buf.len() - head_end
        );
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = buf[head_end..head_end + len].to_vec();
    buf.drain(..head_end + len);
    (head, body)
}

async fn connect(addr: SocketAddr) -> TcpStream {
    TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_answers_arrive_whole_and_in_order() {
    let big = pattern(2 * 1024 * 1024 + 3, 7);
    let small = b"small answer".to_vec();
    let mid = pattern(40_000, 8);
    let origin = Origin::new()
        .route("/big", cacheable(big.clone()))
        .route("/small", cacheable(small.clone()))
        .route("/mid", cacheable(mid.clone()))
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url()).cache("max_object_size", "8MiB"))
        .start()
        .await;
    let client = Client::new();
    for path in ["/big", "/small", "/mid"] {
        assert_eq!(client.get(&proxy.url(path)).await.status, 200);
    }

    let mut stream = connect(proxy.addr()).await;
    let order = ["/big", "/small", "/mid", "/big", "/mid", "/small"];
    let mut requests = String::new();
    for path in order {
        // The same host as the priming requests: the host is in the key.
        requests.push_str(&format!(
            "GET {path} HTTP/1.1\r\nHost: {}\r\n\r\n",
            proxy.addr()
        ));
    }
    // All six at once: hyper answers them one after another on this socket,
    // sealed bodies between heads and small bodies.
    stream.write_all(requests.as_bytes()).await.expect("send");
    let mut buf = Vec::new();
    let answers = tokio::time::timeout(DEADLINE, async {
        let mut out = Vec::new();
        for _ in order {
            out.push(read_response(&mut stream, &mut buf).await);
        }
        out
    })
    .await
    .expect("six answers within the deadline");
    for (path, (head, body)) in order.iter().zip(&answers) {
        assert!(head.starts_with("HTTP/1.1 200"), "{path}: {head}");
        let want: &[u8] = match *path {
            "/big" => &big,
            "/mid" => &mid,
            _ => &small,
        };
        assert!(body == want, "{path}: {}", first_difference(body, want));
    }
    assert!(
        buf.is_empty(),
        "{} stray bytes after the last answer",
        buf.len()
    );
    for (path, (head, _)) in order.iter().zip(&answers) {
        assert!(
            head.to_ascii_lowercase()
                .contains("cache-status: corral; hit"),
            "{path}: {head}"
        );
    }
    assert_eq!(origin.hits("/big"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_slowly_still_gets_every_byte() {
    // Eight MiB: far more than the socket buffers hold, so the proxy's
    // sendfile comes back short and waits for the socket to drain, many
    // times over.
    let body = pattern(8 * 1024 * 1024, 9);
    let origin = Origin::new()
        .route("/slow", cacheable(body.clone()))
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url()).cache("max_object_size", "16MiB"))
        .start()
        .await;
    assert_eq!(Client::new().get(&proxy.url("/slow")).await.status, 200);

    let mut stream = connect(proxy.addr()).await;
    stream
        .write_all(b"GET /slow HTTP/1.1\r\nHost: slow.test\r\n\r\n")
        .await
        .expect("send");
    let got = tokio::time::timeout(DEADLINE * 3, async {
        let mut buf = Vec::new();
        // Small reads with a pause every 64 KiB: the reader, not the
        // proxy, sets the pace (this pause is the scenario, not a wait).
        let mut chunk = [0u8; 4096];
        let mut since_pause = 0;
        loop {
            let n = stream.read(&mut chunk).await.expect("read");
            if n == 0 {
                break buf;
            }
            buf.extend_from_slice(&chunk[..n]);
            if let Some(end) = find_head_end(&buf)
                && buf.len() - end >= body.len()
            {
                break buf;
            }
            since_pause += n;
            if since_pause >= 64 * 1024 {
                since_pause = 0;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    })
    .await
    .expect("the whole answer within the deadline");
    let start = find_head_end(&got).expect("a response head");
    assert!(got.starts_with(b"HTTP/1.1 200"));
    let received = &got[start..];
    assert!(received == body, "{}", first_difference(received, &body));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_clients_get_large_hits_whole() {
    let body = pattern(1024 * 1024 + 11, 10);
    let origin = Origin::new()
        .route("/h2big", cacheable(body.clone()))
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url()).cache("max_object_size", "8MiB"))
        .start()
        .await;
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .timeout(DEADLINE)
        .build()
        .expect("h2c client");
    for _ in 0..3 {
        let res = h2
            .get(proxy.url("/h2big"))
            .send()
            .await
            .expect("h2c request");
        assert_eq!(res.version(), http::Version::HTTP_2);
        let got = res.bytes().await.expect("body");
        assert!(got == body, "{}", first_difference(&got, &body));
    }
    assert_eq!(origin.hits("/h2big"), 1);
    assert_eq!(sealed_bodies(&proxy).await, 1.0);
}

/// The sealed-body files the proxy holds open, from /proc: descriptors
/// that link to `/memfd:corral-body`.
fn body_descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/fd: {e}"))
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| target.to_string_lossy().starts_with("/memfd:corral-body"))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_bodies_give_their_descriptors_back() {
    const KEYS: usize = 60;
    let mut origin = Origin::new();
    for i in 0..KEYS {
        origin = origin.route(&format!("/e{i}"), cacheable(pattern(200_000, i as u32)));
    }
    let origin = origin.start().await;
    // Room for about ten of the sixty bodies.
    let proxy = Proxy::new(Config::single(origin.url()).cache("memory", "2MiB"))
        .start()
        .await;
    let client = Client::new();
    for i in 0..KEYS {
        let path = format!("/e{i}");
        let answer = client.get(&proxy.url(&path)).await;
        let want = pattern(200_000, i as u32);
        assert!(
            answer.body == want,
            "{path}: {}",
            first_difference(&answer.body, &want)
        );
    }
    // moka evicts in its housekeeping, which runs on cache traffic: keep
    // asking for the newest key until the count settles.
    let last = proxy.url(&format!("/e{}", KEYS - 1));
    eventually(DEADLINE, "sealed bodies down to what 2 MiB holds", || {
        let client = client.clone();
        let last = last.clone();
        let proxy = &proxy;
        async move {
            client.get(&last).await;
            sealed_bodies(proxy).await <= 11.0
        }
    })
    .await;
    let open = body_descriptors(proxy.pid());
    assert!(
        open <= 11,
        "{open} body files still open after caching {KEYS} bodies in room for 10"
    );
    assert_eq!(open as f64, sealed_bodies(&proxy).await);
    // Whatever was evicted is fetched again, whole.
    let again = client.get(&proxy.url("/e0")).await;
    assert!(again.body == pattern(200_000, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_body_from_the_shared_cache_is_sealed_and_whole() {
    let redis = Redis::start().await;
    let body = pattern(500_000, 11);
    let origin = Origin::new()
        .route("/shared-big", cacheable(body.clone()))
        .start()
        .await;
    let config = Config::new()
        .route(Route::new("api", origin.url()))
        .redis(&redis.url())
        .redis_field("op_timeout", "250ms");
    let proxies = Proxy::new(config).instances(2).start_all().await;
    let client = Client::new();

    let filled = client.get(&proxies[0].url("/shared-big")).await;
    assert!(filled.body == body);
    let from_l2 = client.get(&proxies[1].url("/shared-big")).await;
    assert!(
        from_l2.body == body,
        "{}",
        first_difference(&from_l2.body, &body)
    );
    let again = client.get(&proxies[1].url("/shared-big")).await;
    assert!(again.cache_status().is_hit(), "{:?}", again.headers);
    assert!(
        again.body == body,
        "{}",
        first_difference(&again.body, &body)
    );
    assert_eq!(origin.hits("/shared-big"), 1, "B served A's fill");
    assert_eq!(sealed_bodies(&proxies[1]).await, 1.0);
}
