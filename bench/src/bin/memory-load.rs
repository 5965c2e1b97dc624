//! The memory benchmark's load: GETs of distinct keys, each with about a
//! kibibyte of request headers, over keep-alive connections, while the
//! server's resident memory (RSS) is sampled from /proc.
//!
//! `memory-load ADDR PID KEYS [CONNECTIONS] [HEADER_BYTES]`
//!
//! Every request is `GET /m?id=N&max-age=600&size=1` (the demo origin makes
//! each a cacheable 1-byte answer), so every key is stored once and the
//! cache bound is what keeps memory in check. Prints one line per tenth of
//! the keys (`keys`, `rss_mib`, `req_per_s`) and a final `peak_rss_mib`.
//! Loopback only; the load ends after KEYS requests.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use corral_bench::rss_mib;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Sends requests for keys taken from `next` until `keys` are done.
async fn connection(addr: SocketAddr, next: Arc<AtomicU64>, keys: u64, pad: Arc<String>) {
    let mut stream = TcpStream::connect(addr).await.expect("connect to corral");
    stream.set_nodelay(true).expect("nodelay");
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = next.fetch_add(1, Ordering::Relaxed);
        if n >= keys {
            return;
        }
        let request = format!(
            "GET /m?id={n}&max-age=600&size=1 HTTP/1.1\r\nHost: memory.test\r\n\
             User-Agent: corral-memory-load\r\nAccept: */*\r\nX-Pad: {pad}\r\n\r\n"
        );
        stream
            .write_all(request.as_bytes())
            .await
            .expect("write request");
        // Read one response: the head, then Content-Length bytes.
        let mut have = 0;
        let (head_end, body_len) = loop {
            let got = stream.read(&mut buf[have..]).await.expect("read response");
            assert!(got > 0, "corral closed the connection");
            have += got;
            if let Some(i) = buf[..have].windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..i]).to_ascii_lowercase();
                assert!(head.starts_with("http/1.1 200"), "{head}");
                let len = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .unwrap_or(0);
                break (i + 4, len);
            }
        };
        while have < head_end + body_len {
            let got = stream.read(&mut buf[have..]).await.expect("read body");
            assert!(got > 0, "corral closed the connection mid-body");
            have += got;
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        eprintln!("usage: memory-load ADDR PID KEYS [CONNECTIONS] [HEADER_BYTES]");
        std::process::exit(2);
    }
    let addr: SocketAddr = args[1].parse().expect("ADDR is host:port");
    let pid: u32 = args[2].parse().expect("PID");
    let keys: u64 = args[3].parse().expect("KEYS");
    let connections: usize = args.get(4).map_or(32, |c| c.parse().expect("CONNECTIONS"));
    let header_bytes: usize = args
        .get(5)
        .map_or(1024, |h| h.parse().expect("HEADER_BYTES"));
    // The fixed headers above take about 100 bytes; X-Pad brings the head
    // to HEADER_BYTES.
    let pad = Arc::new("p".repeat(header_bytes.saturating_sub(100).max(1)));
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..connections)
        .map(|_| tokio::spawn(connection(addr, Arc::clone(&next), keys, Arc::clone(&pad))))
        .collect();
    let step = (keys / 10).max(1);
    let mut mark = step;
    let mut peak: f64 = 0.0;
    println!("keys\trss_mib\treq_per_s");
    while !tasks.iter().all(tokio::task::JoinHandle::is_finished) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let rss = rss_mib(pid);
        peak = peak.max(rss);
        let done = next.load(Ordering::Relaxed).min(keys);
        if done >= mark {
            let rate = done as f64 / started.elapsed().as_secs_f64();
            println!("{done}\t{rss:.1}\t{rate:.0}");
            mark += step;
        }
    }
    for t in tasks {
        t.await.expect("connection task");
    }
    let rss = rss_mib(pid);
    peak = peak.max(rss);
    println!("final_rss_mib\t{rss:.1}");
    println!("peak_rss_mib\t{peak:.1}");
}
