//! Overload (`server.overload`): once the threads serving clients stay busy
//! past the threshold, corral turns new work away and keeps serving the
//! work it has. The load here is real: two connections that pipeline
//! requests for a cached key without pause keep corral's one worker busy
//! (it never parks), at almost no cost to the test's own threads. While
//! that lasts:
//! - a hit on a connection corral already had is served (200);
//! - a pass (a POST here) is turned away: 503 with `Retry-After` and
//!   `Proxy-Status`, and the origin sees nothing;
//! - a miss that will be stored is fetched, as ever;
//! - a new connection, HTTP/1.1 or h2c, is answered 503 and closed.
//!
//! Once the load stops, corral stops shedding and the same pass reaches
//! the origin once.

use std::net::SocketAddr;

use http::Method;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use corral_tests::lifecycle::scrape;
use corral_tests::raw::{find_head_end, head_values};
use corral_tests::{Config, DEADLINE, Origin, Proxy, Reply, RunningProxy, eventually};

const PROXY_STATUS: &str = "corral; error=proxy_internal_response; details=\"overloaded\"";

/// One answer read off a kept-alive connection: status, head, body (by
/// Content-Length).
async fn ask(stream: &mut TcpStream, path: &str) -> (u16, String, String) {
    ask_with(stream, "GET", path).await
}

/// [`ask`] with another method (and an empty body).
async fn ask_with(stream: &mut TcpStream, method: &str, path: &str) -> (u16, String, String) {
    let request =
        format!("{method} {path} HTTP/1.1\r\nHost: overload.test\r\nContent-Length: 0\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let read = async {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let end = loop {
            if let Some(end) = find_head_end(&buf) {
                break end;
            }
            let n = stream.read(&mut chunk).await.expect("read a head");
            assert!(n > 0, "closed before a head: {buf:?}");
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
        let length: usize = head_values(&head, "content-length")
            .first()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no Content-Length: {head}"));
        while buf.len() < end + length {
            let n = stream.read(&mut chunk).await.expect("read a body");
            assert!(n > 0, "closed inside a body");
            buf.extend_from_slice(&chunk[..n]);
        }
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let body = String::from_utf8_lossy(&buf[end..end + length]).into_owned();
        (status, head, body)
    };
    tokio::time::timeout(DEADLINE, read)
        .await
        .unwrap_or_else(|_| panic!("no answer to GET {path} within {DEADLINE:?}"))
}

/// Connections that pipeline GETs of `path` without waiting for the
/// answers, which a reader of their own throws away, until stopped.
struct Load(Vec<tokio::task::JoinHandle<()>>);

impl Load {
    async fn start(addr: SocketAddr, path: &str, connections: usize) -> Load {
        let batch = format!("GET {path} HTTP/1.1\r\nHost: overload.test\r\n\r\n").repeat(64);
        let mut tasks = Vec::new();
        for _ in 0..connections {
            let stream = TcpStream::connect(addr).await.expect("connect the load");
            let (mut rx, mut tx) = stream.into_split();
            let batch = batch.clone();
            tasks.push(tokio::spawn(async move {
                while tx.write_all(batch.as_bytes()).await.is_ok() {}
            }));
            tasks.push(tokio::spawn(async move {
                let mut sink = vec![0u8; 64 * 1024];
                while matches!(rx.read(&mut sink).await, Ok(n) if n > 0) {}
            }));
        }
        Load(tasks)
    }

    fn stop(self) {
        for t in self.0 {
            t.abort();
        }
    }
}

/// GET `path` on a connection of its own, read until corral closes it.
async fn fresh_get(proxy: &RunningProxy, path: &str, close: bool) -> corral_tests::RawResponse {
    let close = if close { "Connection: close\r\n" } else { "" };
    let request = format!("GET {path} HTTP/1.1\r\nHost: overload.test\r\n{close}\r\n");
    corral_tests::exchange_full(proxy.addr(), request.as_bytes(), DEADLINE).await
}

async fn metric(proxy: &RunningProxy, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape(proxy).await.value(name, labels).unwrap_or(0.0)
}

async fn sheds_new_work_and_serves_what_it_has(server: &[(&str, &str)]) {
    let origin = Origin::new()
        .route(
            "/hot",
            Reply::ok("hot").header("cache-control", "max-age=600"),
        )
        .route_method(Method::POST, "/write", Reply::ok("written"))
        .route(
            "/cold",
            Reply::ok("cold").header("cache-control", "max-age=600"),
        )
        .start()
        .await;
    let mut config = Config::single(origin.url()).server("overload", "50%");
    for (k, v) in server {
        config = config.server(k, v);
    }
    let proxy = Proxy::new(config).start().await;
    assert_eq!(metric(&proxy, "corral_overloaded", &[]).await, 0.0);

    // A connection from before the overload, and an entry on it.
    let mut kept = TcpStream::connect(proxy.addr()).await.expect("connect");
    assert_eq!(ask(&mut kept, "/hot").await.0, 200);

    let load = Load::start(proxy.addr(), "/hot", 2).await;
    eventually(
        DEADLINE,
        "corral_overloaded 1 under the pipelined load",
        || async { metric(&proxy, "corral_overloaded", &[]).await == 1.0 },
    )
    .await;

    // What corral has: a hit on a kept connection.
    let (status, _, body) = ask(&mut kept, "/hot").await;
    assert_eq!((status, body.as_str()), (200, "hot"));
    // A pass (it will never be a hit): turned away, the origin not asked.
    let (status, head, _) = ask_with(&mut kept, "POST", "/write").await;
    assert_eq!(status, 503, "{head}");
    assert_eq!(head_values(&head, "retry-after"), ["1"], "{head}");
    assert_eq!(head_values(&head, "proxy-status"), [PROXY_STATUS], "{head}");
    assert!(head.contains("detail=overloaded"), "{head}");
    // A miss that will be stored is fetched: it turns the next ones into hits.
    let (status, head, body) = ask(&mut kept, "/cold").await;
    assert_eq!((status, body.as_str()), (200, "cold"), "{head}");
    assert_eq!(ask(&mut kept, "/cold").await.2, "cold");
    // A new HTTP/1.1 connection: 503, and corral closes it.
    let shed = fresh_get(&proxy, "/hot", false).await;
    assert_eq!(shed.status, 503, "{}", shed.head);
    assert_eq!(shed.header("retry-after"), Some("1"), "{}", shed.head);
    assert_eq!(shed.header("proxy-status"), Some(PROXY_STATUS));
    assert_eq!(shed.header("connection"), Some("close"));
    // A new h2c connection: 503 too.
    let h2 = reqwest::Client::builder()
        .no_proxy()
        .http2_prior_knowledge()
        .build()
        .expect("h2c client");
    let answer = h2.get(proxy.url("/hot")).send().await.expect("h2c request");
    assert_eq!(answer.version(), reqwest::Version::HTTP_2);
    assert_eq!(answer.status(), 503);
    assert_eq!(
        answer.headers().get("proxy-status").map(|v| v.as_bytes()),
        Some(PROXY_STATUS.as_bytes())
    );
    let shed_connections = [("what", "connection")];
    assert!(metric(&proxy, "corral_overload_shed_total", &shed_connections).await >= 2.0);
    assert_eq!(
        metric(&proxy, "corral_overload_shed_total", &[("what", "pass")]).await,
        1.0
    );
    // The h2c connection was told to go (GOAWAY) once answered.
    eventually(DEADLINE, "the shed h2c connection closed", || async {
        metric(
            &proxy,
            "corral_connections_closed_total",
            &[("reason", "overload")],
        )
        .await
            >= 1.0
    })
    .await;
    assert_eq!(origin.hits("/write"), 0, "no pass while overloaded");

    load.stop();
    eventually(
        DEADLINE,
        "corral_overloaded 0 once the load stopped",
        || async { metric(&proxy, "corral_overloaded", &[]).await == 0.0 },
    )
    .await;
    let (status, _, body) = ask_with(&mut kept, "POST", "/write").await;
    assert_eq!((status, body.as_str()), (200, "written"));
    let fresh = fresh_get(&proxy, "/cold", true).await;
    assert_eq!(fresh.status, 200, "{}", fresh.head);
    assert_eq!(origin.hits("/write"), 1);
    assert_eq!(origin.hits("/cold"), 1, "fetched once, while overloaded");
    assert_eq!(origin.hits("/hot"), 1, "every /hot was a hit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_shared_runtime_sheds_new_work_and_serves_what_it_has() {
    sheds_new_work_and_serves_what_it_has(&[("workers", "1")]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_per_core_worker_sheds_new_work_and_serves_what_it_has() {
    sheds_new_work_and_serves_what_it_has(&[("runtime", "per_core"), ("workers", "1")]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_overload_off_nothing_is_shed() {
    let origin = Origin::new()
        .route(
            "/hot",
            Reply::ok("hot").header("cache-control", "max-age=600"),
        )
        .route_method(Method::POST, "/write", Reply::ok("written"))
        .start()
        .await;
    let config = Config::single(origin.url())
        .server("overload", "off")
        .server("workers", "1");
    let proxy = Proxy::new(config).start().await;
    let mut kept = TcpStream::connect(proxy.addr()).await.expect("connect");
    assert_eq!(ask(&mut kept, "/hot").await.0, 200);
    let load = Load::start(proxy.addr(), "/hot", 2).await;
    // The same load that makes corral shed above: the worker is busy.
    eventually(DEADLINE, "the worker busy", || async {
        metric(&proxy, "corral_overload_busy_ratio", &[]).await > 0.5
    })
    .await;
    let (status, _, body) = ask_with(&mut kept, "POST", "/write").await;
    assert_eq!((status, body.as_str()), (200, "written"));
    let fresh = fresh_get(&proxy, "/hot", true).await;
    assert_eq!(fresh.status, 200, "{}", fresh.head);
    load.stop();
    assert_eq!(metric(&proxy, "corral_overloaded", &[]).await, 0.0);
    assert_eq!(origin.hits("/write"), 1);
}
