//! Arbitrary bytes as a trust list and the forwarding fields of a request
//! from a peer: line 1 the peer address, line 2 the trust list (one CIDR
//! per comma), then X-Forwarded-For and Forwarded field lines (`x:` or
//! `f:` prefixed).
//!
//! Invariants: nothing panics; an untrusted peer is always the client and
//! forwards only itself; the client is the peer or an address that was
//! listed; every hop after the client is trusted; the upstream
//! X-Forwarded-For ends with the peer and is a valid header value.
#![no_main]

use std::net::IpAddr;

use corral_core::callers::client_addr::{Cidr, TrustedProxies, resolve};
use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut lines = text.split('\n');
    let Some(peer) = lines.next().and_then(|l| l.trim().parse::<IpAddr>().ok()) else {
        return;
    };
    let trusted = TrustedProxies::new(
        lines
            .next()
            .unwrap_or("")
            .split(',')
            .filter_map(|c| Cidr::parse(c).ok())
            .collect(),
    );
    let mut headers = HeaderMap::new();
    for line in lines {
        let (name, value) = match line.split_at_checked(2) {
            Some(("x:", v)) => ("x-forwarded-for", v),
            Some(("f:", v)) => ("forwarded", v),
            _ => continue,
        };
        if let Ok(v) = HeaderValue::from_str(value) {
            headers.append(name, v);
        }
    }
    let addr = resolve(peer, &headers, &trusted);
    let peer_v4 = match peer {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(peer, IpAddr::V4),
        v4 => v4,
    };
    if trusted.vouch(peer).is_none() {
        assert_eq!(addr.client, peer_v4);
        assert!(addr.hops.is_empty());
    } else if addr.client != peer_v4 {
        let listed = format!("{headers:?}");
        assert!(
            listed.contains(&addr.client.to_string()) || matches!(addr.client, IpAddr::V6(_)),
            "{} was not listed",
            addr.client
        );
    }
    for hop in &addr.hops {
        assert!(trusted.vouch(*hop).is_some(), "untrusted hop {hop}");
    }
    let chain = addr.forwarded_for(peer);
    assert!(chain.ends_with(&peer_v4.to_string()));
    assert!(HeaderValue::from_str(&chain).is_ok());
});
