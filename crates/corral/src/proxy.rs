//! The front end's one handler: match a route, then send GET/HEAD through
//! the cache and every other method straight through to the upstream. An
//! unsafe method answered 2xx/3xx invalidates the stored GET for its URI
//! and for same-origin Location / Content-Location (RFC 9111 §4.4).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{ConnectInfo, State};
use corral_core::{CacheStatus, Forward, PrimaryKey, UriKey};
use http::header::{CONTENT_LOCATION, HOST, LOCATION, RANGE, UPGRADE};
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri};
use http_body::Body as _;
use tokio::time::Instant;

use crate::access_log::{self, AccessLine};
use crate::app::App;
use crate::cache_path;
use crate::hop_by_hop;
use crate::metrics;
use crate::request::{RequestCtx, upstream_request};
use crate::respond;
use crate::routes::Route;
use crate::upstream::DeadlineBody;

pub async fn handle(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request<Body>,
) -> Response<Body> {
    let started = Instant::now();
    let method = req.method().clone();
    // Copied only for the access line, and only when one is written.
    let path = access_log::enabled().then(|| req.uri().path().to_owned());
    let (route, res) = route_request(app, peer, req).await;
    let route_name = route.as_ref().map_or("-", |r| r.name.as_str());
    let cache = cache_result(&res);
    match &route {
        Some(r) => r.requests.count(&method, cache),
        None => metrics::unrouted(&method, cache),
    }
    // The access line: never the query (it may carry tokens), never a
    // credential header.
    let Some(path) = path else {
        return res;
    };
    access_log::log(&AccessLine {
        route: route_name,
        method: method.as_str(),
        path: &path,
        status: res.status().as_u16(),
        cache,
        cache_status: res
            .headers()
            .get(&respond::CACHE_STATUS)
            .and_then(|v| v.to_str().ok())
            .unwrap_or(""),
        ms: started.elapsed().as_secs_f64() * 1000.0,
        peer: peer.ip(),
    });
    res
}

/// The `cache` label of a finished answer, read from its Cache-Status.
fn cache_result(res: &Response<Body>) -> &'static str {
    let Some(st) = res
        .headers()
        .get(&respond::CACHE_STATUS)
        .and_then(|v| v.to_str().ok())
    else {
        return "error";
    };
    if st.contains("; hit") {
        "hit"
    } else if st.contains("collapsed") {
        "collapsed"
    } else if st.contains("fwd=stale") && !st.contains("fwd-status=") || st.contains("detail=stale")
    {
        "stale"
    } else if res.status().is_server_error() && st.contains("detail=") {
        "error"
    } else if st.contains("fwd=bypass") || st.contains("fwd=request") || !st.contains("stored") {
        "pass"
    } else {
        "miss"
    }
}

async fn route_request(
    app: Arc<App>,
    peer: SocketAddr,
    req: Request<Body>,
) -> (Option<Arc<Route>>, Response<Body>) {
    let (parts, body) = req.into_parts();
    if head_size(&parts) > app.max_header_size {
        return (
            None,
            respond::error(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                Forward::Bypass,
                "request-head-too-large",
                None,
            ),
        );
    }
    let Some(host) = request_host(&parts.headers, &parts.uri) else {
        return (
            None,
            respond::error(StatusCode::BAD_REQUEST, Forward::Bypass, "bad-host", None),
        );
    };
    let ctx = RequestCtx {
        method: parts.method,
        version: parts.version,
        host,
        path: parts.uri.path().to_owned(),
        query: parts.uri.query().map(str::to_owned),
        headers: parts.headers,
        peer: peer.ip(),
    };
    // The route table of this moment: a reload does not change the route a
    // request in flight started with.
    let Some(route) = app.routes().find(&ctx.host, &ctx.path).cloned() else {
        return (
            None,
            respond::error(StatusCode::NOT_FOUND, Forward::Bypass, "no-route", None),
        );
    };
    let cacheable_method = ctx.method == Method::GET || ctx.method == Method::HEAD;
    if cacheable_method
        && route.cache_enabled
        && !ctx.headers.contains_key(RANGE)
        && !ctx.headers.contains_key(UPGRADE)
    {
        let res = cache_path::serve(Arc::clone(&app), Arc::clone(&route), ctx).await;
        return (Some(route), res);
    }
    let fwd = if route.cache_enabled && !cacheable_method {
        Forward::Request
    } else {
        Forward::Bypass
    };
    let res = forward_uncached(&app, &route, &ctx, body, fwd).await;
    (Some(route), res)
}

/// Bytes of the request head as sent (request line and header fields).
fn head_size(parts: &http::request::Parts) -> u64 {
    let target = parts.uri.path_and_query().map_or(1, |pq| pq.as_str().len())
        + parts.uri.authority().map_or(0, |a| a.as_str().len());
    let line = parts.method.as_str().len() + target + 12;
    let fields: usize = parts
        .headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len() + 4)
        .sum();
    (line + fields) as u64
}

/// The Host the client asked for: the Host field, else the URI's authority.
/// `None` when it is not valid text.
fn request_host(headers: &HeaderMap, uri: &Uri) -> Option<String> {
    match headers.get(HOST) {
        Some(h) => h.to_str().ok().map(str::to_ascii_lowercase),
        None => Some(
            uri.authority()
                .map(|a| a.as_str().to_ascii_lowercase())
                .unwrap_or_default(),
        ),
    }
}

/// Streams a request through to the upstream and the answer back.
async fn forward_uncached(
    app: &App,
    route: &Route,
    ctx: &RequestCtx,
    body: Body,
    fwd: Forward,
) -> Response<Body> {
    let deadline = Instant::now() + route.upstream.total;
    let bodyless = body.size_hint().exact() == Some(0);
    let req = match upstream_request(route, ctx, ctx.method.clone(), ctx.headers.clone(), body) {
        Ok(r) => r,
        Err(e) => return respond::error(StatusCode::BAD_REQUEST, fwd, e.detail(), None),
    };
    let res = match route.upstream.send(req, bodyless, deadline).await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(route = %route.name, upstream = %route.authority, error = %e, "upstream failed");
            return respond::error(e.status(), fwd, e.detail(), None);
        }
    };
    let (mut parts, body) = res.into_parts();
    if !ctx.method.is_safe() && (parts.status.is_success() || parts.status.is_redirection()) {
        invalidate(app, route, ctx, &parts.headers).await;
    }
    hop_by_hop::strip(&mut parts.headers);
    let st = CacheStatus::forward(fwd).with_fwd_status(parts.status.as_u16());
    respond::decorate(&mut parts.headers, &st, ctx.version);
    Response::from_parts(
        parts,
        Body::new(DeadlineBody::new(body, deadline, route.upstream.total)),
    )
}

/// Retires the URI here and, with Redis, on every instance. Redis trouble
/// is logged, not answered: the client's write already succeeded.
pub(crate) async fn invalidate_everywhere(app: &App, route_name: &str, uri: UriKey) {
    app.l1.invalidate_uri(&uri);
    if let Some(l2) = &app.l2 {
        let primary = PrimaryKey::new(route_name, uri.clone());
        let result = l2.invalidate(&primary, &uri).await;
        tracing::debug!(key = %primary.loggable(), ok = result.is_ok(), "cluster-wide invalidation");
        if let Err(e) = result {
            tracing::warn!(key = %primary.loggable(), error = %e, "cluster-wide invalidation failed; other instances keep their copy until it expires");
        }
    }
}

async fn invalidate(app: &App, route: &Route, ctx: &RequestCtx, response: &HeaderMap) {
    let uri = UriKey::new(
        &ctx.host,
        &ctx.path,
        ctx.query.as_deref(),
        &route.query_filter,
    );
    invalidate_everywhere(app, &route.name, uri).await;
    for name in [LOCATION, CONTENT_LOCATION] {
        let Some(target) = response.get(&name).and_then(|v| v.to_str().ok()) else {
            continue;
        };
        let Ok(uri) = target.parse::<Uri>() else {
            continue;
        };
        // Only the same origin: a response must not evict another site's
        // entries (RFC 9111 §4.4).
        let same_origin = uri
            .authority()
            .is_none_or(|a| a.as_str().eq_ignore_ascii_case(&ctx.host));
        if !same_origin || !uri.path().starts_with('/') {
            continue;
        }
        let routes = app.routes();
        let target = routes
            .find(&ctx.host, uri.path())
            .map_or(route, |r| r.as_ref());
        let key = UriKey::new(&ctx.host, uri.path(), uri.query(), &target.query_filter);
        invalidate_everywhere(app, &target.name, key).await;
    }
}
