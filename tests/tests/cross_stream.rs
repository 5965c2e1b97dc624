//! A growing body shared across instances: the caller of an instance that
//! waits on another instance's fill reads the body as the origin sends it
//! (relayed through a Redis stream), a body that breaks off is cut for
//! every caller and never stored, and a part forged in Redis by someone
//! without the fleet's key never reaches a caller. The origin here sends
//! its answer chunk by chunk on the test's word, so "before the origin
//! finished" is an order of events, not a time.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::StreamBody;
use hyper::body::Frame;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use corral_tests::lifecycle::scrape;
use corral_tests::shared::wait_for_key;
use corral_tests::{Client, Config, DEADLINE, Proxy, Redis, Route, RunningProxy, eventually};

const CHUNK: usize = 64 * 1024;
const CHUNKS: usize = 8; // 512 KiB, within l2_max_object_size

/// An origin whose answer (Content-Length: CHUNK × CHUNKS, cacheable) goes
/// out when the test sends its first chunk, the rest chunk by chunk on the
/// test's word; dropping the sender before the last cuts the body short.
/// Counts the requests it got.
struct GatedOrigin {
    url: String,
    gates: Arc<Mutex<Vec<Option<mpsc::UnboundedSender<Bytes>>>>>,
}

impl GatedOrigin {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let gates: Arc<Mutex<Vec<Option<mpsc::UnboundedSender<Bytes>>>>> = Arc::default();
        let g = Arc::clone(&gates);
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let g = Arc::clone(&g);
                tokio::spawn(async move {
                    let service = service_fn(move |_req| {
                        let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
                        g.lock().expect("gates").push(Some(tx));
                        async move { Ok::<_, Infallible>(answer(rx).await) }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), service)
                        .await;
                });
            }
        });
        GatedOrigin { url, gates }
    }

    fn requests(&self) -> usize {
        self.gates.lock().expect("gates").len()
    }

    /// Waits for the `n`th request and takes its gate.
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

type Frames =
    StreamBody<futures_util::stream::BoxStream<'static, Result<Frame<Bytes>, std::io::Error>>>;

/// The answer, its head held until the first chunk is released.
async fn answer(mut rx: mpsc::UnboundedReceiver<Bytes>) -> hyper::Response<Frames> {
    let first = rx.recv().await;
    let sent = first.as_ref().map_or(0, Bytes::len);
    let head = futures_util::stream::iter(first.map(|b| Ok(Frame::data(b))));
    // A gate dropped before the whole body went out is an error: hyper
    // then drops the connection mid-body.
    let rest = futures_util::stream::unfold((rx, sent), |(mut rx, sent)| async move {
        match rx.recv().await {
            Some(b) => {
                let n = b.len();
                Some((Ok(Frame::data(b)), (rx, sent + n)))
            }
            None if sent < CHUNK * CHUNKS => {
                Some((Err(std::io::Error::other("cut off")), (rx, CHUNK * CHUNKS)))
            }
            None => None,
        }
    });
    let frames: futures_util::stream::BoxStream<'static, _> =
        Box::pin(futures_util::StreamExt::chain(head, rest));
    let mut res = hyper::Response::new(StreamBody::new(frames));
    res.headers_mut().insert(
        "content-length",
        (CHUNK * CHUNKS).to_string().parse().expect("value"),
    );
    res.headers_mut()
        .insert("cache-control", "max-age=60".parse().expect("value"));
    res
}

/// One entry of `XRANGE`: its id and its fields.
type StreamEntry = (String, Vec<(String, Vec<u8>)>);

fn chunk(i: usize) -> Bytes {
    Bytes::from(vec![b'a' + (i % 26) as u8; CHUNK])
}

fn whole() -> Vec<u8> {
    (0..CHUNKS).flat_map(|i| chunk(i).to_vec()).collect()
}

/// Two instances on one Redis (the fleet key is the harness's).
async fn two_instances(origin: &GatedOrigin, redis: &Redis) -> (RunningProxy, RunningProxy) {
    let config = Config::new()
        .route(Route::new("api", origin.url.clone()))
        .redis(&redis.url())
        .redis_field("op_timeout", "250ms");
    let a = Proxy::new(config.clone()).start().await;
    let b = Proxy::new(config).start().await;
    (a, b)
}

/// A GET that returns once its first body bytes arrived, with those bytes
/// and the response to read the rest from.
async fn first_bytes(client: reqwest::Client, url: String) -> (Vec<u8>, reqwest::Response) {
    let mut res = client.get(&url).send().await.expect("answer head");
    assert_eq!(res.status(), 200);
    let first = res.chunk().await.expect("first bytes").expect("some bytes");
    (first.to_vec(), res)
}

/// The rest of `res` after `got`, and whether it broke off.
async fn rest(mut got: Vec<u8>, mut res: reqwest::Response) -> (Vec<u8>, bool) {
    loop {
        match res.chunk().await {
            Ok(Some(b)) => got.extend_from_slice(&b),
            Ok(None) => return (got, false),
            Err(_) => return (got, true),
        }
    }
}

/// A's caller leads (the origin has its request, holding the answer), and
/// B's caller waits on A's lease: B has lost the lease to A, and has said
/// it reads A's stream when A announced it (where it does). Returns A's
/// and B's pending GETs.
async fn a_leads_b_waits(
    origin: &GatedOrigin,
    redis: &Redis,
    (a, b): (&RunningProxy, &RunningProxy),
    path: &str,
) -> (
    tokio::task::JoinHandle<(Vec<u8>, reqwest::Response)>,
    tokio::task::JoinHandle<(Vec<u8>, reqwest::Response)>,
) {
    let client = Client::new().inner().clone();
    let at_a = tokio::spawn(first_bytes(client.clone(), a.url(path)));
    eventually(DEADLINE, "the origin got A's request", || async {
        origin.requests() == 1
    })
    .await;
    let at_b = tokio::spawn(first_bytes(client, b.url(path)));
    eventually(DEADLINE, "B waits on A's lease", || async {
        scrape(b)
            .await
            .sum("corral_lease_total", &[("outcome", "lost")])
            >= 1.0
    })
    .await;
    // B says it reads A's stream when it hears A announce it (A's head
    // is in); an instance without streams never does, and then the test
    // goes on to show that its caller's first bytes wait for the whole
    // body.
    let _ = tokio::time::timeout(
        Duration::from_secs(3),
        wait_for_key(redis, "*:readers:*", Duration::from_secs(3)),
    )
    .await;
    (at_a, at_b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_instance_reads_the_body_while_the_origin_still_sends_it() {
    let redis = Redis::start().await;
    let origin = GatedOrigin::start().await;
    let (a, b) = two_instances(&origin, &redis).await;
    let (at_a, at_b) = a_leads_b_waits(&origin, &redis, (&a, &b), "/big").await;
    let gate = origin.gate(1).await;
    gate.send(chunk(0)).expect("origin body");
    // The origin holds the rest back until B's caller has its first bytes.
    let (a_first, a_res) = tokio::time::timeout(DEADLINE, at_a)
        .await
        .expect("A's caller got its first bytes")
        .expect("task");
    let (b_first, b_res) = tokio::time::timeout(DEADLINE, at_b)
        .await
        .expect("B's caller got its first bytes while the origin held the rest back")
        .expect("task");
    assert_eq!(origin.requests(), 1);
    let cache_status = b_res
        .headers()
        .get("cache-status")
        .map(|v| v.to_str().unwrap_or_default().to_owned())
        .unwrap_or_default();
    assert!(
        cache_status.contains("collapsed") && cache_status.contains("detail=l2"),
        "{cache_status}"
    );
    for i in 1..CHUNKS {
        gate.send(chunk(i)).expect("origin body");
    }
    let (a_body, a_cut) = rest(a_first, a_res).await;
    let (b_body, b_cut) = rest(b_first, b_res).await;
    assert!(!a_cut && !b_cut, "a body broke off");
    assert!(
        a_body == whole(),
        "A's body of {} bytes differs",
        a_body.len()
    );
    assert!(
        b_body == whole(),
        "B's body of {} bytes differs",
        b_body.len()
    );
    // Stored from L2 as before: B's callers after it are answered byte
    // for byte without the origin, and B soon has the entry (the relayed
    // body can end before B's fill has read the entry from L2: a caller
    // then is collapsed onto that fill, as `detail=l2` says).
    eventually(DEADLINE, "B's caller is a hit", || async {
        let next = Client::new().get(&b.url("/big")).await;
        assert!(next.body == whole(), "{}", next.cache_status());
        assert_eq!(origin.requests(), 1);
        next.cache_status().is_hit()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_cut_off_mid_way_is_cut_on_the_waiting_instance_and_not_stored() {
    let redis = Redis::start().await;
    let origin = GatedOrigin::start().await;
    let (a, b) = two_instances(&origin, &redis).await;
    let (at_a, at_b) = a_leads_b_waits(&origin, &redis, (&a, &b), "/cut").await;
    let gate = origin.gate(1).await;
    gate.send(chunk(0)).expect("origin body");
    let (b_first, b_res) = tokio::time::timeout(DEADLINE, at_b)
        .await
        .expect("B's caller got its first bytes while the origin held the rest back")
        .expect("task");
    for i in 1..CHUNKS / 2 {
        gate.send(chunk(i)).expect("origin body");
    }
    // The origin drops the connection at half the body.
    drop(gate);
    let (b_body, b_cut) = tokio::time::timeout(DEADLINE, rest(b_first, b_res))
        .await
        .expect("B's caller's body ended");
    assert!(
        b_cut,
        "a cut body read as complete at B ({} bytes)",
        b_body.len()
    );
    assert!(b_body.len() < CHUNK * CHUNKS);
    assert!(
        whole().starts_with(&b_body),
        "B got bytes the origin never sent"
    );
    let (a_first, a_res) = at_a.await.expect("task");
    let (_, a_cut) = rest(a_first, a_res).await;
    assert!(a_cut, "a cut body read as complete at A");
    // Nothing was stored from the broken body: the origin is asked again
    // (B's fill, now that the leader failed), and what B serves next is
    // that answer, whole.
    let gate = origin.gate(2).await;
    for i in 0..CHUNKS {
        gate.send(chunk(i)).expect("origin body");
    }
    let next = tokio::time::timeout(DEADLINE, Client::new().get(&b.url("/cut")))
        .await
        .expect("the next request was answered");
    assert_eq!(next.status, 200, "{}", next.cache_status());
    assert!(next.body == whole(), "the refetched body is whole");
    assert_eq!(origin.requests(), 2);
}

/// The hostile twin: someone who can write to Redis but has no fleet key
/// appends a part of their own to the stream A relays its body through.
/// B's caller gets the origin's bytes and nothing else: the relay breaks
/// where the forgery sits and its answer is finished from the entry A
/// sealed in L2 (or cut), and the next caller gets the origin's whole
/// body from L2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_forged_in_the_stream_never_reaches_a_caller() {
    let redis = Redis::start().await;
    let origin = GatedOrigin::start().await;
    let (a, b) = two_instances(&origin, &redis).await;
    let (at_a, at_b) = a_leads_b_waits(&origin, &redis, (&a, &b), "/twin").await;
    let gate = origin.gate(1).await;
    gate.send(chunk(0)).expect("origin body");
    let stream = wait_for_key(&redis, "*:stream:*", DEADLINE).await;
    // A data part (sequence number 2, after the head and the first chunk)
    // with a tag the attacker made up, then a copy of the stream's own head
    // (a valid tag, out of its place).
    let mut forged = 2u64.to_be_bytes().to_vec();
    forged.push(1);
    forged.extend_from_slice(b"FORGED BODY BYTES");
    let mut sealed = vec![0x5a; 32];
    sealed.extend_from_slice(&forged);
    let mut xadd = redis::cmd("XADD");
    xadd.arg(&stream).arg("*").arg("p").arg(sealed);
    let _: String = redis.command(&xadd, "XADD a forged part").await;
    let mut range = redis::cmd("XRANGE");
    range.arg(&stream).arg("-").arg("+").arg("COUNT").arg(1);
    let first: Vec<StreamEntry> = redis.command(&range, "XRANGE").await;
    let head = first[0].1[0].1.clone();
    let mut replay = redis::cmd("XADD");
    replay.arg(&stream).arg("*").arg("p").arg(head);
    let _: String = redis.command(&replay, "XADD a replayed head").await;
    for i in 1..CHUNKS {
        gate.send(chunk(i)).expect("origin body");
    }
    // B's caller may be cut before its first bytes: read as it comes.
    let (b_body, b_cut) = match tokio::time::timeout(DEADLINE, at_b)
        .await
        .expect("B's caller was answered")
    {
        Ok((first, res)) => tokio::time::timeout(DEADLINE, rest(first, res))
            .await
            .expect("B's caller's body ended"),
        Err(_) => (Vec::new(), true),
    };
    // The victim got the origin's body, or a prefix of it cut short:
    // never a forged byte.
    assert!(
        whole().starts_with(&b_body),
        "B got bytes the origin never sent"
    );
    assert!(b_cut || b_body == whole(), "a short body read as complete");
    let (a_first, a_res) = at_a.await.expect("task");
    let (a_body, a_cut) = rest(a_first, a_res).await;
    assert!(!a_cut && a_body == whole());
    // What is stored came from L2, sealed by A: B's next caller gets the
    // origin's body, and the origin was asked once.
    let next = Client::new().get(&b.url("/twin")).await;
    assert!(next.body == whole(), "{}", next.cache_status());
    assert_eq!(origin.requests(), 1);
    // The refusal is counted.
    let refused = scrape(&b).await.sum(
        "corral_redis_unauthenticated_records_total",
        &[("kind", "stream-part")],
    );
    assert!(refused >= 1.0, "refused {refused}");
}
