//! Turns the file as written (`raw`) into `Config`: fills defaults, parses addresses,
//! durations, sizes and URIs, and checks the rules that span fields.
//! Every refusal points at the value to change. Reads the parsed file, its text, and
//! the key files `callers.account.jwt` names (read anew on every load and reload).

use std::net::SocketAddr;
use std::time::Duration;

use serde_saphyr::{Location, Spanned};

use super::duration::{describe_duration, parse_duration};
use super::paths::NodePaths;
use super::raw::{
    RawAccount, RawBackoff, RawBreaker, RawCache, RawCallers, RawCircuit, RawCoalesce, RawConfig,
    RawIdentity, RawJwt, RawLimit, RawMatch, RawRedis, RawRoute, RawRouteCache, RawServer,
    RawStaleWindow, RawTimeouts, RawTls, Text,
};
use super::size::{describe_size, parse_size};
use super::{
    CacheConfig, CircuitConfig, CoalesceConfig, Config, ConfigError, DEFAULT_BREAKER_FAILURES,
    DEFAULT_BREAKER_OPEN_FOR, DEFAULT_L2_MAX_OBJECT_SIZE, DEFAULT_MAX_FILLS,
    DEFAULT_MAX_OBJECT_SIZE, DEFAULT_REDIS_CONNECT_TIMEOUT, DEFAULT_REDIS_KEY_PREFIX,
    DEFAULT_REDIS_LEASE_TTL, DEFAULT_REDIS_OP_TIMEOUT, OnTimeout, RedisConfig, RedisServers,
    RouteCacheConfig, RouteConfig, RuntimeMode, SentinelConfig, ServerConfig, StaleWindow,
    TimeoutsConfig,
};
use super::{
    CallersConfig, DEFAULT_JWT_LEEWAY, DEFAULT_LOCAL_BUCKETS, DEFAULT_UPSTREAM_QUEUE_TIMEOUT,
    LimitConfig, LimitKey, OnRedisDown,
};
use corral_core::caller::{AccountSources, JwtKeys, JwtSource, OnInvalid};

/// hyper panics when asked to buffer less than this for a request head.
const MIN_HEADER_SIZE: u64 = 8 * 1024;
/// Above this, jitter would make most entries expire long before their TTL.
const MAX_TTL_JITTER: u8 = 50;
/// Shorter leases would expire between the watchdog's renewals under ordinary jitter.
const MIN_LEASE_TTL: Duration = Duration::from_millis(100);
/// `server.workers` at most: more threads than any machine has cores.
const MAX_WORKERS: u32 = 1024;

/// Keeps keys short and readable in `redis-cli`.
const MAX_KEY_PREFIX_CHARS: usize = 64;

/// Validates `raw`, parsed from `text`, and fills in defaults; `file` is only used in errors.
pub fn resolve(file: &str, text: &str, raw: Spanned<RawConfig>) -> Result<Config, ConfigError> {
    Resolver { file, text }.config(&raw.value, &raw.referenced)
}

/// A value in effect and where it was written; `None` when it is the default.
#[derive(Debug, Clone, Copy)]
struct Setting<T> {
    value: T,
    at: Option<Location>,
}

impl<T> Setting<T> {
    fn defaulted(value: T) -> Self {
        Self { value, at: None }
    }
}

struct Resolver<'a> {
    file: &'a str,
    text: &'a str,
}

impl Resolver<'_> {
    fn error(&self, at: &Location, field: &str, message: impl Into<String>) -> ConfigError {
        ConfigError::at(self.file, at, field, message)
    }

    fn required<'r, T>(
        &self,
        value: &'r Option<T>,
        section: &Location,
        field: &str,
    ) -> Result<&'r T, ConfigError> {
        value.as_ref().ok_or_else(|| {
            // `field:` with nothing after it parses as absent; point at the key then.
            match NodePaths::index(self.text).key_position(field) {
                Some((line, column)) => ConfigError::at_position(
                    self.file,
                    line,
                    column,
                    field,
                    "required field has no value",
                ),
                None => self.error(section, field, "required field is missing"),
            }
        })
    }

    fn config(&self, raw: &RawConfig, root: &Location) -> Result<Config, ConfigError> {
        let empty = raw.listen.is_none()
            && raw.listen_tls.is_none()
            && raw.admin.is_none()
            && raw.server.is_none()
            && raw.cache.is_none()
            && raw.redis.is_none()
            && raw.callers.is_none()
            && raw.limits.is_none()
            && raw.routes.is_none();
        if empty {
            return Err(self.error(
                root,
                "",
                "the file is empty: listen, admin, cache and routes are required",
            ));
        }
        let listen = self.socket_addr(self.required(&raw.listen, root, "listen")?, "listen")?;
        let admin_text = self.required(&raw.admin, root, "admin")?;
        let admin = self.socket_addr(admin_text, "admin")?;
        if collide(listen, admin) {
            return Err(self.error(
                &admin_text.referenced,
                "admin",
                format!(
                    "{admin} overlaps listen address {listen}; give the admin listener its own port"
                ),
            ));
        }
        let server = match &raw.server {
            Some(server) => self.server(server)?,
            None => ServerConfig::default(),
        };
        let listen_tls = match &raw.listen_tls {
            None => None,
            Some(t) => {
                let addr_text = self.required(&t.value.addr, &t.referenced, "listen_tls.addr")?;
                let addr = self.socket_addr(addr_text, "listen_tls.addr")?;
                if collide(addr, listen) || collide(addr, admin) {
                    return Err(self.error(
                        &addr_text.referenced,
                        "listen_tls.addr",
                        format!("{addr} overlaps listen or admin; give it its own port"),
                    ));
                }
                let cert =
                    self.required(&t.value.cert_file, &t.referenced, "listen_tls.cert_file")?;
                let key = self.required(&t.value.key_file, &t.referenced, "listen_tls.key_file")?;
                let (cert_pem, key_pem) = (
                    self.read_file(cert, "listen_tls.cert_file")?,
                    self.read_file(key, "listen_tls.key_file")?,
                );
                if let Err(e) = super::tls::server_config(&cert_pem, &key_pem) {
                    let at = if e.field == "key_file" { key } else { cert };
                    return Err(self.error(
                        &at.referenced,
                        &format!("listen_tls.{}", e.field),
                        e.message,
                    ));
                }
                Some(super::ListenTls {
                    addr,
                    cert_file: cert.value.trim().into(),
                    key_file: key.value.trim().into(),
                })
            }
        };
        let cache = self.cache(self.required(&raw.cache, root, "cache")?)?;
        let redis = match &raw.redis {
            Some(redis) => Some(self.redis(redis)?),
            None => {
                // `redis:` with nothing under it parses as absent; running without Redis
                // because every line of the section was commented out would be a surprise.
                if let Some((line, column)) = NodePaths::index(self.text).key_position("redis") {
                    return Err(ConfigError::at_position(
                        self.file,
                        line,
                        column,
                        "redis",
                        "empty section: redis.url is required (remove `redis:` to run without Redis)",
                    ));
                }
                None
            }
        };
        let callers = match &raw.callers {
            Some(c) => self.callers(c)?,
            None => CallersConfig::default(),
        };
        let limits = match &raw.limits {
            Some(l) => self.limits(l, "limits")?,
            None => Vec::new(),
        };
        let routes = self.routes(self.required(&raw.routes, root, "routes")?)?;
        // Every limit that counts accounts needs a source of them.
        if callers.account.is_empty() {
            let global = raw.limits.iter().map(|l| (l, "limits".to_owned()));
            let per_route = raw
                .routes
                .iter()
                .flat_map(|r| r.value.iter())
                .enumerate()
                .filter_map(|(i, r)| {
                    r.value
                        .limits
                        .as_ref()
                        .map(|l| (l, format!("routes[{i}].limits")))
                });
            for (list, prefix) in global.chain(per_route) {
                for (i, l) in list.value.iter().enumerate() {
                    if let Some(k) = &l.value.key
                        && k.value.trim() != "ip"
                    {
                        return Err(self.error(
                            &k.referenced,
                            &format!("{prefix}[{i}].key"),
                            "counts accounts, but callers.account names no source (jwt, header or api_key_header)",
                        ));
                    }
                }
            }
        }
        // A route's limit may not share a name with a global one: the
        // name is what headers, metrics and logs tell apart.
        for (i, r) in routes.iter().enumerate() {
            if let Some((j, l)) = r
                .limits
                .iter()
                .enumerate()
                .find(|(_, l)| limits.iter().any(|g| g.name == l.name))
            {
                let at = raw
                    .routes
                    .as_ref()
                    .and_then(|rs| rs.value.get(i))
                    .and_then(|r| r.value.limits.as_ref())
                    .and_then(|ls| ls.value.get(j))
                    .and_then(|l| l.value.name.as_ref())
                    .map_or(Location::UNKNOWN, |n| n.referenced);
                return Err(self.error(
                    &at,
                    &format!("routes[{i}].limits[{j}].name"),
                    format!("`{}` is also the name of a global limit", l.name),
                ));
            }
        }
        Ok(Config {
            listen,
            listen_tls,
            admin,
            server,
            cache,
            redis,
            callers,
            limits,
            routes,
        })
    }

    fn socket_addr(&self, text: &Text, field: &str) -> Result<SocketAddr, ConfigError> {
        text.value.trim().parse().map_err(|_| {
            self.error(
                &text.referenced,
                field,
                format!(
                    "`{}` is not an IP address and port such as 127.0.0.1:8080 (host names are not resolved)",
                    text.value
                ),
            )
        })
    }

    fn server(&self, raw: &RawServer) -> Result<ServerConfig, ConfigError> {
        let defaults = ServerConfig::default();
        let header_read_timeout = self.duration(
            raw.header_read_timeout.as_ref(),
            "server.header_read_timeout",
            defaults.header_read_timeout,
        )?;
        self.positive(&header_read_timeout, "server.header_read_timeout")?;
        let idle_timeout = self.duration(
            raw.idle_timeout.as_ref(),
            "server.idle_timeout",
            defaults.idle_timeout,
        )?;
        self.positive(&idle_timeout, "server.idle_timeout")?;
        let send_timeout = self.duration(
            raw.send_timeout.as_ref(),
            "server.send_timeout",
            defaults.send_timeout,
        )?;
        self.positive(&send_timeout, "server.send_timeout")?;
        let min_send_rate = self.size(
            raw.min_send_rate.as_ref(),
            "server.min_send_rate",
            defaults.min_send_rate,
        )?;
        let max_connections = match &raw.max_connections {
            None => None,
            Some(t) => Some(
                whole_number(&t.value, 1, "connections")
                    .map_err(|m| self.error(&t.referenced, "server.max_connections", m))?,
            ),
        };
        let max_header_size = self.size(
            raw.max_header_size.as_ref(),
            "server.max_header_size",
            defaults.max_header_size,
        )?;
        if max_header_size.value < MIN_HEADER_SIZE {
            return Err(self.blame(
                &max_header_size,
                "server.max_header_size",
                format!(
                    "{} is below the 8KiB minimum the HTTP/1 server accepts",
                    describe_size(max_header_size.value)
                ),
            ));
        }
        let shutdown_grace = self.duration(
            raw.shutdown_grace.as_ref(),
            "server.shutdown_grace",
            defaults.shutdown_grace,
        )?;
        let drain_period = self.duration(
            raw.drain_period.as_ref(),
            "server.drain_period",
            defaults.drain_period,
        )?;
        let purge_token = match raw.purge_token.as_ref() {
            None => None,
            Some(t) => {
                let token = t.value.trim();
                if token.len() < 16 {
                    return Err(self.error(
                        &t.referenced,
                        "server.purge_token",
                        "must be at least 16 characters: it guards cache purges",
                    ));
                }
                Some(token.to_owned())
            }
        };
        let trusted_proxies = match &raw.trusted_proxies {
            None => corral_core::client_addr::TrustedProxies::default(),
            Some(entries) => corral_core::client_addr::TrustedProxies::new(
                entries
                    .iter()
                    .enumerate()
                    .map(|(index, entry)| {
                        corral_core::client_addr::Cidr::parse(&entry.value).map_err(|m| {
                            self.error(
                                &entry.referenced,
                                &format!("server.trusted_proxies[{index}]"),
                                m,
                            )
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            ),
        };
        let trusted_proxies = match &raw.trusted_header {
            None => trusted_proxies,
            Some(t) => trusted_proxies.believing(match t.value.trim() {
                "x-forwarded-for" => corral_core::client_addr::TrustedHeader::XForwardedFor,
                "forwarded" => corral_core::client_addr::TrustedHeader::Forwarded,
                other => {
                    return Err(self.error(
                        &t.referenced,
                        "server.trusted_header",
                        format!("`{other}` is not one of x-forwarded-for, forwarded: name the header your proxies write"),
                    ));
                }
            }),
        };
        let runtime = match &raw.runtime {
            None => RuntimeMode::Shared,
            Some(t) => match t.value.trim() {
                "shared" => RuntimeMode::Shared,
                "per_core" => RuntimeMode::PerCore,
                other => {
                    return Err(self.error(
                        &t.referenced,
                        "server.runtime",
                        format!("`{other}` is not a runtime: write shared or per_core"),
                    ));
                }
            },
        };
        let workers = match &raw.workers {
            None => None,
            Some(t) => match whole_u32(&t.value, 1, "threads") {
                Ok(n) if n <= MAX_WORKERS => Some(usize::try_from(n).unwrap_or(1)),
                Ok(n) => {
                    return Err(self.error(
                        &t.referenced,
                        "server.workers",
                        format!("{n} threads is more than the {MAX_WORKERS} allowed"),
                    ));
                }
                Err(m) => return Err(self.error(&t.referenced, "server.workers", m)),
            },
        };
        Ok(ServerConfig {
            runtime,
            workers,
            trusted_proxies,
            listen_proxy_protocol: raw.listen_proxy_protocol.unwrap_or(false),
            purge_token,
            header_read_timeout: header_read_timeout.value,
            idle_timeout: idle_timeout.value,
            send_timeout: send_timeout.value,
            min_send_rate: min_send_rate.value,
            max_connections,
            max_header_size: max_header_size.value,
            shutdown_grace: shutdown_grace.value,
            drain_period: drain_period.value,
        })
    }

    fn cache(&self, raw: &Spanned<RawCache>) -> Result<CacheConfig, ConfigError> {
        let memory_text = self.required(&raw.value.memory, &raw.referenced, "cache.memory")?;
        let memory = self.size(Some(memory_text), "cache.memory", 0)?;
        if memory.value == 0 {
            return Err(self.blame(&memory, "cache.memory", "must be greater than 0"));
        }
        let max_object_size = self.size(
            raw.value.max_object_size.as_ref(),
            "cache.max_object_size",
            DEFAULT_MAX_OBJECT_SIZE,
        )?;
        if max_object_size.value == 0 {
            return Err(self.blame(
                &max_object_size,
                "cache.max_object_size",
                "must be greater than 0",
            ));
        }
        self.ordered(
            (&max_object_size, "cache.max_object_size"),
            (&memory, "cache.memory"),
            describe_size,
        )?;
        // By default fills may buffer a quarter of what the cache holds, and
        // always enough for one object of the largest storable size.
        let fill_memory = self.size(
            raw.value.fill_memory.as_ref(),
            "cache.fill_memory",
            (memory.value / 4).max(max_object_size.value),
        )?;
        self.ordered(
            (&max_object_size, "cache.max_object_size"),
            (&fill_memory, "cache.fill_memory"),
            describe_size,
        )?;
        // Coalesced POST bodies: a sixteenth of the fills' memory by default.
        let post_memory = self.size(
            raw.value.post_memory.as_ref(),
            "cache.post_memory",
            (fill_memory.value / 16).max(1),
        )?;
        if post_memory.value == 0 {
            return Err(self.blame(&post_memory, "cache.post_memory", "must be greater than 0"));
        }
        let max_fills = match &raw.value.max_fills {
            None => DEFAULT_MAX_FILLS,
            Some(t) => whole_number(&t.value, 1, "fills")
                .map_err(|m| self.error(&t.referenced, "cache.max_fills", m))?,
        };
        Ok(CacheConfig {
            memory: memory.value,
            max_object_size: max_object_size.value,
            fill_memory: fill_memory.value,
            post_memory: post_memory.value,
            max_fills,
        })
    }

    fn redis(&self, raw: &Spanned<RawRedis>) -> Result<RedisConfig, ConfigError> {
        let at = &raw.referenced;
        let raw = &raw.value;
        let servers = self.redis_servers(at, raw)?;
        let op_timeout = self.duration(
            raw.op_timeout.as_ref(),
            "redis.op_timeout",
            DEFAULT_REDIS_OP_TIMEOUT,
        )?;
        self.positive(&op_timeout, "redis.op_timeout")?;
        let connect_timeout = self.duration(
            raw.connect_timeout.as_ref(),
            "redis.connect_timeout",
            DEFAULT_REDIS_CONNECT_TIMEOUT,
        )?;
        self.positive(&connect_timeout, "redis.connect_timeout")?;
        let lease_ttl = self.duration(
            raw.lease_ttl.as_ref(),
            "redis.lease_ttl",
            DEFAULT_REDIS_LEASE_TTL,
        )?;
        if lease_ttl.value < MIN_LEASE_TTL {
            return Err(self.blame(
                &lease_ttl,
                "redis.lease_ttl",
                format!(
                    "{} is below the {} minimum",
                    describe_duration(lease_ttl.value),
                    describe_duration(MIN_LEASE_TTL)
                ),
            ));
        }
        let key_prefix = match &raw.key_prefix {
            Some(text) => key_prefix(&text.value)
                .map_err(|m| self.error(&text.referenced, "redis.key_prefix", m))?,
            None => DEFAULT_REDIS_KEY_PREFIX.to_owned(),
        };
        let l2_max_object_size = self.size(
            raw.l2_max_object_size.as_ref(),
            "redis.l2_max_object_size",
            DEFAULT_L2_MAX_OBJECT_SIZE,
        )?;
        if l2_max_object_size.value == 0 {
            return Err(self.blame(
                &l2_max_object_size,
                "redis.l2_max_object_size",
                "must be greater than 0",
            ));
        }
        let (breaker_failures, breaker_open_for) = match &raw.breaker {
            Some(breaker) => self.breaker(breaker)?,
            None => (DEFAULT_BREAKER_FAILURES, DEFAULT_BREAKER_OPEN_FOR),
        };
        let instances = match &raw.instances {
            None => 1,
            Some(t) => whole_u32(&t.value, 1, "instances")
                .map_err(|m| self.error(&t.referenced, "redis.instances", m))?,
        };
        let tls = match (&raw.tls, servers.tls()) {
            (None, _) => None,
            (Some(t), false) => {
                return Err(self.error(
                    &t.referenced,
                    "redis.tls",
                    "applies to rediss:// URLs only",
                ));
            }
            (Some(t), true) => {
                let read = |x: &Option<Text>, field: &str| {
                    self.read_optional(x.as_ref(), &format!("redis.tls.{field}"))
                };
                let ca = read(&t.value.ca_file, "ca_file")?;
                let cert = read(&t.value.client_cert, "client_cert")?;
                let key = read(&t.value.client_key, "client_key")?;
                // The same checks as an upstream's: PEM that rustls takes.
                let files = super::tls::TlsFiles {
                    ca: ca.clone(),
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                    server_name: None,
                    insecure_skip_verify: false,
                };
                if let Err(e) = super::tls::build(&files) {
                    let at = match e.field {
                        "ca_file" => t.value.ca_file.as_ref(),
                        "client_cert" => t.value.client_cert.as_ref(),
                        "client_key" => t.value.client_key.as_ref(),
                        _ => None,
                    }
                    .map_or(t.referenced, |x| x.referenced);
                    return Err(self.error(&at, &format!("redis.tls.{}", e.field), e.message));
                }
                Some(super::RedisTls {
                    ca,
                    client_cert_and_key: cert.zip(key),
                })
            }
        };
        Ok(RedisConfig {
            tls,
            instances,
            servers,
            op_timeout: op_timeout.value,
            connect_timeout: connect_timeout.value,
            lease_ttl: lease_ttl.value,
            key_prefix,
            l2_max_object_size: l2_max_object_size.value,
            breaker_failures,
            breaker_open_for,
        })
    }

    /// Exactly one of `url`, `cluster` and `sentinel`.
    fn redis_servers(&self, at: &Location, raw: &RawRedis) -> Result<RedisServers, ConfigError> {
        let given: Vec<(&str, Location)> = [
            ("redis.url", raw.url.as_ref().map(|t| t.referenced)),
            ("redis.cluster", raw.cluster.as_ref().map(|t| t.referenced)),
            (
                "redis.sentinel",
                raw.sentinel.as_ref().map(|t| t.referenced),
            ),
        ]
        .into_iter()
        .filter_map(|(field, at)| at.map(|at| (field, at)))
        .collect();
        if let [_, (field, second), ..] = given.as_slice() {
            return Err(self.error(
                second,
                field,
                format!(
                    "{} is set too: give one of redis.url (one node), redis.cluster or redis.sentinel",
                    given[0].0
                ),
            ));
        }
        if let Some(url) = &raw.url {
            let url =
                redis_url(&url.value).map_err(|m| self.error(&url.referenced, "redis.url", m))?;
            return Ok(RedisServers::Node(url));
        }
        if let Some(seeds) = &raw.cluster {
            let nodes = self.nodes(
                seeds,
                "redis.cluster",
                "no seed nodes: list one or more nodes of the cluster",
                cluster_node_url,
            )?;
            return Ok(RedisServers::Cluster(nodes));
        }
        if let Some(sentinel) = &raw.sentinel {
            let s = &sentinel.value;
            let master = self.required(&s.master, &sentinel.referenced, "redis.sentinel.master")?;
            let name = master.value.trim();
            if name.is_empty() || name.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(self.error(
                    &master.referenced,
                    "redis.sentinel.master",
                    "the master's name is one word, as in the sentinels' `sentinel monitor NAME …`",
                ));
            }
            let listed = self.required(&s.nodes, &sentinel.referenced, "redis.sentinel.nodes")?;
            let nodes = self.nodes(
                listed,
                "redis.sentinel.nodes",
                "no sentinels: list the address of each",
                sentinel_node_url,
            )?;
            let db = match &s.db {
                None => 0,
                Some(t) => t.value.trim().parse::<u32>().map_err(|_| {
                    self.error(
                        &t.referenced,
                        "redis.sentinel.db",
                        format!("`{}` is not a database number", t.value),
                    )
                })?,
            };
            let text = |t: &Option<Text>| t.as_ref().map(|t| t.value.clone());
            return Ok(RedisServers::Sentinel(SentinelConfig {
                master: name.to_owned(),
                nodes,
                username: text(&s.username),
                password: text(&s.password),
                db: i64::from(db),
            }));
        }
        // `url:` with nothing after it: point at that line.
        if NodePaths::index(self.text)
            .key_position("redis.url")
            .is_some()
        {
            self.required(&raw.url, at, "redis.url")?;
        }
        Err(self.error(
            at,
            "redis.url",
            "required field is missing: give redis.url (one node), redis.cluster or redis.sentinel",
        ))
    }

    /// A list of Redis nodes (`field`): not empty, each one `check`ed, and
    /// every one reached with TLS or none.
    fn nodes(
        &self,
        listed: &Spanned<Vec<Text>>,
        field: &str,
        when_empty: &str,
        check: fn(&str) -> Result<String, String>,
    ) -> Result<Vec<String>, ConfigError> {
        if listed.value.is_empty() {
            return Err(self.error(&listed.referenced, field, when_empty));
        }
        let urls = self.list(&listed.value, field, check)?;
        let tls = |u: &String| u.starts_with("rediss://");
        match urls.iter().position(|u| tls(u) != tls(&urls[0])) {
            None => Ok(urls),
            Some(i) => Err(self.error(
                &listed.value[i].referenced,
                &format!("{field}[{i}]"),
                "mixes redis:// and rediss://: every node is reached the same way",
            )),
        }
    }

    fn breaker(&self, raw: &RawBreaker) -> Result<(u32, Duration), ConfigError> {
        let failures = match &raw.failures {
            Some(text) => breaker_failures(&text.value)
                .map_err(|m| self.error(&text.referenced, "redis.breaker.failures", m))?,
            None => DEFAULT_BREAKER_FAILURES,
        };
        let open_for = self.duration(
            raw.open_for.as_ref(),
            "redis.breaker.open_for",
            DEFAULT_BREAKER_OPEN_FOR,
        )?;
        self.positive(&open_for, "redis.breaker.open_for")?;
        Ok((failures, open_for.value))
    }

    fn routes(
        &self,
        raw: &Spanned<Vec<Spanned<RawRoute>>>,
    ) -> Result<Vec<RouteConfig>, ConfigError> {
        if raw.value.is_empty() {
            return Err(self.error(&raw.referenced, "routes", "at least one route is required"));
        }
        let mut routes: Vec<RouteConfig> = Vec::with_capacity(raw.value.len());
        for (index, raw_route) in raw.value.iter().enumerate() {
            let prefix = format!("routes[{index}]");
            let route = self.route(raw_route, &prefix)?;
            if let Some((first, earlier)) = routes
                .iter()
                .enumerate()
                .find(|(_, r)| r.name == route.name)
            {
                let at = raw_route
                    .value
                    .name
                    .as_ref()
                    .map_or(raw_route.referenced, |n| n.referenced);
                return Err(self.error(
                    &at,
                    &format!("{prefix}.name"),
                    format!(
                        "duplicate route name `{}` (already used by routes[{first}])",
                        earlier.name
                    ),
                ));
            }
            if let Some((first, earlier)) = routes
                .iter()
                .enumerate()
                .find(|(_, r)| r.host == route.host && r.path_prefix == route.path_prefix)
            {
                let (at, field) = match_location(raw_route, &prefix);
                return Err(self.error(
                    &at,
                    &field,
                    format!(
                        "same host and path_prefix as routes[{first}] (`{}`), so this route would never be used",
                        earlier.name
                    ),
                ));
            }
            routes.push(route);
        }
        Ok(routes)
    }

    fn route(&self, raw: &Spanned<RawRoute>, prefix: &str) -> Result<RouteConfig, ConfigError> {
        let at = &raw.referenced;
        let raw = &raw.value;
        let name_field = format!("{prefix}.name");
        let name = self.required(&raw.name, at, &name_field)?;
        let name =
            route_name(&name.value).map_err(|m| self.error(&name.referenced, &name_field, m))?;

        let (host, path_prefix) = match &raw.matcher {
            Some(matcher) => self.matcher(matcher, prefix)?,
            None => (None, "/".to_owned()),
        };

        let upstream_field = format!("{prefix}.upstream");
        let (upstream, upstream_at, upstreams) = match (&raw.upstream, &raw.upstreams) {
            (Some(u), None) => {
                let uri = upstream_uri(&u.value)
                    .map_err(|m| self.error(&u.referenced, &upstream_field, m))?;
                (uri.clone(), u.referenced, vec![uri])
            }
            (None, Some(list)) => {
                let field = format!("{prefix}.upstreams");
                if list.value.is_empty() {
                    return Err(self.error(&list.referenced, &field, "names no server"));
                }
                let mut uris: Vec<http::Uri> = Vec::with_capacity(list.value.len());
                for (i, t) in list.value.iter().enumerate() {
                    let f = format!("{field}[{i}]");
                    let uri =
                        upstream_uri(&t.value).map_err(|m| self.error(&t.referenced, &f, m))?;
                    if uri.scheme() != uris.first().map_or(uri.scheme(), |u| u.scheme()) {
                        return Err(self.error(
                            &t.referenced,
                            &f,
                            "all servers of a route use one scheme",
                        ));
                    }
                    if uris.iter().any(|u| u.authority() == uri.authority()) {
                        return Err(self.error(&t.referenced, &f, "named twice"));
                    }
                    uris.push(uri);
                }
                (uris[0].clone(), list.referenced, uris)
            }
            (Some(_), Some(list)) => {
                return Err(self.error(
                    &list.referenced,
                    &format!("{prefix}.upstreams"),
                    "give upstream (one server) or upstreams (several), not both",
                ));
            }
            (None, None) => {
                self.required(&raw.upstream, at, &upstream_field)?;
                unreachable!("required() refused the missing field")
            }
        };
        let balance = match &raw.balance {
            None => crate::origin::pool::Balance::RoundRobin,
            Some(t) => match t.value.trim() {
                "round_robin" => crate::origin::pool::Balance::RoundRobin,
                "least_outstanding" => crate::origin::pool::Balance::LeastOutstanding,
                other => {
                    return Err(self.error(
                        &t.referenced,
                        &format!("{prefix}.balance"),
                        format!("`{other}` is not one of round_robin, least_outstanding"),
                    ));
                }
            },
        };
        let health = match &raw.health {
            None => super::HealthConfig::default(),
            Some(h) => {
                let d = super::HealthConfig::default();
                let p = format!("{prefix}.health");
                let max_fails = match &h.max_fails {
                    None => d.max_fails,
                    Some(t) => whole_u32(&t.value, 1, "failures")
                        .map_err(|m| self.error(&t.referenced, &format!("{p}.max_fails"), m))?,
                };
                let ft = format!("{p}.fail_timeout");
                let fail_timeout = self.duration(h.fail_timeout.as_ref(), &ft, d.fail_timeout)?;
                self.positive(&fail_timeout, &ft)?;
                let ci = format!("{p}.check_interval");
                let check_interval =
                    self.duration(h.check_interval.as_ref(), &ci, d.check_interval)?;
                self.positive(&check_interval, &ci)?;
                let check_path =
                    match &h.check_path {
                        None => None,
                        Some(t) => Some(match_path_prefix(&t.value).map_err(|m| {
                            self.error(&t.referenced, &format!("{p}.check_path"), m)
                        })?),
                    };
                super::HealthConfig {
                    max_fails,
                    fail_timeout: fail_timeout.value,
                    check_path,
                    check_interval: check_interval.value,
                }
            }
        };
        let tls = match (upstream.scheme_str(), &raw.tls) {
            (Some("https"), tls) => Some(self.tls(tls.as_ref(), &upstream_at, prefix)?),
            (_, None) => None,
            (_, Some(t)) => {
                return Err(self.error(
                    &t.referenced,
                    &format!("{prefix}.tls"),
                    "applies to https:// upstreams only",
                ));
            }
        };

        let timeouts = match &raw.timeouts {
            Some(timeouts) => self.timeouts(timeouts, &format!("{prefix}.timeouts"))?,
            None => TimeoutsConfig::default(),
        };
        let cache = match &raw.cache {
            Some(cache) => self.route_cache(cache, &format!("{prefix}.cache"))?,
            None => RouteCacheConfig::default(),
        };
        let coalesce = match &raw.coalesce {
            Some(coalesce) => self.coalesce(coalesce, &format!("{prefix}.coalesce"))?,
            None => CoalesceConfig::default(),
        };
        let backoff = match &raw.backoff {
            Some(b) => self.backoff(b, &format!("{prefix}.backoff"))?,
            None => corral_core::BackoffPolicy::default(),
        };
        let circuit = match &raw.circuit {
            Some(c) => self.circuit(c, &format!("{prefix}.circuit"))?,
            None => CircuitConfig::default(),
        };
        let limits = match &raw.limits {
            Some(l) => self.limits(l, &format!("{prefix}.limits"))?,
            None => Vec::new(),
        };
        let upstream_concurrency = match &raw.upstream_concurrency {
            None => None,
            Some(t) => Some(whole_u32(&t.value, 1, "requests").map_err(|m| {
                self.error(&t.referenced, &format!("{prefix}.upstream_concurrency"), m)
            })?),
        };
        let queue_field = format!("{prefix}.upstream_queue_timeout");
        let queue = self.duration(
            raw.upstream_queue_timeout.as_ref(),
            &queue_field,
            DEFAULT_UPSTREAM_QUEUE_TIMEOUT,
        )?;
        // Also how long a passed-through request waits for an upstream
        // socket (origin/descriptors.rs), so it applies without
        // upstream_concurrency too.
        self.positive(&queue, &queue_field)?;
        let upstream_http2 = raw.upstream_http2.unwrap_or(false);
        if upstream_http2 && tls.is_none() {
            return Err(self.error(
                at,
                &format!("{prefix}.upstream_http2"),
                "needs an https:// upstream (h2 is offered by ALPN; h2c is not supported)",
            ));
        }
        Ok(RouteConfig {
            upstream_http2,
            upstreams,
            balance,
            health,
            tls,
            limits,
            upstream_concurrency,
            upstream_queue_timeout: queue.value,
            name,
            host,
            path_prefix,
            upstream,
            timeouts,
            cache,
            coalesce,
            backoff,
            circuit,
        })
    }

    /// An https upstream's TLS: the files of `tls:` read and checked, or
    /// the defaults (platform roots, SNI from the upstream host).
    fn tls(
        &self,
        raw: Option<&Spanned<RawTls>>,
        upstream_at: &Location,
        prefix: &str,
    ) -> Result<super::tls::UpstreamTls, ConfigError> {
        let p = format!("{prefix}.tls");
        let read =
            |t: &Option<Text>, field: &str| self.read_optional(t.as_ref(), &format!("{p}.{field}"));
        let files = match raw {
            None => super::tls::TlsFiles {
                ca: None,
                client_cert: None,
                client_key: None,
                server_name: None,
                insecure_skip_verify: false,
            },
            Some(t) => super::tls::TlsFiles {
                ca: read(&t.value.ca_file, "ca_file")?,
                client_cert: read(&t.value.client_cert, "client_cert")?,
                client_key: read(&t.value.client_key, "client_key")?,
                server_name: t.value.server_name.as_ref().map(|n| n.value.clone()),
                insecure_skip_verify: t.value.insecure_skip_verify.unwrap_or(false),
            },
        };
        super::tls::build(&files).map_err(|e| {
            let at = raw.map_or(*upstream_at, |t| {
                let v = &t.value;
                match e.field {
                    "ca_file" => v.ca_file.as_ref(),
                    "client_cert" => v.client_cert.as_ref(),
                    "client_key" => v.client_key.as_ref(),
                    "server_name" => v.server_name.as_ref(),
                    _ => None,
                }
                .map_or(t.referenced, |x| x.referenced)
            });
            let field = if e.field.is_empty() {
                p.clone()
            } else {
                format!("{p}.{}", e.field)
            };
            self.error(&at, &field, e.message)
        })
    }

    fn callers(&self, raw: &Spanned<RawCallers>) -> Result<CallersConfig, ConfigError> {
        let local_buckets = match &raw.value.local_buckets {
            None => DEFAULT_LOCAL_BUCKETS,
            Some(t) => whole_number(&t.value, 1, "callers")
                .map(|n| n as u64)
                .map_err(|m| self.error(&t.referenced, "callers.local_buckets", m))?,
        };
        let account = match &raw.value.account {
            Some(a) => self.account(a)?,
            None => AccountSources::default(),
        };
        Ok(CallersConfig {
            account: std::sync::Arc::new(account),
            local_buckets,
        })
    }

    fn account(&self, raw: &Spanned<RawAccount>) -> Result<AccountSources, ConfigError> {
        let header_name = |t: &Text, field: &str| {
            http::header::HeaderName::from_bytes(t.value.trim().as_bytes()).map_err(|_| {
                self.error(
                    &t.referenced,
                    field,
                    format!("`{}` is not a header name", t.value),
                )
            })
        };
        let sources = AccountSources {
            jwt: match &raw.value.jwt {
                Some(j) => Some(self.jwt(j)?),
                None => None,
            },
            header: raw
                .value
                .header
                .as_ref()
                .map(|t| header_name(t, "callers.account.header"))
                .transpose()?,
            api_key_header: raw
                .value
                .api_key_header
                .as_ref()
                .map(|t| header_name(t, "callers.account.api_key_header"))
                .transpose()?,
        };
        if sources.is_empty() {
            return Err(self.error(
                &raw.referenced,
                "callers.account",
                "names no source: give jwt, header or api_key_header",
            ));
        }
        Ok(sources)
    }

    fn jwt(&self, raw: &Spanned<RawJwt>) -> Result<JwtSource, ConfigError> {
        let at = &raw.referenced;
        let raw = &raw.value;
        let p = "callers.account.jwt";
        let read = |t: &Text, field: &str| self.read_file(t, field);
        let keys = match (&raw.hs256_secret_file, &raw.jwks_file) {
            (Some(secret), None) => {
                let field = format!("{p}.hs256_secret_file");
                let bytes = read(secret, &field)?;
                // A trailing newline from `echo > file` is not part of the secret.
                let bytes = bytes.strip_suffix(b"\n").unwrap_or(&bytes);
                JwtKeys::hs256(bytes).map_err(|m| self.error(&secret.referenced, &field, m))?
            }
            (None, Some(jwks)) => {
                let field = format!("{p}.jwks_file");
                let bytes = read(jwks, &field)?;
                let text = String::from_utf8_lossy(&bytes);
                JwtKeys::jwks(&text).map_err(|m| {
                    self.error(
                        &jwks.referenced,
                        &field,
                        format!("{}: {m}", jwks.value.trim()),
                    )
                })?
            }
            (Some(_), Some(j)) => {
                return Err(self.error(
                    &j.referenced,
                    &format!("{p}.jwks_file"),
                    "give hs256_secret_file or jwks_file, not both",
                ));
            }
            (None, None) => {
                return Err(self.error(
                    at,
                    p,
                    "needs hs256_secret_file or jwks_file (tokens are verified, never trusted as sent)",
                ));
            }
        };
        let header = match &raw.header {
            None => http::header::AUTHORIZATION,
            Some(t) => {
                http::header::HeaderName::from_bytes(t.value.trim().as_bytes()).map_err(|_| {
                    self.error(
                        &t.referenced,
                        &format!("{p}.header"),
                        format!("`{}` is not a header name", t.value),
                    )
                })?
            }
        };
        let text = |t: &Option<Text>, field: &str| -> Result<Option<String>, ConfigError> {
            match t {
                None => Ok(None),
                Some(t) if t.value.trim().is_empty() => {
                    Err(self.error(&t.referenced, &format!("{p}.{field}"), "must not be empty"))
                }
                Some(t) => Ok(Some(t.value.trim().to_owned())),
            }
        };
        let leeway = self.duration(
            raw.leeway.as_ref(),
            &format!("{p}.leeway"),
            DEFAULT_JWT_LEEWAY,
        )?;
        let on_invalid = match &raw.on_invalid {
            None => OnInvalid::Guest,
            Some(t) => match t.value.trim() {
                "guest" => OnInvalid::Guest,
                "reject" => OnInvalid::Reject,
                other => {
                    return Err(self.error(
                        &t.referenced,
                        &format!("{p}.on_invalid"),
                        format!("`{other}` is not one of guest, reject"),
                    ));
                }
            },
        };
        Ok(JwtSource {
            header,
            keys,
            claim: text(&raw.claim, "claim")?.unwrap_or_else(|| "sub".into()),
            issuer: text(&raw.issuer, "issuer")?,
            audience: text(&raw.audience, "audience")?,
            leeway: leeway.value,
            on_invalid,
        })
    }

    fn limits(
        &self,
        raw: &Spanned<Vec<Spanned<RawLimit>>>,
        prefix: &str,
    ) -> Result<Vec<LimitConfig>, ConfigError> {
        let mut out: Vec<LimitConfig> = Vec::with_capacity(raw.value.len());
        for (i, l) in raw.value.iter().enumerate() {
            let lp = format!("{prefix}[{i}]");
            let at = &l.referenced;
            let l = &l.value;
            let name_field = format!("{lp}.name");
            let name = self.required(&l.name, at, &name_field)?;
            let name_text = route_name(&name.value)
                .map_err(|m| self.error(&name.referenced, &name_field, m))?;
            if out.iter().any(|o| o.name == name_text) {
                return Err(self.error(
                    &name.referenced,
                    &name_field,
                    format!("duplicate limit name `{name_text}` in this route"),
                ));
            }
            let key_field = format!("{lp}.key");
            let key = self.required(&l.key, at, &key_field)?;
            let key_kind = match key.value.trim() {
                "account" => LimitKey::Account,
                "ip" => LimitKey::Ip,
                "account_or_ip" => LimitKey::AccountOrIp,
                other => {
                    return Err(self.error(
                        &key.referenced,
                        &key_field,
                        format!("`{other}` is not one of account, ip, account_or_ip"),
                    ));
                }
            };
            let rate_field = format!("{lp}.rate");
            let rate = self.required(&l.rate, at, &rate_field)?;
            let rate_value = corral_core::rate_limit::Rate::parse(&rate.value)
                .map_err(|m| self.error(&rate.referenced, &rate_field, m))?;
            let burst = match &l.burst {
                None => rate_value.count,
                Some(t) => whole_u32(&t.value, 1, "requests")
                    .map_err(|m| self.error(&t.referenced, &format!("{lp}.burst"), m))?,
            };
            let prefix_len =
                |t: &Option<Text>, default: u8, max: u8, field: &str| -> Result<u8, ConfigError> {
                    match t {
                        None => Ok(default),
                        Some(t) => whole_number(&t.value, 1, "bits")
                            .ok()
                            .and_then(|n| u8::try_from(n).ok())
                            .filter(|n| *n <= max)
                            .ok_or_else(|| {
                                self.error(
                                    &t.referenced,
                                    &format!("{lp}.{field}"),
                                    format!("`{}` is not a prefix length from 1 to {max}", t.value),
                                )
                            }),
                    }
                };
            let ipv4_prefix = prefix_len(&l.ipv4_prefix, 32, 32, "ipv4_prefix")?;
            // A /64 is what one IPv6 customer is handed (RFC 6177): counted
            // per address, a customer gets a new bucket per address it makes up.
            let ipv6_prefix = prefix_len(&l.ipv6_prefix, 64, 128, "ipv6_prefix")?;
            if key_kind == LimitKey::Account
                && let Some(t) = l.ipv4_prefix.as_ref().or(l.ipv6_prefix.as_ref())
            {
                return Err(self.error(
                    &t.referenced,
                    &format!("{lp}.ip_prefix"),
                    "has no effect on a limit keyed by account",
                ));
            }
            let on_redis_down = match &l.on_redis_down {
                None => OnRedisDown::Local,
                Some(t) => match t.value.trim() {
                    "local" => OnRedisDown::Local,
                    "refuse" => OnRedisDown::Refuse,
                    other => {
                        return Err(self.error(
                            &t.referenced,
                            &format!("{lp}.on_redis_down"),
                            format!("`{other}` is not one of local, refuse"),
                        ));
                    }
                },
            };
            out.push(LimitConfig {
                name: name_text,
                key: key_kind,
                rate: rate_value,
                burst,
                count_hits: l.count_hits.unwrap_or(false),
                ipv4_prefix,
                ipv6_prefix,
                on_redis_down,
            });
        }
        Ok(out)
    }

    fn backoff(
        &self,
        raw: &RawBackoff,
        prefix: &str,
    ) -> Result<corral_core::BackoffPolicy, ConfigError> {
        let defaults = corral_core::BackoffPolicy::default();
        let min_field = format!("{prefix}.min");
        let max_field = format!("{prefix}.max");
        let min = self.duration(raw.min.as_ref(), &min_field, defaults.min)?;
        self.positive(&min, &min_field)?;
        let max = self.duration(raw.max.as_ref(), &max_field, defaults.max)?;
        self.ordered((&min, &min_field), (&max, &max_field), describe_duration)?;
        let after = match &raw.after {
            None => defaults.after,
            Some(t) => whole_u32(&t.value, 1, "failures")
                .map_err(|m| self.error(&t.referenced, &format!("{prefix}.after"), m))?,
        };
        Ok(corral_core::BackoffPolicy {
            min: min.value,
            max: max.value,
            after,
        })
    }

    fn circuit(&self, raw: &RawCircuit, prefix: &str) -> Result<CircuitConfig, ConfigError> {
        let defaults = CircuitConfig::default();
        let error_rate = match &raw.error_rate {
            None => defaults.error_rate,
            Some(t) => percentage(&t.value, 1, 100)
                .map_err(|m| self.error(&t.referenced, &format!("{prefix}.error_rate"), m))?,
        };
        let min_fetches = match &raw.min_fetches {
            None => defaults.min_fetches,
            Some(t) => whole_u32(&t.value, 1, "fetches")
                .map_err(|m| self.error(&t.referenced, &format!("{prefix}.min_fetches"), m))?,
        };
        let window_field = format!("{prefix}.window");
        let window = self.duration(raw.window.as_ref(), &window_field, defaults.window)?;
        self.positive(&window, &window_field)?;
        let open_field = format!("{prefix}.open_for");
        let open_for = self.duration(raw.open_for.as_ref(), &open_field, defaults.open_for)?;
        self.positive(&open_for, &open_field)?;
        Ok(CircuitConfig {
            enabled: raw.enabled.unwrap_or(defaults.enabled),
            error_rate,
            min_fetches,
            window: window.value,
            open_for: open_for.value,
        })
    }

    fn matcher(
        &self,
        raw: &RawMatch,
        prefix: &str,
    ) -> Result<(Option<String>, String), ConfigError> {
        let host =
            match &raw.host {
                Some(text) => Some(match_host(&text.value).map_err(|m| {
                    self.error(&text.referenced, &format!("{prefix}.match.host"), m)
                })?),
                None => None,
            };
        let path_prefix = match &raw.path_prefix {
            Some(text) => match_path_prefix(&text.value).map_err(|m| {
                self.error(&text.referenced, &format!("{prefix}.match.path_prefix"), m)
            })?,
            None => "/".to_owned(),
        };
        Ok((host, path_prefix))
    }

    fn timeouts(&self, raw: &RawTimeouts, prefix: &str) -> Result<TimeoutsConfig, ConfigError> {
        let defaults = TimeoutsConfig::default();
        let connect_field = format!("{prefix}.connect");
        let headers_field = format!("{prefix}.response_headers");
        let total_field = format!("{prefix}.total");
        let connect = self.duration(raw.connect.as_ref(), &connect_field, defaults.connect)?;
        let response_headers = self.duration(
            raw.response_headers.as_ref(),
            &headers_field,
            defaults.response_headers,
        )?;
        let total = self.duration(raw.total.as_ref(), &total_field, defaults.total)?;
        self.positive(&connect, &connect_field)?;
        self.positive(&response_headers, &headers_field)?;
        self.positive(&total, &total_field)?;
        self.ordered(
            (&connect, &connect_field),
            (&total, &total_field),
            describe_duration,
        )?;
        self.ordered(
            (&response_headers, &headers_field),
            (&total, &total_field),
            describe_duration,
        )?;
        Ok(TimeoutsConfig {
            connect: connect.value,
            response_headers: response_headers.value,
            total: total.value,
        })
    }

    fn route_cache(
        &self,
        raw: &RawRouteCache,
        prefix: &str,
    ) -> Result<RouteCacheConfig, ConfigError> {
        let defaults = RouteCacheConfig::default();

        let default_ttl = match &raw.default_ttl {
            Some(text) => {
                let field = format!("{prefix}.default_ttl");
                let ttl = self.duration(Some(text), &field, Duration::ZERO)?;
                if ttl.value.is_zero() {
                    return Err(self.blame(
                        &ttl,
                        &field,
                        "must be greater than 0; leave default_ttl out to keep it off",
                    ));
                }
                Some(ttl.value)
            }
            None => None,
        };

        let stale_while_revalidate = self.stale_window(
            raw.stale_while_revalidate.as_ref(),
            &format!("{prefix}.stale_while_revalidate"),
            defaults.stale_while_revalidate,
        )?;
        let stale_if_error = self.stale_window(
            raw.stale_if_error.as_ref(),
            &format!("{prefix}.stale_if_error"),
            defaults.stale_if_error,
        )?;

        let ttl_jitter = match &raw.ttl_jitter {
            Some(text) => ttl_jitter(&text.value)
                .map_err(|m| self.error(&text.referenced, &format!("{prefix}.ttl_jitter"), m))?,
            None => defaults.ttl_jitter,
        };
        let early_refresh_beta = match &raw.early_refresh_beta {
            Some(text) => early_refresh_beta(&text.value).map_err(|m| {
                self.error(&text.referenced, &format!("{prefix}.early_refresh_beta"), m)
            })?,
            None => defaults.early_refresh_beta,
        };

        let ignore_query = match &raw.ignore_query {
            Some(entries) => self.list(
                entries,
                &format!("{prefix}.ignore_query"),
                ignore_query_entry,
            )?,
            None => defaults.ignore_query.clone(),
        };
        let (identity_headers, identity_cookies) = match &raw.identity {
            Some(identity) => self.identity(identity, &format!("{prefix}.identity"), &defaults)?,
            None => (
                defaults.identity_headers.clone(),
                defaults.identity_cookies.clone(),
            ),
        };

        let hit_for_pass = self.duration(
            raw.hit_for_pass.as_ref(),
            &format!("{prefix}.hit_for_pass"),
            defaults.hit_for_pass,
        )?;
        let targeted_fields = match &raw.targeted_fields {
            Some(entries) => self.list(
                entries,
                &format!("{prefix}.targeted_fields"),
                targeted_field,
            )?,
            None => defaults.targeted_fields.clone(),
        };

        Ok(RouteCacheConfig {
            enabled: raw.enabled.unwrap_or(defaults.enabled),
            default_ttl,
            heuristic_freshness: raw
                .heuristic_freshness
                .unwrap_or(defaults.heuristic_freshness),
            stale_while_revalidate,
            stale_if_error,
            ttl_jitter,
            early_refresh_beta,
            ignore_query,
            identity_headers,
            identity_cookies,
            store_set_cookie: raw.store_set_cookie.unwrap_or(defaults.store_set_cookie),
            hit_for_pass: hit_for_pass.value,
            targeted_fields,
            post: raw.post.unwrap_or(defaults.post),
        })
    }

    fn stale_window(
        &self,
        raw: Option<&RawStaleWindow>,
        prefix: &str,
        defaults: StaleWindow,
    ) -> Result<StaleWindow, ConfigError> {
        let Some(raw) = raw else {
            return Ok(defaults);
        };
        let default_field = format!("{prefix}.default");
        let max_field = format!("{prefix}.max");
        let default = self.duration(raw.default.as_ref(), &default_field, defaults.default)?;
        let max = self.duration(raw.max.as_ref(), &max_field, defaults.max)?;
        self.ordered(
            (&default, &default_field),
            (&max, &max_field),
            describe_duration,
        )?;
        Ok(StaleWindow {
            default: default.value,
            max: max.value,
        })
    }

    fn identity(
        &self,
        raw: &RawIdentity,
        prefix: &str,
        defaults: &RouteCacheConfig,
    ) -> Result<(Vec<String>, Vec<String>), ConfigError> {
        let headers = match &raw.headers {
            Some(entries) => self.list(entries, &format!("{prefix}.headers"), identity_header)?,
            None => defaults.identity_headers.clone(),
        };
        let cookies = match &raw.cookies {
            Some(entries) => self.list(entries, &format!("{prefix}.cookies"), identity_cookie)?,
            None => defaults.identity_cookies.clone(),
        };
        Ok((headers, cookies))
    }

    fn coalesce(&self, raw: &RawCoalesce, prefix: &str) -> Result<CoalesceConfig, ConfigError> {
        let defaults = CoalesceConfig::default();
        let lock_field = format!("{prefix}.lock_timeout");
        let lock_timeout = self.duration(
            raw.lock_timeout.as_ref(),
            &lock_field,
            defaults.lock_timeout,
        )?;
        self.positive(&lock_timeout, &lock_field)?;
        let on_timeout = match &raw.on_timeout {
            Some(text) => on_timeout(&text.value)
                .map_err(|m| self.error(&text.referenced, &format!("{prefix}.on_timeout"), m))?,
            None => defaults.on_timeout,
        };
        let max_fills = match &raw.max_fills {
            None => defaults.max_fills,
            Some(t) => whole_number(&t.value, 1, "fills")
                .map_err(|m| self.error(&t.referenced, &format!("{prefix}.max_fills"), m))?,
        };
        let max_waiters = match &raw.max_waiters {
            None => defaults.max_waiters,
            Some(t) => whole_number(&t.value, 1, "waiters")
                .map_err(|m| self.error(&t.referenced, &format!("{prefix}.max_waiters"), m))?,
        };
        let post_max_body = match &raw.post {
            None => defaults.post_max_body,
            Some(post) => {
                let field = format!("{prefix}.post.max_body");
                let size = self.size(post.max_body.as_ref(), &field, DEFAULT_POST_BODY)?;
                if size.value == 0 || size.value > MAX_POST_BODY {
                    return Err(self.blame(&size, &field, "must be between 1 byte and 1MiB"));
                }
                Some(size.value)
            }
        };
        let post_read_timeout = match raw.post.as_ref().and_then(|p| p.read_timeout.as_ref()) {
            None => defaults.post_read_timeout,
            Some(text) => {
                let field = format!("{prefix}.post.read_timeout");
                let t = self.duration(Some(text), &field, defaults.post_read_timeout)?;
                self.positive(&t, &field)?;
                t.value
            }
        };
        let lock_age = match &raw.lock_age {
            None => defaults.lock_age,
            Some(text) => {
                let field = format!("{prefix}.lock_age");
                let age = self.duration(Some(text), &field, Duration::ZERO)?;
                self.positive(&age, &field)?;
                if age.value >= lock_timeout.value {
                    return Err(self.blame(
                        &age,
                        &field,
                        "must be shorter than lock_timeout, or waiters give up before it applies",
                    ));
                }
                Some(age.value)
            }
        };
        Ok(CoalesceConfig {
            enabled: raw.enabled.unwrap_or(defaults.enabled),
            lock_timeout: lock_timeout.value,
            on_timeout,
            max_fills,
            max_waiters,
            lock_age,
            post_max_body,
            post_read_timeout,
        })
    }

    /// The bytes of the file `text` names (key and certificate files).
    fn read_file(&self, text: &Text, field: &str) -> Result<Vec<u8>, ConfigError> {
        std::fs::read(text.value.trim()).map_err(|e| {
            self.error(
                &text.referenced,
                field,
                format!("cannot read `{}`: {e}", text.value.trim()),
            )
        })
    }

    fn read_optional(
        &self,
        text: Option<&Text>,
        field: &str,
    ) -> Result<Option<Vec<u8>>, ConfigError> {
        text.map(|t| self.read_file(t, field)).transpose()
    }

    /// Validates each entry of a list, naming the entry (`field[2]`) when one is refused.
    fn list(
        &self,
        entries: &[Text],
        field: &str,
        check: fn(&str) -> Result<String, String>,
    ) -> Result<Vec<String>, ConfigError> {
        entries
            .iter()
            .enumerate()
            .map(|(index, entry)| {
                check(&entry.value)
                    .map_err(|m| self.error(&entry.referenced, &format!("{field}[{index}]"), m))
            })
            .collect()
    }

    fn duration(
        &self,
        raw: Option<&Text>,
        field: &str,
        default: Duration,
    ) -> Result<Setting<Duration>, ConfigError> {
        match raw {
            Some(text) => match parse_duration(&text.value) {
                Ok(value) => Ok(Setting {
                    value,
                    at: Some(text.referenced),
                }),
                Err(e) => Err(self.error(&text.referenced, field, e.to_string())),
            },
            None => Ok(Setting::defaulted(default)),
        }
    }

    fn size(
        &self,
        raw: Option<&Text>,
        field: &str,
        default: u64,
    ) -> Result<Setting<u64>, ConfigError> {
        match raw {
            Some(text) => match parse_size(&text.value) {
                Ok(value) => Ok(Setting {
                    value,
                    at: Some(text.referenced),
                }),
                Err(e) => Err(self.error(&text.referenced, field, e.to_string())),
            },
            None => Ok(Setting::defaulted(default)),
        }
    }

    fn positive(&self, setting: &Setting<Duration>, field: &str) -> Result<(), ConfigError> {
        if setting.value.is_zero() {
            return Err(self.blame(setting, field, "must be greater than 0"));
        }
        Ok(())
    }

    /// Checks `small <= large`, blaming `small` where it was written, else `large`.
    fn ordered<T: PartialOrd + Copy>(
        &self,
        (small, small_field): (&Setting<T>, &str),
        (large, large_field): (&Setting<T>, &str),
        describe: fn(T) -> String,
    ) -> Result<(), ConfigError> {
        if small.value <= large.value {
            return Ok(());
        }
        let shown = |setting: &Setting<T>| match setting.at {
            Some(_) => describe(setting.value),
            None => format!("{}, the default", describe(setting.value)),
        };
        let message = format!(
            "{} ({}) must not exceed {} ({})",
            leaf(small_field),
            shown(small),
            leaf(large_field),
            shown(large),
        );
        if small.at.is_some() {
            Err(self.blame(small, small_field, message))
        } else {
            Err(self.blame(large, large_field, message))
        }
    }

    fn blame<T>(
        &self,
        setting: &Setting<T>,
        field: &str,
        message: impl Into<String>,
    ) -> ConfigError {
        self.error(&setting.at.unwrap_or(Location::UNKNOWN), field, message)
    }
}

/// Where to point when a route's match duplicates an earlier one.
fn match_location(route: &Spanned<RawRoute>, prefix: &str) -> (Location, String) {
    let matcher = route.value.matcher.as_ref();
    if let Some(text) = matcher.and_then(|m| m.path_prefix.as_ref()) {
        return (text.referenced, format!("{prefix}.match.path_prefix"));
    }
    if let Some(text) = matcher.and_then(|m| m.host.as_ref()) {
        return (text.referenced, format!("{prefix}.match.host"));
    }
    (route.referenced, format!("{prefix}.match"))
}

/// Two listeners collide when they would bind the same port on overlapping addresses.
/// Port 0 asks the OS for a free port, so it never collides.
fn collide(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port()
        && a.port() != 0
        && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

fn leaf(field: &str) -> &str {
    field.rsplit('.').next().unwrap_or(field)
}

fn route_name(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err("route name must not be empty".to_owned());
    }
    if !text
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err(format!(
            "`{text}` may only contain letters, digits, `_` and `-`"
        ));
    }
    Ok(text.to_owned())
}

/// `host` or `host:port`, lowercased; IPv6 literals in brackets.
fn match_host(text: &str) -> Result<String, String> {
    let host = text.trim().to_ascii_lowercase();
    if host.is_empty() {
        return Err("empty host; leave match.host out to match any host".to_owned());
    }
    if host.contains("://") || host.contains('/') {
        return Err(format!(
            "`{text}` is not a host name: write only the host, e.g. api.example.com"
        ));
    }
    if host.contains('*') {
        return Err(format!("`{text}`: wildcard hosts are not supported"));
    }
    let (name, port) = if let Some(rest) = host.strip_prefix('[') {
        let (inner, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("`{text}`: unclosed `[` in IPv6 address"))?;
        if inner.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(format!("`{text}`: `{inner}` is not an IPv6 address"));
        }
        let port = match after {
            "" => None,
            _ => Some(
                after
                    .strip_prefix(':')
                    .ok_or_else(|| format!("`{text}`: expected `:port` after `]`"))?,
            ),
        };
        (None, port)
    } else {
        match host.split_once(':') {
            Some((name, port)) => {
                if port.contains(':') {
                    return Err(format!(
                        "`{text}`: write IPv6 addresses in brackets, e.g. [::1]:8080"
                    ));
                }
                (Some(name), Some(port))
            }
            None => (Some(host.as_str()), None),
        }
    };
    if let Some(name) = name {
        let valid_label = |label: &str| {
            !label.is_empty()
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        };
        if !name.split('.').all(valid_label) {
            return Err(format!("`{text}` is not a valid host name"));
        }
    }
    if port.is_some() {
        // Requests are routed and keyed by host name: the port a client
        // names is not part of either (instances behind one balancer
        // listen on different ports and serve the same site).
        return Err(format!(
            "`{text}`: write the host name without a port; the port is not part of routing"
        ));
    }
    Ok(host)
}

fn match_path_prefix(text: &str) -> Result<String, String> {
    if !text.starts_with('/') {
        return Err(format!("`{text}` must start with `/`, e.g. /v1"));
    }
    if let Some(c) = text
        .chars()
        .find(|c| c.is_whitespace() || c.is_control() || *c == '?' || *c == '#')
    {
        return Err(format!(
            "`{text}` contains {c:?}; a path prefix is a plain path without query or fragment"
        ));
    }
    Ok(text.to_owned())
}

fn upstream_uri(text: &str) -> Result<http::Uri, String> {
    let text = text.trim();
    let example = "write e.g. http://127.0.0.1:3000";
    let uri: http::Uri = text
        .parse()
        .map_err(|e| format!("`{text}` is not a valid URI ({e}); {example}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {}
        Some(other) => {
            return Err(format!(
                "unsupported scheme `{other}`: upstreams are http:// or https:// URIs"
            ));
        }
        None => return Err(format!("`{text}` has no scheme: write http://{text}")),
    }
    let authority = uri
        .authority()
        .ok_or_else(|| format!("`{text}` has no host; {example}"))?;
    if authority.as_str().contains('@') {
        return Err("credentials in the upstream URI are not supported".to_owned());
    }
    if authority.host().is_empty() {
        return Err(format!("`{text}` has no host; {example}"));
    }
    if authority.port_u16() == Some(0) {
        return Err(format!("`{text}`: port 0 is not a valid upstream port"));
    }
    let path_and_query = uri.path_and_query().map_or("", |pq| pq.as_str());
    if !matches!(path_and_query, "" | "/") {
        return Err(format!(
            "`{text}` has a path or query (`{path_and_query}`); an upstream is scheme, host and port only, select requests with match.path_prefix"
        ));
    }
    Ok(uri)
}

/// `redis://[user:password@]host[:port][/db]`. Messages never repeat the URL: it may
/// hold a password.
fn redis_url(text: &str) -> Result<String, String> {
    use redis::IntoConnectionInfo as _;

    let text = text.trim();
    let example = "write e.g. redis://127.0.0.1:6379/0";
    let uri: http::Uri = text
        .parse()
        .map_err(|e| format!("not a valid URL ({e}); {example}"))?;
    match uri.scheme_str() {
        Some("redis" | "rediss") => {}
        Some(other) => {
            return Err(format!(
                "unsupported scheme `{other}`: the Redis URL must start with redis:// or rediss:// (TLS)"
            ));
        }
        None => return Err(format!("no scheme; {example}")),
    }
    let authority = uri
        .authority()
        .filter(|a| !a.host().is_empty())
        .ok_or_else(|| format!("no host; {example}"))?;
    if authority.port_u16() == Some(0) {
        return Err("port 0 is not a valid Redis port".to_owned());
    }
    if uri.query().is_some() {
        return Err(format!("query parameters are not supported; {example}"));
    }
    let db = uri.path().strip_prefix('/').unwrap_or(uri.path());
    if !db.is_empty() && db.parse::<u32>().is_err() {
        return Err(format!(
            "the path is the database number, e.g. /0, not `/{db}`"
        ));
    }
    // What the client will do with it: catches what the checks above let through,
    // such as a wildcard address.
    text.into_connection_info()
        .map_err(|e| format!("not a usable Redis URL: {e}"))?;
    Ok(text.to_owned())
}

/// The database a checked Redis URL names (its path without `/`), if any.
fn url_db(url: &str) -> Option<String> {
    let uri: http::Uri = url.parse().ok()?;
    let db = uri.path().trim_start_matches('/');
    (!db.is_empty()).then(|| db.to_owned())
}

/// A seed node of a Cluster: a Redis URL without a database (a cluster
/// has only database 0).
fn cluster_node_url(text: &str) -> Result<String, String> {
    let url = redis_url(text)?;
    match url_db(&url) {
        Some(db) if db != "0" => Err(format!(
            "a cluster has only database 0, not /{db}: leave the path out"
        )),
        _ => Ok(url),
    }
}

/// A sentinel: a Redis URL without a database (the master's is
/// `redis.sentinel.db`).
fn sentinel_node_url(text: &str) -> Result<String, String> {
    let url = redis_url(text)?;
    match url_db(&url) {
        Some(db) => Err(format!(
            "a sentinel has no database: leave /{db} out and set redis.sentinel.db for the master's"
        )),
        None => Ok(url),
    }
}

fn key_prefix(text: &str) -> Result<String, String> {
    let chars = text.chars().count();
    if chars == 0 || chars > MAX_KEY_PREFIX_CHARS {
        return Err(format!(
            "`{text}` is {chars} characters long; a key prefix is 1 to {MAX_KEY_PREFIX_CHARS}"
        ));
    }
    if let Some(c) = text.chars().find(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!(
            "`{text}` contains {c:?}; a key prefix has no whitespace or control characters"
        ));
    }
    if text.contains(['{', '}']) {
        return Err(format!(
            "`{text}` contains a brace; `{{` and `}}` would change the Redis Cluster hash tag of corral's keys"
        ));
    }
    Ok(text.to_owned())
}

/// A whole percentage from `min` to `max` (`50` or `50%`).
fn percentage(text: &str, min: u8, max: u8) -> Result<u8, String> {
    let number = text.trim().trim_end_matches('%').trim();
    match number.parse::<u8>() {
        Ok(p) if (min..=max).contains(&p) => Ok(p),
        _ => Err(format!(
            "`{text}` is not a whole percentage from {min} to {max}"
        )),
    }
}

/// A count of at least `min` (`what` names the unit in the message).
/// [`whole_number`] for a `u32` field.
fn whole_u32(text: &str, min: usize, what: &str) -> Result<u32, String> {
    whole_number(text, min, what)
        .and_then(|n| u32::try_from(n).map_err(|_| format!("`{text}` is too large")))
}

fn whole_number(text: &str, min: usize, what: &str) -> Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(n) if n >= min => Ok(n),
        _ => Err(format!(
            "`{text}` is not a whole number of {what} of at least {min}"
        )),
    }
}

fn breaker_failures(text: &str) -> Result<u32, String> {
    match text.trim().parse::<u32>() {
        Ok(failures) if failures >= 1 => Ok(failures),
        _ => Err(format!(
            "`{text}` is not a whole number of failures of at least 1"
        )),
    }
}

fn ttl_jitter(text: &str) -> Result<u8, String> {
    let number = text.trim().trim_end_matches('%');
    let percent: u64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a whole percentage from 0 to {MAX_TTL_JITTER}"))?;
    match u8::try_from(percent) {
        Ok(percent) if percent <= MAX_TTL_JITTER => Ok(percent),
        _ => Err(format!(
            "{percent}% is out of range: ttl_jitter is a percentage from 0 to {MAX_TTL_JITTER}"
        )),
    }
}

fn early_refresh_beta(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(beta) if beta.is_finite() && beta >= 0.0 => Ok(beta),
        _ => Err(format!(
            "`{text}` is not a finite number >= 0 (0 disables early refresh)"
        )),
    }
}

fn ignore_query_entry(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err("empty query parameter name".to_owned());
    }
    let stem = text.strip_suffix('*').unwrap_or(text);
    if stem.contains('*') {
        return Err(format!(
            "`{text}`: `*` is only allowed at the end (prefix match)"
        ));
    }
    if let Some(c) = stem
        .chars()
        .find(|c| c.is_whitespace() || c.is_control() || matches!(c, '&' | '=' | '#' | '?'))
    {
        return Err(format!(
            "`{text}` contains {c:?}; write the parameter name only"
        ));
    }
    Ok(text.to_owned())
}

fn identity_header(text: &str) -> Result<String, String> {
    http::HeaderName::from_bytes(text.as_bytes())
        .map(|name| name.as_str().to_owned())
        .map_err(|_| format!("`{text}` is not a valid header name"))
}

/// `coalesce.post.max_body` when `post:` is given without it.
const DEFAULT_POST_BODY: u64 = 64 * 1024;
/// The most a POST body that is hashed into a key may hold.
const MAX_POST_BODY: u64 = 1024 * 1024;

fn targeted_field(text: &str) -> Result<String, String> {
    let name = http::HeaderName::from_bytes(text.as_bytes())
        .map_err(|_| format!("`{text}` is not a valid header name"))?;
    if name == http::header::CACHE_CONTROL {
        return Err(
            "Cache-Control is what a targeted field overrides; list fields such as CDN-Cache-Control"
                .to_owned(),
        );
    }
    Ok(name.as_str().to_owned())
}

fn identity_cookie(text: &str) -> Result<String, String> {
    // RFC 6265 cookie-name is an RFC 7230 token.
    let token_char = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    if text.is_empty() || !text.chars().all(token_char) {
        return Err(format!("`{text}` is not a valid cookie name"));
    }
    Ok(text.to_owned())
}

fn on_timeout(text: &str) -> Result<OnTimeout, String> {
    match text {
        "fetch" => Ok(OnTimeout::Fetch),
        "fetch_each" => Ok(OnTimeout::FetchEach),
        "stale" => Ok(OnTimeout::Stale),
        "error" => Ok(OnTimeout::Error),
        _ => Err(format!(
            "unknown value `{text}` (expected one of: fetch, fetch_each, stale, error)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_lowercased_and_checked() {
        assert_eq!(match_host("API.Example.com"), Ok("api.example.com".into()));
        assert_eq!(match_host("[::1]"), Ok("[::1]".into()));
        assert_eq!(match_host("10.0.0.1"), Ok("10.0.0.1".into()));
        // Requests are routed by host name: a port would never match.
        assert!(match_host("api.example.com:8443").is_err_and(|e| e.contains("without a port")));
        for bad in [
            "[::1]:8080",
            "",
            "http://api.example.com",
            "*.example.com",
            "api..example.com",
            "api.example.com:0",
            "api.example.com:http",
            "::1",
            "[::1",
            "bad host",
            "-api.example.com",
        ] {
            assert!(match_host(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn path_prefix_must_be_a_plain_absolute_path() {
        assert_eq!(match_path_prefix("/v1"), Ok("/v1".into()));
        assert!(match_path_prefix("v1").is_err());
        assert!(match_path_prefix("/v1?x=1").is_err());
        assert!(match_path_prefix("/a b").is_err());
    }

    #[test]
    fn upstream_is_plain_http_origin() {
        let uri = upstream_uri("http://127.0.0.1:3000").map_err(|e| e.to_string());
        assert_eq!(
            uri.map(|u| u.to_string()),
            Ok("http://127.0.0.1:3000/".into())
        );
        assert!(upstream_uri("http://upstream.internal/").is_ok());
        assert!(upstream_uri("https://api.internal:8443").is_ok());
        for bad in [
            "127.0.0.1:3000",
            "ftp://host",
            "http://host/api",
            "http://host/?a=1",
            "http://user:pw@host",
            "http://host:0",
            "not a uri",
            "/just/a/path",
            "",
        ] {
            assert!(upstream_uri(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn listeners_collide_on_shared_port_unless_ephemeral() {
        let addr = |s: &str| {
            s.parse::<SocketAddr>()
                .unwrap_or_else(|e| panic!("{s}: {e}"))
        };
        assert!(collide(addr("127.0.0.1:8080"), addr("127.0.0.1:8080")));
        assert!(collide(addr("0.0.0.0:8080"), addr("127.0.0.1:8080")));
        assert!(!collide(addr("127.0.0.1:8080"), addr("127.0.0.1:9080")));
        assert!(!collide(addr("127.0.0.1:8080"), addr("127.0.0.2:8080")));
        assert!(!collide(addr("127.0.0.1:0"), addr("127.0.0.1:0")));
    }

    #[test]
    fn small_value_checks() {
        assert_eq!(ttl_jitter("10"), Ok(10));
        assert_eq!(ttl_jitter("10%"), Ok(10));
        assert!(ttl_jitter("60").is_err());
        assert!(ttl_jitter("300").is_err());
        assert!(ttl_jitter("-1").is_err());
        assert!(ttl_jitter("ten").is_err());
        assert_eq!(early_refresh_beta("0"), Ok(0.0));
        assert_eq!(early_refresh_beta("1.5"), Ok(1.5));
        for bad in ["-1", "inf", "NaN", ".nan", "x"] {
            assert!(early_refresh_beta(bad).is_err(), "{bad} accepted");
        }
        assert_eq!(ignore_query_entry("utm_*"), Ok("utm_*".into()));
        assert_eq!(ignore_query_entry("*"), Ok("*".into()));
        assert!(ignore_query_entry("u*m").is_err());
        assert!(ignore_query_entry("a=b").is_err());
        assert!(ignore_query_entry("").is_err());
        assert_eq!(identity_header("X-Api-Key"), Ok("x-api-key".into()));
        assert!(identity_header("bad header").is_err());
        assert_eq!(identity_cookie("session_id"), Ok("session_id".into()));
        assert!(identity_cookie("a;b").is_err());
        assert_eq!(on_timeout("stale"), Ok(OnTimeout::Stale));
        assert!(on_timeout("Stale").is_err());
        assert!(route_name("api-v2_x").is_ok());
        assert!(route_name("api v2").is_err());
        assert!(route_name("").is_err());
    }

    #[test]
    fn redis_url_is_plain_redis_with_optional_credentials_and_db() {
        for good in [
            "redis://127.0.0.1",
            "redis://127.0.0.1:6379/0",
            " redis://redis.internal/15 ",
            "redis://:secret@127.0.0.1:6379",
            "redis://corral:s%40cret@127.0.0.1:6379/1",
            "redis://[::1]:6379/",
        ] {
            assert_eq!(redis_url(good), Ok(good.trim().to_owned()), "{good}");
        }
        assert!(redis_url("rediss://redis.internal:6380/0").is_ok());
        for bad in [
            "",
            "redis://",
            "redis:///0",
            "127.0.0.1:6379",
            "http://127.0.0.1:6379",
            "unix:///tmp/redis.sock",
            "redis://127.0.0.1:0",
            "redis://127.0.0.1:99999",
            "redis://127.0.0.1/db0",
            "redis://127.0.0.1/0/1",
            "redis://127.0.0.1/0?protocol=resp3",
            "redis://0.0.0.0:6379",
        ] {
            assert!(redis_url(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn key_prefix_and_breaker_failures_checks() {
        assert_eq!(key_prefix("corral:"), Ok("corral:".into()));
        assert_eq!(key_prefix("é"), Ok("é".into()));
        assert!(
            key_prefix(&"é".repeat(64)).is_ok(),
            "64 characters, 128 bytes"
        );
        for bad in ["", "a b", "a\tb", "a\u{0}b", "{corral}", "corral}"] {
            assert!(key_prefix(bad).is_err(), "{bad:?} accepted");
        }
        assert!(key_prefix(&"k".repeat(65)).is_err());
        assert_eq!(breaker_failures("1"), Ok(1));
        assert_eq!(breaker_failures("5"), Ok(5));
        for bad in ["0", "-1", "1.5", "five", "4294967296"] {
            assert!(breaker_failures(bad).is_err(), "{bad} accepted");
        }
    }
}
