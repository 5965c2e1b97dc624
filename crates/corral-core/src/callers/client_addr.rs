//! The real client address behind trusted proxies.
//!
//! The address is the connection's peer, unless the peer is a trusted
//! proxy: then the one header the proxies write ([`TrustedHeader`]: the
//! `X-Forwarded-For` list, or the `for=` parameters of `Forwarded`, RFC
//! 7239; never the other, which a proxy may pass through from the client
//! unchanged) is walked from the right, each
//! trusted hop vouching for the one to its left; the first address that is
//! not trusted is the client. Nothing left of it can be verified (a client
//! writes whatever it likes there), so it is dropped: the verified chain,
//! from the client to the last trusted hop, is what goes on upstream.
//!
//! An entry that is not an address (`unknown`, an obfuscated identifier,
//! junk) ends the walk at the hop that recorded it. An empty trust list
//! trusts nobody: every header is ignored and the peer is the client.

use std::net::IpAddr;

use http::HeaderMap;
use http::header::{FORWARDED, HeaderName};

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// One trusted network, as written in the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cidr {
    net: IpAddr,
    prefix: u8,
    text: String,
}

impl Cidr {
    /// `10.0.0.0/8`, `2001:db8::/32`, or a single address (`/32`, `/128`).
    pub fn parse(text: &str) -> Result<Cidr, String> {
        let text = text.trim();
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (text, None),
        };
        let net: IpAddr = addr
            .parse()
            .map_err(|_| format!("{addr:?} is not an IPv4 or IPv6 address"))?;
        let net = canonical(net);
        let max = if net.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => match p.parse::<u8>() {
                Ok(n) if n <= max && p.bytes().all(|b| b.is_ascii_digit()) => n,
                _ => return Err(format!("prefix {p:?} is not a number from 0 to {max}")),
            },
        };
        if mask(net, prefix) != net {
            return Err(format!(
                "{text} has host bits set: the network is {}/{prefix}",
                mask(net, prefix)
            ));
        }
        Ok(Cidr {
            net,
            prefix,
            text: format!("{net}/{prefix}"),
        })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        ip.is_ipv4() == self.net.is_ipv4() && mask(ip, self.prefix) == self.net
    }

    /// The network in canonical form (`10.0.0.0/8`): the metric label.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

/// An IPv4-mapped IPv6 address is its IPv4 address.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

fn mask(ip: IpAddr, prefix: u8) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => {
            let bits = u32::from(v4);
            let m = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V4((bits & m).into())
        }
        IpAddr::V6(v6) => {
            let bits = u128::from(v6);
            let m = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V6((bits & m).into())
        }
    }
}

/// Which header the trusted proxies write (`server.trusted_header`). Only
/// that one is read: a proxy that writes `Forwarded` and passes a client's
/// own `X-Forwarded-For` through unchanged (or the other way round) would
/// otherwise let the client name any address.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TrustedHeader {
    #[default]
    XForwardedFor,
    Forwarded,
}

/// The configured trust list; empty trusts nobody.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedProxies {
    entries: Vec<Cidr>,
    header: TrustedHeader,
}

impl TrustedProxies {
    /// Proxies that write `X-Forwarded-For`.
    pub fn new(entries: Vec<Cidr>) -> Self {
        TrustedProxies {
            entries,
            header: TrustedHeader::XForwardedFor,
        }
    }

    /// The same proxies, believed in `header` alone.
    pub fn believing(self, header: TrustedHeader) -> Self {
        TrustedProxies { header, ..self }
    }

    pub fn entries(&self) -> &[Cidr] {
        &self.entries
    }

    pub fn header(&self) -> TrustedHeader {
        self.header
    }

    /// The first entry that trusts `ip`.
    pub fn vouch(&self, ip: IpAddr) -> Option<usize> {
        self.entries.iter().position(|c| c.contains(ip))
    }
}

/// Who sent a request, as far as trusted hops can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientAddr {
    /// The real client address.
    pub client: IpAddr,
    /// The verified hops after the client, left to right, not counting the
    /// peer (which corral appends itself): empty when the peer is the client.
    pub hops: Vec<IpAddr>,
    /// The trust entries that vouched for a hop of this request (the peer
    /// first), by index: what `corral_trusted_proxy_requests_total` counts.
    pub vouchers: Vec<usize>,
}

impl ClientAddr {
    /// The verified chain for the upstream `X-Forwarded-For`: the client,
    /// the trusted hops after it, then the peer.
    pub fn forwarded_for(&self, peer: IpAddr) -> String {
        let peer = canonical(peer);
        let mut out = String::new();
        if self.client != peer || !self.hops.is_empty() {
            for ip in std::iter::once(&self.client).chain(&self.hops) {
                out.push_str(&ip.to_string());
                out.push_str(", ");
            }
        }
        out.push_str(&peer.to_string());
        out
    }
}

/// The caller a shared penalty (the circuit, a key's back-off) counts
/// failures of: an IPv4 address, or an IPv6 /64 (what one host is
/// commonly given, so one client cannot be many callers by walking its
/// own prefix). The same number on every instance, so that back-off
/// records shared through Redis can compare callers.
pub fn caller_group(addr: IpAddr) -> u64 {
    match addr {
        IpAddr::V4(v4) => u64::from(u32::from(v4)) | (1 << 63),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => caller_group(IpAddr::V4(v4)),
            None => (u128::from(v6) >> 64) as u64 & !(1 << 63),
        },
    }
}

/// The client address of a request from `peer` that carries `headers`.
pub fn resolve(peer: IpAddr, headers: &HeaderMap, trusted: &TrustedProxies) -> ClientAddr {
    let peer = canonical(peer);
    let alone = ClientAddr {
        client: peer,
        hops: Vec::new(),
        vouchers: Vec::new(),
    };
    let Some(first) = trusted.vouch(peer) else {
        return alone;
    };
    let listed = match trusted.header {
        TrustedHeader::XForwardedFor => forwarded_for_list(headers),
        TrustedHeader::Forwarded => forwarded_list(headers),
    };
    let mut vouchers = vec![first];
    // Walked right to left: each trusted hop says who connected to it.
    let mut walked: Vec<IpAddr> = Vec::new();
    for entry in listed.iter().rev() {
        let Some(ip) = *entry else {
            break; // the trusted hop recorded no address: it is the end
        };
        walked.push(ip);
        match trusted.vouch(ip) {
            Some(i) => vouchers.push(i),
            None => break,
        }
    }
    let Some(client) = walked.pop() else {
        return ClientAddr {
            client: peer,
            hops: Vec::new(),
            vouchers,
        };
    };
    walked.reverse();
    ClientAddr {
        client,
        hops: walked,
        vouchers,
    }
}

/// Every `X-Forwarded-For` field line, in order, split into entries.
fn forwarded_for_list(headers: &HeaderMap) -> Vec<Option<IpAddr>> {
    headers
        .get_all(&X_FORWARDED_FOR)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(|e| std::str::from_utf8(e).ok().and_then(node))
        .collect()
}

/// The `for=` parameter of every `Forwarded` element, in order.
fn forwarded_list(headers: &HeaderMap) -> Vec<Option<IpAddr>> {
    let mut out = Vec::new();
    for value in headers.get_all(FORWARDED) {
        let Ok(value) = value.to_str() else {
            out.push(None);
            continue;
        };
        for element in value.split(',') {
            let found = element.split(';').find_map(|pair| {
                let (k, v) = pair.split_once('=')?;
                k.trim().eq_ignore_ascii_case("for").then_some(v)
            });
            if let Some(v) = found {
                out.push(node(v.trim().trim_matches('"')));
            } else {
                out.push(None);
            }
        }
    }
    out
}

/// An address as proxies write it: `192.0.2.1`, `192.0.2.1:4711`,
/// `2001:db8::1`, `[2001:db8::1]` or `[2001:db8::1]:4711`.
fn node(text: &str) -> Option<IpAddr> {
    let text = text.trim();
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Some(canonical(ip));
    }
    if let Some(rest) = text.strip_prefix('[') {
        let (inner, after) = rest.split_once(']')?;
        let port_ok = after.is_empty()
            || after
                .strip_prefix(':')
                .is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
        return port_ok
            .then(|| inner.parse::<std::net::Ipv6Addr>().ok())
            .flatten()
            .map(|v6| canonical(IpAddr::V6(v6)));
    }
    let (addr, port) = text.rsplit_once(':')?;
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    addr.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use proptest::prelude::*;

    fn trust(list: &[&str]) -> TrustedProxies {
        TrustedProxies::new(list.iter().map(|c| Cidr::parse(c).expect("cidr")).collect())
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    fn xff(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(&X_FORWARDED_FOR, HeaderValue::from_str(v).expect("value"));
        }
        h
    }

    #[test]
    fn cidrs_parse_strictly_and_contain_what_they_say() {
        let c = Cidr::parse("10.0.0.0/8").expect("cidr");
        assert!(c.contains(ip("10.200.1.2")));
        assert!(!c.contains(ip("11.0.0.1")));
        assert!(c.contains(ip("::ffff:10.1.2.3")), "IPv4-mapped is IPv4");
        assert_eq!(
            Cidr::parse("192.0.2.7").expect("one").as_str(),
            "192.0.2.7/32"
        );
        assert_eq!(
            Cidr::parse("2001:db8::/32").expect("v6").as_str(),
            "2001:db8::/32"
        );
        assert!(
            Cidr::parse("0.0.0.0/0")
                .expect("all")
                .contains(ip("203.0.113.9"))
        );
        for bad in [
            "10.0.0.0/33",
            "10.0.0.1/8",
            "10.0.0/8",
            "x",
            "10.0.0.0/",
            "10.0.0.0/+8",
            "",
        ] {
            assert!(Cidr::parse(bad).is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn an_untrusted_peer_is_the_client_whatever_it_sends() {
        let t = trust(&["10.0.0.0/8"]);
        let a = resolve(ip("203.0.113.5"), &xff(&["10.0.0.1, 1.2.3.4"]), &t);
        assert_eq!(a.client, ip("203.0.113.5"));
        assert!(a.hops.is_empty() && a.vouchers.is_empty());
        assert_eq!(a.forwarded_for(ip("203.0.113.5")), "203.0.113.5");
        // Nobody is trusted by default.
        let a = resolve(
            ip("10.0.0.1"),
            &xff(&["1.2.3.4"]),
            &TrustedProxies::default(),
        );
        assert_eq!(a.client, ip("10.0.0.1"));
    }

    #[test]
    fn trusted_hops_are_walked_from_the_right_and_a_spoofed_left_is_dropped() {
        let t = trust(&["10.0.0.0/8", "192.168.0.0/16"]);
        let h = xff(&["6.6.6.6, 198.51.100.7", "192.168.1.1"]);
        let a = resolve(ip("10.0.0.2"), &h, &t);
        assert_eq!(a.client, ip("198.51.100.7"));
        assert_eq!(a.hops, [ip("192.168.1.1")]);
        assert_eq!(a.vouchers, [0, 1]);
        assert_eq!(
            a.forwarded_for(ip("10.0.0.2")),
            "198.51.100.7, 192.168.1.1, 10.0.0.2"
        );
    }

    #[test]
    fn a_hop_that_recorded_no_address_ends_the_walk() {
        let t = trust(&["10.0.0.0/8"]);
        let a = resolve(ip("10.0.0.2"), &xff(&["1.2.3.4, unknown, 10.0.0.9"]), &t);
        assert_eq!(a.client, ip("10.0.0.9"));
        // A trusted peer that forwards no list is the client itself.
        let a = resolve(ip("10.0.0.2"), &HeaderMap::new(), &t);
        assert_eq!(a.client, ip("10.0.0.2"));
        assert_eq!(a.forwarded_for(ip("10.0.0.2")), "10.0.0.2");
    }

    #[test]
    fn only_the_header_the_proxies_write_is_read() {
        let mut h = HeaderMap::new();
        h.append(FORWARDED, HeaderValue::from_static("for=203.0.113.7"));
        // The client's own X-Forwarded-For, passed through unchanged by a
        // proxy that writes Forwarded.
        h.append(&X_FORWARDED_FOR, HeaderValue::from_static("6.6.6.6"));
        let writes_forwarded = trust(&["10.0.0.0/8"]).believing(TrustedHeader::Forwarded);
        let a = resolve(ip("10.0.0.2"), &h, &writes_forwarded);
        assert_eq!(a.client, ip("203.0.113.7"));
        // Proxies that write X-Forwarded-For: Forwarded is never read, even
        // without an X-Forwarded-For.
        let writes_xff = trust(&["10.0.0.0/8"]);
        assert_eq!(
            resolve(ip("10.0.0.2"), &h, &writes_xff).client,
            ip("6.6.6.6")
        );
        h.remove(&X_FORWARDED_FOR);
        assert_eq!(
            resolve(ip("10.0.0.2"), &h, &writes_xff).client,
            ip("10.0.0.2")
        );
    }

    #[test]
    fn forwarded_for_parameters_are_read_as_rfc_7239_writes_them() {
        let t = trust(&["10.0.0.0/8"]).believing(TrustedHeader::Forwarded);
        let mut h = HeaderMap::new();
        h.append(
            FORWARDED,
            HeaderValue::from_static("for=6.6.6.6, For=\"[2001:db8::1]:4711\";proto=https"),
        );
        h.append(
            FORWARDED,
            HeaderValue::from_static("for=10.1.1.1:80;by=10.0.0.2"),
        );
        let a = resolve(ip("10.0.0.2"), &h, &t);
        assert_eq!(a.client, ip("2001:db8::1"));
        assert_eq!(a.hops, [ip("10.1.1.1")]);
    }

    #[test]
    fn addresses_are_read_as_proxies_write_them() {
        for (text, want) in [
            ("192.0.2.1", Some("192.0.2.1")),
            (" 192.0.2.1:4711 ", Some("192.0.2.1")),
            ("2001:db8::1", Some("2001:db8::1")),
            ("[2001:db8::1]", Some("2001:db8::1")),
            ("[2001:db8::1]:80", Some("2001:db8::1")),
            ("::ffff:192.0.2.1", Some("192.0.2.1")),
            ("[2001:db8::1]:", None),
            ("192.0.2.1:", None),
            ("unknown", None),
            ("_hidden", None),
            ("", None),
        ] {
            assert_eq!(node(text), want.map(ip), "{text:?}");
        }
    }

    fn any_ip() -> impl Strategy<Value = IpAddr> {
        prop_oneof![
            (0u8..4, any::<u8>()).prop_map(|(a, b)| IpAddr::V4([10, a, 0, b].into())),
            any::<[u8; 4]>().prop_map(|o| IpAddr::V4(o.into())),
        ]
    }

    proptest! {
        /// The client is the peer or one of the listed addresses, and it is
        /// never an address left of an untrusted one; nothing panics on any
        /// header bytes.
        #[test]
        fn the_client_is_never_left_of_an_untrusted_hop(
            peer in any_ip(),
            list in proptest::collection::vec(any_ip(), 0..6),
            junk in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            let t = trust(&["10.0.0.0/14"]);
            let text = list.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
            let h = xff(&[text.as_str()]);
            let a = resolve(peer, &h, &t);
            if t.vouch(peer).is_none() {
                prop_assert_eq!(a.client, peer);
            } else {
                // Scan as the walk does: the first untrusted from the right.
                let expected = list.iter().rev().find(|ip| t.vouch(**ip).is_none())
                    .or(list.first()).copied().unwrap_or(peer);
                prop_assert_eq!(a.client, expected);
                let chain = a.forwarded_for(peer);
                prop_assert!(chain.ends_with(&peer.to_string()));
            }
            let mut h = HeaderMap::new();
            if let Ok(v) = HeaderValue::from_bytes(&junk) {
                h.append(&X_FORWARDED_FOR, v.clone());
                h.append(FORWARDED, v);
            }
            let _ = resolve(peer, &h, &t);
        }
    }

    #[test]
    fn a_caller_group_is_an_ipv4_address_or_an_ipv6_64() {
        let g = |s: &str| caller_group(s.parse().expect("address"));
        assert_eq!(g("192.0.2.1"), g("192.0.2.1"));
        assert_ne!(g("192.0.2.1"), g("192.0.2.2"));
        assert_eq!(g("2001:db8:1:2::1"), g("2001:db8:1:2:ffff::9"));
        assert_ne!(g("2001:db8:1:2::1"), g("2001:db8:1:3::1"));
        assert_eq!(g("::ffff:192.0.2.1"), g("192.0.2.1"));
        // No IPv6 /64 reads as an IPv4 address.
        assert_ne!(g("0:0:0:0:ffff::"), g("255.255.255.255"));
    }
}
