//! corral: an HTTP reverse-proxy cache that stops cache stampedes.
//! `corral serve --config FILE` runs it; `corral check --config FILE`
//! validates a configuration and exits.

mod admin;
mod app;
#[allow(dead_code)]
mod breaker;
mod cache_path;
mod config;
mod fill;
mod hop_by_hop;
mod l2;
mod lease;
mod proxy;
mod redis_link;
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
            let config = match config::load(&config) {
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
            match runtime.block_on(serve(config)) {
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

async fn serve(config: config::Config) -> anyhow::Result<()> {
    let listener = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {} (listen)", config.listen))?;
    let admin_listener = TcpListener::bind(config.admin)
        .await
        .with_context(|| format!("cannot listen on {} (admin)", config.admin))?;
    let app = Arc::new(app::App::new(&config).context("invalid redis.url")?);
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let admin = tokio::spawn(admin::serve(admin_listener, shutdown_rx.clone()));
    tracing::info!(listen = %config.listen, admin = %config.admin, routes = config.routes.len(), "corral serving");
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutdown requested: draining");
        let _ = shutdown_tx.send(true);
    });
    server::serve(listener, app, &config.server, shutdown_rx).await;
    let _ = admin.await;
    tracing::info!("corral stopped");
    Ok(())
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    match (term, int) {
        (Ok(mut t), Ok(mut i)) => {
            tokio::select! {
                _ = t.recv() => {}
                _ = i.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
