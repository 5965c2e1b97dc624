//! HTTP semantics: the fields and rules of RFC 9110/9111 and the drafts corral implements (Cache-Control, Cache-Status and Proxy-Status, content codings, Vary and No-Vary-Search, ranges, the request head and its HTTP/1.1 parser, structured fields).

pub(crate) mod cache_control;
pub mod cache_status;
pub(crate) mod coding;
pub mod h1;
pub mod head;
pub mod hop_by_hop;
pub(crate) mod no_vary_search;
pub mod path;
pub mod range;
pub mod rfc9111;
pub(crate) mod sf;
pub(crate) mod vary;
