//! Hot reload: on SIGHUP, and whenever the config file's contents change
//! (checked every second by reading the file through its path, which
//! follows editor renames and Kubernetes ConfigMap symlink swaps alike),
//! the file is loaded and validated; a good one replaces the routes and
//! `server.trusted_proxies` atomically, a bad one is refused with its file:line:field and the
//! running configuration stays. Requests in flight finish on the routes
//! they started with.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{SignalKind, signal};

use crate::app::App;
use crate::config::{self, Config};

const POLL: Duration = Duration::from_secs(1);

/// Watches `path` for the life of the process.
/// `loaded` is the fingerprint of the bytes `running` was parsed from.
pub fn spawn(app: Arc<App>, path: PathBuf, running: Config, loaded: u64) {
    tokio::spawn(async move {
        let mut hup = match signal(SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGHUP; reloads come from file changes only");
                None
            }
        };
        let mut last = Some(loaded);
        let mut running = running;
        loop {
            let forced = tokio::select! {
                _ = async { match hup.as_mut() { Some(h) => { h.recv().await; } None => std::future::pending::<()>().await } } => true,
                _ = tokio::time::sleep(POLL) => false,
            };
            // A file caught mid-rename reads as missing: try again next tick.
            let Ok(bytes) = std::fs::read(&path) else {
                if forced {
                    tracing::error!(file = %path.display(), "reload requested but the config file cannot be read; keeping the running configuration");
                }
                continue;
            };
            let digest = crate::config::fingerprint(&bytes);
            if !forced && last == Some(digest) {
                continue;
            }
            last = Some(digest);
            match config::load(&path) {
                Ok(new) => {
                    for field in needs_restart(&running, &new) {
                        tracing::warn!(
                            field,
                            "changed in the config file, but only takes effect after a restart"
                        );
                    }
                    app.reload(&new);
                    tracing::info!(file = %path.display(), routes = new.routes.len(), "configuration reloaded");
                    running = new;
                }
                Err(e) => {
                    tracing::error!(error = %e, "configuration reload refused; keeping the running configuration");
                }
            }
        }
    });
}

/// The settings a reload cannot apply to a running process.
fn needs_restart(old: &Config, new: &Config) -> Vec<&'static str> {
    let mut fields = Vec::new();
    if old.listen != new.listen {
        fields.push("listen");
    }
    if old.admin != new.admin {
        fields.push("admin");
    }
    let tls = |c: &Config| {
        c.listen_tls
            .as_ref()
            .map(|t| (t.addr, t.cert_file.clone(), t.key_file.clone()))
    };
    if tls(old) != tls(new) {
        fields.push("listen_tls");
    }
    if old.cache.memory != new.cache.memory {
        fields.push("cache.memory");
    }
    if old.server.header_read_timeout != new.server.header_read_timeout
        || old.server.max_header_size != new.server.max_header_size
    {
        fields.push("server");
    }
    if (old.server.runtime, old.server.workers) != (new.server.runtime, new.server.workers) {
        fields.push("server.runtime/server.workers");
    }
    if old.server.proxy_name != new.server.proxy_name {
        fields.push("server.proxy_name");
    }
    if old.server.cpu_threads != new.server.cpu_threads {
        fields.push("server.cpu_threads");
    }
    if old.server.listen_proxy_protocol != new.server.listen_proxy_protocol {
        fields.push("server.listen_proxy_protocol");
    }
    let redis = |c: &Config| {
        c.redis
            .as_ref()
            .map(|r| (r.servers.clone(), r.key_prefix.clone()))
    };
    if redis(old) != redis(new) {
        fields.push("redis");
    }
    if old.redis.as_ref().map(|r| &r.tls) != new.redis.as_ref().map(|r| &r.tls) {
        fields.push("redis.tls");
    }
    if old.redis.as_ref().map(|r| r.instances) != new.redis.as_ref().map(|r| r.instances) {
        fields.push("redis.instances");
    }
    if old.callers.local_buckets != new.callers.local_buckets {
        fields.push("callers.local_buckets");
    }
    fields
}
