//! Arbitrary bytes as a request path, through `corral_core::semantics::path::normalize`
//! (the form routing, the key and the upstream target all use).
//!
//! Invariants: nothing panics; a path that is refused stays refused with a
//! leading `/` added or not; an accepted one starts with `/` and holds no
//! `//`, no `.` or `..` segment, no `%2F`/`%5C`/`\`/NUL and only ASCII
//! outside what the input held; normalizing it again gives it back
//! unchanged (what is forwarded is what was routed on), and its escapes
//! are upper-case hex of reserved or non-ASCII bytes only.
#![no_main]

use corral_core::semantics::path::normalize;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let path = format!("/{s}");
    let Ok(normal) = normalize(&path) else {
        return;
    };
    assert!(normal.starts_with('/'), "{path:?} -> {normal:?}");
    assert!(!normal.contains("//"), "{path:?} -> {normal:?}");
    for seg in normal.split('/') {
        assert!(seg != "." && seg != "..", "{path:?} -> {normal:?}");
    }
    let lower = normal.to_ascii_lowercase();
    for bad in ["%2f", "%5c", "%00", "\\", "\0"] {
        assert!(!lower.contains(bad), "{path:?} -> {normal:?}");
    }
    let b = normal.as_bytes();
    for (i, _) in normal.match_indices('%') {
        let hex = &b[i + 1..i + 3];
        assert!(hex.iter().all(|c| c.is_ascii_digit() || (b'A'..=b'F').contains(c)));
        let v = u8::from_str_radix(std::str::from_utf8(hex).unwrap(), 16).unwrap();
        assert!(!(v.is_ascii_alphanumeric() || b"-._~".contains(&v)), "{path:?} -> {normal:?}");
    }
    assert_eq!(normalize(&normal).ok().as_deref(), Some(&*normal), "{path:?}");
});
