//! Range requests answered from a stored complete response (RFC 9110
//! §14): one byte range (`first-last`, `first-`, or the suffix `-n`), with
//! `If-Range` honoured. Several ranges, another unit, or a malformed
//! header read as no Range at all (the whole response), as the RFC allows;
//! a well-formed range the representation cannot satisfy is a 416.

use std::time::Duration;

use http::HeaderValue;

use crate::semantics::rfc9111::parse_http_date;

/// What a request's Range selects of a `len`-byte representation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selected {
    /// The whole representation: 200.
    Full,
    /// Bytes `first..=last`: 206 with `Content-Range: bytes first-last/len`.
    Part { first: u64, last: u64 },
    /// 416 with `Content-Range: bytes */len`.
    Unsatisfiable,
}

/// The stored response's validators, as If-Range compares them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Validators<'a> {
    pub etag: Option<&'a HeaderValue>,
    pub last_modified: Option<&'a HeaderValue>,
    pub date: Option<&'a HeaderValue>,
}

/// What `range` (and `if_range`) select of a representation of `len`
/// bytes with `validators`.
pub fn select(
    range: Option<&HeaderValue>,
    if_range: Option<&HeaderValue>,
    len: u64,
    validators: Validators<'_>,
) -> Selected {
    let Some(range) = range.and_then(|r| r.to_str().ok()) else {
        return Selected::Full;
    };
    if let Some(condition) = if_range
        && !if_range_holds(condition, validators)
    {
        return Selected::Full;
    }
    match parse(range) {
        None => Selected::Full,
        Some(spec) => spec.resolve(len),
    }
}

/// One byte-range-spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spec {
    /// `first-last` or `first-` (`last: None`).
    From { first: u64, last: Option<u64> },
    /// `-n`: the last n bytes.
    Suffix(u64),
}

impl Spec {
    fn resolve(self, len: u64) -> Selected {
        match self {
            Spec::From { first, last } if first < len => Selected::Part {
                first,
                last: last.map_or(len - 1, |l| l.min(len - 1)),
            },
            Spec::Suffix(n) if n > 0 && len > 0 => Selected::Part {
                first: len.saturating_sub(n),
                last: len - 1,
            },
            _ => Selected::Unsatisfiable,
        }
    }
}

/// A Range header of exactly one byte range; `None` for anything else
/// (another unit, a list of ranges, bad syntax, `last < first`).
pub fn parse(text: &str) -> Option<Spec> {
    let text = text.trim_matches([' ', '\t']);
    let (unit, set) = text.split_once('=')?;
    if !unit.trim_matches([' ', '\t']).eq_ignore_ascii_case("bytes") {
        return None;
    }
    let mut specs = set
        .split(',')
        .map(|s| s.trim_matches([' ', '\t']))
        .filter(|s| !s.is_empty());
    let spec = specs.next()?;
    if specs.next().is_some() {
        return None;
    }
    let (first, last) = spec.split_once('-')?;
    let number = |s: &str| -> Option<u64> {
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse().unwrap_or(u64::MAX))
    };
    if first.is_empty() {
        return number(last).map(Spec::Suffix);
    }
    let first = number(first)?;
    let last = if last.is_empty() {
        None
    } else {
        Some(number(last)?)
    };
    if last.is_some_and(|l| l < first) {
        return None;
    }
    Some(Spec::From { first, last })
}

/// RFC 9110 §13.1.5: an entity-tag matches by strong comparison with a
/// strong ETag; a date matches only a Last-Modified equal to it that is
/// strong (at least a second before the response's Date).
fn if_range_holds(condition: &HeaderValue, v: Validators<'_>) -> bool {
    let Ok(condition) = condition.to_str() else {
        return false;
    };
    let condition = condition.trim_matches([' ', '\t']);
    if condition.starts_with('"') || condition.starts_with("W/") {
        let Some(etag) = v.etag.and_then(|e| e.to_str().ok()) else {
            return false;
        };
        let etag = etag.trim_matches([' ', '\t']);
        return !condition.starts_with("W/") && !etag.starts_with("W/") && etag == condition;
    }
    let date = |h: Option<&HeaderValue>| h.and_then(|h| h.to_str().ok()).and_then(parse_http_date);
    let (Some(wanted), Some(modified), Some(sent)) = (
        parse_http_date(condition),
        date(v.last_modified),
        date(v.date),
    ) else {
        return false;
    };
    wanted == modified
        && sent
            .duration_since(modified)
            .is_ok_and(|d| d >= Duration::from_secs(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sel(range: &str, len: u64) -> Selected {
        select(
            Some(&HeaderValue::from_str(range).expect("value")),
            None,
            len,
            Validators::default(),
        )
    }

    #[test]
    fn the_three_forms_of_one_range() {
        assert_eq!(sel("bytes=0-9", 100), Selected::Part { first: 0, last: 9 });
        assert_eq!(
            sel("bytes=90-", 100),
            Selected::Part {
                first: 90,
                last: 99
            }
        );
        assert_eq!(
            sel("bytes=-10", 100),
            Selected::Part {
                first: 90,
                last: 99
            }
        );
        assert_eq!(
            sel("bytes=95-200", 100),
            Selected::Part {
                first: 95,
                last: 99
            }
        );
        assert_eq!(
            sel("bytes=-200", 100),
            Selected::Part { first: 0, last: 99 }
        );
        assert_eq!(
            sel("Bytes = 5-5", 100),
            Selected::Part { first: 5, last: 5 }
        );
    }

    #[test]
    fn unsatisfiable_ranges_are_416() {
        assert_eq!(sel("bytes=100-", 100), Selected::Unsatisfiable);
        assert_eq!(sel("bytes=-0", 100), Selected::Unsatisfiable);
        assert_eq!(sel("bytes=0-", 0), Selected::Unsatisfiable);
    }

    #[test]
    fn anything_else_is_the_whole_response() {
        for r in [
            "bytes=0-1,5-6",
            "items=0-1",
            "bytes=5-1",
            "bytes=a-b",
            "bytes=-",
            "bytes=",
            "0-1",
            "bytes=1-2-3",
        ] {
            assert_eq!(sel(r, 100), Selected::Full, "{r}");
        }
    }

    #[test]
    fn if_range_needs_a_strong_match() {
        let etag = HeaderValue::from_static("\"v1\"");
        let weak = HeaderValue::from_static("W/\"v1\"");
        let lm = HeaderValue::from_static("Sun, 06 Nov 1994 08:49:37 GMT");
        let date = HeaderValue::from_static("Sun, 06 Nov 1994 09:00:00 GMT");
        let same_second = HeaderValue::from_static("Sun, 06 Nov 1994 08:49:37 GMT");
        let range = HeaderValue::from_static("bytes=0-0");
        let with = |cond: &'static str, v: Validators<'_>| {
            select(Some(&range), Some(&HeaderValue::from_static(cond)), 10, v)
        };
        let part = Selected::Part { first: 0, last: 0 };
        let strong = Validators {
            etag: Some(&etag),
            last_modified: Some(&lm),
            date: Some(&date),
        };
        assert_eq!(with("\"v1\"", strong), part);
        assert_eq!(with("\"v2\"", strong), Selected::Full);
        assert_eq!(with("W/\"v1\"", strong), Selected::Full);
        assert_eq!(
            with(
                "\"v1\"",
                Validators {
                    etag: Some(&weak),
                    ..strong
                }
            ),
            Selected::Full
        );
        assert_eq!(with("Sun, 06 Nov 1994 08:49:37 GMT", strong), part);
        assert_eq!(
            with("Sun, 06 Nov 1994 08:49:38 GMT", strong),
            Selected::Full
        );
        // A Last-Modified in the same second as Date is weak.
        assert_eq!(
            with(
                "Sun, 06 Nov 1994 08:49:37 GMT",
                Validators {
                    date: Some(&same_second),
                    ..strong
                }
            ),
            Selected::Full
        );
    }
}
