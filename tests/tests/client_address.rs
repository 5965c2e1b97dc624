//! The real client address (`server.trusted_proxies`): the peer, unless a
//! trusted proxy vouches for another; what the access log's `client` and
//! the upstream `X-Forwarded-For` carry, and what each trust entry counted.
//! Every test client is 127.0.0.1, so "trusted" and "untrusted" are chosen
//! by the list, not by the address.

use corral_tests::lifecycle::{scrape, wait_for_access_lines};
use corral_tests::{Client, Config, DEADLINE, Origin, Proxy, Reply, corral_check};

/// The upstream X-Forwarded-For of each request the origin saw at `path`.
fn forwarded(origin: &corral_tests::RunningOrigin, path: &str) -> Vec<String> {
    origin
        .requests(path)
        .iter()
        .map(|r| r.header_all("x-forwarded-for").join(", "))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_peer_is_the_client_and_what_it_claims_is_dropped() {
    let origin = Origin::new().route("/u", Reply::ok("u")).start().await;
    // Trusts a network the test client is not in.
    let proxy = Proxy::new(Config::single(origin.url()).server("trusted_proxies", "[10.0.0.0/8]"))
        .start()
        .await;
    let client = Client::new();
    client
        .get_with(
            &proxy.url("/u"),
            &[
                ("x-forwarded-for", "10.0.0.1, 203.0.113.7"),
                ("forwarded", "for=198.51.100.1"),
            ],
        )
        .await;
    assert_eq!(forwarded(&origin, "/u"), ["127.0.0.1"]);
    assert!(origin.requests("/u")[0].header("forwarded").is_none());
    let lines = wait_for_access_lines(&proxy, 1, DEADLINE).await;
    assert_eq!(
        (lines[0].peer.as_str(), lines[0].client.as_str()),
        ("127.0.0.1", "127.0.0.1")
    );
    let metrics = scrape(&proxy).await;
    assert_eq!(
        metrics.value(
            "corral_trusted_proxy_requests_total",
            &[("cidr", "10.0.0.0/8")]
        ),
        Some(0.0),
        "an entry that vouched for nobody shows 0"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trusted_hops_are_walked_and_a_spoofed_leftmost_entry_never_becomes_the_client() {
    let origin = Origin::new().route("/t", Reply::ok("t")).start().await;
    let proxy = Proxy::new(Config::single(origin.url()).server(
        "trusted_proxies",
        "[127.0.0.1/32, 10.0.0.0/8, 192.0.2.0/24]",
    ))
    .start()
    .await;
    let client = Client::new();
    // The load balancer (127.0.0.1) got it from an inner proxy (10.1.2.3),
    // which got it from the real client (198.51.100.7), who wrote 6.6.6.6.
    client
        .get_with(
            &proxy.url("/t"),
            &[("x-forwarded-for", "6.6.6.6, 198.51.100.7, 10.1.2.3")],
        )
        .await;
    // These proxies write X-Forwarded-For: a Forwarded is not theirs and
    // is never read, even without an X-Forwarded-For.
    client
        .get_with(
            &proxy.url("/t"),
            &[("forwarded", "for=6.6.6.6, for=\"[2001:db8::7]:4711\"")],
        )
        .await;
    // A trusted hop that recorded no address is where the walk ends.
    client
        .get_with(&proxy.url("/t"), &[("x-forwarded-for", "6.6.6.6, unknown")])
        .await;
    assert_eq!(
        forwarded(&origin, "/t"),
        [
            "198.51.100.7, 10.1.2.3, 127.0.0.1",
            "127.0.0.1",
            "127.0.0.1"
        ]
    );
    let lines = wait_for_access_lines(&proxy, 3, DEADLINE).await;
    let clients: Vec<&str> = lines.iter().map(|l| l.client.as_str()).collect();
    assert_eq!(clients, ["198.51.100.7", "127.0.0.1", "127.0.0.1"]);
    assert!(lines.iter().all(|l| l.peer == "127.0.0.1"));
    let metrics = scrape(&proxy).await;
    let vouched = |cidr| metrics.value("corral_trusted_proxy_requests_total", &[("cidr", cidr)]);
    assert_eq!(vouched("127.0.0.1/32"), Some(3.0));
    assert_eq!(vouched("10.0.0.0/8"), Some(1.0));
    assert_eq!(vouched("192.0.2.0/24"), Some(0.0));
}

/// A proxy that writes `Forwarded` and passes the client's own
/// `X-Forwarded-For` through: with `trusted_header: forwarded`, only what
/// the proxy wrote names the client, for the limits, the log and upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_header_the_trusted_proxies_write_names_the_client() {
    let origin = Origin::new().route("/f", Reply::ok("f")).start().await;
    let proxy = Proxy::new(
        Config::single(origin.url())
            .server("trusted_proxies", "[127.0.0.1/32]")
            .server("trusted_header", "forwarded"),
    )
    .start()
    .await;
    let client = Client::new();
    for claim in ["6.6.6.6", "7.7.7.7"] {
        let answer = client
            .get_with(
                &proxy.url("/f"),
                &[
                    ("forwarded", "for=\"[2001:db8::7]:4711\""),
                    ("x-forwarded-for", claim),
                ],
            )
            .await;
        assert_eq!(answer.status, 200);
    }
    assert_eq!(
        forwarded(&origin, "/f"),
        ["2001:db8::7, 127.0.0.1", "2001:db8::7, 127.0.0.1"]
    );
    let lines = wait_for_access_lines(&proxy, 2, DEADLINE).await;
    assert!(lines.iter().all(|l| l.client == "2001:db8::7"), "{lines:?}");
    let yaml = Config::single(origin.url())
        .server("trusted_header", "x-real-ip")
        .render(
            "127.0.0.1:18080".parse().expect("addr"),
            "127.0.0.1:18081".parse().expect("addr"),
        );
    let (status, stderr) = corral_check(&yaml).await;
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("server.trusted_header") && stderr.contains("x-real-ip"),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_trust_entry_that_is_not_a_network_is_refused_with_its_line_and_field() {
    let yaml = Config::single("http://127.0.0.1:9")
        .server("trusted_proxies", "[10.0.0.0/8, 10.0.0.1/8]")
        .render(
            "127.0.0.1:18080".parse().expect("addr"),
            "127.0.0.1:18081".parse().expect("addr"),
        );
    let (status, stderr) = corral_check(&yaml).await;
    assert!(!status.success(), "exit {status}, stderr:\n{stderr}");
    assert!(
        stderr.contains("server.trusted_proxies[1]") && stderr.contains("host bits"),
        "{stderr}"
    );
    assert!(
        stderr.contains("check.yaml:"),
        "names the file and line: {stderr}"
    );
}

/// A GET that asks the server to close, after `header` (a PROXY protocol
/// header, or nothing).
fn request_after(header: &[u8], path: &str) -> Vec<u8> {
    [
        header,
        format!("GET {path} HTTP/1.1\r\nHost: proxied.test\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    ]
    .concat()
}

/// A version 2 PROXY header: `command` 0 (LOCAL) or 1 (PROXY), `family`
/// 0x11 (TCP4) or 0x21 (TCP6), then the address block.
fn v2(command: u8, family: u8, addresses: &[u8]) -> Vec<u8> {
    let mut h = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
    h.extend_from_slice(&[0x20 | command, family]);
    h.extend_from_slice(&u16::try_from(addresses.len()).expect("short").to_be_bytes());
    h.extend_from_slice(addresses);
    h
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_protocol_header_names_the_peer_and_a_connection_without_one_is_closed() {
    use corral_tests::exchange_full;
    let origin = Origin::new().route("/p", Reply::ok("p")).start().await;
    let proxy = Proxy::new(
        Config::single(origin.url())
            .server("listen_proxy_protocol", "true")
            .server("trusted_proxies", "[10.0.0.0/8]"),
    )
    .start()
    .await;
    let addr = proxy.addr();
    // Version 1 from a balancer that saw 198.51.100.9.
    let v1 = b"PROXY TCP4 198.51.100.9 127.0.0.1 51000 8080\r\n";
    let a = exchange_full(addr, &request_after(v1, "/p"), DEADLINE).await;
    assert_eq!(
        (a.status, a.body.as_slice()),
        (200, &b"p"[..]),
        "{}",
        a.head
    );
    // Version 2, IPv6: 2001:db8::9 port 4711.
    let mut six = vec![0x20, 0x01, 0x0d, 0xb8];
    six.extend_from_slice(&[0; 11]);
    six.push(9);
    six.extend_from_slice(&[0; 16]);
    six.extend_from_slice(&[0x12, 0x67, 0x1f, 0x90]);
    let a = exchange_full(addr, &request_after(&v2(1, 0x21, &six), "/p"), DEADLINE).await;
    assert_eq!(a.status, 200, "{}", a.head);
    // Version 2 LOCAL (a balancer's own health check): the real peer.
    let a = exchange_full(addr, &request_after(&v2(0, 0, &[]), "/p"), DEADLINE).await;
    assert_eq!(a.status, 200, "{}", a.head);
    // A trusted inner proxy (10.0.0.5) behind the balancer: its list counts.
    let v1 = b"PROXY TCP4 10.0.0.5 127.0.0.1 40000 8080\r\n";
    let mut req = request_after(v1, "/p");
    let at = req.len() - 2;
    req.splice(
        at..at,
        b"X-Forwarded-For: 6.6.6.6, 198.51.100.1\r\n"
            .iter()
            .copied(),
    );
    let a = exchange_full(addr, &req, DEADLINE).await;
    assert_eq!(a.status, 200, "{}", a.head);
    assert_eq!(
        forwarded(&origin, "/p"),
        [
            "198.51.100.9",
            "2001:db8::9",
            "127.0.0.1",
            "198.51.100.1, 10.0.0.5"
        ]
    );
    let lines = wait_for_access_lines(&proxy, 4, DEADLINE).await;
    let seen: Vec<(&str, &str)> = lines
        .iter()
        .map(|l| (l.peer.as_str(), l.client.as_str()))
        .collect();
    assert_eq!(
        seen,
        [
            ("198.51.100.9", "198.51.100.9"),
            ("2001:db8::9", "2001:db8::9"),
            ("127.0.0.1", "127.0.0.1"),
            ("10.0.0.5", "198.51.100.1")
        ]
    );
    // Without a header, or with a broken one: closed, no answer, no
    // request upstream.
    for bad in [
        request_after(b"", "/p"),
        request_after(b"PROXY TCP4 198.51.100.9 127.0.0.1 51000\r\n", "/p"),
        request_after(&v2(1, 0x11, &[0; 4]), "/p"),
    ] {
        let a = corral_tests::exchange_bytes(addr, &bad, DEADLINE).await;
        assert!(a.is_empty(), "answered {:?}", String::from_utf8_lossy(&a));
    }
    assert_eq!(origin.requests("/p").len(), 4);
    let metrics = scrape(&proxy).await;
    assert_eq!(
        metrics.value(
            "corral_connections_closed_total",
            &[("reason", "proxy-protocol")]
        ),
        Some(3.0)
    );
}

/// The failure this guards against: a trust entry left for a proxy that is
/// gone lets whoever gets its address name any client. Removing it from the
/// file must take effect on reload, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trust_entry_removed_from_the_file_stops_being_trusted_on_reload() {
    use corral_tests::lifecycle::{current_config, replace_config, wait_for_log};
    let origin = Origin::new().route("/r", Reply::ok("r")).start().await;
    let proxy =
        Proxy::new(Config::single(origin.url()).server("trusted_proxies", "[127.0.0.1/32]"))
            .start()
            .await;
    let client = Client::new();
    let claim = [("x-forwarded-for", "198.51.100.7")];
    client.get_with(&proxy.url("/r"), &claim).await;
    let old = current_config(&proxy);
    assert!(old.contains("trusted_proxies: [127.0.0.1/32]"), "{old}");
    replace_config(
        &proxy,
        &old.replace("trusted_proxies: [127.0.0.1/32]", "trusted_proxies: []"),
    );
    wait_for_log(&proxy, "configuration reloaded", DEADLINE).await;
    client.get_with(&proxy.url("/r"), &claim).await;
    assert_eq!(
        forwarded(&origin, "/r"),
        ["198.51.100.7, 127.0.0.1", "127.0.0.1"]
    );
    let lines = wait_for_access_lines(&proxy, 2, DEADLINE).await;
    let clients: Vec<&str> = lines.iter().map(|l| l.client.as_str()).collect();
    assert_eq!(clients, ["198.51.100.7", "127.0.0.1"]);
}
