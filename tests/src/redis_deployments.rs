//! Redis as production runs it: a Cluster of six nodes (three primaries,
//! one replica each, made by `redis-cli --cluster create`) and a Sentinel
//! deployment (a master, a replica, three sentinels). Every node is a
//! [`Redis`] of its own (killed on drop); every wait has a deadline and a
//! failure prints what the servers logged.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use futures_util::future::BoxFuture;
use redis::Value;
use tokio::time::Instant;

use crate::ports::free_addr_for_restarts;
use crate::redis_server::Redis;

/// How long a cluster or a sentinel deployment may take to form.
pub const FORM_DEADLINE: Duration = Duration::from_secs(20);

/// The keys of a deployment, wherever they live: one node, or every
/// primary of a cluster.
pub trait Keyspace: Sync {
    /// `KEYS pattern`, sorted, over every node that holds data.
    fn keys<'a>(&'a self, pattern: &'a str) -> BoxFuture<'a, Vec<String>>;
    /// `PTTL key` (-2 when no node has it).
    fn pttl<'a>(&'a self, key: &'a str) -> BoxFuture<'a, i64>;
}

impl Keyspace for Redis {
    fn keys<'a>(&'a self, pattern: &'a str) -> BoxFuture<'a, Vec<String>> {
        Box::pin(Redis::keys(self, pattern))
    }
    fn pttl<'a>(&'a self, key: &'a str) -> BoxFuture<'a, i64> {
        Box::pin(Redis::pttl(self, key))
    }
}

/// Certificate, key and CA files.
type TlsFiles<'a> = (&'a Path, &'a Path, &'a Path);

/// The arguments of a TLS port (no client certificate asked for; replicas
/// and sentinels reach their master over TLS too), and that port.
fn tls_args((cert, key, ca): TlsFiles<'_>) -> (Vec<String>, u16) {
    let port = free_addr_for_restarts().expect("a free TLS port").port();
    let mut args = vec!["--tls-port".to_owned(), port.to_string()];
    for (flag, path) in [
        ("--tls-cert-file", cert),
        ("--tls-key-file", key),
        ("--tls-ca-cert-file", ca),
    ] {
        args.extend([flag.to_owned(), path.display().to_string()]);
    }
    args.extend(["--tls-auth-clients", "no", "--tls-replication", "yes"].map(str::to_owned));
    (args, port)
}

/// Six `--cluster-enabled` nodes joined into one cluster with one replica
/// per primary, a 1 s node timeout (so a failover fits in a test).
pub struct RedisCluster {
    nodes: Vec<Redis>,
}

impl RedisCluster {
    pub async fn start() -> Self {
        Self::start_with(None, &[]).await
    }

    /// No failover, and the healthy shards keep serving while one is down:
    /// for a primary frozen or killed for good.
    pub async fn start_without_failover() -> Self {
        Self::start_args(&[
            "--cluster-replica-no-failover",
            "yes",
            "--cluster-require-full-coverage",
            "no",
        ])
        .await
    }

    /// With more arguments for every node (e.g. `--cluster-replica-no-failover yes`).
    pub async fn start_args(extra: &[&str]) -> Self {
        Self::start_with(None, extra).await
    }

    /// Every node also listens with TLS (`--tls-port`; `--tls-cluster yes`,
    /// so `CLUSTER SLOTS` names TLS ports to TLS clients, and replicas sync
    /// over TLS, `--tls-replication yes`) with the server
    /// certificate and key; no client certificate is asked for. The plain
    /// ports stay for the harness.
    pub async fn start_tls(cert: &Path, key: &Path, ca: &Path) -> Self {
        Self::start_with(Some((cert, key, ca)), &[]).await
    }

    async fn start_with(tls: Option<TlsFiles<'_>>, extra: &[&str]) -> Self {
        let mut nodes = Vec::new();
        for _ in 0..6 {
            // The bus port is given, not port + 10000 (which may be taken
            // or past 65535).
            let bus = free_addr_for_restarts().expect("a free bus port").port();
            let args = [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "1000",
                "--cluster-port",
                &bus.to_string(),
                // A replica's first sync starts at once, not 5 s later.
                "--repl-diskless-sync-delay",
                "0",
            ];
            let mut args: Vec<String> = args.iter().chain(extra).map(|s| (*s).to_owned()).collect();
            match tls {
                None => nodes.push(Redis::start_args(args).await),
                Some(files) => {
                    let (tls_args, port) = tls_args(files);
                    args.extend(tls_args);
                    args.extend(["--tls-cluster".to_owned(), "yes".to_owned()]);
                    nodes.push(Redis::start_args_tls(args, port).await);
                }
            }
        }
        let cluster = RedisCluster { nodes };
        let mut create = tokio::process::Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for node in &cluster.nodes {
            create.arg(node.addr().to_string());
        }
        create.args(["--cluster-replicas", "1", "--cluster-yes"]);
        let out = tokio::time::timeout(FORM_DEADLINE, create.output())
            .await
            .unwrap_or_else(|_| panic!("redis-cli --cluster create took over {FORM_DEADLINE:?}"))
            .unwrap_or_else(|e| panic!("run redis-cli (Debian: apt-get install redis-tools): {e}"));
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            cluster.report()
        );
        cluster.wait_formed().await;
        cluster
    }

    /// Every node's URL, as `redis.cluster` seeds.
    pub fn seeds(&self) -> Vec<String> {
        self.nodes.iter().map(Redis::url).collect()
    }

    /// Every node's `rediss://127.0.0.1:TLSPORT`, for a cluster started
    /// with TLS.
    pub fn tls_seeds(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| {
                format!(
                    "rediss://127.0.0.1:{}",
                    n.tls_port().expect("started with TLS")
                )
            })
            .collect()
    }

    /// The node at `index`.
    pub fn node(&self, index: usize) -> &Redis {
        &self.nodes[index]
    }

    /// Kills node `index` with SIGKILL.
    pub fn kill(&mut self, index: usize) {
        self.nodes[index].kill();
    }

    fn live(&self) -> impl Iterator<Item = (usize, &Redis)> {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.pid().is_some())
    }

    /// Waits until every node says `cluster_state:ok` and knows all six,
    /// and every replica's link to its primary is up.
    async fn wait_formed(&self) {
        let deadline = Instant::now() + FORM_DEADLINE;
        loop {
            let mut pending = Vec::new();
            for (i, node) in self.live() {
                let info: String = node
                    .command(redis::cmd("CLUSTER").arg("INFO"), "CLUSTER INFO")
                    .await;
                if !info.contains("cluster_state:ok") || !info.contains("cluster_known_nodes:6") {
                    pending.push(format!("node {i}: not ok yet"));
                }
                let replication: String = node
                    .command(redis::cmd("INFO").arg("replication"), "INFO replication")
                    .await;
                if replication.contains("role:slave")
                    && !replication.contains("master_link_status:up")
                {
                    pending.push(format!("node {i}: replica not in sync"));
                }
            }
            if pending.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not form within {FORM_DEADLINE:?}: {pending:?}\n{}",
                self.report()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The indexes of the nodes that are primaries now.
    pub async fn primaries(&self) -> Vec<usize> {
        let mut out = Vec::new();
        for (i, node) in self.live() {
            if Self::is_primary(node).await {
                out.push(i);
            }
        }
        out
    }

    /// The slot of `key`.
    pub async fn slot(&self, key: &str) -> u16 {
        let (_, node) = self.live().next().expect("a live node");
        node.command(
            redis::cmd("CLUSTER").arg("KEYSLOT").arg(key),
            "CLUSTER KEYSLOT",
        )
        .await
    }

    /// The port of the primary serving `slot`, as live node `asked` sees it.
    async fn primary_port(&self, asked: &Redis, slot: u16) -> Option<u16> {
        let slots: Value = asked
            .command(redis::cmd("CLUSTER").arg("SLOTS"), "CLUSTER SLOTS")
            .await;
        let Value::Array(ranges) = slots else {
            return None;
        };
        ranges.iter().find_map(|range| {
            let Value::Array(fields) = range else {
                return None;
            };
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(primary))) =
                (fields.first(), fields.get(1), fields.get(2))
            else {
                return None;
            };
            if !(*start..=*end).contains(&i64::from(slot)) {
                return None;
            }
            match primary.get(1) {
                Some(Value::Int(port)) => u16::try_from(*port).ok(),
                _ => None,
            }
        })
    }

    /// The index of the node that is primary for `key`'s slot now.
    pub async fn primary_of(&self, key: &str) -> usize {
        let slot = self.slot(key).await;
        let (_, asked) = self.live().next().expect("a live node");
        let port = self
            .primary_port(asked, slot)
            .await
            .unwrap_or_else(|| panic!("no primary serves slot {slot}"));
        self.nodes
            .iter()
            .position(|n| n.port() == port)
            .expect("the primary is one of ours")
    }

    /// Waits until every live node names a live primary for `slot` other
    /// than node `dead` and says `cluster_state:ok`: the replica took over.
    /// Returns the new primary's index.
    pub async fn wait_failover(&self, slot: u16, dead: usize, within: Duration) -> usize {
        let deadline = Instant::now() + within;
        let dead_port = self.nodes[dead].port();
        loop {
            let mut agreed = BTreeSet::new();
            let mut all_ok = true;
            for (_, node) in self.live() {
                let info: String = node
                    .command(redis::cmd("CLUSTER").arg("INFO"), "CLUSTER INFO")
                    .await;
                all_ok &= info.contains("cluster_state:ok");
                agreed.insert(self.primary_port(node, slot).await);
            }
            if let [Some(port)] = agreed.iter().collect::<Vec<_>>().as_slice()
                && all_ok
                && *port != dead_port
            {
                return self
                    .nodes
                    .iter()
                    .position(|n| n.port() == *port)
                    .expect("the new primary is one of ours");
            }
            assert!(
                Instant::now() < deadline,
                "no failover of slot {slot} within {within:?} (primaries named: {agreed:?})\n{}",
                self.report()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// What every node logged.
    pub fn report(&self) -> String {
        self.nodes
            .iter()
            .map(Redis::report)
            .collect::<Vec<_>>()
            .join("\n")
    }

    async fn is_primary(node: &Redis) -> bool {
        let role: Vec<Value> = node.command(&redis::cmd("ROLE"), "ROLE").await;
        matches!(role.first(), Some(Value::BulkString(b)) if b.as_slice() == b"master")
    }
}

impl Keyspace for RedisCluster {
    fn keys<'a>(&'a self, pattern: &'a str) -> BoxFuture<'a, Vec<String>> {
        Box::pin(async move {
            let mut all = BTreeSet::new();
            for (_, node) in self.live() {
                if Self::is_primary(node).await {
                    all.extend(node.keys(pattern).await);
                }
            }
            all.into_iter().collect()
        })
    }

    fn pttl<'a>(&'a self, key: &'a str) -> BoxFuture<'a, i64> {
        Box::pin(async move {
            for (_, node) in self.live() {
                if Self::is_primary(node).await && node.keys(key).await.iter().any(|k| k == key) {
                    return node.pttl(key).await;
                }
            }
            -2
        })
    }
}

/// The name the sentinels monitor.
pub const SENTINEL_MASTER: &str = "corral-primary";

/// A master, its replica and three sentinels (quorum 2) that fail over
/// half a second after the master stops answering.
pub struct RedisSentinels {
    pub master: Redis,
    pub replica: Redis,
    sentinels: Vec<Redis>,
}

impl RedisSentinels {
    pub async fn start() -> Self {
        Self::start_with(None, None).await
    }

    /// Master, replica and sentinels also listen with TLS; the sentinels
    /// monitor the master's TLS port (so they name it) and reach it, and
    /// the replica its master, over TLS.
    pub async fn start_tls(cert: &Path, key: &Path, ca: &Path) -> Self {
        Self::start_with(Some((cert, key, ca)), None).await
    }

    /// Master and replica ask for `password` (`--requirepass`, and
    /// `--masterauth` for the replica's sync); the sentinels are told it
    /// (`sentinel auth-pass`) and ask for none themselves.
    pub async fn start_auth(password: &str) -> Self {
        Self::start_with(None, Some(password)).await
    }

    async fn start_with(tls: Option<TlsFiles<'_>>, password: Option<&str>) -> Self {
        let auth: Vec<String> = match password {
            Some(p) => ["--requirepass", p, "--masterauth", p]
                .map(str::to_owned)
                .to_vec(),
            None => Vec::new(),
        };
        let auth = &auth;
        let start = |mut args: Vec<String>| async move {
            args.extend(auth.iter().cloned());
            match tls {
                None => Redis::start_args(args).await,
                Some(files) => {
                    let (tls, port) = tls_args(files);
                    args.extend(tls);
                    Redis::start_args_tls(args, port).await
                }
            }
        };
        let master = start(vec![
            "--repl-diskless-sync-delay".to_owned(),
            "0".to_owned(),
        ])
        .await;
        let replica = start(vec![
            "--replicaof".to_owned(),
            "127.0.0.1".to_owned(),
            advertised(&master).to_string(),
        ])
        .await;
        let mut config = format!(
            "sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {} 2\n\
             sentinel down-after-milliseconds {SENTINEL_MASTER} 500\n\
             sentinel failover-timeout {SENTINEL_MASTER} 2000\n",
            advertised(&master)
        );
        if let Some(p) = password {
            config.push_str(&format!("sentinel auth-pass {SENTINEL_MASTER} {p}\n"));
        }
        let mut sentinels = Vec::new();
        for _ in 0..3 {
            sentinels.push(match tls {
                None => Redis::start_sentinel(&config).await,
                Some(files) => {
                    let (args, port) = tls_args(files);
                    Redis::start_sentinel_with(&config, args, Some(port)).await
                }
            });
        }
        let deployment = RedisSentinels {
            master,
            replica,
            sentinels,
        };
        deployment.wait_formed().await;
        deployment
    }

    /// The sentinels' URLs, as `redis.sentinel.nodes`: `rediss://` to
    /// their TLS ports when started with TLS.
    pub fn nodes(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| match s.tls_port() {
                Some(port) => format!("rediss://127.0.0.1:{port}"),
                None => format!("redis://127.0.0.1:{}", s.port()),
            })
            .collect()
    }

    /// The master's port as the first sentinel names it.
    pub async fn named_master_port(&self) -> u16 {
        let (_, port): (String, u16) = self.sentinels[0]
            .command(
                redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(SENTINEL_MASTER),
                "SENTINEL get-master-addr-by-name",
            )
            .await;
        port
    }

    /// Waits until every sentinel knows the replica and the two other
    /// sentinels (they find each other through the master's pub/sub every
    /// two seconds), and the replica is in sync: only then can they agree
    /// on a failover.
    async fn wait_formed(&self) {
        let deadline = Instant::now() + FORM_DEADLINE;
        loop {
            let mut pending = Vec::new();
            for (i, s) in self.sentinels.iter().enumerate() {
                let others: Vec<Value> = s
                    .command(
                        redis::cmd("SENTINEL").arg("sentinels").arg(SENTINEL_MASTER),
                        "SENTINEL sentinels",
                    )
                    .await;
                let replicas: Vec<Value> = s
                    .command(
                        redis::cmd("SENTINEL").arg("replicas").arg(SENTINEL_MASTER),
                        "SENTINEL replicas",
                    )
                    .await;
                if others.len() < 2 || replicas.is_empty() {
                    pending.push(format!(
                        "sentinel {i}: {} sentinels, {} replicas",
                        others.len(),
                        replicas.len()
                    ));
                }
            }
            let replication: String = self
                .replica
                .command(redis::cmd("INFO").arg("replication"), "INFO replication")
                .await;
            if !replication.contains("master_link_status:up") {
                pending.push("replica not in sync".to_owned());
            }
            if pending.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the sentinels did not form within {FORM_DEADLINE:?}: {pending:?}\n{}",
                self.report()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Kills the master and waits until the sentinels name the replica.
    pub async fn fail_over(&mut self, within: Duration) {
        self.master.kill();
        let deadline = Instant::now() + within;
        while self.named_master_port().await != advertised(&self.replica) {
            assert!(
                Instant::now() < deadline,
                "the sentinels did not promote the replica within {within:?}\n{}",
                self.report()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn report(&self) -> String {
        std::iter::once(&self.master)
            .chain(std::iter::once(&self.replica))
            .chain(&self.sentinels)
            .map(Redis::report)
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// The port a server is known by: its TLS port when it has one.
fn advertised(redis: &Redis) -> u16 {
    redis.tls_port().unwrap_or_else(|| redis.port())
}
