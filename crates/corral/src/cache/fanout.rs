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
//!
//! The compressing runs on the CPU pool (`cache::cpu`), one thread per
//! coding for as long as the body streams, fed over a channel: the
//! serving thread only hands chunks on. A coding the pool has no slot for
//! when the body starts is not made as it streams.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use corral_core::Coding;
use tokio::sync::oneshot;

use crate::cache::compress::StreamEncoder;
use crate::cache::cpu::{CpuPool, Job};
use crate::cache::shared_body::{SharedBody, Writer};

/// The most bytes a coding of `n` bytes fed in chunks, each flushed when
/// the origin pauses, can take: deflate's stored blocks, brotli's and
/// zstd's raw blocks bound it near `n`, and a flush costs a few bytes of
/// framing at most every `compress::FLUSH_AFTER` bytes fed.
pub fn worst(n: u64) -> u64 {
    n.saturating_add(n / 8).saturating_add(4096)
}

/// Where the codings' work runs: on a thread of the CPU pool, handed each
/// chunk over a channel (the serving thread only sends), or inline when
/// the pool has no threads (`server.cpu_threads: 0`).
enum Runner {
    Pool(mpsc::Sender<Cmd>),
    Inline(Box<Work>),
}

/// What the serving thread asks of the codings' worker, in order.
enum Cmd {
    Feed(Bytes),
    Flush,
    /// The answer will not be stored: keep no copy.
    Unkept,
    /// The body arrived whole: each coding's whole bytes, once made.
    Close(oneshot::Sender<Vec<Finished>>),
    /// The body passed through and ended.
    Passed,
}

/// Every coding of one body, owned by whoever runs them (one job: a
/// streamed answer takes one slot of the pool, whatever its codings).
struct Work {
    coded: Vec<Coded>,
    /// For a body of declared length, what each coding may take.
    cap: Option<u64>,
    /// Shared with [`Fanout::take_produced`].
    produced: Arc<AtomicU64>,
    route: Arc<str>,
}

/// One coding's encoder and what it produced.
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
    /// Each coding's body, for its readers.
    bodies: Vec<(Coding, Arc<SharedBody>)>,
    /// `None`: no coding is made.
    runner: Option<Runner>,
    /// Bytes the codings produced, not yet taken ([`Fanout::take_produced`]).
    produced: Arc<AtomicU64>,
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
    /// The unencoded body `identity` and a body per coding of `codings`,
    /// when the CPU pool has a slot for them now (otherwise none is made
    /// as it streams: their callers read the unencoded body, and the
    /// stored entry has them made on demand); `cap`: for a body of
    /// declared length, what each coding may take (its hold was reserved
    /// up front).
    pub fn new(
        identity: &'a SharedBody,
        codings: &[Coding],
        cap: Option<u64>,
        route: &'a str,
        pool: &CpuPool,
    ) -> Self {
        let produced = Arc::new(AtomicU64::new(0));
        let mut outlets = Fanout {
            identity,
            bodies: Vec::new(),
            runner: None,
            produced: Arc::clone(&produced),
        };
        if codings.is_empty() {
            return outlets;
        }
        let slot = if pool.inline() {
            None
        } else {
            match pool.try_hold(Job::CompressStream) {
                Some(slot) => Some(slot),
                None => return outlets,
            }
        };
        let coded: Vec<Coded> = codings
            .iter()
            .filter_map(|&c| StreamEncoder::new(c))
            .map(|encoder| {
                let body = SharedBody::new(None);
                Coded {
                    writer: Writer::new(&body),
                    body,
                    encoder,
                    kept: Some(Vec::new()),
                    out: 0,
                }
            })
            .collect();
        outlets.bodies = coded
            .iter()
            .map(|c| (c.encoder.coding(), Arc::clone(&c.body)))
            .collect();
        let work = Box::new(Work {
            coded,
            cap,
            produced,
            route: Arc::from(route),
        });
        outlets.runner = Some(match slot {
            None => Runner::Inline(work),
            Some(slot) => {
                let (tx, rx) = mpsc::channel();
                slot.spawn(move || work.serve(&rx));
                Runner::Pool(tx)
            }
        });
        outlets
    }

    /// The coded bodies, for the callers that accept one.
    pub fn bodies(&self) -> Vec<(Coding, Arc<SharedBody>)> {
        self.bodies.clone()
    }

    /// Hands `data` to every body: the unencoded one unless `hold_back`
    /// (its last chunk waits for the entry), every coding always. A
    /// coding that fails, or outgrows its reserved cap (which [`worst`]
    /// says it cannot), fails for its readers and is dropped.
    pub fn push(&mut self, data: Bytes, hold_back: bool) {
        if self.runner.is_some() {
            self.send(Cmd::Feed(data.clone()));
        }
        if !hold_back {
            self.identity.push(data);
        }
    }

    /// The origin paused: every coding pushes out what its encoder holds,
    /// so its readers are not left behind the unencoded ones.
    pub fn flush(&mut self) {
        self.send(Cmd::Flush);
    }

    /// The bytes the codings produced since the last call: what a body of
    /// unknown length takes its hold for (codings made on the pool report
    /// what they made as they make it).
    pub fn take_produced(&mut self) -> u64 {
        self.produced.swap(0, Ordering::AcqRel)
    }

    fn send(&mut self, cmd: Cmd) {
        let alive = match &mut self.runner {
            None => return,
            Some(Runner::Pool(tx)) => tx.send(cmd).is_ok(),
            Some(Runner::Inline(work)) => {
                work.apply(cmd);
                !work.coded.is_empty()
            }
        };
        if !alive {
            self.runner = None;
        }
    }

    /// True when a coding is being made.
    pub fn coding(&self) -> bool {
        self.runner.is_some()
    }

    /// The answer will not be stored: every body passes through, `bound`
    /// bytes held in all, shared among them.
    pub fn pass_through(&mut self, bound: u64) {
        let share = bound / (1 + self.bodies.len() as u64);
        self.identity.pass_through(share);
        for (_, body) in &self.bodies {
            body.pass_through(share);
        }
        self.send(Cmd::Unkept);
    }

    /// Waits, while passing through, until every body holds no more than
    /// its share; returns how many readers were cut off for it.
    pub async fn room(&self, patience: Duration) -> usize {
        let mut cut = self.identity.room(patience).await;
        for (_, body) in &self.bodies {
            cut += body.room(patience).await;
        }
        cut
    }

    /// The body arrived whole: each coding's whole bytes (its last ones
    /// not yet handed to its readers), once the worker has made them
    /// (awaited: the serving thread is free meanwhile).
    pub async fn close(self) -> Vec<Finished> {
        match self.runner {
            None => Vec::new(),
            Some(Runner::Inline(work)) => work.close(),
            Some(Runner::Pool(tx)) => {
                let (done, made) = oneshot::channel();
                if tx.send(Cmd::Close(done)).is_err() {
                    return Vec::new();
                }
                made.await.unwrap_or_default()
            }
        }
    }

    /// A body that passed through ended: each coding's last bytes go to
    /// its readers, and every body ends cleanly.
    pub fn passed(self, identity: Writer) {
        identity.passed();
        match self.runner {
            None => {}
            Some(Runner::Inline(work)) => work.passed(),
            Some(Runner::Pool(tx)) => {
                let _ = tx.send(Cmd::Passed);
            }
        }
    }
}

impl Work {
    /// On a thread of the pool: every command in order, until the body
    /// ends or the fill drops its sender (then the writers, dropped, fail
    /// the codings' readers).
    fn serve(mut self, rx: &mpsc::Receiver<Cmd>) {
        while let Ok(cmd) = rx.recv() {
            match cmd {
                Cmd::Close(done) => {
                    let _ = done.send(self.close());
                    return;
                }
                Cmd::Passed => return self.passed(),
                cmd => {
                    self.apply(cmd);
                    if self.coded.is_empty() {
                        return;
                    }
                }
            }
        }
    }

    /// One command, to every coding; a coding that fails, or outgrows its
    /// cap, is dropped (its writer, dropped, fails its readers).
    fn apply(&mut self, cmd: Cmd) {
        let cap = self.cap;
        let produced = &self.produced;
        match cmd {
            Cmd::Unkept => {
                for c in &mut self.coded {
                    c.kept = None;
                }
            }
            Cmd::Feed(data) => self.coded.retain_mut(|c| {
                c.encoder
                    .feed(&data)
                    .is_ok_and(|out| c.hand_on(out, produced, cap))
            }),
            Cmd::Flush => self.coded.retain_mut(|c| {
                c.encoder
                    .flush()
                    .is_ok_and(|out| c.hand_on(out, produced, cap))
            }),
            // These end the work: [`Work::serve`] and the inline runner
            // take them by value.
            Cmd::Close(_) | Cmd::Passed => {}
        }
    }

    /// Each coding's whole bytes, where it was kept.
    fn close(self) -> Vec<Finished> {
        let route = self.route;
        self.coded
            .into_iter()
            .filter_map(|c| {
                let coding = c.encoder.coding();
                let (last, took) = c.encoder.finish().ok()?;
                crate::telemetry::metrics::compression_time(&route, took);
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

    /// The body passed through: each coding's last bytes to its readers.
    fn passed(self) {
        for c in self.coded {
            let Ok((last, took)) = c.encoder.finish() else {
                continue; // the writer, dropped, fails its readers
            };
            crate::telemetry::metrics::compression_time(&self.route, took);
            c.body.push(last);
            c.writer.passed();
        }
    }
}

impl Coded {
    /// Hands `out` on to the coding's readers; false once the coding
    /// outgrew `cap`.
    fn hand_on(&mut self, out: Bytes, produced: &AtomicU64, cap: Option<u64>) -> bool {
        if !out.is_empty() {
            self.out += out.len() as u64;
            produced.fetch_add(out.len() as u64, Ordering::AcqRel);
            if let Some(kept) = &mut self.kept {
                kept.push(out.clone());
            }
            self.body.push(out);
        }
        cap.is_none_or(|cap| self.out <= cap)
    }
}
