//! The instance's one multiplexed Redis connection: connected lazily in the
//! background (corral starts and serves while Redis is down), reconnected by
//! the ConnectionManager (one node, or the master Sentinel names) or the
//! cluster client (a Redis/Valkey Cluster), every command under a deadline,
//! and a circuit breaker that skips Redis after repeated failures. A Redis
//! failure here is an `L2Error` for the caller to fall back on, never a
//! client error.
//!
//! - `redis.url`: one node; the subscriber has its own pub/sub connection.
//! - `redis.cluster`: a cluster client over every primary, speaking RESP3 so
//!   that the same connections carry the subscriber's pushes (sharded
//!   pub/sub for fill notices, resubscribed by the client after a failover
//!   or a slot move).
//! - `redis.sentinel`: the sentinels are asked for the master at start and
//!   every [`SENTINEL_CHECK`]; when they name another one, the connection
//!   moves to it (after `ROLE` confirms it is a master) and the subscriber
//!   reconnects there.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use tokio::time::Instant;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, FromRedisValue, PushInfo, RedisFuture, Script, Value};
use tokio::sync::{mpsc, watch};

use crate::cluster::breaker::{Breaker, BreakerState};
use crate::cluster::shards::{self, ShardBreakers};
use crate::config::{RedisConfig, RedisServers, RedisTls, SentinelConfig};
use crate::telemetry::{metrics, repeats};

/// How often the sentinels are asked which node is the master.
pub const SENTINEL_CHECK: Duration = Duration::from_millis(500);

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

impl L2Error {
    /// Redis refused a write because it is full (`OOM`).
    pub fn is_full(&self) -> bool {
        matches!(self, L2Error::Redis(e) if e.code() == Some("OOM"))
    }
}

/// The command connection, whichever way Redis is deployed.
#[derive(Clone)]
pub enum Conn {
    Node(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Node(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Node(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Node(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// How to reach Redis.
enum Target {
    Node(redis::Client),
    Cluster(Box<ClusterClient>),
    Sentinel(Sentinel),
}

/// The sentinels and what the master is reached with.
struct Sentinel {
    master: String,
    sentinels: Vec<redis::Client>,
    /// One connection per sentinel, kept between checks.
    held: Mutex<Vec<Option<redis::aio::MultiplexedConnection>>>,
    /// A sentinel said it does not know `master` (logged once).
    unknown_logged: AtomicBool,
    tls: Option<RedisTls>,
    use_tls: bool,
    settings: redis::RedisConnectionInfo,
}

/// The shared connection and its guards.
pub struct RedisLink {
    target: Target,
    conn: RwLock<Option<Conn>>,
    /// The client of the node the subscriber connects to: the one node, or
    /// the master Sentinel named last. `None` in cluster mode.
    node: RwLock<Option<redis::Client>>,
    /// Bumped on every (re)connection that the subscriber must follow: the
    /// cluster connection is ready, or Sentinel named another master.
    epoch: watch::Sender<u64>,
    /// Cluster mode: the pushes (messages, disconnections) the subscriber
    /// reads.
    pushes: Mutex<Option<mpsc::UnboundedReceiver<PushInfo>>>,
    /// Cluster mode: the servers have sharded pub/sub (Redis 7, Valkey 7.2).
    sharded: AtomicBool,
    pub op_timeout: Duration,
    connect_timeout: Duration,
    /// The link's breaker: every command of one node or Sentinel, and a
    /// cluster's commands whose slot is not mapped yet.
    breaker: Arc<Breaker>,
    /// Cluster mode: one breaker per primary.
    shards: Option<ShardBreakers>,
    /// When Redis last refused a write because it is full (`OOM`), and
    /// how long entry writes pause after it (`breaker.open_for`).
    full: Mutex<Option<Instant>>,
    full_pause: Duration,
    /// Redis answered the last command (any answer, even an error reply);
    /// false after a timeout or a dropped connection. A connection kept
    /// while Redis is gone still looks open: this says whether it works.
    answering: AtomicBool,
    /// How far Redis's clock reads ahead of this host's, in ms, as the
    /// last heartbeat measured it (0 until then): the shared clock the
    /// instants other instances read are written on.
    clock_shift: AtomicI64,
}

/// A full Redis is logged again only after this long without a refusal.
const FULL_LOG_EVERY: Duration = Duration::from_secs(60);

/// A client for `url` with `redis.tls`'s certificates when set.
fn client_for(
    url: impl redis::IntoConnectionInfo,
    tls: Option<&RedisTls>,
) -> redis::RedisResult<redis::Client> {
    match tls {
        Some(tls) => redis::Client::build_with_tls(url, certificates(tls)),
        None => redis::Client::open(url),
    }
}

fn certificates(tls: &RedisTls) -> redis::TlsCertificates {
    redis::TlsCertificates {
        client_tls: tls
            .client_cert_and_key
            .as_ref()
            .map(|(cert, key)| redis::ClientTlsConfig {
                client_cert: cert.clone(),
                client_key: key.clone(),
            }),
        root_cert: tls.ca.clone(),
    }
}

impl RedisLink {
    pub fn new(config: &RedisConfig) -> Result<Arc<Self>, redis::RedisError> {
        // rediss:// verifies Redis's certificate against the platform's
        // roots, or redis.tls.ca_file; redis.tls may add a client
        // certificate. rustls with ring, as for https upstreams.
        let tls = config.tls.as_ref();
        let mut pushes = None;
        let target = match &config.servers {
            RedisServers::Node(url) => Target::Node(client_for(url.as_str(), tls)?),
            RedisServers::Cluster(seeds) => {
                let (tx, rx) = mpsc::unbounded_channel();
                pushes = Some(rx);
                let mut builder = ClusterClient::builder(seeds.iter().map(String::as_str))
                    .connection_timeout(config.connect_timeout)
                    .response_timeout(config.op_timeout.max(Duration::from_millis(10)) * 20)
                    // Redirects and TRYAGAIN are retried twice within
                    // a fraction of the command's deadline (the client's
                    // default waits over a second, past any op_timeout).
                    .retries(2)
                    .min_retry_wait(1)
                    .max_retry_wait(
                        u64::try_from(config.op_timeout.as_millis() / 4)
                            .unwrap_or(u64::MAX)
                            .max(2),
                    )
                    .use_protocol(redis::ProtocolVersion::RESP3)
                    .push_sender(tx);
                if let Some(tls) = tls {
                    builder = builder.certs(certificates(tls));
                }
                Target::Cluster(Box::new(builder.build()?))
            }
            RedisServers::Sentinel(s) => Target::Sentinel(Sentinel::new(s, tls)?),
        };
        let node = match &target {
            Target::Node(client) => Some(client.clone()),
            _ => None,
        };
        let shards = matches!(target, Target::Cluster(_))
            .then(|| ShardBreakers::new(config.breaker_failures, config.breaker_open_for));
        Ok(Arc::new(RedisLink {
            target,
            conn: RwLock::new(None),
            node: RwLock::new(node),
            epoch: watch::channel(0).0,
            pushes: Mutex::new(pushes),
            sharded: AtomicBool::new(false),
            op_timeout: config.op_timeout,
            connect_timeout: config.connect_timeout,
            breaker: Arc::new(Breaker::named(
                config.breaker_failures,
                config.breaker_open_for,
                &shown_servers(&config.servers),
            )),
            shards,
            full: Mutex::new(None),
            full_pause: config.breaker_open_for,
            answering: AtomicBool::new(false),
            clock_shift: AtomicI64::new(0),
        }))
    }

    /// How Redis's clock stands to this host's (see [`RedisLink::observe_clock`]).
    pub fn clock_shift(&self) -> corral_core::ClockShift {
        corral_core::ClockShift(self.clock_shift.load(Ordering::Relaxed))
    }

    /// Records Redis's clock, `redis_ms` (ms since the epoch, read by a
    /// script's `TIME`), as read by a command sent at `sent` and answered
    /// at `answered` on this host's wall clock: Redis read it halfway, to
    /// within half the round trip.
    pub fn observe_clock(
        &self,
        redis_ms: u64,
        sent: std::time::SystemTime,
        answered: std::time::SystemTime,
    ) {
        let halfway = sent + answered.duration_since(sent).unwrap_or_default() / 2;
        let local = i128::from(crate::cluster::protocol::epoch_millis(halfway));
        let shift = i128::from(redis_ms) - local;
        let shift = i64::try_from(shift).unwrap_or(0);
        self.clock_shift.store(shift, Ordering::Relaxed);
    }

    /// True for a while (`breaker.open_for`) after Redis refused a write
    /// because it is full: entries are not sent to be refused again. Reads,
    /// leases and notices go on.
    pub fn writes_paused(&self) -> bool {
        self.full
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some_and(|at| at.elapsed() < self.full_pause)
    }

    /// The subscriber reconnected and Redis answered it (one node, or the
    /// master Sentinel names): the command breaker need not wait out its
    /// period. A Cluster's breakers are per primary, and one answer says
    /// nothing of the others: they wait.
    pub fn answered_again(&self) {
        if self.shards.is_none() {
            self.breaker.answered_again();
        }
    }

    /// Redis answered `OOM`: it is up, and full. A refused write, not a
    /// failing Redis: it is not held against the breaker (which would stop
    /// reads and leases too), counted as `kind="oom"` and logged once.
    fn refused_full(&self) {
        let mut full = self.full.lock().unwrap_or_else(PoisonError::into_inner);
        if full.is_none_or(|at| at.elapsed() >= FULL_LOG_EVERY) {
            tracing::warn!(
                "Redis refuses writes: it is full (maxmemory with noeviction, or nothing it may evict); entries stay in L1 and are not written to L2 for redis.breaker.open_for at a time; reads, leases and notices go on where Redis takes them"
            );
        }
        *full = Some(Instant::now());
    }

    /// The node the subscriber connects to (`None` in cluster mode, and
    /// until Sentinel has named a master).
    pub fn node_client(&self) -> Option<redis::Client> {
        self.node
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// `node`, `cluster` or `sentinel`, for `/readyz`.
    pub fn mode(&self) -> &'static str {
        match self.target {
            Target::Node(_) => "node",
            Target::Cluster(_) => "cluster",
            Target::Sentinel(_) => "sentinel",
        }
    }

    /// Whether this is a cluster; the subscriber then reads
    /// [`Self::take_pushes`] and subscribes on [`Self::cluster_connection`].
    pub fn is_cluster(&self) -> bool {
        matches!(self.target, Target::Cluster(_))
    }

    /// Whether fill notices go on sharded channels (cluster mode, on a
    /// server that has them).
    pub fn sharded(&self) -> bool {
        self.sharded.load(Ordering::Relaxed)
    }

    /// The cluster connection, once connected.
    pub fn cluster_connection(&self) -> Option<ClusterConnection> {
        match &*self.conn.read().unwrap_or_else(PoisonError::into_inner) {
            Some(Conn::Cluster(c)) => Some(c.clone()),
            _ => None,
        }
    }

    /// The pushes of the cluster connection (once: the subscriber owns them).
    pub fn take_pushes(&self) -> Option<mpsc::UnboundedReceiver<PushInfo>> {
        self.pushes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// Changes whenever the subscriber must (re)connect.
    pub fn epochs(&self) -> watch::Receiver<u64> {
        self.epoch.subscribe()
    }

    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    fn manager_config(&self) -> ConnectionManagerConfig {
        ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(self.op_timeout.max(Duration::from_millis(10)) * 20))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500))
    }

    fn install(&self, conn: Conn) {
        *self.conn.write().unwrap_or_else(PoisonError::into_inner) = Some(conn);
        self.epoch.send_modify(|e| *e += 1);
    }

    /// One attempt to connect, whichever the mode.
    async fn connect(&self) -> Result<(), String> {
        match &self.target {
            Target::Node(client) => {
                let m = ConnectionManager::new_with_config(client.clone(), self.manager_config())
                    .await
                    .map_err(|e| e.to_string())?;
                self.install(Conn::Node(m));
                tracing::info!("connected to Redis");
            }
            Target::Cluster(client) => {
                let mut c = client
                    .get_async_connection()
                    .await
                    .map_err(|e| e.to_string())?;
                let sharded = has_sharded_pubsub(&mut c).await;
                if !sharded {
                    tracing::error!(
                        "this Redis Cluster has no sharded pub/sub (SPUBLISH: Redis 7.0, Valkey 7.2 or newer); \
                         fill notices are off and waiting instances poll for fills"
                    );
                }
                self.sharded.store(sharded, Ordering::Relaxed);
                self.install(Conn::Cluster(c));
                tracing::info!(sharded_pubsub = sharded, "connected to the Redis Cluster");
            }
            Target::Sentinel(s) => {
                let named = s
                    .ask(self.connect_timeout)
                    .await
                    .ok_or_else(|| format!("no sentinel named a master for `{}`", s.master))?;
                self.move_to_master(s, named).await?;
            }
        }
        Ok(())
    }

    /// Connects to the master the sentinels named and makes it the one
    /// every command and the subscriber use.
    async fn move_to_master(&self, s: &Sentinel, named: (String, u16)) -> Result<(), String> {
        let (client, m) = s.connect_master(self, &named).await?;
        *self.node.write().unwrap_or_else(PoisonError::into_inner) = Some(client);
        tracing::info!(master = %s.master, host = %named.0, port = named.1, "connected to the master Sentinel names");
        self.install(Conn::Node(m));
        Ok(())
    }

    /// Connects in the background, retrying with backoff until it succeeds;
    /// the connection reconnects by itself after that (and, with Sentinel,
    /// follows the master).
    pub fn start(self: &Arc<Self>) {
        let link = Arc::clone(self);
        tokio::spawn(async move {
            let mut retry = Reconnect::new();
            loop {
                // Retried every half second while Redis is away: the first
                // failure is logged, the rest counted (`telemetry::repeats`).
                let redis = link.breaker.name();
                let subject = || repeats::Subject::Redis(redis.to_owned());
                match tokio::time::timeout(link.connect_timeout * 2, link.connect()).await {
                    Ok(Ok(())) => {
                        repeats::ended(CANNOT_CONNECT, &subject());
                        repeats::ended(CONNECT_TIMED_OUT, &subject());
                        break;
                    }
                    Ok(Err(e)) => {
                        if repeats::first(CANNOT_CONNECT, subject(), "") {
                            tracing::warn!(redis, error = %e, "{CANNOT_CONNECT}");
                        }
                    }
                    Err(_) => {
                        if repeats::first(CONNECT_TIMED_OUT, subject(), "") {
                            tracing::warn!(redis, "{CONNECT_TIMED_OUT}");
                        }
                    }
                }
                retry.wait().await;
            }
            match link.target {
                Target::Sentinel(_) => link.follow_sentinel().await,
                Target::Cluster(_) => link.follow_slots().await,
                Target::Node(_) => {}
            }
        });
    }

    /// Asks the sentinels for the master every [`SENTINEL_CHECK`] and moves
    /// to the one they name when it changes (a failover).
    async fn follow_sentinel(self: Arc<Self>) {
        let Target::Sentinel(s) = &self.target else {
            return;
        };
        loop {
            tokio::time::sleep(SENTINEL_CHECK).await;
            let Some(named) = s.ask(self.connect_timeout).await else {
                continue;
            };
            // Where the node client (the master followed last) points.
            let current = self
                .node_client()
                .and_then(|c| match c.get_connection_info().addr() {
                    redis::ConnectionAddr::Tcp(host, port)
                    | redis::ConnectionAddr::TcpTls { host, port, .. } => {
                        Some((host.clone(), *port))
                    }
                    _ => None,
                });
            if current.as_ref() == Some(&named) {
                continue;
            }
            match tokio::time::timeout(self.connect_timeout * 2, self.move_to_master(s, named))
                .await
            {
                Ok(Ok(())) => tracing::warn!(
                    master = %s.master,
                    from = ?current,
                    "Sentinel named another master; following it"
                ),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "cannot reach the master Sentinel names yet")
                }
                Err(_) => tracing::warn!("connecting to the master Sentinel names timed out"),
            }
        }
    }

    /// Whether a breaker is open now (the link's, or a cluster primary's),
    /// and how often any opened.
    pub fn breaker_state(&self) -> (bool, u64) {
        let (shards_open, _, shards_opened) = self.shards.as_ref().map_or((0, 0, 0), |s| s.state());
        (
            self.breaker.state() == BreakerState::Open || shards_open > 0,
            self.breaker.opened_count() + shards_opened,
        )
    }

    /// Redis cannot be used now for `key`: not connected, or the breaker
    /// of whatever serves `key` (one node's or Sentinel's master's, or the
    /// Cluster primary that owns the key's slot) is open.
    pub fn unavailable_for(&self, key: &str) -> bool {
        !self.is_connected() || self.breaker_for(Some(key.as_bytes())).state() == BreakerState::Open
    }

    /// On a Cluster: each primary known and whether its breaker is open;
    /// empty elsewhere (one breaker: [`RedisLink::breaker_state`]).
    pub fn shard_breakers(&self) -> Vec<(String, bool)> {
        self.shards
            .as_ref()
            .map_or_else(Vec::new, |s| s.primaries())
    }

    pub fn is_connected(&self) -> bool {
        self.conn
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    /// Connected, and Redis answered the last command sent (the fleet
    /// heartbeat sends one every 2 s): `corral_redis_connected`.
    pub fn is_answering(&self) -> bool {
        self.is_connected() && self.answering.load(Ordering::Relaxed)
    }

    /// For /readyz: connected, connecting or breaker-open (the link's
    /// breaker, or every primary's; some open is still `connected`, the
    /// metrics tell).
    pub fn status(&self) -> &'static str {
        let all_shards_open = self
            .shards
            .as_ref()
            .is_some_and(|s| matches!(s.state(), (open, known, _) if known > 0 && open == known));
        if !self.is_connected() {
            "connecting"
        } else if self.breaker.state() == BreakerState::Open || all_shards_open {
            "breaker-open"
        } else {
            "connected"
        }
    }

    /// The breaker that guards a command on `key` (its first key).
    fn breaker_for(&self, key: Option<&[u8]>) -> Arc<Breaker> {
        match (&self.shards, key) {
            (Some(shards), Some(key)) => shards
                .for_key(key)
                .unwrap_or_else(|| Arc::clone(&self.breaker)),
            _ => Arc::clone(&self.breaker),
        }
    }

    fn connection(&self, breaker: &Breaker) -> Result<Conn, L2Error> {
        if !breaker.allow() {
            metrics::redis_error(metrics::RedisFailure::BreakerOpen);
            return Err(L2Error::BreakerOpen);
        }
        let conn = self
            .conn
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        match conn {
            Some(c) => Ok(c),
            None => {
                breaker.failure();
                metrics::redis_error(metrics::RedisFailure::NotConnected);
                Err(L2Error::NotConnected)
            }
        }
    }

    fn settle<T>(
        &self,
        breaker: &Breaker,
        r: Result<Result<T, redis::RedisError>, tokio::time::error::Elapsed>,
    ) -> Result<T, L2Error> {
        match r {
            Ok(Ok(v)) => {
                breaker.success();
                self.answering.store(true, Ordering::Relaxed);
                Ok(v)
            }
            // A cluster moving the slot of this request's keys: healthy,
            // just not able to answer this one now. The request goes on
            // without Redis; the breaker is no verdict on a resharding.
            Ok(Err(e))
                if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::TryAgain) =>
            {
                metrics::redis_error(metrics::RedisFailure::TryAgain);
                Err(L2Error::Redis(e))
            }
            Ok(Err(e)) if e.code() == Some("OOM") => {
                breaker.success();
                metrics::redis_error(metrics::RedisFailure::Oom);
                self.refused_full();
                Err(L2Error::Redis(e))
            }
            Ok(Err(e)) => {
                breaker.failure();
                // A reply (an error one) is Redis answering; a connection
                // lost or refused is not.
                let gone = e.is_io_error()
                    || e.is_connection_dropped()
                    || e.is_connection_refusal()
                    || e.is_timeout();
                self.answering.store(!gone, Ordering::Relaxed);
                metrics::redis_error(metrics::RedisFailure::Error);
                Err(L2Error::Redis(e))
            }
            Err(_) => {
                self.answering.store(false, Ordering::Relaxed);
                breaker.failure();
                metrics::redis_error(metrics::RedisFailure::Timeout);
                Err(L2Error::Timeout(self.op_timeout))
            }
        }
    }

    /// Reads the cluster's slot map into the per-primary breakers now and
    /// every [`shards::REFRESH`] (a failover or a resharding changes it).
    async fn follow_slots(self: Arc<Self>) {
        let Some(shards) = &self.shards else {
            return;
        };
        loop {
            let conn = self
                .conn
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            if let Some(mut conn) = conn {
                let answer = tokio::time::timeout(
                    self.op_timeout * 4,
                    redis::cmd("CLUSTER")
                        .arg("SLOTS")
                        .query_async::<Value>(&mut conn),
                )
                .await;
                if let Ok(Ok(answer)) = answer {
                    let ranges = shards::parse_slots(&answer);
                    if !ranges.is_empty() {
                        shards.update(ranges);
                    }
                }
            }
            tokio::time::sleep(shards::REFRESH).await;
        }
    }

    /// Runs one command under the deadline.
    /// On a cluster, the breaker is that of the primary serving the
    /// command's first argument (its key, or a sharded channel).
    pub async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, L2Error> {
        let key = match cmd.args_iter().nth(1) {
            Some(redis::Arg::Simple(k)) if self.shards.is_some() => Some(k),
            _ => None,
        };
        let breaker = self.breaker_for(key);
        let mut conn = self.connection(&breaker)?;
        let r = tokio::time::timeout(self.op_timeout, cmd.query_async(&mut conn)).await;
        self.settle(&breaker, r)
    }

    /// Runs a Lua script under the deadline; `args` are already encoded
    /// (see [`arg`]).
    pub async fn script<T: FromRedisValue>(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[Vec<u8>],
    ) -> Result<T, L2Error> {
        let breaker = self.breaker_for(keys.first().map(|k| k.as_bytes()));
        let mut conn = self.connection(&breaker)?;
        let mut inv = script.prepare_invoke();
        for k in keys {
            inv.key(*k);
        }
        for a in args {
            inv.arg(a.as_slice());
        }
        let r = tokio::time::timeout(self.op_timeout, inv.invoke_async(&mut conn)).await;
        self.settle(&breaker, r)
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

const CANNOT_CONNECT: &str = "cannot connect to Redis yet; serving without it";
const CONNECT_TIMED_OUT: &str = "connecting to Redis timed out; serving without it";

/// The Redis servers as log lines name them: `host:port` (several for a
/// cluster's seeds, the master's name for Sentinel), never the URL's
/// credentials or database.
pub fn shown_servers(servers: &RedisServers) -> String {
    fn host_port(url: &str) -> &str {
        let rest = url.split_once("://").map_or(url, |(_, r)| r);
        let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
        rest.split(['/', '?']).next().unwrap_or(rest)
    }
    match servers {
        RedisServers::Node(url) => host_port(url).to_owned(),
        RedisServers::Cluster(seeds) => seeds
            .iter()
            .map(|s| host_port(s))
            .collect::<Vec<_>>()
            .join(","),
        RedisServers::Sentinel(s) => format!("sentinel master {}", s.master),
    }
}

/// Whether the server knows `SPUBLISH` (`COMMAND INFO` answers nil for a
/// command it does not have).
async fn has_sharded_pubsub(conn: &mut ClusterConnection) -> bool {
    let answer: redis::RedisResult<Value> = redis::cmd("COMMAND")
        .arg("INFO")
        .arg("SPUBLISH")
        .query_async(conn)
        .await;
    match answer {
        Ok(Value::Array(items)) => items.first().is_some_and(|v| !matches!(v, Value::Nil)),
        _ => false,
    }
}

impl Sentinel {
    fn new(config: &SentinelConfig, tls: Option<&RedisTls>) -> redis::RedisResult<Self> {
        let sentinels = config
            .nodes
            .iter()
            .map(|url| client_for(url.as_str(), tls))
            .collect::<redis::RedisResult<Vec<_>>>()?;
        let mut settings = redis::RedisConnectionInfo::default().set_db(config.db);
        if let Some(user) = &config.username {
            settings = settings.set_username(user);
        }
        if let Some(password) = &config.password {
            settings = settings.set_password(password);
        }
        Ok(Sentinel {
            master: config.master.clone(),
            held: Mutex::new(vec![None; sentinels.len()]),
            unknown_logged: AtomicBool::new(false),
            sentinels,
            tls: tls.cloned(),
            use_tls: config
                .nodes
                .first()
                .is_some_and(|u| u.starts_with("rediss://")),
            settings,
        })
    }

    /// The master's address, as most of the sentinels that answer within
    /// `within` name it (all are asked at once, so a dead or unreachable
    /// sentinel costs no more than the deadline; a stale one is outvoted).
    async fn ask(&self, within: Duration) -> Option<(String, u16)> {
        let answers = futures_util::future::join_all(
            (0..self.sentinels.len()).map(|i| self.ask_one(i, within)),
        )
        .await;
        let mut votes: Vec<((String, u16), usize)> = Vec::new();
        for addr in answers.into_iter().flatten() {
            match votes.iter_mut().find(|(a, _)| *a == addr) {
                Some((_, n)) => *n += 1,
                None => votes.push((addr, 1)),
            }
        }
        // The most named; on a tie, the one the first answering sentinel named.
        let most = votes.iter().map(|(_, n)| *n).max()?;
        votes.into_iter().find(|(_, n)| *n == most).map(|(a, _)| a)
    }

    /// One sentinel's answer, on the connection kept for it.
    async fn ask_one(&self, i: usize, within: Duration) -> Option<(String, u16)> {
        let held = self.held.lock().unwrap_or_else(PoisonError::into_inner)[i].clone();
        let sentinel = &self.sentinels[i];
        let answer = tokio::time::timeout(within, async {
            let mut c = match held {
                Some(c) => c,
                None => sentinel.get_multiplexed_async_connection().await?,
            };
            let named = redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg(&self.master)
                .query_async::<Option<(String, u16)>>(&mut c)
                .await?;
            Ok::<_, redis::RedisError>((named, c))
        })
        .await;
        let kept = match &answer {
            Ok(Ok((_, c))) => Some(c.clone()),
            _ => None,
        };
        self.held.lock().unwrap_or_else(PoisonError::into_inner)[i] = kept;
        match answer {
            Ok(Ok((Some(addr), _))) => Some(addr),
            Ok(Ok((None, _))) => {
                if !self.unknown_logged.swap(true, Ordering::Relaxed) {
                    tracing::error!(
                        master = %self.master,
                        "a sentinel does not monitor this master: check redis.sentinel.master"
                    );
                }
                None
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "a sentinel did not answer");
                None
            }
            Err(_) => {
                tracing::debug!("a sentinel did not answer in time");
                None
            }
        }
    }

    /// Connects to the master the sentinels named (`host`, `port`), and
    /// checks with `ROLE` that it is one (a sentinel may lag a failover).
    async fn connect_master(
        &self,
        link: &RedisLink,
        (host, port): &(String, u16),
    ) -> Result<(redis::Client, ConnectionManager), String> {
        let addr = if self.use_tls {
            redis::ConnectionAddr::TcpTls {
                host: host.clone(),
                port: *port,
                insecure: false,
                tls_params: None,
            }
        } else {
            redis::ConnectionAddr::Tcp(host.clone(), *port)
        };
        let info = redis::IntoConnectionInfo::into_connection_info(addr)
            .map_err(|e| e.to_string())?
            .set_redis_settings(self.settings.clone());
        let client = client_for(info, self.tls.as_ref()).map_err(|e| e.to_string())?;
        let mut m = ConnectionManager::new_with_config(client.clone(), link.manager_config())
            .await
            .map_err(|e| e.to_string())?;
        let role: Vec<Value> = redis::cmd("ROLE")
            .query_async(&mut m)
            .await
            .map_err(|e| e.to_string())?;
        match role.first() {
            Some(Value::BulkString(b)) if b.as_slice() == b"master" => {}
            Some(Value::SimpleString(s)) if s == "master" => {}
            _ => return Err(format!("{host}:{port} is not a master yet")),
        }
        Ok((client, m))
    }
}
