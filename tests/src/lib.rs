//! End-to-end harness for corral: a scripted origin, real `corral` processes, a
//! real `redis-server` and HTTP clients, in the style of linkerd2's integration crate.
//!
//! Nothing here reaches into the proxy's code: every assertion goes through the
//! wire, the way an operator would observe corral.

pub mod cache_status;
pub mod check;
pub mod client;
pub mod clock_skew;
pub mod command;
pub mod config;
pub mod fault_proxy;
pub mod fd_limit;
pub mod h2_client;
pub mod origin;
pub mod paths;
pub mod ports;
pub mod proxy;
pub mod raw;
pub mod raw_origin;
pub mod redis_deployments;
pub mod redis_server;
pub mod reply;
pub mod shared;
pub mod temp;
pub mod tls;
pub mod twins;
pub mod wait;

pub use cache_status::CacheStatus;
pub use check::{CheckOutcome, corral_check, corral_check_file};
pub use client::{Answer, Client, assert_every_answer, tally};
pub use config::{Config, Route};
pub use origin::{Origin, OriginMode, RunningOrigin, SeenRequest};
pub use proxy::{Proxy, RunningProxy};
pub use raw::{
    RawAnswer, RawResponse, exchange, exchange_bytes, exchange_full, send_as_slow_reader,
};
pub use raw_origin::{RawOrigin, RawRequest};
pub use redis_deployments::{Keyspace, RedisCluster, RedisSentinels};
pub use redis_server::Redis;
pub use reply::Reply;
pub use wait::{DEADLINE, eventually};

/// Where corral takes its fleet key from when `redis.auth_key_file` is not set.
pub const REDIS_AUTH_KEY_ENV: &str = "CORRAL_REDIS_AUTH_KEY";

/// The key every proxy the harness starts (and every `corral check` it
/// runs) is given: a config with `redis:` needs one.
pub const REDIS_AUTH_KEY: &str = "corral-tests-fleet-key-0123456789abcdef";

/// `summary` sealed as an instance holding [`REDIS_AUTH_KEY`] writes its
/// heartbeat under `instance`: what a test plants to play a (compromised
/// or buggy) member of the fleet rather than an outsider.
pub fn sealed_heartbeat(instance: &str, summary: &str) -> String {
    use corral_core::callers::peer_auth::{PeerAuth, PeerKey, Record};
    let key = PeerKey::new(REDIS_AUTH_KEY.as_bytes()).expect("the test key is long enough");
    PeerAuth::Key(key).seal_text(Record::Heartbeat, instance, summary)
}
pub mod lifecycle;
pub use lifecycle::{Exit, Signal};
