//! Durations as written in the config file: a number and a unit (`250ms`, `1.5s`, `2m`).
//! Parsing only; a bare number is refused rather than given a guessed unit.

use std::time::Duration;

const UNIT_NAMES: [&str; 5] = ["ms", "s", "m", "h", "d"];

/// Why a duration text was refused; the message is meant for the operator.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("empty duration: write a number and a unit, e.g. `5s`")]
    Empty,
    #[error("`{0}` is negative: durations must be zero or more")]
    Negative(String),
    #[error("missing unit in `{0}`: write e.g. `{0}s` (units: ms, s, m, h, d)")]
    MissingUnit(String),
    #[error("space before the unit in `{text}`: write `{compact}`")]
    SpaceBeforeUnit { text: String, compact: String },
    #[error("unknown unit `{unit}` in `{text}` (units: ms, s, m, h, d)")]
    UnknownUnit { text: String, unit: String },
    #[error("`{0}` is not a duration: write a number and a unit, e.g. `250ms`, `1.5s`, `2m`")]
    Malformed(String),
    #[error("`{0}` is too large")]
    TooLarge(String),
}

const NANOS_PER_MILLI: u128 = 1_000_000;
const NANOS_PER_SECOND: u128 = 1_000_000_000;

/// Parses `<integer or decimal><unit>` with unit `ms`, `s`, `m`, `h` or `d`.
///
/// Fractions finer than a nanosecond are truncated.
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    let text = text.trim();
    if text.is_empty() {
        return Err(DurationError::Empty);
    }
    if text.starts_with('-') {
        return Err(DurationError::Negative(text.to_owned()));
    }
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let (whole, fraction) = split_decimal(number).ok_or_else(|| malformed(text))?;
    if unit.is_empty() {
        return Err(DurationError::MissingUnit(text.to_owned()));
    }
    // Only suggest the compact form when the unit itself is a known one.
    if unit.starts_with(char::is_whitespace) && UNIT_NAMES.contains(&unit.trim()) {
        return Err(DurationError::SpaceBeforeUnit {
            text: text.to_owned(),
            compact: format!("{number}{}", unit.trim_start()),
        });
    }
    let unit_nanos = match unit {
        "ms" => NANOS_PER_MILLI,
        "s" => NANOS_PER_SECOND,
        "m" => 60 * NANOS_PER_SECOND,
        "h" => 3_600 * NANOS_PER_SECOND,
        "d" => 86_400 * NANOS_PER_SECOND,
        _ => {
            return Err(DurationError::UnknownUnit {
                text: text.to_owned(),
                unit: unit.trim().to_owned(),
            });
        }
    };

    let too_large = || DurationError::TooLarge(text.to_owned());
    let whole: u128 = whole.parse().map_err(|_| too_large())?;
    // Digits past the 18th are below a nanosecond even for days; dropping them keeps
    // the arithmetic inside u128.
    let fraction = &fraction[..fraction.len().min(18)];
    let fraction_nanos = if fraction.is_empty() {
        0
    } else {
        let digits: u128 = fraction.parse().map_err(|_| malformed(text))?;
        let scale = 10u128.pow(u32::try_from(fraction.len()).map_err(|_| malformed(text))?);
        digits * unit_nanos / scale
    };
    let nanos = whole
        .checked_mul(unit_nanos)
        .and_then(|n| n.checked_add(fraction_nanos))
        .ok_or_else(too_large)?;
    let nanos = u64::try_from(nanos).map_err(|_| too_large())?;
    Ok(Duration::from_nanos(nanos))
}

/// Renders a duration in the largest unit that represents it exactly (`1h`, `1500ms`).
pub fn describe_duration(duration: Duration) -> String {
    let nanos = duration.as_nanos();
    let units: [(u128, &str); 5] = [
        (86_400 * NANOS_PER_SECOND, "d"),
        (3_600 * NANOS_PER_SECOND, "h"),
        (60 * NANOS_PER_SECOND, "m"),
        (NANOS_PER_SECOND, "s"),
        (NANOS_PER_MILLI, "ms"),
    ];
    if nanos == 0 {
        return "0s".to_owned();
    }
    for (size, unit) in units {
        if nanos.is_multiple_of(size) {
            return format!("{}{unit}", nanos / size);
        }
    }
    format!("{duration:?}")
}

/// Splits `12.5` into (`12`, `5`); `None` when the text is not a plain decimal number.
fn split_decimal(number: &str) -> Option<(&str, &str)> {
    let (whole, fraction) = match number.split_once('.') {
        Some((whole, fraction)) => {
            if fraction.is_empty() || fraction.contains('.') {
                return None;
            }
            (whole, fraction)
        }
        None => (number, ""),
    };
    if whole.is_empty() {
        return None;
    }
    Some((whole, fraction))
}

fn malformed(text: &str) -> DurationError {
    DurationError::Malformed(text.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(text: &str) -> Duration {
        parse_duration(text).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    #[test]
    fn every_unit_parses() {
        assert_eq!(ok("250ms"), Duration::from_millis(250));
        assert_eq!(ok("5s"), Duration::from_secs(5));
        assert_eq!(ok("2m"), Duration::from_secs(120));
        assert_eq!(ok("3h"), Duration::from_secs(3 * 3600));
        assert_eq!(ok("1d"), Duration::from_secs(86_400));
        assert_eq!(ok("0s"), Duration::ZERO);
        assert_eq!(ok(" 7s "), Duration::from_secs(7));
    }

    #[test]
    fn decimals_are_exact() {
        assert_eq!(ok("1.5s"), Duration::from_millis(1500));
        assert_eq!(ok("0.25m"), Duration::from_secs(15));
        assert_eq!(ok("1.5ms"), Duration::from_micros(1500));
        assert_eq!(ok("0.1s"), Duration::from_millis(100));
        assert_eq!(ok("0.0000000015s"), Duration::from_nanos(1));
    }

    #[test]
    fn bare_number_is_missing_unit() {
        assert_eq!(
            parse_duration("5"),
            Err(DurationError::MissingUnit("5".into()))
        );
        let message = parse_duration("1.5").map_err(|e| e.to_string());
        assert_eq!(
            message,
            Err("missing unit in `1.5`: write e.g. `1.5s` (units: ms, s, m, h, d)".into())
        );
    }

    #[test]
    fn malformed_texts_are_refused() {
        assert!(matches!(
            parse_duration("5x"),
            Err(DurationError::UnknownUnit { unit, .. }) if unit == "x"
        ));
        assert!(matches!(
            parse_duration("5S"),
            Err(DurationError::UnknownUnit { .. })
        ));
        assert!(matches!(
            parse_duration("5 parsecs"),
            Err(DurationError::UnknownUnit { unit, .. }) if unit == "parsecs"
        ));
        assert!(matches!(
            parse_duration("5 s"),
            Err(DurationError::SpaceBeforeUnit { compact, .. }) if compact == "5s"
        ));
        assert_eq!(parse_duration(""), Err(DurationError::Empty));
        assert!(matches!(
            parse_duration("-1s"),
            Err(DurationError::Negative(_))
        ));
        for text in ["s", ".5s", "1.s", "1..5s", "1.2.3s", "+1s", "1e3s"] {
            assert!(parse_duration(text).is_err(), "{text} accepted");
        }
    }

    #[test]
    fn overflow_is_refused() {
        assert!(matches!(
            parse_duration("99999999999999999999999999999999999999999d"),
            Err(DurationError::TooLarge(_))
        ));
        assert!(matches!(
            parse_duration("1000000d"),
            Err(DurationError::TooLarge(_))
        ));
    }

    #[test]
    fn description_uses_largest_exact_unit() {
        assert_eq!(describe_duration(Duration::from_secs(3600)), "1h");
        assert_eq!(describe_duration(Duration::from_millis(1500)), "1500ms");
        assert_eq!(describe_duration(Duration::from_secs(90)), "90s");
        assert_eq!(describe_duration(Duration::ZERO), "0s");
        assert_eq!(describe_duration(Duration::from_secs(86_400 * 2)), "2d");
    }
}
