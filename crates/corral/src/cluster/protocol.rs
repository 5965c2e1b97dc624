//! The cluster's Redis wire format, in one place: the key layout of a URI,
//! the Lua scripts, the fill notices sent on a variant's channel and the
//! cluster notices sent on the invalidation channel. Nothing else names a
//! Redis key or builds a payload, so a change to the format is a change to
//! this file and its tests.
//!
//! Every key of one URI shares the Redis Cluster hash tag
//! `{primary digest}`, so entry, lease, pass marker, generation and back-off
//! stay on one shard and one round trip reads them all.

use std::sync::LazyLock;
use std::time::{Duration, UNIX_EPOCH};

use corral_core::{Ban, BanTarget, Digest, Identity, PrimaryKey};
use redis::Script;

/// How long a path's No-Vary-Search record lives in Redis: each stored
/// answer of the path writes it again.
pub const RULE_TTL: Duration = Duration::from_secs(86400);

/// How long generation, variant-set and ban records live.
pub const RECORD_TTL: Duration = Duration::from_secs(8 * 86400);

/// A duration as Redis's `PX` takes it: whole milliseconds, at least 1.
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// `t` as milliseconds since the Unix epoch (0 before it), as the
/// records and scores in Redis carry time.
pub fn epoch_millis(t: std::time::SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The names under one `key_prefix`.
#[derive(Debug, Clone)]
pub struct Layout {
    prefix: String,
}

impl Layout {
    pub fn new(prefix: &str) -> Self {
        Layout {
            prefix: prefix.to_owned(),
        }
    }

    /// The channel every [`ClusterNotice`] is published on.
    pub fn invalidate_channel(&self) -> String {
        format!("{}invalidate", self.prefix)
    }

    /// The invalidation log: a Stream of every [`ClusterNotice`] published,
    /// which an instance that lost its subscription replays from where it
    /// was. It shares a hash tag with [`Layout::epoch_key`], so one script
    /// reads both on a Cluster.
    pub fn log_key(&self) -> String {
        format!("{}{{log}}:stream", self.prefix)
    }

    /// A random value set once by whichever instance finds it missing: a
    /// Redis that lost its data (restarted without persistence, flushed)
    /// lost it too, and with it the log's history.
    pub fn epoch_key(&self) -> String {
        format!("{}{{log}}:epoch", self.prefix)
    }

    /// The hash of bans in force, replayed by an instance that (re)connects.
    pub fn bans_key(&self) -> String {
        format!("{}bans", self.prefix)
    }

    /// The GCRA state of one counted caller of one limit: `digest` names
    /// route, limit and caller, so no caller-chosen text reaches a key, and
    /// it is the hash tag (one key per script call: any Cluster slot).
    pub fn rate_key(&self, digest: &str) -> String {
        format!("{}rl:{{{digest}}}", self.prefix)
    }

    /// The slots of one route's `upstream_concurrency`: a sorted set of
    /// holders scored by when their slot lapses.
    pub fn slots_key(&self, route: &str) -> String {
        format!("{}slots:{{{route}}}", self.prefix)
    }

    /// One path's No-Vary-Search rule (`PathScope::digest`), as the last
    /// answer of the path that an instance stored said it: its own hash
    /// tag (any slot), read with one GET.
    pub fn rule_key(&self, scope: Digest) -> String {
        format!("{}{{{}}}:nvs", self.prefix, scope.to_hex())
    }

    /// The fleet's roll: a sorted set of instance names scored by when
    /// their heartbeat lapses (milliseconds since the epoch). It shares a
    /// hash tag with [`Layout::heartbeat_key`], so one MGET reads every
    /// heartbeat on a Cluster.
    pub fn fleet_key(&self) -> String {
        format!("{}{{fleet}}:members", self.prefix)
    }

    /// One instance's last heartbeat: its summary, as `/stats` gives it.
    pub fn heartbeat_key(&self, instance: &str) -> String {
        format!("{}{{fleet}}:i:{instance}", self.prefix)
    }

    /// One of the [`NOTICE_SHARDS`] channels fill notices travel on.
    /// Every instance subscribes to all of them once, when it connects,
    /// and keeps them: a fill costs no SUBSCRIBE or UNSUBSCRIBE. Each is
    /// its own hash tag, so on a Cluster the shards spread over the
    /// primaries (sharded pub/sub: a notice goes to the node that owns its
    /// channel and its replicas, never across the cluster bus).
    pub fn notice_channel(&self, shard: usize) -> String {
        format!("{}{{notice:{shard}}}", self.prefix)
    }

    /// Every notice channel, in shard order.
    pub fn notice_channels(&self) -> Vec<String> {
        (0..NOTICE_SHARDS).map(|s| self.notice_channel(s)).collect()
    }

    /// The keys of one variant of `primary`, for the caller `identity`.
    pub fn keys(&self, primary: &PrimaryKey, variant: Digest, identity: Option<&Identity>) -> Keys {
        let digest = primary.digest();
        Keys {
            notice: self.notice_channel(usize::from(digest.0[0]) % NOTICE_SHARDS),
            tag: format!("{}{{{}}}", self.prefix, digest.to_hex()),
            variant: variant.to_hex(),
            pass_scope: match identity {
                None => String::new(),
                Some(id) => format!(":{}", primary.pass_scope(Some(id)).to_hex()),
            },
        }
    }
}

/// How many channels carry the fleet's fill notices (see
/// [`Layout::notice_channel`]): a URI's notices go on the one its digest
/// picks.
pub const NOTICE_SHARDS: usize = 16;

/// The Redis keys of one variant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    /// The notice channel of this URI's shard.
    notice: String,
    tag: String,
    variant: String,
    /// The pass marker's suffix: empty for anonymous callers, the pass
    /// scope for an identified one (see `PrimaryKey::pass_scope`).
    pass_scope: String,
}

impl Keys {
    pub fn entry(&self) -> String {
        format!("{}:e:{}", self.tag, self.variant)
    }
    /// The variant's name in the URI's variant set.
    pub fn variant(&self) -> &str {
        &self.variant
    }
    /// The entry's body in `coding`, made by whichever instance made it
    /// first (see `L2::write_coding`); removed with the entry by
    /// [`INVALIDATE`].
    pub fn coding(&self, coding: &str) -> String {
        format!("{}{CODING_INFIX}{coding}", self.entry())
    }
    /// The claim of the instance making the entry's body in `coding` (see
    /// [`CODING_READ_OR_CLAIM`]); removed with the entry too.
    pub fn coding_claim(&self, coding: &str) -> String {
        format!("{}{CLAIM_SUFFIX}", self.coding(coding))
    }
    /// What every entry key of this URI starts with (for [`INVALIDATE`]).
    pub fn entry_prefix(&self) -> String {
        format!("{}:e:", self.tag)
    }
    pub fn lease(&self) -> String {
        format!("{}:lease:{}", self.tag, self.variant)
    }
    /// The variant's name in a [`FillNotice`]: what the waiters of this
    /// variant register under, and what a notice names.
    pub fn fill_channel(&self) -> String {
        format!("{}:fill:{}", self.tag, self.variant)
    }
    /// The channel this variant's notices are published on.
    pub fn notice_channel(&self) -> &str {
        &self.notice
    }
    pub fn vary(&self) -> String {
        format!("{}:vary", self.tag)
    }
    pub fn generation(&self) -> String {
        format!("{}:gen", self.tag)
    }
    pub fn pass(&self) -> String {
        format!("{}:pass{}", self.tag, self.pass_scope)
    }
    /// Same scope as the pass marker: a caller's failures back off that
    /// caller's fetches only.
    pub fn backoff(&self) -> String {
        format!("{}:backoff{}", self.tag, self.pass_scope)
    }
    pub fn variants(&self) -> String {
        format!("{}:variants", self.tag)
    }
    /// Where the holder of the lease `lease` (its value) relays its
    /// answer's body to the waiting instances (`stream.rs`).
    pub fn stream(&self, lease: &str) -> String {
        format!("{}:stream:{}:{lease}", self.tag, self.variant)
    }
    /// The lease value a waiting instance reads the stream of (set by the
    /// waiters, read by the holder before it relays anything).
    pub fn stream_readers(&self) -> String {
        format!("{}:readers:{}", self.tag, self.variant)
    }
}

/// Stores an entry only if no invalidation happened since its fetch began.
/// KEYS: entry, generation, vary record, variant set. ARGV: envelope,
/// generation read, entry PX, vary record, variant, record PX.
/// A new entry's codings are the old one's no more: they are deleted with
/// it replaced ([`Keys::coding`]; a reader checks the body digest too).
pub static STORE: LazyLock<Script> =
    LazyLock::new(|| Script::new(&format!("{DEL_CODINGS}{STORE_BODY}")));

/// [`STORE`] for a Redis that refused it as full: the same writes under
/// `allow-oom`, given a short PX by the caller (`lease_ttl`), so that the
/// instances waiting on this fill read the answer instead of each asking
/// the origin. What a full Redis holds past `maxmemory` is bounded by the
/// fills under way times their bodies (at most `l2_max_object_size`), for
/// that short while.
pub static STORE_HANDOFF: LazyLock<Script> =
    LazyLock::new(|| Script::new(&format!("{ALLOW_OOM}{DEL_CODINGS}{STORE_BODY}")));

/// What a kept coding's key adds to its entry's ([`Keys::coding`]).
const CODING_INFIX: &str = ":c:";
/// What a coding's claim adds to the coding's key ([`Keys::coding_claim`]).
const CLAIM_SUFFIX: &str = ":m";

/// Reads a kept coding, or claims its making when none is kept, in one
/// round trip, so that instances asking for the same coding at the same
/// moment make it once: one wins the claim and makes it, the others find
/// it claimed and read again later. KEYS: the coding ([`Keys::coding`]),
/// its claim ([`Keys::coding_claim`]). ARGV: the claim's value, its life
/// in ms. Returns `{1, record}` (kept), `{2, ''}` (claimed: this caller
/// makes it) or `{0, ''}` (another instance is making it).
pub static CODING_READ_OR_CLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{ALLOW_OOM}local v = redis.call('GET', KEYS[1])
if v then return {{1, v}} end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return {{2, ''}} end
return {{0, ''}}"
    ))
});

/// Keeps a coding and ends the claim on making it ([`CODING_READ_OR_CLAIM`]).
/// KEYS: the coding, its claim. ARGV: the sealed record, its life in ms.
pub static CODING_KEEP: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('DEL', KEYS[2])
return 1",
    )
});

/// A Lua function for the scripts that replace or retire an entry: it
/// deletes the codings kept beside the entry key `e` ([`Keys::coding`]),
/// one per coding corral makes, and the claims on making them (a test
/// holds it to `Coding::ALL`).
const DEL_CODINGS: &str = r"
local function del_codings(e)
  redis.call('del', e .. ':c:gzip', e .. ':c:br', e .. ':c:zstd',
    e .. ':c:gzip:m', e .. ':c:br:m', e .. ':c:zstd:m')
end
";

const STORE_BODY: &str = r"
local g = tonumber(redis.call('get', KEYS[2]) or '0')
if g ~= tonumber(ARGV[2]) then return 0 end
redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[3])
del_codings(KEYS[1])
redis.call('set', KEYS[3], ARGV[4], 'PX', ARGV[6])
redis.call('sadd', KEYS[4], ARGV[5])
redis.call('pexpire', KEYS[4], ARGV[6])
return 1
";

/// Retires every variant of a URI: bump the generation (so fills under way
/// cannot store), delete the entries and their codings ([`Keys::coding`]). KEYS: generation, variant set. ARGV:
/// entry prefix, record PX.
pub static INVALIDATE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{DEL_CODINGS}
redis.call('incr', KEYS[1])
redis.call('pexpire', KEYS[1], ARGV[2])
local vs = redis.call('smembers', KEYS[2])
for _, v in ipairs(vs) do
  local e = ARGV[1] .. v
  redis.call('del', e)
  del_codings(e)
end
redis.call('del', KEYS[2])
return #vs
"
    ))
});

/// One GCRA decision (`corral_core::callers::rate_limit::Gcra::decide`, the same
/// arithmetic) on Redis's clock, so instances with skewed clocks count
/// alike. ARGV: emission and tolerance in µs. Returns
/// `{allowed, remaining, retry_after_us, reset_us}`. The TAT is written
/// with `%d`: Lua's default number format keeps 14 digits and would round
/// a µs timestamp.
pub static RATE_LIMIT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local e = tonumber(ARGV[1])
local tol = tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or now) or now
if tat < now then tat = now end
local ahead = tat - now
if ahead > tol then return {0, 0, ahead - tol, ahead} end
local nxt = tat + e
redis.call('SET', KEYS[1], string.format('%d', nxt), 'PX', math.ceil((nxt - now) / 1000))
return {1, math.floor((tol - ahead) / e), 0, nxt - now}",
    )
});

/// Gives back one request's step (`ARGV[1]` µs) of a GCRA state, for a
/// request another limit refused. Keeps the key's expiry; a state given
/// back to a full bucket (no earlier request still counted: what a key
/// the refused request created comes back to) is deleted, so a refused
/// request leaves no key behind.
pub static RATE_REFUND: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local tat = tonumber(redis.call('GET', KEYS[1]))
if not tat then return 0 end
local ttl = redis.call('PTTL', KEYS[1])
if ttl <= 0 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local back = tat - tonumber(ARGV[1])
if back <= now then
  redis.call('DEL', KEYS[1])
  return 1
end
redis.call('SET', KEYS[1], string.format('%d', back), 'PX', ttl)
return 1",
    )
});

/// Takes one of `ARGV[1]` slots for holder `ARGV[2]` until `ARGV[3]` ms
/// from now (Redis's clock), dropping holders whose slot lapsed (a crashed
/// instance's). Returns 1 when taken, 0 when all are held.
pub static SLOT_ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
local until_ms = now + tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], string.format('%d', until_ms), ARGV[2])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return 1",
    )
});

/// The first line of every lease script: Redis 7's script flag
/// `allow-oom`, so a Redis at `maxmemory` under `noeviction` (which
/// refuses every other write) still takes, renews and gives back a lease
/// of a few dozen bytes, and a stampede on a full Redis still reaches the
/// origin once per key, not once per instance. Redis and Valkey before 7
/// read the line as Lua and refuse the script; corral needs 7 or newer.
pub const ALLOW_OOM: &str = "#!lua flags=allow-oom\n";

/// Compare-and-delete of a lease: never a plain DEL, so a leader whose
/// lease expired cannot delete its successor's.
pub static LEASE_RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{ALLOW_OOM}if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end",
    ))
});

/// Takes a free lease: `SET NX PX` of the value `<token>.<ms>`, where
/// `<ms>` is Redis's clock (`TIME`) when it was taken, so that a lease's
/// age is one clock's reading against the same clock's, never one host's
/// wall clock against another's. KEYS: lease. ARGV: token, PX. Returns
/// the value written, or nil when another holds the lease.
pub static LEASE_ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{ALLOW_OOM}local t = redis.call('TIME')
local v = ARGV[1] .. '.' .. string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
if redis.call('SET', KEYS[1], v, 'NX', 'PX', ARGV[2]) then return v end
return false",
    ))
});

/// Compare-and-set of a lease whose holder has held it past `lock_age`:
/// exactly one of the instances that saw the same value takes it over,
/// stamped like [`LEASE_ACQUIRE`]. KEYS: lease. ARGV: the value seen,
/// the new token, PX. Returns the value written, or nil.
pub static LEASE_TAKE_OVER: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{ALLOW_OOM}if redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
local t = redis.call('TIME')
local v = ARGV[2] .. '.' .. string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
redis.call('SET', KEYS[1], v, 'PX', ARGV[3])
return v",
    ))
});

/// The first read of a fill and its lease attempt in one round trip: reads
/// entry, Vary record, pass marker, lease, generation and back-off (as
/// `MGET`), and takes the free lease, stamped like [`LEASE_ACQUIRE`],
/// when nothing is there that the caller could use instead: no pass
/// marker, no back-off, and no entry (or, with `ARGV[3]` = `1`, whatever
/// entry: the caller holds a stale copy, so what L2 holds is likely stale
/// too). A waiting instance thus costs Redis the `MGET` inside this
/// script, and its fill's winner takes the lease with the read that
/// proves nothing is stored (no double-check needed). KEYS: entry, vary,
/// pass, lease, generation, back-off. ARGV: token, PX, lease with an
/// entry (`0`/`1`). Returns the six values and the lease written (or
/// false).
pub static READ_OR_LEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{ALLOW_OOM}local r = redis.call('MGET', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
r[7] = false
if r[3] or r[4] or r[6] or (r[1] and ARGV[3] ~= '1') then return r end
local t = redis.call('TIME')
local v = ARGV[1] .. '.' .. string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
redis.call('SET', KEYS[4], v, 'PX', ARGV[2])
r[4] = v
r[7] = v
return r",
    ))
});

/// A lease's value and Redis's clock now, in ms, read together.
/// KEYS: lease. Returns `{value, now}`, or nil when the lease is free.
pub static LEASE_AGE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local v = redis.call('GET', KEYS[1])
if not v then return false end
local t = redis.call('TIME')
return {v, string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))}",
    )
});

/// A new lease's random token; the script that takes the lease appends
/// when (on Redis's clock).
pub fn lease_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// How long the lease with `value` has been held when Redis's clock reads
/// `now_ms`; `None` for a value without a time.
pub fn lease_held(value: &str, now_ms: u64) -> Option<Duration> {
    let (_, ms) = value.rsplit_once('.')?;
    let since: u64 = ms.parse().ok()?;
    Some(Duration::from_millis(now_ms.saturating_sub(since)))
}

/// Compare-and-pexpire of a lease, for the watchdog of a slow fetch.
pub static LEASE_EXTEND: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{ALLOW_OOM}if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end",
    ))
});

/// How many notices the log keeps (about: `XADD MAXLEN ~`). An instance
/// away for longer than it takes to publish half as many does not replay
/// them one by one; it treats the log as lost.
pub const LOG_MAX_LEN: u64 = 10_000;

/// The most notices an instance replays after a gap.
pub const LOG_REPLAY_MAX: u64 = LOG_MAX_LEN / 2;

/// Appends a notice to the log (creating the epoch if Redis has none)
/// and publishes it, prefixed with its log id, in one step: every
/// instance either hears it or finds it in the log. KEYS: log, epoch.
/// ARGV: notice, channel, a new epoch value, max length, log PX.
/// Returns the log id.
pub static LOG_NOTICE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"if not redis.call('GET', KEYS[2]) then redis.call('SET', KEYS[2], ARGV[3]) end
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[4], '*', 'n', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('PUBLISH', ARGV[2], id .. ' ' .. ARGV[1])
return id",
    )
});

/// Where the log stands: its epoch (set to `ARGV[1]` if Redis has none)
/// and the newest entry's id (`0-0` for none). KEYS: epoch, log.
pub static LOG_HEAD: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local e = redis.call('GET', KEYS[1])
if not e then redis.call('SET', KEYS[1], ARGV[1]); e = ARGV[1] end
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local id = '0-0'
if last[1] then id = last[1][1] end
return {e, id}",
    )
});

/// The log after `ARGV[1]`, at most `ARGV[2]` entries, and whether
/// `ARGV[1]` itself is still in it (1: nothing after it was trimmed).
/// KEYS: log. Returns `{kept, id, notice, id, notice, …}`.
pub static LOG_AFTER: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"local kept = 1
if ARGV[1] ~= '0-0' and #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then kept = 0 end
local out = {kept}
for _, r in ipairs(redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', ARGV[2])) do
  out[#out + 1] = r[1]
  out[#out + 1] = r[2][2]
end
return out",
    )
});

/// A notice's place in the log: its Stream id, `<ms>-<seq>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct LogId(pub u64, pub u64);

impl LogId {
    pub fn parse(s: &str) -> Option<Self> {
        let (ms, seq) = s.split_once('-')?;
        let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
        if !digits(ms) || !digits(seq) {
            return None;
        }
        Some(LogId(ms.parse().ok()?, seq.parse().ok()?))
    }
}

impl std::fmt::Display for LogId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.0, self.1)
    }
}

/// What arrives on the invalidation channel: `<log id> <notice>`, or a
/// bare notice (published by a corral older than the log).
pub fn split_logged(payload: &str) -> (Option<LogId>, &str) {
    match payload.split_once(' ') {
        Some((id, rest)) => match LogId::parse(id) {
            Some(id) => (Some(id), rest),
            None => (None, payload),
        },
        None => (None, payload),
    }
}

/// What a leader announces on its variant's channel when its fill ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FillNotice {
    /// The entry is in L2.
    Stored,
    /// Uncacheable: fetch alone.
    Pass,
    /// The fill failed; the lease is free again (and the key's back-off,
    /// if any, is recorded).
    Failed,
    /// The answer is cacheable but not shared through L2 (larger than
    /// `l2_max_object_size`, or not written): each instance fetches its own
    /// copy now, once, for its local waiters, instead of waiting for an
    /// entry that will not come. Sent as soon as the leader's head says so.
    Local,
    /// The leader renewed its lease: it is alive and still fetching. A
    /// waiter that hears none for a lease window reads once: a dead
    /// leader's lease has lapsed by then, and one waiter takes it.
    Alive,
    /// The leader's head is in and its body, larger than one part, is
    /// relayed through the fill's stream: a waiter whose callers read an
    /// answer as it arrives joins it now (and only then: a fill whose body
    /// is not relayed costs its waiters no stream command). Also a sign of
    /// life, like `Alive`.
    Relaying,
    /// The leader's answer could not be written to L2 (Redis failed or
    /// timed out on the write) and its lease is released: read once, and
    /// take the lease if nothing is there, so that one waiting instance
    /// fetches for the others instead of each fetching its own.
    Unwritten,
}

impl FillNotice {
    pub fn encode(self) -> &'static str {
        match self {
            FillNotice::Stored => "stored",
            FillNotice::Pass => "pass",
            FillNotice::Failed => "failed",
            FillNotice::Local => "local",
            FillNotice::Alive => "alive",
            FillNotice::Relaying => "relaying",
            FillNotice::Unwritten => "unwritten",
        }
    }

    pub fn decode(s: &str) -> Option<Self> {
        match s {
            "stored" => Some(FillNotice::Stored),
            "pass" => Some(FillNotice::Pass),
            "failed" => Some(FillNotice::Failed),
            "local" => Some(FillNotice::Local),
            "alive" => Some(FillNotice::Alive),
            "relaying" => Some(FillNotice::Relaying),
            "unwritten" => Some(FillNotice::Unwritten),
            _ => None,
        }
    }
}

/// A fill notice as published on a notice channel: the variant's name,
/// a space, and the notice (sealed under that name).
pub fn fill_notice_payload(name: &str, sealed: &str) -> String {
    format!("{name} {sealed}")
}

/// The name and sealed notice of a [`fill_notice_payload`]; `None` for
/// anything else.
pub fn split_fill_notice(payload: &str) -> Option<(&str, &str)> {
    payload.split_once(' ')
}

/// What every instance must drop, sent on the invalidation channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterNotice {
    /// Every stored variant of the URI with this digest (an unsafe method
    /// answered 2xx/3xx, or a purge of one URI).
    Invalidate(Digest),
    /// A purge by prefix, tag or URI, hard or soft.
    Ban(Ban),
    /// Everything held in memory.
    All,
    /// Everything held in memory may have missed an invalidation: what an
    /// instance applies to itself when the log was lost (Redis restarted
    /// empty, or the instance was away longer than the log reaches). Kept
    /// and served, and revalidated at a paced rate.
    Unverify,
}

impl ClusterNotice {
    /// The payload: `*`, the URI digest in hex, or
    /// `ban\t<soft 0|1>\t<unix ms>\t<p|t|u|g>\t<value>` (a group's value
    /// is `host\tgroup`).
    pub fn encode(&self) -> String {
        match self {
            ClusterNotice::All => "*".to_owned(),
            ClusterNotice::Unverify => "~".to_owned(),
            ClusterNotice::Invalidate(d) => d.to_hex(),
            ClusterNotice::Ban(b) => {
                let group;
                let (kind, value) = match &b.target {
                    BanTarget::Prefix(v) => ("p", v),
                    BanTarget::Tag(v) => ("t", v),
                    BanTarget::Uri(v) => ("u", v),
                    BanTarget::Group { host, group: g } => {
                        group = format!("{host}\t{g}");
                        ("g", &group)
                    }
                };
                let ms = epoch_millis(b.at);
                format!("ban\t{}\t{ms}\t{kind}\t{value}", u8::from(b.soft))
            }
        }
    }

    /// `None` for anything [`encode`](Self::encode) does not write.
    pub fn decode(s: &str) -> Option<Self> {
        if s == "*" {
            return Some(ClusterNotice::All);
        }
        if s == "~" {
            return Some(ClusterNotice::Unverify);
        }
        if let Some(ban) = s.strip_prefix("ban\t") {
            return decode_ban(ban).map(ClusterNotice::Ban);
        }
        Digest::from_hex(s).map(ClusterNotice::Invalidate)
    }
}

fn decode_ban(s: &str) -> Option<Ban> {
    let mut parts = s.splitn(4, '\t');
    let soft = match parts.next()? {
        "1" => true,
        "0" => false,
        _ => return None,
    };
    let ms: u64 = parts.next()?.parse().ok()?;
    let kind = parts.next()?;
    let value = parts.next()?.to_owned();
    let target = match kind {
        "p" => BanTarget::Prefix(value),
        "t" => BanTarget::Tag(value),
        "u" => BanTarget::Uri(value),
        "g" => {
            let (host, group) = value.split_once('\t')?;
            BanTarget::Group {
                host: host.to_owned(),
                group: group.to_owned(),
            }
        }
        _ => return None,
    };
    Some(Ban {
        target,
        at: UNIX_EPOCH.checked_add(Duration::from_millis(ms))?,
        soft,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_core::{QueryFilter, UriKey};

    /// The scripts delete the kept codings by name: every coding corral
    /// makes, under the key [`Keys::coding`] gives it.
    #[test]
    fn the_scripts_delete_every_coding_corral_keeps() {
        let primary = PrimaryKey::new(
            "api",
            UriKey::new("h", "/x", None, &QueryFilter::new::<&str>(&[])),
        );
        let keys = Layout::new("app1:").keys(&primary, Digest([7; 32]), None);
        for coding in corral_core::Coding::ALL {
            // The coding and the claim on making it.
            for key in [
                keys.coding(coding.as_str()),
                keys.coding_claim(coding.as_str()),
            ] {
                let suffix = key
                    .strip_prefix(&keys.entry())
                    .expect("the entry's key in front");
                assert!(
                    DEL_CODINGS.contains(&format!("e .. '{suffix}'")),
                    "{suffix}"
                );
            }
        }
    }

    #[test]
    fn cluster_notices_round_trip_and_garbage_is_refused() {
        let notices = [
            ClusterNotice::All,
            ClusterNotice::Unverify,
            ClusterNotice::Invalidate(Digest([7; 32])),
            ClusterNotice::Ban(Ban {
                target: BanTarget::Prefix("h/v1/".into()),
                at: UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
                soft: true,
            }),
            ClusterNotice::Ban(Ban {
                target: BanTarget::Tag("a\tb".into()),
                at: UNIX_EPOCH,
                soft: false,
            }),
            ClusterNotice::Ban(Ban {
                target: BanTarget::Uri("h/x?y".into()),
                at: UNIX_EPOCH + Duration::from_millis(1),
                soft: false,
            }),
            ClusterNotice::Ban(Ban {
                target: BanTarget::Group {
                    host: "h".into(),
                    group: "a\tb, c".into(),
                },
                at: UNIX_EPOCH + Duration::from_millis(2),
                soft: false,
            }),
        ];
        for n in notices {
            assert_eq!(ClusterNotice::decode(&n.encode()), Some(n.clone()), "{n:?}");
        }
        for bad in [
            "",
            "**",
            "0123abcd",
            "ban\t2\t1\tp\tx",
            "ban\t1\tx\tp\tx",
            "ban\t1\t1\tq\tx",
            "ban\t1\t1\tp",
            "ban\t1\t1\tg\tno-tab",
        ] {
            assert_eq!(ClusterNotice::decode(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_lease_value_tells_its_age_on_one_clock() {
        let v = format!("{}.1700000000123", lease_token());
        assert_eq!(
            lease_held(&v, 1_700_000_002_123),
            Some(Duration::from_secs(2))
        );
        // Redis's clock stepped back (a failover to a node behind): not
        // an underflow, just a fresh lease.
        assert_eq!(lease_held(&v, 1_700_000_000_000), Some(Duration::ZERO));
        assert_ne!(lease_token(), lease_token(), "tokens differ");
        assert_eq!(lease_held("0123abcd", 5), None);
        assert_eq!(lease_held("x.y", 5), None);
    }

    #[test]
    fn a_logged_notice_splits_into_its_id_and_the_notice() {
        assert_eq!(
            split_logged("1700000000123-7 ban\t1\t5\tt\ta b"),
            (Some(LogId(1_700_000_000_123, 7)), "ban\t1\t5\tt\ta b")
        );
        // A bare notice, from a corral older than the log.
        assert_eq!(split_logged("*"), (None, "*"));
        let hex = Digest([7; 32]).to_hex();
        assert_eq!(split_logged(&hex), (None, hex.as_str()));
        for bad in ["1-x y", "-1 y", "1- y", "x-1 y"] {
            assert_eq!(split_logged(bad), (None, bad), "{bad:?}");
        }
        assert!(LogId(2, 0) > LogId(1, 9));
        assert_eq!(LogId::parse(&LogId(12, 3).to_string()), Some(LogId(12, 3)));
    }

    #[test]
    fn fill_notices_round_trip() {
        for n in [
            FillNotice::Stored,
            FillNotice::Pass,
            FillNotice::Failed,
            FillNotice::Local,
            FillNotice::Alive,
            FillNotice::Relaying,
            FillNotice::Unwritten,
        ] {
            assert_eq!(FillNotice::decode(n.encode()), Some(n));
        }
        assert_eq!(FillNotice::decode("Stored"), None);
    }

    #[test]
    fn a_fill_notice_names_its_variant_and_travels_on_its_uris_shard() {
        let layout = Layout::new("app1:");
        let primary = PrimaryKey::new(
            "api",
            UriKey::new("h", "/x", None, &QueryFilter::new::<&str>(&[])),
        );
        let a = layout.keys(&primary, Digest([1; 32]), None);
        let b = layout.keys(&primary, Digest([2; 32]), None);
        assert_eq!(a.notice_channel(), b.notice_channel(), "one URI, one shard");
        assert_ne!(a.fill_channel(), b.fill_channel(), "each variant named");
        let channels = layout.notice_channels();
        assert_eq!(channels.len(), NOTICE_SHARDS);
        assert!(channels.iter().any(|c| c == a.notice_channel()));
        assert_eq!(channels[3], "app1:{notice:3}");
        let payload = fill_notice_payload(&a.fill_channel(), "stored");
        let (name, notice) = split_fill_notice(&payload).expect("splits");
        assert_eq!((name, notice), (a.fill_channel().as_str(), "stored"));
        assert_eq!(split_fill_notice("no-space"), None);
    }

    #[test]
    fn every_key_of_a_uri_shares_one_hash_tag_and_the_prefix() {
        let layout = Layout::new("app1:");
        let primary = PrimaryKey::new(
            "api",
            UriKey::new("h", "/x", None, &QueryFilter::new::<&str>(&[])),
        );
        let keys = layout.keys(&primary, Digest([1; 32]), None);
        let tag = format!("app1:{{{}}}", primary.digest().to_hex());
        for k in [
            keys.entry(),
            keys.lease(),
            keys.fill_channel(),
            keys.vary(),
            keys.generation(),
            keys.pass(),
            keys.backoff(),
            keys.variants(),
        ] {
            assert!(k.starts_with(&tag), "{k}");
        }
        assert!(keys.entry().starts_with(&keys.entry_prefix()));
        assert_eq!(layout.invalidate_channel(), "app1:invalidate");
        assert_eq!(layout.bans_key(), "app1:bans");
        assert_eq!(millis(Duration::ZERO), 1);
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
    }
}
