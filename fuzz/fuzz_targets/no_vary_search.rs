//! Arbitrary bytes as an answer's `No-Vary-Search` field and, after a
//! NUL, a request's query, through `NoVarySearch::parse` and the key a
//! rule makes (`QueryFilter::normalize_with`).
//!
//! Invariants: nothing panics; parsing is deterministic; a rule read
//! back from its own record is the same rule; a key made with a rule
//! keeps every pair whose parameter matters, drops every one that does
//! not, and is the same key when made again from itself (normalizing is
//! idempotent, so a key is the target it is fetched as).
#![no_main]

use corral_core::{NoVarySearch, QueryFilter};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (field, query) = match data.iter().position(|&b| b == 0) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, &b""[..]),
    };
    let rule = NoVarySearch::parse(field);
    assert_eq!(rule, NoVarySearch::parse(field));
    if let Some(rule) = &rule {
        assert_eq!(NoVarySearch::parse(rule.record().as_bytes()).as_ref(), Some(rule));
    }
    let Ok(query) = std::str::from_utf8(query) else {
        return;
    };
    let filter = QueryFilter::default();
    let key = filter.normalize_with(query, rule.as_ref());
    assert_eq!(filter.normalize_with(&key, rule.as_ref()), key);
    let name = |p: &str| p[..p.find('=').unwrap_or(p.len())].to_owned();
    let kept: Vec<&str> = key.split('&').filter(|p| !p.is_empty()).collect();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let matters = rule.as_ref().is_none_or(|r| r.matters(&name(pair)));
        if matters {
            assert!(kept.contains(&pair), "{pair} matters and was dropped");
        } else {
            assert!(!kept.contains(&pair), "{pair} does not matter and was kept");
        }
    }
});
