//! The one error type of config loading: which file, where in it, which field, and why.
//! Turns serde-saphyr's errors into one-line messages; never renders source snippets.

use std::fmt;

use serde_saphyr::{Location, MessageFormatter, UserMessageFormatter};

use super::paths::NodePaths;

/// A config file that could not be read, parsed or accepted.
///
/// Displays as `{file}:{line}:{column}: {field}: {message}`; the position is left out when
/// unknown (the file could not be read) and the field when the error is about the whole
/// document.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    /// The file name as given to `load` or `parse`.
    pub file: String,
    /// 1-based line of the offending value.
    pub line: Option<u32>,
    /// 1-based character column of the offending value.
    pub column: Option<u32>,
    /// Dotted path of the offending field, e.g. `routes[1].cache.default_ttl`.
    pub field: String,
    /// What is wrong, on one line.
    pub message: String,
    /// Further errors found in the same run (every required field missing
    /// or unreadable is reported at once), each on a line of its own.
    pub also: Vec<ConfigError>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.file)?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(column) = self.column {
                write!(f, ":{column}")?;
            }
        }
        if !self.field.is_empty() {
            write!(f, ": {}", self.field)?;
        }
        write!(f, ": {}", self.message)?;
        for other in &self.also {
            write!(f, "\n{other}")?;
        }
        Ok(())
    }
}

impl ConfigError {
    /// An error about the value at `location`.
    pub(super) fn at(
        file: &str,
        location: &Location,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        let (line, column) = (location.line(), location.column());
        Self::at_position(file, line, column, field, message)
    }

    /// An error about the value at 1-based `line` and `column`; 0 means unknown.
    pub(super) fn at_position(
        file: &str,
        line: u64,
        column: u64,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        let line = u32::try_from(line).ok().filter(|l| *l > 0);
        let column = u32::try_from(column)
            .ok()
            .filter(|c| *c > 0 && line.is_some());
        Self {
            file: file.to_owned(),
            line,
            column,
            field: field.into(),
            message: message.into(),
            also: Vec::new(),
        }
    }

    /// The file could not be read at all.
    pub(super) fn unreadable(file: &str, cause: &std::io::Error) -> Self {
        Self {
            file: file.to_owned(),
            line: None,
            column: None,
            field: String::new(),
            message: format!("cannot read config file: {cause}"),
            also: Vec::new(),
        }
    }

    /// The first of `errors` in file order, carrying the others in
    /// [`ConfigError::also`]; `None` when there are none.
    pub(super) fn all(mut errors: Vec<ConfigError>) -> Option<Self> {
        errors.sort_by_key(|e| (e.line.is_none(), e.line, e.column));
        errors.dedup_by(|a, b| a.field == b.field && a.line == b.line);
        let mut errors = errors.into_iter();
        let mut first = errors.next()?;
        first.also.extend(errors);
        Some(first)
    }

    /// Translates a serde-saphyr error, naming the field from the node at its location.
    pub(super) fn from_yaml(file: &str, text: &str, error: &serde_saphyr::Error) -> Self {
        let error = error.without_snippet();
        let location = error.location().unwrap_or(Location::UNKNOWN);
        let paths = NodePaths::index(text);
        let (line, column) = (location.line(), location.column());
        let field = match error {
            // About the whole stream, not one field.
            serde_saphyr::Error::MultipleDocuments { .. } | serde_saphyr::Error::Eof { .. } => {
                Some("")
            }
            // Both point at the key itself.
            serde_saphyr::Error::SerdeUnknownField { .. }
            | serde_saphyr::Error::DuplicateMappingKey { .. } => paths.key_at(line, column),
            _ => paths
                .value_at(line, column)
                .or_else(|| paths.key_at(line, column)),
        }
        .or_else(|| paths.nearest_before(line, column))
        .unwrap_or_default();
        Self::at(file, &location, field, yaml_message(error))
    }
}

/// A concise message for a serde-saphyr error, worded for someone editing the file.
fn yaml_message(error: &serde_saphyr::Error) -> String {
    use serde_saphyr::Error as E;
    match error {
        E::SerdeUnknownField {
            field, expected, ..
        } => {
            if expected.is_empty() {
                format!("unknown field `{field}` (this section takes no fields)")
            } else {
                format!(
                    "unknown field `{field}` (expected one of: {})",
                    expected.join(", ")
                )
            }
        }
        E::Unexpected { expected, .. } => match *expected {
            "sequence start" => "expected a list".to_owned(),
            "mapping start" => "expected a mapping of `field: value` pairs".to_owned(),
            "string scalar" => "expected a single value, not a list or mapping".to_owned(),
            other => format!("expected {other}"),
        },
        E::Eof { .. } => "the file is empty or ends too early".to_owned(),
        other => UserMessageFormatter.format_message(other).into_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(line: Option<u32>, column: Option<u32>, field: &str) -> ConfigError {
        ConfigError {
            file: "corral.yaml".into(),
            line,
            column,
            field: field.into(),
            message: "bad".into(),
            also: Vec::new(),
        }
    }

    #[test]
    fn display_includes_every_known_part() {
        assert_eq!(
            error(Some(7), Some(5), "routes[0].cache.bogus").to_string(),
            "corral.yaml:7:5: routes[0].cache.bogus: bad"
        );
        assert_eq!(
            error(None, None, "listen").to_string(),
            "corral.yaml: listen: bad"
        );
        assert_eq!(error(Some(3), None, "").to_string(), "corral.yaml:3: bad");
    }

    #[test]
    fn several_errors_show_one_a_line_in_file_order() {
        let all = ConfigError::all(vec![
            error(Some(9), Some(5), "routes[0].upstream"),
            error(Some(1), Some(1), "listen"),
            error(Some(9), Some(5), "routes[0].upstream"),
        ])
        .expect("errors");
        assert_eq!(
            all.to_string(),
            "corral.yaml:1:1: listen: bad\ncorral.yaml:9:5: routes[0].upstream: bad"
        );
        assert_eq!(ConfigError::all(Vec::new()), None);
    }

    #[test]
    fn unreadable_file_has_no_position_or_field() {
        let cause = std::io::Error::new(std::io::ErrorKind::NotFound, "gone");
        let error = ConfigError::unreadable("missing.yaml", &cause);
        assert_eq!(error.field, "");
        assert_eq!(error.line, None);
        assert_eq!(
            error.to_string(),
            "missing.yaml: cannot read config file: gone"
        );
    }
}
