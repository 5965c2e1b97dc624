//! The compact, versioned binary form of a [`StoredResponse`] in the shared L2
//! (Redis). Decoding trusts nothing it reads: every length is checked against
//! the buffer and every field validated, so a corrupt, truncated or foreign
//! value is an error, never a panic.
//!
//! Layout (integers big-endian): magic `CRL`, version u8, status u16,
//! response_time and fresh_until (unix millis u64), swr and sie (millis u64),
//! fetch_duration (micros u64), flags u8 (bit 0 private, bit 1 shared with
//! Authorization callers, bit 2 shared with every caller: RFC 9111 §3.5),
//! vary kind u8 (0 none, 1 headers, 2 star) + u16 count + (u16 len + name)*,
//! vary values u16 count + (u32 len + UTF-8)*, headers u32 count +
//! (u16 name len + name + u32 value len + value)*, body u32 len + bytes, and
//! nothing after.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

use crate::model::clock::ClockShift;
use crate::model::entry::StoredResponse;
use crate::model::policy::Sharing;
use crate::semantics::vary::Vary;

/// The format version written by [`encode`] and the only one [`decode`] reads.
pub const VERSION: u8 = 1;

const MAGIC: &[u8; 3] = b"CRL";
const FLAG_PRIVATE: u8 = 0b01;
/// Set for `must-revalidate` and for `public`/`s-maxage` (what version 1
/// called "shareable"), so older readers share no more than before.
const FLAG_SHARED_AUTHORIZATION: u8 = 0b010;
const FLAG_SHARED_EVERYONE: u8 = 0b100;
const VARY_NONE: u8 = 0;
const VARY_HEADERS: u8 = 1;
const VARY_STAR: u8 = 2;

/// Why bytes read from L2 are not a stored response.
#[derive(Debug, thiserror::Error)]
pub enum EnvelopeError {
    #[error("not a corral envelope (bad magic)")]
    BadMagic,
    #[error("unknown envelope version {0} (this build reads version {VERSION})")]
    UnknownVersion(u8),
    #[error("envelope truncated in {0}")]
    Truncated(&'static str),
    #[error("invalid {0} in envelope: {1}")]
    Invalid(&'static str, String),
    #[error("{0} unexpected bytes after the envelope body")]
    TrailingBytes(usize),
}

/// Encodes `entry` for L2. `generation` is not stored; times
/// are kept to the millisecond (fetch_duration to the microsecond) and times
/// before the epoch become the epoch.
///
/// An entry the format cannot hold (a body or header value of 4 GiB or more,
/// more than 65,535 Vary names or values) encodes to an empty buffer, which
/// [`decode`] refuses: such an entry belongs in L1 only.
pub fn encode(entry: &StoredResponse) -> Bytes {
    encode_checked(entry).unwrap_or_default()
}

/// [`encode`] with the entry's instants moved onto the clock every
/// instance shares (`shift`), so that a reader on another host moves them
/// onto its own with [`decode_shifted`], whatever this host's clock says.
pub fn encode_shifted(entry: &StoredResponse, shift: ClockShift) -> Bytes {
    if shift == ClockShift::default() {
        return encode(entry);
    }
    let mut moved = entry.clone();
    moved.response_time = shift.to_shared(entry.response_time);
    moved.fresh_until = shift.to_shared(entry.fresh_until);
    encode(&moved)
}

/// [`decode`], the instants moved from the shared clock onto this host's.
pub fn decode_shifted(
    bytes: &[u8],
    generation: u64,
    shift: ClockShift,
) -> Result<StoredResponse, EnvelopeError> {
    let mut entry = decode(bytes, generation)?;
    entry.response_time = shift.to_local(entry.response_time);
    entry.fresh_until = shift.to_local(entry.fresh_until);
    Ok(entry)
}

/// `None` when a length or count does not fit its field.
fn encode_checked(entry: &StoredResponse) -> Option<Bytes> {
    let headers_len: usize = entry
        .headers
        .iter()
        .map(|(n, v)| 6 + n.as_str().len() + v.len())
        .sum();
    let mut out = BytesMut::with_capacity(64 + headers_len + entry.body.len());
    out.put_slice(MAGIC);
    out.put_u8(VERSION);
    out.put_u16(entry.status.as_u16());
    out.put_u64(unix_millis(entry.response_time));
    out.put_u64(unix_millis(entry.fresh_until));
    out.put_u64(saturating_u64(entry.swr.as_millis()));
    out.put_u64(saturating_u64(entry.sie.as_millis()));
    out.put_u64(saturating_u64(entry.fetch_duration.as_micros()));
    let mut flags = 0;
    if entry.private {
        flags |= FLAG_PRIVATE;
    }
    match entry.sharing {
        Sharing::Anonymous => {}
        Sharing::Authorization => flags |= FLAG_SHARED_AUTHORIZATION,
        Sharing::Everyone => flags |= FLAG_SHARED_AUTHORIZATION | FLAG_SHARED_EVERYONE,
    }
    out.put_u8(flags);

    let (kind, names): (u8, &[HeaderName]) = match &entry.vary {
        Vary::None => (VARY_NONE, &[]),
        Vary::Headers(names) => (VARY_HEADERS, names),
        Vary::Star => (VARY_STAR, &[]),
    };
    out.put_u8(kind);
    out.put_u16(u16::try_from(names.len()).ok()?);
    for name in names {
        put_u16_prefixed(&mut out, name.as_str().as_bytes())?;
    }

    out.put_u16(u16::try_from(entry.vary_values.len()).ok()?);
    for value in &entry.vary_values {
        put_u32_prefixed(&mut out, value.as_bytes())?;
    }

    out.put_u32(u32::try_from(entry.headers.len()).ok()?);
    for (name, value) in &entry.headers {
        put_u16_prefixed(&mut out, name.as_str().as_bytes())?;
        put_u32_prefixed(&mut out, value.as_bytes())?;
    }

    put_u32_prefixed(&mut out, &entry.body)?;
    Some(out.freeze())
}

fn put_u16_prefixed(out: &mut BytesMut, bytes: &[u8]) -> Option<()> {
    out.put_u16(u16::try_from(bytes.len()).ok()?);
    out.put_slice(bytes);
    Some(())
}

fn put_u32_prefixed(out: &mut BytesMut, bytes: &[u8]) -> Option<()> {
    out.put_u32(u32::try_from(bytes.len()).ok()?);
    out.put_slice(bytes);
    Some(())
}

fn unix_millis(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| saturating_u64(d.as_millis()))
}

fn saturating_u64(n: u128) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// Decodes an envelope read from L2, stamping it with this process's
/// `generation`.
pub fn decode(bytes: &[u8], generation: u64) -> Result<StoredResponse, EnvelopeError> {
    let mut r = Reader { rest: bytes };
    let magic = r.take(MAGIC.len(), "magic").map_err(|e| {
        // A short buffer that starts like ours was cut off; anything else is foreign.
        if MAGIC.starts_with(bytes) {
            e
        } else {
            EnvelopeError::BadMagic
        }
    })?;
    if magic != MAGIC {
        return Err(EnvelopeError::BadMagic);
    }
    let version = r.u8("version")?;
    if version != VERSION {
        return Err(EnvelopeError::UnknownVersion(version));
    }

    let status_code = r.u16("status")?;
    let status = StatusCode::from_u16(status_code)
        .map_err(|_| EnvelopeError::Invalid("status", status_code.to_string()))?;
    let response_time = r.time("response_time")?;
    let fresh_until = r.time("fresh_until")?;
    let swr = Duration::from_millis(r.u64("swr")?);
    let sie = Duration::from_millis(r.u64("sie")?);
    let fetch_duration = Duration::from_micros(r.u64("fetch_duration")?);
    let flags = r.u8("flags")?;
    if flags & !(FLAG_PRIVATE | FLAG_SHARED_AUTHORIZATION | FLAG_SHARED_EVERYONE) != 0 {
        return Err(EnvelopeError::Invalid("flags", format!("{flags:#010b}")));
    }

    let vary = r.vary()?;
    let value_count = r.u16("vary_values")?;
    if usize::from(value_count) != vary.names().len() {
        return Err(EnvelopeError::Invalid(
            "vary_values",
            format!("{value_count} values for {} Vary names", vary.names().len()),
        ));
    }
    let mut vary_values = Vec::new();
    for _ in 0..value_count {
        let len = r.u32_len("vary_values")?;
        let raw = r.take(len, "vary_values")?;
        let value = std::str::from_utf8(raw)
            .map_err(|e| EnvelopeError::Invalid("vary_values", e.to_string()))?;
        vary_values.push(value.to_owned());
    }

    let mut headers = r.headers()?;
    crate::semantics::rfc9111::sanitize_age(&mut headers);
    let body_len = r.u32_len("body")?;
    let body = r.take(body_len, "body")?;
    let body = Bytes::copy_from_slice(body);
    if !r.rest.is_empty() {
        return Err(EnvelopeError::TrailingBytes(r.rest.len()));
    }

    let sharing = if flags & FLAG_SHARED_EVERYONE != 0 {
        Sharing::Everyone
    } else if flags & FLAG_SHARED_AUTHORIZATION != 0 {
        Sharing::Authorization
    } else {
        Sharing::Anonymous
    };
    let freshness = crate::model::policy::Freshness {
        ttl: Duration::ZERO,
        swr,
        sie,
        sharing,
    };
    let mut entry = StoredResponse::builder(status, headers, body, &freshness, response_time)
        .fetch_duration(fetch_duration)
        .vary(vary, vary_values)
        .generation(generation)
        .private(flags & FLAG_PRIVATE != 0)
        .build();
    entry.fresh_until = fresh_until;
    Ok(entry)
}

/// A cursor over untrusted bytes; every read is bounds-checked.
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize, field: &'static str) -> Result<&'a [u8], EnvelopeError> {
        let (head, tail) = self
            .rest
            .split_at_checked(len)
            .ok_or(EnvelopeError::Truncated(field))?;
        self.rest = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], EnvelopeError> {
        let head = self.take(N, field)?;
        <[u8; N]>::try_from(head).map_err(|_| EnvelopeError::Truncated(field))
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, EnvelopeError> {
        Ok(u8::from_be_bytes(self.array(field)?))
    }

    fn u16(&mut self, field: &'static str) -> Result<u16, EnvelopeError> {
        Ok(u16::from_be_bytes(self.array(field)?))
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, EnvelopeError> {
        Ok(u32::from_be_bytes(self.array(field)?))
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, EnvelopeError> {
        Ok(u64::from_be_bytes(self.array(field)?))
    }

    /// A u32 length, already known to fit in what is left of the buffer.
    fn u32_len(&mut self, field: &'static str) -> Result<usize, EnvelopeError> {
        let len = usize::try_from(self.u32(field)?).map_err(|_| EnvelopeError::Truncated(field))?;
        if len > self.rest.len() {
            return Err(EnvelopeError::Truncated(field));
        }
        Ok(len)
    }

    fn time(&mut self, field: &'static str) -> Result<SystemTime, EnvelopeError> {
        let millis = self.u64(field)?;
        UNIX_EPOCH
            .checked_add(Duration::from_millis(millis))
            .ok_or_else(|| EnvelopeError::Invalid(field, format!("{millis}ms after the epoch")))
    }

    fn vary(&mut self) -> Result<Vary, EnvelopeError> {
        let kind = self.u8("vary")?;
        let count = self.u16("vary")?;
        match kind {
            VARY_NONE | VARY_STAR if count != 0 => Err(EnvelopeError::Invalid(
                "vary",
                format!("kind {kind} with {count} names"),
            )),
            VARY_NONE => Ok(Vary::None),
            VARY_STAR => Ok(Vary::Star),
            VARY_HEADERS => {
                if count == 0 {
                    return Err(EnvelopeError::Invalid("vary", "no header names".to_owned()));
                }
                let mut names: Vec<HeaderName> = Vec::new();
                for _ in 0..count {
                    let len = usize::from(self.u16("vary")?);
                    let raw = self.take(len, "vary")?;
                    let name = header_name(raw, "vary")?;
                    // Vary::Headers holds lowercase names, sorted and unique.
                    if name.as_str().as_bytes() != raw {
                        return Err(EnvelopeError::Invalid(
                            "vary",
                            format!("`{name}` is not lowercase"),
                        ));
                    }
                    if names
                        .last()
                        .is_some_and(|prev| prev.as_str() >= name.as_str())
                    {
                        return Err(EnvelopeError::Invalid(
                            "vary",
                            format!("`{name}` out of order or repeated"),
                        ));
                    }
                    names.push(name);
                }
                Ok(Vary::Headers(names))
            }
            other => Err(EnvelopeError::Invalid(
                "vary",
                format!("unknown kind {other}"),
            )),
        }
    }

    fn headers(&mut self) -> Result<HeaderMap, EnvelopeError> {
        let count = self.u32("headers")?;
        let mut headers = HeaderMap::new();
        // Each header takes at least 6 bytes, so a huge count runs out of
        // buffer long before it costs anything.
        for _ in 0..count {
            let name_len = usize::from(self.u16("headers")?);
            let name = header_name(self.take(name_len, "headers")?, "headers")?;
            let value_len = self.u32_len("headers")?;
            let raw = self.take(value_len, "headers")?;
            let value = HeaderValue::from_bytes(raw).map_err(|_| {
                EnvelopeError::Invalid(
                    "headers",
                    format!("value of `{name}` is not a valid header value"),
                )
            })?;
            headers.try_append(name, value).map_err(|_| {
                EnvelopeError::Invalid("headers", "more headers than a HeaderMap holds".to_owned())
            })?;
        }
        Ok(headers)
    }
}

fn header_name(raw: &[u8], field: &'static str) -> Result<HeaderName, EnvelopeError> {
    HeaderName::from_bytes(raw).map_err(|_| {
        EnvelopeError::Invalid(
            field,
            format!("`{}` is not a header name", String::from_utf8_lossy(raw)),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// A response time on a whole millisecond, so it survives the round trip exactly.
    fn response_time() -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(1_700_000_000_123)
    }

    fn entry(vary: Vary, vary_values: Vec<String>, body: Bytes) -> StoredResponse {
        let mut headers = HeaderMap::new();
        headers.append("cache-control", HeaderValue::from_static("max-age=60"));
        headers.append("age", HeaderValue::from_static("30"));
        headers.append("link", HeaderValue::from_static("</a.css>; rel=preload"));
        headers.append("x-multi", HeaderValue::from_static("first"));
        headers.append("link", HeaderValue::from_static("</b.js>; rel=preload"));
        headers.append("x-multi", HeaderValue::from_static("second"));
        headers.append("x-multi", HeaderValue::from_static("third"));
        headers.append("x-empty", HeaderValue::from_static(""));
        headers.append(
            "x-obs-text",
            HeaderValue::from_bytes(b"caf\xe9").expect("obs-text is a valid header value"),
        );
        let status = StatusCode::from_u16(203).expect("status");
        let freshness = crate::model::policy::Freshness {
            ttl: Duration::from_secs(60),
            swr: Duration::from_secs(5),
            sie: Duration::from_millis(86_400_250),
            sharing: Sharing::Authorization,
        };
        StoredResponse::builder(status, headers, body, &freshness, response_time())
            .fetch_duration(Duration::from_micros(12_345))
            .vary(vary, vary_values)
            .generation(7)
            .private(true)
            .build()
    }

    fn varied() -> StoredResponse {
        entry(
            Vary::Headers(vec![
                HeaderName::from_static("accept-encoding"),
                HeaderName::from_static("accept-language"),
            ]),
            vec!["br,gzip".to_owned(), "\u{0}absent".to_owned()],
            Bytes::from_static(b"hello, world"),
        )
    }

    fn round_trip(e: &StoredResponse) -> StoredResponse {
        decode(&encode(e), 42).unwrap_or_else(|err| panic!("decode failed: {err}"))
    }

    fn assert_same(a: &StoredResponse, b: &StoredResponse) {
        assert_eq!(a.status, b.status);
        assert_eq!(a.headers, b.headers);
        assert_eq!(a.body, b.body);
        assert_eq!(a.response_time, b.response_time);
        assert_eq!(a.fresh_until, b.fresh_until);
        assert_eq!(a.swr, b.swr);
        assert_eq!(a.sie, b.sie);
        assert_eq!(a.fetch_duration, b.fetch_duration);
        assert_eq!(a.vary, b.vary);
        assert_eq!(a.vary_values, b.vary_values);
        assert_eq!(a.private, b.private);
        assert_eq!(a.sharing, b.sharing);
        for later in [0, 1, 5, 3600] {
            let now = a.response_time + Duration::from_secs(later);
            assert_eq!(a.age_secs(now), b.age_secs(now), "age {later}s later");
        }
    }

    #[test]
    fn round_trip_keeps_every_field_and_multi_valued_headers_in_order() {
        let e = varied();
        let d = round_trip(&e);
        assert_same(&e, &d);
        assert_eq!(d.generation, 42, "generation comes from the reader");
        let multi: Vec<_> = d.headers.get_all("x-multi").iter().collect();
        assert_eq!(multi, ["first", "second", "third"]);
        let links: Vec<_> = d.headers.get_all("link").iter().collect();
        assert_eq!(links, ["</a.css>; rel=preload", "</b.js>; rel=preload"]);
        // The origin's Age is counted: 30s plus 5s in cache.
        assert_eq!(d.age_secs(d.response_time + Duration::from_secs(5)), 35);
    }

    #[test]
    fn round_trip_of_each_flag_combination() {
        for private in [false, true] {
            for sharing in [
                Sharing::Anonymous,
                Sharing::Authorization,
                Sharing::Everyone,
            ] {
                let mut e = varied();
                e.private = private;
                e.sharing = sharing;
                assert_same(&e, &round_trip(&e));
            }
        }
    }

    #[test]
    fn round_trip_of_vary_star_and_none() {
        for vary in [Vary::Star, Vary::None] {
            let e = entry(vary, vec![], Bytes::new());
            let d = round_trip(&e);
            assert_same(&e, &d);
            assert!(d.body.is_empty());
        }
    }

    #[test]
    fn one_mebibyte_body_round_trips() {
        let body: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 251) as u8).collect();
        let e = entry(Vary::None, vec![], Bytes::from(body));
        assert_same(&e, &round_trip(&e));
    }

    #[test]
    fn times_before_the_epoch_encode_as_the_epoch() {
        let mut e = varied();
        e.response_time = UNIX_EPOCH - Duration::from_secs(10);
        e.fresh_until = UNIX_EPOCH - Duration::from_secs(1);
        let d = round_trip(&e);
        assert_eq!((d.response_time, d.fresh_until), (UNIX_EPOCH, UNIX_EPOCH));
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = encode(&varied());
        for len in 0..bytes.len() {
            assert!(
                decode(&bytes[..len], 0).is_err(),
                "prefix of {len} bytes decoded"
            );
        }
        assert!(matches!(
            decode(&bytes[..10], 0),
            Err(EnvelopeError::Truncated(_))
        ));
    }

    #[test]
    fn flipped_magic_is_bad_magic() {
        let mut bytes = encode(&varied()).to_vec();
        bytes[0] ^= 0xff;
        assert!(matches!(decode(&bytes, 0), Err(EnvelopeError::BadMagic)));
        assert!(matches!(decode(b"XY", 0), Err(EnvelopeError::BadMagic)));
    }

    #[test]
    fn other_version_is_refused() {
        let mut bytes = encode(&varied()).to_vec();
        bytes[3] = 2;
        assert!(matches!(
            decode(&bytes, 0),
            Err(EnvelopeError::UnknownVersion(2))
        ));
    }

    #[test]
    fn trailing_byte_is_refused() {
        let mut bytes = encode(&varied()).to_vec();
        bytes.push(0);
        assert!(matches!(
            decode(&bytes, 0),
            Err(EnvelopeError::TrailingBytes(1))
        ));
    }

    #[test]
    fn invalid_fields_are_refused() {
        let good = encode(&varied()).to_vec();
        let patched = |at: usize, with: &[u8]| {
            let mut bytes = good.clone();
            bytes[at..at + with.len()].copy_from_slice(with);
            decode(&bytes, 0)
        };
        // status: offset 4
        assert!(matches!(
            patched(4, &99u16.to_be_bytes()),
            Err(EnvelopeError::Invalid("status", _))
        ));
        assert!(matches!(
            patched(4, &1000u16.to_be_bytes()),
            Err(EnvelopeError::Invalid("status", _))
        ));
        // flags: 4 + 2 + 5 * 8
        assert!(matches!(
            patched(46, &[0b1000]),
            Err(EnvelopeError::Invalid("flags", _))
        ));
        // vary kind
        assert!(matches!(
            patched(47, &[3]),
            Err(EnvelopeError::Invalid("vary", _))
        ));
        assert!(matches!(
            patched(47, &[VARY_NONE]),
            Err(EnvelopeError::Invalid("vary", _))
        ));
        // first vary name: `accept-encoding` after kind, count and length.
        assert!(matches!(
            patched(52, b"A"),
            Err(EnvelopeError::Invalid("vary", _))
        ));
        assert!(matches!(
            patched(52, b" "),
            Err(EnvelopeError::Invalid("vary", _))
        ));
    }

    #[test]
    fn unrepresentable_entry_encodes_to_nothing_decode_refuses() {
        let names: Vec<HeaderName> = (0..=u16::MAX as u32)
            .map(|i| HeaderName::try_from(format!("x-{i:05}")).expect("name"))
            .collect();
        let values = vec![String::new(); names.len()];
        let e = entry(Vary::Headers(names), values, Bytes::new());
        let bytes = encode(&e);
        assert!(bytes.is_empty());
        assert!(matches!(
            decode(&bytes, 0),
            Err(EnvelopeError::Truncated("magic"))
        ));
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x00c0_77a1);
        let valid = encode(&varied()).to_vec();
        for round in 0..2000 {
            let len = rng.random_range(0..=200);
            let mut bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            // Half start with a valid header so the fields behind it get exercised.
            if round % 2 == 0 {
                let mut prefixed = b"CRL\x01".to_vec();
                prefixed.append(&mut bytes);
                bytes = prefixed;
            }
            let _ = decode(&bytes, 0);
            // And a valid envelope with a few bytes corrupted.
            let mut mutated = valid.clone();
            for _ in 0..rng.random_range(1..=4) {
                let at = rng.random_range(0..mutated.len());
                mutated[at] = rng.random();
            }
            let _ = decode(&mutated, 0);
        }
    }
}
