//! Arbitrary bytes as a response's Vary field and a request's headers, one
//! per line: the first two lines are Vary field lines, each later line is a
//! request header (`name:value`, or a value for one of a few usual names).
//! They go through `Vary::parse`, `Vary::values` and `normalized_value`.
//!
//! Invariants: nothing panics; equal inputs give equal outputs; the names
//! are lowercase, sorted and unique; unreadable Vary bytes mean `Vary: *`;
//! and two single values share a variant exactly when they mean the same
//! once whitespace (and, for Accept-Encoding, case, order and repeats of
//! codings) is normalized, so different bytes never share one.
#![no_main]

use corral_core::Vary;
use corral_core::normalized_value;
use http::header::{ACCEPT_ENCODING, ACCEPT_LANGUAGE, HeaderName, VARY};
use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;

const USUAL: [&str; 5] = [
    "accept-encoding",
    "accept-language",
    "accept",
    "cookie",
    "x-device",
];

fuzz_target!(|data: &[u8]| {
    let mut lines = data.split(|&b| b == b'\n');
    let mut response = HeaderMap::new();
    for line in lines.by_ref().take(2) {
        if let Ok(v) = HeaderValue::from_bytes(line) {
            response.append(VARY, v);
        }
    }
    let request_lines: Vec<&[u8]> = lines.collect();

    let vary = Vary::parse(&response);
    assert_eq!(vary, Vary::parse(&response.clone()));
    if response.get_all(VARY).iter().any(|v| v.to_str().is_err()) {
        assert_eq!(vary, Vary::Star, "unreadable Vary must never be served");
    }
    let names = vary.names();
    assert!(names.windows(2).all(|w| w[0].as_str() < w[1].as_str()));
    assert!(
        names
            .iter()
            .all(|n| n.as_str() == n.as_str().to_ascii_lowercase())
    );
    if let Vary::Headers(n) = &vary {
        assert!(!n.is_empty());
    }

    let request = request_headers(&request_lines);
    let values = vary.values(&request);
    assert_eq!(values.len(), names.len());
    assert_eq!(values, vary.values(&request_headers(&request_lines)));
    assert_eq!(values, vary.values(&request.clone()));

    // Pairwise: the same variant exactly when the same meaning.
    let probe = HeaderName::from_static("x-probe");
    let singles: Vec<&[u8]> = request_lines
        .iter()
        .copied()
        .filter(|l| HeaderValue::from_bytes(l).is_ok())
        .take(8)
        .collect();
    let absent = normalized_value(&probe, &HeaderMap::new());
    for a in &singles {
        let na = single(&probe, a);
        assert_ne!(na, absent, "absent reads as {a:?}");
        let ea = single(&ACCEPT_ENCODING, a);
        // Coding (and language range) order carries no meaning.
        let mut reversed: Vec<&[u8]> = a.split(|&b| b == b',').collect();
        reversed.reverse();
        assert_eq!(ea, single(&ACCEPT_ENCODING, &reversed.join(&b',')));
        let la = single(&ACCEPT_LANGUAGE, a);
        assert_eq!(la, single(&ACCEPT_LANGUAGE, &reversed.join(&b',')));
        for b in &singles {
            let nb = single(&probe, b);
            assert_eq!(
                na == nb,
                meaning(a) == meaning(b),
                "{:?} -> {na:?}, {:?} -> {nb:?}",
                String::from_utf8_lossy(a),
                String::from_utf8_lossy(b)
            );
            let eb = single(&ACCEPT_ENCODING, b);
            assert_eq!(
                ea == eb,
                encoding_meaning(a) == encoding_meaning(b),
                "accept-encoding {:?} -> {ea:?}, {:?} -> {eb:?}",
                String::from_utf8_lossy(a),
                String::from_utf8_lossy(b)
            );
            // Language ranges are read like codings.
            let lb = single(&ACCEPT_LANGUAGE, b);
            assert_eq!(la == lb, ea == eb);
        }
    }
});

fn request_headers(lines: &[&[u8]]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (i, line) in lines.iter().enumerate() {
        let named = line.iter().position(|&b| b == b':').and_then(|at| {
            let name = HeaderName::from_bytes(&line[..at]).ok()?;
            Some((name, &line[at + 1..]))
        });
        let (name, value) =
            named.unwrap_or_else(|| (HeaderName::from_static(USUAL[i % USUAL.len()]), &line[..]));
        if let Ok(v) = HeaderValue::from_bytes(value) {
            h.append(name, v);
        }
    }
    h
}

fn single(name: &HeaderName, value: &[u8]) -> String {
    let mut h = HeaderMap::new();
    h.insert(name, HeaderValue::from_bytes(value).expect("a valid value"));
    normalized_value(name, &h)
}

/// What normalized_value documents as equivalent, on the raw bytes:
/// comma-separated tokens, each trimmed of spaces and tabs, runs of them
/// collapsed to one space and dropped next to `;` and `=`; empty tokens
/// dropped.
fn meaning(v: &[u8]) -> Vec<Vec<u8>> {
    v.split(|&b| b == b',')
        .map(|token| {
            let ws = |b: &u8| *b == b' ' || *b == b'\t';
            let start = token.iter().position(|b| !ws(b)).unwrap_or(token.len());
            let end = token.iter().rposition(|b| !ws(b)).map_or(start, |i| i + 1);
            let mut out = Vec::new();
            let mut pending = false;
            for &b in &token[start..end] {
                if ws(&b) {
                    pending = true;
                    continue;
                }
                if pending && b != b';' && b != b'=' && !matches!(out.last(), Some(b';' | b'=')) {
                    out.push(b' ');
                }
                pending = false;
                out.push(b);
            }
            out
        })
        .filter(|t| !t.is_empty())
        .collect()
}

/// Accept-Encoding: also ASCII case, order and repeats carry no meaning.
fn encoding_meaning(v: &[u8]) -> Vec<Vec<u8>> {
    let mut tokens: Vec<Vec<u8>> = meaning(v)
        .into_iter()
        .map(|t| t.to_ascii_lowercase())
        .collect();
    tokens.sort_unstable();
    tokens.dedup();
    tokens
}
