//! Running a program to its end under a deadline, as the scenarios that
//! check a script or a tool do.

use std::process::{Output, Stdio};
use std::time::Duration;

/// Runs `cmd` (stdin closed, stdout and stderr captured, killed if the
/// test drops it) and returns what it printed; fails the test naming
/// `what` if it cannot start or runs past `within`.
pub async fn output_within(
    cmd: &mut tokio::process::Command,
    within: Duration,
    what: &str,
) -> Output {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {what}: {e}"));
    tokio::time::timeout(within, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {within:?}"))
        .unwrap_or_else(|e| panic!("wait for {what}: {e}"))
}
