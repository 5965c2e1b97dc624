//! HEAD through the cache (RFC 9111 §4, §4.3.5): a HEAD is answered from
//! a stored GET answer while it is fresh; one that finds no copy fills it
//! with a GET; one that finds a copy no longer fresh asks the origin with
//! HEAD, and the answer freshens the copy (here and, through Redis, on
//! every instance) or retires it. Each scenario asserts the methods and
//! the number of requests that reached the origin, and what every client
//! got. Lifetimes run out on corral's test clock, never by sleeping.

use std::time::Duration;

use corral_tests::raw_origin::response;
use corral_tests::{
    Answer, Client, Config, DEADLINE, Origin, Proxy, RawOrigin, RawRequest, Redis, Reply, Route,
    RunningOrigin,
};
use http::Method;

/// Past a `max-age=1`.
const PAST_ONE_SECOND: Duration = Duration::from_millis(1200);

const BODY: &str = "the whole representation";

/// The methods of the requests that reached `origin` for `path`, in order.
fn methods(origin: &RunningOrigin, path: &str) -> Vec<String> {
    origin
        .requests(path)
        .iter()
        .map(|r| r.method.to_string())
        .collect()
}

/// A GET answer stored for a second, and the origin's HEAD answer for the
/// same representation (same ETag and length) with new fields.
fn origin_freshening(path: &str, head_delay: Duration) -> Origin {
    Origin::new()
        .route(
            path,
            Reply::ok(BODY)
                .header("cache-control", "max-age=1")
                .header("etag", "\"v1\"")
                .header("template-a", "1"),
        )
        .route_method(
            Method::HEAD,
            path,
            Reply::ok(BODY)
                .header("cache-control", "max-age=100")
                .header("etag", "\"v1\"")
                .header("template-a", "2")
                .delay(head_delay),
        )
}

fn assert_whole(a: &Answer, what: &str) {
    assert_eq!(a.status, 200, "{what}");
    assert_eq!(a.text(), BODY, "{what}");
    assert_eq!(
        a.header("content-length"),
        Some(BODY.len().to_string().as_str()),
        "{what}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_of_a_stale_copy_is_sent_as_head_and_freshens_it() {
    let origin = origin_freshening("/doc", Duration::ZERO).start().await;
    let proxy = Proxy::new(Config::single(origin.url()))
        .with_test_clock()
        .start()
        .await;
    let client = Client::new();

    // No copy: the HEAD fills the cache with a GET, which the next GET
    // is answered from.
    let cold = client.head(&proxy.url("/doc")).await;
    assert_eq!(cold.status, 200);
    assert!(cold.body.is_empty());
    assert_eq!(methods(&origin, "/doc"), ["GET"]);
    let hit = client.get(&proxy.url("/doc")).await;
    assert_whole(&hit, "the GET after a cold HEAD");
    assert!(hit.cache_status().is_hit(), "{}", hit.cache_status());
    // A fresh copy answers a HEAD without a request.
    let fresh = client.head(&proxy.url("/doc")).await;
    assert!(fresh.cache_status().is_hit(), "{}", fresh.cache_status());
    assert_eq!(origin.hits("/doc"), 1);

    proxy.advance_clock(PAST_ONE_SECOND).await;
    let head = client.head(&proxy.url("/doc")).await;
    assert_eq!(methods(&origin, "/doc"), ["GET", "HEAD"]);
    // Conditional on the stored validator, as a GET's revalidation is.
    assert_eq!(
        origin.requests("/doc")[1].header("if-none-match"),
        Some("\"v1\"")
    );
    assert_eq!(head.status, 200);
    assert!(head.body.is_empty());
    assert_eq!(head.header("template-a"), Some("2"));
    assert_eq!(head.header("content-length"), Some("24"));
    let status = head.cache_status();
    assert_eq!(status.fwd(), Some("stale"), "{status}");
    assert_eq!(status.param("fwd-status"), Some("200"), "{status}");

    // The stored answer took the HEAD's fields and lifetime, and kept its
    // body: the next GET is a hit.
    let after = client.get(&proxy.url("/doc")).await;
    assert_whole(&after, "the GET after the HEAD");
    assert_eq!(after.header("template-a"), Some("2"));
    assert!(after.cache_status().is_hit(), "{}", after.cache_status());
    assert_eq!(methods(&origin, "/doc"), ["GET", "HEAD"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_without_validators_is_freshened_by_a_head_that_agrees_on_its_length() {
    // The case §4.3.5 is for: no validator, so no 304 is possible.
    let origin = Origin::new()
        .route(
            "/bare",
            Reply::ok(BODY)
                .header("cache-control", "max-age=1")
                .header("template-a", "1"),
        )
        .route_method(
            Method::HEAD,
            "/bare",
            Reply::ok(BODY)
                .header("cache-control", "max-age=100")
                .header("template-a", "2"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url()))
        .with_test_clock()
        .start()
        .await;
    let client = Client::new();
    assert_whole(&client.get(&proxy.url("/bare")).await, "the fill");
    proxy.advance_clock(PAST_ONE_SECOND).await;
    let head = client.head(&proxy.url("/bare")).await;
    assert_eq!(head.header("template-a"), Some("2"));
    assert_eq!(methods(&origin, "/bare"), ["GET", "HEAD"]);
    assert_eq!(origin.requests("/bare")[1].header("if-none-match"), None);
    let after = client.get(&proxy.url("/bare")).await;
    assert_whole(&after, "the GET after the HEAD");
    assert_eq!(after.header("template-a"), Some("2"));
    assert!(after.cache_status().is_hit(), "{}", after.cache_status());
    assert_eq!(origin.hits("/bare"), 2);
}

/// A raw origin's answer to `r`: `status`, `headers` and `body`, the body
/// left out for a HEAD (its Content-Length still says how long it is).
fn answer(r: &RawRequest, status: u16, headers: &[(&str, &str)], body: &str) -> Vec<u8> {
    let bytes = response(status, headers, body);
    if r.method() != "HEAD" {
        return bytes;
    }
    let end = bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head")
        + 4;
    bytes[..end].to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_answer_that_no_longer_describes_the_copy_retires_it() {
    // /changed: the HEAD names another ETag. /gone: the HEAD is a 410.
    // /denied: a 403 is about the request, not the representation.
    let origin = RawOrigin::start(|r| {
        let head = r.method() == "HEAD";
        match (r.target(), head) {
            ("/changed", true) => answer(r, 200, &[("etag", "\"v2\"")], "new"),
            ("/gone", true) => answer(r, 410, &[("template-a", "gone")], ""),
            ("/denied", true) => answer(r, 403, &[], "denied"),
            (_, _) => answer(
                r,
                200,
                &[("cache-control", "max-age=1"), ("etag", "\"v1\"")],
                BODY,
            ),
        }
    })
    .await;
    let proxy = Proxy::new(Config::single(origin.url()))
        .with_test_clock()
        .start()
        .await;
    let client = Client::new();
    for path in ["/changed", "/gone", "/denied"] {
        assert_whole(&client.get(&proxy.url(path)).await, path);
    }
    proxy.advance_clock(PAST_ONE_SECOND).await;

    let changed = client.head(&proxy.url("/changed")).await;
    assert_eq!(changed.status, 200);
    assert_eq!(changed.header("etag"), Some("\"v2\""));
    let gone = client.head(&proxy.url("/gone")).await;
    assert_eq!(gone.status, 410);
    assert_eq!(gone.header("template-a"), Some("gone"));
    let denied = client.head(&proxy.url("/denied")).await;
    assert_eq!(denied.status, 403);

    for path in ["/changed", "/gone", "/denied"] {
        assert_whole(&client.get(&proxy.url(path)).await, path);
    }
    let seen = origin.requests();
    let line = |r: &RawRequest| {
        format!(
            "{} {} {}",
            r.method(),
            r.target(),
            r.header("if-none-match").unwrap_or("-")
        )
    };
    let seen: Vec<String> = seen.iter().skip(3).map(line).collect();
    assert_eq!(
        seen,
        [
            "HEAD /changed \"v1\"",
            "HEAD /gone \"v1\"",
            "HEAD /denied \"v1\"",
            // Retired: fetched whole, not revalidated.
            "GET /changed -",
            "GET /gone -",
            // Left as it was: revalidated with its validator.
            "GET /denied \"v1\"",
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_heads_on_a_stale_copy_is_one_head_at_the_origin() {
    let origin = origin_freshening("/burst", Duration::from_millis(300))
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url()))
        .with_test_clock()
        .start()
        .await;
    let client = Client::new();
    assert_whole(&client.get(&proxy.url("/burst")).await, "the fill");
    proxy.advance_clock(PAST_ONE_SECOND).await;

    let heads: Vec<_> = (0..20)
        .map(|_| {
            let client = client.clone();
            let url = proxy.url("/burst");
            tokio::spawn(async move { client.head(&url).await })
        })
        .collect();
    for h in heads {
        let a = h.await.expect("a HEAD task");
        assert_eq!(a.status, 200);
        assert!(a.body.is_empty());
        assert_eq!(a.header("template-a"), Some("2"));
    }
    assert_eq!(methods(&origin, "/burst"), ["GET", "HEAD"]);
    let after = client.get(&proxy.url("/burst")).await;
    assert_whole(&after, "the GET after the burst");
    assert!(after.cache_status().is_hit(), "{}", after.cache_status());
    assert_eq!(origin.hits("/burst"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_beside_a_slow_head_gets_the_whole_body_and_its_own_fields() {
    // The hostile twin of HEAD: an attacker's HEAD is at the origin when
    // a victim's GET arrives. The GET never waits on (or gets) the HEAD's
    // empty answer, and the HEAD's answer, sent before the GET's, does not
    // replace what the GET stored.
    let origin = origin_freshening("/twin", Duration::from_secs(2))
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url()))
        .with_test_clock()
        .start()
        .await;
    let client = Client::new();
    assert_whole(&client.get(&proxy.url("/twin")).await, "the fill");
    proxy.advance_clock(PAST_ONE_SECOND).await;
    // What the victim's GET gets lives long enough to be looked at after
    // the HEAD's two seconds.
    origin.set_route(
        "/twin",
        Reply::ok(BODY)
            .header("cache-control", "max-age=100")
            .header("etag", "\"v1\"")
            .header("template-a", "1"),
    );

    let attacker = {
        let client = client.clone();
        let url = proxy.url("/twin");
        tokio::spawn(async move { client.head(&url).await })
    };
    origin.wait_hits("/twin", 2, DEADLINE).await;
    let victim = client.get(&proxy.url("/twin")).await;
    assert_whole(&victim, "the victim's GET");
    assert_eq!(victim.header("template-a"), Some("1"));
    assert_eq!(methods(&origin, "/twin"), ["GET", "HEAD", "GET"]);
    let attacked = attacker.await.expect("the HEAD task");
    assert_eq!(attacked.status, 200);
    assert!(attacked.body.is_empty());

    // What the victim's GET stored stands.
    let again = client.get(&proxy.url("/twin")).await;
    assert_whole(&again, "the next GET");
    assert_eq!(again.header("template-a"), Some("1"));
    assert!(again.cache_status().is_hit(), "{}", again.cache_status());
    assert_eq!(origin.hits("/twin"), 3);
}

/// What a victim's GET of a stale copy gets after an attacker's HEAD of
/// it with `attack` (none: the victim alone), and the requests the origin
/// saw: an origin that answers a HEAD carrying `x-attack` with a 401, or
/// with another ETag, or the same representation with the attacker's
/// value echoed.
async fn victim_after(attack: Option<&str>) -> (Answer, Vec<String>) {
    let origin = RawOrigin::start(|r| {
        let fields = [("cache-control", "max-age=1"), ("etag", "\"v1\"")];
        match r.header("x-attack") {
            Some("deny") => answer(r, 401, &[], "no"),
            Some("other") => answer(r, 200, &[("etag", "\"evil\"")], ""),
            _ if r.header("if-none-match") == Some("\"v1\"") && r.method() == "GET" => {
                answer(r, 304, &fields, "")
            }
            _ => answer(r, 200, &fields, BODY),
        }
    })
    .await;
    let proxy = Proxy::new(Config::single(origin.url()))
        .with_test_clock()
        .start()
        .await;
    let client = Client::new();
    assert_whole(&client.get(&proxy.url("/page")).await, "the fill");
    proxy.advance_clock(PAST_ONE_SECOND).await;
    if let Some(value) = attack {
        let a = client
            .send(
                Method::HEAD,
                &proxy.url("/page"),
                &[("x-attack", value)],
                None,
            )
            .await;
        assert!(a.body.is_empty());
    }
    let victim = client.get(&proxy.url("/page")).await;
    let seen = origin
        .requests()
        .iter()
        .map(|r| format!("{} {}", r.method(), r.header("x-attack").unwrap_or("-")))
        .collect();
    (victim, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attackers_head_changes_nothing_a_victims_get_gets() {
    let (alone, seen) = victim_after(None).await;
    assert_whole(&alone, "alone");
    assert_eq!(seen, ["GET -", "GET -"]);
    for attack in ["deny", "other"] {
        let (victim, seen) = victim_after(Some(attack)).await;
        assert_eq!(victim.status, alone.status, "{attack}");
        assert_eq!(victim.body, alone.body, "{attack}");
        for field in ["etag", "cache-control", "content-length"] {
            assert_eq!(
                victim.header(field),
                alone.header(field),
                "{attack}: {field}"
            );
        }
        // The attacker's HEAD reached the origin as a HEAD; the victim's
        // GET was fetched as it would have been.
        assert_eq!(
            seen,
            [
                "GET -".to_owned(),
                format!("HEAD {attack}"),
                "GET -".to_owned()
            ],
            "{attack}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_freshened_by_a_head_on_one_instance_is_fresh_on_the_other() {
    let redis = Redis::start().await;
    let origin = origin_freshening("/shared", Duration::ZERO).start().await;
    let config = Config::new()
        .route(Route::new("api", origin.url()))
        .redis(&redis.url());
    let proxies = Proxy::new(config)
        .instances(2)
        .with_test_clock()
        .start_all()
        .await;
    let (a, b) = (&proxies[0], &proxies[1]);
    let client = Client::new();
    assert_whole(&client.get(&a.url("/shared")).await, "A's fill");
    // B holds the copy too (read from Redis into its own memory).
    assert_whole(&client.get(&b.url("/shared")).await, "B's copy");
    assert_eq!(origin.hits("/shared"), 1);
    for proxy in &proxies {
        proxy.advance_clock(PAST_ONE_SECOND).await;
    }

    let head = client.head(&a.url("/shared")).await;
    assert_eq!(head.header("template-a"), Some("2"));
    assert_eq!(methods(&origin, "/shared"), ["GET", "HEAD"]);
    let on_b = client.get(&b.url("/shared")).await;
    assert_whole(&on_b, "B after A's HEAD");
    assert_eq!(on_b.header("template-a"), Some("2"));
    assert_eq!(
        on_b.cache_status().detail(),
        Some("l2"),
        "{}",
        on_b.cache_status()
    );
    assert_eq!(methods(&origin, "/shared"), ["GET", "HEAD"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heads_on_two_instances_and_a_get_beside_them_are_one_head_at_the_origin() {
    let redis = Redis::start().await;
    let origin = origin_freshening("/fleet", Duration::from_millis(500))
        .start()
        .await;
    let config = Config::new()
        .route(Route::new("api", origin.url()))
        .redis(&redis.url());
    let proxies = Proxy::new(config)
        .instances(2)
        .with_test_clock()
        .start_all()
        .await;
    let client = Client::new();
    for proxy in &proxies {
        assert_whole(&client.get(&proxy.url("/fleet")).await, "a copy");
    }
    assert_eq!(origin.hits("/fleet"), 1);
    for proxy in &proxies {
        proxy.advance_clock(PAST_ONE_SECOND).await;
    }

    let heads: Vec<_> = (0..20)
        .map(|i| {
            let client = client.clone();
            let url = proxies[i % 2].url("/fleet");
            tokio::spawn(async move { client.head(&url).await })
        })
        .collect();
    // A GET on the other instance while the HEAD is at the origin: it is
    // answered from what the HEAD freshened (a whole stored answer, read
    // from Redis), never from the HEAD's own answer.
    origin.wait_hits("/fleet", 2, DEADLINE).await;
    let get = client.get(&proxies[1].url("/fleet")).await;
    assert_whole(&get, "the GET beside the HEADs");
    for h in heads {
        let a = h.await.expect("a HEAD task");
        assert_eq!(a.status, 200);
        assert!(a.body.is_empty());
        assert_eq!(a.header("template-a"), Some("2"));
    }
    assert_eq!(get.header("template-a"), Some("2"));
    assert_eq!(methods(&origin, "/fleet"), ["GET", "HEAD"]);
}
