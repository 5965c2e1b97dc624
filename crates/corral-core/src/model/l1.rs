//! L1: the in-process store. Entries live in moka, bounded in bytes, each
//! expiring when its last window (fresh, stale, revalidation grace) closes.
//! Beside the entries: the Vary set learned per URI (so followers group
//! correctly before a response arrives), "pass" markers for uncacheable keys
//! (Varnish's hit-for-pass), and invalidation generations (RFC 9111 §4.4)
//! that retire every variant of a URI in O(1).
//! Nothing here blocks on I/O or holds a lock across an await.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use crate::model::clock::{Clock, SystemClock};

use moka::Expiry;
use moka::notification::RemovalCause;
use moka::sync::Cache;

use crate::model::backoff::Backoff;
use crate::model::ban::{BanList, Verdict};
use crate::model::entry::{MAX_RESIDENCY, StoredResponse};
use crate::model::key::{Digest, LocalKey, PathScope, PrimaryKey, UriKey, VariantKey};
use crate::semantics::no_vary_search::NoVarySearch;
use crate::semantics::vary::Vary;

/// Sizing for L1.
#[derive(Debug, Clone)]
pub struct L1Config {
    /// Bound on the bytes L1 holds: stored responses and the records kept
    /// beside them (learned Vary sets, pass and back-off markers,
    /// invalidation generations), each weighed as what it really costs.
    pub memory: u64,
}

/// The share of `memory` each side table (Vary sets, pass markers, back-off
/// markers, generations, No-Vary-Search rules) may hold: 1/32 each, 5/32
/// together.
const SIDE_TABLE_SHARE: u64 = 32;

/// What one side-table record costs: the 32-byte key, the value and the
/// store's own per-entry records (see `STORE_OVERHEAD`).
fn side_record_weight(value_bytes: usize) -> u32 {
    u32::try_from(32 + value_bytes + crate::model::entry::STORE_OVERHEAD).unwrap_or(u32::MAX)
}

/// What an entry's key costs beside the entry: its bytes and the `Arc`'s
/// counts (the store's own share is in `STORE_OVERHEAD`).
fn key_weight(k: &LocalKey) -> u32 {
    u32::try_from(crate::model::entry::heap_bytes(16 + k.as_bytes().len())).unwrap_or(u32::MAX)
}

/// An entry lives until its last window closes, read on L1's clock.
struct EntryExpiry(Arc<dyn Clock>);

impl Expiry<LocalKey, Arc<StoredResponse>> for EntryExpiry {
    fn expire_after_create(
        &self,
        _: &LocalKey,
        v: &Arc<StoredResponse>,
        _: Instant,
    ) -> Option<Duration> {
        Some(v.residency(self.0.now()))
    }

    fn expire_after_update(
        &self,
        _: &LocalKey,
        v: &Arc<StoredResponse>,
        _: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(v.residency(self.0.now()))
    }
}

/// A hit-for-pass marker lives for its own duration.
#[derive(Clone, Copy)]
struct PassMarker(Duration);

struct PassExpiry;

impl Expiry<Digest, PassMarker> for PassExpiry {
    fn expire_after_create(&self, _: &Digest, v: &PassMarker, _: Instant) -> Option<Duration> {
        Some(v.0)
    }

    fn expire_after_update(
        &self,
        _: &Digest,
        v: &PassMarker,
        _: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(v.0)
    }
}

/// A back-off and how long to remember it once it ends.
#[derive(Clone)]
struct BackoffRecord {
    backoff: Backoff,
    keep: Duration,
    /// The key as the operator's views show it (no query, no secret).
    name: Option<Arc<str>>,
    /// One caller's own back-off (see [`L1::set_own_backoff`]): not a key
    /// in back-off, so the operator's views leave it out.
    own: bool,
}

/// A back-off record lives until its period ends and its memory passes.
struct BackoffExpiry(Arc<dyn Clock>);

impl Expiry<Digest, BackoffRecord> for BackoffExpiry {
    fn expire_after_create(&self, _: &Digest, v: &BackoffRecord, _: Instant) -> Option<Duration> {
        Some(v.backoff.remaining(self.0.now()) + v.keep)
    }

    fn expire_after_update(
        &self,
        _: &Digest,
        v: &BackoffRecord,
        _: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(v.backoff.remaining(self.0.now()) + v.keep)
    }
}

/// What L1 knows of one path's No-Vary-Search rule, and for how long.
#[derive(Clone)]
struct RuleRecord {
    /// `None`: every parameter matters.
    rule: Option<Arc<NoVarySearch>>,
    keep: Duration,
}

struct RuleExpiry;

impl Expiry<PathScope, RuleRecord> for RuleExpiry {
    fn expire_after_create(&self, _: &PathScope, v: &RuleRecord, _: Instant) -> Option<Duration> {
        Some(v.keep)
    }

    fn expire_after_update(
        &self,
        _: &PathScope,
        v: &RuleRecord,
        _: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(v.keep)
    }
}

/// What L1 knows of a path's No-Vary-Search rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathRule {
    /// Nothing: ask Redis, or learn it from the next answer.
    Unknown,
    /// Every parameter matters.
    None,
    Rule(Arc<NoVarySearch>),
}

impl PathRule {
    pub fn rule(&self) -> Option<&NoVarySearch> {
        match self {
            PathRule::Rule(r) => Some(r),
            _ => None,
        }
    }
}

/// The in-process cache.
pub struct L1 {
    /// Hashed with foldhash, seeded at random per process: a key is
    /// compared whole on a match, so the hash decides only where it is
    /// looked for, and it costs a hit a fraction of SipHash's.
    entries: Cache<LocalKey, Arc<StoredResponse>, foldhash::quality::RandomState>,
    vary: Cache<Digest, Vary>,
    pass: Cache<Digest, PassMarker>,
    /// Keys whose origin failed: their back-off, kept a while past its end
    /// so that the next failure counts as one more in a row.
    backoff: Cache<Digest, BackoffRecord>,
    generations: Cache<Digest, u64>,
    /// The No-Vary-Search rule learned per path, on routes that use them.
    rules: Cache<PathScope, RuleRecord, foldhash::quality::RandomState>,
    /// Set once any response Varied; until then `learned_vary` is free.
    any_vary: AtomicBool,
    /// Set once any key went into back-off; until then the hit path skips
    /// the back-off lookup.
    any_backoff: AtomicBool,
    /// Monotonic stamp: fetches record it when they start; invalidations
    /// take a new one.
    clock: AtomicU64,
    /// Purges by prefix, tag and soft purges.
    pub bans: BanList,
    /// Where expiry, back-off and the ban horizon read "now": the cache
    /// path's clock.
    time: Arc<dyn Clock>,
    /// Entries stamped below this are invalid for every URI whose
    /// generation record was evicted for space (conservative, never stale).
    floor: Arc<AtomicU64>,
    /// Set by the first invalidation of one URI; until then the hit path
    /// skips the generations lookup.
    any_generation: AtomicBool,
    /// Entries stamped below this may have missed an invalidation (the
    /// invalidation log was lost): served, and revalidated at a paced
    /// rate. 0: none.
    suspect: AtomicU64,
}

impl L1 {
    /// L1 on the system clock.
    pub fn new(config: &L1Config) -> Self {
        L1::with_clock(config, Arc::new(SystemClock))
    }

    /// L1 whose expiry, back-off and ban horizon read `time`.
    pub fn with_clock(config: &L1Config, time: Arc<dyn Clock>) -> Self {
        let floor = Arc::new(AtomicU64::new(0));
        let listener_floor = Arc::clone(&floor);
        let side = (config.memory / SIDE_TABLE_SHARE).max(1);
        let entries = config.memory.saturating_sub(5 * side).max(1);
        let marker_weight =
            |_: &Digest, _: &PassMarker| side_record_weight(size_of::<PassMarker>());
        L1 {
            entries: Cache::builder()
                .max_capacity(entries)
                // The key's bytes are the entry's too.
                .weigher(|k: &LocalKey, v: &Arc<StoredResponse>| {
                    v.weight().saturating_add(key_weight(k))
                })
                .expire_after(EntryExpiry(Arc::clone(&time)))
                .build_with_hasher(foldhash::quality::RandomState::default()),
            vary: Cache::builder()
                .max_capacity(side)
                .weigher(|_, v: &Vary| {
                    side_record_weight(size_of::<Vary>() + size_of_val(v.names()))
                })
                // No entry outlives MAX_RESIDENCY, so neither need its Vary.
                .time_to_live(MAX_RESIDENCY)
                .build(),
            pass: Cache::builder()
                .max_capacity(side)
                .weigher(marker_weight)
                .expire_after(PassExpiry)
                .build(),
            backoff: Cache::builder()
                .max_capacity(side)
                .weigher(|_, r: &BackoffRecord| {
                    side_record_weight(
                        size_of::<BackoffRecord>() + r.name.as_deref().map_or(0, str::len),
                    )
                })
                .expire_after(BackoffExpiry(Arc::clone(&time)))
                .build(),
            generations: Cache::builder()
                .max_capacity(side)
                .weigher(|_, _: &u64| side_record_weight(size_of::<u64>()))
                // Outlives every entry stamped before it.
                .time_to_live(MAX_RESIDENCY + Duration::from_secs(60))
                .eviction_listener(move |_, g: u64, cause| {
                    if cause == RemovalCause::Size {
                        listener_floor.fetch_max(g, Ordering::AcqRel);
                    }
                })
                .build(),
            rules: Cache::builder()
                .max_capacity(side)
                .weigher(|k: &PathScope, v: &RuleRecord| {
                    side_record_weight(
                        k.as_bytes().len() + v.rule.as_deref().map_or(0, NoVarySearch::weight),
                    )
                })
                .expire_after(RuleExpiry)
                .build_with_hasher(foldhash::quality::RandomState::default()),
            clock: AtomicU64::new(1),
            any_vary: AtomicBool::new(false),
            any_backoff: AtomicBool::new(false),
            bans: BanList::default(),
            time,
            floor,
            any_generation: AtomicBool::new(false),
            suspect: AtomicU64::new(0),
        }
    }

    /// Adds a purge's ban; bans too old to match any entry go.
    pub fn add_ban(&self, ban: crate::Ban) {
        self.bans.add(ban, self.time.now());
    }

    /// The stamp a fetch records when it starts; an invalidation after this
    /// point makes what the fetch stores invalid.
    pub fn generation_stamp(&self) -> u64 {
        self.clock.load(Ordering::Acquire)
    }

    fn current_generation(&self, uri: &UriKey) -> u64 {
        let floor = self.floor.load(Ordering::Acquire);
        // Until the first invalidation of one URI there is nothing to look
        // up: the common hit path skips a map lookup.
        if !self.any_generation.load(Ordering::Acquire) {
            return floor;
        }
        self.generations
            .get(&uri.digest())
            .map_or(floor, |g| g.max(floor))
    }

    /// Retires every stored entry at once (fills under way cannot store
    /// either), for when invalidations may have been missed.
    pub fn invalidate_all(&self) {
        let g = self.clock.fetch_add(1, Ordering::AcqRel) + 1;
        self.floor.fetch_max(g, Ordering::AcqRel);
    }

    /// Marks every entry stored before now unverified: it may have missed
    /// an invalidation (see [`L1::unverified`]). What is fetched from now
    /// on is not.
    pub fn unverify_all(&self) {
        let g = self.clock.fetch_add(1, Ordering::AcqRel) + 1;
        self.suspect.fetch_max(g, Ordering::AcqRel);
    }

    /// True for an entry stored before the last [`L1::unverify_all`]: the
    /// cache path revalidates it in the background, paced, when asked
    /// for it. One load on the hit path.
    #[inline]
    pub fn unverified(&self, e: &StoredResponse) -> bool {
        e.generation < self.suspect.load(Ordering::Relaxed)
    }

    /// A stored variant, by its local key's bytes ([`VariantKey::local`],
    /// which a hit makes on the stack with [`PrimaryKey::local_bytes`]),
    /// unless an
    /// invalidation retired it.
    pub fn get(&self, local: &[u8], uri: &UriKey) -> Option<Arc<StoredResponse>> {
        let e = self.entries.get(local)?;
        if e.generation < self.current_generation(uri) {
            self.entries.invalidate(local);
            return None;
        }
        self.apply_bans(e).or_else(|| {
            self.entries.invalidate(local);
            None
        })
    }

    /// `e` as the bans in force let it be served: unchanged, stale from a
    /// soft purge, or `None` (purged).
    pub fn apply_bans(&self, e: Arc<StoredResponse>) -> Option<Arc<StoredResponse>> {
        match self.bans.verdict(&e) {
            Verdict::Keep => Some(e),
            Verdict::Drop => None,
            Verdict::StaleFrom(t) => {
                let mut stale = (*e).clone();
                stale.fresh_until = t;
                Some(Arc::new(stale))
            }
        }
    }

    /// Stores a variant (replacing any older one) unless an invalidation
    /// happened since its fetch started.
    pub fn insert(&self, key: &VariantKey, uri: &UriKey, entry: Arc<StoredResponse>) -> bool {
        if entry.generation < self.current_generation(uri) {
            return false;
        }
        self.entries.insert(key.local.clone(), entry);
        true
    }

    pub fn remove(&self, key: &VariantKey) {
        self.entries.invalidate(key.local.as_bytes());
    }

    /// Retires every stored variant of `uri`, on every route.
    pub fn invalidate_uri(&self, uri: &UriKey) {
        self.invalidate_uri_digest(uri.digest());
    }

    /// The same, by the URI's digest (as other instances announce it).
    pub fn invalidate_uri_digest(&self, uri: Digest) {
        let g = self.clock.fetch_add(1, Ordering::AcqRel) + 1;
        self.generations.insert(uri, g);
        self.any_generation.store(true, Ordering::Release);
    }

    /// The Vary set last seen for this URI on this route.
    pub fn learned_vary(&self, primary: &PrimaryKey) -> Vary {
        // Most sites never Vary: until one response did, every hit skips
        // this lookup (it showed up in hit-path profiles).
        if !self.any_vary.load(Ordering::Acquire) {
            return Vary::None;
        }
        self.vary.get(&primary.digest()).unwrap_or_default()
    }

    /// Records the Vary set of a response. Only a real Vary is kept (no
    /// record means none); a URI that stops Varying loses its record.
    pub fn learn_vary(&self, primary: &PrimaryKey, vary: &Vary) {
        if *vary == Vary::None {
            if self.any_vary.load(Ordering::Acquire) && self.vary.contains_key(&primary.digest()) {
                self.vary.invalidate(&primary.digest());
            }
            return;
        }
        if self.vary.get(&primary.digest()).as_ref() != Some(vary) {
            self.any_vary.store(true, Ordering::Release);
            self.vary.insert(primary.digest(), vary.clone());
        }
    }

    /// What is known of `scope`'s No-Vary-Search rule.
    pub fn path_rule(&self, scope: &PathScope) -> PathRule {
        match self.rules.get(scope.as_bytes()) {
            None => PathRule::Unknown,
            Some(RuleRecord { rule: None, .. }) => PathRule::None,
            Some(RuleRecord { rule: Some(r), .. }) => PathRule::Rule(r),
        }
    }

    /// Records `scope`'s rule for `keep`, and says what is now known.
    pub fn learn_path_rule(
        &self,
        scope: &PathScope,
        rule: Option<NoVarySearch>,
        keep: Duration,
    ) -> PathRule {
        let rule = rule.map(Arc::new);
        self.rules.insert(
            scope.clone(),
            RuleRecord {
                rule: rule.clone(),
                keep,
            },
        );
        rule.map_or(PathRule::None, PathRule::Rule)
    }

    /// True while `key` is remembered as uncacheable.
    pub fn is_pass(&self, key: &Digest) -> bool {
        self.pass.contains_key(key)
    }

    pub fn mark_pass(&self, key: Digest, duration: Duration) {
        if !duration.is_zero() {
            self.pass.insert(key, PassMarker(duration));
        }
    }

    /// `key`'s back-off, while its origin is to be left alone at `now`.
    /// The key is asked for only when some key has backed off: most keys
    /// never failed, and until one did this is a load, not a hash and a
    /// lookup.
    #[inline]
    pub fn active_backoff(&self, key: impl FnOnce() -> Digest, now: SystemTime) -> Option<Backoff> {
        if !self.any_backoff.load(Ordering::Acquire) {
            return None;
        }
        self.backoff
            .get(&key())
            .map(|r| r.backoff)
            .filter(|b| b.active(now))
    }

    /// `key`'s last back-off, ended or not (the count of failures in a row).
    pub fn last_backoff(&self, key: &Digest) -> Option<Backoff> {
        self.backoff.get(key).map(|r| r.backoff)
    }

    /// Puts `key` into `backoff`, remembered `keep` past its end; `name`
    /// is how the operator's views show it ([`L1::backoff_names`]).
    pub fn set_backoff(&self, key: Digest, backoff: Backoff, keep: Duration, name: &str) {
        self.any_backoff.store(true, Ordering::Release);
        let name = (!name.is_empty()).then(|| Arc::from(name));
        self.backoff.insert(
            key,
            BackoffRecord {
                backoff,
                keep,
                name,
                own: false,
            },
        );
    }

    /// Records one caller's own back-off for a key (its own failures in a
    /// row leave its own requests to the stale copy): kept and read like a
    /// key's, but never shown as a key in back-off.
    pub fn set_own_backoff(&self, key: Digest, backoff: Backoff, keep: Duration) {
        self.any_backoff.store(true, Ordering::Release);
        self.backoff.insert(
            key,
            BackoffRecord {
                backoff,
                keep,
                name: None,
                own: true,
            },
        );
    }

    /// The origin answered for `key`: its back-off ends.
    pub fn clear_backoff(&self, key: &Digest) {
        // A read first: every fill clears, and a moka write costs more.
        if self.any_backoff.load(Ordering::Acquire) && self.backoff.contains_key(key) {
            self.backoff.invalidate(key);
        }
    }

    /// The bytes the entries may weigh in all (`cache.memory`, less the
    /// side tables' share).
    pub fn capacity(&self) -> u64 {
        self.entries.policy().max_capacity().unwrap_or(0)
    }

    /// Up to `n` keys whose back-off is running now, as their fills named
    /// them, the longest to run first, with the time left.
    pub fn backoff_names(&self, n: usize) -> Vec<(String, Duration)> {
        let now = self.time.now();
        let mut all: Vec<(String, Duration)> = self
            .backoff
            .iter()
            .filter(|(_, r)| !r.own && r.backoff.active(now))
            .map(|(_, r)| {
                let name = r.name.as_deref().unwrap_or_default().to_owned();
                (name, r.backoff.remaining(now))
            })
            .collect();
        all.sort_by_key(|a| std::cmp::Reverse(a.1));
        all.truncate(n);
        all
    }

    /// Keys whose back-off is running now.
    pub fn backoff_keys(&self) -> usize {
        let now = self.time.now();
        self.backoff
            .iter()
            .filter(|(_, r)| !r.own && r.backoff.active(now))
            .count()
    }

    pub fn clear_pass(&self, key: &Digest) {
        if self.pass.contains_key(key) {
            self.pass.invalidate(key);
        }
    }

    /// Stored variants (approximate until pending maintenance runs).
    pub fn entry_count(&self) -> u64 {
        self.entries.entry_count()
    }

    /// Bytes held by stored variants (approximate).
    pub fn weighted_size(&self) -> u64 {
        self.entries.weighted_size()
    }

    /// Runs moka's pending maintenance (tests and metrics).
    pub fn sync(&self) {
        self.entries.run_pending_tasks();
        self.vary.run_pending_tasks();
        self.pass.run_pending_tasks();
        self.backoff.run_pending_tasks();
        self.generations.run_pending_tasks();
    }

    /// Bytes held by the side tables (approximate).
    pub fn side_weighted_size(&self) -> u64 {
        self.vary.weighted_size()
            + self.pass.weighted_size()
            + self.backoff.weighted_size()
            + self.generations.weighted_size()
    }
}

#[cfg(test)]
mod backoff_view {
    use super::*;
    use crate::model::clock::PausedClock;

    #[tokio::test(start_paused = true)]
    async fn keys_in_back_off_are_named_longest_first_and_leave_when_it_ends() {
        let clock = Arc::new(PausedClock::new());
        let l1 = L1::with_clock(&L1Config { memory: 1 << 20 }, clock.clone());
        let now = clock.now();
        let keep = Duration::from_secs(60);
        for (n, secs, name) in [
            (1u8, 5, "api GET a/one"),
            (2, 30, "api GET a/two"),
            (3, 1, ""),
        ] {
            let backoff = Backoff {
                until: now + Duration::from_secs(secs),
                failures: 1,
                caller: None,
            };
            l1.set_backoff(Digest([n; 32]), backoff, keep, name);
        }
        l1.backoff.run_pending_tasks();
        let names: Vec<(String, u64)> = l1
            .backoff_names(2)
            .into_iter()
            .map(|(k, left)| (k, left.as_secs()))
            .collect();
        assert_eq!(
            names,
            [
                ("api GET a/two".to_owned(), 30),
                ("api GET a/one".to_owned(), 5)
            ]
        );
        // A caller's own back-off is no key in back-off.
        let own = Backoff {
            until: now + Duration::from_secs(600),
            failures: 2,
            caller: None,
        };
        l1.set_own_backoff(Digest([9; 32]), own, keep);
        l1.backoff.run_pending_tasks();
        assert_eq!(l1.backoff_names(10).len(), 3, "the three keys alone");
        assert_eq!(l1.backoff_keys(), 3);
        l1.backoff.invalidate(&Digest([9; 32]));
        tokio::time::advance(Duration::from_secs(10)).await;
        let names: Vec<String> = l1.backoff_names(10).into_iter().map(|(k, _)| k).collect();
        assert_eq!(names, ["api GET a/two"], "ended back-offs are not shown");
        assert_eq!(l1.backoff_keys(), 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::key::QueryFilter;
    use crate::model::policy::{Freshness, Sharing};
    use bytes::Bytes;
    use http::{HeaderMap, StatusCode};

    fn stored(body: &'static [u8], generation: u64) -> Arc<StoredResponse> {
        let fr = Freshness {
            ttl: Duration::from_secs(60),
            swr: Duration::ZERO,
            sie: Duration::ZERO,
            sharing: Sharing::Everyone,
        };
        Arc::new(
            StoredResponse::builder(
                StatusCode::OK,
                HeaderMap::new(),
                Bytes::from_static(body),
                &fr,
                SystemTime::now(),
            )
            .fetch_duration(Duration::from_millis(1))
            .generation(generation)
            .build(),
        )
    }

    fn keys(path: &str) -> (UriKey, VariantKey) {
        let uri = UriKey::new("h", path, None, &QueryFilter::default());
        let v = PrimaryKey::new("r", uri.clone()).variant(None, &[]);
        (uri, v)
    }

    #[test]
    fn invalidation_retires_stored_and_in_flight_fills() {
        let l1 = L1::new(&L1Config { memory: 1 << 20 });
        let (uri, k) = keys("/a");
        let stamp = l1.generation_stamp();
        assert!(l1.insert(&k, &uri, stored(b"one", stamp)));
        assert!(l1.get(k.local.as_bytes(), &uri).is_some());
        let in_flight = l1.generation_stamp();
        l1.invalidate_uri(&uri);
        assert!(l1.get(k.local.as_bytes(), &uri).is_none());
        // A fill that started before the invalidation is refused.
        assert!(!l1.insert(&k, &uri, stored(b"old", in_flight)));
        // One that starts after it is kept.
        assert!(l1.insert(&k, &uri, stored(b"new", l1.generation_stamp())));
        assert_eq!(
            l1.get(k.local.as_bytes(), &uri).map(|e| e.body.clone()),
            Some(Bytes::from_static(b"new"))
        );
        // Other URIs are untouched.
        let (uri_b, kb) = keys("/b");
        assert!(l1.insert(&kb, &uri_b, stored(b"b", 1)));
        assert!(l1.get(kb.local.as_bytes(), &uri_b).is_some());
    }

    #[test]
    fn invalidate_all_retires_everything_stored_before_it() {
        let l1 = L1::new(&L1Config { memory: 1 << 20 });
        let (ua, ka) = keys("/a");
        let (ub, kb) = keys("/b");
        assert!(l1.insert(&ka, &ua, stored(b"a", l1.generation_stamp())));
        l1.invalidate_uri(&ub);
        assert!(l1.insert(&kb, &ub, stored(b"b", l1.generation_stamp())));
        let in_flight = l1.generation_stamp();
        l1.invalidate_all();
        assert!(l1.get(ka.local.as_bytes(), &ua).is_none());
        assert!(l1.get(kb.local.as_bytes(), &ub).is_none());
        assert!(!l1.insert(&ka, &ua, stored(b"late", in_flight)));
        assert!(l1.insert(&ka, &ua, stored(b"new", l1.generation_stamp())));
        assert!(l1.get(ka.local.as_bytes(), &ua).is_some());
    }

    #[test]
    fn unverify_all_keeps_every_entry_and_marks_only_those_stored_before_it() {
        let l1 = L1::new(&L1Config { memory: 1 << 20 });
        let (ua, ka) = keys("/a");
        let (ub, kb) = keys("/b");
        assert!(l1.insert(&ka, &ua, stored(b"a", l1.generation_stamp())));
        let in_flight = l1.generation_stamp();
        l1.unverify_all();
        // Kept and served, but unverified.
        let a = l1.get(ka.local.as_bytes(), &ua).expect("kept");
        assert!(l1.unverified(&a));
        // A fetch that began before it stores, unverified too; one that
        // begins after it is verified.
        assert!(l1.insert(&kb, &ub, stored(b"b", in_flight)));
        assert!(l1.unverified(&l1.get(kb.local.as_bytes(), &ub).expect("stored")));
        assert!(l1.insert(&ka, &ua, stored(b"new", l1.generation_stamp())));
        assert!(!l1.unverified(&l1.get(ka.local.as_bytes(), &ua).expect("stored")));
        // An invalidation of one URI still retires it (the generations
        // lookup is not skipped once one happened).
        l1.invalidate_uri(&ua);
        assert!(l1.get(ka.local.as_bytes(), &ua).is_none());
        assert!(l1.get(kb.local.as_bytes(), &ub).is_some());
    }

    #[test]
    fn memory_bound_is_in_bytes() {
        let l1 = L1::new(&L1Config { memory: 64 * 1024 });
        static BIG: [u8; 8192] = [b'x'; 8192];
        for i in 0..64 {
            let (uri, k) = keys(&format!("/{i}"));
            l1.insert(&k, &uri, stored(&BIG, 1));
        }
        l1.sync();
        assert!(l1.weighted_size() <= 64 * 1024, "{}", l1.weighted_size());
        assert!(l1.entry_count() < 64);
    }

    #[test]
    fn pass_markers_expire() {
        let l1 = L1::new(&L1Config { memory: 1 << 20 });
        let d = Digest([1; 32]);
        l1.mark_pass(d, Duration::from_millis(30));
        assert!(l1.is_pass(&d));
        std::thread::sleep(Duration::from_millis(60));
        assert!(!l1.is_pass(&d));
    }
}
