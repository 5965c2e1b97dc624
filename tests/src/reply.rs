//! What the scripted origin answers on a route: status, headers, body, delay.
//!
//! A reply is data plus, at most, a closure of the request; it never keeps
//! state of its own (the origin counts and records requests).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};

use crate::origin::SeenRequest;

/// How the body of a reply is produced.
#[derive(Clone)]
pub(crate) enum ReplyBody {
    /// The same bytes every time.
    Fixed(Bytes),
    /// The request's body, streamed back as it arrives.
    EchoRequestBody,
    /// Computed from the request's head (method, URI, headers).
    FromRequest(Arc<dyn Fn(&SeenRequest) -> String + Send + Sync>),
    /// `count` copies of `chunk`, one every `every`, chunked (no length).
    Trickle {
        chunk: Bytes,
        count: usize,
        every: Duration,
    },
}

/// A scripted answer of the origin.
#[derive(Clone)]
pub struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: Vec<(HeaderName, HeaderValue)>,
    pub(crate) body: ReplyBody,
    pub(crate) delay: Duration,
    /// Headers sent only to the requests their test accepts.
    pub(crate) conditional: Vec<ConditionalHeader>,
}

/// A response header sent when `when(request)` holds.
pub(crate) type ConditionalHeader = (
    HeaderName,
    HeaderValue,
    Arc<dyn Fn(&SeenRequest) -> bool + Send + Sync>,
);

impl Reply {
    /// 200 with a fixed body.
    pub fn ok(body: impl Into<Bytes>) -> Self {
        Self::status(200, body)
    }

    /// `code` with a fixed body.
    pub fn status(code: u16, body: impl Into<Bytes>) -> Self {
        Self {
            status: StatusCode::from_u16(code).expect("valid status code"),
            headers: Vec::new(),
            body: ReplyBody::Fixed(body.into()),
            delay: Duration::ZERO,
            conditional: Vec::new(),
        }
    }

    /// 200 whose body is the request body, streamed back.
    pub fn echo_body() -> Self {
        Self {
            body: ReplyBody::EchoRequestBody,
            ..Self::ok("")
        }
    }

    /// 200 whose body is `count` chunks of `chunk_size` bytes sent `every`
    /// apart, with no Content-Length (chunked): a slow body of a length
    /// nobody knows in advance.
    pub fn trickle(chunk_size: usize, count: usize, every: Duration) -> Self {
        Self {
            body: ReplyBody::Trickle {
                chunk: Bytes::from(vec![b't'; chunk_size]),
                count,
                every,
            },
            ..Self::ok("")
        }
    }

    /// 200 whose body is computed from the request head.
    pub fn from_request(f: impl Fn(&SeenRequest) -> String + Send + Sync + 'static) -> Self {
        Self {
            body: ReplyBody::FromRequest(Arc::new(f)),
            ..Self::ok("")
        }
    }

    /// 200 whose body is `{prefix}{value of request header name}` (empty
    /// value when the header is absent).
    pub fn echo_header(prefix: &str, name: &str) -> Self {
        let prefix = prefix.to_owned();
        let name = name.to_owned();
        Self::from_request(move |req| format!("{prefix}{}", req.header(&name).unwrap_or_default()))
    }

    /// Replaces the status code.
    pub fn with_status(mut self, code: u16) -> Self {
        self.status = StatusCode::from_u16(code).expect("valid status code");
        self
    }

    /// Adds a response header (repeatable).
    pub fn header(mut self, name: &str, value: &str) -> Self {
        let name = HeaderName::from_bytes(name.as_bytes()).expect("valid header name");
        let value = HeaderValue::from_str(value).expect("valid header value");
        self.headers.push((name, value));
        self
    }

    /// Adds a response header sent only to requests for which `when`
    /// holds (e.g. a `Set-Cookie` for callers that sent a Cookie).
    pub fn header_when(
        mut self,
        name: &str,
        value: &str,
        when: impl Fn(&SeenRequest) -> bool + Send + Sync + 'static,
    ) -> Self {
        let name = HeaderName::from_bytes(name.as_bytes()).expect("valid header name");
        let value = HeaderValue::from_str(value).expect("valid header value");
        self.conditional.push((name, value, Arc::new(when)));
        self
    }

    /// Waits this long after the request head arrived before answering.
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// The value of the first response header `name`, if scripted.
    pub fn header_value(&self, name: &str) -> Option<&HeaderValue> {
        self.headers
            .iter()
            .find(|(n, _)| n.as_str().eq_ignore_ascii_case(name))
            .map(|(_, v)| v)
    }
}

impl std::fmt::Debug for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let body = match &self.body {
            ReplyBody::Fixed(b) => format!("{b:?}"),
            ReplyBody::EchoRequestBody => "<echo request body>".to_owned(),
            ReplyBody::FromRequest(_) => "<from request>".to_owned(),
            ReplyBody::Trickle {
                chunk,
                count,
                every,
            } => {
                format!("<{count} x {} bytes every {every:?}>", chunk.len())
            }
        };
        f.debug_struct("Reply")
            .field("status", &self.status)
            .field("headers", &self.headers)
            .field("body", &body)
            .field("delay", &self.delay)
            .finish()
    }
}
