//! The admin listener: liveness (`/healthz`), readiness (`/readyz`, which
//! reports Redis but is not failed by it: corral serves without Redis),
//! load-balancer health (`/lb-health`, 503 from the moment a drain starts)
//! Prometheus `/metrics` and the purge API (`POST /purge`, see purge.rs). It never shares a port with client traffic.

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
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/lb-health", get(lb_health))
        .route("/metrics", get(metrics))
        .route("/purge", axum::routing::post(crate::ops::purge::handle))
        .with_state(state)
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

async fn metrics(State(s): State<Arc<AdminState>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        crate::telemetry::metrics::render(&s.metrics, &gauges(&s.app)),
    )
}

/// The point-in-time state the metrics export.
fn gauges(app: &App) -> crate::telemetry::metrics::Gauges {
    app.cache.l1.sync();
    crate::telemetry::metrics::Gauges {
        l1_entries: app.cache.l1.entry_count(),
        l1_bytes: app.cache.l1.weighted_size(),
        l1_side_bytes: app.cache.l1.side_weighted_size(),
        fill_buffer_bytes: app.cache.fill_memory.used(),
        post_buffer_bytes: app.post_memory.used(),
        ahead_buffer_bytes: app.cache.ahead_memory.used(),
        backoff_keys: app.cache.l1.backoff_keys(),
        circuits: app
            .routes()
            .iter()
            .map(|r| (r.name.clone(), r.circuit.is_open()))
            .collect(),
        sealed_bodies: crate::sealed::live(),
        sealed_bytes: crate::sealed::live_bytes(),
        flights: app.cache.flights.len(),
        redis: app.l2.as_ref().map(|l2| {
            let (open, opened) = l2.link.breaker_state();
            (open, opened, l2.link.is_connected())
        }),
    }
}

/// Connections the admin listener serves at once: scrapers, health checks
/// and operators, never client traffic.
const ADMIN_CONNECTIONS: usize = 64;

/// Serves the admin endpoints under the same deadlines as client traffic
/// (an idle or silent socket is closed), with their own small limit.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AdminState>,
    server: &crate::config::ServerConfig,
    shutdown: watch::Receiver<bool>,
) {
    let limits = crate::http::connection::Limits {
        header_read_timeout: server.header_read_timeout,
        idle_timeout: server.idle_timeout,
        send_timeout: server.send_timeout,
        min_send_rate: server.min_send_rate,
        max_connections: ADMIN_CONNECTIONS,
        proxy_protocol: false,
        shed_when_overloaded: false,
        h1_buffer: 0,
    };
    let builder = crate::http::connection::builder(&limits, 16 * 1024, 64 * 1024);
    crate::http::connection::serve(
        "admin",
        listener,
        router(state),
        builder,
        limits,
        shutdown,
        server.shutdown_grace,
    )
    .await;
}
