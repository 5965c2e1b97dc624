//! The client-facing listener: hyper's HTTP/1.1 and h2c on one port, a
//! header-read timeout against slowloris, a bound on the request head
//! (hyper answers 431 past it, 400 to a malformed request), and a graceful
//! drain on shutdown.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tower::ServiceExt;

use crate::app::App;
use crate::client_stream::ClientStream;
use crate::config::ServerConfig;
use crate::proxy;

/// hyper's one buffer bound covers both the request head it reads and the
/// response it writes; at the configured header limit (16 KiB by default)
/// it throttled large bodies (64 KiB hits ran ~10-40% slower with a worse
/// tail). hyper gets at least this much; the configured request-head limit
/// is enforced by the proxy handler instead (431), and hyper's own bound
/// still answers 431 past this.
const HYPER_BUF: u64 = 256 * 1024;

/// Serves proxy traffic on `listener` until `shutdown` turns true, then
/// lets in-flight requests finish within the configured grace.
pub async fn serve(
    listener: TcpListener,
    app: Arc<App>,
    config: &ServerConfig,
    mut shutdown: watch::Receiver<bool>,
) {
    let router = Router::new().fallback(proxy::handle).with_state(app);
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(config.header_read_timeout)
        .max_buf_size(usize::try_from(config.max_header_size.max(HYPER_BUF)).unwrap_or(usize::MAX))
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(config.max_header_size).unwrap_or(u32::MAX));
    let graceful = GracefulShutdown::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of descriptors and the like: back off a little
                        // instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let svc = router.clone().map_request(move |mut req: http::Request<Incoming>| {
                    req.extensions_mut().insert(ConnectInfo::<SocketAddr>(peer));
                    req.map(axum::body::Body::new)
                });
                let conn = builder
                    .serve_connection(TokioIo::new(ClientStream::new(stream)), TowerToHyperService::new(svc))
                    .into_owned();
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(%peer, error = %e, "client connection ended with an error");
                    }
                });
            }
            _ = shutdown.changed() => break,
        }
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => tracing::info!("all client connections drained"),
        _ = tokio::time::sleep(config.shutdown_grace) => {
            tracing::warn!(grace = ?config.shutdown_grace, "shutdown grace elapsed with connections still open");
        }
    }
}
