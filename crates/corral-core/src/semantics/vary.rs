//! Vary: which request headers select among stored responses, and how their
//! values are normalized so that equivalent requests share an entry
//! (`gzip, br` and `br,gzip`). `Vary: *` can never be served from cache.

use http::HeaderMap;
use http::header::{ACCEPT, ACCEPT_ENCODING, ACCEPT_LANGUAGE, HeaderName, VARY};

/// What a response's Vary field says.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Vary {
    /// No Vary: one response serves every request for the URI.
    #[default]
    None,
    /// Select on these request headers (lowercased, sorted, deduplicated).
    Headers(Vec<HeaderName>),
    /// `Vary: *`: never served from cache.
    Star,
}

impl Vary {
    pub fn parse(headers: &HeaderMap) -> Self {
        let mut names = Vec::new();
        for value in headers.get_all(VARY) {
            let Ok(value) = value.to_str() else {
                return Vary::Star;
            };
            for token in value.split(',').map(str::trim).filter(|t| !t.is_empty()) {
                if token == "*" {
                    return Vary::Star;
                }
                match HeaderName::from_bytes(token.to_ascii_lowercase().as_bytes()) {
                    Ok(n) => names.push(n),
                    Err(_) => return Vary::Star,
                }
            }
        }
        if names.is_empty() {
            return Vary::None;
        }
        names.sort_unstable_by(|a, b| a.as_str().cmp(b.as_str()));
        names.dedup();
        Vary::Headers(names)
    }

    /// The header names this Vary selects on (none for `None` and `Star`).
    pub fn names(&self) -> &[HeaderName] {
        match self {
            Vary::Headers(n) => n,
            _ => &[],
        }
    }

    /// The request's normalized values for the selecting headers, in order.
    pub fn values(&self, request: &HeaderMap) -> Vec<String> {
        self.names()
            .iter()
            .map(|n| normalized_value(n, request))
            .collect()
    }
}

/// One request header's value, normalized for comparison. An absent header
/// is distinct from an empty one.
pub fn normalized_value(name: &HeaderName, headers: &HeaderMap) -> String {
    let mut raw = headers.get_all(name).iter().peekable();
    if raw.peek().is_none() {
        return "\u{0}absent".to_owned();
    }
    let mut tokens: Vec<String> = raw
        .flat_map(|v| {
            escaped(v.as_bytes())
                .split(',')
                .map(collapse)
                .collect::<Vec<_>>()
        })
        .filter(|t| !t.is_empty())
        .collect();
    if name == ACCEPT_ENCODING || name == ACCEPT_LANGUAGE || name == ACCEPT {
        // Codings, language ranges and media ranges are case-insensitive,
        // and the order of a list of them carries no meaning (weights do,
        // and stay attached to their member). A media range's parameters
        // may be case-sensitive: only the range itself is lowercased.
        for t in &mut tokens {
            *t = if name == ACCEPT {
                match t.split_once(';') {
                    Some((range, params)) => format!("{};{params}", range.to_ascii_lowercase()),
                    None => t.to_ascii_lowercase(),
                }
            } else {
                t.to_ascii_lowercase()
            };
        }
        tokens.sort_unstable();
        tokens.dedup();
    }
    tokens.join(",")
}

/// A header value as text that keeps every byte apart: bytes outside
/// visible ASCII (and `%` itself) become `%XX`, so two different values
/// never read as one (a lossy conversion would map every invalid byte to
/// U+FFFD and merge their variants).
fn escaped(value: &[u8]) -> String {
    let mut out = String::with_capacity(value.len());
    for &b in value {
        if b == b'%' || !(b == b'\t' || (0x20..0x7f).contains(&b)) {
            out.push('%');
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xf)]));
        } else {
            out.push(char::from(b));
        }
    }
    out
}

const HEX: &[u8; 16] = b"0123456789ABCDEF";

/// Trims and removes whitespace around `;` and `=` and collapses runs.
fn collapse(token: &str) -> String {
    let mut out = String::with_capacity(token.len());
    let mut pending_space = false;
    for c in token.trim().chars() {
        if c.is_ascii_whitespace() {
            pending_space = true;
            continue;
        }
        if pending_space && !matches!(c, ';' | '=') && !out.ends_with([';', '=']) {
            out.push(' ');
        }
        pending_space = false;
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(*n, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn parses_names_and_star() {
        let v = Vary::parse(&headers(&[
            ("vary", "Accept-Encoding, accept-language"),
            ("vary", "Accept-Encoding"),
        ]));
        assert_eq!(v.names().len(), 2);
        assert_eq!(Vary::parse(&headers(&[("vary", "Accept, *")])), Vary::Star);
        assert_eq!(Vary::parse(&headers(&[])), Vary::None);
    }

    #[test]
    fn accept_encoding_is_normalized() {
        let a = normalized_value(
            &ACCEPT_ENCODING,
            &headers(&[("accept-encoding", "gzip, br")]),
        );
        let b = normalized_value(
            &ACCEPT_ENCODING,
            &headers(&[("accept-encoding", "BR,gzip")]),
        );
        let c = normalized_value(&ACCEPT_ENCODING, &headers(&[("accept-encoding", "gzip")]));
        assert_eq!(a, b);
        assert_ne!(a, c);
        let q1 = normalized_value(
            &ACCEPT_ENCODING,
            &headers(&[("accept-encoding", "gzip ; q=0.5")]),
        );
        let q2 = normalized_value(
            &ACCEPT_ENCODING,
            &headers(&[("accept-encoding", "gzip;q=0.5")]),
        );
        assert_eq!(q1, q2);
    }

    #[test]
    fn different_bytes_never_share_a_variant() {
        let n = HeaderName::from_static("accept-language");
        let v = |b: &[u8]| {
            let mut h = HeaderMap::new();
            h.insert(&n, HeaderValue::from_bytes(b).expect("value"));
            normalized_value(&n, &h)
        };
        assert_ne!(v(b"fr\xff"), v(b"fr\xfe"));
        assert_ne!(v(b"fr\xff"), v(b"fr%FF"));
        assert_eq!(v(b"fr\xff"), v(b"fr\xff"));
    }

    #[test]
    fn absent_differs_from_empty() {
        let n = HeaderName::from_static("accept-language");
        assert_ne!(
            normalized_value(&n, &headers(&[])),
            normalized_value(&n, &headers(&[("accept-language", "")]))
        );
    }

    #[test]
    fn language_and_media_ranges_differing_in_case_or_order_are_one_variant() {
        let one = |name: &HeaderName, v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(name.clone(), HeaderValue::from_static(v));
            normalized_value(name, &h)
        };
        assert_eq!(
            one(&ACCEPT_LANGUAGE, "en-US, fr;q=0.5"),
            one(&ACCEPT_LANGUAGE, "FR;q=0.5,EN-us")
        );
        assert_ne!(
            one(&ACCEPT_LANGUAGE, "en-US, fr;q=0.5"),
            one(&ACCEPT_LANGUAGE, "en-US, fr;q=0.6")
        );
        assert_eq!(
            one(&ACCEPT, "Text/HTML, application/json;q=0.9"),
            one(&ACCEPT, "application/JSON;q=0.9, text/html")
        );
        // Parameter values keep their case.
        assert_ne!(
            one(&ACCEPT, "text/html;level=A"),
            one(&ACCEPT, "text/html;level=a")
        );
    }
}
