//! The upstream half of the descriptor budget, counted per upstream
//! exchange rather than per client connection. Every client connection is
//! budgeted one upstream socket beside its own (`main.rs`); an HTTP/2
//! connection carries up to 128 streams, and each passed-through stream
//! holds an upstream connection of its own. So each client connection has
//! one permit of its own ([`Own`]), and the streams beyond it share a
//! bounded overflow ([`set_overflow`]): a connection's first exchange never
//! waits for another client's, and many streams on a few connections can
//! take the overflow and nothing more. It must never let the process hold
//! more upstream sockets for passed-through requests than connections plus
//! the overflow.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// What the overflow holds when the server never set it (unit tests).
const DEFAULT_OVERFLOW: usize = 256;

static OVERFLOW: OnceLock<Arc<Semaphore>> = OnceLock::new();

/// Sets the overflow's size, once, before any request.
pub fn set_overflow(n: usize) {
    let _ = OVERFLOW.set(Arc::new(Semaphore::new(n.max(1))));
}

fn overflow() -> &'static Arc<Semaphore> {
    OVERFLOW.get_or_init(|| Arc::new(Semaphore::new(DEFAULT_OVERFLOW)))
}

/// One client connection's own upstream socket.
#[derive(Clone, Debug)]
pub struct Own(Arc<Semaphore>);

impl Own {
    pub fn new() -> Self {
        Own(Arc::new(Semaphore::new(1)))
    }
}

impl Default for Own {
    fn default() -> Self {
        Own::new()
    }
}

/// An upstream socket counted for one exchange: shared by the request's
/// body ([`Counted`]) and the answer's, and given back once both are done
/// (the socket is busy while either still streams).
#[derive(Debug)]
pub struct Permit {
    _held: OwnedSemaphorePermit,
}

/// A request body that keeps its exchange's socket counted until it has
/// been sent (or dropped).
pub struct Counted {
    inner: axum::body::Body,
    _permit: Arc<Permit>,
}

impl Counted {
    pub fn new(inner: axum::body::Body, permit: Arc<Permit>) -> Self {
        Counted {
            inner,
            _permit: permit,
        }
    }
}

impl http_body::Body for Counted {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The connection's own permit if it is free, else one of the overflow's;
/// waits up to `within` for either. `None`: none came free in time.
pub async fn take(own: &Own, within: Duration) -> Option<Permit> {
    let held = match Arc::clone(&own.0).try_acquire_owned() {
        Ok(p) => p,
        Err(_) => match Arc::clone(overflow()).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                let wait = async {
                    tokio::select! {
                        p = Arc::clone(&own.0).acquire_owned() => p,
                        p = Arc::clone(overflow()).acquire_owned() => p,
                    }
                };
                tokio::time::timeout(within, wait).await.ok()?.ok()?
            }
        },
    };
    Some(Permit { _held: held })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_connection_has_one_of_its_own_and_shares_the_overflow() {
        let a = Own::new();
        let b = Own::new();
        let first = take(&a, Duration::from_secs(1)).await.expect("its own");
        // The overflow (unset here: the default) takes the rest of a's.
        let mut extra = Vec::new();
        for _ in 0..DEFAULT_OVERFLOW {
            extra.push(take(&a, Duration::from_secs(1)).await.expect("overflow"));
        }
        assert!(take(&a, Duration::from_secs(1)).await.is_none(), "bounded");
        // Another connection still has its own.
        let other = take(&b, Duration::from_secs(1)).await;
        assert!(other.is_some());
        // One given back is taken by a waiter.
        drop(first);
        assert!(take(&a, Duration::from_secs(1)).await.is_some());
    }
}
