//! Loads and validates corral's YAML config file into typed settings with defaults filled in.
//! A pure function of the file: no environment lookups, no DNS, no defaults from elsewhere.
//! Every refusal of the file's contents names its line, column and dotted field path.

mod duration;
mod error;
mod paths;
mod raw;
mod resolve;
mod size;
pub mod tls;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

pub use error::ConfigError;

/// Reads the config file at `path`, parses and validates it.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::unreadable(&file, &e))?;
    parse(&file, &text)
}

/// True when `text` is a duration of zero (`0`, `0s`, `0ms`): what
/// `corral proxy --ttl 0` means by "keep nothing without freshness".
pub fn is_zero_duration(text: &str) -> bool {
    text.trim() == "0" || duration::parse_duration(text).is_ok_and(|d| d.is_zero())
}

/// Parses and validates config `text`; `file_name` is only used in error messages.
pub fn parse(file_name: &str, text: &str) -> Result<Config, ConfigError> {
    let options = serde_saphyr::options! {
        with_snippet: false,
        // `enabled: no` should not silently mean false: only true/false are booleans.
        strict_booleans: true,
    };
    let raw = serde_saphyr::from_str_with_options(text, options)
        .map_err(|e| ConfigError::from_yaml(file_name, text, &e))?;
    resolve::resolve(file_name, text, raw)
}

/// How a route's pool chooses the next server (`balance`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balance {
    RoundRobin,
    /// The server with the fewest requests outstanding from this instance.
    LeastOutstanding,
}

/// A cheap content fingerprint (FNV-1a) of a file read at load or reload
/// (the configuration, a certificate and its key); only compared with
/// itself.
pub fn fingerprint(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The whole validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Address the proxy listens on for client traffic.
    pub listen: SocketAddr,
    /// A second client listener, with TLS (`listen_tls`).
    pub listen_tls: Option<ListenTls>,
    /// Address of the admin listener (metrics, health, purge); never the same as `listen`.
    pub admin: SocketAddr,
    /// A listener of its own for the health probes alone (`/healthz`,
    /// `/readyz`, `/lb-health`), so that whoever fills the admin listener
    /// cannot fail them; `None`: the probes are on the admin listener only.
    pub health_listen: Option<SocketAddr>,
    pub server: ServerConfig,
    pub cache: CacheConfig,
    /// The shared L2 cache and cross-instance coalescing; `None` when the file has no
    /// `redis:` section, and each instance then works on its own.
    pub redis: Option<RedisConfig>,
    /// Who is calling (`callers:`): the account sources rate limits count by.
    pub callers: CallersConfig,
    /// Limits every route applies, each counted once across all of them
    /// (a caller's total, whichever routes it calls).
    pub limits: Vec<LimitConfig>,
    /// Routes in file order; at least one, names unique.
    pub routes: Vec<RouteConfig>,
}

/// `listen_tls:`: HTTP/1.1 and h2 over TLS, the certificate read anew
/// whenever its files change.
#[derive(Debug, Clone)]
pub struct ListenTls {
    pub addr: SocketAddr,
    pub cert_file: std::path::PathBuf,
    pub key_file: std::path::PathBuf,
}

/// `callers:` (optional).
#[derive(Debug, Clone)]
pub struct CallersConfig {
    /// How a request's account is found; the key files are read when the
    /// configuration is loaded (and reloaded).
    pub account: std::sync::Arc<corral_core::caller::AccountSources>,
    /// Callers counted in this process at once (the local limiter, and the
    /// fallback when Redis is out of reach); the least used are forgotten.
    pub local_buckets: u64,
}

impl Default for CallersConfig {
    fn default() -> Self {
        CallersConfig {
            account: Default::default(),
            local_buckets: DEFAULT_LOCAL_BUCKETS,
        }
    }
}

const DEFAULT_LOCAL_BUCKETS: u64 = 100_000;
const DEFAULT_JWT_LEEWAY: Duration = Duration::from_secs(30);
const DEFAULT_UPSTREAM_QUEUE_TIMEOUT: Duration = Duration::from_secs(5);

/// A pool's passive (and optional active) health (`health:`).
#[derive(Debug, Clone)]
pub struct HealthConfig {
    pub max_fails: u32,
    pub fail_timeout: Duration,
    pub check_path: Option<String>,
    pub check_interval: Duration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            max_fails: 1,
            fail_timeout: Duration::from_secs(10),
            check_path: None,
            check_interval: Duration::from_secs(5),
        }
    }
}

/// One rate limit of a route (`limits:`).
#[derive(Debug, Clone)]
pub struct LimitConfig {
    /// Unique in the route, `[A-Za-z0-9_-]+`: in headers, metrics and logs.
    pub name: String,
    pub key: LimitKey,
    pub rate: corral_core::rate_limit::Rate,
    /// Requests let through at once; default: the rate's count.
    pub burst: u32,
    /// Whether answers from the cache count (default false: a hit costs
    /// the origin nothing).
    pub count_hits: bool,
    /// Addresses are counted by this prefix (`ip`, and guests of
    /// `account_or_ip`): 32 and 128 count each address.
    pub ipv4_prefix: u8,
    pub ipv6_prefix: u8,
    pub on_redis_down: OnRedisDown,
}

/// What a limit counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKey {
    /// Callers with an account; guests pass this limit.
    Account,
    /// The real client address (by prefix).
    Ip,
    /// The account, or the address for guests.
    AccountOrIp,
}

/// A shared limit while Redis cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnRedisDown {
    /// Fail open: each instance counts alone, at the rate divided by
    /// `redis.instances`.
    Local,
    /// Fail closed: 503 with Retry-After until Redis answers again.
    Refuse,
}

/// Front-end connection limits (`server:` section, optional).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// How long a client may take to send the request head, counted from
    /// the moment its connection is accepted (or its previous answer sent).
    pub header_read_timeout: Duration,
    /// How long a connection with no request in progress stays open
    /// (HTTP/1.1 keep-alive and HTTP/2 alike).
    pub idle_timeout: Duration,
    /// How long a write to a client may stay blocked (the client reads
    /// nothing) before the connection is closed.
    pub send_timeout: Duration,
    /// Bytes a second a client must read while an answer waits on it,
    /// measured over `send_timeout`; 0: no minimum.
    pub min_send_rate: u64,
    /// Client connections open at once; `None`: derived from the open-file
    /// limit at start. Past it, corral stops accepting (the kernel queues).
    pub max_connections: Option<usize>,
    /// Bytes of request head hyper may buffer; at least 8KiB (hyper's minimum).
    pub max_header_size: u64,
    /// How long in-flight requests may run after a shutdown signal.
    pub shutdown_grace: Duration,
    /// After SIGTERM, how long `/lb-health` answers 503 while corral still
    /// serves, so load balancers stop sending before the listener closes.
    pub drain_period: Duration,
    /// Bearer token of the purge API; `CORRAL_PURGE_TOKEN` is used when
    /// this is absent. Neither set: purging is refused.
    pub purge_token: Option<String>,
    /// Token of the live view (`/`, `/stats`) when the admin listener is
    /// not on loopback; `CORRAL_ADMIN_TOKEN` when absent, else the purge
    /// token.
    pub admin_token: Option<String>,
    /// Host names (lower case, no port) the admin listener's views,
    /// metrics and purges answer for, besides IP literals and `localhost`.
    pub admin_hosts: Vec<String>,
    /// Proxies whose `X-Forwarded-For` / `Forwarded` is believed (empty:
    /// nobody's; the peer is the client).
    pub trusted_proxies: corral_core::client_addr::TrustedProxies,
    /// Every client connection opens with a PROXY protocol header (v1 or
    /// v2) from a TCP load balancer; its address is the peer.
    pub listen_proxy_protocol: bool,
    /// How client connections are scheduled over threads.
    pub runtime: RuntimeMode,
    /// Threads serving clients (`server.workers`); `None`: one per
    /// available core (or `TOKIO_WORKER_THREADS` with `shared`).
    pub workers: Option<usize>,
    /// `server.cpu_threads`: CPU jobs (compression, decoding, digest
    /// checks, large copies) run at once off the serving threads; `None`:
    /// half the cores, at least one; 0: inline on the serving threads.
    pub cpu_threads: Option<usize>,
    /// `server.overload`: the share of time (percent) the serving threads
    /// may be busy, sustained, before corral sheds passed-through requests
    /// and new connections (`overload`); `None` (`off`): it never sheds.
    pub overload: Option<u8>,
}

/// `server.overload` unless configured: shed once the serving threads have
/// been busy 90% of the time for a second.
pub const DEFAULT_OVERLOAD: u8 = 90;

/// `server.runtime`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RuntimeMode {
    /// One work-stealing runtime: any thread may run any connection.
    #[default]
    Shared,
    /// One thread per worker, each with its own listener socket
    /// (`SO_REUSEPORT`) and event loop, serving each of its connections
    /// from accept to close (as nginx's worker processes do); the cache,
    /// flights and Redis stay one per process.
    PerCore,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            send_timeout: Duration::from_secs(60),
            min_send_rate: DEFAULT_MIN_SEND_RATE,
            max_connections: None,
            max_header_size: 16 * 1024,
            shutdown_grace: Duration::from_secs(30),
            drain_period: Duration::from_secs(5),
            purge_token: None,
            admin_token: None,
            admin_hosts: Vec::new(),
            trusted_proxies: Default::default(),
            listen_proxy_protocol: false,
            runtime: RuntimeMode::Shared,
            workers: None,
            cpu_threads: None,
            overload: Some(DEFAULT_OVERLOAD),
        }
    }
}

/// The shared in-memory cache (`cache:` section, required).
#[derive(Debug, Clone)]
pub struct CacheConfig {
    /// Total bytes the cache may hold.
    pub memory: u64,
    /// Largest response body stored; never more than `memory`.
    pub max_object_size: u64,
    /// Bytes all fills under way may buffer together; a fill that would
    /// pass it streams through uncached. At least `max_object_size`.
    pub fill_memory: u64,
    /// Bytes the bodies of coalesced POSTs (read, or waiting for their
    /// flight) may hold together: their own bound, so stalled bodies
    /// cannot take the fills' memory.
    pub post_memory: u64,
    /// Origin fetches the cache path may have under way at once.
    pub max_fills: usize,
}

/// Default `coalesce.post.read_timeout`: well below `timeouts.total`, so a
/// body that trickles in holds its memory briefly.
pub const DEFAULT_POST_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Default `server.min_send_rate`: 4 KiB a second (32 kbit/s), under any
/// real client's pace, over a slow reader's that pins a body for hours.
pub const DEFAULT_MIN_SEND_RATE: u64 = 4096;

/// Default `cache.max_fills`.
const DEFAULT_MAX_FILLS: usize = 1024;
/// `cache.memory` when the file leaves it (or `cache:`) out: what
/// `corral proxy --memory` defaults to.
const DEFAULT_MEMORY: u64 = 256 << 20;

/// Default `cache.max_object_size`: 8MiB.
const DEFAULT_MAX_OBJECT_SIZE: u64 = 8 * 1024 * 1024;

/// Redis, shared by every instance (`redis:` section, optional).
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// Which Redis: one node, a Cluster or the master Sentinel names.
    pub servers: RedisServers,
    /// Deadline for each Redis command; positive.
    pub op_timeout: Duration,
    /// Deadline for (re)connecting; positive.
    pub connect_timeout: Duration,
    /// Lease expiry, extended by a watchdog while a fetch runs; at least 100ms.
    pub lease_ttl: Duration,
    /// Prepended to every key; 1 to 64 characters, no whitespace, `{` or `}`.
    pub key_prefix: String,
    /// Largest body written to Redis; larger ones stay in L1 only. Positive.
    pub l2_max_object_size: u64,
    /// Consecutive failed commands that open the circuit breaker; at least 1.
    pub breaker_failures: u32,
    /// How long the open breaker skips Redis before one probe; positive.
    pub breaker_open_for: Duration,
    /// How many corral instances share this Redis: while it cannot be
    /// reached, each counts rate limits and `upstream_concurrency` alone
    /// at 1/`instances` of the route's figure. At least 1.
    pub instances: u32,
    /// Unverified entries (held when the invalidation log was lost: Redis
    /// restarted empty) revalidated per second by this instance, in the
    /// background, as they are asked for. At least 1.
    pub resync_rate: u32,
    /// `rediss://` only: the CA (else the platform's roots) and an optional
    /// client certificate, as PEM bytes read at load.
    pub tls: Option<RedisTls>,
    /// How instances authenticate what they read from each other through
    /// Redis (entries, Vary records, back-offs, path rules, heartbeats,
    /// purges): an HMAC-SHA256 keyed with a secret of at least 32 bytes,
    /// from `auth_key_file` (the file's bytes, one trailing newline
    /// dropped) or else the `CORRAL_REDIS_AUTH_KEY` environment variable.
    /// Every instance of a fleet needs the same key. A `redis:` section
    /// with neither is refused unless it says `auth: none`, which trusts
    /// whoever can write to Redis. A record that does not verify is a miss
    /// (`corral_redis_unauthenticated_records_total`), never served.
    pub auth: corral_core::peer_auth::PeerAuth,
}

/// How corral finds Redis: exactly one of `redis.url`, `redis.cluster`
/// and `redis.sentinel`.
#[derive(Clone, PartialEq, Eq)]
pub enum RedisServers {
    /// `url`: `redis[s]://[user:password@]host[:port][/db]`, as written
    /// (trimmed).
    Node(String),
    /// `cluster`: seed nodes of a Redis/Valkey Cluster (one scheme, db 0);
    /// the rest of the cluster is discovered from them.
    Cluster(Vec<String>),
    /// `sentinel`: the master the sentinels name, followed through
    /// failovers.
    Sentinel(SentinelConfig),
}

impl RedisServers {
    /// Whether corral speaks TLS to Redis (`rediss://`).
    pub fn tls(&self) -> bool {
        let first = match self {
            RedisServers::Node(url) => Some(url),
            RedisServers::Cluster(nodes) => nodes.first(),
            RedisServers::Sentinel(s) => s.nodes.first(),
        };
        first.is_some_and(|u| u.starts_with("rediss://"))
    }
}

impl std::fmt::Debug for RedisServers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RedisServers::Node(_) => f.write_str("Node(..)"),
            RedisServers::Cluster(n) => write!(f, "Cluster({} seed nodes)", n.len()),
            RedisServers::Sentinel(s) => write!(f, "Sentinel({:?})", s.master),
        }
    }
}

/// `redis.sentinel:`.
#[derive(Clone, PartialEq, Eq)]
pub struct SentinelConfig {
    /// The master's name, as the sentinels monitor it.
    pub master: String,
    /// The sentinels, `redis[s]://[user:password@]host[:port]` (port 26379
    /// when left out); their scheme is the master's too.
    pub nodes: Vec<String>,
    /// The master's credentials and database.
    pub username: Option<String>,
    pub password: Option<String>,
    pub db: i64,
}

/// `redis.tls:`.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisTls {
    pub ca: Option<Vec<u8>>,
    pub client_cert_and_key: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for RedisTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTls")
            .field("ca", &self.ca.is_some())
            .field("client_cert", &self.client_cert_and_key.is_some())
            .finish()
    }
}

/// Defaults of the `redis:` fields other than `url`.
const DEFAULT_REDIS_OP_TIMEOUT: Duration = Duration::from_millis(50);
const DEFAULT_REDIS_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
const DEFAULT_REDIS_LEASE_TTL: Duration = Duration::from_secs(3);
const DEFAULT_REDIS_KEY_PREFIX: &str = "corral:";
const DEFAULT_L2_MAX_OBJECT_SIZE: u64 = 1024 * 1024;
const DEFAULT_BREAKER_FAILURES: u32 = 5;
const DEFAULT_BREAKER_OPEN_FOR: Duration = Duration::from_secs(2);

/// One upstream and the requests that go to it.
#[derive(Debug, Clone)]
pub struct RouteConfig {
    /// Unique, `[A-Za-z0-9_-]+`; used in logs, metrics and headers.
    pub name: String,
    /// `compression:`: stored answers kept compressed too; `None`: off.
    pub compression: Option<CompressionConfig>,
    /// `match.host`: a lowercased host name; `None` matches any host.
    pub host: Option<String>,
    /// `match.path_prefix`: starts with `/`; default `/`.
    pub path_prefix: String,
    /// `match.case_sensitive`: the path prefix is compared as written.
    /// Off by default: many origins (Express, Koa's router, ASP.NET Core,
    /// IIS) route `/API/x` as `/api/x`, so the policy is chosen on the
    /// case-folded path, the form no such origin can tell apart.
    pub case_sensitive: bool,
    /// `underscores_in_headers`: request fields whose names hold `_` are
    /// passed on. Off by default, as nginx's `underscores_in_headers`:
    /// CGI-style servers read `X_Forwarded_Host` as `X-Forwarded-Host`,
    /// so such a field would pass every strip list by its spelling.
    pub underscores_in_headers: bool,
    /// `http://host[:port]` or `https://host[:port]`, with an empty or `/` path.
    pub upstream: http::Uri,
    pub timeouts: TimeoutsConfig,
    pub cache: RouteCacheConfig,
    pub coalesce: CoalesceConfig,
    /// Per-key back-off when the origin fails (`backoff:`).
    pub backoff: corral_core::BackoffPolicy,
    /// The route's origin circuit (`circuit:`).
    pub circuit: CircuitConfig,
    /// Every server of the route (`upstreams:`, or the one `upstream:`,
    /// which is also `upstream` above): one scheme, no duplicates.
    pub upstreams: Vec<http::Uri>,
    pub balance: Balance,
    pub health: HealthConfig,
    /// HTTP/2 to an https upstream: ALPN offers h2 alone, and one
    /// connection carries every request as a stream.
    pub upstream_http2: bool,
    /// TLS to the upstream: set exactly for `https://` upstreams.
    pub tls: Option<tls::UpstreamTls>,
    /// Rate limits, each checked in order.
    pub limits: Vec<LimitConfig>,
    /// At most this many requests outstanding to the upstream, across
    /// every instance (`upstream_concurrency`).
    pub upstream_concurrency: Option<u32>,
    /// How long a request waits for one of those slots before a 503.
    pub upstream_queue_timeout: Duration,
}

/// When most of a route's fetches fail, the route stops sending all but a
/// probe to its origin for a while.
#[derive(Debug, Clone, Copy)]
pub struct CircuitConfig {
    pub enabled: bool,
    /// Percentage of failed fetches in a window that opens the circuit; 1 to 100.
    pub error_rate: u8,
    /// Fewer fetches than this in a window never open it; at least 1.
    pub min_fetches: u32,
    /// The window fetches are counted in; positive.
    pub window: Duration,
    /// How long it stays open before one probe fetch; positive.
    pub open_for: Duration,
}

impl Default for CircuitConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            error_rate: 50,
            min_fetches: 20,
            window: Duration::from_secs(10),
            open_for: Duration::from_secs(5),
        }
    }
}

/// Upstream timeouts; each positive, and neither phase longer than `total`.
#[derive(Debug, Clone)]
pub struct TimeoutsConfig {
    /// TCP connect to the upstream.
    pub connect: Duration,
    /// From sending the request to receiving the response head.
    pub response_headers: Duration,
    /// The whole exchange, body included.
    pub total: Duration,
}

impl Default for TimeoutsConfig {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(2),
            response_headers: Duration::from_secs(15),
            total: Duration::from_secs(60),
        }
    }
}

/// Caching policy of one route.
/// A route's `compression:`: what stored answers are compressed in, once,
/// when they are stored.
#[derive(Debug, Clone, PartialEq)]
pub struct CompressionConfig {
    /// In the order they are preferred when a caller accepts several.
    pub encodings: Vec<corral_core::Coding>,
    /// Smaller bodies are kept as they are.
    pub min_size: u64,
    /// Media types compressed (`type/subtype`, or `type/*`), lowercased.
    pub types: Vec<String>,
}

impl Default for CompressionConfig {
    fn default() -> Self {
        CompressionConfig {
            encodings: vec![corral_core::Coding::Br, corral_core::Coding::Gzip],
            min_size: 1024,
            types: [
                "application/json",
                "application/*+json",
                "application/javascript",
                "application/xml",
                "application/*+xml",
                "application/x-ndjson",
                "image/svg+xml",
                "text/*",
            ]
            .map(str::to_owned)
            .to_vec(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct RouteCacheConfig {
    /// Whether responses of this route are cached at all.
    pub enabled: bool,
    /// TTL for storable responses that carry no freshness information; `None` = not stored.
    pub default_ttl: Option<Duration>,
    /// RFC 9111 §4.2.2 heuristic freshness from `Last-Modified`; off by default.
    pub heuristic_freshness: bool,
    pub stale_while_revalidate: StaleWindow,
    pub stale_if_error: StaleWindow,
    /// Neither stale window longer than this fraction of a response's
    /// freshness lifetime (`0.5`: half); `None` (the default): no such bound.
    pub stale_max_ratio: Option<f64>,
    /// Percent (0..=50) by which TTLs are randomly shortened to spread expiries.
    pub ttl_jitter: u8,
    /// Probabilistic early refresh strength (XFetch beta); 0 disables, always finite.
    pub early_refresh_beta: f64,
    /// Query parameter names left out of the cache key; a trailing `*` matches a prefix.
    pub ignore_query: Vec<String>,
    /// Learn each path's No-Vary-Search rule from the origin's answers and
    /// leave the parameters it names out of the key (off by default: the
    /// origin then decides what shares an entry).
    pub no_vary_search: bool,
    /// Order query parameters by name in keys, so `?b=2&a=1` shares
    /// `?a=1&b=2`'s entry. On by default; off by default where
    /// `no_vary_search` is on, whose rules' `key-order` then decides.
    pub sort_query: bool,
    /// `identity.headers`: lowercased request headers that make a response user-specific.
    pub identity_headers: Vec<String>,
    /// `identity.cookies`: request cookies that make a response user-specific;
    /// `*` (the default): every cookie, the whole Cookie field.
    pub identity_cookies: Vec<String>,
    /// `false`: responses with `Set-Cookie` are not stored; `true`: stored without it.
    pub store_set_cookie: bool,
    /// How long a key found uncacheable is passed straight to the upstream; 0 disables.
    pub hit_for_pass: Duration,
    /// RFC 9213 targeted fields (lowercased), in priority order.
    pub targeted_fields: Vec<String>,
    /// Store answers to coalesced POSTs that the origin made cacheable
    /// with explicit freshness (needs `coalesce.post`).
    pub post: bool,
}

impl Default for RouteCacheConfig {
    /// The policy's defaults (one source: `RoutePolicy::default`), plus
    /// what only the configuration has.
    fn default() -> Self {
        let p = corral_core::RoutePolicy::default();
        Self {
            enabled: true,
            default_ttl: p.default_ttl,
            heuristic_freshness: p.heuristic_freshness,
            stale_while_revalidate: StaleWindow {
                default: p.swr_default,
                max: p.swr_max,
            },
            stale_if_error: StaleWindow {
                default: p.sie_default,
                max: p.sie_max,
            },
            stale_max_ratio: p.stale_max_ratio,
            ttl_jitter: p.ttl_jitter_percent,
            early_refresh_beta: p.early_refresh_beta,
            ignore_query: Vec::new(),
            no_vary_search: false,
            sort_query: true,
            identity_headers: vec!["authorization".to_owned()],
            // Any cookie may carry a session: a caller with cookies is
            // keyed on them unless the route names the ones that matter.
            identity_cookies: vec!["*".to_owned()],
            store_set_cookie: p.store_set_cookie,
            hit_for_pass: p.hit_for_pass,
            targeted_fields: p.targeted.iter().map(|h| h.as_str().to_owned()).collect(),
            post: p.store_post,
        }
    }
}

/// How long a stale response may be served: `default` when the response does not say,
/// and never more than `max` whatever it says. `default <= max`.
#[derive(Debug, Clone, Copy)]
pub struct StaleWindow {
    pub default: Duration,
    pub max: Duration,
}

/// Request coalescing: one upstream fetch per key at a time.
#[derive(Debug, Clone)]
pub struct CoalesceConfig {
    pub enabled: bool,
    /// How long a waiter waits for the leader's response; positive.
    pub lock_timeout: Duration,
    /// What a waiter does when `lock_timeout` passes.
    pub on_timeout: OnTimeout,
    /// Origin fetches this route may have under way at once.
    pub max_fills: usize,
    /// Callers one key's flight may hold waiting; the next gets the stale
    /// copy or a 503.
    pub max_waiters: usize,
    /// A leader holding a key this long without an answer gives it up to
    /// one of its waiters; `None`: off. Shorter than `lock_timeout`.
    pub lock_age: Option<Duration>,
    /// `coalesce.post.max_body`: POSTs with a body up to this size are
    /// coalesced (the body is part of the key); `None`: POST is never
    /// coalesced.
    pub post_max_body: Option<u64>,
    /// `coalesce.post.read_timeout`: a coalesced POST's body must have
    /// arrived whole within this, or it is a 408.
    pub post_read_timeout: Duration,
}

impl Default for CoalesceConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            lock_timeout: Duration::from_secs(5),
            on_timeout: OnTimeout::Fetch,
            max_fills: 256,
            max_waiters: 10_000,
            lock_age: None,
            post_max_body: None,
            post_read_timeout: DEFAULT_POST_READ_TIMEOUT,
        }
    }
}

/// What a coalesced waiter does after `lock_timeout` (YAML: `fetch`, `stale`, `error`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnTimeout {
    /// The first waiter to time out fetches again and the others wait on
    /// that fetch to its end (bounded by `timeouts.total`). A slow origin
    /// sees at most two requests per key per instance, not one per waiter.
    #[default]
    Fetch,
    /// Every waiter fetches from the upstream itself (a stampede on a slow
    /// origin; nginx's `proxy_cache_lock_timeout`).
    FetchEach,
    /// Serve a stale copy if the cache holds one.
    Stale,
    /// Answer with an error instead of fetching.
    Error,
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "corral.yaml";

    /// Lines 1-7 of a valid config with one route; `extra` starts at line 8 inside that route.
    fn route_with(extra: &str) -> String {
        format!(
            "\
listen: 127.0.0.1:8080
admin: 127.0.0.1:9080
cache:
  memory: 256MiB
routes:
  - name: api
    upstream: http://127.0.0.1:3000
{extra}"
        )
    }

    /// `text` parsed; a `redis:` block section that says nothing of
    /// `auth` gets `auth: none` (the key is the environment's, which unit
    /// tests do not set; `redis_auth_*` tests cover it).
    fn config(text: &str) -> Config {
        let text = if text.contains("\n  auth") {
            text.to_owned()
        } else {
            text.replacen("\nredis:\n", "\nredis:\n  auth: none\n", 1)
        };
        parse(FILE, &text).unwrap_or_else(|e| panic!("config refused: {e}"))
    }

    fn refused(text: &str) -> ConfigError {
        match parse(FILE, text) {
            Ok(config) => panic!("config accepted: {config:?}"),
            Err(error) => error,
        }
    }

    /// Asserts line, column and field, and returns the message.
    fn assert_at(error: &ConfigError, line: u32, column: u32, field: &str) -> String {
        assert_eq!(
            (error.line, error.column, error.field.as_str()),
            (Some(line), Some(column), field),
            "{error}"
        );
        assert_eq!(error.file, FILE);
        error.message.clone()
    }

    #[test]
    fn example_file_loads() {
        let path = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../config/corral.yaml"
        ));
        let config = load(path).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(config.listen, "127.0.0.1:8080".parse().expect("address"));
        assert_eq!(config.admin, "127.0.0.1:9080".parse().expect("address"));
        assert_eq!(config.cache.memory, 256 * 1024 * 1024);
        assert_eq!(config.routes.len(), 1);
        let route = &config.routes[0];
        assert_eq!(route.name, "api");
        assert_eq!(route.host, None);
        assert_eq!(route.path_prefix, "/");
        assert_eq!(route.upstream, "http://127.0.0.1:3000/");
        assert_eq!(route.cache.ignore_query, ["utm_*", "fbclid"]);
        assert_eq!(
            route.cache.targeted_fields,
            ["corral-cache-control", "cdn-cache-control"]
        );
        assert_eq!(route.coalesce.on_timeout, OnTimeout::Fetch);
        assert!(config.redis.is_none(), "the example runs without Redis");
    }

    #[test]
    fn missing_file_is_a_read_error_without_position() {
        let error = match load(Path::new("/nonexistent/corral.yaml")) {
            Ok(_) => panic!("loaded a missing file"),
            Err(error) => error,
        };
        assert_eq!(error.file, "/nonexistent/corral.yaml");
        assert_eq!((error.line, error.column), (None, None));
        assert_eq!(error.field, "");
        assert!(
            error.message.starts_with("cannot read config file: "),
            "{error}"
        );
    }

    #[test]
    fn minimal_config_gets_every_default() {
        let config = config(
            "\
listen: 127.0.0.1:8080
admin: 127.0.0.1:9080
cache:
  memory: 64MiB
routes:
  - name: api
    match: { path_prefix: / }
    upstream: http://127.0.0.1:3000
",
        );
        let server = &config.server;
        assert_eq!(server.header_read_timeout, Duration::from_secs(10));
        assert_eq!(server.max_header_size, 16 * 1024);
        assert_eq!(server.shutdown_grace, Duration::from_secs(30));
        assert_eq!(config.cache.memory, 64 * 1024 * 1024);
        assert_eq!(config.cache.max_object_size, 8 * 1024 * 1024);

        let route = &config.routes[0];
        assert_eq!(route.host, None);
        assert_eq!(route.path_prefix, "/");
        assert_eq!(route.upstream.host(), Some("127.0.0.1"));
        assert_eq!(route.upstream.port_u16(), Some(3000));
        assert_eq!(route.timeouts.connect, Duration::from_secs(2));
        assert_eq!(route.timeouts.response_headers, Duration::from_secs(15));
        assert_eq!(route.timeouts.total, Duration::from_secs(60));

        let cache = &route.cache;
        assert!(cache.enabled);
        assert_eq!(cache.default_ttl, None);
        assert!(!cache.heuristic_freshness);
        assert_eq!(cache.stale_while_revalidate.default, Duration::ZERO);
        assert_eq!(cache.stale_while_revalidate.max, Duration::from_secs(3600));
        assert_eq!(cache.stale_if_error.default, Duration::ZERO);
        assert_eq!(cache.stale_if_error.max, Duration::from_secs(86_400));
        assert_eq!(cache.ttl_jitter, 0);
        assert_eq!(cache.early_refresh_beta, 1.0);
        assert!(cache.ignore_query.is_empty());
        assert_eq!(cache.identity_headers, ["authorization"]);
        assert_eq!(cache.identity_cookies, ["*"]);
        assert!(!cache.store_set_cookie);
        assert_eq!(cache.hit_for_pass, Duration::from_secs(10));
        assert_eq!(cache.targeted_fields, ["cdn-cache-control"]);

        let coalesce = &route.coalesce;
        assert!(coalesce.enabled);
        assert_eq!(coalesce.lock_timeout, Duration::from_secs(5));
        assert_eq!(coalesce.on_timeout, OnTimeout::Fetch);
    }

    #[test]
    fn every_field_of_the_documented_shape_is_read() {
        let config = config(
            "\
listen: 0.0.0.0:8080
admin: 127.0.0.1:9080
server: { header_read_timeout: 5s, max_header_size: 32KiB, shutdown_grace: 1m }
cache: { memory: 1GB, max_object_size: 1MB }
routes:
  - name: api
    match: { host: API.Example.com, path_prefix: /v1 }
    upstream: http://127.0.0.1:3000
    timeouts: { connect: 250ms, response_headers: 1.5s, total: 2m }
    cache:
      enabled: false
      default_ttl: 30s
      heuristic_freshness: true
      stale_while_revalidate: { default: 10s, max: 1h }
      stale_if_error: { default: 1m, max: 1d }
      stale_max_ratio: 0.5
      ttl_jitter: 10
      early_refresh_beta: 0
      ignore_query: [utm_*, fbclid]
      no_vary_search: true
      identity: { headers: [Authorization, X-Api-Key], cookies: [session] }
      store_set_cookie: true
      hit_for_pass: 0s
    coalesce: { enabled: false, lock_timeout: 100ms, on_timeout: stale }
  - name: static
    match: { host: api.example.com }
    upstream: http://10.0.0.2
",
        );
        assert_eq!(config.server.header_read_timeout, Duration::from_secs(5));
        assert_eq!(config.server.max_header_size, 32 * 1024);
        assert_eq!(config.server.shutdown_grace, Duration::from_secs(60));
        assert_eq!(config.cache.memory, 1_000_000_000);
        assert_eq!(config.cache.max_object_size, 1_000_000);

        let api = &config.routes[0];
        assert_eq!(api.host.as_deref(), Some("api.example.com"));
        assert_eq!(api.path_prefix, "/v1");
        assert_eq!(api.timeouts.connect, Duration::from_millis(250));
        assert_eq!(api.timeouts.response_headers, Duration::from_millis(1500));
        assert_eq!(api.timeouts.total, Duration::from_secs(120));
        let cache = &api.cache;
        assert!(!cache.enabled);
        assert_eq!(cache.default_ttl, Some(Duration::from_secs(30)));
        assert!(cache.heuristic_freshness);
        assert_eq!(
            cache.stale_while_revalidate.default,
            Duration::from_secs(10)
        );
        assert_eq!(cache.stale_if_error.default, Duration::from_secs(60));
        assert_eq!(cache.stale_if_error.max, Duration::from_secs(86_400));
        assert_eq!(cache.stale_max_ratio, Some(0.5));
        assert!(cache.no_vary_search);
        assert_eq!(cache.ttl_jitter, 10);
        assert_eq!(cache.early_refresh_beta, 0.0);
        assert_eq!(cache.identity_headers, ["authorization", "x-api-key"]);
        assert_eq!(cache.identity_cookies, ["session"]);
        assert!(cache.store_set_cookie);
        assert_eq!(cache.hit_for_pass, Duration::ZERO);
        assert!(!api.coalesce.enabled);
        assert_eq!(api.coalesce.lock_timeout, Duration::from_millis(100));
        assert_eq!(api.coalesce.on_timeout, OnTimeout::Stale);

        let static_route = &config.routes[1];
        assert_eq!(static_route.path_prefix, "/");
        assert_eq!(static_route.upstream.host(), Some("10.0.0.2"));
    }

    #[test]
    fn unknown_field_in_route_cache_names_line_and_path() {
        let error = refused(
            "\
listen: 127.0.0.1:8080
admin: 127.0.0.1:9080
cache: { memory: 256MiB }
routes:
- name: api
  cache:
    bogus: 1
  upstream: http://127.0.0.1:3000
",
        );
        let message = assert_at(&error, 7, 5, "routes[0].cache.bogus");
        assert!(
            error
                .to_string()
                .starts_with("corral.yaml:7:5: routes[0].cache.bogus: unknown field `bogus`"),
            "{error}"
        );
        assert!(message.contains("default_ttl"), "{message}");
    }

    #[test]
    fn an_ip_limit_counts_one_ipv6_customer_by_its_64_unless_told() {
        let limit = |c: &Config| {
            (
                c.routes[0].limits[0].ipv4_prefix,
                c.routes[0].limits[0].ipv6_prefix,
            )
        };
        let plain = config(&route_with(
            "    limits: [{ name: a, key: ip, rate: 3/min }]\n",
        ));
        assert_eq!(limit(&plain), (32, 64), "the defaults");
        let each = config(&route_with(
            "    limits: [{ name: a, key: ip, rate: 3/min, ipv6_prefix: 128 }]\n",
        ));
        assert_eq!(limit(&each), (32, 128));
    }

    #[test]
    fn backoff_after_counts_failures_in_a_row_and_is_at_least_one() {
        let routes = |c: &Config| c.routes[0].backoff;
        assert_eq!(routes(&config(&route_with(""))).after, 2, "the default");
        let set = config(&route_with("    backoff: { min: 2s, after: 1 }\n"));
        assert_eq!(routes(&set).after, 1);
        assert_eq!(routes(&set).min, std::time::Duration::from_secs(2));
        let error = refused(&route_with("    backoff: { after: 0 }\n"));
        assert_at(&error, 8, 23, "routes[0].backoff.after");
        let error = refused(&route_with("    backoff: { after: twice }\n"));
        assert_at(&error, 8, 23, "routes[0].backoff.after");
    }

    #[test]
    fn unknown_field_in_flow_mapping_and_at_top_level() {
        let error = refused(&route_with("    coalesce: { enabled: true, wait: 5s }\n"));
        assert_at(&error, 8, 32, "routes[0].coalesce.wait");

        let text = route_with("").replace("routes:", "listen_on: 1\nroutes:");
        let error = refused(&text);
        assert_at(&error, 5, 1, "listen_on");
    }

    #[test]
    fn bad_duration_names_the_field() {
        let error = refused(&route_with("    coalesce:\n      lock_timeout: 5x\n"));
        let message = assert_at(&error, 9, 21, "routes[0].coalesce.lock_timeout");
        assert_eq!(message, "unknown unit `x` in `5x` (units: ms, s, m, h, d)");
    }

    #[test]
    fn bare_number_duration_is_refused() {
        let error = refused(&route_with("    timeouts:\n      total: 30\n"));
        let message = assert_at(&error, 9, 14, "routes[0].timeouts.total");
        assert!(message.contains("missing unit"), "{message}");
    }

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        let text =
            route_with("").replace("memory: 256MiB", "memory: 256MiB\n  max_object_size: 1GB");
        let text = text.replace("memory: 256MiB", "memory: 2GiB");
        let config = config(&format!("server:\n  max_header_size: 16KiB\n{text}"));
        assert_eq!(config.cache.memory, 2 * 1024 * 1024 * 1024);
        assert_eq!(config.cache.max_object_size, 1_000_000_000);
        assert_eq!(config.server.max_header_size, 16_384);

        let config = self::config(&route_with(""));
        assert_eq!(config.cache.memory, 268_435_456);
    }

    #[test]
    fn ambiguous_size_unit_is_refused() {
        let error = refused(&route_with("").replace("256MiB", "256M"));
        let message = assert_at(&error, 4, 11, "cache.memory");
        assert!(message.contains("ambiguous unit `M`"), "{message}");
    }

    #[test]
    fn duplicate_route_names_are_refused_at_the_second() {
        let error = refused(&route_with(
            "  - name: api\n    match: { path_prefix: /other }\n    upstream: http://127.0.0.1:3001\n",
        ));
        let message = assert_at(&error, 8, 11, "routes[1].name");
        assert_eq!(
            message,
            "duplicate route name `api` (already used by routes[0])"
        );
    }

    #[test]
    fn identical_matches_are_refused() {
        let error = refused(&route_with(
            "  - name: web\n    upstream: http://127.0.0.1:3001\n",
        ));
        let message = assert_at(&error, 8, 5, "routes[1].match");
        assert!(message.contains("never be used"), "{message}");
    }

    #[test]
    fn prefixes_that_differ_only_in_case_are_one_match_unless_both_are_case_sensitive() {
        let two = |a: &str, b: &str| {
            format!(
                "  - name: lower\n    match: {{ path_prefix: /api{a} }}\n    upstream: http://127.0.0.1:3001\n  - name: upper\n    match: {{ path_prefix: /API{b} }}\n    upstream: http://127.0.0.1:3002\n"
            )
        };
        let error = refused(&route_with(&two("", "")));
        let message = assert_at(&error, 12, 27, "routes[2].match.path_prefix");
        assert!(message.contains("never be used"), "{message}");
        let error = refused(&route_with(&two(", case_sensitive: true", "")));
        assert!(error.to_string().contains("never be used"), "{error}");
        let both = ", case_sensitive: true";
        let config = config(&route_with(&two(both, both)));
        assert!(config.routes[1].case_sensitive && config.routes[2].case_sensitive);
        assert!(!config.routes[0].case_sensitive);
        assert!(!config.routes[0].underscores_in_headers);
        let config = self::config(&route_with("    underscores_in_headers: true\n"));
        assert!(config.routes[0].underscores_in_headers);
    }

    #[test]
    fn listen_equal_to_admin_is_refused() {
        let error = refused(&route_with("").replace("127.0.0.1:9080", "127.0.0.1:8080"));
        let message = assert_at(&error, 2, 8, "admin");
        assert!(message.contains("overlaps listen"), "{message}");

        // Port 0 lets the OS pick, so two ephemeral listeners are fine.
        let text = route_with("")
            .replace("127.0.0.1:9080", "127.0.0.1:0")
            .replace("127.0.0.1:8080", "127.0.0.1:0");
        config(&text);
    }

    #[test]
    fn admin_hosts_are_names_and_health_listen_has_its_own_port() {
        let text = route_with("").replace(
            "admin: 127.0.0.1:9080\n",
            "admin: 127.0.0.1:9080\nhealth_listen: 0.0.0.0:9081\nserver:\n  admin_hosts: [Corral.Example., ops-1]\n",
        );
        let c = config(&text);
        assert_eq!(c.server.admin_hosts, ["corral.example", "ops-1"]);
        assert_eq!(c.health_listen, Some("0.0.0.0:9081".parse().expect("addr")));
        assert_eq!(config(&route_with("")).health_listen, None);

        let text = route_with("").replace(
            "admin: 127.0.0.1:9080\n",
            "admin: 127.0.0.1:9080\nserver:\n  admin_hosts: [ok.example, \"evil.example:9080\"]\n",
        );
        let message = assert_at(&refused(&text), 4, 29, "server.admin_hosts[1]");
        assert!(message.contains("without a port"), "{message}");

        let text = route_with("").replace(
            "admin: 127.0.0.1:9080\n",
            "admin: 127.0.0.1:9080\nhealth_listen: 0.0.0.0:9080\n",
        );
        let message = assert_at(&refused(&text), 3, 16, "health_listen");
        assert!(message.contains("its own port"), "{message}");
    }

    #[test]
    fn https_upstream_gets_tls_and_tls_on_http_is_refused() {
        let https =
            route_with("    tls: { insecure_skip_verify: true, server_name: api.internal }\n")
                .replace("http://127.0.0.1:3000", "https://10.0.0.7:8443");
        let c = config(&https);
        let tls = c.routes[0].tls.as_ref().expect("an https route has TLS");
        assert!(tls.insecure_skip_verify);
        assert_eq!(
            tls.server_name.as_ref().map(|n| n.to_str().into_owned()),
            Some("api.internal".to_owned())
        );
        let error = refused(&route_with("    tls: { insecure_skip_verify: true }\n"));
        let message = assert_at(&error, 8, 10, "routes[0].tls");
        assert_eq!(message, "applies to https:// upstreams only");
    }

    #[test]
    fn garbage_upstreams_are_refused() {
        for (upstream, hint) in [
            ("not a uri", "not a valid URI"),
            ("127.0.0.1:3000", "no scheme"),
            ("http://127.0.0.1:3000/api", "path or query"),
            ("ftp://files", "unsupported scheme"),
        ] {
            let error = refused(&route_with("").replace("http://127.0.0.1:3000", upstream));
            let message = assert_at(&error, 7, 15, "routes[0].upstream");
            assert!(message.contains(hint), "{upstream}: {message}");
        }
    }

    #[test]
    fn missing_upstream_points_at_the_route() {
        let text = route_with("").replace("    upstream: http://127.0.0.1:3000\n", "");
        let error = refused(&text);
        let message = assert_at(&error, 6, 5, "routes[0].upstream");
        assert_eq!(message, "required field is missing");
    }

    #[test]
    fn required_field_without_value_points_at_its_key() {
        let text = route_with("").replace("upstream: http://127.0.0.1:3000", "upstream:");
        let message = assert_at(&refused(&text), 7, 5, "routes[0].upstream");
        assert_eq!(message, "required field has no value");

        // A `cache:` with nothing in it is the defaults.
        let text = route_with("").replace("  memory: 256MiB\n", "");
        assert_eq!(config(&text).cache.memory, 256 << 20);
    }

    #[test]
    fn stale_default_above_max_is_refused() {
        let error = refused(&route_with(
            "    cache:\n      stale_while_revalidate:\n        default: 2h\n        max: 1h\n",
        ));
        let message = assert_at(
            &error,
            10,
            18,
            "routes[0].cache.stale_while_revalidate.default",
        );
        assert_eq!(message, "default (2h) must not exceed max (1h)");

        // Against the default max, the written default is still the one blamed.
        let error = refused(&route_with(
            "    cache:\n      stale_if_error: { default: 2d }\n",
        ));
        let message = assert_at(&error, 9, 34, "routes[0].cache.stale_if_error.default");
        assert_eq!(
            message,
            "default (2d) must not exceed max (1d, the default)"
        );
    }

    #[test]
    fn a_stale_max_ratio_that_is_not_a_fraction_is_refused() {
        assert_eq!(
            RouteCacheConfig::default().stale_max_ratio,
            None,
            "off unless set"
        );
        let error = refused(&route_with("    cache:\n      stale_max_ratio: 50%\n"));
        let message = assert_at(&error, 9, 24, "routes[0].cache.stale_max_ratio");
        assert_eq!(
            message,
            "`50%` is not a finite number >= 0: a fraction of the freshness lifetime, e.g. 0.5 for half"
        );
    }

    #[test]
    fn ttl_jitter_above_50_is_refused() {
        let error = refused(&route_with("    cache:\n      ttl_jitter: 60\n"));
        let message = assert_at(&error, 9, 19, "routes[0].cache.ttl_jitter");
        assert_eq!(
            message,
            "60% is out of range: ttl_jitter is a percentage from 0 to 50"
        );
    }

    #[test]
    fn max_object_size_above_memory_is_refused() {
        let text =
            route_with("").replace("memory: 256MiB", "memory: 1MiB\n  max_object_size: 2MiB");
        let error = refused(&text);
        let message = assert_at(&error, 5, 20, "cache.max_object_size");
        assert_eq!(
            message,
            "max_object_size (2MiB) must not exceed memory (1MiB)"
        );

        // With the 8MiB default, the written memory is blamed.
        let error = refused(&route_with("").replace("256MiB", "1MiB"));
        let message = assert_at(&error, 4, 11, "cache.memory");
        assert_eq!(
            message,
            "max_object_size (8MiB, the default) must not exceed memory (1MiB)"
        );
    }

    #[test]
    fn timeout_longer_than_total_is_refused() {
        let error = refused(&route_with("    timeouts: { connect: 90s }\n"));
        let message = assert_at(&error, 8, 26, "routes[0].timeouts.connect");
        assert_eq!(
            message,
            "connect (90s) must not exceed total (1m, the default)"
        );

        let error = refused(&route_with("    timeouts: { total: 10s }\n"));
        let message = assert_at(&error, 8, 24, "routes[0].timeouts.total");
        assert_eq!(
            message,
            "response_headers (15s, the default) must not exceed total (10s)"
        );

        let error = refused(&route_with("    timeouts: { connect: 0s }\n"));
        assert_at(&error, 8, 26, "routes[0].timeouts.connect");
    }

    #[test]
    fn list_entries_are_named_by_index() {
        let error = refused(&route_with(
            "    cache:\n      identity:\n        headers: [authorization, \"x api\"]\n",
        ));
        let message = assert_at(&error, 10, 34, "routes[0].cache.identity.headers[1]");
        assert_eq!(message, "`x api` is not a valid header name");
    }

    #[test]
    fn wrong_shapes_name_the_field() {
        let error = refused(&route_with("    coalesce:\n      lock_timeout: [5s]\n"));
        let message = assert_at(&error, 9, 21, "routes[0].coalesce.lock_timeout");
        assert_eq!(message, "expected a single value, not a list or mapping");

        let error = refused(&route_with("    cache:\n      enabled: yes\n"));
        assert_at(&error, 9, 16, "routes[0].cache.enabled");

        let error = refused(&route_with("").replace("routes:\n", "routes: 5\n"));
        assert_at(&error, 5, 9, "routes");
    }

    #[test]
    fn empty_routes_and_missing_sections_are_refused() {
        let error = refused(
            "listen: 127.0.0.1:8080\nadmin: 127.0.0.1:9080\ncache: { memory: 1GiB }\nroutes: []\n",
        );
        let message = assert_at(&error, 4, 9, "routes");
        assert_eq!(message, "at least one route is required");

        let error = refused("listen: 127.0.0.1:8080\nadmin: 127.0.0.1:9080\nroutes: []\n");
        assert_at(&error, 3, 9, "routes");
        let error = refused("listen: 127.0.0.1:8080\n");
        let message = assert_at(&error, 1, 1, "routes");
        assert_eq!(message, "required field is missing");
    }

    #[test]
    fn a_minimal_config_is_listen_and_a_route_with_an_upstream() {
        let c = config("listen: 127.0.0.1:8080\nroutes:\n  - upstream: http://127.0.0.1:3000\n");
        assert_eq!(c.admin, "127.0.0.1:9080".parse().expect("addr"));
        assert_eq!(c.cache.memory, 256 << 20);
        assert_eq!(c.routes[0].name, "route-0");
        assert_eq!(c.routes[0].path_prefix, "/");
        assert_eq!(c.routes[0].cache.identity_cookies, ["*"]);
        // The default admin address is not silently shared with listen.
        let error =
            refused("listen: 127.0.0.1:9080\nroutes:\n  - upstream: http://127.0.0.1:3000\n");
        let message = assert_at(&error, 1, 9, "listen");
        assert!(message.contains("give `admin:` another"), "{message}");
    }

    #[test]
    fn every_missing_or_unreadable_required_field_is_reported_in_one_run() {
        let text = "admin: nowhere\ncache: { memory: lots }\nroutes:\n  - name: a\n  - name: \"b c\"\n    upstream: ftp://x\n  - upstreams: [\"127.0.0.1:2\"]\n";
        let error = refused(text);
        let all: Vec<(Option<u32>, &str)> = std::iter::once(&error)
            .chain(&error.also)
            .map(|e| (e.line, e.field.as_str()))
            .collect();
        assert_eq!(
            all,
            [
                (Some(1), "listen"),
                (Some(1), "admin"),
                (Some(2), "cache.memory"),
                (Some(4), "routes[0].upstream"),
                (Some(5), "routes[1].name"),
                (Some(6), "routes[1].upstream"),
                (Some(7), "routes[2].upstreams[0]"),
            ],
            "{error}"
        );
        assert_eq!(error.to_string().lines().count(), 7, "{error}");
    }

    #[test]
    fn targeted_fields_are_header_names_other_than_cache_control() {
        let error = refused(&route_with(
            "    cache: { targeted_fields: [CDN-Cache-Control, Cache-Control] }\n",
        ));
        let message = assert_at(&error, 8, 51, "routes[0].cache.targeted_fields[1]");
        assert!(
            message.contains("Cache-Control is what a targeted field overrides"),
            "{message}"
        );
        let error = refused(&route_with(
            "    cache: { targeted_fields: [\"bad name\"] }\n",
        ));
        assert_at(&error, 8, 32, "routes[0].cache.targeted_fields[0]");
    }

    #[test]
    fn wait_list_bounds_are_checked() {
        let error = refused(&route_with("    coalesce: { max_waiters: 0 }\n"));
        assert_at(&error, 8, 30, "routes[0].coalesce.max_waiters");
        let error = refused(&route_with(
            "    coalesce: { lock_timeout: 2s, lock_age: 2s }\n",
        ));
        let message = assert_at(&error, 8, 45, "routes[0].coalesce.lock_age");
        assert!(message.contains("shorter than lock_timeout"), "{message}");
        let config = config(&route_with(
            "    coalesce: { lock_age: 1500ms, max_waiters: 7 }\n",
        ));
        let c = &config.routes[0].coalesce;
        assert_eq!(
            (c.lock_age, c.max_waiters),
            (Some(Duration::from_millis(1500)), 7)
        );
    }

    #[test]
    fn post_coalescing_is_opt_in_and_bounded() {
        let config = config(&route_with(""));
        assert_eq!(config.routes[0].coalesce.post_max_body, None);
        assert!(!config.routes[0].cache.post);
        let config = super::parse(
            FILE,
            &route_with("    coalesce: { post: {} }\n    cache: { post: true }\n"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(config.routes[0].coalesce.post_max_body, Some(64 * 1024));
        assert!(config.routes[0].cache.post);
        assert_eq!(
            config.routes[0].coalesce.post_read_timeout,
            std::time::Duration::from_secs(5),
            "well below timeouts.total"
        );
        assert_eq!(config.cache.post_memory, config.cache.fill_memory / 16);
        let set = super::parse(
            FILE,
            &route_with("    coalesce: { post: { read_timeout: 2s } }\n"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            set.routes[0].coalesce.post_read_timeout,
            std::time::Duration::from_secs(2)
        );
        let error = refused(&route_with(
            "    coalesce: { post: { read_timeout: 0s } }\n",
        ));
        assert_at(&error, 8, 39, "routes[0].coalesce.post.read_timeout");
        let error = refused(&route_with("    coalesce: { post: { max_body: 2MiB } }\n"));
        let message = assert_at(&error, 8, 35, "routes[0].coalesce.post.max_body");
        assert!(message.contains("between 1 byte and 1MiB"), "{message}");
    }

    #[test]
    fn unknown_on_timeout_is_refused() {
        let error = refused(&route_with("    coalesce: { on_timeout: wait }\n"));
        let message = assert_at(&error, 8, 29, "routes[0].coalesce.on_timeout");
        assert_eq!(
            message,
            "unknown value `wait` (expected one of: fetch, fetch_each, stale, error)"
        );
    }

    #[test]
    fn tab_indentation_is_a_syntax_error_with_a_line() {
        let text = route_with("    cache:\n\tenabled: true\n");
        let error = refused(&text);
        assert_eq!(error.line, Some(9), "{error}");
        assert!(error.message.contains("tab"), "{error}");
    }

    #[test]
    fn yaml_syntax_error_has_a_line() {
        let error = refused(&route_with("    cache: { enabled: true\n"));
        assert!(error.line.is_some(), "{error}");
        let error = refused("listen: 127.0.0.1:8080\nadmin: [\n");
        assert!(error.line.is_some(), "{error}");
    }

    #[test]
    fn empty_file_is_refused() {
        let error = refused("");
        assert!(error.message.contains("empty"), "{error}");
        let error = refused("# only a comment\n");
        assert!(error.message.contains("empty"), "{error}");
    }

    #[test]
    fn duplicate_keys_are_refused() {
        let error = refused(&route_with("    upstream: http://127.0.0.1:3001\n"));
        assert_at(&error, 8, 5, "routes[0].upstream");
    }

    /// A valid config whose `redis:` section starts at line 8; `fields` start at line 9.
    fn redis_with(fields: &str) -> String {
        format!("{}redis:\n{fields}", route_with(""))
    }

    #[test]
    fn redis_auth_needs_a_key_or_an_explicit_none() {
        let base = "  url: redis://127.0.0.1\n";
        let error = refused(&redis_with(base));
        assert_eq!(error.field, "redis", "{error}");
        assert!(error.message.contains("auth: none"), "{error}");
        let off = parse(FILE, &redis_with(&format!("{base}  auth: none\n")))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(
            off.redis.map(|r| r.auth),
            Some(corral_core::peer_auth::PeerAuth::Off)
        ));
        let bad = refused(&redis_with(&format!("{base}  auth: maybe\n")));
        assert_eq!(bad.field, "redis.auth", "{bad}");
    }

    #[test]
    fn redis_auth_key_file_is_read_and_must_be_long_enough() {
        let dir = std::env::temp_dir().join(format!("corral-auth-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let (long, short) = (dir.join("long"), dir.join("short"));
        std::fs::write(&long, format!("{}\n", "k".repeat(32))).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(&short, format!("{}\n", "k".repeat(31))).unwrap_or_else(|e| panic!("{e}"));
        let with = |p: &std::path::Path| {
            redis_with(&format!(
                "  url: redis://127.0.0.1\n  auth_key_file: {}\n",
                p.display()
            ))
        };
        let keyed = parse(FILE, &with(&long)).unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(
            keyed.redis.map(|r| r.auth),
            Some(corral_core::peer_auth::PeerAuth::Key(_))
        ));
        // The trailing newline is not part of the key: 31 bytes are refused.
        let error = refused(&with(&short));
        assert_eq!(error.field, "redis.auth_key_file", "{error}");
        let both = refused(&format!("{}  auth: none\n", with(&long)));
        assert_eq!(both.field, "redis.auth_key_file", "{both}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn redis_section_absent_is_none() {
        assert!(config(&route_with("")).redis.is_none());
    }

    #[test]
    fn every_redis_field_is_read() {
        let config = config(&redis_with(
            "  url: redis://corral:s3cret@redis.internal:6380/2
  op_timeout: 20ms
  connect_timeout: 500ms
  lease_ttl: 100ms
  key_prefix: \"edge:v2:\"
  l2_max_object_size: 256KiB
  breaker: { failures: 3, open_for: 10s }
",
        ));
        let redis = config.redis.unwrap_or_else(|| panic!("no redis section"));
        assert_eq!(
            redis.servers,
            RedisServers::Node("redis://corral:s3cret@redis.internal:6380/2".into())
        );
        assert_eq!(redis.op_timeout, Duration::from_millis(20));
        assert_eq!(redis.connect_timeout, Duration::from_millis(500));
        assert_eq!(redis.lease_ttl, Duration::from_millis(100));
        assert_eq!(redis.key_prefix, "edge:v2:");
        assert_eq!(redis.l2_max_object_size, 256 * 1024);
        assert_eq!(redis.breaker_failures, 3);
        assert_eq!(redis.breaker_open_for, Duration::from_secs(10));
    }

    /// Every `redis:` field but `url` at its documented default.
    fn assert_redis_defaults(redis: &RedisConfig) {
        assert_eq!(redis.op_timeout, Duration::from_millis(50));
        assert_eq!(redis.connect_timeout, Duration::from_secs(1));
        assert_eq!(redis.lease_ttl, Duration::from_secs(3));
        assert_eq!(redis.key_prefix, "corral:");
        assert_eq!(redis.l2_max_object_size, 1024 * 1024);
        assert_eq!(redis.breaker_failures, 5);
        assert_eq!(redis.breaker_open_for, Duration::from_secs(2));
    }

    #[test]
    fn redis_defaults_fill_every_field_but_url() {
        let config = config(&redis_with("  url: redis://127.0.0.1\n"));
        let redis = config.redis.unwrap_or_else(|| panic!("no redis section"));
        assert_eq!(
            redis.servers,
            RedisServers::Node("redis://127.0.0.1".into())
        );
        assert_redis_defaults(&redis);

        // A breaker mapping with one field keeps the other's default.
        let config = self::config(&redis_with(
            "  url: redis://127.0.0.1\n  breaker: { failures: 1 }\n",
        ));
        let redis = config.redis.unwrap_or_else(|| panic!("no redis section"));
        assert_eq!(redis.breaker_failures, 1);
        assert_eq!(redis.breaker_open_for, Duration::from_secs(2));
    }

    #[test]
    fn documented_redis_section_parses_when_uncommented() {
        let example = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../config/corral.yaml"
        ))
        .unwrap_or_else(|e| panic!("{e}"));
        let mut in_block = false;
        let mut uncommented = 0;
        let text: String = example
            .lines()
            .map(|line| {
                if line == "# redis:" {
                    in_block = true;
                } else if in_block && !line.starts_with("#   ") {
                    in_block = false;
                }
                if in_block {
                    uncommented += 1;
                    format!("{}\n", &line[2..])
                } else {
                    format!("{line}\n")
                }
            })
            .collect();
        assert!(uncommented > 10, "no `# redis:` block in the example");
        let redis = config(&text)
            .redis
            .unwrap_or_else(|| panic!("uncommented block has no redis section"));
        assert_eq!(
            redis.servers,
            RedisServers::Node("redis://127.0.0.1:6379/0".into())
        );
        assert_redis_defaults(&redis);

        // The documented alternatives, each in place of `url`.
        let without_url = text.replace("  url: redis://127.0.0.1:6379/0\n", "");
        assert_ne!(without_url, text, "the example's url line moved");
        let cluster = config(&without_url.replace("  # cluster: [", "  cluster: ["))
            .redis
            .unwrap_or_else(|| panic!("no redis section"));
        assert!(
            matches!(&cluster.servers, RedisServers::Cluster(n) if n.len() == 3),
            "{:?}",
            cluster.servers
        );
        let mut sentinel = without_url.replace("  # sentinel:\n", "  sentinel:\n");
        for key in ["master", "nodes", "username", "password", "db"] {
            sentinel = sentinel.replace(&format!("  #   {key}:"), &format!("    {key}:"));
        }
        let sentinel = config(&sentinel)
            .redis
            .unwrap_or_else(|| panic!("no redis section"));
        match &sentinel.servers {
            RedisServers::Sentinel(s) => {
                assert_eq!((s.master.as_str(), s.nodes.len(), s.db), ("mymaster", 3, 0));
                assert_eq!(s.username.as_deref(), Some("corral"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn rediss_is_accepted_and_tls_on_plain_redis_is_refused() {
        let c = config(&redis_with("  url: rediss://redis.internal:6380\n"));
        assert!(c.redis.as_ref().is_some_and(|r| r.servers.tls()));
        let error = refused(&redis_with(
            "  url: redis://redis.internal:6379\n  tls: { ca_file: /nonexistent }\n",
        ));
        assert_eq!(error.field, "redis.tls");
    }

    #[test]
    fn the_runtime_is_shared_unless_per_core_is_asked_with_bounded_workers() {
        let c = config(&route_with(""));
        assert_eq!(
            (c.server.runtime, c.server.workers),
            (RuntimeMode::Shared, None)
        );
        let c = config(&format!(
            "server:\n  runtime: per_core\n  workers: 8\n{}",
            route_with("")
        ));
        assert_eq!(
            (c.server.runtime, c.server.workers),
            (RuntimeMode::PerCore, Some(8))
        );
        let c = config(&format!("server:\n  cpu_threads: 0\n{}", route_with("")));
        assert_eq!(c.server.cpu_threads, Some(0), "0: inline");
        assert_eq!(config(&route_with("")).server.cpu_threads, None);
        for (fields, column, field, hint) in [
            (
                "  runtime: threads\n",
                12,
                "server.runtime",
                "write shared or per_core",
            ),
            ("  workers: 0\n", 12, "server.workers", "at least 1"),
            (
                "  workers: 4096\n",
                12,
                "server.workers",
                "more than the 1024 allowed",
            ),
            (
                "  cpu_threads: 4096\n",
                16,
                "server.cpu_threads",
                "more than the 1024 allowed",
            ),
            (
                "  cpu_threads: some\n",
                16,
                "server.cpu_threads",
                "whole number",
            ),
        ] {
            let error = refused(&format!("server:\n{fields}{}", route_with("")));
            let message = assert_at(&error, 2, column, field);
            assert!(message.contains(hint), "{fields}: {message}");
        }
    }

    #[test]
    fn overload_sheds_at_90_percent_unless_set_or_turned_off() {
        assert_eq!(config(&route_with("")).server.overload, Some(90));
        for (value, expected) in [("50%", Some(50)), ("100", Some(100)), ("off", None)] {
            let c = config(&format!("server:\n  overload: {value}\n{}", route_with("")));
            assert_eq!(c.server.overload, expected, "{value}");
        }
        for value in ["0%", "101%", "high", "95.5%"] {
            let error = refused(&format!("server:\n  overload: {value}\n{}", route_with("")));
            let message = assert_at(&error, 2, 13, "server.overload");
            assert!(
                message.contains("whole percentage from 1 to 100"),
                "{value}: {message}"
            );
        }
    }

    #[test]
    fn a_cluster_is_its_seed_nodes_and_sentinel_its_master_name_and_sentinels() {
        let c = config(&redis_with(
            "  cluster: [redis://10.0.0.1:7000, redis://:s3cret@10.0.0.2:7000/0]\n",
        ));
        let redis = c.redis.unwrap_or_else(|| panic!("no redis"));
        assert_eq!(
            redis.servers,
            RedisServers::Cluster(vec![
                "redis://10.0.0.1:7000".into(),
                "redis://:s3cret@10.0.0.2:7000/0".into()
            ])
        );
        assert!(!redis.servers.tls());
        assert_redis_defaults(&redis);

        let c = config(&redis_with(
            "  sentinel:\n    master: cache-primary\n    nodes: [rediss://s1:26379, rediss://s2:26379]\n    username: corral\n    password: s3cret\n    db: 2\n",
        ));
        let redis = c.redis.unwrap_or_else(|| panic!("no redis"));
        assert_eq!(
            redis.servers,
            RedisServers::Sentinel(SentinelConfig {
                master: "cache-primary".into(),
                nodes: vec!["rediss://s1:26379".into(), "rediss://s2:26379".into()],
                username: Some("corral".into()),
                password: Some("s3cret".into()),
                db: 2,
            })
        );
        assert!(redis.servers.tls(), "the sentinels' scheme is the master's");
        assert!(!format!("{:?}", redis.servers).contains("s3cret"));
    }

    #[test]
    fn cluster_and_sentinel_mistakes_name_their_line_and_field() {
        for (fields, line, column, field, hint) in [
            (
                "  url: redis://a\n  cluster: [redis://b]\n",
                10,
                12,
                "redis.cluster",
                "redis.url is set too",
            ),
            ("  cluster: []\n", 9, 12, "redis.cluster", "no seed nodes"),
            (
                "  cluster: [redis://a:7000, rediss://b:7000]\n",
                9,
                29,
                "redis.cluster[1]",
                "mixes redis:// and rediss://",
            ),
            (
                "  cluster: [redis://a:7000/3]\n",
                9,
                13,
                "redis.cluster[0]",
                "only database 0",
            ),
            (
                "  sentinel: { nodes: [redis://s1] }\n",
                9,
                13,
                "redis.sentinel.master",
                "required field is missing",
            ),
            (
                "  sentinel: { master: m, nodes: [] }\n",
                9,
                33,
                "redis.sentinel.nodes",
                "no sentinels",
            ),
            (
                "  sentinel: { master: m, nodes: [redis://s1:26379/1] }\n",
                9,
                34,
                "redis.sentinel.nodes[0]",
                "a sentinel has no database",
            ),
            (
                "  sentinel: { master: m, nodes: [redis://s1], db: x }\n",
                9,
                51,
                "redis.sentinel.db",
                "not a database number",
            ),
            (
                "  sentinel: { master: 'two words', nodes: [redis://s1] }\n",
                9,
                23,
                "redis.sentinel.master",
                "one word",
            ),
            (
                "  cluster: [redis://a]\n  tls: { ca_file: /nonexistent }\n",
                10,
                8,
                "redis.tls",
                "rediss:// URLs only",
            ),
        ] {
            let error = refused(&redis_with(fields));
            let message = assert_at(&error, line, column, field);
            assert!(message.contains(hint), "{fields}: {message}");
        }
    }

    #[test]
    fn garbage_redis_urls_are_refused_without_echoing_passwords() {
        for (url, hint) in [
            ("http://127.0.0.1:6379", "unsupported scheme `http`"),
            ("127.0.0.1:6379", "no scheme"),
            ("redis://", "not a valid URL"),
            ("redis://:hunter2@127.0.0.1:0", "port 0"),
            ("redis://:hunter2@127.0.0.1/cache", "database number"),
            ("redis://127.0.0.1/0?protocol=resp3", "query parameters"),
            ("redis://:hunter2@0.0.0.0:6379", "wildcard"),
        ] {
            let error = refused(&redis_with(&format!("  url: {url}\n")));
            let message = assert_at(&error, 9, 8, "redis.url");
            assert!(message.contains(hint), "{url}: {message}");
            assert!(!error.to_string().contains("hunter2"), "{error}");
        }
    }

    #[test]
    fn missing_redis_url_is_refused() {
        let error = refused(&redis_with("  op_timeout: 10ms\n"));
        let message = assert_at(&error, 9, 3, "redis.url");
        assert!(
            message.starts_with("required field is missing"),
            "{message}"
        );
        assert!(
            message.contains("redis.cluster or redis.sentinel"),
            "{message}"
        );

        let error = refused(&redis_with("  url:\n"));
        let message = assert_at(&error, 9, 3, "redis.url");
        assert_eq!(message, "required field has no value");

        // Every line of the section commented out: not silently "no Redis".
        let error = refused(&redis_with("#  url: redis://127.0.0.1\n"));
        let message = assert_at(&error, 8, 1, "redis");
        assert!(message.contains("remove `redis:`"), "{message}");
    }

    #[test]
    fn unknown_field_in_redis_names_line_and_path() {
        let error = refused(&redis_with("  url: redis://127.0.0.1\n  bogus: 1\n"));
        assert_at(&error, 10, 3, "redis.bogus");
        assert!(
            error.message.starts_with(
                "unknown field `bogus` (expected one of: url, cluster, sentinel, op_timeout"
            ),
            "{error}"
        );

        let error = refused(&redis_with(
            "  url: redis://127.0.0.1\n  breaker: { failures: 2, cooldown: 1s }\n",
        ));
        assert_at(&error, 10, 27, "redis.breaker.cooldown");
    }

    #[test]
    fn bad_key_prefix_is_refused() {
        let too_long = format!("\"{}\"", "k".repeat(65));
        for (prefix, hint) in [
            ("\"a b\"", "whitespace"),
            ("\"corral:{x}:\"", "hash tag"),
            ("\"\"", "1 to 64"),
            (too_long.as_str(), "65 characters"),
        ] {
            let error = refused(&redis_with(&format!(
                "  url: redis://127.0.0.1\n  key_prefix: {prefix}\n"
            )));
            let message = assert_at(&error, 10, 15, "redis.key_prefix");
            assert!(message.contains(hint), "{prefix}: {message}");
        }
        // 64 characters is the limit, not past it.
        let text = redis_with(&format!(
            "  url: redis://127.0.0.1\n  key_prefix: {}\n",
            "k".repeat(64)
        ));
        assert!(config(&text).redis.is_some());
    }

    #[test]
    fn zero_op_timeout_is_refused() {
        let error = refused(&redis_with("  url: redis://127.0.0.1\n  op_timeout: 0s\n"));
        let message = assert_at(&error, 10, 15, "redis.op_timeout");
        assert_eq!(message, "must be greater than 0");

        let error = refused(&redis_with(
            "  url: redis://127.0.0.1\n  connect_timeout: 0ms\n",
        ));
        assert_at(&error, 10, 20, "redis.connect_timeout");
        let error = refused(&redis_with(
            "  url: redis://127.0.0.1\n  l2_max_object_size: 0\n",
        ));
        assert_at(&error, 10, 23, "redis.l2_max_object_size");
    }

    #[test]
    fn lease_ttl_below_100ms_is_refused() {
        let error = refused(&redis_with("  url: redis://127.0.0.1\n  lease_ttl: 99ms\n"));
        let message = assert_at(&error, 10, 14, "redis.lease_ttl");
        assert_eq!(message, "99ms is below the 100ms minimum");
    }

    #[test]
    fn breaker_needs_a_failure_and_an_open_period() {
        let error = refused(&redis_with(
            "  url: redis://127.0.0.1\n  breaker:\n    failures: 0\n",
        ));
        let message = assert_at(&error, 11, 15, "redis.breaker.failures");
        assert_eq!(
            message,
            "`0` is not a whole number of failures of at least 1"
        );

        let error = refused(&redis_with(
            "  url: redis://127.0.0.1\n  breaker: { open_for: 0s }\n",
        ));
        let message = assert_at(&error, 10, 24, "redis.breaker.open_for");
        assert_eq!(message, "must be greater than 0");
    }
}
