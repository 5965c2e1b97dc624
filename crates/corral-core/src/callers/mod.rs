//! Callers and limits, which are not caching: who a caller is (client address, trusted proxies, JWT accounts, peer authentication) and the rate limits that count them.

pub mod caller;
pub mod client_addr;
pub mod peer_auth;
pub mod rate_limit;
