//! Hostile twins: for each feature that decides what callers share, an
//! attacker's variant of a request runs beside a victim's, against origins
//! with the personalities real servers have, and the victim must get what
//! it would have got alone (see `corral_tests::twins`). What everyone
//! shares (the stored answer, the route's policy, its circuit, a key's
//! back-off) is steered by no one client.

use corral_tests::raw_origin::response;
use corral_tests::twins::{Personality, Role, Step, Twin};
use corral_tests::{Client, Config, Proxy, RawOrigin, Route};

/// A cache-disabled `/profile` route beside a catch-all that caches.
fn private_profile(origin: &str) -> Config {
    Config::new()
        .route(
            Route::new("profile", origin)
                .path_prefix("/profile")
                .cache("enabled", "false"),
        )
        // Cookies identify no one on the catch-all (the default keys a
        // request with any cookie per caller, which would hide a route
        // chosen wrongly): only the route's policy can keep the page
        // private.
        .route(Route::new("site", origin).cache("identity", "{ cookies: [] }"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_spelling_of_a_private_path_takes_its_routes_policy() {
    // An origin that folds case, and one that normalizes paths too: every
    // spelling is `/profile` to them, so every spelling must be private.
    for (personality, spellings) in [
        (
            Personality::CaseInsensitive,
            &["/PROFILE?x", "/Profile?x"][..],
        ),
        (
            Personality::Normalizing,
            &["/PrOfIlE?x", "//profile?x", "/%70rofile?x"][..],
        ),
    ] {
        for spelling in spellings {
            let (victim, seen) = Twin::new(personality, private_profile)
                .step(Step::get(Role::Attacker, spelling).field("cookie", "sess=alice"))
                .step(Step::get(Role::Victim, spelling))
                .run()
                .await;
            assert_eq!(
                victim,
                [(200, "profile of anonymous".to_owned())],
                "{spelling}"
            );
            // The exact spelling still reaches the origin.
            assert!(seen.iter().all(|r| r.target().ends_with("?x")), "{seen:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trailing_dot_on_the_host_takes_the_hosts_route() {
    let config = |origin: &str| {
        Config::new()
            .route(
                Route::new("private-host", origin)
                    .host("ex.test")
                    .cache("enabled", "false"),
            )
            .route(Route::new("any", origin).cache("identity", "{ cookies: [] }"))
    };
    let (victim, _) = Twin::new(Personality::CaseInsensitive, config)
        .step(
            Step::get(Role::Attacker, "/profile")
                .field("host", "ex.test.")
                .field("cookie", "sess=alice"),
        )
        .step(Step::get(Role::Victim, "/profile").field("host", "ex.test."))
        .run()
        .await;
    assert_eq!(victim, [(200, "profile of anonymous".to_owned())]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_holds_for_every_spelling_of_its_path() {
    // An origin that routes case-insensitively: every spelling is a login.
    let origin = RawOrigin::start(|_| response(200, &[], "in")).await;
    let proxy = Proxy::new(
        Config::new()
            .route(
                Route::new("api", origin.url())
                    .path_prefix("/api/")
                    .field("limits", "[{ name: login, key: ip, rate: 5/min }]"),
            )
            .route(Route::new("site", origin.url())),
    )
    .start()
    .await;
    let client = Client::new();
    let mut statuses = Vec::new();
    for spelling in ["/API/login", "/Api/login", "/api/login", "/aPi/login"] {
        for _ in 0..2 {
            statuses.push(client.get(&proxy.url(spelling)).await.status.as_u16());
        }
    }
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429, 429, 429]);
}

/// The fields a CGI application would read as forwarding and identity
/// fields, spelled to pass a list of dashed names.
const CGI_SPELLINGS: [(&str, &str); 6] = [
    ("x_forwarded_host", "evil.example"),
    ("x_real_ip", "6.6.6.6"),
    ("x_account_id", "admin"),
    ("true-client-ip", "6.6.6.6"),
    ("x-client-ip", "6.6.6.6"),
    ("X_Forwarded_For", "6.6.6.6"),
];

fn cgi_attack() -> Step {
    CGI_SPELLINGS
        .iter()
        .fold(Step::get(Role::Attacker, "/page"), |step, (n, v)| {
            step.field(n, v)
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn underscore_spellings_never_reach_a_cgi_origin() {
    let accounts = "{ account: { header: X-Account-Id } }";
    for allow in [false, true] {
        let config = move |origin: &str| {
            let route = Route::new("api", origin);
            let route = if allow {
                route.field("underscores_in_headers", "true")
            } else {
                route
            };
            Config::new().top("callers", accounts).route(route)
        };
        let (victim, seen) = Twin::new(Personality::Cgi, config)
            .step(cgi_attack())
            .step(Step::get(Role::Victim, "/page"))
            .run()
            .await;
        assert_eq!(
            victim,
            [(
                200,
                "<script src=\"//127.0.0.1/app.js\"></script> client=- account=-".to_owned()
            )],
            "underscores_in_headers: {allow}"
        );
        for r in &seen {
            for (_, planted) in CGI_SPELLINGS {
                assert!(
                    !r.head.contains(planted),
                    "{planted} reached the origin: {r:?}"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn underscored_fields_pass_only_where_a_route_allows_them() {
    let origin =
        RawOrigin::start(|r| response(200, &[], r.header("x_trace_id").unwrap_or("none"))).await;
    let proxy = Proxy::new(
        Config::new()
            .route(
                Route::new("legacy", origin.url())
                    .path_prefix("/legacy")
                    .field("underscores_in_headers", "true")
                    .cache("enabled", "false"),
            )
            .route(Route::new("api", origin.url()).cache("enabled", "false")),
    )
    .start()
    .await;
    let client = Client::new();
    let traced = [("x_trace_id", "t-1")];
    assert_eq!(
        client
            .get_with(&proxy.url("/legacy/a"), &traced)
            .await
            .text(),
        "t-1"
    );
    assert_eq!(
        client.get_with(&proxy.url("/a"), &traced).await.text(),
        "none"
    );
}

/// One route for every path, on defaults.
fn one_route(origin: &str) -> Config {
    Config::single(origin)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_field_the_application_chokes_on_backs_off_no_one_else() {
    let unexpected = || Step::get(Role::Attacker, "/page").field("x-unexpected", "1");
    let (victim, _) = Twin::new(Personality::ChokesOnFields, one_route)
        .step(unexpected())
        .step(unexpected())
        .step(unexpected())
        .step(Step::get(Role::Victim, "/page"))
        .run()
        .await;
    assert_eq!(victim, [(200, "page /page".to_owned())]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_clients_failing_urls_never_open_the_circuit() {
    let mut twin = Twin::new(Personality::ChokesOnFields, one_route);
    // A new URL each time, so each is a fill: 25 that throw (500) and 25
    // behind the application's own failing gateway (502).
    for n in 0..25 {
        twin = twin
            .step(Step::get(Role::Attacker, &format!("/throws/{n}")))
            .step(Step::get(Role::Attacker, &format!("/gateway/{n}")));
    }
    let twin = twin
        .step(Step::get(Role::Victim, "/page"))
        .step(Step::get(Role::Victim, "/other"));
    let (victim, seen) = twin.run().await;
    assert_eq!(
        victim,
        [
            (200, "page /page".to_owned()),
            (200, "page /other".to_owned())
        ]
    );
    assert_eq!(seen.len(), 52, "every request reached the origin");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_never_replaces_its_own_targets_get() {
    let (victim, seen) = Twin::new(Personality::QueryEcho, one_route)
        .step(Step::get(Role::Victim, "/search?q=1"))
        .step(Step::with_body(
            Role::Attacker,
            "QUERY",
            "/search?q=1",
            "evil",
        ))
        .step(Step::get(Role::Victim, "/search?q=1"))
        .run()
        .await;
    assert_eq!(
        victim,
        [
            (200, "GET /search?q=1".to_owned()),
            (200, "GET /search?q=1".to_owned())
        ]
    );
    let gets = seen.iter().filter(|r| r.method() == "GET").count();
    assert_eq!(gets, 1, "the second GET was a hit: {seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cookie_callers_uncacheable_answer_never_turns_coalescing_off_for_the_others() {
    // The application greets a caller with cookies by setting another:
    // that answer is not stored, and the URI is hit-for-pass for such
    // callers. Callers without cookies get a shareable page.
    let origin = corral_tests::Origin::new()
        .route(
            "/home",
            corral_tests::Reply::ok("home")
                .header("cache-control", "max-age=60")
                .header_when("set-cookie", "seen=1", |r| r.header("cookie").is_some())
                .delay(std::time::Duration::from_millis(300)),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let attacker = Client::from_address(std::net::Ipv4Addr::new(127, 0, 0, 66));
    let first = attacker
        .get_with(&proxy.url("/home"), &[("cookie", "sess=x")])
        .await;
    assert_eq!(first.header("set-cookie"), Some("seen=1"), "its own answer");
    assert_eq!(origin.hits("/home"), 1);
    // The next burst of callers without cookies is one origin request.
    let answers = Client::new().burst(30, &proxy.url("/home"), &[]).await;
    corral_tests::assert_every_answer(&answers, 200, "home");
    assert_eq!(
        origin.hits("/home"),
        2,
        "{:?}",
        corral_tests::tally(&answers)
    );
}

/// A personalized page as most applications send it: no Cache-Control, no
/// Set-Cookie, the caller's session (a cookie, or Authorization) in it.
fn personal_origin() -> corral_tests::Origin {
    let page = corral_tests::Reply::from_request(|r| {
        format!(
            "account of {}",
            r.header("cookie")
                .or(r.header("authorization"))
                .unwrap_or("anonymous")
        )
    })
    .delay(std::time::Duration::from_millis(300));
    corral_tests::Origin::new().route("/account", page)
}

/// With a default TTL (what `corral proxy` runs on, and what a minimal
/// config's `default_ttl` gives) a victim's personalized page is kept; an
/// attacker without the victim's cookie or Authorization, asking after
/// it or at the same moment, must get the anonymous page, never the
/// victim's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_personalized_page_without_cache_control_never_reaches_a_caller_without_the_credential() {
    let anonymous = "account of anonymous".to_owned();
    for credential in [("cookie", "sess=alice"), ("authorization", "Bearer alice")] {
        let victim_page = format!("account of {}", credential.1);
        for proxy in ["minimal config", "corral proxy"] {
            let origin = personal_origin().start().await;
            let proxy = match proxy {
                "corral proxy" => Proxy::flags(&origin.url(), &[]),
                _ => Proxy::new(
                    Config::new()
                        .route(Route::new("site", origin.url()).cache("default_ttl", "10s")),
                ),
            }
            .start()
            .await;
            let url = proxy.url("/account");
            let victim = Client::new();
            let attacker = Client::from_address(std::net::Ipv4Addr::new(127, 0, 0, 66));
            // After: the victim's page is in the cache.
            let mine = victim.get_with(&url, &[credential]).await;
            assert_eq!(mine.text(), victim_page);
            let theirs = attacker.get(&url).await;
            assert_eq!(theirs.text(), anonymous, "{credential:?} after");
            // At the same moment: the victim leads a fill, the attacker
            // asks while it runs (another key: fresh ones).
            let url = proxy.url("/account?at=once");
            let fields = [credential];
            let (mine, theirs) = tokio::join!(victim.get_with(&url, &fields), async {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                attacker.get(&url).await
            });
            assert_eq!(mine.text(), victim_page);
            assert_eq!(theirs.text(), anonymous, "{credential:?} at once");
            // The anonymous page is shared between anonymous callers, and
            // the victim's is still the victim's own.
            let again = victim.get_with(&proxy.url("/account"), &[credential]).await;
            assert_eq!(again.text(), victim_page);
            assert!(again.cache_status().is_hit(), "{}", again.cache_status());
            assert_eq!(origin.hits("/account"), 4, "{credential:?}");
        }
    }
}
