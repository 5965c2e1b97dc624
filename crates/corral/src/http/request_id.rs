//! A request's id: the `X-Request-Id` it came with when that is a short
//! token, else one corral makes. It is forwarded to the origin (in place
//! of a client's field that is not kept), echoed on the answer and written on the
//! access line, so one request can be followed through corral's log and
//! the origin's. It must never carry what a client wrote unchecked into a
//! log line or a header: anything but a bounded run of token characters
//! is replaced.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use corral_core::semantics::head::RequestId;
pub use corral_core::semantics::head::X_REQUEST_ID;
use http::HeaderMap;
use http::header::Entry;

/// The longest id taken from a client.
pub const MAX_LEN: usize = 128;

/// The id the client's field in `headers` carries when it is fit to keep
/// (the field is left as it is: the client sent it, and an origin's
/// `Vary` may name it), else a new one (the client's field is taken out).
/// A new id is not written into `headers`: it travels beside them
/// (`RequestHead::request_id`) into the origin's request only, as
/// `X-Forwarded-For` does, so a hit, which asks no origin, never writes it
/// into the header map.
pub fn take(headers: &mut HeaderMap) -> RequestId {
    // Most requests carry none: their names are compared, not this
    // custom name hashed. One that does is found once, through an entry.
    if !corral_core::semantics::head::carries(headers, &X_REQUEST_ID) {
        return generate();
    }
    match headers.entry(&X_REQUEST_ID) {
        Entry::Occupied(given) => {
            if given.iter().nth(1).is_none() && acceptable(given.get().as_bytes()) {
                return RequestId::Kept(given.get().clone());
            }
            given.remove_entry_mult();
            generate()
        }
        Entry::Vacant(_) => generate(),
    }
}

/// 1 to [`MAX_LEN`] token characters (RFC 9110 §5.6.2), less the few
/// that mean something to a log reader's shell or a CSV (`'`, `` ` ``,
/// `|`).
fn acceptable(id: &[u8]) -> bool {
    !id.is_empty()
        && id.len() <= MAX_LEN
        && id.iter().all(|&b| {
            b.is_ascii_alphanumeric()
                || matches!(
                    b,
                    b'!' | b'#'
                        | b'$'
                        | b'%'
                        | b'&'
                        | b'*'
                        | b'+'
                        | b'-'
                        | b'.'
                        | b'^'
                        | b'_'
                        | b'~'
                )
        })
}

/// A new id: 8 hex digits drawn once per process, then a counter, so ids
/// are unique within a process and very likely across a fleet.
fn generate() -> RequestId {
    static PREFIX: OnceLock<[u8; 8]> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let prefix = PREFIX.get_or_init(|| prefix_hex(rand::random()));
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    // Kept inline: made into a field value only where one is written
    // into a header map (not on a hit, which writes its bytes).
    RequestId::Made(hex_id(prefix, n))
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// `{prefix:08x}`, written once per process.
fn prefix_hex(prefix: u32) -> [u8; 8] {
    let mut out = [0u8; 8];
    for (i, slot) in out.iter_mut().enumerate() {
        *slot = HEX[((prefix >> (28 - 4 * i)) & 0xf) as usize];
    }
    out
}

/// The prefix's digits, then `{n:012x}`, written by hand: `format!` cost
/// every hit more than 1,000 instructions.
fn hex_id(prefix: &[u8; 8], n: u64) -> [u8; 20] {
    let mut id = [0u8; 20];
    id[..8].copy_from_slice(prefix);
    for (i, slot) in id[8..].iter_mut().enumerate() {
        *slot = HEX[((n >> (44 - 4 * i)) & 0xf) as usize];
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn with(values: &[&[u8]]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(
                X_REQUEST_ID.clone(),
                HeaderValue::from_bytes(v).expect("value"),
            );
        }
        h
    }

    #[test]
    fn a_token_is_kept_and_anything_else_replaced() {
        let long = vec![b'a'; MAX_LEN];
        let too_long = vec![b'a'; MAX_LEN + 1];
        let kept: [&[u8]; 3] = [b"abc-123", b"5f0c6e2a.req_7~", &long];
        for id in kept {
            let mut h = with(&[id]);
            assert_eq!(
                take(&mut h),
                RequestId::Kept(HeaderValue::from_bytes(id).expect("value"))
            );
            // Left as the client sent it.
            let sent: Vec<_> = h.get_all(&X_REQUEST_ID).iter().collect();
            assert_eq!(sent, [id]);
        }
        let replaced: [&[&[u8]]; 7] = [
            &[],
            &[b""],
            &[b"a b"],
            &[b"a\"b"],
            &[b"a'b"],
            &[&too_long],
            &[b"one", b"two"],
        ];
        for ids in replaced {
            let mut h = with(ids);
            let id = take(&mut h);
            assert!(matches!(id, RequestId::Made(_)), "{ids:?}");
            assert_eq!(id.as_bytes().len(), 20, "{ids:?}");
            assert!(id.as_bytes().iter().all(u8::is_ascii_hexdigit));
            assert_eq!(id.to_value().as_bytes(), id.as_bytes());
            assert!(h.is_empty(), "{ids:?}");
        }
    }

    #[test]
    fn ids_are_written_as_format_would() {
        for (prefix, n) in [
            (0, 0),
            (0xdead_beef, 1),
            (u32::MAX, 0xfff_ffff_ffff),
            (7, 1 << 40),
        ] {
            assert_eq!(
                hex_id(&prefix_hex(prefix), n).as_slice(),
                format!("{prefix:08x}{n:012x}").as_bytes()
            );
        }
    }

    #[test]
    fn made_ids_differ() {
        let a = take(&mut HeaderMap::new());
        let b = take(&mut HeaderMap::new());
        assert_ne!(a, b);
        assert_eq!(a.as_bytes()[..8], b.as_bytes()[..8]);
    }
}
