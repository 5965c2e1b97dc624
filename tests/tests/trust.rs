//! Trust: corral tried as an attacker would. Each scenario is one class of
//! attack (smuggling, key confusion, identity bypass, per-user data in a
//! shared answer, unkeyed inputs) and asserts what reached the origin, byte
//! for byte where framing matters, and what every caller got back.

use std::time::Duration;

use corral_tests::raw_origin::response;
use corral_tests::{
    Client, Config, DEADLINE, Origin, Proxy, RawOrigin, Reply, Route, exchange, exchange_full,
};
use http::Method;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// An origin that answers every request with its target and body length,
/// cacheable for a minute.
async fn echo_origin() -> RawOrigin {
    RawOrigin::start(|r| {
        let body = format!("{} {} body={}", r.method(), r.target(), r.body.len());
        response(200, &[("cache-control", "max-age=60")], &body)
    })
    .await
}

/// Every request the origin framed carries exactly the body its head
/// declares (the raw origin frames by those headers), and nothing else.
fn assert_framing_matches(origin: &RawOrigin) {
    for r in origin.requests() {
        let declared = r.header("content-length").map(|v| v.parse::<usize>());
        let chunked = r.header("transfer-encoding").is_some();
        match declared {
            Some(Ok(n)) => assert_eq!(n, r.body.len(), "{r:?}"),
            Some(Err(_)) => panic!("unreadable Content-Length upstream: {r:?}"),
            None if chunked => {}
            None => assert!(r.body.is_empty(), "{r:?}"),
        }
        assert!(
            r.header("expect").is_none(),
            "Expect reached the origin: {r:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_with_a_body_is_passed_through_whole_and_cannot_smuggle_a_request() {
    let origin = echo_origin().await;
    let proxy = Proxy::new(
        Config::new().route(Route::new("api", origin.url()).timeouts("response_headers", "2s")),
    )
    .start()
    .await;

    // The attacker's GET declares a body whose bytes look like a request.
    let smuggled = "GET /poison HTTP/1.1\r\nHost: site.test\r\n\r\n";
    let attack = format!(
        "GET /a HTTP/1.1\r\nHost: site.test\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{smuggled}",
        smuggled.len()
    );
    let first = exchange_full(proxy.addr(), attack.as_bytes(), DEADLINE).await;
    assert_eq!(first.status, 200, "{}", first.head);
    assert_eq!(
        String::from_utf8_lossy(&first.body),
        format!("GET /a body={}", smuggled.len()),
        "the origin got the GET's body, framed"
    );
    assert!(
        first
            .header("cache-status")
            .is_some_and(|s| s.contains("fwd=bypass") && s.contains("detail=request-body")),
        "{}",
        first.head
    );
    // The next request on the pooled upstream connection is read as itself.
    let next = Client::new()
        .get_with(&proxy.url("/b"), &[("x-a", "GET /poison HTTP/1.1")])
        .await;
    assert_eq!(next.text(), "GET /b body=0");
    // A GET with a body is never stored: the plain GET reaches the origin.
    let plain = Client::new().get(&proxy.url("/a")).await;
    assert_eq!(plain.text(), "GET /a body=0");

    let seen = origin.requests();
    let targets: Vec<&str> = seen.iter().map(|r| r.target()).collect();
    assert_eq!(targets, ["/a", "/b", "/a"], "{seen:?}");
    assert_eq!(seen[0].body, smuggled.as_bytes());
    assert_framing_matches(&origin);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_and_framing_headers_never_travel_without_their_body() {
    let origin = echo_origin().await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;

    // Expect with a body: the body goes along, Expect does not.
    let with_body = "GET /e HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello";
    let answer = exchange_full(proxy.addr(), with_body.as_bytes(), DEADLINE).await;
    assert_eq!(answer.status, 200, "{}", answer.head);
    assert!(String::from_utf8_lossy(&answer.body).ends_with("GET /e body=5"));

    // Expect, Content-Length: 0 and a Content-Type on a body-less GET: the
    // cache path, and none of them upstream.
    let bodyless = "GET /f HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 0\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n";
    let answer = exchange_full(proxy.addr(), bodyless.as_bytes(), DEADLINE).await;
    assert_eq!(answer.status, 200, "{}", answer.head);
    assert!(String::from_utf8_lossy(&answer.body).ends_with("GET /f body=0"));

    // A chunked GET body is forwarded chunked, whole.
    let chunked = "GET /g HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
    let answer = exchange_full(proxy.addr(), chunked.as_bytes(), DEADLINE).await;
    assert!(String::from_utf8_lossy(&answer.body).ends_with("GET /g body=5"));

    let seen = origin.requests();
    assert_eq!(seen.len(), 3, "{seen:?}");
    let f = &seen[1];
    assert!(
        f.header("content-length").is_none() && f.header("content-type").is_none(),
        "{f:?}"
    );
    assert_eq!(seen[2].body, b"abcde");
    assert_framing_matches(&origin);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_get_with_content_length_and_data_is_forwarded_framed() {
    let origin = echo_origin().await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .no_proxy()
        .timeout(DEADLINE)
        .build()
        .expect("h2 client");
    let res = h2
        .get(proxy.url("/h"))
        .header("content-length", "7")
        .body("payload")
        .send()
        .await
        .expect("h2 GET");
    assert_eq!(res.status(), 200);
    assert_eq!(res.text().await.expect("body"), "GET /h body=7");
    let res = h2.get(proxy.url("/h")).send().await.expect("h2 GET");
    assert_eq!(
        res.text().await.expect("body"),
        "GET /h body=0",
        "the GET with a body was not stored"
    );
    assert_eq!(origin.requests()[0].body, b"payload");
    assert_framing_matches(&origin);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_missing_or_repeated_host_is_refused_and_cannot_collide_keys() {
    let origin = Origin::new()
        .route(
            "/app.js",
            Reply::echo_header("app for ", "x-forwarded-host")
                .header("cache-control", "max-age=60"),
        )
        .route(
            "/static/app.js",
            Reply::ok("the real static app").header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let addr = proxy.addr();

    for (request, what) in [
        (
            "GET /app.js HTTP/1.1\r\nHost: site.test/static\r\n\r\n",
            "a Host with a path",
        ),
        ("GET /app.js HTTP/1.1\r\n\r\n", "no Host on HTTP/1.1"),
        (
            "GET /app.js HTTP/1.1\r\nHost: site.test\r\nHost: other.test\r\n\r\n",
            "two Host fields",
        ),
        (
            "GET /app.js HTTP/1.1\r\nHost: site.test:99999\r\n\r\n",
            "a port out of range",
        ),
        (
            "GET /app.js HTTP/1.1\r\nHost: user@site.test\r\n\r\n",
            "userinfo",
        ),
    ] {
        let answer = exchange(addr, request.as_bytes(), DEADLINE).await;
        assert_eq!(answer.status, 400, "{what}: {}", answer.head);
    }
    assert_eq!(origin.hits("/app.js"), 0);

    // The victim's request for site.test/static/app.js is not poisoned.
    let victim = exchange_full(
        addr,
        b"GET /static/app.js HTTP/1.1\r\nHost: site.test\r\nConnection: close\r\n\r\n",
        DEADLINE,
    )
    .await;
    assert_eq!(victim.body, b"the real static app");

    // HTTP/1.0 may omit Host.
    let old = exchange(addr, b"GET /app.js HTTP/1.0\r\n\r\n", DEADLINE).await;
    assert_eq!(old.status, 200, "{}", old.head);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absolute_form_target_wins_over_host_and_the_port_is_never_forwarded() {
    let origin = Origin::new()
        .route(
            "/links",
            Reply::echo_header("base=", "x-forwarded-host").header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let config = Config::new().route(Route::new("site", origin.url()).host("site.test"));
    let proxy = Proxy::new(config).start().await;
    let addr = proxy.addr();

    // An origin building links from X-Forwarded-Host sees only what is keyed.
    let poisoned = exchange_full(
        addr,
        b"GET /links HTTP/1.1\r\nHost: site.test:1337\r\nConnection: close\r\n\r\n",
        DEADLINE,
    )
    .await;
    assert_eq!(poisoned.body, b"base=site.test");
    let absolute = exchange_full(
        addr,
        b"GET http://site.test/links HTTP/1.1\r\nHost: evil.test\r\nConnection: close\r\n\r\n",
        DEADLINE,
    )
    .await;
    assert_eq!(absolute.status, 200, "{}", absolute.head);
    assert_eq!(absolute.body, b"base=site.test");
    let seen = origin.requests("/links");
    assert_eq!(seen.len(), 1, "the second was a hit on the same key");
    assert_eq!(seen[0].header("x-forwarded-host"), Some("site.test"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_control_and_method_override_headers_never_reach_the_origin() {
    let origin = Origin::new()
        .route("/p", Reply::ok("p").header("cache-control", "max-age=60"))
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    Client::new()
        .get_with(
            &proxy.url("/p"),
            &[
                ("forwarded", "host=evil.test;proto=https"),
                ("x-forwarded-host", "evil.test"),
                ("x-forwarded-proto", "https"),
                ("x-forwarded-port", "443"),
                ("x-original-url", "/admin"),
                ("x-rewrite-url", "/admin"),
                ("x-http-method-override", "DELETE"),
                ("x-keep", "1"),
            ],
        )
        .await;
    let seen = &origin.requests("/p")[0];
    for name in [
        "forwarded",
        "x-forwarded-port",
        "x-original-url",
        "x-rewrite-url",
        "x-http-method-override",
    ] {
        assert!(seen.header(name).is_none(), "{name} reached the origin");
    }
    assert_eq!(seen.header("x-forwarded-host"), Some("127.0.0.1"));
    assert_eq!(seen.header("x-forwarded-proto"), Some("http"));
    assert_eq!(seen.header("x-keep"), Some("1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vary_values_are_read_after_connection_named_headers_are_removed() {
    let origin = Origin::new()
        .route(
            "/lang",
            Reply::echo_header("lang:", "accept-language")
                .header("vary", "accept-language")
                .header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    let url = proxy.url("/lang");

    // The origin never sees the French value, so the answer is the
    // no-language variant, and must be stored as that.
    let hidden = client
        .get_with(
            &url,
            &[("connection", "accept-language"), ("accept-language", "fr")],
        )
        .await;
    assert_eq!(hidden.text(), "lang:");
    let french = client.get_with(&url, &[("accept-language", "fr")]).await;
    assert_eq!(french.text(), "lang:fr", "{}", french.cache_status());
    let none = client.get(&url).await;
    assert_eq!(none.text(), "lang:");
    assert!(none.cache_status().is_hit(), "{}", none.cache_status());
    assert_eq!(origin.hits("/lang"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credential_cookie_the_origin_can_read_is_never_treated_as_anonymous() {
    let origin = Origin::new()
        .route(
            "/me",
            Reply::echo_header("page for ", "cookie").header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let route = Route::new("api", origin.url()).cache(
        "identity",
        "{ headers: [authorization], cookies: [session] }",
    );
    let proxy = Proxy::new(Config::new().route(route)).start().await;
    let addr = proxy.addr();
    let anonymous = |addr| async move {
        let r = exchange_full(
            addr,
            b"GET /me HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
            DEADLINE,
        )
        .await;
        String::from_utf8_lossy(&r.body).into_owned()
    };

    for (i, cookie) in [
        &b"session =alice"[..],
        b"theme=caf\xc3\xa9; session=bob",
        b"SESSION=carol",
        b"sess%69on=dave",
        b"session",
        b"a=1; se\"ssion=erin",
    ]
    .into_iter()
    .enumerate()
    {
        let path = format!("/me?i={i}");
        let mut request = format!("GET {path} HTTP/1.1\r\nHost: h\r\nCookie: ").into_bytes();
        request.extend_from_slice(cookie);
        request.extend_from_slice(b"\r\nConnection: close\r\n\r\n");
        let mine = exchange_full(addr, &request, DEADLINE).await;
        assert_eq!(mine.status, 200, "{}", mine.head);
        // Same URI, no cookie: never the identified caller's page.
        let other = exchange_full(
            addr,
            format!("GET {path} HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n").as_bytes(),
            DEADLINE,
        )
        .await;
        assert_eq!(
            String::from_utf8_lossy(&other.body),
            "page for ",
            "cookie {:?} was taken for anonymous",
            String::from_utf8_lossy(cookie)
        );
    }
    assert_eq!(anonymous(addr).await, "page for ");
    assert_eq!(origin.hits("/me"), 13);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn must_revalidate_does_not_share_an_identity_cookie_answer() {
    let origin = Origin::new()
        .route(
            "/acct",
            Reply::echo_header("for ", "cookie")
                .header("cache-control", "max-age=60, must-revalidate"),
        )
        .start()
        .await;
    let route = Route::new("api", origin.url()).cache(
        "identity",
        "{ headers: [authorization], cookies: [session] }",
    );
    let proxy = Proxy::new(Config::new().route(route)).start().await;
    let client = Client::new();
    let url = proxy.url("/acct");
    let alice = client.get_with(&url, &[("cookie", "session=alice")]).await;
    assert_eq!(alice.text(), "for session=alice");
    let anonymous = client.get(&url).await;
    assert_eq!(
        anonymous.text(),
        "for ",
        "Alice's page reached an anonymous caller"
    );
    let bob = client.get_with(&url, &[("cookie", "session=bob")]).await;
    assert_eq!(bob.text(), "for session=bob");
    assert_eq!(origin.hits("/acct"), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coalesced_error_gives_no_waiter_the_leaders_cookie() {
    let origin = Origin::new()
        .route(
            "/down",
            Reply::status(503, "down")
                .header("set-cookie", "sid=leader-only")
                .delay(ms(400)),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let answers = Client::new().burst(10, &proxy.url("/down"), &[]).await;
    assert!(
        answers
            .iter()
            .all(|a| a.status == 503 && a.text() == "down")
    );
    let with_cookie = answers
        .iter()
        .filter(|a| a.header("set-cookie").is_some())
        .count();
    assert_eq!(origin.hits("/down"), 1, "the error was shared");
    assert_eq!(with_cookie, 1, "only the leader gets its own cookie");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coalesced_error_respects_vary() {
    let origin = Origin::new()
        .route(
            "/down",
            Reply::echo_header("down:", "accept-language")
                .with_status(503)
                .header("vary", "accept-language")
                .delay(ms(400)),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    let url = proxy.url("/down");
    let en = {
        let client = client.clone();
        let url = url.clone();
        tokio::spawn(async move { client.get_with(&url, &[("accept-language", "en")]).await })
    };
    origin.wait_hits("/down", 1, DEADLINE).await;
    let fr = client.get_with(&url, &[("accept-language", "fr")]).await;
    let en = en.await.expect("en task");
    assert_eq!(en.text(), "down:en");
    // The French caller never gets the English error: it fetches alone, or,
    // once the English failure put the URI into back-off, gets corral's 503.
    let own = fr.text() == "down:fr";
    let backed_off = fr.status == 503 && fr.cache_status().detail() == Some("backoff");
    assert!(own || backed_off, "{}: {}", fr.cache_status(), fr.text());
    assert!(origin.hits("/down") <= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_callers_private_answer_does_not_stop_coalescing_for_everyone() {
    let origin = Origin::new()
        .route(
            "/page",
            Reply::ok("yours").header("cache-control", "private"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    let url = proxy.url("/page");
    let alice = client
        .get_with(&url, &[("authorization", "Bearer alice")])
        .await;
    assert_eq!(alice.text(), "yours");

    origin.set_route(
        "/page",
        Reply::ok("everyone's")
            .header("cache-control", "max-age=60")
            .delay(ms(300)),
    );
    let answers = client.burst(20, &url, &[]).await;
    assert!(answers.iter().all(|a| a.text() == "everyone's"));
    assert_eq!(
        origin.hits("/page"),
        2,
        "Alice's private answer made 20 anonymous callers fetch alone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ignored_parameters_are_not_forwarded_and_repeated_ones_keep_their_order() {
    let origin = Origin::new()
        .route(
            "/q",
            Reply::from_request(|r| format!("q={}", r.query().unwrap_or_default()))
                .header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let route = Route::new("api", origin.url()).cache("ignore_query", "[utm_*]");
    let proxy = Proxy::new(Config::new().route(route)).start().await;
    let client = Client::new();

    let first = client.get(&proxy.url("/q?utm_source=evil&b=2&a=1")).await;
    assert_eq!(first.text(), "q=a=1&b=2", "what is keyed is what is asked");
    let again = client.get(&proxy.url("/q?a=1&b=2&utm_source=x")).await;
    assert!(again.cache_status().is_hit());

    let one_two = client.get(&proxy.url("/q?x=1&x=2")).await;
    let two_one = client.get(&proxy.url("/q?x=2&x=1")).await;
    assert_eq!(one_two.text(), "q=x=1&x=2");
    assert_eq!(two_one.text(), "q=x=2&x=1");
    assert_eq!(origin.hits("/q"), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vary_values_that_differ_in_any_byte_are_different_variants() {
    let origin = Origin::new()
        .route(
            "/v",
            Reply::from_request(|r| {
                format!(
                    "{:?}",
                    r.headers.get("x-lang").map(|v| v.as_bytes().to_vec())
                )
            })
            .header("vary", "x-lang")
            .header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let mut bodies = Vec::new();
    for value in [&b"\xff"[..], b"\xfe"] {
        let mut request = b"GET /v HTTP/1.1\r\nHost: h\r\nX-Lang: ".to_vec();
        request.extend_from_slice(value);
        request.extend_from_slice(b"\r\nConnection: close\r\n\r\n");
        let answer = exchange_full(proxy.addr(), &request, DEADLINE).await;
        bodies.push(String::from_utf8_lossy(&answer.body).into_owned());
    }
    assert_eq!(bodies, ["Some([255])", "Some([254])"]);
    assert_eq!(origin.hits("/v"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_answer_with_both_content_length_and_chunked_is_passed_as_chunked() {
    let origin = RawOrigin::start(|_| {
        b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\ntransfer-encoding: chunked\r\ncache-control: max-age=60\r\n\r\n5\r\nhello\r\n0\r\n\r\n".to_vec()
    })
    .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    for _ in 0..2 {
        let answer = exchange_full(
            proxy.addr(),
            b"GET /ct HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
            DEADLINE,
        )
        .await;
        assert_eq!(answer.status, 200, "{}", answer.head);
        assert!(answer.header("content-length").is_none(), "{}", answer.head);
        assert_eq!(answer.body, b"hello");
    }
    assert_eq!(origin.requests().len(), 2, "never stored");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrades_are_refused_clearly_and_an_unrequested_101_is_an_error() {
    let origin = RawOrigin::start(|_| {
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n"
            .to_vec()
    })
    .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let ws = exchange(
        proxy.addr(),
        b"GET /ws HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
        DEADLINE,
    )
    .await;
    assert_eq!(ws.status, 501, "{}", ws.head);
    assert!(
        ws.head.to_ascii_lowercase().contains(
            "\r\nproxy-status: corral; error=http_request_denied; details=\"upgrade-unsupported\"\r\n"
        ),
        "{}",
        ws.head
    );
    assert!(origin.requests().is_empty());

    let plain = Client::new()
        .send(Method::GET, &proxy.url("/x"), &[], None)
        .await;
    assert_eq!(plain.status, 502, "{:?}", plain.headers);
    assert_eq!(
        plain.cache_status().detail(),
        Some("upstream-protocol-error")
    );
    // The origin did answer: Proxy-Status says with what.
    assert_eq!(
        plain.header("proxy-status"),
        Some(
            "corral; error=http_protocol_error; details=\"upstream-protocol-error\"; received-status=101"
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambiguous_request_framing_never_reaches_the_origin_as_sent() {
    let origin = echo_origin().await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    for (request, what) in [
        (
            "POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\nContent-Length: 5\r\n\r\nabcde",
            "two different Content-Lengths",
        ),
        (
            "GET /p HTTP/1.1\r\nHost : h\r\n\r\n",
            "whitespace before the colon",
        ),
        (
            "GET /p HTTP/1.1\r\nHost: h\r\nX-A: 1\r\n folded\r\n\r\n",
            "an obsolete line folding",
        ),
        (
            "POST /p HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
            "chunked not the final coding",
        ),
    ] {
        let answer = exchange(proxy.addr(), request.as_bytes(), DEADLINE).await;
        assert_eq!(answer.status, 400, "{what}: {}", answer.head);
    }
    assert!(origin.requests().is_empty(), "{:?}", origin.requests());

    // Content-Length beside chunked: read as chunked alone (RFC 9112 §6.1),
    // forwarded with corral's own framing, and the connection closed after,
    // so bytes a Content-Length reader would have taken for a next request
    // are never read as one.
    let both = "POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: 30\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: h\r\n\r\n";
    let answer = exchange_full(proxy.addr(), both.as_bytes(), DEADLINE).await;
    assert_eq!(answer.status, 200, "{}", answer.head);
    assert_eq!(String::from_utf8_lossy(&answer.body), "POST /p body=3");
    let seen = origin.requests();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].body, b"abc");
    assert_framing_matches(&origin);
}

/// A broken exchange is retried only for what is idempotent as the origin
/// reads it: a DELETE that a method override makes a POST is sent once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_a_method_override_is_never_retried() {
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = std::sync::Arc::clone(&seen);
    // Every odd request: the connection closes before any answer.
    let origin = RawOrigin::start(move |_| {
        if count
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            .is_multiple_of(2)
        {
            Vec::new()
        } else {
            response(200, &[], "done")
        }
    })
    .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let plain = b"DELETE /item/1 HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n";
    let answer = exchange_full(proxy.addr(), plain, DEADLINE).await;
    assert_eq!(
        answer.status, 200,
        "a plain DELETE is retried: {}",
        answer.head
    );
    assert_eq!(origin.requests().len(), 2);
    let overridden = b"DELETE /item/1 HTTP/1.1\r\nHost: h\r\nX-HTTP-Method-Override: POST\r\nConnection: close\r\n\r\n";
    let answer = exchange_full(proxy.addr(), overridden, DEADLINE).await;
    assert_eq!(answer.status, 502, "{}", answer.head);
    let requests = origin.requests();
    assert_eq!(requests.len(), 3, "sent once: {requests:?}");
    assert_eq!(requests[2].header("x-http-method-override"), Some("POST"));
}

/// corral does not tunnel: CONNECT is answered here, never asked of the
/// origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_is_refused_without_asking_the_origin() {
    let origin = echo_origin().await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    for req in [
        &b"CONNECT internal.test:22 HTTP/1.1\r\nHost: internal.test:22\r\nConnection: close\r\n\r\n"[..],
        b"CONNECT h:443 HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
    ] {
        let answer = exchange_full(proxy.addr(), req, DEADLINE).await;
        assert_eq!(answer.status, 501, "{}", answer.head);
        assert!(
            answer
                .header("cache-status")
                .is_some_and(|s| s.contains("detail=method-unsupported")),
            "{}",
            answer.head
        );
    }
    assert!(origin.requests().is_empty(), "{:?}", origin.requests());
}

/// The origin is told the scheme the client used, and the two schemes
/// never share an entry: an origin that redirects plain callers to https
/// (Rails `force_ssl`) would otherwise send TLS callers round in a loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_listener_tells_the_origin_its_scheme_and_schemes_never_share_an_entry() {
    use corral_tests::temp::TempDir;
    use corral_tests::tls::{Pki, tls_get};
    let dir = TempDir::new("corral-scheme").expect("temp dir");
    let pki = Pki::new(dir.path(), "ca");
    let cert = pki.issue("listener", &["corral.test"], false);
    let origin = RawOrigin::start(|r| match r.header("x-forwarded-proto") {
        Some("https") => response(200, &[("cache-control", "max-age=60")], "secure page"),
        proto => {
            let body = format!("proto={proto:?}");
            response(
                301,
                &[
                    ("cache-control", "max-age=60"),
                    ("location", "https://corral.test/page"),
                ],
                &body,
            )
        }
    })
    .await;
    let tls_addr = corral_tests::ports::free_addr_for_config().expect("free port");
    let proxy =
        Proxy::new(Config::single(origin.url()).top("listen_tls", &cert.listen_tls(tls_addr)))
            .start()
            .await;
    let ca = pki.ca_file("ca");
    let plain = b"GET /page HTTP/1.1\r\nHost: corral.test\r\nConnection: close\r\n\r\n";
    // The plain caller is redirected, and that redirect is stored...
    for _ in 0..2 {
        let answer = exchange_full(proxy.addr(), plain, DEADLINE).await;
        assert_eq!(answer.status, 301, "{}", answer.head);
    }
    // ...but never served to a TLS caller, over HTTP/1.1 or h2.
    for alpn in [&b"http/1.1"[..], b"h2", b"http/1.1"] {
        let secure = tls_get(tls_addr, &ca, "corral.test", &[alpn], "/page")
            .await
            .expect("a TLS request");
        assert_eq!((secure.status, secure.body.as_str()), (200, "secure page"));
    }
    let protos: Vec<Option<String>> = origin
        .requests()
        .iter()
        .map(|r| r.header("x-forwarded-proto").map(str::to_owned))
        .collect();
    assert_eq!(
        protos,
        [Some("http".to_owned()), Some("https".to_owned())],
        "one fill per scheme"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origins_proxy_status_in_corrals_name_never_reaches_the_client() {
    let origin = RawOrigin::start(|_| {
        response(
            200,
            &[
                ("cache-control", "max-age=60"),
                (
                    "proxy-status",
                    "corral; error=destination_unavailable, origin-gw; error=\"x\"",
                ),
            ],
            "page",
        )
    })
    .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    // The fill's answer, and the hit that follows.
    for _ in 0..2 {
        let answer = client.get(&proxy.url("/p")).await;
        assert_eq!(answer.text(), "page");
        assert_eq!(
            answer.header("proxy-status"),
            Some("origin-gw; error=\"x\""),
            "{}",
            answer.cache_status()
        );
    }
}
