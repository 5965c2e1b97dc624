//! The shared tier as the cache sees it: the seam between the miss path
//! (`cache/`) and Redis. The cache holds an `Arc<dyn SharedTier>` and never
//! names [`L2`](crate::cluster::l2::L2), so the lease protocol it runs can
//! be driven by an in-memory tier in unit tests, and the import runs one
//! way: cache → cluster.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use corral_core::{
    Backoff, Ban, Coding, Digest, Identity, PrimaryKey, StoredResponse, UriKey, Vary,
};
use futures_util::future::BoxFuture;

use crate::cluster::protocol::{FillNotice, Keys};
use crate::cluster::redis_link::L2Error;
use crate::cluster::stream::{StreamReader, StreamWriter};

/// What one round trip read about a variant.
pub struct Probe {
    /// The stored entry, decoded (a corrupt one reads as `None`).
    pub entry: Option<StoredResponse>,
    /// The URI's Vary set, as the last fill recorded it.
    pub vary: Option<Vary>,
    /// The key is hit-for-pass for this caller's scope.
    pub pass: bool,
    /// Another fill holds the variant's lease.
    pub lease_held: bool,
    /// The lease's value (token and when it was taken, on Redis's clock),
    /// if held.
    pub lease: Option<String>,
    /// The URI's generation (bumped by invalidation).
    pub generation: u64,
    /// The origin's back-off for this key, as some instance recorded it.
    pub backoff: Option<Backoff>,
}

/// A first read and the lease it took with it, if it did.
pub type ProbeAndLease = (Probe, Option<Box<dyn HeldLease>>);

/// A held lease: the one fill, across every instance, that fetches a
/// variant.
pub trait HeldLease: Send {
    /// Keeps the lease alive while the fetch runs; dropping the guard
    /// stops extending it.
    fn keep_alive(&self) -> Box<dyn Send>;
    /// Gives the lease up; `Ok(false)` when it had passed to another
    /// holder already.
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<bool, L2Error>>;
    /// The lease's name, for logs.
    fn name(&self) -> &str;
    /// The lease's value (its token): what its fill's relayed body is
    /// named by; empty where there is none.
    fn value(&self) -> &str {
        ""
    }
}

/// One waiter's subscription to a variant's fill notices.
pub trait Notices: Send {
    /// The next notice; `None` once no more can come (the subscriber is
    /// gone): the waiter polls instead.
    fn next(&mut self) -> BoxFuture<'_, Option<FillNotice>>;
}

/// What Redis says of a coding an instance is asked for
/// ([`SharedTier::read_or_claim_coding`]).
pub enum KeptCoding {
    /// Another instance made it for the same body: these bytes.
    Found(Bytes),
    /// None is kept (or none that verifies): this instance makes it.
    Make,
    /// Another instance claimed its making a moment ago: ask again later.
    Busy,
}

/// Redis as the cache path uses it. Every call may fail; the cache path
/// treats a failure as "Redis is not there" and serves locally.
pub trait SharedTier: Send + Sync {
    /// The records of one variant.
    fn keys(&self, primary: &PrimaryKey, variant: Digest, identity: Option<&Identity>) -> Keys;
    /// Reads every record of a variant in one round trip.
    fn probe<'a>(&'a self, keys: &'a Keys, stamp: u64) -> BoxFuture<'a, Result<Probe, L2Error>>;
    /// The first read of a fill and its lease attempt in one round trip:
    /// the lease is taken when nothing the fill could use is there (with
    /// `with_entry`, whatever entry is; the fill judges it, and gives the
    /// lease back if it serves that). A tier without such a script reads,
    /// and the fill acquires the lease in a second round trip.
    fn probe_or_acquire<'a>(
        &'a self,
        keys: &'a Keys,
        stamp: u64,
        _with_entry: bool,
    ) -> BoxFuture<'a, Result<ProbeAndLease, L2Error>> {
        Box::pin(async move { Ok((self.probe(keys, stamp).await?, None)) })
    }
    /// How long a lease lives past its last renewal (its holder renews it
    /// every third of that, and tells the waiters so): a waiter that hears
    /// nothing for this long reads once.
    fn lease_window(&self) -> Duration {
        Duration::from_secs(3)
    }
    /// Takes the variant's lease if nobody holds it.
    fn acquire<'a>(
        &'a self,
        keys: &'a Keys,
    ) -> BoxFuture<'a, Result<Option<Box<dyn HeldLease>>, L2Error>>;
    /// Takes the lease over from a holder that has held it past
    /// `lock_age`, if it still holds the value `seen`.
    fn take_over<'a>(
        &'a self,
        keys: &'a Keys,
        seen: &'a str,
    ) -> BoxFuture<'a, Result<Option<Box<dyn HeldLease>>, L2Error>>;
    /// The variant's lease value and how long it has been held, on Redis's
    /// clock (never this host's against the holder's); `None` when free.
    fn lease_age<'a>(
        &'a self,
        keys: &'a Keys,
    ) -> BoxFuture<'a, Result<Option<(String, Duration)>, L2Error>>;
    /// Registers for the variant's fill notices (before reading, so that
    /// no notice falls between the read and the wait). The instance's
    /// subscription is long-lived: this costs Redis nothing.
    fn watch<'a>(&'a self, keys: &'a Keys) -> BoxFuture<'a, Box<dyn Notices>>;
    /// Redis cannot be used now for `primary`'s records (no connection,
    /// or the breaker of the node or Cluster primary that holds them is
    /// open): a background refresh would fetch for this instance alone, so
    /// a stale-while-revalidate answer waits for Redis instead (see
    /// `lookup`).
    fn unavailable(&self, _primary: &PrimaryKey) -> bool {
        false
    }
    /// The largest body `store` writes.
    fn max_object_size(&self) -> u64;

    /// Keeps `packed`, the body whose SHA-256 is `body` in `coding`, beside
    /// the entry of `keys` for `ttl`, so that no other instance makes it
    /// again. A tier that keeps none does nothing.
    fn write_coding<'a>(
        &'a self,
        _keys: &'a Keys,
        _coding: Coding,
        _body: [u8; 32],
        _packed: &'a [u8],
        _ttl: Duration,
    ) -> BoxFuture<'a, Result<(), L2Error>> {
        Box::pin(async { Ok(()) })
    }

    /// Ends this instance's claim on making `coding` of the entry of
    /// `keys` ([`SharedTier::read_or_claim_coding`]) without keeping it:
    /// the CPU pool had no slot for it. A tier that keeps none does
    /// nothing.
    fn end_coding_claim<'a>(
        &'a self,
        _keys: &'a Keys,
        _coding: Coding,
    ) -> BoxFuture<'a, Result<(), L2Error>> {
        Box::pin(async { Ok(()) })
    }

    /// The body whose SHA-256 is `body` in `coding`, if an instance kept
    /// it ([`SharedTier::write_coding`]); else the claim on making it for
    /// `claim`, or word that another instance holds it. One that does not
    /// verify, or that encodes another body, is none: make it. A tier that
    /// keeps none says make it.
    fn read_or_claim_coding<'a>(
        &'a self,
        _keys: &'a Keys,
        _coding: Coding,
        _body: [u8; 32],
        _claim: Duration,
    ) -> BoxFuture<'a, Result<KeptCoding, L2Error>> {
        Box::pin(async { Ok(KeptCoding::Make) })
    }
    /// Writes an entry under the generation it was fetched in; `Ok(false)`
    /// when it was not written (too large, expired, or invalidated since).
    fn write_entry<'a>(
        &'a self,
        keys: &'a Keys,
        entry: &'a StoredResponse,
        generation: u64,
        now: SystemTime,
    ) -> BoxFuture<'a, Result<bool, L2Error>>;
    /// Marks the key hit-for-pass for `duration`.
    fn write_pass<'a>(
        &'a self,
        keys: &'a Keys,
        duration: Duration,
    ) -> BoxFuture<'a, Result<(), L2Error>>;
    /// Records the origin's back-off for every instance, kept `keep` past
    /// its end.
    fn write_backoff<'a>(
        &'a self,
        keys: &'a Keys,
        backoff: &'a Backoff,
        keep: Duration,
        now: SystemTime,
    ) -> BoxFuture<'a, Result<(), L2Error>>;
    fn delete_backoff<'a>(&'a self, keys: &'a Keys) -> BoxFuture<'a, Result<(), L2Error>>;
    /// Retires every variant of a URI on every instance: the generation of
    /// each of its `primaries` (one per scheme) moves on (so no fill under
    /// way stores the old answer) and the instances are told, once.
    fn invalidate<'a>(
        &'a self,
        primaries: &'a [PrimaryKey],
        uri: &'a UriKey,
    ) -> BoxFuture<'a, Result<(), L2Error>>;
    /// Records a ban for every instance (those connected later read it
    /// too) and broadcasts it.
    fn publish_ban<'a>(&'a self, ban: &'a Ban) -> BoxFuture<'a, Result<(), L2Error>>;
    /// The No-Vary-Search rule an instance recorded for the path `scope`
    /// (`PathScope::digest`), as `NoVarySearch::record` wrote it, or `-`
    /// for none; `Ok(None)` when nothing is recorded.
    fn read_path_rule(&self, _scope: Digest) -> BoxFuture<'_, Result<Option<String>, L2Error>> {
        Box::pin(async { Ok(None) })
    }
    /// Records the rule the origin gave `scope` for every instance.
    fn write_path_rule(
        &self,
        _scope: Digest,
        _record: String,
    ) -> BoxFuture<'_, Result<(), L2Error>> {
        Box::pin(async { Ok(()) })
    }
    /// The lease holder's end of the stream that relays its answer's body
    /// to the waiting instances as it arrives (`cluster::stream`); `None`
    /// where there is none.
    fn stream_writer(&self, _keys: &Keys, _lease: &str) -> Option<StreamWriter> {
        None
    }
    /// A waiting instance's read of the stream of the lease held now;
    /// `None` where there is none (the waiter reads L2 when it is written).
    fn stream_reader<'a>(
        &'a self,
        _keys: &'a Keys,
        _stamp: u64,
    ) -> BoxFuture<'a, Option<StreamReader>> {
        Box::pin(async { None })
    }
    /// Announces how a fill ended to the variant's waiters.
    fn publish<'a>(
        &'a self,
        keys: &'a Keys,
        notice: FillNotice,
    ) -> BoxFuture<'a, Result<(), L2Error>>;
}
