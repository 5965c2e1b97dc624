//! What every request handler shares: the route table, L1, the flights and,
//! when Redis is configured, L2; and the three seams the miss path runs
//! through (the clock, the origin, the shared tier), which unit tests
//! replace.

use std::sync::Arc;

use arc_swap::ArcSwap;
use corral_core::{Budget, Clock, Flights, L1, L1Config, SystemClock};

use crate::cache::fetch::UpstreamOrigin;
use crate::cache::fill::{FillOutcome, Origin};
use crate::cluster::l2::L2;
use crate::cluster::protocol::ClusterNotice;
use crate::cluster::tier::SharedTier;
use crate::config::Config;
use crate::routes::RouteTable;

/// The running proxy's state.
pub struct App {
    /// Swapped whole on reload; a request keeps the table it started with.
    routes: ArcSwap<RouteTable>,
    pub l1: Arc<L1>,
    pub flights: Flights<FillOutcome>,
    /// Redis, for the operations surface (purge, readiness, metrics).
    pub l2: Option<Arc<L2>>,
    /// Redis as the miss path reaches it.
    pub tier: Option<Arc<dyn SharedTier>>,
    /// Where fills fetch from.
    pub origin: Arc<dyn Origin>,
    /// Where freshness, back-off and stale windows read "now".
    pub clock: Arc<dyn Clock>,
    /// What fills may buffer at once (`cache.fill_memory`).
    pub fill_memory: Arc<Budget>,
    /// Fills under way in this instance (`cache.max_fills`).
    pub fills: Arc<tokio::sync::Semaphore>,
    /// `server.max_header_size`: a larger request head is answered 431.
    pub max_header_size: u64,
    /// `server.trusted_proxies` of the running configuration: swapped on
    /// reload, so that an entry removed from the file (its proxy gone)
    /// stops being trusted at once.
    trust: ArcSwap<Trust>,
}

/// The trust list, and per entry the count of requests it vouched for.
pub struct Trust {
    pub proxies: corral_core::client_addr::TrustedProxies,
    pub vouched: Vec<metrics::Counter>,
}

impl Trust {
    fn new(config: &Config) -> Self {
        Trust {
            proxies: config.server.trusted_proxies.clone(),
            vouched: crate::telemetry::metrics::trusted_proxy_counters(
                &config.server.trusted_proxies,
            ),
        }
    }
}

impl App {
    /// Builds the state; with Redis configured, starts connecting to it in
    /// the background (so it must run inside the runtime).
    pub fn new(config: &Config) -> Result<Self, redis::RedisError> {
        let l1 = Arc::new(L1::new(&L1Config {
            memory: config.cache.memory,
        }));
        let l2: Option<Arc<L2>> = match &config.redis {
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
        let tier = l2.clone().map(|l2| l2 as Arc<dyn SharedTier>);
        Ok(App {
            routes: ArcSwap::from_pointee(RouteTable::new(config)),
            l1,
            flights: Flights::new(),
            l2,
            tier,
            origin: Arc::new(UpstreamOrigin),
            clock: Arc::new(SystemClock),
            fill_memory: Budget::new(config.cache.fill_memory),
            fills: Arc::new(tokio::sync::Semaphore::new(config.cache.max_fills)),
            max_header_size: config.server.max_header_size,
            trust: ArcSwap::from_pointee(Trust::new(config)),
        })
    }
}

impl App {
    /// The state with other seams: unit tests drive the miss path against
    /// a scripted origin, an in-memory shared tier and a paused clock.
    #[cfg(test)]
    pub fn with_seams(
        config: &Config,
        origin: Arc<dyn Origin>,
        tier: Option<Arc<dyn SharedTier>>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        let mut app = App::new(&Config {
            redis: None,
            ..config.clone()
        })
        .expect("no Redis to connect to");
        app.origin = origin;
        app.tier = tier;
        app.clock = clock;
        app
    }

    /// The route table in force now.
    pub fn routes(&self) -> Arc<RouteTable> {
        self.routes.load_full()
    }

    /// The trust list of this moment.
    pub fn trust(&self) -> arc_swap::Guard<Arc<Trust>> {
        self.trust.load()
    }

    /// Installs the routes and the trust list of a new, already validated
    /// configuration.
    pub fn reload(&self, config: &Config) {
        self.routes.store(Arc::new(RouteTable::new(config)));
        if self.trust.load().proxies != config.server.trusted_proxies {
            self.trust.store(Arc::new(Trust::new(config)));
        }
    }
}
