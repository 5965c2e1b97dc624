//! Rate limits that count the caller (`limits:` per route). (The pacing
//! of the origin, `upstream_concurrency`, is `origin/slots.rs`.) A
//! refusal is a [`Refusal`], which `http` answers.
//!
//! A request's caller is resolved once: its account (`corral_core::callers::caller`)
//! and its real address (`server.trusted_proxies`). Each limit names what
//! it counts; the count is one GCRA state per (route, limit, caller), kept
//! in Redis when there is Redis, so every instance adds to the same total,
//! with one script call per limit, one limit after another, least
//! forgeable first, stopping at the first refusal ([`Limiter::check`]).
//! When Redis cannot
//! answer within `redis.op_timeout` (or its breaker is open), a limit
//! either counts locally at 1/`redis.instances` of its rate (fail open,
//! the default) or refuses with a 503 (`on_redis_down: refuse`). Redis
//! trouble is never a 429.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use corral_core::callers::caller::{AccountSources, Caller};
use corral_core::callers::rate_limit::{Decision, Gcra};

use http::HeaderValue;

use crate::cluster::protocol::{Layout, RATE_LIMIT, RATE_REFUND};
use crate::cluster::redis_link::{RedisLink, arg};
use crate::config::{LimitConfig, LimitKey, OnRedisDown};

/// The limits of one route, ready to check.
pub struct RouteLimits {
    route: String,
    limits: Vec<Limit>,
    /// Some limit counts accounts: the caller's account must be resolved.
    pub counts_accounts: bool,
    /// Some limit lets cache hits through uncounted.
    pub spares_hits: bool,
}

struct Limit {
    config: LimitConfig,
    /// A top-level limit: counted once across every route.
    global: bool,
    gcra: Gcra,
    /// `"name";q=30;w=60`
    policy: Arc<str>,
    /// The name, shared with the tallies of the answers it counts.
    name: Arc<str>,
    counters: Vec<metrics::Counter>,
}

impl RouteLimits {
    /// The route's own limits, then the global ones, in the order they are
    /// checked: least forgeable first ([`forgeability`]), that order kept
    /// within each kind.
    pub fn new(route: &str, own: &[LimitConfig], global: &[LimitConfig]) -> Self {
        let all = || {
            own.iter()
                .map(|l| (l, false))
                .chain(global.iter().map(|l| (l, true)))
        };
        let mut limits: Vec<Limit> = all()
            .map(|(l, global)| Limit {
                global,
                gcra: Gcra::new(l.rate, l.burst),
                policy: format!(
                    "\"{}\";q={};w={}",
                    l.name,
                    l.rate.count,
                    l.rate.period.as_secs()
                )
                .into(),
                name: l.name.as_str().into(),
                counters: crate::telemetry::metrics::rate_limit_counters(route, &l.name),
                config: l.clone(),
            })
            .collect();
        // A stable sort: the configured order within each kind.
        limits.sort_by_key(|l| forgeability(l.config.key));
        RouteLimits {
            route: route.to_owned(),
            counts_accounts: all().any(|(l, _)| l.key != LimitKey::Ip),
            spares_hits: all().any(|(l, _)| !l.count_hits),
            limits,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.limits.is_empty()
    }
}

/// Who one request is, for counting.
#[derive(Debug, Clone)]
pub struct Who {
    /// The account, with its source prefix; `None` for a guest.
    pub account: Option<String>,
    /// The real client address.
    pub ip: IpAddr,
}

impl Who {
    /// Resolves the caller of a request on a route with `limits`; a token
    /// the configuration says to refuse is refused.
    pub fn resolve(
        limits: &RouteLimits,
        sources: &AccountSources,
        headers: &http::HeaderMap,
        client: &corral_core::callers::client_addr::ClientAddr,
    ) -> Result<Who, Refusal> {
        let account = if limits.counts_accounts {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            // The peer is trusted exactly when a trust entry vouched for it.
            match sources.identify(headers, !client.vouchers.is_empty(), now) {
                Caller::Account(a) => Some(a),
                Caller::Guest => None,
                Caller::Rejected(why) => {
                    tracing::debug!(route = %limits.route, reason = why, "invalid bearer token refused");
                    return Err(Refusal::InvalidToken);
                }
            }
        } else {
            None
        };
        Ok(Who {
            account,
            ip: client.client,
        })
    }
}

/// Which of a route's limits a check covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Before the cache is asked: the limits that count hits.
    BeforeCache,
    /// When the cache cannot answer (a fetch, or a wait for one): the
    /// limits that spare hits.
    Fetch,
    /// A request that never goes through the cache: every limit.
    All,
}

/// What an allowed request is told of a limit that counted it, and what
/// to give back if it is refused after all.
#[derive(Debug, Clone)]
pub struct Tally {
    policy: Arc<str>,
    name: Arc<str>,
    remaining: u64,
    reset_us: u64,
    key: [u8; 16],
    local: bool,
    emission_us: u64,
    /// The `allowed` counter, counted once every limit of the phase
    /// allowed the request.
    counter: Option<metrics::Counter>,
}

/// The order limits are checked in: what a caller can forge last.
fn forgeability(key: LimitKey) -> u8 {
    match key {
        LimitKey::Ip => 0,
        LimitKey::AccountOrIp => 1,
        LimitKey::Account => 2,
    }
}

/// The process's counters: the local GCRA states (bounded, least used
/// forgotten first) and, with Redis, the shared ones.
pub struct Limiter {
    local: moka::sync::Cache<[u8; 16], Arc<AtomicU64>>,
    shared: Option<(Arc<RedisLink>, Layout)>,
    /// `redis.instances`: the local fallback's share of a shared limit.
    instances: u32,
    epoch: std::time::Instant,
}

impl Limiter {
    pub fn new(
        local_buckets: u64,
        shared: Option<(Arc<RedisLink>, Layout)>,
        instances: u32,
    ) -> Self {
        Limiter {
            local: moka::sync::Cache::builder()
                .max_capacity(local_buckets)
                // No GCRA state outlives its day-long period.
                .time_to_idle(std::time::Duration::from_secs(86_400))
                .build(),
            shared,
            instances: instances.max(1),
            epoch: std::time::Instant::now(),
        }
    }

    /// Counts the request against the limits of `phase`: the tallies for
    /// the RateLimit fields when every limit lets it through, else why not
    /// (a spent allowance, or a limit that refuses without Redis).
    ///
    /// One limit after another, least forgeable first (an address, then an
    /// account or address, then an account, which a caller can make up;
    /// the configured order within each), stopping at the first refusal:
    /// a request already refused writes nothing more, so inventing an API
    /// key per request behind a refusing address creates no counter. What
    /// the limits before the refusal counted is given back.
    pub async fn check(
        &self,
        limits: &RouteLimits,
        who: &Who,
        phase: Phase,
    ) -> Result<Vec<Tally>, Refusal> {
        let keyed: Vec<(&Limit, [u8; 16])> = limits
            .limits
            .iter()
            .filter(|l| match phase {
                Phase::All => true,
                Phase::BeforeCache => l.config.count_hits,
                Phase::Fetch => !l.config.count_hits,
            })
            .filter_map(|l| key(&limits.route, l, who).map(|k| (l, k)))
            .collect();
        let mut tallies = Vec::with_capacity(keyed.len());
        for (limit, key) in keyed {
            let counted = self.decide(limit, &key).await;
            let (refused, outcome) = match &counted {
                Counted::Decided { d, local, .. } if d.allowed => (None, 2 * usize::from(*local)),
                Counted::Decided { d, local, .. } => (
                    Some(Refusal::RateLimited {
                        limit: limit.config.name.clone(),
                        policy: Arc::clone(&limit.policy),
                        retry_after: secs(d.retry_after_us).max(1),
                    }),
                    1 + 2 * usize::from(*local),
                ),
                Counted::Unavailable => (
                    Some(Refusal::Unavailable {
                        limit: limit.config.name.clone(),
                    }),
                    4,
                ),
            };
            if let Some(refusal) = refused {
                // Indexes into LIMIT_OUTCOMES. The limits that let it
                // through count it as neither allowed nor limited: their
                // count is given back (nginx's limit_req does the same), so
                // a caller refused on one route does not spend its global
                // allowance.
                if let Some(c) = limit.counters.get(outcome) {
                    c.increment(1);
                }
                self.give_back(&tallies).await;
                return Err(refusal);
            }
            if let Counted::Decided {
                d,
                local,
                emission_us,
            } = counted
            {
                tallies.push(Tally {
                    policy: Arc::clone(&limit.policy),
                    name: Arc::clone(&limit.name),
                    remaining: d.remaining,
                    reset_us: d.reset_us,
                    key,
                    local,
                    emission_us,
                    counter: limit.counters.get(outcome).cloned(),
                });
            }
        }
        for t in &tallies {
            if let Some(c) = &t.counter {
                c.increment(1);
            }
        }
        Ok(tallies)
    }

    /// Gives back what `tallies` counted: the request was refused after
    /// all (by a limit of a later phase), and is counted by none.
    pub async fn give_back(&self, tallies: &[Tally]) {
        let refunds = tallies
            .iter()
            .map(|t| self.refund(&t.key, t.local, t.emission_us));
        futures_util::future::join_all(refunds).await;
    }

    /// Takes back one request's count from `key`.
    async fn refund(&self, key: &[u8; 16], local: bool, emission_us: u64) {
        match (&self.shared, local) {
            (Some((link, layout)), false) => {
                let r: Result<i64, _> = link
                    .script(
                        &RATE_REFUND,
                        &[&layout.rate_key(&hex(key))],
                        &[arg(emission_us)],
                    )
                    .await;
                if let Err(e) = r {
                    tracing::debug!(error = %e, "a rate-limit refund was lost");
                }
            }
            _ => {
                if let Some(cell) = self.local.get(key) {
                    let _ = cell.fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                        Some(t.saturating_sub(emission_us).max(1))
                    });
                }
            }
        }
    }

    async fn decide(&self, limit: &Limit, key: &[u8; 16]) -> Counted {
        let Some((link, layout)) = &self.shared else {
            return Counted::Decided {
                d: self.local_decide(key, limit.gcra),
                local: true,
                emission_us: limit.gcra.emission_us,
            };
        };
        let hex = hex(key);
        let r: Result<Vec<i64>, _> = link
            .script(
                &RATE_LIMIT,
                &[&layout.rate_key(&hex)],
                &[arg(limit.gcra.emission_us), arg(limit.gcra.tolerance_us)],
            )
            .await;
        match r {
            Ok(v) if v.len() == 4 => {
                let n = |i: usize| u64::try_from(v[i]).unwrap_or(0);
                Counted::Decided {
                    d: Decision {
                        allowed: v[0] == 1,
                        tat_us: 0,
                        remaining: n(1),
                        retry_after_us: n(2),
                        reset_us: n(3),
                    },
                    local: false,
                    emission_us: limit.gcra.emission_us,
                }
            }
            other => {
                if let Err(e) = &other {
                    tracing::debug!(error = %e, limit = %limit.config.name, "shared rate limit unreachable");
                }
                match limit.config.on_redis_down {
                    OnRedisDown::Refuse => Counted::Unavailable,
                    OnRedisDown::Local => {
                        let g = limit.gcra.divided(self.instances, limit.config.burst);
                        Counted::Decided {
                            d: self.local_decide(key, g),
                            local: true,
                            emission_us: g.emission_us,
                        }
                    }
                }
            }
        }
    }

    /// The GCRA decision on this process's counter for `key`.
    fn local_decide(&self, key: &[u8; 16], gcra: Gcra) -> Decision {
        let cell = self.local.get_with(*key, || Arc::new(AtomicU64::new(0)));
        let now = u64::try_from(self.epoch.elapsed().as_micros())
            .unwrap_or(u64::MAX)
            .saturating_add(1);
        loop {
            let cur = cell.load(Ordering::Acquire);
            let d = gcra.decide((cur != 0).then_some(cur), now);
            if !d.allowed
                || cell
                    .compare_exchange(cur, d.tat_us, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                return d;
            }
        }
    }
}

enum Counted {
    /// The decision, whether the local counter made it, and the step it
    /// took (to give back).
    Decided {
        d: Decision,
        local: bool,
        emission_us: u64,
    },
    Unavailable,
}

/// The counted identity of `who` under `limit`, or `None` when the limit
/// does not apply (a guest under an `account` limit).
fn key(route: &str, limit: &Limit, who: &Who) -> Option<[u8; 16]> {
    let c = &limit.config;
    let mut h = blake3::Hasher::new();
    // A global limit's count is the same on every route ("" is no
    // route's name).
    let route = if limit.global { "" } else { route };
    for part in [route, c.name.as_str()] {
        h.update(part.as_bytes());
        h.update(&[0]);
    }
    match (c.key, &who.account) {
        (LimitKey::Account | LimitKey::AccountOrIp, Some(a)) => {
            h.update(b"a\0");
            h.update(a.as_bytes());
        }
        (LimitKey::Account, None) => return None,
        (LimitKey::Ip | LimitKey::AccountOrIp, _) => {
            h.update(b"i\0");
            match masked(who.ip, c.ipv4_prefix, c.ipv6_prefix) {
                IpAddr::V4(v4) => h.update(&v4.octets()),
                IpAddr::V6(v6) => h.update(&v6.octets()),
            };
        }
    }
    let mut out = [0u8; 16];
    out.copy_from_slice(&h.finalize().as_bytes()[..16]);
    Some(out)
}

/// `ip` with all but its first `v4`/`v6` bits cleared.
fn masked(ip: IpAddr, v4: u8, v6: u8) -> IpAddr {
    match ip {
        IpAddr::V4(a) => {
            let bits = u32::from(a);
            let mask = u32::MAX
                .checked_shl(32 - u32::from(v4.min(32)))
                .unwrap_or(0);
            IpAddr::V4((bits & mask).into())
        }
        IpAddr::V6(a) => {
            let bits = u128::from(a);
            let mask = u128::MAX
                .checked_shl(128 - u32::from(v6.min(128)))
                .unwrap_or(0);
            IpAddr::V6((bits & mask).into())
        }
    }
}

fn hex(key: &[u8; 16]) -> String {
    use std::fmt::Write;
    key.iter().fold(String::with_capacity(32), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn secs(us: u64) -> u64 {
    us.div_ceil(1_000_000)
}

/// Why a request was refused; `http` answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// A bearer token the configuration says to refuse (401).
    InvalidToken,
    /// The limit's allowance is spent (429): come back in `retry_after`
    /// seconds. `policy` is its RateLimit-Policy member.
    RateLimited {
        limit: String,
        policy: Arc<str>,
        retry_after: u64,
    },
    /// The limit refuses while its shared counter is out of reach (503):
    /// the caller did nothing wrong.
    Unavailable { limit: String },
}

pub const RATELIMIT: http::HeaderName = http::HeaderName::from_static("ratelimit");
pub const RATELIMIT_POLICY: http::HeaderName = http::HeaderName::from_static("ratelimit-policy");

/// Adds the RateLimit fields of the limits that counted an allowed
/// request to its answer (draft-ietf-httpapi-ratelimit-headers): one list
/// member per limit.
pub fn annotate(headers: &mut http::HeaderMap, tallies: &[Tally]) {
    if tallies.is_empty() {
        return;
    }
    let policy = tallies
        .iter()
        .map(|t| &*t.policy)
        .collect::<Vec<_>>()
        .join(", ");
    let now = tallies
        .iter()
        .map(|t| format!("\"{}\";r={};t={}", t.name, t.remaining, secs(t.reset_us)))
        .collect::<Vec<_>>()
        .join(", ");
    if let (Ok(p), Ok(n)) = (HeaderValue::from_str(&policy), HeaderValue::from_str(&now)) {
        headers.insert(RATELIMIT_POLICY, p);
        headers.insert(RATELIMIT, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_counted_by_their_prefix() {
        let ip = |s: &str| s.parse::<IpAddr>().expect("test value");
        assert_eq!(masked(ip("203.0.113.77"), 24, 64), ip("203.0.113.0"));
        assert_eq!(masked(ip("203.0.113.77"), 32, 64), ip("203.0.113.77"));
        assert_eq!(
            masked(ip("2001:db8:1:2:3:4:5:6"), 24, 64),
            ip("2001:db8:1:2::")
        );
        assert_eq!(masked(ip("2001:db8::1"), 24, 128), ip("2001:db8::1"));
    }
}
