//! The RFC 9211 `Cache-Status` field corral adds to every answer: what the
//! cache did with the request. Built in one place so every path names its
//! outcome the same way.

use http::HeaderValue;

/// The cache's name in `Cache-Status`.
pub const CACHE_NAME: &str = "corral";

/// Why the request was forwarded (RFC 9211 §2.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forward {
    /// Nothing stored could be used; corral cannot tell which of the two below.
    Miss,
    /// Nothing stored for this URI.
    UriMiss,
    /// The URI is stored, but not the variant this request selects.
    VaryMiss,
    /// A stored response was stale and had to be refreshed.
    Stale,
    /// The request's own semantics prevented using the cache.
    Request,
    /// The cache was configured not to handle this request.
    Bypass,
}

impl Forward {
    fn as_str(self) -> &'static str {
        match self {
            Forward::Miss => "miss",
            Forward::UriMiss => "uri-miss",
            Forward::VaryMiss => "vary-miss",
            Forward::Stale => "stale",
            Forward::Request => "request",
            Forward::Bypass => "bypass",
        }
    }
}

/// One `Cache-Status` entry for corral.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheStatus {
    pub hit: bool,
    pub fwd: Option<Forward>,
    pub fwd_status: Option<u16>,
    pub stored: bool,
    pub collapsed: bool,
    /// Remaining freshness in seconds; negative when stale.
    pub ttl: Option<i64>,
    pub detail: Option<&'static str>,
}

impl CacheStatus {
    /// A fresh hit.
    pub fn hit(ttl: i64) -> Self {
        CacheStatus {
            hit: true,
            ttl: Some(ttl),
            ..Default::default()
        }
    }

    /// A forwarded request.
    pub fn forward(fwd: Forward) -> Self {
        CacheStatus {
            fwd: Some(fwd),
            ..Default::default()
        }
    }

    pub fn with_fwd_status(mut self, status: u16) -> Self {
        self.fwd_status = Some(status);
        self
    }

    pub fn with_detail(mut self, detail: &'static str) -> Self {
        self.detail = Some(detail);
        self
    }

    pub fn with_ttl(mut self, ttl: i64) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// The field value, e.g. `corral; fwd=uri-miss; fwd-status=200; stored; ttl=60`.
    pub fn to_header_value(&self) -> HeaderValue {
        let mut s = String::with_capacity(64);
        s.push_str(CACHE_NAME);
        if self.hit {
            s.push_str("; hit");
        }
        if let Some(fwd) = self.fwd {
            s.push_str("; fwd=");
            s.push_str(fwd.as_str());
        }
        if let Some(status) = self.fwd_status {
            s.push_str("; fwd-status=");
            push_int(&mut s, i64::from(status));
        }
        if self.stored {
            s.push_str("; stored");
        }
        if self.collapsed {
            s.push_str("; collapsed");
        }
        if let Some(ttl) = self.ttl {
            s.push_str("; ttl=");
            push_int(&mut s, ttl);
        }
        if let Some(detail) = self.detail {
            s.push_str("; detail=");
            s.push_str(detail);
        }
        // Only ASCII tokens and numbers are written above; the String's
        // buffer becomes the header value without a copy.
        HeaderValue::from_maybe_shared(bytes::Bytes::from(s))
            .unwrap_or_else(|_| HeaderValue::from_static(CACHE_NAME))
    }
}

/// `n` in decimal, without the formatting machinery (this runs on every
/// answer).
fn push_int(s: &mut String, n: i64) {
    if n < 0 {
        s.push('-');
    }
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut v = n.unsigned_abs();
    loop {
        i -= 1;
        digits[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    for &d in &digits[i..] {
        s.push(char::from(d));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_are_written_like_display() {
        for n in [0, 1, 9, 10, 59, 86_399, -1, -6, -10, i64::MAX, i64::MIN] {
            let mut s = String::new();
            push_int(&mut s, n);
            assert_eq!(s, n.to_string());
        }
    }

    #[test]
    fn formats_parameters_in_rfc9211_order() {
        let mut st = CacheStatus::forward(Forward::UriMiss).with_fwd_status(200);
        st.stored = true;
        st.collapsed = true;
        st.ttl = Some(59);
        assert_eq!(
            st.to_header_value(),
            "corral; fwd=uri-miss; fwd-status=200; stored; collapsed; ttl=59"
        );
        assert_eq!(
            CacheStatus::hit(-3).to_header_value(),
            "corral; hit; ttl=-3"
        );
        assert_eq!(
            CacheStatus::forward(Forward::Stale)
                .with_detail("stale-if-error")
                .to_header_value(),
            "corral; fwd=stale; detail=stale-if-error"
        );
    }
}
