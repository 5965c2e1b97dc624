//! Builds corral's YAML config for a test: the harness fills `listen` and
//! `admin`, a test names only what its scenario needs.
//!
//! Values are written verbatim into YAML (`"30s"`, `"{ default: 0s, max: 1h }"`),
//! so a test can also feed the proxy something invalid on purpose.

use std::fmt::Write as _;
use std::net::SocketAddr;

/// Ordered `key: value` pairs of one YAML mapping; setting a key again
/// replaces its value in place.
#[derive(Clone, Debug, Default)]
struct Section(Vec<(String, String)>);

impl Section {
    fn set(&mut self, key: &str, value: &str) {
        match self.0.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = value.to_owned(),
            None => self.0.push((key.to_owned(), value.to_owned())),
        }
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn write(&self, out: &mut String, indent: &str) {
        for (key, value) in &self.0 {
            let _ = writeln!(out, "{indent}{key}: {value}");
        }
    }
}

/// One entry of `routes:`.
#[derive(Clone, Debug)]
pub struct Route {
    name: String,
    path_prefix: String,
    host: Option<String>,
    upstream: String,
    timeouts: Section,
    cache: Section,
    coalesce: Section,
    fields: Section,
    upstreams: Vec<String>,
}

impl Route {
    /// A route for every path (`path_prefix: /`) to `upstream`
    /// (`http://127.0.0.1:PORT`). Early refresh is off (`early_refresh_beta: 0`)
    /// so that hits are deterministic; tests that want it set it back.
    pub fn new(name: &str, upstream: impl Into<String>) -> Self {
        let mut cache = Section::default();
        cache.set("early_refresh_beta", "0");
        cache.set("ttl_jitter", "0");
        Self {
            name: name.to_owned(),
            path_prefix: "/".to_owned(),
            host: None,
            upstream: upstream.into(),
            timeouts: Section::default(),
            cache,
            coalesce: Section::default(),
            fields: Section::default(),
            upstreams: Vec::new(),
        }
    }

    /// A pool: `upstreams: [..]` in place of `upstream:`.
    pub fn upstreams(mut self, servers: &[String]) -> Self {
        self.upstreams = servers.to_vec();
        self
    }

    /// Sets a route field written as is (e.g. `("upstream_concurrency",
    /// "2")`, `("limits", "[{ name: a, key: ip, rate: 5/min }]")`).
    pub fn field(mut self, key: &str, value: &str) -> Self {
        self.fields.set(key, value);
        self
    }

    /// Matches paths under `prefix` only.
    pub fn path_prefix(mut self, prefix: &str) -> Self {
        self.path_prefix = prefix.to_owned();
        self
    }

    /// Matches requests for `host` only.
    pub fn host(mut self, host: &str) -> Self {
        self.host = Some(host.to_owned());
        self
    }

    /// Sets `timeouts.{key}` (e.g. `("total", "2s")`).
    pub fn timeouts(mut self, key: &str, value: &str) -> Self {
        self.timeouts.set(key, value);
        self
    }

    /// Sets `cache.{key}` (e.g. `("stale_if_error", "{ default: 0s, max: 24h }")`).
    pub fn cache(mut self, key: &str, value: &str) -> Self {
        self.cache.set(key, value);
        self
    }

    /// Sets `coalesce.{key}` (e.g. `("lock_timeout", "5s")`).
    pub fn coalesce(mut self, key: &str, value: &str) -> Self {
        self.coalesce.set(key, value);
        self
    }

    fn write(&self, out: &mut String) {
        let _ = writeln!(out, "  - name: {}", self.name);
        let _ = writeln!(out, "    match:");
        let _ = writeln!(out, "      path_prefix: {}", self.path_prefix);
        if let Some(host) = &self.host {
            let _ = writeln!(out, "      host: {host}");
        }
        if self.upstreams.is_empty() {
            let _ = writeln!(out, "    upstream: {}", self.upstream);
        } else {
            let _ = writeln!(out, "    upstreams: [{}]", self.upstreams.join(", "));
        }
        self.fields.write(out, "    ");
        for (title, section) in [
            ("timeouts", &self.timeouts),
            ("cache", &self.cache),
            ("coalesce", &self.coalesce),
        ] {
            if !section.is_empty() {
                let _ = writeln!(out, "    {title}:");
                section.write(out, "      ");
            }
        }
    }
}

/// A whole config file minus `listen` and `admin`, which the harness picks.
#[derive(Clone, Debug)]
pub struct Config {
    server: Section,
    cache: Section,
    redis: Section,
    top: Section,
    routes: Vec<Route>,
}

impl Default for Config {
    fn default() -> Self {
        let mut cache = Section::default();
        cache.set("memory", "64MiB");
        cache.set("max_object_size", "1MiB");
        Self {
            server: Section::default(),
            cache,
            redis: Section::default(),
            top: Section::default(),
            routes: Vec::new(),
        }
    }
}

impl Config {
    /// 64MiB of cache, 1MiB objects, no routes yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A config with one route `api` for every path to `upstream`.
    pub fn single(upstream: impl Into<String>) -> Self {
        Self::new().route(Route::new("api", upstream))
    }

    /// Appends a route.
    pub fn route(mut self, route: Route) -> Self {
        self.routes.push(route);
        self
    }

    /// Sets `server.{key}` (e.g. `("max_header_size", "16KiB")`).
    pub fn server(mut self, key: &str, value: &str) -> Self {
        self.server.set(key, value);
        self
    }

    /// Sets top-level `cache.{key}` (e.g. `("memory", "8MiB")`).
    pub fn cache(mut self, key: &str, value: &str) -> Self {
        self.cache.set(key, value);
        self
    }

    /// Turns on the shared cache: `redis.url` (e.g. `redis://127.0.0.1:PORT/0`).
    /// Without it the config has no `redis:` section (single-instance mode).
    pub fn redis(self, url: &str) -> Self {
        self.redis_field("url", url)
    }

    /// Sets `redis.{key}` (e.g. `("lease_ttl", "1s")`,
    /// `("breaker", "{ failures: 5, open_for: 1s }")`).
    pub fn redis_field(mut self, key: &str, value: &str) -> Self {
        self.redis.set(key, value);
        self
    }

    /// Sets a top-level field written as is (e.g. `("callers",
    /// "{ account: { header: X-Account-Id } }")`).
    pub fn top(mut self, key: &str, value: &str) -> Self {
        self.top.set(key, value);
        self
    }

    /// Renders the YAML without `listen`/`admin`.
    pub fn to_yaml(&self) -> String {
        let mut out = String::new();
        if !self.server.is_empty() {
            out.push_str("server:\n");
            self.server.write(&mut out, "  ");
        }
        out.push_str("cache:\n");
        self.cache.write(&mut out, "  ");
        if !self.redis.is_empty() {
            out.push_str("redis:\n");
            self.redis.write(&mut out, "  ");
        }
        self.top.write(&mut out, "");
        out.push_str("routes:\n");
        for route in &self.routes {
            route.write(&mut out);
        }
        out
    }

    /// Renders the YAML with `listen` and `admin` first.
    pub fn render(&self, listen: SocketAddr, admin: SocketAddr) -> String {
        with_listeners(&self.to_yaml(), listen, admin)
    }
}

/// Prepends `listen` and `admin` to a config body that has neither.
pub fn with_listeners(body: &str, listen: SocketAddr, admin: SocketAddr) -> String {
    format!("listen: {listen}\nadmin: {admin}\n{body}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_route_renders_its_sections_under_the_route() {
        let yaml = Config::single("http://127.0.0.1:9")
            .server("max_header_size", "16KiB")
            .route(
                Route::new("b", "http://127.0.0.1:10")
                    .path_prefix("/b")
                    .cache("default_ttl", "30s")
                    .coalesce("lock_timeout", "5s"),
            )
            .render(
                "127.0.0.1:1".parse().expect("addr"),
                "127.0.0.1:2".parse().expect("addr"),
            );
        let expected = "listen: 127.0.0.1:1\nadmin: 127.0.0.1:2\n\
            server:\n  max_header_size: 16KiB\n\
            cache:\n  memory: 64MiB\n  max_object_size: 1MiB\n\
            routes:\n\
            \x20 - name: api\n    match:\n      path_prefix: /\n    upstream: http://127.0.0.1:9\n\
            \x20   cache:\n      early_refresh_beta: 0\n      ttl_jitter: 0\n\
            \x20 - name: b\n    match:\n      path_prefix: /b\n    upstream: http://127.0.0.1:10\n\
            \x20   cache:\n      early_refresh_beta: 0\n      ttl_jitter: 0\n      default_ttl: 30s\n\
            \x20   coalesce:\n      lock_timeout: 5s\n";
        assert_eq!(yaml, expected);
    }

    #[test]
    fn the_redis_section_follows_cache_and_only_when_asked_for() {
        let plain = Config::single("http://127.0.0.1:9").to_yaml();
        assert!(!plain.contains("redis"), "{plain}");

        let yaml = Config::single("http://127.0.0.1:9")
            .redis_field("lease_ttl", "1s")
            .redis("redis://127.0.0.1:6399/0")
            .redis_field("breaker", "{ failures: 5, open_for: 1s }")
            .redis_field("lease_ttl", "3s")
            .to_yaml();
        let expected = "cache:\n  memory: 64MiB\n  max_object_size: 1MiB\n\
            redis:\n  lease_ttl: 3s\n  url: redis://127.0.0.1:6399/0\n\
            \x20 breaker: { failures: 5, open_for: 1s }\n\
            routes:\n";
        assert!(yaml.starts_with(expected), "{yaml}");
    }
}
