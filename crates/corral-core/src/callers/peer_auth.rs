//! Authentication of what corral instances read from each other through
//! Redis: an HMAC-SHA256 tag, keyed with a secret every instance of a fleet
//! shares, over each record (L2 entry, Vary record, back-off, path rule,
//! heartbeat, cluster notice). Whoever can write to Redis without the key can
//! delete or garble records, never plant one: a record whose tag does not
//! verify is refused before a byte of it is parsed.
//!
//! The tag covers the record's kind and the name it is stored under (its
//! Redis key, or the instance that wrote a heartbeat), so a valid record
//! copied to another key or read as another kind does not verify either.
//! It does not stop a replay of the same record under the same name; a
//! record carries its own time where that matters (an entry its freshness, a
//! ban its instant).
//!
//! Layout of a sealed record: the 32-byte tag, then the record; text records
//! carry the tag as 64 lowercase hex digits, so they stay valid UTF-8.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// Bytes of the tag in front of a sealed binary record.
pub const TAG_LEN: usize = 32;

/// Characters of the tag in front of a sealed text record.
pub const TEXT_TAG_LEN: usize = 2 * TAG_LEN;

/// The shortest key accepted: as many bytes as the tag, so the key is never
/// the weaker part.
pub const MIN_KEY_LEN: usize = 32;

/// What a record is, so one kind's tag never verifies another kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record {
    /// An L2 entry (a response envelope), bound to its entry key.
    Entry,
    /// A URI's Vary record, bound to its key.
    Vary,
    /// A key's shared back-off, bound to its key.
    Backoff,
    /// A path's No-Vary-Search rule, bound to its key.
    PathRule,
    /// An instance's fleet summary, bound to the instance's name.
    Heartbeat,
    /// An invalidation, purge or ban, wherever it is read (channel, log,
    /// bans hash), bound to the key prefix.
    Notice,
    /// One part of a fill's body relayed to waiting instances (its head, a
    /// chunk, its end), bound to the fill's stream key (entry and lease
    /// token) and carrying its sequence number.
    StreamPart,
    /// A stored answer's body in one coding, bound to its key (the entry's
    /// and the coding's) and carrying the digest of the body it encodes.
    Coding,
}

impl Record {
    pub const ALL: [Record; 8] = [
        Record::Entry,
        Record::Vary,
        Record::Backoff,
        Record::PathRule,
        Record::Heartbeat,
        Record::Notice,
        Record::StreamPart,
        Record::Coding,
    ];

    /// The name mixed into the tag.
    pub fn as_str(self) -> &'static str {
        match self {
            Record::Entry => "entry",
            Record::Vary => "vary",
            Record::Backoff => "backoff",
            Record::PathRule => "path-rule",
            Record::Heartbeat => "heartbeat",
            Record::Notice => "notice",
            Record::StreamPart => "stream-part",
            Record::Coding => "coding",
        }
    }
}

/// Why a record read from Redis is not used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PeerAuthError {
    /// Shorter than a tag, or (text) no hex tag in front.
    #[error("no authentication tag")]
    Missing,
    /// A tag that this fleet's key did not make for this record.
    #[error("authentication tag does not verify")]
    Mismatch,
}

/// The fleet's shared secret, ready to tag and check records.
#[derive(Clone)]
pub struct PeerKey {
    /// The keyed state before any input: cloned per record, so the key's
    /// own hashing is done once.
    keyed: Hmac<Sha256>,
}

impl std::fmt::Debug for PeerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PeerKey(..)")
    }
}

/// Why a secret is not a key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the key is {0} bytes; at least {MIN_KEY_LEN} are needed (e.g. `openssl rand -hex 32`)")]
pub struct ShortKey(pub usize);

impl PeerKey {
    /// A key from the secret's bytes (at least [`MIN_KEY_LEN`]).
    pub fn new(secret: &[u8]) -> Result<Self, ShortKey> {
        if secret.len() < MIN_KEY_LEN {
            return Err(ShortKey(secret.len()));
        }
        let keyed = Hmac::<Sha256>::new_from_slice(secret).map_err(|_| ShortKey(secret.len()))?;
        Ok(PeerKey { keyed })
    }

    /// The MAC state over kind and name, each length-prefixed so that no
    /// (kind, name, record) triple reads as another.
    fn over(&self, kind: Record, name: &str) -> Hmac<Sha256> {
        let mut mac = self.keyed.clone();
        let kind = kind.as_str().as_bytes();
        mac.update(&(kind.len() as u32).to_be_bytes());
        mac.update(kind);
        mac.update(&(name.len() as u64).to_be_bytes());
        mac.update(name.as_bytes());
        mac
    }

    fn tag(&self, kind: Record, name: &str, record: &[u8]) -> [u8; TAG_LEN] {
        let mut mac = self.over(kind, name);
        mac.update(record);
        mac.finalize().into_bytes().into()
    }

    fn verify(&self, kind: Record, name: &str, record: &[u8], tag: &[u8]) -> bool {
        let mut mac = self.over(kind, name);
        mac.update(record);
        // Constant time: how much of a forged tag matched is not told.
        mac.verify_slice(tag).is_ok()
    }
}

/// How a fleet authenticates its records: with a key, or (an operator's
/// explicit choice, `redis.auth: none`) not at all, trusting whoever can
/// write to Redis.
#[derive(Debug, Clone)]
pub enum PeerAuth {
    Key(PeerKey),
    Off,
}

impl PeerAuth {
    /// `record`, tagged for `kind` under `name`.
    pub fn seal(&self, kind: Record, name: &str, record: &[u8]) -> Vec<u8> {
        match self {
            PeerAuth::Off => record.to_vec(),
            PeerAuth::Key(key) => {
                let mut out = Vec::with_capacity(TAG_LEN + record.len());
                out.extend_from_slice(&key.tag(kind, name, record));
                out.extend_from_slice(record);
                out
            }
        }
    }

    /// The record inside `sealed`, once its tag verifies.
    pub fn open<'a>(
        &self,
        kind: Record,
        name: &str,
        sealed: &'a [u8],
    ) -> Result<&'a [u8], PeerAuthError> {
        match self {
            PeerAuth::Off => Ok(sealed),
            PeerAuth::Key(key) => {
                let (tag, record) = sealed
                    .split_at_checked(TAG_LEN)
                    .ok_or(PeerAuthError::Missing)?;
                if key.verify(kind, name, record, tag) {
                    Ok(record)
                } else {
                    Err(PeerAuthError::Mismatch)
                }
            }
        }
    }

    /// A text record, tagged (hex in front).
    pub fn seal_text(&self, kind: Record, name: &str, record: &str) -> String {
        match self {
            PeerAuth::Off => record.to_owned(),
            PeerAuth::Key(key) => {
                let tag = key.tag(kind, name, record.as_bytes());
                let mut out = String::with_capacity(TEXT_TAG_LEN + record.len());
                for b in tag {
                    out.push(char::from(HEX[usize::from(b >> 4)]));
                    out.push(char::from(HEX[usize::from(b & 0xf)]));
                }
                out.push_str(record);
                out
            }
        }
    }

    /// The text record inside `sealed`, once its tag verifies.
    pub fn open_text<'a>(
        &self,
        kind: Record,
        name: &str,
        sealed: &'a str,
    ) -> Result<&'a str, PeerAuthError> {
        match self {
            PeerAuth::Off => Ok(sealed),
            PeerAuth::Key(key) => {
                let (hex, record) = sealed
                    .split_at_checked(TEXT_TAG_LEN)
                    .ok_or(PeerAuthError::Missing)?;
                let tag = unhex(hex).ok_or(PeerAuthError::Missing)?;
                if key.verify(kind, name, record.as_bytes(), &tag) {
                    Ok(record)
                } else {
                    Err(PeerAuthError::Mismatch)
                }
            }
        }
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn unhex(hex: &str) -> Option<[u8; TAG_LEN]> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; TAG_LEN];
    for (o, pair) in out.iter_mut().zip(hex.as_bytes().chunks_exact(2)) {
        *o = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth(secret: &[u8]) -> PeerAuth {
        PeerAuth::Key(PeerKey::new(secret).expect("a long enough key"))
    }

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

    #[test]
    fn a_sealed_record_opens_to_itself() {
        let a = auth(KEY);
        let sealed = a.seal(Record::Entry, "corral:{ab}:e:cd", b"CRL\x01body");
        assert_eq!(sealed.len(), TAG_LEN + 8);
        assert_eq!(
            a.open(Record::Entry, "corral:{ab}:e:cd", &sealed),
            Ok(&b"CRL\x01body"[..])
        );
        let text = a.seal_text(Record::Heartbeat, "host-1", "{\"instance\":\"host-1\"}");
        assert_eq!(text.len(), TEXT_TAG_LEN + 21);
        assert_eq!(
            a.open_text(Record::Heartbeat, "host-1", &text),
            Ok("{\"instance\":\"host-1\"}")
        );
    }

    #[test]
    fn every_tampered_byte_is_refused() {
        let a = auth(KEY);
        let sealed = a.seal(Record::Entry, "k", b"a record of some length");
        for at in 0..sealed.len() {
            for flip in [0x01, 0x80, 0xff] {
                let mut bad = sealed.clone();
                bad[at] ^= flip;
                assert_eq!(
                    a.open(Record::Entry, "k", &bad),
                    Err(PeerAuthError::Mismatch),
                    "byte {at} ^ {flip:#x} accepted"
                );
            }
        }
        let text = a.seal_text(Record::Notice, "corral:", "ban\t0\t1\tp\th/");
        for at in 0..text.len() {
            let mut bad = text.clone().into_bytes();
            // Another character of the same class: hex stays hex.
            bad[at] = if bad[at] == b'0' { b'1' } else { b'0' };
            let bad = String::from_utf8(bad).expect("ASCII");
            assert!(
                a.open_text(Record::Notice, "corral:", &bad).is_err(),
                "character {at} changed and accepted"
            );
        }
    }

    #[test]
    fn a_cut_or_extended_record_is_refused() {
        let a = auth(KEY);
        let sealed = a.seal(Record::Entry, "k", b"record");
        for len in 0..sealed.len() {
            assert!(a.open(Record::Entry, "k", &sealed[..len]).is_err(), "{len}");
        }
        let mut longer = sealed.clone();
        longer.push(0);
        assert_eq!(
            a.open(Record::Entry, "k", &longer),
            Err(PeerAuthError::Mismatch)
        );
        assert_eq!(
            a.open(Record::Entry, "k", &sealed[..TAG_LEN - 1]),
            Err(PeerAuthError::Missing)
        );
        assert_eq!(
            a.open_text(Record::Entry, "k", "short"),
            Err(PeerAuthError::Missing)
        );
        // 64 characters that are not hex: no tag.
        let not_hex = format!("{}{}", "z".repeat(TEXT_TAG_LEN), "record");
        assert_eq!(
            a.open_text(Record::Entry, "k", &not_hex),
            Err(PeerAuthError::Missing)
        );
    }

    #[test]
    fn an_unsealed_record_is_refused() {
        let a = auth(KEY);
        let plain = b"CRL\x01 a plain envelope of more than thirty-two bytes";
        assert_eq!(
            a.open(Record::Entry, "k", plain),
            Err(PeerAuthError::Mismatch)
        );
    }

    #[test]
    fn another_key_kind_or_name_does_not_verify() {
        let a = auth(KEY);
        let sealed = a.seal(Record::Entry, "k1", b"record");
        let other = auth(b"another key, also thirty-two bytes long");
        assert!(other.open(Record::Entry, "k1", &sealed).is_err());
        assert!(a.open(Record::Vary, "k1", &sealed).is_err());
        assert!(a.open(Record::Entry, "k2", &sealed).is_err());
        // Name and record do not run into each other.
        let split = a.seal(Record::Entry, "ab", b"c");
        assert!(a.open(Record::Entry, "a", &split).is_err());
    }

    #[test]
    fn off_passes_records_through() {
        let off = PeerAuth::Off;
        assert_eq!(off.seal(Record::Entry, "k", b"x"), b"x");
        assert_eq!(off.open(Record::Entry, "k", b"x"), Ok(&b"x"[..]));
        assert_eq!(off.open_text(Record::Notice, "k", "*"), Ok("*"));
    }

    #[test]
    fn a_short_key_is_refused() {
        assert_eq!(PeerKey::new(&[7; 31]).err(), Some(ShortKey(31)));
        assert!(PeerKey::new(&[7; 32]).is_ok());
    }
}
