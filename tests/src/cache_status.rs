//! Reads corral's RFC 9211 `Cache-Status` response header.

/// The `corral` member of a `Cache-Status` header.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheStatus {
    raw: String,
    params: Vec<(String, Option<String>)>,
}

impl CacheStatus {
    /// Parses a header value; the last member named `corral` wins (a cache
    /// appends its member after those of caches closer to the origin).
    pub fn parse(value: &str) -> Self {
        let member = value
            .split(',')
            .rev()
            .find(|m| m.split(';').next().map(str::trim) == Some("corral"))
            .unwrap_or("");
        let params = member
            .split(';')
            .skip(1)
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| match p.split_once('=') {
                Some((k, v)) => (
                    k.trim().to_owned(),
                    Some(v.trim().trim_matches('"').to_owned()),
                ),
                None => (p.to_owned(), None),
            })
            .collect();
        Self {
            raw: value.to_owned(),
            params,
        }
    }

    /// The header as received.
    pub fn raw(&self) -> &str {
        &self.raw
    }

    /// Whether a parameter is present (`hit`, `stored`, `collapsed`, `fwd`…).
    pub fn has(&self, key: &str) -> bool {
        self.params.iter().any(|(k, _)| k == key)
    }

    /// The value of a parameter (`fwd`, `fwd-status`, `ttl`, `detail`).
    pub fn param(&self, key: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k == key)
            .and_then(|(_, v)| v.as_deref())
    }

    /// Served from cache without contacting the origin.
    pub fn is_hit(&self) -> bool {
        self.has("hit")
    }

    /// Why the request went forward, if it did.
    pub fn fwd(&self) -> Option<&str> {
        self.param("fwd")
    }

    /// The answer was stored.
    pub fn stored(&self) -> bool {
        self.has("stored")
    }

    /// The request waited on another request's fetch.
    pub fn collapsed(&self) -> bool {
        self.has("collapsed")
    }

    /// The `detail` parameter.
    pub fn detail(&self) -> Option<&str> {
        self.param("detail")
    }
}

impl std::fmt::Display for CacheStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.raw)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_of_the_corral_member_are_read() {
        let status = CacheStatus::parse(
            "origin-cdn; hit, corral; fwd=uri-miss; fwd-status=200; stored; ttl=59",
        );
        assert_eq!(status.fwd(), Some("uri-miss"));
        assert_eq!(status.param("fwd-status"), Some("200"));
        assert!(status.stored());
        assert!(!status.is_hit());
        assert!(!status.collapsed());
        assert_eq!(status.param("ttl"), Some("59"));
    }

    #[test]
    fn a_quoted_detail_is_unquoted() {
        let status = CacheStatus::parse("corral; fwd=stale; detail=\"stale-if-error\"");
        assert_eq!(status.detail(), Some("stale-if-error"));
    }

    #[test]
    fn a_header_without_corral_has_no_parameters() {
        let status = CacheStatus::parse("other; hit");
        assert!(!status.is_hit());
    }
}
