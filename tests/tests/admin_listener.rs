//! The admin listener tried as an attacker beside its operators would:
//! silent sockets that would starve the health probes. Each asserts what
//! the victim (the prober, the operator) got, against what it gets alone.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use corral_tests::lifecycle::scrape::Scrape;
use corral_tests::{Client, Config, DEADLINE, Proxy, RunningProxy};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpSocket, TcpStream};

/// A probe's deadline, as the shipped Kubernetes probes set it
/// (`timeoutSeconds: 2`).
const PROBE_DEADLINE: Duration = Duration::from_secs(2);
/// The connections one address may hold on the admin listener.
const PER_PEER: usize = 8;

/// `n` TCP connections to `to` from the loopback address `from`, each
/// open and silent.
async fn silent_connections(from: Ipv4Addr, to: SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        let socket = TcpSocket::new_v4().expect("socket");
        socket
            .bind(SocketAddr::from((from, 0)))
            .expect("bind a loopback source");
        held.push(socket.connect(to).await.expect("connect"));
    }
    held
}

/// Whether corral has closed `stream` (end of stream or reset), without
/// waiting for it to.
async fn closed(stream: &mut TcpStream) -> bool {
    let mut byte = [0u8; 1];
    matches!(
        tokio::time::timeout(Duration::from_millis(1), stream.read(&mut byte)).await,
        Ok(Ok(0) | Err(_))
    )
}

/// A kubelet's probe: a new connection for each, from `from`, answered
/// within [`PROBE_DEADLINE`] or failed.
async fn probe(from: Ipv4Addr, url: &str) -> Result<(u16, String), String> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .http1_only()
        .pool_max_idle_per_host(0)
        .local_address(std::net::IpAddr::V4(from))
        .timeout(PROBE_DEADLINE)
        .build()
        .expect("probe client");
    let answer = client.get(url).send().await.map_err(|e| format!("{e}"))?;
    let status = answer.status().as_u16();
    Ok((status, answer.text().await.map_err(|e| format!("{e}"))?))
}

/// Ten probes of `url` from `from`, one after the other: each answer.
async fn ten_probes(from: Ipv4Addr, url: &str) -> Vec<Result<(u16, String), String>> {
    let mut answers = Vec::new();
    for _ in 0..10 {
        answers.push(probe(from, url).await);
    }
    answers
}

fn assert_all_ok(answers: &[Result<(u16, String), String>], what: &str) {
    let ok = answers
        .iter()
        .filter(|a| matches!(a, Ok((200, body)) if body == "ok\n"))
        .count();
    assert_eq!(ok, answers.len(), "{what}: {answers:?}");
}

async fn metrics_of(proxy: &RunningProxy) -> Scrape {
    corral_tests::lifecycle::scrape(proxy).await
}

/// 200 silent connections from one address take that address's share of
/// the admin listener (eight) and no more: the rest are closed at once,
/// the eight when the short head deadline passes, and meanwhile the
/// probes from the kubelet's address answer ten of ten within their
/// deadline, and an operator on a third address reads the metrics. On the
/// listener without shares, the 64 slots were filled and the probes
/// queued behind 136 silent sockets, every one failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_from_one_address_leave_the_probes_and_others_served() {
    let proxy = Proxy::new(Config::single("http://127.0.0.1:9"))
        .start()
        .await;
    let before = metrics_of(&proxy).await;
    let attacker = Ipv4Addr::new(127, 0, 0, 2);
    let mut silent = silent_connections(attacker, proxy.admin_addr(), 200).await;

    let probes = ten_probes(Ipv4Addr::LOCALHOST, &proxy.admin_url("/healthz")).await;
    assert_all_ok(&probes, "liveness probes beside 200 silent connections");
    let readiness = probe(Ipv4Addr::LOCALHOST, &proxy.admin_url("/readyz")).await;
    assert!(
        matches!(&readiness, Ok((200, body)) if body.contains("\"ready\":true")),
        "{readiness:?}"
    );
    // The twin, an operator on an address of its own, gets what it gets
    // alone: the metrics, whole.
    let operator = Client::from_address(Ipv4Addr::new(127, 0, 0, 3));
    let metrics = operator.get(&proxy.admin_url("/metrics")).await;
    assert_eq!(metrics.status, 200);
    let seen = Scrape::parse(&metrics.text()).expect("the operator's scrape parses");
    assert_eq!(
        seen.value("corral_l1_limit_bytes", &[]),
        before.value("corral_l1_limit_bytes", &[]),
        "the operator's scrape is whole"
    );

    // Every silent connection is closed: all but the address's share at
    // once, the share at the head deadline (2 s).
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let mut open = 0;
        for s in &mut silent {
            open += usize::from(!closed(s).await);
        }
        if open == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{open} silent connections still open after {DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let after = metrics_of(&proxy).await;
    let closed_for = |reason: &str| {
        after.sum("corral_connections_closed_total", &[("reason", reason)])
            - before.sum("corral_connections_closed_total", &[("reason", reason)])
    };
    let past_share = closed_for("peer-limit");
    let silent_served = closed_for("no-request");
    assert_eq!(
        past_share + silent_served,
        200.0,
        "each silent connection closed once, as past its share or as silent"
    );
    assert!(
        silent_served >= PER_PEER as f64 && past_share >= 100.0,
        "the address held its share and most were refused at once: \
         {past_share} past the share, {silent_served} served"
    );
    assert_eq!(
        closed_for("listener-full"),
        0.0,
        "the listener never filled"
    );
}

/// The health listener is the probers' alone: with the admin listener
/// full (silent connections from nine addresses, each within its share),
/// the probes on `health_listen` still answer ten of ten, and it answers
/// nothing but the probes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_listener_answers_the_probes_while_the_admin_listener_is_full() {
    let health = corral_tests::ports::free_addr_for_config().expect("a port");
    let proxy =
        Proxy::new(Config::single("http://127.0.0.1:9").top("health_listen", &health.to_string()))
            .start()
            .await;
    let mut silent = Vec::new();
    for host in 10..19 {
        let from = Ipv4Addr::new(127, 0, 0, host);
        silent.extend(silent_connections(from, proxy.admin_addr(), PER_PEER).await);
    }
    // Beside them, the health listener.
    let probes = ten_probes(Ipv4Addr::LOCALHOST, &format!("http://{health}/healthz")).await;
    assert_all_ok(
        &probes,
        "probes on health_listen beside a full admin listener",
    );
    for (path, status) in [
        ("/readyz", 200),
        ("/lb-health", 200),
        ("/metrics", 404),
        ("/stats", 404),
    ] {
        let answer = probe(Ipv4Addr::LOCALHOST, &format!("http://{health}{path}")).await;
        assert!(
            matches!(answer, Ok((s, _)) if s == status),
            "{path} on the health listener: {answer:?}"
        );
    }
    drop(silent);
}
