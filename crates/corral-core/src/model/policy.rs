//! Whether and for how long a response may be stored, as an RFC 9111 shared
//! cache (through http-cache-semantics) with the route's defaults and caps:
//! default TTL, stale-while-revalidate / stale-if-error windows, TTL jitter.
//! Client Cache-Control request directives are ignored, as nginx and Varnish
//! do by default, so no client can bust the cache for everyone else.

use std::time::{Duration, SystemTime};

use http::header::{CONTENT_LENGTH, EXPIRES, SET_COOKIE};
use http::{request, response};
use http_cache_semantics::{CacheOptions, CachePolicy};
use rand::Rng;

use crate::model::identity::Identity;
use crate::semantics::cache_control::CacheControl;
use crate::semantics::rfc9111;
use crate::semantics::vary::Vary;

/// A route's cache policy, as configured.
#[derive(Debug, Clone)]
pub struct RoutePolicy {
    /// Freshness for storable responses that carry no freshness information.
    pub default_ttl: Option<Duration>,
    /// RFC 9111 §4.2.2 heuristic freshness from Last-Modified.
    pub heuristic_freshness: bool,
    pub swr_default: Duration,
    pub swr_max: Duration,
    pub sie_default: Duration,
    pub sie_max: Duration,
    /// Neither stale window may be longer than this fraction of the
    /// freshness lifetime the response was given (`stale_max_ratio`):
    /// a 5-second object is not served stale for an hour because a
    /// route's `stale_if_error.default` is large. `None`: no such bound.
    pub stale_max_ratio: Option<f64>,
    /// Up to this percent is taken off each TTL, so keys filled together
    /// do not expire together. Only ever shortens.
    pub ttl_jitter_percent: u8,
    /// XFetch early-refresh aggressiveness; 0 disables.
    pub early_refresh_beta: f64,
    /// Store responses that set cookies (with Set-Cookie removed).
    pub store_set_cookie: bool,
    pub max_object_size: u64,
    /// How long an uncacheable key is remembered as "pass".
    pub hit_for_pass: Duration,
    /// RFC 9213 targeted fields, in priority order: the first one a
    /// response carries (validly) replaces its Cache-Control and Expires
    /// for corral's decisions.
    pub targeted: Vec<http::HeaderName>,
    /// Answers to POST may be stored (with explicit freshness, RFC 9110
    /// §9.3.3); off: they are only shared in flight.
    pub store_post: bool,
}

impl Default for RoutePolicy {
    fn default() -> Self {
        RoutePolicy {
            default_ttl: None,
            // On: only an answer with Last-Modified and no explicit
            // freshness gets one, a tenth of its age, at most a day (see
            // the Standards page for why this suits an API cache).
            heuristic_freshness: true,
            swr_default: Duration::ZERO,
            swr_max: Duration::from_secs(3600),
            sie_default: Duration::ZERO,
            sie_max: Duration::from_secs(86400),
            stale_max_ratio: None,
            ttl_jitter_percent: 0,
            early_refresh_beta: 1.0,
            store_set_cookie: false,
            max_object_size: 8 << 20,
            hit_for_pass: Duration::from_secs(10),
            targeted: vec![http::HeaderName::from_static("cdn-cache-control")],
            store_post: false,
        }
    }
}

/// How long a stored response stays usable, and how.
#[derive(Debug, Clone)]
pub struct Freshness {
    /// Remaining freshness from the response time, jitter applied.
    pub ttl: Duration,
    pub swr: Duration,
    pub sie: Duration,
    /// Which identified callers besides the one who asked may be served it.
    pub sharing: Sharing,
}

/// Who may be served a response stored for one request (RFC 9111 §3.5).
/// Anonymous callers may always be served a stored response; identified
/// ones only what the origin marked shareable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Sharing {
    /// Identified callers get their own copy.
    Anonymous,
    /// `must-revalidate`: also callers identified by `Authorization` alone
    /// (RFC 9111 §3.5's exception is for Authorization; an identity cookie
    /// or header is not covered by it).
    Authorization,
    /// `public` or `s-maxage`: every caller.
    Everyone,
}

impl Sharing {
    /// What the response's directives allow.
    pub fn of(cc: &CacheControl) -> Self {
        if cc.public || cc.s_maxage.is_some() {
            Sharing::Everyone
        } else if cc.must_revalidate {
            Sharing::Authorization
        } else {
            Sharing::Anonymous
        }
    }

    /// True when a response shared so, fetched for a caller with
    /// `identity`, must be stored under that caller's own key: it may not
    /// serve callers like them.
    pub fn keeps_private(self, identity: Option<&Identity>) -> bool {
        identity.is_some() && !self.admits(identity)
    }

    /// True when a caller with `identity` may be served a response shared so.
    pub fn admits(self, identity: Option<&Identity>) -> bool {
        match identity {
            None => true,
            Some(id) if id.is_authorization_only() => self >= Sharing::Authorization,
            Some(_) => self == Sharing::Everyone,
        }
    }
}

/// Why a response is not stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassReason {
    NoStore,
    Private,
    SetCookie,
    VaryStar,
    NotStorable,
    NoFreshness,
    TooLarge,
    /// Another instance found this key uncacheable (the shared pass marker).
    HitForPass,
    /// The fills under way already hold all the memory they may.
    FillMemory,
    /// The origin framed the answer with both Content-Length and
    /// Transfer-Encoding (RFC 9112 §6.3): passed on as chunked, never stored.
    ConflictingFraming,
    /// Compressed with a dictionary the caller named (RFC 9842:
    /// `Content-Encoding: dcb` or `dcz`) without `Vary: Available-Dictionary`:
    /// only that caller can decode it, so it is neither stored nor shared.
    DictionaryCompressed,
    /// Encoded by the origin on a route that compresses (which asked it
    /// for none), in a coding corral cannot decode within the object size:
    /// only callers that accept the coding could read it, so it is
    /// neither stored nor shared.
    Undecodable,
    /// The answer names another No-Vary-Search rule than the one its
    /// key was made with: it answers its own caller, the path learns the
    /// rule, and the flight's waiters look again with keys made with it.
    /// Not a hit-for-pass: the next request is keyed with the new rule.
    RuleChanged,
}

impl PassReason {
    /// The `Cache-Status` detail for this reason.
    pub fn as_str(self) -> &'static str {
        match self {
            PassReason::NoStore => "no-store",
            PassReason::Private => "private",
            PassReason::SetCookie => "set-cookie",
            PassReason::VaryStar => "vary-star",
            PassReason::NotStorable => "not-storable",
            PassReason::NoFreshness => "no-freshness",
            PassReason::TooLarge => "too-large",
            PassReason::HitForPass => "hit-for-pass",
            PassReason::FillMemory => "fill-memory",
            PassReason::ConflictingFraming => "conflicting-framing",
            PassReason::DictionaryCompressed => "dictionary-compressed",
            PassReason::Undecodable => "undecodable",
            PassReason::RuleChanged => "no-vary-search-changed",
        }
    }
}

/// The verdict on one response.
#[derive(Debug)]
pub enum Decision {
    Store { freshness: Freshness },
    Pass(PassReason),
}

/// True when `headers` say the body is compressed with a shared
/// dictionary (RFC 9842: the `dcb` or `dcz` content coding, in any place
/// of the list).
pub fn dictionary_compressed(headers: &http::HeaderMap) -> bool {
    headers
        .get_all(http::header::CONTENT_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .any(|c| c.eq_ignore_ascii_case(b"dcb") || c.eq_ignore_ascii_case(b"dcz"))
}

impl RoutePolicy {
    /// Decides on a response to a `method` request for `uri`, received at
    /// `response_time`. Request headers play no part: client Cache-Control
    /// is ignored, and credentials are keyed into the entry by the caller
    /// (the key keeps a credentialed answer private), so they do not make
    /// the response unstorable here.
    pub fn evaluate(
        &self,
        method: &http::Method,
        uri: &http::Uri,
        res: &response::Parts,
        response_time: SystemTime,
    ) -> Decision {
        let targeted = self.retargeted(res);
        let res = targeted.as_ref().unwrap_or(res);
        let cc = CacheControl::parse(&res.headers);
        match self.evaluate_parsed(method, uri, res, &cc, response_time) {
            Ok(freshness) => Decision::Store { freshness },
            Err(reason) => Decision::Pass(reason),
        }
    }

    /// RFC 9213: a targeted field replaces Cache-Control and Expires; the
    /// answer with its fields so replaced, where one is present.
    fn retargeted(&self, res: &response::Parts) -> Option<response::Parts> {
        let value = crate::semantics::cache_control::targeted_value(&res.headers, &self.targeted)?;
        let mut parts = res.clone();
        parts.headers.remove(http::header::CACHE_CONTROL);
        parts.headers.remove(EXPIRES);
        if let Ok(v) = http::HeaderValue::from_str(&value) {
            parts.headers.insert(http::header::CACHE_CONTROL, v);
        }
        Some(parts)
    }

    /// [`RoutePolicy::evaluate`] once the answer's Cache-Control is read.
    fn evaluate_parsed(
        &self,
        method: &http::Method,
        uri: &http::Uri,
        res: &response::Parts,
        cc: &CacheControl,
        response_time: SystemTime,
    ) -> Result<Freshness, PassReason> {
        let res_for_policy = self.storable_fields(method, res, cc)?;
        let explicit = cc.has_explicit_lifetime() || res.headers.contains_key(EXPIRES);
        let policy = crate_policy(
            method,
            uri,
            res.status,
            explicit || cc.public,
            res_for_policy,
            self.heuristic_freshness,
            response_time,
        )
        .ok_or(PassReason::NotStorable)?;
        let ttl = self.lifetime(&policy, cc, explicit, response_time);
        let age = policy.age(response_time);
        let (swr, sie) = self.stale_windows(cc, ttl.saturating_add(age));
        // §5.2.2.4: a `no-cache` response may be stored, and is then
        // revalidated before every reuse; worth it only with a validator
        // to make the revalidation conditional.
        let revalidate_each_time = cc.no_cache && has_validator(&res.headers);
        if ttl.is_zero() && swr.is_zero() && sie.is_zero() && !revalidate_each_time {
            return Err(PassReason::NoFreshness);
        }
        Ok(Freshness {
            ttl: self.jitter(ttl),
            swr,
            sie,
            sharing: Sharing::of(cc),
        })
    }

    /// The answer's fields as the policy crate is to read them, or why it
    /// is never stored: a dictionary-compressed answer, `no-store`
    /// (unless `must-understand` overrides it), `private`, `Vary: *`,
    /// Set-Cookie (unless the route stores it), a POST on a route that
    /// does not store them, or a declared length past `max_object_size`.
    fn storable_fields(
        &self,
        method: &http::Method,
        res: &response::Parts,
        cc: &CacheControl,
    ) -> Result<http::HeaderMap, PassReason> {
        // RFC 9842: an answer compressed with the caller's dictionary is the
        // caller's alone unless it varies on the dictionary. Decided first:
        // whatever else its fields say, it is never stored or shared.
        if dictionary_compressed(&res.headers)
            && !Vary::parse(&res.headers)
                .names()
                .iter()
                .any(|n| n == "available-dictionary")
        {
            return Err(PassReason::DictionaryCompressed);
        }
        // §5.2.2.3: `must-understand` stores only statuses corral
        // understands, and for those overrides `no-store`.
        let understood = rfc9111::understood_status(res.status);
        if cc.must_understand && !understood {
            return Err(PassReason::NotStorable);
        }
        let must_understand_overrides = cc.must_understand && cc.no_store;
        if cc.no_store && !must_understand_overrides {
            return Err(PassReason::NoStore);
        }
        if cc.private {
            return Err(PassReason::Private);
        }
        if Vary::parse(&res.headers) == Vary::Star {
            return Err(PassReason::VaryStar);
        }
        let mut res_for_policy = res.headers.clone();
        if res.headers.contains_key(SET_COOKIE) {
            if !self.store_set_cookie {
                return Err(PassReason::SetCookie);
            }
            res_for_policy.remove(SET_COOKIE);
        }
        // After the rules above: they also decide whether the answer to a
        // coalesced POST may be shared with its waiters (a `private`,
        // `no-store` or Set-Cookie answer is the caller's own), so an
        // unstorable POST must not hide them.
        if *method == http::Method::POST && !self.store_post {
            return Err(PassReason::NotStorable);
        }
        let declared_len = res
            .headers
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared_len.is_some_and(|n| n > self.max_object_size) {
            return Err(PassReason::TooLarge);
        }
        // What the crate reads wrongly is normalised first (directive
        // case, Age lists, the three date formats, unknown statuses): see
        // rfc9111.rs.
        let mut res_for_policy = rfc9111::for_the_crate(&res_for_policy);
        if must_understand_overrides {
            rfc9111::drop_no_store(&mut res_for_policy);
        }
        Ok(res_for_policy)
    }

    /// The freshness lifetime left: the crate's (a heuristic's capped), or
    /// the route's `default_ttl` for an answer that gave none and did not
    /// ask to be revalidated.
    fn lifetime(
        &self,
        policy: &CachePolicy,
        cc: &CacheControl,
        explicit: bool,
        response_time: SystemTime,
    ) -> Duration {
        let mut ttl = policy.time_to_live(response_time).min(MAX_TTL);
        if !explicit {
            // Only a heuristic (Last-Modified) gave this lifetime.
            ttl = ttl.min(rfc9111::HEURISTIC_MAX);
        }
        if let Some(default) = self.default_ttl
            && ttl.is_zero()
            && !explicit
            && !cc.no_cache
            && !cc.proxy_revalidate
        {
            ttl = default.saturating_sub(policy.age(response_time));
        }
        ttl
    }

    /// The stale-while-revalidate and stale-if-error windows of an answer
    /// whose whole freshness lifetime is `lifetime`.
    fn stale_windows(&self, cc: &CacheControl, lifetime: Duration) -> (Duration, Duration) {
        if cc.forbids_stale() {
            return (Duration::ZERO, Duration::ZERO);
        }
        // §5.2.2.10: `s-maxage` carries proxy-revalidate's meaning for a
        // shared cache. The origin's own stale-while-revalidate or
        // stale-if-error still permits stale (it names the window on
        // purpose, as `s-maxage=1, stale-while-revalidate=59` does); the
        // route's defaults never do.
        let defaults_apply = cc.s_maxage.is_none();
        let window = |given: Option<u64>, default: Duration, max: Duration| {
            let default = if defaults_apply {
                default
            } else {
                Duration::ZERO
            };
            given.map_or(default, Duration::from_secs).min(max)
        };
        let swr = window(cc.stale_while_revalidate, self.swr_default, self.swr_max);
        let sie = window(cc.stale_if_error, self.sie_default, self.sie_max);
        // The smaller of the absolute bound (above) and the relative one.
        match self.stale_max_ratio {
            Some(ratio) => {
                let bound = stale_bound(lifetime, ratio);
                (swr.min(bound), sie.min(bound))
            }
            None => (swr, sie),
        }
    }

    fn jitter(&self, ttl: Duration) -> Duration {
        if self.ttl_jitter_percent == 0 || ttl.is_zero() {
            return ttl;
        }
        let fraction =
            rand::rng().random_range(0.0..=f64::from(self.ttl_jitter_percent.min(100)) / 100.0);
        ttl.mul_f64(1.0 - fraction)
    }
}

/// `ratio` of `lifetime`: the longest a response given that freshness
/// lifetime may be served stale. Never panics: a ratio that is not a
/// finite number >= 0 (the configuration refuses one) allows no stale,
/// and a product past `Duration`'s range allows any.
fn stale_bound(lifetime: Duration, ratio: f64) -> Duration {
    if !(ratio.is_finite() && ratio >= 0.0) {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(lifetime.as_secs_f64() * ratio).unwrap_or(Duration::MAX)
}

fn has_validator(headers: &http::HeaderMap) -> bool {
    headers.contains_key(http::header::ETAG) || headers.contains_key(http::header::LAST_MODIFIED)
}

/// No freshness lifetime is taken beyond this, whatever max-age says.
const MAX_TTL: Duration = Duration::from_secs(10 * 365 * 86400);

/// The policy crate's reading of an answer with `fields` (already made
/// storable) to a `method` request for `uri`; `None` where it would not
/// store it. `known_lifetime`: the answer gave a lifetime or is public, so
/// a status the crate does not know may be stored.
fn crate_policy(
    method: &http::Method,
    uri: &http::Uri,
    status: http::StatusCode,
    known_lifetime: bool,
    fields: http::HeaderMap,
    heuristic: bool,
    response_time: SystemTime,
) -> Option<CachePolicy> {
    let mut req_for_policy = http::Request::new(());
    // RFC 10008 §2.8: a QUERY's answer is cached as a GET's is (its
    // content is in the key); the crate knows GET's rules.
    *req_for_policy.method_mut() = if crate::semantics::head::is_query(method) {
        http::Method::GET
    } else {
        method.clone()
    };
    *req_for_policy.uri_mut() = uri.clone();
    let req_for_policy: request::Parts = req_for_policy.into_parts().0;
    let status = rfc9111::status_for_the_crate(status, known_lifetime)?;
    let mut b = http::Response::builder().status(status);
    if let Some(h) = b.headers_mut() {
        *h = fields;
    }
    let res_parts = b.body(()).ok()?;
    let opts = CacheOptions {
        shared: true,
        cache_heuristic: if heuristic { 0.1 } else { 0.0 },
        immutable_min_time_to_live: Duration::ZERO,
        ignore_cargo_cult: false,
    };
    let policy = CachePolicy::new_options(&req_for_policy, &res_parts, response_time, opts);
    policy.is_storable().then_some(policy)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::identity::IdentityRules;
    use http::header::AUTHORIZATION;

    fn res(headers: &[(&str, &str)]) -> response::Parts {
        let mut b = http::Response::builder().status(200);
        for (n, v) in headers {
            b = b.header(*n, *v);
        }
        b.body(()).expect("response").into_parts().0
    }

    fn decide(p: &RoutePolicy, h: &[(&str, &str)]) -> Decision {
        let uri = http::Uri::from_static("http://h/p");
        p.evaluate(&http::Method::GET, &uri, &res(h), SystemTime::now())
    }

    fn decide_status(p: &RoutePolicy, status: u16, h: &[(&str, &str)]) -> Decision {
        let mut parts = res(h);
        parts.status = http::StatusCode::from_u16(status).expect("status");
        let uri = http::Uri::from_static("http://h/p");
        p.evaluate(&http::Method::GET, &uri, &parts, SystemTime::now())
    }

    fn ttl(d: Decision) -> Option<Duration> {
        match d {
            Decision::Store { freshness } => Some(freshness.ttl),
            Decision::Pass(_) => None,
        }
    }

    #[test]
    fn must_understand_stores_understood_statuses_only_and_overrides_no_store() {
        let p = RoutePolicy::default();
        let cc = |v| [("cache-control", v)];
        // An unknown status is not stored, whatever its freshness.
        for status in [299, 499, 599] {
            assert!(
                matches!(
                    decide_status(&p, status, &cc("max-age=3600, must-understand")),
                    Decision::Pass(PassReason::NotStorable)
                ),
                "{status}"
            );
        }
        // An understood one is, and its no-store (for caches that do not
        // understand must-understand) is ignored, in any case and order.
        for v in [
            "max-age=3600, must-understand",
            "no-store, max-age=3600, must-understand",
            "max-age=3600, Must-Understand, No-Store",
        ] {
            assert_eq!(
                ttl(decide_status(&p, 200, &cc(v))).map(|t| t.as_secs()),
                Some(3600),
                "{v}"
            );
        }
        // Without must-understand, no-store still wins.
        assert!(matches!(
            decide_status(&p, 200, &cc("no-store, max-age=3600")),
            Decision::Pass(PassReason::NoStore)
        ));
    }

    #[test]
    fn any_final_status_with_explicit_freshness_is_stored() {
        let p = RoutePolicy::default();
        for status in [299, 400, 403, 499, 500, 502, 503, 599] {
            assert_eq!(
                ttl(decide_status(
                    &p,
                    status,
                    &[("cache-control", "max-age=60")]
                )),
                Some(Duration::from_secs(60)),
                "{status}"
            );
        }
        // Without freshness, an error is not stored, and neither is a
        // status that only a heuristic could make fresh.
        for status in [299, 400, 500, 503] {
            assert!(ttl(decide_status(&p, status, &[])).is_none(), "{status}");
        }
        // Never from a fill: partial content and interim answers.
        assert!(ttl(decide_status(&p, 206, &[("cache-control", "max-age=60")])).is_none());
    }

    #[test]
    fn directive_names_match_in_any_case() {
        let p = RoutePolicy::default();
        assert_eq!(
            ttl(decide(&p, &[("cache-control", "MaX-aGe=60")])),
            Some(Duration::from_secs(60))
        );
        assert!(matches!(
            decide(&p, &[("cache-control", "No-StOrE, max-age=60")]),
            Decision::Pass(PassReason::NoStore)
        ));
        assert_eq!(
            ttl(decide(&p, &[("cache-control", "S-MAXAGE=30, max-age=60")])),
            Some(Duration::from_secs(30))
        );
    }

    #[test]
    fn age_lists_count_their_first_member() {
        let p = RoutePolicy::default();
        assert_eq!(
            ttl(decide(
                &p,
                &[("cache-control", "max-age=7300"), ("age", "7200, 0")]
            )),
            Some(Duration::from_secs(100))
        );
    }

    #[test]
    fn expires_in_every_date_format_and_invalid_ones_are_past() {
        let p = RoutePolicy::default();
        let now = SystemTime::now();
        let later = now + Duration::from_secs(3600);
        let imf = httpdate::fmt_http_date(later);
        let date = httpdate::fmt_http_date(now);
        // The same instant as RFC 850 and asctime.
        let t = crate::semantics::rfc9111::parse_http_date(&imf).expect("imf");
        assert_eq!(Some(t), crate::semantics::rfc9111::parse_http_date(&imf));
        let long_day = |d: &str| match d {
            "Mon" => "Monday",
            "Tue" => "Tuesday",
            "Wed" => "Wednesday",
            "Thu" => "Thursday",
            "Fri" => "Friday",
            "Sat" => "Saturday",
            _ => "Sunday",
        };
        let (day, rest) = imf.split_once(", ").expect("imf");
        let (dd, rest) = rest.split_once(' ').expect("day");
        let (mon, rest) = rest.split_once(' ').expect("month");
        let (yyyy, rest) = rest.split_once(' ').expect("year");
        let hms = rest.trim_end_matches(" GMT");
        let rfc850 = format!("{}, {dd}-{mon}-{} {hms} GMT", long_day(day), &yyyy[2..]);
        let d: u32 = dd.parse().expect("dd");
        let asctime = format!("{day} {mon} {d:>2} {hms} {yyyy}");
        for expires in [&imf, &rfc850, &asctime] {
            let got = ttl(decide(&p, &[("expires", expires), ("date", &date)]));
            assert!(
                got.is_some_and(|t| t > Duration::from_secs(3590)),
                "{expires}: {got:?}"
            );
        }
        // Two spaces where the grammar has one: invalid, so already
        // expired (and with no other freshness, not stored).
        let spaced = imf.replacen(' ', "  ", 1);
        assert!(ttl(decide(&p, &[("expires", &spaced), ("date", &date)])).is_none());
    }

    fn windows(d: Decision) -> Option<(Duration, Duration)> {
        match d {
            Decision::Store { freshness } => Some((freshness.swr, freshness.sie)),
            Decision::Pass(_) => None,
        }
    }

    #[test]
    fn stale_max_ratio_bounds_both_stale_windows_by_the_freshness_lifetime() {
        let secs = Duration::from_secs;
        let p = RoutePolicy {
            swr_default: secs(600),
            sie_default: secs(3600),
            stale_max_ratio: Some(0.5),
            ..Default::default()
        };
        // A 5-second object: at most 2.5 s of either window.
        assert_eq!(
            windows(decide(&p, &[("cache-control", "max-age=5")])),
            Some((Duration::from_millis(2500), Duration::from_millis(2500)))
        );
        // The origin's own directives are bounded the same way.
        assert_eq!(
            windows(decide(
                &p,
                &[(
                    "cache-control",
                    "max-age=100, stale-while-revalidate=30, stale-if-error=86400"
                )]
            )),
            Some((secs(30), secs(50)))
        );
        // The lifetime is the one the response was given, not what was
        // left of it on arrival (Age).
        assert_eq!(
            windows(decide(
                &p,
                &[("cache-control", "max-age=100"), ("age", "90")]
            )),
            Some((secs(50), secs(50)))
        );
        // A long-lived object keeps the absolute bounds.
        assert_eq!(
            windows(decide(&p, &[("cache-control", "max-age=86400")])),
            Some((secs(600), secs(3600)))
        );
        // No freshness, no stale: with nothing else to serve it for, the
        // answer is not stored.
        assert!(matches!(
            decide(
                &p,
                &[("cache-control", "max-age=0, stale-while-revalidate=60")]
            ),
            Decision::Pass(PassReason::NoFreshness)
        ));
        // Without the option, the absolute bounds alone, as before.
        let unbounded = RoutePolicy {
            stale_max_ratio: None,
            ..p.clone()
        };
        assert_eq!(
            windows(decide(&unbounded, &[("cache-control", "max-age=5")])),
            Some((secs(600), secs(3600)))
        );
    }

    #[test]
    fn a_stale_bound_never_panics() {
        let max = Duration::MAX;
        assert_eq!(stale_bound(Duration::from_secs(10), 0.0), Duration::ZERO);
        assert_eq!(
            stale_bound(Duration::from_secs(10), 2.0),
            Duration::from_secs(20)
        );
        assert_eq!(stale_bound(max, 1e300), max);
        assert_eq!(stale_bound(max, 1.0), max);
        for bad in [f64::NAN, f64::INFINITY, -1.0] {
            assert_eq!(stale_bound(Duration::from_secs(10), bad), Duration::ZERO);
        }
    }

    #[test]
    fn no_cache_with_a_validator_is_stored_to_be_revalidated() {
        let p = RoutePolicy {
            swr_default: Duration::from_secs(30),
            sie_default: Duration::from_secs(30),
            ..Default::default()
        };
        let Decision::Store { freshness } = decide(
            &p,
            &[
                ("cache-control", "no-cache, max-age=600"),
                ("etag", "\"v1\""),
            ],
        ) else {
            panic!("expected store");
        };
        // Stale at once, and never served stale: every reuse revalidates.
        assert_eq!(
            (freshness.ttl, freshness.swr, freshness.sie),
            (Duration::ZERO, Duration::ZERO, Duration::ZERO)
        );
        assert!(matches!(
            decide(&p, &[("cache-control", "no-cache")]),
            Decision::Pass(PassReason::NoFreshness)
        ));
    }

    #[test]
    fn heuristic_freshness_is_a_tenth_of_the_last_modified_age_capped() {
        let p = RoutePolicy {
            heuristic_freshness: true,
            ..Default::default()
        };
        let now = SystemTime::now();
        let date = httpdate::fmt_http_date(now);
        let lm = httpdate::fmt_http_date(now - Duration::from_secs(10_000));
        assert_eq!(
            ttl(decide(&p, &[("date", &date), ("last-modified", &lm)])),
            Some(Duration::from_secs(1000))
        );
        let years = httpdate::fmt_http_date(now - Duration::from_secs(3 * 365 * 86400));
        assert_eq!(
            ttl(decide(&p, &[("date", &date), ("last-modified", &years)])),
            Some(crate::semantics::rfc9111::HEURISTIC_MAX)
        );
        // Only for the statuses RFC 9110 names heuristically cacheable.
        assert!(
            ttl(decide_status(
                &p,
                302,
                &[("date", &date), ("last-modified", &lm)]
            ))
            .is_none()
        );
        // On by default; off when the route turns it off.
        assert_eq!(
            ttl(decide(
                &RoutePolicy::default(),
                &[("date", &date), ("last-modified", &lm)]
            )),
            Some(Duration::from_secs(1000))
        );
        let off = RoutePolicy {
            heuristic_freshness: false,
            ..Default::default()
        };
        assert!(ttl(decide(&off, &[("date", &date), ("last-modified", &lm)])).is_none());
    }

    #[test]
    fn max_age_stores_with_that_ttl_and_route_stale_defaults() {
        let p = RoutePolicy {
            swr_default: Duration::from_secs(5),
            ..Default::default()
        };
        let Decision::Store { freshness, .. } = decide(&p, &[("cache-control", "max-age=60")])
        else {
            panic!("expected store");
        };
        assert_eq!(freshness.ttl.as_secs(), 60);
        assert_eq!(freshness.swr.as_secs(), 5);
        assert_eq!(freshness.sharing, Sharing::Anonymous);
    }

    #[test]
    fn private_no_store_set_cookie_and_vary_star_pass() {
        let p = RoutePolicy::default();
        for (h, why) in [
            (
                ("cache-control", "private, max-age=60"),
                PassReason::Private,
            ),
            (("cache-control", "no-store"), PassReason::NoStore),
            (("vary", "*"), PassReason::VaryStar),
            (("set-cookie", "a=b"), PassReason::SetCookie),
        ] {
            let hs = [("cache-control", "max-age=60"), h];
            match decide(&p, &hs) {
                Decision::Pass(r) => assert_eq!(r, why),
                Decision::Store { .. } => panic!("stored {h:?}"),
            }
        }
    }

    #[test]
    fn no_freshness_information_passes_unless_default_ttl() {
        let p = RoutePolicy::default();
        assert!(matches!(
            decide(&p, &[]),
            Decision::Pass(PassReason::NoFreshness)
        ));
        let p = RoutePolicy {
            default_ttl: Some(Duration::from_secs(30)),
            ..Default::default()
        };
        let Decision::Store { freshness, .. } = decide(&p, &[]) else {
            panic!("expected store");
        };
        assert_eq!(freshness.ttl.as_secs(), 30);
        // An explicit max-age=0 is not overridden by the default.
        assert!(matches!(
            decide(&p, &[("cache-control", "max-age=0")]),
            Decision::Pass(PassReason::NoFreshness)
        ));
    }

    #[test]
    fn stale_windows_are_capped_and_forbidden_by_must_revalidate() {
        let p = RoutePolicy {
            swr_max: Duration::from_secs(10),
            ..Default::default()
        };
        let Decision::Store { freshness, .. } = decide(
            &p,
            &[(
                "cache-control",
                "max-age=1, stale-while-revalidate=999, stale-if-error=7",
            )],
        ) else {
            panic!("expected store");
        };
        assert_eq!((freshness.swr.as_secs(), freshness.sie.as_secs()), (10, 7));
        let Decision::Store { freshness, .. } = decide(
            &p,
            &[(
                "cache-control",
                "max-age=1, must-revalidate, stale-if-error=7",
            )],
        ) else {
            panic!("expected store");
        };
        assert!(freshness.sie.is_zero());
        assert_eq!(freshness.sharing, Sharing::Authorization);
    }

    #[test]
    fn a_dictionary_compressed_answer_is_stored_only_varying_on_the_dictionary() {
        let p = RoutePolicy::default();
        for ce in ["dcb", "DCZ", "gzip, dcb", "dcz ,br"] {
            for extra in [None, Some("no-store"), Some("public")] {
                let cc = match extra {
                    Some(e) => format!("max-age=60, {e}"),
                    None => "max-age=60".to_owned(),
                };
                let d = decide(&p, &[("cache-control", &cc), ("content-encoding", ce)]);
                assert!(
                    matches!(d, Decision::Pass(PassReason::DictionaryCompressed)),
                    "{ce} {cc}: {d:?}"
                );
                let d = decide(
                    &p,
                    &[
                        ("cache-control", &cc),
                        ("content-encoding", ce),
                        ("vary", "Accept-Encoding"),
                    ],
                );
                assert!(
                    matches!(d, Decision::Pass(PassReason::DictionaryCompressed)),
                    "{ce}"
                );
            }
            let d = decide(
                &p,
                &[
                    ("cache-control", "max-age=60"),
                    ("content-encoding", ce),
                    ("vary", "accept-encoding, Available-Dictionary"),
                ],
            );
            assert!(matches!(d, Decision::Store { .. }), "{ce}: {d:?}");
        }
        for ce in ["gzip", "br, zstd", "dcbx", ""] {
            let d = decide(
                &p,
                &[("cache-control", "max-age=60"), ("content-encoding", ce)],
            );
            assert!(matches!(d, Decision::Store { .. }), "{ce}: {d:?}");
        }
    }

    #[test]
    fn s_maxage_takes_the_routes_stale_defaults_away_but_not_the_origins_own() {
        // cache-tests' stale-close-s-maxage: with a route default for
        // stale-if-error, an s-maxage answer was served stale when the
        // origin went away.
        let p = RoutePolicy {
            swr_default: Duration::from_secs(30),
            sie_default: Duration::from_secs(60),
            ..Default::default()
        };
        let stale = |cc: &str| match decide(&p, &[("cache-control", cc)]) {
            Decision::Store { freshness, .. } => (freshness.swr.as_secs(), freshness.sie.as_secs()),
            other => panic!("{cc}: {other:?}"),
        };
        assert_eq!(stale("max-age=2"), (30, 60));
        assert_eq!(stale("s-maxage=2"), (0, 0));
        assert_eq!(stale("max-age=60, s-maxage=2"), (0, 0));
        assert_eq!(stale("s-maxage=1, stale-while-revalidate=59"), (59, 0));
        assert_eq!(stale("s-maxage=1, stale-if-error=5"), (0, 5));
    }

    #[test]
    fn authenticated_responses_are_storable_but_only_public_ones_shareable() {
        let p = RoutePolicy::default();
        let Decision::Store { freshness, .. } = decide(&p, &[("cache-control", "max-age=60")])
        else {
            panic!("expected store");
        };
        assert_eq!(freshness.sharing, Sharing::Anonymous);
        let Decision::Store { freshness, .. } =
            decide(&p, &[("cache-control", "public, max-age=60")])
        else {
            panic!("expected store");
        };
        assert_eq!(freshness.sharing, Sharing::Everyone);
    }

    #[test]
    fn must_revalidate_shares_with_authorization_callers_only() {
        let bearer = {
            let mut h = http::HeaderMap::new();
            h.insert(AUTHORIZATION, http::HeaderValue::from_static("Bearer a"));
            IdentityRules::new(vec![AUTHORIZATION], vec![]).identify(&h)
        };
        let cookie = {
            let mut h = http::HeaderMap::new();
            h.insert(
                http::header::COOKIE,
                http::HeaderValue::from_static("sid=1"),
            );
            IdentityRules::new(vec![AUTHORIZATION], vec!["sid".into()]).identify(&h)
        };
        assert!(bearer.is_some() && cookie.is_some());
        let mr = Sharing::Authorization;
        assert!(mr.admits(None) && mr.admits(bearer.as_ref()) && !mr.admits(cookie.as_ref()));
        let public = Sharing::Everyone;
        assert!(public.admits(bearer.as_ref()) && public.admits(cookie.as_ref()));
        let none = Sharing::Anonymous;
        assert!(none.admits(None) && !none.admits(bearer.as_ref()));
    }

    #[test]
    fn absurd_age_and_max_age_neither_panic_nor_overflow() {
        let p = RoutePolicy::default();
        let d = decide(
            &p,
            &[
                ("cache-control", "max-age=18446744073709551615"),
                ("age", "18446744073709551615"),
            ],
        );
        let Decision::Store { freshness, .. } = d else {
            panic!("expected store");
        };
        assert_eq!(freshness.ttl, MAX_TTL);
        let Decision::Store { freshness, .. } =
            decide(&p, &[("cache-control", "max-age=18446744073709551615")])
        else {
            panic!("expected store");
        };
        assert_eq!(freshness.ttl, MAX_TTL);
        let mut h = http::HeaderMap::new();
        h.insert(http::header::AGE, http::HeaderValue::from_static("abc"));
        crate::semantics::rfc9111::sanitize_age(&mut h);
        assert!(h.get(http::header::AGE).is_none());
    }

    #[test]
    fn jitter_only_shortens() {
        let p = RoutePolicy {
            ttl_jitter_percent: 20,
            ..Default::default()
        };
        for _ in 0..200 {
            let t = p.jitter(Duration::from_secs(100));
            assert!(
                t <= Duration::from_secs(100) && t >= Duration::from_secs(80),
                "{t:?}"
            );
        }
    }

    #[test]
    fn declared_oversize_passes() {
        let p = RoutePolicy {
            max_object_size: 10,
            ..Default::default()
        };
        assert!(matches!(
            decide(
                &p,
                &[("cache-control", "max-age=60"), ("content-length", "11")]
            ),
            Decision::Pass(PassReason::TooLarge)
        ));
    }
}
