//! Resolves a route's `coalesce:`: how long waiters wait on a shared fetch and what
//! they do then, how many fills and waiters there may be, and coalesced POSTs.

use super::{Resolver, whole_number};
use crate::config::raw::{RawCoalesce, RawCoalescePost};
use crate::config::{CoalesceConfig, ConfigError, OnTimeout};

/// `coalesce.post.max_body` when `post:` is given without it.
const DEFAULT_POST_BODY: u64 = 64 * 1024;
/// The most a POST body that is hashed into a key may hold.
const MAX_POST_BODY: u64 = 1024 * 1024;

impl Resolver<'_> {
    /// The `coalesce` of the route at `prefix` (`routes[0]`).
    pub(super) fn coalesce(
        &self,
        raw: Option<&RawCoalesce>,
        prefix: &str,
    ) -> Result<CoalesceConfig, ConfigError> {
        let defaults = CoalesceConfig::default();
        let Some(raw) = raw else {
            return Ok(defaults);
        };
        let prefix = &format!("{prefix}.coalesce");
        let lock_timeout = self
            .under(prefix, "lock_timeout", &raw.lock_timeout)
            .duration_or(defaults.lock_timeout)?
            .positive()?;
        let on_timeout = self
            .under(prefix, "on_timeout", &raw.on_timeout)
            .parse_or(defaults.on_timeout, on_timeout)?;
        let max_fills = self
            .under(prefix, "max_fills", &raw.max_fills)
            .parse_or(defaults.max_fills, |t| whole_number(t, 1, "fills"))?;
        let max_waiters = self
            .under(prefix, "max_waiters", &raw.max_waiters)
            .parse_or(defaults.max_waiters, |t| whole_number(t, 1, "waiters"))?;
        let post_max_body = match &raw.post {
            None => defaults.post_max_body,
            Some(post) => Some(self.post_max_body(post, prefix)?),
        };
        let post_read_timeout = match self
            .under(
                prefix,
                "post.read_timeout",
                raw.post.as_ref().and_then(|p| p.read_timeout.as_ref()),
            )
            .duration()?
        {
            None => defaults.post_read_timeout,
            Some(t) => t.positive()?.value,
        };
        let lock_age = match self.under(prefix, "lock_age", &raw.lock_age).duration()? {
            None => defaults.lock_age,
            Some(age) => {
                let age = age.positive()?;
                if age.value >= lock_timeout.value {
                    return Err(age.blame(
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

    /// `post.max_body`: a given `post:` turns POST coalescing on, with this bound.
    fn post_max_body(&self, post: &RawCoalescePost, prefix: &str) -> Result<u64, ConfigError> {
        let size = self
            .under(prefix, "post.max_body", &post.max_body)
            .size_or(DEFAULT_POST_BODY)?;
        if size.value == 0 || size.value > MAX_POST_BODY {
            return Err(size.blame("must be between 1 byte and 1MiB"));
        }
        Ok(size.value)
    }
}

/// `on_timeout`: what a waiter does after `lock_timeout`.
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
    fn on_timeout_is_one_of_four_lowercase_words() {
        assert_eq!(on_timeout("stale"), Ok(OnTimeout::Stale));
        assert!(on_timeout("Stale").is_err());
    }
}
