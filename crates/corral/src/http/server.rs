//! The client-facing listener: hyper's HTTP/1.1 and h2c on one port, every
//! connection under the deadlines and the connection limit of
//! `connection.rs`, a bound on the request head (the handler answers 431
//! past `server.max_header_size`, hyper 400 to a malformed request), and a
//! graceful drain on shutdown.

use std::sync::Arc;

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

/// What every listener shares: the proxy's handler, the connection limits, the
/// hyper builder and the one connection limit (the slots); the TLS
/// certificate files are watched from here on.
struct Shared {
    proxy: proxy::Proxy,
    limits: Limits,
    builder: connection::Protocols,
    slots: Arc<tokio::sync::Semaphore>,
}

fn shared(
    app: Arc<App>,
    config: &ServerConfig,
    max_connections: usize,
    tls: Option<&Arc<crate::http::tls::ListenerTls>>,
) -> Shared {
    let proxy = proxy::Proxy(app);
    let limits = Limits {
        header_read_timeout: config.header_read_timeout,
        idle_timeout: config.idle_timeout,
        send_timeout: config.send_timeout,
        min_send_rate: config.min_send_rate,
        max_connections,
        proxy_protocol: config.listen_proxy_protocol,
        shed_when_overloaded: config.overload.is_some(),
        h1_buffer: usize::try_from(config.max_header_size.max(HYPER_BUF)).unwrap_or(usize::MAX),
        per_peer: 0,
        refuse_when_full: false,
    };
    let builder = connection::protocols(
        &limits,
        config.max_header_size,
        config.max_header_size.max(HYPER_BUF),
    );
    if let Some(tls) = tls {
        tls.spawn_watch();
    }
    Shared {
        proxy,
        limits,
        builder,
        slots: Arc::new(tokio::sync::Semaphore::new(max_connections)),
    }
}

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
    let s = shared(
        app,
        config,
        max_connections,
        tls_listener.as_ref().map(|(_, tls)| tls),
    );
    let serving = connection::Serving {
        protocols: s.builder,
        limits: s.limits,
        shutdown,
        grace: config.shutdown_grace,
        slots: s.slots,
    };
    serve_listeners(listener, tls_listener, s.proxy, serving).await;
}

/// The plain listener and the TLS one (if any) of one runtime.
async fn serve_listeners(
    listener: TcpListener,
    tls_listener: Option<(TcpListener, Arc<crate::http::tls::ListenerTls>)>,
    proxy: proxy::Proxy,
    serving: connection::Serving,
) {
    let plain = connection::serve_on("client", listener, proxy.clone(), serving.clone(), None);
    match tls_listener {
        None => plain.await,
        Some((tls_listener, tls)) => {
            let secure =
                connection::serve_on("client-tls", tls_listener, proxy, serving, Some(tls));
            tokio::join!(plain, secure);
        }
    }
}

/// `server.runtime: per_core`: one thread per pair of sockets, each with a
/// current-thread runtime that accepts on its own sockets and serves each
/// connection from accept to close, so a connection's work never moves
/// between cores. They share the process's cache, flights, Redis link
/// and connection limit. Returns when every thread has drained.
pub async fn serve_per_core(
    listeners: Vec<(std::net::TcpListener, Option<std::net::TcpListener>)>,
    tls: Option<Arc<crate::http::tls::ListenerTls>>,
    app: Arc<App>,
    config: &ServerConfig,
    max_connections: usize,
    shutdown: watch::Receiver<bool>,
) {
    let Shared {
        proxy,
        limits,
        builder,
        slots,
    } = shared(app, config, max_connections, tls.as_ref());
    let mut done = Vec::new();
    for (worker, (plain, secure)) in listeners.into_iter().enumerate() {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        done.push(rx);
        let (proxy, builder, shutdown, slots, tls) = (
            proxy.clone(),
            builder.clone(),
            shutdown.clone(),
            Arc::clone(&slots),
            tls.clone(),
        );
        let grace = config.shutdown_grace;
        let spawned = std::thread::Builder::new()
            .name(format!("corral-worker-{worker}"))
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::error!(worker, error = %e, "cannot start a worker's runtime");
                        return;
                    }
                };
                runtime.block_on(async move {
                    let registered = TcpListener::from_std(plain).and_then(|p| {
                        let s = match (secure, tls) {
                            (Some(s), Some(tls)) => Some((TcpListener::from_std(s)?, tls)),
                            _ => None,
                        };
                        Ok((p, s))
                    });
                    match registered {
                        Ok((plain, secure)) => {
                            tracing::debug!(worker, "worker accepting");
                            crate::telemetry::metrics::worker_started(worker);
                            crate::overload::serving_here();
                            let serving = connection::Serving {
                                protocols: builder,
                                limits,
                                shutdown,
                                grace,
                                slots,
                            };
                            serve_listeners(plain, secure, proxy, serving).await;
                        }
                        Err(e) => {
                            tracing::error!(worker, error = %e, "a worker cannot use its listener")
                        }
                    }
                });
                let _ = tx.send(());
            });
        if let Err(e) = spawned {
            tracing::error!(worker, error = %e, "cannot start a worker thread");
        }
    }
    for rx in done {
        let _ = rx.await;
    }
}
