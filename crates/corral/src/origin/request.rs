//! The request corral sends upstream for a validated [`RequestHead`]: built
//! from the head, not copied from the client. Framing (Content-Length,
//! Transfer-Encoding) is written only beside the body corral actually
//! sends; `X-Forwarded-*` and `Via` are corral's own.

use axum::body::Body;
use corral_core::semantics::head::{RequestBody, RequestHead};
use http::header::{
    CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE, EXPECT, HOST, HeaderName, TRANSFER_ENCODING,
    VIA,
};
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Method, Request, Uri, Version};
use http_body::Body as _;

use crate::origin::upstream::{Upstream, UpstreamError};

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Whether `body` carries content, and how it is framed.
pub fn body_of(body: &Body) -> RequestBody {
    if body.is_end_stream() {
        return RequestBody::None;
    }
    match body.size_hint().exact() {
        Some(0) => RequestBody::None,
        Some(n) => RequestBody::Sized(n),
        None => RequestBody::Streamed,
    }
}

pub fn via_value(version: Version) -> HeaderValue {
    HeaderValue::from_static(match version {
        Version::HTTP_09 => "0.9 corral",
        Version::HTTP_10 => "1.0 corral",
        Version::HTTP_2 => "2 corral",
        Version::HTTP_3 => "3 corral",
        _ => corral_core::VIA_1_1,
    })
}

/// The request corral sends upstream for `head` to the upstream at
/// `upstream` (the route's: its scheme and authority): `method`,
/// `target` (path and query), `headers` (the head's end-to-end headers,
/// possibly edited) and `body`, framed by `framing`. With no body, no
/// header describing one is sent.
pub fn upstream_request(
    upstream: &Upstream,
    head: &RequestHead,
    method: Method,
    target: &str,
    mut headers: HeaderMap,
    body: Body,
    framing: RequestBody,
) -> Result<Request<Body>, UpstreamError> {
    let bad = |e: http::header::InvalidHeaderValue| UpstreamError::Request(e.to_string());
    headers.insert(
        X_FORWARDED_FOR.clone(),
        match &head.forwarded_for {
            Some(chain) => HeaderValue::from_str(chain),
            None => HeaderValue::from_str(&head.peer.to_string()),
        }
        .map_err(bad)?,
    );
    headers.insert(
        X_FORWARDED_PROTO.clone(),
        HeaderValue::from_static(if head.tls { "https" } else { "http" }),
    );
    if head.host.is_empty() {
        headers.remove(&X_FORWARDED_HOST);
    } else {
        headers.insert(
            X_FORWARDED_HOST.clone(),
            HeaderValue::from_str(&head.host).map_err(bad)?,
        );
    }
    // The client's own id, when corral kept it, is this same value.
    if let Some(id) = &head.request_id {
        headers.insert(
            corral_core::semantics::head::X_REQUEST_ID.clone(),
            id.to_value(),
        );
    }
    headers.append(VIA, via_value(head.version));
    headers.insert(
        HOST,
        HeaderValue::from_str(upstream.authority.as_str()).map_err(bad)?,
    );
    // Framing is corral's, for the body it sends: hyper writes
    // Content-Length for a sized body; a streamed one is chunked.
    headers.remove(CONTENT_LENGTH);
    headers.remove(TRANSFER_ENCODING);
    headers.remove(EXPECT);
    match framing {
        RequestBody::None => {
            headers.remove(CONTENT_TYPE);
            headers.remove(CONTENT_ENCODING);
        }
        RequestBody::Sized(n) => {
            headers.insert(CONTENT_LENGTH, HeaderValue::from(n));
        }
        RequestBody::Streamed => {
            headers.insert(TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        }
    }
    let pq = PathAndQuery::try_from(target).map_err(|e| UpstreamError::Request(e.to_string()))?;
    let uri = Uri::builder()
        .scheme(upstream.scheme.clone())
        .authority(upstream.authority.clone())
        .path_and_query(pq)
        .build()
        .map_err(|e| UpstreamError::Request(e.to_string()))?;
    let mut req = Request::new(body);
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    Ok(req)
}
