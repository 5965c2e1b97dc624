//! L2: the cache every instance shares, in Redis (or Valkey). Entries are
//! versioned binary envelopes with a Redis TTL of freshness plus the largest
//! stale window. The key layout, scripts and notices are in `protocol.rs`.
//! A corrupt value is a miss, never a client error. Every record another
//! instance reads is sealed with the fleet's key (`trust.rs`) and checked
//! before it is decoded: one that does not verify is a miss too.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use corral_core::callers::peer_auth::Record;
use corral_core::wire::envelope;
use corral_core::{Backoff, Coding, Digest, Identity, PrimaryKey, StoredResponse, UriKey, Vary};
use futures_util::future::BoxFuture;
use http::header::HeaderName;

use crate::cluster::lease;
use crate::cluster::protocol::{
    CODING_KEEP, CODING_READ_OR_CLAIM, ClusterNotice, FillNotice, INVALIDATE, Keys, LOG_MAX_LEN,
    LOG_NOTICE, Layout, READ_OR_LEASE, RECORD_TTL, RULE_TTL, STORE, STORE_HANDOFF,
    fill_notice_payload, lease_token, millis,
};
use crate::cluster::redis_link::{L2Error, RedisLink, arg};
use crate::cluster::stream::{StreamReader, StreamWriter, Streams};
use crate::cluster::subscriber::{NoticeWatch, Subscriber};
use crate::cluster::tier::{HeldLease, KeptCoding, Notices, Probe, ProbeAndLease, SharedTier};
use crate::cluster::trust::Trust;
use crate::config::RedisConfig;

/// What one probe reads: entry, Vary record, pass marker, lease,
/// generation, back-off.
type Row = (
    Option<Vec<u8>>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<u64>,
    Option<String>,
);

/// A [`Row`] and the lease [`READ_OR_LEASE`] wrote, if it took it.
type ProbeRow = (
    Option<Vec<u8>>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<u64>,
    Option<String>,
    Option<String>,
);

/// The shared store.
pub struct L2 {
    pub link: Arc<RedisLink>,
    pub subscriber: Arc<Subscriber>,
    layout: Layout,
    pub max_object_size: u64,
    pub lease_ttl: Duration,
    /// A lease's life past its last renewal (`redis.lease_window`).
    pub lease_window: Duration,
    /// Values that failed to decode (corrupt or another version).
    pub corrupt: AtomicU64,
    /// Seals what this instance writes, checks what it reads.
    trust: Arc<Trust>,
    /// Fills' bodies relayed to the waiting instances as they arrive.
    streams: Arc<Streams>,
}

impl L2 {
    /// Connects in the background; `on_notice` receives every
    /// [`ClusterNotice`], from any instance.
    pub fn start(
        config: &RedisConfig,
        on_notice: Box<dyn Fn(ClusterNotice) + Send + Sync>,
    ) -> Result<Arc<Self>, redis::RedisError> {
        let link = RedisLink::new(config)?;
        link.start();
        let layout = Layout::new(&config.key_prefix);
        let trust = Arc::new(Trust::new(config.auth.clone()));
        if !trust.enabled() {
            tracing::warn!(
                "redis.auth: none: entries, heartbeats and purges read from Redis are not authenticated; whoever can write to it can plant answers"
            );
        }
        let subscriber =
            Subscriber::start(Arc::clone(&link), &layout, Arc::clone(&trust), on_notice);
        let streams = Streams::new(Arc::clone(&link), Arc::clone(&trust));
        Ok(Arc::new(L2 {
            streams,
            link,
            subscriber,
            layout,
            max_object_size: config.l2_max_object_size,
            lease_ttl: config.lease_ttl,
            lease_window: config.lease_window,
            corrupt: AtomicU64::new(0),
            trust,
        }))
    }

    /// The keys of `variant` of `primary`, for a caller with `identity`.
    pub fn keys(
        &self,
        primary: &PrimaryKey,
        variant: Digest,
        identity: Option<&corral_core::Identity>,
    ) -> Keys {
        self.layout.keys(primary, variant, identity)
    }

    /// Reads entry, Vary record, pass marker, lease, generation and back-off
    /// at once.
    pub async fn probe(&self, keys: &Keys, generation_stamp: u64) -> Result<Probe, L2Error> {
        let mut cmd = redis::cmd("MGET");
        cmd.arg(keys.entry())
            .arg(keys.vary())
            .arg(keys.pass())
            .arg(keys.lease())
            .arg(keys.generation())
            .arg(keys.backoff());
        let row: Row = self.link.query(&cmd).await?;
        Ok(self.decode_probe(keys, row, generation_stamp))
    }

    /// The first read of a fill with its lease attempt, in one round trip
    /// ([`READ_OR_LEASE`]): the lease is taken when nothing usable can be
    /// there (`with_entry`: even if an entry is, which the caller judges).
    pub async fn probe_or_acquire(
        &self,
        keys: &Keys,
        generation_stamp: u64,
        with_entry: bool,
    ) -> Result<(Probe, Option<lease::Lease>), L2Error> {
        let (entry, vary, pass, lease, generation, backoff, won): ProbeRow = self
            .link
            .script(
                &READ_OR_LEASE,
                &[
                    &keys.entry(),
                    &keys.vary(),
                    &keys.pass(),
                    &keys.lease(),
                    &keys.generation(),
                    &keys.backoff(),
                ],
                &[
                    arg(lease_token()),
                    arg(millis(self.lease_window)),
                    arg(if with_entry { "1" } else { "0" }),
                ],
            )
            .await?;
        let probe = self.decode_probe(
            keys,
            (entry, vary, pass, lease, generation, backoff),
            generation_stamp,
        );
        let held = won.map(|value| {
            lease::Lease::won(&self.link, keys.lease(), value, self.lease_window)
                .pinging(self.notice_cmd(keys, FillNotice::Alive))
        });
        Ok((probe, held))
    }

    /// A probe's values, each checked against its seal before decoding.
    fn decode_probe(&self, keys: &Keys, row: Row, generation_stamp: u64) -> Probe {
        let (entry, vary, pass, lease, generation, backoff) = row;
        let entry_key = keys.entry();
        // Nothing of a record is decoded before its tag verifies.
        let entry = entry.and_then(|sealed| {
            let bytes = self.trust.open(Record::Entry, &entry_key, &sealed)?;
            self.decode_entry(&entry_key, bytes, generation_stamp)
        });
        let vary = vary.and_then(|v| {
            let v = self.trust.open_text(Record::Vary, &keys.vary(), &v)?;
            Some(parse_vary(v))
        });
        let backoff = backoff.and_then(|b| {
            let b = self.trust.open_text(Record::Backoff, &keys.backoff(), &b)?;
            corral_core::Backoff::decode(b).map(|b| corral_core::Backoff {
                until: self.link.clock_shift().to_local(b.until),
                ..b
            })
        });
        Probe {
            entry,
            vary,
            pass: pass.is_some(),
            lease_held: lease.is_some(),
            lease,
            generation: generation.unwrap_or(0),
            backoff,
        }
    }

    /// An envelope whose tag verified; a corrupt one is a miss.
    fn decode_entry(
        &self,
        key: &str,
        bytes: &[u8],
        generation_stamp: u64,
    ) -> Option<StoredResponse> {
        // The writer's instants were moved onto Redis's clock: onto this
        // host's now.
        match envelope::decode_shifted(bytes, generation_stamp, self.link.clock_shift()) {
            // A large body is answered with sendfile from a sealed memory
            // file, as when it was filled here.
            Ok(e) => Some(e.map_body(crate::sealed::seal_or_keep)),
            Err(err) => {
                self.corrupt.fetch_add(1, Ordering::Relaxed);
                crate::telemetry::metrics::l2(crate::telemetry::metrics::L2Read::Corrupt);
                tracing::warn!(key, error = %err, "unreadable L2 entry treated as a miss");
                None
            }
        }
    }

    /// Shares a key's back-off with every instance, for as long as it is
    /// worth remembering (`keep` past its end).
    pub async fn set_backoff(
        &self,
        keys: &Keys,
        backoff: &corral_core::Backoff,
        keep: Duration,
        now: SystemTime,
    ) -> Result<(), L2Error> {
        let ttl = backoff.remaining(now) + keep;
        let mut cmd = redis::cmd("SET");
        let shared = corral_core::Backoff {
            until: self.link.clock_shift().to_shared(backoff.until),
            ..*backoff
        };
        let sealed = self
            .trust
            .seal_text(Record::Backoff, &keys.backoff(), &shared.encode());
        cmd.arg(keys.backoff())
            .arg(sealed)
            .arg("PX")
            .arg(millis(ttl));
        self.link.query::<()>(&cmd).await
    }

    /// The origin answered for the key: its back-off ends everywhere.
    pub async fn clear_backoff(&self, keys: &Keys) -> Result<(), L2Error> {
        let mut cmd = redis::cmd("DEL");
        cmd.arg(keys.backoff());
        self.link.query::<()>(&cmd).await
    }

    /// Writes an entry unless the URI was invalidated after `generation`
    /// was read. Bodies over `l2_max_object_size` stay in L1 only.
    pub async fn store(
        &self,
        keys: &Keys,
        entry: &StoredResponse,
        generation: u64,
        now: SystemTime,
    ) -> Result<bool, L2Error> {
        if entry.body().len() as u64 > self.max_object_size {
            return Ok(false);
        }
        let ttl = entry.residency(now);
        if ttl.is_zero() {
            return Ok(false);
        }
        // On Redis's clock, for instances whose own clocks disagree with
        // this one's.
        let bytes = envelope::encode_shifted(entry, self.link.clock_shift());
        if bytes.is_empty() {
            // Too big for the envelope's fields: L1 only.
            return Ok(false);
        }
        let entry_key = keys.entry();
        let sealed = self.trust.seal(Record::Entry, &entry_key, &bytes);
        let vary = self
            .trust
            .seal_text(Record::Vary, &keys.vary(), &vary_record(entry.vary()));
        let record_keys = [
            entry_key.as_str(),
            &keys.generation(),
            &keys.vary(),
            &keys.variants(),
        ];
        let args = |px: Duration| {
            vec![
                sealed.clone(),
                arg(generation),
                arg(millis(px)),
                arg(&vary),
                arg(keys.variant()),
                arg(millis(RECORD_TTL)),
            ]
        };
        // Redis refused a write moments ago because it is full: the entry
        // is not sent to be refused again, only handed off.
        if !self.link.writes_paused() {
            match self
                .link
                .script::<i64>(&STORE, &record_keys, &args(ttl))
                .await
            {
                Ok(stored) => return Ok(stored == 1),
                Err(e) if e.is_full() => {}
                Err(e) => return Err(e),
            }
        }
        // Full: the entry is handed off to the instances waiting on this
        // fill for `lease_ttl` (written under `allow-oom`), so a full Redis
        // still costs the origin one request per key; it then lapses, and
        // this instance's L1 keeps it for its whole life.
        let handoff = ttl.min(self.lease_ttl);
        let stored: i64 = self
            .link
            .script(&STORE_HANDOFF, &record_keys, &args(handoff))
            .await?;
        Ok(stored == 1)
    }

    /// Remembers the URI as uncacheable, for callers of this pass scope, on
    /// every instance.
    /// Keeps `packed`, the body whose SHA-256 is `body` in `coding`, for
    /// the other instances, as long as its entry (`ttl`), sealed under its
    /// key with the body's digest in front, and ends the claim on making
    /// it. A new entry for the variant, or its invalidation, deletes it.
    pub async fn write_coding(
        &self,
        keys: &Keys,
        coding: Coding,
        body: [u8; 32],
        packed: &[u8],
        ttl: Duration,
    ) -> Result<(), L2Error> {
        if ttl.is_zero() || packed.len() as u64 > self.max_object_size {
            // Not kept: the others need not wait for it.
            return self.end_coding_claim(keys, coding).await;
        }
        let (key, claim) = (
            keys.coding(coding.as_str()),
            keys.coding_claim(coding.as_str()),
        );
        let mut record = Vec::with_capacity(body.len() + packed.len());
        record.extend_from_slice(&body);
        record.extend_from_slice(packed);
        let sealed = self.trust.seal(Record::Coding, &key, &record);
        self.link
            .script::<i64>(&CODING_KEEP, &[&key, &claim], &[sealed, arg(millis(ttl))])
            .await
            .map(drop)
    }

    /// Ends the claim on making `coding` ([`CODING_READ_OR_CLAIM`]), which
    /// this instance will not make (or keep): the others make it at their
    /// next read instead of waiting out the claim's life.
    pub async fn end_coding_claim(&self, keys: &Keys, coding: Coding) -> Result<(), L2Error> {
        let mut cmd = redis::cmd("DEL");
        cmd.arg(keys.coding_claim(coding.as_str()));
        self.link.query::<()>(&cmd).await
    }

    /// The body whose SHA-256 is `body` in `coding`, if an instance kept
    /// it; else a claim on making it, for `claim` (see
    /// [`CODING_READ_OR_CLAIM`]). A record whose seal does not verify, or
    /// that encodes another body (an older answer's), is none: this
    /// instance makes its own.
    pub async fn read_or_claim_coding(
        &self,
        keys: &Keys,
        coding: Coding,
        body: [u8; 32],
        claim: Duration,
    ) -> Result<KeptCoding, L2Error> {
        let key = keys.coding(coding.as_str());
        let (found, sealed): (i64, Vec<u8>) = self
            .link
            .script(
                &CODING_READ_OR_CLAIM,
                &[&key, &keys.coding_claim(coding.as_str())],
                &[arg(lease_token()), arg(millis(claim))],
            )
            .await?;
        Ok(match found {
            1 => match self.trust.open(Record::Coding, &key, &sealed) {
                Some(record) => match record.split_at_checked(body.len()) {
                    Some((of, packed)) if of == body => {
                        KeptCoding::Found(Bytes::copy_from_slice(packed))
                    }
                    _ => KeptCoding::Make,
                },
                None => KeptCoding::Make,
            },
            2 => KeptCoding::Make,
            _ => KeptCoding::Busy,
        })
    }

    pub async fn mark_pass(&self, keys: &Keys, duration: Duration) -> Result<(), L2Error> {
        if duration.is_zero() {
            return Ok(());
        }
        let mut cmd = redis::cmd("SET");
        cmd.arg(keys.pass())
            .arg("1")
            .arg("PX")
            .arg(millis(duration));
        self.link.query::<()>(&cmd).await
    }

    /// Announces how a fill ended to the waiters on other instances.
    /// On a Cluster, a sharded channel: the notice goes to the node that
    /// owns the key's slot (and its replicas), not across the cluster bus.
    pub async fn publish(&self, keys: &Keys, notice: FillNotice) -> Result<(), L2Error> {
        match self.notice_cmd(keys, notice) {
            Some(cmd) => self.link.query::<()>(&cmd).await,
            None => Ok(()),
        }
    }

    /// The command that announces `notice` for the variant of `keys`: on
    /// its URI's notice channel, naming the variant, sealed under its name
    /// (a notice that does not verify wakes nobody: one that anyone could
    /// publish would send every waiting instance to the origin). `None`
    /// on a Cluster without sharded pub/sub: nobody listens there, and
    /// waiters read at the end of each lease window instead.
    fn notice_cmd(&self, keys: &Keys, notice: FillNotice) -> Option<redis::Cmd> {
        let mut cmd = match (self.link.is_cluster(), self.link.sharded()) {
            (false, _) => redis::cmd("PUBLISH"),
            (true, true) => redis::cmd("SPUBLISH"),
            (true, false) => return None,
        };
        let name = keys.fill_channel();
        let sealed = self.trust.seal_text(Record::Notice, &name, notice.encode());
        cmd.arg(keys.notice_channel())
            .arg(fill_notice_payload(&name, &sealed));
        Some(cmd)
    }

    /// Registers a waiter for the variant's fill notices (in this process:
    /// the subscription itself is long-lived).
    pub fn watch(&self, keys: &Keys) -> NoticeWatch {
        self.subscriber.watch(keys.fill_channel())
    }

    /// Records a ban (for instances that connect later) and broadcasts it.
    pub async fn publish_ban(&self, ban: &corral_core::Ban) -> Result<(), L2Error> {
        // The ban's instant on Redis's clock: entries produced before it on
        // any instance are banned, whatever the clock of the one purging.
        let shared = corral_core::Ban {
            at: self.link.clock_shift().to_shared(ban.at),
            ..ban.clone()
        };
        let wire = self.seal_notice(&ClusterNotice::Ban(shared));
        let mut pipe = redis::cmd("HSET");
        pipe.arg(self.bans_key()).arg(&wire).arg(1);
        self.link.query::<()>(&pipe).await?;
        let mut exp = redis::cmd("PEXPIRE");
        exp.arg(self.bans_key()).arg(millis(RECORD_TTL));
        self.link.query::<()>(&exp).await?;
        self.log_notice(&wire).await
    }

    /// `notice` as every instance checks it: sealed under the invalidation
    /// channel's name, whichever way it travels (channel, log, bans hash).
    fn seal_notice(&self, notice: &ClusterNotice) -> String {
        self.trust.seal_text(
            Record::Notice,
            &self.layout.invalidate_channel(),
            &notice.encode(),
        )
    }

    /// Appends `notice` (sealed) to the invalidation log and publishes it with its
    /// log id, in one script: an instance that misses the publication
    /// finds it in the log when it resubscribes.
    async fn log_notice(&self, notice: &str) -> Result<(), L2Error> {
        let epoch = format!("{:032x}", rand::random::<u128>());
        let _: String = self
            .link
            .script(
                &LOG_NOTICE,
                &[&self.layout.log_key(), &self.layout.epoch_key()],
                &[
                    arg(notice),
                    arg(self.layout.invalidate_channel()),
                    arg(epoch),
                    arg(LOG_MAX_LEN),
                    arg(millis(RECORD_TTL)),
                ],
            )
            .await?;
        Ok(())
    }

    fn bans_key(&self) -> String {
        self.layout.bans_key()
    }

    /// Deletes every stored variant of each of `primaries` (the keys of one
    /// URI: one per scheme) and tells every instance, once, to drop `uri`
    /// from its L1.
    pub async fn invalidate(&self, primaries: &[PrimaryKey], uri: &UriKey) -> Result<(), L2Error> {
        for primary in primaries {
            let keys = self.keys(primary, Digest([0; 32]), None);
            let entry_prefix = keys.entry_prefix();
            let _: i64 = self
                .link
                .script(
                    &INVALIDATE,
                    &[&keys.generation(), &keys.variants()],
                    &[arg(&entry_prefix), arg(millis(RECORD_TTL))],
                )
                .await?;
        }
        self.log_notice(&self.seal_notice(&ClusterNotice::Invalidate(uri.digest())))
            .await
    }
}

/// `-` for no Vary, `*` for Vary: *, else the names joined by commas.
impl SharedTier for L2 {
    fn keys(&self, primary: &PrimaryKey, variant: Digest, identity: Option<&Identity>) -> Keys {
        L2::keys(self, primary, variant, identity)
    }
    fn stream_writer(&self, keys: &Keys, lease: &str) -> Option<StreamWriter> {
        Some(self.streams.writer(keys, lease))
    }
    fn stream_reader<'a>(
        &'a self,
        keys: &'a Keys,
        stamp: u64,
    ) -> BoxFuture<'a, Option<StreamReader>> {
        Box::pin(self.streams.reader(keys, stamp))
    }
    fn max_object_size(&self) -> u64 {
        self.max_object_size
    }
    fn unavailable(&self, primary: &PrimaryKey) -> bool {
        if !self.link.is_cluster() {
            return self.link.unavailable_for("");
        }
        // Every key of a URI shares its hash tag: the entry key names its
        // slot as well as any.
        let keys = self.layout.keys(primary, Digest([0; 32]), None);
        self.link.unavailable_for(&keys.entry())
    }
    fn probe<'a>(&'a self, keys: &'a Keys, stamp: u64) -> BoxFuture<'a, Result<Probe, L2Error>> {
        Box::pin(L2::probe(self, keys, stamp))
    }
    fn probe_or_acquire<'a>(
        &'a self,
        keys: &'a Keys,
        stamp: u64,
        with_entry: bool,
    ) -> BoxFuture<'a, Result<ProbeAndLease, L2Error>> {
        Box::pin(async move {
            let (probe, lease) = L2::probe_or_acquire(self, keys, stamp, with_entry).await?;
            Ok((probe, lease.map(|l| Box::new(l) as Box<dyn HeldLease>)))
        })
    }
    fn lease_window(&self) -> Duration {
        self.lease_window
    }
    fn acquire<'a>(
        &'a self,
        keys: &'a Keys,
    ) -> BoxFuture<'a, Result<Option<Box<dyn HeldLease>>, L2Error>> {
        Box::pin(async move {
            let lease = lease::acquire(&self.link, keys.lease(), self.lease_window).await?;
            let ping = self.notice_cmd(keys, FillNotice::Alive);
            Ok(lease.map(|l| Box::new(l.pinging(ping)) as Box<dyn HeldLease>))
        })
    }
    fn take_over<'a>(
        &'a self,
        keys: &'a Keys,
        seen: &'a str,
    ) -> BoxFuture<'a, Result<Option<Box<dyn HeldLease>>, L2Error>> {
        Box::pin(async move {
            let lease = lease::take_over(&self.link, keys.lease(), seen, self.lease_window).await?;
            let ping = self.notice_cmd(keys, FillNotice::Alive);
            Ok(lease.map(|l| Box::new(l.pinging(ping)) as Box<dyn HeldLease>))
        })
    }
    fn lease_age<'a>(
        &'a self,
        keys: &'a Keys,
    ) -> BoxFuture<'a, Result<Option<(String, Duration)>, L2Error>> {
        Box::pin(async move { lease::age(&self.link, &keys.lease()).await })
    }
    fn watch<'a>(&'a self, keys: &'a Keys) -> BoxFuture<'a, Box<dyn Notices>> {
        Box::pin(async move { Box::new(L2::watch(self, keys)) as Box<dyn Notices> })
    }
    fn write_entry<'a>(
        &'a self,
        keys: &'a Keys,
        entry: &'a StoredResponse,
        generation: u64,
        now: SystemTime,
    ) -> BoxFuture<'a, Result<bool, L2Error>> {
        Box::pin(L2::store(self, keys, entry, generation, now))
    }
    fn write_pass<'a>(
        &'a self,
        keys: &'a Keys,
        duration: Duration,
    ) -> BoxFuture<'a, Result<(), L2Error>> {
        Box::pin(L2::mark_pass(self, keys, duration))
    }
    fn write_coding<'a>(
        &'a self,
        keys: &'a Keys,
        coding: Coding,
        body: [u8; 32],
        packed: &'a [u8],
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), L2Error>> {
        Box::pin(L2::write_coding(self, keys, coding, body, packed, ttl))
    }
    fn end_coding_claim<'a>(
        &'a self,
        keys: &'a Keys,
        coding: Coding,
    ) -> BoxFuture<'a, Result<(), L2Error>> {
        Box::pin(L2::end_coding_claim(self, keys, coding))
    }
    fn read_or_claim_coding<'a>(
        &'a self,
        keys: &'a Keys,
        coding: Coding,
        body: [u8; 32],
        claim: Duration,
    ) -> BoxFuture<'a, Result<KeptCoding, L2Error>> {
        Box::pin(L2::read_or_claim_coding(self, keys, coding, body, claim))
    }
    fn write_backoff<'a>(
        &'a self,
        keys: &'a Keys,
        backoff: &'a Backoff,
        keep: Duration,
        now: SystemTime,
    ) -> BoxFuture<'a, Result<(), L2Error>> {
        Box::pin(L2::set_backoff(self, keys, backoff, keep, now))
    }
    fn delete_backoff<'a>(&'a self, keys: &'a Keys) -> BoxFuture<'a, Result<(), L2Error>> {
        Box::pin(L2::clear_backoff(self, keys))
    }
    fn invalidate<'a>(
        &'a self,
        primaries: &'a [PrimaryKey],
        uri: &'a UriKey,
    ) -> BoxFuture<'a, Result<(), L2Error>> {
        Box::pin(L2::invalidate(self, primaries, uri))
    }
    fn publish_ban<'a>(&'a self, ban: &'a corral_core::Ban) -> BoxFuture<'a, Result<(), L2Error>> {
        Box::pin(L2::publish_ban(self, ban))
    }
    fn publish<'a>(
        &'a self,
        keys: &'a Keys,
        notice: FillNotice,
    ) -> BoxFuture<'a, Result<(), L2Error>> {
        Box::pin(L2::publish(self, keys, notice))
    }

    fn read_path_rule(&self, scope: Digest) -> BoxFuture<'_, Result<Option<String>, L2Error>> {
        Box::pin(async move {
            let key = self.layout.rule_key(scope);
            let mut cmd = redis::cmd("GET");
            cmd.arg(&key);
            let sealed = self.link.query::<Option<String>>(&cmd).await?;
            Ok(sealed.and_then(|r| {
                self.trust
                    .open_text(Record::PathRule, &key, &r)
                    .map(str::to_owned)
            }))
        })
    }

    fn write_path_rule(&self, scope: Digest, record: String) -> BoxFuture<'_, Result<(), L2Error>> {
        Box::pin(async move {
            // Paused while Redis refuses writes for want of memory.
            if self.link.writes_paused() {
                return Ok(());
            }
            let key = self.layout.rule_key(scope);
            let sealed = self.trust.seal_text(Record::PathRule, &key, &record);
            let mut cmd = redis::cmd("SET");
            cmd.arg(&key).arg(sealed).arg("PX").arg(millis(RULE_TTL));
            self.link.query::<()>(&cmd).await
        })
    }
}

/// The most instances a fleet view reads.
pub const FLEET_MAX: usize = 256;

/// The largest heartbeat (sealed summary) written or read: a few KiB hold
/// an instance's summary with dozens of routes. Larger ones are skipped
/// unread, so one forged heartbeat cannot make every fleet view (at most
/// [`FLEET_MAX`] of them, 2 MiB in all) heavy, nor tie up the Redis link.
pub const HEARTBEAT_MAX_BYTES: usize = 8 * 1024;

/// The longest instance name on the roll (host name and process id).
pub const INSTANCE_NAME_MAX: usize = 255;

/// Writes a heartbeat and enrols its instance on the roll (scored by when
/// it lapses, on Redis's clock: an instance whose wall clock is off is
/// neither dropped early nor kept late), dropping those that lapsed:
/// KEYS[1] the roll, KEYS[2] the heartbeat; ARGV: instance, summary,
/// lifetime in ms. Returns Redis's clock, in ms, which the instance
/// measures its own against.
static HEARTBEAT: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        r"local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('ZADD', KEYS[1], string.format('%d', now + tonumber(ARGV[3])), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%d', now))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return now",
    )
});

/// The live names on the roll (KEYS[1]) now (Redis's clock), at most
/// `ARGV[1]` of them, each shorter than `ARGV[2]` bytes: a forged name of
/// any size never leaves Redis.
static ROLL: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        r"local t = redis.call('TIME')
local now = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
local out = {}
for _, n in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf', 'LIMIT', 0, ARGV[1])) do
  if #n <= tonumber(ARGV[2]) then out[#out + 1] = n end
end
return out",
    )
});

/// Each heartbeat of KEYS whose length is at most `ARGV[1]` bytes, else
/// `false` (as for a missing one): an oversized value is measured with
/// STRLEN, never sent.
static BEATS: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        r"local out = {}
for i, k in ipairs(KEYS) do
  if redis.call('STRLEN', k) <= tonumber(ARGV[1]) then
    out[i] = redis.call('GET', k) or false
  else
    out[i] = -1
  end
end
return out",
    )
});

impl L2 {
    /// Publishes this instance's summary for `ttl`: the fleet view lists
    /// it until then. The view is best effort: while Redis cannot be used
    /// (not connected, or the breaker of its slot open) nothing is sent,
    /// so a heartbeat never counts toward a breaker the cache relies on.
    /// A summary that would seal to more than [`HEARTBEAT_MAX_BYTES`] is
    /// not sent (the others would skip it): `Ok(false)`.
    pub async fn heartbeat(
        &self,
        instance: &str,
        summary: &str,
        ttl: Duration,
    ) -> Result<bool, L2Error> {
        let roll = self.layout.fleet_key();
        if self.link.unavailable_for(&roll) {
            return Ok(true);
        }
        let sealed = self.trust.seal_text(Record::Heartbeat, instance, summary);
        if sealed.len() > HEARTBEAT_MAX_BYTES || instance.len() > INSTANCE_NAME_MAX {
            return Ok(false);
        }
        let beat = self.layout.heartbeat_key(instance);
        let sent = SystemTime::now();
        let redis_now = self
            .link
            .script::<u64>(
                &HEARTBEAT,
                &[&roll, &beat],
                &[arg(instance), arg(sealed), arg(millis(ttl))],
            )
            .await?;
        self.link.observe_clock(redis_now, sent, SystemTime::now());
        Ok(true)
    }

    /// The live heartbeats (at most [`FLEET_MAX`], each at most
    /// [`HEARTBEAT_MAX_BYTES`] and sealed by this fleet's key; others are
    /// skipped unparsed), as their instances wrote them; `None` while
    /// Redis cannot be used (see [`L2::heartbeat`]).
    pub async fn fleet(&self) -> Result<Option<Vec<String>>, L2Error> {
        let roll = self.layout.fleet_key();
        if self.link.unavailable_for(&roll) {
            return Ok(None);
        }
        let names: Vec<String> = self
            .link
            .script(&ROLL, &[&roll], &[arg(FLEET_MAX), arg(INSTANCE_NAME_MAX)])
            .await?;
        if names.is_empty() {
            return Ok(Some(Vec::new()));
        }
        let keys: Vec<String> = names.iter().map(|n| self.layout.heartbeat_key(n)).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let beats: Vec<redis::Value> = self
            .link
            .script(&BEATS, &keys, &[arg(HEARTBEAT_MAX_BYTES)])
            .await?;
        let mut out = Vec::with_capacity(names.len());
        for (name, beat) in names.iter().zip(beats) {
            match beat {
                redis::Value::BulkString(bytes) => {
                    let Ok(text) = std::str::from_utf8(&bytes) else {
                        self.trust.skipped(Record::Heartbeat, name, "not UTF-8");
                        continue;
                    };
                    if let Some(summary) = self.trust.open_text(Record::Heartbeat, name, text) {
                        out.push(summary.to_owned());
                    }
                }
                redis::Value::Int(_) => {
                    self.trust
                        .skipped(Record::Heartbeat, name, "over the heartbeat size bound");
                }
                // Lapsed between the two reads.
                _ => {}
            }
        }
        Ok(Some(out))
    }
}

fn vary_record(v: &Vary) -> String {
    match v {
        Vary::None => "-".to_owned(),
        Vary::Star => "*".to_owned(),
        Vary::Headers(names) => names
            .iter()
            .map(HeaderName::as_str)
            .collect::<Vec<_>>()
            .join(","),
    }
}

fn parse_vary(s: &str) -> Vary {
    match s {
        "-" | "" => Vary::None,
        "*" => Vary::Star,
        names => {
            let mut v: Vec<HeaderName> = names
                .split(',')
                .filter_map(|n| HeaderName::from_bytes(n.as_bytes()).ok())
                .collect();
            v.sort_unstable_by(|a, b| a.as_str().cmp(b.as_str()));
            v.dedup();
            if v.is_empty() {
                Vary::None
            } else {
                Vary::Headers(v)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vary_records_round_trip() {
        for v in [
            Vary::None,
            Vary::Star,
            Vary::Headers(vec![
                HeaderName::from_static("accept"),
                HeaderName::from_static("accept-encoding"),
            ]),
        ] {
            assert_eq!(parse_vary(&vary_record(&v)), v);
        }
    }
}
