//! Who is asking. When a request carries credentials (the route's identity
//! headers, Authorization by default, or named cookies) a keyed hash of them
//! becomes part of the key, so one caller's answer never reaches another.
//! Identity fails closed: a credential header is hashed whatever its bytes,
//! and a Cookie field corral cannot parse strictly is hashed whole, so a
//! request is anonymous only when corral is sure it carries no credential.
//! Credential values are hashed here and never kept or logged.

use http::HeaderMap;
use http::header::{AUTHORIZATION, COOKIE, HeaderName};

/// A keyed hash of a caller's credentials.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Identity {
    digest: [u8; 32],
    /// Only `Authorization` identified the caller: RFC 9111 §3.5's
    /// exceptions (`must-revalidate` too lets a response be shared) apply.
    authorization_only: bool,
}

impl Identity {
    pub fn from_bytes(b: [u8; 32]) -> Self {
        Identity {
            digest: b,
            authorization_only: true,
        }
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.digest
    }

    /// True when the caller was identified by `Authorization` alone.
    pub fn is_authorization_only(&self) -> bool {
        self.authorization_only
    }
}

/// The identity a caller's hit-for-pass marker and back-off are kept
/// under: its own when it is identified; else one shared by the anonymous
/// callers that carry a Cookie field, and none for those that carry none.
/// An answer that could not be stored for a caller with cookies (it set a
/// cookie, say) then never turns coalescing off for callers without: a
/// penalty never crosses from one class of caller to another.
pub fn pass_class(identity: Option<&Identity>, headers: &HeaderMap) -> Option<Identity> {
    /// The anonymous callers with cookies, as one class.
    const COOKIE_CALLERS: Identity = Identity {
        digest: *b"corral: anonymous, with cookies.",
        authorization_only: false,
    };
    match identity {
        Some(id) => Some(*id),
        None => crate::semantics::head::carries(headers, &COOKIE).then_some(COOKIE_CALLERS),
    }
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Identity(..)")
    }
}

/// Which request headers and cookies identify a caller.
#[derive(Debug, Clone)]
pub struct IdentityRules {
    headers: Vec<HeaderName>,
    /// The configured cookie names, in the canonical form [`cookie_name_forms`]
    /// compares.
    cookies: Vec<Vec<u8>>,
    /// `*` among the cookie names: the whole Cookie field identifies the
    /// caller, whatever its cookies are called (the default).
    every_cookie: bool,
    key: [u8; 32],
}

impl IdentityRules {
    pub fn new(headers: Vec<HeaderName>, cookies: Vec<String>) -> Self {
        // The same key in every process, so that instances sharing a cache
        // agree on keys; the hash is keyed so a key does not reveal a
        // credential to anyone who can only read the store.
        let key = blake3::derive_key("corral 2026-11 identity v1", b"");
        let every_cookie = cookies.iter().any(|c| c == "*");
        IdentityRules {
            headers,
            cookies: cookies
                .iter()
                .filter(|c| *c != "*")
                .map(|c| canonical_cookie_name(c.as_bytes()))
                .collect(),
            every_cookie,
            key,
        }
    }

    /// The caller's identity, or `None` for an anonymous request.
    pub fn identify(&self, headers: &HeaderMap) -> Option<Identity> {
        self.identify_with(headers, false)
    }

    /// The identity of a caller whose POST is coalesced: as [`identify`],
    /// and when the route names no identity cookie, the whole Cookie
    /// field too. A browser's POST carries its session in a cookie nobody
    /// named; without this, two users' identical GraphQL bodies would share
    /// one answer (and one user's mutation would stand for another's).
    ///
    /// [`identify`]: IdentityRules::identify
    pub fn identify_post(&self, headers: &HeaderMap) -> Option<Identity> {
        self.identify_with(headers, true)
    }

    #[inline]
    fn identify_with(&self, headers: &HeaderMap, whole_cookie: bool) -> Option<Identity> {
        // Most requests (every hit of an anonymous caller) carry none of
        // the fields: answered before a keyed hasher is set up.
        let cookies = !self.cookies.is_empty() || self.every_cookie || whole_cookie;
        // One pass over the few names a request carries, compared (not
        // hashed and looked up once per name asked for).
        let carried = headers
            .keys()
            .any(|n| (cookies && *n == COOKIE) || self.headers.contains(n));
        if !carried {
            return None;
        }
        let mut h = blake3::Hasher::new_keyed(&self.key);
        let mut found = false;
        let mut authorization_only = true;
        for name in &self.headers {
            for value in headers.get_all(name) {
                found = true;
                authorization_only &= *name == AUTHORIZATION;
                h.update(name.as_str().as_bytes());
                h.update(b"\x00");
                h.update(value.as_bytes());
                h.update(b"\x00");
            }
        }
        if !self.cookies.is_empty() {
            let mut pairs: Vec<&[u8]> = Vec::new();
            for value in headers.get_all(COOKIE) {
                match cookie_pairs(value.as_bytes()) {
                    Some(parsed) => pairs.extend(
                        parsed
                            .filter(|(name, _)| self.names_credential(name))
                            .map(|(_, pair)| pair),
                    ),
                    // Fail closed: a field corral cannot read strictly may
                    // hold a credential some origin can read.
                    None => pairs.push(value.as_bytes()),
                }
            }
            pairs.sort_unstable();
            for pair in pairs {
                found = true;
                authorization_only = false;
                h.update(b"cookie\x00");
                h.update(&(pair.len() as u64).to_le_bytes());
                h.update(pair);
            }
        }
        // `*`, or a coalesced POST on a route that names no cookie: the
        // session may be in any cookie, so all of them identify.
        if self.every_cookie || (whole_cookie && self.cookies.is_empty()) {
            for value in headers.get_all(COOKIE) {
                found = true;
                authorization_only = false;
                h.update(b"cookie-field\x00");
                h.update(&(value.len() as u64).to_le_bytes());
                h.update(value.as_bytes());
            }
        }
        found.then(|| Identity {
            digest: *h.finalize().as_bytes(),
            authorization_only,
        })
    }

    /// True when an origin could read a cookie called `name` as one of the
    /// configured credential cookies.
    fn names_credential(&self, name: &[u8]) -> bool {
        let canonical = canonical_cookie_name(name);
        self.cookies.contains(&canonical)
    }
}

/// The cookie-pairs of one Cookie field (RFC 6265 §4.2.1, read as leniently
/// as common servers do: whitespace around `;` and `=` is trimmed), each as
/// (name, the whole trimmed pair). `None` when the field does not parse
/// strictly: a pair without `=`, or a name that is not an RFC 9110 token.
/// Values may hold any bytes: they are hashed, never interpreted.
fn cookie_pairs(field: &[u8]) -> Option<impl Iterator<Item = (&[u8], &[u8])>> {
    let mut out = Vec::new();
    for piece in field.split(|&b| b == b';') {
        let pair = trim_ows(piece);
        if pair.is_empty() {
            continue;
        }
        let eq = pair.iter().position(|&b| b == b'=')?;
        let name = trim_ows(&pair[..eq]);
        if name.is_empty() || !name.iter().all(|&b| is_tchar(b)) {
            return None;
        }
        out.push((name, pair));
    }
    Some(out.into_iter())
}

fn trim_ows(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

/// RFC 9110 §5.6.2 tchar.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A cookie name as the most lenient common servers read it, so that every
/// spelling one of them would take for a credential cookie counts as it:
/// percent-decoded (PHP decodes names), ASCII-lowercased, `.`, space and a
/// literal `+` (PHP decodes it to a space) read as `_`, and anything from
/// `[` on dropped (PHP again).
fn canonical_cookie_name(name: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(name.len());
    let mut i = 0;
    while i < name.len() {
        let mut b = name[i];
        if b == b'+' {
            b = b' ';
        } else if b == b'%'
            && let (Some(h), Some(l)) = (
                name.get(i + 1).and_then(|c| (*c as char).to_digit(16)),
                name.get(i + 2).and_then(|c| (*c as char).to_digit(16)),
            )
        {
            b = u8::try_from(h * 16 + l).unwrap_or(b'%');
            i += 2;
        }
        i += 1;
        match b {
            b'[' => break,
            b'.' | b' ' => out.push(b'_'),
            _ => out.push(b.to_ascii_lowercase()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_star_makes_every_cookie_a_credential() {
        let every = IdentityRules::new(vec![AUTHORIZATION], vec!["*".into()]);
        let field = |v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(COOKIE, http::HeaderValue::from_static(v));
            h
        };
        let a = every
            .identify(&field("_ga=1; theme=dark"))
            .expect("identified");
        let b = every
            .identify(&field("_ga=2; theme=dark"))
            .expect("identified");
        assert_ne!(a, b);
        assert!(!a.is_authorization_only());
        assert_eq!(every.identify(&HeaderMap::new()), None);
        // Named cookies alone: the others are anonymous.
        let named = IdentityRules::new(vec![AUTHORIZATION], vec!["session".into()]);
        assert_eq!(named.identify(&field("_ga=1")), None);
        let none = IdentityRules::new(vec![AUTHORIZATION], Vec::new());
        assert_eq!(none.identify(&field("session=1")), None);
    }

    #[test]
    fn callers_with_cookies_are_a_pass_class_of_their_own() {
        let mut cookie = HeaderMap::new();
        cookie.insert(COOKIE, http::HeaderValue::from_static("sess=a"));
        let plain = HeaderMap::new();
        let id = Identity::from_bytes([7; 32]);
        assert_eq!(pass_class(None, &plain), None);
        let cookies = pass_class(None, &cookie).expect("a class");
        assert_ne!(cookies, id);
        assert_eq!(pass_class(Some(&id), &cookie), Some(id));
        assert_eq!(pass_class(Some(&id), &plain), Some(id));
    }
    use http::HeaderValue;

    fn rules() -> IdentityRules {
        IdentityRules::new(vec![AUTHORIZATION], vec!["session".into()])
    }

    fn with_cookies(fields: &[&[u8]]) -> Option<Identity> {
        let mut h = HeaderMap::new();
        for f in fields {
            h.append(COOKIE, HeaderValue::from_bytes(f).expect("cookie field"));
        }
        rules().identify(&h)
    }

    #[test]
    fn anonymous_requests_have_no_identity() {
        assert!(with_cookies(&[b"theme=dark"]).is_none());
        assert!(with_cookies(&[b"theme=d\xc3\xa9cor; lang=fr"]).is_none());
        assert!(rules().identify(&HeaderMap::new()).is_none());
    }

    #[test]
    fn different_credentials_differ_and_same_ones_agree() {
        let mk = |auth: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(AUTHORIZATION, HeaderValue::from_static(auth));
            rules().identify(&h)
        };
        assert_ne!(mk("Bearer a"), mk("Bearer b"));
        assert_eq!(mk("Bearer a"), mk("Bearer a"));
        assert!(mk("Bearer a").is_some_and(|i| i.is_authorization_only()));
    }

    #[test]
    fn named_cookies_identify_regardless_of_order_and_others() {
        let a = with_cookies(&[b"theme=1; session=abc"]);
        assert!(a.is_some_and(|i| !i.is_authorization_only()));
        assert_eq!(a, with_cookies(&[b"session=abc; x=2"]));
        assert_ne!(a, with_cookies(&[b"session=abd"]));
    }

    #[test]
    fn every_spelling_a_server_reads_as_the_credential_cookie_identifies() {
        for field in [
            &b"session =x"[..],
            b"session= x",
            b"\tsession=x",
            b"SESSION=x",
            b"sess%69on=x",
            b"session=caf\xc3\xa9",
            b"session=\xff\xfe",
            b"theme=\xe2\x9c\x93; session=x",
        ] {
            assert!(
                with_cookies(&[field]).is_some(),
                "{:?}",
                String::from_utf8_lossy(field)
            );
        }
        // PHP reads `a.b`, `a+b` and `a b` as `a_b`, and `a[x]` as `a`.
        let php = IdentityRules::new(vec![], vec!["sid_v2".into()]);
        for field in [
            &b"sid.v2=x"[..],
            b"sid%2Ev2=x",
            b"sid+v2=x",
            b"sid%20v2=x",
            b"sid_v2[0]=x",
        ] {
            let mut h = HeaderMap::new();
            h.insert(COOKIE, HeaderValue::from_bytes(field).expect("cookie"));
            assert!(
                php.identify(&h).is_some(),
                "{:?}",
                String::from_utf8_lossy(field)
            );
        }
    }

    #[test]
    fn a_cookie_field_that_does_not_parse_fails_closed() {
        for field in [&b"session"[..], b"se\"ss=x", b"(x)=1", b"a=1; junk"] {
            let id = with_cookies(&[field]);
            assert!(id.is_some(), "{:?}", String::from_utf8_lossy(field));
        }
        // Keyed on the raw bytes: two different unparseable fields differ.
        assert_ne!(with_cookies(&[b"junk1"]), with_cookies(&[b"junk2"]));
    }
}
