//! A load that the server, not the client, limits. oha spends about as
//! much CPU on an answer as the server does, so on two cores (server on
//! one, client on the other) oha's core is full first and the server is
//! measured below capacity, idling between batches. This client does
//! little per answer: a blocking thread per keep-alive connection, one
//! write per request, one read per answer (for a small one), the head
//! scanned only for its status and Content-Length. With one request in
//! flight per connection it keeps the server's core full on a 1 KiB hit;
//! DEPTH > 1 pipelines (HTTP/1.1) that many per connection.
//!
//! `capacity-load ADDR PATH CONNECTIONS DEPTH SECONDS`
//!
//! Prints one JSON object: `answers` (complete 200 answers with exactly
//! their Content-Length of body), `failed` (any other status, a head
//! without Content-Length, a connection that broke or went quiet for 5 s),
//! `seconds` (from the first request to the last answer), `rps`, and with
//! DEPTH 1 `p50_ms` / `p99_ms` from request written to answer whole
//! (within 1/32 of the value; `null` when pipelined, where an answer's wait
//! includes those queued before it). Requests stop at SECONDS; the answers
//! still owed are then read. Exits 1 when any answer failed or none came.
//! Loopback addresses only.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long a connection waits for a byte (connect, and each read) before
/// it counts as failed.
const QUIET: Duration = Duration::from_secs(5);

/// Latencies in nanoseconds, in buckets 1/32 of a power of two wide
/// (values below 32 ns exact): fixed memory whatever the run's length.
struct Histogram {
    counts: Vec<u64>,
}

impl Histogram {
    const SUB: u32 = 32;

    fn new() -> Self {
        // Up to 2^64 ns: (64 - 5 + 1) powers of two, 32 buckets each.
        Histogram {
            counts: vec![0; (65 - 5) * Self::SUB as usize],
        }
    }

    fn bucket(ns: u64) -> usize {
        if ns < u64::from(Self::SUB) {
            return ns as usize;
        }
        let e = 63 - ns.leading_zeros(); // >= 5
        let m = ns >> (e - 5); // 32..64
        ((e - 4) * Self::SUB) as usize + (m - u64::from(Self::SUB)) as usize
    }

    /// The largest value bucket `i` holds.
    fn upper(i: usize) -> u64 {
        let sub = Self::SUB as usize;
        if i < sub {
            return i as u64;
        }
        let e = (i / sub) as u32 + 4;
        let m = (i % sub) as u64 + u64::from(Self::SUB);
        // The last bucket ends at u64::MAX: (64 << 58) wraps to 0.
        ((m + 1) << (e - 5)).wrapping_sub(1)
    }

    fn record(&mut self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.counts[Self::bucket(ns)] += 1;
    }

    fn add(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
    }

    /// The value at quantile `q` (0..=1), from above; `None` when empty.
    fn quantile(&self, q: f64) -> Option<u64> {
        let total: u64 = self.counts.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(Self::upper(i));
            }
        }
        None
    }
}

/// What a connection counted.
struct Tally {
    answers: u64,
    failed: u64,
    latency: Histogram,
}

/// One answer at the front of `buf`: its length when whole and a 200 with
/// a Content-Length, `Some(Err)` for anything else, `None` while partial.
fn answer(buf: &[u8]) -> Option<Result<usize, String>> {
    match corral_bench::answer_head(buf)? {
        Err(why) => Some(Err(why)),
        Ok((end, len)) => (buf.len() >= end + len).then_some(Ok(end + len)),
    }
}

fn connection(addr: SocketAddr, request: &[u8], depth: usize, stop: &AtomicBool) -> Tally {
    let mut tally = Tally {
        answers: 0,
        failed: 0,
        latency: Histogram::new(),
    };
    let broke = |mut tally: Tally, owed: usize, why: String| {
        eprintln!("capacity-load: {why}");
        tally.failed += owed.max(1) as u64;
        tally
    };
    let mut tcp = match TcpStream::connect_timeout(&addr, QUIET) {
        Ok(t) => t,
        Err(e) => return broke(tally, depth, format!("connect: {e}")),
    };
    let _ = tcp.set_nodelay(true);
    let _ = tcp.set_read_timeout(Some(QUIET));
    let batch = request.repeat(depth);
    let mut sent = Instant::now();
    if let Err(e) = tcp.write_all(&batch) {
        return broke(tally, depth, format!("write: {e}"));
    }
    let mut owed = depth;
    let mut buf = vec![0u8; 256 * 1024];
    let mut have = 0;
    while owed > 0 {
        if have == buf.len() {
            buf.resize(buf.len() * 2, 0);
        }
        let n = match tcp.read(&mut buf[have..]) {
            Ok(0) => return broke(tally, owed, "closed by the server".to_owned()),
            Ok(n) => n,
            Err(e) => return broke(tally, owed, format!("read: {e}")),
        };
        have += n;
        let mut at = 0;
        let mut done = 0;
        while let Some(found) = answer(&buf[at..have]) {
            match found {
                Ok(len) => {
                    at += len;
                    done += 1;
                    tally.answers += 1;
                }
                // The rest of this connection's stream cannot be framed.
                Err(why) => return broke(tally, owed - done, why),
            }
        }
        if done > 0 && depth == 1 {
            tally.latency.record(sent.elapsed());
        }
        buf.copy_within(at..have, 0);
        have -= at;
        owed -= done;
        if done > 0 && !stop.load(Ordering::Relaxed) {
            sent = Instant::now();
            if let Err(e) = tcp.write_all(&batch[..done * request.len()]) {
                return broke(tally, owed, format!("write: {e}"));
            }
            owed += done;
        }
    }
    tally
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: capacity-load ADDR PATH CONNECTIONS DEPTH SECONDS";
    let [_, addr, path, conns, depth, secs] = &args[..] else {
        eprintln!("{usage}");
        std::process::exit(2);
    };
    let (Ok(addr), Ok(conns), Ok(depth), Ok(secs)) = (
        addr.parse::<SocketAddr>(),
        conns.parse::<usize>(),
        depth.parse::<usize>(),
        secs.parse::<f64>(),
    ) else {
        eprintln!("{usage}");
        std::process::exit(2);
    };
    let fits = addr.ip().is_loopback()
        && (1..=1024).contains(&conns)
        && (1..=256).contains(&depth)
        && secs > 0.0
        && secs <= 600.0;
    if !fits {
        eprintln!("capacity-load: a loopback address, 1-1024 connections, depth 1-256, 0-600 s");
        std::process::exit(2);
    }
    let request = Arc::new(
        format!("GET {path} HTTP/1.1\r\nHost: bench.test\r\nAccept: */*\r\n\r\n").into_bytes(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let workers: Vec<_> = (0..conns)
        .map(|_| {
            let (request, stop) = (Arc::clone(&request), Arc::clone(&stop));
            std::thread::spawn(move || connection(addr, &request, depth, &stop))
        })
        .collect();
    std::thread::sleep(Duration::from_secs_f64(secs));
    stop.store(true, Ordering::Relaxed);
    let (mut answers, mut failed, mut latency) = (0, 0, Histogram::new());
    for w in workers {
        match w.join() {
            Ok(t) => {
                answers += t.answers;
                failed += t.failed;
                latency.add(&t.latency);
            }
            Err(_) => failed += depth as u64,
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let ms = |q: f64| match latency.quantile(q) {
        Some(ns) if depth == 1 => format!("{:.3}", ns as f64 / 1e6),
        _ => "null".to_owned(),
    };
    println!(
        "{{\"answers\": {answers}, \"failed\": {failed}, \"seconds\": {seconds:.3}, \"rps\": {:.0}, \"p50_ms\": {}, \"p99_ms\": {}}}",
        answers as f64 / seconds,
        ms(0.50),
        ms(0.99),
    );
    // A load with failures, or none answered, measured nothing.
    if failed > 0 || answers == 0 {
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::{Histogram, answer};
    use std::time::Duration;

    #[test]
    fn an_answer_is_whole_only_with_its_body() {
        let a = b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nabcHTTP/1.1";
        assert_eq!(answer(a), Some(Ok(41)));
        assert_eq!(answer(&a[..40]), None);
        assert_eq!(answer(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n"), None);
        assert!(matches!(
            answer(b"HTTP/1.1 503 x\r\ncontent-length: 0\r\n\r\n"),
            Some(Err(_))
        ));
        assert!(matches!(
            answer(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"),
            Some(Err(_))
        ));
    }

    #[test]
    fn a_bucket_holds_its_value_within_a_32nd() {
        for ns in (0..5000).chain([
            31,
            32,
            63,
            64,
            65,
            1_000_000,
            123_456_789,
            u64::MAX >> 1,
            u64::MAX,
        ]) {
            let i = Histogram::bucket(ns);
            let upper = Histogram::upper(i);
            assert!(upper >= ns, "{ns} in bucket {i} up to {upper}");
            assert!(upper - ns <= ns / 32, "{ns} in bucket {i} up to {upper}");
            assert!(i == 0 || Histogram::upper(i - 1) < ns, "{ns}: bucket {i}");
        }
    }

    #[test]
    fn quantiles_come_from_the_counts() {
        let mut h = Histogram::new();
        assert_eq!(h.quantile(0.5), None);
        for ms in 1..=100 {
            h.record(Duration::from_millis(ms));
        }
        let p50 = h.quantile(0.5).expect("100 values");
        let p99 = h.quantile(0.99).expect("100 values");
        assert!(
            (50_000_000..=50_000_000 + 50_000_000 / 32).contains(&p50),
            "{p50}"
        );
        assert!(
            (99_000_000..=99_000_000 + 99_000_000 / 32).contains(&p99),
            "{p99}"
        );
    }
}
