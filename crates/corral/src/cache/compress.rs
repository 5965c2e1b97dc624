//! Compression, once, when an answer is stored: on a route with
//! `compression:`, a compressible answer (by its media type, at least
//! `min_size`, not `no-transform`, not already encoded) is kept in each
//! configured coding beside its unencoded self, and every answer made
//! from the entry (a hit, a waiter's, a stale one) picks the
//! representation its caller accepts (`StoredResponse::pick`). A hit
//! copies; it never compresses.
//!
//! Each compressed representation says `Content-Encoding`, has its own
//! `Content-Length`, and an ETag of its own (RFC 9110 §8.8.3: the coding
//! is appended inside the quotes, so a strong validator never names two
//! different bodies); the digests of the unencoded content go. Every
//! representation says `Vary: Accept-Encoding`.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use corral_core::{CacheControl, Coding, StoredResponse};
use http::header::{CONTENT_ENCODING, CONTENT_RANGE, CONTENT_TYPE, ETAG, VARY};
use http::{HeaderMap, HeaderValue, StatusCode};

use crate::config::CompressionConfig;

/// `entry`, with its compressed representations when the route
/// compresses and the answer is compressible; as it was otherwise. `Err`:
/// the origin encoded it in a coding corral cannot decode within `limit`,
/// and it must not be stored (see [`PassReason::Undecodable`]).
///
/// [`PassReason::Undecodable`]: corral_core::PassReason::Undecodable
pub fn encode(
    config: Option<&CompressionConfig>,
    route: &str,
    entry: StoredResponse,
    limit: u64,
) -> Result<StoredResponse, Box<StoredResponse>> {
    encode_with(config, route, entry, limit, Vec::new())
}

/// [`encode`], with the codings in `ready` compressed already (while the
/// body streamed: see `cache::fanout`), so only the others are made now.
pub fn encode_with(
    config: Option<&CompressionConfig>,
    route: &str,
    entry: StoredResponse,
    limit: u64,
    ready: Vec<(Coding, Bytes)>,
) -> Result<StoredResponse, Box<StoredResponse>> {
    let Some(config) = config else {
        return Ok(entry);
    };
    if has_coding(entry.headers()) {
        return match origin_coding(&entry) {
            Some(coding) => decoded(entry, coding, limit),
            None => Err(Box::new(entry)),
        };
    }
    if !compressible(config, &entry) {
        return Ok(entry);
    }
    let started = Instant::now();
    let body = entry.body();
    let mut encoded = Vec::with_capacity(config.encodings.len());
    let identity_headers = identity_headers(entry.headers());
    for &coding in &config.encodings {
        let compressed = match ready.iter().find(|(c, _)| *c == coding) {
            Some((_, done)) => done.clone(),
            None => match compress(coding, body) {
                Some(packed) => Bytes::from(packed),
                None => continue,
            },
        };
        // Not worth a representation of its own.
        if compressed.len() >= body.len() {
            continue;
        }
        crate::telemetry::metrics::compressed(route, coding.as_str(), body.len(), compressed.len());
        let headers = encoded_headers(&identity_headers, coding);
        let representation = entry.representation(headers, compressed);
        encoded.push((coding, Arc::new(representation)));
    }
    crate::telemetry::metrics::compression_time(route, started.elapsed());
    crate::telemetry::metrics::variants_per_key(route, 1 + encoded.len());
    if encoded.is_empty() {
        return Ok(entry);
    }
    let body = entry.body().clone();
    Ok(entry
        .representation(identity_headers, body)
        .with_encoded(encoded))
}

/// Whether a fill's caller asks for a coding the route makes: a GET
/// whose Accept-Encoding accepts one of them. A HEAD, or a caller that
/// accepts none, has the answer stored unencoded ([`deferred`]), its
/// codings made when someone first asks for one (`cache::demand`).
pub fn asked(
    config: Option<&CompressionConfig>,
    request: &corral_core::semantics::head::RequestHead,
) -> bool {
    let Some(config) = config else {
        return false;
    };
    request.method == http::Method::GET
        && corral_core::Accepted::of(&request.headers)
            .is_some_and(|a| a.best(config.encodings.iter().map(|&c| (c, ()))).is_some())
}

/// `entry` stored unencoded on a route that compresses: when it is
/// compressible, with `Vary: Accept-Encoding` and marked as having its
/// codings made on demand; as it was otherwise (and where the origin
/// encoded it: [`encode`] decodes that).
pub fn deferred(config: Option<&CompressionConfig>, entry: StoredResponse) -> StoredResponse {
    match config {
        Some(c) if !has_coding(entry.headers()) && compressible(c, &entry) => {
            let body = entry.body().clone();
            entry
                .representation(identity_headers(entry.headers()), body)
                .with_codings_pending(true)
        }
        _ => entry,
    }
}

/// The coding of `config` a caller (`request`) should have made for a
/// stored `entry` whose codings are made on demand: the one it accepts
/// best, when the entry lacks it.
pub fn demanded(
    config: &CompressionConfig,
    entry: &StoredResponse,
    request: &HeaderMap,
) -> Option<Coding> {
    let best =
        corral_core::Accepted::of(request)?.best(config.encodings.iter().map(|&c| (c, c)))?;
    (!entry.encoded().iter().any(|(c, _)| *c == best)).then_some(best)
}

/// `entry` with `coding` (`packed`, already made) among its
/// representations, still marked pending while a coding of `config` is
/// missing. `None` when `packed` is not worth keeping (no smaller).
pub fn with_coding(
    config: &CompressionConfig,
    entry: &StoredResponse,
    coding: Coding,
    packed: Bytes,
) -> StoredResponse {
    let mut encoded: Vec<(Coding, Arc<StoredResponse>)> = entry.encoded().to_vec();
    if packed.len() < entry.body().len() && !encoded.iter().any(|(c, _)| *c == coding) {
        let headers = encoded_headers(entry.headers(), coding);
        encoded.push((coding, Arc::new(entry.representation(headers, packed))));
    }
    // In the route's order of preference, as `encode` keeps them.
    encoded.sort_by_key(|(c, _)| config.encodings.iter().position(|k| k == c));
    let missing = config
        .encodings
        .iter()
        .any(|c| *c != coding && !encoded.iter().any(|(k, _)| k == c));
    let body = entry.body().clone();
    entry
        .representation(entry.headers().clone(), body)
        .with_encoded(encoded)
        .with_codings_pending(missing)
}

/// The representations of `stale` carried over to its copy `refreshed`
/// by a 304: the same bodies (a 304 says the content did not change),
/// under the refreshed fields; nothing is compressed again.
pub fn carried(stale: &StoredResponse, refreshed: StoredResponse) -> StoredResponse {
    if stale.encoded().is_empty() || has_coding(refreshed.headers()) {
        let pending = stale.codings_pending();
        return refreshed.with_codings_pending(pending);
    }
    let encoded = stale
        .encoded()
        .iter()
        .map(|(c, rep)| {
            let headers = encoded_headers(refreshed.headers(), *c);
            (
                *c,
                Arc::new(refreshed.representation(headers, rep.body().clone())),
            )
        })
        .collect();
    let pending = stale.codings_pending();
    refreshed
        .with_encoded(encoded)
        .with_codings_pending(pending)
}

/// True when `headers` name a Content-Encoding other than identity.
pub fn has_coding(headers: &HeaderMap) -> bool {
    headers
        .get_all(CONTENT_ENCODING)
        .iter()
        .any(|v| !v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"identity"))
}

/// The first content coding of an answer (`response`) that its caller
/// (`request`) does not accept (see [`corral_core::accepts_coding`]):
/// such an answer is decoded for the caller, or refused with a 502, never
/// passed on encoded. Only the codings corral knows are judged (gzip,
/// br, zstd, deflate, and the dictionary codings); another is opaque to
/// it and passes as it came. `None` when every coding judged is accepted.
pub fn unaccepted_coding(request: &HeaderMap, response: &HeaderMap) -> Option<String> {
    const KNOWN: [&str; 7] = ["gzip", "x-gzip", "br", "zstd", "deflate", "dcb", "dcz"];
    response
        .get_all(CONTENT_ENCODING)
        .iter()
        .flat_map(|v| v.to_str().unwrap_or_default().split(','))
        .map(str::trim)
        .filter(|c| KNOWN.iter().any(|k| c.eq_ignore_ascii_case(k)))
        .find(|c| !corral_core::accepts_coding(request, c))
        .map(str::to_owned)
}

/// An answer the origin encoded in a coding its caller does not accept,
/// on a route that does not compress: kept as it came for the callers
/// that accept it, beside its decoded bytes for the others, as
/// [`encode`] keeps it where the route compresses. `Err`: a coding corral
/// does not know, or past `limit` once decoded.
pub fn decode_for_callers(
    entry: StoredResponse,
    limit: u64,
) -> Result<StoredResponse, Box<StoredResponse>> {
    match origin_coding(&entry) {
        Some(coding) => decoded(entry, coding, limit),
        None => Err(Box::new(entry)),
    }
}

/// A passed-on answer's body, decoded for a caller that does not accept
/// its coding, with `headers` made to say so (no `Content-Encoding`, no
/// digests of the encoded bytes, a weak validator). `None`: a coding
/// corral does not know, or past `limit` once decoded.
pub fn decode_passed(headers: &mut HeaderMap, body: &[u8], limit: u64) -> Option<Bytes> {
    let mut codings = headers.get_all(CONTENT_ENCODING).iter();
    let only = codings.next()?;
    if codings.next().is_some() {
        return None;
    }
    let coding = Coding::from_name(only.to_str().ok()?.trim())?;
    let body = decompress(coding, body, limit)?;
    headers.remove(CONTENT_ENCODING);
    headers.remove(corral_core::wire::digest::CONTENT_DIGEST.clone());
    headers.remove(corral_core::wire::digest::REPR_DIGEST.clone());
    headers.remove(http::header::CONTENT_LENGTH);
    if let Some(weak) = headers
        .get(ETAG)
        .and_then(|v| v.to_str().ok())
        .filter(|t| !t.starts_with("W/"))
        .and_then(|t| HeaderValue::from_str(&format!("W/{t}")).ok())
    {
        headers.insert(ETAG, weak);
    }
    Some(Bytes::from(body))
}

/// The one coding corral knows that the origin encoded its answer in
/// (though it was asked for none).
fn origin_coding(entry: &StoredResponse) -> Option<Coding> {
    let mut codings = entry.headers().get_all(CONTENT_ENCODING).iter();
    let only = codings.next()?;
    if codings.next().is_some() {
        return None;
    }
    Coding::from_name(only.to_str().ok()?.trim())
}

/// An answer the origin encoded anyway, kept as it came for the callers
/// that accept its coding, beside its decoded bytes for every other caller
/// (never sent a coding it did not accept). The decoded body is bounded
/// by `limit` (the route's object size): past it, or if it does not
/// decode, `Err` gives the entry back as it was.
fn decoded(
    entry: StoredResponse,
    coding: Coding,
    limit: u64,
) -> Result<StoredResponse, Box<StoredResponse>> {
    let Some(body) = decompress(coding, entry.body(), limit) else {
        return Err(Box::new(entry));
    };
    let mut as_sent = entry.headers().clone();
    add_vary(&mut as_sent);
    let mut plain = as_sent.clone();
    plain.remove(CONTENT_ENCODING);
    plain.remove(corral_core::wire::digest::CONTENT_DIGEST.clone());
    plain.remove(corral_core::wire::digest::REPR_DIGEST.clone());
    // The origin's validator names its encoded bytes; the decoded ones
    // are the same content, not the same bytes: a weak validator.
    if let Some(weak) = plain
        .get(ETAG)
        .and_then(|v| v.to_str().ok())
        .map(|t| {
            if t.starts_with("W/") {
                t.to_owned()
            } else {
                format!("W/{t}")
            }
        })
        .and_then(|t| HeaderValue::from_str(&t).ok())
    {
        plain.insert(ETAG, weak);
    }
    let original = entry.representation(as_sent, entry.body().clone());
    Ok(entry
        .representation(plain, Bytes::from(body))
        .with_encoded(vec![(coding, Arc::new(original))]))
}

/// `body` decoded from `coding`, if it decodes to at most `limit` bytes.
fn decompress(coding: Coding, body: &[u8], limit: u64) -> Option<Vec<u8>> {
    use std::io::Read;
    let mut out = Vec::new();
    let read = match coding {
        Coding::Gzip => flate2::read::MultiGzDecoder::new(body)
            .take(limit + 1)
            .read_to_end(&mut out),
        Coding::Br => brotli::Decompressor::new(body, 4096)
            .take(limit + 1)
            .read_to_end(&mut out),
        Coding::Zstd => zstd::stream::read::Decoder::new(body)
            .and_then(|d| d.take(limit + 1).read_to_end(&mut out)),
    };
    (read.is_ok() && out.len() as u64 <= limit).then_some(out)
}

/// True when the answer is one the route compresses.
fn compressible(config: &CompressionConfig, entry: &StoredResponse) -> bool {
    let len = entry.body().len() as u64;
    compressible_head(config, entry.status(), entry.headers(), Some(len))
}

/// The codings an answer with this status and these fields (and this
/// declared length, if it has one) is compressed in as it streams: the
/// route's, when it compresses and the answer is compressible and not
/// encoded already; none otherwise.
pub fn stream_codings(
    config: Option<&CompressionConfig>,
    status: StatusCode,
    headers: &HeaderMap,
    declared: Option<u64>,
) -> Vec<Coding> {
    match config {
        Some(c) if !has_coding(headers) && compressible_head(c, status, headers, declared) => {
            c.encodings.clone()
        }
        _ => Vec::new(),
    }
}

/// [`compressible`] from the head alone: a body of unknown length may be
/// long enough.
fn compressible_head(
    config: &CompressionConfig,
    status: StatusCode,
    h: &HeaderMap,
    len: Option<u64>,
) -> bool {
    status == StatusCode::OK
        && len.is_none_or(|n| n >= config.min_size)
        && !h.contains_key(CONTENT_RANGE)
        && !CacheControl::parse(h).no_transform
        && h.get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|t| type_listed(&config.types, t))
}

/// Whether a Content-Type (parameters and case aside) is one of `types`:
/// `type/subtype`, `type/*`, or `type/*+suffix`.
fn type_listed(types: &[String], content_type: &str) -> bool {
    let media = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    let Some((kind, sub)) = media.split_once('/') else {
        return false;
    };
    types.iter().any(|t| match t.split_once('/') {
        Some((k, "*")) => k == kind,
        Some((k, s)) => match s.strip_prefix("*+") {
            Some(suffix) => k == kind && sub.ends_with(&format!("+{suffix}")),
            None => k == kind && s == sub,
        },
        None => false,
    })
}

/// `headers` with `Vary: Accept-Encoding`: the unencoded representation's
/// fields beside compressed ones.
pub fn identity_headers(headers: &HeaderMap) -> HeaderMap {
    let mut identity = headers.clone();
    add_vary(&mut identity);
    identity
}

/// `Vary: Accept-Encoding`, unless the answer says it already.
fn add_vary(headers: &mut HeaderMap) {
    let says = headers.get_all(VARY).iter().any(|v| {
        v.to_str().is_ok_and(|v| {
            v.split(',')
                .any(|n| n.trim().eq_ignore_ascii_case("accept-encoding") || n.trim() == "*")
        })
    });
    if !says {
        headers.append(VARY, HeaderValue::from_static("Accept-Encoding"));
    }
}

/// The unencoded representation's fields, for the `coding` one.
pub fn encoded_headers(identity: &HeaderMap, coding: Coding) -> HeaderMap {
    let mut headers = identity.clone();
    headers.insert(CONTENT_ENCODING, HeaderValue::from_static(coding.as_str()));
    // Digests of the unencoded content say nothing of these bytes.
    headers.remove(corral_core::wire::digest::CONTENT_DIGEST.clone());
    headers.remove(corral_core::wire::digest::REPR_DIGEST.clone());
    if let Some(etag) = headers.get(ETAG).and_then(|v| v.to_str().ok())
        && let Some(tagged) = etag_for(etag, coding)
        && let Ok(v) = HeaderValue::from_str(&tagged)
    {
        headers.insert(ETAG, v);
    } else {
        headers.remove(ETAG);
    }
    headers
}

/// `"abc"` as the `coding` representation's ETag: `"abc-gzip"` (weak ones
/// stay weak); `None` for a malformed one.
fn etag_for(etag: &str, coding: Coding) -> Option<String> {
    let (weak, opaque) = match etag.strip_prefix("W/") {
        Some(rest) => ("W/", rest),
        None => ("", etag),
    };
    let inner = opaque.strip_prefix('"')?.strip_suffix('"')?;
    Some(format!("{weak}\"{inner}-{}\"", coding.as_str()))
}

/// `body` in `coding`, at a level that suits a body compressed once and
/// copied many times.
pub fn compress(coding: Coding, body: &[u8]) -> Option<Vec<u8>> {
    match coding {
        Coding::Gzip => {
            let mut e = flate2::write::GzEncoder::new(
                Vec::with_capacity(body.len() / 3),
                flate2::Compression::new(6),
            );
            e.write_all(body).ok()?;
            e.finish().ok()
        }
        Coding::Br => {
            let mut out = Vec::with_capacity(body.len() / 3);
            let params = brotli::enc::BrotliEncoderParams {
                quality: 5,
                lgwin: 22,
                ..Default::default()
            };
            brotli::BrotliCompress(&mut &body[..], &mut out, &params).ok()?;
            Some(out)
        }
        Coding::Zstd => zstd::bulk::compress(body, 3).ok(),
    }
}

/// Input fed since the last flush below which a pause of the origin does
/// not flush: each flush costs a few bytes of framing, so an origin that
/// trickles a byte at a time cannot make the coded copy outgrow the body
/// by more than about a twentieth (see `cache::fanout::worst`).
const FLUSH_AFTER: usize = 128;

/// One coding of a body compressed as it arrives: what each chunk fed
/// produces is handed on at once, and a flush (when the origin pauses)
/// pushes out what the encoder still holds, so a reader of the coded
/// stream is never further behind than a reader of the body.
pub struct StreamEncoder {
    coding: Coding,
    inner: Encoder,
    /// Bytes fed since the last flush.
    unflushed: usize,
    /// Time spent compressing.
    took: std::time::Duration,
}

enum Encoder {
    Gzip(flate2::write::GzEncoder<Vec<u8>>),
    Br(Box<brotli::CompressorWriter<Vec<u8>>>),
    Zstd(zstd::stream::write::Encoder<'static, Vec<u8>>),
}

impl StreamEncoder {
    /// An encoder at the levels [`compress`] uses.
    pub fn new(coding: Coding) -> Option<Self> {
        let inner = match coding {
            Coding::Gzip => Encoder::Gzip(flate2::write::GzEncoder::new(
                Vec::new(),
                flate2::Compression::new(6),
            )),
            Coding::Br => {
                let params = brotli::enc::BrotliEncoderParams {
                    quality: 5,
                    lgwin: 22,
                    ..Default::default()
                };
                Encoder::Br(Box::new(brotli::CompressorWriter::with_params(
                    Vec::new(),
                    4096,
                    &params,
                )))
            }
            Coding::Zstd => Encoder::Zstd(zstd::stream::write::Encoder::new(Vec::new(), 3).ok()?),
        };
        Some(StreamEncoder {
            coding,
            inner,
            unflushed: 0,
            took: std::time::Duration::ZERO,
        })
    }

    pub fn coding(&self) -> Coding {
        self.coding
    }

    fn writer(&mut self) -> &mut dyn Write {
        match &mut self.inner {
            Encoder::Gzip(e) => e,
            Encoder::Br(e) => &mut **e,
            Encoder::Zstd(e) => e,
        }
    }

    /// What the encoder wrote so far and nobody took.
    fn take(&mut self) -> Bytes {
        let out = match &mut self.inner {
            Encoder::Gzip(e) => e.get_mut(),
            Encoder::Br(e) => e.get_mut(),
            Encoder::Zstd(e) => e.get_mut(),
        };
        Bytes::from(std::mem::take(out))
    }

    /// Feeds `data`; what it produced.
    pub fn feed(&mut self, data: &[u8]) -> std::io::Result<Bytes> {
        let started = Instant::now();
        self.writer().write_all(data)?;
        self.unflushed += data.len();
        self.took += started.elapsed();
        Ok(self.take())
    }

    /// The origin paused: pushes out what the encoder holds (unless too
    /// little was fed since the last flush to be worth its framing).
    pub fn flush(&mut self) -> std::io::Result<Bytes> {
        if self.unflushed < FLUSH_AFTER {
            return Ok(Bytes::new());
        }
        let started = Instant::now();
        self.writer().flush()?;
        self.unflushed = 0;
        self.took += started.elapsed();
        Ok(self.take())
    }

    /// The body ended: the coding's last bytes, and the time it took in
    /// all.
    pub fn finish(mut self) -> std::io::Result<(Bytes, std::time::Duration)> {
        let started = Instant::now();
        let rest = self.take();
        let last = match self.inner {
            Encoder::Gzip(e) => e.finish()?,
            Encoder::Br(e) => e.into_inner(),
            Encoder::Zstd(e) => e.finish()?,
        };
        let took = self.took + started.elapsed();
        let mut out = Vec::with_capacity(rest.len() + last.len());
        out.extend_from_slice(&rest);
        out.extend_from_slice(&last);
        Ok((Bytes::from(out), took))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_match_exactly_by_family_or_by_suffix() {
        let types = CompressionConfig::default().types;
        for t in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "text/html",
            "application/problem+json",
            "image/svg+xml",
        ] {
            assert!(type_listed(&types, t), "{t}");
        }
        for t in [
            "image/png",
            "application/octet-stream",
            "json",
            "",
            "application/jsonp",
        ] {
            assert!(!type_listed(&types, t), "{t}");
        }
    }

    #[test]
    fn etags_name_their_coding() {
        assert_eq!(
            etag_for("\"v1\"", Coding::Gzip).as_deref(),
            Some("\"v1-gzip\"")
        );
        assert_eq!(
            etag_for("W/\"v1\"", Coding::Br).as_deref(),
            Some("W/\"v1-br\"")
        );
        assert_eq!(etag_for("v1", Coding::Br), None);
    }

    #[test]
    fn a_coding_made_as_the_body_arrives_decodes_back_to_it() {
        let body: Vec<u8> =
            br#"{"id": 1, "name": "corral", "tags": ["cache", "proxy"]}"#.repeat(200);
        for coding in Coding::ALL {
            let mut e = StreamEncoder::new(coding).expect("encoder");
            let mut out = Vec::new();
            // Uneven chunks, with a pause (a flush) after each.
            let mut fed = 0;
            for (i, chunk) in body.chunks(997).enumerate() {
                let (a, b) = chunk.split_at(chunk.len().min(i % 7));
                for part in [a, b] {
                    out.extend_from_slice(&e.feed(part).expect("feed"));
                    out.extend_from_slice(&e.flush().expect("flush"));
                    fed += part.len();
                }
                // Whatever was fed before a pause can be read before the
                // end, less at most what was too little to flush.
                let readable = decode_prefix(coding, &out);
                assert!(body[..fed].starts_with(&readable), "{coding:?}");
                assert!(
                    readable.len() + FLUSH_AFTER >= fed,
                    "{coding:?}: {} of {fed}",
                    readable.len()
                );
            }
            let (last, _) = e.finish().expect("finish");
            out.extend_from_slice(&last);
            assert!(out.len() < body.len() / 2, "{coding:?}: {}", out.len());
            assert!(decode(coding, &out) == body, "{coding:?}");
        }
    }

    /// A byte at a time, each flushed when it may be: the coded copy stays
    /// within the bound the fill reserves for it.
    #[test]
    fn a_trickle_does_not_outgrow_the_body_by_much() {
        let body: Vec<u8> = (0..20_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for coding in Coding::ALL {
            let mut e = StreamEncoder::new(coding).expect("encoder");
            let mut out = Vec::new();
            for b in &body {
                out.extend_from_slice(&e.feed(std::slice::from_ref(b)).expect("feed"));
                out.extend_from_slice(&e.flush().expect("flush"));
            }
            out.extend_from_slice(&e.finish().expect("finish").0);
            let n = body.len();
            assert!(
                out.len() <= n + n / 8 + 4096,
                "{coding:?}: {} for {n}",
                out.len()
            );
            assert!(decode(coding, &out) == body, "{coding:?}");
        }
    }

    /// What a reader can decode of a coding cut short.
    fn decode_prefix(coding: Coding, packed: &[u8]) -> Vec<u8> {
        use std::io::Read;
        let mut reader: Box<dyn Read + '_> = match coding {
            Coding::Gzip => Box::new(flate2::read::GzDecoder::new(packed)),
            Coding::Br => Box::new(brotli::Decompressor::new(packed, 4096)),
            Coding::Zstd => Box::new(zstd::stream::read::Decoder::new(packed).expect("zstd")),
        };
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = reader.read(&mut buf) {
            out.extend_from_slice(&buf[..n]);
        }
        out
    }

    fn decode(coding: Coding, packed: &[u8]) -> Vec<u8> {
        use std::io::Read;
        let mut back = Vec::new();
        match coding {
            Coding::Gzip => {
                flate2::read::GzDecoder::new(packed)
                    .read_to_end(&mut back)
                    .expect("gunzip");
            }
            Coding::Br => {
                brotli::Decompressor::new(packed, 4096)
                    .read_to_end(&mut back)
                    .expect("unbrotli");
            }
            Coding::Zstd => back = zstd::decode_all(packed).expect("unzstd"),
        }
        back
    }

    #[test]
    fn every_coding_decodes_back_to_the_body() {
        use std::io::Read;
        let body: Vec<u8> =
            br#"{"id": 1, "name": "corral", "tags": ["cache", "proxy"]}"#.repeat(50);
        for coding in Coding::ALL {
            let packed = compress(coding, &body).expect("compressed");
            assert!(
                packed.len() < body.len() / 4,
                "{coding:?}: {}",
                packed.len()
            );
            let mut back = Vec::new();
            match coding {
                Coding::Gzip => {
                    flate2::read::GzDecoder::new(&packed[..])
                        .read_to_end(&mut back)
                        .expect("gunzip");
                }
                Coding::Br => {
                    brotli::Decompressor::new(&packed[..], 4096)
                        .read_to_end(&mut back)
                        .expect("unbrotli");
                }
                Coding::Zstd => back = zstd::decode_all(&packed[..]).expect("unzstd"),
            }
            assert!(back == body, "{coding:?}");
        }
    }
}
