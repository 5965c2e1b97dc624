//! Raw bytes over a TcpStream, for requests no HTTP client would send.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The head of a response read off a raw connection.
#[derive(Clone, Debug)]
pub struct RawAnswer {
    /// The status code of the status line.
    pub status: u16,
    /// The response head (status line and headers) as text.
    pub head: String,
}

/// Sends `bytes` to `addr` and reads the response head; fails the test when no
/// complete head arrives within `within`.
pub async fn exchange(addr: SocketAddr, bytes: &[u8], within: Duration) -> RawAnswer {
    tokio::time::timeout(within, exchange_inner(addr, bytes))
        .await
        .unwrap_or_else(|_| panic!("no response head from {addr} within {within:?}"))
}

async fn exchange_inner(addr: SocketAddr, bytes: &[u8]) -> RawAnswer {
    let mut stream = TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    // The server may answer and close before it read everything (e.g. 431
    // after the first 16KiB): a failed write is not the test's verdict, the
    // response is.
    let _ = stream.write_all(bytes).await;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(end) = find_head_end(&buf) {
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            let status = head
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("no status code in response head {head:?}"));
            return RawAnswer { status, head };
        }
        match stream.read(&mut chunk).await {
            Ok(0) => panic!(
                "{addr} closed the connection after {:?} without a complete response head",
                String::from_utf8_lossy(&buf)
            ),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => panic!(
                "reading from {addr} after {:?}: {e}",
                String::from_utf8_lossy(&buf)
            ),
        }
    }
}

/// Where the body starts in `buf`: just past the first blank line ending a
/// response head, or `None` while the head is incomplete.
pub fn find_head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4)
}

/// Opens a connection and sends `bytes` without reading: the caller holds the
/// stream (e.g. to drop it mid-request and simulate a client going away).
pub async fn send_and_hold(addr: SocketAddr, bytes: &[u8]) -> TcpStream {
    let mut stream = TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    stream
        .write_all(bytes)
        .await
        .unwrap_or_else(|e| panic!("write to {addr}: {e}"));
    stream
}
