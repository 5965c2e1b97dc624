//! Arbitrary bytes as the headers a caller sends: each line `name: value`
//! (the first byte of the input says whether the peer is a trusted proxy),
//! checked against an HS256 secret, an account header and an API-key
//! header; the first line is also parsed as a rate (`30/min`).
//!
//! Invariants: nothing panics; no input makes a `jwt:` account (that
//! needs the secret); an account header counts only from a trusted peer,
//! and only as sent (printable, one value); an API key is never kept as
//! itself.
#![no_main]

use std::time::Duration;

use corral_core::callers::caller::{AccountSources, Caller, JwtKeys, JwtSource, OnInvalid};
use http::header::HeaderName;
use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;

const NOW: u64 = 1_800_000_000;

fuzz_target!(|data: &[u8]| {
    let Some((&trusted, rest)) = data.split_first() else {
        return;
    };
    let trusted = trusted & 1 == 1;
    let text = String::from_utf8_lossy(rest);
    let _ = corral_core::callers::rate_limit::Rate::parse(text.lines().next().unwrap_or(""));
    let mut headers = HeaderMap::new();
    for line in text.lines() {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.trim().as_bytes()),
            HeaderValue::from_str(value.trim()),
        ) {
            headers.append(n, v);
        }
    }
    let Ok(keys) = JwtKeys::hs256(b"fuzzing secret of thirty-two bytes!") else {
        return;
    };
    let sources = AccountSources {
        jwt: Some(JwtSource {
            header: http::header::AUTHORIZATION,
            keys,
            claim: "sub".into(),
            issuer: None,
            audience: None,
            leeway: Duration::from_secs(30),
            on_invalid: OnInvalid::Guest,
        }),
        header: Some(HeaderName::from_static("x-account-id")),
        api_key_header: Some(HeaderName::from_static("x-api-key")),
    };
    match sources.identify(&headers, trusted, NOW) {
        Caller::Account(a) if a.starts_with("jwt:") => panic!("forged token accepted: {a}"),
        Caller::Account(a) if a.starts_with("hdr:") => {
            assert!(trusted, "account header from an untrusted peer: {a}");
            let sent: Vec<_> = headers.get_all("x-account-id").iter().collect();
            assert_eq!(sent.len(), 1);
            assert_eq!(sent[0].as_bytes().trim_ascii(), &a.as_bytes()[4..]);
        }
        Caller::Account(a) => {
            assert!(a.starts_with("key:") && a.len() == 4 + 64, "{a}");
        }
        Caller::Guest | Caller::Rejected(_) => {}
    }
});
