//! A body being fetched, read by every caller of its flight while it
//! grows: the fill appends the origin's chunks, each reader walks them at
//! its own pace (a slow one never holds the fill or the others back), and
//! the chunks are shared, not copied per reader.
//!
//! An end is always explicit. The fill says `finish` once the whole body
//! arrived (its declared length, or the end of a body without one);
//! anything else (an origin that fails mid-body, a fill that is dropped)
//! is an abort, which every reader sees as an error, never as a clean end:
//! hyper then cuts an HTTP/1.1 answer short of its Content-Length (or of
//! its last chunk) and resets an h2 stream, so a truncated answer never
//! looks complete.
//!
//! A body without a declared length may outgrow what can be stored. It is
//! then passed through ([`SharedBody::pass_through`]): the readers already
//! reading get every byte, the chunks every one of them has passed are
//! released, the fill reads on only while what is held is within the
//! bound ([`SharedBody::room`]), a reader that holds the others back past
//! its patience is cut off (its answer fails, the others go on), and no
//! reader can start any more once a chunk was released.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
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
pub struct SharedBody {
    /// The declared length, if there was one.
    len: Option<u64>,
    state: Mutex<State>,
    /// Chunks appended so far, and how it ended.
    progress: watch::Sender<(usize, End)>,
    /// A reader moved on or left: room may have been made.
    advanced: tokio::sync::Notify,
}

/// The chunks still held, and who reads them.
struct State {
    chunks: VecDeque<Bytes>,
    /// How many chunks were released before `chunks[0]`.
    base: usize,
    /// Bytes in `chunks`.
    held: u64,
    /// Set by [`SharedBody::pass_through`]: the most bytes held for the
    /// readers while the body passes through.
    passing: Option<u64>,
    /// Each reader's next chunk, by reader.
    readers: HashMap<u64, usize>,
    next_reader: u64,
    /// A reader came (or none would): until then nothing is released,
    /// since the first readers (the flight's leader, its waiters) attach
    /// a moment after the head.
    attached: bool,
}

impl State {
    /// Once passing through, releases the chunks every reader has passed.
    fn release(&mut self) {
        if self.passing.is_none() || !self.attached {
            return;
        }
        let end = self.base + self.chunks.len();
        let slowest = self.readers.values().copied().min().unwrap_or(end);
        while self.base < slowest {
            let Some(c) = self.chunks.pop_front() else {
                break;
            };
            self.held -= c.len() as u64;
            self.base += 1;
        }
    }

    /// True while more than the pass-through bound is held.
    fn over(&self) -> bool {
        self.passing.is_some_and(|bound| self.held > bound)
    }
}

impl std::fmt::Debug for SharedBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBody")
            .field("len", &self.len)
            .field("progress", &*self.progress.borrow())
            .finish()
    }
}

impl SharedBody {
    /// A body that will hold exactly `len` bytes, or, with `None`, as
    /// many as arrive before the fill finishes it.
    pub fn new(len: Option<u64>) -> Arc<Self> {
        Arc::new(SharedBody {
            len,
            state: Mutex::new(State {
                chunks: VecDeque::new(),
                base: 0,
                held: 0,
                passing: None,
                readers: HashMap::new(),
                next_reader: 0,
                attached: false,
            }),
            progress: watch::channel((0, End::Open)).0,
            advanced: tokio::sync::Notify::new(),
        })
    }

    /// The declared length.
    pub fn len(&self) -> Option<u64> {
        self.len
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Appends a chunk for every reader.
    pub fn push(&self, chunk: Bytes) {
        if chunk.is_empty() {
            return;
        }
        let n = {
            let mut state = self.state();
            state.held += chunk.len() as u64;
            state.chunks.push_back(chunk);
            state.release();
            state.base + state.chunks.len()
        };
        self.progress.send_modify(|p| p.0 = n);
    }

    /// The body will not be stored: from now on it is held for its
    /// readers only, at most `bound` bytes of it (see the module's notes).
    pub fn pass_through(&self, bound: u64) {
        let mut state = self.state();
        state.passing = Some(bound);
        state.release();
    }

    /// Waits, while passing through, until what is held is within the
    /// bound: as the readers move on. A reader that has not let it get
    /// there within `patience` is cut off, the slowest first.
    pub async fn room(&self, patience: std::time::Duration) -> usize {
        let mut cut = 0;
        loop {
            let advanced = self.advanced.notified();
            tokio::pin!(advanced);
            // Registered before the check: a reader's notice in between
            // is not lost.
            advanced.as_mut().enable();
            if !self.state().over() {
                return cut;
            }
            if tokio::time::timeout(patience, advanced).await.is_err() && self.cut_slowest() {
                cut += 1;
            }
        }
    }

    /// Cuts off the reader furthest behind (its answer fails); false when
    /// there is none: then nobody reads what is held, and it goes.
    fn cut_slowest(&self) -> bool {
        let mut state = self.state();
        let slowest = state
            .readers
            .iter()
            .min_by_key(|(_, next)| **next)
            .map(|(id, _)| *id);
        let Some(id) = slowest else {
            state.attached = true;
            state.release();
            return false;
        };
        state.readers.remove(&id);
        state.release();
        true
    }

    /// Bytes held now.
    #[cfg(test)]
    fn held(&self) -> u64 {
        self.state().held
    }

    /// True while a reader starting now would read it from its first
    /// byte: nothing was released and it did not fail.
    pub fn joinable(&self) -> bool {
        self.state().base == 0 && self.progress.borrow().1 != End::Aborted
    }

    /// The body will not arrive whole: every reader fails.
    pub fn abort(&self) {
        self.progress.send_modify(|p| {
            if p.1 == End::Open {
                p.1 = End::Aborted;
            }
        });
    }

    /// A reader from the first byte; one that fails at once when the
    /// first bytes were released already.
    pub fn reader(self: &Arc<Self>) -> Reader {
        let id = {
            let mut state = self.state();
            let id = state.next_reader;
            state.next_reader += 1;
            if state.base == 0 {
                state.readers.insert(id, 0);
                state.attached = true;
            }
            id
        };
        Reader {
            body: Arc::clone(self),
            id,
            next: 0,
            sent: 0,
            progress: Watch::Idle(self.progress.subscribe()),
        }
    }

    /// Reader `id`'s chunk `i`; `None` when it was cut off or the chunk
    /// is gone.
    fn chunk(&self, id: u64, i: usize) -> Option<Bytes> {
        let mut state = self.state();
        let next = state.readers.get_mut(&id)?;
        *next = i + 1;
        let c = state.chunks.get(i.checked_sub(state.base)?).cloned();
        if state.passing.is_some() {
            state.release();
            self.advanced.notify_one();
        }
        c
    }

    fn leave(&self, id: u64) {
        let mut state = self.state();
        if state.readers.remove(&id).is_some() && state.passing.is_some() {
            state.release();
            self.advanced.notify_one();
        }
    }
}

/// The fill's end of a growing body: aborts it if the fill goes away
/// without finishing (an origin error, a panic, a cancelled task).
pub struct Writer(Arc<SharedBody>);

impl Writer {
    pub fn new(body: &Arc<SharedBody>) -> Self {
        Writer(Arc::clone(body))
    }

    /// The whole body arrived and is `whole` (the stored entry's bytes):
    /// the chunks readers have yet to read become slices of it, so only
    /// one copy stays in memory; what was held back (the last chunk, so
    /// that no reader has every byte before the entry is stored) is added,
    /// and the readers end cleanly.
    pub fn finish(self, whole: &Bytes) {
        let n = {
            let mut state = self.0.state();
            let mut at = 0;
            for c in &mut state.chunks {
                let len = c.len();
                if at + len <= whole.len() {
                    *c = whole.slice(at..at + len);
                }
                at += len;
            }
            if at < whole.len() {
                let rest = whole.slice(at..);
                state.held += rest.len() as u64;
                state.chunks.push_back(rest);
            }
            state.base + state.chunks.len()
        };
        self.end(n);
    }

    /// A body passed through ended: every chunk was pushed already.
    pub fn passed(self) {
        let n = {
            let state = self.0.state();
            state.base + state.chunks.len()
        };
        self.end(n);
    }

    fn end(self, n: usize) {
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
/// length (or, without one, of what arrives).
pub struct Reader {
    body: Arc<SharedBody>,
    id: u64,
    next: usize,
    sent: u64,
    progress: Watch,
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.body.leave(self.id);
    }
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

impl Reader {
    /// True once every byte was read and the body is complete.
    fn done(&self, available: usize) -> bool {
        match self.body.len {
            Some(len) => self.sent == len,
            None => self.next == available,
        }
    }
}

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
            if end == End::Aborted {
                return Poll::Ready(Some(Err(Aborted)));
            }
            if this.next < available {
                this.progress = Watch::Idle(rx);
                let Some(chunk) = this.body.chunk(this.id, this.next) else {
                    return Poll::Ready(Some(Err(Aborted)));
                };
                this.next += 1;
                this.sent += chunk.len() as u64;
                return Poll::Ready(Some(Ok(Frame::data(chunk))));
            }
            match end {
                End::Complete if this.done(available) => {
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
        matches!(&self.progress, Watch::Idle(rx) if {
            let (available, end) = *rx.borrow();
            end == End::Complete && self.next == available && self.done(available)
        })
    }

    fn size_hint(&self) -> SizeHint {
        match self.body.len {
            Some(len) => SizeHint::with_exact(len - self.sent),
            None => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn every_reader_gets_every_byte_at_its_own_pace() {
        let g = SharedBody::new(Some(6));
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
        let g = SharedBody::new(Some(6));
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
        let g = SharedBody::new(Some(6));
        let r = g.reader();
        g.push(Bytes::from_static(b"abc"));
        drop(Writer::new(&g));
        assert!(r.collect().await.is_err());
        // Finished with fewer bytes than declared is no clean end either.
        let g = SharedBody::new(Some(6));
        let r = g.reader();
        g.push(Bytes::from_static(b"abc"));
        Writer::new(&g).finish(&Bytes::from_static(b"abc"));
        assert!(r.collect().await.is_err());
    }
}

#[cfg(test)]
mod without_a_length {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn a_body_without_a_length_ends_at_its_finish() {
        let g = SharedBody::new(None);
        let r = g.reader();
        assert_eq!(http_body::Body::size_hint(&r).exact(), None);
        g.push(Bytes::from_static(b"ab"));
        Writer::new(&g).finish(&Bytes::from_static(b"abcd"));
        let got = r.collect().await.expect("whole").to_bytes();
        assert_eq!(&got[..], b"abcd");
        // Dropped before its finish: an error, never a clean end.
        let g = SharedBody::new(None);
        let r = g.reader();
        g.push(Bytes::from_static(b"ab"));
        drop(Writer::new(&g));
        assert!(r.collect().await.is_err());
    }

    /// Passed through: every reader gets every byte, what all of them
    /// passed is released, and no reader can start once something was.
    #[tokio::test]
    async fn passing_through_releases_what_every_reader_passed() {
        let g = SharedBody::new(None);
        let w = Writer::new(&g);
        let mut a = g.reader();
        let mut b = g.reader();
        g.pass_through(1024);
        g.push(Bytes::from_static(b"one"));
        g.push(Bytes::from_static(b"two"));
        assert_eq!(g.held(), 6);
        let frame = |f: Option<Result<Frame<Bytes>, Aborted>>| {
            f.expect("a frame")
                .expect("data")
                .into_data()
                .expect("data")
        };
        assert_eq!(&frame(a.frame().await)[..], b"one");
        assert_eq!(g.held(), 6, "b has not read `one`");
        assert!(g.joinable());
        assert_eq!(&frame(b.frame().await)[..], b"one");
        assert_eq!(g.held(), 3, "both passed `one`: released");
        assert!(!g.joinable());
        assert!(g.reader().collect().await.is_err(), "too late to start");
        g.push(Bytes::from_static(b"three"));
        w.passed();
        let rest_a = a.collect().await.expect("whole").to_bytes();
        let rest_b = b.collect().await.expect("whole").to_bytes();
        assert_eq!(
            (&rest_a[..], &rest_b[..]),
            (&b"twothree"[..], &b"twothree"[..])
        );
        assert_eq!(g.held(), 0, "read by everyone, and they are gone");
    }

    /// While more than the bound is held the fill waits for the readers;
    /// one that holds the others back past its patience is cut off (its
    /// answer fails), and the others read on.
    #[tokio::test(start_paused = true)]
    async fn a_reader_that_holds_the_others_back_is_cut_off() {
        let g = SharedBody::new(None);
        let w = Writer::new(&g);
        let slow = g.reader();
        let mut fast = g.reader();
        g.pass_through(8);
        let patience = std::time::Duration::from_secs(2);
        let mut got = Vec::new();
        for chunk in [&b"abcd"[..], b"efgh", b"ijkl", b"mnop"] {
            g.room(patience).await;
            assert!(g.held() <= 8, "held {}", g.held());
            g.push(Bytes::from_static(chunk));
            let f = fast.frame().await.expect("a frame").expect("data");
            got.extend_from_slice(&f.into_data().expect("data"));
        }
        w.passed();
        assert!(fast.frame().await.is_none(), "a clean end");
        assert_eq!(&got[..], b"abcdefghijklmnop");
        assert!(slow.collect().await.is_err(), "cut off, never a clean end");
    }

    /// A reader that keeps up is never cut off: the fill waits for it.
    #[tokio::test(start_paused = true)]
    async fn a_reader_that_moves_on_is_waited_for() {
        let g = SharedBody::new(None);
        let w = Writer::new(&g);
        let reader = g.reader();
        g.pass_through(4);
        let reading = tokio::spawn(async move {
            let mut r = reader;
            let mut got = Vec::new();
            while let Some(f) = r.frame().await {
                got.extend_from_slice(&f.expect("data").into_data().expect("data"));
                // Slower than the fill, within its patience.
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
            got
        });
        for chunk in [&b"abcd"[..], b"efgh", b"ijkl"] {
            g.room(std::time::Duration::from_secs(2)).await;
            g.push(Bytes::from_static(chunk));
        }
        g.room(std::time::Duration::from_secs(2)).await;
        w.passed();
        assert_eq!(&reading.await.expect("task")[..], b"abcdefghijkl");
    }
}

#[cfg(test)]
mod before_the_first_reader {
    use super::*;
    use http_body_util::BodyExt;

    /// The first readers attach a moment after the head: what passes
    /// through before them is kept for them, not released as unread.
    #[tokio::test(start_paused = true)]
    async fn nothing_is_released_before_a_reader_came() {
        let g = SharedBody::new(None);
        let w = Writer::new(&g);
        g.pass_through(0);
        g.push(Bytes::from_static(b"early"));
        assert!(g.joinable());
        let r = g.reader();
        let reading = tokio::spawn(async move { r.collect().await.map(|b| b.to_bytes()) });
        g.room(std::time::Duration::from_secs(2)).await;
        g.push(Bytes::from_static(b"late"));
        w.passed();
        let got = reading.await.expect("task").expect("whole");
        assert_eq!(&got[..], b"earlylate");
    }

    /// When nobody comes within the patience, what is held goes.
    #[tokio::test(start_paused = true)]
    async fn what_nobody_comes_for_is_let_go() {
        let g = SharedBody::new(None);
        g.pass_through(0);
        g.push(Bytes::from_static(b"unread"));
        assert_eq!(g.room(std::time::Duration::from_secs(2)).await, 0);
        assert_eq!(g.held(), 0);
        assert!(!g.joinable());
    }
}
