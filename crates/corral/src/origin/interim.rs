//! Interim (1xx) responses passed on to the client: the origin's
//! `103 Early Hints` and `102 Processing` reach the caller whose request
//! made the origin request, before the final answer (RFC 9110 §15.2: a
//! proxy forwards 1xx responses; they are never stored, and their fields
//! never reach a stored response).
//!
//! On HTTP/1.1 hyper's server has no way to send a 1xx, so they are
//! written under it: [`InterimIo`] wraps the connection's stream and
//! writes the queued interim bytes when hyper flushes with nothing of its
//! own left to write (hyper calls `poll_flush` on the stream only once its
//! write buffer is empty, so every byte of the previous answer is out
//! first), and the request's service does not hand hyper the final answer
//! until the queue is empty, so nothing of the final answer can overtake
//! them. An interim write hyper interrupts half-way is finished before
//! hyper's next bytes.
//!
//! On HTTP/2 each stream has its own queue ([`Hints`]), which the task
//! answering the stream (`http::http2`) sends as HEADERS frames before the
//! final answer's. Both carry the same fields: the origin's less the
//! hop-by-hop ones, within the same bounds.
//!
//! Not for HTTP/1.0 clients (§15.2 forbids it): those callers get the
//! final answer only. Only the caller whose request reached the origin
//! gets them; callers served from a coalesced flight or the cache do not.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
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
    /// none does (its final answer is out). 32 bits keep a [`Sender`] (and
    /// an `Option` of one, which every fill carries) at two words; a number
    /// comes round again only after 4 billion requests on one connection,
    /// long after its request ended.
    open: AtomicU32,
    /// The last number given.
    last: AtomicU32,
    /// The connection's task is in `State::service` (it is the same task
    /// for every request of the connection).
    registered: AtomicBool,
}

#[derive(Debug, Default)]
struct State {
    /// Interim response bytes not yet written, in order, each with the
    /// number of its request: one whose request has closed is dropped,
    /// never written after that request's final answer.
    queue: VecDeque<(u32, Bytes)>,
    /// The front of `queue` is partly written: it is finished before any
    /// of hyper's bytes.
    started: bool,
    /// The connection's task, which serves the request: woken when an
    /// interim response is queued (so that hyper flushes) and when the
    /// queue empties.
    service: Option<Waker>,
    /// Whose bounds `count` and `bytes` are, and how much of them is used.
    budget_of: u32,
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
    fn open(&self) -> u32 {
        let request = loop {
            // 0 is "none open".
            let n = self.last.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
            if n != 0 {
                break n;
            }
        };
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
    to: To,
}

/// Where a request's interim responses go.
#[derive(Debug, Clone)]
enum To {
    /// Written under hyper on the HTTP/1.1 connection, as request number
    /// `request` of it.
    Connection { shared: Arc<Shared>, request: u32 },
    /// Sent on the request's own HTTP/2 stream.
    Stream(Arc<Hints>),
}

impl Sender {
    /// Opens the connection's channel for its next request.
    pub fn open(shared: &Arc<Shared>) -> Sender {
        Sender {
            to: To::Connection {
                request: shared.open(),
                shared: Arc::clone(shared),
            },
        }
    }

    /// A channel for one HTTP/2 stream, and the queue its task sends from.
    pub fn for_stream() -> (Sender, Arc<Hints>) {
        let hints = Arc::new(Hints::default());
        let sender = Sender {
            to: To::Stream(Arc::clone(&hints)),
        };
        (sender, hints)
    }

    /// Notes the task serving the request, to wake when an interim answer
    /// is queued: hyper writes only when its connection's task runs. Once
    /// per connection: its requests are all served by its task.
    pub async fn begin(&self) {
        let To::Connection { shared, .. } = &self.to else {
            return;
        };
        if shared.registered.load(Ordering::Acquire) {
            return;
        }
        std::future::poll_fn(|cx| {
            register(shared, cx.waker());
            shared.registered.store(true, Ordering::Release);
            Poll::Ready(())
        })
        .await;
    }

    /// The final answer is ready: waits until every interim answer queued
    /// for it is written, then closes the channel. One queued after the
    /// look is dropped by the stream (its request is closed by then), so
    /// none is written after the final answer. On HTTP/2 the stream's task
    /// sends what is queued before the answer; the channel only closes.
    pub async fn finish(self) {
        let shared = match self.to {
            To::Connection { shared, .. } => shared,
            To::Stream(hints) => {
                hints.lock().closed = true;
                return;
            }
        };
        if shared.pending.load(Ordering::Acquire) {
            std::future::poll_fn(|cx| {
                register(&shared, cx.waker());
                if shared.pending.load(Ordering::Acquire) {
                    Poll::Pending
                } else {
                    Poll::Ready(())
                }
            })
            .await;
        }
        shared.close();
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
        let queued = match &self.to {
            To::Connection { shared, request } => queue_bytes(shared, *request, status, headers),
            To::Stream(hints) => hints.queue(status, headers),
        };
        if queued {
            crate::telemetry::metrics::interim_forwarded(status.as_u16());
        }
    }
}

fn register(shared: &Shared, waker: &Waker) {
    let mut state = shared.lock();
    if !state.service.as_ref().is_some_and(|w| w.will_wake(waker)) {
        state.service = Some(waker.clone());
    }
}

/// Queues an interim response's bytes for request `request` of the
/// HTTP/1.1 connection; false when its answer is out or past the bounds.
fn queue_bytes(shared: &Shared, request: u32, status: StatusCode, headers: &HeaderMap) -> bool {
    let open = || shared.open.load(Ordering::Acquire) == request;
    if !open() {
        // The answer is out: not even encoded.
        return false;
    }
    let bytes = encode(status, &fields(headers));
    let mut state = shared.lock();
    if !open() {
        return false;
    }
    if state.budget_of != request {
        state.budget_of = request;
        state.count = 0;
        state.bytes = 0;
    }
    if state.count >= MAX_INTERIM || state.bytes + bytes.len() > MAX_INTERIM_BYTES {
        return false;
    }
    state.count += 1;
    state.bytes += bytes.len();
    state.queue.push_back((request, bytes));
    shared.pending.store(true, Ordering::Release);
    if let Some(w) = &state.service {
        w.wake_by_ref();
    }
    true
}

/// One HTTP/2 stream's interim responses, queued by the origin exchange
/// and sent by the stream's task before the final answer. Bounded as the
/// HTTP/1.1 channel is (the bytes counted as HTTP/1.1 would write them).
#[derive(Debug, Default)]
pub struct Hints {
    state: Mutex<HintsState>,
}

#[derive(Debug, Default)]
struct HintsState {
    queue: VecDeque<http::Response<()>>,
    /// The final answer is ready: nothing more is queued.
    closed: bool,
    count: u32,
    bytes: usize,
    /// The stream's task, waiting for the answer or a hint.
    task: Option<Waker>,
}

impl Hints {
    fn lock(&self) -> MutexGuard<'_, HintsState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn queue(&self, status: StatusCode, headers: &HeaderMap) -> bool {
        let fields = fields(headers);
        let size = encoded_len(status, &fields);
        let mut state = self.lock();
        if state.closed || state.count >= MAX_INTERIM || state.bytes + size > MAX_INTERIM_BYTES {
            return false;
        }
        state.count += 1;
        state.bytes += size;
        let mut res = http::Response::new(());
        *res.status_mut() = status;
        *res.headers_mut() = fields;
        state.queue.push_back(res);
        if let Some(w) = state.task.take() {
            w.wake();
        }
        true
    }

    /// The next interim response queued; pending (the task woken when one
    /// comes) while none is.
    pub fn poll_next(&self, cx: &mut Context<'_>) -> Poll<http::Response<()>> {
        let mut state = self.lock();
        match state.queue.pop_front() {
            Some(res) => Poll::Ready(res),
            None => {
                if !state.task.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    state.task = Some(cx.waker().clone());
                }
                Poll::Pending
            }
        }
    }

    /// The next interim response queued, if any, without waiting.
    pub fn next(&self) -> Option<http::Response<()>> {
        self.lock().queue.pop_front()
    }
}

/// Has the origin's interim answers to `req` passed on through `sender`.
pub fn forward_to<B>(sender: Option<Sender>, req: &mut http::Request<B>) {
    if let Some(sender) = sender {
        hyper::ext::on_informational(req, move |res| sender.forward(res.status(), res.headers()));
    }
}

/// The origin's fields of an interim response that reach the client:
/// all but the hop-by-hop ones (which HTTP/2 forbids as well).
fn fields(headers: &HeaderMap) -> HeaderMap {
    let mut fields = headers.clone();
    corral_core::semantics::hop_by_hop::strip(&mut fields);
    fields
}

/// The interim response's bytes: its status line and `fields`.
fn encode(status: StatusCode, fields: &HeaderMap) -> Bytes {
    let mut out = Vec::with_capacity(encoded_len(status, fields));
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in fields {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    Bytes::from(out)
}

/// The length of [`encode`]'s bytes, which the bounds count.
fn encoded_len(status: StatusCode, fields: &HeaderMap) -> usize {
    let line = "HTTP/1.1 200 \r\n".len() + status.canonical_reason().unwrap_or("").len();
    let each: usize = fields
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len() + 4)
        .sum();
    line + each + 2
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

    #[test]
    fn an_h2_streams_hints_lose_hop_by_hop_fields_keep_the_bounds_and_end_with_its_answer() {
        let (sender, hints) = Sender::for_stream();
        let mut h = HeaderMap::new();
        h.insert("link", "</s.css>; rel=preload".parse().expect("value"));
        h.insert("connection", "x-hop".parse().expect("value"));
        h.insert("x-hop", "1".parse().expect("value"));
        h.insert("keep-alive", "timeout=5".parse().expect("value"));
        sender.forward(StatusCode::CONTINUE, &h);
        sender.forward(StatusCode::EARLY_HINTS, &h);
        let first = hints.next().expect("the 103");
        assert_eq!(first.status(), StatusCode::EARLY_HINTS);
        let names: Vec<&str> = first.headers().keys().map(|n| n.as_str()).collect();
        assert_eq!(names, ["link"]);
        assert!(hints.next().is_none(), "100 is never passed on");
        // The HTTP/1.1 channel's bounds: a count, and bytes counted as
        // HTTP/1.1 writes them.
        for _ in 0..20 {
            sender.forward(StatusCode::PROCESSING, &HeaderMap::new());
        }
        assert_eq!(
            std::iter::from_fn(|| hints.next()).count(),
            MAX_INTERIM as usize - 1
        );
        let fields = fields(&h);
        assert_eq!(
            encoded_len(StatusCode::EARLY_HINTS, &fields),
            encode(StatusCode::EARLY_HINTS, &fields).len()
        );
        // Once the answer is ready, nothing more is queued.
        let (sender, hints) = Sender::for_stream();
        futures_util::FutureExt::now_or_never(sender.clone().finish()).expect("finish at once");
        sender.forward(StatusCode::EARLY_HINTS, &h);
        assert!(hints.next().is_none());
    }

    #[test]
    fn a_sender_and_an_optional_one_stay_two_words() {
        // Every fill carries an `Option<Sender>`; the miss path's values
        // were sized with it at two words.
        assert_eq!(std::mem::size_of::<Option<Sender>>(), 16);
    }
}
