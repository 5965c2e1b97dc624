//! A stored response and its lifecycle: fresh, stale but usable while one
//! refresh runs (stale-while-revalidate), usable only when the origin fails
//! (stale-if-error), or expired. Bodies are `Bytes`, shared, never copied
//! per hit.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header::{
    CONTENT_LENGTH, ETAG, HeaderName, LAST_MODIFIED, SET_COOKIE, TRANSFER_ENCODING,
};
use http::{HeaderMap, StatusCode};
use http_cache_semantics::CachePolicy;

use crate::policy::Freshness;
use crate::vary::Vary;

/// Entries with a validator are kept this much past their stale windows so
/// they can still be revalidated with a cheap 304.
pub const REVALIDATION_GRACE: Duration = Duration::from_secs(3600);
/// No entry stays in memory longer than this, whatever the origin allowed.
pub const MAX_RESIDENCY: Duration = Duration::from_secs(7 * 86400);

/// Where an entry stands at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryState {
    Fresh,
    /// Serve it and refresh in the background.
    StaleWhileRevalidate,
    /// Serve it only if the origin fails.
    StaleIfError,
    /// Only good for a conditional revalidation.
    Expired,
}

/// One stored response.
#[derive(Debug, Clone)]
pub struct StoredResponse {
    pub status: StatusCode,
    /// End-to-end headers as received (hop-by-hop already removed).
    pub headers: HeaderMap,
    pub body: Bytes,
    pub policy: CachePolicy,
    pub response_time: SystemTime,
    pub fresh_until: SystemTime,
    pub swr: Duration,
    pub sie: Duration,
    /// How long the origin took: the XFetch delta.
    pub fetch_duration: Duration,
    pub vary: Vary,
    /// The normalized values of the Vary headers of the request that
    /// produced this response.
    pub vary_values: Vec<String>,
    /// The L1 invalidation stamp read when the fetch started.
    pub generation: u64,
    /// Keyed to one caller's credentials.
    pub private: bool,
    /// RFC 9111 §3.5: may be served to authenticated requests of any caller.
    pub shareable: bool,
    /// The readable URI key (`host/path?query`), for prefix purges. Not
    /// part of the L2 envelope: whoever reads an entry knows its URI.
    pub uri: Arc<str>,
}

impl StoredResponse {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        status: StatusCode,
        mut headers: HeaderMap,
        body: Bytes,
        policy: CachePolicy,
        freshness: &Freshness,
        response_time: SystemTime,
        fetch_duration: Duration,
        vary: Vary,
        vary_values: Vec<String>,
        generation: u64,
        private: bool,
    ) -> Self {
        // A stored copy never hands one caller's cookie to another.
        headers.remove(SET_COOKIE);
        headers.remove(TRANSFER_ENCODING);
        if let Ok(v) = http::HeaderValue::from_str(&body.len().to_string()) {
            headers.insert(CONTENT_LENGTH, v);
        }
        StoredResponse {
            status,
            headers,
            body,
            policy,
            response_time,
            fresh_until: later(response_time, freshness.ttl),
            swr: freshness.swr,
            sie: freshness.sie,
            fetch_duration,
            vary,
            vary_values,
            generation,
            private,
            shareable: freshness.shareable,
            uri: Arc::from(""),
        }
    }

    /// The same entry, labelled with its URI key.
    pub fn with_uri(mut self, uri: &str) -> Self {
        self.uri = Arc::from(uri);
        self
    }

    pub fn state(&self, now: SystemTime) -> EntryState {
        if now < self.fresh_until {
            return EntryState::Fresh;
        }
        let past = now.duration_since(self.fresh_until).unwrap_or_default();
        if past < self.swr {
            EntryState::StaleWhileRevalidate
        } else if past < self.sie {
            EntryState::StaleIfError
        } else {
            EntryState::Expired
        }
    }

    /// True while stale-if-error still allows serving this entry.
    pub fn usable_on_error(&self, now: SystemTime) -> bool {
        now < later(self.fresh_until, self.sie.max(self.swr))
    }

    /// Remaining freshness in whole seconds, negative once stale.
    pub fn ttl_secs(&self, now: SystemTime) -> i64 {
        match self.fresh_until.duration_since(now) {
            Ok(left) => i64::try_from(left.as_secs()).unwrap_or(i64::MAX),
            Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(i64::MAX),
        }
    }

    /// The `Age` to send (RFC 9111 §4.2.3), including the origin's own Age.
    pub fn age_secs(&self, now: SystemTime) -> u64 {
        self.policy.age(now).as_secs()
    }

    pub fn has_validators(&self) -> bool {
        self.headers.contains_key(ETAG) || self.headers.contains_key(LAST_MODIFIED)
    }

    /// True when `request` selects this variant.
    pub fn matches_vary(&self, request: &HeaderMap) -> bool {
        self.vary.values(request) == self.vary_values
    }

    /// How long L1 keeps this entry from `now`.
    pub fn residency(&self, now: SystemTime) -> Duration {
        let mut until = later(self.fresh_until, self.swr.max(self.sie));
        if self.has_validators() {
            until = later(until, REVALIDATION_GRACE);
        }
        until
            .duration_since(now)
            .unwrap_or_default()
            .min(MAX_RESIDENCY)
    }

    /// Bytes this entry costs in L1.
    pub fn weight(&self) -> u32 {
        let headers: usize = self
            .headers
            .iter()
            .map(|(n, v)| n.as_str().len() + v.len() + 32)
            .sum();
        // A sealed body occupies whole pages.
        let body = if crate::sealed::is_sealed(&self.body) {
            self.body.len().div_ceil(4096) * 4096
        } else {
            self.body.len()
        };
        u32::try_from(body + headers + 512).unwrap_or(u32::MAX)
    }

    /// This entry refreshed by a 304, with `headers` from
    /// [`merge_not_modified`].
    pub fn revalidated(
        &self,
        headers: HeaderMap,
        policy: CachePolicy,
        freshness: &Freshness,
        response_time: SystemTime,
        generation: u64,
    ) -> Self {
        StoredResponse {
            headers,
            policy,
            response_time,
            fresh_until: later(response_time, freshness.ttl),
            swr: freshness.swr,
            sie: freshness.sie,
            shareable: freshness.shareable,
            generation,
            ..self.clone()
        }
    }
}

/// `t + d`, saturating far in the future instead of overflowing: the
/// durations come from origin headers and L2 values.
fn later(t: SystemTime, d: Duration) -> SystemTime {
    t.checked_add(d.min(MAX_RESIDENCY * 1000)).unwrap_or(t)
}

/// The stored headers updated by a 304's: each field the 304 carries
/// replaces the stored field of that name (RFC 9111 §3.2), except framing.
pub fn merge_not_modified(stored: &HeaderMap, not_modified: &HeaderMap) -> HeaderMap {
    let mut headers = stored.clone();
    let names: Vec<&HeaderName> = not_modified
        .keys()
        .filter(|n| **n != CONTENT_LENGTH && **n != TRANSFER_ENCODING && **n != SET_COOKIE)
        .collect();
    for name in names {
        headers.remove(name);
        for v in not_modified.get_all(name) {
            headers.append(name.clone(), v.clone());
        }
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn entry(ttl: u64, swr: u64, sie: u64) -> StoredResponse {
        let now = SystemTime::now();
        let req = http::Request::get("http://h/").body(()).expect("req");
        let res = http::Response::builder()
            .header("cache-control", "max-age=60")
            .body(())
            .expect("res");
        let policy = CachePolicy::new(&req, &res);
        let fr = Freshness {
            ttl: Duration::from_secs(ttl),
            swr: Duration::from_secs(swr),
            sie: Duration::from_secs(sie),
            shareable: true,
        };
        let mut h = HeaderMap::new();
        h.insert("etag", HeaderValue::from_static("\"v1\""));
        h.insert("x-a", HeaderValue::from_static("1"));
        h.insert("set-cookie", HeaderValue::from_static("s=1"));
        StoredResponse::new(
            StatusCode::OK,
            h,
            Bytes::from_static(b"hello"),
            policy,
            &fr,
            now,
            Duration::from_millis(10),
            Vary::None,
            vec![],
            0,
            false,
        )
    }

    #[test]
    fn states_follow_the_windows() {
        let e = entry(10, 5, 20);
        let t = e.response_time;
        assert_eq!(e.state(t), EntryState::Fresh);
        assert_eq!(
            e.state(t + Duration::from_secs(12)),
            EntryState::StaleWhileRevalidate
        );
        assert_eq!(
            e.state(t + Duration::from_secs(20)),
            EntryState::StaleIfError
        );
        assert_eq!(e.state(t + Duration::from_secs(31)), EntryState::Expired);
        assert_eq!(e.ttl_secs(t + Duration::from_secs(13)), -3);
        assert!(e.usable_on_error(t + Duration::from_secs(29)));
        assert!(!e.usable_on_error(t + Duration::from_secs(30)));
    }

    #[test]
    fn stored_copy_drops_set_cookie_and_states_its_length() {
        let e = entry(10, 0, 0);
        assert!(e.headers.get("set-cookie").is_none());
        assert_eq!(
            e.headers.get("content-length").map(|v| v.as_bytes()),
            Some(&b"5"[..])
        );
        // validators keep the entry around for a 304 after it expired.
        assert!(e.residency(e.response_time) > REVALIDATION_GRACE);
    }

    #[test]
    fn revalidation_replaces_named_headers_only() {
        let e = entry(0, 0, 0);
        let mut h304 = HeaderMap::new();
        h304.insert("x-a", HeaderValue::from_static("2"));
        h304.insert("content-length", HeaderValue::from_static("0"));
        let fr = Freshness {
            ttl: Duration::from_secs(60),
            swr: Duration::ZERO,
            sie: Duration::ZERO,
            shareable: true,
        };
        let later = e.response_time + Duration::from_secs(5);
        let r = e.revalidated(
            merge_not_modified(&e.headers, &h304),
            e.policy.clone(),
            &fr,
            later,
            3,
        );
        assert_eq!(r.headers.get("x-a").map(|v| v.as_bytes()), Some(&b"2"[..]));
        assert_eq!(
            r.headers.get("content-length").map(|v| v.as_bytes()),
            Some(&b"5"[..])
        );
        assert_eq!(
            r.headers.get("etag").map(|v| v.as_bytes()),
            Some(&b"\"v1\""[..])
        );
        assert_eq!(r.state(later), EntryState::Fresh);
        assert_eq!(r.body, e.body);
    }
}
