//! The operator's surface: the admin listener (`admin`: health,
//! readiness, metrics, status, and the recent past, `history`), purges (`purge`) and configuration reload
//! (`reload`). Drives `cache` and `cluster`.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use metrics_exporter_prometheus::PrometheusHandle;

use crate::app::App;

pub mod admin;
pub mod history;
pub mod purge;
pub mod reload;
pub mod stats;
pub mod top;

/// What the admin endpoints report on.
pub struct AdminState {
    pub app: Arc<App>,
    pub metrics: PrometheusHandle,
    /// Set when SIGTERM starts the drain.
    pub draining: AtomicBool,
    /// The purge API's bearer token; `None` refuses every purge.
    pub purge_token: Option<String>,
    /// The live view's token (`server.admin_token`, else the purge token).
    pub admin_token: Option<String>,
    /// The admin listener is not on loopback, or has a token of its own:
    /// the live view needs `admin_token`.
    pub guarded: bool,
    /// `/metrics`' token: the admin token when it is the instance's own
    /// (`server.admin_token`, `CORRAL_ADMIN_TOKEN`); `None`: open.
    pub metrics_token: Option<String>,
    /// Names (lower case) besides IP literals and `localhost` that the
    /// views, metrics and purges answer for (`server.admin_hosts`).
    pub admin_hosts: Vec<String>,
    /// This process, as the fleet view names it: host name and pid.
    pub instance: String,
    /// The client listener's address.
    pub listen: String,
    pub started: std::time::Instant,
    /// The last 15 minutes of readings (`GET /history`).
    pub history: history::History,
}

/// One JSON object and a newline: the admin endpoints' bodies.
pub fn json_line(value: &impl serde::Serialize) -> String {
    let mut s = serde_json::to_string(value).unwrap_or_else(|_| "{}".to_owned());
    s.push('\n');
    s
}
