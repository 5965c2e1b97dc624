//! Raises the soft open-files limit so bursts of a thousand connections fit.
//!
//! The tests crate has no libc binding (and `unsafe` is denied outside
//! corral-core's sealed-body module), so this reads `/proc/self/limits`
//! and asks `prlimit(1)` to lift the soft limit of this
//! process; children (the proxy) inherit it. It never lowers a limit.

use std::sync::OnceLock;

/// Makes sure the soft RLIMIT_NOFILE is at least `min` (capped at the hard
/// limit) and returns the soft limit in force, or `None` where it cannot be read.
pub fn ensure_open_files(min: u64) -> Option<u64> {
    static RAISED: OnceLock<Option<u64>> = OnceLock::new();
    *RAISED.get_or_init(|| raise(min))
}

fn raise(min: u64) -> Option<u64> {
    let (soft, hard) = read_limits()?;
    if soft >= min {
        return Some(soft);
    }
    let target = hard.map_or(min, |hard| hard.min(min));
    let hard_arg = hard.map_or_else(|| "unlimited".to_owned(), |h| h.to_string());
    let status = std::process::Command::new("prlimit")
        .arg(format!("--pid={}", std::process::id()))
        .arg(format!("--nofile={target}:{hard_arg}"))
        .status();
    if !matches!(status, Ok(s) if s.success()) {
        eprintln!(
            "corral-tests: could not raise the open-files limit from {soft} \
             (run `ulimit -n {min}` before the suite if bursts fail)"
        );
    }
    read_limits().map(|(soft, _)| soft)
}

/// (soft, hard) with `None` for "unlimited".
fn read_limits() -> Option<(u64, Option<u64>)> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let mut fields = line["Max open files".len()..].split_whitespace();
    let parse = |s: &str| -> Option<Option<u64>> {
        if s == "unlimited" {
            Some(None)
        } else {
            s.parse().ok().map(Some)
        }
    };
    let soft = parse(fields.next()?)?.unwrap_or(u64::MAX);
    let hard = parse(fields.next()?)?;
    Some((soft, hard))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_in_force_is_at_least_what_was_asked_or_the_hard_cap() {
        if let Some((_, hard)) = read_limits() {
            let soft = ensure_open_files(1024).expect("limits readable");
            assert!(soft >= hard.unwrap_or(u64::MAX).min(1024));
        }
    }
}
