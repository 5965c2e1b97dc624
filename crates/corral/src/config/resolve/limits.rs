//! Resolves rate limits: the global `limits:` and each route's `limits:`, one entry
//! at a time, and the rules that span sections (a limit that counts accounts needs
//! `callers.account`; a route's limit may not take a global one's name).

use corral_core::callers::rate_limit::Rate;
use serde_saphyr::{Location, Spanned};

use super::route::route_name;
use super::{Resolver, whole_number, whole_u32};
use crate::config::raw::{RawConfig, RawLimit};
use crate::config::{CallersConfig, ConfigError, LimitConfig, LimitKey, OnRedisDown, RouteConfig};

impl Resolver<'_> {
    /// The limits at `prefix` (`limits`, `routes[0].limits`), names unique among them.
    pub(super) fn limits(
        &self,
        raw: &Spanned<Vec<Spanned<RawLimit>>>,
        prefix: &str,
    ) -> Result<Vec<LimitConfig>, ConfigError> {
        let mut out: Vec<LimitConfig> = Vec::with_capacity(raw.value.len());
        for (i, l) in raw.value.iter().enumerate() {
            let limit = self.limit(l, &format!("{prefix}[{i}]"), &out)?;
            out.push(limit);
        }
        Ok(out)
    }

    /// One limit at `lp` (`routes[0].limits[1]`); `earlier` are the ones before it.
    fn limit(
        &self,
        raw: &Spanned<RawLimit>,
        lp: &str,
        earlier: &[LimitConfig],
    ) -> Result<LimitConfig, ConfigError> {
        let at = &raw.referenced;
        let l = &raw.value;
        let name = self.under(lp, "name", &l.name).required(at, route_name)?;
        if earlier.iter().any(|o| o.name == name.value) {
            return Err(name.blame(format!(
                "duplicate limit name `{}` in this route",
                name.value
            )));
        }
        let key = self.under(lp, "key", &l.key).required(at, limit_key)?.value;
        let rate = self
            .under(lp, "rate", &l.rate)
            .required(at, Rate::parse)?
            .value;
        let burst = self
            .under(lp, "burst", &l.burst)
            .parse_or(rate.count, |t| whole_u32(t, 1, "requests"))?;
        let ipv4_prefix = self
            .under(lp, "ipv4_prefix", &l.ipv4_prefix)
            .parse_or(32, |t| prefix_len(t, 32))?;
        // A /64 is what one IPv6 customer is handed (RFC 6177): counted
        // per address, a customer gets a new bucket per address it makes up.
        let ipv6_prefix = self
            .under(lp, "ipv6_prefix", &l.ipv6_prefix)
            .parse_or(64, |t| prefix_len(t, 128))?;
        if key == LimitKey::Account
            && let Some(t) = l.ipv4_prefix.as_ref().or(l.ipv6_prefix.as_ref())
        {
            return Err(self.error(
                &t.referenced,
                &format!("{lp}.ip_prefix"),
                "has no effect on a limit keyed by account",
            ));
        }
        let on_redis_down = self.under(lp, "on_redis_down", &l.on_redis_down).parse_or(
            OnRedisDown::Local,
            |t| match t.trim() {
                "local" => Ok(OnRedisDown::Local),
                "refuse" => Ok(OnRedisDown::Refuse),
                other => Err(format!("`{other}` is not one of local, refuse")),
            },
        )?;
        Ok(LimitConfig {
            name: name.value,
            key,
            rate,
            burst,
            count_hits: l.count_hits.unwrap_or(false),
            ipv4_prefix,
            ipv6_prefix,
            on_redis_down,
        })
    }

    /// Every limit that counts accounts needs a source of them.
    pub(super) fn limits_have_account_source(
        &self,
        raw: &RawConfig,
        callers: &CallersConfig,
    ) -> Result<(), ConfigError> {
        if !callers.account.is_empty() {
            return Ok(());
        }
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
        Ok(())
    }

    /// A route's limit may not share a name with a global one: the
    /// name is what headers, metrics and logs tell apart.
    pub(super) fn limit_names_differ_from_global(
        &self,
        raw: &RawConfig,
        routes: &[RouteConfig],
        limits: &[LimitConfig],
    ) -> Result<(), ConfigError> {
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
        Ok(())
    }
}

/// What a limit counts by (`key:`).
fn limit_key(text: &str) -> Result<LimitKey, String> {
    match text.trim() {
        "account" => Ok(LimitKey::Account),
        "ip" => Ok(LimitKey::Ip),
        "account_or_ip" => Ok(LimitKey::AccountOrIp),
        other => Err(format!(
            "`{other}` is not one of account, ip, account_or_ip"
        )),
    }
}

/// A network prefix length from 1 to `max` bits (`ipv4_prefix`, `ipv6_prefix`).
fn prefix_len(text: &str, max: u8) -> Result<u8, String> {
    whole_number(text, 1, "bits")
        .ok()
        .and_then(|n| u8::try_from(n).ok())
        .filter(|n| *n <= max)
        .ok_or_else(|| format!("`{text}` is not a prefix length from 1 to {max}"))
}
