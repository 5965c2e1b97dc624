//! The demo origin for load scenarios: every answer is shaped by its query
//! string, and it counts the requests it receives per path.
//!
//! `GET /any/path?delay=300&size=1024&max-age=60&swr=30&sie=600&status=200&vary=accept-encoding&etag=v1&tag=k7`
//! - `delay` milliseconds before answering; `size` body bytes; `trickle`
//!   milliseconds over which the body goes out in 20 even chunks (with its
//!   Content-Length), as a slow origin download would; the others
//!   become Cache-Control / Vary / ETag. With `tag`, the body is the tag
//!   and `;` repeated to `size` bytes (so a checking client can tell one
//!   key's body from another's); without it, `x` repeated.
//! - `GET /__hits?path=/any/path` → that path's request count; `GET /__hits` → the total.
//! - `GET /__stats?prefix=/a/` → `hits=N paths=M max=K` over the paths starting
//!   with the prefix: requests, distinct paths requested, most requests on one path
//!   (a cache that fetched every key once has hits == paths and max == 1).
//! - `POST /__outage?mode=503|slow|off` → every other request answers 503, or
//!   waits 30 s, until `off`.
//!
//! Usage: `demo-origin [ADDR]` (default 127.0.0.1:3000). Loopback only.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use http::{HeaderValue, Method, StatusCode};

#[derive(Default)]
struct Counters {
    total: AtomicU64,
    per_path: Mutex<HashMap<String, u64>>,
    /// 0 off, 1 answer 503, 2 slow.
    outage: AtomicU8,
}

fn query(req: &Request) -> HashMap<String, String> {
    req.uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|p| p.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

fn text(status: StatusCode, body: String) -> Response {
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = status;
    r
}

async fn handle(State(c): State<Arc<Counters>>, req: Request) -> Response {
    let q = query(&req);
    let path = req.uri().path().to_owned();
    if path == "/__hits" {
        let n = match q.get("path") {
            Some(p) => c
                .per_path
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(p)
                .copied()
                .unwrap_or(0),
            None => c.total.load(Ordering::Relaxed),
        };
        return text(StatusCode::OK, format!("{n}\n"));
    }
    if path == "/__stats" {
        let prefix = q.get("prefix").map_or("/", String::as_str);
        let (mut hits, mut paths, mut max) = (0u64, 0u64, 0u64);
        for (_, &n) in c
            .per_path
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(p, _)| p.starts_with(prefix))
        {
            hits += n;
            paths += 1;
            max = max.max(n);
        }
        return text(
            StatusCode::OK,
            format!("hits={hits} paths={paths} max={max}\n"),
        );
    }
    if path == "/__outage" && req.method() == Method::POST {
        let mode = match q.get("mode").map(String::as_str) {
            Some("503") => 1,
            Some("slow") => 2,
            _ => 0,
        };
        c.outage.store(mode, Ordering::Relaxed);
        return text(StatusCode::OK, "ok\n".into());
    }
    c.total.fetch_add(1, Ordering::Relaxed);
    *c.per_path
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .entry(path)
        .or_insert(0) += 1;
    match c.outage.load(Ordering::Relaxed) {
        1 => return text(StatusCode::SERVICE_UNAVAILABLE, "outage\n".into()),
        2 => tokio::time::sleep(Duration::from_secs(30)).await,
        _ => {}
    }
    let num = |k: &str| q.get(k).and_then(|v| v.parse::<u64>().ok());
    if let Some(ms) = num("delay") {
        tokio::time::sleep(Duration::from_millis(ms.min(60_000))).await;
    }
    let size = usize::try_from(num("size").unwrap_or(1024).min(64 << 20)).unwrap_or(1024);
    let status = num("status")
        .and_then(|s| u16::try_from(s).ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::OK);
    let mut cc = Vec::new();
    for (k, name) in [
        ("max-age", "max-age"),
        ("swr", "stale-while-revalidate"),
        ("sie", "stale-if-error"),
    ] {
        if let Some(v) = num(k) {
            cc.push(format!("{name}={v}"));
        }
    }
    let body = match q.get("tag") {
        Some(tag) => format!("{tag};").bytes().cycle().take(size).collect(),
        None => vec![b'x'; size],
    };
    let mut r = match num("trickle").filter(|ms| *ms > 0) {
        Some(ms) => trickled(body, Duration::from_millis(ms.min(60_000))),
        None => Response::new(Body::from(body)),
    };
    *r.status_mut() = status;
    let h = r.headers_mut();
    if !cc.is_empty()
        && let Ok(v) = HeaderValue::from_str(&cc.join(", "))
    {
        h.insert(http::header::CACHE_CONTROL, v);
    }
    if let Some(v) = q.get("vary").and_then(|v| HeaderValue::from_str(v).ok()) {
        h.insert(http::header::VARY, v);
    }
    if let Some(v) = q
        .get("etag")
        .and_then(|v| HeaderValue::from_str(&format!("\"{v}\"")).ok())
    {
        h.insert(http::header::ETAG, v);
    }
    r
}

/// `body` in 20 chunks spread over `over`, the first at once, with its
/// Content-Length (hyper sends a streamed body at the declared length).
fn trickled(body: Vec<u8>, over: Duration) -> Response {
    const CHUNKS: usize = 20;
    let len = body.len();
    let body = bytes::Bytes::from(body);
    let step = len.div_ceil(CHUNKS).max(1);
    let pause = over / CHUNKS as u32;
    let chunks = futures_util::stream::unfold(0usize, move |at| {
        let body = body.clone();
        async move {
            if at >= len {
                return None;
            }
            if at > 0 {
                tokio::time::sleep(pause).await;
            }
            let end = (at + step).min(len);
            Some((Ok::<_, std::io::Error>(body.slice(at..end)), end))
        }
    });
    let mut r = Response::new(Body::from_stream(chunks));
    r.headers_mut()
        .insert(http::header::CONTENT_LENGTH, HeaderValue::from(len));
    r
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let addr: SocketAddr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:3000".into())
        .parse()
        .map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("bad address: {e}"),
            )
        })?;
    if !addr.ip().is_loopback() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "demo-origin listens on loopback only",
        ));
    }
    let app = Router::new()
        .fallback(handle)
        .with_state(Arc::new(Counters::default()));
    let listener = tokio::net::TcpListener::bind(addr).await?;
    eprintln!("demo-origin on {addr}");
    axum::serve(listener, app).await
}
