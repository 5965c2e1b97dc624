//! Resolves a route's `cache:`: freshness (`default_ttl`, the two stale windows,
//! jitter and early refresh), what makes up the key (`ignore_query`, `identity`),
//! and which fields override Cache-Control.

use std::time::Duration;

use super::Resolver;
use crate::config::duration::describe_duration;
use crate::config::raw::{RawIdentity, RawRouteCache, RawStaleWindow};
use crate::config::{ConfigError, RouteCacheConfig, StaleWindow};

/// Above this, jitter would make most entries expire long before their TTL.
const MAX_TTL_JITTER: u8 = 50;

impl Resolver<'_> {
    /// The `cache` of the route at `prefix` (`routes[0]`).
    pub(super) fn route_cache(
        &self,
        raw: Option<&RawRouteCache>,
        prefix: &str,
    ) -> Result<RouteCacheConfig, ConfigError> {
        let defaults = RouteCacheConfig::default();
        let Some(raw) = raw else {
            return Ok(defaults);
        };
        let prefix = &format!("{prefix}.cache");
        let default_ttl = self.default_ttl(raw, prefix)?;
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
        let stale_max_ratio = self
            .under(prefix, "stale_max_ratio", &raw.stale_max_ratio)
            .parse_or(defaults.stale_max_ratio, |t| stale_max_ratio(t).map(Some))?;
        let ttl_jitter = self
            .under(prefix, "ttl_jitter", &raw.ttl_jitter)
            .parse_or(defaults.ttl_jitter, ttl_jitter)?;
        let early_refresh_beta = self
            .under(prefix, "early_refresh_beta", &raw.early_refresh_beta)
            .parse_or(defaults.early_refresh_beta, early_refresh_beta)?;
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
        let hit_for_pass = self
            .under(prefix, "hit_for_pass", &raw.hit_for_pass)
            .duration_or(defaults.hit_for_pass)?;
        let targeted_fields = match &raw.targeted_fields {
            Some(entries) => self.list(
                entries,
                &format!("{prefix}.targeted_fields"),
                targeted_field,
            )?,
            None => defaults.targeted_fields.clone(),
        };
        let no_vary_search = raw.no_vary_search.unwrap_or(defaults.no_vary_search);
        Ok(RouteCacheConfig {
            enabled: raw.enabled.unwrap_or(defaults.enabled),
            default_ttl,
            heuristic_freshness: raw
                .heuristic_freshness
                .unwrap_or(defaults.heuristic_freshness),
            stale_while_revalidate,
            stale_if_error,
            stale_max_ratio,
            ttl_jitter,
            early_refresh_beta,
            ignore_query,
            no_vary_search,
            sort_query: raw.sort_query.unwrap_or(!no_vary_search),
            identity_headers,
            identity_cookies,
            store_set_cookie: raw.store_set_cookie.unwrap_or(defaults.store_set_cookie),
            hit_for_pass: hit_for_pass.value,
            targeted_fields,
            post: raw.post.unwrap_or(defaults.post),
        })
    }

    /// `default_ttl`: off when absent, so zero is refused rather than read as "off".
    fn default_ttl(
        &self,
        raw: &RawRouteCache,
        prefix: &str,
    ) -> Result<Option<Duration>, ConfigError> {
        match self
            .under(prefix, "default_ttl", &raw.default_ttl)
            .duration()?
        {
            None => Ok(None),
            Some(ttl) if ttl.value.is_zero() => {
                Err(ttl.blame("must be greater than 0; leave default_ttl out to keep it off"))
            }
            Some(ttl) => Ok(Some(ttl.value)),
        }
    }

    /// `stale_while_revalidate` or `stale_if_error` at `prefix`: `default` at most `max`.
    fn stale_window(
        &self,
        raw: Option<&RawStaleWindow>,
        prefix: &str,
        defaults: StaleWindow,
    ) -> Result<StaleWindow, ConfigError> {
        let Some(raw) = raw else {
            return Ok(defaults);
        };
        let default = self
            .under(prefix, "default", &raw.default)
            .duration_or(defaults.default)?;
        let max = self
            .under(prefix, "max", &raw.max)
            .duration_or(defaults.max)?;
        default.at_most(&max, describe_duration)?;
        Ok(StaleWindow {
            default: default.value,
            max: max.value,
        })
    }

    /// `identity` at `prefix`: the request headers and cookies that name one user.
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
}

/// `ttl_jitter`: a whole percentage up to [`MAX_TTL_JITTER`].
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

/// `early_refresh_beta`: finite and not negative.
fn early_refresh_beta(text: &str) -> Result<f64, String> {
    finite_non_negative(text)
        .ok_or_else(|| format!("`{text}` is not a finite number >= 0 (0 disables early refresh)"))
}

/// `stale_max_ratio`: a fraction of the freshness lifetime, finite and not
/// negative (`0` serves nothing stale, `1` as long stale as fresh).
fn stale_max_ratio(text: &str) -> Result<f64, String> {
    finite_non_negative(text).ok_or_else(|| {
        format!(
            "`{text}` is not a finite number >= 0: a fraction of the freshness lifetime, e.g. 0.5 for half"
        )
    })
}

/// `text` as a finite number >= 0, or `None`.
fn finite_non_negative(text: &str) -> Option<f64> {
    text.trim()
        .parse::<f64>()
        .ok()
        .filter(|n| n.is_finite() && *n >= 0.0)
}

/// A query parameter left out of the key; a trailing `*` matches a prefix.
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

/// An identity header's name, lowercased.
fn identity_header(text: &str) -> Result<String, String> {
    http::HeaderName::from_bytes(text.as_bytes())
        .map(|name| name.as_str().to_owned())
        .map_err(|_| format!("`{text}` is not a valid header name"))
}

/// An RFC 9213 targeted field: any header but Cache-Control, which it overrides.
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

/// An identity cookie's name.
fn identity_cookie(text: &str) -> Result<String, String> {
    // RFC 6265 cookie-name is an RFC 7230 token.
    let token_char = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    if text.is_empty() || !text.chars().all(token_char) {
        return Err(format!("`{text}` is not a valid cookie name"));
    }
    Ok(text.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_value_checks() {
        assert_eq!(ttl_jitter("10"), Ok(10));
        assert_eq!(ttl_jitter("10%"), Ok(10));
        assert!(ttl_jitter("60").is_err());
        assert!(ttl_jitter("300").is_err());
        assert!(ttl_jitter("-1").is_err());
        assert!(ttl_jitter("ten").is_err());
        assert_eq!(stale_max_ratio("0.5"), Ok(0.5));
        assert_eq!(stale_max_ratio("0"), Ok(0.0));
        assert_eq!(stale_max_ratio("2"), Ok(2.0));
        for bad in ["-0.1", "inf", "NaN", "50%", "half", ""] {
            assert!(stale_max_ratio(bad).is_err(), "{bad} accepted");
        }
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
    }
}
