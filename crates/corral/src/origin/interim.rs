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
use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes};
use futures_util::task::AtomicWaker;
use http::{HeaderMap, StatusCode};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// At most this many interim responses are passed on per request.
const MAX_INTERIM: u32 = 8;
/// And at most this many bytes of them.
const MAX_INTERIM_BYTES: usize = 16 * 1024;

tokio::task_local! {
    /// The interim channel of the request being served on this task, if
    /// its client can take 1xx responses.
    static CALLER: Sender;
}

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
    /// The request's service: woken when an interim response is queued (so
    /// that hyper flushes) and when the queue empties.
    service: AtomicWaker,
}

#[derive(Debug, Default)]
struct State {
    /// Interim response bytes not yet written, in order.
    queue: VecDeque<Bytes>,
    /// The front of `queue` is partly written: it is finished before any
    /// of hyper's bytes.
    started: bool,
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
    /// The channel of the request being served on this task, if any.
    pub fn current() -> Option<Sender> {
        CALLER.try_with(Sender::clone).ok()
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
        let bytes = encode(status, headers);
        let mut state = self.shared.lock();
        // Checked under the lock: the service closes the channel before it
        // looks at the queue under the lock for the last time.
        if self.shared.open.load(Ordering::Acquire) != self.request {
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
        state.queue.push_back(bytes);
        self.shared.pending.store(true, Ordering::Release);
        drop(state);
        self.shared.service.wake();
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
    corral_core::hop_by_hop::strip(&mut fields);
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

/// Serves one request's `service` with an interim channel when the client
/// can take 1xx responses (`shared` given), and hands back its final
/// answer only once every interim response queued for it is written.
pub async fn serve<F: Future>(shared: Option<Arc<Shared>>, service: F) -> F::Output {
    let Some(shared) = shared else {
        return service.await;
    };
    let sender = Sender {
        request: shared.open(),
        shared: Arc::clone(&shared),
    };
    let service = CALLER.scope(sender, service);
    tokio::pin!(service);
    let out = std::future::poll_fn(|cx| {
        shared.service.register(cx.waker());
        service.as_mut().poll(cx)
    })
    .await;
    {
        // Closed under the lock, so no interim response is queued after
        // the look below.
        let _state = shared.lock();
        shared.close();
    }
    if shared.pending.load(Ordering::Acquire) {
        std::future::poll_fn(|cx| {
            shared.service.register(cx.waker());
            if shared.pending.load(Ordering::Acquire) {
                Poll::Pending
            } else {
                Poll::Ready(())
            }
        })
        .await;
    }
    out
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
        let mut wrote = false;
        loop {
            if !all && !state.started {
                break;
            }
            let Some(front) = state.queue.front_mut() else {
                break;
            };
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
            if wrote {
                self.shared.service.wake();
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
        let sender = Sender {
            request: shared.open(),
            shared: Arc::clone(&shared),
        };
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
    async fn a_closed_spent_or_earlier_channel_forwards_nothing() {
        let shared = Shared::new();
        let sender = Sender {
            request: shared.open(),
            shared: Arc::clone(&shared),
        };
        for _ in 0..20 {
            sender.forward(StatusCode::PROCESSING, &HeaderMap::new());
        }
        assert_eq!(shared.lock().queue.len(), MAX_INTERIM as usize);
        shared.lock().queue.clear();
        // The next request's channel: the earlier one's calls are ignored.
        let next = Sender {
            request: shared.open(),
            shared: Arc::clone(&shared),
        };
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
