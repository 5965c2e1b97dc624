//! The answers to a refusal of the rate limits (`limits::Refusal`): a 401
//! for a token the configuration refuses, a 429 with Retry-After, the
//! RateLimit fields and a JSON body, or a 503 while a limit's shared
//! counter is out of reach; and the 503 of a connection accepted while
//! corral is overloaded (`overload`).

use axum::body::Body;
use corral_core::{Detail, Forward};
use http::{HeaderValue, Response, StatusCode};

use crate::cache::respond::{self, Answer};
use crate::limits::{RATELIMIT, RATELIMIT_POLICY, Refusal};

/// Carried by a refused answer to its access line: the limit's name.
#[derive(Debug, Clone)]
pub struct LimitedBy(pub String);

/// The 503 of work an overloaded corral turns away (`overload`): a
/// passed-through request, or any request on a connection accepted while
/// shedding (which closes after it: [`overloaded_connection`]).
pub fn overloaded(fwd: Forward) -> Answer {
    let mut a = respond::error(
        StatusCode::SERVICE_UNAVAILABLE,
        fwd,
        Detail::Overloaded,
        None,
    );
    // Its Proxy-Status (`proxy_internal_response`) is every own error's.
    a.response
        .headers_mut()
        .insert(http::header::RETRY_AFTER, HeaderValue::from(1u64));
    a
}

/// [`overloaded`] for a request on a connection accepted while shedding,
/// not routed; with `close`, the connection ends after it (HTTP/1).
pub fn overloaded_connection(close: bool) -> Response<Body> {
    let mut res = overloaded(Forward::Bypass).response;
    if close {
        res.headers_mut()
            .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
    }
    res
}

/// The answer to `refusal`.
pub fn answer(refusal: Refusal) -> Answer {
    match refusal {
        Refusal::InvalidToken => invalid_token(),
        Refusal::RateLimited {
            limit,
            policy,
            retry_after,
        } => rate_limited(limit, &policy, retry_after),
        Refusal::Unavailable { limit } => unavailable(limit),
    }
}

fn invalid_token() -> Answer {
    let mut a = respond::error(
        StatusCode::UNAUTHORIZED,
        Forward::Bypass,
        Detail::InvalidToken,
        None,
    );
    a.response.headers_mut().insert(
        http::header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer error=\"invalid_token\""),
    );
    a
}

/// The 429: Retry-After, the RateLimit fields, and a JSON body.
fn rate_limited(limit: String, policy: &str, retry: u64) -> Answer {
    let mut a = respond::error(
        StatusCode::TOO_MANY_REQUESTS,
        Forward::Bypass,
        Detail::RateLimited,
        None,
    );
    let body = serde_json::json!({
        "error": "rate_limited",
        "limit": limit,
        "retry_after": retry,
    })
    .to_string();
    let h = a.response.headers_mut();
    h.insert(http::header::RETRY_AFTER, HeaderValue::from(retry));
    if let Ok(v) = HeaderValue::from_str(policy) {
        h.insert(RATELIMIT_POLICY, v);
    }
    if let Ok(v) = HeaderValue::from_str(&format!("\"{limit}\";r=0;t={retry}")) {
        h.insert(RATELIMIT, v);
    }
    a.response.extensions_mut().insert(LimitedBy(limit));
    json_body(a, body)
}

/// The 503 of a limit that refuses while its shared counter is out of
/// reach: the caller did nothing wrong, so not a 429.
fn unavailable(limit: String) -> Answer {
    let mut a = respond::error(
        StatusCode::SERVICE_UNAVAILABLE,
        Forward::Bypass,
        Detail::LimiterUnavailable,
        None,
    );
    a.response
        .headers_mut()
        .insert(http::header::RETRY_AFTER, HeaderValue::from(1u64));
    let body = serde_json::json!({
        "error": "limiter_unavailable",
        "limit": limit,
        "retry_after": 1,
    })
    .to_string();
    a.response.extensions_mut().insert(LimitedBy(limit));
    json_body(a, body)
}

fn json_body(mut a: Answer, body: String) -> Answer {
    let h = a.response.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-store"),
    );
    h.remove(http::header::CONTENT_LENGTH);
    *a.response.body_mut() = Body::from(body);
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_overload_refusal_says_when_to_come_back_and_who_made_it() {
        let res = overloaded_connection(true);
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        let h = res.headers();
        assert_eq!(h["retry-after"], "1");
        assert_eq!(
            h["proxy-status"],
            "corral; error=proxy_internal_response; details=\"overloaded\""
        );
        assert_eq!(h["connection"], "close");
        assert!(
            h["cache-status"]
                .to_str()
                .is_ok_and(|v| v.contains("detail=overloaded"))
        );
        assert!(
            !overloaded_connection(false)
                .headers()
                .contains_key("connection")
        );
    }
}
