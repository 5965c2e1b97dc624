//! Whether a POST body may be coalesced: read as GraphQL where it is
//! GraphQL, from the parsed operation. A route's `coalesce.post` shares
//! one origin request among identical POSTs of one caller; that is right
//! for a read and wrong for a write, which must reach the origin once per
//! request sent.
//!
//! - A body with a `Content-Encoding` cannot be read without decoding it:
//!   never coalesced.
//! - JSON (an object, or a batch of them): an operation's `query` is
//!   parsed as a GraphQL document (JSON escapes such as `\u006d` decoded
//!   first), and a document that defines a `mutation` or `subscription`
//!   operation anywhere is a write, whichever `operationName` it names.
//!   A persisted operation sent by its hash or id alone
//!   (`extensions.persistedQuery`, `documentId`) cannot be read: never
//!   coalesced. Nor is a `query` that is not a document. JSON that does
//!   not parse gets the coarse test below.
//! - `application/graphql`: the body is the document.
//! - A form (`application/x-www-form-urlencoded`): its `query` field is
//!   the document, its `extensions` may persist one.
//! - Any other body: the coarse test, the keywords anywhere as whole
//!   words. A false alarm costs one origin request; it never shares an
//!   answer.

use std::borrow::Cow;

/// The bytes a document's structure turns on, named so that no brace or
/// quote stands alone in the code.
const OPEN: u8 = b'{';
const CLOSE: u8 = b'}';
const QUOTE: u8 = b'"';

/// What a POST body is, for coalescing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PostBody {
    /// A read, or no GraphQL at all: identical ones may share a request.
    Read,
    /// A GraphQL mutation or subscription.
    Write,
    /// Encoded, persisted by hash, or malformed: what it does is unknown.
    Unreadable,
}

impl PostBody {
    /// True when identical bodies may share one origin request.
    pub fn coalescible(self) -> bool {
        self == PostBody::Read
    }
}

/// What `body`, sent with `content_type` and `content_encoding` (the
/// request's fields, if any), is.
pub fn classify(
    content_type: Option<&[u8]>,
    content_encoding: Option<&[u8]>,
    body: &[u8],
) -> PostBody {
    if content_encoding.is_some_and(|c| !c.trim_ascii().eq_ignore_ascii_case(b"identity")) {
        return PostBody::Unreadable;
    }
    let media = content_type
        .map(|t| {
            let end = t.iter().position(|&b| b == b';').unwrap_or(t.len());
            t[..end].trim_ascii().to_ascii_lowercase()
        })
        .unwrap_or_default();
    let json = media == b"application/json" || media.ends_with(b"+json");
    if json || (media.is_empty() && body.trim_ascii_start().first() == Some(&OPEN)) {
        // JSON that does not parse is no operation an origin runs: the
        // coarse test still keeps a keyword in it from being shared.
        return match serde_json::from_slice::<serde_json::Value>(body) {
            Ok(value) => json_body(&value),
            Err(_) => coarse(body),
        };
    }
    if media == b"application/graphql" {
        return match std::str::from_utf8(body) {
            Ok(doc) => document(doc),
            Err(_) => PostBody::Unreadable,
        };
    }
    if media == b"application/x-www-form-urlencoded" {
        return form(body);
    }
    coarse(body)
}

/// True when `body` holds `mutation` or `subscription` as a whole word:
/// the coarse test, for bodies of no type corral reads.
pub fn may_write(body: &[u8]) -> bool {
    [&b"mutation"[..], b"subscription"]
        .iter()
        .any(|word| holds_word(body, word))
}

fn coarse(body: &[u8]) -> PostBody {
    if may_write(body) {
        PostBody::Write
    } else {
        PostBody::Read
    }
}

fn holds_word(body: &[u8], word: &[u8]) -> bool {
    let name_byte = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    body.windows(word.len()).enumerate().any(|(i, w)| {
        w == word
            && (i == 0 || !name_byte(body[i - 1]))
            && body.get(i + word.len()).is_none_or(|&b| !name_byte(b))
    })
}

/// A JSON body: one GraphQL request, a batch of them, or JSON that is
/// not GraphQL (no `query`, nothing persisted).
fn json_body(value: &serde_json::Value) -> PostBody {
    match value {
        serde_json::Value::Array(batch) => batch
            .iter()
            .map(json_body)
            .max_by_key(|v| match v {
                PostBody::Read => 0,
                PostBody::Write => 1,
                PostBody::Unreadable => 2,
            })
            .unwrap_or(PostBody::Read),
        serde_json::Value::Object(fields) => {
            let persisted = fields.contains_key("documentId")
                || fields
                    .get("extensions")
                    .and_then(|e| e.get("persistedQuery"))
                    .is_some();
            match fields.get("query") {
                Some(serde_json::Value::String(doc)) => document(doc),
                Some(_) => PostBody::Unreadable,
                None if persisted => PostBody::Unreadable,
                None => PostBody::Read,
            }
        }
        _ => PostBody::Read,
    }
}

/// A form body: GraphQL's `query` field, or a persisted operation's
/// `extensions`; otherwise the coarse test on the decoded form.
fn form(body: &[u8]) -> PostBody {
    let mut decoded_all = Vec::with_capacity(body.len());
    let mut verdict = None;
    for pair in body.split(|&b| b == b'&') {
        let (name, value) = match pair.iter().position(|&b| b == b'=') {
            Some(i) => (&pair[..i], &pair[i + 1..]),
            None => (pair, &b""[..]),
        };
        let name = form_decoded(name);
        let value = form_decoded(value);
        decoded_all.extend_from_slice(&name);
        decoded_all.push(b'=');
        decoded_all.extend_from_slice(&value);
        decoded_all.push(b'\n');
        match &name[..] {
            b"query" => {
                verdict = Some(match std::str::from_utf8(&value) {
                    Ok(doc) => document(doc),
                    Err(_) => PostBody::Unreadable,
                });
            }
            b"extensions" | b"documentId" if verdict.is_none() => {
                verdict = Some(PostBody::Unreadable);
            }
            _ => {}
        }
        if verdict.is_some_and(|v| v != PostBody::Read) {
            return verdict.unwrap_or(PostBody::Unreadable);
        }
    }
    verdict.unwrap_or_else(|| coarse(&decoded_all))
}

fn form_decoded(raw: &[u8]) -> Cow<'_, [u8]> {
    crate::semantics::no_vary_search::form_decoded(raw)
}

/// A GraphQL document: a write when it defines a `mutation` or
/// `subscription` operation (a keyword outside every selection set),
/// unreadable when its braces or strings do not close. Names inside
/// selection sets (fields, arguments) never count; a type or default
/// value named like a keyword in a variable definition is a false alarm
/// on the safe side.
fn document(doc: &str) -> PostBody {
    let b = doc.as_bytes();
    let mut depth: usize = 0;
    let mut writes = false;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'#' => {
                while i < b.len() && b[i] != b'\n' && b[i] != b'\r' {
                    i += 1;
                }
            }
            QUOTE if b[i..].starts_with(b"\"\"\"") => {
                i += 3;
                loop {
                    if i >= b.len() {
                        return PostBody::Unreadable;
                    }
                    if b[i..].starts_with(b"\\\"\"\"") {
                        i += 4;
                    } else if b[i..].starts_with(b"\"\"\"") {
                        i += 2;
                        break;
                    } else {
                        i += 1;
                    }
                }
            }
            QUOTE => {
                i += 1;
                loop {
                    match b.get(i) {
                        None | Some(b'\n' | b'\r') => return PostBody::Unreadable,
                        Some(b'\\') => i += 2,
                        Some(&QUOTE) => break,
                        Some(_) => i += 1,
                    }
                }
            }
            OPEN => depth += 1,
            CLOSE => match depth.checked_sub(1) {
                Some(d) => depth = d,
                None => return PostBody::Unreadable,
            },
            c if c == b'_' || c.is_ascii_alphabetic() => {
                let start = i;
                while i < b.len() && (b[i] == b'_' || b[i].is_ascii_alphanumeric()) {
                    i += 1;
                }
                let name = &b[start..i];
                if depth == 0 && (name == b"mutation" || name == b"subscription") {
                    writes = true;
                }
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    match (depth, writes) {
        (0, true) => PostBody::Write,
        (0, false) => PostBody::Read,
        _ => PostBody::Unreadable,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const JSON: Option<&[u8]> = Some(b"application/json");

    #[test]
    fn writes_are_found_from_the_parsed_operation() {
        for w in [
            &br#"{"query":"mutation { like(id: 1) }"}"#[..],
            br#"{"query":"  mutation Like($id: ID!) { like(id: $id) }"}"#,
            br#"{"query":"query A { me } mutation B { x }","operationName":"A"}"#,
            br#"{"query":"\u006dutation { like(id: 1) }"}"#,
            br##"{"query":"# a comment\nsubscription { ticks }"}"##,
            br#"[{"query":"{ me }"},{"query":"mutation{x}"}]"#,
        ] {
            assert_eq!(
                classify(JSON, None, w),
                PostBody::Write,
                "{}",
                String::from_utf8_lossy(w)
            );
        }
        assert_eq!(
            classify(Some(b"application/graphql"), None, b"mutation{x}"),
            PostBody::Write
        );
        assert_eq!(
            classify(
                Some(b"application/x-www-form-urlencoded"),
                None,
                b"query=%6Dutation+%7B+x+%7D"
            ),
            PostBody::Write
        );
        assert_eq!(classify(None, None, b"mutation{x}"), PostBody::Write);
    }

    #[test]
    fn reads_are_reads_wherever_a_keyword_appears_inside_them() {
        for r in [
            &br#"{"query":"{ me { name } }"}"#[..],
            br#"{"query":"query Mutations { mutations_count }"}"#,
            br#"{"query":"{ mutation { name } }"}"#,
            br#"{"query":"{ search(text: \"mutation {\") { id } }"}"#,
            br##"{"query":"{ me } # mutation"}"##,
            br#"{"query":"{ doc(text: \"\"\"a mutation \\\"\"\" b\"\"\") }"}"#,
            br#"{"search":"mutation"}"#,
            br#"[{"query":"{ a }"},{"query":"{ b }"}]"#,
        ] {
            assert_eq!(
                classify(JSON, None, r),
                PostBody::Read,
                "{}",
                String::from_utf8_lossy(r)
            );
        }
        assert_eq!(
            classify(Some(b"application/x-www-form-urlencoded"), None, b"q=shoes"),
            PostBody::Read
        );
        assert_eq!(classify(None, None, b""), PostBody::Read);
        assert_eq!(classify(JSON, None, b"{not json}"), PostBody::Read);
        assert_eq!(classify(JSON, None, b"{mutation}"), PostBody::Write);
    }

    #[test]
    fn what_cannot_be_read_is_never_coalesced() {
        let persisted = br#"{"extensions":{"persistedQuery":{"version":1,"sha256Hash":"ecf4edb46db40b5132295c0291d62fb65d6759a9eedfa4d5d612dd5ec54a6b38"}}}"#;
        for (ct, ce, body) in [
            (JSON, None, &persisted[..]),
            (JSON, None, br#"{"documentId":"sha256:abc"}"#),
            (JSON, None, br#"{"query":5}"#),
            (JSON, None, br#"{"query":"{ me "}"#),
            (JSON, None, br#"{"query":"{ me(x: \"open) }"}"#),
            (JSON, Some(&b"gzip"[..]), br#"{"query":"{ me }"}"#),
            (None, Some(&b"br"[..]), b"q=shoes"),
            (
                Some(b"application/x-www-form-urlencoded"),
                None,
                b"extensions=%7B%22persistedQuery%22%3A1%7D",
            ),
        ] {
            assert_eq!(
                classify(ct, ce, body),
                PostBody::Unreadable,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        assert_eq!(
            classify(JSON, Some(b"identity"), br#"{"query":"{ me }"}"#),
            PostBody::Read
        );
    }

    proptest! {
        #[test]
        fn classify_never_panics(
            body in proptest::collection::vec(any::<u8>(), 0..96),
            kind in 0..4usize,
        ) {
            let ct: Option<&[u8]> = [
                None,
                Some(&b"application/json"[..]),
                Some(b"application/graphql"),
                Some(b"application/x-www-form-urlencoded"),
            ][kind];
            let _ = classify(ct, None, &body);
        }

        /// A mutation spelled with any JSON escapes of its letters is
        /// still a write.
        #[test]
        fn escaped_keywords_are_still_writes(mask in proptest::collection::vec(any::<bool>(), 8)) {
            let word: String = "mutation"
                .chars()
                .zip(mask)
                .map(|(c, esc)| if esc { format!("\\u{:04x}", c as u32) } else { c.to_string() })
                .collect();
            let body = format!(r#"{{"query":"{word} {{ like(id: 1) }}"}}"#);
            prop_assert_eq!(classify(JSON, None, body.as_bytes()), PostBody::Write);
        }
    }
}
