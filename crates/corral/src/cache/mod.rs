//! The miss path, as layers that each hold the one below and never call
//! back up:
//!
//! 1. `lookup`: keys, L1, `corral_core::model::miss` decisions, answers from a
//!    stored copy;
//! 2. `flight`: the key's flight in this process (join, lead, follow, the
//!    waiter cap, `on_timeout`, lock age), answering each waiter through
//!    `outcome`, over `driver`: the fill's own task, its events, and
//!    abandonment;
//! 3. `shared`: the lease state machine across instances, over
//!    `cluster::tier::SharedTier` (only with Redis), reading and writing
//!    L2's records through `records`, and relaying a growing body to the
//!    waiting instances (and from the leader's) through `relay`;
//! 4. `gate`: back-off, the circuit, fill slots;
//! 5. `exchange`: the request for a fill and the verdict on the origin's
//!    answer, over `origin::exchange`;
//! 6. `store`: the answer's body, streamed or read whole, and the entry
//!    stored in L1, over `fanout`: where a streamed body's chunks go (the
//!    unencoded body and each coding made as it arrives).
//!
//! Beneath them all: `synthetic` (the outcomes corral makes itself when the
//! origin is not asked or fails), `fill` (the vocabulary every layer
//! shares: the [`Cache`] state, what a fill is given — its job, and each
//! layer's parts of the cache and the route, the only way a layer reaches
//! them — and what it produces),
//! `respond` (answers from an entry, corral's errors) and `shared_body` (a
//! body readers share as it arrives). `rules` is the No-Vary-Search rule
//! learned per path that keys are made with. `invalidate` is what a write or a
//! purge retires. `cpu` is the bounded pool compression, decoding, digest
//! checks and large copies run on, off the serving threads; `demand` makes
//! a stored answer's coding when a caller first asks for it. The order is checked by `tests/tests/layers.rs`.

pub use fill::Cache;

pub mod compress;
pub mod cpu;
pub mod demand;
pub mod driver;
pub mod exchange;
pub mod fanout;
pub mod fill;
pub mod flight;
pub mod gate;
pub mod invalidate;
pub mod lookup;
pub mod outcome;
pub mod records;
pub mod relay;
pub mod respond;
pub mod resync;
pub mod rules;
pub mod shared;
pub mod shared_body;
pub mod store;
pub mod synthetic;

#[cfg(test)]
mod tests;
