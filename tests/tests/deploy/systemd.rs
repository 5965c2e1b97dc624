//! deploy/systemd/: the unit carries its hardening (and passes `systemd-analyze verify` when installed).

use super::*;

fn unit_text() -> String {
    read(&deploy_dir().join("systemd").join("corral.service"))
}

/// `Key=value` lines of the unit (comments skipped), in order.
fn unit_directives(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#') && !l.starts_with(';') && !l.starts_with('['))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

#[test]
fn the_systemd_unit_is_hardened() {
    let directives = unit_directives(&unit_text());
    let value = |key: &str| -> Vec<&str> {
        directives
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .collect()
    };
    for (key, expected) in [
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("PrivateDevices", "yes"),
        ("CapabilityBoundingSet", ""),
        ("RestrictAddressFamilies", "AF_INET AF_INET6 AF_UNIX"),
        ("SystemCallFilter", "@system-service"),
        ("MemoryDenyWriteExecute", "yes"),
        ("LimitNOFILE", "65536"),
        ("ExecReload", "/bin/kill -HUP $MAINPID"),
        ("KillSignal", "SIGTERM"),
        ("Restart", "on-failure"),
    ] {
        assert!(
            value(key).contains(&expected),
            "corral.service lacks {key}={expected} (has {:?})",
            value(key)
        );
    }
    assert!(
        value("DynamicUser").contains(&"yes") || !value("User").is_empty(),
        "corral.service runs as DynamicUser or a named user"
    );
    assert!(
        !value("User").contains(&"root"),
        "corral.service must not run as root"
    );
    assert_eq!(
        value("ExecStart"),
        vec!["/usr/local/bin/corral serve --config /etc/corral/corral.yaml"],
        "ExecStart"
    );
}

#[test]
fn the_systemd_stop_timeout_outlasts_the_drain() {
    let directives = unit_directives(&unit_text());
    let timeout = directives
        .iter()
        .find(|(k, _)| k == "TimeoutStopSec")
        .map(|(_, v)| v.clone())
        .expect("TimeoutStopSec (systemd's 90s default hides the intent)");
    // The unit runs /etc/corral/corral.yaml, installed from config/corral.yaml.
    let config: CorralConfig = parse(
        "config/corral.yaml",
        &read(&workspace_root().join("config").join("corral.yaml")),
    );
    let timeout = if timeout.chars().all(|c| c.is_ascii_digit()) {
        timeout.parse::<f64>().expect("TimeoutStopSec seconds")
    } else {
        seconds(&timeout)
    };
    assert!(
        timeout > config.server.stop_seconds(),
        "TimeoutStopSec {timeout}s must exceed drain + shutdown_grace = {}s",
        config.server.stop_seconds()
    );
}

#[tokio::test]
async fn systemd_analyze_verifies_the_unit_when_installed() {
    let Some(analyze) = which("systemd-analyze") else {
        eprintln!("systemd-analyze is not installed: only the string checks ran");
        return;
    };
    // verify wants ExecStart's binary to exist: point it at the built one.
    let scratch = TempDir::new("deploy-systemd").expect("create a scratch dir");
    let unit = scratch.path().join("corral.service");
    let bin = corral_bin();
    let text = unit_text().replace("/usr/local/bin/corral", &bin.display().to_string());
    std::fs::write(&unit, text).expect("write the unit copy");
    let output = output_within(
        tokio::process::Command::new(analyze)
            .arg("verify")
            .arg(&unit),
        DEADLINE,
        "systemd-analyze verify",
    )
    .await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    // verify exits 0 on unknown keys but names them: any line about the unit fails.
    let complaints: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("corral.service"))
        .collect();
    assert!(
        output.status.success() && complaints.is_empty(),
        "systemd-analyze verify ({}):\n{stderr}",
        output.status
    );
}
