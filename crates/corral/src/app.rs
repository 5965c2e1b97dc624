//! What every request handler shares: the route table, L1, the flights and,
//! when Redis is configured, L2; and the three seams the miss path runs
//! through (the clock, the transport to the origin, the shared tier),
//! which unit tests replace.

use std::sync::Arc;

use arc_swap::ArcSwap;
use corral_core::{Budget, Flights, L1, L1Config, SystemClock};

use crate::cache::Cache;
use crate::cluster::l2::L2;
use crate::cluster::protocol::ClusterNotice;
use crate::cluster::tier::SharedTier;
use crate::config::Config;
use crate::routes::RouteTable;

/// The running proxy's state.
pub struct App {
    /// Swapped whole on reload; a request keeps the table it started with.
    routes: ArcSwap<RouteTable>,
    /// The miss path's state: L1, the flights, the shared tier, and the
    /// seams it runs through (clock, transport).
    pub cache: Arc<Cache>,
    /// Redis, for the operations surface (purge, readiness, metrics).
    pub l2: Option<Arc<L2>>,
    /// What coalesced POST bodies may hold at once (`cache.post_memory`).
    pub post_memory: Arc<Budget>,
    /// `server.max_header_size`: a larger request head is answered 431.
    pub max_header_size: u64,
    /// The clock an end-to-end test moves (`CORRAL_TEST_CLOCK=1`); `None`
    /// in service.
    pub test_clock: Option<Arc<corral_core::ShiftedClock>>,
    /// `server.trusted_proxies` of the running configuration: swapped on
    /// reload, so that an entry removed from the file (its proxy gone)
    /// stops being trusted at once.
    trust: ArcSwap<Trust>,
    /// The rate limits' counters.
    pub limiter: crate::limits::Limiter,
    /// `upstream_concurrency` slots by route, kept across reloads.
    slots: crate::origin::slots::SlotRegistry,
    /// Redis as the limits and slots reach it, with `redis.instances`.
    counters: Option<(
        Arc<crate::cluster::redis_link::RedisLink>,
        crate::cluster::protocol::Layout,
        u32,
    )>,
}

/// The trust list, and per entry the count of requests it vouched for.
pub struct Trust {
    pub proxies: corral_core::callers::client_addr::TrustedProxies,
    pub vouched: Vec<metrics::Counter>,
    /// `callers.account`: where accounts come from (key files included).
    pub accounts: Arc<corral_core::callers::caller::AccountSources>,
}

impl Trust {
    fn new(config: &Config) -> Self {
        Trust {
            proxies: config.server.trusted_proxies.clone(),
            vouched: crate::telemetry::metrics::trusted_proxy_counters(
                &config.server.trusted_proxies,
            ),
            accounts: Arc::clone(&config.callers.account),
        }
    }
}

impl App {
    /// Builds the state; with Redis configured, starts connecting to it in
    /// the background (so it must run inside the runtime).
    /// With `CORRAL_TEST_CLOCK=1` in its environment, its clock is one an
    /// end-to-end test moves forward through the admin listener.
    pub fn new(config: &Config) -> Result<Self, redis::RedisError> {
        if std::env::var_os("CORRAL_TEST_CLOCK").is_some_and(|v| v == "1") {
            tracing::warn!(
                "CORRAL_TEST_CLOCK=1: the cache's clock moves forward on POST /test/clock; for tests only"
            );
            let clock = Arc::new(corral_core::ShiftedClock::default());
            let mut app = App::on_clock(config, Arc::clone(&clock) as Arc<dyn corral_core::Clock>)?;
            app.test_clock = Some(clock);
            return Ok(app);
        }
        App::on_clock(config, Arc::new(SystemClock))
    }

    /// [`App::new`] with freshness, expiry, back-off and bans read from
    /// `clock`.
    fn on_clock(
        config: &Config,
        clock: Arc<dyn corral_core::Clock>,
    ) -> Result<Self, redis::RedisError> {
        let memory = L1Config {
            memory: config.cache.memory,
        };
        let l1 = Arc::new(L1::with_clock(&memory, Arc::clone(&clock)));
        let l2: Option<Arc<L2>> = match &config.redis {
            None => None,
            Some(rc) => {
                let l1 = Arc::clone(&l1);
                let on_notice = Box::new(move |notice: ClusterNotice| match notice {
                    ClusterNotice::All => l1.invalidate_all(),
                    ClusterNotice::Unverify => l1.unverify_all(),
                    ClusterNotice::Ban(ban) => l1.add_ban(ban),
                    ClusterNotice::Invalidate(uri) => l1.invalidate_uri_digest(uri),
                });
                crate::telemetry::metrics::register_redis();
                Some(L2::start(rc, on_notice)?)
            }
        };
        let tier = l2.clone().map(|l2| l2 as Arc<dyn SharedTier>);
        let counters = match (&l2, &config.redis) {
            (Some(l2), Some(rc)) => Some((
                Arc::clone(&l2.link),
                crate::cluster::protocol::Layout::new(&rc.key_prefix),
                rc.instances,
            )),
            _ => None,
        };
        let slots = crate::origin::slots::SlotRegistry::default();
        let routes = RouteTable::new(
            config,
            &crate::routes::RouteShared {
                redis: counters.clone(),
                slots: &slots,
            },
        );
        Ok(App {
            limiter: crate::limits::Limiter::new(
                config.callers.local_buckets,
                counters
                    .as_ref()
                    .map(|(link, layout, _)| (Arc::clone(link), layout.clone())),
                counters.as_ref().map_or(1, |c| c.2),
            ),
            slots,
            counters,
            routes: ArcSwap::from_pointee(routes),
            cache: Arc::new(Cache {
                l1,
                flights: Flights::new(),
                tier,
                transport: Arc::new(crate::origin::exchange::Network),
                clock,
                fill_memory: Budget::new(config.cache.fill_memory),
                ahead_memory: Budget::new(config.cache.fill_memory),
                fills: Arc::new(tokio::sync::Semaphore::new(config.cache.max_fills)),
                resync: crate::cache::resync::Pacer::new(
                    config.redis.as_ref().map_or(1, |rc| rc.resync_rate),
                ),
                cpu: crate::cache::cpu::CpuPool::new(
                    config
                        .server
                        .cpu_threads
                        .unwrap_or_else(crate::cache::cpu::CpuPool::default_threads),
                ),
                making: crate::cache::cpu::Making::default(),
            }),
            l2,
            post_memory: Budget::new(config.cache.post_memory),
            max_header_size: config.server.max_header_size,
            test_clock: None,
            trust: ArcSwap::from_pointee(Trust::new(config)),
        })
    }
}

impl App {
    /// The state with other seams: unit tests drive the miss path against
    /// a scripted transport, an in-memory shared tier and a paused clock.
    #[cfg(test)]
    pub fn with_seams(
        config: &Config,
        transport: Arc<dyn crate::origin::exchange::Transport>,
        tier: Option<Arc<dyn SharedTier>>,
        clock: Arc<dyn corral_core::Clock>,
    ) -> Self {
        let config = Config {
            redis: None,
            ..config.clone()
        };
        let mut app = App::on_clock(&config, clock).expect("no Redis to connect to");
        let cache = Arc::get_mut(&mut app.cache).expect("not shared yet");
        cache.transport = transport;
        cache.tier = tier;
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
        self.routes.store(Arc::new(RouteTable::new(
            config,
            &crate::routes::RouteShared {
                redis: self.counters.clone(),
                slots: &self.slots,
            },
        )));
        self.slots.keep_only(
            config
                .routes
                .iter()
                .filter(|r| r.upstream_concurrency.is_some())
                .map(|r| r.name.as_str()),
        );
        // Always swapped: the account key files were read anew.
        self.trust.store(Arc::new(Trust::new(config)));
    }
}
