//! Who is asking. When a request carries credentials (the route's identity
//! headers, Authorization by default, or named cookies) a keyed hash of them
//! becomes part of the key, so one caller's answer never reaches another.
//! Credential values are hashed here and never kept or logged.

use http::HeaderMap;
use http::header::{COOKIE, HeaderName};

/// A keyed hash of a caller's credentials.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Identity([u8; 32]);

impl Identity {
    pub fn from_bytes(b: [u8; 32]) -> Self {
        Identity(b)
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Identity(..)")
    }
}

/// Which request headers and cookies identify a caller.
#[derive(Debug, Clone)]
pub struct IdentityRules {
    headers: Vec<HeaderName>,
    cookies: Vec<String>,
    key: [u8; 32],
}

impl IdentityRules {
    pub fn new(headers: Vec<HeaderName>, cookies: Vec<String>) -> Self {
        // The same key in every process, so that instances sharing a cache
        // agree on keys; the hash is keyed so a key does not reveal a
        // credential to anyone who can only read the store.
        let key = blake3::derive_key("corral 2026-11 identity v1", b"");
        IdentityRules {
            headers,
            cookies,
            key,
        }
    }

    /// True when `name` is one of the headers that identify a caller.
    pub fn is_identity_header(&self, name: &HeaderName) -> bool {
        self.headers.contains(name)
    }

    /// The caller's identity, or `None` for an anonymous request.
    pub fn identify(&self, headers: &HeaderMap) -> Option<Identity> {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        let mut found = false;
        for name in &self.headers {
            for value in headers.get_all(name) {
                found = true;
                h.update(name.as_str().as_bytes());
                h.update(b"\x00");
                h.update(value.as_bytes());
                h.update(b"\x00");
            }
        }
        if !self.cookies.is_empty() {
            let mut pairs: Vec<(&str, &str)> = headers
                .get_all(COOKIE)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(|v| v.split(';'))
                .filter_map(|c| c.trim().split_once('='))
                .filter(|(n, _)| self.cookies.iter().any(|c| c == n))
                .collect();
            pairs.sort_unstable();
            for (n, v) in pairs {
                found = true;
                h.update(b"cookie\x00");
                h.update(n.as_bytes());
                h.update(b"=");
                h.update(v.as_bytes());
                h.update(b"\x00");
            }
        }
        found.then(|| Identity(*h.finalize().as_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use http::header::AUTHORIZATION;

    fn rules() -> IdentityRules {
        IdentityRules::new(vec![AUTHORIZATION], vec!["session".into()])
    }

    #[test]
    fn anonymous_requests_have_no_identity() {
        let mut h = HeaderMap::new();
        h.insert(COOKIE, HeaderValue::from_static("theme=dark"));
        assert!(rules().identify(&h).is_none());
    }

    #[test]
    fn different_credentials_differ_and_same_ones_agree() {
        let mk = |auth: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(AUTHORIZATION, HeaderValue::from_static(auth));
            rules().identify(&h)
        };
        assert_ne!(mk("Bearer a"), mk("Bearer b"));
        assert_eq!(mk("Bearer a"), mk("Bearer a"));
    }

    #[test]
    fn named_cookies_identify_regardless_of_order_and_others() {
        let mk = |c: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(COOKIE, HeaderValue::from_static(c));
            rules().identify(&h)
        };
        assert_eq!(mk("theme=1; session=abc"), mk("session=abc; x=2"));
        assert_ne!(mk("session=abc"), mk("session=abd"));
    }
}
