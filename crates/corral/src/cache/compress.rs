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
    let mut identity_headers = entry.headers().clone();
    add_vary(&mut identity_headers);
    for &coding in &config.encodings {
        let Some(compressed) = compress(coding, body) else {
            continue;
        };
        // Not worth a representation of its own.
        if compressed.len() >= body.len() {
            continue;
        }
        crate::telemetry::metrics::compressed(route, coding.as_str(), body.len(), compressed.len());
        let headers = encoded_headers(&identity_headers, coding);
        let representation = entry.representation(headers, Bytes::from(compressed));
        encoded.push((coding, Arc::new(representation)));
    }
    crate::telemetry::metrics::compression_time(route, started.elapsed());
    if encoded.is_empty() {
        return Ok(entry);
    }
    let body = entry.body().clone();
    Ok(entry
        .representation(identity_headers, body)
        .with_encoded(encoded))
}

/// True when `headers` name a Content-Encoding other than identity.
pub fn has_coding(headers: &HeaderMap) -> bool {
    headers
        .get_all(CONTENT_ENCODING)
        .iter()
        .any(|v| !v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"identity"))
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
    plain.remove(corral_core::digest::CONTENT_DIGEST.clone());
    plain.remove(corral_core::digest::REPR_DIGEST.clone());
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
    let h = entry.headers();
    entry.status() == StatusCode::OK
        && (entry.body().len() as u64) >= config.min_size
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
fn encoded_headers(identity: &HeaderMap, coding: Coding) -> HeaderMap {
    let mut headers = identity.clone();
    headers.insert(CONTENT_ENCODING, HeaderValue::from_static(coding.as_str()));
    // Digests of the unencoded content say nothing of these bytes.
    headers.remove(corral_core::digest::CONTENT_DIGEST.clone());
    headers.remove(corral_core::digest::REPR_DIGEST.clone());
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
