//! Flights that stream: a coalesced answer reaches every caller while its
//! body is still arriving, a body that breaks off fails every caller
//! visibly (HTTP/1.1 and h2) and is never stored, and a slow reader holds
//! nobody back. The origin here releases its body chunk by chunk on the
//! test's word, so "before the body ended" is an order of events, not a
//! time.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::join_all;
use http_body_util::StreamBody;
use hyper::body::Frame;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use corral_tests::{Client, Config, DEADLINE, Proxy, Route};

const CHUNK: usize = 64 * 1024;
const CHUNKS: usize = 16; // 1 MiB

/// An origin whose one answer (Content-Length: CHUNK × CHUNKS, or chunked
/// with `chunked`; cacheable, and with `varying`, `Vary: Accept-Language`)
/// sends a chunk each time the test says so; closing the sender before the
/// last one cuts the body short. Counts the requests it got.
struct GatedOrigin {
    url: String,
    gates: Arc<Mutex<Vec<Option<mpsc::UnboundedSender<Bytes>>>>>,
    requests: Arc<Mutex<usize>>,
}

impl GatedOrigin {
    async fn start() -> Self {
        Self::with(CHUNKS, false).await
    }

    async fn with(chunks: usize, varying: bool) -> Self {
        Self::with_fields(chunks, varying, Vec::new()).await
    }

    /// An answer of `chunks` chunks with no Content-Length: chunked.
    async fn chunked(chunks: usize) -> Self {
        Self::serve(chunks, false, Vec::new(), true).await
    }

    /// [`GatedOrigin::chunked`], its answer carrying `fields` too.
    async fn chunked_with(chunks: usize, fields: Vec<(&'static str, String)>) -> Self {
        Self::serve(chunks, false, fields, true).await
    }

    /// [`GatedOrigin::with`], its answer carrying `fields` too.
    async fn with_fields(
        chunks: usize,
        varying: bool,
        fields: Vec<(&'static str, String)>,
    ) -> Self {
        Self::serve(chunks, varying, fields, false).await
    }

    async fn serve(
        chunks: usize,
        varying: bool,
        fields: Vec<(&'static str, String)>,
        chunked: bool,
    ) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let gates: Arc<Mutex<Vec<Option<mpsc::UnboundedSender<Bytes>>>>> = Arc::default();
        let requests: Arc<Mutex<usize>> = Arc::default();
        let (g, r) = (Arc::clone(&gates), Arc::clone(&requests));
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let (g, r) = (Arc::clone(&g), Arc::clone(&r));
                let fields = fields.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |_req| {
                        let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
                        g.lock().expect("gates").push(Some(tx));
                        *r.lock().expect("requests") += 1;
                        // A gate dropped before the whole body went out is an
                        // error: hyper then drops the connection mid-body.
                        let frames = futures_util::stream::unfold(
                            (rx, 0usize),
                            move |(mut rx, sent)| async move {
                                match rx.recv().await {
                                    Some(b) => {
                                        let n = b.len();
                                        Some((Ok(Frame::data(b)), (rx, sent + n)))
                                    }
                                    None if sent < CHUNK * chunks => Some((
                                        Err(std::io::Error::other("cut off")),
                                        (rx, CHUNK * chunks),
                                    )),
                                    None => None,
                                }
                            },
                        );
                        let mut res = hyper::Response::new(StreamBody::new(frames));
                        if !chunked {
                            res.headers_mut().insert(
                                "content-length",
                                (CHUNK * chunks).to_string().parse().expect("value"),
                            );
                        }
                        res.headers_mut()
                            .insert("cache-control", "max-age=60".parse().expect("value"));
                        if varying {
                            res.headers_mut()
                                .insert("vary", "accept-language".parse().expect("value"));
                        }
                        for (name, value) in &fields {
                            let value = value.parse().expect("value");
                            // A Cache-Control of the test's replaces the default.
                            if *name == "cache-control" {
                                res.headers_mut().insert(*name, value);
                            } else {
                                res.headers_mut().append(*name, value);
                            }
                        }
                        async move { Ok::<_, Infallible>(res) }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), service)
                        .await;
                });
            }
        });
        GatedOrigin {
            url,
            gates,
            requests,
        }
    }

    fn requests(&self) -> usize {
        *self.requests.lock().expect("requests")
    }

    /// Waits for the `n`th request and takes its gate: dropping it ends
    /// that body where it is.
    async fn gate(&self, n: usize) -> mpsc::UnboundedSender<Bytes> {
        tokio::time::timeout(DEADLINE, async {
            loop {
                if let Some(g) = self
                    .gates
                    .lock()
                    .expect("gates")
                    .get_mut(n - 1)
                    .and_then(Option::take)
                {
                    return g;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the origin got the request")
    }
}

fn chunk(i: usize) -> Bytes {
    Bytes::from(vec![b'a' + (i % 26) as u8; CHUNK])
}

fn whole() -> Vec<u8> {
    whole_of(CHUNKS)
}

fn whole_of(chunks: usize) -> Vec<u8> {
    (0..chunks).flat_map(|i| chunk(i).to_vec()).collect()
}

/// `n` GETs that each return once their first body bytes arrived, with
/// those bytes and the response to read the rest from.
async fn first_bytes(
    client: &reqwest::Client,
    url: &str,
    n: usize,
) -> Vec<(Vec<u8>, reqwest::Response)> {
    join_all((0..n).map(|_| async {
        let mut res = client.get(url).send().await.expect("answer head");
        assert_eq!(res.status(), 200);
        let first = res.chunk().await.expect("first bytes").expect("some bytes");
        (first.to_vec(), res)
    }))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_coalesced_caller_reads_the_body_while_it_arrives() {
    let origin = GatedOrigin::start().await;
    let proxy = Proxy::new(Config::single(origin.url.clone())).start().await;
    let client = Client::new();
    let url = proxy.url("/big");
    let gate = {
        let (client, url) = (client.inner().clone(), url.clone());
        let heads = tokio::spawn(async move { first_bytes(&client, &url, 100).await });
        let gate = origin.gate(1).await;
        // Half the body, then wait: every caller must already be reading.
        for i in 0..CHUNKS / 2 {
            gate.send(chunk(i)).expect("origin body");
        }
        let responses = tokio::time::timeout(DEADLINE, heads)
            .await
            .expect("every caller got its first bytes while the origin held the rest back")
            .expect("task");
        (gate, responses)
    };
    let (gate, responses) = gate;
    assert_eq!(origin.requests(), 1);
    for i in CHUNKS / 2..CHUNKS {
        gate.send(chunk(i)).expect("origin body");
    }
    let expected = whole();
    let bodies = join_all(responses.into_iter().map(|(mut got, mut res)| async move {
        while let Some(b) = res.chunk().await.expect("the rest") {
            got.extend_from_slice(&b);
        }
        got
    }))
    .await;
    for b in &bodies {
        assert!(b == &expected, "a body of {} bytes differs", b.len());
    }
    // Stored once complete: a later caller is a hit, byte for byte.
    let hit = client.get(&url).await;
    assert!(hit.cache_status().is_hit(), "{}", hit.cache_status());
    assert_eq!(hit.body, expected);
    assert_eq!(origin.requests(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_cut_off_mid_way_fails_every_caller_and_is_not_stored() {
    let origin = GatedOrigin::start().await;
    // The key backs off from its first failure, so that the request after
    // the cut is answered without the origin (the default retries once).
    let route = Route::new("api", origin.url.clone()).field("backoff", "{ after: 1 }");
    let proxy = Proxy::new(Config::new().route(route)).start().await;
    let client = Client::new();
    let url = proxy.url("/cut");
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .expect("h2 client");
    let (h1_heads, h2_heads) = {
        let (c1, c2, u1, u2) = (client.inner().clone(), h2.clone(), url.clone(), url.clone());
        (
            tokio::spawn(async move { first_bytes(&c1, &u1, 20).await }),
            tokio::spawn(async move { first_bytes(&c2, &u2, 20).await }),
        )
    };
    let gate = origin.gate(1).await;
    for i in 0..CHUNKS / 2 {
        gate.send(chunk(i)).expect("origin body");
    }
    let mut responses = h1_heads.await.expect("task");
    responses.extend(h2_heads.await.expect("task"));
    assert_eq!(responses.len(), 40);
    // The origin drops the connection at 50%.
    drop(gate);
    // Read concurrently: h2 streams share one connection window, and one
    // read after another would stall on data the others hold.
    let ends = join_all(responses.into_iter().map(|(_, mut res)| async move {
        let version = res.version();
        loop {
            match res.chunk().await {
                Ok(Some(_)) => {}
                Ok(None) => return (version, false),
                Err(_) => return (version, true),
            }
        }
    }));
    let ends = tokio::time::timeout(DEADLINE, ends)
        .await
        .expect("every caller's body ended");
    for (version, failed) in &ends {
        assert!(failed, "a cut body read as complete over {version:?}");
    }
    let h2s = ends
        .iter()
        .filter(|(v, _)| *v == reqwest::Version::HTTP_2)
        .count();
    assert_eq!(h2s, 20, "half the callers spoke h2");
    // Nothing was stored: the next request is no hit. The failure backs the
    // key off (a failing origin gets less traffic, not more), so it is
    // answered 503 without an origin request ...
    let next = client.get(&url).await;
    assert_eq!(next.status, 503, "{}", next.cache_status());
    assert_eq!(next.cache_status().detail(), Some("backoff"));
    assert_eq!(origin.requests(), 1);
    // ... and once the back-off ends, a new fill fetches it whole.
    let again = {
        let client = client.clone();
        let url = url.clone();
        tokio::spawn(async move {
            tokio::time::timeout(DEADLINE, async {
                loop {
                    let a = client.get(&url).await;
                    if a.cache_status().detail() != Some("backoff") {
                        return a;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
            .await
            .expect("the back-off ended")
        })
    };
    let gate = origin.gate(2).await;
    for i in 0..CHUNKS {
        gate.send(chunk(i)).expect("origin body");
    }
    let res = again.await.expect("task");
    assert_eq!(res.status, 200);
    assert!(res.body == whole(), "the refetched body is whole");
    assert_eq!(origin.requests(), 2);
    let hit = client.get(&url).await;
    assert!(hit.cache_status().is_hit(), "{}", hit.cache_status());
}

/// A caller that reads its answer's head and then stops reading, with a
/// 4 KiB receive buffer: it holds its connection's writes back, nothing
/// else.
async fn stalled_reader(addr: std::net::SocketAddr, path: &str) -> tokio::net::TcpStream {
    use tokio::io::AsyncReadExt;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    let mut tcp = corral_tests::send_as_slow_reader(addr, request.as_bytes()).await;
    let mut head = [0u8; 1];
    tcp.read_exact(&mut head).await.expect("the answer began");
    tcp
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_reader_holds_back_neither_the_fill_nor_the_others() {
    use tokio::io::AsyncReadExt;
    // 8 MiB: far more than the stalled reader's socket buffers take in.
    let chunks = 128;
    let origin = GatedOrigin::with(chunks, false).await;
    let proxy = Proxy::new(
        Config::single(origin.url.clone())
            .cache("memory", "128MiB")
            .cache("max_object_size", "16MiB"),
    )
    .start()
    .await;
    let client = Client::new();
    let url = proxy.url("/slow");
    let before = proxy.rss_mib();
    let slow = tokio::spawn(stalled_reader(proxy.addr(), "/slow"));
    let gate = origin.gate(1).await;
    gate.send(chunk(0)).expect("origin body");
    let mut slow = tokio::time::timeout(DEADLINE, slow)
        .await
        .expect("the stalled reader's answer began")
        .expect("task");
    // Fifty callers join the flight while the body arrives, and read fast.
    let fast = {
        let (client, url) = (client.inner().clone(), url.clone());
        tokio::spawn(async move { first_bytes(&client, &url, 50).await })
    };
    for i in 1..chunks {
        gate.send(chunk(i)).expect("origin body");
    }
    let fast = tokio::time::timeout(DEADLINE, fast)
        .await
        .expect("the fast callers began")
        .expect("task");
    let expected = whole_of(chunks);
    let bodies = join_all(fast.into_iter().map(|(mut got, mut res)| async move {
        while let Some(b) = res.chunk().await.expect("the rest") {
            got.extend_from_slice(&b);
        }
        got
    }));
    let bodies = tokio::time::timeout(DEADLINE, bodies)
        .await
        .expect("the fast callers finished while one caller read nothing");
    assert!(bodies.iter().all(|b| b == &expected), "a fast body differs");
    // The fill finished too: the entry is stored while the stalled caller
    // still holds most of its answer back.
    let hit = client.get(&url).await;
    assert!(hit.cache_status().is_hit(), "{}", hit.cache_status());
    assert_eq!(origin.requests(), 1);
    // Fifty-one readers of an 8 MiB body share its chunks: far less than
    // a copy each (408 MiB) was ever added.
    let grown = proxy.rss_mib() - before;
    assert!(grown < 64.0, "RSS grew {grown:.1} MiB");
    // The stalled caller now reads its whole answer.
    let mut raw = Vec::new();
    tokio::time::timeout(DEADLINE, async {
        let mut buf = vec![0u8; 64 * 1024];
        let mut head_end = None;
        loop {
            let n = slow.read(&mut buf).await.expect("read");
            raw.extend_from_slice(&buf[..n]);
            if head_end.is_none() {
                head_end = raw.windows(4).position(|w| w == b"\r\n\r\n");
            }
            let body_len = head_end.map(|at| raw.len() - (at + 4));
            if n == 0 || body_len >= Some(expected.len()) {
                break;
            }
        }
    })
    .await
    .expect("the stalled caller read to the end");
    let at = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head");
    // The first byte was read before; it begins the head ("H").
    let body = &raw[at + 4..];
    assert!(
        body == &expected[..],
        "the stalled caller's body differs ({} bytes)",
        body.len()
    );
    println!("rss grew {grown:.1} MiB");
}

/// Across instances nothing streams: a waiting instance answers from the
/// entry in Redis. An answer too large for Redis (`l2_max_object_size`)
/// never gets there, so the leader says so as soon as its head arrives and
/// each waiting instance fetches its own copy at once, side by side,
/// rather than waiting out the leader's download and then taking the
/// lease one after another (until lock_timeout let every caller go).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_too_large_for_redis_is_fetched_once_per_instance_at_once() {
    let redis = corral_tests::Redis::start().await;
    let origin = GatedOrigin::start().await;
    let proxies = Proxy::new(
        Config::single(origin.url.clone())
            .redis(&redis.url())
            .redis_field("op_timeout", "250ms")
            .redis_field("l2_max_object_size", "256KiB"),
    )
    .instances(3)
    .start_all()
    .await;
    let client = Client::new();
    let callers: Vec<_> = proxies
        .iter()
        .flat_map(|p| std::iter::repeat_n(p.url("/large"), 10))
        .map(|url| {
            let client = client.clone();
            tokio::spawn(async move { client.get(&url).await })
        })
        .collect();
    let first = origin.gate(1).await;
    first.send(chunk(0)).expect("origin body");
    // The other two instances ask while the first answer is still held
    // back after its first chunk.
    let (second, third) = (origin.gate(2).await, origin.gate(3).await);
    for gate in [&first, &second, &third] {
        for i in usize::from(std::ptr::eq(gate, &first))..CHUNKS {
            gate.send(chunk(i)).expect("origin body");
        }
    }
    let expected = whole();
    for caller in callers {
        let a = tokio::time::timeout(DEADLINE, caller)
            .await
            .expect("every caller answered")
            .expect("task");
        assert_eq!(a.status, 200, "{}", a.cache_status());
        assert!(
            a.body == expected,
            "a body of {} bytes differs",
            a.body.len()
        );
    }
    assert_eq!(origin.requests(), 3, "one request per instance");
}

/// The first answer of a URI that varies is read whole before anyone gets
/// it (its flight's callers were keyed before the Vary was known): callers
/// of the other variant then learn the Vary from the stored entry and
/// coalesce on their own variant's flight, one origin request per variant,
/// instead of finding a stream that is not theirs and each fetching alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_of_another_variant_coalesce_on_their_own_flight() {
    let origin = GatedOrigin::with(CHUNKS, true).await;
    let proxy = Proxy::new(Config::single(origin.url.clone())).start().await;
    let client = Client::new();
    let url = proxy.url("/v");
    let callers: Vec<_> = ["en", "de"]
        .into_iter()
        .flat_map(|lang| std::iter::repeat_n(lang, 10))
        .map(|lang| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move { client.get_with(&url, &[("accept-language", lang)]).await })
        })
        .collect();
    for n in 1..=2 {
        let gate = origin.gate(n).await;
        for i in 0..CHUNKS {
            gate.send(chunk(i)).expect("origin body");
        }
    }
    let expected = whole();
    for caller in callers {
        let a = tokio::time::timeout(DEADLINE, caller)
            .await
            .expect("every caller answered")
            .expect("task");
        assert_eq!(a.status, 200, "{}", a.cache_status());
        assert!(
            a.body == expected,
            "a body of {} bytes differs",
            a.body.len()
        );
    }
    assert_eq!(origin.requests(), 2, "one request per variant");
}

/// `Content-Digest` / `Repr-Digest` value of `body` (RFC 9530), computed
/// here with sha2, not with corral's code.
fn sha256_field(body: &[u8]) -> String {
    use base64::Engine;
    use sha2::Digest;
    format!(
        "sha-256=:{}:",
        base64::engine::general_purpose::STANDARD.encode(sha2::Sha256::digest(body))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_fails_its_digest_fails_every_reader_and_is_not_stored() {
    // Every byte arrives, to the last, but not the bytes the origin's
    // Content-Digest names: one byte of the body differs.
    let mut claimed = whole();
    claimed[CHUNK * CHUNKS - 1] ^= 1;
    let origin = GatedOrigin::with_fields(
        CHUNKS,
        false,
        vec![("content-digest", sha256_field(&claimed))],
    )
    .await;
    let route = Route::new("api", origin.url.clone()).field("backoff", "{ after: 1 }");
    let proxy = Proxy::new(Config::new().route(route)).start().await;
    let client = Client::new();
    let url = proxy.url("/digest");
    let heads = {
        let (c, u) = (client.inner().clone(), url.clone());
        tokio::spawn(async move { first_bytes(&c, &u, 20).await })
    };
    let gate = origin.gate(1).await;
    gate.send(chunk(0)).expect("origin body");
    let responses = heads.await.expect("task");
    for i in 1..CHUNKS {
        gate.send(chunk(i)).expect("origin body");
    }
    let ends = join_all(responses.into_iter().map(|(first, mut res)| async move {
        let mut got = first;
        loop {
            match res.chunk().await {
                Ok(Some(b)) => got.extend_from_slice(&b),
                Ok(None) => return Some(got),
                Err(_) => return None,
            }
        }
    }));
    let ends = tokio::time::timeout(DEADLINE, ends)
        .await
        .expect("every caller's body ended");
    for (i, end) in ends.iter().enumerate() {
        assert!(
            end.is_none(),
            "caller {i} read {} bytes as a complete body",
            end.as_ref().map_or(0, Vec::len)
        );
    }
    // Not stored: the key backs off, like a body cut short.
    let next = client.get(&url).await;
    assert_eq!(next.status, 503, "{}", next.cache_status());
    assert_eq!(next.cache_status().detail(), Some("backoff"));
    assert_eq!(origin.requests(), 1);
    let metrics = corral_tests::lifecycle::scrape(&proxy).await;
    assert_eq!(
        metrics.value(
            "corral_digest_mismatches_total",
            &[("route", "api"), ("field", "content-digest")]
        ),
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_has_its_digest_is_stored_and_one_read_whole_that_fails_it_is_a_502() {
    use corral_tests::{Origin, Reply};
    let body = "{\"hello\": \"world\"}";
    let origin = Origin::new()
        .route(
            "/good",
            Reply::ok(body)
                .header("cache-control", "max-age=60")
                .header(
                    "content-digest",
                    &format!("md5=:AAAA:, {}", sha256_field(body.as_bytes())),
                )
                .header("repr-digest", &sha256_field(body.as_bytes())),
        )
        // The first answer with a Vary: read whole before anyone gets a
        // byte (its flight's callers were keyed without it).
        .route(
            "/bad",
            Reply::trickle(100, 3, Duration::from_millis(1))
                .header("cache-control", "max-age=60")
                .header("vary", "accept-language")
                .header("repr-digest", &sha256_field(b"something else")),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    let good = client.get(&proxy.url("/good")).await;
    assert_eq!((good.status.as_u16(), good.text().as_str()), (200, body));
    let hit = client.get(&proxy.url("/good")).await;
    assert!(hit.cache_status().is_hit(), "{}", hit.cache_status());
    assert_eq!(origin.hits("/good"), 1);

    let bad = client.get(&proxy.url("/bad")).await;
    assert_eq!(bad.status, 502, "{}", bad.cache_status());
    assert_eq!(
        bad.cache_status().detail(),
        Some("upstream-digest-mismatch")
    );
    assert_eq!(
        bad.header("proxy-status"),
        Some(
            "corral; error=http_response_incomplete; details=\"upstream-digest-mismatch\"; received-status=200"
        ),
        "RFC 9209 §2.1.3: the status the origin sent"
    );
    let metrics = corral_tests::lifecycle::scrape(&proxy).await;
    assert_eq!(
        metrics.value(
            "corral_digest_mismatches_total",
            &[("route", "api"), ("field", "repr-digest")]
        ),
        Some(1.0)
    );
}

// ---------------------------------------------------------------------------
// Answers without a Content-Length (chunked)
// ---------------------------------------------------------------------------

/// Reads the rest of each response after its first bytes, all at once;
/// `Err` for a body that failed.
async fn rest_of(responses: Vec<(Vec<u8>, reqwest::Response)>) -> Vec<Result<Vec<u8>, String>> {
    let bodies = join_all(responses.into_iter().map(|(mut got, mut res)| async move {
        loop {
            match res.chunk().await {
                Ok(Some(b)) => got.extend_from_slice(&b),
                Ok(None) => return Ok(got),
                Err(e) => return Err(format!("{e:#}")),
            }
        }
    }));
    tokio::time::timeout(DEADLINE, bodies)
        .await
        .expect("every body ended")
}

/// A chunked answer streams to every caller of its flight as it arrives,
/// as one with a Content-Length does, and is stored once complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_body_reaches_every_coalesced_caller_while_it_arrives() {
    let origin = GatedOrigin::chunked(CHUNKS).await;
    let proxy = Proxy::new(Config::single(origin.url.clone())).start().await;
    let client = Client::new();
    let url = proxy.url("/chunked");
    let heads = {
        let (client, url) = (client.inner().clone(), url.clone());
        tokio::spawn(async move { first_bytes(&client, &url, 100).await })
    };
    let gate = origin.gate(1).await;
    for i in 0..CHUNKS / 2 {
        gate.send(chunk(i)).expect("origin body");
    }
    let responses = tokio::time::timeout(DEADLINE, heads)
        .await
        .expect("every caller got its first bytes while the origin held the rest back")
        .expect("task");
    assert_eq!(origin.requests(), 1);
    assert!(
        responses
            .iter()
            .all(|(_, r)| r.headers().get("content-length").is_none()),
        "no length is made up"
    );
    for i in CHUNKS / 2..CHUNKS {
        gate.send(chunk(i)).expect("origin body");
    }
    drop(gate);
    let expected = whole();
    for body in rest_of(responses).await {
        let body = body.expect("a whole body");
        assert!(body == expected, "a body of {} bytes differs", body.len());
    }
    let hit = client.get(&url).await;
    assert!(hit.cache_status().is_hit(), "{}", hit.cache_status());
    assert_eq!(hit.body, expected);
    assert_eq!(origin.requests(), 1);
}

/// A chunked answer the origin cuts short (no last chunk) fails every
/// caller that was reading it, and nothing is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_body_cut_off_fails_every_caller_and_is_not_stored() {
    let origin = GatedOrigin::chunked(CHUNKS).await;
    let route = Route::new("api", origin.url.clone()).field("backoff", "{ after: 1 }");
    let proxy = Proxy::new(Config::new().route(route)).start().await;
    let client = Client::new();
    let url = proxy.url("/cut");
    let heads = {
        let (client, url) = (client.inner().clone(), url.clone());
        tokio::spawn(async move { first_bytes(&client, &url, 20).await })
    };
    let gate = origin.gate(1).await;
    for i in 0..CHUNKS / 2 {
        gate.send(chunk(i)).expect("origin body");
    }
    let responses = heads.await.expect("task");
    drop(gate);
    for body in rest_of(responses).await {
        assert!(body.is_err(), "a cut body read as complete");
    }
    let next = client.get(&url).await;
    assert!(!next.cache_status().is_hit(), "{}", next.cache_status());
    assert_eq!(
        next.cache_status().detail(),
        Some("backoff"),
        "nothing stored"
    );
    assert_eq!(origin.requests(), 1);
}

/// A chunked answer that outgrows `max_object_size` after its readers
/// began is passed through to them: each gets the whole body, byte for
/// byte, nothing is stored, and the next caller fetches alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_body_past_the_object_size_reaches_its_readers_whole_and_is_not_stored() {
    let origin = GatedOrigin::chunked(CHUNKS).await;
    // 1 MiB in 64 KiB chunks against a 256 KiB object size.
    let config = Config::single(origin.url.clone()).cache("max_object_size", "256KiB");
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();
    let url = proxy.url("/large");
    let heads = {
        let (client, url) = (client.inner().clone(), url.clone());
        tokio::spawn(async move { first_bytes(&client, &url, 20).await })
    };
    let gate = origin.gate(1).await;
    gate.send(chunk(0)).expect("origin body");
    let responses = tokio::time::timeout(DEADLINE, heads)
        .await
        .expect("every caller got its first bytes")
        .expect("task");
    let reading = tokio::spawn(rest_of(responses));
    for i in 1..CHUNKS {
        gate.send(chunk(i)).expect("origin body");
    }
    drop(gate);
    let expected = whole();
    for body in reading.await.expect("task") {
        let body = body.expect("a whole body");
        assert!(body == expected, "a body of {} bytes differs", body.len());
    }
    assert_eq!(origin.requests(), 1);
    // Not stored: the next caller fetches its own copy.
    let next = {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move { client.get(&url).await })
    };
    let gate = origin.gate(2).await;
    for i in 0..CHUNKS {
        gate.send(chunk(i)).expect("origin body");
    }
    drop(gate);
    let next = next.await.expect("task");
    assert!(!next.cache_status().is_hit(), "{}", next.cache_status());
    assert!(next.body == expected);
    assert_eq!(origin.requests(), 2);
}

/// A miss that has a stale copy an origin error could serve reads its
/// answer whole first (a streamed head could not fall back to the copy),
/// unless the answer says `Incremental: ?1`: then it streams, and its
/// readers get its first bytes while the origin holds the rest back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incremental_answer_streams_even_with_a_stale_copy_in_hand() {
    let fields = vec![
        ("cache-control", "max-age=0, stale-if-error=600".to_owned()),
        ("incremental", "?1".to_owned()),
    ];
    let origin = GatedOrigin::chunked_with(4, fields).await;
    let proxy = Proxy::new(Config::single(origin.url.clone())).start().await;
    let client = Client::new();
    let url = proxy.url("/events");
    // The first answer is stored, stale at once but good for errors.
    let first = {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move { client.get(&url).await })
    };
    let gate = origin.gate(1).await;
    for i in 0..4 {
        gate.send(chunk(i)).expect("origin body");
    }
    drop(gate);
    let first = first.await.expect("task");
    assert!(first.cache_status().stored(), "{}", first.cache_status());
    assert!(first.body == whole_of(4));
    // The next miss has that copy in hand, and still streams.
    let heads = {
        let (client, url) = (client.inner().clone(), url.clone());
        tokio::spawn(async move { first_bytes(&client, &url, 5).await })
    };
    let gate = origin.gate(2).await;
    gate.send(chunk(0)).expect("origin body");
    let responses = tokio::time::timeout(DEADLINE, heads)
        .await
        .expect("the callers got the first bytes while the origin held the rest")
        .expect("task");
    for i in 1..4 {
        gate.send(chunk(i)).expect("origin body");
    }
    drop(gate);
    for body in rest_of(responses).await {
        assert!(body.expect("whole") == whole_of(4));
    }
    assert_eq!(origin.requests(), 2);
}

// ---------------------------------------------------------------------------
// Compressed as it arrives (a route with `compression:`)
// ---------------------------------------------------------------------------

/// The Accept-Encoding fields of a flight's callers, and the coding each
/// gets of zstd, br, gzip (none: the unencoded body).
const ACCEPTS: [(Option<&str>, Option<&str>); 5] = [
    (Some("gzip, deflate, br, zstd"), Some("zstd")),
    (Some("gzip"), Some("gzip")),
    (Some("br;q=1.0, gzip;q=0.8"), Some("br")),
    (Some("identity"), None),
    (None, None),
];

fn compressing(origin: &GatedOrigin) -> Config {
    Config::new().route(
        Route::new("api", origin.url.clone())
            .field("compression", "{ encodings: [zstd, br, gzip] }"),
    )
}

fn json() -> Vec<(&'static str, String)> {
    vec![("content-type", "application/json".to_owned())]
}

/// What a reader can decode of `coding` so far (a body still arriving).
fn decode_prefix(coding: Option<&str>, packed: &[u8]) -> Vec<u8> {
    use std::io::Read;
    let mut reader: Box<dyn Read + '_> = match coding {
        None => return packed.to_vec(),
        Some("gzip") => Box::new(flate2::read::GzDecoder::new(packed)),
        Some("br") => Box::new(brotli::Decompressor::new(packed, 4096)),
        Some("zstd") => Box::new(zstd::stream::read::Decoder::new(packed).expect("zstd")),
        Some(other) => panic!("a coding corral does not make: {other}"),
    };
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    while let Ok(n @ 1..) = reader.read(&mut buf) {
        out.extend_from_slice(&buf[..n]);
    }
    out
}

/// A caller's answer in the making: its coding, and the bytes so far.
struct Reading {
    accept: Option<&'static str>,
    coding: Option<String>,
    got: Vec<u8>,
    res: reqwest::Response,
}

impl Reading {
    /// Reads on until `n` bytes of the body decode (the answer still
    /// arriving), within the deadline.
    async fn until_decoded(&mut self, n: usize) {
        tokio::time::timeout(DEADLINE, async {
            while decode_prefix(self.coding.as_deref(), &self.got).len() < n {
                let more = self.res.chunk().await.expect("more").expect("not the end");
                self.got.extend_from_slice(&more);
            }
        })
        .await
        .unwrap_or_else(|_| {
            panic!(
                "{:?}: fewer than {n} bytes decoded ({} read, {} decoded)",
                self.accept,
                self.got.len(),
                decode_prefix(self.coding.as_deref(), &self.got).len()
            )
        });
    }

    /// The rest of the body, or the error it ended with.
    async fn rest(mut self) -> Result<Vec<u8>, String> {
        loop {
            match self.res.chunk().await {
                Ok(Some(b)) => self.got.extend_from_slice(&b),
                Ok(None) => return Ok(self.got),
                Err(e) => return Err(format!("{e:#}")),
            }
        }
    }
}

/// `n` callers, their Accept-Encoding in turn from [`ACCEPTS`], each
/// returned once its answer's head came. The first leads the flight, alone: it accepts every coding, so each is
/// made as the answer arrives (a flight led by a caller that accepts no
/// coding makes none).
async fn callers(client: &reqwest::Client, url: &str, n: usize) -> Vec<Reading> {
    let first = caller(client, url, 0).await;
    let rest = join_all((1..n).map(|i| caller(client, url, i))).await;
    std::iter::once(first).chain(rest).collect()
}

/// The `i`th caller of [`callers`], once its answer's head came.
async fn caller(client: &reqwest::Client, url: &str, i: usize) -> Reading {
    let accept = ACCEPTS[i % ACCEPTS.len()].0;
    let mut req = client.get(url);
    if let Some(a) = accept {
        req = req.header("accept-encoding", a);
    }
    let res = req.send().await.expect("answer head");
    assert_eq!(res.status(), 200);
    let coding = res
        .headers()
        .get("content-encoding")
        .map(|v| v.to_str().expect("ascii").to_owned());
    Reading {
        accept,
        coding,
        got: Vec::new(),
        res,
    }
}

fn expected_coding(accept: Option<&str>) -> Option<&'static str> {
    ACCEPTS
        .iter()
        .find(|(a, _)| *a == accept)
        .and_then(|(_, c)| *c)
}

/// The flight's callers get the coding they accept while the answer is
/// still arriving: it is compressed once, as it arrives, and each
/// caller's first half decodes while the origin holds the second back.
/// Those codings are the ones stored: later callers hit them, and no
/// coding was made twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flights_callers_read_their_coding_while_the_answer_arrives() {
    for chunked in [false, true] {
        let origin = GatedOrigin::serve(CHUNKS, false, json(), chunked).await;
        let proxy = Proxy::new(compressing(&origin)).start().await;
        let client = Client::new();
        let url = proxy.url("/feed");
        let heads = {
            let (client, url) = (client.inner().clone(), url.clone());
            tokio::spawn(async move { callers(&client, &url, 50).await })
        };
        let gate = origin.gate(1).await;
        for i in 0..CHUNKS / 2 {
            gate.send(chunk(i)).expect("origin body");
        }
        let mut readings = tokio::time::timeout(DEADLINE, heads)
            .await
            .expect("every caller got its head while the origin held the rest back")
            .expect("task");
        let half = CHUNK * CHUNKS / 2;
        for r in &mut readings {
            assert_eq!(
                r.coding.as_deref(),
                expected_coding(r.accept),
                "{:?}",
                r.accept
            );
            if r.coding.is_some() {
                assert!(r.res.headers().get("content-length").is_none());
                let vary = r.res.headers().get("vary").expect("vary");
                assert_eq!(vary.to_str().expect("ascii"), "Accept-Encoding");
            }
            // Less at most what was fed since the coding's last flush when
            // that was too little to be worth one (`compress::FLUSH_AFTER`,
            // 128 bytes): the network may cut the last chunk so.
            r.until_decoded(half - 128).await;
        }
        assert_eq!(origin.requests(), 1, "chunked: {chunked}");
        for i in CHUNKS / 2..CHUNKS {
            gate.send(chunk(i)).expect("origin body");
        }
        drop(gate);
        let expected = whole();
        for r in readings {
            let (accept, coding) = (r.accept, r.coding.clone());
            let body = r.rest().await.expect("a whole body");
            let plain = decode_prefix(coding.as_deref(), &body);
            assert!(
                plain == expected,
                "{accept:?}: {} bytes differ",
                plain.len()
            );
        }
        // Stored in the codings made as it arrived: each was made once.
        let scrape = corral_tests::lifecycle::scrape(&proxy).await;
        for coding in ["zstd", "br", "gzip"] {
            let made = scrape.sum("corral_compression_bytes_in_total", &[("coding", coding)]);
            assert_eq!(made, expected.len() as f64, "{coding}");
        }
        for (accept, coding) in ACCEPTS {
            let headers: Vec<(&str, &str)> =
                accept.map(|a| ("accept-encoding", a)).into_iter().collect();
            let hit = client.get_with(&url, &headers).await;
            assert!(hit.cache_status().is_hit(), "{}", hit.cache_status());
            assert_eq!(hit.header("content-encoding"), coding, "{accept:?}");
            assert!(decode_prefix(coding, &hit.body) == expected);
        }
        let after = corral_tests::lifecycle::scrape(&proxy).await;
        assert_eq!(
            after.sum("corral_compression_bytes_in_total", &[]),
            scrape.sum("corral_compression_bytes_in_total", &[]),
            "a hit compressed"
        );
        assert_eq!(
            after.sum("corral_variants_per_key_count", &[]),
            1.0,
            "one entry stored"
        );
        assert_eq!(
            after.sum("corral_variants_per_key_sum", &[]),
            4.0,
            "unencoded, zstd, br, gzip"
        );
        assert_eq!(origin.requests(), 1);
    }
}

/// A body cut short fails the readers of every coding too, and nothing is
/// stored; one that outgrows the object size reaches the readers of each
/// coding whole, and is not stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coded_stream_fails_or_passes_through_with_its_body() {
    // Cut short.
    let origin = GatedOrigin::serve(CHUNKS, false, json(), true).await;
    let route = Route::new("api", origin.url.clone())
        .field("compression", "{ encodings: [zstd, br, gzip] }")
        .field("backoff", "{ after: 1 }");
    let proxy = Proxy::new(Config::new().route(route)).start().await;
    let client = Client::new();
    let url = proxy.url("/cut");
    let heads = {
        let (client, url) = (client.inner().clone(), url.clone());
        tokio::spawn(async move { callers(&client, &url, 20).await })
    };
    let gate = origin.gate(1).await;
    for i in 0..CHUNKS / 2 {
        gate.send(chunk(i)).expect("origin body");
    }
    let readings = tokio::time::timeout(DEADLINE, heads)
        .await
        .expect("heads")
        .expect("task");
    drop(gate);
    for r in readings {
        let accept = r.accept;
        assert!(
            r.rest().await.is_err(),
            "{accept:?}: a cut body read as complete"
        );
    }
    let next = client.get(&url).await;
    assert_eq!(
        next.cache_status().detail(),
        Some("backoff"),
        "nothing stored"
    );

    // Past the object size.
    let origin = GatedOrigin::serve(CHUNKS, false, json(), true).await;
    let config = compressing(&origin).cache("max_object_size", "256KiB");
    let proxy = Proxy::new(config).start().await;
    let url = proxy.url("/large");
    let heads = {
        let (client, url) = (client.inner().clone(), url.clone());
        tokio::spawn(async move { callers(&client, &url, 20).await })
    };
    let gate = origin.gate(1).await;
    gate.send(chunk(0)).expect("origin body");
    let readings = tokio::time::timeout(DEADLINE, heads)
        .await
        .expect("heads")
        .expect("task");
    let reading = tokio::spawn(join_all(readings.into_iter().map(|r| async move {
        let (accept, coding) = (r.accept, r.coding.clone());
        (accept, coding, r.rest().await)
    })));
    for i in 1..CHUNKS {
        gate.send(chunk(i)).expect("origin body");
    }
    drop(gate);
    let expected = whole();
    for (accept, coding, body) in tokio::time::timeout(DEADLINE, reading)
        .await
        .expect("every body ended")
        .expect("task")
    {
        assert_eq!(coding.as_deref(), expected_coding(accept), "{accept:?}");
        let plain = decode_prefix(coding.as_deref(), &body.expect("a whole body"));
        assert!(
            plain == expected,
            "{accept:?}: {} bytes differ",
            plain.len()
        );
    }
    assert_eq!(origin.requests(), 1);
    let scrape = corral_tests::lifecycle::scrape(&proxy).await;
    assert_eq!(
        scrape.sum("corral_variants_per_key_count", &[]),
        0.0,
        "stored"
    );
}

/// The codings made as a body of declared length arrives take their room
/// in `fill_memory` before they start: where the worst they can take does
/// not fit beside the body, the flight's callers read it unencoded, and
/// the codings are made when it is stored. Where it fits, they get their
/// coding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coded_streams_take_their_room_in_fill_memory_first() {
    // 1 MiB streamed holds 2 MiB; three codings at worst 3 × 2 × 1.13 MiB.
    for (fill_memory, coded) in [("4MiB", false), ("16MiB", true)] {
        let origin = GatedOrigin::serve(CHUNKS, false, json(), false).await;
        let config = compressing(&origin).cache("fill_memory", fill_memory);
        let proxy = Proxy::new(config).start().await;
        let client = Client::new();
        let url = proxy.url("/feed");
        let heads = {
            let (client, url) = (client.inner().clone(), url.clone());
            tokio::spawn(async move { callers(&client, &url, 10).await })
        };
        let gate = origin.gate(1).await;
        for i in 0..CHUNKS {
            gate.send(chunk(i)).expect("origin body");
        }
        drop(gate);
        let readings = tokio::time::timeout(DEADLINE, heads)
            .await
            .expect("heads")
            .expect("task");
        let expected = whole();
        for r in readings {
            let (accept, coding) = (r.accept, r.coding.clone());
            let want = if coded { expected_coding(accept) } else { None };
            assert_eq!(coding.as_deref(), want, "{fill_memory}: {accept:?}");
            let plain = decode_prefix(coding.as_deref(), &r.rest().await.expect("whole"));
            assert!(
                plain == expected,
                "{accept:?}: {} bytes differ",
                plain.len()
            );
        }
        // Stored in every coding either way.
        let hit = client.get_with(&url, &[("accept-encoding", "gzip")]).await;
        assert!(hit.cache_status().is_hit(), "{}", hit.cache_status());
        assert_eq!(hit.header("content-encoding"), Some("gzip"));
        assert_eq!(origin.requests(), 1);
    }
}
