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

/// An HTTP/1.1 200 answer's head at the front of `buf`: where the head ends
/// and its Content-Length, once the whole head is there (`None` before);
/// `Some(Err)` for another status or a head without Content-Length. For
/// the load clients (`ttfb-load`, `capacity-load`), which count only whole
/// 200 answers of a known length.
pub fn answer_head(buf: &[u8]) -> Option<Result<(usize, usize), String>> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let text = String::from_utf8_lossy(&buf[..end]);
    let mut lines = text.split("\r\n");
    let status = lines.next().unwrap_or("");
    if !status.starts_with("HTTP/1.1 200") {
        return Some(Err(format!("status line {status:?}")));
    }
    let len = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse().ok());
    Some(
        len.map(|n| (end, n))
            .ok_or_else(|| "no Content-Length".to_owned()),
    )
}
