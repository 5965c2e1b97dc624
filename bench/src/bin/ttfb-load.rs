//! Time to first byte for a crowd of callers of one URL: N connections
//! opened first, then one GET on each at the same instant; for each answer
//! the time to its first body byte and to its last, and whether the body
//! arrived whole (exactly its Content-Length, status 200).
//!
//! `ttfb-load ADDR PATH N [DEADLINE_SECS]`
//!
//! Prints one JSON object: `n`, `whole` (complete 200 answers), `failed`,
//! and `ttfb_ms` / `total_ms` with `p50`, `p99`, `max` over the complete
//! answers. Loopback only; every connection gives up at the deadline
//! (default 60 s).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Barrier;

struct Timing {
    first_body_byte: Duration,
    last_byte: Duration,
}

async fn one(
    addr: SocketAddr,
    path: Arc<String>,
    start: Arc<Barrier>,
    t0: Arc<std::sync::OnceLock<Instant>>,
) -> Result<Timing, String> {
    let mut tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    tcp.set_nodelay(true).map_err(|e| e.to_string())?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: ttfb.test\r\nConnection: close\r\n\r\n");
    start.wait().await;
    let t0 = *t0.get_or_init(Instant::now);
    tcp.write_all(request.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut buf = Vec::with_capacity(16 * 1024);
    let mut chunk = vec![0u8; 256 * 1024];
    let (mut first, mut parsed) = (None, None);
    let mut body = 0usize;
    loop {
        let n = tcp.read(&mut chunk).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err(format!("closed after {body} body bytes"));
        }
        match parsed {
            None => {
                buf.extend_from_slice(&chunk[..n]);
                if let Some(h) = corral_bench::answer_head(&buf) {
                    let (end, len) = h?;
                    parsed = Some(len);
                    body = buf.len() - end;
                    buf = Vec::new();
                }
            }
            Some(_) => body += n,
        }
        if body > 0 && first.is_none() {
            first = Some(t0.elapsed());
        }
        if let Some(len) = parsed
            && body >= len
        {
            if body > len {
                return Err(format!("{body} body bytes, {len} declared"));
            }
            return Ok(Timing {
                first_body_byte: first.unwrap_or_default(),
                last_byte: t0.elapsed(),
            });
        }
    }
}

fn percentiles(mut v: Vec<f64>) -> String {
    if v.is_empty() {
        return "null".into();
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1];
    format!(
        "{{\"p50\":{:.1},\"p99\":{:.1},\"max\":{:.1}}}",
        at(0.5),
        at(0.99),
        v[v.len() - 1]
    )
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        eprintln!("usage: ttfb-load ADDR PATH N [DEADLINE_SECS]");
        std::process::exit(2);
    }
    let addr: SocketAddr = args[1].parse().expect("ADDR is host:port");
    let path = Arc::new(args[2].clone());
    let n: usize = args[3].parse().expect("N is a number");
    let deadline = Duration::from_secs(args.get(4).and_then(|s| s.parse().ok()).unwrap_or(60));
    let start = Arc::new(Barrier::new(n));
    let t0 = Arc::new(std::sync::OnceLock::new());
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (path, start, t0) = (Arc::clone(&path), Arc::clone(&start), Arc::clone(&t0));
            tokio::spawn(tokio::time::timeout(deadline, one(addr, path, start, t0)))
        })
        .collect();
    let (mut ttfb, mut total, mut failed) = (Vec::new(), Vec::new(), Vec::new());
    for t in tasks {
        match t.await {
            Ok(Ok(Ok(timing))) => {
                ttfb.push(timing.first_body_byte.as_secs_f64() * 1e3);
                total.push(timing.last_byte.as_secs_f64() * 1e3);
            }
            Ok(Ok(Err(e))) => failed.push(e),
            Ok(Err(_)) => failed.push("deadline".into()),
            Err(e) => failed.push(e.to_string()),
        }
    }
    if let Some(e) = failed.first() {
        eprintln!("ttfb-load: {} failed, the first: {e}", failed.len());
    }
    println!(
        "{{\"n\":{n},\"whole\":{},\"failed\":{},\"ttfb_ms\":{},\"total_ms\":{}}}",
        ttfb.len(),
        failed.len(),
        percentiles(ttfb),
        percentiles(total)
    );
}
