//! The miss path: lookup, fresh / stale answers, the local flight
//! (`cache_path`), the fill that fetches and stores (`fill`) through the
//! origin's one exchange (`fetch`), the shared
//! tier's lease and L2 use (`shared_flight`, through `cluster`), the
//! answers built from what was found (`respond`), and what a write or a
//! purge retires (`invalidate`).

pub mod cache_path;
pub mod fetch;
pub mod fill;
pub mod growing;
pub mod invalidate;
pub mod respond;
pub mod shared_flight;

#[cfg(test)]
mod tests;
