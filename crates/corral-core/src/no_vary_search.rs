//! No-Vary-Search (draft-ietf-httpbis-no-vary-search-10): the origin says
//! which query parameters do not change its answer, so that requests that
//! differ only in them share one entry and one flight.
//!
//! The field is an RFC 8941 Dictionary:
//! - `params=("a" "b")`: the named parameters do not matter;
//! - `params` (true) with `except=("id")`: only the named ones matter;
//! - `key-order`: the order of parameters does not matter. corral keys a
//!   query with its parameters ordered by name already, so this changes
//!   nothing here.
//!
//! A field that is not such a Dictionary is ignored (every parameter
//! matters), as the draft says. So is one with a member corral does not
//! know, `except` without `params` true, or a `params` that is neither a
//! Boolean nor an inner list of Strings: a rule corral cannot read whole
//! never makes two requests share.
//!
//! Names are compared as the draft compares them: as
//! `application/x-www-form-urlencoded` parses them (`+` is a space,
//! `%XX` a byte), both in the field and in the query. A name that does
//! not decode to UTF-8 is never taken for a named one: under `except` it
//! is kept (it matters), so corral is never looser than an origin that
//! decodes lossily.

use std::borrow::Cow;

use http::HeaderMap;
use http::header::HeaderName;

use crate::path::hex;
use crate::sf;

pub static NO_VARY_SEARCH: HeaderName = HeaderName::from_static("no-vary-search");

/// A No-Vary-Search rule that lets some parameters not matter.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum NoVarySearch {
    /// These parameters do not matter (decoded names, sorted, distinct).
    Ignore(Vec<Vec<u8>>),
    /// Only these parameters matter (decoded names, sorted, distinct).
    Only(Vec<Vec<u8>>),
}

impl NoVarySearch {
    /// The rule an answer's fields give; `None` when they give none that
    /// lets a parameter not matter (no field, a malformed one, or one that
    /// only says `key-order`).
    pub fn of(headers: &HeaderMap) -> Option<Self> {
        Self::parse(&sf::joined(headers.get_all(&NO_VARY_SEARCH).iter())?)
    }

    /// One field value; `None` as for [`NoVarySearch::of`].
    pub fn parse(raw: &[u8]) -> Option<Self> {
        let mut params: Option<sf::Member> = None;
        let mut except: Option<sf::Member> = None;
        for (key, value) in sf::dictionary(raw)? {
            match key.as_str() {
                "key-order" => {
                    if !matches!(value, sf::Member::Item(sf::Item::Boolean(_))) {
                        return None;
                    }
                }
                "params" => params = Some(value),
                "except" => except = Some(value),
                _ => return None,
            }
        }
        let names = |items: Vec<sf::Item>| -> Option<Vec<Vec<u8>>> {
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
        match (params, except) {
            (None | Some(sf::Member::Item(sf::Item::Boolean(false))), None) => None,
            (Some(sf::Member::InnerList(items)), None) => {
                let names = names(items)?;
                (!names.is_empty()).then_some(NoVarySearch::Ignore(names))
            }
            (Some(sf::Member::Item(sf::Item::Boolean(true))), None) => {
                Some(NoVarySearch::Only(Vec::new()))
            }
            (
                Some(sf::Member::Item(sf::Item::Boolean(true))),
                Some(sf::Member::InnerList(items)),
            ) => Some(NoVarySearch::Only(names(items)?)),
            _ => None,
        }
    }

    /// True when the parameter named `raw_name` (as it is in the query)
    /// changes the answer.
    pub fn matters(&self, raw_name: &str) -> bool {
        let name = form_decoded(raw_name.as_bytes());
        match self {
            NoVarySearch::Ignore(names) => {
                std::str::from_utf8(&name).is_err()
                    || names.binary_search_by(|n| n[..].cmp(&name)).is_err()
            }
            NoVarySearch::Only(names) => {
                std::str::from_utf8(&name).is_err()
                    || names.binary_search_by(|n| n[..].cmp(&name)).is_ok()
            }
        }
    }

    /// The rule as a field value that [`NoVarySearch::parse`] reads back
    /// as the same rule: how it is recorded in Redis.
    pub fn record(&self) -> String {
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
        match self {
            NoVarySearch::Ignore(names) => format!("params={}", list(names)),
            NoVarySearch::Only(names) => format!("params, except={}", list(names)),
        }
    }

    /// What the rule costs to keep, in bytes.
    pub fn weight(&self) -> usize {
        let names = match self {
            NoVarySearch::Ignore(n) | NoVarySearch::Only(n) => n,
        };
        std::mem::size_of::<Self>() + names.iter().map(|n| 24 + n.len()).sum::<usize>()
    }
}

/// A name as `application/x-www-form-urlencoded` decodes it: `+` is a
/// space and `%XX` a byte (a `%` not followed by two hex digits stays).
fn form_decoded(raw: &[u8]) -> Cow<'_, [u8]> {
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

    #[test]
    fn the_drafts_forms_parse() {
        assert_eq!(
            NoVarySearch::parse(br#"params=("utm_source" "fbclid")"#),
            Some(NoVarySearch::Ignore(names(&["fbclid", "utm_source"])))
        );
        assert_eq!(
            NoVarySearch::parse(br#"key-order, params=("a")"#),
            Some(NoVarySearch::Ignore(names(&["a"])))
        );
        assert_eq!(
            NoVarySearch::parse(br#"params, except=("id")"#),
            Some(NoVarySearch::Only(names(&["id"])))
        );
        assert_eq!(
            NoVarySearch::parse(b"params"),
            Some(NoVarySearch::Only(Vec::new()))
        );
        // Percent-encoded and `+` names are compared decoded.
        assert_eq!(
            NoVarySearch::parse(br#"params=("a%5Fb" "c+d")"#),
            Some(NoVarySearch::Ignore(names(&["a_b", "c d"])))
        );
    }

    #[test]
    fn a_rule_that_is_not_read_whole_lets_nothing_go() {
        for bad in [
            &b""[..],
            b"key-order",
            b"params=?0",
            br#"params=("a" b)"#,
            br#"params=("a"), except=("b")"#,
            br#"except=("b")"#,
            br#"params, except=b"#,
            b"key-order=1, params",
            br#"params=("a"), unknown"#,
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
        let only = NoVarySearch::parse(br#"params, except=("id")"#).expect("rule");
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
            br#"params, except=("id" "a%22b" "c\\d")"#,
            b"params",
            br#"params=("%25" "+" "%2B")"#,
        ] {
            let rule = NoVarySearch::parse(raw).expect("rule");
            let record = rule.record();
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
        ) {
            let mut list = list;
            list.sort();
            list.dedup();
            let rule = if only { NoVarySearch::Only(list) } else { NoVarySearch::Ignore(list) };
            let record = rule.record();
            prop_assert_eq!(NoVarySearch::parse(record.as_bytes()), Some(rule));
        }
    }
}
