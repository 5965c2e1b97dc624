//! The purge API on the admin listener, behind a bearer token:
//! `POST /purge?url=URL`, `?prefix=URL-PREFIX`, `?tag=TAG`, each with
//! `&soft=true` to mark entries stale (stale-while-revalidate then serves
//! them while one refresh runs) instead of removing them. With Redis, a
//! purge reaches every instance: hard URL purges delete the L2 entries,
//! prefix / tag / soft purges become bans stored in Redis and broadcast.

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use corral_core::{BanTarget, UriKey};
use serde::Deserialize;

use crate::app::App;
use crate::ops::{AdminState, json_line};

#[derive(Debug, Deserialize)]
pub struct PurgeQuery {
    url: Option<String>,
    prefix: Option<String>,
    tag: Option<String>,
    #[serde(default)]
    soft: bool,
}

/// `POST /purge`.
pub async fn handle(
    State(s): State<Arc<AdminState>>,
    headers: HeaderMap,
    Query(q): Query<PurgeQuery>,
) -> impl IntoResponse {
    let Some(expected) = s.purge_token.as_deref() else {
        return reply(
            StatusCode::FORBIDDEN,
            "purging is disabled: set server.purge_token or CORRAL_PURGE_TOKEN",
        );
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if !constant_time_eq(given.as_bytes(), expected.as_bytes()) {
        return reply(StatusCode::UNAUTHORIZED, "missing or wrong bearer token");
    }
    let app = &s.app;
    let scope = if app.l2.is_some() {
        "cluster"
    } else {
        "instance"
    };
    let mode = if q.soft { "soft" } else { "hard" };
    let result = match (&q.url, &q.prefix, &q.tag) {
        (Some(url), None, None) => purge_url(app, url, q.soft).await,
        (None, Some(prefix), None) => match uri_prefix(prefix) {
            Some(p) => {
                crate::cache::invalidate::ban(&app.cache, BanTarget::Prefix(p.clone()), q.soft)
                    .await;
                Ok(p)
            }
            None => Err("prefix must be a URL (http://host/path) or host/path"),
        },
        (None, None, Some(tag)) if !tag.trim().is_empty() && !tag.contains(['\t', '\n']) => {
            crate::cache::invalidate::ban(
                &app.cache,
                BanTarget::Tag(tag.trim().to_owned()),
                q.soft,
            )
            .await;
            Ok(tag.trim().to_owned())
        }
        _ => Err("give exactly one of url, prefix or tag"),
    };
    match result {
        Ok(what) => {
            tracing::info!(what = %what, mode, scope, "purged");
            (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "application/json")],
                json_line(&Purged {
                    purged: &what,
                    mode,
                    scope,
                }),
            )
        }
        Err(why) => reply(StatusCode::BAD_REQUEST, why),
    }
}

#[derive(serde::Serialize)]
struct Purged<'a> {
    purged: &'a str,
    mode: &'a str,
    scope: &'a str,
}

#[derive(serde::Serialize)]
struct Refused<'a> {
    error: &'a str,
}

fn reply(
    status: StatusCode,
    message: &str,
) -> (StatusCode, [(header::HeaderName, &'static str); 1], String) {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        json_line(&Refused { error: message }),
    )
}

/// Purge tokens shorter than this are refused: the token guards every
/// cached answer.
const MIN_TOKEN_CHARS: usize = 16;

/// The purge token in force: `server.purge_token` (checked by the config
/// loader), else `CORRAL_PURGE_TOKEN` (`env`), held to the same minimum. An
/// empty variable counts as unset.
pub fn token(configured: Option<&str>, env: Option<&str>) -> Result<Option<String>, String> {
    token_of(configured, env, "CORRAL_PURGE_TOKEN", "cache purges")
}

/// A token in force: the configured one, else the environment variable
/// `var`'s (`env`), held to the same minimum (it guards `what`).
pub fn token_of(
    configured: Option<&str>,
    env: Option<&str>,
    var: &str,
    what: &str,
) -> Result<Option<String>, String> {
    if let Some(t) = configured {
        return Ok(Some(t.to_owned()));
    }
    match env.map(str::trim).filter(|t| !t.is_empty()) {
        None => Ok(None),
        Some(t) if t.chars().count() < MIN_TOKEN_CHARS => Err(format!(
            "{var} must be at least {MIN_TOKEN_CHARS} characters: it guards {what}"
        )),
        Some(t) => Ok(Some(t.to_owned())),
    }
}

pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `http://Host:port/path?q` or `host/path` → the URI key form `host/path?q`.
/// The host must be one a request could carry (validated as a Host field
/// is, never empty), and a prefix without a path means the whole host
/// (`host/`), so `a.test` cannot purge `a.test.example`.
fn uri_prefix(s: &str) -> Option<String> {
    let rest = s
        .strip_prefix("http://")
        .or_else(|| s.strip_prefix("https://"))
        .unwrap_or(s);
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, "/"),
    };
    let host = corral_core::semantics::head::parse_authority(authority.as_bytes())
        .filter(|h| !h.is_empty())?;
    Some(format!("{host}{path}"))
}

async fn purge_url(app: &Arc<App>, url: &str, soft: bool) -> Result<String, &'static str> {
    let uri: http::Uri = url.parse().map_err(|_| "url is not a valid URL")?;
    let authority = uri
        .authority()
        .map(|a| a.as_str())
        .ok_or("url must be absolute: http://host/path")?;
    let host = corral_core::semantics::head::parse_authority(authority.as_bytes())
        .filter(|h| !h.is_empty())
        .ok_or("url must name a valid host")?;
    // The path in the form requests are routed and keyed on.
    let path = corral_core::semantics::path::normalize(uri.path())
        .map_err(|_| "url's path is refused as a request's would be (encoded '/', '..' above the root, bad escapes)")?;
    let routes = app.routes();
    let route = routes
        .find(&host, &path)
        .ok_or("no route serves this url")?;
    let key = UriKey::new(&host, &path, uri.query(), &route.cache.query_filter);
    let readable = key.readable().to_owned();
    // Under a No-Vary-Search rule, the entry that answers the URL is
    // stored under the key the rule makes of it.
    let url = crate::cache::rules::Url {
        host: host.as_str(),
        path: path.as_ref(),
        query: uri.query(),
    };
    let narrowed = crate::cache::rules::narrowed(&app.cache, route, url, &key);
    for key in narrowed.into_iter().chain([key]) {
        if soft {
            let target = BanTarget::Uri(key.readable().to_owned());
            crate::cache::invalidate::ban(&app.cache, target, true).await;
        } else {
            crate::cache::invalidate::everywhere(&app.cache, &route.name, key).await;
        }
    }
    Ok(readable)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_normalize_like_keys() {
        assert_eq!(
            uri_prefix("http://API.example.com:8080/v1/").as_deref(),
            Some("api.example.com/v1/")
        );
        assert_eq!(
            uri_prefix("api.example.com/v1").as_deref(),
            Some("api.example.com/v1")
        );
        assert_eq!(uri_prefix("/v1"), None);
        // A host alone means everything under it, and nothing beyond.
        assert_eq!(uri_prefix("a.test").as_deref(), Some("a.test/"));
        // No host, or no valid one: refused, never "purge everything".
        for bad in [":", "http://:80/", "http://", "", "a b/x", "http://[::1/x"] {
            assert_eq!(uri_prefix(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_environment_token_is_held_to_the_same_minimum() {
        assert_eq!(token(None, None), Ok(None));
        assert_eq!(token(None, Some("  ")), Ok(None));
        assert!(token(None, Some("short")).is_err());
        assert_eq!(
            token(None, Some("0123456789abcdef")),
            Ok(Some("0123456789abcdef".to_owned()))
        );
        assert_eq!(
            token(Some("from-the-config-file"), Some("short")),
            Ok(Some("from-the-config-file".to_owned()))
        );
    }

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
    }
}
