//! The HTTP front end: listeners and the life of a client connection
//! (`server`, `connection` with its watchdog's `on_wake`, `client_stream`, `peer_cap`; HTTP/1.1's GET and HEAD
//! without a body served by `h1`, the rest of HTTP/1 by hyper, HTTP/2 by
//! `http2` over the h2 crate; the origin's 1xx answers are written under
//! `h1` and hyper by `origin::interim`, and sent on each HTTP/2 stream by
//! `http2`) and the one request handler
//! (`proxy`), which names each request (`request_id`), with the rate limits that spare hits handed to the cache
//! path (`gate`) and the answers to their refusals (`refusal`). Uses `cache` for GET/HEAD and `origin` to pass everything
//! else through.

pub mod client_stream;
pub mod connection;
pub mod gate;
pub mod h1;
pub mod http2;
pub mod on_wake;
pub mod peer_cap;
pub mod proxy;
pub mod refusal;
pub mod request_id;
pub mod server;
pub mod tls;
