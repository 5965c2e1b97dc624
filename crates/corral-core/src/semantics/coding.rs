//! Content codings (RFC 9110 §8.4) corral compresses stored answers in,
//! and the choice among them that a request's `Accept-Encoding` (§12.5.3)
//! makes.
//!
//! A coding is sent only to a caller that accepts it: named with a
//! non-zero weight, or covered by a non-zero `*` that does not name it.
//! With nothing offered acceptable the answer is the unencoded one (§12.5.3:
//! a response without a content coding), whatever the field says of
//! `identity`. A field corral cannot read (not a list of tokens with
//! weights) accepts no coding. No `Accept-Encoding` at all accepts none
//! either: as nginx, corral compresses only for callers that ask.

use http::HeaderMap;
use http::header::ACCEPT_ENCODING;

/// A content coding corral can compress in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Coding {
    Gzip,
    Br,
    Zstd,
}

impl Coding {
    pub const ALL: [Coding; 3] = [Coding::Zstd, Coding::Br, Coding::Gzip];

    /// Its name in `Content-Encoding` and `Accept-Encoding`.
    pub fn as_str(self) -> &'static str {
        match self {
            Coding::Gzip => "gzip",
            Coding::Br => "br",
            Coding::Zstd => "zstd",
        }
    }

    /// The coding a (case-insensitive) name stands for; `x-gzip` is gzip
    /// (RFC 9110 §8.4.1.3).
    pub fn from_name(name: &str) -> Option<Self> {
        Coding::ALL
            .into_iter()
            .find(|c| name.eq_ignore_ascii_case(c.as_str()))
            .or_else(|| name.eq_ignore_ascii_case("x-gzip").then_some(Coding::Gzip))
    }
}

/// What one `Accept-Encoding` says of the codings, as weights in
/// thousandths (RFC 9110 §12.4.2: three decimals).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Accepted {
    /// Explicit weights, by coding.
    named: Vec<(Coding, u16)>,
    /// The weight of `*`, if present.
    star: Option<u16>,
}

impl Accepted {
    /// The request's field lines, as one list. `None` when the field is
    /// absent or cannot be read: no coding is then acceptable.
    pub fn of(request: &HeaderMap) -> Option<Self> {
        let mut lines = request.get_all(ACCEPT_ENCODING).iter().peekable();
        lines.peek()?;
        let mut accepted = Accepted::default();
        for line in lines {
            accepted.add(line.to_str().ok()?)?;
        }
        Some(accepted)
    }

    /// One field line: `#( codings [ weight ] )`.
    fn add(&mut self, line: &str) -> Option<()> {
        for member in line.split(',') {
            let member = member.trim_matches([' ', '\t']);
            if member.is_empty() {
                continue;
            }
            let mut parts = member.split(';');
            let name = parts.next()?.trim_matches([' ', '\t']);
            if name.is_empty() || !name.bytes().all(is_tchar) {
                return None;
            }
            let mut weight = 1000;
            for param in parts {
                let (k, v) = param.split_once('=')?;
                if k.trim_matches([' ', '\t']).eq_ignore_ascii_case("q") {
                    weight = qvalue(v.trim_matches([' ', '\t']))?;
                } else {
                    // Accept-Encoding has no other parameter.
                    return None;
                }
            }
            if name == "*" {
                self.star = Some(self.star.map_or(weight, |w| w.min(weight)));
            } else if let Some(c) = Coding::from_name(name) {
                // Named twice: the lower weight stands (the cautious read).
                match self.named.iter_mut().find(|(n, _)| *n == c) {
                    Some((_, w)) => *w = (*w).min(weight),
                    None => self.named.push((c, weight)),
                }
            }
        }
        Some(())
    }

    /// Of `offered` (in the server's order of preference), the one whose
    /// coding the caller gives the highest weight above zero, ties going
    /// to the earlier.
    pub fn best<T>(&self, offered: impl IntoIterator<Item = (Coding, T)>) -> Option<T> {
        let mut best: Option<(T, u16)> = None;
        for (c, item) in offered {
            let w = self.weight(c);
            if w > 0 && best.as_ref().is_none_or(|(_, b)| w > *b) {
                best = Some((item, w));
            }
        }
        best.map(|(item, _)| item)
    }

    /// The weight the caller gives `coding`: its own, else `*`'s, else 0.
    pub fn weight(&self, coding: Coding) -> u16 {
        self.named
            .iter()
            .find(|(c, _)| *c == coding)
            .map(|(_, w)| *w)
            .or(self.star)
            .unwrap_or(0)
    }
}

/// True when `request` accepts the content coding named `name` (any
/// coding, not only those corral compresses in): named with a weight
/// above zero, or covered by a `*` above zero that does not name it. No
/// `Accept-Encoding`, or one corral cannot read, accepts none (as in
/// [`Accepted::of`]). A dictionary coding (`dcb`, `dcz`: RFC 9842) is
/// accepted from a caller that offered a dictionary, and from no other
/// (its `Accept-Encoding` may have been normalized on the way).
pub fn accepts(request: &HeaderMap, name: &str) -> bool {
    if name.eq_ignore_ascii_case("dcb") || name.eq_ignore_ascii_case("dcz") {
        return request.contains_key("available-dictionary");
    }
    // Bytes, not `str` splitting with trimmed patterns: every request of
    // a route without `compression:` asks this, hits too.
    accepts_in(request.get_all(ACCEPT_ENCODING).iter(), name)
}

/// [`accepts`] for the `Accept-Encoding` field lines `lines`, and a
/// coding other than a dictionary one.
fn accepts_in<'a>(lines: impl Iterator<Item = &'a http::HeaderValue>, name: &str) -> bool {
    let name = name.as_bytes();
    let gzip = name.eq_ignore_ascii_case(b"gzip") || name.eq_ignore_ascii_case(b"x-gzip");
    let mut named: Option<u16> = None;
    let mut star: Option<u16> = None;
    for line in lines {
        for member in line.as_bytes().split(|&b| b == b',') {
            let member = trim(member);
            if member.is_empty() {
                continue;
            }
            let (coding, params) = match member.iter().position(|&b| b == b';') {
                Some(i) => (trim(&member[..i]), Some(&member[i + 1..])),
                None => (member, None),
            };
            // A field corral cannot read accepts nothing.
            if coding.is_empty() || !coding.iter().all(|&b| is_tchar(b)) {
                return false;
            }
            let mut weight = 1000;
            for param in params.into_iter().flat_map(|p| p.split(|&b| b == b';')) {
                let Some(eq) = param.iter().position(|&b| b == b'=') else {
                    return false;
                };
                let q = std::str::from_utf8(trim(&param[eq + 1..])).ok();
                match q.and_then(qvalue) {
                    Some(w) if trim(&param[..eq]).eq_ignore_ascii_case(b"q") => weight = w,
                    _ => return false,
                }
            }
            let same = coding.eq_ignore_ascii_case(name)
                || (gzip
                    && (coding.eq_ignore_ascii_case(b"gzip")
                        || coding.eq_ignore_ascii_case(b"x-gzip")));
            if same {
                named = Some(named.map_or(weight, |w| w.min(weight)));
            } else if coding == b"*" {
                star = Some(star.map_or(weight, |w| w.min(weight)));
            }
        }
    }
    named.or(star).is_some_and(|w| w > 0)
}

/// The coding, of those `offered` (in the server's order of preference),
/// to answer `request` in: the highest weight the caller gives one, ties
/// going to the earlier offered; `None` for the unencoded answer.
pub fn choose(request: &HeaderMap, offered: &[Coding]) -> Option<Coding> {
    Accepted::of(request)?.best(offered.iter().map(|&c| (c, c)))
}

/// Rewrites a request's `Accept-Encoding` to one of two classes, as
/// Varnish does by default: `gzip` when the caller accepts gzip (named, or
/// `x-gzip`, or covered by `*`, with a weight above zero), else no field at
/// all. The cache key (through `Vary`) and the request sent upstream are
/// both made from the rewritten field, so the many spellings clients send
/// (`gzip, deflate, br`, `br, gzip`, `GZIP`, ...) share one variant and
/// one origin request, and a caller that accepts no gzip is only ever
/// served an answer fetched without it. A field corral cannot read
/// accepts no coding (the cautious read).
pub fn normalize_accept_encoding(request: &mut HeaderMap) {
    // Every request of a route without `compression:` comes here, hits
    // too: read without allocating, the field found once (an entry, not a
    // lookup and then an insert), and left alone when it already says
    // what it would be rewritten to.
    let http::header::Entry::Occupied(mut field) = request.entry(ACCEPT_ENCODING) else {
        return;
    };
    let single = field.iter().nth(1).is_none();
    let first = field.get();
    let already = single && first.as_bytes() == b"gzip";
    // A client sends the same field on every request of a connection:
    // this thread's last answer, for the same bytes, is this one's.
    let gzip = if single {
        LAST_FIELD.with(|last| {
            let mut last = last.borrow_mut();
            match &*last {
                Some((seen, gzip)) if seen.as_bytes() == first.as_bytes() => *gzip,
                _ => {
                    let gzip = accepts_in(std::iter::once(first), "gzip");
                    *last = Some((first.clone(), gzip));
                    gzip
                }
            }
        })
    } else {
        accepts_in(field.iter(), "gzip")
    };
    if gzip {
        if !already {
            field.insert(http::HeaderValue::from_static("gzip"));
        }
    } else {
        field.remove();
    }
}

thread_local! {
    /// The last single `Accept-Encoding` field line this thread read, and
    /// whether it accepts gzip (see [`normalize_accept_encoding`]).
    static LAST_FIELD: std::cell::RefCell<Option<(http::HeaderValue, bool)>> =
        const { std::cell::RefCell::new(None) };
}

/// `qvalue = ( "0" [ "." 0*3DIGIT ] ) / ( "1" [ "." 0*3("0") ] )`, in
/// thousandths.
fn qvalue(v: &str) -> Option<u16> {
    let (int, frac) = v.split_once('.').unwrap_or((v, ""));
    if frac.len() > 3 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let thousandths = frac
        .bytes()
        .chain(std::iter::repeat(b'0'))
        .take(3)
        .fold(0u16, |acc, b| acc * 10 + u16::from(b - b'0'));
    match int {
        "0" => Some(thousandths),
        "1" if thousandths == 0 => Some(1000),
        _ => None,
    }
}

/// `b` without the spaces and tabs around it.
fn trim(b: &[u8]) -> &[u8] {
    let start = b
        .iter()
        .position(|&c| c != b' ' && c != b'\t')
        .unwrap_or(b.len());
    let end = b
        .iter()
        .rposition(|&c| c != b' ' && c != b'\t')
        .map_or(start, |i| i + 1);
    &b[start..end]
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use proptest::prelude::*;

    fn ae(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(ACCEPT_ENCODING, HeaderValue::from_str(v).expect("value"));
        h
    }

    const OFFERED: &[Coding] = &[Coding::Zstd, Coding::Br, Coding::Gzip];

    #[test]
    fn a_coding_is_accepted_only_where_the_caller_says_so() {
        assert!(accepts(&ae("gzip, br"), "gzip"));
        assert!(accepts(&ae("x-gzip"), "gzip"));
        assert!(accepts(&ae("*"), "deflate"));
        assert!(accepts(&ae("br;q=0.5, *;q=0.1"), "gzip"));
        assert!(!accepts(&ae("gzip;q=0, *"), "gzip"));
        assert!(!accepts(&ae("identity"), "gzip"));
        assert!(!accepts(&ae(""), "gzip"));
        assert!(!accepts(&ae("gzip;level=9"), "gzip"));
        assert!(!accepts(&HeaderMap::new(), "gzip"));
        // A dictionary coding needs a dictionary offered.
        assert!(!accepts(&ae("dcb, gzip"), "dcb"));
        let mut offered = ae("dcb, gzip");
        offered.insert(
            "available-dictionary",
            HeaderValue::from_static(":pZGm1Av0IEBKARczz7exkNYsZb8LzaMrV7J32a2fFG4=:"),
        );
        assert!(accepts(&offered, "dcb"));
        assert!(accepts(&offered, "dcz"));
    }

    #[test]
    fn accept_encoding_is_normalized_to_gzip_or_nothing() {
        for (field, gzip) in [
            ("gzip, deflate, br", true),
            ("br, gzip", true),
            ("gzip;q=1.0, identity; q=0.5", true),
            ("GZIP", true),
            ("deflate, gzip", true),
            ("x-gzip", true),
            ("*", true),
            ("br, *;q=0.1", true),
            ("gzip;q=0", false),
            ("*, gzip;q=0", false),
            ("br", false),
            ("identity", false),
            ("deflate", false),
            ("gzip;level=9", false),
            ("", false),
        ] {
            let mut h = ae(field);
            normalize_accept_encoding(&mut h);
            let want = gzip.then_some("gzip");
            let got = h.get(ACCEPT_ENCODING).map(|v| v.to_str().expect("ascii"));
            assert_eq!(got, want, "{field:?}");
        }
        let mut none = HeaderMap::new();
        normalize_accept_encoding(&mut none);
        assert!(none.is_empty());
    }

    #[test]
    fn what_clients_send_chooses_as_expected() {
        for (field, want) in [
            ("gzip, deflate, br, zstd", Some(Coding::Zstd)),
            ("gzip, deflate, br", Some(Coding::Br)),
            ("gzip", Some(Coding::Gzip)),
            ("GZIP", Some(Coding::Gzip)),
            ("x-gzip", Some(Coding::Gzip)),
            ("br;q=0.5, gzip;q=0.9", Some(Coding::Gzip)),
            ("*", Some(Coding::Zstd)),
            ("*;q=0, gzip", Some(Coding::Gzip)),
            ("*;q=0", None),
            ("identity", None),
            ("identity;q=0", None),
            ("gzip;q=0", None),
            ("", None),
            ("deflate", None),
            ("gzip;q=2", None),
            ("gzip;level=9", None),
            ("gzip;q=0.0001", None),
        ] {
            assert_eq!(choose(&ae(field), OFFERED), want, "{field:?}");
        }
        assert_eq!(choose(&HeaderMap::new(), OFFERED), None, "no field");
        assert_eq!(choose(&ae("gzip, br"), &[Coding::Gzip]), Some(Coding::Gzip));
    }

    fn member() -> impl Strategy<Value = String> {
        let names = prop_oneof![
            Just("gzip"),
            Just("br"),
            Just("zstd"),
            Just("identity"),
            Just("*"),
            Just("deflate"),
            Just("GZip"),
            Just("x-gzip"),
        ];
        let q = prop_oneof![
            Just(""),
            Just(";q=0"),
            Just(";q=0.0"),
            Just(";q=0.5"),
            Just(";q=1"),
            Just("; q=0.001"),
            Just(";q=1.5"),
        ];
        (names, q).prop_map(|(n, q)| format!("{n}{q}"))
    }

    proptest! {
        /// The byte reader `accepts` uses (it runs on every request of a
        /// route without compression) says what the full parser says.
        #[test]
        fn accepts_reads_gzip_as_the_parser_does(
            members in proptest::collection::vec(
                (
                    prop_oneof![
                        Just("gzip"), Just("GZIP"), Just("x-gzip"), Just("br"), Just("*"),
                        Just("identity"), Just("deflate"), Just(""), Just("g zip"),
                    ],
                    prop_oneof![
                        Just(""), Just(";q=0"), Just(";q=0.5"), Just("; q=1"), Just(";q=1.0"),
                        Just(";q=2"), Just(";level=1"), Just(";q="),
                    ],
                    prop_oneof![Just(""), Just(" "), Just("\t")],
                ),
                0..5,
            ),
        ) {
            let field: Vec<String> = members
                .iter()
                .map(|(c, q, pad)| format!("{pad}{c}{q}{pad}"))
                .collect();
            let field = field.join(",");
            let h = ae(&field);
            let parsed = Accepted::of(&h).is_some_and(|a| a.weight(Coding::Gzip) > 0);
            prop_assert_eq!(accepts(&h, "gzip"), parsed, "{:?}", field);
        }

        /// A coding is chosen only when the field gives it a weight above
        /// zero, itself or through `*` (when not named): never one the
        /// caller refused, `*;q=0` and `gzip;q=0` included.
        #[test]
        fn a_caller_is_never_sent_a_coding_it_did_not_accept(
            members in proptest::collection::vec(member(), 0..6)
        ) {
            let field = members.join(", ");
            if let Some(c) = choose(&ae(&field), OFFERED) {
                // Read independently: the lowest weight among the members
                // naming `c` (or `x-gzip` for gzip), else `*`'s.
                let weight_of = |name: &str| {
                    members
                        .iter()
                        .filter(|m| m.split(';').next().is_some_and(|n| n.eq_ignore_ascii_case(name)
                            || (name == "gzip" && n.eq_ignore_ascii_case("x-gzip"))))
                        .map(|m| m.contains("q=0") && !m.contains("q=0.5") && !m.contains("q=0.001"))
                        .collect::<Vec<_>>()
                };
                let named = weight_of(c.as_str());
                if named.is_empty() {
                    let star = weight_of("*");
                    prop_assert!(!star.is_empty() && !star.iter().any(|zero| *zero), "{field:?} -> {c:?}");
                } else {
                    prop_assert!(!named.iter().any(|zero| *zero), "{field:?} -> {c:?}");
                }
            }
        }

        #[test]
        fn any_field_is_read_without_a_panic(field in "[ -~]{0,40}") {
            if let Ok(v) = HeaderValue::from_str(&field) {
                let mut h = HeaderMap::new();
                h.insert(ACCEPT_ENCODING, v);
                let _ = choose(&h, OFFERED);
            }
        }
    }
}
