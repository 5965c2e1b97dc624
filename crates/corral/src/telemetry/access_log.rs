//! The access line: one JSON line per request, in the shape tracing's JSON
//! format gives every other line (`timestamp`, `level`, the fields,
//! `target: corral::access`), but formatted here straight into the log
//! sink. Going through tracing's formatter cost a quarter of the hit
//! throughput at the default `info` level. It must never log the query or
//! a credential, and it honours `CORRAL_LOG` like any other target.

use std::cell::RefCell;
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::IpAddr;
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use tracing_subscriber::fmt::MakeWriter;

use crate::telemetry::log_sink::LogSink;

/// The sink access lines go to; unset (tracing then formats them) with
/// `--log-format pretty` or without a sink.
static DIRECT: OnceLock<LogSink> = OnceLock::new();

/// From now on, access lines are written as JSON straight into `sink`.
pub fn write_json_to(sink: LogSink) {
    let _ = DIRECT.set(sink);
}

/// What one access line says.
pub struct AccessLine<'a> {
    pub route: &'a str,
    pub method: &'a str,
    /// The host asked for, without port or user information.
    pub host: &'a str,
    /// The path, never the query.
    pub path: &'a str,
    pub status: u16,
    pub cache: &'a str,
    pub cache_status: &'a str,
    pub ms: f64,
    /// The connection's peer.
    pub peer: IpAddr,
    /// The real client address: the peer, or what trusted proxies say.
    pub client: IpAddr,
    /// The rate limit that refused the request, if one did.
    pub limit: Option<&'a str>,
    /// The answer's body length, where it was known when the head went.
    pub bytes: Option<u64>,
    /// The origin asked for this request (host and port), if one was.
    pub upstream: Option<&'a str>,
    /// How long the origin took to answer (its head), in milliseconds.
    pub upstream_ms: Option<f64>,
    /// The request's id (`X-Request-Id`), as the origin got it and the
    /// answer echoed it.
    pub request_id: &'a str,
}

/// Whether access lines are logged (`corral::access` enabled at info):
/// ask before gathering what a line needs.
#[inline]
pub fn enabled() -> bool {
    tracing::enabled!(target: "corral::access", tracing::Level::INFO)
}

/// Logs `line`; the caller checked [`enabled`].
pub fn log(line: &AccessLine<'_>) {
    match DIRECT.get() {
        Some(sink) => {
            thread_local! {
                static BUF: RefCell<String> = RefCell::new(String::with_capacity(512));
            }
            BUF.with(|buf| {
                let mut buf = buf.borrow_mut();
                buf.clear();
                format_json(&mut buf, SystemTime::now(), line);
                let _ = sink.make_writer().write_all(buf.as_bytes());
            });
        }
        None => tracing::info!(
            target: "corral::access",
            route = line.route,
            method = line.method,
            host = line.host,
            path = line.path,
            status = line.status,
            cache = line.cache,
            cache_status = line.cache_status,
            ms = line.ms,
            peer = %line.peer,
            client = %line.client,
            limit = line.limit,
            bytes = line.bytes,
            upstream = line.upstream,
            upstream_ms = line.upstream_ms,
            request_id = line.request_id,
        ),
    }
}

/// The JSON line for `line` at `now`, newline included.
fn format_json(out: &mut String, now: SystemTime, line: &AccessLine<'_>) {
    out.push_str("{\"timestamp\":\"");
    rfc3339(out, now);
    out.push_str("\",\"level\":\"INFO\",\"route\":");
    string(out, line.route);
    out.push_str(",\"method\":");
    string(out, line.method);
    out.push_str(",\"host\":");
    string(out, line.host);
    out.push_str(",\"path\":");
    string(out, line.path);
    let _ = write!(out, ",\"status\":{},\"cache\":", line.status);
    string(out, line.cache);
    out.push_str(",\"cache_status\":");
    string(out, line.cache_status);
    let ms = if line.ms.is_finite() { line.ms } else { 0.0 };
    let _ = write!(
        out,
        ",\"ms\":{ms:.3},\"peer\":\"{}\",\"client\":\"{}\"",
        line.peer, line.client
    );
    if let Some(limit) = line.limit {
        out.push_str(",\"limit\":");
        string(out, limit);
    }
    if let Some(bytes) = line.bytes {
        let _ = write!(out, ",\"bytes\":{bytes}");
    }
    if let Some(upstream) = line.upstream {
        out.push_str(",\"upstream\":");
        string(out, upstream);
    }
    if let Some(ms) = line.upstream_ms.filter(|ms| ms.is_finite()) {
        let _ = write!(out, ",\"upstream_ms\":{ms:.3}");
    }
    out.push_str(",\"request_id\":");
    string(out, line.request_id);
    out.push_str(",\"target\":\"corral::access\"}\n");
}

/// `s` as a JSON string.
fn string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `t` as `YYYY-MM-DDTHH:MM:SS.ffffffZ` (UTC, microseconds), as tracing
/// writes its timestamps.
fn rfc3339(out: &mut String, t: SystemTime) {
    let since = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(i64::try_from(days).unwrap_or(0));
    let _ = write!(
        out,
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        since.subsec_micros()
    );
}

/// The proleptic Gregorian date `days` after 1970-01-01 (Howard Hinnant's
/// `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(secs: u64, micros: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_micros(micros)
    }

    fn stamp(t: SystemTime) -> String {
        let mut s = String::new();
        rfc3339(&mut s, t);
        s
    }

    #[test]
    fn timestamps_match_the_calendar() {
        assert_eq!(stamp(at(0, 0)), "1970-01-01T00:00:00.000000Z");
        // 2000-02-29 (a leap day in a century year divisible by 400).
        assert_eq!(stamp(at(951_782_400, 5)), "2000-02-29T00:00:00.000005Z");
        assert_eq!(
            stamp(at(1_795_951_586, 904_097)),
            "2026-11-29T11:26:26.904097Z"
        );
        // 2100-03-01: 2100 is not a leap year.
        assert_eq!(stamp(at(4_107_542_400, 0)), "2100-03-01T00:00:00.000000Z");
        // Every day of four years, against a day count kept by hand.
        let mut ymd = (1999i64, 12u32, 31u32);
        for day in 10_957..10_957 + 4 * 366 {
            let next = civil_from_days(day);
            let lengths = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
            let leap = ymd.0 % 4 == 0 && (ymd.0 % 100 != 0 || ymd.0 % 400 == 0);
            let len = if ymd.1 == 2 && leap {
                29
            } else {
                lengths[ymd.1 as usize - 1]
            };
            let want = if ymd.2 < len {
                (ymd.0, ymd.1, ymd.2 + 1)
            } else if ymd.1 < 12 {
                (ymd.0, ymd.1 + 1, 1)
            } else {
                (ymd.0 + 1, 1, 1)
            };
            assert_eq!(next, want, "day {day}");
            ymd = next;
        }
    }

    #[test]
    fn a_line_is_one_json_object_with_every_field_escaped() {
        let line = AccessLine {
            route: "r\"1\\",
            method: "GET",
            host: "api.example",
            path: "/a\"b\n\u{1}",
            status: 200,
            cache: "hit",
            cache_status: "corral; hit; ttl=59",
            ms: 0.25,
            peer: "127.0.0.1".parse().expect("ip"),
            client: "2001:db8::1".parse().expect("ip"),
            limit: None,
            bytes: Some(12),
            upstream: Some("10.0.0.1:8080"),
            upstream_ms: Some(3.5),
            request_id: "f00d-1",
        };
        let mut s = String::new();
        format_json(&mut s, at(1_795_951_586, 904_097), &line);
        assert_eq!(
            s,
            "{\"timestamp\":\"2026-11-29T11:26:26.904097Z\",\"level\":\"INFO\",\"route\":\"r\\\"1\\\\\",\
             \"method\":\"GET\",\"host\":\"api.example\",\"path\":\"/a\\\"b\\n\\u0001\",\"status\":200,\"cache\":\"hit\",\
             \"cache_status\":\"corral; hit; ttl=59\",\"ms\":0.250,\"peer\":\"127.0.0.1\",\"client\":\"2001:db8::1\",\
             \"bytes\":12,\"upstream\":\"10.0.0.1:8080\",\"upstream_ms\":3.500,\"request_id\":\"f00d-1\",\
             \"target\":\"corral::access\"}\n"
        );
    }
}
