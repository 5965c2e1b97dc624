//! The admin listener: health for now (metrics and purge come later). It
//! never shares a port with client traffic.

use axum::Router;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::sync::watch;

pub fn router() -> Router {
    Router::new().route("/healthz", get(|| async { "ok\n" }))
}

pub async fn serve(listener: TcpListener, mut shutdown: watch::Receiver<bool>) {
    let r = axum::serve(listener, router())
        .with_graceful_shutdown(async move {
            let _ = shutdown.changed().await;
        })
        .await;
    if let Err(e) = r {
        tracing::error!(error = %e, "admin listener failed");
    }
}
