//! HTTP/1.1's common request served without hyper: a GET or HEAD with no
//! body, the shape of nearly every cache hit. hyper's parse, dispatch and
//! encode cost a hit about half its instructions; this loop parses the head
//! with the parser hyper uses (`httparse`), hands the request to the same
//! handler, and writes the answer with the framing hyper's server would
//! give it, in one vectored write when the body is whole.
//!
//! It is narrow on purpose. The first request it does not take (see
//! `corral_core::semantics::h1`: another method or version, a body or the fields that
//! frame one, `Expect`, `Upgrade`, `TE`, a target that is not origin-form,
//! too many fields, an HTTP/2 preface, anything `httparse` refuses; or a
//! head past the buffer) is handed, with every byte read so far, to hyper
//! for the rest of the connection ([`LoopEnd::Handoff`]): hyper then parses
//! those same bytes as if it had read them itself, and answers or refuses
//! them as it always did. So a request is framed by the same parser
//! whichever of the two serves it, and nothing with a body (the ground of
//! request smuggling) is ever framed here.
//!
//! What hyper did for a connection, the loop does too: one request at a
//! time, pipelined heads kept for after the answer; a client that closes
//! while its answer is being made abandons it (hyper's unexpected EOF);
//! interim answers go out at a flush (`origin::interim`); an answer body
//! that ends short of its length, or fails, closes the connection with
//! nothing more written; `Connection: close` from either side closes it
//! after the answer; a graceful shutdown closes it between requests.

use std::future::{Future, poll_fn};
use std::io::{self, IoSlice};
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use corral_core::semantics::h1::{Parsed, decimal, has_token, parse};
use http::header::{self, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Version};
use http_body::Body as HttpBody;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

use crate::cache::respond::Wire;
use crate::http::client_stream::Rewind;

/// The read buffer's first size, and what each read asks room for.
const READ_CHUNK: usize = 8 * 1024;

/// The answer head buffer's first size.
const OUT_FIRST: usize = 512;

/// How a connection's time on this loop ended.
pub enum LoopEnd<I> {
    /// The connection is done: the client closed it, an answer said
    /// `Connection: close`, or a graceful shutdown came between requests.
    Closed,
    /// A request this loop does not take: the stream, with every byte read
    /// and not yet answered, for hyper.
    Handoff(Rewind<I>),
}

/// What the loop asks of the connection it serves.
pub trait Answers: Send + Sync + 'static {
    type Body: HttpBody<Data = Bytes, Error = axum::Error> + Send + Unpin;
    /// The answer to `req`, counted as the connection's request.
    fn answer(
        &self,
        req: Request<Body>,
    ) -> impl Future<Output = Response<Self::Body>> + Send + 'static;
    /// Set once the connection should close between requests.
    fn stopping(&self) -> &AtomicBool;
    /// The hit in `body` to write from its entry's head bytes, if it is one
    /// (its response then carries only the status).
    fn wire(_body: &Self::Body) -> Option<&Wire> {
        None
    }
}

/// Serves `io`'s requests while they are the kind this loop takes; up to
/// `max_buf` bytes of one head are read before hyper is handed it.
pub async fn serve<I, A>(mut io: I, service: A, max_buf: usize) -> io::Result<LoopEnd<I>>
where
    I: AsyncRead + AsyncWrite + Unpin + Send,
    A: Answers,
{
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    let mut out = Vec::with_capacity(OUT_FIRST);
    let mut fields = Vec::with_capacity(16);
    loop {
        let fast = loop {
            // Told to close between requests: none more is begun, by either
            // loop (hyper's graceful shutdown closes an idle HTTP/1.1
            // connection too, pipelined requests unread).
            if service.stopping().load(Ordering::Relaxed) {
                return Ok(LoopEnd::Closed);
            }
            if !buf.is_empty() {
                match parse(&buf, &mut fields) {
                    Parsed::Fast(fast) => break fast,
                    Parsed::Partial => {}
                    Parsed::Other => return Ok(LoopEnd::Handoff(Rewind::new(buf.freeze(), io))),
                }
            }
            if buf.len() >= max_buf {
                // hyper answers a head past its buffer (431).
                return Ok(LoopEnd::Handoff(Rewind::new(buf.freeze(), io)));
            }
            if buf.capacity() - buf.len() < READ_CHUNK / 4 {
                buf.reserve(READ_CHUNK);
            }
            let read = {
                let mut read = pin!(io.read_buf(&mut buf));
                poll_fn(|cx| {
                    if service.stopping().load(Ordering::Relaxed) {
                        return Poll::Ready(None);
                    }
                    read.as_mut().poll(cx).map(Some)
                })
                .await
            };
            match read {
                None | Some(Ok(0)) => return Ok(LoopEnd::Closed),
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e),
            }
        };
        // How much the buffer holds, all of it kept alive by what is split
        // off: past two reads' worth (a large head), it is let go once the
        // connection is idle again (below).
        let grown = buf.capacity() > 2 * READ_CHUNK;
        let head = buf.split_to(fast.len()).freeze();
        let Some(req) = fast.request(&head, &fields) else {
            // A target or a field hyper's types refuse: hyper says so.
            return Ok(LoopEnd::Handoff(Rewind::new(rejoined(&head, &buf), io)));
        };
        drop(head);
        let is_head = fast.method() == Method::HEAD;
        let req = req.map(|()| Body::empty());
        // Pinned where it is made: moved into `answered`, the answer's
        // future (its request and reply inline) was copied twice per hit.
        let answer = pin!(service.answer(req));
        let Some(res) = answered(&mut io, &mut buf, answer).await? else {
            // The client left before its answer.
            return Ok(LoopEnd::Closed);
        };
        out.clear();
        let (mut parts, body) = res.into_parts();
        let keep_alive = !fast.closes() && !service.stopping().load(Ordering::Relaxed);
        let closes = if let Some(wire) = A::wire(&body) {
            encode_wire(&mut out, wire, keep_alive);
            let body: &[u8] = if is_head { &[] } else { wire.body() };
            write_all(&mut io, &mut [IoSlice::new(&out), IoSlice::new(body)]).await?;
            !keep_alive
        } else {
            let Some((framing, last)) =
                encode_head(&mut out, is_head, keep_alive, &mut parts, length_of(&body))
            else {
                // An answer hyper would refuse to frame: nothing is written.
                return Ok(LoopEnd::Closed);
            };
            write_body(&mut io, &out, framing, body).await?;
            last || framing == Framing::Close
        };
        poll_fn(|cx| Pin::new(&mut io).poll_flush(cx)).await?;
        if closes {
            let _ = poll_fn(|cx| Pin::new(&mut io).poll_shutdown(cx)).await;
            return Ok(LoopEnd::Closed);
        }
        if grown && buf.is_empty() {
            // A kept-alive connection does not keep one large head's
            // buffer (hyper's read buffer shrinks back too).
            buf = BytesMut::with_capacity(READ_CHUNK);
        }
        if out.capacity() > READ_CHUNK {
            // Nor the buffer one large answer head was written in.
            out = Vec::with_capacity(OUT_FIRST);
        }
    }
}

/// A head split off the buffer, and what followed it, as one run of bytes
/// again (for hyper, which reads them from the start).
fn rejoined(head: &Bytes, rest: &BytesMut) -> Bytes {
    let mut all = BytesMut::with_capacity(head.len() + rest.len());
    all.extend_from_slice(head);
    all.extend_from_slice(rest);
    all.freeze()
}

/// Waits for `answer`, writing interim answers as they are queued, and
/// watching for the client to close while `buf` holds nothing of its
/// next request; `None`: the client closed.
async fn answered<I, F, B>(
    io: &mut I,
    buf: &mut BytesMut,
    mut answer: Pin<&mut F>,
) -> io::Result<Option<B>>
where
    I: AsyncRead + AsyncWrite + Unpin,
    F: Future<Output = B>,
{
    poll_fn(|cx| {
        if let Poll::Ready(res) = answer.as_mut().poll(cx) {
            return Poll::Ready(Ok(Some(res)));
        }
        // Queued interim answers are written at a flush.
        if let Poll::Ready(Err(e)) = Pin::new(&mut *io).poll_flush(cx) {
            return Poll::Ready(Err(e));
        }
        if buf.is_empty() {
            match read_some(io, cx, buf) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Ok(None)),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(_)) | Poll::Pending => {}
            }
        }
        Poll::Pending
    })
    .await
}

/// One read into `buf`, while an answer is being made.
fn read_some<I: AsyncRead + Unpin>(
    io: &mut I,
    cx: &mut Context<'_>,
    buf: &mut BytesMut,
) -> Poll<io::Result<usize>> {
    let mut chunk = [0u8; 2048];
    let mut rb = ReadBuf::new(&mut chunk);
    match Pin::new(io).poll_read(cx, &mut rb) {
        Poll::Ready(Ok(())) => {
            buf.extend_from_slice(rb.filled());
            Poll::Ready(Ok(rb.filled().len()))
        }
        Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
        Poll::Pending => Poll::Pending,
    }
}

/// What the body says of its length, as hyper reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Length {
    /// Nothing to send.
    Empty,
    Known(u64),
    Unknown,
}

fn length_of<B: HttpBody>(body: &B) -> Length {
    if body.is_end_stream() {
        return Length::Empty;
    }
    body.size_hint()
        .exact()
        .map_or(Length::Unknown, Length::Known)
}

/// How the body goes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// Exactly this many bytes (0: no body).
    Length(u64),
    Chunked,
    /// Until the connection closes (an HTTP/1.0 answer without a length).
    Close,
}

/// Writes the answer's head into `out` as hyper's HTTP/1.1 server does
/// (`proto::h1::role::Server::encode`, after `Conn::enforce_version`): the
/// same status line, fields in order, `Connection: close` when the
/// connection is not kept alive, the framing fields hyper would write or
/// keep, and a Date unless the answer has one. Its framing, and whether
/// the connection closes after it; `None` where hyper would refuse the
/// head and write nothing.
fn encode_head(
    out: &mut Vec<u8>,
    is_head: bool,
    keep_alive: bool,
    parts: &mut http::response::Parts,
    body: Length,
) -> Option<(Framing, bool)> {
    let status = parts.status;
    if status.is_informational() {
        return None;
    }
    if !keep_alive {
        add_connection_close(&mut parts.headers);
    }
    let http10 = parts.version == Version::HTTP_10;
    status_line(out, status, http10, parts.extensions.get());
    let can_length = !matches!(status, StatusCode::NO_CONTENT | StatusCode::NOT_MODIFIED);
    let mut fields = HeadFields {
        is_head,
        body,
        can_length,
        can_body: can_length && !is_head,
        can_chunk: can_length && !is_head && !http10,
        framing: None,
        last: !keep_alive,
        wrote_date: false,
        open: None,
        chunked_last: true,
    };
    for (name, value) in &parts.headers {
        fields.write(out, name, value)?;
    }
    fields.finish(out)
}

/// Adds `close` to the answer's Connection field, unless it is there.
fn add_connection_close(headers: &mut http::HeaderMap) {
    match headers.entry(header::CONNECTION) {
        header::Entry::Occupied(mut e) => {
            if !e.iter().any(|v| has_token(v.as_bytes(), b"close")) {
                e.append(HeaderValue::from_static("close"));
            }
        }
        header::Entry::Vacant(e) => {
            e.insert(HeaderValue::from_static("close"));
        }
    }
}

/// The status line, with the origin's own reason phrase as hyper's client
/// read it, else the canonical one.
fn status_line(
    out: &mut Vec<u8>,
    status: StatusCode,
    http10: bool,
    reason: Option<&hyper::ext::ReasonPhrase>,
) {
    if !http10 && status == StatusCode::OK && reason.is_none() {
        out.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
        return;
    }
    out.extend_from_slice(if http10 { b"HTTP/1.0 " } else { b"HTTP/1.1 " });
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    match reason {
        Some(r) => out.extend_from_slice(r.as_bytes()),
        None => out.extend_from_slice(status.canonical_reason().unwrap_or("<none>").as_bytes()),
    }
    out.extend_from_slice(b"\r\n");
}

/// The fields of a head as [`encode_head`] writes them, one at a time:
/// what the status and the request allow, and what was written so far.
struct HeadFields {
    is_head: bool,
    body: Length,
    /// The status may carry a Content-Length (not 204 or 304).
    can_length: bool,
    /// A body follows the head (and the request was not a HEAD).
    can_body: bool,
    /// That body may be chunked (not HTTP/1.0).
    can_chunk: bool,
    framing: Option<Framing>,
    /// The connection closes after this answer.
    last: bool,
    wrote_date: bool,
    /// A framing or Connection field's line is open: its next values join it.
    open: Option<HeaderName>,
    chunked_last: bool,
}

impl HeadFields {
    /// Writes one field; `None` where hyper would refuse the head.
    fn write(&mut self, out: &mut Vec<u8>, name: &HeaderName, value: &HeaderValue) -> Option<()> {
        if self.open.as_ref().is_some_and(|o| o != name) {
            close_line(out, &mut self.open, self.chunked_last);
        }
        let joins = self.open.as_ref() == Some(name);
        match *name {
            header::CONTENT_LENGTH if self.content_length(out, name, value, joins)? => {
                return Some(());
            }
            header::TRANSFER_ENCODING => return self.transfer_encoding(out, name, value, joins),
            header::CONNECTION | header::TRAILER => {
                self.listed(out, name, value, joins);
                return Some(());
            }
            header::DATE => self.wrote_date = true,
            _ => {}
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
        Some(())
    }

    /// A Content-Length field: whether it was dealt with (written, joined
    /// or dropped), or is to be written as it is; `None` where hyper
    /// refuses two framings or lengths that differ.
    fn content_length(
        &mut self,
        out: &mut Vec<u8>,
        name: &HeaderName,
        value: &HeaderValue,
        joins: bool,
    ) -> Option<bool> {
        let n = match self.body {
            Length::Known(n) => {
                if joins {
                    return Some(true);
                }
                n
            }
            Length::Unknown => {
                let n = parse_length(value)?;
                if joins {
                    // Every value the same length, as hyper checks.
                    return (self.framing == Some(Framing::Length(n))).then_some(true);
                }
                n
            }
            Length::Empty => {
                if !self.is_head {
                    // hyper drops it: the body is empty.
                    return Some(true);
                }
                self.framing = Some(Framing::Length(0));
                return Some(false);
            }
        };
        if self.framing.is_some() {
            return None;
        }
        self.framing = Some(Framing::Length(n));
        field(out, "content-length: ", value);
        self.open = Some(name.clone());
        Some(true)
    }

    fn transfer_encoding(
        &mut self,
        out: &mut Vec<u8>,
        name: &HeaderName,
        value: &HeaderValue,
        joins: bool,
    ) -> Option<()> {
        if self.framing.is_some() && !joins {
            return None;
        }
        if !self.can_chunk {
            return Some(());
        }
        self.framing = Some(Framing::Chunked);
        self.chunked_last = has_last_token(value.as_bytes(), b"chunked");
        if joins {
            out.extend_from_slice(b", ");
            out.extend_from_slice(value.as_bytes());
        } else {
            field(out, "transfer-encoding: ", value);
            self.open = Some(name.clone());
        }
        Some(())
    }

    /// Connection and Trailer: their values joined on one line.
    fn listed(&mut self, out: &mut Vec<u8>, name: &HeaderName, value: &HeaderValue, joins: bool) {
        if *name == header::TRAILER && !self.can_chunk {
            return;
        }
        if *name == header::CONNECTION && has_token(value.as_bytes(), b"close") {
            self.last = true;
        }
        if joins {
            out.extend_from_slice(b", ");
            out.extend_from_slice(value.as_bytes());
        } else {
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            self.open = Some(name.clone());
        }
    }

    /// Closes the open line, writes the framing hyper would add and a
    /// Date where the answer had none, and ends the head.
    fn finish(mut self, out: &mut Vec<u8>) -> Option<(Framing, bool)> {
        if self.open.is_some() {
            close_line(out, &mut self.open, self.chunked_last);
        }
        let framing = match self.framing {
            Some(f) => f,
            None => self.default_framing(out),
        };
        let framing = if self.can_body {
            framing
        } else {
            Framing::Length(0)
        };
        if !self.wrote_date {
            out.extend_from_slice(b"date: ");
            date(out);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"\r\n");
        Some((framing, self.last))
    }

    /// The framing of an answer that named none, and its field.
    fn default_framing(&self, out: &mut Vec<u8>) -> Framing {
        match self.body {
            Length::Unknown if !self.can_chunk => Framing::Close,
            Length::Unknown => {
                out.extend_from_slice(b"transfer-encoding: chunked\r\n");
                Framing::Chunked
            }
            Length::Empty | Length::Known(0) => {
                if self.can_body {
                    out.extend_from_slice(b"content-length: 0\r\n");
                }
                Framing::Length(0)
            }
            Length::Known(n) => {
                if self.can_length {
                    out.extend_from_slice(b"content-length: ");
                    out.extend_from_slice(decimal(n, &mut [0; 20]));
                    out.extend_from_slice(b"\r\n");
                    Framing::Length(n)
                } else {
                    Framing::Length(0)
                }
            }
        }
    }
}

/// Writes a [`Wire`] hit's head into `out`: its entry's head bytes, then
/// the fields each answer has its own values for, `Date` where the entry
/// has none, and `Connection: close` when the connection is not kept
/// alive. Its body (of `Content-Length`'s length) follows it, unless the
/// request was a HEAD.
fn encode_wire(out: &mut Vec<u8>, wire: &Wire, keep_alive: bool) {
    let mut digits = [0u8; 20];
    out.extend_from_slice(wire.head());
    out.extend_from_slice(b"age: ");
    out.extend_from_slice(decimal(wire.age(), &mut digits));
    out.extend_from_slice(b"\r\ncache-status: ");
    out.extend_from_slice(wire.cache_status().as_bytes());
    out.extend_from_slice(b"\r\ncontent-length: ");
    out.extend_from_slice(decimal(wire.body().len() as u64, &mut digits));
    out.extend_from_slice(b"\r\n");
    if let Some(id) = wire.request_id_bytes() {
        out.extend_from_slice(b"x-request-id: ");
        out.extend_from_slice(id);
        out.extend_from_slice(b"\r\n");
    }
    if !wire.dated() {
        out.extend_from_slice(b"date: ");
        date(out);
        out.extend_from_slice(b"\r\n");
    }
    if !keep_alive {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

fn field(out: &mut Vec<u8>, name: &str, value: &HeaderValue) {
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(value.as_bytes());
}

/// Ends an open field's line; a Transfer-Encoding whose last coding is
/// not chunked gets chunked added, as hyper does.
fn close_line(out: &mut Vec<u8>, open: &mut Option<HeaderName>, chunked_last: bool) {
    if open.take() == Some(header::TRANSFER_ENCODING) && !chunked_last {
        out.extend_from_slice(b", chunked");
    }
    out.extend_from_slice(b"\r\n");
}

fn has_last_token(value: &[u8], token: &[u8]) -> bool {
    value
        .rsplit(|&b| b == b',')
        .next()
        .is_some_and(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

fn parse_length(value: &HeaderValue) -> Option<u64> {
    let v = value.as_bytes();
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    v.iter().try_fold(0u64, |n, d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

thread_local! {
    /// The Date value of the current second, formatted once a second.
    static DATE: std::cell::RefCell<(u64, String)> = const { std::cell::RefCell::new((u64::MAX, String::new())) };
}

fn date(out: &mut Vec<u8>) {
    let now = SystemTime::now();
    let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    DATE.with(|d| {
        let mut d = d.borrow_mut();
        if d.0 != secs {
            d.1 = httpdate::fmt_http_date(now);
            d.0 = secs;
        }
        out.extend_from_slice(d.1.as_bytes());
    });
}

/// The Date value of the current second, as this loop writes it, for the
/// answers HTTP/2 frames.
pub fn date_value() -> Option<http::HeaderValue> {
    let mut out = Vec::with_capacity(29);
    date(&mut out);
    http::HeaderValue::from_maybe_shared(Bytes::from(out)).ok()
}

/// Writes the head `head` and the body as `framing` says. An error, or a
/// body that ends short of its length, is an error: the caller closes the
/// connection with nothing more written, so the client sees the answer cut.
async fn write_body<I, B>(io: &mut I, head: &[u8], framing: Framing, body: B) -> io::Result<()>
where
    I: AsyncWrite + Unpin,
    B: HttpBody<Data = Bytes, Error = axum::Error> + Unpin,
{
    let mut remaining = match framing {
        Framing::Length(0) => return write_all(io, &mut [IoSlice::new(head)]).await,
        Framing::Length(n) => n,
        Framing::Chunked | Framing::Close => u64::MAX,
    };
    let mut head = Some(head);
    let mut body = body;
    loop {
        let frame = poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
        let data = match frame {
            None => break,
            Some(Err(e)) => return Err(io::Error::other(e)),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => data,
                // Trailers: this loop never has a client that asked for
                // them (`TE: trailers` goes to hyper).
                Err(_) => continue,
            },
        };
        if data.is_empty() {
            continue;
        }
        let h = head.take().unwrap_or_default();
        match framing {
            Framing::Length(_) => {
                let take = usize::try_from(remaining.min(data.len() as u64)).unwrap_or(0);
                remaining -= take as u64;
                write_all(io, &mut [IoSlice::new(h), IoSlice::new(&data[..take])]).await?;
                if remaining == 0 {
                    return Ok(());
                }
            }
            Framing::Chunked => {
                let mut size = [0u8; 18];
                let line = chunk_line(data.len(), &mut size);
                write_all(
                    io,
                    &mut [
                        IoSlice::new(h),
                        IoSlice::new(line),
                        IoSlice::new(&data),
                        IoSlice::new(b"\r\n"),
                    ],
                )
                .await?;
            }
            Framing::Close => write_all(io, &mut [IoSlice::new(h), IoSlice::new(&data)]).await?,
        }
    }
    let h = head.take().unwrap_or_default();
    match framing {
        Framing::Length(_) => Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the answer's body ended short of its length",
        )),
        Framing::Chunked => write_all(io, &mut [IoSlice::new(h), IoSlice::new(b"0\r\n\r\n")]).await,
        Framing::Close => write_all(io, &mut [IoSlice::new(h)]).await,
    }
}

/// A chunk's size line: hexadecimal, then CRLF.
fn chunk_line(n: usize, buf: &mut [u8; 18]) -> &[u8] {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut i = buf.len() - 2;
    buf[i] = b'\r';
    buf[i + 1] = b'\n';
    let mut n = n;
    loop {
        i -= 1;
        buf[i] = HEX[n & 0xf];
        n >>= 4;
        if n == 0 {
            return &buf[i..];
        }
    }
}

/// Writes every byte of `bufs`, in as few calls as the stream allows.
async fn write_all<I: AsyncWrite + Unpin>(io: &mut I, bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    let mut bufs = bufs;
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        let n = poll_fn(|cx| Pin::new(&mut *io).poll_write_vectored(cx, bufs)).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    use proptest::prelude::*;
    use tokio::io::{AsyncWriteExt, DuplexStream};

    /// An answer made from a description, the same for both servers.
    #[derive(Debug, Clone)]
    struct Canned {
        status: u16,
        fields: Vec<(&'static str, String)>,
        body: Shape,
        /// An origin's own reason phrase, as hyper's client passes it on.
        reason: Option<&'static str>,
    }

    #[derive(Debug, Clone)]
    enum Shape {
        Empty,
        Full(usize),
        /// Chunks of these sizes, of no declared length.
        Stream(Vec<usize>),
    }

    impl Canned {
        fn response(&self) -> Response<Body> {
            let body = match &self.body {
                Shape::Empty => Body::empty(),
                Shape::Full(n) => Body::from(vec![b'f'; *n]),
                Shape::Stream(chunks) => {
                    let chunks: Vec<Result<Bytes, Infallible>> = chunks
                        .iter()
                        .enumerate()
                        .map(|(i, n)| Ok(Bytes::from(vec![b'a' + (i % 26) as u8; *n])))
                        .collect();
                    Body::from_stream(futures_util::stream::iter(chunks))
                }
            };
            let mut res = Response::new(body);
            *res.status_mut() = StatusCode::from_u16(self.status).expect("status");
            if let Some(r) = self.reason {
                res.extensions_mut()
                    .insert(hyper::ext::ReasonPhrase::from_static(r.as_bytes()));
            }
            for (n, v) in &self.fields {
                res.headers_mut()
                    .append(*n, HeaderValue::from_str(v).expect("value"));
            }
            res
        }
    }

    /// The loop's view of a connection that answers `canned` to every request.
    struct Answerer {
        canned: Canned,
        stopping: AtomicBool,
        asked: Arc<AtomicUsize>,
    }

    impl Answers for Arc<Answerer> {
        type Body = Body;

        fn answer(
            &self,
            _req: Request<Body>,
        ) -> impl Future<Output = Response<Body>> + Send + 'static {
            self.asked.fetch_add(1, Ordering::Relaxed);
            let res = self.canned.response();
            async move { res }
        }

        fn stopping(&self) -> &AtomicBool {
            &self.stopping
        }
    }

    /// A connection's view that answers an empty 200 (or `body`) to
    /// every request, told to stop or not.
    fn answerer(body: Shape, stopping: bool) -> Arc<Answerer> {
        Arc::new(Answerer {
            canned: Canned {
                status: 200,
                fields: vec![],
                body,
                reason: None,
            },
            stopping: AtomicBool::new(stopping),
            asked: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// What a client that sends `request` and reads to the end gets back
    /// from `serve` on the other end of a pipe.
    async fn exchange<F, Fut>(request: &[u8], half_close: bool, serve: F) -> Vec<u8>
    where
        F: FnOnce(DuplexStream) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (mut client, server) = tokio::io::duplex(1 << 20);
        let served = tokio::spawn(serve(server));
        client.write_all(request).await.expect("write");
        if half_close {
            client.shutdown().await.expect("shutdown");
        }
        let mut got = Vec::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(5),
            client.read_to_end(&mut got),
        )
        .await
        .expect("the server ends the connection")
        .expect("read");
        let _ = served.await;
        got
    }

    async fn by_hyper(canned: &Canned, request: &[u8]) -> Vec<u8> {
        let canned = canned.clone();
        exchange(request, false, move |io| async move {
            let service = hyper::service::service_fn(move |_req| {
                let res = canned.response();
                async move { Ok::<_, Infallible>(res) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(io), service)
                .await;
        })
        .await
    }

    async fn by_h1(canned: &Canned, request: &[u8], half_close: bool) -> (Vec<u8>, usize) {
        let asked = Arc::new(AtomicUsize::new(0));
        let answerer = Arc::new(Answerer {
            canned: canned.clone(),
            stopping: AtomicBool::new(false),
            asked: Arc::clone(&asked),
        });
        let got = exchange(request, half_close, move |io| async move {
            match serve(io, answerer, 64 * 1024).await {
                Ok(LoopEnd::Closed) | Err(_) => {}
                Ok(LoopEnd::Handoff(_)) => panic!("handed off"),
            }
        })
        .await;
        (got, asked.load(Ordering::Relaxed))
    }

    /// The Date hyper and the loop add hold the second they were written:
    /// set apart so that two runs compare.
    fn undated(raw: &[u8]) -> Vec<u8> {
        let text = String::from_utf8_lossy(raw).into_owned();
        let mut out = String::new();
        for line in text.split_inclusive("\r\n") {
            if line.starts_with("date: ") && line.ends_with(" GMT\r\n") && line.len() == 37 {
                out.push_str("date: -\r\n");
            } else {
                out.push_str(line);
            }
        }
        out.into_bytes()
    }

    fn canned() -> impl Strategy<Value = Canned> {
        let status = prop_oneof![
            Just(200u16),
            Just(203),
            Just(204),
            Just(206),
            Just(301),
            Just(304),
            Just(404),
            Just(500),
            Just(503),
            Just(599),
        ];
        let body = prop_oneof![
            Just(Shape::Empty),
            (0usize..3000).prop_map(Shape::Full),
            proptest::collection::vec(1usize..700, 0..4).prop_map(Shape::Stream),
        ];
        let extra = proptest::collection::vec(
            prop_oneof![
                Just(("cache-control", "max-age=60".to_owned())),
                Just(("x-two", "1".to_owned())),
                Just(("x-two", "2".to_owned())),
                Just(("connection", "close".to_owned())),
                Just(("connection", "keep-alive".to_owned())),
                Just(("trailer", "x-sum".to_owned())),
                Just(("date", "Sun, 06 Nov 1994 08:49:37 GMT".to_owned())),
                // Not `gzip`: hyper then writes `, chunked` after the next
                // joined field too (`connection: close, chunked`), where
                // this loop ends the line; corral's answers never carry a
                // Transfer-Encoding (it is hop-by-hop), and
                // `a_coding_before_chunked_gets_chunked_added` covers it.
                Just(("transfer-encoding", "chunked".to_owned())),
            ],
            0..5,
        );
        let reason = prop_oneof![Just(None), Just(Some("X")), Just(Some("Fine Thanks"))];
        (status, body, extra, any::<bool>(), reason).prop_map(
            |(status, body, fields, with_length, reason)| {
                let mut fields = fields;
                let total = match &body {
                    Shape::Empty => 0,
                    Shape::Full(n) => *n,
                    Shape::Stream(c) => c.iter().sum(),
                };
                let chunked = fields.iter().any(|(n, _)| *n == "transfer-encoding");
                // A length that matches the body, as corral's answers have
                // (hyper asserts it in debug builds); never beside chunked.
                if with_length && !chunked {
                    fields.push(("content-length", total.to_string()));
                }
                Canned {
                    status,
                    fields,
                    body,
                    reason,
                }
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]
        /// The loop writes exactly what hyper's HTTP/1.1 server writes for
        /// the same answer: status line, fields, framing, body and close.
        #[test]
        fn the_loop_writes_what_hyper_writes(canned in canned(), head in any::<bool>(), close in any::<bool>()) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            let method = if head { "HEAD" } else { "GET" };
            // One request, or two pipelined when the first keeps the
            // connection; the last asks to close, so both servers end.
            let one = format!("{method} /k HTTP/1.1\r\nHost: a\r\n\r\n");
            let last = format!("{method} /k HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
            let request = if close { last } else { one + &last };
            let (hyper, (ours, _)) = rt.block_on(async {
                (by_hyper(&canned, request.as_bytes()).await, by_h1(&canned, request.as_bytes(), false).await)
            });
            let ours = String::from_utf8_lossy(&undated(&ours)).into_owned();
            let hyper = String::from_utf8_lossy(&undated(&hyper)).into_owned();
            prop_assert_eq!(ours, hyper, "{:?} to {}", canned, method);
        }
    }

    #[tokio::test]
    async fn a_coding_before_chunked_gets_chunked_added() {
        let canned = Canned {
            status: 200,
            fields: vec![("transfer-encoding", "gzip".to_owned())],
            body: Shape::Stream(vec![3]),
            reason: None,
        };
        let (got, _) = by_h1(
            &canned,
            b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n",
            false,
        )
        .await;
        assert_eq!(
            String::from_utf8_lossy(&undated(&got)),
            "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\nconnection: close\r\ndate: -\r\n\r\n3\r\naaa\r\n0\r\n\r\n"
        );
    }

    #[tokio::test]
    async fn pipelined_requests_are_answered_in_order_and_a_post_goes_to_hyper_with_its_bytes() {
        let answerer = answerer(Shape::Full(3), false);
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let post = b"POST /p HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello";
        let mut sent =
            b"GET /1 HTTP/1.1\r\nHost: a\r\n\r\nHEAD /2 HTTP/1.1\r\nHost: a\r\n\r\n".to_vec();
        sent.extend_from_slice(post);
        client.write_all(&sent).await.expect("write");
        let ended = serve(server, Arc::clone(&answerer), 64 * 1024)
            .await
            .expect("served");
        let LoopEnd::Handoff(mut rest) = ended else {
            panic!("the POST is hyper's");
        };
        assert_eq!(answerer.asked.load(Ordering::Relaxed), 2);
        let mut handed = vec![0; post.len()];
        rest.read_exact(&mut handed).await.expect("read");
        assert_eq!(handed, post, "hyper reads the POST from its first byte");
        drop(rest);
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.expect("read");
        let got = String::from_utf8_lossy(&undated(&got)).into_owned();
        assert_eq!(
            got,
            "HTTP/1.1 200 OK\r\ncontent-length: 3\r\ndate: -\r\n\r\nfff\
             HTTP/1.1 200 OK\r\ncontent-length: 3\r\ndate: -\r\n\r\n"
        );
    }

    #[tokio::test]
    async fn a_client_gone_before_its_answer_abandons_it_and_a_stop_ends_an_idle_connection() {
        // A head cut short, then the client closes: nothing asked, nothing
        // written.
        let (got, asked) = by_h1(
            &Canned {
                status: 200,
                fields: vec![],
                body: Shape::Empty,
                reason: None,
            },
            b"GET / HTTP/1.1\r\nHost:",
            true,
        )
        .await;
        assert_eq!((got.len(), asked), (0, 0));
        // Told to stop while waiting for a head: closed.
        let answerer = answerer(Shape::Empty, true);
        let (mut client, server) = tokio::io::duplex(1 << 16);
        // Even with a whole request waiting: none more is begun.
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
            .await
            .expect("write");
        let asked = Arc::clone(&answerer.asked);
        assert!(matches!(
            serve(server, answerer, 1024).await,
            Ok(LoopEnd::Closed)
        ));
        assert_eq!(asked.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn a_head_past_the_buffer_goes_to_hyper_whole() {
        let answerer = answerer(Shape::Empty, false);
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let mut sent = b"GET / HTTP/1.1\r\nX-Long: ".to_vec();
        sent.extend(std::iter::repeat_n(b'v', 4000));
        client.write_all(&sent).await.expect("write");
        let Ok(LoopEnd::Handoff(mut rest)) = serve(server, answerer, 2048).await else {
            panic!("handed to hyper");
        };
        let mut handed = vec![0; sent.len()];
        rest.read_exact(&mut handed).await.expect("read");
        assert_eq!(handed, sent, "every byte read goes to hyper, in order");
    }

    /// A head's status line and its fields, sorted, names lowercased;
    /// `Date`'s value blanked where the encoder wrote its own (it may be
    /// a second apart between two writes).
    fn fields_of(raw: &[u8], own_date: bool) -> (String, Vec<(String, String)>) {
        let text = String::from_utf8_lossy(raw);
        let (head, _) = text.split_once("\r\n\r\n").expect("a whole head");
        let mut lines = head.split("\r\n");
        let status = lines.next().unwrap_or_default().to_owned();
        let mut fields: Vec<(String, String)> = lines
            .map(|l| {
                let (n, v) = l.split_once(": ").expect("name: value");
                let n = n.to_ascii_lowercase();
                let v = if own_date && n == "date" {
                    String::new()
                } else {
                    v.to_owned()
                };
                (n, v)
            })
            .collect();
        fields.sort();
        (status, fields)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]
        /// A hit written from its entry's head bytes has the status line
        /// and exactly the fields (each value, each repetition) that the
        /// field-by-field encoder writes for the same answer made as a
        /// response, and the same framing; a head the bytes cannot carry
        /// is never written from them.
        #[test]
        fn a_wire_hit_writes_what_the_head_encoder_writes(
            status in prop_oneof![
                Just(200u16), Just(203), Just(204), Just(206), Just(301), Just(304),
                Just(404), Just(410), Just(500), Just(599),
            ],
            fields in proptest::collection::vec(
                prop_oneof![
                    Just(("cache-control", "max-age=60")),
                    Just(("x-two", "1")),
                    Just(("x-two", "2")),
                    Just(("etag", "\"v1\"")),
                    Just(("date", "Sun, 06 Nov 1994 08:49:37 GMT")),
                    Just(("age", "7")),
                    Just(("cache-status", "upstream; hit")),
                    Just(("via", "1.1 upstream")),
                    Just(("content-length", "999")),
                    Just(("connection", "close")),
                    Just(("trailer", "x-sum")),
                ],
                0..6,
            ),
            len in prop_oneof![Just(0usize), 1usize..3000],
            age in prop_oneof![0u64..100, 9_990u64..10_010, Just(40_000_000)],
            keep_alive in any::<bool>(),
        ) {
            let mut headers = http::HeaderMap::new();
            for (n, v) in &fields {
                headers.append(*n, HeaderValue::from_static(v));
            }
            let now = SystemTime::now();
            let freshness = corral_core::Freshness {
                ttl: std::time::Duration::from_secs(60),
                swr: std::time::Duration::ZERO,
                sie: std::time::Duration::ZERO,
                sharing: corral_core::Sharing::Everyone,
            };
            let status = StatusCode::from_u16(status).expect("status");
            let entry = corral_core::StoredResponse::builder(
                status,
                headers,
                Bytes::from(vec![b'b'; len]),
                &freshness,
                now - std::time::Duration::from_secs(age),
            )
            .build();
            let bodyless = matches!(status, StatusCode::NO_CONTENT | StatusCode::NOT_MODIFIED);
            let framed = fields.iter().any(|(n, _)| *n == "connection" || *n == "trailer");
            let answer = crate::cache::respond::hit(
                Arc::new(entry),
                &corral_core::CacheStatus::hit(60),
                now,
                false,
                &http::HeaderMap::new(),
                true,
            );
            let Some(wire) = answer.wire else {
                prop_assert!(bodyless || framed, "{status} {fields:?}: not written from its bytes");
                return Ok(());
            };
            prop_assert!(!bodyless && !framed, "{status} {fields:?}: written from its bytes");
            let own_date = !wire.dated();
            let mut by_wire = Vec::new();
            encode_wire(&mut by_wire, &wire, keep_alive);
            prop_assert!(by_wire.ends_with(b"\r\n\r\n"));
            let (mut parts, body) = wire.into_response().into_parts();
            let mut by_map = Vec::new();
            let (framing, last) =
                encode_head(&mut by_map, false, keep_alive, &mut parts, length_of(&body))
                    .expect("framed");
            prop_assert_eq!(framing, Framing::Length(len as u64));
            prop_assert_eq!(last, !keep_alive);
            let (wire_status, wire_fields) = fields_of(&by_wire, own_date);
            let (map_status, map_fields) = fields_of(&by_map, own_date);
            prop_assert_eq!(&wire_status, &map_status);
            prop_assert_eq!(&wire_fields, &map_fields);
            // The origin's Age (7 where it sent one) plus the time stored.
            let origin_age = if fields.iter().any(|(n, _)| *n == "age") { 7 } else { 0 };
            let age_line = ("age".to_owned(), (origin_age + age).to_string());
            prop_assert!(wire_fields.contains(&age_line), "{:?}", wire_fields);
            prop_assert_eq!(
                wire_fields.iter().filter(|(n, _)| n == "content-length").count(),
                1
            );
        }
    }
}
