//! The client-facing listener: hyper's HTTP/1.1 and h2c on one port, every
//! connection under the deadlines and the connection limit of
//! `connection.rs`, a bound on the request head (the handler answers 431
//! past `server.max_header_size`, hyper 400 to a malformed request), and a
//! graceful drain on shutdown.

use std::sync::Arc;

use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::app::App;
use crate::config::ServerConfig;
use crate::http::connection::{self, Limits};
use crate::http::proxy;

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
    tls_listener: Option<(TcpListener, Arc<crate::http::tls::ListenerTls>)>,
    app: Arc<App>,
    config: &ServerConfig,
    max_connections: usize,
    shutdown: watch::Receiver<bool>,
) {
    let router = Router::new().fallback(proxy::handle).with_state(app);
    let limits = Limits {
        header_read_timeout: config.header_read_timeout,
        idle_timeout: config.idle_timeout,
        send_timeout: config.send_timeout,
        max_connections,
        proxy_protocol: config.listen_proxy_protocol,
    };
    let builder = connection::builder(
        &limits,
        config.max_header_size,
        config.max_header_size.max(HYPER_BUF),
    );
    // One connection limit for both listeners.
    let slots = Arc::new(tokio::sync::Semaphore::new(max_connections));
    let plain = connection::serve_on(
        "client",
        listener,
        router.clone(),
        builder.clone(),
        limits,
        shutdown.clone(),
        config.shutdown_grace,
        Arc::clone(&slots),
        None,
    );
    match tls_listener {
        None => plain.await,
        Some((tls_listener, tls)) => {
            tls.spawn_watch();
            let secure = connection::serve_on(
                "client-tls",
                tls_listener,
                router,
                builder,
                limits,
                shutdown,
                config.shutdown_grace,
                slots,
                Some(tls),
            );
            tokio::join!(plain, secure);
        }
    }
}
