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

/// Opens a connection whose receive buffer is pinned small (4 KiB), sends
/// `bytes` and reads nothing: a client that reads slowly or not at all, so
/// the server's writes wait on it once the kernel's buffers are full.
pub async fn send_as_slow_reader(addr: SocketAddr, bytes: &[u8]) -> TcpStream {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()
    } else {
        tokio::net::TcpSocket::new_v6()
    }
    .expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let mut stream = socket
        .connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    stream
        .write_all(bytes)
        .await
        .unwrap_or_else(|e| panic!("write to {addr}: {e}"));
    stream
}

/// Sends `bytes` and returns every byte the server sent until it closed the
/// connection, within `within` (empty: it closed without answering).
pub async fn exchange_bytes(addr: SocketAddr, bytes: &[u8], within: Duration) -> Vec<u8> {
    tokio::time::timeout(within, async {
        let mut stream = TcpStream::connect(addr)
            .await
            .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
        let _ = stream.write_all(bytes).await;
        let mut all = Vec::new();
        let _ = stream.read_to_end(&mut all).await;
        all
    })
    .await
    .unwrap_or_else(|_| panic!("{addr} did not close the connection within {within:?}"))
}

/// A whole response read off a raw connection: head and de-framed body.
#[derive(Clone, Debug)]
pub struct RawResponse {
    /// The status code of the status line.
    pub status: u16,
    /// The response head (status line and headers) as text.
    pub head: String,
    /// The body, after removing chunked framing when the head says chunked.
    pub body: Vec<u8>,
}

/// Every value of header `name` (case-insensitive, trimmed) in a message
/// head as text (start line, then header lines, CRLF-separated).
pub fn head_values<'h>(head: &'h str, name: &str) -> Vec<&'h str> {
    head.split("\r\n")
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .filter(|(n, _)| n.trim().eq_ignore_ascii_case(name))
        .map(|(_, v)| v.trim())
        .collect()
}

impl RawResponse {
    /// Every value of header `name` (case-insensitive).
    pub fn header_all(&self, name: &str) -> Vec<&str> {
        head_values(&self.head, name)
    }

    /// The first value of header `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.header_all(name).into_iter().next()
    }
}

/// Sends `bytes` (which should ask for `Connection: close`) and reads until
/// the server closes, within `within`; the body is de-framed by the head's
/// Content-Length or chunked encoding, and bytes past that are kept in
/// `body` too, so a framing mismatch shows.
pub async fn exchange_full(addr: SocketAddr, bytes: &[u8], within: Duration) -> RawResponse {
    let all = exchange_bytes(addr, bytes, within).await;
    // Interim answers (100 Continue) come before the final one: skip them.
    let mut all = &all[..];
    while all.starts_with(b"HTTP/1.1 1")
        && !all.starts_with(b"HTTP/1.1 101")
        && let Some(end) = find_head_end(all)
    {
        all = &all[end..];
    }
    let end = find_head_end(all).unwrap_or_else(|| {
        panic!(
            "no complete response head from {addr}: {:?}",
            String::from_utf8_lossy(all)
        )
    });
    let head = String::from_utf8_lossy(&all[..end - 4]).into_owned();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status code in response head {head:?}"));
    let mut response = RawResponse {
        status,
        head,
        body: Vec::new(),
    };
    let rest = &all[end..];
    let chunked = response
        .header_all("transfer-encoding")
        .iter()
        .any(|v| v.eq_ignore_ascii_case("chunked"));
    response.body = if chunked {
        dechunk(rest)
    } else {
        rest.to_vec()
    };
    response
}

/// The data of a chunked body (whatever follows the last chunk is dropped).
fn dechunk(mut rest: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(i) = rest.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(
            String::from_utf8_lossy(&rest[..i])
                .split(';')
                .next()
                .unwrap_or("")
                .trim(),
            16,
        )
        .unwrap_or(0);
        rest = &rest[i + 2..];
        if size == 0 || rest.len() < size {
            break;
        }
        out.extend_from_slice(&rest[..size]);
        rest = rest.get(size + 2..).unwrap_or(&[]);
    }
    out
}
