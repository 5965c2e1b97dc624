//! The PROXY protocol header (HAProxy's spec, versions 1 and 2) that a TCP
//! load balancer puts before the first byte of each connection to tell the
//! client's address. Parsed from the bytes read so far: incomplete until
//! the whole header is there, then the address and how many bytes it took
//! (what follows is the HTTP request), or invalid.
//!
//! A header that names no address (v1 `UNKNOWN`, v2 `LOCAL` such as a
//! balancer's own health check, or a v2 family other than TCP over IPv4 or
//! IPv6) is valid and means: the connection's own peer is the client.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The 12 bytes that open a version 2 header.
pub const V2_SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";
/// A version 1 header is at most this long, CRLF included.
pub const V1_MAX: usize = 107;
/// The longest version 2 header accepted (16 bytes + addresses + TLVs).
pub const V2_MAX: usize = 16 + 1024;

/// What a complete header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Header {
    /// The client's address, as the balancer saw it.
    Proxied(SocketAddr),
    /// No address: the connection's peer is the client.
    Local,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed {
    /// The bytes so far are a prefix of a valid header.
    Incomplete,
    /// A header of this many bytes.
    Done(Header, usize),
    Invalid(&'static str),
}

/// Parses the header at the start of `buf`.
pub fn parse(buf: &[u8]) -> Parsed {
    if buf.first() == Some(&b'P') {
        return v1(buf);
    }
    let sig = buf.len().min(V2_SIGNATURE.len());
    if buf[..sig] != V2_SIGNATURE[..sig] {
        return Parsed::Invalid("no PROXY protocol header");
    }
    v2(buf)
}

fn v1(buf: &[u8]) -> Parsed {
    const PREFIX: &[u8] = b"PROXY ";
    let start = buf.len().min(PREFIX.len());
    if buf[..start] != PREFIX[..start] {
        return Parsed::Invalid("no PROXY protocol header");
    }
    let Some(end) = buf.windows(2).take(V1_MAX - 1).position(|w| w == b"\r\n") else {
        return if buf.len() >= V1_MAX {
            Parsed::Invalid("a version 1 header longer than 107 bytes")
        } else {
            Parsed::Incomplete
        };
    };
    let Ok(line) = std::str::from_utf8(&buf[PREFIX.len().min(end)..end]) else {
        return Parsed::Invalid("a version 1 header that is not ASCII");
    };
    let fields: Vec<&str> = line.split(' ').collect();
    let header = match fields.first().copied() {
        Some("UNKNOWN") => Header::Local,
        Some(family @ ("TCP4" | "TCP6")) => {
            let [_, src, _dst, sport, _dport] = fields[..] else {
                return Parsed::Invalid("a version 1 header without four address fields");
            };
            let ip = if family == "TCP4" {
                src.parse::<Ipv4Addr>().ok().map(IpAddr::V4)
            } else {
                src.parse::<Ipv6Addr>().ok().map(IpAddr::V6)
            };
            let (Some(ip), Some(port), Some(_), Some(_)) = (
                ip,
                port(sport),
                valid_ip(fields[2], family),
                port(fields[4]),
            ) else {
                return Parsed::Invalid("a version 1 header with a bad address or port");
            };
            Header::Proxied(SocketAddr::new(ip, port))
        }
        _ => return Parsed::Invalid("a version 1 header with an unknown protocol"),
    };
    Parsed::Done(header, end + 2)
}

fn valid_ip(text: &str, family: &str) -> Option<()> {
    let ok = if family == "TCP4" {
        text.parse::<Ipv4Addr>().is_ok()
    } else {
        text.parse::<Ipv6Addr>().is_ok()
    };
    ok.then_some(())
}

/// A decimal port, 0-65535, without a sign or leading zeros.
fn port(text: &str) -> Option<u16> {
    let digits = !text.is_empty() && text.len() <= 5 && text.bytes().all(|b| b.is_ascii_digit());
    let leading_zero = text.len() > 1 && text.starts_with('0');
    (digits && !leading_zero)
        .then(|| text.parse().ok())
        .flatten()
}

fn v2(buf: &[u8]) -> Parsed {
    if buf.len() < 16 {
        return Parsed::Incomplete;
    }
    let (version, command) = (buf[12] >> 4, buf[12] & 0x0f);
    if version != 2 {
        return Parsed::Invalid("a version 2 signature with another version");
    }
    let len = usize::from(u16::from_be_bytes([buf[14], buf[15]]));
    let total = 16 + len;
    if total > V2_MAX {
        return Parsed::Invalid("a version 2 header longer than 1040 bytes");
    }
    if buf.len() < total {
        return Parsed::Incomplete;
    }
    let body = &buf[16..total];
    let header = match command {
        0 => Header::Local,
        1 => match buf[13] {
            // TCP over IPv4: source, destination, source port, destination port.
            0x11 => {
                let Some(a) = body.get(..12) else {
                    return Parsed::Invalid("a version 2 TCP4 header too short for addresses");
                };
                let ip = Ipv4Addr::new(a[0], a[1], a[2], a[3]);
                Header::Proxied(SocketAddr::new(
                    IpAddr::V4(ip),
                    u16::from_be_bytes([a[8], a[9]]),
                ))
            }
            0x21 => {
                let Some(a) = body.get(..36) else {
                    return Parsed::Invalid("a version 2 TCP6 header too short for addresses");
                };
                let mut octets = [0u8; 16];
                octets.copy_from_slice(&a[..16]);
                Header::Proxied(SocketAddr::new(
                    IpAddr::V6(Ipv6Addr::from(octets)),
                    u16::from_be_bytes([a[32], a[33]]),
                ))
            }
            // UNSPEC, UDP, UNIX: the spec says use the real connection's.
            _ => Header::Local,
        },
        _ => return Parsed::Invalid("a version 2 header with an unknown command"),
    };
    Parsed::Done(header, total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn v2_header(command: u8, family: u8, addresses: &[u8]) -> Vec<u8> {
        let mut h = V2_SIGNATURE.to_vec();
        h.push(0x20 | command);
        h.push(family);
        h.extend_from_slice(&u16::try_from(addresses.len()).expect("short").to_be_bytes());
        h.extend_from_slice(addresses);
        h
    }

    #[test]
    fn version_1_headers_are_read_with_their_length() {
        let line = b"PROXY TCP4 198.51.100.9 10.0.0.1 51000 8080\r\n";
        let h = [&line[..], b"GET / HTTP/1.1\r\n"].concat();
        assert_eq!(
            parse(&h),
            Parsed::Done(
                Header::Proxied("198.51.100.9:51000".parse().expect("addr")),
                line.len()
            )
        );
        let h = b"PROXY TCP6 2001:db8::9 2001:db8::1 4711 80\r\n";
        assert_eq!(
            parse(h),
            Parsed::Done(
                Header::Proxied("[2001:db8::9]:4711".parse().expect("addr")),
                h.len()
            )
        );
        assert_eq!(parse(b"PROXY UNKNOWN\r\n"), Parsed::Done(Header::Local, 15));
        assert_eq!(
            parse(b"PROXY UNKNOWN ffff::1 ::1 1 2\r\n"),
            Parsed::Done(Header::Local, 31)
        );
        for prefix in [
            &b"P"[..],
            b"PROXY",
            b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2",
            b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\r",
        ] {
            assert_eq!(parse(prefix), Parsed::Incomplete, "{prefix:?}");
        }
    }

    #[test]
    fn bad_version_1_headers_are_refused() {
        for bad in [
            &b"GET / HTTP/1.1\r\n"[..],
            b"PROXY TCP4 1.2.3.4 5.6.7.8 1\r\n",
            b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2 3\r\n",
            b"PROXY TCP4 2001:db8::1 5.6.7.8 1 2\r\n",
            b"PROXY TCP6 1.2.3.4 ::1 1 2\r\n",
            b"PROXY TCP4 1.2.3.4 5.6.7.8 65536 2\r\n",
            b"PROXY TCP4 1.2.3.4 5.6.7.8 01 2\r\n",
            b"PROXY TCP4 1.2.3.4 5.6.7.8 +1 2\r\n",
            b"PROXY TCP4  1.2.3.4 5.6.7.8 1 2\r\n",
            b"PROXY UDP4 1.2.3.4 5.6.7.8 1 2\r\n",
            b"PROXY \xff\r\n",
        ] {
            assert!(
                matches!(parse(bad), Parsed::Invalid(_)),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        let long = [b"PROXY TCP4 ".as_slice(), &[b'1'; 120]].concat();
        assert!(matches!(parse(&long), Parsed::Invalid(_)));
    }

    #[test]
    fn version_2_headers_are_read_with_their_length() {
        let tcp4 = v2_header(
            1,
            0x11,
            &[198, 51, 100, 9, 10, 0, 0, 1, 0xc7, 0x38, 0x1f, 0x90],
        );
        let mut with_request = tcp4.clone();
        with_request.extend_from_slice(b"GET / HTTP/1.1\r\n");
        assert_eq!(
            parse(&with_request),
            Parsed::Done(
                Header::Proxied("198.51.100.9:51000".parse().expect("addr")),
                28
            )
        );
        let mut six = vec![0x20, 0x01, 0x0d, 0xb8];
        six.extend_from_slice(&[0; 11]);
        six.push(9);
        six.extend_from_slice(&[0; 16]);
        six.extend_from_slice(&[0x12, 0x67, 0, 80]);
        six.extend_from_slice(&[0x04, 0, 1, 0]); // a TLV, skipped
        assert_eq!(
            parse(&v2_header(1, 0x21, &six)),
            Parsed::Done(
                Header::Proxied("[2001:db8::9]:4711".parse().expect("addr")),
                16 + 40
            )
        );
        assert_eq!(
            parse(&v2_header(0, 0x00, &[])),
            Parsed::Done(Header::Local, 16)
        );
        assert_eq!(
            parse(&v2_header(1, 0x31, &[0; 216])),
            Parsed::Done(Header::Local, 232)
        );
        for cut in 1..tcp4.len() {
            assert_eq!(parse(&tcp4[..cut]), Parsed::Incomplete, "cut at {cut}");
        }
    }

    #[test]
    fn bad_version_2_headers_are_refused() {
        let mut wrong_version = v2_header(1, 0x11, &[0; 12]);
        wrong_version[12] = 0x11;
        assert!(matches!(parse(&wrong_version), Parsed::Invalid(_)));
        assert!(matches!(
            parse(&v2_header(2, 0x11, &[0; 12])),
            Parsed::Invalid(_)
        ));
        assert!(matches!(
            parse(&v2_header(1, 0x11, &[0; 8])),
            Parsed::Invalid(_)
        ));
        assert!(matches!(
            parse(&v2_header(1, 0x21, &[0; 20])),
            Parsed::Invalid(_)
        ));
        let mut huge = V2_SIGNATURE.to_vec();
        huge.extend_from_slice(&[0x21, 0x11, 0xff, 0xff]);
        assert!(matches!(parse(&huge), Parsed::Invalid(_)));
        assert!(matches!(parse(b"\r\n\r\n\0\r\nQUIX\n"), Parsed::Invalid(_)));
    }

    proptest! {
        /// Any bytes: no panic, a consumed length within the input, and a
        /// header is found again in any longer input that starts with it.
        #[test]
        fn any_bytes_parse_without_panic_and_a_header_is_a_prefix(
            head in prop_oneof![
                Just(b"PROXY ".to_vec()),
                Just(V2_SIGNATURE.to_vec()),
                Just(Vec::new()),
            ],
            rest in proptest::collection::vec(any::<u8>(), 0..200),
            more in proptest::collection::vec(any::<u8>(), 0..20),
        ) {
            let buf = [head, rest].concat();
            match parse(&buf) {
                Parsed::Done(h, n) => {
                    prop_assert!(n <= buf.len());
                    let longer = [buf.clone(), more].concat();
                    prop_assert_eq!(parse(&longer), Parsed::Done(h, n));
                }
                Parsed::Incomplete => prop_assert!(buf.len() < V2_MAX),
                Parsed::Invalid(_) => {}
            }
        }

        /// Every address written as a version 1 header reads back.
        #[test]
        fn version_1_round_trips(
            src in any::<[u8; 4]>(), dst in any::<[u8; 4]>(), sport: u16, dport: u16,
        ) {
            let (s, d) = (Ipv4Addr::from(src), Ipv4Addr::from(dst));
            let h = format!("PROXY TCP4 {s} {d} {sport} {dport}\r\n");
            prop_assert_eq!(
                parse(h.as_bytes()),
                Parsed::Done(Header::Proxied(SocketAddr::new(IpAddr::V4(s), sport)), h.len())
            );
        }
    }
}
