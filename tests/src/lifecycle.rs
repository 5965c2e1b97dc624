//! Operating a running proxy from the outside, the way an operator or an
//! orchestrator does: signals, the admin endpoints, the log, rewriting the
//! config file in place, and waiting for the process to exit.
//!
//! Everything goes through `RunningProxy`'s public API, the process table
//! and the wire. The exit status is read from `/proc` before the child is
//! reaped, so a test can tell "exited 0" from "killed".

pub mod access_log;
pub mod scrape;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::proxy::RunningProxy;

pub use access_log::{AccessLine, Json, access_lines, lines_with_message, occurrences};
pub use scrape::{Sample, Scrape};

/// How often the waits below look again when there is no event to wait on.
const POLL: Duration = Duration::from_millis(10);

/// A signal an operator sends to `corral serve`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    /// Drain: leave the load balancer, serve on for the drain period, stop.
    Term,
    /// Stop without the drain period.
    Int,
    /// Reload the config file.
    Hup,
}

impl Signal {
    fn flag(self) -> &'static str {
        match self {
            Signal::Term => "-TERM",
            Signal::Int => "-INT",
            Signal::Hup => "-HUP",
        }
    }
}

/// Sends `signal` to the proxy with `kill(1)`.
pub fn send_signal(proxy: &RunningProxy, signal: Signal) {
    let pid = proxy.pid().to_string();
    let status = Command::new("kill")
        .arg(signal.flag())
        .arg(&pid)
        .status()
        .unwrap_or_else(|e| panic!("run kill {} {pid}: {e}", signal.flag()));
    assert!(status.success(), "kill {} {pid}: {status}", signal.flag());
}

/// How the process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// It exited with this code.
    Code(i32),
    /// A signal killed it.
    Signaled(i32),
}

/// Waits until the proxy process has exited and returns how; fails the test
/// (with the log) after `within`.
///
/// The child stays a zombie until reaped, and a zombie's `/proc/PID/stat`
/// carries its wait status (field 52), so the status is read there first;
/// only then is the child reaped through [`RunningProxy::is_running`].
pub async fn wait_for_exit(proxy: &mut RunningProxy, within: Duration) -> Exit {
    let pid = proxy.pid();
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_else(|e| {
            panic!("process {pid} was reaped before its exit status was read: {e}")
        });
        // The thread-group leader shows as a zombie while its other
        // threads are still exiting; waitpid reports the exit only after
        // them, so poll until it does.
        if let Some(exit) = exit_from_stat(&stat)
            && !proxy.is_running()
        {
            return exit;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!(
                "corral (pid {pid}) still running {within:?} later\n{}",
                proxy.report()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The exit of a process whose `/proc/PID/stat` is `stat`, once it is a
/// zombie (state `Z` or `X`); `None` while it runs.
fn exit_from_stat(stat: &str) -> Option<Exit> {
    // `comm` (field 2) is parenthesized and may hold spaces: split after it.
    let fields: Vec<&str> = stat
        .get(stat.rfind(')')? + 1..)?
        .split_whitespace()
        .collect();
    // fields[0] is field 3 (state); field 52 (exit_code) is fields[49].
    if !matches!(fields.first(), Some(&("Z" | "X"))) {
        return None;
    }
    let wait_status: i32 = fields.get(49)?.parse().ok()?;
    Some(match wait_status & 0x7f {
        0 => Exit::Code((wait_status >> 8) & 0xff),
        signal => Exit::Signaled(signal),
    })
}

/// An admin endpoint's answer.
#[derive(Clone, Debug)]
pub struct AdminAnswer {
    /// Status code.
    pub status: u16,
    /// The `Content-Type`, if any.
    pub content_type: Option<String>,
    /// The body as text.
    pub body: String,
}

fn admin_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .http1_only()
        .timeout(Duration::from_secs(2))
        .build()
        .expect("build the admin client")
}

/// `GET {admin}{path}`; transport errors are returned.
pub async fn try_admin_get(proxy: &RunningProxy, path: &str) -> anyhow::Result<AdminAnswer> {
    let response = admin_client().get(proxy.admin_url(path)).send().await?;
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = response.text().await?;
    Ok(AdminAnswer {
        status,
        content_type,
        body,
    })
}

/// `GET {admin}{path}`; a transport error fails the test.
pub async fn admin_get(proxy: &RunningProxy, path: &str) -> AdminAnswer {
    try_admin_get(proxy, path)
        .await
        .unwrap_or_else(|e| panic!("GET {}: {e:#}", proxy.admin_url(path)))
}

/// Polls `{admin}{path}` until it answers `status`; fails the test (with the
/// last answer) after `within`.
pub async fn wait_for_admin_status(
    proxy: &RunningProxy,
    path: &str,
    status: u16,
    within: Duration,
) -> AdminAnswer {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let last = try_admin_get(proxy, path).await;
        match &last {
            Ok(answer) if answer.status == status => return answer.clone(),
            _ if tokio::time::Instant::now() >= deadline => panic!(
                "GET {} did not answer {status} within {within:?}; last: {last:?}",
                proxy.admin_url(path)
            ),
            _ => tokio::time::sleep(POLL).await,
        }
    }
}

/// Scrapes `/metrics`; fails the test unless it answers 200 with readable text.
pub async fn scrape(proxy: &RunningProxy) -> Scrape {
    let answer = admin_get(proxy, "/metrics").await;
    assert_eq!(answer.status, 200, "GET /metrics: {answer:?}");
    Scrape::parse(&answer.body).unwrap_or_else(|e| panic!("{e}\n{}", answer.body))
}

/// The log lines that contain `needle`, in order.
pub fn log_lines_with(proxy: &RunningProxy, needle: &str) -> Vec<String> {
    proxy
        .log()
        .lines()
        .filter(|line| line.contains(needle))
        .map(str::to_owned)
        .collect()
}

/// Waits until at least `n` log lines contain `needle` and returns them all;
/// fails the test (with the log) after `within`.
pub async fn wait_for_log_lines(
    proxy: &RunningProxy,
    needle: &str,
    n: usize,
    within: Duration,
) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let lines = log_lines_with(proxy, needle);
        if lines.len() >= n {
            return lines;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!(
                "{} log line(s) with {needle:?} after {within:?}, expected at least {n}\n{}",
                lines.len(),
                proxy.report()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Waits for the first log line that contains `needle`.
pub async fn wait_for_log(proxy: &RunningProxy, needle: &str, within: Duration) -> String {
    wait_for_log_lines(proxy, needle, 1, within)
        .await
        .swap_remove(0)
}

/// Waits until the log holds at least `n` access lines and returns them all.
pub async fn wait_for_access_lines(
    proxy: &RunningProxy,
    n: usize,
    within: Duration,
) -> Vec<AccessLine> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let lines = access_lines(&proxy.log());
        if lines.len() >= n {
            return lines;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!(
                "{} access line(s) after {within:?}, expected at least {n}\n{}",
                lines.len(),
                proxy.report()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The config file as it is on disk now.
pub fn current_config(proxy: &RunningProxy) -> String {
    let path = proxy.config_path();
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// Replaces the config file the way editors and ConfigMap updates do: the
/// new text goes to a temporary file in the same directory, which is then
/// renamed over the old one, so the proxy never reads half a file.
pub fn replace_config(proxy: &RunningProxy, yaml: &str) {
    replace_file(proxy.config_path(), yaml);
}

fn replace_file(path: &Path, text: &str) {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("config");
    let temp = path.with_file_name(format!(".{name}.tmp"));
    std::fs::write(&temp, text).unwrap_or_else(|e| panic!("write {}: {e}", temp.display()));
    std::fs::rename(&temp, path)
        .unwrap_or_else(|e| panic!("rename {} over {}: {e}", temp.display(), path.display()));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(state: &str, exit_code: i32) -> String {
        // pid (comm with spaces) then fields 3..=52.
        let mut fields = vec!["0"; 50];
        fields[0] = state;
        let code = exit_code.to_string();
        fields[49] = &code;
        format!("4242 (corral worker) {}", fields.join(" "))
    }

    #[test]
    fn the_wait_status_of_a_zombie_is_decoded() {
        assert_eq!(exit_from_stat(&stat("S", 0)), None);
        assert_eq!(exit_from_stat(&stat("Z", 0)), Some(Exit::Code(0)));
        assert_eq!(exit_from_stat(&stat("Z", 2 << 8)), Some(Exit::Code(2)));
        assert_eq!(exit_from_stat(&stat("Z", 9)), Some(Exit::Signaled(9)));
    }

    #[test]
    fn this_kernel_reports_the_fields_read_here() {
        let own = std::fs::read_to_string("/proc/self/stat").expect("read /proc/self/stat");
        let after_comm = &own[own.rfind(')').expect("comm") + 1..];
        assert!(
            after_comm.split_whitespace().count() >= 50,
            "no exit_code field in {own}"
        );
    }

    #[test]
    fn a_replaced_file_holds_the_new_text_and_no_temporary_is_left() {
        let dir = crate::temp::TempDir::new("replace").expect("scratch dir");
        let path = dir.path().join("corral.yaml");
        std::fs::write(&path, "old").expect("write");
        replace_file(&path, "new");
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "new");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, ["corral.yaml"]);
    }
}
