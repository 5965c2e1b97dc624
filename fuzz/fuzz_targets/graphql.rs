//! Arbitrary bytes as a POST body under each content type corral reads,
//! through `graphql::classify`.
//!
//! Invariants: nothing panics; the verdict is deterministic; an encoded
//! body is never coalescible; a JSON body whose `query` holds a
//! `mutation` operation at the top of the document is never a read.
#![no_main]

use corral_core::wire::graphql::{PostBody, classify};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&kind, body)) = data.split_first() else {
        return;
    };
    let ct: Option<&[u8]> = match kind % 5 {
        0 => None,
        1 => Some(b"application/json"),
        2 => Some(b"application/graphql"),
        3 => Some(b"application/x-www-form-urlencoded"),
        _ => Some(b"text/plain"),
    };
    let verdict = classify(ct, None, body);
    assert_eq!(verdict, classify(ct, None, body));
    assert_eq!(classify(ct, Some(b"gzip"), body), PostBody::Unreadable);
    if let Ok(text) = std::str::from_utf8(body) {
        let wrapped = serde_json::json!({ "query": format!("mutation {{ x }} {text}") });
        let wrapped = wrapped.to_string();
        assert_ne!(
            classify(Some(b"application/json"), None, wrapped.as_bytes()),
            PostBody::Read,
            "{wrapped}"
        );
    }
});
