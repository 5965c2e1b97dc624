//! A body being fetched, read by every caller of its flight while it
//! grows: the fill appends the origin's chunks, each reader walks them at
//! its own pace (a slow one never holds the fill or the others back), and
//! the chunks are shared, not copied per reader.
//!
//! An end is always explicit. The fill says `finish` once the whole
//! declared length arrived; anything else (an origin that fails mid-body,
//! a fill that is dropped) is an abort, which every reader sees as an
//! error, never as a clean end: hyper then cuts an HTTP/1.1 answer short of
//! its Content-Length and resets an h2 stream, so a truncated answer never
//! looks complete.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use tokio::sync::watch;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Open,
    Complete,
    Aborted,
}

/// The shared body.
pub struct Growing {
    len: u64,
    chunks: Mutex<Vec<Bytes>>,
    /// Chunks appended so far, and how it ended.
    progress: watch::Sender<(usize, End)>,
}

impl std::fmt::Debug for Growing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Growing")
            .field("len", &self.len)
            .field("progress", &*self.progress.borrow())
            .finish()
    }
}

impl Growing {
    /// A body that will hold exactly `len` bytes.
    pub fn new(len: u64) -> Arc<Self> {
        Arc::new(Growing {
            len,
            chunks: Mutex::new(Vec::new()),
            progress: watch::channel((0, End::Open)).0,
        })
    }

    /// The declared length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Appends a chunk for every reader.
    pub fn push(&self, chunk: Bytes) {
        if chunk.is_empty() {
            return;
        }
        let n = {
            let mut chunks = self.chunks.lock().unwrap_or_else(PoisonError::into_inner);
            chunks.push(chunk);
            chunks.len()
        };
        self.progress.send_modify(|p| p.0 = n);
    }

    /// The body will not arrive whole: every reader fails.
    pub fn abort(&self) {
        self.progress.send_modify(|p| {
            if p.1 == End::Open {
                p.1 = End::Aborted;
            }
        });
    }

    /// A reader from the first byte.
    pub fn reader(self: &Arc<Self>) -> Reader {
        Reader {
            body: Arc::clone(self),
            next: 0,
            sent: 0,
            progress: Watch::Idle(self.progress.subscribe()),
        }
    }

    fn chunk(&self, i: usize) -> Option<Bytes> {
        self.chunks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(i)
            .cloned()
    }
}

/// The fill's end of a growing body: aborts it if the fill goes away
/// without finishing (an origin error, a panic, a cancelled task).
pub struct Writer(Arc<Growing>);

impl Writer {
    pub fn new(body: &Arc<Growing>) -> Self {
        Writer(Arc::clone(body))
    }

    /// The whole body arrived and is `whole` (the stored entry's bytes):
    /// the chunks readers have yet to read become slices of it, so only
    /// one copy stays in memory; what was held back (the last chunk, so
    /// that no reader has every byte before the entry is stored) is added,
    /// and the readers end cleanly.
    pub fn finish(self, whole: &Bytes) {
        let n = {
            let mut chunks = self.0.chunks.lock().unwrap_or_else(PoisonError::into_inner);
            let mut at = 0;
            for c in chunks.iter_mut() {
                let len = c.len();
                if at + len <= whole.len() {
                    *c = whole.slice(at..at + len);
                }
                at += len;
            }
            if at < whole.len() {
                chunks.push(whole.slice(at..));
            }
            chunks.len()
        };
        self.0.progress.send_modify(|p| {
            p.0 = n;
            if p.1 == End::Open {
                p.1 = End::Complete;
            }
        });
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One caller's read of a growing body, as an HTTP body of the declared
/// length.
pub struct Reader {
    body: Arc<Growing>,
    next: usize,
    sent: u64,
    progress: Watch,
}

type Changed = (
    watch::Receiver<(usize, End)>,
    Result<(), watch::error::RecvError>,
);

/// The reader's view of the progress: the receiver, or (while waiting for
/// the next chunk) the one future that waits with it, kept across polls so
/// that its wake-up is not lost.
enum Watch {
    Idle(watch::Receiver<(usize, End)>),
    Waiting(Pin<Box<dyn Future<Output = Changed> + Send + Sync>>),
    Gone,
}

/// Why a reader's body failed.
#[derive(Debug)]
pub struct Aborted;

impl std::fmt::Display for Aborted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the origin's answer broke off before its end")
    }
}

impl std::error::Error for Aborted {}

impl http_body::Body for Reader {
    type Data = Bytes;
    type Error = Aborted;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Aborted>>> {
        let this = self.get_mut();
        loop {
            let mut rx = match std::mem::replace(&mut this.progress, Watch::Gone) {
                Watch::Idle(rx) => rx,
                Watch::Waiting(mut wait) => match wait.as_mut().poll(cx) {
                    Poll::Pending => {
                        this.progress = Watch::Waiting(wait);
                        return Poll::Pending;
                    }
                    // The writer side is gone without an end: an abort.
                    Poll::Ready((_, Err(_))) => return Poll::Ready(Some(Err(Aborted))),
                    Poll::Ready((rx, Ok(()))) => rx,
                },
                Watch::Gone => return Poll::Ready(Some(Err(Aborted))),
            };
            let (available, end) = *rx.borrow_and_update();
            if this.next < available {
                this.progress = Watch::Idle(rx);
                let Some(chunk) = this.body.chunk(this.next) else {
                    return Poll::Ready(Some(Err(Aborted)));
                };
                this.next += 1;
                this.sent += chunk.len() as u64;
                return Poll::Ready(Some(Ok(Frame::data(chunk))));
            }
            match end {
                End::Complete if this.sent == this.body.len => {
                    this.progress = Watch::Idle(rx);
                    return Poll::Ready(None);
                }
                End::Complete | End::Aborted => return Poll::Ready(Some(Err(Aborted))),
                End::Open => {}
            }
            // Wait for the next chunk or the end.
            this.progress = Watch::Waiting(Box::pin(async move {
                let changed = rx.changed().await;
                (rx, changed)
            }));
        }
    }

    fn is_end_stream(&self) -> bool {
        self.sent == self.body.len
            && matches!(&self.progress, Watch::Idle(rx) if rx.borrow().1 == End::Complete)
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.body.len - self.sent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn every_reader_gets_every_byte_at_its_own_pace() {
        let g = Growing::new(6);
        let early = g.reader();
        g.push(Bytes::from_static(b"abc"));
        let late = g.reader();
        let fill = {
            let w = Writer::new(&g);
            let g = Arc::clone(&g);
            tokio::spawn(async move {
                tokio::task::yield_now().await;
                g.push(Bytes::from_static(b"def"));
                w.finish(&Bytes::from_static(b"abcdef"));
            })
        };
        let a = early.collect().await.expect("whole").to_bytes();
        let b = late.collect().await.expect("whole").to_bytes();
        fill.await.expect("fill");
        assert_eq!((&a[..], &b[..]), (&b"abcdef"[..], &b"abcdef"[..]));
        // A reader that starts after the end still reads it all.
        assert_eq!(
            &g.reader().collect().await.expect("whole").to_bytes()[..],
            b"abcdef"
        );
    }

    #[tokio::test]
    async fn the_last_bytes_come_with_the_finish() {
        let g = Growing::new(6);
        let r = g.reader();
        g.push(Bytes::from_static(b"abc"));
        let w = Writer::new(&g);
        let read = tokio::spawn(async move { r.collect().await.map(|b| b.to_bytes()) });
        tokio::task::yield_now().await;
        assert!(
            !read.is_finished(),
            "a reader has every byte only after finish"
        );
        w.finish(&Bytes::from_static(b"abcdef"));
        let got = read.await.expect("task").expect("whole");
        assert_eq!(&got[..], b"abcdef");
    }

    #[tokio::test]
    async fn an_abort_is_an_error_for_every_reader_never_a_clean_end() {
        let g = Growing::new(6);
        let r = g.reader();
        g.push(Bytes::from_static(b"abc"));
        drop(Writer::new(&g));
        assert!(r.collect().await.is_err());
        // Finished with fewer bytes than declared is no clean end either.
        let g = Growing::new(6);
        let r = g.reader();
        g.push(Bytes::from_static(b"abc"));
        Writer::new(&g).finish(&Bytes::from_static(b"abc"));
        assert!(r.collect().await.is_err());
    }
}
