//! Resolves `routes:`: each route's name and `match`, in file order, and the rules
//! between routes (names unique, no route hidden by an earlier one). A route's other
//! sections are resolved in the files named after them; this one only calls them, in
//! the order their errors are reported.

use serde_saphyr::{Location, Spanned};

use super::{Resolver, whole_u32};
use crate::config::raw::{RawMatch, RawRoute};
use crate::config::{ConfigError, DEFAULT_UPSTREAM_QUEUE_TIMEOUT, RouteConfig};

impl Resolver<'_> {
    /// `routes:`: at least one, in file order.
    pub(super) fn routes(
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
                .find(|(_, r)| r.host == route.host && same_prefix(r, &route))
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

    /// The route at `prefix` (`routes[0]`).
    fn route(&self, raw: &Spanned<RawRoute>, prefix: &str) -> Result<RouteConfig, ConfigError> {
        let at = &raw.referenced;
        let raw = &raw.value;
        // Unnamed: called after its place, as metrics and logs need a name.
        let name = self
            .under(prefix, "name", &raw.name)
            .parse_or(default_route_name(prefix), route_name)?;
        let (host, path_prefix) = match &raw.matcher {
            Some(matcher) => self.matcher(matcher, prefix)?,
            None => (None, "/".to_owned()),
        };
        let case_sensitive = raw
            .matcher
            .as_ref()
            .and_then(|m| m.case_sensitive)
            .unwrap_or(false);
        let (upstream, upstream_at, upstreams) = self.upstreams(raw, at, prefix)?;
        let balance = self.balance(raw, prefix)?;
        let health = self.health(raw.health.as_ref(), prefix)?;
        let tls = self.route_tls(&upstream, &upstream_at, raw.tls.as_ref(), prefix)?;
        let timeouts = self.timeouts(raw.timeouts.as_ref(), prefix)?;
        let cache = self.route_cache(raw.cache.as_ref(), prefix)?;
        let coalesce = self.coalesce(raw.coalesce.as_ref(), prefix)?;
        let backoff = self.backoff(raw.backoff.as_ref(), prefix)?;
        let circuit = self.circuit(raw.circuit.as_ref(), prefix)?;
        let limits = match &raw.limits {
            Some(l) => self.limits(l, &format!("{prefix}.limits"))?,
            None => Vec::new(),
        };
        let upstream_concurrency = self
            .under(prefix, "upstream_concurrency", &raw.upstream_concurrency)
            .parse(|t| whole_u32(t, 1, "requests"))?;
        // Also how long a passed-through request waits for an upstream
        // socket (origin/descriptors.rs), so it applies without
        // upstream_concurrency too.
        let queue = self
            .under(
                prefix,
                "upstream_queue_timeout",
                &raw.upstream_queue_timeout,
            )
            .duration_or(DEFAULT_UPSTREAM_QUEUE_TIMEOUT)?
            .positive()?;
        let compression = match &raw.compression {
            Some(c) => Some(self.compression(c, prefix)?),
            None => None,
        };
        let upstream_http2 = raw.upstream_http2.unwrap_or(false);
        if upstream_http2 && tls.is_none() {
            return Err(self.error(
                at,
                &format!("{prefix}.upstream_http2"),
                "needs an https:// upstream (h2 is offered by ALPN; h2c is not supported)",
            ));
        }
        Ok(RouteConfig {
            compression,
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
            case_sensitive,
            underscores_in_headers: raw.underscores_in_headers.unwrap_or(false),
            upstream,
            timeouts,
            cache,
            coalesce,
            backoff,
            circuit,
        })
    }

    /// A route's `match`: the host (any when absent) and the path prefix (`/`).
    fn matcher(
        &self,
        raw: &RawMatch,
        prefix: &str,
    ) -> Result<(Option<String>, String), ConfigError> {
        let host = self
            .under(prefix, "match.host", &raw.host)
            .parse(match_host)?;
        let path_prefix = self
            .under(prefix, "match.path_prefix", &raw.path_prefix)
            .parse_or("/".to_owned(), match_path_prefix)?;
        Ok((host, path_prefix))
    }
}

/// True when no request could tell `a`'s path prefix from `b`'s: the
/// same prefix, or one that differs only in case where either route
/// matches case-insensitively (a request would match both, equally long).
fn same_prefix(a: &RouteConfig, b: &RouteConfig) -> bool {
    if a.case_sensitive && b.case_sensitive {
        a.path_prefix == b.path_prefix
    } else {
        a.path_prefix.eq_ignore_ascii_case(&b.path_prefix)
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

/// A route's or a limit's name: shown in headers, metrics and logs, so plain.
/// The name of an unnamed route: `route-0` for `routes[0]`.
fn default_route_name(prefix: &str) -> String {
    let index = prefix.trim_start_matches("routes[").trim_end_matches(']');
    format!("route-{index}")
}

pub(super) fn route_name(text: &str) -> Result<String, String> {
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

/// A plain absolute path (`match.path_prefix`, `health.check_path`).
pub(super) fn match_path_prefix(text: &str) -> Result<String, String> {
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
    fn route_names_are_letters_digits_dash_and_underscore() {
        assert!(route_name("api-v2_x").is_ok());
        assert!(route_name("api v2").is_err());
        assert!(route_name("").is_err());
    }
}
