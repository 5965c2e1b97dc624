//! Runs a real `redis-server` on a free loopback port, for the shared-cache
//! scenarios: it can be killed, restarted on the same port, paused and resumed
//! like a failing server, and read or written raw the way an operator would
//! with `redis-cli`.
//!
//! The binary is `redis-server`, or `$CORRAL_REDIS_SERVER` (a `valkey-server`:
//! scripts/test runs the shared-cache scenarios on both).
//!
//! It never persists anything (`--save ""`, no AOF) and never outlives its
//! handle: `Drop` kills and reaps it. Every command the harness sends has a
//! deadline, so a paused server fails a test instead of hanging it.

use std::fs::File;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use crate::ports::free_addr_for_restarts;
use crate::temp::TempDir;

/// How long `redis-server` may take to answer PING after spawn.
pub const REDIS_STARTUP_DEADLINE: Duration = Duration::from_secs(5);

/// Deadline of one command the harness sends (KEYS, GET, SET, PING, ROLE).
/// Generous: six cluster nodes, five corrals and a 1,000-request burst
/// share two cores in CI, and a ROLE once took over 2 s to be answered
/// there (a clean run of `scripts/test`, 2026-12-01).
pub const COMMAND_DEADLINE: Duration = Duration::from_secs(5);

const NOT_INSTALLED: &str = "redis-server is not on PATH: install redis-server \
     (scripts/test installs it on Debian: apt-get install redis-server)";

/// The server binary: `$CORRAL_REDIS_SERVER` (e.g. a `valkey-server`), else
/// `redis-server`.
pub fn server_binary() -> String {
    std::env::var("CORRAL_REDIS_SERVER")
        .ok()
        .filter(|s| !s.trim().is_empty())
        .unwrap_or_else(|| "redis-server".to_owned())
}

/// A running `redis-server` on 127.0.0.1; killed and reaped on drop.
pub struct Redis {
    child: Option<Child>,
    port: u16,
    dir: TempDir,
    /// Starts so far (the first one and every restart), for log file names.
    starts: usize,
    /// Arguments before the others (a sentinel's config file), more
    /// `redis-server` arguments after them (TLS, cluster), and the TLS
    /// port if any.
    leading: Vec<String>,
    extra: Vec<String>,
    tls_port: Option<u16>,
    /// A sentinel's config file (which the sentinel rewrites).
    _conf: Option<TempDir>,
}

impl Redis {
    /// Spawns `redis-server` on a free port and waits until it answers PING.
    ///
    /// A start that fails because the picked port was taken in the meantime
    /// is retried on a new port; anything else fails the test with the log.
    pub async fn start() -> Self {
        Self::start_with(Vec::new(), None).await
    }

    /// Spawns a server with more arguments (e.g. `--replicaof HOST PORT`,
    /// `--cluster-enabled yes`).
    pub async fn start_args(extra: Vec<String>) -> Self {
        Self::start_with(extra, None).await
    }

    /// Spawns a sentinel (`--sentinel`) whose config file holds `config`
    /// (`sentinel monitor …` lines).
    pub async fn start_sentinel(config: &str) -> Self {
        Self::start_sentinel_with(config, Vec::new(), None).await
    }

    /// A sentinel with more arguments (TLS) and the TLS port they set.
    pub async fn start_sentinel_with(
        config: &str,
        extra: Vec<String>,
        tls_port: Option<u16>,
    ) -> Self {
        let conf = TempDir::new("sentinel-conf").expect("a scratch dir for sentinel.conf");
        let path = conf.path().join("sentinel.conf");
        std::fs::write(&path, config).expect("write sentinel.conf");
        Self::start_full(
            vec![path.display().to_string(), "--sentinel".to_owned()],
            extra,
            tls_port,
            Some(conf),
        )
        .await
    }

    /// Also listens with TLS on another port (`--tls-port`), with the
    /// server certificate and key and the CA for client certificates;
    /// `auth_clients`: whether a client certificate is required. The
    /// plain port stays for the harness's own checks.
    pub async fn start_tls(cert: &Path, key: &Path, client_ca: &Path, auth_clients: bool) -> Self {
        let tls_port = free_addr_for_restarts().expect("a free TLS port").port();
        let mut extra = vec!["--tls-port".to_owned(), tls_port.to_string()];
        for (flag, path) in [
            ("--tls-cert-file", cert),
            ("--tls-key-file", key),
            ("--tls-ca-cert-file", client_ca),
        ] {
            extra.push(flag.to_owned());
            extra.push(path.display().to_string());
        }
        extra.push("--tls-auth-clients".to_owned());
        extra.push(if auth_clients { "yes" } else { "no" }.to_owned());
        Self::start_with(extra, Some(tls_port)).await
    }

    /// Spawns a server with more arguments and a TLS port they configure.
    pub async fn start_args_tls(extra: Vec<String>, tls_port: u16) -> Self {
        Self::start_with(extra, Some(tls_port)).await
    }

    /// The TLS port, for a server started with one.
    pub fn tls_port(&self) -> Option<u16> {
        self.tls_port
    }

    /// `rediss://localhost:TLSPORT/0`.
    pub fn tls_url(&self) -> String {
        format!(
            "rediss://localhost:{}/0",
            self.tls_port.expect("started with TLS")
        )
    }

    async fn start_with(extra: Vec<String>, tls_port: Option<u16>) -> Self {
        Self::start_full(Vec::new(), extra, tls_port, None).await
    }

    async fn start_full(
        leading: Vec<String>,
        extra: Vec<String>,
        tls_port: Option<u16>,
        conf: Option<TempDir>,
    ) -> Self {
        let dir = TempDir::new("redis").expect("create a scratch dir for redis");
        let mut redis = Self {
            child: None,
            port: 0,
            dir,
            starts: 0,
            leading,
            extra,
            tls_port,
            _conf: conf,
        };
        let mut failure = String::new();
        for _attempt in 0..3 {
            redis.port = free_addr_for_restarts()
                .expect("a free port for redis")
                .port();
            match redis.spawn_and_wait().await {
                Ok(()) => return redis,
                Err(why) => {
                    failure = why;
                    if !redis.log().to_ascii_lowercase().contains("in use") {
                        break;
                    }
                }
            }
        }
        panic!("{failure}");
    }

    /// `redis://127.0.0.1:PORT/0`, for the proxy's `redis.url`
    /// (`redis://:PASSWORD@…` for a server started with `--requirepass`).
    pub fn url(&self) -> String {
        let password = self
            .extra
            .iter()
            .position(|a| a == "--requirepass")
            .and_then(|i| self.extra.get(i + 1));
        match password {
            Some(p) => format!("redis://:{p}@127.0.0.1:{}/0", self.port),
            None => format!("redis://127.0.0.1:{}/0", self.port),
        }
    }

    /// The port it listens on (kept across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The process id of the current server, if one runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the server with SIGKILL and reaps it: connections drop at once,
    /// nothing is flushed, the data set is gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts a fresh (empty) server on the same port and waits for PING.
    pub async fn restart(&mut self) {
        self.kill();
        if let Err(why) = self.spawn_and_wait().await {
            panic!("restarting redis on port {}: {why}", self.port);
        }
    }

    /// Freezes the server with SIGSTOP: it keeps its connections open and
    /// answers nothing, like a server stuck in a long command or a GC pause.
    pub fn pause(&self) {
        self.signal("STOP");
    }

    /// Lets a paused server run again with SIGCONT.
    pub fn resume(&self) {
        self.signal("CONT");
    }

    /// `KEYS pattern`, sorted.
    pub async fn keys(&self, pattern: &str) -> Vec<String> {
        let mut keys: Vec<String> = self
            .command(
                ::redis::cmd("KEYS").arg(pattern),
                &format!("KEYS {pattern}"),
            )
            .await;
        keys.sort();
        keys
    }

    /// `GET key` as raw bytes (`None` when the key does not exist).
    pub async fn get_raw(&self, key: &str) -> Option<Vec<u8>> {
        self.command(::redis::cmd("GET").arg(key), &format!("GET {key}"))
            .await
    }

    /// `SET key bytes` without expiry.
    pub async fn set_raw(&self, key: &str, bytes: &[u8]) {
        let _: () = self
            .command(
                ::redis::cmd("SET").arg(key).arg(bytes),
                &format!("SET {key}"),
            )
            .await;
    }

    /// `PTTL key` in milliseconds (-1: no expiry, -2: no such key).
    pub async fn pttl(&self, key: &str) -> i64 {
        self.command(::redis::cmd("PTTL").arg(key), &format!("PTTL {key}"))
            .await
    }

    /// Whether the server answers PING within a short deadline.
    pub async fn answers_ping(&self) -> bool {
        ping(&self.url(), Duration::from_millis(200)).await
    }

    /// Everything the current server and the ones before it logged.
    pub fn log(&self) -> String {
        (0..self.starts)
            .map(|n| std::fs::read_to_string(self.dir.path().join(format!("redis-{n}.log"))))
            .filter_map(Result::ok)
            .collect::<Vec<_>>()
            .join("--- restart ---\n")
    }

    /// Sends one command on a fresh connection; fails the test on an error or
    /// when the server does not answer within [`COMMAND_DEADLINE`].
    pub async fn command<T: ::redis::FromRedisValue>(&self, cmd: &::redis::Cmd, what: &str) -> T {
        let url = self.url();
        let answer = tokio::time::timeout(COMMAND_DEADLINE, async {
            let client = ::redis::Client::open(url.as_str())?;
            // The client's own deadlines (500 ms by default) would fail a
            // command on two cores busy with a burst: this one is ours.
            let config = ::redis::AsyncConnectionConfig::new()
                .set_connection_timeout(Some(COMMAND_DEADLINE))
                .set_response_timeout(Some(COMMAND_DEADLINE));
            let mut connection = client
                .get_multiplexed_async_connection_with_config(&config)
                .await?;
            cmd.query_async::<T>(&mut connection).await
        })
        .await;
        match answer {
            Ok(Ok(value)) => value,
            Ok(Err(e)) => panic!("redis {what} on {url}: {e}"),
            Err(_) => panic!("redis {what} on {url}: no answer within {COMMAND_DEADLINE:?}"),
        }
    }

    fn signal(&self, signal: &str) {
        let pid = self
            .pid()
            .unwrap_or_else(|| panic!("SIG{signal} to redis: the server is not running"));
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .unwrap_or_else(|e| panic!("run `kill -{signal} {pid}`: {e}"));
        assert!(
            status.success(),
            "`kill -{signal} {pid}` exited with {status}"
        );
    }

    async fn spawn_and_wait(&mut self) -> Result<(), String> {
        let log_path = self.dir.path().join(format!("redis-{}.log", self.starts));
        self.starts += 1;
        let log = File::create(&log_path).expect("create the redis log");
        let log_err = log.try_clone().expect("clone the redis log handle");
        let child = Command::new(server_binary())
            .args(&self.leading)
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--protected-mode", "no"])
            .args(["--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                panic!(
                    "{NOT_INSTALLED} (or CORRAL_REDIS_SERVER={})",
                    server_binary()
                )
            }
            Err(e) => panic!("spawn {}: {e}", server_binary()),
        };
        self.child = Some(child);
        match self.wait_ready(REDIS_STARTUP_DEADLINE).await {
            Ok(()) => Ok(()),
            Err(exited) => {
                let why = match exited {
                    Some(status) => {
                        format!("redis-server exited with {status} before it answered PING")
                    }
                    None => format!(
                        "redis-server did not answer PING on {} within {REDIS_STARTUP_DEADLINE:?}",
                        self.addr()
                    ),
                };
                self.kill();
                Err(format!("{why}\n{}", self.report()))
            }
        }
    }

    /// `Err(Some(status))` when the process exited, `Err(None)` on timeout.
    async fn wait_ready(&mut self, within: Duration) -> Result<(), Option<ExitStatus>> {
        let url = self.url();
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(Some(status));
            }
            if ping(&url, Duration::from_millis(200)).await {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(None);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The end of the log, for failure messages.
    pub fn report(&self) -> String {
        const TAIL: usize = 60;
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        let skipped = lines.len().saturating_sub(TAIL);
        format!(
            "--- redis log (port {}, {}, last {} of {} lines) ---\n{}\n--- end of redis log ---",
            self.port,
            self.dir.path().display(),
            lines.len() - skipped,
            lines.len(),
            lines[skipped..].join("\n")
        )
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        // SIGKILL also ends a stopped (paused) process.
        self.kill();
        if std::thread::panicking() {
            self.dir.keep();
            eprintln!("{}", self.report());
        }
    }
}

/// Whether `PING` on a fresh connection answers `PONG` within `within`.
async fn ping(url: &str, within: Duration) -> bool {
    let answer = tokio::time::timeout(within, async {
        let client = ::redis::Client::open(url)?;
        let mut connection = client.get_multiplexed_async_connection().await?;
        ::redis::cmd("PING")
            .query_async::<String>(&mut connection)
            .await
    })
    .await;
    matches!(answer, Ok(Ok(pong)) if pong == "PONG")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn raw_values_round_trip_and_keys_match_globs_with_braces() {
        let redis = Redis::start().await;
        redis.set_raw("corral:{ab}:lease:01", b"token-1").await;
        redis.set_raw("corral:{ab}:e:01", b"CRL\x01\xff\x00").await;
        assert_eq!(redis.keys("*:lease:*").await, ["corral:{ab}:lease:01"]);
        assert_eq!(
            redis.get_raw("corral:{ab}:e:01").await.as_deref(),
            Some(&b"CRL\x01\xff\x00"[..])
        );
        assert_eq!(redis.get_raw("corral:missing").await, None);
        assert_eq!(redis.pttl("corral:{ab}:e:01").await, -1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_killed_server_restarts_empty_on_the_same_port() {
        let mut redis = Redis::start().await;
        let port = redis.port();
        redis.set_raw("k", b"v").await;
        redis.kill();
        assert!(!redis.answers_ping().await);
        redis.restart().await;
        assert_eq!(redis.port(), port);
        assert!(redis.answers_ping().await);
        assert!(redis.keys("*").await.is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_paused_server_answers_nothing_until_resumed() {
        let redis = Redis::start().await;
        redis.pause();
        assert!(
            !redis.answers_ping().await,
            "a stopped server answered PING"
        );
        redis.resume();
        assert!(redis.answers_ping().await);
    }
}
