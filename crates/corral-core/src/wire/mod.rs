//! Wire formats corral reads or writes that are not HTTP fields: the L2 envelope, body digests, GraphQL operations, the PROXY protocol header.

pub mod digest;
pub mod envelope;
pub mod graphql;
pub mod proxy_protocol;
