//! Resolves how a route reaches its origin: `upstream` or `upstreams`, `balance`,
//! `health` and `timeouts`. A route's upstream `tls` is resolved in `tls.rs`.

use serde_saphyr::Location;

use super::route::match_path_prefix;
use super::{Resolver, whole_u32};
use crate::config::duration::describe_duration;
use crate::config::raw::{RawHealth, RawRoute, RawTimeouts};
use crate::config::{ConfigError, HealthConfig, TimeoutsConfig};

impl Resolver<'_> {
    /// `upstream` (one server) or `upstreams` (several, one scheme, each once): the
    /// first server, where the file names them, and all of them.
    pub(super) fn upstreams(
        &self,
        raw: &RawRoute,
        at: &Location,
        prefix: &str,
    ) -> Result<(http::Uri, Location, Vec<http::Uri>), ConfigError> {
        let upstream_field = format!("{prefix}.upstream");
        match (&raw.upstream, &raw.upstreams) {
            (Some(u), None) => {
                let uri = upstream_uri(&u.value)
                    .map_err(|m| self.error(&u.referenced, &upstream_field, m))?;
                Ok((uri.clone(), u.referenced, vec![uri]))
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
                Ok((uris[0].clone(), list.referenced, uris))
            }
            (Some(_), Some(list)) => Err(self.error(
                &list.referenced,
                &format!("{prefix}.upstreams"),
                "give upstream (one server) or upstreams (several), not both",
            )),
            (None, None) => {
                self.required(&raw.upstream, at, &upstream_field)?;
                unreachable!("required() refused the missing field")
            }
        }
    }

    /// `balance`: how requests are spread over the route's servers.
    pub(super) fn balance(
        &self,
        raw: &RawRoute,
        prefix: &str,
    ) -> Result<crate::config::Balance, ConfigError> {
        self.under(prefix, "balance", &raw.balance).parse_or(
            crate::config::Balance::RoundRobin,
            |t| match t.trim() {
                "round_robin" => Ok(crate::config::Balance::RoundRobin),
                "least_outstanding" => Ok(crate::config::Balance::LeastOutstanding),
                other => Err(format!(
                    "`{other}` is not one of round_robin, least_outstanding"
                )),
            },
        )
    }

    /// `health`: when a server is left out, and how it is asked whether it is back.
    pub(super) fn health(
        &self,
        raw: Option<&RawHealth>,
        prefix: &str,
    ) -> Result<HealthConfig, ConfigError> {
        let d = HealthConfig::default();
        let Some(h) = raw else {
            return Ok(d);
        };
        let p = format!("{prefix}.health");
        let max_fails = self
            .under(&p, "max_fails", &h.max_fails)
            .parse_or(d.max_fails, |t| whole_u32(t, 1, "failures"))?;
        let fail_timeout = self
            .under(&p, "fail_timeout", &h.fail_timeout)
            .duration_or(d.fail_timeout)?
            .positive()?;
        let check_interval = self
            .under(&p, "check_interval", &h.check_interval)
            .duration_or(d.check_interval)?
            .positive()?;
        let check_path = self
            .under(&p, "check_path", &h.check_path)
            .parse(match_path_prefix)?;
        Ok(HealthConfig {
            max_fails,
            fail_timeout: fail_timeout.value,
            check_path,
            check_interval: check_interval.value,
        })
    }

    /// The `timeouts` of the route at `prefix`: each > 0, connect and
    /// response_headers at most total.
    pub(super) fn timeouts(
        &self,
        raw: Option<&RawTimeouts>,
        prefix: &str,
    ) -> Result<TimeoutsConfig, ConfigError> {
        let defaults = TimeoutsConfig::default();
        let Some(raw) = raw else {
            return Ok(defaults);
        };
        let prefix = &format!("{prefix}.timeouts");
        let connect = self
            .under(prefix, "connect", &raw.connect)
            .duration_or(defaults.connect)?;
        let response_headers = self
            .under(prefix, "response_headers", &raw.response_headers)
            .duration_or(defaults.response_headers)?;
        let total = self
            .under(prefix, "total", &raw.total)
            .duration_or(defaults.total)?;
        let stale_after = self
            .under(prefix, "stale_after", &raw.stale_after)
            .duration_or(defaults.stale_after)?;
        // All four are read before any is checked: one that does not parse is
        // reported before one that is zero.
        let connect = connect.positive()?;
        let response_headers = response_headers.positive()?;
        let total = total.positive()?;
        let stale_after = stale_after.positive()?;
        connect.at_most(&total, describe_duration)?;
        response_headers.at_most(&total, describe_duration)?;
        Ok(TimeoutsConfig {
            connect: connect.value,
            response_headers: response_headers.value,
            total: total.value,
            stale_after: stale_after.value,
        })
    }
}

/// An origin: `http://` or `https://`, a host and maybe a port, nothing more.
pub(super) fn upstream_uri(text: &str) -> Result<http::Uri, String> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
