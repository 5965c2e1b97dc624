//! corral: an HTTP reverse-proxy cache that stops cache stampedes.
//! `corral serve --config FILE` runs it; `corral check --config FILE`
//! validates a configuration and exits.

mod app;
mod cache;
mod cluster;
mod config;
mod http;
mod limits;
mod ops;
mod origin;
mod overload;
mod routes;
mod sealed;
mod telemetry;

use crate::config::RuntimeMode;
use crate::http::server;
use crate::ops::{admin, purge, reload};
use crate::telemetry::{access_log, log_sink, metrics};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use tokio::net::TcpListener;
use tokio::sync::watch;

#[derive(Parser)]
#[command(
    name = "corral",
    version,
    about = "HTTP reverse-proxy cache that stops cache stampedes"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy.
    Serve {
        /// The routes file (YAML).
        #[arg(long, short)]
        config: PathBuf,
        /// Log format on stdout.
        #[arg(long, value_enum, default_value_t = LogFormat::Json)]
        log_format: LogFormat,
    },
    /// Run in front of one origin with the defaults, no file:
    /// `corral proxy --to http://127.0.0.1:3000`.
    Proxy {
        /// The origin, e.g. http://127.0.0.1:3000 (or https://).
        #[arg(long)]
        to: String,
        /// Where clients connect.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: String,
        /// The admin listener: health, metrics, purge.
        #[arg(long, default_value = "127.0.0.1:9080")]
        admin: String,
        /// Share the cache and the coalescing with every instance on this
        /// Redis, e.g. redis://127.0.0.1:6379.
        #[arg(long)]
        redis: Option<String>,
        /// The cache's memory bound (L1), e.g. 256MiB or 1GiB.
        #[arg(long, default_value = "256MiB")]
        memory: String,
        /// How long an answer without freshness information (no
        /// Cache-Control max-age, no Expires) is kept, e.g. 10s or 2m;
        /// 0: such answers are not kept (concurrent requests still share
        /// one fetch). The origin's own Cache-Control always wins.
        #[arg(long, default_value = DEFAULT_PROXY_TTL)]
        ttl: String,
        /// Serve a stale answer for up to this long past its freshness
        /// while one background fetch refreshes it, where the origin's
        /// Cache-Control names no stale-while-revalidate, e.g. 30s.
        #[arg(long, conflicts_with = "no_cache")]
        stale_while_revalidate: Option<String>,
        /// Serve a stale answer for up to this long past its freshness
        /// when the origin fails (a 5xx, a timeout, no connection), where
        /// its Cache-Control names no stale-if-error, e.g. 1h.
        #[arg(long, conflicts_with = "no_cache")]
        stale_if_error: Option<String>,
        /// Keep nothing and coalesce nothing: a plain reverse proxy.
        #[arg(long, conflicts_with = "ttl")]
        no_cache: bool,
        /// Log format on stdout.
        #[arg(long, value_enum, default_value_t = LogFormat::Pretty)]
        log_format: LogFormat,
    },
    /// The live view in the terminal: requests, origin requests saved,
    /// flights, instances and bounds, read from admin listeners' /stats
    /// and redrawn in place (q or Ctrl-C quits).
    Top {
        /// Admin listeners to read, e.g. http://127.0.0.1:9080 (repeat
        /// for several instances).
        #[arg(long = "admin", default_value = "http://127.0.0.1:9080")]
        admins: Vec<String>,
        /// Every instance sharing the first admin's Redis (its
        /// /stats?fleet=1).
        #[arg(long)]
        fleet: bool,
        /// Print one reading and exit.
        #[arg(long)]
        once: bool,
        /// With --once: print the reading as JSON (the /stats?fleet=1 form).
        #[arg(long, requires = "once")]
        json: bool,
        /// Seconds between readings (with --once, between the two that
        /// make its rates).
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
        /// The admin token, where the live view is guarded; defaults to
        /// $CORRAL_ADMIN_TOKEN.
        #[arg(long, env = "CORRAL_ADMIN_TOKEN", hide_env_values = true)]
        token: Option<String>,
    },
    /// Validate a configuration file and exit (0 when valid).
    Check {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Purge cached answers through a running instance's admin listener
    /// (with Redis, every instance). Exactly one of --url, --prefix, --tag.
    Purge {
        /// The admin listener, e.g. http://127.0.0.1:9080.
        #[arg(long, default_value = "http://127.0.0.1:9080")]
        admin: String,
        /// Bearer token; defaults to $CORRAL_PURGE_TOKEN.
        #[arg(long, env = "CORRAL_PURGE_TOKEN", hide_env_values = true)]
        token: String,
        /// One URL, e.g. http://api.example.com/v1/items/1.
        #[arg(long, group = "what")]
        url: Option<String>,
        /// Every URL starting with this, e.g. http://api.example.com/v1/.
        #[arg(long, group = "what")]
        prefix: Option<String>,
        /// Every answer tagged so (Surrogate-Key or Cache-Tag).
        #[arg(long, group = "what")]
        tag: Option<String>,
        /// Mark stale instead of removing: stale-while-revalidate serves while one refresh runs.
        #[arg(long)]
        soft: bool,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Json,
    Pretty,
}

/// Descriptors kept for everything that is not a client connection or a
/// sealed body: listeners, Redis, the admin listener's connections, logs.
const RESERVED_DESCRIPTORS: u64 = 256;

/// Raises the open-file limit to its hard limit and splits it: a quarter
/// to sealed bodies (one descriptor each), a reserve, and the rest to
/// client connections, each of which may need one upstream connection too,
/// and to the overflow of upstream sockets HTTP/2 streams share.
/// Returns the client connection limit (`server.max_connections` when set).
fn budget_descriptors(configured: Option<usize>) -> usize {
    let limit = crate::sealed::raise_open_file_limit();
    let sealed = match limit {
        Some(limit) => usize::try_from(limit / 4).unwrap_or(usize::MAX),
        None => crate::sealed::DEFAULT_MAX_LIVE,
    };
    crate::sealed::set_max_live(sealed);
    // Each connection: its own socket and one upstream; and a quarter of a
    // socket more, the overflow HTTP/2 streams beyond a connection's first
    // share (origin/descriptors.rs): 2.25 descriptors a connection.
    let fitting = limit.map(|l| {
        usize::try_from((l - l / 4).saturating_sub(RESERVED_DESCRIPTORS) * 4 / 9)
            .unwrap_or(usize::MAX)
            .max(16)
    });
    let connections = configured.or(fitting).unwrap_or(1024);
    crate::origin::descriptors::set_overflow(connections / 4);
    if let (Some(c), Some(fit)) = (configured, fitting)
        && c > fit
    {
        tracing::warn!(
            max_connections = c,
            open_files = limit,
            fits = fit,
            "server.max_connections is more than the open-file limit can hold: past {fit}, accepts may fail for lack of descriptors"
        );
    }
    tracing::info!(
        open_files = limit,
        sealed_bodies = sealed,
        max_connections = connections,
        "descriptor budget"
    );
    connections
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check { config } => check(&config),
        Command::Top {
            admins,
            fleet,
            once,
            json,
            interval,
            token,
        } => {
            if !(0.1..=3600.0).contains(&interval) {
                eprintln!("corral top: --interval must be between 0.1 and 3600 seconds");
                return ExitCode::from(2);
            }
            crate::ops::top::run(crate::ops::top::Args {
                admins,
                token,
                fleet,
                once,
                json,
                interval: Duration::from_secs_f64(interval),
            })
        }
        Command::Purge {
            admin,
            token,
            url,
            prefix,
            tag,
            soft,
        } => {
            let what = match (url, prefix, tag) {
                (Some(u), None, None) => ("url", u),
                (None, Some(p), None) => ("prefix", p),
                (None, None, Some(t)) => ("tag", t),
                _ => {
                    eprintln!("corral purge: give exactly one of --url, --prefix, --tag");
                    return ExitCode::from(2);
                }
            };
            purge_cli(&admin, &token, what, soft)
        }
        Command::Proxy {
            to,
            listen,
            admin,
            redis,
            memory,
            ttl,
            stale_while_revalidate,
            stale_if_error,
            no_cache,
            log_format,
        } => proxy_command(
            ProxyFlags {
                to: &to,
                listen: &listen,
                admin: &admin,
                redis: redis.as_deref(),
                memory: &memory,
                ttl: (!no_cache).then_some(ttl.as_str()),
                stale: (stale_while_revalidate.as_deref(), stale_if_error.as_deref()),
            },
            log_format,
        ),
        Command::Serve { config, log_format } => serve_command(config, log_format),
    }
}

/// `corral proxy`: a config made from its flags, then served.
fn proxy_command(flags: ProxyFlags<'_>, log_format: LogFormat) -> ExitCode {
    let text = proxy_config(&flags);
    let config = match config::parse("corral proxy", &text) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("corral proxy: {}: {}", proxy_flag(&e.field), e.message);
            return ExitCode::from(2);
        }
    };
    println!(
        "corral proxy: http://{} in front of {}; live view on http://{}/ (and health, metrics, purge)",
        config.listen, flags.to, config.admin
    );
    run(config, None, log_format)
}

/// `corral serve`: the config file read once (what runs and what the
/// reload watcher compares against are the same bytes), then served.
fn serve_command(path: PathBuf, log_format: LogFormat) -> ExitCode {
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("corral: cannot read {}: {e}", path.display());
            return ExitCode::from(2);
        }
    };
    let config = match config::parse(&path.display().to_string(), &text) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("corral: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    let loaded = config::fingerprint(text.as_bytes());
    run(config, Some((path, loaded)), log_format)
}

/// `corral proxy`'s default for `--ttl`: long enough that a burst on a
/// hot key is one origin request every ten seconds, short enough that an
/// API's answers are never more than seconds old (docs/src/getting-started.md).
const DEFAULT_PROXY_TTL: &str = "10s";

/// The flags of `corral proxy` that make its configuration.
struct ProxyFlags<'a> {
    to: &'a str,
    listen: &'a str,
    admin: &'a str,
    redis: Option<&'a str>,
    memory: &'a str,
    /// `--ttl`; `None` with `--no-cache`.
    ttl: Option<&'a str>,
    /// `--stale-while-revalidate` and `--stale-if-error`, when given.
    stale: (Option<&'a str>, Option<&'a str>),
}

/// The configuration `corral proxy` runs: one route, everything under
/// `/`, to `to`, answers without freshness information kept for `--ttl`;
/// the defaults for the rest. Each value is written as a quoted YAML
/// string (a JSON string is one), so whatever the flags hold is read as
/// that value and checked as a file's would be.
fn proxy_config(flags: &ProxyFlags<'_>) -> String {
    let quoted = |v: &str| serde_json::to_string(v).unwrap_or_else(|_| "\"\"".to_owned());
    let mut text = format!(
        "listen: {}\nadmin: {}\ncache: {{ memory: {} }}\n",
        quoted(flags.listen),
        quoted(flags.admin),
        quoted(flags.memory)
    );
    if let Some(url) = flags.redis {
        text.push_str(&format!("redis: {{ url: {} }}\n", quoted(url)));
    }
    text.push_str(&format!(
        "routes:\n  - name: proxy\n    match: {{ path_prefix: / }}\n    upstream: {}\n",
        quoted(flags.to)
    ));
    let Some(ttl) = flags.ttl else {
        text.push_str("    cache: { enabled: false }\n");
        return text;
    };
    let mut cache = Vec::new();
    // `--ttl 0`: the origin's Cache-Control alone decides.
    if !config::is_zero_duration(ttl) {
        cache.push(format!("default_ttl: {}", quoted(ttl)));
    }
    let (swr, sie) = flags.stale;
    if let Some(d) = swr {
        cache.push(format!(
            "stale_while_revalidate: {{ default: {} }}",
            quoted(d)
        ));
    }
    if let Some(d) = sie {
        cache.push(format!("stale_if_error: {{ default: {} }}", quoted(d)));
    }
    if !cache.is_empty() {
        text.push_str(&format!("    cache: {{ {} }}\n", cache.join(", ")));
    }
    text
}

/// The flag of `corral proxy` a configuration field came from.
fn proxy_flag(field: &str) -> &str {
    match field {
        "routes[0].upstream" => "--to",
        "listen" => "--listen",
        "admin" => "--admin",
        "cache.memory" => "--memory",
        "routes[0].cache.default_ttl" => "--ttl",
        f if f.starts_with("routes[0].cache.stale_while_revalidate") => "--stale-while-revalidate",
        f if f.starts_with("routes[0].cache.stale_if_error") => "--stale-if-error",
        f if f.starts_with("redis") => "--redis",
        f => f,
    }
}

/// Runs `config` until a signal stops it; with `source` (the file and its
/// fingerprint) it is reloaded when the file changes or on SIGHUP.
fn run(config: config::Config, source: Option<(PathBuf, u64)>, log_format: LogFormat) -> ExitCode {
    let env_token = std::env::var("CORRAL_PURGE_TOKEN").ok();
    let purge_token = match purge::token(config.server.purge_token.as_deref(), env_token.as_deref())
    {
        Ok(t) => t,
        Err(e) => {
            eprintln!("corral: {e}");
            return ExitCode::from(2);
        }
    };
    let env_admin = std::env::var("CORRAL_ADMIN_TOKEN").ok();
    let admin_token = match purge::token_of(
        config.server.admin_token.as_deref(),
        env_admin.as_deref(),
        "CORRAL_ADMIN_TOKEN",
        "the live view",
    ) {
        // A token of its own guards the view wherever it listens; the
        // purge token only off loopback.
        Ok(Some(t)) => AdminToken::Own(t),
        Ok(None) => AdminToken::Purge(purge_token.clone()),
        Err(e) => {
            eprintln!("corral: {e}");
            return ExitCode::from(2);
        }
    };
    init_logs(log_format);
    let max_connections = budget_descriptors(config.server.max_connections);
    // per_core: this runtime is the control thread (admin
    // listener, reloads, Redis, signals); the client threads have
    // their own (http/server.rs).
    let mut builder = match (config.server.runtime, config.server.workers) {
        (RuntimeMode::PerCore, _) => tokio::runtime::Builder::new_current_thread(),
        (RuntimeMode::Shared, workers) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            if let Some(n) = workers {
                b.worker_threads(n);
            }
            b
        }
    };
    let runtime = match builder.enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("corral: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let tokens = Tokens {
        purge: purge_token,
        admin: admin_token,
    };
    // Before any answer is made: every member corral writes carries it
    // (the config checked it is a token).
    corral_core::semantics::cache_status::set_name(&config.server.proxy_name);
    let served = runtime.block_on(serve(config, source, tokens, max_connections));
    // Warnings counted since their last summary, then the last lines
    // ("corral stopped"), still queued for stdout.
    telemetry::repeats::flush();
    if !log_sink::flush_installed(Duration::from_secs(2)) {
        eprintln!("corral: stdout did not take the last log lines within 2s");
    }
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("corral: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn check(path: &Path) -> ExitCode {
    match config::load(path) {
        Ok(c) => {
            println!("{}: ok ({} routes)", path.display(), c.routes.len());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(2)
        }
    }
}

fn purge_cli(admin: &str, token: &str, (kind, value): (&str, String), soft: bool) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("corral purge: {e}");
            return ExitCode::FAILURE;
        }
    };
    let endpoint = format!("{}/purge", admin.trim_end_matches('/'));
    let soft = if soft { "true" } else { "false" };
    let result = runtime.block_on(async {
        let client = reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(10))
            .no_proxy()
            .build()?;
        let res = client
            .post(&endpoint)
            .bearer_auth(token)
            .query(&[(kind, value.as_str()), ("soft", soft)])
            .send()
            .await?;
        let status = res.status();
        let body = res.text().await?;
        Ok::<_, reqwest::Error>((status, body))
    });
    match result {
        Ok((status, body)) => {
            print!("{body}");
            if status.is_success() {
                ExitCode::SUCCESS
            } else {
                eprintln!("corral purge: {endpoint} answered {status}");
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("corral purge: {endpoint}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Log lines go to stdout through [`log_sink`]: requests never wait on it.
fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CORRAL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    match log_sink::install() {
        Ok(sink) => {
            if matches!(format, LogFormat::Json) {
                access_log::write_json_to(sink.clone());
            }
            init_subscriber(filter, format, sink);
        }
        Err(e) => {
            eprintln!("corral: no log writer thread ({e}); logging straight to stdout");
            init_subscriber(filter, format, std::io::stdout);
        }
    }
}

fn init_subscriber<W>(filter: tracing_subscriber::EnvFilter, format: LogFormat, writer: W)
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    // Colour only for a person at a terminal: a file or a pipe (journald,
    // a log shipper, `scripts/demo`'s log) gets the plain text.
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stdout().is_terminal())
        .with_writer(writer);
    match format {
        LogFormat::Json => builder.json().flatten_event(true).init(),
        LogFormat::Pretty => builder.init(),
    }
}

/// The tokens of the admin listener.
struct Tokens {
    /// The purge API's.
    purge: Option<String>,
    /// The live view's.
    admin: AdminToken,
}

/// The live view's token.
enum AdminToken {
    /// `server.admin_token` or `CORRAL_ADMIN_TOKEN`: always asked for.
    Own(String),
    /// None of its own: the purge token (if any), asked for only when
    /// the admin listener is not on loopback.
    Purge(Option<String>),
}

/// The addresses a serving process bound and its name: logged, and
/// written as JSON to the file `CORRAL_READY_FILE` names once every
/// listener is bound, so that whoever started it with port 0 (a test
/// harness, a supervisor) learns its ports from it.
#[derive(serde::Serialize)]
struct Bound {
    instance: String,
    listen: std::net::SocketAddr,
    listen_tls: Option<std::net::SocketAddr>,
    admin: std::net::SocketAddr,
    health_listen: Option<std::net::SocketAddr>,
}

impl Bound {
    /// Written whole or not at all: to a file beside it, then renamed.
    fn write(&self, path: &std::path::Path) -> anyhow::Result<()> {
        let mut temp = path.as_os_str().to_owned();
        temp.push(".tmp");
        std::fs::write(&temp, serde_json::to_vec(self)?)?;
        std::fs::rename(&temp, path)?;
        Ok(())
    }
}

/// This process, as the fleet view names it: the host name and the pid.
fn instance_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned());
    format!("{host}/{}", std::process::id())
}

/// How often an instance with Redis publishes its summary for the fleet
/// view, and how long one lasts: an instance that stopped drops off
/// within that.
const HEARTBEAT_EVERY: Duration = Duration::from_secs(2);
const HEARTBEAT_TTL: Duration = Duration::from_secs(10);

/// Publishes this instance's summary in Redis every [`HEARTBEAT_EVERY`]
/// for the fleet view (`/stats?fleet=1`). A failed write is retried at
/// the next beat; the view then lists this instance a while less.
async fn heartbeat(state: Arc<crate::ops::AdminState>) {
    // The first once the instance has had a moment to reach Redis.
    let first = tokio::time::Instant::now() + HEARTBEAT_EVERY / 4;
    let mut tick = tokio::time::interval_at(first, HEARTBEAT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(l2) = &state.app.l2 else {
            return;
        };
        let mut summary = admin::summary(&state);
        let line = crate::ops::json_line(&summary);
        let written = match l2
            .heartbeat(&state.instance, line.trim_end(), HEARTBEAT_TTL)
            .await
        {
            // Over the heartbeat's size bound (a great many routes, long
            // keys): the fleet view gets this instance's totals without its
            // routes and most-waited keys.
            Ok(false) => {
                summary.routes.clear();
                summary.flights.most_waited.clear();
                let line = crate::ops::json_line(&summary);
                l2.heartbeat(&state.instance, line.trim_end(), HEARTBEAT_TTL)
                    .await
            }
            other => other,
        };
        match written {
            Ok(true) => {}
            Ok(false) => tracing::debug!("fleet heartbeat over its size bound: not written"),
            Err(e) => tracing::debug!(error = %e, "fleet heartbeat not written"),
        }
    }
}

/// The client sockets, bound here so that a taken port fails the start,
/// and the addresses they were given (a configured port 0 becomes the
/// kernel's). per_core: one listening socket per worker thread on the
/// same address (SO_REUSEPORT: the kernel spreads connections over them).
#[expect(
    clippy::type_complexity,
    reason = "each worker's plain and TLS socket, then the two addresses"
)]
fn bind_clients(
    config: &config::Config,
) -> anyhow::Result<(
    Vec<(std::net::TcpListener, Option<std::net::TcpListener>)>,
    std::net::SocketAddr,
    Option<std::net::SocketAddr>,
)> {
    let sockets = match config.server.runtime {
        RuntimeMode::Shared => 1,
        RuntimeMode::PerCore => config
            .server
            .workers
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
    };
    let reuseport = config.server.runtime == RuntimeMode::PerCore;
    let mut listeners = Vec::with_capacity(sockets);
    // After the first socket, the others take its address (a configured
    // port 0 becomes the one the first was given).
    let (mut plain_addr, mut tls_addr) =
        (config.listen, config.listen_tls.as_ref().map(|t| t.addr));
    for _ in 0..sockets {
        let plain = client_listener(plain_addr, reuseport)
            .with_context(|| format!("cannot listen on {} (listen)", config.listen))?;
        plain_addr = plain.local_addr()?;
        let secure = match tls_addr {
            None => None,
            Some(addr) => {
                let l = client_listener(addr, reuseport)
                    .with_context(|| format!("cannot listen on {addr} (listen_tls.addr)"))?;
                tls_addr = Some(l.local_addr()?);
                Some(l)
            }
        };
        listeners.push((plain, secure));
    }
    Ok((listeners, plain_addr, tls_addr))
}

async fn serve(
    config: config::Config,
    source: Option<(PathBuf, u64)>,
    tokens: Tokens,
    max_connections: usize,
) -> anyhow::Result<()> {
    let (listeners, plain_addr, tls_addr) = bind_clients(&config)?;
    let listener_tls = match &config.listen_tls {
        None => None,
        Some(t) => Some(http::tls::ListenerTls::load(t)?),
    };
    let (admin_listener, health_listener) = bind_admin(&config).await?;
    let admin_addr = admin_listener.local_addr()?;
    let health_addr = match &health_listener {
        Some(l) => Some(l.local_addr()?),
        None => None,
    };
    let metrics = metrics::install();
    metrics::spawn_upkeep(metrics.clone());
    let app = Arc::new(app::App::new(&config).context("invalid redis section")?);
    let admin_state = admin_state(&app, metrics, tokens, &config, plain_addr);
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let admin = spawn_admin(
        &admin_state,
        admin_listener,
        health_listener,
        &config,
        &shutdown_rx,
    );
    if let Some((path, loaded)) = source {
        reload::spawn(Arc::clone(&app), path, config.clone(), loaded);
    }
    // What was bound, which a configured port 0 leaves to the kernel.
    let bound = Bound {
        instance: admin_state.instance.clone(),
        listen: plain_addr,
        listen_tls: tls_addr,
        admin: admin_addr,
        health_listen: health_addr,
    };
    if let Some(path) = std::env::var_os("CORRAL_READY_FILE") {
        bound.write(std::path::Path::new(&path)).with_context(|| {
            format!("cannot write CORRAL_READY_FILE {}", path.to_string_lossy())
        })?;
    }
    tracing::info!(listen = %bound.listen, admin = %bound.admin, health_listen = ?bound.health_listen, live = %format_args!("http://{}/", bound.admin), routes = config.routes.len(), redis = config.redis.is_some(), "corral serving");
    spawn_drain(admin_state, config.server.drain_period, shutdown_tx);
    crate::overload::spawn(config.server.overload.map(|p| f64::from(p) / 100.0));
    serve_clients(
        &config,
        listeners,
        listener_tls,
        app,
        max_connections,
        shutdown_rx,
    )
    .await?;
    let _ = admin.await;
    tracing::info!("corral stopped");
    Ok(())
}

/// The admin listener, and the health listener where one is configured.
async fn bind_admin(config: &config::Config) -> anyhow::Result<(TcpListener, Option<TcpListener>)> {
    let admin = TcpListener::bind(config.admin)
        .await
        .with_context(|| format!("cannot listen on {} (admin)", config.admin))?;
    let health = match config.health_listen {
        None => None,
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr} (health_listen)"))?,
        ),
    };
    Ok((admin, health))
}

/// What the admin and health listeners serve from, with its history
/// sampler and (with Redis) its heartbeat running.
fn admin_state(
    app: &Arc<app::App>,
    metrics: metrics_exporter_prometheus::PrometheusHandle,
    tokens: Tokens,
    config: &config::Config,
    listen: std::net::SocketAddr,
) -> Arc<crate::ops::AdminState> {
    let admin_state = Arc::new(crate::ops::AdminState {
        app: Arc::clone(app),
        metrics,
        draining: std::sync::atomic::AtomicBool::new(false),
        purge_token: tokens.purge,
        guarded: matches!(tokens.admin, AdminToken::Own(_)) || !config.admin.ip().is_loopback(),
        metrics_token: match &tokens.admin {
            AdminToken::Own(t) => Some(t.clone()),
            AdminToken::Purge(_) => None,
        },
        admin_hosts: config.server.admin_hosts.clone(),
        admin_token: match tokens.admin {
            AdminToken::Own(t) => Some(t),
            AdminToken::Purge(t) => t,
        },
        instance: instance_name(),
        listen: listen.to_string(),
        started: std::time::Instant::now(),
        history: crate::ops::history::History::default(),
    });
    {
        let state = Arc::clone(&admin_state);
        tokio::spawn(async move {
            crate::ops::history::record(&state.history, || admin::summary(&state)).await;
        });
    }
    if app.l2.is_some() {
        tokio::spawn(heartbeat(Arc::clone(&admin_state)));
    }
    admin_state
}

/// The admin listener's task (returned, to be awaited at shutdown), and
/// the health listener's.
fn spawn_admin(
    admin_state: &Arc<crate::ops::AdminState>,
    admin_listener: TcpListener,
    health_listener: Option<TcpListener>,
    config: &config::Config,
    shutdown_rx: &watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    if let Some(listener) = health_listener {
        let (state, server, shutdown) = (
            Arc::clone(admin_state),
            config.server.clone(),
            shutdown_rx.clone(),
        );
        tokio::spawn(async move {
            admin::serve_health(listener, state, &server, shutdown).await;
        });
    }
    let (state, server, shutdown) = (
        Arc::clone(admin_state),
        config.server.clone(),
        shutdown_rx.clone(),
    );
    tokio::spawn(async move {
        admin::serve(admin_listener, state, &server, shutdown).await;
    })
}

/// On SIGTERM or SIGINT: load balancers and Kubernetes see the instance
/// leave first (/lb-health and /readyz turn 503) while it still serves;
/// after the drain period it stops accepting and lets in-flight requests
/// finish.
fn spawn_drain(
    admin_state: Arc<crate::ops::AdminState>,
    drain_period: Duration,
    shutdown_tx: watch::Sender<bool>,
) {
    tokio::spawn(async move {
        let graceful = wait_for_signal().await;
        admin_state
            .draining
            .store(true, std::sync::atomic::Ordering::Release);
        if graceful {
            tracing::info!(drain_period = ?drain_period, "SIGTERM: draining");
            tokio::time::sleep(drain_period).await;
        }
        tracing::info!("no longer accepting connections; finishing in-flight requests");
        let _ = shutdown_tx.send(true);
    });
}

/// Serves the clients on this runtime (`shared`) or on a runtime per
/// core (`per_core`) until shutdown.
async fn serve_clients(
    config: &config::Config,
    mut listeners: Vec<(std::net::TcpListener, Option<std::net::TcpListener>)>,
    listener_tls: Option<Arc<http::tls::ListenerTls>>,
    app: Arc<app::App>,
    max_connections: usize,
    shutdown_rx: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    match config.server.runtime {
        RuntimeMode::Shared => {
            // This runtime serves clients (per_core: each worker's does).
            crate::overload::serving_here();
            let (plain, secure) = listeners.pop().context("no listener")?;
            let plain = TcpListener::from_std(plain).context("the client listener")?;
            let secure = match (secure, listener_tls) {
                (Some(s), Some(tls)) => Some((
                    TcpListener::from_std(s).context("the TLS client listener")?,
                    tls,
                )),
                _ => None,
            };
            server::serve(
                plain,
                secure,
                app,
                &config.server,
                max_connections,
                shutdown_rx,
            )
            .await;
        }
        RuntimeMode::PerCore => {
            server::serve_per_core(
                listeners,
                listener_tls,
                app,
                &config.server,
                max_connections,
                shutdown_rx,
            )
            .await;
        }
    }
    Ok(())
}

/// The client listener, with a deep accept queue: a stampede is a burst of
/// connections too, and an overflowing queue costs a client a 1 s SYN retry.
/// Returned unregistered (a std listener), for the runtime that serves it;
/// `reuseport`: one of several sockets on the address (per_core).
fn client_listener(
    addr: std::net::SocketAddr,
    reuseport: bool,
) -> std::io::Result<std::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    if reuseport {
        socket.set_reuseport(true)?;
    }
    socket.bind(addr)?;
    socket.listen(8192)?.into_std()
}

/// Waits for SIGTERM (true: drain first) or SIGINT (false: stop now).
async fn wait_for_signal() -> bool {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    match (term, int) {
        (Ok(mut t), Ok(mut i)) => {
            tokio::select! {
                _ = t.recv() => true,
                _ = i.recv() => false,
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proxy_flag_is_one_value_whatever_it_holds() {
        let config = |to: &str, redis: Option<&str>| {
            config::parse(
                "corral proxy",
                &proxy_config(&flags(to, redis, Some("10s"))),
            )
        };
        // Quotes, a newline and YAML of its own stay inside the one value,
        // which is then refused as the upstream it claims to be.
        let Err(error) = config("http://127.0.0.1:3000\"\n  evil: {x: 1}\n", None) else {
            panic!("a --to holding YAML was accepted");
        };
        assert_eq!(proxy_flag(&error.field), "--to", "{error}");
        // Without CORRAL_REDIS_AUTH_KEY (not set for unit tests) a --redis
        // is refused, and the refusal names the flag.
        let Err(error) = config("http://127.0.0.1:3000", Some("redis://127.0.0.1:6379")) else {
            panic!("--redis without a key was accepted");
        };
        assert_eq!(proxy_flag(&error.field), "--redis", "{error}");
        let ok = config("http://127.0.0.1:3000", None).expect("valid");
        assert_eq!(ok.routes.len(), 1);
        assert_eq!(ok.routes[0].path_prefix, "/");
        assert!(ok.redis.is_none());
        assert_eq!(ok.cache.memory, 64 << 20);
    }

    fn flags<'a>(to: &'a str, redis: Option<&'a str>, ttl: Option<&'a str>) -> ProxyFlags<'a> {
        ProxyFlags {
            to,
            listen: "127.0.0.1:8080",
            admin: "127.0.0.1:9080",
            redis,
            memory: "64MiB",
            ttl,
            stale: (None, None),
        }
    }

    #[test]
    fn ttl_gives_answers_without_freshness_a_lifetime_and_no_cache_turns_caching_off() {
        let route = |ttl: Option<&str>| {
            let text = proxy_config(&flags("http://127.0.0.1:3000", None, ttl));
            let config = config::parse("corral proxy", &text).expect("valid");
            config.routes.into_iter().next().expect("one route")
        };
        let default = route(Some(DEFAULT_PROXY_TTL));
        assert_eq!(default.cache.default_ttl, Some(Duration::from_secs(10)));
        assert!(default.cache.enabled);
        assert_eq!(
            route(Some("2m")).cache.default_ttl,
            Some(Duration::from_secs(120))
        );
        for zero in ["0", "0s", "0ms"] {
            let off = route(Some(zero));
            assert_eq!(off.cache.default_ttl, None, "{zero}");
            assert!(off.cache.enabled);
        }
        assert!(!route(None).cache.enabled);
        let text = proxy_config(&flags("http://127.0.0.1:3000", None, Some("soon")));
        let Err(error) = config::parse("corral proxy", &text) else {
            panic!("--ttl soon was accepted");
        };
        assert_eq!(proxy_flag(&error.field), "--ttl", "{error}");
    }

    #[test]
    fn the_stale_flags_set_the_routes_stale_windows_and_name_themselves() {
        let with = |swr: Option<&str>, sie: Option<&str>| {
            let mut f = flags("http://127.0.0.1:3000", None, Some("0"));
            f.stale = (swr, sie);
            config::parse("corral proxy", &proxy_config(&f))
        };
        let route = with(Some("30s"), Some("1h"))
            .expect("valid")
            .routes
            .into_iter()
            .next()
            .expect("one route");
        assert_eq!(route.cache.default_ttl, None);
        assert_eq!(
            route.cache.stale_while_revalidate.default,
            Duration::from_secs(30)
        );
        assert_eq!(
            route.cache.stale_if_error.default,
            Duration::from_secs(3600)
        );
        for (swr, sie, flag) in [
            (Some("soon"), None, "--stale-while-revalidate"),
            (None, Some("later"), "--stale-if-error"),
        ] {
            let Err(error) = with(swr, sie) else {
                panic!("{flag} accepted a bad value");
            };
            assert_eq!(proxy_flag(&error.field), flag, "{error}");
        }
    }
}
