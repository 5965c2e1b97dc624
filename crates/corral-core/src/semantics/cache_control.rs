//! Cache-Control directives as corral reads them: the RFC 9111 set that
//! decides storing and serving, plus RFC 5861's stale-while-revalidate and
//! stale-if-error, which http-cache-semantics does not interpret.
//! Parsing never fails: a malformed directive is read conservatively.

use http::HeaderMap;
use http::header::CACHE_CONTROL;

/// Response (or request) Cache-Control directives, parsed once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheControl {
    pub max_age: Option<u64>,
    pub s_maxage: Option<u64>,
    pub no_store: bool,
    /// The unqualified `no-cache` (or a qualified one corral cannot read):
    /// revalidate before every reuse.
    pub no_cache: bool,
    /// §5.2.2.4's qualified form, `no-cache="field, ..."`: the answer may
    /// be reused without revalidation, without these fields (lowercase).
    pub no_cache_fields: Vec<http::HeaderName>,
    pub private: bool,
    pub public: bool,
    pub must_revalidate: bool,
    pub proxy_revalidate: bool,
    /// §5.2.2.3: store only if the status is understood; then `no-store`
    /// is ignored.
    pub must_understand: bool,
    pub stale_while_revalidate: Option<u64>,
    pub stale_if_error: Option<u64>,
    /// §5.2.2.6: no intermediary transforms the content (corral does not
    /// compress it).
    pub no_transform: bool,
}

impl CacheControl {
    /// Reads every Cache-Control field line of `headers`.
    pub fn parse(headers: &HeaderMap) -> Self {
        let mut cc = CacheControl::default();
        for value in headers.get_all(CACHE_CONTROL) {
            let Ok(value) = value.to_str() else {
                // Unreadable bytes: behave as if the origin forbade storing
                // (and transforming).
                cc.no_store = true;
                cc.no_transform = true;
                continue;
            };
            for directive in split_directives(value) {
                cc.apply(directive);
            }
        }
        cc
    }

    fn apply(&mut self, directive: &str) {
        let (name, arg) = match directive.split_once('=') {
            Some((n, a)) => (n.trim(), Some(a.trim().trim_matches('"'))),
            None => (directive.trim(), None),
        };
        // A malformed delta-seconds is treated as 0: RFC 9111 §1.2.2 asks
        // for the conservative reading.
        let seconds = || arg.map(|a| a.parse::<u64>().unwrap_or(0)).unwrap_or(0);
        match name.to_ascii_lowercase().as_str() {
            "max-age" => set_first(&mut self.max_age, seconds()),
            "s-maxage" => set_first(&mut self.s_maxage, seconds()),
            "stale-while-revalidate" => set_first(&mut self.stale_while_revalidate, seconds()),
            "stale-if-error" => set_first(&mut self.stale_if_error, seconds()),
            "no-store" => self.no_store = true,
            // §5.2.2.4: the qualified form names the fields a reuse must
            // not carry; the rest may be reused. One that names nothing,
            // or a name that is not a field name, is read as the
            // unqualified form: stricter, never wrong.
            "no-cache" => match arg.and_then(field_names) {
                Some(names) => self.no_cache_fields.extend(names),
                None => self.no_cache = true,
            },
            // The qualified `private="x"` is read as the unqualified one
            // (the answer is not stored at all): stricter, never wrong.
            "private" => self.private = true,
            "public" => self.public = true,
            "must-revalidate" => self.must_revalidate = true,
            "proxy-revalidate" => self.proxy_revalidate = true,
            "must-understand" => self.must_understand = true,
            "no-transform" => self.no_transform = true,
            _ => {}
        }
    }

    /// True when the response names its own freshness lifetime.
    pub fn has_explicit_lifetime(&self) -> bool {
        self.max_age.is_some() || self.s_maxage.is_some()
    }

    /// RFC 9111 §3.5: directives that let a shared cache reuse a response to
    /// an authenticated request for other callers.
    pub fn shareable_when_authenticated(&self) -> bool {
        self.public || self.s_maxage.is_some() || self.must_revalidate
    }

    /// True when the origin forbids serving this response stale.
    pub fn forbids_stale(&self) -> bool {
        self.must_revalidate || self.proxy_revalidate || self.no_cache
    }
}

/// Cache-Control text without its qualified `no-cache="field, ..."`
/// members that [`CacheControl`] reads as such (names already lowercased):
/// http-cache-semantics reads any `no-cache` as the unqualified form.
pub(crate) fn without_qualified_no_cache(text: &str) -> String {
    split_directives(text)
        .filter(|d| {
            let qualified = d.split_once('=').and_then(|(name, arg)| {
                (name.trim() == "no-cache").then(|| field_names(arg.trim().trim_matches('"')))
            });
            !matches!(qualified, Some(Some(_)))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The field names of a qualified directive's argument, lowercased;
/// `None` when it names none or one that is not a field name.
fn field_names(arg: &str) -> Option<Vec<http::HeaderName>> {
    let names = arg
        .split(',')
        .map(|n| http::HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect::<Option<Vec<_>>>()?;
    (!names.is_empty()).then_some(names)
}

/// RFC 9213: the value of the first of `fields` (a route's targeted
/// fields, in priority order) that the response carries with a valid,
/// non-empty value. A targeted field is a Structured Fields Dictionary:
/// lowercase keys, each bare or with an integer, token or string value.
/// `None` when none qualifies: Cache-Control (and Expires) apply.
pub fn targeted_value(headers: &HeaderMap, fields: &[http::HeaderName]) -> Option<String> {
    fields.iter().find_map(|name| {
        let mut lines = headers.get_all(name).iter().peekable();
        lines.peek()?;
        let text = lines
            .map(|v| v.to_str().ok())
            .collect::<Option<Vec<_>>>()?
            .join(", ");
        valid_dictionary(&text).then(|| booleans_resolved(&text))
    })
}

/// The directives of a valid targeted field as Cache-Control reads them:
/// a boolean member that is false (`no-store=?0`) is left out, a true one
/// (`no-store=?1`) is written bare.
fn booleans_resolved(text: &str) -> String {
    if !text.contains('?') {
        return text.to_owned();
    }
    split_directives(text)
        .filter(|m| !m.ends_with("=?0"))
        .map(|m| m.strip_suffix("=?1").unwrap_or(m))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The kind of a targeted field member's value (RFC 8941 bare items).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Item {
    Integer { negative: bool },
    Boolean,
    String,
    Token,
}

/// What `v` is as a bare item; `None` when it is none.
fn item(v: &str) -> Option<Item> {
    let digits = v.strip_prefix('-').unwrap_or(v);
    if !digits.is_empty() && digits.len() <= 15 && digits.bytes().all(|b| b.is_ascii_digit()) {
        return Some(Item::Integer {
            negative: digits.len() != v.len(),
        });
    }
    if v == "?0" || v == "?1" {
        return Some(Item::Boolean);
    }
    if v.len() >= 2 && v.starts_with('"') && v.ends_with('"') {
        return Some(Item::String);
    }
    let token = v
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'*')
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/".contains(&b));
    token.then_some(Item::Token)
}

/// RFC 9213 §2.1: the directives whose values have a type; a targeted
/// field in which one has a value of another type is invalid (ignored as a
/// whole, like any field that does not parse). `value` is `None` for a
/// bare member.
fn typed_right(key: &str, value: Option<Item>) -> bool {
    match key {
        "max-age" | "s-maxage" | "stale-while-revalidate" | "stale-if-error" => {
            value == Some(Item::Integer { negative: false })
        }
        "no-store" | "no-cache" | "private" | "public" | "must-revalidate" | "proxy-revalidate"
        | "must-understand" | "immutable" => matches!(value, None | Some(Item::Boolean)),
        _ => true,
    }
}

fn valid_dictionary(text: &str) -> bool {
    let members: Vec<&str> = split_directives(text).collect();
    if members.is_empty() {
        return false;
    }
    members.iter().all(|m| {
        let (key, value) = match m.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (*m, None),
        };
        let key_ok = key
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b == b'*')
            && key.bytes().all(|b| {
                b.is_ascii_lowercase()
                    || b.is_ascii_digit()
                    || matches!(b, b'_' | b'-' | b'.' | b'*')
            });
        let value = match value.map(item) {
            None => None,
            Some(None) => return false,
            Some(kind) => kind,
        };
        key_ok && typed_right(key, value)
    })
}

fn set_first(slot: &mut Option<u64>, value: u64) {
    if slot.is_none() {
        *slot = Some(value);
    }
}

/// Splits on commas outside quoted strings.
fn split_directives(value: &str) -> impl Iterator<Item = &str> {
    let mut in_quotes = false;
    let mut start = 0;
    let mut parts = Vec::new();
    for (i, b) in value.bytes().enumerate() {
        match b {
            b'"' => in_quotes = !in_quotes,
            b',' if !in_quotes => {
                parts.push(&value[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&value[start..]);
    parts.into_iter().map(str::trim).filter(|p| !p.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn cc(v: &str) -> CacheControl {
        let mut h = HeaderMap::new();
        h.insert(CACHE_CONTROL, HeaderValue::from_str(v).expect("header"));
        CacheControl::parse(&h)
    }

    #[test]
    fn reads_rfc5861_extensions_and_lifetimes() {
        let c = cc("public, max-age=60, stale-while-revalidate=30, stale-if-error=600");
        assert_eq!(c.max_age, Some(60));
        assert_eq!(c.stale_while_revalidate, Some(30));
        assert_eq!(c.stale_if_error, Some(600));
        assert!(c.public && !c.private);
    }

    #[test]
    fn malformed_seconds_read_as_zero_and_first_wins() {
        let c = cc("max-age=abc, max-age=100, s-maxage=\"5\"");
        assert_eq!(c.max_age, Some(0));
        assert_eq!(c.s_maxage, Some(5));
    }

    #[test]
    fn quoted_commas_do_not_split() {
        let c = cc("private=\"set-cookie, x-a\", max-age=5");
        assert!(c.private);
        assert_eq!(c.max_age, Some(5));
    }

    #[test]
    fn a_qualified_no_cache_names_fields_and_an_unreadable_one_is_plain() {
        let c = cc("no-cache=\"X-Secret, set-cookie\", max-age=60");
        assert!(!c.no_cache && !c.forbids_stale());
        assert_eq!(c.no_cache_fields, ["x-secret", "set-cookie"]);
        assert_eq!(c.max_age, Some(60));
        for plain in [
            "no-cache",
            "no-cache=\"\"",
            "no-cache=\"a b\"",
            "no-cache=\"x,,y\"",
        ] {
            let c = cc(plain);
            assert!(c.no_cache && c.no_cache_fields.is_empty(), "{plain}");
        }
        // Plain and qualified together: the plain one rules.
        let c = cc("no-cache=\"x-a\", no-cache");
        assert!(c.no_cache);
        // What http-cache-semantics is shown: the qualified form gone,
        // an unreadable one kept (it reads it as the plain one).
        assert_eq!(
            without_qualified_no_cache("max-age=60, no-cache=\"x-a, x-b\", public"),
            "max-age=60, public"
        );
        assert_eq!(
            without_qualified_no_cache("no-cache=\"a b\", no-cache"),
            "no-cache=\"a b\", no-cache"
        );
    }

    #[test]
    fn multiple_field_lines_combine() {
        let mut h = HeaderMap::new();
        h.append(CACHE_CONTROL, HeaderValue::from_static("max-age=5"));
        h.append(CACHE_CONTROL, HeaderValue::from_static("Must-Revalidate"));
        let c = CacheControl::parse(&h);
        assert_eq!(c.max_age, Some(5));
        assert!(c.must_revalidate && c.forbids_stale() && c.shareable_when_authenticated());
    }

    #[test]
    fn the_first_valid_targeted_field_wins() {
        let cdn = http::HeaderName::from_static("cdn-cache-control");
        let own = http::HeaderName::from_static("corral-cache-control");
        let mut h = HeaderMap::new();
        h.insert(CACHE_CONTROL, http::HeaderValue::from_static("no-store"));
        h.insert(
            &cdn,
            http::HeaderValue::from_static("max-age=60, x-ext=\"x, y\""),
        );
        assert_eq!(
            targeted_value(&h, &[own.clone(), cdn.clone()]).as_deref(),
            Some("max-age=60, x-ext=\"x, y\"")
        );
        h.insert(&own, http::HeaderValue::from_static("max-age=5"));
        assert_eq!(
            targeted_value(&h, &[own.clone(), cdn.clone()]).as_deref(),
            Some("max-age=5")
        );
        // Invalid (uppercase key, empty, stray syntax, a value of the wrong
        // type for its directive): the next one.
        for bad in [
            "MAX-AGE=5",
            "",
            " , ",
            "max-age=5 6",
            "=5",
            "max-age=--5",
            "max-age=\"5\"",
            "max-age=-5",
            "max-age",
            "max-age=5, no-store=1",
            "private=\"x\"",
        ] {
            h.insert(&own, http::HeaderValue::from_static(bad));
            assert_eq!(
                targeted_value(&h, &[own.clone(), cdn.clone()]).as_deref(),
                Some("max-age=60, x-ext=\"x, y\""),
                "{bad:?}"
            );
        }
        // Booleans: ?1 is the bare directive, ?0 its absence.
        h.insert(
            &own,
            http::HeaderValue::from_static("max-age=5, no-store=?0, must-revalidate=?1"),
        );
        assert_eq!(
            targeted_value(&h, &[own.clone(), cdn.clone()]).as_deref(),
            Some("max-age=5, must-revalidate")
        );
        assert_eq!(targeted_value(&HeaderMap::new(), &[own, cdn]), None);
    }
}
