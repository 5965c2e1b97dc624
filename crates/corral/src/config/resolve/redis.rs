//! Resolves `redis:`: which servers (one node, a Cluster or Sentinel), the deadlines
//! and lease of each command, the key prefix and the circuit breaker. Its `tls:` is
//! resolved in `tls.rs`. Messages never repeat a Redis URL: it may hold a password.

use std::time::Duration;

use corral_core::callers::peer_auth::{PeerAuth, PeerKey};
use serde_saphyr::{Location, Spanned};

use super::{Resolver, whole_u32};
use crate::config::duration::describe_duration;
use crate::config::paths::NodePaths;
use crate::config::raw::{RawBreaker, RawRedis, RawSentinel, Text};
use crate::config::{
    ConfigError, DEFAULT_BREAKER_FAILURES, DEFAULT_BREAKER_OPEN_FOR, DEFAULT_L2_MAX_OBJECT_SIZE,
    DEFAULT_REDIS_CONNECT_TIMEOUT, DEFAULT_REDIS_KEY_PREFIX, DEFAULT_REDIS_LEASE_TTL,
    DEFAULT_REDIS_OP_TIMEOUT, RedisConfig, RedisServers, SentinelConfig,
};

/// The fleet's key when `redis.auth_key_file` is not given.
pub const AUTH_KEY_ENV: &str = "CORRAL_REDIS_AUTH_KEY";

/// The Redis password when the URLs name a user but no password (e.g.
/// `redis://corral@valkey:6379/0`): a Kubernetes or compose secret, kept
/// out of the config file. It is put into each URL, percent-encoded.
pub const PASSWORD_ENV: &str = "CORRAL_REDIS_PASSWORD";

fn with_env_password(
    servers: RedisServers,
    at: &Location,
    resolver: &Resolver<'_>,
) -> Result<RedisServers, ConfigError> {
    let Ok(password) = std::env::var(PASSWORD_ENV) else {
        return Ok(servers);
    };
    let password: String = password
        .trim_end_matches(['\r', '\n'])
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect();
    let fill = |url: String| -> Result<String, ConfigError> {
        let Some((scheme, rest)) = url.split_once("://") else {
            return Ok(url);
        };
        let authority_end = rest.find('/').unwrap_or(rest.len());
        match rest[..authority_end].split_once('@') {
            Some((user, host)) if !user.contains(':') && !password.is_empty() => Ok(format!(
                "{scheme}://{user}:{password}@{host}{}",
                &rest[authority_end..]
            )),
            Some((user, _)) if user.contains(':') => Err(resolver.error(
                at,
                "redis",
                format!("{PASSWORD_ENV} is set and a URL holds a password too: give it once"),
            )),
            _ => Ok(url),
        }
    };
    Ok(match servers {
        RedisServers::Node(url) => RedisServers::Node(fill(url)?),
        RedisServers::Cluster(urls) => {
            RedisServers::Cluster(urls.into_iter().map(fill).collect::<Result<_, _>>()?)
        }
        sentinel @ RedisServers::Sentinel(_) => sentinel,
    })
}

/// A key file written by `echo` or an editor ends with a newline the
/// secret does not hold.
fn trim_newline(key: &mut Vec<u8>) {
    if key.last() == Some(&b'\n') {
        key.pop();
        if key.last() == Some(&b'\r') {
            key.pop();
        }
    }
}

/// Unverified entries revalidated per second after the invalidation log
/// was lost: 3 instances add at most 60 conditional requests a second.
const DEFAULT_RESYNC_RATE: u32 = 20;

/// Default `redis.lease_window` (or `lease_ttl`, when that is shorter): a
/// dead leader is noticed about this long after its last renewal.
const DEFAULT_LEASE_WINDOW: Duration = Duration::from_secs(1);

/// Shorter leases would expire between the watchdog's renewals under ordinary jitter.
const MIN_LEASE_TTL: Duration = Duration::from_millis(100);
/// Keeps keys short and readable in `redis-cli`.
const MAX_KEY_PREFIX_CHARS: usize = 64;

impl Resolver<'_> {
    /// `redis:`, or `None` when the file has no such section.
    pub(super) fn redis(
        &self,
        raw: Option<&Spanned<RawRedis>>,
    ) -> Result<Option<RedisConfig>, ConfigError> {
        if let Some(redis) = raw {
            return Ok(Some(self.redis_config(redis)?));
        }
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
        Ok(None)
    }

    /// A `redis:` section the file gives.
    fn redis_config(&self, raw: &Spanned<RawRedis>) -> Result<RedisConfig, ConfigError> {
        let at = &raw.referenced;
        let raw = &raw.value;
        let servers = with_env_password(self.redis_servers(at, raw)?, at, self)?;
        let op_timeout = self
            .at("redis.op_timeout", &raw.op_timeout)
            .duration_or(DEFAULT_REDIS_OP_TIMEOUT)?
            .positive()?;
        let connect_timeout = self
            .at("redis.connect_timeout", &raw.connect_timeout)
            .duration_or(DEFAULT_REDIS_CONNECT_TIMEOUT)?
            .positive()?;
        let lease_ttl = self
            .at("redis.lease_ttl", &raw.lease_ttl)
            .duration_or(DEFAULT_REDIS_LEASE_TTL)?;
        if lease_ttl.value < MIN_LEASE_TTL {
            return Err(lease_ttl.blame(format!(
                "{} is below the {} minimum",
                describe_duration(lease_ttl.value),
                describe_duration(MIN_LEASE_TTL)
            )));
        }
        let lease_window = self
            .at("redis.lease_window", &raw.lease_window)
            .duration_or(DEFAULT_LEASE_WINDOW.min(lease_ttl.value))?;
        if lease_window.value < MIN_LEASE_TTL || lease_window.value > lease_ttl.value {
            return Err(lease_window.blame(format!(
                "{} is outside {} to redis.lease_ttl ({})",
                describe_duration(lease_window.value),
                describe_duration(MIN_LEASE_TTL),
                describe_duration(lease_ttl.value)
            )));
        }
        let key_prefix = self
            .at("redis.key_prefix", &raw.key_prefix)
            .parse_or(DEFAULT_REDIS_KEY_PREFIX.to_owned(), key_prefix)?;
        let l2_max_object_size = self
            .at("redis.l2_max_object_size", &raw.l2_max_object_size)
            .size_or(DEFAULT_L2_MAX_OBJECT_SIZE)?
            .positive()?;
        let (breaker_failures, breaker_open_for) = match &raw.breaker {
            Some(breaker) => self.breaker(breaker)?,
            None => (DEFAULT_BREAKER_FAILURES, DEFAULT_BREAKER_OPEN_FOR),
        };
        let instances = self
            .at("redis.instances", &raw.instances)
            .parse_or(1, |t| whole_u32(t, 1, "instances"))?;
        let resync_rate = self
            .at("redis.resync_rate", &raw.resync_rate)
            .parse_or(DEFAULT_RESYNC_RATE, |t| whole_u32(t, 1, "resync_rate"))?;
        let tls = self.redis_tls(raw.tls.as_ref(), servers.tls())?;
        let auth = self.redis_auth(at, raw)?;
        Ok(RedisConfig {
            auth,
            tls,
            instances,
            resync_rate,
            servers,
            op_timeout: op_timeout.value,
            connect_timeout: connect_timeout.value,
            lease_ttl: lease_ttl.value,
            lease_window: lease_window.value,
            key_prefix,
            l2_max_object_size: l2_max_object_size.value,
            breaker_failures,
            breaker_open_for,
        })
    }

    /// `auth` and `auth_key_file`, or `CORRAL_REDIS_AUTH_KEY`: the fleet's
    /// key, or the explicit choice to trust whoever can write to Redis.
    fn redis_auth(&self, at: &Location, raw: &RawRedis) -> Result<PeerAuth, ConfigError> {
        let off = match raw.auth.as_ref() {
            None => false,
            Some(t) => match t.value.trim() {
                "none" => true,
                "hmac" => false,
                other => {
                    return Err(self.error(
                        &t.referenced,
                        "redis.auth",
                        format!("`{other}` is not `hmac` (the default) or `none`"),
                    ));
                }
            },
        };
        let from_file = match raw.auth_key_file.as_ref() {
            Some(file) if off => {
                return Err(self.error(
                    &file.referenced,
                    "redis.auth_key_file",
                    "a key with `auth: none`: remove one of them",
                ));
            }
            Some(file) => {
                let mut key = self.read_file(file, "redis.auth_key_file")?;
                trim_newline(&mut key);
                Some((key, file))
            }
            None => None,
        };
        if off {
            return Ok(PeerAuth::Off);
        }
        let key = match from_file {
            Some((key, file)) => PeerKey::new(&key)
                .map_err(|e| self.error(&file.referenced, "redis.auth_key_file", e.to_string()))?,
            None => match std::env::var(AUTH_KEY_ENV) {
                Ok(key) if !key.is_empty() => PeerKey::new(key.as_bytes())
                    .map_err(|e| self.error(at, "redis", format!("{AUTH_KEY_ENV}: {e}")))?,
                _ => {
                    return Err(self.error(
                        at,
                        "redis",
                        format!(
                            "no key to authenticate what instances read from each other: \
                             set redis.auth_key_file or {AUTH_KEY_ENV} (32 bytes or more, \
                             the same on every instance), or `auth: none` to trust whoever \
                             can write to this Redis"
                        ),
                    ));
                }
            },
        };
        Ok(PeerAuth::Key(key))
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
        if let Some(url) = self.at("redis.url", &raw.url).parse(redis_url)? {
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
            return Ok(RedisServers::Sentinel(self.sentinel(sentinel)?));
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

    /// `redis.sentinel`: the master's name, the sentinels, and the master's credentials.
    fn sentinel(&self, sentinel: &Spanned<RawSentinel>) -> Result<SentinelConfig, ConfigError> {
        let (at, s) = (&sentinel.referenced, &sentinel.value);
        let master = self
            .at("redis.sentinel.master", &s.master)
            .required(at, |name| {
                let name = name.trim();
                if name.is_empty() || name.chars().any(|c| c.is_whitespace() || c.is_control()) {
                    return Err(
                        "the master's name is one word, as in the sentinels' `sentinel monitor NAME …`",
                    );
                }
                Ok(name.to_owned())
            })?;
        let listed = self.required(&s.nodes, at, "redis.sentinel.nodes")?;
        let nodes = self.nodes(
            listed,
            "redis.sentinel.nodes",
            "no sentinels: list the address of each",
            sentinel_node_url,
        )?;
        let db = self.at("redis.sentinel.db", &s.db).parse_or(0, |t| {
            t.trim()
                .parse::<u32>()
                .map_err(|_| format!("`{t}` is not a database number"))
        })?;
        let text = |t: &Option<Text>| t.as_ref().map(|t| t.value.clone());
        Ok(SentinelConfig {
            master: master.value,
            nodes,
            username: text(&s.username),
            password: text(&s.password),
            db: i64::from(db),
        })
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

    /// `redis.breaker`: failures in a row that open it, and for how long.
    fn breaker(&self, raw: &RawBreaker) -> Result<(u32, Duration), ConfigError> {
        let failures = self
            .at("redis.breaker.failures", &raw.failures)
            .parse_or(DEFAULT_BREAKER_FAILURES, breaker_failures)?;
        let open_for = self
            .at("redis.breaker.open_for", &raw.open_for)
            .duration_or(DEFAULT_BREAKER_OPEN_FOR)?
            .positive()?;
        Ok((failures, open_for.value))
    }
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

/// `redis.key_prefix`: short, printable, and no brace that would move corral's keys
/// to another Cluster slot.
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

/// `redis.breaker.failures`: at least one.
fn breaker_failures(text: &str) -> Result<u32, String> {
    match text.trim().parse::<u32>() {
        Ok(failures) if failures >= 1 => Ok(failures),
        _ => Err(format!(
            "`{text}` is not a whole number of failures of at least 1"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
