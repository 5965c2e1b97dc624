//! The client connection as hyper sees it: a TCP stream whose writes send
//! any part of a sealed cached body (`corral_core::sealed`) with
//! sendfile(2), so a large hit is not copied from memory into the socket.
//! The bytes on the wire are exactly the ones hyper asked to write; only
//! the way they reach the kernel changes. It must never reorder, drop or
//! duplicate a byte, and it reports short writes as short.

use std::io::{self, IoSlice};
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;

#[cfg(target_os = "linux")]
const MSG_MORE: libc::c_int = libc::MSG_MORE;
#[cfg(not(target_os = "linux"))]
const MSG_MORE: libc::c_int = 0;

/// Who hears how the client takes its writes: the connection's watchdog.
pub trait Writes {
    /// A write could not complete: the client is not reading.
    fn write_blocked(&self);
    /// A write of `n` bytes went through.
    fn write_done(&self, n: usize);
}

/// A client TCP connection that sends sealed bodies with sendfile, and
/// tells its connection's watchdog (`W`) when a write has to wait for the
/// client.
#[derive(Debug)]
pub struct ClientStream<W> {
    tcp: TcpStream,
    activity: Arc<W>,
}

impl<W: Writes> ClientStream<W> {
    pub fn new(tcp: TcpStream, activity: Arc<W>) -> Self {
        ClientStream { tcp, activity }
    }

    /// Records whether a write went through or has to wait.
    fn track(&self, poll: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        match &poll {
            Poll::Pending => self.activity.write_blocked(),
            Poll::Ready(Ok(n)) => self.activity.write_done(*n),
            Poll::Ready(Err(_)) => self.activity.write_done(0),
        }
        poll
    }

    /// Writes `bufs` with MSG_MORE: more follows at once, so the kernel
    /// holds a short head back for the body instead of sending it alone.
    fn poll_write_more(
        &self,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let sock = socket2::SockRef::from(&self.tcp);
        self.poll_send(cx, || sock.send_vectored_with_flags(bufs, MSG_MORE))
    }

    /// Sends `data`, which is sealed, with sendfile once the socket is
    /// writable.
    fn poll_send_sealed(&self, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_send(cx, || {
            // The caller found `data` sealed and holds it, so it stays
            // sealed; were it not, failing the connection beats sending
            // something else.
            crate::sealed::send(self.tcp.as_fd(), data)
                .unwrap_or_else(|| Err(io::Error::other("body no longer sealed")))
        })
    }

    /// Runs the non-blocking `send` once the socket is writable, again
    /// whenever it was not ready after all or a signal cut it short.
    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        mut send: impl FnMut() -> io::Result<usize>,
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.tcp.poll_write_ready(cx))?;
            match self.tcp.try_io(Interest::WRITABLE, &mut send) {
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) =>
                {
                    continue;
                }
                other => return Poll::Ready(other),
            }
        }
    }
}

impl<W: Writes> AsyncRead for ClientStream<W> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_read(cx, buf)
    }
}

impl<W: Writes> AsyncWrite for ClientStream<W> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = if crate::sealed::is_sealed(buf) {
            this.poll_send_sealed(cx, buf)
        } else {
            Pin::new(&mut this.tcp).poll_write(cx, buf)
        };
        this.track(poll)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = match bufs.iter().position(|b| crate::sealed::is_sealed(b)) {
            // Nothing sealed: one writev, as before.
            None => Pin::new(&mut this.tcp).poll_write_vectored(cx, bufs),
            // A sealed body first: sendfile it. The caller comes back for
            // whatever follows.
            Some(0) => this.poll_send_sealed(cx, &bufs[0]),
            // The response head (and anything else) before the body: write
            // that much now, held back by MSG_MORE so it leaves in one
            // segment with the start of the body; the body goes with
            // sendfile on the next call. A short count is allowed by the
            // contract and hyper expects it.
            Some(k) if bufs[..k].iter().any(|b| !b.is_empty()) => {
                this.poll_write_more(cx, &bufs[..k])
            }
            // Only empty slices before it: nothing to hold back.
            Some(k) => this.poll_send_sealed(cx, &bufs[k]),
        };
        this.track(poll)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

/// A stream whose reads give `prefix` first: bytes already read off it
/// for someone else to read (past a PROXY protocol header, or what `h1`
/// read and did not answer, for hyper). Writes go straight through,
/// vectored ones included (sealed bodies go with sendfile).
#[derive(Debug)]
pub struct Rewind<I> {
    prefix: Bytes,
    inner: I,
}

impl<I> Rewind<I> {
    pub fn new(prefix: Bytes, inner: I) -> Self {
        Rewind { prefix, inner }
    }
}

impl<I: AsyncRead + Unpin> Rewind<I> {
    /// Reads until the bytes read so far start with `want`, or cannot
    /// (a byte differs, or the stream ended): whether they do. What was
    /// read stays to be read.
    pub fn poll_starts_with(
        &mut self,
        cx: &mut Context<'_>,
        want: &[u8],
    ) -> Poll<io::Result<bool>> {
        loop {
            let n = self.prefix.len().min(want.len());
            if self.prefix[..n] != want[..n] {
                return Poll::Ready(Ok(false));
            }
            if n == want.len() {
                return Poll::Ready(Ok(true));
            }
            let mut more = [0u8; 64];
            let mut buf = ReadBuf::new(&mut more);
            ready!(Pin::new(&mut self.inner).poll_read(cx, &mut buf))?;
            if buf.filled().is_empty() {
                return Poll::Ready(Ok(false));
            }
            let mut joined = Vec::with_capacity(self.prefix.len() + buf.filled().len());
            joined.extend_from_slice(&self.prefix);
            joined.extend_from_slice(buf.filled());
            self.prefix = Bytes::from(joined);
        }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Rewind<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.prefix.is_empty() {
            let n = this.prefix.len().min(buf.remaining());
            buf.put_slice(&this.prefix.split_to(n));
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Rewind<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}
