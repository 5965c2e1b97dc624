//! No-Vary-Search rules, learned per path on a route with
//! `cache.no_vary_search`: from each stored answer of the path (L1, and
//! a record in Redis for every instance), read from Redis by an instance
//! that knows none yet, and used to make the key of every GET of the
//! path (`UriKey::with_rule`) before it is looked up or joins a flight.

use std::time::Duration;

use corral_core::semantics::head::RequestHead;
use corral_core::{L1, NoVarySearch, PathRule, PathScope, UriKey};
use http::{HeaderMap, Method};

use crate::cache::fill::{Cache, FillRequest};
use crate::routes::{CacheParams, Route};

/// How long L1 keeps a rule it learned (from an answer or from Redis):
/// every stored answer of the path teaches it again.
pub const KEEP: Duration = Duration::from_secs(3600);

/// How long L1 remembers that Redis had no rule for a path, before a
/// miss on it asks again.
pub const KEEP_UNKNOWN: Duration = Duration::from_secs(2);

/// Where the rule of `ctx`'s path is kept, if the route learns rules and
/// the request is one they apply to (GET and HEAD).
pub fn scope(route: &Route, ctx: &RequestHead) -> Option<PathScope> {
    scope_of(&route.name, &route.cache, ctx)
}

/// [`scope`], for the route named `name` with `params`.
fn scope_of(name: &str, params: &CacheParams, ctx: &RequestHead) -> Option<PathScope> {
    (params.no_vary_search && (ctx.method == Method::GET || ctx.method == Method::HEAD))
        .then(|| PathScope::new(name, &ctx.host, &ctx.path, ctx.tls))
}

/// What L1 knows of the rule of `ctx`'s path; `None` where rules do not
/// apply. A request without a query has nothing for a rule to leave out
/// and never asks.
#[inline]
pub fn known(cache: &Cache, route: &Route, ctx: &RequestHead) -> Option<(PathScope, PathRule)> {
    ctx.query.as_ref()?;
    let scope = scope(route, ctx)?;
    let rule = cache.l1.path_rule(&scope);
    Some((scope, rule))
}

/// What L1 knows of the rule of `host` and `path` on `route` (any
/// method's view of a GET of it).
fn rule_of(l1: &L1, route: &str, (host, path): (&str, &str), tls: bool) -> PathRule {
    l1.path_rule(&PathScope::new(route, host, path, tls))
}

/// Reads the rule another instance recorded for `scope`, into L1. Errors
/// (Redis away) leave it unknown: the key is then made without a rule,
/// which never shares more than the origin allows.
pub async fn read(cache: &Cache, scope: &PathScope) -> PathRule {
    let Some(tier) = &cache.tier else {
        return PathRule::Unknown;
    };
    let Ok(record) = tier.read_path_rule(scope.digest()).await else {
        return PathRule::Unknown;
    };
    let (rule, keep) = match record {
        // "-" (or anything unreadable) is a path whose answers name no rule.
        Some(r) => (NoVarySearch::parse(r.as_bytes()), KEEP),
        None => (None, KEEP_UNKNOWN),
    };
    cache.l1.learn_path_rule(scope, rule, keep)
}

/// Learns the rule of an answer the fill stores (or found in Redis).
pub fn learn(fill: &FillRequest, headers: &HeaderMap) {
    if let Some(scope) = scope_of(fill.route_name(), fill.cache_params(), &fill.head) {
        fill.l1()
            .learn_path_rule(&scope, NoVarySearch::of(headers), KEEP);
    }
}

/// True when the answer to `fill` names another rule than the one its key
/// was made with: it must not be stored under that key, since requests
/// the old rule made equivalent may not be under the answer's own. The
/// path learns the answer's rule here (and every instance with it), so
/// that the flight's waiters, looking again, make their keys with it.
/// A request without a query has the same key under every rule, and
/// never asks.
pub fn changed(fill: &FillRequest, headers: &HeaderMap) -> bool {
    if fill.body.is_some() || fill.head.query.is_none() {
        return false;
    }
    let Some(scope) = scope_of(fill.route_name(), fill.cache_params(), &fill.head) else {
        return false;
    };
    let rule = NoVarySearch::of(headers);
    if rule.as_ref().map(NoVarySearch::record) == fill.primary.uri().rule_mark() {
        return false;
    }
    let record = rule
        .as_ref()
        .map_or_else(|| "-".to_owned(), |r| r.record().to_owned());
    fill.l1().learn_path_rule(&scope, rule, KEEP);
    if let Some(tier) = fill.shared().tier.cloned() {
        let route = fill.route_name().to_owned();
        tokio::spawn(async move {
            if let Err(e) = tier.write_path_rule(scope.digest(), record).await {
                tracing::debug!(%route, error = %e, "No-Vary-Search rule not recorded in Redis");
            }
        });
    }
    true
}

/// Records the rule of an answer the fill stored for every instance.
pub async fn publish(fill: &FillRequest, headers: &HeaderMap) {
    let scope = scope_of(fill.route_name(), fill.cache_params(), &fill.head);
    let (Some(tier), Some(scope)) = (fill.shared().tier, scope) else {
        return;
    };
    let record =
        NoVarySearch::of(headers).map_or_else(|| "-".to_owned(), |r| r.record().to_owned());
    if let Err(e) = tier.write_path_rule(scope.digest(), record).await {
        tracing::debug!(route = %fill.route_name(), error = %e, "No-Vary-Search rule not recorded in Redis");
    }
}

/// A URL as a write or a purge names it: host, path and query.
#[derive(Clone, Copy)]
pub struct Url<'a> {
    pub host: &'a str,
    pub path: &'a str,
    pub query: Option<&'a str>,
}

/// The keys the rules this instance knows for the path make of `query`
/// (for either scheme), where they differ from `plain`, the key made
/// without one: what a write to, or a purge of, the URL must retire too,
/// since the entry that answers it is stored under them.
pub fn narrowed(cache: &Cache, route: &Route, url: Url<'_>, plain: &UriKey) -> Vec<UriKey> {
    let Url { host, path, query } = url;
    let mut out: Vec<UriKey> = Vec::new();
    if !route.cache.no_vary_search || query.is_none() {
        return out;
    }
    for tls in [false, true] {
        if let PathRule::Rule(rule) = rule_of(&cache.l1, &route.name, (host, path), tls) {
            let key = UriKey::with_rule(host, path, query, &route.cache.query_filter, Some(&rule));
            if key != *plain && !out.contains(&key) {
                out.push(key);
            }
        }
    }
    out
}

/// The key a GET of `head`'s host and path with `query` is looked up
/// under, with the path's rule where the route learns them.
pub fn get_key(
    l1: &L1,
    route: &str,
    params: &CacheParams,
    head: &RequestHead,
    query: Option<&str>,
) -> UriKey {
    let rule = match params.no_vary_search && query.is_some() {
        true => rule_of(l1, route, (&head.host, &head.path), head.tls),
        false => PathRule::Unknown,
    };
    UriKey::with_rule(
        &head.host,
        &head.path,
        query,
        &params.query_filter,
        rule.rule(),
    )
}
