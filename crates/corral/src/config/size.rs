//! Byte sizes as written in the config file: `256MiB`, `16KiB`, `1GB`, or bare bytes.
//! Parsing only; an ambiguous unit such as `M` is refused rather than guessed.

/// Why a size text was refused; the message is meant for the operator.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("empty size: write a whole number and a unit, e.g. `256MiB`")]
    Empty,
    #[error("`{0}` is negative: sizes must be zero or more")]
    Negative(String),
    #[error("`{0}` is not a whole number of bytes: write e.g. `1536KiB` instead of `1.5MiB`")]
    Fractional(String),
    #[error("space before the unit in `{text}`: write `{compact}`")]
    SpaceBeforeUnit { text: String, compact: String },
    #[error(
        "ambiguous unit `{unit}` in `{text}`: write `{number}{unit}iB` (powers of 1024) or `{number}{unit}B` (powers of 1000)"
    )]
    AmbiguousUnit {
        text: String,
        number: String,
        unit: String,
    },
    #[error("unknown unit `{unit}` in `{text}` (units: B, KiB, MiB, GiB, KB, MB, GB)")]
    UnknownUnit { text: String, unit: String },
    #[error("`{0}` is not a size: write a whole number and a unit, e.g. `16KiB`, `256MiB`, `1GB`")]
    Malformed(String),
    #[error("`{0}` is too large")]
    TooLarge(String),
}

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Parses `<integer><unit>` where unit is `B`, `KiB`, `MiB`, `GiB` (powers of 1024),
/// `KB`, `MB`, `GB` (powers of 1000) or absent (bytes).
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let text = text.trim();
    if text.is_empty() {
        return Err(SizeError::Empty);
    }
    if text.starts_with('-') {
        return Err(SizeError::Negative(text.to_owned()));
    }
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    if number.is_empty() {
        return Err(SizeError::Malformed(text.to_owned()));
    }
    if unit.starts_with('.') {
        return Err(SizeError::Fractional(text.to_owned()));
    }
    if unit.starts_with(char::is_whitespace) {
        return Err(SizeError::SpaceBeforeUnit {
            text: text.to_owned(),
            compact: format!("{number}{}", unit.trim_start()),
        });
    }
    let multiplier = match unit {
        "" | "B" => 1,
        "KiB" => KIB,
        "MiB" => MIB,
        "GiB" => GIB,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "K" | "M" | "G" | "k" | "m" | "g" => {
            return Err(SizeError::AmbiguousUnit {
                text: text.to_owned(),
                number: number.to_owned(),
                unit: unit.to_ascii_uppercase(),
            });
        }
        _ => {
            return Err(SizeError::UnknownUnit {
                text: text.to_owned(),
                unit: unit.to_owned(),
            });
        }
    };
    let too_large = || SizeError::TooLarge(text.to_owned());
    let count: u64 = number.parse().map_err(|_| too_large())?;
    count.checked_mul(multiplier).ok_or_else(too_large)
}

/// Renders a size in the largest binary unit that represents it exactly (`8MiB`, `1000B`).
pub fn describe_size(bytes: u64) -> String {
    for (size, unit) in [(GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")] {
        if bytes != 0 && bytes.is_multiple_of(size) {
            return format!("{}{unit}", bytes / size);
        }
    }
    format!("{bytes}B")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(text: &str) -> u64 {
        parse_size(text).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    #[test]
    fn binary_and_decimal_units_parse() {
        assert_eq!(ok("256MiB"), 268_435_456);
        assert_eq!(ok("16KiB"), 16_384);
        assert_eq!(ok("2GiB"), 2_147_483_648);
        assert_eq!(ok("1GB"), 1_000_000_000);
        assert_eq!(ok("5MB"), 5_000_000);
        assert_eq!(ok("3KB"), 3_000);
        assert_eq!(ok("512B"), 512);
    }

    #[test]
    fn bare_integer_is_bytes() {
        assert_eq!(ok("1024"), 1024);
        assert_eq!(ok("0"), 0);
    }

    #[test]
    fn ambiguous_units_are_refused() {
        for text in ["1K", "256M", "1G", "1m"] {
            assert!(
                matches!(parse_size(text), Err(SizeError::AmbiguousUnit { .. })),
                "{text}"
            );
        }
        let message = parse_size("256M").map_err(|e| e.to_string());
        assert_eq!(
            message,
            Err("ambiguous unit `M` in `256M`: write `256MiB` (powers of 1024) or `256MB` (powers of 1000)".into())
        );
    }

    #[test]
    fn malformed_sizes_are_refused() {
        assert!(matches!(
            parse_size("1.5MiB"),
            Err(SizeError::Fractional(_))
        ));
        assert!(matches!(
            parse_size("1 MiB"),
            Err(SizeError::SpaceBeforeUnit { compact, .. }) if compact == "1MiB"
        ));
        assert!(matches!(
            parse_size("1mib"),
            Err(SizeError::UnknownUnit { .. })
        ));
        assert!(matches!(parse_size("-1"), Err(SizeError::Negative(_))));
        assert!(matches!(parse_size("MiB"), Err(SizeError::Malformed(_))));
        assert_eq!(parse_size(""), Err(SizeError::Empty));
    }

    #[test]
    fn overflow_is_refused() {
        assert!(matches!(
            parse_size("20000000000GiB"),
            Err(SizeError::TooLarge(_))
        ));
        assert!(matches!(
            parse_size("99999999999999999999999"),
            Err(SizeError::TooLarge(_))
        ));
    }

    #[test]
    fn description_uses_largest_exact_unit() {
        assert_eq!(describe_size(8 * MIB), "8MiB");
        assert_eq!(describe_size(16 * KIB), "16KiB");
        assert_eq!(describe_size(1000), "1000B");
        assert_eq!(describe_size(0), "0B");
    }
}
