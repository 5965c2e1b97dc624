//! The config file exactly as written: a serde mirror of the YAML with source positions.
//! It refuses unknown fields and wrong shapes but never interprets or defaults a value;
//! `resolve` does that, so every semantic error can name its line and field.
//!
//! Required fields are `Option` here on purpose: `resolve` reports them missing with
//! the position of the section that lacks them (all of them in one run), and fills
//! the defaults of the rest.

use serde::Deserialize;
use serde_saphyr::Spanned;

/// A scalar kept as its text, with where it was written.
pub type Text = Spanned<String>;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub listen: Option<Text>,
    pub listen_tls: Option<Spanned<RawListenTls>>,
    pub admin: Option<Text>,
    pub health_listen: Option<Text>,
    pub server: Option<RawServer>,
    pub cache: Option<Spanned<RawCache>>,
    pub redis: Option<Spanned<RawRedis>>,
    pub callers: Option<Spanned<RawCallers>>,
    pub limits: Option<Spanned<Vec<Spanned<RawLimit>>>>,
    pub routes: Option<Spanned<Vec<Spanned<RawRoute>>>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCallers {
    pub account: Option<Spanned<RawAccount>>,
    pub local_buckets: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAccount {
    pub jwt: Option<Spanned<RawJwt>>,
    pub header: Option<Text>,
    pub api_key_header: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawJwt {
    pub header: Option<Text>,
    pub hs256_secret_file: Option<Text>,
    pub jwks_file: Option<Text>,
    pub claim: Option<Text>,
    pub issuer: Option<Text>,
    pub audience: Option<Text>,
    pub leeway: Option<Text>,
    pub on_invalid: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawListenTls {
    pub addr: Option<Text>,
    pub cert_file: Option<Text>,
    pub key_file: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHealth {
    pub max_fails: Option<Text>,
    pub fail_timeout: Option<Text>,
    pub check_path: Option<Text>,
    pub check_interval: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    pub ca_file: Option<Text>,
    pub client_cert: Option<Text>,
    pub client_key: Option<Text>,
    pub server_name: Option<Text>,
    pub insecure_skip_verify: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimit {
    pub name: Option<Text>,
    pub key: Option<Text>,
    pub rate: Option<Text>,
    pub burst: Option<Text>,
    pub count_hits: Option<bool>,
    pub ipv4_prefix: Option<Text>,
    pub ipv6_prefix: Option<Text>,
    pub on_redis_down: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    pub header_read_timeout: Option<Text>,
    pub idle_timeout: Option<Text>,
    pub send_timeout: Option<Text>,
    pub min_send_rate: Option<Text>,
    pub max_connections: Option<Text>,
    pub max_header_size: Option<Text>,
    pub shutdown_grace: Option<Text>,
    pub drain_period: Option<Text>,
    pub purge_token: Option<Text>,
    pub admin_token: Option<Text>,
    pub admin_hosts: Option<Vec<Text>>,
    pub trusted_proxies: Option<Vec<Text>>,
    pub trusted_header: Option<Text>,
    pub listen_proxy_protocol: Option<bool>,
    pub runtime: Option<Text>,
    pub workers: Option<Text>,
    pub cpu_threads: Option<Text>,
    pub overload: Option<Text>,
    pub proxy_name: Option<Text>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCache {
    pub memory: Option<Text>,
    pub max_object_size: Option<Text>,
    pub fill_memory: Option<Text>,
    pub post_memory: Option<Text>,
    pub max_fills: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRedis {
    pub url: Option<Text>,
    pub cluster: Option<Spanned<Vec<Text>>>,
    pub sentinel: Option<Spanned<RawSentinel>>,
    pub op_timeout: Option<Text>,
    pub connect_timeout: Option<Text>,
    pub lease_ttl: Option<Text>,
    pub lease_window: Option<Text>,
    pub key_prefix: Option<Text>,
    pub l2_max_object_size: Option<Text>,
    pub breaker: Option<RawBreaker>,
    pub instances: Option<Text>,
    pub resync_rate: Option<Text>,
    pub tls: Option<Spanned<RawRedisTls>>,
    pub auth: Option<Text>,
    pub auth_key_file: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSentinel {
    pub master: Option<Text>,
    pub nodes: Option<Spanned<Vec<Text>>>,
    pub username: Option<Text>,
    pub password: Option<Text>,
    pub db: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRedisTls {
    pub ca_file: Option<Text>,
    pub client_cert: Option<Text>,
    pub client_key: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBreaker {
    pub failures: Option<Text>,
    pub open_for: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    pub name: Option<Text>,
    #[serde(rename = "match")]
    pub matcher: Option<RawMatch>,
    pub upstream: Option<Text>,
    pub upstreams: Option<Spanned<Vec<Text>>>,
    pub balance: Option<Text>,
    pub health: Option<RawHealth>,
    pub timeouts: Option<RawTimeouts>,
    pub cache: Option<RawRouteCache>,
    pub coalesce: Option<RawCoalesce>,
    pub backoff: Option<RawBackoff>,
    pub circuit: Option<RawCircuit>,
    pub limits: Option<Spanned<Vec<Spanned<RawLimit>>>>,
    pub tls: Option<Spanned<RawTls>>,
    pub upstream_http2: Option<bool>,
    pub upstream_concurrency: Option<Text>,
    pub upstream_queue_timeout: Option<Text>,
    pub compression: Option<Spanned<RawCompression>>,
    pub underscores_in_headers: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCompression {
    pub encodings: Option<Vec<Text>>,
    pub min_size: Option<Text>,
    pub types: Option<Vec<Text>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMatch {
    pub host: Option<Text>,
    pub path_prefix: Option<Text>,
    pub case_sensitive: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTimeouts {
    pub connect: Option<Text>,
    pub response_headers: Option<Text>,
    pub total: Option<Text>,
    pub stale_after: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRouteCache {
    pub enabled: Option<bool>,
    pub default_ttl: Option<Text>,
    pub heuristic_freshness: Option<bool>,
    pub stale_while_revalidate: Option<RawStaleWindow>,
    pub stale_if_error: Option<RawStaleWindow>,
    pub stale_max_ratio: Option<Text>,
    pub ttl_jitter: Option<Text>,
    pub early_refresh_beta: Option<Text>,
    pub ignore_query: Option<Vec<Text>>,
    pub no_vary_search: Option<bool>,
    pub sort_query: Option<bool>,
    pub identity: Option<RawIdentity>,
    pub store_set_cookie: Option<bool>,
    pub hit_for_pass: Option<Text>,
    pub targeted_fields: Option<Vec<Text>>,
    pub post: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStaleWindow {
    pub default: Option<Text>,
    pub max: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawIdentity {
    pub headers: Option<Vec<Text>>,
    pub cookies: Option<Vec<Text>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCoalesce {
    pub enabled: Option<bool>,
    pub lock_timeout: Option<Text>,
    pub on_timeout: Option<Text>,
    pub max_fills: Option<Text>,
    pub max_waiters: Option<Text>,
    pub lock_age: Option<Text>,
    pub post: Option<RawCoalescePost>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCoalescePost {
    pub max_body: Option<Text>,
    pub read_timeout: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBackoff {
    pub min: Option<Text>,
    pub max: Option<Text>,
    pub after: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCircuit {
    pub enabled: Option<bool>,
    pub error_rate: Option<Text>,
    pub min_fetches: Option<Text>,
    pub window: Option<Text>,
    pub open_for: Option<Text>,
}
