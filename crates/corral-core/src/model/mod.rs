//! The cache model: keys, stored entries, the L1 store, freshness policy and the miss decisions, the flights registry, back-off, the circuit, bans and budgets, and the clock they read.

pub(crate) mod backoff;
pub(crate) mod ban;
pub(crate) mod budget;
pub(crate) mod circuit;
pub(crate) mod clock;
pub(crate) mod entry;
pub(crate) mod flights;
pub(crate) mod identity;
pub(crate) mod key;
pub(crate) mod l1;
pub mod miss;
pub(crate) mod policy;
pub mod xfetch;
