//! Hop-by-hop headers (RFC 9110 §7.6.1): they describe one connection and
//! must never be forwarded, in either direction, nor stored.

use http::HeaderMap;
use http::header::{CONNECTION, HeaderName};

/// True for the hop-by-hop fields every connection has (RFC 9110 §7.6.1,
/// and the obsolete Keep-Alive and Proxy-Connection) and Upgrade: a
/// `match`, not a scan, since it runs for every header of every request
/// and answer.
pub(crate) fn fixed(n: &str) -> bool {
    matches!(
        n,
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

/// Removes the hop-by-hop headers, including those the Connection field names.
///
/// One pass over the names present, so a request or response that carries
/// none (the usual case) costs a few comparisons, not a hash lookup for
/// every name that could be there.
pub fn strip(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = if headers.contains_key(CONNECTION) {
        headers
            .get_all(CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
            .collect()
    } else {
        Vec::new()
    };
    let doomed: Vec<HeaderName> = headers
        .keys()
        .filter(|n| fixed(n.as_str()) || named.contains(n))
        .cloned()
        .collect();
    for n in doomed {
        headers.remove(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use http::header::{
        PROXY_AUTHENTICATE, PROXY_AUTHORIZATION, TE, TRAILER, TRANSFER_ENCODING, UPGRADE,
    };

    #[test]
    fn the_name_match_agrees_with_the_list() {
        let every = [
            CONNECTION,
            HeaderName::from_static("keep-alive"),
            HeaderName::from_static("proxy-connection"),
            PROXY_AUTHENTICATE,
            PROXY_AUTHORIZATION,
            TE,
            TRAILER,
            TRANSFER_ENCODING,
            UPGRADE,
        ];
        for n in &every {
            assert!(fixed(n.as_str()), "{n}");
        }
        for n in ["accept", "connectio", "tee", "x-upgrade", "host"] {
            assert!(!fixed(n), "{n}");
        }
    }

    #[test]
    fn removes_fixed_and_connection_named_headers() {
        let mut h = HeaderMap::new();
        h.insert(CONNECTION, HeaderValue::from_static("close, X-Custom"));
        h.insert("x-custom", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        h.insert("x-keep", HeaderValue::from_static("1"));
        strip(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-keep"));
    }

    #[test]
    fn removes_every_value_of_a_repeated_field_and_upgrade() {
        let mut h = HeaderMap::new();
        h.append("te", HeaderValue::from_static("trailers"));
        h.append("te", HeaderValue::from_static("gzip"));
        h.insert(UPGRADE, HeaderValue::from_static("websocket"));
        h.append(CONNECTION, HeaderValue::from_static("x-a"));
        h.append(CONNECTION, HeaderValue::from_static(" X-B ,"));
        h.insert("x-a", HeaderValue::from_static("1"));
        h.insert("x-b", HeaderValue::from_static("1"));
        h.insert("accept", HeaderValue::from_static("*/*"));
        strip(&mut h);
        assert_eq!(h.keys().collect::<Vec<_>>(), ["accept"]);
    }
}
