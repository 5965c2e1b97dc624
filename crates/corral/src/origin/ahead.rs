//! Reading a passed-through answer's body ahead of its client, as nginx's
//! `proxy_buffering` does: the origin's body is read at the origin's pace
//! into a buffer the client drains at its own, so the exchange ends (and its
//! `upstream_concurrency` slot, its pooled connection and its counted socket
//! are given back) when the origin is done, not when a slow reader is.
//! Bounded twice: each answer reads at most `max_object_size` ahead, and all
//! of them together at most the budget (`ahead_buffer_bytes`, a budget of its
//! own beside the fills'). Past either, the body is read at the client's
//! pace again, one frame at a time. It must never reorder, drop or add a
//! byte: frames, trailers and a cut-off body reach the client as the origin
//! sent them.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use corral_core::{Budget, Hold};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One frame on its way to the client, with the room it takes ahead.
struct Ahead {
    frame: Result<Frame<Bytes>, BoxError>,
    _room: Option<OwnedSemaphorePermit>,
    _hold: Option<Hold>,
}

/// The client's side: frames as the origin sent them.
pub struct ReadAhead {
    rx: mpsc::UnboundedReceiver<Ahead>,
    hint: SizeHint,
    done: bool,
}

/// Reads `body` ahead of its client in a task of its own, up to `max`
/// bytes of it and what `budget` grants at once.
pub fn read_ahead<B>(body: B, max: u64, budget: &Arc<Budget>) -> ReadAhead
where
    B: HttpBody<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
{
    let hint = body.size_hint();
    let (tx, rx) = mpsc::unbounded_channel();
    // Room is counted in KiB so that a semaphore's u32 permits cover any
    // max_object_size.
    let room_kib = u32::try_from(max.div_ceil(1024)).unwrap_or(u32::MAX).max(1);
    let room = Arc::new(Semaphore::new(room_kib as usize));
    let budget = Arc::clone(budget);
    tokio::spawn(async move {
        let mut body = body;
        loop {
            // The origin's pace: the next frame as soon as it arrives. A
            // client that went away ends the exchange at once, not at the
            // origin's next frame (a long poll may send none for minutes).
            let next = tokio::select! {
                f = body.frame() => f,
                () = tx.closed() => None,
            };
            let Some(frame) = next.map(|f| f.map_err(Into::into)) else {
                break;
            };
            let len = match &frame {
                Ok(f) => f.data_ref().map_or(0, |d| d.len() as u64),
                Err(_) => 0,
            };
            let kib = u32::try_from(len.div_ceil(1024))
                .unwrap_or(u32::MAX)
                .min(room_kib);
            let mut hold = budget.hold();
            let (want, hold) = if hold.grow(len) {
                (kib, Some(hold))
            } else {
                // The budget is spent: wait until this client has taken
                // everything read ahead of it, then hand it over as the
                // client's pace allows.
                (room_kib, None)
            };
            let room_permit = tokio::select! {
                p = Arc::clone(&room).acquire_many_owned(want) => match p {
                    Ok(p) => p,
                    Err(_) => break,
                },
                () = tx.closed() => break,
            };
            let failed = frame.is_err();
            let sent = tx.send(Ahead {
                frame,
                _room: Some(room_permit),
                _hold: hold,
            });
            if sent.is_err() || failed {
                // The client went away, or the body broke off: nothing more
                // is read, and the exchange ends here.
                break;
            }
        }
        // Dropping `body` here gives the exchange back.
    });
    ReadAhead {
        rx,
        hint,
        done: false,
    }
}

impl HttpBody for ReadAhead {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(ahead)) => Poll::Ready(Some(ahead.frame)),
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.hint.exact() == Some(0)
    }

    fn size_hint(&self) -> SizeHint {
        self.hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, StreamBody};

    fn frames(chunks: Vec<&'static [u8]>) -> impl HttpBody<Data = Bytes, Error = BoxError> + Unpin {
        let stream = futures_util::stream::iter(
            chunks
                .into_iter()
                .map(|c| Ok::<_, BoxError>(Frame::data(Bytes::from_static(c)))),
        );
        StreamBody::new(stream)
    }

    #[tokio::test]
    async fn every_byte_arrives_in_order_and_the_budget_is_given_back() {
        let budget = Budget::new(1 << 20);
        let body = read_ahead(frames(vec![b"ab", b"", b"cde", b"f"]), 1 << 20, &budget);
        let got = body.collect().await.expect("body").to_bytes();
        assert_eq!(&got[..], b"abcdef");
        assert_eq!(budget.used(), 0);
    }

    #[tokio::test]
    async fn the_origin_is_read_to_its_end_before_the_client_reads() {
        let budget = Budget::new(1 << 20);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        // A body whose end is seen only when the reader reaches it: the
        // oneshot fires when the source is dropped, after its last frame.
        struct Source(Option<tokio::sync::oneshot::Sender<()>>, Vec<Bytes>);
        impl HttpBody for Source {
            type Data = Bytes;
            type Error = BoxError;
            fn poll_frame(
                mut self: Pin<&mut Self>,
                _: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
                Poll::Ready(self.1.pop().map(|b| Ok(Frame::data(b))))
            }
        }
        impl Drop for Source {
            fn drop(&mut self) {
                if let Some(tx) = self.0.take() {
                    let _ = tx.send(());
                }
            }
        }
        let chunks = vec![Bytes::from(vec![b'x'; 4096]); 16];
        let body = read_ahead(Source(Some(tx), chunks), 1 << 20, &budget);
        // Nobody has read a byte, and the origin's body is done with.
        rx.await
            .expect("the source was read to its end and dropped");
        assert_eq!(budget.used(), 16 * 4096);
        let got = body.collect().await.expect("body").to_bytes();
        assert_eq!(got.len(), 16 * 4096);
        assert_eq!(budget.used(), 0);
    }

    #[tokio::test]
    async fn a_client_that_goes_away_ends_the_exchange_without_another_frame() {
        let budget = Budget::new(1 << 20);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        // A body that never sends a frame (a long poll), and says when it
        // is dropped.
        struct Silent(Option<tokio::sync::oneshot::Sender<()>>);
        impl HttpBody for Silent {
            type Data = Bytes;
            type Error = BoxError;
            fn poll_frame(
                self: Pin<&mut Self>,
                _: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
                Poll::Pending
            }
        }
        impl Drop for Silent {
            fn drop(&mut self) {
                if let Some(tx) = self.0.take() {
                    let _ = tx.send(());
                }
            }
        }
        let body = read_ahead(Silent(Some(tx)), 1 << 20, &budget);
        drop(body);
        tokio::time::timeout(std::time::Duration::from_secs(5), rx)
            .await
            .expect("the origin's body was dropped with its client")
            .expect("dropped, not leaked");
    }

    #[tokio::test]
    async fn past_the_budget_the_client_paces_the_reads() {
        let budget = Budget::new(4);
        let body = read_ahead(frames(vec![b"abcd", b"efgh", b"ij"]), 1 << 20, &budget);
        let got = body.collect().await.expect("body").to_bytes();
        assert_eq!(&got[..], b"abcdefghij");
        assert_eq!(budget.used(), 0);
    }
}
