//! Arbitrary bytes as the unread start of a client's HTTP/1.1 connection,
//! read by `corral_core::semantics::h1::parse`: which requests corral's own loop
//! serves, and where each ends.
//!
//! Invariants: nothing panics; a head taken is GET or HEAD over HTTP/1.1,
//! ends within the bytes given, and keeps its verdict whatever follows it
//! (a pipelined next request cannot change where this one ends); every
//! shorter prefix of it is partial (a head split across reads is never
//! refused); its fields are httparse's, none of them frames a body, and
//! the request built from it has exactly those fields.
#![no_main]

use bytes::Bytes;
use corral_core::semantics::h1::{Parsed, parse};
use http::{Method, Version};
use libfuzzer_sys::fuzz_target;

const FRAMING: [&str; 5] = ["content-length", "transfer-encoding", "expect", "upgrade", "te"];

fuzz_target!(|data: &[u8]| {
    let mut fields = Vec::new();
    let Parsed::Fast(head) = parse(data, &mut fields) else {
        return;
    };
    assert!(head.len() <= data.len());
    assert!(*head.method() == Method::GET || *head.method() == Method::HEAD);
    let mut longer = data.to_vec();
    longer.extend_from_slice(b"POST / HTTP/1.1\r\nContent-Length: 1\r\n\r\nx");
    let mut again = Vec::new();
    assert_eq!(parse(&longer, &mut again), Parsed::Fast(parse_fast(data)));
    assert_eq!(again, fields);
    for cut in 0..head.len() {
        assert_eq!(parse(&data[..cut], &mut Vec::new()), Parsed::Partial, "cut at {cut}");
    }
    if let Some(req) = head.request(&Bytes::copy_from_slice(&data[..head.len()]), &fields) {
        assert_eq!(req.version(), Version::HTTP_11);
        assert_eq!(req.headers().len(), fields.len());
        for f in FRAMING {
            assert!(!req.headers().contains_key(f));
        }
        assert!(req.uri().path().starts_with('/'));
    }
});

fn parse_fast(data: &[u8]) -> corral_core::semantics::h1::FastHead {
    match parse(data, &mut Vec::new()) {
        Parsed::Fast(h) => h,
        _ => unreachable!("parsed as a head above"),
    }
}
