//! corral: an HTTP reverse-proxy cache that stops cache stampedes.
//! `corral serve --config FILE` runs it; `corral check --config FILE`
//! validates a configuration and exits.

mod admin;
mod app;
mod breaker;
mod cache_path;
mod config;
mod fill;
mod hop_by_hop;
mod l2;
mod lease;
mod metrics;
mod proxy;
mod redis_link;
mod reload;
mod request;
mod respond;
mod routes;
mod server;
mod shared_flight;
mod subscriber;
mod upstream;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

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
    /// Validate a configuration file and exit (0 when valid).
    Check {
        #[arg(long, short)]
        config: PathBuf,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Json,
    Pretty,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check { config } => check(&config),
        Command::Serve { config, log_format } => {
            let path = config;
            let config = match config::load(&path) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("corral: invalid configuration: {e}");
                    return ExitCode::from(2);
                }
            };
            init_logs(log_format);
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("corral: cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match runtime.block_on(serve(config, path)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("corral: {e:#}");
                    ExitCode::FAILURE
                }
            }
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

fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CORRAL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stdout);
    match format {
        LogFormat::Json => builder.json().flatten_event(true).init(),
        LogFormat::Pretty => builder.init(),
    }
}

async fn serve(config: config::Config, path: PathBuf) -> anyhow::Result<()> {
    let listener = client_listener(config.listen)
        .with_context(|| format!("cannot listen on {} (listen)", config.listen))?;
    let admin_listener = TcpListener::bind(config.admin)
        .await
        .with_context(|| format!("cannot listen on {} (admin)", config.admin))?;
    let metrics = metrics::install();
    let app = Arc::new(app::App::new(&config).context("invalid redis.url")?);
    let admin_state = Arc::new(admin::AdminState {
        app: Arc::clone(&app),
        metrics,
        draining: std::sync::atomic::AtomicBool::new(false),
    });
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let admin = tokio::spawn(admin::serve(
        admin_listener,
        Arc::clone(&admin_state),
        shutdown_rx.clone(),
    ));
    reload::spawn(Arc::clone(&app), path, config.clone());
    tracing::info!(listen = %config.listen, admin = %config.admin, routes = config.routes.len(), redis = config.redis.is_some(), "corral serving");
    let drain_period = config.server.drain_period;
    tokio::spawn(async move {
        let graceful = wait_for_signal().await;
        // Load balancers and Kubernetes see the instance leave first
        // (/lb-health and /readyz turn 503) while it still serves; only then
        // does it stop accepting and let in-flight requests finish.
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
    server::serve(listener, app, &config.server, shutdown_rx).await;
    let _ = admin.await;
    tracing::info!("corral stopped");
    Ok(())
}

/// The client listener, with a deep accept queue: a stampede is a burst of
/// connections too, and an overflowing queue costs a client a 1 s SYN retry.
fn client_listener(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(8192)
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
