//! Resolves a route's `compression:`: the codings stored answers are
//! compressed in, the smallest body worth it, and the media types that
//! are.

use serde_saphyr::Spanned;

use super::Resolver;
use crate::config::raw::RawCompression;
use crate::config::{CompressionConfig, ConfigError};

impl Resolver<'_> {
    /// The `compression` of the route at `prefix` (`routes[0]`).
    pub(super) fn compression(
        &self,
        spanned: &Spanned<RawCompression>,
        prefix: &str,
    ) -> Result<CompressionConfig, ConfigError> {
        let raw = &spanned.value;
        let defaults = CompressionConfig::default();
        let prefix = &format!("{prefix}.compression");
        let encodings = match &raw.encodings {
            Some(entries) => {
                let field = format!("{prefix}.encodings");
                let names = self.list(entries, &field, encoding)?;
                let mut codings: Vec<corral_core::Coding> = Vec::new();
                for (i, name) in names.iter().enumerate() {
                    let c =
                        corral_core::Coding::from_name(name).unwrap_or(corral_core::Coding::Gzip);
                    if codings.contains(&c) {
                        return Err(self.error(
                            &entries[i].referenced,
                            &format!("{field}[{i}]"),
                            format!("`{name}` is listed twice"),
                        ));
                    }
                    codings.push(c);
                }
                if codings.is_empty() {
                    return Err(self.error(
                        &spanned.referenced,
                        &field,
                        "lists no coding; leave compression out to keep answers as the origin sends them",
                    ));
                }
                codings
            }
            None => defaults.encodings,
        };
        let min_size = self
            .under(prefix, "min_size", &raw.min_size)
            .size_or(defaults.min_size)?
            .value;
        let types = match &raw.types {
            Some(entries) => self.list(entries, &format!("{prefix}.types"), media_type)?,
            None => defaults.types,
        };
        Ok(CompressionConfig {
            encodings,
            min_size,
            types,
        })
    }
}

/// `gzip`, `br` or `zstd`.
fn encoding(text: &str) -> Result<String, String> {
    corral_core::Coding::from_name(text)
        .filter(|_| !text.eq_ignore_ascii_case("x-gzip"))
        .map(|c| c.as_str().to_owned())
        .ok_or_else(|| format!("`{text}` is not a coding corral compresses in: gzip, br or zstd"))
}

/// `type/subtype`, `type/*`, or `type/*+suffix`, lowercased.
fn media_type(text: &str) -> Result<String, String> {
    let lower = text.trim().to_ascii_lowercase();
    let ok = lower.split_once('/').is_some_and(|(t, s)| {
        let token = |x: &str| {
            !x.is_empty()
                && x.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"!#$&-^_.+".contains(&b))
        };
        token(t) && (s == "*" || token(s) || s.strip_prefix("*+").is_some_and(token))
    });
    if ok {
        Ok(lower)
    } else {
        Err(format!(
            "`{text}` is not a media type (`application/json`, `text/*`, `application/*+json`)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_read_or_refused_with_a_reason() {
        assert_eq!(encoding("GZIP"), Ok("gzip".into()));
        assert_eq!(encoding("zstd"), Ok("zstd".into()));
        assert!(encoding("deflate").is_err());
        assert!(encoding("x-gzip").is_err());
        assert_eq!(
            media_type("Application/JSON"),
            Ok("application/json".into())
        );
        assert_eq!(media_type("text/*"), Ok("text/*".into()));
        assert_eq!(
            media_type("application/*+json"),
            Ok("application/*+json".into())
        );
        assert!(media_type("json").is_err());
        assert!(media_type("text/").is_err());
        assert!(media_type("*/*x").is_err());
    }
}
