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

/// `-ln(r)` for the smallest `r` that `roll` draws (`1 - random::<f64>()`,
/// whose largest value is `1 - 2^-53`): `53 ln 2`, the largest factor of
/// `beta * fetch_duration` a draw can give.
const LARGEST_FACTOR: f64 = 53.0 * std::f64::consts::LN_2;

/// Draws `r` and decides.
pub fn roll(now: SystemTime, fresh_until: SystemTime, fetch_duration: Duration, beta: f64) -> bool {
    // Far from expiry no draw can refresh: the smallest `r` drawn is
    // 2^-53, so the gap is at most `beta * fetch_duration * 53 ln 2`. Most
    // hits are there, and skip the random number and the logarithm.
    if far_from_expiry(now, fresh_until, fetch_duration, beta) {
        return false;
    }
    // random::<f64>() is in [0, 1); 1 - r moves it to (0, 1].
    let r = 1.0 - rand::random::<f64>();
    should_refresh_early(now, fresh_until, fetch_duration, beta, r)
}

/// No draw can refresh: more is left than the largest gap a draw gives
/// (the gap only shrinks as `r` grows, so none refreshes where the smallest
/// `r` does not). The bound is looser than `should_refresh_early`'s own
/// arithmetic by a part in a million, so that rounding can only leave a
/// hit to the draw, never refuse one a draw would refresh.
fn far_from_expiry(
    now: SystemTime,
    fresh_until: SystemTime,
    fetch_duration: Duration,
    beta: f64,
) -> bool {
    fresh_until.duration_since(now).is_ok_and(|left| {
        left.as_secs_f64() > beta * fetch_duration.as_secs_f64() * LARGEST_FACTOR * (1.0 + 1e-6)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The smallest `r` that `roll` draws.
    const SMALLEST_R: f64 = f64::EPSILON / 2.0;

    proptest! {
        /// What the fast check calls far, the exact test with the smallest
        /// draw refuses too, at the boundary (`scale` near 1) and away.
        #[test]
        fn far_is_only_what_no_draw_can_refresh(
            fetch_us in 1u64..60_000_000,
            beta in 0.001f64..20.0,
            scale in prop_oneof![0.999_99f64..1.000_01, 0.0f64..4.0],
        ) {
            let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_790_000_000);
            let d = Duration::from_micros(fetch_us);
            let gap = beta * d.as_secs_f64() * LARGEST_FACTOR;
            let until = now + Duration::from_secs_f64(gap * scale);
            if far_from_expiry(now, until, d, beta) {
                prop_assert!(!should_refresh_early(now, until, d, beta, SMALLEST_R));
            }
            // And it is not so loose that it never skips: twice the gap away.
            let twice = now + Duration::from_secs_f64(gap * 2.0);
            prop_assert!(far_from_expiry(now, twice, d, beta));
        }
    }

    #[test]
    fn the_shortcut_never_refuses_what_a_draw_could_grant() {
        // The smallest r a draw gives decides "yes" wherever any r does:
        // the gap only grows as r shrinks.
        assert_eq!(1.0 - (1.0 - f64::EPSILON / 2.0), SMALLEST_R);
        let now = SystemTime::now();
        let d = Duration::from_millis(200);
        for ms in [1u64, 100, 1000, 5000, 7000, 7400, 8000, 60_000] {
            let until = now + Duration::from_millis(ms);
            let any = [1.0, 0.5, 1e-3, 1e-9, SMALLEST_R]
                .iter()
                .any(|&r| should_refresh_early(now, until, d, 1.0, r));
            assert_eq!(
                any,
                should_refresh_early(now, until, d, 1.0, SMALLEST_R),
                "{ms} ms"
            );
        }
        assert!((LARGEST_FACTOR + SMALLEST_R.ln()).abs() < 1e-12);
        // 200 ms * 36.7 = 7.3 s: past that, no draw refreshes.
        let far = now + Duration::from_secs(8);
        assert!((0..1000).all(|_| !roll(now, far, d, 1.0)));
    }

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
