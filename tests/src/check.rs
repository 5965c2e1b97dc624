//! Runs `corral check --config FILE` and reports its exit status and stderr.

use std::path::{Path, PathBuf};
use std::process::ExitStatus;

use crate::paths::corral_bin;
use crate::temp::TempDir;

/// What `corral check` said about a file.
#[derive(Debug)]
pub struct CheckOutcome {
    /// The exit status.
    pub status: ExitStatus,
    /// Everything printed on stderr.
    pub stderr: String,
    /// The file that was checked.
    pub path: PathBuf,
}

/// Writes `yaml` verbatim to `<scratch>/check.yaml` and runs `corral check` on
/// it; returns (exit status, stderr).
pub async fn corral_check(yaml: &str) -> (ExitStatus, String) {
    let dir = TempDir::new("check").expect("create a scratch dir for check");
    let path = dir.path().join("check.yaml");
    std::fs::write(&path, yaml).expect("write the config to check");
    let outcome = corral_check_file(&path).await;
    (outcome.status, outcome.stderr)
}

/// Runs `corral check --config path`, failing the test after [`crate::DEADLINE`].
pub async fn corral_check_file(path: &Path) -> CheckOutcome {
    let bin = corral_bin();
    let output = crate::command::output_within(
        tokio::process::Command::new(&bin)
            .arg("check")
            .arg("--config")
            .arg(path)
            .env(crate::REDIS_AUTH_KEY_ENV, crate::REDIS_AUTH_KEY),
        crate::DEADLINE,
        &format!("{} check --config {}", bin.display(), path.display()),
    )
    .await;
    CheckOutcome {
        status: output.status,
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        path: path.to_owned(),
    }
}
