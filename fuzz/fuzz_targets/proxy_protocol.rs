//! Arbitrary bytes as the first bytes of a client connection on a
//! `listen_proxy_protocol` listener.
//!
//! Invariants: nothing panics; a header never claims more bytes than it
//! was given, nor more than the format allows; the verdict on a header is
//! the same whatever follows it; a prefix of an input that holds a header
//! is incomplete (never invalid), so a header split across reads is
//! never refused.
#![no_main]

use corral_core::wire::proxy_protocol::{Parsed, V1_MAX, V2_MAX, parse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match parse(data) {
        Parsed::Done(header, n) => {
            assert!(n <= data.len() && n <= V2_MAX.max(V1_MAX));
            let mut longer = data.to_vec();
            longer.extend_from_slice(b"GET / HTTP/1.1\r\n");
            assert_eq!(parse(&longer), Parsed::Done(header, n));
            for cut in 0..n {
                assert_eq!(parse(&data[..cut]), Parsed::Incomplete, "cut at {cut}");
            }
        }
        Parsed::Incomplete => assert!(data.len() < V2_MAX),
        Parsed::Invalid(_) => {}
    }
});
