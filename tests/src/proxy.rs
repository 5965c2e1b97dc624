//! Runs the real `corral serve` as a child process on loopback ports.
//!
//! Every listener is configured on port 0: corral binds what the kernel
//! gives it and writes the bound addresses, with its instance name, to the
//! file `CORRAL_READY_FILE` names, which the harness reads (as linkerd's
//! tests read their proxies' bound addresses back). No port is picked,
//! released and hoped for, so two tests can never start on one port, and
//! `/healthz` must answer with this child's instance name
//! (`corral-instance`), so another test's corral can never pass for it.
//! A binary given by `CORRAL_BIN` (an older build, to show a test fails on
//! it) may not write the file: there the harness picks free ports as
//! before.
//!
//! The child is killed (and reaped) when its handle drops; its stdout and
//! stderr go to a log file in a scratch directory, printed along with the
//! config when the test is failing. Nothing here reaches into corral's code.

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use crate::config::{Config, with_listeners};
use crate::fd_limit::ensure_open_files;
use crate::paths::corral_bin;
use crate::ports::free_addrs;
use crate::temp::TempDir;

/// How long a proxy may take to answer `/healthz` after spawn.
pub const STARTUP_DEADLINE: Duration = Duration::from_secs(10);

/// Open files the suite wants for itself and the proxy (bursts of 1000).
const OPEN_FILES: u64 = 8192;

/// Where a proxy's config comes from.
#[derive(Clone, Debug)]
pub enum ConfigSource {
    /// A config built with [`Config`].
    Built(Config),
    /// Raw YAML without `listen`/`admin`; the harness prepends both.
    Yaml(String),
    /// No file: `corral proxy` with these flags (`--to` among them); the
    /// harness adds `--listen` and `--admin`.
    Flags(Vec<String>),
}

impl From<Config> for ConfigSource {
    fn from(config: Config) -> Self {
        Self::Built(config)
    }
}

impl From<&str> for ConfigSource {
    fn from(yaml: &str) -> Self {
        Self::Yaml(yaml.to_owned())
    }
}

impl From<String> for ConfigSource {
    fn from(yaml: String) -> Self {
        Self::Yaml(yaml)
    }
}

/// Builder of `corral serve` processes: one, or several sharing a config.
#[derive(Clone, Debug)]
pub struct Proxy {
    config: ConfigSource,
    env: Vec<(String, String)>,
    instances: usize,
    wait_for_redis: bool,
    stall_stdout: bool,
    open_files: Option<u64>,
}

impl Proxy {
    /// A proxy serving `config` (a [`Config`] or raw YAML without listeners).
    pub fn new(config: impl Into<ConfigSource>) -> Self {
        Self {
            config: config.into(),
            // Every instance of a test fleet shares one key, as a real
            // fleet's do; `.env(...)` may replace it.
            env: vec![(
                crate::REDIS_AUTH_KEY_ENV.to_owned(),
                crate::REDIS_AUTH_KEY.to_owned(),
            )],
            instances: 1,
            wait_for_redis: true,
            stall_stdout: false,
            open_files: None,
        }
    }

    /// `corral proxy --to upstream` with `flags` (e.g. `["--ttl", "0"]`):
    /// what a newcomer runs, with no file.
    pub fn flags(upstream: &str, flags: &[&str]) -> Self {
        let mut all = vec!["--to".to_owned(), upstream.to_owned()];
        all.extend(flags.iter().map(|f| (*f).to_owned()));
        Self::new(ConfigSource::Flags(all))
    }

    /// Do not wait for the shared cache at start (for a Redis that is down
    /// on purpose). By default, a proxy with a `redis:` section is started
    /// only once its `/readyz` reports Redis connected: corral serves before
    /// that, alone, which would make exact cross-instance counts a race.
    pub fn without_waiting_for_redis(mut self) -> Self {
        self.wait_for_redis = false;
        self
    }

    /// How many processes [`Proxy::start_all`] starts: the same config, each
    /// with its own `listen` and `admin` ports (e.g. five instances sharing
    /// one Redis).
    pub fn instances(mut self, n: usize) -> Self {
        assert!(n > 0, "a cluster needs at least one instance");
        self.instances = n;
        self
    }

    /// Starts every instance concurrently and waits until all are healthy;
    /// instance `i` of the result is the `i`-th started.
    pub async fn start_all(self) -> Vec<RunningProxy> {
        let starts = (0..self.instances).map(|_| self.clone().start());
        futures_util::future::join_all(starts).await
    }

    /// Gives the process a stdout pipe that nobody reads: once the pipe's
    /// buffer is full, every write to it would block (a log shipper that
    /// stopped). stderr still goes to the log file.
    pub fn with_stalled_stdout(mut self) -> Self {
        self.stall_stdout = true;
        self
    }

    /// Runs the process with this open-file limit, soft and hard (through
    /// `prlimit(1)`, which execs it: the pid is corral's), so a test can
    /// show what happens at the descriptor limit.
    pub fn open_files(mut self, n: u64) -> Self {
        self.open_files = Some(n);
        self
    }

    /// Starts it on a clock the test moves forward
    /// ([`RunningProxy::advance_clock`]) instead of sleeping out a TTL.
    pub fn with_test_clock(self) -> Self {
        self.env("CORRAL_TEST_CLOCK", "1")
    }

    /// Sets an environment variable for the process (e.g. `RUST_LOG`).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Spawns the process and waits for `GET /healthz` on the admin listener.
    ///
    /// A start that fails because a picked port was taken in the meantime is
    /// retried on new ports; any other failure fails the test with the log.
    pub async fn start(self) -> RunningProxy {
        ensure_open_files(OPEN_FILES);
        let bin = corral_bin();
        // Another build, which may not report its bound addresses.
        let legacy = std::env::var_os("CORRAL_BIN").is_some();
        let mut failure = String::new();
        for _attempt in 0..3 {
            let (addr, admin_addr) = if legacy {
                let picked = free_addrs(2).expect("free ports for listen and admin");
                (picked[0], picked[1])
            } else {
                let any: SocketAddr = ([127, 0, 0, 1], 0).into();
                (any, any)
            };
            let mut proxy = self.spawn(&bin, addr, admin_addr);
            let started = match proxy.wait_ready(STARTUP_DEADLINE, legacy).await {
                Ok(()) => proxy.wait_healthy(STARTUP_DEADLINE).await,
                Err(e) => Err(e),
            };
            match started {
                Ok(()) if self.wait_for_redis && proxy.has_redis() => {
                    proxy.wait_redis_connected(STARTUP_DEADLINE).await;
                    return proxy;
                }
                Ok(()) => return proxy,
                Err(Unhealthy::Exited(status)) => {
                    let log = proxy.log();
                    failure = format!(
                        "corral serve exited with {status} before it was healthy\n{}",
                        proxy.report()
                    );
                    if !log.to_ascii_lowercase().contains("in use") {
                        break;
                    }
                }
                Err(Unhealthy::TimedOut) => {
                    failure = format!(
                        "corral serve did not answer GET http://{}/healthz with 200 within {STARTUP_DEADLINE:?}\n{}",
                        proxy.admin_addr,
                        proxy.report()
                    );
                    break;
                }
            }
        }
        panic!("{failure}");
    }

    fn spawn(&self, bin: &Path, addr: SocketAddr, admin_addr: SocketAddr) -> RunningProxy {
        let dir = TempDir::new("proxy").expect("create a scratch dir for the proxy");
        let yaml = match &self.config {
            ConfigSource::Built(config) => config.render(addr, admin_addr),
            ConfigSource::Yaml(body) => with_listeners(body, addr, admin_addr),
            ConfigSource::Flags(flags) => format!("# corral proxy {}\n", flags.join(" ")),
        };
        let config_path = dir.path().join("corral.yaml");
        std::fs::write(&config_path, &yaml).expect("write the proxy config");
        let log_path = dir.path().join("corral.log");
        let log = File::create(&log_path).expect("create the proxy log");
        let log_err = log.try_clone().expect("clone the proxy log handle");
        // A stalled stdout is the read end of a pipe kept, unread, in the
        // Child for as long as the process lives.
        let stdout = if self.stall_stdout {
            Stdio::piped()
        } else {
            Stdio::from(log)
        };
        let mut command = match self.open_files {
            Some(n) => {
                let mut c = Command::new("prlimit");
                c.arg(format!("--nofile={n}:{n}")).arg("--").arg(bin);
                c
            }
            None => Command::new(bin),
        };
        match &self.config {
            ConfigSource::Flags(flags) => command
                .arg("proxy")
                .args(flags)
                .args(["--listen", &addr.to_string()])
                .args(["--admin", &admin_addr.to_string()])
                .args(["--log-format", "json"]),
            _ => command.arg("serve").arg("--config").arg(&config_path),
        };
        let child = command
            .env("CORRAL_READY_FILE", dir.path().join("ready.json"))
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(log_err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {} serve: {e}", bin.display()));
        RunningProxy {
            child,
            addr,
            admin_addr,
            instance: None,
            config_path,
            log_path,
            dir,
        }
    }
}

/// What corral writes to `CORRAL_READY_FILE` once it listens.
#[derive(serde::Deserialize)]
struct Ready {
    instance: String,
    listen: SocketAddr,
    admin: SocketAddr,
}

enum Unhealthy {
    Exited(ExitStatus),
    TimedOut,
}

/// A running `corral serve`; killed and reaped on drop.
pub struct RunningProxy {
    child: Child,
    addr: SocketAddr,
    admin_addr: SocketAddr,
    /// The instance name corral reported; `/healthz` must say it.
    instance: Option<String>,
    config_path: PathBuf,
    log_path: PathBuf,
    dir: TempDir,
}

impl RunningProxy {
    /// The proxy listener.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The admin listener (`/healthz`).
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// `http://{listen}{path_and_query}`.
    pub fn url(&self, path_and_query: &str) -> String {
        format!("http://{}{path_and_query}", self.addr)
    }

    /// `http://{admin}{path}`.
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin_addr)
    }

    /// Moves the cache's clock `by` forward (started
    /// [`Proxy::with_test_clock`]): entries age, TTLs and stale windows run
    /// out, as if that much time had passed.
    pub async fn advance_clock(&self, by: Duration) {
        let url = self.admin_url(&format!("/test/clock?advance_ms={}", by.as_millis()));
        let answer = reqwest::Client::new()
            .post(&url)
            .timeout(crate::DEADLINE)
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {url}: {e}"));
        assert_eq!(
            answer.status(),
            200,
            "POST {url}: is the proxy started with_test_clock()?"
        );
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The process's resident memory (VmRSS), in MiB.
    pub fn rss_mib(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("the proxy's /proc status");
        let kb: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS");
        kb / 1024.0
    }

    /// What the process really holds, in MiB: its resident memory less the
    /// shared pages it maps (RssShmem), plus the whole size of every memfd
    /// it holds open (sealed bodies: read with sendfile, their pages are
    /// not in its RSS, but the machine's Shmem holds them all).
    pub fn held_mib(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("the proxy's /proc status");
        let kb = |field: &str| -> f64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or(0.0)
        };
        let private = kb("VmRSS:") - kb("RssShmem:");
        let mut memfd = 0u64;
        if let Ok(fds) = std::fs::read_dir(format!("/proc/{}/fd", self.pid())) {
            for fd in fds.flatten() {
                let is_memfd = std::fs::read_link(fd.path())
                    .is_ok_and(|target| target.to_string_lossy().starts_with("/memfd:"));
                if is_memfd && let Ok(meta) = std::fs::metadata(fd.path()) {
                    memfd += meta.len();
                }
            }
        }
        private / 1024.0 + memfd as f64 / (1024.0 * 1024.0)
    }

    /// The config file the process was started with.
    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// Everything the process printed so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Config and the end of the log, for failure messages.
    pub fn report(&self) -> String {
        const TAIL: usize = 200;
        let config = std::fs::read_to_string(&self.config_path).unwrap_or_default();
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        let skipped = lines.len().saturating_sub(TAIL);
        let tail = lines[skipped..].join("\n");
        format!(
            "--- corral config ({}) ---\n{config}--- corral log ({}, last {} of {} lines) ---\n{tail}\n--- end of corral log ---",
            self.config_path.display(),
            self.log_path.display(),
            lines.len() - skipped,
            lines.len()
        )
    }

    /// Kills the process with SIGKILL and reaps it: no drain, no cleanup, as
    /// when a machine dies (its Redis leases are left to expire).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    fn has_redis(&self) -> bool {
        std::fs::read_to_string(&self.config_path)
            .is_ok_and(|c| c.lines().any(|l| l.starts_with("redis:")))
    }

    /// Waits until `/readyz` reports `"redis":"connected"`.
    async fn wait_redis_connected(&self, within: Duration) {
        let client = reqwest::Client::builder()
            .no_proxy()
            .http1_only()
            .timeout(Duration::from_secs(1))
            .build()
            .expect("build the readiness client");
        let url = self.admin_url("/readyz");
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Ok(r) = client.get(&url).send().await
                && let Ok(body) = r.text().await
                && body.contains("\"redis\":\"connected\"")
            {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "corral did not report Redis connected on {url} within {within:?}\n{}",
                self.report()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits for the addresses corral bound (its ready file), and takes
    /// them; a `legacy` binary may write none, and keeps the picked ports.
    async fn wait_ready(&mut self, within: Duration, legacy: bool) -> Result<(), Unhealthy> {
        let path = self.dir.path().join("ready.json");
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Ok(text) = std::fs::read_to_string(&path) {
                let ready: Ready = serde_json::from_str(&text)
                    .unwrap_or_else(|e| panic!("{}: {e}: {text}", path.display()));
                self.addr = ready.listen;
                self.admin_addr = ready.admin;
                self.instance = Some(ready.instance);
                return Ok(());
            }
            if legacy {
                return Ok(());
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(Unhealthy::Exited(status));
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Unhealthy::TimedOut);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn wait_healthy(&mut self, within: Duration) -> Result<(), Unhealthy> {
        let client = reqwest::Client::builder()
            .no_proxy()
            .http1_only()
            .timeout(Duration::from_secs(1))
            .build()
            .expect("build the health-check client");
        let url = self.admin_url("/healthz");
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(Unhealthy::Exited(status));
            }
            if let Ok(response) = client.get(&url).send().await
                && response.status() == reqwest::StatusCode::OK
            {
                let said = response
                    .headers()
                    .get("corral-instance")
                    .and_then(|v| v.to_str().ok());
                match (&self.instance, said) {
                    (None, _) => return Ok(()),
                    (Some(ours), Some(said)) if said == ours => return Ok(()),
                    // Another process on this port: never ours.
                    (Some(ours), said) => panic!(
                        "GET {url} was answered by {said:?}, not this test's corral {ours}\n{}",
                        self.report()
                    ),
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Unhealthy::TimedOut);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for RunningProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            self.dir.keep();
            eprintln!("{}", self.report());
        }
    }
}
