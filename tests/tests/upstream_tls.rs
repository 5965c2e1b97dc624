//! `upstream: https://…`: TLS to the origin with the certificate checked
//! (a CA made at run time by the harness), SNI, a name override, mutual
//! TLS, and the clear 502 when the certificate is wrong.

use corral_tests::temp::TempDir;
use corral_tests::tls::{Pki, TlsOrigin};
use corral_tests::{Client, Config, DEADLINE, Proxy, Route, corral_check, eventually};

fn route(port: u16, host: &str, tls: &str) -> Route {
    let r = Route::new("api", format!("https://{host}:{port}"));
    if tls.is_empty() {
        r
    } else {
        r.field("tls", tls)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verified_https_upstream_answers_and_gets_its_host_as_sni() {
    let dir = TempDir::new("corral-tls").expect("temp dir");
    let pki = Pki::new(dir.path(), "ca");
    let origin = TlsOrigin::start(&pki.issue("origin", &["localhost"], false), None).await;
    let tls = format!("{{ ca_file: {} }}", pki.ca_file("ca").display());
    let proxy = Proxy::new(Config::new().route(route(origin.port(), "localhost", &tls)))
        .start()
        .await;
    let a = Client::new().get(&proxy.url("/x")).await;
    assert_eq!((a.status.as_u16(), a.text().as_str()), (200, "tls ok"));
    assert_eq!(origin.sni(), [Some("localhost".to_owned())]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_a_wrong_name_or_an_expired_certificate_is_a_clear_502() {
    let dir = TempDir::new("corral-tls").expect("temp dir");
    let pki = Pki::new(dir.path(), "ca");
    let _other = Pki::new(dir.path(), "other");
    let good = TlsOrigin::start(&pki.issue("good", &["localhost"], false), None).await;
    let expired = TlsOrigin::start(&pki.issue("old", &["localhost"], true), None).await;
    let ca = |name: &str| format!("{{ ca_file: {} }}", pki.ca_file(name).display());
    let cases = [
        (
            route(good.port(), "localhost", &ca("other")),
            "UnknownIssuer",
        ),
        (
            route(good.port(), "127.0.0.1", &ca("ca")),
            "not valid for name",
        ),
        (route(expired.port(), "localhost", &ca("ca")), "expired"),
    ];
    let client = Client::new();
    for (r, why) in cases {
        let proxy = Proxy::new(Config::new().route(r)).start().await;
        let a = client.get(&proxy.url("/x")).await;
        assert_eq!(a.status, 502, "{why}");
        assert_eq!(
            a.cache_status().detail(),
            Some("upstream-tls-error"),
            "{why}"
        );
        // RFC 9209 tells a refused certificate from other TLS failures.
        assert_eq!(
            a.header("proxy-status"),
            Some("corral; error=tls_certificate_error; details=\"upstream-tls-error\""),
            "{why}"
        );
        eventually(DEADLINE, &format!("a log line naming {why}"), || {
            let log = proxy.log();
            async move { log.contains("TLS handshake failed") && log.contains(why) }
        })
        .await;
    }
    assert_eq!((good.requests(), expired.requests()), (0, 0));

    // The name the certificate carries, sent and checked in place of the
    // address: the same upstream is fine.
    let named = format!(
        "{{ ca_file: {}, server_name: localhost }}",
        pki.ca_file("ca").display()
    );
    let proxy = Proxy::new(Config::new().route(route(good.port(), "127.0.0.1", &named)))
        .start()
        .await;
    assert_eq!(client.get(&proxy.url("/x")).await.status, 200);
    assert_eq!(good.sni(), [Some("localhost".to_owned())]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_sends_the_client_certificate_and_fails_clearly_without_it() {
    let dir = TempDir::new("corral-tls").expect("temp dir");
    let pki = Pki::new(dir.path(), "ca");
    let clients = Pki::new(dir.path(), "clients");
    let me = clients.issue("corral-client", &["corral.internal"], false);
    let origin = TlsOrigin::start(
        &pki.issue("origin", &["localhost"], false),
        Some(&clients.ca_file("clients")),
    )
    .await;
    let client = Client::new();
    let without = format!("{{ ca_file: {} }}", pki.ca_file("ca").display());
    let proxy = Proxy::new(Config::new().route(route(origin.port(), "localhost", &without)))
        .start()
        .await;
    let a = client.get(&proxy.url("/x")).await;
    assert_eq!(a.status, 502);
    assert_eq!(a.cache_status().detail(), Some("upstream-tls-error"));
    let proxy_status = a.header("proxy-status").unwrap_or_default();
    assert!(
        proxy_status.starts_with("corral; error=tls_"),
        "{proxy_status}"
    );
    assert_eq!(origin.requests(), 0);

    let with = format!(
        "{{ ca_file: {}, client_cert: {}, client_key: {} }}",
        pki.ca_file("ca").display(),
        me.cert.display(),
        me.key.display()
    );
    let proxy = Proxy::new(Config::new().route(route(origin.port(), "localhost", &with)))
        .start()
        .await;
    let a = client.get(&proxy.url("/x")).await;
    assert_eq!((a.status.as_u16(), a.text().as_str()), (200, "tls ok"));
    assert_eq!((origin.requests(), origin.client_certs()), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insecure_skip_verify_connects_and_says_so_at_start() {
    let dir = TempDir::new("corral-tls").expect("temp dir");
    let pki = Pki::new(dir.path(), "ca");
    let origin = TlsOrigin::start(&pki.issue("origin", &["elsewhere.test"], false), None).await;
    let proxy = Proxy::new(Config::new().route(route(
        origin.port(),
        "127.0.0.1",
        "{ insecure_skip_verify: true }",
    )))
    .start()
    .await;
    assert_eq!(Client::new().get(&proxy.url("/x")).await.status, 200);
    eventually(DEADLINE, "the insecure_skip_verify warning", || {
        let log = proxy.log();
        async move { log.contains("insecure_skip_verify") && log.contains("WARN") }
    })
    .await;
}

#[tokio::test]
async fn tls_mistakes_name_their_line_and_field() {
    let dir = TempDir::new("corral-tls").expect("temp dir");
    let pki = Pki::new(dir.path(), "ca");
    let leaf = pki.issue("leaf", &["localhost"], false);
    let render = |c: Config| {
        c.render(
            "127.0.0.1:18080".parse().expect("addr"),
            "127.0.0.1:18081".parse().expect("addr"),
        )
    };
    let cases = [
        (
            Route::new("api", "http://127.0.0.1:9").field("tls", "{ insecure_skip_verify: true }"),
            "routes[0].tls",
            "https:// upstreams only",
        ),
        (
            route(9, "localhost", "{ ca_file: /nonexistent/ca.pem }"),
            "routes[0].tls.ca_file",
            "cannot read",
        ),
        (
            route(
                9,
                "localhost",
                &format!("{{ ca_file: {} }}", leaf.key.display()),
            ),
            "routes[0].tls.ca_file",
            "no PEM certificate",
        ),
        (
            route(
                9,
                "localhost",
                &format!("{{ client_cert: {} }}", leaf.cert.display()),
            ),
            "routes[0].tls.client_key",
            "needs client_key",
        ),
    ];
    for (r, field, words) in cases {
        let (status, stderr) = corral_check(&render(Config::new().route(r))).await;
        assert!(!status.success(), "accepted; stderr:\n{stderr}");
        assert!(
            stderr.contains(field) && stderr.contains(words) && stderr.contains("check.yaml:"),
            "expected {field} / {words}: {stderr}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tls_listener_speaks_http1_and_h2_and_follows_its_certificate_files() {
    use corral_tests::tls::{cert_der, tls_get};
    let dir = TempDir::new("corral-tls").expect("temp dir");
    let pki = Pki::new(dir.path(), "ca");
    let first = pki.issue("listener", &["corral.test", "127.0.0.1"], false);
    let origin = corral_tests::Origin::new()
        .route("/hello", corral_tests::Reply::ok("hello"))
        .start()
        .await;
    let addr = corral_tests::ports::free_addr_for_config().expect("free port");
    let proxy = Proxy::new(Config::single(origin.url()).top("listen_tls", &first.listen_tls(addr)))
        .start()
        .await;
    let ca = pki.ca_file("ca");
    let h1 = tls_get(addr, &ca, "corral.test", &[b"http/1.1"], "/hello")
        .await
        .expect("h1");
    assert_eq!(
        (h1.alpn.as_deref(), h1.status, h1.body.as_str()),
        (Some(&b"http/1.1"[..]), 200, "hello")
    );
    let h2 = tls_get(addr, &ca, "corral.test", &[b"h2", b"http/1.1"], "/hello")
        .await
        .expect("h2");
    assert_eq!(
        (h2.alpn.as_deref(), h2.status, h2.body.as_str()),
        (Some(&b"h2"[..]), 200, "hello")
    );
    assert_eq!(h2.server_cert, cert_der(&first.cert));
    // The plain listener still serves.
    assert_eq!(Client::new().get(&proxy.url("/hello")).await.status, 200);

    // cert-manager replaces the files: new connections get the new one.
    let second = pki.issue("next", &["corral.test", "127.0.0.1"], false);
    let staged = dir.path().join("staged.crt");
    std::fs::copy(&second.key, &first.key).expect("key");
    std::fs::copy(&second.cert, &staged).expect("stage");
    std::fs::rename(&staged, &first.cert).expect("swap");
    let new_der = cert_der(&first.cert);
    eventually(DEADLINE, "new connections get the new certificate", || {
        let ca = ca.clone();
        let new_der = new_der.clone();
        async move {
            tls_get(addr, &ca, "corral.test", &[b"h2"], "/hello")
                .await
                .is_ok_and(|a| a.server_cert == new_der && a.status == 200)
        }
    })
    .await;
    // A broken pair is refused and the running certificate stays.
    let refusals = |log: &str| log.matches("not a valid pair").count();
    let before = refusals(&proxy.log());
    std::fs::write(&first.cert, "not a certificate").expect("break");
    let log_says = || {
        let now = refusals(&proxy.log());
        async move { now > before }
    };
    eventually(DEADLINE, "the broken pair is logged", log_says).await;
    let still = tls_get(addr, &ca, "corral.test", &[b"http/1.1"], "/hello")
        .await
        .expect("still");
    assert_eq!((still.status, still.server_cert == new_der), (200, true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_http2_sends_many_requests_as_streams_of_one_connection() {
    let dir = TempDir::new("corral-tls").expect("temp dir");
    let pki = Pki::new(dir.path(), "ca");
    let origin = TlsOrigin::start(&pki.issue("origin", &["localhost"], false), None).await;
    let tls = format!("{{ ca_file: {} }}", pki.ca_file("ca").display());
    let proxy = Proxy::new(
        Config::new().route(
            route(origin.port(), "localhost", &tls)
                .field("upstream_http2", "true")
                .cache("enabled", "false"),
        ),
    )
    .start()
    .await;
    let answers = Client::new().burst(20, &proxy.url("/x"), &[]).await;
    assert!(
        answers
            .iter()
            .all(|a| a.status == 200 && a.text() == "tls ok")
    );
    let versions = origin.versions();
    assert_eq!(versions.len(), 20);
    assert!(
        versions.iter().all(|v| *v == http::Version::HTTP_2),
        "{versions:?}"
    );
    assert_eq!(origin.sni().len(), 1, "one connection, twenty streams");
    // The host travels as :authority only: nginx answers 400 to a Host
    // field beside it ("duplicate host header").
    assert_eq!(origin.host_fields(), 0);

    // Without the option the same origin is spoken to in HTTP/1.1.
    let plain = Proxy::new(Config::new().route(route(origin.port(), "localhost", &tls)))
        .start()
        .await;
    assert_eq!(Client::new().get(&plain.url("/x")).await.status, 200);
    assert_eq!(origin.versions().last(), Some(&http::Version::HTTP_11));

    // An upstream that does not speak h2 refuses the handshake: a clear 502.
    let h1_only = TlsOrigin::start_http1(&pki.issue("old", &["localhost"], false)).await;
    let strict = Proxy::new(
        Config::new()
            .route(route(h1_only.port(), "localhost", &tls).field("upstream_http2", "true")),
    )
    .start()
    .await;
    let a = Client::new().get(&strict.url("/x")).await;
    assert_eq!(a.status, 502);
    assert_eq!(a.cache_status().detail(), Some("upstream-tls-error"));
}
