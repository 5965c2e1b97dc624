//! The soak benchmark's checking client (run by `bench/soak.sh`): a steady
//! request rate over Zipf-distributed keys, spread over several corral
//! instances, with origin outages in between, checking every answer.
//!
//! `soak-load INSTANCES ORIGIN PIDS RATE KEYS WARM OUTAGE AFTER CYCLES`
//!
//! INSTANCES and PIDS are comma-separated (`127.0.0.1:8197,...`), RATE is
//! requests per second, KEYS the key count, WARM/OUTAGE/AFTER seconds per
//! phase; a cycle is warm, outage (the origin answers 503), after; CYCLES
//! of them run. Key `k` is `/s/k?max-age=T&swr=5&sie=60&size=S&tag=kK` with
//! T from 1 to 5 s, so keys expire, go stale and refresh all the time.
//!
//! Every answer is checked: a 200 must carry exactly its own key's body
//! (the demo origin's `tag` pattern, `size` bytes) and an `Age` no larger
//! than its freshness plus its longest stale window (plus a second); a 503
//! (or, in a hang, a 504) is allowed only during an outage. Prints, each second, the client's
//! answers and the origin's requests in that second; each minute, every
//! instance's RSS; at the end, origin requests per second before, during
//! and after the outages, and the totals. Exit status 1 if any answer was
//! wrong. Loopback only; the load ends after the last phase.
//!
//! `SOAK_OUTAGE=slow` makes the outage a hang instead of 503s: the origin
//! takes each request and answers 30 s later. `SOAK_CLIENTS=N` spreads the
//! connections over N loopback source addresses (127.0.0.1 upward), so
//! that corral sees N callers, as behind no load balancer. Every request
//! gives up after 20 s (a client's patience; counted as `timeouts`), and a
//! 5xx for a key whose last 200 came within its freshness plus its
//! stale-if-error window (a key that had a stale copy to serve) is counted
//! apart (`5xx_with_stale`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use corral_bench::rss_mib;
use rand::Rng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

/// Kept-alive connections to one instance (connecting for every request
/// would run out of loopback ports at these rates).
type Pool = Arc<std::sync::Mutex<Vec<TcpStream>>>;

const SWR: u64 = 5;
const SIE: u64 = 60;

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    stale: AtomicU64,
    unavailable: AtomicU64,
    wrong: AtomicU64,
    failed: AtomicU64,
    /// Requests the client gave up on after [`PATIENCE`].
    timeouts: AtomicU64,
    /// 5xx answers for a key that had a stale copy to serve.
    unavailable_with_stale: AtomicU64,
}

/// How long a request may take before the client gives up on it.
const PATIENCE: Duration = Duration::from_secs(20);

/// Until when each key had a copy to serve stale on an error: the end of
/// the stale-if-error window of the last 200 it got (that answer's
/// freshness, less its `Age`, plus the window).
struct LastOk {
    started: Instant,
    /// Milliseconds since `started`; 0 for never.
    until: Vec<AtomicU64>,
}

impl LastOk {
    fn new(keys: u64) -> Self {
        LastOk {
            started: Instant::now(),
            until: (0..keys).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Key `k` got a 200 whose `Age` was `age` seconds.
    fn saw_ok(&self, k: u64, age: u64) {
        let (ttl, _) = key_params(k);
        let left = (ttl + SIE).saturating_sub(age) * 1000;
        if let Some(a) = self.until.get(k as usize) {
            a.fetch_max(self.now_ms() + left, Ordering::Relaxed);
        }
    }

    /// True when key `k` still had a copy within its stale-if-error window
    /// (a second of margin for the `Age` rounding).
    fn had_stale(&self, k: u64) -> bool {
        let until = self
            .until
            .get(k as usize)
            .map_or(0, |a| a.load(Ordering::Relaxed));
        self.now_ms() + 1000 < until
    }
}

/// A connection to `instance`, from one of `clients` loopback addresses
/// (127.0.0.1 upward), picked at random.
async fn connect(instance: SocketAddr, clients: u8) -> std::io::Result<TcpStream> {
    if clients <= 1 {
        return TcpStream::connect(instance).await;
    }
    let n = rand::rng().random_range(0..clients);
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(SocketAddr::from(([127, 0, 0, 1 + n], 0)))?;
    socket.connect(instance).await
}

/// One plain HTTP/1.1 exchange on a fresh or kept connection: status,
/// head (lowercased) and body.
async fn exchange(
    stream: &mut TcpStream,
    request: &[u8],
) -> std::io::Result<(u16, String, Vec<u8>)> {
    stream.write_all(request).await?;
    let mut buf = Vec::with_capacity(8192);
    let mut chunk = [0u8; 16384];
    let head_end = loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + len {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok((status, head, buf[head_end..head_end + len].to_vec()))
}

fn key_params(k: u64) -> (u64, usize) {
    let ttl = k % 5 + 1;
    let size = 64 + usize::try_from(k * 37 % 2000).unwrap_or(0);
    (ttl, size)
}

/// Checks one answer for key `k`; true when it is right.
fn check(k: u64, status: u16, head: &str, body: &[u8], outage: bool, tally: &Tally) -> bool {
    let (ttl, size) = key_params(k);
    match status {
        200 => {
            let want: Vec<u8> = format!("k{k};").bytes().cycle().take(size).collect();
            let age: u64 = head
                .lines()
                .find_map(|l| l.strip_prefix("age:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if body != want.as_slice() || age > ttl + SWR.max(SIE) + 1 {
                return false;
            }
            if head.contains("fwd=stale") {
                tally.stale.fetch_add(1, Ordering::Relaxed);
            }
            tally.ok.fetch_add(1, Ordering::Relaxed);
            true
        }
        // The origin's own 503, during an outage; or corral's, while it
        // leaves a failing origin alone (a key in back-off, an open route
        // circuit) and has no stale copy: those may outlast the outage by
        // a back-off or an open period.
        503 if outage
            || head.contains("detail=backoff")
            || head.contains("detail=circuit-open") =>
        {
            tally.unavailable.fetch_add(1, Ordering::Relaxed);
            true
        }
        // A hung origin's fetch that ran out of `response_headers`, for a
        // key without a stale copy.
        504 if outage => {
            tally.unavailable.fetch_add(1, Ordering::Relaxed);
            true
        }
        _ => false,
    }
}

/// Zipf over 0..n with exponent 1: the inverse of the harmonic CDF, by
/// bisection over a precomputed table.
struct Zipf(Vec<f64>);

impl Zipf {
    fn new(n: u64) -> Self {
        let mut acc = 0.0;
        let mut cdf = Vec::new();
        for i in 1..=n {
            acc += 1.0 / i as f64;
            cdf.push(acc);
        }
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf(cdf)
    }

    fn sample(&self, r: f64) -> u64 {
        self.0.partition_point(|c| *c < r) as u64
    }
}

async fn origin_total(origin: SocketAddr) -> u64 {
    let Ok(mut s) = TcpStream::connect(origin).await else {
        return 0;
    };
    let req = b"GET /__hits HTTP/1.1\r\nHost: origin\r\nConnection: close\r\n\r\n";
    match exchange(&mut s, req).await {
        Ok((_, _, body)) => String::from_utf8_lossy(&body).trim().parse().unwrap_or(0),
        Err(_) => 0,
    }
}

async fn set_outage(origin: SocketAddr, mode: &str) {
    if let Ok(mut s) = TcpStream::connect(origin).await {
        let req = format!(
            "POST /__outage?mode={mode} HTTP/1.1\r\nHost: origin\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        let _ = exchange(&mut s, req.as_bytes()).await;
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 10 {
        eprintln!("usage: soak-load INSTANCES ORIGIN PIDS RATE KEYS WARM OUTAGE AFTER CYCLES");
        std::process::exit(2);
    }
    let instances: Vec<(SocketAddr, Pool)> = args[1]
        .split(',')
        .map(|a| (a.parse().expect("instance address"), Pool::default()))
        .collect();
    let origin: SocketAddr = args[2].parse().expect("origin address");
    let pids: Vec<u32> = args[3]
        .split(',')
        .map(|p| p.parse().expect("pid"))
        .collect();
    let num = |i: usize| -> u64 { args[i].parse().expect("a number") };
    let (rate, keys, warm, outage, after, cycles) =
        (num(4), num(5), num(6), num(7), num(8), num(9));
    let cycle = warm + outage + after;
    let total = cycle * cycles;

    let outage_mode = std::env::var("SOAK_OUTAGE").unwrap_or_else(|_| "503".to_owned());
    let clients: u8 = std::env::var("SOAK_CLIENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let last_ok = Arc::new(LastOk::new(keys));
    let zipf = Arc::new(Zipf::new(keys));
    let tally = Arc::new(Tally::default());
    let in_flight = Arc::new(Semaphore::new(256));
    let started = Instant::now();
    // (second, phase, client answers, origin requests)
    let mut seconds: Vec<(u64, &'static str, u64, u64)> = Vec::new();
    let mut last_total = origin_total(origin).await;
    let mut last_answers = 0;
    let mut outage_on = false;
    println!("t\tphase\tanswers\torigin_req\tstale\t503\twrong");
    let tick = Duration::from_millis(10);
    let per_tick = (rate as f64 / 100.0).max(1.0);
    let mut owed = 0.0;
    let mut next_second = 1;
    let mut rng = rand::rng();
    while started.elapsed() < Duration::from_secs(total) {
        let t = started.elapsed().as_secs();
        let in_cycle = t % cycle;
        let phase = if in_cycle < warm {
            "before"
        } else if in_cycle < warm + outage {
            "outage"
        } else {
            "after"
        };
        let want_outage = phase == "outage";
        if want_outage != outage_on {
            set_outage(origin, if want_outage { &outage_mode } else { "off" }).await;
            outage_on = want_outage;
        }
        owed += per_tick;
        while owed >= 1.0 {
            owed -= 1.0;
            let k = zipf.sample(rng.random::<f64>());
            let (instance, pool) = instances[rng.random_range(0..instances.len())].clone();
            let Ok(permit) = Arc::clone(&in_flight).try_acquire_owned() else {
                tally.failed.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            let tally = Arc::clone(&tally);
            let last_ok = Arc::clone(&last_ok);
            tokio::spawn(async move {
                let _permit = permit;
                let (ttl, size) = key_params(k);
                let request = format!(
                    "GET /s/{k}?max-age={ttl}&swr={SWR}&sie={SIE}&size={size}&tag=k{k} HTTP/1.1\r\nHost: soak.test\r\n\r\n"
                );
                let kept = pool
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .pop();
                // A kept connection the server has closed meanwhile (idle
                // timeout) fails at once: like any client, try a new one.
                let attempt = async {
                    let mut result = Err(std::io::ErrorKind::NotConnected.into());
                    if let Some(mut s) = kept {
                        result = exchange(&mut s, request.as_bytes()).await.map(|r| (r, s));
                    }
                    if result.is_err() {
                        result = match connect(instance, clients).await {
                            Ok(mut s) => exchange(&mut s, request.as_bytes()).await.map(|r| (r, s)),
                            Err(e) => Err(e),
                        };
                    }
                    result
                };
                let Ok(result) = tokio::time::timeout(PATIENCE, attempt).await else {
                    tally.timeouts.fetch_add(1, Ordering::Relaxed);
                    return;
                };
                let result = result.map(|(r, s)| {
                    pool.lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push(s);
                    r
                });
                match result {
                    Ok((status, head, body)) => {
                        if status == 200 {
                            let age = head
                                .lines()
                                .find_map(|l| l.strip_prefix("age:"))
                                .and_then(|v| v.trim().parse().ok())
                                .unwrap_or(0);
                            last_ok.saw_ok(k, age);
                        } else if status >= 500 && last_ok.had_stale(k) {
                            let n = tally.unavailable_with_stale.fetch_add(1, Ordering::Relaxed);
                            if n < 5 {
                                eprintln!("{status} for key {k}, which had a stale copy: {head:?}");
                            }
                        }
                        if !check(k, status, &head, &body, want_outage, &tally) {
                            tally.wrong.fetch_add(1, Ordering::Relaxed);
                            eprintln!("wrong answer for key {k}: {status} {head:?}");
                        }
                    }
                    Err(_) => {
                        tally.failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
        if started.elapsed() >= Duration::from_secs(next_second) {
            let total_now = origin_total(origin).await;
            let answers =
                tally.ok.load(Ordering::Relaxed) + tally.unavailable.load(Ordering::Relaxed);
            let row = (
                next_second,
                phase,
                answers - last_answers,
                total_now.saturating_sub(last_total),
            );
            println!(
                "{}\t{}\t{}\t{}\t{}\t{}\t{}",
                row.0,
                row.1,
                row.2,
                row.3,
                tally.stale.load(Ordering::Relaxed),
                tally.unavailable.load(Ordering::Relaxed),
                tally.wrong.load(Ordering::Relaxed)
            );
            seconds.push(row);
            last_total = total_now;
            last_answers = answers;
            if next_second % 60 == 0 {
                let rss: Vec<String> = pids.iter().map(|p| format!("{:.1}", rss_mib(*p))).collect();
                println!("rss_mib\tminute {}\t{}", next_second / 60, rss.join("\t"));
            }
            next_second += 1;
        }
        tokio::time::sleep(tick).await;
    }
    set_outage(origin, "off").await;
    let _ = in_flight.acquire_many(256).await;

    let mean = |phase: &str| {
        let rows: Vec<u64> = seconds
            .iter()
            .filter(|r| r.1 == phase)
            .map(|r| r.3)
            .collect();
        let n = rows.len().max(1) as f64;
        (
            rows.iter().sum::<u64>() as f64 / n,
            rows.iter().copied().max().unwrap_or(0),
        )
    };
    for phase in ["before", "outage", "after"] {
        let (avg, max) = mean(phase);
        println!("origin_req_per_s\t{phase}\tmean {avg:.1}\tmax {max}");
    }
    let rss: Vec<String> = pids.iter().map(|p| format!("{:.1}", rss_mib(*p))).collect();
    println!("rss_mib\tend\t{}", rss.join("\t"));
    let t = &tally;
    println!(
        "answers\tok {}\tstale {}\t503 {}\twrong {}\tfailed {}\ttimeouts {}\t5xx_with_stale {}",
        t.ok.load(Ordering::Relaxed),
        t.stale.load(Ordering::Relaxed),
        t.unavailable.load(Ordering::Relaxed),
        t.wrong.load(Ordering::Relaxed),
        t.failed.load(Ordering::Relaxed),
        t.timeouts.load(Ordering::Relaxed),
        t.unavailable_with_stale.load(Ordering::Relaxed)
    );
    if t.wrong.load(Ordering::Relaxed) > 0 {
        std::process::exit(1);
    }
}
