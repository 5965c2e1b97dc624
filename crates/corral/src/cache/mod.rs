//! The miss path: lookup, fresh / stale answers, the local flight
//! (`cache_path`), the fill that fetches and stores (`fill`) through the
//! origin's one exchange (`fetch`), the shared
//! tier's lease and L2 use (`shared_flight`, through `cluster`), the
//! answers built from what was found (`respond`), and what a write or a
//! purge retires (`invalidate`).

use std::sync::Arc;

use corral_core::{Budget, Clock, Flights, L1};

use crate::cache::fill::FillOutcome;
use crate::cluster::tier::SharedTier;
use crate::origin::exchange::Transport;

/// What the miss path owns and every request's fill shares: the running
/// process lends it nothing else, so nothing under `cache/` names the
/// process's state.
pub struct Cache {
    pub l1: Arc<L1>,
    pub flights: Flights<FillOutcome>,
    /// Redis as the miss path reaches it.
    pub tier: Option<Arc<dyn SharedTier>>,
    /// What fills reach the origin over.
    pub transport: Arc<dyn Transport>,
    /// Where freshness, back-off and stale windows read "now".
    pub clock: Arc<dyn Clock>,
    /// What fills may buffer at once (`cache.fill_memory`).
    pub fill_memory: Arc<Budget>,
    /// What passed-through bodies may be read ahead of their clients at
    /// once (as much as `cache.fill_memory`, a budget of its own).
    pub ahead_memory: Arc<Budget>,
    /// Fills under way in this instance (`cache.max_fills`).
    pub fills: Arc<tokio::sync::Semaphore>,
}

pub mod exchange;
pub mod fill;
pub mod flight;
pub mod gate;
pub mod growing;
pub mod invalidate;
pub mod lookup;
pub mod outcome;
pub mod respond;
pub mod shared;

#[cfg(test)]
mod tests;
