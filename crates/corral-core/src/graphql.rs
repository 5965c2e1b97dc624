//! Whether a POST body is a GraphQL operation that writes: a `mutation` (or
//! a `subscription`, which is no one-shot read either). A route's
//! `coalesce.post` shares one origin request among identical POSTs of one
//! caller; that is right for a read and wrong for a write, which must reach
//! the origin once per request sent. The test is deliberately coarse: the
//! keyword anywhere as a whole word, in any body, counts, so a document
//! holding a query and a mutation, or a mutation spelled in a JSON string,
//! is never coalesced. A false alarm costs one origin request; it never
//! shares an answer.

/// True when `body` holds `mutation` or `subscription` as a whole word.
pub fn may_write(body: &[u8]) -> bool {
    [&b"mutation"[..], b"subscription"]
        .iter()
        .any(|word| holds_word(body, word))
}

fn holds_word(body: &[u8], word: &[u8]) -> bool {
    let name_byte = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    body.windows(word.len()).enumerate().any(|(i, w)| {
        w == word
            && (i == 0 || !name_byte(body[i - 1]))
            && body.get(i + word.len()).is_none_or(|&b| !name_byte(b))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_are_found_wherever_the_keyword_stands_and_reads_are_not() {
        for w in [
            &br#"{"query":"mutation { like(id: 1) }"}"#[..],
            br#"{"query":"  mutation Like($id: ID!) { like(id: $id) }"}"#,
            br#"{"query":"query A { me } mutation B { x }","operationName":"B"}"#,
            b"mutation{x}",
            br#"{"query":"subscription { ticks }"}"#,
        ] {
            assert!(may_write(w), "{}", String::from_utf8_lossy(w));
        }
        for r in [
            &br#"{"query":"{ me { name } }"}"#[..],
            br#"{"query":"query Mutations { mutations_count }"}"#,
            br#"{"query":"{ mutationCount }"}"#,
            b"",
            b"q=shoes",
        ] {
            assert!(!may_write(r), "{}", String::from_utf8_lossy(r));
        }
    }
}
