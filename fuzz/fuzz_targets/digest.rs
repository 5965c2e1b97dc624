//! Arbitrary bytes as an answer's `Content-Digest` and `Repr-Digest`
//! field lines (one per line, the first byte choosing which field each
//! line goes to) and, after a NUL, its body. They go through
//! `digest::parse`, `digest::expected` and `digest::verify`.
//!
//! Invariants: nothing panics; parsing is deterministic; a field corral
//! keeps a digest from names only the algorithms it computes, with values
//! it decoded; a body verifies against digests of itself that are
//! appended to any parsable field, and never against those of another body.
#![no_main]

use corral_core::wire::digest::{self, Algorithm};
use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (fields, body) = match data.iter().position(|&b| b == 0) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, &b""[..]),
    };
    let mut headers = HeaderMap::new();
    for (i, line) in fields.split(|&b| b == b'\n').enumerate() {
        let parsed = digest::parse(line);
        assert_eq!(parsed, digest::parse(line));
        if let Some(members) = &parsed {
            for (algorithm, value) in members {
                assert!(matches!(algorithm, Algorithm::Sha256 | Algorithm::Sha512));
                assert!(value.len() <= line.len());
            }
        }
        if let Ok(v) = HeaderValue::from_bytes(line) {
            let name = if i % 2 == 0 { &digest::CONTENT_DIGEST } else { &digest::REPR_DIGEST };
            headers.append(name, v);
        }
    }
    for whole in [true, false] {
        let expected = digest::expected(&headers, whole);
        let _ = digest::verify(&expected, body);
    }
    // The body's own digest, alone in a field: it verifies, and another
    // body does not.
    for algorithm in [Algorithm::Sha256, Algorithm::Sha512] {
        let mut own = HeaderMap::new();
        let value = digest::field_value(algorithm, body);
        own.insert(&digest::CONTENT_DIGEST, HeaderValue::from_str(&value).expect("ascii"));
        let expected = digest::expected(&own, true);
        assert_eq!(expected.len(), 1);
        assert!(digest::verify(&expected, body).is_ok());
        let mut other = body.to_vec();
        other.push(0);
        assert!(digest::verify(&expected, &other).is_err());
    }
});
