//! Which HTTP/1.1 request heads corral's own connection loop may serve
//! (`corral::http::h1`), and the request such a head is. A head is taken
//! only when it is whole, parses with `httparse` (the parser hyper uses,
//! with hyper's default settings), is `GET` or `HEAD` over HTTP/1.1 with
//! an origin-form target, has at most [`MAX_FIELDS`] fields, and has none
//! of the fields that frame or ask for a body or for a protocol change
//! (`Content-Length`, `Transfer-Encoding`, `Expect`, `Upgrade`, `TE`).
//! Everything else is [`Parsed::Other`]: hyper's, from the same bytes. So
//! the request ends where its head ends, and the next byte is the next
//! request's, as hyper would read it.

use std::mem::MaybeUninit;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::{Method, Request, Uri, Version};

/// A head with more fields than this is hyper's (which allows 100).
pub const MAX_FIELDS: usize = 64;

/// What a parse of a connection's unread bytes found.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    /// A whole head of the kind corral serves itself.
    Fast(FastHead),
    /// Not a whole head yet: read more.
    Partial,
    /// Anything else: hyper's.
    Other,
}

/// Where one field's name and value lie in the bytes parsed, as offsets
/// (name start, name end, value start, value end).
pub type Field = (usize, usize, usize, usize);

/// Where the parts of a head lie in the bytes parsed, as offsets; its
/// fields are in the list given to [`parse`].
#[derive(Debug, PartialEq, Eq)]
pub struct FastHead {
    method: Method,
    target: (usize, usize),
    len: usize,
    close: bool,
}

/// Reads a head off the start of `buf`; a head taken has its fields'
/// places in `fields` (cleared first, and kept by the caller from one
/// request to the next so that it is not allocated again).
pub fn parse(buf: &[u8], fields: &mut Vec<Field>) -> Parsed {
    let mut slots = [MaybeUninit::<httparse::Header<'_>>::uninit(); MAX_FIELDS];
    let mut req = httparse::Request::new(&mut []);
    let len = match req.parse_with_uninit_headers(buf, &mut slots) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Parsed::Partial,
        Err(_) => return Parsed::Other,
    };
    let method = match req.method {
        Some("GET") => Method::GET,
        Some("HEAD") => Method::HEAD,
        _ => return Parsed::Other,
    };
    let (Some(1), Some(target)) = (req.version, req.path) else {
        return Parsed::Other;
    };
    if !target.starts_with('/') {
        return Parsed::Other;
    }
    let base = buf.as_ptr() as usize;
    let at = |s: &[u8]| {
        let start = s.as_ptr() as usize - base;
        (start, start + s.len())
    };
    let mut close = false;
    fields.clear();
    for f in req.headers.iter() {
        let name = f.name.as_bytes();
        if asks_for_more(name) {
            return Parsed::Other;
        }
        if name.eq_ignore_ascii_case(b"connection") && has_token(f.value, b"close") {
            close = true;
        }
        let (ns, ne) = at(name);
        let (vs, ve) = at(f.value);
        fields.push((ns, ne, vs, ve));
    }
    Parsed::Fast(FastHead {
        method,
        target: at(target.as_bytes()),
        len,
        close,
    })
}

/// Fields that frame a body, ask for one, or ask for what only hyper
/// does: their request is hyper's.
fn asks_for_more(name: &[u8]) -> bool {
    [
        &b"content-length"[..],
        b"transfer-encoding",
        b"expect",
        b"upgrade",
        b"te",
    ]
    .iter()
    .any(|n| name.eq_ignore_ascii_case(n))
}

/// True when the comma-separated `value` lists `token` (in any case).
pub fn has_token(value: &[u8], token: &[u8]) -> bool {
    value
        .split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

/// `n` in decimal, written into `buf`: the digits, for a head written by
/// hand (no formatting machinery on every answer). Below 10,000 (a hit's
/// `Age` and a small body's `Content-Length`), read from a table instead.
#[inline]
pub fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    if let Some(digits) = small_decimal(n) {
        return digits;
    }
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[i..];
        }
    }
}

/// How many numbers [`small_decimal`] has in its table.
const SMALL: usize = 10_000;

/// The decimal forms of `0..SMALL`, left-aligned, built at compile time.
static SMALL_DIGITS: [[u8; 4]; SMALL] = small_digits();

const fn small_digits() -> [[u8; 4]; SMALL] {
    let mut table = [[0u8; 4]; SMALL];
    let mut n = 0;
    while n < SMALL {
        let len = small_len(n);
        let mut rest = n;
        let mut i = len;
        while i > 0 {
            i -= 1;
            table[n][i] = b'0' + (rest % 10) as u8;
            rest /= 10;
        }
        n += 1;
    }
    table
}

const fn small_len(n: usize) -> usize {
    if n < 10 {
        1
    } else if n < 100 {
        2
    } else if n < 1000 {
        3
    } else {
        4
    }
}

/// `n` in decimal as static bytes, for `n` below 10,000: a field value
/// made from them (a hit's `Age`) needs no allocation of its own.
pub fn small_decimal(n: u64) -> Option<&'static [u8]> {
    let n = usize::try_from(n).ok().filter(|&n| n < SMALL)?;
    Some(&SMALL_DIGITS[n][..small_len(n)])
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// The names most requests carry, as clients spell them (all lowercase,
/// or each word capitalized): compared whole, where
/// `HeaderName::from_bytes` lowercases every name into a buffer and then
/// matches it against every standard name. Anything else is `None`.
fn known_name(raw: &[u8]) -> Option<HeaderName> {
    use http::header;
    Some(match raw {
        b"host" | b"Host" => header::HOST,
        b"user-agent" | b"User-Agent" => header::USER_AGENT,
        b"accept" | b"Accept" => header::ACCEPT,
        b"accept-encoding" | b"Accept-Encoding" => header::ACCEPT_ENCODING,
        b"accept-language" | b"Accept-Language" => header::ACCEPT_LANGUAGE,
        b"connection" | b"Connection" => header::CONNECTION,
        b"cookie" | b"Cookie" => header::COOKIE,
        b"authorization" | b"Authorization" => header::AUTHORIZATION,
        b"cache-control" | b"Cache-Control" => header::CACHE_CONTROL,
        b"if-none-match" | b"If-None-Match" => header::IF_NONE_MATCH,
        b"if-modified-since" | b"If-Modified-Since" => header::IF_MODIFIED_SINCE,
        b"referer" | b"Referer" => header::REFERER,
        b"origin" | b"Origin" => header::ORIGIN,
        b"pragma" | b"Pragma" => header::PRAGMA,
        b"range" | b"Range" => header::RANGE,
        b"x-forwarded-for" | b"X-Forwarded-For" => X_FORWARDED_FOR,
        _ => return None,
    })
}

impl FastHead {
    /// The head's length: the next request starts here.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: a head has at least its request line.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn method(&self) -> &Method {
        &self.method
    }

    /// The client said `Connection: close`: the connection ends after
    /// the answer.
    pub fn closes(&self) -> bool {
        self.close
    }

    /// The request, its target and field values shared with `head` (the
    /// bytes parsed, cut at [`len`](Self::len)), its fields those
    /// [`parse`] listed; `None` when `http`'s
    /// types refuse the target or a field, which hyper then answers.
    pub fn request(&self, head: &Bytes, fields: &[Field]) -> Option<Request<()>> {
        let uri = Uri::from_maybe_shared(head.slice(self.target.0..self.target.1)).ok()?;
        // Filled where it lies: a map built beside the request and moved
        // in was copied, and the empty one it replaced dropped.
        let mut req = Request::new(());
        let headers = req.headers_mut();
        headers.reserve(fields.len());
        for &(ns, ne, vs, ve) in fields {
            let raw = &head[ns..ne];
            let name = match known_name(raw) {
                Some(name) => name,
                None => HeaderName::from_bytes(raw).ok()?,
            };
            let value = HeaderValue::from_maybe_shared(head.slice(vs..ve)).ok()?;
            headers.append(name, value);
        }
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = uri;
        *req.version_mut() = Version::HTTP_11;
        Some(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parsed(raw: &[u8]) -> Parsed {
        parse(raw, &mut Vec::new())
    }

    #[test]
    fn the_small_decimals_are_the_numbers_written_out() {
        for n in [0, 1, 9, 10, 99, 100, 999, 1000, 4321, 9999] {
            assert_eq!(small_decimal(n), Some(n.to_string().as_bytes()), "{n}");
        }
        // Every one, against the formatter (`decimal` reads this table).
        for n in 0..SMALL as u64 {
            assert_eq!(small_decimal(n), Some(n.to_string().as_bytes()), "{n}");
        }
        assert_eq!(small_decimal(10_000), None);
        assert_eq!(small_decimal(u64::MAX), None);
    }

    fn fast(raw: &[u8]) -> (FastHead, Vec<Field>) {
        let mut fields = Vec::new();
        match parse(raw, &mut fields) {
            Parsed::Fast(h) => (h, fields),
            other => panic!("{:?}: {other:?}", String::from_utf8_lossy(raw)),
        }
    }

    #[test]
    fn a_plain_get_or_head_is_taken_and_ends_where_its_head_ends() {
        let raw = b"GET /a/b?x=1&y=2 HTTP/1.1\r\nHost: example.com\r\nAccept: */*\r\nX-Two: 1\r\nX-Two: 2\r\n\r\nGET /next HTTP/1.1\r\n";
        let (h, fields) = fast(raw);
        let end = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("end") + 4;
        assert_eq!(h.len(), end);
        assert!(!h.closes());
        let req = h
            .request(&Bytes::copy_from_slice(&raw[..h.len()]), &fields)
            .expect("request");
        assert_eq!(req.method(), Method::GET);
        assert_eq!(req.version(), Version::HTTP_11);
        assert_eq!(req.uri(), "/a/b?x=1&y=2");
        assert_eq!(req.headers()["host"], "example.com");
        let two: Vec<_> = req.headers().get_all("x-two").iter().collect();
        assert_eq!(two, ["1", "2"]);
        let (h, _) = fast(b"HEAD / HTTP/1.1\r\nConnection: keep-alive, Close\r\n\r\n");
        assert_eq!(h.method(), Method::HEAD);
        assert!(h.closes());
    }

    #[test]
    fn anything_with_a_body_an_upgrade_or_another_shape_is_hypers() {
        for raw in [
            &b"POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n"[..],
            b"GET / HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
            b"GET / HTTP/1.1\r\ncontent-length: 5\r\n\r\nhello",
            b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            b"GET / HTTP/1.1\r\nTRANSFER-ENCODING: chunked\r\n\r\n",
            // A space before the colon: refused by httparse, as by hyper.
            b"GET / HTTP/1.1\r\nTransfer-Encoding : chunked\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a\r\n continued\r\n\r\n",
            b"GET / HTTP/1.1\r\nExpect: 100-continue\r\n\r\n",
            b"GET / HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
            b"GET / HTTP/1.1\r\nTE: trailers\r\n\r\n",
            b"GET / HTTP/1.0\r\n\r\n",
            b"GET http://example.com/ HTTP/1.1\r\n\r\n",
            b"OPTIONS * HTTP/1.1\r\n\r\n",
            b"DELETE / HTTP/1.1\r\n\r\n",
            b"get / HTTP/1.1\r\n\r\n",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
            b"GET / HTTP/1.1\r\nBad\x01Name: x\r\n\r\n",
        ] {
            assert_eq!(
                parsed(raw),
                Parsed::Other,
                "{:?}",
                String::from_utf8_lossy(raw)
            );
        }
        let mut many = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..=MAX_FIELDS {
            many.extend_from_slice(format!("X-{i}: v\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        assert_eq!(parsed(&many), Parsed::Other);
    }

    #[test]
    fn decimal_writes_every_digit() {
        for n in [0u64, 7, 10, 9_999, 10_000, 10_001, 86_399, u64::MAX] {
            assert_eq!(decimal(n, &mut [0; 20]), n.to_string().as_bytes());
        }
    }

    #[test]
    fn a_head_cut_short_is_partial() {
        let raw = b"GET /path HTTP/1.1\r\nHost: a\r\n\r\n";
        for cut in 0..raw.len() {
            assert_eq!(parsed(&raw[..cut]), Parsed::Partial, "cut at {cut}");
        }
    }

    fn field_name() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("host".to_owned()),
            Just("Content-Length".to_owned()),
            Just("transfer-encoding".to_owned()),
            Just("Connection".to_owned()),
            Just("Expect".to_owned()),
            Just("TE".to_owned()),
            "[A-Za-z][A-Za-z0-9-]{0,12}",
        ]
    }

    /// The names `known_name` knows, as it spells them.
    const KNOWN: [&str; 16] = [
        "host",
        "user-agent",
        "accept",
        "accept-encoding",
        "accept-language",
        "connection",
        "cookie",
        "authorization",
        "cache-control",
        "if-none-match",
        "if-modified-since",
        "referer",
        "origin",
        "pragma",
        "range",
        "x-forwarded-for",
    ];

    /// Each word capitalized: `User-Agent`.
    fn capitalized(name: &str) -> String {
        name.split('-')
            .map(|w| {
                let mut w = w.to_owned();
                w[..1].make_ascii_uppercase();
                w
            })
            .collect::<Vec<_>>()
            .join("-")
    }

    #[test]
    fn every_known_name_is_known_in_both_spellings() {
        for name in KNOWN {
            for raw in [name.to_owned(), capitalized(name)] {
                let known = known_name(raw.as_bytes());
                assert_eq!(known.as_ref().map(HeaderName::as_str), Some(name), "{raw}");
            }
        }
        assert_eq!(known_name(b"HOST"), None);
        assert_eq!(known_name(b"hosts"), None);
        assert_eq!(known_name(b""), None);
    }

    proptest! {
        /// A name `known_name` knows is the name `http` makes of the same
        /// bytes, in any spelling; the rest are left to `http`.
        #[test]
        fn a_known_name_is_the_name_http_makes(
            pick in 0..KNOWN.len(),
            flips in proptest::collection::vec(any::<bool>(), 20),
            other in "[A-Za-z-]{0,20}",
        ) {
            let mut raw: Vec<u8> = KNOWN[pick].bytes().collect();
            for (b, flip) in raw.iter_mut().zip(&flips) {
                if *flip {
                    *b = b.to_ascii_uppercase();
                }
            }
            for raw in [raw, other.into_bytes()] {
                if let Some(name) = known_name(&raw) {
                    prop_assert_eq!(Some(name), HeaderName::from_bytes(&raw).ok());
                }
            }
        }

        /// Whatever the bytes, a head taken is whole, is GET or HEAD over
        /// HTTP/1.1, carries none of the fields that frame a body, keeps
        /// its verdict whatever follows it, and is partial when cut.
        #[test]
        fn a_head_taken_frames_no_body_and_ends_at_its_blank_line(
            method in prop_oneof![Just("GET".to_owned()), Just("HEAD".to_owned()), Just("POST".to_owned()), "[A-Z]{1,7}"],
            target in "/[a-z0-9/?=&%.]{0,20}",
            version in prop_oneof![Just("HTTP/1.1".to_owned()), Just("HTTP/1.0".to_owned())],
            fields in proptest::collection::vec((field_name(), "[ -~]{0,16}"), 0..8),
            tail in proptest::collection::vec(any::<u8>(), 0..32),
        ) {
            let mut raw = format!("{method} {target} {version}\r\n").into_bytes();
            for (n, v) in &fields {
                raw.extend_from_slice(format!("{n}: {v}\r\n").as_bytes());
            }
            raw.extend_from_slice(b"\r\n");
            let head_len = raw.len();
            raw.extend_from_slice(&tail);
            let mut listed = Vec::new();
            match parse(&raw, &mut listed) {
                Parsed::Fast(h) => {
                    prop_assert_eq!(h.len(), head_len);
                    prop_assert!(method == "GET" || method == "HEAD");
                    prop_assert_eq!(version, "HTTP/1.1");
                    if let Some(req) = h.request(&Bytes::copy_from_slice(&raw[..h.len()]), &listed) {
                        for f in ["content-length", "transfer-encoding", "expect", "upgrade", "te"] {
                            prop_assert!(!req.headers().contains_key(f));
                        }
                        prop_assert_eq!(req.headers().len(), fields.len());
                    }
                    prop_assert_eq!(parsed(&raw[..head_len]), Parsed::Fast(h));
                    for cut in 0..head_len {
                        prop_assert_eq!(parsed(&raw[..cut]), Parsed::Partial);
                    }
                }
                Parsed::Partial => prop_assert!(false, "a whole head is never partial"),
                Parsed::Other => {
                    let framing = fields.iter().any(|(n, _)| asks_for_more(n.as_bytes()));
                    let shape = !(method == "GET" || method == "HEAD") || version != "HTTP/1.1";
                    prop_assert!(framing || shape, "{:?}", String::from_utf8_lossy(&raw));
                }
            }
        }

        #[test]
        fn any_bytes_parse_without_panic(raw in proptest::collection::vec(any::<u8>(), 0..256)) {
            let mut fields = Vec::new();
            if let Parsed::Fast(h) = parse(&raw, &mut fields) {
                prop_assert!(h.len() <= raw.len());
                let _ = h.request(&Bytes::copy_from_slice(&raw[..h.len()]), &fields);
            }
        }
    }
}
