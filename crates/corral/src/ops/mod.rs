//! The operator's surface: the admin listener (`admin`: health,
//! readiness, metrics, status), purges (`purge`) and configuration reload
//! (`reload`). Drives `cache` and `cluster`.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use metrics_exporter_prometheus::PrometheusHandle;

use crate::app::App;

pub mod admin;
pub mod purge;
pub mod reload;

/// What the admin endpoints report on.
pub struct AdminState {
    pub app: Arc<App>,
    pub metrics: PrometheusHandle,
    /// Set when SIGTERM starts the drain.
    pub draining: AtomicBool,
    /// The purge API's bearer token; `None` refuses every purge.
    pub purge_token: Option<String>,
}

/// One JSON object and a newline: the admin endpoints' bodies.
pub fn json_line(value: &impl serde::Serialize) -> String {
    let mut s = serde_json::to_string(value).unwrap_or_else(|_| "{}".to_owned());
    s.push('\n');
    s
}
