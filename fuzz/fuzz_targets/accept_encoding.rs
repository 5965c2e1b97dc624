//! Arbitrary bytes as a request's `Accept-Encoding` field lines (split at
//! newlines), through `Accepted::of` and `choose_coding`.
//!
//! Invariants: nothing panics; the choice is deterministic and one of the
//! codings offered; a coding is chosen only when the field gives it a
//! weight above zero; no choice at all when the field does not parse.
#![no_main]

use corral_core::{Accepted, Coding, choose_coding};
use http::header::ACCEPT_ENCODING;
use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut request = HeaderMap::new();
    for line in data.split(|&b| b == b'\n') {
        if let Ok(v) = HeaderValue::from_bytes(line) {
            request.append(ACCEPT_ENCODING, v);
        }
    }
    let offered = [Coding::Gzip, Coding::Br];
    let chosen = choose_coding(&request, &offered);
    assert_eq!(chosen, choose_coding(&request, &offered));
    match Accepted::of(&request) {
        None => assert_eq!(chosen, None),
        Some(accepted) => {
            if let Some(c) = chosen {
                assert!(offered.contains(&c));
                assert!(accepted.weight(c) > 0);
                // Nothing offered is weighed above it.
                assert!(offered.iter().all(|o| accepted.weight(*o) <= accepted.weight(c)));
            }
        }
    }
});
