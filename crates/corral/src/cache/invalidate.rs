//! Invalidation: what a write through corral (RFC 9111 §4.4, and the
//! groups RFC 9875's Cache-Group-Invalidation names) and a purge retire,
//! here and, through the shared tier, on every instance.

use corral_core::semantics::head::RequestHead;
use corral_core::{Ban, BanTarget, PrimaryKey, UriKey};
use http::header::{CONTENT_LOCATION, LOCATION};
use http::{HeaderMap, Uri};

use crate::cache::fill::Cache;

static CACHE_GROUP_INVALIDATION: http::HeaderName =
    http::HeaderName::from_static("cache-group-invalidation");
use crate::routes::Route;

/// Retires the URI here and, with Redis, on every instance. Redis trouble
/// is logged, not answered: the client's write already succeeded.
pub async fn everywhere(cache: &Cache, route_name: &str, uri: UriKey) {
    cache.l1.invalidate_uri(&uri);
    if let Some(tier) = &cache.tier {
        // L1 indexes entries by URI, whatever the scheme; L2 by primary
        // key, which holds the scheme: both schemes' entries go.
        let primaries = [false, true].map(|tls| PrimaryKey::get(route_name, uri.clone(), tls));
        let result = tier.invalidate(&primaries, &uri).await;
        let key = primaries[0].loggable();
        tracing::debug!(key = %key, ok = result.is_ok(), "cluster-wide invalidation");
        if let Err(e) = result {
            tracing::warn!(key = %key, error = %e, "cluster-wide invalidation failed; other instances keep their copy until it expires");
        }
    }
}

/// Adds a ban here and, with Redis, records and broadcasts it.
pub async fn ban(cache: &Cache, target: BanTarget, soft: bool) {
    let ban = Ban {
        target,
        at: cache.clock.now(),
        soft,
    };
    cache.l1.add_ban(ban.clone());
    if let Some(tier) = &cache.tier
        && let Err(e) = tier.publish_ban(&ban).await
    {
        tracing::warn!(error = %e, "the purge could not reach the other instances; they keep their copies until expiry");
    }
}

/// A write (an unsafe method answered 2xx or 3xx) retires the target URI,
/// the same-origin URIs its Location and Content-Location name (RFC 9111
/// §4.4), and the same-origin responses of every group its
/// Cache-Group-Invalidation lists (RFC 9875).
pub async fn after_write(
    cache: &Cache,
    routes: &crate::routes::RouteTable,
    route: &Route,
    ctx: &RequestHead,
    response: &HeaderMap,
) {
    for group in corral_core::string_list(response, &CACHE_GROUP_INVALIDATION) {
        let target = BanTarget::Group {
            host: ctx.host.clone(),
            group,
        };
        ban(cache, target, false).await;
    }
    let uri = UriKey::new(
        &ctx.host,
        &ctx.path,
        ctx.query.as_deref(),
        &route.cache.query_filter,
    );
    let url = crate::cache::rules::Url {
        host: ctx.host.as_str(),
        path: ctx.path.as_str(),
        query: ctx.query.as_deref(),
    };
    for narrowed in crate::cache::rules::narrowed(cache, route, url, &uri) {
        everywhere(cache, &route.name, narrowed).await;
    }
    everywhere(cache, &route.name, uri).await;
    for name in [LOCATION, CONTENT_LOCATION] {
        let Some(target) = response.get(&name).and_then(|v| v.to_str().ok()) else {
            continue;
        };
        let Ok(uri) = target.parse::<Uri>() else {
            continue;
        };
        // Only the same origin: a response must not evict another site's
        // entries (RFC 9111 §4.4).
        let same_origin = uri.authority().is_none_or(|a| {
            corral_core::semantics::head::parse_authority(a.as_str().as_bytes()).as_deref()
                == Some(ctx.host.as_str())
        });
        if !same_origin || !uri.path().starts_with('/') {
            continue;
        }
        // Keys hold the normal form of a path; one no request could have
        // is in no key.
        let Ok(path) = corral_core::semantics::path::normalize(uri.path()) else {
            continue;
        };
        let target = routes.find(&ctx.host, &path).map_or(route, |r| r.as_ref());
        let key = UriKey::new(&ctx.host, &path, uri.query(), &target.cache.query_filter);
        let url = crate::cache::rules::Url {
            host: ctx.host.as_str(),
            path: path.as_ref(),
            query: uri.query(),
        };
        for narrowed in crate::cache::rules::narrowed(cache, target, url, &key) {
            everywhere(cache, &target.name, narrowed).await;
        }
        everywhere(cache, &target.name, key).await;
    }
}
