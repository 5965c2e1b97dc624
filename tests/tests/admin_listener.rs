//! The admin listener tried as an attacker beside its operators would:
//! silent sockets that would starve the health probes, a page in an
//! operator's browser that rebinds its name to the listener, a scrape
//! that would read hot keys, and an open fleet view next to a guarded
//! instance. Each asserts what the victim (the prober, the operator, the
//! guarded instance) got, against what it gets alone.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use corral_tests::exchange_full;
use corral_tests::lifecycle::scrape::Scrape;
use corral_tests::shared::{cacheable, wait_for_key};
use corral_tests::{Client, Config, DEADLINE, Origin, Proxy, Redis, Route, RunningProxy};
use serde_json::Value;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpSocket, TcpStream};

/// A probe's deadline, as the shipped Kubernetes probes set it
/// (`timeoutSeconds: 2`).
const PROBE_DEADLINE: Duration = Duration::from_secs(2);
/// The connections one address may hold on the admin listener.
const PER_PEER: usize = 8;
const TOKEN: &str = "admin-listener-token-0123456789";

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

/// A GET on the admin listener with `host` as its Host field.
async fn get_as(proxy: &RunningProxy, path: &str, host: &str) -> corral_tests::RawResponse {
    let request = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    exchange_full(proxy.admin_addr(), request.as_bytes(), DEADLINE).await
}

/// DNS rebinding: a page on `attacker.example` has its name point at the
/// admin listener, and the operator's browser reads it as the page's own
/// origin. The listener answers its views, metrics and purges only for an
/// IP address, `localhost` or a name it lists, so the page gets a 421 and
/// nothing of the figures; the operator, by address, by `localhost` or by
/// the listed name, gets them; probes answer whatever Host they name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebound_name_reads_nothing_from_the_admin_listener() {
    // As shipped: no names listed.
    let proxy = Proxy::new(Config::single("http://127.0.0.1:9"))
        .start()
        .await;
    let port = proxy.admin_addr().port();
    for path in ["/stats", "/stats?fleet=1", "/metrics", "/", "/live.js"] {
        let page = get_as(&proxy, path, &format!("attacker.example:{port}")).await;
        assert_eq!(page.status, 421, "{path}: {}", page.head);
        let body = String::from_utf8_lossy(&page.body);
        assert!(body.contains("server.admin_hosts"), "{path}: {body}");
        assert!(
            !body.contains("corral_") && !body.contains("instance"),
            "{body}"
        );
        for host in [format!("127.0.0.1:{port}"), format!("localhost:{port}")] {
            let operator = get_as(&proxy, path, &host).await;
            assert_eq!(operator.status, 200, "{path} as {host}: {}", operator.head);
        }
    }
    let purge = "POST /purge HTTP/1.1\r\nHost: attacker.example\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    let purge = exchange_full(proxy.admin_addr(), purge.as_bytes(), DEADLINE).await;
    assert_eq!(purge.status, 421, "{}", purge.head);
    for path in ["/healthz", "/readyz", "/lb-health"] {
        let probe = get_as(&proxy, path, "corral.svc.example").await;
        assert_eq!(probe.status, 200, "{path}: {}", probe.head);
    }

    // A name the operator lists is answered; others still are not.
    let listed = Proxy::new(
        Config::single("http://127.0.0.1:9").server("admin_hosts", "[corral-admin.test]"),
    )
    .start()
    .await;
    let port = listed.admin_addr().port();
    let named = get_as(&listed, "/stats", &format!("corral-admin.test:{port}")).await;
    assert_eq!(named.status, 200, "{}", named.head);
    let other = get_as(&listed, "/stats", &format!("attacker.example:{port}")).await;
    assert_eq!(other.status, 421, "{}", other.head);
}

/// With an admin token of its own, `/metrics` needs it as the rest of the
/// view does, and names no key or path at all: a stampede on a path
/// shows on the guarded `/stats` (the busiest keys), never as a label.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_need_the_admin_token_and_name_no_key() {
    let origin = Origin::new()
        .route(
            "/private-report-7731",
            cacheable("r").delay(Duration::from_millis(300)),
        )
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url()))
        .env("CORRAL_ADMIN_TOKEN", TOKEN)
        .start()
        .await;
    let answers = Client::new()
        .burst(20, &proxy.url("/private-report-7731"), &[])
        .await;
    assert!(answers.iter().all(|a| a.status == 200));
    assert_eq!(origin.hits("/private-report-7731"), 1);

    let http = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client");
    let metrics = proxy.admin_url("/metrics");
    let none = http.get(&metrics).send().await.expect("answer");
    assert_eq!(none.status(), 401);
    assert!(none.headers().contains_key("www-authenticate"));
    let wrong = http
        .get(&metrics)
        .bearer_auth("admin-listener-token-012345678X")
        .send()
        .await
        .expect("answer");
    assert_eq!(wrong.status(), 401);
    let text = http
        .get(&metrics)
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("answer")
        .text()
        .await
        .expect("text");
    assert!(
        text.contains("corral_flight_waiters_count"),
        "the scrape with the token is whole"
    );
    assert!(
        !text.contains("private-report"),
        "a path as a label value:\n{text}"
    );
    assert!(!text.contains("key=\""), "a key label:\n{text}");
    // The guarded live view still shows the hot key.
    let stats: Value = http
        .get(proxy.admin_url("/stats"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("answer")
        .text()
        .await
        .map(|t| serde_json::from_str::<Value>(&t).expect("JSON"))
        .expect("text");
    let hot = stats["flights"]["most_waited"]
        .as_array()
        .expect("most_waited");
    assert!(
        hot.iter().any(|k| k["key"]
            .as_str()
            .is_some_and(|k| k.contains("/private-report-7731"))),
        "{stats:#}"
    );
    // Health stays open for the probes.
    assert_eq!(
        http.get(proxy.admin_url("/healthz"))
            .send()
            .await
            .expect("answer")
            .status(),
        200
    );
}

/// Two instances on one Redis: `guarded` has an admin token, `open` has
/// none. The open instance's fleet view, which anyone on its host may
/// read, lists itself and counts the guarded one as withheld, with none
/// of its figures; the guarded instance's view (with its token) lists
/// both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_fleet_view_shows_nothing_of_a_guarded_instance() {
    let redis = Redis::start().await;
    let origin = Origin::new().route("/a", cacheable("a")).start().await;
    let config = || {
        Config::new()
            .route(Route::new("api", origin.url()))
            .redis(&redis.url())
            .redis_field("op_timeout", "250ms")
    };
    let guarded = Proxy::new(config())
        .env("CORRAL_ADMIN_TOKEN", TOKEN)
        .start()
        .await;
    let open = Proxy::new(config()).start().await;
    // The guarded instance's traffic, which its view alone may show.
    let client = Client::new();
    for _ in 0..7 {
        client.get(&guarded.url("/a")).await;
    }
    // Both heartbeats are in Redis (every 2 s)...
    wait_for_key(&redis, "corral:{fleet}:i:*", DEADLINE).await;
    let r = &redis;
    corral_tests::eventually(DEADLINE, "both heartbeats in Redis", move || async move {
        r.keys("corral:{fleet}:i:*").await.len() == 2
    })
    .await;
    let http = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client");
    let own: Value = http
        .get(guarded.admin_url("/stats"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("answer")
        .text()
        .await
        .map(|t| serde_json::from_str::<Value>(&t).expect("JSON"))
        .expect("text");
    let guarded_name = own["instance"].as_str().expect("name").to_owned();

    // ... and the open view shows only the open instance.
    let text = http
        .get(open.admin_url("/stats?fleet=1"))
        .send()
        .await
        .expect("answer")
        .text()
        .await
        .expect("text");
    let fleet: Value = serde_json::from_str(&text).expect("JSON");
    let listed = fleet["instances"].as_array().expect("instances");
    assert_eq!(listed.len(), 1, "{fleet:#}");
    assert_ne!(listed[0]["instance"], own["instance"]);
    assert_eq!(fleet["withheld"], 1, "{fleet:#}");
    assert!(!text.contains(&guarded_name), "{text}");
    assert_eq!(fleet["totals"]["requests"]["hit"], 0, "{fleet:#}");
    // corral top, reading the open view, shows the same.
    let top = std::process::Command::new(corral_tests::paths::corral_bin())
        .args(["top", "--once", "--json", "--fleet", "--admin"])
        .arg(open.admin_url(""))
        .env_remove("CORRAL_ADMIN_TOKEN")
        .output()
        .expect("corral top runs");
    assert!(top.status.success(), "{top:?}");
    let top: Value = serde_json::from_slice(&top.stdout).expect("JSON");
    assert_eq!(
        top["instances"].as_array().map(Vec::len),
        Some(1),
        "{top:#}"
    );
    assert_eq!(top["withheld"], 1, "{top:#}");

    // The guarded view, with its token, lists both.
    let (http, url) = (&http, guarded.admin_url("/stats?fleet=1"));
    let url = &url;
    corral_tests::eventually(
        DEADLINE,
        "the guarded view lists both",
        move || async move {
            let fleet: Value = http
                .get(url)
                .bearer_auth(TOKEN)
                .send()
                .await
                .expect("answer")
                .text()
                .await
                .map(|t| serde_json::from_str::<Value>(&t).expect("JSON"))
                .expect("text");
            fleet["instances"].as_array().map(Vec::len) == Some(2) && fleet["withheld"] == 0
        },
    )
    .await;
}
