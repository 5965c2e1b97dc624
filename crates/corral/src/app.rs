//! What every request handler shares: the route table, L1, the flights and,
//! when Redis is configured, L2.

use std::sync::Arc;

use corral_core::{Digest, Flights, L1, L1Config};

use crate::config::Config;
use crate::fill::FillOutcome;
use crate::l2::L2;
use crate::routes::RouteTable;

/// The running proxy's state.
pub struct App {
    pub routes: RouteTable,
    pub l1: Arc<L1>,
    pub flights: Flights<FillOutcome>,
    pub l2: Option<Arc<L2>>,
}

impl App {
    /// Builds the state; with Redis configured, starts connecting to it in
    /// the background (so it must run inside the runtime).
    pub fn new(config: &Config) -> Result<Self, redis::RedisError> {
        let l1 = Arc::new(L1::new(&L1Config {
            memory: config.cache.memory,
        }));
        let l2 = match &config.redis {
            None => None,
            Some(rc) => {
                let l1 = Arc::clone(&l1);
                let on_invalidate = Box::new(move |hex: &str| {
                    if hex == crate::subscriber::ALL {
                        return l1.invalidate_all();
                    }
                    match Digest::from_hex(hex) {
                        Some(d) => l1.invalidate_uri_digest(d),
                        None => tracing::warn!(
                            payload = hex,
                            "ignoring a malformed invalidation notice"
                        ),
                    }
                });
                Some(L2::start(rc, on_invalidate)?)
            }
        };
        Ok(App {
            routes: RouteTable::new(config),
            l1,
            flights: Flights::new(),
            l2,
        })
    }
}
