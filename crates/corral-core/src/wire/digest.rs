//! RFC 9530 integrity fields: `Content-Digest` (of the content, the body
//! as sent) and `Repr-Digest` (of the selected representation, which for
//! any answer but a 206 is the same bytes). When an origin sends one in an
//! algorithm corral computes (`sha-256`, `sha-512`: the registry's active
//! ones), a body is checked against it before it is stored or handed to a
//! flight's waiters as complete: a body that was cut or corrupted on the
//! way but still looks whole is then an origin error, never a cache entry.
//!
//! Each field is an RFC 8941 Dictionary of Byte Sequences. A field that
//! does not parse as one is ignored, as RFC 9530 §2 allows; so are
//! algorithms corral does not compute (the deprecated `md5`, `sha`,
//! `unixsum`, `crc32c`, ...). A value of the wrong length for its algorithm
//! can never match and counts as a mismatch.

use base64::Engine;
use base64::engine::general_purpose;
use http::HeaderMap;
use http::header::HeaderName;
use sha2::Digest as _;

use crate::semantics::sf;

/// The SHA-256 of `body`: what names a body across instances (a coding
/// kept in Redis says which body it encodes).
pub fn sha256(body: &[u8]) -> [u8; 32] {
    sha2::Sha256::digest(body).into()
}

pub static CONTENT_DIGEST: HeaderName = HeaderName::from_static("content-digest");
pub static REPR_DIGEST: HeaderName = HeaderName::from_static("repr-digest");

/// A hash algorithm of the RFC 9530 registry that corral computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    Sha256,
    Sha512,
}

impl Algorithm {
    fn of(key: &str) -> Option<Self> {
        match key {
            "sha-256" => Some(Algorithm::Sha256),
            "sha-512" => Some(Algorithm::Sha512),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::Sha256 => "sha-256",
            Algorithm::Sha512 => "sha-512",
        }
    }

    fn hash(self, body: &[u8]) -> Vec<u8> {
        match self {
            Algorithm::Sha256 => sha2::Sha256::digest(body).to_vec(),
            Algorithm::Sha512 => sha2::Sha512::digest(body).to_vec(),
        }
    }
}

/// One digest a body must have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    /// `content-digest` or `repr-digest`.
    pub field: &'static str,
    pub algorithm: Algorithm,
    pub value: Vec<u8>,
}

/// A body that does not have a digest its answer claims.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    pub field: &'static str,
    pub algorithm: Algorithm,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the body does not match its {} ({})",
            self.field,
            self.algorithm.as_str()
        )
    }
}

/// The digests an answer's body must have: its `Content-Digest`, and with
/// `whole` (any answer but a 206, whose content is the whole
/// representation) its `Repr-Digest`. Empty when it claims none corral
/// computes.
pub fn expected(headers: &HeaderMap, whole: bool) -> Vec<Expected> {
    let mut out = Vec::new();
    let mut fields = vec![(&CONTENT_DIGEST, "content-digest")];
    if whole {
        fields.push((&REPR_DIGEST, "repr-digest"));
    }
    for (name, field) in fields {
        let Some(joined) = sf::joined(headers.get_all(name).iter()) else {
            continue;
        };
        for (algorithm, value) in parse(&joined).unwrap_or_default() {
            out.push(Expected {
                field,
                algorithm,
                value,
            });
        }
    }
    out
}

/// Checks `body` against every digest in `expected`.
pub fn verify(expected: &[Expected], body: &[u8]) -> Result<(), Mismatch> {
    for e in expected {
        if e.algorithm.hash(body) != e.value {
            return Err(Mismatch {
                field: e.field,
                algorithm: e.algorithm,
            });
        }
    }
    Ok(())
}

/// A field value as an RFC 8941 Dictionary whose members are Byte
/// Sequences (parameters allowed and ignored), keeping the members whose
/// key is an algorithm corral computes, the last of a repeated key.
/// `None`: not such a dictionary.
pub fn parse(raw: &[u8]) -> Option<Vec<(Algorithm, Vec<u8>)>> {
    let members = sf::dictionary(raw)?;
    let mut out = Vec::with_capacity(members.len());
    for (key, value) in members {
        let sf::Member::Item(sf::Item::ByteSequence(value)) = value else {
            return None;
        };
        if let Some(algorithm) = Algorithm::of(&key) {
            out.push((algorithm, value));
        }
    }
    Some(out)
}

/// `body`'s `Content-Digest` value in `algorithm` (for tests and tools).
pub fn field_value(algorithm: Algorithm, body: &[u8]) -> String {
    format!(
        "{}=:{}:",
        algorithm.as_str(),
        general_purpose::STANDARD.encode(algorithm.hash(body))
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use proptest::prelude::*;

    fn headers(fields: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in fields {
            h.append(*n, HeaderValue::from_str(v).expect("value"));
        }
        h
    }

    #[test]
    fn the_rfc_examples_parse_and_verify() {
        // RFC 9530 Appendix D: {"hello": "world"} with a newline-free body.
        let body = b"{\"hello\": \"world\"}";
        let h = headers(&[(
            "content-digest",
            "sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=:",
        )]);
        let want = expected(&h, true);
        assert_eq!(want.len(), 1);
        assert_eq!(verify(&want, body), Ok(()));
        assert_eq!(
            verify(&want, b"{\"hello\": \"world\"").map_err(|m| m.field),
            Err("content-digest")
        );
        let h = headers(&[(
            "repr-digest",
            "sha-512=:WZDPaVn/7XgHaAy8pmojAkGWoRx2UFChF41A2svX+TaPm+AbwAgBWnrIiYllu7BNNyealdVLvRwEmTHWXvJwew==:",
        )]);
        assert_eq!(verify(&expected(&h, true), body), Ok(()));
        // Repr-Digest is not the part's digest on a 206.
        assert!(expected(&h, false).is_empty());
    }

    #[test]
    fn malformed_fields_and_other_algorithms_are_ignored() {
        for v in [
            "sha-256",
            "sha-256=abc",
            "sha-256=:not base64:",
            "sha-256=:AAAA:,",
            "SHA-256=:AAAA:",
            "sha-256=:AAAA:;",
            "sha-256=:AAAA: x",
        ] {
            assert_eq!(parse(v.as_bytes()), None, "{v}");
        }
        assert_eq!(parse(b"md5=:AAAA:, unixsum=:AAAA:"), Some(Vec::new()));
        assert_eq!(parse(b""), Some(Vec::new()));
        // Parameters are allowed and skipped; the last of a key stands.
        assert_eq!(
            parse(b"sha-256=:AAAA:;a=1;b=\"x,y\";c, sha-256=:AAE=:"),
            Some(vec![(Algorithm::Sha256, vec![0, 1])])
        );
        // Several field lines are one dictionary; a wrong length can never
        // match.
        let h = headers(&[
            ("content-digest", "md5=:AAAA:"),
            ("content-digest", "sha-256=:AAAA:"),
        ]);
        assert_eq!(
            verify(&expected(&h, true), b"x"),
            Err(Mismatch {
                field: "content-digest",
                algorithm: Algorithm::Sha256
            })
        );
    }

    proptest! {
        /// A body verifies against its own digests, in either field and
        /// algorithm, and fails against another body's; nothing panics on
        /// any field value.
        #[test]
        fn a_body_matches_its_own_digest_and_no_other(
            body in proptest::collection::vec(any::<u8>(), 0..300),
            other in proptest::collection::vec(any::<u8>(), 0..300),
            sha512 in any::<bool>(),
            repr in any::<bool>(),
            noise in "[ -~]{0,40}",
        ) {
            let algorithm = if sha512 { Algorithm::Sha512 } else { Algorithm::Sha256 };
            let field = if repr { "repr-digest" } else { "content-digest" };
            let h = headers(&[(field, &format!("md5=:AAAA:, {}", field_value(algorithm, &body)))]);
            let want = expected(&h, true);
            prop_assert_eq!(want.len(), 1);
            prop_assert_eq!(verify(&want, &body), Ok(()));
            prop_assert_eq!(verify(&want, &other).is_ok(), other == body);
            let _ = parse(noise.as_bytes());
        }
    }
}
