//! HTTP/2 connections, served with the `h2` crate directly rather than
//! through hyper: hyper keeps h2's informational send to itself, and the
//! origin's `103 Early Hints` must reach an HTTP/2 client as a HEADERS
//! frame before the final answer's, as it reaches an HTTP/1.1 one.
//!
//! Everything hyper's HTTP/2 server did is done here the same way: the
//! same SETTINGS (windows, frame and send-buffer sizes, header list size,
//! 128 concurrent streams, reset-stream caps), keep-alive pings that close
//! a connection whose peer stops answering, the request given to the
//! handler as hyper gave it (`Request<Body>`, version HTTP/2, the URI with
//! scheme and authority, a body that knows its Content-Length and gives
//! its window back as it is read), a request dropped when the client
//! resets its stream (counted as abandoned on the connection), the answer
//! with its connection-specific fields removed, a Date, a Content-Length
//! when the body's length is known, its body sent as the client's window
//! allows, its trailers, and `RST_STREAM` when the body fails half-way.
//! The connection's deadlines stay with its watchdog (`connection`).
//!
//! Nothing here panics on what a client sends: `h2` checks frames,
//! pseudo-header fields and Content-Length against the data, and answers
//! a malformed stream with `RST_STREAM`.

use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use h2::server::{Connection as H2Connection, Handshake, SendResponse};
use h2::{Ping, PingPong, Reason, RecvStream, SendStream};
use http::header::{CONTENT_LENGTH, DATE, HeaderMap};
use http::{Request, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::origin::interim::{Hints, Sender};

/// What a client sends first on an HTTP/2 connection (RFC 9113 §3.4).
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

// hyper's server defaults, kept so that clients see the SETTINGS they saw.
const STREAM_WINDOW: u32 = 1024 * 1024;
const CONNECTION_WINDOW: u32 = 1024 * 1024;
const MAX_FRAME_SIZE: u32 = 16 * 1024;
const MAX_SEND_BUFFER: usize = 400 * 1024;
const MAX_LOCAL_ERROR_RESETS: usize = 1024;
/// Streams a client may have open at once.
const MAX_STREAMS: u32 = 128;

/// The HTTP/2 settings of a listener.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    max_header_list_size: u32,
    /// A ping goes out this long after the last one was answered...
    ping_interval: Duration,
    /// ...and the connection closes when its pong takes longer than this.
    ping_timeout: Duration,
}

impl Settings {
    /// Pings find peers that vanished while a request was in progress;
    /// idle connections are closed by the watchdog either way.
    pub fn new(idle_timeout: Duration, max_header_size: u64) -> Self {
        Settings {
            max_header_list_size: u32::try_from(max_header_size).unwrap_or(u32::MAX),
            ping_interval: idle_timeout.min(Duration::from_secs(30)),
            ping_timeout: Duration::from_secs(20),
        }
    }

    fn builder(&self) -> h2::server::Builder {
        let mut b = h2::server::Builder::new();
        b.initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_frame_size(MAX_FRAME_SIZE)
            .max_header_list_size(self.max_header_list_size)
            .max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESETS))
            .max_send_buffer_size(MAX_SEND_BUFFER)
            .max_concurrent_streams(MAX_STREAMS);
        b
    }
}

/// What answers the streams of a connection (the connection's counted
/// handler): the answer to a request, given the channel its interim
/// responses go through. Called as the stream is accepted, so that the
/// request is counted on the connection at once.
pub trait Streams: Send + Sync + 'static {
    type Body: HttpBody<Data = Bytes, Error = axum::Error> + Send + 'static;

    fn answer(
        &self,
        req: Request<Body>,
        interim: Sender,
    ) -> impl Future<Output = Response<Self::Body>> + Send + 'static;
}

/// One HTTP/2 connection being served: its handshake, then its streams,
/// each answered in a task of its own.
pub struct Connection<I, S> {
    state: State<I>,
    streams: S,
    settings: Settings,
    /// Told to finish before the handshake was done.
    stop: bool,
}

// Nothing of it is pinned in place: the handshake and the connection are
// polled through `&mut`.
impl<I, S> Unpin for Connection<I, S> {}

enum State<I> {
    Handshaking(Handshake<I, Bytes>),
    Serving(H2Connection<I, Bytes>, Option<KeepAlive>),
}

impl<I, S> Connection<I, S>
where
    I: AsyncRead + AsyncWrite + Unpin,
    S: Streams,
{
    /// Serves `io`, whose first bytes are the preface.
    pub fn new(io: I, streams: S, settings: &Settings) -> Self {
        Connection {
            state: State::Handshaking(settings.builder().handshake(io)),
            streams,
            settings: *settings,
            stop: false,
        }
    }

    /// Finishes the streams in progress, takes no more (GOAWAY), then ends.
    pub fn graceful_shutdown(&mut self) {
        match &mut self.state {
            State::Handshaking(_) => self.stop = true,
            State::Serving(conn, _) => conn.graceful_shutdown(),
        }
    }
}

impl<I, S> Future for Connection<I, S>
where
    I: AsyncRead + AsyncWrite + Unpin,
    S: Streams,
{
    type Output = Result<(), h2::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        loop {
            match &mut this.state {
                State::Handshaking(hs) => {
                    let mut conn = ready!(Pin::new(hs).poll(cx))?;
                    if this.stop {
                        conn.graceful_shutdown();
                    }
                    let pings = conn
                        .ping_pong()
                        .map(|pp| KeepAlive::new(pp, &this.settings));
                    this.state = State::Serving(conn, pings);
                }
                State::Serving(conn, pings) => {
                    if let Some(p) = pings
                        && p.poll_dead(cx).is_ready()
                    {
                        tracing::debug!(
                            "closing an HTTP/2 connection whose peer stopped answering pings"
                        );
                        conn.abrupt_shutdown(Reason::NO_ERROR);
                        *pings = None;
                    }
                    // The connection's frames are read and written only
                    // while it is polled: accept until nothing is ready.
                    loop {
                        match ready!(conn.poll_accept(cx)) {
                            Some(Ok((req, reply))) => accept(&this.streams, req, reply),
                            Some(Err(e)) => return Poll::Ready(Err(e)),
                            None => return Poll::Ready(Ok(())),
                        }
                    }
                }
            }
        }
    }
}

/// A new stream: its request counted and handed to the handler now, its
/// answer sent from a task of its own (as hyper's executor did).
fn accept<S: Streams>(streams: &S, req: Request<RecvStream>, reply: SendResponse<Bytes>) {
    let (parts, recv) = req.into_parts();
    let length = content_length(&parts.headers);
    let req = Request::from_parts(parts, Body::new(RecvBody::new(recv, length)));
    let (interim, hints) = Sender::for_stream();
    let answer = streams.answer(req, interim);
    tokio::spawn(respond(answer, reply, hints));
}

/// The request's Content-Length: every value the same number, else none
/// (`h2` then checks the data against it).
fn content_length(headers: &HeaderMap) -> Option<u64> {
    let mut length = None;
    for value in headers.get_all(CONTENT_LENGTH) {
        let text = value.to_str().ok()?;
        for n in text.split(',') {
            let n = n.trim();
            if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            let n: u64 = n.parse().ok()?;
            if length.is_some_and(|l| l != n) {
                return None;
            }
            length = Some(n);
        }
    }
    length
}

/// What the stream's task waits for while the answer is being made.
enum Waited<R> {
    Answer(R),
    Hint(Response<()>),
    Reset,
}

/// Answers one stream: the interim responses as they come, then the
/// answer and its body. A client that resets the stream before the
/// answer drops it (and the request counts as abandoned).
async fn respond<F, B>(answer: F, mut reply: SendResponse<Bytes>, hints: std::sync::Arc<Hints>)
where
    F: Future<Output = Response<B>>,
    B: HttpBody<Data = Bytes, Error = axum::Error>,
{
    let mut answer = pin!(answer);
    let res = loop {
        let waited = poll_fn(|cx| {
            if let Poll::Ready(res) = answer.as_mut().poll(cx) {
                return Poll::Ready(Waited::Answer(res));
            }
            if let Poll::Ready(hint) = hints.poll_next(cx) {
                return Poll::Ready(Waited::Hint(hint));
            }
            match reply.poll_reset(cx) {
                Poll::Ready(_) => Poll::Ready(Waited::Reset),
                Poll::Pending => Poll::Pending,
            }
        })
        .await;
        match waited {
            Waited::Answer(res) => break res,
            Waited::Hint(hint) => {
                if let Err(e) = reply.send_informational(hint) {
                    tracing::debug!(error = %e, "an interim response could not be sent");
                    return;
                }
            }
            Waited::Reset => return,
        }
    };
    // Queued before the answer was ready: they go before it.
    while let Some(hint) = hints.next() {
        if reply.send_informational(hint).is_err() {
            return;
        }
    }
    send_answer(reply, res).await;
}

/// Sends the answer's head, then its body.
async fn send_answer<B>(mut reply: SendResponse<Bytes>, res: Response<B>)
where
    B: HttpBody<Data = Bytes, Error = axum::Error>,
{
    let (mut head, body) = res.into_parts();
    strip_connection_fields(&mut head.headers);
    if !head.headers.contains_key(DATE)
        && let Some(date) = crate::http::h1::date_value()
    {
        head.headers.insert(DATE, date);
    }
    let ends = body.is_end_stream();
    if !ends
        && let Some(n) = body.size_hint().exact()
        && !head.headers.contains_key(CONTENT_LENGTH)
    {
        head.headers.insert(CONTENT_LENGTH, n.into());
    }
    match reply.send_response(Response::from_parts(head, ()), ends) {
        Ok(send) if !ends => send_body(body, send).await,
        Ok(_) => {}
        Err(e) => {
            tracing::debug!(error = %e, "an answer could not be sent");
            reply.send_reset(Reason::INTERNAL_ERROR);
        }
    }
}

/// Sends a body as the client's window allows, its trailers if it has
/// them; a body that fails resets the stream so that the client sees it
/// cut, never complete. Ends when the client resets the stream.
async fn send_body<B>(body: B, mut send: SendStream<Bytes>)
where
    B: HttpBody<Data = Bytes, Error = axum::Error>,
{
    let mut body = pin!(body);
    loop {
        let frame = poll_fn(|cx| {
            if send.poll_reset(cx).is_ready() {
                return Poll::Ready(None);
            }
            body.as_mut().poll_frame(cx).map(Some)
        })
        .await;
        let frame = match frame {
            None => return,
            Some(None) => {
                let _ = send.send_data(Bytes::new(), true);
                return;
            }
            Some(Some(Err(e))) => {
                tracing::debug!(error = %e, "an answer's body failed; resetting its stream");
                send.send_reset(Reason::INTERNAL_ERROR);
                return;
            }
            Some(Some(Ok(frame))) => frame,
        };
        match frame.into_data() {
            Ok(data) => {
                let ends = body.is_end_stream();
                if send_data(&mut send, data, ends).await.is_err() || ends {
                    return;
                }
            }
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    let _ = send.send_trailers(trailers);
                    return;
                }
            }
        }
    }
}

/// Sends `data` in parts no larger than the window granted, waiting for
/// more window between them, so that no more than the window is queued.
async fn send_data(send: &mut SendStream<Bytes>, mut data: Bytes, ends: bool) -> Result<(), ()> {
    if data.is_empty() {
        return send.send_data(data, ends).map_err(drop);
    }
    while !data.is_empty() {
        send.reserve_capacity(data.len());
        while send.capacity() == 0 {
            match poll_fn(|cx| send.poll_capacity(cx)).await {
                Some(Ok(_)) => {}
                // Reset or closed: the client is gone.
                Some(Err(_)) | None => return Err(()),
            }
        }
        let part = data.split_to(send.capacity().min(data.len()));
        send.send_data(part, ends && data.is_empty())
            .map_err(drop)?;
    }
    Ok(())
}

/// Removes what HTTP/2 forbids in an answer (RFC 9113 §8.2.2), as hyper
/// did: Connection and the fields it names, Keep-Alive,
/// Proxy-Connection, Transfer-Encoding, Upgrade and TE.
fn strip_connection_fields(headers: &mut HeaderMap) {
    use http::header::{CONNECTION, TE, TRANSFER_ENCODING, UPGRADE};
    if let Some(named) = headers.remove(CONNECTION)
        && let Ok(named) = named.to_str()
    {
        for name in named.split(',') {
            headers.remove(name.trim());
        }
    }
    for name in [TRANSFER_ENCODING, UPGRADE, TE] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
}

/// A request's body as the handler reads it: its data, giving the
/// client its window back as each part is read, then its trailers.
struct RecvBody {
    recv: RecvStream,
    /// What the Content-Length says is left to come.
    remaining: Option<u64>,
    data_done: bool,
}

impl RecvBody {
    fn new(recv: RecvStream, length: Option<u64>) -> Self {
        // A request whose headers ended the stream has no body whatever
        // its fields say.
        let remaining = if recv.is_end_stream() {
            length.or(Some(0))
        } else {
            length
        };
        RecvBody {
            recv,
            remaining,
            data_done: false,
        }
    }
}

/// A reset with NO_ERROR only says the client wants no more of the
/// exchange: the body ends there, it does not fail.
fn ended(e: h2::Error) -> Option<Result<Frame<Bytes>, h2::Error>> {
    (e.reason() != Some(Reason::NO_ERROR)).then_some(Err(e))
}

impl HttpBody for RecvBody {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        let this = &mut *self;
        if !this.data_done {
            match ready!(this.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    let _ = this.recv.flow_control().release_capacity(data.len());
                    if let Some(left) = &mut this.remaining {
                        *left = left.saturating_sub(data.len() as u64);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(e)) => return Poll::Ready(ended(e)),
                None => this.data_done = true,
            }
        }
        match ready!(this.recv.poll_trailers(cx)) {
            Ok(trailers) => Poll::Ready(trailers.map(|t| Ok(Frame::trailers(t)))),
            Err(e) => Poll::Ready(ended(e)),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        match self.remaining {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}

/// Keep-alive pings: one every `ping_interval` after the last was
/// answered; a peer that does not answer one within `ping_timeout` is
/// taken for gone (hyper's keep-alive, which also pinged idle
/// connections).
struct KeepAlive {
    pings: PingPong,
    timer: Pin<Box<tokio::time::Sleep>>,
    interval: Duration,
    timeout: Duration,
    /// A ping is out, unanswered.
    waiting: bool,
}

impl KeepAlive {
    fn new(pings: PingPong, settings: &Settings) -> Self {
        KeepAlive {
            pings,
            timer: Box::pin(tokio::time::sleep(settings.ping_interval)),
            interval: settings.ping_interval,
            timeout: settings.ping_timeout,
            waiting: false,
        }
    }

    /// Ready when the peer is taken for gone.
    fn poll_dead(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            if self.waiting {
                match self.pings.poll_pong(cx) {
                    Poll::Ready(Ok(_)) => {
                        self.waiting = false;
                        let next = tokio::time::Instant::now() + self.interval;
                        self.timer.as_mut().reset(next);
                    }
                    // The connection itself failed: its accept says so.
                    Poll::Ready(Err(_)) => return Poll::Pending,
                    Poll::Pending => {}
                }
            }
            ready!(self.timer.as_mut().poll(cx));
            if self.waiting {
                return Poll::Ready(());
            }
            if self.pings.send_ping(Ping::opaque()).is_err() {
                return Poll::Pending;
            }
            self.waiting = true;
            let deadline = tokio::time::Instant::now() + self.timeout;
            self.timer.as_mut().reset(deadline);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_content_length_counts_only_when_every_value_agrees() {
        let of = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(CONTENT_LENGTH, v.parse().expect("value"));
            }
            content_length(&h)
        };
        assert_eq!(of(&[]), None);
        assert_eq!(of(&["12"]), Some(12));
        assert_eq!(of(&["12, 12", "12"]), Some(12));
        assert_eq!(of(&["12", "13"]), None);
        assert_eq!(of(&["+12"]), None);
        assert_eq!(of(&[""]), None);
        assert_eq!(of(&["99999999999999999999999"]), None);
    }

    #[test]
    fn an_answer_loses_what_http2_forbids_and_keeps_the_rest() {
        let mut h = HeaderMap::new();
        for (n, v) in [
            ("connection", "x-hop, keep-alive"),
            ("x-hop", "1"),
            ("keep-alive", "timeout=5"),
            ("proxy-connection", "keep-alive"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "h2c"),
            ("te", "trailers"),
            ("link", "</a.css>; rel=preload"),
        ] {
            h.append(n, v.parse().expect("value"));
        }
        strip_connection_fields(&mut h);
        let left: Vec<&str> = h.keys().map(|n| n.as_str()).collect();
        assert_eq!(left, ["link"]);
    }
}
