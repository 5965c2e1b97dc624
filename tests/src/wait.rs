//! Bounded waiting: every wait in the suite has a deadline.

use std::future::Future;
use std::time::Duration;

/// The default deadline for anything a test waits on.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// Re-runs `check` until it returns true, failing the test after `within`.
///
/// Only for conditions that have no event to wait on (e.g. "the background
/// refresh has been stored"), checked every 10ms.
pub async fn eventually<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if check().await {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {within:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
