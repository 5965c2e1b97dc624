//! Storage and keys: what is stored, what a hit looks like, how HEAD, unsafe
//! methods and query strings map onto stored entries.

use http::Method;

use corral_tests::{Client, Config, Origin, Proxy, Reply, Route};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_get_is_a_hit_with_age_and_does_not_reach_the_origin() {
    let origin = Origin::new()
        .route(
            "/doc",
            Reply::ok("document").header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();

    let first = client.get(&proxy.url("/doc")).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.text(), "document");
    let status = first.cache_status();
    assert_eq!(status.fwd(), Some("uri-miss"), "{status}");
    assert_eq!(status.param("fwd-status"), Some("200"), "{status}");
    assert!(status.stored(), "{status}");

    let second = client.get(&proxy.url("/doc")).await;
    assert_eq!(second.status, 200);
    assert_eq!(second.text(), "document");
    let status = second.cache_status();
    assert!(status.is_hit(), "{status}");
    assert!(status.fwd().is_none(), "{status}");
    let age: u64 = second
        .header("age")
        .expect("an answer from cache carries Age")
        .parse()
        .expect("Age is a number of seconds");
    assert!(age <= 60, "Age {age}");
    assert_eq!(origin.hits("/doc"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_store_private_and_set_cookie_answers_are_not_stored() {
    let origin = Origin::new()
        .route(
            "/no-store",
            Reply::ok("n").header("cache-control", "no-store, max-age=60"),
        )
        .route(
            "/private",
            Reply::ok("p").header("cache-control", "private, max-age=60"),
        )
        .route(
            "/cookie",
            Reply::ok("c")
                .header("cache-control", "max-age=60")
                .header("set-cookie", "session=abc"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();

    for path in ["/no-store", "/private", "/cookie"] {
        for round in 1..=2 {
            let answer = client.get(&proxy.url(path)).await;
            assert_eq!(answer.status, 200, "{path}");
            let status = answer.cache_status();
            assert!(
                status.fwd().is_some() && !status.stored() && !status.is_hit(),
                "{path} round {round}: {status}"
            );
        }
        assert_eq!(origin.hits(path), 2, "{path} reached the origin every time");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_default_ttl_stores_answers_without_freshness_information() {
    let origin = Origin::new()
        .route("/plain", Reply::ok("plain"))
        .start()
        .await;
    let config = Config::new().route(Route::new("api", origin.url()).cache("default_ttl", "30s"));
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();

    let first = client.get(&proxy.url("/plain")).await;
    assert!(first.cache_status().stored(), "{}", first.cache_status());
    let second = client.get(&proxy.url("/plain")).await;
    assert!(second.cache_status().is_hit(), "{}", second.cache_status());
    assert_eq!(second.text(), "plain");
    assert_eq!(origin.hits("/plain"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_after_a_get_is_served_from_the_stored_get() {
    let origin = Origin::new()
        .route(
            "/doc",
            Reply::ok("hello head").header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();

    let get = client.get(&proxy.url("/doc")).await;
    assert_eq!(get.text(), "hello head");
    let head = client.head(&proxy.url("/doc")).await;

    assert_eq!(head.status, 200);
    assert!(head.body.is_empty(), "HEAD has no body: {:?}", head.body);
    assert!(head.cache_status().is_hit(), "{}", head.cache_status());
    if let Some(length) = get.header("content-length") {
        assert_eq!(head.header("content-length"), Some(length));
    }
    assert_eq!(origin.hits("/doc"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_successful_post_invalidates_the_stored_get_for_its_uri() {
    let origin = Origin::new()
        .route(
            "/item",
            Reply::ok("item v1").header("cache-control", "max-age=60"),
        )
        .route_method(Method::POST, "/item", Reply::status(201, "created"))
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    let url = proxy.url("/item");

    client.get(&url).await;
    let hit = client.get(&url).await;
    assert!(hit.cache_status().is_hit(), "{}", hit.cache_status());
    assert_eq!(origin.hits("/item"), 1);

    origin.set_route(
        "/item",
        Reply::ok("item v2").header("cache-control", "max-age=60"),
    );
    let post = client
        .send(Method::POST, &url, &[], Some("new".into()))
        .await;
    assert_eq!(post.status, 201);
    assert_eq!(post.text(), "created");
    // RFC 9211 §2.2: forwarded because of its method.
    assert_eq!(
        post.cache_status().fwd(),
        Some("method"),
        "{}",
        post.cache_status()
    );
    assert_eq!(origin.hits("/item"), 2, "the POST reached the origin");

    let after = client.get(&url).await;
    assert_eq!(after.text(), "item v2");
    assert!(!after.cache_status().is_hit(), "{}", after.cache_status());
    assert_eq!(
        origin.hits("/item"),
        3,
        "the GET after the POST reached the origin"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_post_leaves_the_stored_get_in_place() {
    let origin = Origin::new()
        .route(
            "/item",
            Reply::ok("item v1").header("cache-control", "max-age=60"),
        )
        .route_method(Method::POST, "/item", Reply::status(500, "nope"))
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    let url = proxy.url("/item");

    client.get(&url).await;
    let post = client
        .send(Method::POST, &url, &[], Some("new".into()))
        .await;
    assert_eq!(post.status, 500);

    let after = client.get(&url).await;
    assert!(after.cache_status().is_hit(), "{}", after.cache_status());
    assert_eq!(after.text(), "item v1");
    assert_eq!(
        origin.hits("/item"),
        2,
        "the GET, then the POST; no second GET"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_parameters_are_sorted_and_ignored_ones_dropped_from_the_key() {
    let origin = Origin::new()
        .route(
            "/q",
            Reply::from_request(|req| format!("query:{}", req.query().unwrap_or_default()))
                .header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let config =
        Config::new().route(Route::new("api", origin.url()).cache("ignore_query", "[utm_*]"));
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();

    let first = client.get(&proxy.url("/q?b=2&a=1")).await;
    assert_eq!(first.status, 200);
    for same in [
        "/q?a=1&b=2",
        "/q?a=1&b=2&utm_source=x",
        "/q?utm_medium=y&b=2&a=1",
    ] {
        let answer = client.get(&proxy.url(same)).await;
        assert!(
            answer.cache_status().is_hit(),
            "{same}: {}",
            answer.cache_status()
        );
        assert_eq!(answer.text(), first.text(), "{same}");
    }
    assert_eq!(origin.hits("/q"), 1);

    let other = client.get(&proxy.url("/q?a=1&b=3")).await;
    assert!(!other.cache_status().is_hit(), "{}", other.cache_status());
    assert_eq!(origin.hits("/q"), 2, "a different value is a different key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_larger_than_max_object_size_is_served_whole_and_not_stored() {
    let big: Vec<u8> = (0..2 * 1024 * 1024).map(|i| (i % 251) as u8).collect();
    let origin = Origin::new()
        .route(
            "/big",
            Reply::ok(big.clone()).header("cache-control", "max-age=60"),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url()).cache("max_object_size", "1MiB"))
        .start()
        .await;
    let client = Client::new();

    for round in 1..=2 {
        let answer = client.get(&proxy.url("/big")).await;
        assert_eq!(answer.status, 200);
        assert!(
            answer.body == big,
            "round {round}: body of {} bytes differs",
            answer.body.len()
        );
        assert!(!answer.cache_status().is_hit(), "{}", answer.cache_status());
    }
    assert_eq!(origin.hits("/big"), 2);
}

/// An origin answer that echoes the query, with `rule` as its
/// No-Vary-Search field (none when empty).
fn echo_with_rule(rule: &'static str) -> Reply {
    let reply = Reply::from_request(|req| format!("query:{}", req.query().unwrap_or_default()))
        .header("cache-control", "max-age=60");
    if rule.is_empty() {
        reply
    } else {
        reply.header("no-vary-search", rule)
    }
}

/// No-Vary-Search (draft-ietf-httpbis-no-vary-search-10), opted in per
/// route: the rule of each path is learned from its answers, and the
/// parameters it says do not matter leave the key. The origin is asked
/// the client's whole query, and an answer is stored only under a key
/// made with its own rule: the first answer of a path teaches the rule
/// and answers its caller; from then on, requests the rule makes
/// equivalent share one entry. What matters never shares; a path without
/// the field, a malformed field and a route that did not opt in keep
/// every parameter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_vary_search_leaves_out_what_the_origin_says_does_not_matter() {
    let origin = Origin::new()
        .route("/only-id", echo_with_rule(r#"except=("id")"#))
        .route(
            "/utm",
            echo_with_rule(r#"key-order, params=("utm_source" "fbclid")"#),
        )
        .route("/none", echo_with_rule(""))
        .route("/malformed", echo_with_rule("params=(utm_source)"))
        .start()
        .await;
    let learns = Proxy::new(
        Config::new().route(Route::new("api", origin.url()).cache("no_vary_search", "true")),
    )
    .start()
    .await;
    let client = Client::new();
    let get = |path: &str| {
        let client = client.clone();
        let url = learns.url(path);
        async move { client.get(&url).await }
    };

    // The first answer of a path teaches its rule and answers its caller;
    // it was keyed with no rule, so it is not stored.
    let taught = get("/only-id?id=1&x=1").await;
    assert_eq!(taught.text(), "query:id=1&x=1");
    // From now on only `id` is in the key; the origin is asked the whole
    // query, and its answer answers every URL with the same `id`.
    let first = get("/only-id?x=2&id=1").await;
    assert_eq!(
        first.text(),
        "query:x=2&id=1",
        "the origin is asked the URL"
    );
    for same in ["/only-id?id=1", "/only-id?y=3&id=1&session=abc"] {
        let answer = get(same).await;
        assert!(
            answer.cache_status().is_hit(),
            "{same}: {}",
            answer.cache_status()
        );
        assert_eq!(answer.text(), "query:x=2&id=1", "{same}");
    }
    let other = get("/only-id?id=2&x=2").await;
    assert!(!other.cache_status().is_hit(), "{}", other.cache_status());
    assert_eq!(other.text(), "query:id=2&x=2", "`id` matters");
    assert_eq!(origin.hits("/only-id"), 3);
    // A write to one of its URLs retires the entry that answers it
    // (RFC 9111 §4.4), stored under the key the rule makes.
    let write = client
        .send(Method::POST, &learns.url("/only-id?x=7&id=1"), &[], None)
        .await;
    assert_eq!(write.status, 200);
    let after = get("/only-id?id=1").await;
    assert!(!after.cache_status().is_hit(), "{}", after.cache_status());
    assert_eq!(origin.hits("/only-id"), 5, "the POST, then the GET again");

    // `params=(...)`: the named ones go, encoded or not; the rest stay.
    get("/utm?q=a").await;
    get("/utm?q=a").await;
    let hit = get("/utm?utm%5Fsource=x&q=a&fbclid=y").await;
    assert!(hit.cache_status().is_hit(), "{}", hit.cache_status());
    assert_eq!(hit.text(), "query:q=a");
    let other = get("/utm?q=b&utm_source=x").await;
    assert_eq!(other.text(), "query:q=b&utm_source=x");
    let cased = get("/utm?q=a&UTM_SOURCE=x").await;
    assert_eq!(
        cased.text(),
        "query:q=a&UTM_SOURCE=x",
        "names are compared exactly"
    );
    assert_eq!(origin.hits("/utm"), 4);

    // No field, or one that does not parse: every parameter matters.
    for path in ["/none", "/malformed"] {
        for query in [
            "?a=1&utm_source=1",
            "?a=1&utm_source=2",
            "?a=1&utm_source=2",
        ] {
            get(&format!("{path}{query}")).await;
        }
        assert_eq!(origin.hits(path), 2, "{path}: one fetch per distinct query");
    }

    // A route that did not opt in keeps every parameter, whatever the
    // origin says.
    let plain = Proxy::new(Config::single(origin.url())).start().await;
    for query in ["id=5&x=1", "id=5&x=2", "id=5&x=2"] {
        let answer = client.get(&plain.url(&format!("/only-id?{query}"))).await;
        assert_eq!(answer.text(), format!("query:{query}"));
    }
    assert_eq!(origin.hits("/only-id"), 7, "two fetches: x differs");
}

/// A stored answer is reused only where its own No-Vary-Search rule
/// makes the URLs equivalent, never under a rule a later answer of the
/// path taught; draft-10's forms are read as draft-10 writes them (the
/// forms it dropped are ignored, its allow-list shares); and without
/// `key-order`, the order of parameters matters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_vary_search_reuses_an_answer_only_under_its_own_rule() {
    let origin = Origin::new()
        .route("/p", echo_with_rule(r#"params=("y")"#))
        .route("/bool", echo_with_rule("params"))
        .route("/true", echo_with_rule("params=?1"))
        .route("/both", echo_with_rule(r#"params, except=("page")"#))
        .route("/allow", echo_with_rule(r#"except=("id")"#))
        .route("/none-matter", echo_with_rule("except=()"))
        .route("/order", echo_with_rule(r#"params=("utm")"#))
        .route("/any-order", echo_with_rule(r#"key-order, params=("utm")"#))
        .start()
        .await;
    let proxy = Proxy::new(
        Config::new().route(Route::new("api", origin.url()).cache("no_vary_search", "true")),
    )
    .start()
    .await;
    let client = Client::new();
    let get = |path: &str| {
        let client = client.clone();
        let url = proxy.url(path);
        async move { client.get(&url).await }
    };

    // `?id=1` is stored under a rule in which `x` matters.
    get("/p?id=1").await;
    let stored = get("/p?id=1").await;
    assert_eq!(stored.text(), "query:id=1");
    assert!(get("/p?id=1").await.cache_status().is_hit());
    // A later answer of the path says `x` does not matter.
    origin.set_route("/p", echo_with_rule(r#"params=("x")"#));
    assert_eq!(get("/p?id=2").await.text(), "query:id=2");
    // The victim's `x` matters to the answer stored for `?id=1`.
    let victim = get("/p?id=1&x=5").await;
    assert_eq!(victim.text(), "query:id=1&x=5", "{}", victim.cache_status());
    assert_eq!(origin.hits("/p"), 4);

    // Forms draft-10 dropped are ignored: every id gets its own answer.
    for path in ["/bool", "/true", "/both"] {
        for id in [4, 3, 5, 3] {
            let answer = get(&format!("{path}?id={id}")).await;
            assert_eq!(answer.text(), format!("query:id={id}"), "{path}");
        }
        assert_eq!(origin.hits(path), 3, "{path}: one fetch per id");
    }

    // Its allow-list shares what it leaves out.
    get("/allow?id=1&t=1").await;
    assert_eq!(get("/allow?id=1&t=2").await.text(), "query:id=1&t=2");
    let shared = get("/allow?t=3&id=1").await;
    assert!(shared.cache_status().is_hit(), "{}", shared.cache_status());
    assert_eq!(shared.text(), "query:id=1&t=2");
    assert_eq!(get("/allow?id=2&t=2").await.text(), "query:id=2&t=2");
    assert_eq!(origin.hits("/allow"), 3);
    get("/none-matter?a=1").await;
    get("/none-matter?a=2").await;
    let any = get("/none-matter?b=3").await;
    assert!(any.cache_status().is_hit(), "{}", any.cache_status());
    assert_eq!(any.text(), "query:a=2");
    assert_eq!(origin.hits("/none-matter"), 2);

    // Order matters unless the rule says `key-order`.
    get("/order?a=1&b=2").await;
    get("/order?a=1&b=2").await;
    let swapped = get("/order?b=2&a=1&utm=1").await;
    assert_eq!(swapped.text(), "query:b=2&a=1&utm=1");
    assert_eq!(origin.hits("/order"), 3);
    get("/any-order?a=1&b=2").await;
    get("/any-order?a=1&b=2").await;
    let swapped = get("/any-order?b=2&a=1&utm=1").await;
    assert!(
        swapped.cache_status().is_hit(),
        "{}",
        swapped.cache_status()
    );
    assert_eq!(swapped.text(), "query:a=1&b=2");
    assert_eq!(origin.hits("/any-order"), 2);
}

/// `cache.sort_query`: on by default, reorderings of one query share an
/// entry; off, the client's order is kept in the key and what the origin
/// is asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sort_query_decides_whether_parameter_order_matters() {
    let origin = Origin::new().route("/s", echo_with_rule("")).start().await;
    let client = Client::new();
    let sorting = Proxy::new(Config::single(origin.url())).start().await;
    for query in ["a=1&b=2", "b=2&a=1"] {
        let answer = client.get(&sorting.url(&format!("/s?{query}"))).await;
        assert_eq!(answer.text(), "query:a=1&b=2");
    }
    assert_eq!(origin.hits("/s"), 1);
    let kept = Proxy::new(
        Config::new().route(Route::new("api", origin.url()).cache("sort_query", "false")),
    )
    .start()
    .await;
    for query in ["a=1&b=2", "b=2&a=1", "b=2&a=1"] {
        let answer = client.get(&kept.url(&format!("/s?{query}"))).await;
        assert_eq!(answer.text(), format!("query:{query}"));
    }
    assert_eq!(origin.hits("/s"), 3, "the order matters: two more fetches");
}
