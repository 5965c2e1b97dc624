//! What every request handler shares: the route table, L1, the flights and,
//! when Redis is configured, L2.

use std::sync::Arc;

use arc_swap::ArcSwap;
use corral_core::{Budget, Flights, L1, L1Config};

use crate::cache::fill::FillOutcome;
use crate::cluster::l2::L2;
use crate::cluster::protocol::ClusterNotice;
use crate::config::Config;
use crate::routes::RouteTable;

/// The running proxy's state.
pub struct App {
    /// Swapped whole on reload; a request keeps the table it started with.
    routes: ArcSwap<RouteTable>,
    pub l1: Arc<L1>,
    pub flights: Flights<FillOutcome>,
    pub l2: Option<Arc<L2>>,
    /// What fills may buffer at once (`cache.fill_memory`).
    pub fill_memory: Arc<Budget>,
    /// Fills under way in this instance (`cache.max_fills`).
    pub fills: Arc<tokio::sync::Semaphore>,
    /// `server.max_header_size`: a larger request head is answered 431.
    pub max_header_size: u64,
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
                let on_notice = Box::new(move |notice: ClusterNotice| match notice {
                    ClusterNotice::All => l1.invalidate_all(),
                    ClusterNotice::Ban(ban) => l1.bans.add(ban),
                    ClusterNotice::Invalidate(uri) => l1.invalidate_uri_digest(uri),
                });
                Some(L2::start(rc, on_notice)?)
            }
        };
        Ok(App {
            routes: ArcSwap::from_pointee(RouteTable::new(config)),
            l1,
            flights: Flights::new(),
            l2,
            fill_memory: Budget::new(config.cache.fill_memory),
            fills: Arc::new(tokio::sync::Semaphore::new(config.cache.max_fills)),
            max_header_size: config.server.max_header_size,
        })
    }
}

impl App {
    /// The route table in force now.
    pub fn routes(&self) -> Arc<RouteTable> {
        self.routes.load_full()
    }

    /// Installs the routes of a new, already validated configuration.
    pub fn replace_routes(&self, config: &Config) {
        self.routes.store(Arc::new(RouteTable::new(config)));
    }
}
