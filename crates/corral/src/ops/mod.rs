//! The operator's surface: the admin listener (`admin`: health,
//! readiness, metrics, status), purges (`purge`) and configuration reload
//! (`reload`). Drives `cache` and `cluster`.

pub mod admin;
pub mod purge;
pub mod reload;
