//! corral's benchmarks. The criterion micro-benchmarks live in
//! `benches/`; load scenarios (oha against real processes) in `bench/run.sh`.

/// The resident memory (RSS) of process `pid` in MiB, from /proc; 0 when it
/// cannot be read (the process is gone).
pub fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0.0);
    kb / 1024.0
}
