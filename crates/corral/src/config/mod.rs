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
    pub account: std::sync::Arc<corral_core::callers::caller::AccountSources>,
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
    pub rate: corral_core::callers::rate_limit::Rate,
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
    pub trusted_proxies: corral_core::callers::client_addr::TrustedProxies,
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
    /// The name of corral's own `Cache-Status` and `Proxy-Status` members
    /// (`server.proxy_name`, an RFC 8941 token); members from upstream in
    /// this name are removed. Default `corral`.
    pub proxy_name: String,
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
            proxy_name: corral_core::semantics::cache_status::DEFAULT_NAME.to_owned(),
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
    /// How long an entry handed off by a full Redis lives, and the bound
    /// of `lease_window`; at least 100ms.
    pub lease_ttl: Duration,
    /// How long a lease lives past its holder's last renewal (every third
    /// of it, announced to the waiters); 100ms to `lease_ttl`.
    pub lease_window: Duration,
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
    pub auth: corral_core::callers::peer_auth::PeerAuth,
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
    /// How long a fill that has a stale-if-error copy keeps its callers
    /// waiting on the origin before it answers them from the copy (the
    /// fetch goes on and replaces the copy when it answers).
    pub stale_after: Duration,
}

impl Default for TimeoutsConfig {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(2),
            response_headers: Duration::from_secs(15),
            total: Duration::from_secs(60),
            stale_after: Duration::from_secs(2),
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
    /// RFC 9111 §4.2.2 heuristic freshness from `Last-Modified`; on by default.
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
mod tests;
