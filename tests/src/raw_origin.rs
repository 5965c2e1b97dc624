//! A raw-bytes HTTP/1.1 origin on 127.0.0.1 that records exactly the bytes
//! that reach it, so a test can assert upstream framing byte for byte.
//!
//! It reads requests the way common origins (Node, nginx) do: a head up to
//! the blank line, then as many body bytes as `Content-Length` says (or a
//! chunked body), then the next request on the same connection. That is
//! what makes a smuggled request visible: a `Content-Length` sent without
//! its body swallows the start of the next request, and the recorded
//! requests show it. Each request is answered with the bytes the test's
//! script returns for it, written as they are (framing errors included).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// One request as the raw origin framed it.
#[derive(Clone, Debug)]
pub struct RawRequest {
    /// The connection it arrived on (0, 1, ... in accept order).
    pub connection: usize,
    /// The head, request line and header lines, without the blank line.
    pub head: String,
    /// The body bytes the head's framing claimed.
    pub body: Vec<u8>,
}

impl RawRequest {
    /// The request line's method.
    pub fn method(&self) -> &str {
        self.head.split(' ').next().unwrap_or("")
    }

    /// The request target (path and query) as sent.
    pub fn target(&self) -> &str {
        self.head.split(' ').nth(1).unwrap_or("")
    }

    /// Every value of header `name` (case-insensitive), trimmed.
    pub fn header_all(&self, name: &str) -> Vec<&str> {
        crate::raw::head_values(&self.head, name)
    }

    /// The first value of header `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.header_all(name).into_iter().next()
    }
}

type Script = Arc<dyn Fn(&RawRequest) -> Vec<u8> + Send + Sync>;

#[derive(Default)]
struct Record {
    /// Every byte received, per connection.
    bytes: Vec<Vec<u8>>,
    requests: Vec<RawRequest>,
}

/// A running raw origin; stops serving when dropped.
pub struct RawOrigin {
    addr: SocketAddr,
    record: Arc<Mutex<Record>>,
    arrivals: watch::Sender<usize>,
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

/// `HTTP/1.1 {status} X` with `headers`, `Content-Length` and `body`.
pub fn response(status: u16, headers: &[(&str, &str)], body: &str) -> Vec<u8> {
    let mut out = format!("HTTP/1.1 {status} X\r\n");
    for (n, v) in headers {
        out.push_str(&format!("{n}: {v}\r\n"));
    }
    out.push_str(&format!("content-length: {}\r\n\r\n{body}", body.len()));
    out.into_bytes()
}

impl RawOrigin {
    /// Serves on 127.0.0.1:0, answering each request with `script(request)`;
    /// an empty answer closes the connection instead, and one whose head
    /// says `connection: close` closes it after being written (so a body
    /// shorter than its Content-Length is cut off).
    pub async fn start(script: impl Fn(&RawRequest) -> Vec<u8> + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the raw origin on 127.0.0.1:0");
        let addr = listener.local_addr().expect("raw origin address");
        let record = Arc::new(Mutex::new(Record::default()));
        let (arrivals, _) = watch::channel(0);
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(accept_loop(
            listener,
            Arc::new(script),
            Arc::clone(&record),
            arrivals.clone(),
            stopped,
        ));
        RawOrigin {
            addr,
            record,
            arrivals,
            stop,
            task: Some(task),
        }
    }

    /// `http://127.0.0.1:PORT`, for a route's `upstream`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request framed so far, in arrival order.
    pub fn requests(&self) -> Vec<RawRequest> {
        lock(&self.record).requests.clone()
    }

    /// Every byte received so far, one vector per connection.
    pub fn bytes(&self) -> Vec<Vec<u8>> {
        lock(&self.record).bytes.clone()
    }

    /// Waits until `n` requests have been framed; fails the test after `within`.
    pub async fn wait_requests(&self, n: usize, within: Duration) {
        let mut rx = self.arrivals.subscribe();
        let reached = tokio::time::timeout(within, async {
            while *rx.borrow_and_update() < n {
                if rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        })
        .await;
        assert!(
            reached.is_ok(),
            "the raw origin framed {} requests within {within:?}, wanted {n}: {:?}",
            self.requests().len(),
            self.requests()
        );
    }
}

impl Drop for RawOrigin {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

fn lock(m: &Mutex<Record>) -> MutexGuard<'_, Record> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn accept_loop(
    listener: TcpListener,
    script: Script,
    record: Arc<Mutex<Record>>,
    arrivals: watch::Sender<usize>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let index = {
                    let mut r = lock(&record);
                    r.bytes.push(Vec::new());
                    r.bytes.len() - 1
                };
                conns.spawn(serve(stream, index, Arc::clone(&script), Arc::clone(&record), arrivals.clone()));
            }
            _ = stopped.changed() => return,
        }
    }
}

/// Frames requests off one connection and answers each.
async fn serve(
    mut stream: TcpStream,
    connection: usize,
    script: Script,
    record: Arc<Mutex<Record>>,
    arrivals: watch::Sender<usize>,
) {
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let Some(end) = read_until(&mut stream, &mut buf, connection, &record, |b| {
            b.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4)
        })
        .await
        else {
            return;
        };
        let head = String::from_utf8_lossy(&buf[..end - 4]).into_owned();
        buf.drain(..end);
        let mut request = RawRequest {
            connection,
            head,
            body: Vec::new(),
        };
        let chunked = request
            .header_all("transfer-encoding")
            .iter()
            .any(|v| v.to_ascii_lowercase().contains("chunked"));
        if chunked {
            loop {
                let Some(line_end) = read_until(&mut stream, &mut buf, connection, &record, |b| {
                    b.windows(2).position(|w| w == b"\r\n").map(|i| i + 2)
                })
                .await
                else {
                    return;
                };
                let size_text = String::from_utf8_lossy(&buf[..line_end - 2]).into_owned();
                buf.drain(..line_end);
                let size =
                    usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
                        .unwrap_or(0);
                let want = size + 2;
                if read_until(&mut stream, &mut buf, connection, &record, |b| {
                    (b.len() >= want).then_some(want)
                })
                .await
                .is_none()
                {
                    return;
                }
                request.body.extend_from_slice(&buf[..size]);
                buf.drain(..want);
                if size == 0 {
                    break;
                }
            }
        } else if let Some(len) = request
            .header("content-length")
            .and_then(|v| v.parse::<usize>().ok())
        {
            if read_until(&mut stream, &mut buf, connection, &record, |b| {
                (b.len() >= len).then_some(len)
            })
            .await
            .is_none()
            {
                return;
            }
            request.body = buf.drain(..len).collect();
        }
        let answer = script(&request);
        let head_end = answer
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or(answer.len());
        let says_close = String::from_utf8_lossy(&answer[..head_end])
            .to_ascii_lowercase()
            .contains("\r\nconnection: close");
        {
            let mut r = lock(&record);
            r.requests.push(request);
            let n = r.requests.len();
            arrivals.send_replace(n);
        }
        // An empty answer closes the connection without one; an answer
        // that says `connection: close` closes it once written.
        if answer.is_empty() || stream.write_all(&answer).await.is_err() || says_close {
            return;
        }
    }
}

/// Reads into `buf` (recording every byte) until `done(buf)` says where the
/// wanted part ends; `None` when the connection closes first.
async fn read_until(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    connection: usize,
    record: &Mutex<Record>,
    done: impl Fn(&[u8]) -> Option<usize>,
) -> Option<usize> {
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(end) = done(buf) {
            return Some(end);
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                lock(record).bytes[connection].extend_from_slice(&chunk[..n]);
            }
        }
    }
}
