//! The rules of RFC 9111 (and RFC 9110's HTTP-date) that corral owns
//! instead of http-cache-semantics, in one place. The crate decides
//! storability and computes the freshness lifetime and age, and is right
//! about most of it; where it is wrong, what goes into it is normalised
//! here first, so the crate only ever sees input it reads correctly:
//!
//! | rule | the crate | here |
//! | --- | --- | --- |
//! | directive names are case-insensitive (§5.2) | matches them case-sensitively | names lowercased |
//! | `Age` is a list; use the first member (§5.1) | ignores a list | first member of the first line |
//! | HTTP-date has three formats (RFC 9110 §5.6.7) | reads only RFC 2822, leniently | all three, strictly but in any case (§4.2); an invalid `Expires` is "already expired" (§5.3), an invalid `Date` or `Last-Modified` is dropped |
//! | any final status may be stored when the response says so (§3) | only the statuses it knows | an unknown final status with explicit freshness (or `public`) is evaluated as a 200 |
//! | heuristic freshness (§4.2.2) | uncapped | capped at [`HEURISTIC_MAX`] |
//! | `no-cache` responses may be stored and revalidated (§5.2.2.4) | not stored | stored when they carry a validator (see `policy.rs`) |
//! | `no-cache="field"` lets the rest be reused without revalidation (§5.2.2.4) | read as `no-cache` | not shown to the crate; the fields are left out of the stored copy (`entry.rs`) |
//! | `must-understand` (§5.2.2.3) | unknown | not stored with a status corral does not understand; `no-store` ignored with one it does |

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::header::{AGE, CACHE_CONTROL, DATE, EXPIRES, LAST_MODIFIED};
use http::{HeaderMap, HeaderValue, StatusCode};

/// The longest freshness lifetime a heuristic (10% of the time since
/// Last-Modified) may give: a day, so that a file unchanged for years is
/// not kept for months on a guess.
pub const HEURISTIC_MAX: Duration = Duration::from_secs(86400);

/// The statuses http-cache-semantics stores at all.
const UNDERSTOOD: [u16; 14] = [
    200, 203, 204, 300, 301, 302, 303, 307, 308, 404, 405, 410, 414, 501,
];

/// The response headers as the crate should read them.
pub fn for_the_crate(headers: &HeaderMap) -> HeaderMap {
    let mut h = headers.clone();
    rewrite_cache_control(&mut h, |t| {
        crate::semantics::cache_control::without_qualified_no_cache(&lowercase_names(t))
    });
    sanitize_age(&mut h);
    if let Some(v) = h.get(EXPIRES) {
        let when = first_date(v).unwrap_or(UNIX_EPOCH);
        h.insert(EXPIRES, date_value(when));
    }
    for name in [DATE, LAST_MODIFIED] {
        match h.get(&name).map(first_date) {
            Some(Some(when)) => {
                h.insert(name, date_value(when));
            }
            Some(None) => {
                h.remove(name);
            }
            None => {}
        }
    }
    h
}

/// The status to present to the crate: `status` itself when the crate
/// understands it; 200 for any other final status whose response says it
/// may be stored (explicit freshness, or `public`), so that the crate's
/// freshness arithmetic applies; `None` when it may not be stored (206,
/// 304 and interim answers are never stored from a fill).
pub fn status_for_the_crate(status: StatusCode, explicit_or_public: bool) -> Option<StatusCode> {
    let code = status.as_u16();
    if UNDERSTOOD.contains(&code) {
        return Some(status);
    }
    if code < 200 || code == 206 || code == 304 {
        return None;
    }
    explicit_or_public.then_some(StatusCode::OK)
}

/// RFC 9111 §5.2.2.3: whether corral understands `status` for
/// `must-understand`: the final statuses RFC 9110 defines, whose caching
/// requirements corral follows. A response with `must-understand` and any
/// other status is not stored; with one of these, its `no-store` is
/// ignored.
pub fn understood_status(status: StatusCode) -> bool {
    matches!(
        status.as_u16(),
        200..=206 | 300..=305 | 307 | 308 | 400..=417 | 421 | 422 | 426 | 500..=505
    )
}

/// Takes the `no-store` directive out of every Cache-Control line: what
/// the crate must see for a `must-understand` response whose status corral
/// understands (§5.2.2.3), since the crate knows nothing of
/// `must-understand`.
pub fn drop_no_store(headers: &mut HeaderMap) {
    rewrite_cache_control(headers, |text| {
        text.split(',')
            .filter(|d| !d.trim().eq_ignore_ascii_case("no-store"))
            .collect::<Vec<_>>()
            .join(",")
    });
}

/// Replaces each readable Cache-Control line with `rewrite` of its text,
/// in place and in order; a line rewritten to nothing is dropped, an
/// unreadable one (or one whose rewrite is not a field value) kept as is.
fn rewrite_cache_control(headers: &mut HeaderMap, rewrite: impl Fn(&str) -> String) {
    if !headers.contains_key(CACHE_CONTROL) {
        return;
    }
    let lines: Vec<HeaderValue> = headers
        .get_all(CACHE_CONTROL)
        .iter()
        .filter_map(|v| {
            let Ok(text) = v.to_str() else {
                return Some(v.clone());
            };
            let new = rewrite(text);
            let new = new.trim();
            (!new.is_empty()).then(|| HeaderValue::from_str(new).unwrap_or_else(|_| v.clone()))
        })
        .collect();
    headers.remove(CACHE_CONTROL);
    for line in lines {
        headers.append(CACHE_CONTROL, line);
    }
}

/// Cache-Control text with every directive name lowercased (arguments,
/// quoted or not, kept as they are).
pub fn lowercase_names(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut in_quotes = false;
    let mut in_name = true;
    for c in text.chars() {
        match c {
            '"' => {
                in_quotes = !in_quotes;
                out.push(c);
            }
            ',' if !in_quotes => {
                in_name = true;
                out.push(c);
            }
            '=' if !in_quotes => {
                in_name = false;
                out.push(c);
            }
            _ if in_name => out.push(c.to_ascii_lowercase()),
            _ => out.push(c),
        }
    }
    out
}

/// RFC 9111 §5.1: `Age` is a list whose first member counts; a value that
/// is not delta-seconds is ignored (removed), one that overflows is read as
/// 2^31 seconds. Leaves exactly one field line, or none.
pub fn sanitize_age(headers: &mut HeaderMap) {
    let Some(v) = headers.get(AGE) else {
        return;
    };
    match first_age(v) {
        None => {
            headers.remove(AGE);
        }
        Some(secs) => {
            headers.insert(AGE, HeaderValue::from(secs));
        }
    }
}

/// The first member of an Age field line, if it is delta-seconds.
pub fn first_age(v: &HeaderValue) -> Option<u64> {
    let text = v.to_str().ok()?;
    let first = text.split(',').next()?.trim_matches([' ', '\t']);
    if first.is_empty() || !first.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(first.parse::<u64>().unwrap_or(u64::MAX).min(1 << 31))
}

fn first_date(v: &HeaderValue) -> Option<SystemTime> {
    parse_http_date(v.to_str().ok()?)
}

fn date_value(t: SystemTime) -> HeaderValue {
    HeaderValue::from_str(&httpdate::fmt_http_date(t)).unwrap_or(HeaderValue::from_static("0"))
}

const DAYS: [&str; 7] = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"];
const LONG_DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const MONTHS: [&str; 12] = [
    "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
];

/// An HTTP-date (RFC 9110 §5.6.7) in any of its three formats, read as the
/// grammar writes it: exact spacing, a real calendar date, GMT; names of
/// days and months and `GMT` in any case (RFC 9111 §4.2: "a cache
/// recipient SHOULD match the field value case-insensitively"). `None` for
/// anything else (including leading or trailing whitespace, which the
/// field parser has already removed).
///
/// - IMF-fixdate: `Sun, 06 Nov 1994 08:49:37 GMT`
/// - rfc850-date: `Sunday, 06-Nov-94 08:49:37 GMT` (a two-digit year more
///   than 50 years ahead is read in the past century)
/// - asctime-date: `Sun Nov  6 08:49:37 1994`
pub fn parse_http_date(s: &str) -> Option<SystemTime> {
    if !s.is_ascii() {
        return None;
    }
    let b = s.as_bytes();
    if b.len() == 29 && b.get(3) == Some(&b',') {
        // IMF-fixdate
        if !named(&DAYS, &s[0..3]) || &s[3..5] != ", " || b[7] != b' ' || b[11] != b' ' {
            return None;
        }
        let day = digits(&s[5..7])?;
        let month = month(&s[8..11])?;
        let year = digits(&s[12..16])?;
        if b[16] != b' ' || !s[25..].eq_ignore_ascii_case(" GMT") {
            return None;
        }
        let (h, m, sec) = time_of_day(&s[17..25])?;
        return civil(year, month, day, h, m, sec);
    }
    if b.len() == 24 && b.get(3) == Some(&b' ') {
        // asctime-date: day-name SP month SP ( 2DIGIT / ( SP DIGIT ) ) SP time SP year
        if !named(&DAYS, &s[0..3]) || b[7] != b' ' || b[10] != b' ' || b[19] != b' ' {
            return None;
        }
        let month = month(&s[4..7])?;
        let day = if b[8] == b' ' {
            digits(&s[9..10])?
        } else {
            digits(&s[8..10])?
        };
        let (h, m, sec) = time_of_day(&s[11..19])?;
        let year = digits(&s[20..24])?;
        return civil(year, month, day, h, m, sec);
    }
    // rfc850-date: day-name-l "," SP 2DIGIT "-" month "-" 2DIGIT SP time SP "GMT"
    let (name, rest) = s.split_once(", ")?;
    if !named(&LONG_DAYS, name) || rest.len() != 22 {
        return None;
    }
    let r = rest.as_bytes();
    if r[2] != b'-' || r[6] != b'-' || r[9] != b' ' || !rest[18..].eq_ignore_ascii_case(" GMT") {
        return None;
    }
    let day = digits(&rest[0..2])?;
    let month = month(&rest[3..6])?;
    let yy = digits(&rest[7..9])?;
    let (h, m, sec) = time_of_day(&rest[10..18])?;
    let now_year = civil_year(SystemTime::now());
    // The most recent year with these two digits that is not more than
    // 50 years ahead.
    let mut year = now_year - now_year % 100 + yy;
    if year > now_year + 50 {
        year -= 100;
    }
    civil(year, month, day, h, m, sec)
}

fn digits(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

fn month(s: &str) -> Option<u64> {
    MONTHS
        .iter()
        .position(|m| m.eq_ignore_ascii_case(s))
        .map(|i| i as u64 + 1)
}

/// Whether `s` is one of `names`, in any case.
fn named(names: &[&str], s: &str) -> bool {
    names.iter().any(|n| n.eq_ignore_ascii_case(s))
}

fn time_of_day(s: &str) -> Option<(u64, u64, u64)> {
    let b = s.as_bytes();
    if b.len() != 8 || b[2] != b':' || b[5] != b':' {
        return None;
    }
    let (h, m, sec) = (digits(&s[0..2])?, digits(&s[3..5])?, digits(&s[6..8])?);
    // A leap second (60) is allowed by the grammar.
    (h < 24 && m < 60 && sec <= 60).then_some((h, m, sec))
}

fn days_in_month(year: u64, month: u64) -> u64 {
    match month {
        2 if year.is_multiple_of(4) && (!year.is_multiple_of(100) || year.is_multiple_of(400)) => {
            29
        }
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Seconds since the epoch of a UTC civil time; `None` before 1970 or for
/// a day the month does not have.
fn civil(year: u64, month: u64, day: u64, h: u64, m: u64, s: u64) -> Option<SystemTime> {
    if year < 1970 || day == 0 || day > days_in_month(year, month) {
        return None;
    }
    // Days from 1970-01-01 (Howard Hinnant's days_from_civil).
    let (y, mo) = if month <= 2 {
        (year - 1, month + 9)
    } else {
        (year, month - 3)
    };
    let era = y / 400;
    let yoe = y - era * 400;
    let doy = (153 * mo + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = (era * 146_097 + doe).checked_sub(719_468)?;
    UNIX_EPOCH.checked_add(Duration::from_secs(days * 86400 + h * 3600 + m * 60 + s))
}

fn civil_year(t: SystemTime) -> u64 {
    let days = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs() / 86400;
    // civil_from_days, year only.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    yoe + era * 400 + u64::from(month <= 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> Option<SystemTime> {
        Some(UNIX_EPOCH + Duration::from_secs(secs))
    }

    #[test]
    fn the_three_formats_of_one_instant() {
        let t = at(784_111_777); // Sun, 06 Nov 1994 08:49:37 GMT
        assert_eq!(parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT"), t);
        assert_eq!(parse_http_date("Sunday, 06-Nov-94 08:49:37 GMT"), t);
        assert_eq!(parse_http_date("Sun Nov  6 08:49:37 1994"), t);
        assert_eq!(parse_http_date("Thu, 01 Jan 1970 00:00:00 GMT"), at(0));
        // §4.2: names and GMT in any case.
        assert_eq!(parse_http_date("sun, 06 nov 1994 08:49:37 gmt"), t);
        assert_eq!(parse_http_date("SUNDAY, 06-NOV-94 08:49:37 GmT"), t);
        assert_eq!(parse_http_date("SUN NOV  6 08:49:37 1994"), t);
        assert_eq!(
            parse_http_date("Tue, 29 Feb 2000 23:59:60 GMT"),
            at(951_868_800)
        );
    }

    #[test]
    fn anything_else_is_invalid() {
        for bad in [
            "",
            "0",
            "-1",
            "Sun, 06 Nov 1994 08:49:37 GMT ",
            " Sun, 06 Nov 1994 08:49:37 GMT",
            "Sun,  06 Nov 1994 08:49:37 GMT",
            "Sun, 06  Nov 1994 08:49:37 GMT",
            "Sun, 06 Nov 1994  08:49:37 GMT",
            "Sun, 6 Nov 1994 08:49:37 GMT",
            "Sun, 06 Nov 1994 08:49:37 UTC",
            "Sun, 06 Nov 1994 08:49:37 utc",
            "Sunx, 06 Nov 1994 08:49:37 GMT",
            "Sun, 06 Novx 1994 08:49:37 GMT",
            "Sun, 06 Nov 1994 24:00:00 GMT",
            "Sun, 31 Nov 1994 08:49:37 GMT",
            "Sun, 29 Feb 1900 08:49:37 GMT",
            "Sun, 06 Nov 1969 08:49:37 GMT",
            "Sunday, 06-Nov-1994 08:49:37 GMT",
            "Sun Nov 6 08:49:37 1994",
            "Sun Nov  6 08:49:37 1994 ",
            "Sun, 06 Nov 1994 08:49:37 +0000",
        ] {
            assert_eq!(parse_http_date(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_two_digit_year_is_never_more_than_50_years_ahead() {
        let year = civil_year(SystemTime::now());
        let ahead = (year + 49) % 100;
        let parsed =
            parse_http_date(&format!("Monday, 01-Jan-{ahead:02} 00:00:00 GMT")).map(civil_year);
        assert_eq!(parsed, Some(year + 49));
        let behind = (year + 51) % 100;
        let parsed =
            parse_http_date(&format!("Monday, 01-Jan-{behind:02} 00:00:00 GMT")).map(civil_year);
        assert_eq!(parsed, Some(year + 51 - 100));
    }

    #[test]
    fn age_is_its_first_member() {
        let age = |v: &str| first_age(&HeaderValue::from_str(v).expect("test value"));
        assert_eq!(age("7200, 0"), Some(7200));
        assert_eq!(age("7200,0"), Some(7200));
        assert_eq!(age(" 60 "), Some(60));
        assert_eq!(age("99999999999999999999"), Some(1 << 31));
        for junk in ["", "-1", "1.5", "abc", ", 5", "1 2"] {
            assert_eq!(age(junk), None, "{junk:?}");
        }
    }

    #[test]
    fn directive_names_are_lowercased_and_arguments_kept() {
        assert_eq!(
            lowercase_names(r#"MaX-aGe=60, No-CaChE="Set-Cookie, X-Foo", PUBLIC"#),
            r#"max-age=60, no-cache="Set-Cookie, X-Foo", public"#
        );
    }

    #[test]
    fn the_crate_sees_normalised_dates() {
        let mut h = HeaderMap::new();
        h.insert(
            EXPIRES,
            HeaderValue::from_static("Sun Nov  6 08:49:37 1994"),
        );
        h.insert(DATE, HeaderValue::from_static("garbage"));
        h.insert(
            LAST_MODIFIED,
            HeaderValue::from_static("Sunday, 06-Nov-94 08:49:37 GMT"),
        );
        let n = for_the_crate(&h);
        assert_eq!(n[EXPIRES], "Sun, 06 Nov 1994 08:49:37 GMT");
        assert_eq!(n[LAST_MODIFIED], "Sun, 06 Nov 1994 08:49:37 GMT");
        assert!(n.get(DATE).is_none());
        let mut h = HeaderMap::new();
        h.insert(
            EXPIRES,
            HeaderValue::from_static("Sun, 06 Nov 2094  08:49:37 GMT"),
        );
        assert_eq!(for_the_crate(&h)[EXPIRES], "Thu, 01 Jan 1970 00:00:00 GMT");
    }
}
