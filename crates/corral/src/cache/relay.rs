//! A growing body shared across instances: the lease holder relays its
//! answer's body as it arrives ([`pump`]) and each waiting instance streams
//! it to its callers ([`Relay`]), so that their first byte comes with the
//! leader's, not when the whole entry is in L2. The stream is a second
//! path for the bytes only: what is stored still comes from L2 as before,
//! and a relay that breaks (a forged, reordered or missing part, an
//! abort, a lease that lapsed, a failed read) cuts its callers' answers
//! short, never presents them as whole. Only a body with a declared length
//! larger than one part ([`CHUNK`]) and within `l2_max_object_size` is
//! relayed; others stay per instance (one part gains nothing over the
//! entry, which comes as soon). The holder announces a relay on the fill's
//! notice channel, and a waiter joins the stream only when it hears that,
//! so a fill that is not relayed costs its waiters no stream command.
//! The Redis side, and what it costs, is `cluster::stream`.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use corral_core::StoredResponse;
use http::HeaderMap;
use http_body_util::BodyExt;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::cache::fill::{Cache, Ended, Events, FillEvent, FillOutcome, FillRequest, RelayParts};
use crate::cache::shared_body::{Reader, SharedBody, Writer};
use crate::cluster::protocol::{FillNotice, Keys};
use crate::cluster::stream::{CHUNK, FLUSH_EVERY, Part, StreamReader, StreamWriter};
use crate::cluster::tier::SharedTier;

/// When the holder announces its relay on the fill's notice channel
/// (`FillNotice::Relaying`), after its head is in, and from the second on,
/// offers its stream first if nobody read it yet: a waiter joins when it
/// hears an announcement, so one that began to wait after the first
/// (its callers came later, or its first read was slower than the
/// origin's head) hears a later one and reads the stream from its start.
/// A waiter that begins later than the last waits for the entry, as
/// without streams. A body that ends sooner stops them: a fill nobody
/// waits on elsewhere costs eight commands here, whatever the
/// fleet's size.
const ANNOUNCE_AT: [Duration; 5] = [
    Duration::ZERO,
    Duration::from_millis(20),
    Duration::from_millis(60),
    Duration::from_millis(200),
    Duration::from_millis(500),
];
/// The most body one append carries (what gathered before anyone read is
/// sent in parts of this size).
const PART_MAX: usize = 4 * CHUNK;

/// How long one read of the stream waits on the server. With nothing new
/// by then, the waiter checks that the lease is still the one it reads
/// the stream of (a dead holder's lapses), then reads on.
const BLOCK: Duration = Duration::from_secs(2);

/// The holder's relay of `outcome` (its answer, streaming), started as its
/// head is in, if the tier relays and the body's declared length is more
/// than one part and fits L2.
pub(crate) fn pump(fill: &FillRequest, keys: &Keys, lease: &str, outcome: &FillOutcome) {
    let FillOutcome::Streaming { head, body, .. } = outcome else {
        return;
    };
    let Some(tier) = fill.shared().tier.cloned() else {
        return;
    };
    let Some(len) = body
        .len()
        .filter(|n| *n > CHUNK as u64 && *n <= tier.max_object_size())
    else {
        return;
    };
    if lease.is_empty() {
        return;
    }
    let Some(out) = tier.stream_writer(keys, lease) else {
        return;
    };
    // Attached now, before any of the body can be read by anyone else.
    let reader = body.reader();
    let outgoing = Outgoing {
        tier,
        keys: keys.clone(),
        out,
        head: Arc::clone(head),
        len,
        opened: false,
        ticks: 0,
        started: Instant::now(),
        gave_up: false,
        unsent: Vec::new(),
        buf: BytesMut::new(),
        total: 0,
        hasher: blake3::Hasher::new(),
        last: None,
    };
    tokio::spawn(outgoing.run(reader));
}

/// The holder's side of one relay.
struct Outgoing {
    tier: Arc<dyn SharedTier>,
    keys: Keys,
    out: StreamWriter,
    head: Arc<StoredResponse>,
    len: u64,
    /// A waiter reads the stream: what arrives is appended.
    opened: bool,
    /// Announcements made so far (see [`ANNOUNCE_AT`]).
    ticks: usize,
    started: Instant,
    /// Nobody came, or Redis failed: the rest is not relayed.
    gave_up: bool,
    /// What arrived before anyone read, sent when someone does.
    unsent: Vec<Bytes>,
    /// What arrived since the last append.
    buf: BytesMut,
    total: u64,
    hasher: blake3::Hasher,
    last: Option<Instant>,
}

impl Outgoing {
    async fn run(mut self, mut body: Reader) {
        self.started = Instant::now();
        while !self.gave_up {
            // The first bytes go at once, then at least CHUNK at a time
            // (or what FLUSH_EVERY gathered).
            let flush_at = self.last.map_or_else(Instant::now, |at| at + FLUSH_EVERY);
            let tick_at = ANNOUNCE_AT
                .get(self.ticks)
                .map(|after| self.started + *after);
            tokio::select! {
                () = sleep_until_some(tick_at) => self.tick().await,
                frame = body.frame() => match frame {
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            self.take(&data);
                        }
                        if self.buf.len() >= CHUNK {
                            self.flush().await;
                        }
                    }
                    // The body broke off: the waiters' answers are cut.
                    Some(Err(_)) => return self.append(Part::Abort).await,
                    None => return self.end().await,
                },
                () = tokio::time::sleep_until(flush_at), if !self.buf.is_empty() => self.flush().await,
            }
        }
    }

    fn take(&mut self, data: &Bytes) {
        self.total += data.len() as u64;
        self.hasher.update(data);
        self.buf.extend_from_slice(data);
    }

    /// One announcement, after an offer of the stream if nobody reads it
    /// yet (those that heard the previous one may have joined since).
    async fn tick(&mut self) {
        self.ticks += 1;
        if !self.opened && self.ticks > 1 {
            self.offer().await;
        }
        // Nothing more to offer and nobody reads: nobody is told to join.
        if self.gave_up || (!self.opened && self.ticks == ANNOUNCE_AT.len()) {
            return;
        }
        // A failed notice: nobody joins on it; the next one may do.
        let _ = self.tier.publish(&self.keys, FillNotice::Relaying).await;
    }

    /// Opens the stream if some waiter reads it now, with what arrived
    /// before as one part.
    async fn offer(&mut self) {
        match self.out.offer(&self.head, Some(self.len)).await {
            Ok(true) => {
                self.opened = true;
                let before: Vec<u8> = self.unsent.drain(..).flatten().collect();
                self.append_data(Bytes::from(before)).await;
            }
            Ok(false) if self.ticks < ANNOUNCE_AT.len() => {}
            _ => self.give_up(),
        }
    }

    fn give_up(&mut self) {
        self.gave_up = true;
        self.unsent.clear();
        self.buf.clear();
    }

    /// Appends what arrived since the last append; kept for when someone
    /// reads, while nobody does.
    async fn flush(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        self.last = Some(Instant::now());
        let data = self.buf.split().freeze();
        if self.opened {
            self.append_data(data).await;
        } else {
            self.unsent.push(data);
        }
    }

    /// Appends `data` in parts of at most [`PART_MAX`], so that no one
    /// command holds the shared connection long.
    async fn append_data(&mut self, mut data: Bytes) {
        while !data.is_empty() {
            let part = data.split_to(data.len().min(PART_MAX));
            self.append(Part::Data(part)).await;
        }
    }

    async fn end(mut self) {
        self.flush().await;
        let digest = *self.hasher.finalize().as_bytes();
        let total = self.total;
        self.append(Part::End { len: total, digest }).await;
    }

    async fn append(&mut self, part: Part) {
        if !self.opened || self.gave_up {
            return;
        }
        if self.out.append(&part).await.is_err() {
            // Redis is slow or gone: the waiters see nothing more, find the
            // lease released, and finish their callers' bodies from the
            // entry (or cut them, if none comes).
            self.give_up();
        }
    }
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// A waiting instance's relay of the holder's body: started once per fill
/// when the holder announces it ([`FillNotice::Relaying`]), if its callers
/// read an answer as it arrives.
pub(crate) struct Relay {
    events: Events,
    /// The callers' own bound: the relay reads no longer.
    until: Instant,
    started: bool,
    /// Where the entry the fill read from L2 goes, for a relay that broke
    /// off to finish its callers' bodies from (dropped: none will come).
    entry: Option<oneshot::Sender<Arc<StoredResponse>>>,
}

impl Relay {
    pub(crate) fn new(events: &Events, until: Instant) -> Self {
        Relay {
            events: events.clone(),
            until,
            started: false,
            entry: None,
        }
    }

    /// Joins the holder's stream (the holder announced it).
    pub(crate) fn start(&mut self, fill: &FillRequest, keys: &Keys) {
        if self.started || !fill.streams(&self.events) {
            return;
        }
        self.started = true;
        let RelayParts { tier, cache } = fill.relay();
        let Some(tier) = tier else {
            return;
        };
        let (tx, entry) = oneshot::channel();
        self.entry = Some(tx);
        let incoming = Incoming {
            entry: Some(entry),
            tier,
            keys: keys.clone(),
            events: self.events.clone(),
            cache,
            request: fill.head.headers.clone(),
            identity: fill.identity,
            uri: fill.primary.uri().readable().to_owned(),
            fwd: fill.fwd,
            until: self.until,
            open: None,
        };
        tokio::spawn(incoming.run());
    }

    /// The fill ended with `ended`: an entry read from L2 goes to the
    /// relay, for the case it broke off.
    pub(crate) fn ended(&mut self, ended: Ended) -> Ended {
        if let (Ended::Outcome(FillOutcome::FromL2 { entry, .. }), Some(tx)) =
            (&ended, self.entry.take())
        {
            let _ = tx.send(Arc::clone(entry));
        }
        ended
    }
}

/// A waiter's side of one relay.
struct Incoming {
    tier: Arc<dyn SharedTier>,
    keys: Keys,
    events: Events,
    cache: Arc<Cache>,
    request: HeaderMap,
    identity: Option<corral_core::Identity>,
    uri: String,
    fwd: corral_core::Forward,
    until: Instant,
    /// Once the head is in: the body its callers read.
    open: Option<Relayed>,
    /// The entry the fill reads from L2, if it does.
    entry: Option<oneshot::Receiver<Arc<StoredResponse>>>,
}

/// A relayed body being written for this instance's callers. Dropped
/// before its end (any break), its writer cuts every reader.
struct Relayed {
    /// The body's room in `cache.fill_memory`, while it is relayed.
    _hold: corral_core::Hold,
    writer: Writer,
    body: Arc<SharedBody>,
    len: u64,
    total: u64,
    hasher: blake3::Hasher,
    /// The part that completes the body, held back until the end
    /// verifies: no caller has every byte of a body not checked whole.
    held: Option<Bytes>,
    /// Bytes the callers were given, and their BLAKE3.
    pushed: usize,
    pushed_hash: blake3::Hasher,
}

impl Relayed {
    fn push(&mut self, data: Bytes) {
        self.pushed += data.len();
        self.pushed_hash.update(&data);
        self.body.push(data);
    }

    /// Finishes the body from `entry` (read from L2, sealed by the leader)
    /// when what the callers were given is its beginning; else it is cut.
    fn finish_from(self, entry: &StoredResponse) {
        let whole = entry.body();
        let fits = whole.len() as u64 == self.len
            && whole.len() >= self.pushed
            && blake3::hash(&whole[..self.pushed]) == self.pushed_hash.finalize();
        if fits {
            let rest = whole.slice(self.pushed..);
            if !rest.is_empty() {
                self.body.push(rest);
            }
            self.writer.passed();
        }
    }
}

/// Whether a relay reads on.
enum Step {
    On,
    Done,
}

impl Incoming {
    async fn run(mut self) {
        let stamp = self.cache.l1.generation_stamp();
        let Some(input) = self.tier.stream_reader(&self.keys, stamp).await else {
            return;
        };
        self.read(input).await;
        // Broken off before its end (a part that does not verify, an
        // abort, a lapsed lease, a failed read): the callers' bodies are
        // finished from the entry the fill reads from L2, as without
        // streams, or cut if none comes.
        let Some(open) = self.open.take() else {
            return;
        };
        let Some(entry) = self.entry.take() else {
            return;
        };
        if let Ok(Ok(entry)) = tokio::time::timeout_at(self.until, entry).await {
            open.finish_from(&entry);
        }
    }

    /// Reads the stream until its end or a break.
    async fn read(&mut self, mut input: StreamReader) {
        loop {
            // Nobody waits on the fill any more and nothing is relayed yet.
            if Instant::now() >= self.until || (self.open.is_none() && self.events.is_closed()) {
                return;
            }
            let parts = match input.next(BLOCK).await {
                Ok(parts) => parts,
                Err(e) => {
                    tracing::debug!(key = %self.uri, error = %e, "relayed body broken: cut");
                    return;
                }
            };
            if parts.is_empty() && !self.lease_stands(&input).await {
                return;
            }
            for part in parts {
                if let Step::Done = self.take(part) {
                    return;
                }
            }
        }
    }

    /// True while the lease whose stream `input` reads is still held.
    async fn lease_stands(&self, input: &StreamReader) -> bool {
        matches!(self.tier.lease_age(&self.keys).await, Ok(Some((v, _))) if v == input.lease())
    }

    fn take(&mut self, part: Part) -> Step {
        match (part, self.open.as_mut()) {
            (Part::Head { head, len }, None) => self.begin(*head, len),
            (Part::Data(data), Some(open)) => {
                open.total += data.len() as u64;
                if open.total > open.len {
                    return Step::Done;
                }
                open.hasher.update(&data);
                // The part that completes the body waits for the end's
                // check; every other goes to the callers at once.
                if open.total == open.len {
                    open.held = Some(data);
                } else {
                    open.push(data);
                }
                Step::On
            }
            (Part::End { len, digest }, Some(open)) => {
                let whole = len == open.len
                    && open.total == len
                    && *open.hasher.finalize().as_bytes() == digest;
                if let (true, Some(mut open)) = (whole, self.open.take()) {
                    if let Some(last) = open.held.take() {
                        open.push(last);
                    }
                    open.writer.passed();
                }
                Step::Done
            }
            // The origin broke off: no entry will come of this fill, and
            // the callers' bodies are cut now.
            (Part::Abort, _) => {
                self.open = None;
                Step::Done
            }
            // A part where none belongs: the relay is broken.
            _ => Step::Done,
        }
    }

    /// The head is in: this instance's callers read the body from now on,
    /// if the answer is one they may have.
    fn begin(&mut self, head: StoredResponse, len: Option<u64>) -> Step {
        let Some(len) = len else {
            return Step::Done;
        };
        let head = Arc::new(head.with_uri(&self.uri));
        let Some(head) = self.cache.l1.apply_bans(head) else {
            return Step::Done;
        };
        if !head.matches_vary(&self.request) || !head.sharing().admits(self.identity.as_ref()) {
            return Step::Done;
        }
        // Counted like a fill's buffer: with no room, the callers wait for
        // the entry instead.
        let mut hold = self.cache.fill_memory.hold();
        if !hold.grow(len) {
            return Step::Done;
        }
        let body = SharedBody::new(Some(len));
        let writer = Writer::new(&body);
        self.events
            .send(FillEvent::Streaming(FillOutcome::Streaming {
                fwd_status: Some(head.status().as_u16()),
                head,
                body: Arc::clone(&body),
                coded: Vec::new(),
                fwd: self.fwd,
                own: HeaderMap::new(),
                relayed: true,
            }));
        self.open = Some(Relayed {
            _hold: hold,
            writer,
            body,
            len,
            total: 0,
            hasher: blake3::Hasher::new(),
            held: None,
            pushed: 0,
            pushed_hash: blake3::Hasher::new(),
        });
        Step::On
    }
}
