//! The HTTP front end and the origin client: listeners and the life of a
//! client connection (`server`, `connection`, `client_stream`), the one
//! request handler (`proxy`), and the requests corral sends the origin
//! (`request`, `upstream`). Uses `cache` for GET/HEAD and `ops` for the
//! invalidations an unsafe method causes.

pub mod client_stream;
pub mod connection;
pub mod proxy;
pub mod request;
pub mod server;
pub mod upstream;
