//! The instance's one multiplexed Redis connection: connected lazily in the
//! background (corral starts and serves while Redis is down), reconnected by
//! the ConnectionManager, every command under a deadline, and a circuit
//! breaker that skips Redis after repeated failures. A Redis failure here is
//! an `L2Error` for the caller to fall back on, never a client error.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, FromRedisValue, Script};

use crate::cluster::breaker::Breaker;
use crate::config::RedisConfig;
use crate::telemetry::metrics;

/// Why a Redis operation did not happen.
#[derive(Debug, thiserror::Error)]
pub enum L2Error {
    #[error("the Redis circuit breaker is open")]
    BreakerOpen,
    #[error("not connected to Redis yet")]
    NotConnected,
    #[error("Redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("Redis error: {0}")]
    Redis(#[from] redis::RedisError),
}

/// The shared connection and its guards.
pub struct RedisLink {
    client: redis::Client,
    conn: RwLock<Option<ConnectionManager>>,
    pub op_timeout: Duration,
    connect_timeout: Duration,
    breaker: Breaker,
}

impl RedisLink {
    pub fn new(config: &RedisConfig) -> Result<Arc<Self>, redis::RedisError> {
        // rediss:// verifies Redis's certificate against the platform's
        // roots, or redis.tls.ca_file; redis.tls may add a client
        // certificate. rustls with ring, as for https upstreams.
        let client = match &config.tls {
            Some(tls) => redis::Client::build_with_tls(
                config.url.as_str(),
                redis::TlsCertificates {
                    client_tls: tls.client_cert_and_key.as_ref().map(|(cert, key)| {
                        redis::ClientTlsConfig {
                            client_cert: cert.clone(),
                            client_key: key.clone(),
                        }
                    }),
                    root_cert: tls.ca.clone(),
                },
            )?,
            None => redis::Client::open(config.url.as_str())?,
        };
        Ok(Arc::new(RedisLink {
            client,
            conn: RwLock::new(None),
            op_timeout: config.op_timeout,
            connect_timeout: config.connect_timeout,
            breaker: Breaker::new(config.breaker_failures, config.breaker_open_for),
        }))
    }

    pub fn client(&self) -> &redis::Client {
        &self.client
    }

    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// Connects in the background, retrying with backoff until it succeeds;
    /// the ConnectionManager reconnects by itself after that.
    pub fn start(self: &Arc<Self>) {
        let link = Arc::clone(self);
        tokio::spawn(async move {
            let mut retry = Reconnect::new();
            loop {
                let cfg = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(link.connect_timeout))
                    .set_response_timeout(Some(link.op_timeout.max(Duration::from_millis(10)) * 20))
                    .set_number_of_retries(2)
                    .set_max_delay(Duration::from_millis(500));
                let attempt = tokio::time::timeout(
                    link.connect_timeout * 2,
                    ConnectionManager::new_with_config(link.client.clone(), cfg),
                )
                .await;
                match attempt {
                    Ok(Ok(m)) => {
                        *link
                            .conn
                            .write()
                            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(m);
                        tracing::info!("connected to Redis");
                        return;
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "cannot connect to Redis yet; serving without it")
                    }
                    Err(_) => tracing::warn!("connecting to Redis timed out; serving without it"),
                }
                retry.wait().await;
            }
        });
    }

    /// Whether the breaker is open now, and how often it opened.
    pub fn breaker_state(&self) -> (bool, u64) {
        (
            self.breaker.state() == crate::cluster::breaker::BreakerState::Open,
            self.breaker.opened_count(),
        )
    }

    pub fn is_connected(&self) -> bool {
        self.conn
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some()
    }

    /// For /readyz: connected, connecting or breaker-open.
    pub fn status(&self) -> &'static str {
        if !self.is_connected() {
            "connecting"
        } else if self.breaker_state().0 {
            "breaker-open"
        } else {
            "connected"
        }
    }

    fn connection(&self) -> Result<ConnectionManager, L2Error> {
        if !self.breaker.allow() {
            metrics::redis_error("breaker_open");
            return Err(L2Error::BreakerOpen);
        }
        let conn = self
            .conn
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        match conn {
            Some(c) => Ok(c),
            None => {
                self.breaker.failure();
                metrics::redis_error("not_connected");
                Err(L2Error::NotConnected)
            }
        }
    }

    fn settle<T>(
        &self,
        r: Result<Result<T, redis::RedisError>, tokio::time::error::Elapsed>,
    ) -> Result<T, L2Error> {
        match r {
            Ok(Ok(v)) => {
                self.breaker.success();
                Ok(v)
            }
            Ok(Err(e)) => {
                self.breaker.failure();
                metrics::redis_error("error");
                Err(L2Error::Redis(e))
            }
            Err(_) => {
                self.breaker.failure();
                metrics::redis_error("timeout");
                Err(L2Error::Timeout(self.op_timeout))
            }
        }
    }

    /// Runs one command under the deadline.
    pub async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, L2Error> {
        let mut conn = self.connection()?;
        let r = tokio::time::timeout(self.op_timeout, cmd.query_async(&mut conn)).await;
        self.settle(r)
    }

    /// Runs a Lua script under the deadline; `args` are already encoded
    /// (see [`arg`]).
    pub async fn script<T: FromRedisValue>(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[Vec<u8>],
    ) -> Result<T, L2Error> {
        let mut conn = self.connection()?;
        let mut inv = script.prepare_invoke();
        for k in keys {
            inv.key(*k);
        }
        for a in args {
            inv.arg(a.as_slice());
        }
        let r = tokio::time::timeout(self.op_timeout, inv.invoke_async(&mut conn)).await;
        self.settle(r)
    }
}

/// One script argument, encoded as Redis expects.
pub fn arg(v: impl std::fmt::Display) -> Vec<u8> {
    v.to_string().into_bytes()
}

/// The pause between attempts to reach Redis (the command connection and
/// the subscriber alike): 100 ms, doubling to 500 ms, back to 100 ms after
/// a success.
pub struct Reconnect {
    next: Duration,
}

impl Reconnect {
    const FIRST: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_millis(500);

    pub fn new() -> Self {
        Reconnect { next: Self::FIRST }
    }

    /// Sleeps the current pause and lengthens the next one.
    pub async fn wait(&mut self) {
        tokio::time::sleep(self.next).await;
        self.next = (self.next * 2).min(Self::MAX);
    }

    pub fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}
