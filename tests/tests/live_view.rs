//! The operator's live view (issue 30): `/stats` and the fleet behind it,
//! `corral top`, the page in a real browser, and who may see them. The
//! figures are checked against `/metrics` and the origin's own count: the
//! origin requests saved are the clients less the origin's requests.

use std::process::Command;
use std::time::Duration;

use corral_tests::lifecycle::{admin_get, scrape};
use corral_tests::paths::corral_bin;
use corral_tests::shared::{cacheable, spawn_bursts};
use corral_tests::{Client, Config, DEADLINE, Origin, Proxy, Redis, Route, RunningProxy};
use serde_json::Value;

const OUTCOMES: [&str; 6] = ["hit", "stale", "miss", "collapsed", "pass", "error"];

fn shared(origin: &corral_tests::RunningOrigin, redis: &Redis) -> Config {
    shared_route(Route::new("api", origin.url()), redis)
}

/// One route, `route`, sharing `redis` (whose deadline is raised from the
/// 50 ms default: two shared cores under a burst).
fn shared_route(route: Route, redis: &Redis) -> Config {
    Config::new()
        .route(route)
        .redis(&redis.url())
        .redis_field("op_timeout", "250ms")
}

async fn stats(proxy: &RunningProxy, path: &str) -> Value {
    let answer = admin_get(proxy, path).await;
    assert_eq!(answer.status, 200, "GET {path}: {}", answer.body);
    assert_eq!(answer.content_type.as_deref(), Some("application/json"));
    serde_json::from_str(&answer.body).expect("JSON")
}

/// `/stats?fleet=1` of `proxy` once `ready` says so (heartbeats come
/// every 2 s); fails the test past the deadline.
async fn fleet_when(proxy: &RunningProxy, what: &str, ready: impl Fn(&Value) -> bool) -> Value {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let fleet = stats(proxy, "/stats?fleet=1").await;
        if ready(&fleet) {
            return fleet;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for the fleet view: {what}\n{fleet:#}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn count(v: &Value) -> u64 {
    v.as_u64().expect("a count")
}

fn clients(traffic: &Value) -> u64 {
    OUTCOMES
        .iter()
        .map(|o| count(&traffic["requests"][o]))
        .sum()
}

/// A stampede of `n` on each of `proxies` for one cold key (300 ms at the
/// origin): every answer a 200.
async fn stampede(proxies: &[RunningProxy], n: usize, path: &str) {
    let client = Client::new();
    let answers = spawn_bursts(&client, proxies, n, path)
        .await
        .expect("burst");
    for a in answers.iter().flatten() {
        assert_eq!(a.status, 200);
    }
}

/// `corral top --once --json` with `args`: its JSON, or its failure.
fn top(args: &[&str]) -> Result<Value, String> {
    let out = Command::new(corral_bin())
        .arg("top")
        .args(["--once", "--json"])
        .args(args)
        .env_remove("CORRAL_ADMIN_TOKEN")
        .output()
        .expect("corral top runs");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    serde_json::from_slice(&out.stdout).map_err(|e| format!("{e}"))
}

/// Two instances on one Redis, 400 callers, one origin request: each
/// instance's `/stats` agrees with its `/metrics`, the fleet view (on
/// either instance, and `corral top`) lists both and sums them, and the
/// origin requests saved are the clients less the origin's own count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_shows_one_origin_request_for_every_client() {
    let redis = Redis::start().await;
    let origin = Origin::new()
        .route(
            "/cold",
            cacheable("the one answer").delay(Duration::from_millis(300)),
        )
        .start()
        .await;
    let proxies = Proxy::new(shared(&origin, &redis))
        .instances(2)
        .start_all()
        .await;
    stampede(&proxies, 200, "/cold").await;
    assert_eq!(origin.hits("/cold"), 1);

    // Each instance's own figures are its metrics'.
    let mut names = Vec::new();
    for p in &proxies {
        let own = stats(p, "/stats").await;
        let metrics = scrape(p).await;
        assert_eq!(
            clients(&own["totals"]) as f64,
            metrics.sum("corral_requests_total", &[])
        );
        assert_eq!(
            count(&own["totals"]["origin_requests"]) as f64,
            metrics.sum("corral_origin_fetches_total", &[])
        );
        assert_eq!(clients(&own["totals"]), 200);
        assert_eq!(own["redis"]["mode"], "node");
        assert_eq!(own["redis"]["link"], "connected");
        let route = &own["routes"][0];
        assert_eq!(route["name"], "api");
        assert_eq!(route["circuit"], "closed");
        let bounds: Vec<&str> = own["bounds"]
            .as_array()
            .expect("bounds")
            .iter()
            .map(|b| b["name"].as_str().expect("name"))
            .collect();
        for b in ["l1", "fill_memory", "pinned_by_slow_readers", "descriptors"] {
            assert!(bounds.contains(&b), "{b} in {bounds:?}");
        }
        assert!(bounds.iter().any(|b| b.starts_with("connections_")));
        names.push(own["instance"].as_str().expect("name").to_owned());
    }
    assert_ne!(names[0], names[1]);

    // The fleet, from either instance: both, once their heartbeats (every
    // 2 s) carry the stampede.
    for p in &proxies {
        let fleet = fleet_when(p, "both instances, 400 clients", |f| {
            f["instances"].as_array().map(Vec::len) == Some(2) && clients(&f["totals"]) == 400
        })
        .await;
        assert_eq!(fleet["source"], "redis");
        let totals = &fleet["totals"];
        let origin_requests = count(&totals["origin_requests"]);
        assert_eq!(origin_requests, origin.hits("/cold") as u64);
        let saved = clients(totals) - origin_requests;
        assert_eq!(saved, 399, "{totals}");
        let by_reason: u64 = ["hit", "collapsed", "stale"]
            .iter()
            .map(|r| count(&totals["saved"][r]))
            .sum();
        assert_eq!(by_reason, 399, "{totals}");
    }

    // corral top reads the same, from both admin listeners or the fleet.
    let (a, b) = (proxies[0].admin_url(""), proxies[1].admin_url(""));
    for args in [
        vec!["--admin", &a, "--admin", &b],
        vec!["--fleet", "--admin", &a],
    ] {
        let seen = top(&args).expect("corral top");
        assert_eq!(
            seen["instances"].as_array().map(Vec::len),
            Some(2),
            "{args:?}"
        );
        assert_eq!(clients(&seen["totals"]), 400, "{args:?}");
        assert_eq!(count(&seen["totals"]["origin_requests"]), 1, "{args:?}");
    }
    let down = top(&["--admin", "http://127.0.0.1:9"]).expect_err("nothing listens");
    assert!(down.contains("127.0.0.1:9"), "{down}");
}

/// Without Redis the fleet view is the one instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_redis_the_fleet_is_this_instance() {
    let origin = Origin::new().route("/a", cacheable("a")).start().await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    for _ in 0..3 {
        client.get(&proxy.url("/a")).await;
    }
    let fleet = stats(&proxy, "/stats?fleet=1").await;
    assert_eq!(fleet["source"], "local");
    assert_eq!(fleet["instances"].as_array().map(Vec::len), Some(1));
    assert_eq!(count(&fleet["totals"]["requests"]["hit"]), 2);
    assert_eq!(count(&fleet["totals"]["requests"]["miss"]), 1);
    assert_eq!(fleet["instances"][0]["redis"]["mode"], "off");
}

const TOKEN: &str = "live-view-token-0123456789";

/// With an admin token of its own, the page, its assets, `/stats` and
/// `/metrics` need it (bearer or HTTP Basic, as a browser sends it);
/// health stays open. The page forbids everything but its own script and style.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_view_needs_its_token_when_one_is_set() {
    let origin = Origin::new().route("/a", cacheable("a")).start().await;
    let proxy = Proxy::new(Config::single(origin.url()))
        .env("CORRAL_ADMIN_TOKEN", TOKEN)
        .start()
        .await;
    let http = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client");
    for path in [
        "/",
        "/live.js",
        "/live.css",
        "/stats",
        "/stats?fleet=1",
        "/history",
        "/metrics",
    ] {
        let url = proxy.admin_url(path);
        let none = http.get(&url).send().await.expect("answer");
        assert_eq!(none.status(), 401, "{path}");
        let challenge = none.headers().get("www-authenticate").expect("challenge");
        // A browser is asked for Basic; a scraper is told to bring a bearer.
        let scheme = if path == "/metrics" {
            "Bearer "
        } else {
            "Basic "
        };
        assert!(
            challenge.to_str().expect("ascii").starts_with(scheme),
            "{path}"
        );
        let wrong = http
            .get(&url)
            .bearer_auth("live-view-token-012345678X")
            .send()
            .await
            .expect("answer");
        assert_eq!(wrong.status(), 401, "{path}");
        let bearer = http
            .get(&url)
            .bearer_auth(TOKEN)
            .send()
            .await
            .expect("answer");
        assert_eq!(bearer.status(), 200, "{path}");
        let basic = http
            .get(&url)
            .basic_auth("operator", Some(TOKEN))
            .send()
            .await
            .expect("answer");
        assert_eq!(basic.status(), 200, "{path}");
        if path == "/metrics" {
            continue;
        }
        assert_eq!(
            basic
                .headers()
                .get("cache-control")
                .map(|v| v.to_str().expect("ascii")),
            Some("no-store")
        );
    }
    let page = http
        .get(proxy.admin_url("/"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("page");
    let csp = page
        .headers()
        .get("content-security-policy")
        .expect("CSP")
        .to_str()
        .expect("ascii")
        .to_owned();
    assert!(
        csp.starts_with("default-src 'none'; script-src 'self';"),
        "{csp}"
    );
    assert!(!csp.contains("unsafe"), "{csp}");
    for open in ["/healthz", "/readyz", "/lb-health"] {
        let answer = http
            .get(proxy.admin_url(open))
            .send()
            .await
            .expect("answer");
        assert_eq!(answer.status(), 200, "{open}");
    }
    // corral top asks with the token, or is told why not.
    let admin = proxy.admin_url("");
    let refused = top(&["--admin", &admin]).expect_err("no token");
    assert!(refused.contains("401"), "{refused}");
    let seen = top(&["--admin", &admin, "--token", TOKEN]).expect("with the token");
    assert_eq!(seen["instances"].as_array().map(Vec::len), Some(1));
}

/// A token too short to guard anything is refused at start, naming it.
#[tokio::test]
async fn a_short_admin_token_is_refused() {
    let (status, message) = corral_tests::corral_check(
        "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\ncache: { memory: 64MiB }\n\
         server: { admin_token: short }\nroutes: []\n",
    )
    .await;
    assert!(!status.success());
    assert!(message.contains("admin_token"), "{message}");
    assert!(message.contains("16 characters"), "{message}");
}

// ---------------------------------------------------------------------------
// The page in a real browser
// ---------------------------------------------------------------------------

/// Debian's Chromium, headless, as the probe of this machine runs it.
fn chromium() -> Option<std::path::PathBuf> {
    ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .iter()
        .map(std::path::PathBuf::from)
        .find(|p| p.exists())
}

/// `chromium --headless` on `url` with `extra`, its stdout.
fn headless(url: &str, extra: &[&str]) -> String {
    let Some(bin) = chromium() else {
        if std::env::var("CORRAL_SKIP_CHROMIUM").as_deref() == Ok("1") {
            return String::new();
        }
        panic!("no Chromium: install Debian's `chromium` package (or set CORRAL_SKIP_CHROMIUM=1)");
    };
    let profile = corral_tests::temp::TempDir::new("chromium").expect("profile dir");
    let out = Command::new(bin)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(extra)
        .arg(url)
        .output()
        .expect("chromium runs");
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The text of the element `id` in a serialized DOM.
fn element_text<'a>(dom: &'a str, id: &str) -> &'a str {
    let open = format!("id=\"{id}\">");
    let start = dom
        .find(&open)
        .unwrap_or_else(|| panic!("#{id} in the page"))
        + open.len();
    let end = dom[start..].find('<').expect("closing tag") + start;
    &dom[start..end]
}

fn number(text: &str) -> u64 {
    text.replace(',', "")
        .parse()
        .unwrap_or_else(|_| panic!("a number: {text:?}"))
}

/// Headless Chromium loads the page of one of two instances sharing a
/// Redis after a stampede: the figures it renders (read through its DOM)
/// are the fleet's, and the origin requests saved are the clients less
/// the origin's own count. A heartbeat forged in Redis with markup in its
/// names is shown as text: no element of it is made, no script of it
/// runs. A screenshot is saved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_the_fleet_in_a_browser_and_escapes_what_it_shows() {
    if chromium().is_none() && std::env::var("CORRAL_SKIP_CHROMIUM").as_deref() == Ok("1") {
        eprintln!("SKIPPED: no Chromium and CORRAL_SKIP_CHROMIUM=1");
        return;
    }
    let server = Redis::start().await;
    let origin = Origin::new()
        .route(
            "/cold",
            cacheable("the one answer").delay(Duration::from_millis(300)),
        )
        .route("/broken", corral_tests::Reply::status(503, "down"))
        .route("/slow", cacheable("slow").delay(Duration::from_secs(20)))
        .start()
        .await;
    // A key backs off from its first failure here (once two callers saw
    // one: one caller's failures back off no one else).
    let backoff = "{ after: 1, min: 60s, max: 60s }";
    let route = Route::new("api", origin.url()).field("backoff", backoff);
    let proxies = Proxy::new(shared_route(route, &server))
        .instances(2)
        .start_all()
        .await;
    stampede(&proxies, 150, "/cold").await;
    assert_eq!(origin.hits("/cold"), 1);
    // A key whose origin failed: in back-off.
    let client = Client::new();
    let failed = client.get(&proxies[0].url("/broken")).await;
    assert_eq!(failed.status, 503);
    let other = Client::from_address(std::net::Ipv4Addr::new(127, 0, 0, 2));
    let failed = other.get(&proxies[0].url("/broken")).await;
    assert_eq!(failed.status, 503);
    // A flight in progress while the page looks: 40 callers on one key
    // the origin takes its time with.
    let slow = {
        let (client, url) = (client.clone(), proxies[0].url("/slow"));
        tokio::spawn(async move { client.burst(40, &url, &[]).await })
    };

    // An instance nobody runs, with markup wherever a name goes.
    let forged = serde_json::json!({
        "instance": "<script>document.title='pwned'</script>",
        "listen": "<img src=x id=injected>",
        "version": "0", "uptime_s": 1,
        "at_ms": std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH).expect("now").as_millis() as u64,
        "totals": { "requests": {"hit": 0, "stale": 0, "miss": 0, "collapsed": 0, "pass": 0, "error": 0},
                    "origin_requests": 0, "saved": {"hit": 0, "collapsed": 0, "stale": 0} },
        "routes": [{ "name": "<b id=bold>route</b>", "requests": {"hit": 0}, "origin_requests": 0,
                     "saved": {}, "circuit": "closed" }],
        "flights": { "in_progress": 1, "backoff_keys": 1,
                     "backoff": [{ "key": "api GET h/<u id=under>x</u>", "remaining_ms": 900 }],
                     "busiest": [{ "key": "api GET h/<script>alert(1)</script>", "waiting": 7, "age_ms": 5 }] },
        "redis": { "mode": "cluster", "link": "connected", "breaker_open": true,
                   "primaries": [{ "node": "<i id=italic>10.0.0.1:6379</i>", "breaker_open": true }],
                   "l2_reads": {} },
        "bounds": []
    });
    let name = "<script>document.title='pwned'</script>";
    let mut zadd = ::redis::cmd("ZADD");
    zadd.arg("corral:{fleet}:members")
        .arg(i64::MAX / 2)
        .arg(name);
    server.command::<i64>(&zadd, "ZADD").await;
    // Sealed with the fleet's key: a member of the fleet, not an outsider
    // (whose heartbeat is skipped unread), is what shows markup here.
    server
        .set_raw(
            &format!("corral:{{fleet}}:i:{name}"),
            corral_tests::sealed_heartbeat(name, &forged.to_string()).as_bytes(),
        )
        .await;

    let a = &proxies[0];
    let fleet = fleet_when(a, "all three, 302 clients, 39 waiting", |f| {
        let waiting = f["instances"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|i| {
                i["flights"]["busiest"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .any(|b| b["key"] == "api GET 127.0.0.1/slow" && b["waiting"] == 39);
        f["instances"].as_array().map(Vec::len) == Some(3)
            && clients(&f["totals"]) == 302
            && waiting
    })
    .await;
    let url = a.admin_url("/");
    let page = url.clone();
    let dom = tokio::task::spawn_blocking(move || {
        headless(&page, &["--virtual-time-budget=4000", "--dump-dom"])
    })
    .await
    .expect("chromium task");
    assert!(!dom.is_empty(), "no DOM");
    // The page read the fleet at least twice (rates need two readings).
    let updates = dom
        .split("data-updates=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .map(number)
        .unwrap_or(0);
    assert!(updates >= 2, "the page updated {updates} times");
    let origin_hits = origin.hits("/cold") as u64;
    let metrics_clients: f64 = {
        let mut n = 0.0;
        for p in &proxies {
            n += scrape(p).await.sum("corral_requests_total", &[]);
        }
        n
    };
    assert_eq!(number(element_text(&dom, "total-clients")), 302);
    assert_eq!(metrics_clients, 302.0);
    let origin_hits = origin_hits + origin.hits("/broken") as u64;
    assert_eq!(number(element_text(&dom, "total-origin")), origin_hits);
    assert_eq!(
        number(element_text(&dom, "total-saved")),
        302 - origin_hits,
        "saved = clients - origin requests"
    );
    assert_eq!(number(element_text(&dom, "instance-count")), 3);
    let collapsed = number(element_text(&dom, "saved-collapsed"));
    let hit = number(element_text(&dom, "saved-hit"));
    assert_eq!(
        collapsed + hit,
        count(&fleet["totals"]["saved"]["collapsed"]) + count(&fleet["totals"]["saved"]["hit"])
    );
    // The flight under way with its callers waiting, and the key in
    // back-off, as this instance sees them.
    assert!(
        dom.contains("<td class=\"key\">api GET 127.0.0.1/slow</td><td>39</td>"),
        "the slow flight"
    );
    assert!(
        dom.contains("<td class=\"key\">api GET 127.0.0.1/broken</td>"),
        "the key in back-off: {}",
        &dom[dom.find("id=\"backoff\"").unwrap_or(0)..][..600.min(dom.len())]
    );
    assert_eq!(
        number(element_text(&dom, "backoff-keys")),
        2,
        "one here, one forged"
    );
    // The forged names are text: escaped in the DOM, no element made.
    assert!(
        dom.contains("&lt;script&gt;document.title='pwned'&lt;/script&gt;"),
        "instance name shown as text"
    );
    assert!(
        dom.contains("api GET h/&lt;script&gt;alert(1)&lt;/script&gt;"),
        "flight key shown as text"
    );
    assert!(
        dom.contains("&lt;b id=bold&gt;route&lt;/b&gt;"),
        "route name shown as text"
    );
    assert!(!dom.contains("id=\"injected\""), "an element was injected");
    assert!(!dom.contains("id=\"bold\""), "an element was injected");
    assert!(!dom.contains("id=\"italic\""), "an element was injected");
    assert!(!dom.contains("id=\"under\""), "an element was injected");
    assert!(
        dom.contains("&lt;u id=under&gt;x&lt;/u&gt;"),
        "back-off key shown as text"
    );
    assert_eq!(
        dom.matches("<script").count(),
        1,
        "only the page's own script"
    );
    assert!(
        dom.contains("<title>corral: live</title>"),
        "a forged script ran"
    );

    // A screenshot, for the record (and the user guide's docs/src/live-view.png).
    let shot = std::env::temp_dir().join(format!("corral-live-{}.png", std::process::id()));
    let arg = format!("--screenshot={}", shot.display());
    tokio::task::spawn_blocking(move || {
        headless(
            &url,
            &[
                "--virtual-time-budget=4000",
                "--window-size=1280,1500",
                &arg,
            ],
        )
    })
    .await
    .expect("chromium task");
    slow.abort();
    let png = std::fs::read(&shot).expect("a screenshot");
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    if let Ok(keep) = std::env::var("CORRAL_LIVE_SCREENSHOT") {
        std::fs::copy(&shot, keep).expect("screenshot kept");
    }
    let _ = std::fs::remove_file(&shot);
}

/// The text of the first element whose attributes include `attr`, in a
/// serialized DOM, with its opening tag.
fn tagged<'a>(dom: &'a str, attr: &str) -> (&'a str, &'a str) {
    let at = dom
        .find(attr)
        .unwrap_or_else(|| panic!("{attr} in the page"));
    let open = dom[..at].rfind('<').expect("a tag");
    let end = dom[at..].find('>').expect("the tag's end") + at;
    let text_end = dom[end..].find('<').expect("closing tag") + end;
    (&dom[open..=end], &dom[end + 1..text_end])
}

/// The value of attribute `name` in `tag`.
fn attribute<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
    let from = tag.find(&format!(" {name}=\""))? + name.len() + 3;
    tag[from..].split('"').next()
}

/// A page opened in the middle of an incident (the origin gone, Redis
/// gone) shows what led to it: its chart starts with the readings the
/// instance kept before the page opened (`/history`), has a time and a
/// rate axis, shades the trouble, and draws the origin's errors; the
/// origin errors have a figure of their own, and the open Redis breaker
/// is flagged over the page and on its instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_opened_mid_incident_draws_what_led_to_it_and_flags_the_breaker() {
    if chromium().is_none() && std::env::var("CORRAL_SKIP_CHROMIUM").as_deref() == Ok("1") {
        eprintln!("SKIPPED: no Chromium and CORRAL_SKIP_CHROMIUM=1");
        return;
    }
    let mut redis = Redis::start().await;
    let mut origin = Origin::new().route("/o", cacheable("up")).start().await;
    let config = shared(&origin, &redis).redis_field("breaker", "{ failures: 2, open_for: 60s }");
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();
    for i in 0..20 {
        assert_eq!(
            client.get(&proxy.url(&format!("/o?k={i}"))).await.status,
            200
        );
    }
    origin.stop().await;
    redis.kill();
    for i in 0..30 {
        let a = client.get(&proxy.url(&format!("/o?down={i}"))).await;
        assert!(a.status.is_server_error(), "{a:?}");
    }
    // The instance's own readings (one every 5 s) come to show it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let history = loop {
        let h = stats(&proxy, "/history").await;
        let points = h["points"].as_array().cloned().unwrap_or_default();
        if points
            .last()
            .is_some_and(|p| p["redis_breaker_open"] == true && count(&p["origin_errors"]) > 0)
        {
            break points;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no reading showed the incident: {h:#}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(history.len() >= 2, "{history:#?}");
    assert!(
        history.iter().any(|p| p["redis_breaker_open"] == false),
        "a reading from before the incident: {history:#?}"
    );
    let opened_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("now")
        .as_millis() as u64;
    let metrics = scrape(&proxy).await;
    let errors = metrics.sum("corral_origin_fetches_total", &[("status", "error")])
        + metrics.sum("corral_origin_fetches_total", &[("status", "502")])
        + metrics.sum("corral_origin_fetches_total", &[("status", "503")])
        + metrics.sum("corral_origin_fetches_total", &[("status", "504")]);
    assert!(errors >= 1.0);

    let url = proxy.admin_url("/");
    let dom = tokio::task::spawn_blocking(move || {
        headless(&url, &["--virtual-time-budget=3000", "--dump-dom"])
    })
    .await
    .expect("chromium task");
    assert!(!dom.is_empty(), "no DOM");
    let (chart, _) = tagged(&dom, "id=\"chart\"");
    let since: u64 = attribute(chart, "data-since")
        .map(number)
        .unwrap_or_else(|| panic!("the history's start: {chart}"));
    assert!(since < opened_ms, "the chart starts before the page opened");
    assert_eq!(since, count(&history[0]["at_ms"]));
    let kept = attribute(chart, "data-history-points").map(number);
    assert!(kept >= Some(history.len() as u64), "{chart}");
    assert!(attribute(chart, "data-points").map(number) >= Some(history.len() as u64 - 1));
    // The axes: clock times below, rates beside, and the trouble shaded.
    assert!(dom.matches("class=\"axis-x\"").count() >= 1, "a time axis");
    assert_eq!(dom.matches("class=\"axis-y\"").count(), 3, "a rate axis");
    assert!(dom.contains(" /s</text>"), "rates labelled per second");
    assert!(dom.contains("class=\"trouble\""), "the incident shaded");
    assert!(
        dom.contains("data-series=\"errors\""),
        "the origin's errors drawn"
    );
    // The origin's errors, a figure of their own.
    assert_eq!(
        number(element_text(&dom, "total-origin-errors")) as f64,
        errors
    );
    // The breaker, flagged over the page and on its instance.
    let (alarms, said) = tagged(&dom, "id=\"alarms\"");
    assert_eq!(attribute(alarms, "data-breaker"), Some("open"), "{alarms}");
    assert!(!alarms.contains(" hidden"), "{alarms}");
    assert!(said.starts_with("Redis breaker open: "), "{said}");
    assert!(
        dom.contains("<td class=\"alarm\">"),
        "the instance's Redis cell"
    );
}

/// `corral top --once` in an incident: the open Redis breaker, the open
/// circuit and the keys in back-off head the view (plain text: stdout is
/// no terminal), and its rates are made of two readings an interval
/// apart, so they are figures, not dashes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corral_top_once_heads_with_what_is_open_and_shows_rates() {
    let mut redis = Redis::start().await;
    let mut origin = Origin::new().route("/o", cacheable("up")).start().await;
    let circuit = "{ error_rate: 50%, min_fetches: 5, window: 10s, open_for: 60s }";
    let route = Route::new("api", origin.url()).field("circuit", circuit);
    let config =
        shared_route(route, &redis).redis_field("breaker", "{ failures: 2, open_for: 60s }");
    let proxy = Proxy::new(config).start().await;
    let client = Client::new();
    origin.stop().await;
    redis.kill();
    // Five callers see the origin fail (one caller's failures count once).
    for i in 0..5u8 {
        let caller = Client::from_address(std::net::Ipv4Addr::new(127, 0, 0, 20 + i));
        let a = caller.get(&proxy.url(&format!("/o?k={i}"))).await;
        assert!(a.status.is_server_error(), "{a:?}");
    }
    fleet_when(&proxy, "the circuit and the breaker open", |f| {
        let i = &f["instances"][0];
        i["routes"][0]["circuit"] == "open" && i["redis"]["breaker_open"] == true
    })
    .await;
    // Requests go on while top takes its two readings.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (stop, client, url) = (stop.clone(), client.clone(), proxy.url("/o?busy"));
        tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = client.get(&url).await;
            }
        })
    };
    let admin = proxy.admin_url("");
    let out = tokio::task::spawn_blocking(move || {
        Command::new(corral_bin())
            .args(["top", "--once", "--interval", "1", "--admin", &admin])
            .env_remove("CORRAL_ADMIN_TOKEN")
            .output()
            .expect("corral top runs")
    })
    .await
    .expect("top task");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    load.await.expect("load");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let alarm = text
        .lines()
        .find(|l| l.starts_with("!! "))
        .unwrap_or_else(|| panic!("no alarm line:\n{text}"));
    assert!(alarm.contains("REDIS BREAKER OPEN: "), "{alarm}");
    assert!(alarm.contains("CIRCUIT OPEN: api"), "{alarm}");
    assert!(!text.contains('\x1b'), "no terminal, no escapes:\n{text}");
    let rate = |label: &str| -> f64 {
        let line = text
            .lines()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("{label}:\n{text}"));
        let per_s = line
            .split_whitespace()
            .find(|w| w.ends_with("/s"))
            .unwrap_or_else(|| panic!("a rate: {line}"));
        per_s
            .trim_end_matches("/s")
            .parse()
            .unwrap_or_else(|_| panic!("a rate, not a dash: {line}"))
    };
    assert!(rate("client requests") > 0.0, "{text}");
    assert!(rate("origin errors") >= 0.0, "{text}");
}

// ---------------------------------------------------------------------------
// corral top, interactive, in tmux
// ---------------------------------------------------------------------------

fn tmux(args: &[&str]) -> std::process::Output {
    Command::new("tmux").args(args).output().expect("tmux runs")
}

/// What the tmux pane `session` shows once `ready` says so.
async fn pane_when(session: &str, ready: impl Fn(&str) -> bool) -> String {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let out = tmux(&["capture-pane", "-p", "-t", session]);
        let screen = String::from_utf8_lossy(&out.stdout).into_owned();
        if ready(&screen) {
            return screen;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out; the pane shows:\n{screen}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `corral top` in a terminal (tmux): it draws the view with the
/// instance's figures, redraws them as they change, and exits cleanly on
/// q and on Ctrl-C, each time with status 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corral_top_draws_in_a_terminal_and_quits_on_q_or_ctrl_c() {
    if Command::new("tmux").arg("-V").output().is_err() {
        if std::env::var("CORRAL_SKIP_TMUX").as_deref() == Ok("1") {
            eprintln!("SKIPPED: no tmux and CORRAL_SKIP_TMUX=1");
            return;
        }
        panic!("no tmux: install Debian's `tmux` package (or set CORRAL_SKIP_TMUX=1)");
    }
    let origin = Origin::new().route("/a", cacheable("a")).start().await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let client = Client::new();
    let dir = corral_tests::temp::TempDir::new("top").expect("dir");
    for key in ["q", "C-c"] {
        let session = format!("corral-top-{}-{}", std::process::id(), key.len());
        let status = dir.path().join(format!("status-{}", key.len()));
        let command = format!(
            "{} top --interval 0.2 --admin {}; echo $? > {}",
            corral_bin().display(),
            proxy.admin_url(""),
            status.display()
        );
        let started = tmux(&[
            "new-session",
            "-d",
            "-s",
            &session,
            "-x",
            "150",
            "-y",
            "60",
            &command,
        ]);
        assert!(started.status.success(), "{started:?}");
        client.get(&proxy.url("/a")).await;
        let screen = pane_when(&session, |s| {
            s.contains("corral top") && s.contains("client requests")
        })
        .await;
        assert!(screen.contains("q quits"), "{screen}");
        // Its figures follow the instance's: two more answers, two more.
        let before = scrape(&proxy).await.sum("corral_requests_total", &[]) as u64;
        client.get(&proxy.url("/a")).await;
        client.get(&proxy.url("/a")).await;
        let want = format!("client requests {:>12}", before + 2);
        pane_when(&session, |s| s.contains(&want)).await;
        let sent = tmux(&["send-keys", "-t", &session, key]);
        assert!(sent.status.success());
        // The shell writes the status once corral top has quit: whole
        // once its line ends.
        let written = || std::fs::read_to_string(&status).is_ok_and(|s| s.ends_with('\n'));
        let what = format!("corral top quits on {key}");
        corral_tests::eventually(DEADLINE, &what, || std::future::ready(written())).await;
        let code = std::fs::read_to_string(&status).expect("status");
        assert_eq!(code.trim(), "0", "corral top's status after {key}");
        let _ = tmux(&["kill-session", "-t", &session]);
    }
}

/// The fleet view is best effort and never costs the cache its Redis: a
/// heartbeat due while Redis cannot be reached is not sent, so it does not
/// count toward the breaker (here one failure opens it for a minute, and a
/// heartbeat that counted would keep the instance from Redis and from the
/// fleet view for that minute). Once Redis is back, the heartbeat lists
/// the instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_never_opens_the_redis_breaker() {
    let mut redis = Redis::start().await;
    redis.kill();
    let origin = Origin::new().route("/a", cacheable("a")).start().await;
    let config = Config::new()
        .route(Route::new("api", origin.url()))
        .redis(&redis.url())
        .redis_field("breaker", "{ failures: 1, open_for: 60s }");
    let proxy = Proxy::new(config).without_waiting_for_redis().start().await;
    // Heartbeats are due 0.5 s after the start and every 2 s: a window in
    // which the first two come while Redis is down (there is no event for
    // a request that is not made).
    tokio::time::sleep(Duration::from_millis(2_700)).await;
    let metrics = scrape(&proxy).await;
    assert_eq!(
        metrics.sum("corral_redis_breaker_opened_total", &[]),
        0.0,
        "a heartbeat counted toward the breaker"
    );
    redis.restart().await;
    // Its heartbeat reaches Redis, and the fleet view reads it back.
    corral_tests::shared::wait_for_key(&redis, "corral:{fleet}:i:*", DEADLINE).await;
    assert_eq!(redis.keys("corral:{fleet}:i:*").await.len(), 1);
    let fleet = stats(&proxy, "/stats?fleet=1").await;
    assert_eq!(fleet["source"], "redis");
    assert_eq!(fleet["instances"].as_array().map(Vec::len), Some(1));
    assert_eq!(fleet["instances"][0]["redis"]["link"], "connected");
    assert_eq!(
        scrape(&proxy)
            .await
            .sum("corral_redis_breaker_opened_total", &[]),
        0.0
    );
}
