//! What every request handler shares: the route table, L1 and the flights.

use corral_core::{Flights, L1, L1Config};

use crate::config::Config;
use crate::fill::FillOutcome;
use crate::routes::RouteTable;

/// The running proxy's state.
pub struct App {
    pub routes: RouteTable,
    pub l1: L1,
    pub flights: Flights<FillOutcome>,
}

impl App {
    pub fn new(config: &Config) -> Self {
        App {
            routes: RouteTable::new(config),
            l1: L1::new(&L1Config {
                memory: config.cache.memory,
            }),
            flights: Flights::new(),
        }
    }
}
