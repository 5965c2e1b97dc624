//! The route table: which upstream and which cache policy a request gets.
//! A route matches on host (optional) and path prefix; the longest prefix
//! wins, and a route naming the host beats one that does not.
//!
//! The route (and so the policy: caching, limits, identity) is chosen on
//! the form of the request no origin can tell apart: the path case-folded
//! (unless the route says `match.case_sensitive`), and the host without
//! one trailing dot. Many origins route `/API/login` as `/api/login` and
//! resolve `ex.test.` as `ex.test`; choosing on the exact form would let a
//! client pick a laxer route's policy for the same resource. The exact
//! path stays in the key and the upstream target.

use std::sync::Arc;
use std::time::Duration;

use corral_core::{IdentityRules, QueryFilter, RoutePolicy};
use http::header::HeaderName;
use http::uri::{Authority, Scheme};

use crate::config::{Config, OnTimeout, RouteConfig};
use crate::origin::upstream::{Upstream, UpstreamSpec};

const CDN_CACHE_CONTROL: &str = "cdn-cache-control";

/// One route, ready to serve: its match, and the policy each layer reads,
/// apart (linkerd2-proxy's layers each take the one `Param` they need):
/// the edge's ([`EdgeParams`]), the cache's ([`CacheParams`]), the
/// flight's ([`CoalesceParams`]) and the origin's ([`OriginParams`]).
pub struct Route {
    pub name: String,
    host: Option<String>,
    prefix: String,
    /// `match.case_sensitive`: the prefix is compared as written.
    case_sensitive: bool,
    pub edge: EdgeParams,
    pub cache: CacheParams,
    pub coalesce: CoalesceParams,
    pub origin: OriginParams,
}

/// What the request handler reads of a route before the cache: how the
/// head is passed on, what is counted, what is limited.
pub struct EdgeParams {
    /// `underscores_in_headers`: fields named with `_` reach the origin.
    pub underscores_in_headers: bool,
    pub requests: crate::telemetry::metrics::RequestCounters,
    /// `limits:`, checked before the cache (those that count hits) and
    /// before a fetch (those that spare them).
    pub limits: crate::limits::RouteLimits,
}

/// What the lookup and the store read of a route: keys and freshness.
pub struct CacheParams {
    /// `cache.enabled`.
    pub enabled: bool,
    pub policy: RoutePolicy,
    pub query_filter: QueryFilter,
    /// `cache.no_vary_search`: keys leave out what the path's learned
    /// No-Vary-Search rule says does not matter.
    pub no_vary_search: bool,
    /// `compression:`: stored answers are kept compressed too, and the
    /// origin is asked for the unencoded one.
    pub compression: Option<crate::config::CompressionConfig>,
    pub identity: IdentityRules,
}

/// What the flight (and the shared tier's wait) read of a route.
pub struct CoalesceParams {
    /// `coalesce.enabled`.
    pub enabled: bool,
    pub lock_timeout: Duration,
    pub on_timeout: OnTimeout,
    /// Callers one flight holds waiting (`coalesce.max_waiters`).
    pub max_waiters: usize,
    /// `coalesce.lock_age`.
    pub lock_age: Option<Duration>,
    /// `coalesce.post.max_body`: POSTs up to this size are coalesced.
    pub post_max_body: Option<u64>,
    /// `coalesce.post.read_timeout`.
    pub post_read_timeout: Duration,
}

/// What the gate and the exchange read of a route: the origin, and when
/// it is left alone.
pub struct OriginParams {
    /// Fills under way on this route (`coalesce.max_fills`).
    pub fills: Arc<tokio::sync::Semaphore>,
    /// How long a key whose origin failed is left alone.
    pub backoff: corral_core::BackoffPolicy,
    /// Stops fills to an origin that fails most of them.
    pub circuit: corral_core::Circuit,
    pub upstream: Upstream,
}

/// What routes share with the running process: Redis (for
/// `upstream_concurrency` across instances, with `redis.instances`) and
/// the slots that outlive a reload.
pub struct RouteShared<'a> {
    pub redis: Option<(
        Arc<crate::cluster::redis_link::RedisLink>,
        crate::cluster::protocol::Layout,
        u32,
    )>,
    pub slots: &'a crate::origin::slots::SlotRegistry,
}

impl Route {
    /// Removes the targeted fields that address corral alone (RFC 9213):
    /// every configured one but CDN-Cache-Control, which addresses every
    /// CDN on the way and is passed on. Cache-Control always stays, for
    /// the caches downstream.
    pub fn strip_own_fields(&self, headers: &mut http::HeaderMap) {
        for name in &self.cache.policy.targeted {
            if name != CDN_CACHE_CONTROL {
                headers.remove(name);
            }
        }
    }

    /// True when [`Route::strip_own_fields`] would take anything off
    /// `headers`.
    pub fn strips_own_fields_of(&self, headers: &http::HeaderMap) -> bool {
        self.cache
            .policy
            .targeted
            .iter()
            .any(|name| name != CDN_CACHE_CONTROL && headers.contains_key(name))
    }

    fn from_config(
        rc: &RouteConfig,
        max_object_size: u64,
        global_limits: &[crate::config::LimitConfig],
        shared: &RouteShared<'_>,
    ) -> Self {
        let c = &rc.cache;
        let policy = policy_of(c, max_object_size);
        let identity_headers = c
            .identity_headers
            .iter()
            .filter_map(|h| HeaderName::from_bytes(h.as_bytes()).ok())
            .collect();
        Route {
            name: rc.name.clone(),
            host: rc.host.as_ref().map(|h| h.to_ascii_lowercase()),
            prefix: rc.path_prefix.clone(),
            case_sensitive: rc.case_sensitive,
            edge: EdgeParams {
                underscores_in_headers: rc.underscores_in_headers,
                requests: crate::telemetry::metrics::RequestCounters::new(&rc.name),
                limits: crate::limits::RouteLimits::new(&rc.name, &rc.limits, global_limits),
            },
            cache: CacheParams {
                enabled: c.enabled,
                policy,
                query_filter: QueryFilter::new(&c.ignore_query).sorted(c.sort_query),
                no_vary_search: c.no_vary_search,
                compression: rc.compression.clone(),
                identity: IdentityRules::new(identity_headers, c.identity_cookies.clone()),
            },
            coalesce: CoalesceParams {
                enabled: rc.coalesce.enabled,
                lock_timeout: rc.coalesce.lock_timeout,
                on_timeout: rc.coalesce.on_timeout,
                max_waiters: rc.coalesce.max_waiters,
                lock_age: rc.coalesce.lock_age,
                post_max_body: rc.coalesce.post_max_body,
                post_read_timeout: rc.coalesce.post_read_timeout,
            },
            origin: origin_of(rc, shared),
        }
    }

    /// `host` without its trailing dot.
    fn matches(&self, host: &str, path: &str) -> bool {
        let host_ok = match &self.host {
            None => true,
            Some(h) => h == host,
        };
        host_ok && self.prefix_of(path)
    }

    /// True when `path` starts with the route's prefix: in ASCII case-
    /// folded form unless the route is case-sensitive. The normal form of
    /// a path ([`corral_core::semantics::path::normalize`]) leaves only ASCII, with
    /// unreserved characters decoded, so folding its bytes folds letters.
    fn prefix_of(&self, path: &str) -> bool {
        if self.case_sensitive {
            return path.starts_with(&self.prefix);
        }
        path.as_bytes()
            .get(..self.prefix.len())
            .is_some_and(|head| head.eq_ignore_ascii_case(self.prefix.as_bytes()))
    }
}

/// All routes of one configuration.
pub struct RouteTable {
    routes: Vec<Arc<Route>>,
}

impl RouteTable {
    pub fn new(config: &Config, shared: &RouteShared<'_>) -> Self {
        RouteTable {
            routes: config
                .routes
                .iter()
                .map(|r| {
                    let route = Arc::new(Route::from_config(
                        r,
                        config.cache.max_object_size,
                        &config.limits,
                        shared,
                    ));
                    if let Some(path) = &r.health.check_path {
                        route.origin.upstream.spawn_checks(
                            route.origin.upstream.scheme.clone(),
                            path.clone(),
                            r.health.check_interval,
                        );
                    }
                    route
                })
                .collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.routes.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Route>> {
        self.routes.iter()
    }

    /// The route for a request to `host` (a validated, lowercased host name
    /// without port) and `path` (in its normal form). A fully qualified
    /// host (`ex.test.`) names the same site as `ex.test`.
    pub fn find(&self, host: &str, path: &str) -> Option<&Arc<Route>> {
        let host = host.strip_suffix('.').unwrap_or(host);
        self.routes
            .iter()
            .filter(|r| r.matches(host, path))
            .max_by_key(|r| (r.prefix.len(), r.host.is_some()))
    }
}

/// What a route's fills to its origin are: its upstream, fill slots,
/// back-off and circuit.
fn origin_of(rc: &RouteConfig, shared: &RouteShared<'_>) -> OriginParams {
    let scheme = rc.upstream.scheme().cloned().unwrap_or(Scheme::HTTP);
    // The config loader refuses an upstream without a host.
    let authority = rc
        .upstream
        .authority()
        .cloned()
        .unwrap_or_else(|| Authority::from_static("127.0.0.1"));
    OriginParams {
        fills: Arc::new(tokio::sync::Semaphore::new(rc.coalesce.max_fills)),
        backoff: rc.backoff,
        circuit: corral_core::Circuit::named(
            corral_core::CircuitSettings {
                enabled: rc.circuit.enabled,
                error_rate: rc.circuit.error_rate,
                min_fetches: rc.circuit.min_fetches,
                window: rc.circuit.window,
                open_for: rc.circuit.open_for,
            },
            &rc.name,
            authority.as_str(),
        ),
        upstream: Upstream::new(UpstreamSpec {
            route: &rc.name,
            scheme,
            authority,
            timeouts: &rc.timeouts,
            pool: Arc::new(crate::origin::pool::Pool::new(
                &rc.name,
                rc.upstreams
                    .iter()
                    .filter_map(|u| u.authority().cloned())
                    .collect(),
                rc.balance,
                rc.health.max_fails,
                rc.health.fail_timeout,
            )),
            tls: rc.tls.as_ref(),
            http2: rc.upstream_http2,
            slots: rc.upstream_concurrency.map(|max| {
                shared.slots.get(
                    &rc.name,
                    max,
                    rc.upstream_queue_timeout,
                    rc.timeouts.total,
                    shared.redis.clone(),
                )
            }),
            queue_timeout: rc.upstream_queue_timeout,
        }),
    }
}

/// The caching policy a route's `cache:` section gives corral-core.
fn policy_of(c: &crate::config::RouteCacheConfig, max_object_size: u64) -> RoutePolicy {
    RoutePolicy {
        default_ttl: c.default_ttl,
        heuristic_freshness: c.heuristic_freshness,
        swr_default: c.stale_while_revalidate.default,
        swr_max: c.stale_while_revalidate.max,
        sie_default: c.stale_if_error.default,
        sie_max: c.stale_if_error.max,
        stale_max_ratio: c.stale_max_ratio,
        ttl_jitter_percent: c.ttl_jitter,
        early_refresh_beta: c.early_refresh_beta,
        store_set_cookie: c.store_set_cookie,
        max_object_size,
        hit_for_pass: c.hit_for_pass,
        targeted: c
            .targeted_fields
            .iter()
            .filter_map(|h| HeaderName::from_bytes(h.as_bytes()).ok())
            .collect(),
        store_post: c.post,
    }
}
