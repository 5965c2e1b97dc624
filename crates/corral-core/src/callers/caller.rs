//! Who is calling: the account a request belongs to, for rate limits that
//! count callers rather than addresses. Every source fails closed: a value
//! corral cannot verify never becomes an account someone else could be
//! charged for, and never an account the caller picked for themselves
//! unless the operator said it may be.
//!
//! Sources, tried in this order, the first that yields an answer wins:
//! 1. `jwt`: a bearer token verified with an HS256 secret or the public
//!    keys of a JWKS file (read from disk; corral fetches nothing). The
//!    account is a claim (`sub` by default). An invalid, expired or
//!    not-yet-valid token makes the caller a guest, or is refused (401),
//!    as configured; it never falls through to the other sources.
//! 2. `header`: an account header (`X-Account-Id`) set by an
//!    authenticating proxy. Honoured only when the connection's peer is in
//!    `server.trusted_proxies`: from anyone else it is the caller's own
//!    claim, and is ignored.
//! 3. `api_key_header`: an API key, kept only as its hash. corral does not
//!    know which keys are real, so a caller may invent keys: pair an
//!    `api_key` account limit with an `ip` limit.
//!
//! The account string carries its source (`jwt:`, `hdr:`, `key:`) so that
//! one source can never name another's account.

use std::time::Duration;

use http::HeaderMap;
use http::header::HeaderName;
use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};

/// The longest account identifier or token read; longer ones are invalid.
pub const MAX_VALUE: usize = 8 * 1024;

/// How accounts are found (`callers.account`).
#[derive(Default)]
pub struct AccountSources {
    pub jwt: Option<JwtSource>,
    pub header: Option<HeaderName>,
    pub api_key_header: Option<HeaderName>,
}

impl std::fmt::Debug for AccountSources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccountSources")
            .field("jwt", &self.jwt.is_some())
            .field("header", &self.header)
            .field("api_key_header", &self.api_key_header)
            .finish()
    }
}

/// What an invalid token makes of its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnInvalid {
    /// Counted as a guest (by address).
    Guest,
    /// Answered 401.
    Reject,
}

/// Verified bearer tokens.
pub struct JwtSource {
    /// Where the token is: `Authorization` (with the `Bearer` scheme) or
    /// another header holding the bare token.
    pub header: HeaderName,
    pub keys: JwtKeys,
    /// The claim that names the account.
    pub claim: String,
    pub issuer: Option<String>,
    pub audience: Option<String>,
    /// Clock skew allowed on `exp` and `nbf`.
    pub leeway: Duration,
    pub on_invalid: OnInvalid,
}

/// The keys tokens are checked against.
pub enum JwtKeys {
    /// One shared secret, HS256 only.
    Hs256(DecodingKey),
    /// Public keys, each with its algorithm and optional key id.
    Jwks(Vec<PublicKey>),
}

pub struct PublicKey {
    pub kid: Option<String>,
    pub alg: Algorithm,
    pub key: DecodingKey,
}

impl JwtKeys {
    pub fn hs256(secret: &[u8]) -> Result<JwtKeys, String> {
        if secret.len() < 32 {
            return Err(format!(
                "the HS256 secret is {} bytes; use at least 32 (RFC 7518 §3.2)",
                secret.len()
            ));
        }
        DecodingKey::from_secret(secret)
            .map(JwtKeys::Hs256)
            .map_err(|e| e.to_string())
    }

    /// Parses a JWKS document. Every key must say its algorithm (`alg`)
    /// and be a public signature key; a set with none is refused, and so
    /// is a symmetric key (a JWKS file is for public keys).
    pub fn jwks(json: &str) -> Result<JwtKeys, String> {
        let set: JwkSet =
            serde_json::from_str(json).map_err(|e| format!("not a JWKS document: {e}"))?;
        if set.keys.is_empty() {
            return Err("the JWKS holds no keys".into());
        }
        let mut keys = Vec::with_capacity(set.keys.len());
        for (i, jwk) in set.keys.iter().enumerate() {
            let name = jwk.common.key_id.clone().unwrap_or_else(|| format!("#{i}"));
            let alg = jwk
                .common
                .key_algorithm
                .and_then(|a| format!("{a:?}").parse::<Algorithm>().ok())
                .ok_or_else(|| {
                    format!("key {name}: `alg` is missing or not a signature algorithm")
                })?;
            if matches!(alg, Algorithm::HS256 | Algorithm::HS384 | Algorithm::HS512) {
                return Err(format!(
                    "key {name}: a symmetric key does not belong in a JWKS file; use hs256_secret_file"
                ));
            }
            let key = DecodingKey::from_jwk(jwk).map_err(|e| format!("key {name}: {e}"))?;
            if key.family() != alg.family() {
                return Err(format!(
                    "key {name}: `alg` {alg:?} does not fit its key type"
                ));
            }
            keys.push(PublicKey {
                kid: jwk.common.key_id.clone(),
                alg,
                key,
            });
        }
        Ok(JwtKeys::Jwks(keys))
    }
}

/// Who the request says it is, after checking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// An account, prefixed with its source.
    Account(String),
    /// No account: counted by address.
    Guest,
    /// A token was presented and failed, and the source says to refuse
    /// (401); the reason is for the log.
    Rejected(&'static str),
}

impl AccountSources {
    pub fn is_empty(&self) -> bool {
        self.jwt.is_none() && self.header.is_none() && self.api_key_header.is_none()
    }

    /// The caller of a request with `headers`; `peer_trusted` is whether
    /// the connection's peer is a trusted proxy.
    pub fn identify(&self, headers: &HeaderMap, peer_trusted: bool, now_secs: u64) -> Caller {
        if let Some(jwt) = &self.jwt {
            match jwt.account(headers, now_secs) {
                Token::Absent => {}
                Token::Valid(sub) => return Caller::Account(format!("jwt:{sub}")),
                Token::Invalid(why) => {
                    return match jwt.on_invalid {
                        OnInvalid::Guest => Caller::Guest,
                        OnInvalid::Reject => Caller::Rejected(why),
                    };
                }
            }
        }
        if let Some(name) = &self.header
            && peer_trusted
            && let Some(v) = single(headers, name)
        {
            return match std::str::from_utf8(v.trim_ascii()) {
                Ok(id) if !id.is_empty() && id.len() <= MAX_VALUE && printable(id) => {
                    Caller::Account(format!("hdr:{id}"))
                }
                _ => Caller::Guest,
            };
        }
        if let Some(name) = &self.api_key_header
            && let Some(v) = single(headers, name)
        {
            let v = v.trim_ascii();
            if !v.is_empty() && v.len() <= MAX_VALUE {
                // Only the hash is kept: the key itself is a credential.
                return Caller::Account(format!("key:{}", blake3::hash(v).to_hex()));
            }
        }
        Caller::Guest
    }
}

/// The one value of `name`, or `None` when absent or sent more than once
/// (two values is ambiguous: which would be the account?).
fn single<'h>(headers: &'h HeaderMap, name: &HeaderName) -> Option<&'h [u8]> {
    let mut all = headers.get_all(name).iter();
    let first = all.next()?;
    if all.next().is_some() {
        return None;
    }
    Some(first.as_bytes())
}

fn printable(s: &str) -> bool {
    s.bytes().all(|b| (0x21..0x7f).contains(&b))
}

enum Token {
    Absent,
    Valid(String),
    Invalid(&'static str),
}

impl JwtSource {
    fn account(&self, headers: &HeaderMap, now_secs: u64) -> Token {
        let mut all = headers.get_all(&self.header).iter();
        let Some(value) = all.next() else {
            return Token::Absent;
        };
        if all.next().is_some() {
            return Token::Invalid("more than one token");
        }
        let value = value.as_bytes().trim_ascii();
        let token = if self.header == http::header::AUTHORIZATION {
            // `Bearer <token>`; another scheme (Basic) is not a token.
            match value.split_at_checked(7) {
                Some((scheme, rest)) if scheme.eq_ignore_ascii_case(b"bearer ") => {
                    rest.trim_ascii()
                }
                _ => return Token::Absent,
            }
        } else {
            value
        };
        if token.is_empty() || token.len() > MAX_VALUE {
            return Token::Invalid("malformed token");
        }
        let Ok(token) = std::str::from_utf8(token) else {
            return Token::Invalid("malformed token");
        };
        let Ok(header) = jsonwebtoken::decode_header(token) else {
            return Token::Invalid("malformed token");
        };
        let (key, alg) = match &self.keys {
            JwtKeys::Hs256(k) => (k, Algorithm::HS256),
            JwtKeys::Jwks(keys) => {
                let found = match &header.kid {
                    Some(kid) => keys.iter().find(|k| k.kid.as_deref() == Some(kid)),
                    None if keys.len() == 1 => keys.first(),
                    None => None,
                };
                match found {
                    Some(k) => (&k.key, k.alg),
                    None => return Token::Invalid("unknown key"),
                }
            }
        };
        // The algorithm is the key's, never the token's choice.
        if header.alg != alg {
            return Token::Invalid("wrong algorithm");
        }
        let mut v = Validation::new(alg);
        v.leeway = self.leeway.as_secs();
        v.validate_exp = false; // checked below against the given clock
        v.validate_nbf = false;
        v.required_spec_claims.clear();
        if let Some(iss) = &self.issuer {
            v.set_issuer(&[iss]);
            v.required_spec_claims.insert("iss".into());
        }
        match &self.audience {
            Some(aud) => {
                v.set_audience(&[aud]);
                v.required_spec_claims.insert("aud".into());
            }
            None => v.validate_aud = false,
        }
        let claims = match jsonwebtoken::decode::<serde_json::Map<String, serde_json::Value>>(
            token, key, &v,
        ) {
            Ok(data) => data.claims,
            Err(_) => return Token::Invalid("bad signature or claims"),
        };
        let leeway = self.leeway.as_secs();
        // `exp` is required: a token that never expires is a credential
        // that can never be taken back.
        match claims.get("exp").and_then(serde_json::Value::as_u64) {
            Some(exp) if exp.saturating_add(leeway) > now_secs => {}
            Some(_) => return Token::Invalid("expired"),
            None => return Token::Invalid("no exp claim"),
        }
        if let Some(nbf) = claims.get("nbf") {
            match nbf.as_u64() {
                Some(nbf) if nbf <= now_secs.saturating_add(leeway) => {}
                _ => return Token::Invalid("not yet valid"),
            }
        }
        let id = match claims.get(&self.claim) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Number(n)) => n.to_string(),
            _ => return Token::Invalid("no account claim"),
        };
        if id.is_empty() || id.len() > MAX_VALUE {
            return Token::Invalid("no account claim");
        }
        Token::Valid(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use jsonwebtoken::{EncodingKey, Header};

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";
    const NOW: u64 = 1_800_000_000;

    fn token(alg: Algorithm, key: &EncodingKey, claims: serde_json::Value) -> String {
        jsonwebtoken::encode(&Header::new(alg), &claims, key).expect("test value")
    }

    fn sources(on_invalid: OnInvalid) -> AccountSources {
        AccountSources {
            jwt: Some(JwtSource {
                header: http::header::AUTHORIZATION,
                keys: JwtKeys::hs256(SECRET).expect("test value"),
                claim: "sub".into(),
                issuer: None,
                audience: None,
                leeway: Duration::from_secs(30),
                on_invalid,
            }),
            header: Some(HeaderName::from_static("x-account-id")),
            api_key_header: Some(HeaderName::from_static("x-api-key")),
        }
    }

    fn with(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(*n, HeaderValue::from_str(v).expect("test value"));
        }
        h
    }

    #[test]
    fn a_valid_token_names_the_account() {
        let s = sources(OnInvalid::Guest);
        let t = token(
            Algorithm::HS256,
            &EncodingKey::from_secret(SECRET).expect("test value"),
            serde_json::json!({"sub": "alice", "exp": NOW + 60}),
        );
        let h = with(&[("authorization", &format!("Bearer {t}"))]);
        assert_eq!(
            s.identify(&h, false, NOW),
            Caller::Account("jwt:alice".into())
        );
        // The token wins over a header naming another account.
        let h = with(&[
            ("authorization", &format!("bearer {t}")),
            ("x-account-id", "mallory"),
        ]);
        assert_eq!(
            s.identify(&h, true, NOW),
            Caller::Account("jwt:alice".into())
        );
    }

    #[test]
    fn a_bad_token_is_never_an_account() {
        let good = EncodingKey::from_secret(SECRET).expect("test value");
        let other =
            EncodingKey::from_secret(b"another secret of thirty-two b..").expect("test value");
        let cases = [
            token(
                Algorithm::HS256,
                &other,
                serde_json::json!({"sub": "alice", "exp": NOW + 60}),
            ),
            token(
                Algorithm::HS256,
                &good,
                serde_json::json!({"sub": "alice", "exp": NOW - 60}),
            ),
            token(Algorithm::HS256, &good, serde_json::json!({"sub": "alice"})),
            token(
                Algorithm::HS256,
                &good,
                serde_json::json!({"sub": "alice", "exp": NOW + 60, "nbf": NOW + 120}),
            ),
            token(
                Algorithm::HS256,
                &good,
                serde_json::json!({"exp": NOW + 60}),
            ),
            token(
                Algorithm::HS384,
                &good,
                serde_json::json!({"sub": "alice", "exp": NOW + 60}),
            ),
            // alg "none": an unsigned token.
            "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.eyJzdWIiOiJhbGljZSIsImV4cCI6MTkwMDAwMDAwMH0."
                .into(),
            "not.a.token".into(),
        ];
        for t in &cases {
            let h = with(&[
                ("authorization", &format!("Bearer {t}")),
                ("x-account-id", "alice"),
            ]);
            assert_eq!(
                sources(OnInvalid::Guest).identify(&h, true, NOW),
                Caller::Guest,
                "{t}"
            );
            assert!(
                matches!(
                    sources(OnInvalid::Reject).identify(&h, true, NOW),
                    Caller::Rejected(_)
                ),
                "{t}"
            );
        }
        // Within the leeway an expired token still counts.
        let t = token(
            Algorithm::HS256,
            &good,
            serde_json::json!({"sub": "a", "exp": NOW - 10}),
        );
        let h = with(&[("authorization", &format!("Bearer {t}"))]);
        assert_eq!(
            sources(OnInvalid::Reject).identify(&h, false, NOW),
            Caller::Account("jwt:a".into())
        );
    }

    #[test]
    fn an_account_header_counts_only_from_a_trusted_proxy() {
        let s = sources(OnInvalid::Guest);
        let h = with(&[("x-account-id", "school-42")]);
        assert_eq!(
            s.identify(&h, true, NOW),
            Caller::Account("hdr:school-42".into())
        );
        assert_eq!(s.identify(&h, false, NOW), Caller::Guest);
        let two = with(&[("x-account-id", "a"), ("x-account-id", "b")]);
        assert_eq!(s.identify(&two, true, NOW), Caller::Guest);
        let blank = with(&[("x-account-id", "  ")]);
        assert_eq!(s.identify(&blank, true, NOW), Caller::Guest);
    }

    #[test]
    fn an_api_key_is_kept_as_its_hash() {
        let s = sources(OnInvalid::Guest);
        let h = with(&[("x-api-key", "sk_live_secret")]);
        let Caller::Account(a) = s.identify(&h, false, NOW) else {
            panic!("no account")
        };
        assert!(a.starts_with("key:") && !a.contains("sk_live"), "{a}");
        // Basic credentials are not a bearer token.
        let h = with(&[("authorization", "Basic dXNlcjpwYXNz")]);
        assert_eq!(s.identify(&h, false, NOW), Caller::Guest);
    }

    /// An Ed25519 key pair made for these tests (`openssl genpkey
    /// -algorithm ed25519`): the PKCS#8 private key, and its JWK.
    const ED_PRIVATE: &str = "MC4CAQAwBQYDK2VwBCIEIKyTLbLE9mW4C4K/kZgXUQU1JvRGMeNk32CNeEJ6nctc";
    const ED_JWKS: &str = r#"{"keys": [
        {"kty": "OKP", "crv": "Ed25519", "alg": "EdDSA", "kid": "k1", "use": "sig",
         "x": "sS5pa11a16UZHcRO-9N5bOE2jS-3vWaZuUlU7p3orpE"},
        {"kty": "OKP", "crv": "Ed25519", "alg": "EdDSA", "kid": "k2",
         "x": "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"}
    ]}"#;

    fn ed_token(kid: Option<&str>, claims: serde_json::Value) -> String {
        let der = base64_decode(ED_PRIVATE);
        let mut header = Header::new(Algorithm::EdDSA);
        header.kid = kid.map(str::to_owned);
        jsonwebtoken::encode(&header, &claims, &EncodingKey::from_ed_der(&der)).expect("test value")
    }

    fn base64_decode(s: &str) -> Vec<u8> {
        const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = Vec::new();
        let (mut acc, mut bits) = (0u32, 0);
        for c in s.bytes().filter(|c| *c != b'=') {
            let v = A.iter().position(|a| *a == c).expect("base64") as u32;
            acc = (acc << 6) | v;
            bits += 6;
            if bits >= 8 {
                bits -= 8;
                out.push((acc >> bits) as u8);
            }
        }
        out
    }

    #[test]
    fn a_jwks_key_is_chosen_by_kid_and_its_algorithm_is_the_keys() {
        let s = AccountSources {
            jwt: Some(JwtSource {
                header: http::header::AUTHORIZATION,
                keys: JwtKeys::jwks(ED_JWKS).expect("test value"),
                claim: "uid".into(),
                issuer: Some("https://id.example".into()),
                audience: None,
                leeway: Duration::ZERO,
                on_invalid: OnInvalid::Reject,
            }),
            ..Default::default()
        };
        let ask = |t: String| {
            s.identify(
                &with(&[("authorization", &format!("Bearer {t}"))]),
                false,
                NOW,
            )
        };
        let claims = serde_json::json!({"uid": 42, "iss": "https://id.example", "exp": NOW + 60});
        assert_eq!(
            ask(ed_token(Some("k1"), claims.clone())),
            Caller::Account("jwt:42".into())
        );
        // Signed by k1's key but naming k2, or a kid nobody knows.
        assert!(matches!(
            ask(ed_token(Some("k2"), claims.clone())),
            Caller::Rejected(_)
        ));
        assert!(matches!(
            ask(ed_token(Some("k9"), claims.clone())),
            Caller::Rejected(_)
        ));
        // Two keys and no kid: which one is not the token's to say.
        assert!(matches!(ask(ed_token(None, claims)), Caller::Rejected(_)));
        // Another issuer, or none.
        let other = serde_json::json!({"uid": 42, "iss": "https://evil.example", "exp": NOW + 60});
        assert!(matches!(
            ask(ed_token(Some("k1"), other)),
            Caller::Rejected(_)
        ));
        let none = serde_json::json!({"uid": 42, "exp": NOW + 60});
        assert!(matches!(
            ask(ed_token(Some("k1"), none)),
            Caller::Rejected(_)
        ));
        // An HS256 token whose "secret" is the public key (the classic
        // algorithm confusion) is refused: the key says EdDSA.
        let confused = jsonwebtoken::encode(
            &{
                let mut h = Header::new(Algorithm::HS256);
                h.kid = Some("k1".into());
                h
            },
            &serde_json::json!({"uid": 1, "iss": "https://id.example", "exp": NOW + 60}),
            &EncodingKey::from_secret(b"sS5pa11a16UZHcRO-9N5bOE2jS-3vWaZuUlU7p3orpE")
                .expect("test value"),
        )
        .expect("test value");
        assert!(matches!(ask(confused), Caller::Rejected(_)));
    }

    #[test]
    fn jwks_files_are_checked_when_loaded() {
        assert!(JwtKeys::jwks("{}").is_err());
        assert!(JwtKeys::jwks(r#"{"keys": []}"#).is_err());
        let hmac = r#"{"keys": [{"kty": "oct", "k": "c2VjcmV0", "alg": "HS256"}]}"#;
        assert!(JwtKeys::jwks(hmac).is_err());
        assert!(JwtKeys::hs256(b"short").is_err());
    }

    proptest::proptest! {
        /// Any header bytes: no panic, and nothing but a guest or a
        /// refusal without a valid signature.
        #[test]
        fn junk_tokens_never_become_accounts(raw in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            let s = sources(OnInvalid::Guest);
            if let Ok(v) = HeaderValue::from_bytes(&raw) {
                let mut h = HeaderMap::new();
                h.insert(http::header::AUTHORIZATION, v.clone());
                proptest::prop_assert_eq!(s.identify(&h, false, NOW), Caller::Guest);
                let mut h = HeaderMap::new();
                h.insert(http::header::AUTHORIZATION, HeaderValue::from_bytes(&[b"Bearer ".as_slice(), &raw].concat()).unwrap_or(v));
                proptest::prop_assert_eq!(s.identify(&h, false, NOW), Caller::Guest);
            }
        }
    }
}
