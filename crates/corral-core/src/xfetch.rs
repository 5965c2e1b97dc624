//! Early refresh (XFetch, Vattani et al.): a fresh hit triggers a refresh
//! with a probability that grows as expiry nears and with how long the
//! origin takes, so hot keys are refreshed before they ever expire.

use std::time::{Duration, SystemTime};

/// `now - beta * fetch_duration * ln(r) >= fresh_until`, with `r` uniform in (0, 1].
pub fn should_refresh_early(
    now: SystemTime,
    fresh_until: SystemTime,
    fetch_duration: Duration,
    beta: f64,
    r: f64,
) -> bool {
    if beta <= 0.0 || !(r > 0.0 && r <= 1.0) || fetch_duration.is_zero() {
        return false;
    }
    let gap = -(beta * fetch_duration.as_secs_f64() * r.ln());
    let Ok(gap) = Duration::try_from_secs_f64(gap) else {
        return true;
    };
    now.checked_add(gap).is_none_or(|t| t >= fresh_until)
}

/// Draws `r` and decides.
pub fn roll(now: SystemTime, fresh_until: SystemTime, fetch_duration: Duration, beta: f64) -> bool {
    // random::<f64>() is in [0, 1); 1 - r moves it to (0, 1].
    let r = 1.0 - rand::random::<f64>();
    should_refresh_early(now, fresh_until, fetch_duration, beta, r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn far_from_expiry_never_refreshes_and_near_expiry_often_does() {
        let now = SystemTime::now();
        let d = Duration::from_millis(200);
        let far = now + Duration::from_secs(3600);
        assert!(!should_refresh_early(now, far, d, 1.0, 0.5));
        // r = 0.5: gap = 0.2 * ln 2 ≈ 139 ms.
        assert!(should_refresh_early(
            now,
            now + Duration::from_millis(100),
            d,
            1.0,
            0.5
        ));
        assert!(!should_refresh_early(
            now,
            now + Duration::from_millis(200),
            d,
            1.0,
            0.5
        ));
        // beta 0 turns it off.
        assert!(!should_refresh_early(now, now, d, 0.0, 0.001));
    }

    #[test]
    fn probability_rises_toward_expiry() {
        let now = SystemTime::now();
        let d = Duration::from_millis(100);
        let count = |left_ms| {
            (0..2000)
                .filter(|_| roll(now, now + Duration::from_millis(left_ms), d, 1.0))
                .count()
        };
        let near = count(10);
        let far = count(300);
        assert!(near > far, "near {near} far {far}");
        assert!(near > 1500, "near {near}");
    }
}
