//! Rate limits as GCRA (the generic cell rate algorithm): one number per
//! counted caller, the "theoretical arrival time" (TAT) of its next
//! request. A limit of `count` per `period` with a burst of `burst` lets
//! `burst` requests through at once, then one every `period / count`.
//!
//! Why GCRA and not a sliding window: it is exact (no boundary where twice
//! the rate gets through, as a fixed window allows), it needs one integer
//! per caller (a sliding log needs one per request; a sliding-window
//! counter needs two and is an approximation), and its update is one
//! compare-and-set, which a Redis script does in one round trip. The same
//! decision runs here for the local limiter and, in Lua, in Redis
//! (`corral::limits::shared`); the property tests below pin the arithmetic
//! both follow.

use std::time::Duration;

/// `count` requests per `period` (`30/min`, `5/s`, `1000/h`, `10/30s`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub count: u32,
    pub period: Duration,
}

impl Rate {
    /// Parses `N/UNIT` or `N/DURATION`: `30/min`, `5/s`, `2/1m`, `100/10s`.
    pub fn parse(text: &str) -> Result<Rate, String> {
        let hint = "a rate such as 30/min, 5/s, 1000/h or 100/10s";
        let (n, per) = text
            .trim()
            .split_once('/')
            .ok_or_else(|| format!("`{text}` is not {hint}"))?;
        let count: u32 = n
            .trim()
            .parse()
            .map_err(|_| format!("`{n}` in `{text}` is not a whole number of requests"))?;
        if count == 0 {
            return Err(format!("`{text}`: the count must be at least 1"));
        }
        let per = per.trim();
        let (digits, unit) = per.split_at(per.find(|c: char| !c.is_ascii_digit()).unwrap_or(0));
        let times: u64 = if digits.is_empty() {
            1
        } else {
            digits
                .parse()
                .map_err(|_| format!("`{per}` in `{text}` is not a period"))?
        };
        let unit_secs: u64 = match unit {
            "s" | "sec" | "second" => 1,
            "m" | "min" | "minute" => 60,
            "h" | "hour" => 3600,
            "d" | "day" => 86_400,
            _ => {
                return Err(format!(
                    "`{per}` in `{text}` is not a period: use s, min, h or d, optionally after a number (10s)"
                ));
            }
        };
        let secs = times
            .checked_mul(unit_secs)
            .filter(|s| (1..=86_400).contains(s))
            .ok_or_else(|| format!("`{text}`: the period must be between 1s and 1d"))?;
        let rate = Rate {
            count,
            period: Duration::from_secs(secs),
        };
        if rate.period.as_micros() / u128::from(count) == 0 {
            return Err(format!("`{text}` is more than one request per microsecond"));
        }
        Ok(rate)
    }
}

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}s", self.count, self.period.as_secs())
    }
}

/// A limit's arithmetic, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gcra {
    /// Time between two requests at the steady rate.
    pub emission_us: u64,
    /// How far ahead of now the TAT may run: `(burst - 1) × emission`.
    pub tolerance_us: u64,
}

/// What one request gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub allowed: bool,
    /// The TAT to store (unchanged when refused).
    pub tat_us: u64,
    /// Requests that would still be let through now, after this one.
    pub remaining: u64,
    /// When refused, how long until one more would be let through.
    pub retry_after_us: u64,
    /// How long until the caller's whole burst is available again.
    pub reset_us: u64,
}

impl Gcra {
    pub fn new(rate: Rate, burst: u32) -> Gcra {
        let emission = (rate.period.as_micros() / u128::from(rate.count.max(1))).max(1);
        let emission_us = u64::try_from(emission).unwrap_or(u64::MAX);
        Gcra {
            emission_us,
            tolerance_us: emission_us.saturating_mul(u64::from(burst.max(1) - 1)),
        }
    }

    /// The same limit shared by `instances` counters that cannot see each
    /// other (the local fallback when Redis is out of reach): each lets
    /// through 1/`instances` of the rate and of the burst (at least one).
    pub fn divided(self, instances: u32, burst: u32) -> Gcra {
        let n = u64::from(instances.max(1));
        let emission_us = self.emission_us.saturating_mul(n);
        let burst = (u64::from(burst.max(1)) / n).max(1);
        Gcra {
            emission_us,
            tolerance_us: emission_us.saturating_mul(burst - 1),
        }
    }

    /// The decision for a request at `now_us` given the stored TAT
    /// (`None`: nothing stored, a fresh caller).
    pub fn decide(&self, tat_us: Option<u64>, now_us: u64) -> Decision {
        let tat = tat_us.unwrap_or(now_us).max(now_us);
        let ahead = tat - now_us;
        if ahead > self.tolerance_us {
            return Decision {
                allowed: false,
                tat_us: tat,
                remaining: 0,
                retry_after_us: ahead - self.tolerance_us,
                reset_us: ahead,
            };
        }
        let next = tat.saturating_add(self.emission_us);
        Decision {
            allowed: true,
            tat_us: next,
            remaining: (self.tolerance_us - ahead) / self.emission_us,
            retry_after_us: 0,
            reset_us: next - now_us,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rates_parse_with_units_and_multiples() {
        let r = |t| Rate::parse(t).map(|r| (r.count, r.period.as_secs()));
        assert_eq!(r("30/min"), Ok((30, 60)));
        assert_eq!(r("5/s"), Ok((5, 1)));
        assert_eq!(r(" 1000 / h "), Ok((1000, 3600)));
        assert_eq!(r("100/10s"), Ok((100, 10)));
        assert_eq!(r("2/1m"), Ok((2, 60)));
        assert_eq!(r("7/d"), Ok((7, 86_400)));
        for bad in [
            "",
            "30",
            "0/s",
            "-1/s",
            "30/",
            "30/fortnight",
            "30/0s",
            "1/2d",
            "x/s",
            "5000000/s",
            "30/min/min",
            "1e3/s",
        ] {
            assert!(Rate::parse(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn a_burst_goes_through_at_once_then_the_steady_rate() {
        // 60/min, burst 3: three at once, then one a second.
        let g = Gcra::new(Rate::parse("60/min").expect("test value"), 3);
        let mut tat = None;
        let t0 = 1_000_000_000u64;
        for remaining in [2, 1, 0] {
            let d = g.decide(tat, t0);
            assert!(d.allowed);
            assert_eq!(d.remaining, remaining);
            tat = Some(d.tat_us);
        }
        let d = g.decide(tat, t0);
        assert!(!d.allowed);
        assert_eq!(d.retry_after_us, 1_000_000);
        assert_eq!(d.reset_us, 3_000_000);
        assert_eq!(
            d.tat_us,
            tat.expect("test value"),
            "a refusal changes nothing"
        );
        assert!(!g.decide(tat, t0 + 999_999).allowed);
        let d = g.decide(tat, t0 + 1_000_000);
        assert!(d.allowed);
        assert_eq!(d.remaining, 0);
    }

    #[test]
    fn divided_shares_rate_and_burst_across_instances() {
        let g = Gcra::new(Rate::parse("100/s").expect("test value"), 10);
        let d = g.divided(5, 10);
        assert_eq!(d.emission_us, 50_000);
        assert_eq!(d.tolerance_us, 50_000); // burst 2
        let one = g.divided(20, 10);
        assert_eq!(one.tolerance_us, 0, "at least one at once");
    }

    proptest! {
        /// Over any sequence of arrivals, what is let through in [0, t]
        /// never exceeds burst + t / emission, and a caller who waits
        /// `retry_after` is let through.
        #[test]
        fn never_more_than_burst_plus_the_rate(
            count in 1u32..1000,
            period_s in 1u64..3600,
            burst in 1u32..50,
            gaps in proptest::collection::vec(0u64..2_000_000, 1..300),
        ) {
            let g = Gcra::new(Rate { count, period: Duration::from_secs(period_s) }, burst);
            let start = 1_700_000_000_000_000u64;
            let mut now = start;
            let mut tat = None;
            let mut allowed = 0u64;
            for gap in gaps {
                now += gap;
                let d = g.decide(tat, now);
                if d.allowed {
                    allowed += 1;
                    tat = Some(d.tat_us);
                } else {
                    prop_assert!(d.retry_after_us > 0);
                    let later = g.decide(tat, now + d.retry_after_us);
                    prop_assert!(later.allowed);
                }
                let bound = u64::from(burst) + (now - start) / g.emission_us;
                prop_assert!(allowed <= bound, "{allowed} > {bound}");
                prop_assert!(d.remaining < u64::from(burst));
            }
        }

        /// Arbitrary text never panics the rate parser, and what it accepts
        /// prints back to the same rate.
        #[test]
        fn rate_parser_takes_junk_without_panic(text in "\\PC{0,16}") {
            if let Ok(r) = Rate::parse(&text) {
                let again = Rate::parse(&r.to_string()).expect("test value");
                prop_assert_eq!(again, r);
            }
        }
    }
}
