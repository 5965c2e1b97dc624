//! Resolves what a route does when its origin fails: `backoff:` (per key, after
//! failures in a row) and `circuit:` (per route, on a failing share of fetches).

use corral_core::BackoffPolicy;

use super::{Resolver, percentage, whole_u32};
use crate::config::duration::describe_duration;
use crate::config::raw::{RawBackoff, RawCircuit};
use crate::config::{CircuitConfig, ConfigError};

impl Resolver<'_> {
    /// The `backoff` of the route at `prefix` (`routes[0]`): `min` at most `max`.
    pub(super) fn backoff(
        &self,
        raw: Option<&RawBackoff>,
        prefix: &str,
    ) -> Result<BackoffPolicy, ConfigError> {
        let defaults = BackoffPolicy::default();
        let Some(raw) = raw else {
            return Ok(defaults);
        };
        let prefix = &format!("{prefix}.backoff");
        let min = self
            .under(prefix, "min", &raw.min)
            .duration_or(defaults.min)?
            .positive()?;
        let max = self
            .under(prefix, "max", &raw.max)
            .duration_or(defaults.max)?;
        min.at_most(&max, describe_duration)?;
        let after = self
            .under(prefix, "after", &raw.after)
            .parse_or(defaults.after, |t| whole_u32(t, 1, "failures"))?;
        Ok(BackoffPolicy {
            min: min.value,
            max: max.value,
            after,
        })
    }

    /// The `circuit` of the route at `prefix` (`routes[0]`).
    pub(super) fn circuit(
        &self,
        raw: Option<&RawCircuit>,
        prefix: &str,
    ) -> Result<CircuitConfig, ConfigError> {
        let defaults = CircuitConfig::default();
        let Some(raw) = raw else {
            return Ok(defaults);
        };
        let prefix = &format!("{prefix}.circuit");
        let error_rate = self
            .under(prefix, "error_rate", &raw.error_rate)
            .parse_or(defaults.error_rate, |t| percentage(t, 1, 100))?;
        let min_fetches = self
            .under(prefix, "min_fetches", &raw.min_fetches)
            .parse_or(defaults.min_fetches, |t| whole_u32(t, 1, "fetches"))?;
        let window = self
            .under(prefix, "window", &raw.window)
            .duration_or(defaults.window)?
            .positive()?;
        let open_for = self
            .under(prefix, "open_for", &raw.open_for)
            .duration_or(defaults.open_for)?
            .positive()?;
        Ok(CircuitConfig {
            enabled: raw.enabled.unwrap_or(defaults.enabled),
            error_rate,
            min_fetches,
            window: window.value,
            open_for: open_for.value,
        })
    }
}
