//! Where a streamed answer's chunks go as they arrive: the unencoded body
//! every caller of the flight can read, and, on a route that compresses a
//! compressible answer, one body per coding, compressed once as the chunks
//! arrive and read by every caller that accepts it. A flight's callers
//! thus get the coding they would get from the stored entry, without
//! waiting for its end and without a compression per caller; the codings
//! made this way are the ones stored (`compress::encode_with`).
//!
//! Each coded body is a [`SharedBody`] like the unencoded one, and shares its
//! fate: it ends cleanly only when the entry is stored (the coding's last
//! bytes come then, so no reader holds a whole coded body before the
//! entry is stored), fails for its readers when the fill fails, and
//! passes through (bounded, the slowest reader cut off) when the body
//! outgrows what can be stored. What a coding holds is counted in the
//! fill's hold on `cache.fill_memory`: reserved up front for a body of
//! declared length ([`worst`]), taken as it grows otherwise.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use corral_core::Coding;

use crate::cache::compress::StreamEncoder;
use crate::cache::shared_body::{SharedBody, Writer};

/// The most bytes a coding of `n` bytes fed in chunks, each flushed when
/// the origin pauses, can take: deflate's stored blocks, brotli's and
/// zstd's raw blocks bound it near `n`, and a flush costs a few bytes of
/// framing at most every `compress::FLUSH_AFTER` bytes fed.
pub fn worst(n: u64) -> u64 {
    n.saturating_add(n / 8).saturating_add(4096)
}

/// One coding's body.
struct Coded {
    encoder: StreamEncoder,
    body: Arc<SharedBody>,
    writer: Writer,
    /// The chunks kept to store, while the answer may be stored.
    kept: Option<Vec<Bytes>>,
    /// Bytes produced so far.
    out: u64,
}

/// The bodies a streamed answer feeds.
pub struct Fanout<'a> {
    identity: &'a SharedBody,
    coded: Vec<Coded>,
    /// For a body of declared length, what each coding may take (its
    /// hold was reserved up front).
    cap: Option<u64>,
    /// Bytes the codings produced, not yet taken ([`Fanout::take_produced`]).
    produced: u64,
    route: &'a str,
}

/// A coding of a body that arrived whole, to be stored and then ended
/// for its readers ([`Finished::end`]).
pub struct Finished {
    pub coding: Coding,
    pub whole: Bytes,
    writer: Writer,
}

impl Finished {
    /// Ends the coding's readers cleanly, the stored bytes being `whole`.
    pub fn end(self) {
        self.writer.finish(&self.whole);
    }
}

impl<'a> Fanout<'a> {
    /// The unencoded body `identity` and a body per coding of `codings`;
    /// `cap` as [`Fanout::cap`].
    pub fn new(
        identity: &'a SharedBody,
        codings: &[Coding],
        cap: Option<u64>,
        route: &'a str,
    ) -> Self {
        let coded = codings
            .iter()
            .filter_map(|&c| StreamEncoder::new(c))
            .map(|encoder| {
                let body = SharedBody::new(None);
                Coded {
                    writer: Writer::new(&body),
                    encoder,
                    body,
                    kept: Some(Vec::new()),
                    out: 0,
                }
            })
            .collect();
        Fanout {
            identity,
            coded,
            cap,
            produced: 0,
            route,
        }
    }

    /// The coded bodies, for the callers that accept one.
    pub fn bodies(&self) -> Vec<(Coding, Arc<SharedBody>)> {
        self.coded
            .iter()
            .map(|c| (c.encoder.coding(), Arc::clone(&c.body)))
            .collect()
    }

    /// Hands `data` to every body: the unencoded one unless `hold_back`
    /// (its last chunk waits for the entry), every coding always. A
    /// coding that fails, or outgrows its reserved cap (which [`worst`]
    /// says it cannot), fails for its readers and is dropped.
    pub fn push(&mut self, data: Bytes, hold_back: bool) {
        self.each(|e| e.feed(&data));
        if !hold_back {
            self.identity.push(data);
        }
    }

    /// The origin paused: every coding pushes out what its encoder holds,
    /// so its readers are not left behind the unencoded ones.
    pub fn flush(&mut self) {
        self.each(StreamEncoder::flush);
    }

    /// The bytes the codings produced since the last call: what a body of
    /// unknown length takes its hold for.
    pub fn take_produced(&mut self) -> u64 {
        std::mem::take(&mut self.produced)
    }

    fn each(&mut self, mut f: impl FnMut(&mut StreamEncoder) -> std::io::Result<Bytes>) {
        let cap = self.cap;
        let mut produced = 0;
        self.coded.retain_mut(|c| {
            let Ok(out) = f(&mut c.encoder) else {
                return false;
            };
            produced += out.len() as u64;
            c.hand_on(out);
            cap.is_none_or(|cap| c.out <= cap)
        });
        self.produced += produced;
    }

    /// True when a coding is being made.
    pub fn coding(&self) -> bool {
        !self.coded.is_empty()
    }

    /// The answer will not be stored: every body passes through, `bound`
    /// bytes held in all, shared among them.
    pub fn pass_through(&mut self, bound: u64) {
        let share = bound / (1 + self.coded.len() as u64);
        self.identity.pass_through(share);
        for c in &mut self.coded {
            c.kept = None;
            c.body.pass_through(share);
        }
    }

    /// Waits, while passing through, until every body holds no more than
    /// its share; returns how many readers were cut off for it.
    pub async fn room(&self, patience: Duration) -> usize {
        let mut cut = self.identity.room(patience).await;
        for c in &self.coded {
            cut += c.body.room(patience).await;
        }
        cut
    }

    /// The body arrived whole: each coding's whole bytes (its last ones
    /// not yet handed to its readers).
    pub fn close(self) -> Vec<Finished> {
        let route = self.route;
        self.coded
            .into_iter()
            .filter_map(|c| {
                let coding = c.encoder.coding();
                let (last, took) = c.encoder.finish().ok()?;
                crate::telemetry::metrics::compression_time(route, took);
                let kept = c.kept?;
                let mut whole = BytesMut::with_capacity(c.out as usize + last.len());
                for chunk in &kept {
                    whole.extend_from_slice(chunk);
                }
                whole.extend_from_slice(&last);
                Some(Finished {
                    coding,
                    whole: whole.freeze(),
                    writer: c.writer,
                })
            })
            .collect()
    }

    /// A body that passed through ended: each coding's last bytes go to
    /// its readers, and every body ends cleanly.
    pub fn passed(self, identity: Writer) {
        identity.passed();
        for c in self.coded {
            let Ok((last, took)) = c.encoder.finish() else {
                continue; // the writer, dropped, fails its readers
            };
            crate::telemetry::metrics::compression_time(self.route, took);
            c.body.push(last);
            c.writer.passed();
        }
    }
}

impl Coded {
    fn hand_on(&mut self, out: Bytes) {
        if out.is_empty() {
            return;
        }
        self.out += out.len() as u64;
        if let Some(kept) = &mut self.kept {
            kept.push(out.clone());
        }
        self.body.push(out);
    }
}
