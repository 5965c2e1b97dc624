//! The admin listener: liveness (`/healthz`), readiness (`/readyz`, which
//! reports Redis but is not failed by it: corral serves without Redis),
//! load-balancer health (`/lb-health`, 503 from the moment a drain starts)
//! Prometheus `/metrics`, the purge API (`POST /purge`, see purge.rs), and
//! the operator's live view: the page (`/`, its script and style embedded
//! in the binary) and the figures it reads every second (`/stats`, and
//! `/stats?fleet=1` for every instance sharing the Redis; see stats.rs).
//! It never shares a port with client traffic. The probes may also have a
//! listener of their own (`health_listen`, [`serve_health`]).
//!
//! On loopback (the default) anyone on the host may read the live view,
//! as `/metrics`, unless an admin token of its own is set. Listening
//! anywhere else, or with `server.admin_token` (`CORRAL_ADMIN_TOKEN`) set,
//! `/`, its assets and `/stats` need the admin token (else, off loopback,
//! the purge token), as a bearer token or as the password of HTTP Basic
//! (which a browser asks for); with no token at all they are refused.
//! `/metrics` needs the admin token when it is the instance's own.
//!
//! Everything but the probes answers only a Host that is an IP literal,
//! `localhost` or a listed name (DNS rebinding), and no one address may
//! hold more than its share of the connections (see [`serve`]): the
//! probes must stay answerable whoever else reaches the port.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::app::App;
use crate::ops::{AdminState, json_line};

pub fn router(state: Arc<AdminState>) -> Router {
    let mut views = Router::new()
        .route("/metrics", get(metrics))
        .route("/purge", axum::routing::post(crate::ops::purge::handle))
        .route("/", get(page))
        .route("/live.js", get(script))
        .route("/live.css", get(style))
        .route("/stats", get(stats))
        .route("/history", get(history));
    if state.app.test_clock.is_some() {
        views = views.route("/test/clock", axum::routing::post(move_clock));
    }
    let views = views.route_layer(axum::middleware::from_fn_with_state(
        Arc::clone(&state),
        named_host,
    ));
    probes().merge(views).with_state(state)
}

/// `POST /test/clock?advance_ms=N`, served only with `CORRAL_TEST_CLOCK=1`:
/// moves the cache's clock N ms forward, so that an end-to-end test lets
/// a TTL run out without sleeping. Answers how far ahead it now is.
async fn move_clock(
    State(s): State<Arc<AdminState>>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> impl IntoResponse {
    let Some(clock) = &s.app.test_clock else {
        return (StatusCode::NOT_FOUND, String::new());
    };
    let advance = query
        .as_deref()
        .and_then(|q| q.strip_prefix("advance_ms="))
        .and_then(|ms| ms.parse::<u64>().ok());
    match advance {
        Some(ms) => {
            clock.advance(std::time::Duration::from_millis(ms));
            (
                StatusCode::OK,
                format!("ahead_ms {}\n", clock.ahead().as_millis()),
            )
        }
        None => (
            StatusCode::BAD_REQUEST,
            "give ?advance_ms=N (milliseconds)\n".to_owned(),
        ),
    }
}

/// The health listener's endpoints: the probes and nothing else.
pub fn health_router(state: Arc<AdminState>) -> Router {
    probes().with_state(state)
}

/// Liveness, readiness and load-balancer health. They answer whatever
/// Host a request names: a load balancer's health check may name the
/// service, and what they tell is not private.
fn probes() -> Router<Arc<AdminState>> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/lb-health", get(lb_health))
}

/// Liveness: `ok`, with the instance's name (`corral-instance`, as the
/// fleet view names it), so that whoever checks knows which process
/// answered (a test, the one it started; an operator, the pod).
async fn healthz(State(s): State<Arc<AdminState>>) -> impl IntoResponse {
    ([("corral-instance", s.instance.clone())], "ok\n")
}

/// Refuses a request for a view, the metrics or a purge whose Host is
/// not one the admin listener answers for (see [`host_allowed`]): a page
/// an operator's browser loaded from elsewhere may have its name point at
/// this listener (DNS rebinding), and would then read it as its own.
async fn named_host(
    State(s): State<Arc<AdminState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let host = match req.headers().get(header::HOST) {
        // Unreadable bytes name no host it answers for.
        Some(v) => Some(v.to_str().unwrap_or("")),
        None => req.uri().authority().map(|a| a.as_str()),
    };
    if host_allowed(host, &s.admin_hosts) {
        return next.run(req).await;
    }
    (
        StatusCode::MISDIRECTED_REQUEST,
        [(header::X_CONTENT_TYPE_OPTIONS, "nosniff")],
        "the admin listener answers only for an IP address, localhost or a name in \
         server.admin_hosts: ask it by its address, or list the name you use\n",
    )
        .into_response()
}

/// Whether the admin listener answers for `host` (a Host field or an
/// authority, with or without its port): an IP literal, `localhost`, or a
/// name in `listed` (lower case, without a trailing dot). No Host at all
/// is let through: every browser sends one, so its absence is no page.
fn host_allowed(host: Option<&str>, listed: &[String]) -> bool {
    let Some(host) = host else {
        return true;
    };
    let port_ok = |p: &str| p.is_empty() || p.strip_prefix(':').is_some_and(digits);
    if let Some(rest) = host.strip_prefix('[') {
        return rest
            .split_once(']')
            .is_some_and(|(ip, port)| ip.parse::<std::net::Ipv6Addr>().is_ok() && port_ok(port));
    }
    let name = match host.rsplit_once(':') {
        Some((name, port)) if digits(port) => name,
        Some(_) => return false,
        None => host,
    };
    let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    !name.is_empty()
        && (name.parse::<std::net::Ipv4Addr>().is_ok()
            || name == "localhost"
            || listed.contains(&name))
}

fn digits(s: &str) -> bool {
    !s.is_empty() && s.len() <= 5 && s.bytes().all(|b| b.is_ascii_digit())
}

/// The live page and its assets, built into the binary.
const PAGE: &str = include_str!("../../assets/live.html");
const SCRIPT: &str = include_str!("../../assets/live.js");
const STYLE: &str = include_str!("../../assets/live.css");

/// Nothing but the page's own script, style and `/stats` may load: what
/// the page shows from the data path (keys, route names) is set as text,
/// and an injected tag could not run or call out anyway.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
    img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; \
    frame-ancestors 'none'";

/// Refuses a live-view request the listener's access rule does not let
/// through (see the module's notes).
fn refused(s: &AdminState, headers: &header::HeaderMap) -> Option<axum::response::Response> {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    match access(s.guarded, s.admin_token.as_deref(), given) {
        Access::Open => None,
        Access::NoToken => Some(
            (
                StatusCode::FORBIDDEN,
                "the admin listener is not on loopback: set server.admin_token \
                 (or CORRAL_ADMIN_TOKEN) to see the live view\n",
            )
                .into_response(),
        ),
        Access::Wrong => Some(
            (
                StatusCode::UNAUTHORIZED,
                [(
                    header::WWW_AUTHENTICATE,
                    "Basic realm=\"corral\", charset=\"UTF-8\"",
                )],
                "missing or wrong admin token\n",
            )
                .into_response(),
        ),
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Access {
    Open,
    /// Guarded, and no token to check against.
    NoToken,
    Wrong,
}

/// Whether the live view opens to a request whose Authorization field is
/// `given`: always when not `guarded`; otherwise only with `expected`.
fn access(guarded: bool, expected: Option<&str>, given: Option<&str>) -> Access {
    if !guarded {
        return Access::Open;
    }
    let Some(expected) = expected else {
        return Access::NoToken;
    };
    match given.and_then(presented_token) {
        Some(g) if crate::ops::purge::constant_time_eq(g.as_bytes(), expected.as_bytes()) => {
            Access::Open
        }
        _ => Access::Wrong,
    }
}

/// The token an Authorization field presents: a bearer token, or HTTP
/// Basic's password (any user name).
fn presented_token(value: &str) -> Option<String> {
    use base64::Engine;
    if let Some(t) = value.strip_prefix("Bearer ") {
        return Some(t.trim().to_owned());
    }
    let encoded = value.strip_prefix("Basic ")?;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let pair = String::from_utf8(decoded).ok()?;
    pair.split_once(':')
        .map(|(_, password)| password.to_owned())
}

fn asset(
    s: &AdminState,
    headers: &header::HeaderMap,
    content_type: &'static str,
    body: &'static str,
) -> axum::response::Response {
    if let Some(r) = refused(s, headers) {
        return r;
    }
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
}

async fn page(State(s): State<Arc<AdminState>>, headers: header::HeaderMap) -> impl IntoResponse {
    asset(&s, &headers, "text/html; charset=utf-8", PAGE)
}

async fn script(State(s): State<Arc<AdminState>>, headers: header::HeaderMap) -> impl IntoResponse {
    asset(&s, &headers, "text/javascript; charset=utf-8", SCRIPT)
}

async fn style(State(s): State<Arc<AdminState>>, headers: header::HeaderMap) -> impl IntoResponse {
    asset(&s, &headers, "text/css; charset=utf-8", STYLE)
}

#[derive(serde::Deserialize)]
struct StatsQuery {
    #[serde(default)]
    fleet: Option<String>,
}

/// `GET /stats`: this instance's summary; `?fleet=1`: every live
/// instance's and their totals.
async fn stats(
    State(s): State<Arc<AdminState>>,
    headers: header::HeaderMap,
    axum::extract::Query(q): axum::extract::Query<StatsQuery>,
) -> axum::response::Response {
    if let Some(r) = refused(&s, &headers) {
        return r;
    }
    let own = summary(&s);
    let body = match q.fleet.as_deref() {
        None | Some("0") => json_line(&own),
        Some(_) => json_line(&fleet(&s, own).await),
    };
    (
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
}

/// `GET /history`: this instance's readings of the last 15 minutes,
/// under the same access rule as `/stats`.
async fn history(
    State(s): State<Arc<AdminState>>,
    headers: header::HeaderMap,
) -> axum::response::Response {
    if let Some(r) = refused(&s, &headers) {
        return r;
    }
    let recent = crate::ops::history::Recent {
        instance: s.instance.clone(),
        every_s: crate::ops::history::EVERY.as_secs(),
        points: s.history.points(),
    };
    (
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        json_line(&recent),
    )
        .into_response()
}

/// This instance's summary now.
pub fn summary(s: &AdminState) -> crate::ops::stats::Summary {
    let text = crate::telemetry::metrics::render(&s.metrics, &gauges(&s.app));
    crate::ops::stats::summary(
        &text,
        &crate::ops::stats::Live {
            app: &s.app,
            instance: &s.instance,
            listen: &s.listen,
            uptime_s: s.started.elapsed().as_secs(),
            guarded: s.guarded,
        },
    )
}

/// Every instance whose heartbeat is live in Redis (this one's summary
/// always fresh); this one alone without Redis, or when it fails. A view
/// anyone may read (not `guarded`) leaves out the instances whose own
/// view needs a token: what they guard is not shown by their neighbour,
/// only counted (`withheld`).
async fn fleet(s: &AdminState, own: crate::ops::stats::Summary) -> crate::ops::stats::Fleet {
    use crate::ops::stats::{Fleet, Summary};
    let Some(l2) = &s.app.l2 else {
        return Fleet::of("local", vec![own]);
    };
    match l2.fleet().await {
        Err(e) => {
            tracing::debug!(error = %e, "fleet view: Redis did not answer; this instance only");
            Fleet::of("local", vec![own])
        }
        Ok(None) => Fleet::of("local", vec![own]),
        Ok(Some(beats)) => {
            let (mut all, withheld): (Vec<Summary>, Vec<Summary>) = beats
                .iter()
                .filter_map(|b| serde_json::from_str::<Summary>(b).ok())
                .filter(|other| other.instance != own.instance)
                .partition(|other| s.guarded || !other.guarded);
            all.push(own);
            all.sort_by(|a, b| a.instance.cmp(&b.instance));
            let mut fleet = Fleet::of("redis", all);
            fleet.withheld = withheld.len();
            fleet
        }
    }
}

/// `/readyz`'s body, fields in this order.
#[derive(serde::Serialize)]
struct Ready<'a> {
    ready: bool,
    draining: bool,
    routes: usize,
    redis: &'a str,
    /// `node`, `cluster`, `sentinel` or `off`.
    redis_mode: &'a str,
}

async fn readyz(State(s): State<Arc<AdminState>>) -> impl IntoResponse {
    let redis = s.app.l2.as_ref().map_or("off", |l2| l2.link.status());
    let redis_mode = s.app.l2.as_ref().map_or("off", |l2| l2.link.mode());
    let draining = s.draining.load(Ordering::Acquire);
    let status = if draining {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    let body = json_line(&Ready {
        ready: !draining,
        draining,
        routes: s.app.routes().len(),
        redis,
        redis_mode,
    });
    (status, [(header::CONTENT_TYPE, "application/json")], body)
}

async fn lb_health(State(s): State<Arc<AdminState>>) -> impl IntoResponse {
    if s.draining.load(Ordering::Acquire) {
        (StatusCode::SERVICE_UNAVAILABLE, "draining\n")
    } else {
        (StatusCode::OK, "ok\n")
    }
}

/// `GET /metrics`: open, as scrapers expect, unless the instance has an
/// admin token of its own; then only to it (a bearer token, as
/// Prometheus' `authorization` sends it, or HTTP Basic's password).
async fn metrics(
    State(s): State<Arc<AdminState>>,
    headers: header::HeaderMap,
) -> axum::response::Response {
    if let Some(token) = s.metrics_token.as_deref() {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if access(true, Some(token), given) != Access::Open {
            return (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer realm=\"corral\"")],
                "missing or wrong admin token: /metrics needs server.admin_token \
                 (or CORRAL_ADMIN_TOKEN) as a bearer token\n",
            )
                .into_response();
        }
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        crate::telemetry::metrics::render(&s.metrics, &gauges(&s.app)),
    )
        .into_response()
}

/// The point-in-time state the metrics export.
fn gauges(app: &App) -> crate::telemetry::metrics::Gauges {
    app.cache.l1.sync();
    crate::telemetry::metrics::Gauges {
        l1_entries: app.cache.l1.entry_count(),
        l1_bytes: app.cache.l1.weighted_size(),
        l1_side_bytes: app.cache.l1.side_weighted_size(),
        l1_limit_bytes: app.cache.l1.capacity(),
        fill_buffer_bytes: app.cache.fill_memory.used(),
        fill_memory_limit_bytes: app.cache.fill_memory.limit(),
        post_buffer_bytes: app.post_memory.used(),
        ahead_buffer_bytes: app.cache.ahead_memory.used(),
        backoff_keys: app.cache.l1.backoff_keys(),
        circuits: app
            .routes()
            .iter()
            .map(|r| (r.name.clone(), r.origin.circuit.is_open()))
            .collect(),
        sealed_bodies: crate::sealed::live(),
        sealed_bytes: crate::sealed::live_bytes(),
        flights: app.cache.flights.len(),
        redis: app.l2.as_ref().map(|l2| {
            let (open, opened) = l2.link.breaker_state();
            (open, opened, l2.link.is_answering())
        }),
    }
}

/// Connections the admin listener serves at once: scrapers, health checks
/// and operators, never client traffic. Past it a connection is closed at
/// once, never queued behind the ones served.
const ADMIN_CONNECTIONS: usize = 64;
/// Connections the health listener (`health_listen`) serves at once.
const HEALTH_CONNECTIONS: usize = 32;
/// Connections one address may hold on the admin or health listener: a
/// scraper, a prober and an operator's views need a few each; whoever
/// opens more takes nothing from the others.
pub const CONNECTIONS_PER_PEER: usize = 8;
/// The first request head (and each next one on HTTP/1) must come within
/// this of the accept (or of the last answer), or the connection closes;
/// shorter than the client listener's, since nothing slow has a reason
/// to be here. `server.header_read_timeout` applies when it is shorter.
pub const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// The admin and health listeners' deadlines and limits, from the
/// client listener's `server` settings, with their own connection limit.
fn limits(
    server: &crate::config::ServerConfig,
    max_connections: usize,
) -> crate::http::connection::Limits {
    crate::http::connection::Limits {
        header_read_timeout: server.header_read_timeout.min(HEADER_READ_TIMEOUT),
        idle_timeout: server.idle_timeout,
        send_timeout: server.send_timeout,
        min_send_rate: server.min_send_rate,
        max_connections,
        proxy_protocol: false,
        shed_when_overloaded: false,
        h1_buffer: 0,
        per_peer: CONNECTIONS_PER_PEER,
        refuse_when_full: true,
    }
}

/// Serves the admin endpoints under the same deadlines as client traffic
/// (an idle or silent socket is closed) but a shorter head deadline, with
/// their own small limit shared out by peer address.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AdminState>,
    server: &crate::config::ServerConfig,
    shutdown: watch::Receiver<bool>,
) {
    let admin = AdminListener {
        name: "admin",
        routes: router(state),
        connections: ADMIN_CONNECTIONS,
    };
    serve_as(admin, listener, server, shutdown).await;
}

/// Serves the probes alone on `health_listen`, with the admin listener's
/// rules and slots of its own: whoever can reach the admin listener, and
/// fills it, leaves this one to the probers.
pub async fn serve_health(
    listener: TcpListener,
    state: Arc<AdminState>,
    server: &crate::config::ServerConfig,
    shutdown: watch::Receiver<bool>,
) {
    let health = AdminListener {
        name: "health",
        routes: health_router(state),
        connections: HEALTH_CONNECTIONS,
    };
    serve_as(health, listener, server, shutdown).await;
}

/// One admin-side listener: its name, what it routes, and how many
/// connections it serves at once.
struct AdminListener {
    name: &'static str,
    routes: Router,
    connections: usize,
}

/// `listener` served as `what` under the admin listener's rules.
async fn serve_as(
    what: AdminListener,
    listener: TcpListener,
    server: &crate::config::ServerConfig,
    shutdown: watch::Receiver<bool>,
) {
    let AdminListener {
        name,
        routes,
        connections,
    } = what;
    let limits = limits(server, connections);
    let builder = crate::http::connection::protocols(&limits, 16 * 1024, 64 * 1024);
    crate::http::connection::serve(
        name,
        listener,
        routes,
        builder,
        limits,
        shutdown,
        server.shutdown_grace,
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "a-token-of-24-characters";

    #[test]
    fn the_live_view_opens_on_loopback_or_to_its_token() {
        assert_eq!(access(false, None, None), Access::Open);
        assert_eq!(access(false, Some(TOKEN), None), Access::Open);
        assert_eq!(access(true, None, Some("Bearer x")), Access::NoToken);
        assert_eq!(access(true, Some(TOKEN), None), Access::Wrong);
        let bearer = format!("Bearer {TOKEN}");
        assert_eq!(access(true, Some(TOKEN), Some(&bearer)), Access::Open);
        assert_eq!(
            access(true, Some(TOKEN), Some("Bearer a-token-of-24-characterz")),
            Access::Wrong
        );
        // HTTP Basic, as a browser sends it: any user, the token as password.
        use base64::Engine;
        let basic = |pair: &str| {
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(pair)
            )
        };
        assert_eq!(
            access(true, Some(TOKEN), Some(&basic(&format!("ops:{TOKEN}")))),
            Access::Open
        );
        assert_eq!(
            access(true, Some(TOKEN), Some(&basic(&format!(":{TOKEN}")))),
            Access::Open
        );
        assert_eq!(
            access(true, Some(TOKEN), Some(&basic(TOKEN))),
            Access::Wrong,
            "no colon: no password"
        );
        assert_eq!(access(true, Some(TOKEN), Some("Basic !!!")), Access::Wrong);
        assert_eq!(access(true, Some(TOKEN), Some(TOKEN)), Access::Wrong);
    }

    #[test]
    fn the_admin_listener_answers_for_ip_literals_localhost_and_listed_names() {
        let listed = vec!["corral-admin.ops.svc".to_owned()];
        let allowed = |h: &str| host_allowed(Some(h), &listed);
        for ok in [
            "127.0.0.1",
            "127.0.0.1:9080",
            "10.1.2.3:9080",
            "[::1]:9080",
            "[fe80::1]",
            "localhost",
            "LOCALHOST:9080",
            "localhost.:9080",
            "corral-admin.ops.svc:9080",
            "Corral-Admin.ops.svc.",
        ] {
            assert!(allowed(ok), "{ok} refused");
        }
        for refused in [
            "attacker.example",
            "attacker.example:9080",
            "127.0.0.1.attacker.example",
            "localhost.attacker.example",
            "corral-admin.ops.svc.attacker.example",
            "[::1",
            "[not-an-ip]:9080",
            "127.0.0.1:x",
            "",
            ":9080",
            "2130706433",
        ] {
            assert!(!allowed(refused), "{refused:?} let through");
        }
        assert!(host_allowed(None, &[]), "no Host: not a browser");
    }
}
