//! Connections from accept to close, against hostile clients: sockets that
//! send nothing or only the HTTP/2 preface, clients that never read, a
//! flood of idle sockets past the descriptor limit, and an HTTP/2 client
//! that resets every stream it opens. Every one is bounded by
//! configuration, and the bound is measured (sockets closed, descriptors,
//! origin requests), not assumed.

use std::time::Duration;

use corral_tests::lifecycle::scrape;
use corral_tests::{Client, Config, DEADLINE, Origin, Proxy, Reply, Route, RunningProxy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Waits until the server closes `stream` (EOF or reset), reading and
/// dropping whatever it sends first; `false` if it is still open at `within`.
async fn closed_within(mut stream: TcpStream, within: Duration) -> bool {
    tokio::time::timeout(within, async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

/// Descriptors the process holds now.
fn open_descriptors(proxy: &RunningProxy) -> usize {
    std::fs::read_dir(format!("/proc/{}/fd", proxy.pid()))
        .map(|d| d.count())
        .unwrap_or(0)
}

async fn closed_for(proxy: &RunningProxy, reason: &str) -> f64 {
    scrape(proxy)
        .await
        .sum("corral_connections_closed_total", &[("reason", reason)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_preface_only_and_idle_connections_are_closed_on_both_listeners() {
    let origin = Origin::new()
        .route("/a", Reply::ok("a").header("cache-control", "max-age=60"))
        .start()
        .await;
    let config = Config::single(origin.url())
        .server("header_read_timeout", "1s")
        .server("idle_timeout", "1s");
    let proxy = Proxy::new(config).start().await;

    let mut sockets = Vec::new();
    for _ in 0..100 {
        sockets.push(TcpStream::connect(proxy.addr()).await.expect("connect"));
    }
    for _ in 0..20 {
        let mut s = TcpStream::connect(proxy.addr()).await.expect("connect");
        s.write_all(PREFACE).await.expect("preface");
        sockets.push(s);
    }
    for _ in 0..10 {
        sockets.push(
            TcpStream::connect(proxy.admin_addr())
                .await
                .expect("connect admin"),
        );
    }
    // A keep-alive connection that served one request, then went quiet.
    let mut kept = TcpStream::connect(proxy.addr()).await.expect("connect");
    kept.write_all(b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n")
        .await
        .expect("request");
    sockets.push(kept);

    let checks = sockets
        .into_iter()
        .map(|s| tokio::spawn(closed_within(s, Duration::from_secs(8))));
    let results = futures_util::future::join_all(checks).await;
    let open = results
        .into_iter()
        .filter(|r| !matches!(r, Ok(true)))
        .count();
    assert_eq!(open, 0, "connections still open after their deadline");
    assert!(closed_for(&proxy, "no-request").await >= 120.0);

    // An HTTP/2 connection that served a request, then went quiet: hyper
    // has no idle timeout for HTTP/2; corral's closes it (GOAWAY).
    let tcp = TcpStream::connect(proxy.addr()).await.expect("connect");
    let (h2, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
    let driver = tokio::spawn(connection);
    let mut ready = h2.ready().await.expect("h2 ready");
    let (response, _) = ready
        .send_request(
            http::Request::get("http://h/a").body(()).expect("request"),
            true,
        )
        .expect("send");
    let response = response.await.expect("h2 response");
    assert_eq!(response.status(), 200);
    drop(ready);
    let ended = tokio::time::timeout(Duration::from_secs(8), driver).await;
    assert!(ended.is_ok(), "an idle HTTP/2 connection stayed open");
    assert!(closed_for(&proxy, "idle").await >= 1.0);
    // And the proxy serves.
    assert_eq!(Client::new().get(&proxy.url("/a")).await.text(), "a");
}

/// The deadline of every HTTP/1.1 head after the first is corral's own
/// (the watchdog's), not hyper's per-request timer: a kept-alive client
/// that trickles its next head, or sends none, is cut off within
/// `header_read_timeout` of its last answer even when `idle_timeout` is
/// an hour, while one that keeps asking in time is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_alive_client_trickling_its_next_head_is_cut_off_at_header_read_timeout() {
    let origin = Origin::new()
        .route("/a", Reply::ok("a").header("cache-control", "max-age=60"))
        .start()
        .await;
    let config = Config::single(origin.url())
        .server("header_read_timeout", "1s")
        .server("idle_timeout", "1h");
    let proxy = Proxy::new(config).start().await;
    const GET: &[u8] = b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n";

    // Answered once, then its next head a byte every 100 ms: 2.7 s for
    // the whole head, past the 1 s it has.
    let mut trickler = TcpStream::connect(proxy.addr()).await.expect("connect");
    trickler.write_all(GET).await.expect("request");
    let mut buf = [0u8; 4096];
    let n = trickler.read(&mut buf).await.expect("answer");
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "first answer");
    let answered = tokio::time::Instant::now();
    let mut cut_off = false;
    for b in GET {
        if trickler.write_all(&[*b]).await.is_err() {
            cut_off = true;
            break;
        }
        tokio::time::sleep(ms(100)).await;
    }
    assert!(
        cut_off || closed_within(trickler, ms(100)).await,
        "a head trickled for 2.7 s was not cut off"
    );
    assert!(
        answered.elapsed() < Duration::from_secs(2) + ms(700),
        "cut off only at the end of the trickle"
    );

    // Answered once, then silent: closed after about 1 s, not idle_timeout.
    let mut quiet = TcpStream::connect(proxy.addr()).await.expect("connect");
    quiet.write_all(GET).await.expect("request");
    let n = quiet.read(&mut buf).await.expect("answer");
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    assert!(closed_within(quiet, Duration::from_secs(5)).await);
    assert!(closed_for(&proxy, "idle").await >= 2.0);

    // A client that keeps asking within the deadline is served throughout.
    let mut steady = TcpStream::connect(proxy.addr()).await.expect("connect");
    for _ in 0..6 {
        steady.write_all(GET).await.expect("request");
        let n = steady.read(&mut buf).await.expect("answer");
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "kept-alive answer");
        tokio::time::sleep(ms(400)).await;
    }
    assert_eq!(origin.hits("/a"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_clients_past_the_descriptor_limit_never_exhaust_it() {
    const LIMIT: u64 = 512;
    const IDLE: usize = 700;
    let origin = Origin::new()
        .route(
            "/ok",
            Reply::ok("served").header("cache-control", "no-store"),
        )
        .start()
        .await;
    let config = Config::single(origin.url()).server("header_read_timeout", "500ms");
    let proxy = Proxy::new(config).open_files(LIMIT).start().await;

    let mut idle = Vec::new();
    for _ in 0..IDLE {
        idle.push(TcpStream::connect(proxy.addr()).await.expect("connect"));
    }
    // Behind every idle socket in the accept queue, a real request.
    let client = Client::new();
    let url = proxy.url("/ok");
    let real = tokio::spawn(async move { client.get(&url).await });
    let mut most = 0;
    while !real.is_finished() {
        most = most.max(open_descriptors(&proxy));
        tokio::time::sleep(ms(50)).await;
    }
    let answer = real.await.expect("request task");
    assert_eq!(answer.text(), "served");
    assert!(
        most < LIMIT as usize / 2,
        "corral held {most} descriptors of {LIMIT} with {IDLE} idle clients"
    );
    drop(idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_nothing_is_cut_off_after_send_timeout() {
    // Larger than what the kernel can buffer for a client that reads
    // nothing: its receive buffer is pinned small below, and corral's send
    // buffer grows to tcp_wmem's maximum (4 MiB by default) at most.
    const SIZE: usize = 24 * 1024 * 1024;
    let origin = Origin::new()
        .route(
            "/big",
            Reply::ok("x".repeat(SIZE)).header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let config = Config::single(origin.url())
        .cache("max_object_size", "32MiB")
        .server("send_timeout", "1s")
        // Every other deadline far away, so that only send_timeout can
        // close the stuck connection inside the test's deadline.
        .server("idle_timeout", "1h")
        .server("header_read_timeout", "1h");
    let proxy = Proxy::new(config).start().await;
    // Warm the cache so the answer is a hit that no origin paces. The key
    // holds the host without its port, so `Host: 127.0.0.1` below is the
    // same key as this request.
    assert_eq!(Client::new().get(&proxy.url("/big")).await.body.len(), SIZE);
    let stuck = corral_tests::send_as_slow_reader(
        proxy.addr(),
        b"GET /big HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    )
    .await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while closed_for(&proxy, "send-timeout").await < 1.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a client that reads nothing still holds its connection"
        );
        tokio::time::sleep(ms(100)).await;
    }
    assert!(closed_within(stuck, DEADLINE).await);
    assert_eq!(
        origin.hits("/big"),
        1,
        "the stuck client was answered from the cache"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_client_resetting_every_stream_makes_corral_fetch_almost_nothing() {
    const STREAMS: usize = 2000;
    let origin = Origin::new()
        .route(
            "/r",
            Reply::ok("r")
                .header("cache-control", "max-age=60")
                .delay(ms(3000)),
        )
        .start()
        .await;
    let proxy = Proxy::new(
        Config::new().route(Route::new("api", origin.url()).coalesce("max_fills", "16")),
    )
    .start()
    .await;

    let tcp = TcpStream::connect(proxy.addr()).await.expect("connect");
    let (h2, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
    let driver = tokio::spawn(connection);
    // Streams reset before the server took them are the h2 crate's to
    // refuse; these are reset a moment after, once corral has started on
    // them: each stream opened, then reset 2 ms later.
    let mut sent = 0;
    for i in 0..STREAMS {
        let request = http::Request::get(format!("http://h/r?k={i}"))
            .body(())
            .expect("request");
        let ready = tokio::time::timeout(DEADLINE, h2.clone().ready()).await;
        let Ok(Ok(mut ready)) = ready else { break };
        let Ok((response, _)) = ready.send_request(request, true) else {
            break;
        };
        sent += 1;
        tokio::time::sleep(ms(2)).await;
        drop(response);
    }
    drop(h2);
    let _ = tokio::time::timeout(DEADLINE, driver).await;

    let fetched = origin.hits("/r");
    assert!(sent >= 64, "the client got {sent} streams out");
    assert!(
        fetched <= 200,
        "{sent} reset streams made corral fetch {fetched} times"
    );
    assert!(closed_for(&proxy, "abandoned-requests").await >= 1.0);
    // The fills nobody wanted were cancelled, and the origin saw it.
    let cancelled = origin.cancelled("/r");
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while origin.cancelled("/r") < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no abandoned fill was cancelled ({cancelled} by the origin's count)"
        );
        tokio::time::sleep(ms(50)).await;
    }
    assert!(
        scrape(&proxy)
            .await
            .sum("corral_fills_cancelled_total", &[])
            >= 1.0
    );
    // Honest clients are still served.
    assert_eq!(Client::new().get(&proxy.url("/r?k=x")).await.text(), "r");
}

/// HTTP/2 carries 128 streams on one connection, and each passed-through
/// stream holds an upstream socket of its own: the descriptor budget counts
/// those sockets, not connections. Four h2 connections keeping 50 POST
/// bodies each open (to an origin that reads the whole body before it
/// answers) get one upstream socket per connection and share the overflow
/// (a quarter of max_connections); the other streams are told 503, and an
/// honest client is served beside them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_streams_with_open_bodies_hold_no_more_upstream_sockets_than_the_budget() {
    // 512 descriptors: 128 for sealed bodies, 256 reserved, 128 left:
    // 56 connections (2.25 descriptors each) and an overflow of 14.
    const LIMIT: u64 = 512;
    const OVERFLOW: usize = 14;
    const CONNECTIONS: usize = 4;
    const STREAMS: usize = 50;
    let origin = Origin::new()
        .route_method(http::Method::POST, "/upload", Reply::echo_body())
        .route(
            "/ok",
            Reply::ok("served").header("cache-control", "no-store"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url()))
        .open_files(LIMIT)
        .start()
        .await;
    let before = open_descriptors(&proxy);
    let mut drivers = Vec::new();
    let mut answers = Vec::new();
    let mut bodies = Vec::new();
    for _ in 0..CONNECTIONS {
        let tcp = TcpStream::connect(proxy.addr()).await.expect("connect");
        let (h2, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
        drivers.push(tokio::spawn(connection));
        for _ in 0..STREAMS {
            let mut ready = h2.clone().ready().await.expect("h2 ready");
            let req = http::Request::post("http://h/upload")
                .body(())
                .expect("request");
            let (response, mut body) = ready.send_request(req, false).expect("send");
            // A first piece of the body; the rest comes at the end.
            body.send_data(bytes::Bytes::from_static(b"part"), false)
                .expect("data");
            bodies.push(body);
            answers.push(tokio::spawn(async move {
                response.await.map(|r| r.status().as_u16()).unwrap_or(0)
            }));
        }
    }
    let held = CONNECTIONS + OVERFLOW;
    // Those that reached the origin are answered at once (it echoes the
    // body as it reads it); the rest wait for a socket (5 s), then 503.
    let mut statuses = Vec::new();
    for a in answers {
        let status = tokio::time::timeout(DEADLINE, a)
            .await
            .expect("every stream answered in time")
            .expect("stream task");
        statuses.push(status);
    }
    let ok = statuses.iter().filter(|s| **s == 200).count();
    let busy = statuses.iter().filter(|s| **s == 503).count();
    assert_eq!(
        (ok, busy),
        (held, CONNECTIONS * STREAMS - held),
        "{statuses:?}"
    );
    assert_eq!(origin.hits("/upload"), held, "no more reached the origin");
    // The bodies still open hold their sockets, and the process about
    // those: not one per stream.
    let during = open_descriptors(&proxy);
    assert!(
        during < before + 2 * held + 10,
        "corral holds {during} descriptors (from {before}) for {} open streams",
        CONNECTIONS * STREAMS
    );
    // An honest client's connection has a socket of its own.
    assert_eq!(Client::new().get(&proxy.url("/ok")).await.text(), "served");
    drop(bodies);
    drop(drivers);
}

/// An `upstream_concurrency` slot measures origin work: a passed-through
/// answer is read ahead of a client that reads slowly (up to
/// max_object_size), so the slot is given back when the origin is done,
/// and two clients that read nothing do not lock everyone else out of the
/// route's two slots. The slow clients still get every byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_readers_do_not_hold_upstream_slots_past_the_origins_answer() {
    // Larger than what the kernel buffers for a client that reads nothing
    // (corral's send buffer grows to 4 MiB at most, see above).
    const SIZE: usize = 12 * 1024 * 1024;
    let origin = Origin::new()
        .route(
            "/big",
            Reply::ok("x".repeat(SIZE)).header("cache-control", "no-store"),
        )
        .route(
            "/small",
            Reply::ok("small").header("cache-control", "no-store"),
        )
        .start()
        .await;
    let config = Config::new()
        .cache("max_object_size", "16MiB")
        .cache("fill_memory", "64MiB")
        .route(
            Route::new("api", origin.url())
                .field("upstream_concurrency", "2")
                .field("upstream_queue_timeout", "2s"),
        );
    let proxy = Proxy::new(config).start().await;
    let mut stuck = Vec::new();
    for _ in 0..2 {
        let request = b"GET /big HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n";
        stuck.push(corral_tests::send_as_slow_reader(proxy.addr(), request).await);
    }
    origin.wait_hits("/big", 2, DEADLINE).await;
    // Both slots were taken; the origin's answers are read ahead, so they
    // come back at once, and the next caller is served.
    let next = Client::new().get(&proxy.url("/small")).await;
    assert_eq!(next.status, 200, "{}", next.cache_status());
    assert_eq!(next.text(), "small");
    let ahead = scrape(&proxy).await.value("corral_ahead_buffer_bytes", &[]);
    assert!(
        ahead.is_some_and(|b| b > 0.0 && b <= 2.0 * SIZE as f64),
        "{ahead:?}"
    );
    // The slow clients lose nothing.
    for mut s in stuck {
        let mut all = Vec::new();
        tokio::time::timeout(DEADLINE, s.read_to_end(&mut all))
            .await
            .expect("read in time")
            .expect("read");
        let body = corral_tests::raw::find_head_end(&all).map_or(0, |at| all.len() - at);
        assert_eq!(body, SIZE);
    }
}

/// The answers on one connection, in order: each head, and its body as its
/// Content-Length frames it (none for a HEAD's answer).
fn answers_in_order(mut raw: &[u8], heads: &[bool]) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for &head_only in heads {
        let end = corral_tests::raw::find_head_end(raw).unwrap_or_else(|| {
            panic!(
                "answer {} incomplete: {:?}",
                out.len() + 1,
                String::from_utf8_lossy(raw)
            )
        });
        let head = String::from_utf8_lossy(&raw[..end]).into_owned();
        let len: usize = corral_tests::raw::head_values(&head, "content-length")
            .first()
            .map_or(0, |v| v.parse().expect("content-length"));
        let len = if head_only { 0 } else { len };
        out.push((head, raw[end..end + len].to_vec()));
        raw = &raw[end + len..];
    }
    assert!(
        raw.is_empty(),
        "bytes after the last answer: {:?}",
        String::from_utf8_lossy(raw)
    );
    out
}

/// HTTP/1.1 GETs and HEADs without a body are served by corral's own loop
/// (`http/h1.rs`); the first request it does not take hands the connection
/// to hyper from that request's first byte. Pipelined on one connection:
/// both serve their share, in order, and the origin sees each request
/// once, framed as the client framed it. A GET with a Content-Length is
/// hyper's too: the bytes its length covers never become a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_is_served_by_corrals_loop_then_by_hyper_in_order() {
    let origin = corral_tests::RawOrigin::start(|req| match (req.method(), req.target()) {
        ("GET", "/a") => {
            corral_tests::raw_origin::response(200, &[("cache-control", "max-age=60")], "a-body")
        }
        ("GET", "/b") => {
            corral_tests::raw_origin::response(200, &[("cache-control", "max-age=60")], "b-body")
        }
        ("GET", "/u") => {
            corral_tests::raw_origin::response(200, &[("cache-control", "no-store")], "u-body")
        }
        ("POST", "/p") => corral_tests::raw_origin::response(
            200,
            &[],
            &format!("posted:{}", String::from_utf8_lossy(&req.body)),
        ),
        _ => corral_tests::raw_origin::response(404, &[], "no"),
    })
    .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let pipelined = b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n\
        GET /a HTTP/1.1\r\nHost: h\r\n\r\n\
        HEAD /a HTTP/1.1\r\nHost: h\r\n\r\n\
        GET /u HTTP/1.1\r\nHost: h\r\n\r\n\
        POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello\
        GET /b HTTP/1.1\r\nHost: h\r\n\r\n\
        GET /a HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n";
    let raw = corral_tests::raw::exchange_bytes(proxy.addr(), pipelined, DEADLINE).await;
    let answers = answers_in_order(&raw, &[false, false, true, false, false, false, false]);
    let bodies: Vec<&[u8]> = answers.iter().map(|(_, b)| b.as_slice()).collect();
    assert_eq!(
        bodies,
        [
            &b"a-body"[..],
            b"a-body",
            b"",
            b"u-body",
            b"posted:hello",
            b"b-body",
            b"a-body"
        ]
    );
    // The origin's own reason phrase ("X") on what it answered without
    // storing (/u by corral's loop, the POST by hyper); one built from a
    // stored entry has the standard one.
    for (i, (head, _)) in answers.iter().enumerate() {
        let line = if [3, 4].contains(&i) {
            "HTTP/1.1 200 X\r\n"
        } else {
            "HTTP/1.1 200 OK\r\n"
        };
        assert!(head.starts_with(line), "answer {}: {head}", i + 1);
    }
    for i in [1, 2, 6] {
        let status = corral_tests::raw::head_values(&answers[i].0, "cache-status").join(",");
        assert!(
            status.contains("hit"),
            "answer {} was not a hit: {status}",
            i + 1
        );
    }
    // The HEAD's answer has the GET's length and no body.
    assert_eq!(
        corral_tests::raw::head_values(&answers[2].0, "content-length"),
        ["6"]
    );
    assert_eq!(
        corral_tests::raw::head_values(&answers[6].0, "connection"),
        ["close"]
    );
    let seen: Vec<(String, String, Vec<u8>)> = origin
        .requests()
        .iter()
        .map(|r| (r.method().to_owned(), r.target().to_owned(), r.body.clone()))
        .collect();
    assert_eq!(
        seen,
        [
            ("GET".to_owned(), "/a".to_owned(), vec![]),
            ("GET".to_owned(), "/u".to_owned(), vec![]),
            ("POST".to_owned(), "/p".to_owned(), b"hello".to_vec()),
            ("GET".to_owned(), "/b".to_owned(), vec![]),
        ]
    );

    // A GET whose Content-Length covers a second request line: hyper's,
    // and what the length covers is body, never a request of its own.
    let hidden = b"GET /b HTTP/1.1\r\nHost: h\r\n\r\n\
        GET /a HTTP/1.1\r\nHost: h\r\nConnection: close\r\nContent-Length: 28\r\n\r\nGET /secret HTTP/1.1\r\nX: y\r\n\r\n";
    let _ = corral_tests::raw::exchange_bytes(proxy.addr(), hidden, DEADLINE).await;
    assert!(
        origin
            .requests()
            .iter()
            .all(|r| !r.target().contains("secret")),
        "a request was smuggled past its Content-Length: {:?}",
        origin
            .requests()
            .iter()
            .map(|r| r.head.clone())
            .collect::<Vec<_>>()
    );
}
