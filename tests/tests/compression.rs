//! Compression on a route with `compression:`: the origin is asked once,
//! for the unencoded answer, whatever the callers accept; each caller gets
//! the stored coding it accepts best (decoded here and compared with the
//! origin's bytes), and a hit copies, never compresses. What must not be
//! compressed (no-transform, already encoded, too small, a type that is
//! not compressible) never is.

use std::io::Read;
use std::time::Duration;

use corral_tests::lifecycle::scrape;
use corral_tests::{
    Answer, Client, Config, DEADLINE, Origin, Proxy, Redis, Reply, Route, RunningOrigin,
    eventually, tally,
};

/// A JSON document of about 20 KiB.
fn document() -> String {
    document_of(200)
}

/// A JSON array of `items` small objects (about 82 bytes each).
fn document_of(items: usize) -> String {
    let items: Vec<String> = (0..items)
        .map(|i| format!("{{\"id\":{i},\"name\":\"item {i}\",\"tags\":[\"cache\",\"proxy\"]}}"))
        .collect();
    format!("[{}]", items.join(","))
}

/// An origin serving [`document`] at `/doc`, fresh for a minute.
async fn document_origin() -> RunningOrigin {
    json_origin(document()).await
}

/// An origin serving `body` as JSON at `/doc`, fresh for a minute.
async fn json_origin(body: String) -> RunningOrigin {
    Origin::new().route("/doc", json(body)).start().await
}

/// `body` as JSON, fresh for a minute.
fn json(body: impl Into<bytes::Bytes>) -> Reply {
    Reply::ok(body)
        .header("content-type", "application/json")
        .header("cache-control", "max-age=60")
}

/// The answer's body decoded from its Content-Encoding.
fn decoded(a: &Answer) -> Vec<u8> {
    let mut out = Vec::new();
    match a.header("content-encoding") {
        None => out = a.body.to_vec(),
        Some("gzip") => {
            flate2::read::GzDecoder::new(&a.body[..])
                .read_to_end(&mut out)
                .expect("gzip");
        }
        Some("br") => {
            brotli::Decompressor::new(&a.body[..], 4096)
                .read_to_end(&mut out)
                .expect("br");
        }
        Some("zstd") => out = zstd::decode_all(&a.body[..]).expect("zstd"),
        Some(other) => panic!("a coding corral does not make: {other}"),
    }
    out
}

/// The request's fields: this Accept-Encoding, or none.
fn accepting(accept: Option<&str>) -> Vec<(&str, &str)> {
    accept.map(|a| ("accept-encoding", a)).into_iter().collect()
}

/// The coding a caller with this Accept-Encoding gets of zstd, br, gzip.
fn best(accept: Option<&str>) -> Option<&'static str> {
    match accept {
        Some("gzip, deflate, br, zstd") => Some("zstd"),
        Some("gzip") => Some("gzip"),
        Some("br;q=1.0, gzip;q=0.8") => Some("br"),
        _ => None,
    }
}

fn compressing(origin: &RunningOrigin, encodings: &str) -> Config {
    Config::new().route(
        Route::new("api", origin.url())
            .field("compression", &format!("{{ encodings: {encodings} }}")),
    )
}

async fn compressed_in(proxy: &corral_tests::RunningProxy) -> f64 {
    scrape(proxy)
        .await
        .sum("corral_compression_bytes_in_total", &[])
}

/// Asks `url` with `fields` until the answer comes in `coding` (made in
/// the background on a caller's first demand), within ten seconds; every
/// answer decodes to [`document`].
async fn made_for(client: &Client, url: &str, fields: &[(&str, &str)], coding: &str) -> Answer {
    let doc = document();
    let within = Duration::from_secs(10);
    made_of(client, url, fields, coding, doc.as_bytes(), within).await
}

/// [`made_for`], for an answer whose body decodes to `body`, within `within`.
async fn made_of(
    client: &Client,
    url: &str,
    fields: &[(&str, &str)],
    coding: &str,
    body: &[u8],
    within: Duration,
) -> Answer {
    let deadline = std::time::Instant::now() + within;
    loop {
        let a = client.get_with(url, fields).await;
        assert!(decoded(&a) == body);
        if a.header("content-encoding") == Some(coding) {
            return a;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{coding} was never made"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The issue's stampede: 1,000 callers with five different
/// Accept-Encoding fields on a cold key are one origin request, asked
/// unencoded; each gets a body it accepts that decodes to the origin's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stampede_in_five_accept_encodings_is_one_fetch_and_every_body_decodes() {
    const ACCEPTS: [Option<&str>; 5] = [
        Some("gzip, deflate, br, zstd"),
        Some("gzip"),
        Some("br;q=1.0, gzip;q=0.8"),
        Some("identity"),
        None,
    ];
    let doc = document();
    let origin = Origin::new()
        .route(
            "/catalog",
            json(doc.clone())
                .header("etag", "\"v1\"")
                .delay(Duration::from_millis(300)),
        )
        .start()
        .await;
    let proxy = Proxy::new(compressing(&origin, "[zstd, br, gzip]"))
        .start()
        .await;
    let client = Client::new();
    // The leader accepts codings: they are made as the answer arrives
    // (a flight led by a HEAD, or by a caller that accepts none, makes
    // none: see the test below).
    let leader = {
        let (client, url) = (client.clone(), proxy.url("/catalog"));
        let accept = ACCEPTS[0];
        tokio::spawn(async move { (accept, client.get_with(&url, &accepting(accept)).await) })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while origin.hits("/catalog") == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the leader never asked"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let tasks: Vec<_> = std::iter::once(leader)
        .chain((1..1000).map(|i| {
            let (client, url) = (client.clone(), proxy.url("/catalog"));
            let accept = ACCEPTS[i % ACCEPTS.len()];
            tokio::spawn(async move { (accept, client.get_with(&url, &accepting(accept)).await) })
        }))
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.expect("task"));
    }
    assert_eq!(
        origin.hits("/catalog"),
        1,
        "{:#?}",
        tally(answers.iter().map(|(_, a)| a))
    );
    let asked = origin.requests("/catalog");
    assert_eq!(asked[0].header("accept-encoding"), Some("identity"));
    for (accept, a) in &answers {
        assert_eq!(a.status, 200);
        assert!(decoded(a) == doc.as_bytes(), "{accept:?}: the body differs");
        // The flight's callers read the answer in their coding as it
        // arrives (compressed once, as it arrives: no length to declare);
        // a later one gets the stored coding. Never one it did not accept.
        let coding = a.header("content-encoding");
        assert_eq!(coding, best(*accept), "{accept:?}");
        if let Some(n) = a.header("content-length") {
            assert_eq!(n, a.body.len().to_string());
        } else {
            assert!(
                coding.is_some(),
                "{accept:?}: the unencoded body has its length"
            );
        }
    }
    // Hits copy: nothing more is compressed for them.
    let before = compressed_in(&proxy).await;
    assert!(before > 0.0);
    for accept in ACCEPTS {
        let hit = client
            .get_with(&proxy.url("/catalog"), &accepting(accept))
            .await;
        assert!(hit.cache_status().is_hit(), "{}", hit.cache_status());
        assert_eq!(hit.header("content-encoding"), best(accept), "{accept:?}");
        assert!(decoded(&hit) == doc.as_bytes());
    }
    assert_eq!(compressed_in(&proxy).await, before, "a hit compressed");
}

/// `curl --compressed` and plain `curl` from one stored entry: the one
/// gets br (the default order prefers it), the other the origin's bytes;
/// each representation has its own ETag, conditionals and ranges are
/// answered on the representation served, and every one says
/// `Vary: Accept-Encoding`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_caller_gets_the_representation_it_accepts_with_its_own_validators() {
    let doc = document();
    let origin = Origin::new()
        .route(
            "/doc",
            Reply::ok(doc.clone())
                .header("content-type", "application/json; charset=utf-8")
                .header("cache-control", "max-age=60")
                .header("etag", "\"v1\""),
        )
        .start()
        .await;
    let config = Config::new().route(Route::new("api", origin.url()).field("compression", "{}"));
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();
    let url = proxy.url("/doc");
    let first = client.get(&url).await;
    assert_eq!(first.body, doc.as_bytes());
    // Stored for a caller that accepts no coding: br is made when first
    // asked for (in the background; that caller gets the unencoded bytes).
    let compressed = made_for(
        &client,
        &url,
        &[("accept-encoding", "deflate, gzip, br")],
        "br",
    )
    .await;
    assert!(
        compressed.cache_status().is_hit(),
        "{}",
        compressed.cache_status()
    );
    assert_eq!(compressed.header("content-encoding"), Some("br"));
    assert_eq!(compressed.header("etag"), Some("\"v1-br\""));
    assert!(decoded(&compressed) == doc.as_bytes());
    let plain = client.get(&url).await;
    assert!(plain.cache_status().is_hit(), "{}", plain.cache_status());
    assert_eq!(plain.header("content-encoding"), None);
    assert_eq!(plain.header("etag"), Some("\"v1\""));
    assert_eq!(plain.body, doc.as_bytes());
    for a in [&compressed, &plain] {
        assert!(
            a.header("vary")
                .is_some_and(|v| v.to_ascii_lowercase().contains("accept-encoding")),
            "{:?}",
            a.header("vary")
        );
    }
    let gzip = made_for(&client, &url, &[("accept-encoding", "gzip")], "gzip").await;
    // Conditionals: each representation by its own ETag.
    let not_modified = client
        .get_with(
            &url,
            &[
                ("accept-encoding", "gzip"),
                ("if-none-match", "\"v1-gzip\""),
            ],
        )
        .await;
    assert_eq!(not_modified.status, 304);
    let other = client
        .get_with(
            &url,
            &[("accept-encoding", "gzip"), ("if-none-match", "\"v1\"")],
        )
        .await;
    assert_eq!(
        other.status, 200,
        "the unencoded ETag is not the gzip one's"
    );
    // A range of the representation served.
    let ranged = client
        .get_with(&url, &[("accept-encoding", "gzip"), ("range", "bytes=0-9")])
        .await;
    assert_eq!(ranged.status, 206);
    assert_eq!(ranged.body, gzip.body.slice(0..10));
    assert_eq!(origin.hits("/doc"), 1);
}

/// What is never compressed: `no-transform`, an answer the origin encoded
/// itself (not encoded twice), one under `min_size`, and one whose type is
/// not listed. Each reaches a caller that accepts gzip as the origin sent
/// it (decoding is not compressing: the counters stay at zero).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_must_not_be_compressed_never_is() {
    let doc = document();
    let gzipped = {
        use std::io::Write;
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(doc.as_bytes()).expect("gzip");
        e.finish().expect("gzip")
    };
    let origin = Origin::new()
        .route(
            "/no-transform",
            json(doc.clone().into_bytes()).header("cache-control", "max-age=60, no-transform"),
        )
        .route(
            "/encoded",
            json(gzipped.clone()).header("content-encoding", "gzip"),
        )
        .route("/small", json(b"{\"ok\":true}".to_vec()))
        .route(
            "/png",
            Reply::ok(doc.clone())
                .header("content-type", "image/png")
                .header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let proxy = Proxy::new(compressing(&origin, "[gzip]")).start().await;
    let client = Client::new();
    for (path, body, coding) in [
        ("/no-transform", doc.as_bytes().to_vec(), None),
        ("/encoded", gzipped.clone(), Some("gzip")),
        ("/small", b"{\"ok\":true}".to_vec(), None),
        ("/png", doc.as_bytes().to_vec(), None),
    ] {
        for round in 0..2 {
            let a = client
                .get_with(&proxy.url(path), &[("accept-encoding", "gzip")])
                .await;
            assert_eq!(a.status, 200, "{path}");
            assert_eq!(a.header("content-encoding"), coding, "{path} round {round}");
            assert!(
                a.body == body,
                "{path} round {round}: the origin's bytes, as sent"
            );
        }
    }
    assert_eq!(compressed_in(&proxy).await, 0.0, "nothing was compressed");
}

/// A mistake in `compression:` names its field, and `corral check`
/// refuses the file.
#[tokio::test]
async fn a_compression_mistake_names_its_field() {
    for (value, field, says) in [
        (
            "{ encodings: [deflate] }",
            "routes[0].compression.encodings[0]",
            "not a coding",
        ),
        (
            "{ encodings: [gzip, gzip] }",
            "routes[0].compression.encodings[1]",
            "listed twice",
        ),
        (
            "{ encodings: [] }",
            "routes[0].compression.encodings",
            "no coding",
        ),
        (
            "{ types: [json] }",
            "routes[0].compression.types[0]",
            "not a media type",
        ),
        (
            "{ min_size: lots }",
            "routes[0].compression.min_size",
            "lots",
        ),
        ("{ level: 9 }", "level", "unknown"),
    ] {
        let config = Config::new()
            .route(Route::new("api", "http://127.0.0.1:9").field("compression", value))
            .render(
                "127.0.0.1:18080".parse().expect("addr"),
                "127.0.0.1:18081".parse().expect("addr"),
            );
        let (status, stderr) = corral_tests::corral_check(&config).await;
        assert!(!status.success(), "{value}: accepted");
        assert!(
            stderr.contains(field) && stderr.contains(says),
            "{value}: {stderr}"
        );
    }
}

/// An uncacheable answer is not compressed; once its key is known to be
/// uncacheable, the origin is asked with the caller's own
/// Accept-Encoding (its answer goes to that caller alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncacheable_key_passes_with_the_callers_own_accept_encoding() {
    let origin = Origin::new()
        .route(
            "/private",
            Reply::ok(document())
                .header("content-type", "application/json")
                .header("cache-control", "no-store"),
        )
        .start()
        .await;
    let proxy = Proxy::new(compressing(&origin, "[gzip]")).start().await;
    let client = Client::new();
    for _ in 0..2 {
        let a = client
            .get_with(&proxy.url("/private"), &[("accept-encoding", "gzip")])
            .await;
        assert_eq!(a.header("content-encoding"), None);
        assert_eq!(a.body, document().as_bytes());
    }
    let asked: Vec<Option<String>> = origin
        .requests("/private")
        .iter()
        .map(|r| r.header("accept-encoding").map(str::to_owned))
        .collect();
    assert_eq!(
        asked,
        [Some("identity".to_owned()), Some("gzip".to_owned())],
        "the fill asks unencoded; the known pass asks as its caller did"
    );
}

/// An origin that encodes its answer although it was asked for none: the
/// answer is kept as it came for callers that accept its coding, and
/// decoded once for every other caller (with a weak ETag: the same
/// content, not the same bytes). One it cannot decode within
/// `max_object_size` (a decompression bomb) is never stored: only the
/// caller it was fetched for gets it, and the next one fetches its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_the_origin_encoded_anyway_reaches_only_callers_that_accept_it() {
    use std::io::Write;
    let gzip = |body: &[u8]| {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(body).expect("gzip");
        e.finish().expect("gzip")
    };
    let doc = document();
    let sent = gzip(doc.as_bytes());
    let bomb = gzip(&vec![0u8; 4 * 1024 * 1024]);
    let origin = Origin::new()
        .route(
            "/gzipped",
            Reply::ok(sent.clone())
                .header("content-type", "application/json")
                .header("content-encoding", "gzip")
                .header("cache-control", "max-age=60")
                .header("etag", "\"e1\""),
        )
        .route(
            "/bomb",
            Reply::ok(bomb.clone())
                .header("content-type", "application/json")
                .header("content-encoding", "gzip")
                .header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let config = compressing(&origin, "[gzip]").cache("max_object_size", "1MiB");
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();
    let url = proxy.url("/gzipped");
    let first = client.get_with(&url, &[("accept-encoding", "gzip")]).await;
    assert_eq!(first.header("content-encoding"), Some("gzip"));
    assert!(first.body == sent);
    for accept in [None, Some("br"), Some("identity"), Some("gzip;q=0, *")] {
        let a = client.get_with(&url, &accepting(accept)).await;
        assert!(
            a.cache_status().is_hit(),
            "{accept:?}: {}",
            a.cache_status()
        );
        assert_eq!(a.header("content-encoding"), None, "{accept:?}");
        assert_eq!(a.body, doc.as_bytes(), "{accept:?}");
        assert_eq!(a.header("etag"), Some("W/\"e1\""), "{accept:?}");
    }
    let again = client.get_with(&url, &[("accept-encoding", "gzip")]).await;
    assert!(again.cache_status().is_hit(), "{}", again.cache_status());
    assert!(again.body == sent, "the origin's bytes, as sent");
    assert_eq!(again.header("etag"), Some("\"e1\""));
    assert_eq!(origin.hits("/gzipped"), 1);

    let bomb_url = proxy.url("/bomb");
    let caller = client
        .get_with(&bomb_url, &[("accept-encoding", "gzip")])
        .await;
    assert!(caller.body == bomb, "its caller gets it as sent");
    assert_eq!(caller.cache_status().detail(), Some("undecodable"));
    let plain = client.get(&bomb_url).await;
    assert!(!plain.cache_status().is_hit(), "{}", plain.cache_status());
    assert_eq!(origin.hits("/bomb"), 2, "never stored");
}

async fn decoded_on_pool(proxy: &corral_tests::RunningProxy) -> f64 {
    scrape(proxy).await.sum(
        "corral_cpu_jobs_total",
        &[("job", "decompress"), ("result", "pool")],
    )
}

/// An answer the origin encoded, read from L2 by an instance whose route
/// compresses, is decoded there on the CPU pool (one `decompress` job),
/// not on the thread that serves its callers; a caller that accepts no
/// coding gets the origin's document, and the origin was asked once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_encoded_entry_read_from_l2_is_decoded_on_the_cpu_pool() {
    let doc = document();
    let sent = gzipped(doc.as_bytes());
    let origin = Origin::new()
        .route(
            "/gzipped",
            Reply::ok(sent.clone())
                .header("content-type", "application/json")
                .header("content-encoding", "gzip")
                .header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let redis = Redis::start().await;
    // The writer's route does not compress (a fleet part-way through a
    // configuration change): it stores the origin's gzip bytes as they
    // came, and the reader, whose route compresses, decodes them.
    let plain = Config::new()
        .route(Route::new("api", origin.url()))
        .redis(&redis.url());
    let writer = Proxy::new(plain).start().await;
    let reader = Proxy::new(compressing(&origin, "[gzip]").redis(&redis.url()))
        .start()
        .await;
    let client = Client::new();
    let first = client
        .get_with(&writer.url("/gzipped"), &[("accept-encoding", "gzip")])
        .await;
    assert!(first.body == sent, "{}", first.cache_status());
    let before = decoded_on_pool(&reader).await;
    let other = client.get(&reader.url("/gzipped")).await;
    assert_eq!(other.status, 200, "{}", other.cache_status());
    assert_eq!(other.header("content-encoding"), None);
    assert_eq!(other.body, doc.as_bytes(), "{}", other.cache_status());
    assert_eq!(origin.hits("/gzipped"), 1, "{}", other.cache_status());
    let after = decoded_on_pool(&reader).await;
    assert_eq!(after - before, 1.0, "decompress jobs on the pool");
}

fn gzipped(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(bytes).expect("gzip");
    enc.finish().expect("gzip")
}

/// An origin that encodes whatever its callers accept: on a route that
/// does not compress, a caller that accepts no coding gets the body
/// decoded (stored beside the encoded one), never the encoded bytes; a
/// gzip bomb that does not decode within `max_object_size`, and a
/// dictionary coding for a caller that offered no dictionary, are a 502
/// (`http_response_content_coding`) for it and are never stored for the
/// next such caller, while a caller that accepts gzip still gets the
/// origin's bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coding_the_caller_does_not_accept_is_decoded_or_refused_never_passed_on() {
    let text = document();
    let small = gzipped(text.as_bytes());
    let bomb = gzipped(&vec![0u8; 4 * 1024 * 1024]);
    let gz = |body: Vec<u8>, cc: &'static str| {
        Reply::ok(body)
            .header("content-encoding", "gzip")
            .header("content-type", "application/json")
            .header("vary", "accept-encoding")
            .header("cache-control", cc)
    };
    let origin = Origin::new()
        .route("/small", gz(small.clone(), "max-age=60"))
        .route("/uncached", gz(small.clone(), "no-store"))
        .route("/bomb", gz(bomb.clone(), "max-age=60"))
        .route(
            "/slow-bomb",
            gz(bomb.clone(), "max-age=60").delay(Duration::from_millis(300)),
        )
        .route(
            "/dcb",
            Reply::ok(vec![0xffu8, 0xd8, 0xff, 1, 2, 3])
                .header("content-encoding", "dcb")
                .header("vary", "accept-encoding, available-dictionary")
                .header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url()).cache("max_object_size", "1MiB"))
        .start()
        .await;
    let client = Client::new();
    let get = |path: &str, accept: &'static str| {
        let client = client.clone();
        let url = proxy.url(path);
        async move {
            client
                .send(
                    http::Method::GET,
                    &url,
                    &[("accept-encoding", accept)],
                    None,
                )
                .await
        }
    };

    for path in ["/small", "/small", "/uncached"] {
        let plain = get(path, "identity").await;
        assert_eq!(plain.status, 200, "{path}");
        assert_eq!(plain.header("content-encoding"), None, "{path}");
        assert!(plain.body == text.as_bytes(), "{path}: decoded for it");
    }
    let encoded = get("/small", "gzip").await;
    assert_eq!(encoded.header("content-encoding"), Some("gzip"));
    assert!(encoded.body == small);
    assert_eq!(origin.hits("/small"), 2, "one fetch per Accept-Encoding");

    for _ in 0..2 {
        let refused = get("/bomb", "identity").await;
        assert_eq!(refused.status, 502);
        assert!(
            refused
                .header("proxy-status")
                .is_some_and(|p| p.contains("http_response_content_coding")),
            "{:?}",
            refused.header("proxy-status")
        );
        assert!(refused.body.len() < 4096, "never the bomb's bytes");
    }
    let accepted = get("/bomb", "gzip").await;
    assert_eq!(accepted.status, 200);
    assert!(accepted.body == bomb, "the caller that accepts gzip");

    // The attacker's flight: its refusal is never the victim's.
    let (attacker, victim) = tokio::join!(get("/slow-bomb", "identity"), async {
        // Joins the attacker's flight once its fetch is under way.
        corral_tests::eventually(Duration::from_secs(5), "the attacker's fetch", || async {
            origin.hits("/slow-bomb") == 1
        })
        .await;
        get("/slow-bomb", "gzip").await
    });
    assert_eq!(attacker.status, 502);
    assert_eq!(victim.status, 200, "{:?}", victim.header("cache-status"));
    assert!(victim.body == bomb);

    for _ in 0..2 {
        let refused = get("/dcb", "gzip, br, dcb").await;
        assert_eq!(refused.status, 502, "no dictionary was offered");
        assert_ne!(refused.header("content-encoding"), Some("dcb"));
    }
    assert_eq!(origin.hits("/dcb"), 2, "never stored for the next caller");
}

/// On a route without `compression:`, an origin that gzips for callers
/// that accept it and says `Vary: Accept-Encoding` (as nginx's `gzip on`
/// and most frameworks do): the five spellings of "gzip" that clients send
/// are one variant and one origin request, asked with `gzip`; callers that
/// accept no gzip share the unencoded one, fetched without the field, and
/// never get a gzip body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_encoding_is_gzip_or_nothing_on_defaults_so_five_spellings_are_one_fetch() {
    use corral_tests::RawOrigin;
    use std::io::Write;
    let doc = document();
    let gzipped = {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(doc.as_bytes()).expect("gzip");
        e.finish().expect("gzip")
    };
    let (plain, sent) = (doc.clone(), gzipped.clone());
    // Reads the field as a lax origin does: any mention of gzip.
    let origin = RawOrigin::start(move |r| {
        let gzip = r
            .header("accept-encoding")
            .is_some_and(|v| v.to_ascii_lowercase().contains("gzip"));
        let body: &[u8] = if gzip { &sent } else { plain.as_bytes() };
        let mut head = String::from(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncache-control: max-age=60\r\nvary: Accept-Encoding\r\n",
        );
        if gzip {
            head.push_str("content-encoding: gzip\r\n");
        }
        head.push_str(&format!("content-length: {}\r\n\r\n", body.len()));
        let mut out = head.into_bytes();
        out.extend_from_slice(body);
        out
    })
    .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    let url = proxy.url("/doc");
    for accept in [
        "gzip, deflate, br",
        "br, gzip",
        "gzip;q=1.0, identity; q=0.5",
        "GZIP",
        "deflate, gzip",
    ] {
        let a = client.get_with(&url, &[("accept-encoding", accept)]).await;
        assert_eq!(a.status, 200, "{accept}");
        assert_eq!(a.header("content-encoding"), Some("gzip"), "{accept}");
        assert!(a.body == gzipped, "{accept}: the origin's gzip bytes");
        assert_eq!(decoded(&a), doc.as_bytes(), "{accept}");
    }
    assert_eq!(origin.requests().len(), 1, "five spellings, one fetch");
    for accept in [None, Some("br"), Some("gzip;q=0"), Some("identity")] {
        let a = client.get_with(&url, &accepting(accept)).await;
        assert_eq!(a.status, 200, "{accept:?}");
        assert_eq!(a.header("content-encoding"), None, "{accept:?}");
        assert_eq!(a.body, doc.as_bytes(), "{accept:?}");
    }
    let asked: Vec<Option<String>> = origin
        .requests()
        .iter()
        .map(|r| r.header("accept-encoding").map(str::to_owned))
        .collect();
    assert_eq!(
        asked,
        [Some("gzip".to_owned()), None],
        "one fetch per class, each asked as its class"
    );
}

/// A HEAD miss (even one that accepts every coding) stores the answer
/// without compressing it, and so does a caller that accepts none: no
/// one pays for codings nobody reads. The coding a caller then asks for
/// is made once, in the background, however many ask for it at once,
/// and no other; until it is there they get the unencoded bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_miss_compresses_nothing_and_a_coding_is_made_once_when_first_asked() {
    let doc = document();
    let origin = Origin::new()
        .route(
            "/doc",
            Reply::ok(doc.clone())
                .header("content-type", "application/json")
                .header("cache-control", "max-age=60")
                .header("etag", "\"v1\""),
        )
        .start()
        .await;
    let proxy = Proxy::new(compressing(&origin, "[zstd, br, gzip]"))
        .start()
        .await;
    let client = Client::new();
    let url = proxy.url("/doc");
    let all = [("accept-encoding", "gzip, deflate, br, zstd")];
    let head = client.send(http::Method::HEAD, &url, &all, None).await;
    assert_eq!(head.status, 200);
    assert_eq!(compressed_in(&proxy).await, 0.0, "a HEAD miss compressed");
    // The HEAD's caller had its answer at the head; the fill stores the
    // body after it. Callers that accept no coding wait for the entry
    // (none of them makes one).
    let (c, u) = (&client, &url);
    eventually(DEADLINE, "the HEAD's fill is stored", move || async move {
        c.get(u).await.cache_status().is_hit()
    })
    .await;
    let plain = client.get(&url).await;
    assert!(plain.cache_status().is_hit(), "{}", plain.cache_status());
    assert_eq!(plain.body, doc.as_bytes());
    assert_eq!(compressed_in(&proxy).await, 0.0, "a plain hit compressed");
    // Twenty callers ask for gzip at once: each gets a body it accepts.
    let gzip = [("accept-encoding", "gzip")];
    let answers =
        futures_util::future::join_all((0..20).map(|_| client.get_with(&url, &gzip))).await;
    for a in &answers {
        assert_eq!(a.status, 200);
        assert!(a.cache_status().is_hit(), "{}", a.cache_status());
        assert!(matches!(a.header("content-encoding"), None | Some("gzip")));
        assert!(decoded(a) == doc.as_bytes());
    }
    // Made in the background: asked again until it is served.
    made_for(&client, &url, &gzip, "gzip").await;
    let metrics = scrape(&proxy).await;
    let made = |coding| metrics.sum("corral_compression_bytes_in_total", &[("coding", coding)]);
    assert_eq!(made("gzip"), doc.len() as f64, "gzip made once");
    assert_eq!((made("br"), made("zstd")), (0.0, 0.0), "nobody asked");
    assert_eq!(
        metrics.sum("corral_codings_made_on_demand_total", &[("coding", "gzip")]),
        1.0
    );
    assert_eq!(origin.hits("/doc"), 1);
}

/// Hostile twin of codings made on demand: an attacker who leads the
/// miss with a HEAD and then asks for br again and again (and with a
/// malformed field) makes br once, and nothing it sends reaches a victim
/// that accepts only gzip: the victim gets the bytes it would have got
/// alone, in gzip once that is made, never br.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attackers_accept_encoding_changes_nothing_a_gzip_caller_gets() {
    let doc = document();
    let origin = document_origin().await;
    let proxy = Proxy::new(compressing(&origin, "[zstd, br, gzip]"))
        .start()
        .await;
    let client = Client::new();
    let url = proxy.url("/doc");
    let head = client
        .send(http::Method::HEAD, &url, &[("accept-encoding", "br")], None)
        .await;
    assert_eq!(head.status, 200);
    for accept in ["br", "br;q=1, gzip;q=0", "br;;;q=x, *;q=0.5", "br"] {
        let a = client.get_with(&url, &[("accept-encoding", accept)]).await;
        assert_eq!(a.status, 200, "{accept}");
        assert!(decoded(&a) == doc.as_bytes(), "{accept}");
    }
    let victim = [("accept-encoding", "gzip")];
    for _ in 0..5 {
        let a = client.get_with(&url, &victim).await;
        assert!(matches!(a.header("content-encoding"), None | Some("gzip")));
        assert!(decoded(&a) == doc.as_bytes());
    }
    let gzip = made_for(&client, &url, &victim, "gzip").await;
    assert_eq!(gzip.header("content-encoding"), Some("gzip"));
    made_for(&client, &url, &[("accept-encoding", "br")], "br").await;
    let metrics = scrape(&proxy).await;
    let made = |coding| metrics.sum("corral_codings_made_on_demand_total", &[("coding", coding)]);
    assert_eq!((made("br"), made("gzip"), made("zstd")), (1.0, 1.0, 0.0));
    assert_eq!(origin.hits("/doc"), 1);
}

/// Codings kept in Redis: an instance that has a coding made on demand
/// keeps it beside the entry, so another instance that reads the entry
/// from Redis and is asked for the same coding reads it there instead of
/// compressing the body again: a coding is made once per body across the
/// fleet. The two instances' br answers are the same bytes, and decode to
/// the origin's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coding_made_on_demand_is_made_once_across_instances() {
    let doc = document();
    let origin = document_origin().await;
    let redis = Redis::start().await;
    let config = || compressing(&origin, "[br, gzip]").redis(&redis.url());
    let first = Proxy::new(config()).start().await;
    let second = Proxy::new(config()).start().await;
    let client = Client::new();
    let br = [("accept-encoding", "br")];
    // Stored for a caller that accepts no coding: no coding made yet.
    let plain = client.get(&first.url("/doc")).await;
    assert_eq!(plain.body, doc.as_bytes());
    let made_first = made_for(&client, &first.url("/doc"), &br, "br").await;
    assert_eq!(redis.keys("*:c:br").await.len(), 1, "br kept in Redis");
    let made_second = made_for(&client, &second.url("/doc"), &br, "br").await;
    assert!(made_second.body == made_first.body, "the same br bytes");
    assert_eq!(origin.hits("/doc"), 1);
    let (one, two) = (scrape(&first).await, scrape(&second).await);
    let on_demand = [("coding", "br")];
    assert_eq!(
        one.sum("corral_codings_made_on_demand_total", &on_demand),
        1.0
    );
    assert_eq!(
        two.sum("corral_codings_made_on_demand_total", &on_demand),
        0.0
    );
    assert_eq!(two.sum("corral_codings_from_l2_total", &on_demand), 1.0);
    assert_eq!(
        two.sum("corral_compression_bytes_in_total", &[]),
        0.0,
        "the second instance compressed nothing"
    );
}

/// Two instances asked for the same coding of the same entry at the same
/// moment make it once: the read of Redis that finds none kept claims its
/// making, and the instance that finds it claimed waits for the kept
/// coding (its callers answered unencoded meanwhile). Both then serve the
/// same br bytes, which decode to the origin's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coding_asked_for_on_two_instances_at_once_is_made_once() {
    // About 900 KiB (under `l2_max_object_size`): slow enough to compress
    // that two instances asking for br at the same moment would both be
    // making it.
    let doc = document_of(11_000);
    let origin = json_origin(doc.clone()).await;
    let redis = Redis::start().await;
    let config = || compressing(&origin, "[br]").redis(&redis.url());
    let first = Proxy::new(config()).start().await;
    let second = Proxy::new(config()).start().await;
    let client = Client::new();
    // Stored unencoded on both, for callers that accept no coding.
    for p in [&first, &second] {
        assert_eq!(client.get(&p.url("/doc")).await.body, doc.as_bytes());
    }
    assert_eq!(origin.hits("/doc"), 1);
    let br = [("accept-encoding", "br")];
    // Both demands at once.
    let (url_a, url_b) = (first.url("/doc"), second.url("/doc"));
    let (a, b) = tokio::join!(client.get_with(&url_a, &br), client.get_with(&url_b, &br));
    for answer in [&a, &b] {
        assert!(decoded(answer) == doc.as_bytes(), "every answer decodes");
    }
    let within = Duration::from_secs(15);
    let br_a = made_of(&client, &url_a, &br, "br", doc.as_bytes(), within).await;
    let br_b = made_of(&client, &url_b, &br, "br", doc.as_bytes(), within).await;
    assert!(br_a.body == br_b.body, "the same br bytes on both");
    let on_demand = [("coding", "br")];
    let (one, two) = (scrape(&first).await, scrape(&second).await);
    let made = one.sum("corral_codings_made_on_demand_total", &on_demand)
        + two.sum("corral_codings_made_on_demand_total", &on_demand);
    let shared = one.sum("corral_codings_from_l2_total", &on_demand)
        + two.sum("corral_codings_from_l2_total", &on_demand);
    assert_eq!((made, shared), (1.0, 1.0), "made once, read once");
    assert!(redis.keys("*:c:br:m").await.is_empty(), "the claim ended");
    assert_eq!(origin.hits("/doc"), 1);
}

/// An instance that claims a coding's making and then finds its CPU pool
/// full ends the claim at once, so that another instance asked for the
/// coding makes it now instead of waiting out the claim's life (5 s).
/// Here the first instance's pool (one slot) is taken by a coded fill
/// that streams for seconds, between its digest of the stored body and
/// its claim: the reply to the claim is held back by a proxy in front of
/// Redis meanwhile, and Redis forgets its scripts first, so that the
/// claim itself is taken only when the reply is let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_on_a_coding_the_cpu_pool_has_no_room_for_is_ended_at_once() {
    let doc = document_of(2_000);
    let origin = Origin::new()
        .route("/doc", json(doc.clone()))
        .route(
            "/slow",
            Reply::trickle(4096, 100, Duration::from_millis(100))
                .header("content-type", "text/plain")
                .header("cache-control", "max-age=60")
                .delay(Duration::from_secs(1)),
        )
        .start()
        .await;
    let redis = Redis::start().await;
    let link = corral_tests::fault_proxy::FaultProxy::start(redis.addr()).await;
    let config = |url: &str| {
        compressing(&origin, "[br]")
            .redis(url)
            .redis_field("op_timeout", "8s")
            .server("cpu_threads", "1")
    };
    let full = Proxy::new(config(&format!("redis://{}/0", link.addr())))
        .start()
        .await;
    let other = Proxy::new(config(&redis.url())).start().await;
    let client = Client::new();
    // Stored unencoded on both, for callers that accept no coding.
    for p in [&full, &other] {
        assert_eq!(client.get(&p.url("/doc")).await.body, doc.as_bytes());
    }
    let br = [("accept-encoding", "br")];
    // A coded fill whose answer comes in a second and then streams for
    // ten: once it comes, it holds the pool's one slot.
    let streaming = {
        let (client, url) = (client.clone(), full.url("/slow"));
        tokio::spawn(async move { client.get_with(&url, &br).await })
    };
    origin.wait_hits("/slow", 1, DEADLINE).await;
    let _: () = redis
        .command(&::redis::cmd("SCRIPT").arg("FLUSH").clone(), "SCRIPT FLUSH")
        .await;
    link.stall(b":c:br:m", 1, Duration::from_secs(3));
    let asked = client.get_with(&full.url("/doc"), &br).await;
    assert!(decoded(&asked) == doc.as_bytes());
    let jobs = |job: &'static str, result: &'static str| {
        let full = &full;
        async move {
            scrape(full)
                .await
                .sum("corral_cpu_jobs_total", &[("job", job), ("result", result)])
        }
    };
    eventually(DEADLINE, "the coded fill holds the pool's slot", || async {
        jobs("compress-stream", "pool").await == 1.0
    })
    .await;
    assert_eq!(link.stalls_left(), 0, "the claim's reply was held back");
    eventually(DEADLINE, "the coding found no room on the pool", || async {
        jobs("compress", "saturated").await >= 1.0
    })
    .await;
    // Ended, not left to lapse (it would stand for 5 s).
    eventually(Duration::from_secs(2), "the claim ended", || async {
        redis.keys("*:c:br:m").await.is_empty()
    })
    .await;
    // Every answer on the way decodes to the origin's bytes.
    made_of(
        &client,
        &other.url("/doc"),
        &br,
        "br",
        doc.as_bytes(),
        Duration::from_secs(15),
    )
    .await;
    let on_demand = [("coding", "br")];
    let (one, two) = (scrape(&full).await, scrape(&other).await);
    assert_eq!(
        (
            one.sum("corral_codings_made_on_demand_total", &on_demand),
            two.sum("corral_codings_made_on_demand_total", &on_demand)
        ),
        (0.0, 1.0),
        "made by the instance with room"
    );
    assert_eq!(origin.hits("/doc"), 1);
    streaming.abort();
}

const PURGE_TOKEN: &str = "purge-token-for-the-tests-0123";

/// The hostile twin: a coding record in Redis that this fleet's key did
/// not seal (here a real one with one byte of its body changed, as anyone
/// who can write to Redis could) is never served: the instance that reads
/// it makes its own, and its callers get bytes that decode to the origin's.
/// A purge removes the kept codings with the entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_coding_in_redis_is_never_served() {
    let doc = document();
    let origin = document_origin().await;
    let redis = Redis::start().await;
    let config = || {
        compressing(&origin, "[br, gzip]")
            .redis(&redis.url())
            .server("purge_token", &format!("\"{PURGE_TOKEN}\""))
    };
    let first = Proxy::new(config()).start().await;
    let second = Proxy::new(config()).start().await;
    let client = Client::new();
    let br = [("accept-encoding", "br")];
    assert_eq!(client.get(&first.url("/doc")).await.body, doc.as_bytes());
    let genuine = made_for(&client, &first.url("/doc"), &br, "br").await;
    let key = redis.keys("*:c:br").await.pop().expect("br kept in Redis");
    let mut forged = redis.get_raw(&key).await.expect("the record");
    let last = forged.len() - 1;
    forged[last] ^= 0x55;
    redis.set_raw(&key, &forged).await;

    let served = made_for(&client, &second.url("/doc"), &br, "br").await;
    assert!(
        served.body == genuine.body,
        "made again, not the forged bytes"
    );
    let metrics = scrape(&second).await;
    let on_demand = [("coding", "br")];
    assert_eq!(metrics.sum("corral_codings_from_l2_total", &on_demand), 0.0);
    assert_eq!(
        metrics.sum("corral_codings_made_on_demand_total", &on_demand),
        1.0
    );
    assert_eq!(
        metrics.sum(
            "corral_redis_unauthenticated_records_total",
            &[("kind", "coding")]
        ),
        1.0
    );
    assert_eq!(origin.hits("/doc"), 1);

    // A purge deletes the entry's kept codings with it.
    let target = first
        .url("/doc")
        .replace(':', "%3A")
        .replace('/', "%2F")
        .replace('?', "%3F");
    let purged = client
        .send(
            http::Method::POST,
            &first.admin_url(&format!("/purge?url={target}")),
            &[("authorization", &format!("Bearer {PURGE_TOKEN}"))],
            None,
        )
        .await;
    assert_eq!(purged.status, 200, "{}", purged.text());
    assert!(
        redis.keys("*:c:*").await.is_empty(),
        "{:?}",
        redis.keys("*").await
    );
}
