//! No-Vary-Search (draft-ietf-httpbis-no-vary-search-10): the origin says
//! which query parameters, and whether their order, do not change its
//! answer, so that requests that differ only in them share one entry and
//! one flight.
//!
//! The field is an RFC 8941 Dictionary, in draft-10's forms (the working
//! group's change of 2025-12-24):
//! - `params=("a" "b")`: the named parameters do not matter;
//! - `except=("id")`: only the named parameters matter (`except=()`:
//!   none does);
//! - `key-order`: the order of parameters does not matter. Without it,
//!   order matters: `?a=1&b=2` is not `?b=2&a=1`.
//!
//! A field that does not parse as such a Dictionary is ignored (every
//! parameter, and their order, matters), as the draft says. So is one
//! with `key-order` not a Boolean, `params` or `except` not an inner list
//! of Strings (the earlier drafts' Boolean `params`, `params=?1`, is no
//! longer a form), or both `params` and `except`: a rule corral cannot
//! read whole never makes two requests share. Members of other names are
//! ignored, as the draft says.
//!
//! Names are compared as the draft compares them: as
//! `application/x-www-form-urlencoded` parses them (`+` is a space,
//! `%XX` a byte), both in the field and in the query. A name that does
//! not decode to UTF-8 is never taken for a named one: under `except` it
//! is kept (it matters), so corral is never looser than an origin that
//! decodes lossily. Values are compared as sent, which is never looser
//! than the draft's decoded comparison.
//!
//! A stored answer is reused only under its own rule: keys made with a
//! rule carry [`NoVarySearch::record`], so an entry stored under one rule
//! is never found by a key made with another.

use std::borrow::Cow;

use http::HeaderMap;
use http::header::HeaderName;

use crate::semantics::path::hex;
use crate::semantics::sf;

pub static NO_VARY_SEARCH: HeaderName = HeaderName::from_static("no-vary-search");

/// A No-Vary-Search rule that lets some parameters, or their order, not
/// matter.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NoVarySearch {
    params: Params,
    /// `key-order`: parameters' order does not matter.
    key_order: bool,
    /// The rule as [`NoVarySearch::record`] writes it: made once, since
    /// every key made with the rule carries it.
    record: Box<str>,
}

/// Which parameters matter.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Params {
    /// These parameters do not matter (decoded names, sorted, distinct).
    Ignore(Vec<Vec<u8>>),
    /// Only these parameters matter (decoded names, sorted, distinct).
    Only(Vec<Vec<u8>>),
}

impl NoVarySearch {
    /// The rule an answer's fields give; `None` when they give none that
    /// lets anything not matter (no field, a malformed one, or one that
    /// names nothing).
    pub fn of(headers: &HeaderMap) -> Option<Self> {
        Self::parse(&sf::joined(headers.get_all(&NO_VARY_SEARCH).iter())?)
    }

    /// One field value; `None` as for [`NoVarySearch::of`].
    pub fn parse(raw: &[u8]) -> Option<Self> {
        let mut params: Option<Vec<Vec<u8>>> = None;
        let mut except: Option<Vec<Vec<u8>>> = None;
        let mut key_order = false;
        let names = |value: sf::Member| -> Option<Vec<Vec<u8>>> {
            let sf::Member::InnerList(items) = value else {
                return None;
            };
            let mut names = items
                .into_iter()
                .map(|item| match item {
                    sf::Item::String(s) => Some(form_decoded(&s).into_owned()),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()?;
            names.sort_unstable();
            names.dedup();
            Some(names)
        };
        for (key, value) in sf::dictionary(raw)? {
            match key.as_str() {
                "key-order" => match value {
                    sf::Member::Item(sf::Item::Boolean(b)) => key_order = b,
                    _ => return None,
                },
                "params" => params = Some(names(value)?),
                "except" => except = Some(names(value)?),
                // Members this draft does not define are ignored.
                _ => {}
            }
        }
        let params = match (params, except) {
            (Some(_), Some(_)) => return None,
            (Some(ignored), None) => Params::Ignore(ignored),
            (None, Some(kept)) => Params::Only(kept),
            (None, None) => Params::Ignore(Vec::new()),
        };
        if params == Params::Ignore(Vec::new()) && !key_order {
            return None;
        }
        Some(Self::new(params, key_order))
    }

    fn new(params: Params, key_order: bool) -> Self {
        let list = |names: &[Vec<u8>]| -> String {
            let mut out = String::from("(");
            for (i, n) in names.iter().enumerate() {
                if i > 0 {
                    out.push(' ');
                }
                // Encoded so that decoding gives the name back; the
                // encoding leaves nothing a String would have to escape.
                out.push('"');
                out.extend(form_encoded(n).into_iter().map(char::from));
                out.push('"');
            }
            out.push(')');
            out
        };
        let mut record = String::new();
        if key_order {
            record.push_str("key-order");
        }
        let members = match &params {
            Params::Ignore(names) if names.is_empty() => None,
            Params::Ignore(names) => Some(format!("params={}", list(names))),
            Params::Only(names) => Some(format!("except={}", list(names))),
        };
        if let Some(m) = members {
            if !record.is_empty() {
                record.push_str(", ");
            }
            record.push_str(&m);
        }
        NoVarySearch {
            params,
            key_order,
            record: record.into_boxed_str(),
        }
    }

    /// True when the parameter named `raw_name` (as it is in the query)
    /// changes the answer.
    pub fn matters(&self, raw_name: &str) -> bool {
        let name = form_decoded(raw_name.as_bytes());
        match &self.params {
            Params::Ignore(names) => {
                std::str::from_utf8(&name).is_err()
                    || names.binary_search_by(|n| n[..].cmp(&name)).is_err()
            }
            Params::Only(names) => {
                std::str::from_utf8(&name).is_err()
                    || names.binary_search_by(|n| n[..].cmp(&name)).is_ok()
            }
        }
    }

    /// True when the order of the parameters does not matter
    /// (`key-order`).
    pub fn ignores_order(&self) -> bool {
        self.key_order
    }

    /// The rule as a field value that [`NoVarySearch::parse`] reads back
    /// as the same rule: how it is recorded in Redis, and the mark a key
    /// made with it carries.
    pub fn record(&self) -> &str {
        &self.record
    }

    /// What the rule costs to keep, in bytes.
    pub fn weight(&self) -> usize {
        let names = match &self.params {
            Params::Ignore(n) | Params::Only(n) => n,
        };
        std::mem::size_of::<Self>()
            + self.record.len()
            + names.iter().map(|n| 24 + n.len()).sum::<usize>()
    }
}

/// A name as `application/x-www-form-urlencoded` decodes it: `+` is a
/// space and `%XX` a byte (a `%` not followed by two hex digits stays).
pub(crate) fn form_decoded(raw: &[u8]) -> Cow<'_, [u8]> {
    if !raw.iter().any(|&b| b == b'+' || b == b'%') {
        return Cow::Borrowed(raw);
    }
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        match raw[i] {
            b'+' => out.push(b' '),
            b'%' => match (
                raw.get(i + 1).and_then(|&b| hex(b)),
                raw.get(i + 2).and_then(|&b| hex(b)),
            ) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    Cow::Owned(out)
}

/// A decoded name as a String's content that [`form_decoded`] turns back
/// into it: `%`, `+`, `"`, `\` and bytes outside printable ASCII become
/// `%XX`.
fn form_encoded(name: &[u8]) -> Vec<u8> {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = Vec::with_capacity(name.len());
    for &b in name {
        if matches!(b, b'%' | b'+' | b'"' | b'\\') || !(0x20..0x7f).contains(&b) {
            out.extend_from_slice(&[b'%', HEX[usize::from(b >> 4)], HEX[usize::from(b & 0xf)]]);
        } else {
            out.push(b);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn names(list: &[&str]) -> Vec<Vec<u8>> {
        let mut v: Vec<Vec<u8>> = list.iter().map(|s| s.as_bytes().to_vec()).collect();
        v.sort();
        v
    }

    fn ignore(list: &[&str], key_order: bool) -> Option<NoVarySearch> {
        Some(NoVarySearch::new(Params::Ignore(names(list)), key_order))
    }

    fn only(list: &[&str], key_order: bool) -> Option<NoVarySearch> {
        Some(NoVarySearch::new(Params::Only(names(list)), key_order))
    }

    #[test]
    fn the_drafts_forms_parse() {
        assert_eq!(
            NoVarySearch::parse(br#"params=("utm_source" "fbclid")"#),
            ignore(&["fbclid", "utm_source"], false)
        );
        assert_eq!(
            NoVarySearch::parse(br#"key-order, params=("a")"#),
            ignore(&["a"], true)
        );
        assert_eq!(
            NoVarySearch::parse(br#"except=("id")"#),
            only(&["id"], false)
        );
        assert_eq!(NoVarySearch::parse(b"except=()"), only(&[], false));
        assert_eq!(NoVarySearch::parse(b"key-order"), ignore(&[], true));
        assert_eq!(
            NoVarySearch::parse(b"key-order, params=()"),
            ignore(&[], true)
        );
        // Percent-encoded and `+` names are compared decoded.
        assert_eq!(
            NoVarySearch::parse(br#"params=("a%5Fb" "c+d")"#),
            ignore(&["a_b", "c d"], false)
        );
        // Members the draft does not define are ignored.
        assert_eq!(
            NoVarySearch::parse(br#"params=("a"), future=?1"#),
            ignore(&["a"], false)
        );
    }

    #[test]
    fn a_rule_that_is_not_read_whole_lets_nothing_go() {
        for bad in [
            &b""[..],
            // The forms before draft-10: a Boolean `params`, and
            // `except` beside it.
            b"params",
            b"params=?1",
            b"params=?0",
            br#"params, except=("id")"#,
            br#"params=("a"), except=("b")"#,
            br#"params=("a" b)"#,
            br#"except=b"#,
            b"key-order=1, params=(\"a\")",
            b"key-order=?0",
            b"params=(",
            br#"params=("a"),"#,
            b"params=()",
        ] {
            assert_eq!(
                NoVarySearch::parse(bad),
                None,
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn matters_decodes_the_querys_names() {
        let r = NoVarySearch::parse(br#"params=("utm_source")"#).expect("rule");
        assert!(!r.matters("utm_source"));
        assert!(!r.matters("utm%5Fsource"));
        assert!(!r.matters("utm%5fsource"));
        assert!(r.matters("utm_sourc"));
        assert!(r.matters("UTM_SOURCE"));
        let only = NoVarySearch::parse(br#"except=("id")"#).expect("rule");
        assert!(only.matters("id"));
        assert!(only.matters("%69d"));
        assert!(!only.matters("page"));
        // A name that is not UTF-8 once decoded always matters.
        assert!(only.matters("%FF"));
        let r = NoVarySearch::parse(br#"params=("%FF")"#).expect("rule");
        assert!(r.matters("%FF"));
    }

    #[test]
    fn records_read_back_as_the_same_rule() {
        for raw in [
            &br#"params=("utm_source" "fbclid")"#[..],
            br#"except=("id" "a%22b" "c\\d")"#,
            b"except=()",
            b"key-order",
            br#"key-order, except=("id")"#,
            br#"params=("%25" "+" "%2B")"#,
        ] {
            let rule = NoVarySearch::parse(raw).expect("rule");
            let record = rule.record().to_owned();
            assert_eq!(
                NoVarySearch::parse(record.as_bytes()),
                Some(rule),
                "{record}"
            );
        }
    }

    proptest! {
        #[test]
        fn parse_never_panics(raw in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = NoVarySearch::parse(&raw);
        }

        #[test]
        fn any_rule_records_and_reads_back(
            list in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..6), 1..5),
            only in any::<bool>(),
            key_order in any::<bool>(),
        ) {
            let mut list = list;
            list.sort();
            list.dedup();
            let params = if only { Params::Only(list) } else { Params::Ignore(list) };
            let rule = NoVarySearch::new(params, key_order);
            let record = rule.record().to_owned();
            prop_assert_eq!(NoVarySearch::parse(record.as_bytes()), Some(rule));
        }
    }
}
