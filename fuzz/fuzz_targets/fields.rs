//! Arbitrary bytes as the request and response fields corral parses with
//! its own code for RFC 9110/9111/9213/9875, one field value per line:
//! Range, If-Range, a stored ETag, Last-Modified and Date, Cache-Groups,
//! CDN-Cache-Control, Corral-Cache-Control, and an HTTP-date. The first
//! two bytes give the stored body's length.
//!
//! Invariants: nothing panics; a selected range lies inside the body and
//! is never empty; an unsatisfiable one only for a range whose start is
//! past the end (or an empty body, or `-0`); an If-Range that holds never
//! holds for a weak or different validator; a group list never has more
//! than 128 members of more than 256 characters, all printable ASCII; a
//! targeted value is one of the fields, in priority order, with its boolean
//! members resolved (a false one left out, a true one bare); a parsed date
//! is written back by httpdate and reads again as the same instant.
#![no_main]

use corral_core::semantics::range::{self, Selected, Validators};
use corral_core::semantics::rfc9111::parse_http_date;
use http::header::{DATE, ETAG, HeaderName, IF_RANGE, LAST_MODIFIED, RANGE};
use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;

const FIELDS: [&str; 8] = [
    "range",
    "if-range",
    "etag",
    "last-modified",
    "date",
    "cache-groups",
    "cdn-cache-control",
    "corral-cache-control",
];

fuzz_target!(|data: &[u8]| {
    let Some((len_bytes, rest)) = data.split_at_checked(2) else {
        return;
    };
    let len = u64::from(u16::from_le_bytes([len_bytes[0], len_bytes[1]]));
    let mut lines = rest.split(|&b| b == b'\n');
    let mut h = HeaderMap::new();
    for name in FIELDS {
        let Some(line) = lines.next() else { break };
        if line.is_empty() {
            continue;
        }
        if let Ok(v) = HeaderValue::from_bytes(line) {
            h.append(HeaderName::from_static(name), v);
        }
    }

    // Range.
    let validators = Validators {
        etag: h.get(ETAG),
        last_modified: h.get(LAST_MODIFIED),
        date: h.get(DATE),
    };
    let selected = range::select(h.get(RANGE), h.get(IF_RANGE), len, validators);
    match selected {
        Selected::Part { first, last } => {
            assert!(first <= last && last < len, "{first}-{last} of {len}");
        }
        Selected::Unsatisfiable => {
            let spec = h
                .get(RANGE)
                .and_then(|r| r.to_str().ok())
                .and_then(range::parse)
                .expect("416 only for a parsed range");
            match spec {
                range::Spec::From { first, .. } => assert!(first >= len),
                range::Spec::Suffix(n) => assert!(n == 0 || len == 0),
            }
        }
        Selected::Full => {}
    }
    if let (Some(cond), Selected::Part { .. }) = (h.get(IF_RANGE), selected) {
        let cond = cond.to_str().expect("a holding If-Range is text").trim();
        if cond.starts_with('"') || cond.starts_with("W/") {
            let etag = h.get(ETAG).and_then(|e| e.to_str().ok()).expect("etag");
            assert!(!cond.starts_with("W/") && etag.trim() == cond);
        }
    }

    // Cache groups.
    let groups = corral_core::string_list(&h, &HeaderName::from_static("cache-groups"));
    assert!(groups.len() <= 128);
    for g in &groups {
        assert!(g.len() <= 256 && g.bytes().all(|b| (0x20..0x7f).contains(&b)), "{g:?}");
    }

    // Targeted fields: the first valid one, in order, read as Cache-Control
    // reads it (RFC 9213 members are typed: `x=?0` is a false boolean, left
    // out; `x=?1` a true one, written bare).
    let cdn = HeaderName::from_static("cdn-cache-control");
    let own = HeaderName::from_static("corral-cache-control");
    if let Some(v) = corral_core::targeted_value(&h, &[own.clone(), cdn.clone()]) {
        let read = |n: &HeaderName| {
            let text = h
                .get_all(n)
                .iter()
                .map(|v| v.to_str().ok())
                .collect::<Option<Vec<_>>>()?
                .join(", ");
            if !text.contains('?') {
                return Some(text);
            }
            let members = members(&text);
            Some(
                members
                    .iter()
                    .filter(|m| !m.ends_with("=?0"))
                    .map(|m| m.strip_suffix("=?1").unwrap_or(m))
                    .collect::<Vec<_>>()
                    .join(", "),
            )
        };
        assert!(
            Some(&v) == read(&own).as_ref() || Some(&v) == read(&cdn).as_ref(),
            "{v:?}"
        );
    }

    // HTTP-dates.
    for name in [DATE, LAST_MODIFIED] {
        if let Some(t) = h.get(&name).and_then(|v| v.to_str().ok()).and_then(parse_http_date) {
            assert_eq!(parse_http_date(&httpdate::fmt_http_date(t)), Some(t));
        }
    }
});

/// A field's members: split at commas outside quoted strings, trimmed,
/// empty ones dropped.
fn members(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut quoted, mut start) = (false, 0);
    for (i, b) in text.bytes().enumerate() {
        match b {
            b'"' => quoted = !quoted,
            b',' if !quoted => {
                out.push(text[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(text[start..].trim());
    out.retain(|m| !m.is_empty());
    out
}
