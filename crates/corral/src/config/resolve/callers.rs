//! Resolves `callers:`: where a caller's account comes from (a verified JWT, a header
//! a trusted proxy sets, an API key) and how many callers are counted locally.
//! Reads the key files `callers.account.jwt` names, anew on every load and reload.

use corral_core::callers::caller::{AccountSources, JwtKeys, JwtSource, OnInvalid};
use http::header::HeaderName;
use serde_saphyr::{Location, Spanned};

use super::{Resolver, whole_number};
use crate::config::raw::{RawAccount, RawCallers, RawJwt};
use crate::config::{CallersConfig, ConfigError, DEFAULT_JWT_LEEWAY, DEFAULT_LOCAL_BUCKETS};

impl Resolver<'_> {
    /// `callers:`; without `account`, every caller is a guest.
    pub(super) fn callers(&self, raw: &Spanned<RawCallers>) -> Result<CallersConfig, ConfigError> {
        let local_buckets = self
            .at("callers.local_buckets", &raw.value.local_buckets)
            .parse_or(DEFAULT_LOCAL_BUCKETS, |t| {
                whole_number(t, 1, "callers").map(|n| n as u64)
            })?;
        let account = match &raw.value.account {
            Some(a) => self.account(a)?,
            None => AccountSources::default(),
        };
        Ok(CallersConfig {
            account: std::sync::Arc::new(account),
            local_buckets,
        })
    }

    /// `callers.account`: at least one source, tried in the order written here.
    fn account(&self, raw: &Spanned<RawAccount>) -> Result<AccountSources, ConfigError> {
        let sources = AccountSources {
            jwt: match &raw.value.jwt {
                Some(j) => Some(self.jwt(j)?),
                None => None,
            },
            header: self
                .at("callers.account.header", &raw.value.header)
                .parse(header_name)?,
            api_key_header: self
                .at("callers.account.api_key_header", &raw.value.api_key_header)
                .parse(header_name)?,
        };
        if sources.is_empty() {
            return Err(self.error(
                &raw.referenced,
                "callers.account",
                "names no source: give jwt, header or api_key_header",
            ));
        }
        Ok(sources)
    }

    /// `callers.account.jwt`: the keys tokens are verified with, and what to read from
    /// a token once verified.
    fn jwt(&self, raw: &Spanned<RawJwt>) -> Result<JwtSource, ConfigError> {
        let at = &raw.referenced;
        let raw = &raw.value;
        let p = "callers.account.jwt";
        let keys = self.jwt_keys(raw, at, p)?;
        let header = self
            .under(p, "header", &raw.header)
            .parse_or(http::header::AUTHORIZATION, header_name)?;
        let leeway = self
            .under(p, "leeway", &raw.leeway)
            .duration_or(DEFAULT_JWT_LEEWAY)?;
        let on_invalid =
            self.under(p, "on_invalid", &raw.on_invalid)
                .parse_or(OnInvalid::Guest, |t| match t.trim() {
                    "guest" => Ok(OnInvalid::Guest),
                    "reject" => Ok(OnInvalid::Reject),
                    other => Err(format!("`{other}` is not one of guest, reject")),
                })?;
        let claim = self.under(p, "claim", &raw.claim).parse(not_empty)?;
        Ok(JwtSource {
            header,
            keys,
            claim: claim.unwrap_or_else(|| "sub".into()),
            issuer: self.under(p, "issuer", &raw.issuer).parse(not_empty)?,
            audience: self.under(p, "audience", &raw.audience).parse(not_empty)?,
            leeway: leeway.value,
            on_invalid,
        })
    }

    /// Exactly one of `hs256_secret_file` and `jwks_file` (`p` is the section's path),
    /// read and parsed.
    fn jwt_keys(&self, raw: &RawJwt, at: &Location, p: &str) -> Result<JwtKeys, ConfigError> {
        match (&raw.hs256_secret_file, &raw.jwks_file) {
            (Some(secret), None) => {
                let field = format!("{p}.hs256_secret_file");
                let bytes = self.read_file(secret, &field)?;
                // A trailing newline from `echo > file` is not part of the secret.
                let bytes = bytes.strip_suffix(b"\n").unwrap_or(&bytes);
                JwtKeys::hs256(bytes).map_err(|m| self.error(&secret.referenced, &field, m))
            }
            (None, Some(jwks)) => {
                let field = format!("{p}.jwks_file");
                let bytes = self.read_file(jwks, &field)?;
                let text = String::from_utf8_lossy(&bytes);
                JwtKeys::jwks(&text).map_err(|m| {
                    self.error(
                        &jwks.referenced,
                        &field,
                        format!("{}: {m}", jwks.value.trim()),
                    )
                })
            }
            (Some(_), Some(j)) => Err(self.error(
                &j.referenced,
                &format!("{p}.jwks_file"),
                "give hs256_secret_file or jwks_file, not both",
            )),
            (None, None) => Err(self.error(
                at,
                p,
                "needs hs256_secret_file or jwks_file (tokens are verified, never trusted as sent)",
            )),
        }
    }
}

/// A header to read an account or a token from.
fn header_name(text: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(text.trim().as_bytes())
        .map_err(|_| format!("`{text}` is not a header name"))
}

/// A claim or a required claim value: what a token is checked against may not be
/// blank.
fn not_empty(text: &str) -> Result<String, &'static str> {
    let text = text.trim();
    if text.is_empty() {
        return Err("must not be empty");
    }
    Ok(text.to_owned())
}
