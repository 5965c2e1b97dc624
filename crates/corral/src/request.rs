//! The client's request as the proxy sees it, and the request corral sends
//! upstream for it: hop-by-hop headers removed, `X-Forwarded-*` and `Via`
//! added, `Host` set to the upstream's (nginx's default).

use std::net::IpAddr;

use axum::body::Body;
use http::header::{HOST, HeaderName, VIA};
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Method, Request, Uri, Version};

use crate::hop_by_hop;
use crate::routes::Route;
use crate::upstream::UpstreamError;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// A client request, without its body.
#[derive(Debug, Clone)]
pub struct RequestCtx {
    pub method: Method,
    pub version: Version,
    /// Lowercased, as sent (may carry a port); empty when the client sent none.
    pub host: String,
    pub path: String,
    pub query: Option<String>,
    pub headers: HeaderMap,
    pub peer: IpAddr,
}

impl RequestCtx {
    pub fn path_and_query(&self) -> String {
        match &self.query {
            Some(q) => format!("{}?{q}", self.path),
            None => self.path.clone(),
        }
    }

    /// The `Via` token for this hop (RFC 9110 §7.6.3).
    pub fn via(&self) -> HeaderValue {
        via_value(self.version)
    }
}

pub fn via_value(version: Version) -> HeaderValue {
    HeaderValue::from_static(match version {
        Version::HTTP_09 => "0.9 corral",
        Version::HTTP_10 => "1.0 corral",
        Version::HTTP_2 => "2 corral",
        Version::HTTP_3 => "3 corral",
        _ => "1.1 corral",
    })
}

/// The request to send upstream for `ctx` on `route`, with `method`,
/// `headers` (the client's, possibly edited) and `body`.
pub fn upstream_request(
    route: &Route,
    ctx: &RequestCtx,
    method: Method,
    mut headers: HeaderMap,
    body: Body,
) -> Result<Request<Body>, UpstreamError> {
    hop_by_hop::strip(&mut headers);
    let peer = ctx.peer.to_string();
    let xff = match headers.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
        Some(prev) => format!("{prev}, {peer}"),
        None => peer,
    };
    let bad = |e: http::header::InvalidHeaderValue| UpstreamError::Request(e.to_string());
    headers.insert(
        X_FORWARDED_FOR.clone(),
        HeaderValue::from_str(&xff).map_err(bad)?,
    );
    headers.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static("http"));
    if !ctx.host.is_empty() {
        headers.insert(
            X_FORWARDED_HOST.clone(),
            HeaderValue::from_str(&ctx.host).map_err(bad)?,
        );
    }
    headers.append(VIA, ctx.via());
    headers.insert(
        HOST,
        HeaderValue::from_str(route.authority.as_str()).map_err(bad)?,
    );
    let pq = PathAndQuery::try_from(ctx.path_and_query())
        .map_err(|e| UpstreamError::Request(e.to_string()))?;
    let uri = Uri::builder()
        .scheme(route.scheme.clone())
        .authority(route.authority.clone())
        .path_and_query(pq)
        .build()
        .map_err(|e| UpstreamError::Request(e.to_string()))?;
    let mut req = Request::new(body);
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    Ok(req)
}
