//! Interim (1xx) responses passed on to an HTTP/1.1 client: the origin's
//! `103 Early Hints` and `102 Processing` reach the caller whose request
//! made the origin request, before the final answer (RFC 9110 §15.2: a
//! proxy forwards 1xx responses; they are never stored, and their fields
//! never reach a stored response).
//!
//! hyper's server has no way to send a 1xx, so they are written under it:
//! [`InterimIo`] wraps the connection's stream and writes the queued
//! interim bytes when hyper flushes with nothing of its own left to write
//! (hyper calls `poll_flush` on the stream only once its write buffer is
//! empty, so every byte of the previous answer is out first), and the
//! request's service does not hand hyper the final answer until the queue
//! is empty, so nothing of the final answer can overtake them. An interim
//! write hyper interrupts half-way is finished before hyper's next bytes.
//!
//! Not for HTTP/1.0 clients (§15.2 forbids it), not on h2 (hyper exposes
//! no informational send): those callers get the final answer only. Only
//! the caller whose request reached the origin gets them; callers served
//! from a coalesced flight or the cache do not.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker, ready};

use bytes::{Buf, Bytes};
use http::{HeaderMap, StatusCode};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// At most this many interim responses are passed on per request.
const MAX_INTERIM: u32 = 8;
/// And at most this many bytes of them.
const MAX_INTERIM_BYTES: usize = 16 * 1024;

/// What a connection's stream and its requests share. hyper serves an
/// HTTP/1.1 connection's requests one at a time, so one request at a time
/// is open here; a late call from an earlier request is told apart by its
/// number. A request that gets no interim response (every hit) takes no
/// lock: the atomics below are all it touches.
#[derive(Debug, Default)]
pub struct Shared {
    state: Mutex<State>,
    /// Interim bytes are queued: the stream's writes look at the queue
    /// only then.
    pending: AtomicBool,
    /// The number of the request that takes interim responses now; 0 when
    /// none does (its final answer is out).
    open: AtomicU64,
    /// The last number given.
    last: AtomicU64,
    /// The connection's task is in `State::service` (it is the same task
    /// for every request of the connection).
    registered: AtomicBool,
}

#[derive(Debug, Default)]
struct State {
    /// Interim response bytes not yet written, in order, each with the
    /// number of its request: one whose request has closed is dropped,
    /// never written after that request's final answer.
    queue: VecDeque<(u64, Bytes)>,
    /// The front of `queue` is partly written: it is finished before any
    /// of hyper's bytes.
    started: bool,
    /// The connection's task, which serves the request: woken when an
    /// interim response is queued (so that hyper flushes) and when the
    /// queue empties.
    service: Option<Waker>,
    /// Whose bounds `count` and `bytes` are, and how much of them is used.
    budget_of: u64,
    count: u32,
    bytes: usize,
}

impl Shared {
    pub fn new() -> Arc<Self> {
        Arc::new(Shared::default())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Opens the channel for the next request; its number.
    fn open(&self) -> u64 {
        let request = self.last.fetch_add(1, Ordering::Relaxed) + 1;
        self.open.store(request, Ordering::Release);
        request
    }

    fn close(&self) {
        self.open.store(0, Ordering::Release);
    }
}

/// One request's way to pass interim responses on.
#[derive(Debug, Clone)]
pub struct Sender {
    shared: Arc<Shared>,
    request: u64,
}

impl Sender {
    /// Opens the connection's channel for its next request.
    pub fn open(shared: &Arc<Shared>) -> Sender {
        Sender {
            request: shared.open(),
            shared: Arc::clone(shared),
        }
    }

    /// Notes the task serving the request, to wake when an interim answer
    /// is queued: hyper writes only when its connection's task runs. Once
    /// per connection: its requests are all served by its task.
    pub async fn begin(&self) {
        if self.shared.registered.load(Ordering::Acquire) {
            return;
        }
        std::future::poll_fn(|cx| {
            self.register(cx.waker());
            self.shared.registered.store(true, Ordering::Release);
            Poll::Ready(())
        })
        .await;
    }

    fn register(&self, waker: &Waker) {
        let mut state = self.shared.lock();
        if !state.service.as_ref().is_some_and(|w| w.will_wake(waker)) {
            state.service = Some(waker.clone());
        }
    }

    /// The final answer is ready: waits until every interim answer queued
    /// for it is written, then closes the channel. One queued after the
    /// look is dropped by the stream (its request is closed by then), so
    /// none is written after the final answer.
    pub async fn finish(self) {
        if self.shared.pending.load(Ordering::Acquire) {
            std::future::poll_fn(|cx| {
                self.register(cx.waker());
                if self.shared.pending.load(Ordering::Acquire) {
                    Poll::Pending
                } else {
                    Poll::Ready(())
                }
            })
            .await;
        }
        self.shared.close();
    }

    /// Queues an interim response from the origin for the client. Ignored
    /// once the final answer is out, past the bounds, and for 100 and 101
    /// (corral answers Expect itself and never asks for an upgrade).
    pub fn forward(&self, status: StatusCode, headers: &HeaderMap) {
        if !status.is_informational()
            || status == StatusCode::CONTINUE
            || status == StatusCode::SWITCHING_PROTOCOLS
        {
            return;
        }
        let open = || self.shared.open.load(Ordering::Acquire) == self.request;
        if !open() {
            // The answer is out: not even encoded.
            return;
        }
        let bytes = encode(status, headers);
        let mut state = self.shared.lock();
        if !open() {
            return;
        }
        if state.budget_of != self.request {
            state.budget_of = self.request;
            state.count = 0;
            state.bytes = 0;
        }
        if state.count >= MAX_INTERIM || state.bytes + bytes.len() > MAX_INTERIM_BYTES {
            return;
        }
        state.count += 1;
        state.bytes += bytes.len();
        state.queue.push_back((self.request, bytes));
        self.shared.pending.store(true, Ordering::Release);
        if let Some(w) = &state.service {
            w.wake_by_ref();
        }
        drop(state);
        crate::telemetry::metrics::interim_forwarded(status.as_u16());
    }
}

/// Has the origin's interim answers to `req` passed on through `sender`.
pub fn forward_to<B>(sender: Option<Sender>, req: &mut http::Request<B>) {
    if let Some(sender) = sender {
        hyper::ext::on_informational(req, move |res| sender.forward(res.status(), res.headers()));
    }
}

/// The interim response's bytes: its status line and the origin's fields
/// less the hop-by-hop ones.
fn encode(status: StatusCode, headers: &HeaderMap) -> Bytes {
    let mut fields = headers.clone();
    corral_core::semantics::hop_by_hop::strip(&mut fields);
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in &fields {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    Bytes::from(out)
}

/// A connection's stream with the interim responses of its requests
/// written in their place (see the module's notes).
#[derive(Debug)]
pub struct InterimIo<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> InterimIo<S> {
    pub fn new(inner: S, shared: Arc<Shared>) -> Self {
        InterimIo { inner, shared }
    }
}

impl<S: AsyncWrite + Unpin> InterimIo<S> {
    /// Writes queued interim bytes: all of them (`all`), or only the rest
    /// of one already started.
    fn poll_drain(&mut self, cx: &mut Context<'_>, all: bool) -> Poll<io::Result<()>> {
        if !self.shared.pending.load(Ordering::Acquire) {
            return Poll::Ready(Ok(()));
        }
        let mut state = self.shared.lock();
        // Something left the queue (written or dropped): the service may
        // wait for it to empty.
        let mut wrote = false;
        loop {
            if !all && !state.started {
                break;
            }
            let open = self.shared.open.load(Ordering::Acquire);
            let started = state.started;
            let Some((request, front)) = state.queue.front_mut() else {
                break;
            };
            if *request != open && !started {
                // Its request's final answer has gone to hyper.
                state.queue.pop_front();
                wrote = true;
                continue;
            }
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, front))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            wrote = true;
            front.advance(n);
            if front.is_empty() {
                state.queue.pop_front();
                state.started = false;
            } else {
                state.started = true;
            }
        }
        if state.queue.is_empty() {
            self.shared.pending.store(false, Ordering::Release);
            if wrote && let Some(w) = &state.service {
                w.wake_by_ref();
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for InterimIo<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for InterimIo<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx, false))?;
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx, false))?;
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx, true))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn interim_bytes_go_out_at_a_flush_and_never_inside_a_write() {
        let shared = Shared::new();
        let (client, mut server) = tokio::io::duplex(1 << 16);
        let mut io = InterimIo::new(client, Arc::clone(&shared));
        let sender = Sender::open(&shared);
        // The previous answer's tail, written before the flush.
        io.write_all(b"tail-of-previous").await.expect("write");
        let mut h = HeaderMap::new();
        h.insert("link", "</s.css>; rel=preload".parse().expect("value"));
        h.insert("connection", "close".parse().expect("value"));
        sender.forward(StatusCode::EARLY_HINTS, &h);
        sender.forward(StatusCode::CONTINUE, &h);
        io.flush().await.expect("flush");
        io.write_all(b"HTTP/1.1 200 OK\r\n").await.expect("write");
        drop(io);
        let mut got = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut server, &mut got)
            .await
            .expect("read");
        assert_eq!(
            String::from_utf8(got).expect("text"),
            "tail-of-previousHTTP/1.1 103 Early Hints\r\nlink: </s.css>; rel=preload\r\n\r\nHTTP/1.1 200 OK\r\n"
        );
    }

    #[tokio::test]
    async fn an_interim_answer_of_a_closed_request_is_dropped_not_written() {
        // Queued just after its request's last look at the queue: the
        // final answer may already be hyper's, so the 1xx must not follow.
        let shared = Shared::new();
        let (client, mut server) = tokio::io::duplex(1 << 16);
        let mut io = InterimIo::new(client, Arc::clone(&shared));
        let first = Sender::open(&shared);
        first.forward(StatusCode::EARLY_HINTS, &HeaderMap::new());
        shared.close();
        let _second = Sender::open(&shared);
        io.write_all(b"HTTP/1.1 200 OK\r\n").await.expect("write");
        io.flush().await.expect("flush");
        assert!(shared.lock().queue.is_empty());
        assert!(!shared.pending.load(Ordering::Acquire));
        drop(io);
        let mut got = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut server, &mut got)
            .await
            .expect("read");
        assert_eq!(got, b"HTTP/1.1 200 OK\r\n");
    }

    #[tokio::test]
    async fn a_closed_spent_or_earlier_channel_forwards_nothing() {
        let shared = Shared::new();
        let sender = Sender::open(&shared);
        for _ in 0..20 {
            sender.forward(StatusCode::PROCESSING, &HeaderMap::new());
        }
        assert_eq!(shared.lock().queue.len(), MAX_INTERIM as usize);
        shared.lock().queue.clear();
        // The next request's channel: the earlier one's calls are ignored.
        let next = Sender::open(&shared);
        sender.forward(StatusCode::EARLY_HINTS, &HeaderMap::new());
        assert!(shared.lock().queue.is_empty());
        next.forward(StatusCode::EARLY_HINTS, &HeaderMap::new());
        assert_eq!(shared.lock().queue.len(), 1);
        shared.close();
        next.forward(StatusCode::EARLY_HINTS, &HeaderMap::new());
        assert_eq!(
            shared.lock().queue.len(),
            1,
            "closed once the answer is out"
        );
    }
}
