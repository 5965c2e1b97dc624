//! Cluster mode: one circuit breaker per primary. A dead or frozen primary
//! opens its own breaker, and only the keys of its slots are served
//! without Redis; the other shards stay in use. (One breaker for the
//! whole cluster would either open for every key or, with the healthy
//! shards' successes resetting its count, never open, and every request
//! for the frozen shard's keys would wait out `op_timeout`.)
//!
//! Which primary serves which slots is read with `CLUSTER SLOTS` after
//! connecting and every [`REFRESH`]; a breaker belongs to a primary's
//! address, so a refresh keeps its state, and a replica promoted after a
//! failover starts with a closed one. A key whose slot is not in the map
//! yet uses the link's own breaker.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use redis::Value;

use crate::cluster::breaker::{Breaker, BreakerState};

/// How often the slot map is read again.
pub const REFRESH: Duration = Duration::from_secs(1);

/// Redis Cluster's slot count.
const SLOTS: u16 = 16384;

/// The slot of a key: CRC16 (XMODEM) of its hash tag (the part between
/// the first `{` and the next `}`, when not empty), else of the key.
pub fn slot(key: &[u8]) -> u16 {
    let tag = key
        .iter()
        .position(|b| *b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.iter()
                .position(|b| *b == b'}')
                .map(|close| &rest[..close])
        })
        .filter(|tag| !tag.is_empty())
        .unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(tag) % SLOTS
}

#[derive(Default)]
struct Map {
    /// `(first slot, last slot, the primary's breaker)`, sorted.
    ranges: Vec<(u16, u16, Arc<Breaker>)>,
    by_primary: HashMap<String, Arc<Breaker>>,
}

/// The breakers of a cluster's primaries.
pub struct ShardBreakers {
    failures: u32,
    open_for: Duration,
    map: RwLock<Map>,
    /// Openings of breakers whose primary left the map.
    retired_opened: AtomicU64,
}

impl ShardBreakers {
    pub fn new(failures: u32, open_for: Duration) -> Self {
        ShardBreakers {
            failures,
            open_for,
            map: RwLock::new(Map::default()),
            retired_opened: AtomicU64::new(0),
        }
    }

    /// The breaker of the primary serving `key`'s slot, if known.
    pub fn for_key(&self, key: &[u8]) -> Option<Arc<Breaker>> {
        let slot = slot(key);
        let map = self.map.read().unwrap_or_else(PoisonError::into_inner);
        let i = map.ranges.partition_point(|(_, last, _)| *last < slot);
        map.ranges
            .get(i)
            .filter(|(first, _, _)| *first <= slot)
            .map(|(_, _, b)| Arc::clone(b))
    }

    /// Installs a new slot map (`(first, last, primary address)`), keeping
    /// the breaker of every primary still in it.
    pub fn update(&self, ranges: Vec<(u16, u16, String)>) {
        let mut map = self.map.write().unwrap_or_else(PoisonError::into_inner);
        let mut by_primary = HashMap::new();
        let mut new_ranges = Vec::with_capacity(ranges.len());
        for (first, last, primary) in ranges {
            let breaker = by_primary
                .entry(primary.clone())
                .or_insert_with(|| {
                    map.by_primary.get(&primary).cloned().unwrap_or_else(|| {
                        Arc::new(Breaker::named(self.failures, self.open_for, &primary))
                    })
                })
                .clone();
            new_ranges.push((first, last, breaker));
        }
        new_ranges.sort_by_key(|(first, _, _)| *first);
        for (primary, gone) in &map.by_primary {
            if !by_primary.contains_key(primary) {
                self.retired_opened
                    .fetch_add(gone.opened_count(), Ordering::Relaxed);
            }
        }
        *map = Map {
            ranges: new_ranges,
            by_primary,
        };
    }

    /// `(open breakers, primaries known, times any opened)`.
    /// Each known primary and whether its breaker is open, by address.
    pub fn primaries(&self) -> Vec<(String, bool)> {
        let map = self.map.read().unwrap_or_else(PoisonError::into_inner);
        let mut all: Vec<(String, bool)> = map
            .by_primary
            .iter()
            .map(|(p, b)| (p.clone(), b.state() == BreakerState::Open))
            .collect();
        all.sort();
        all
    }

    pub fn state(&self) -> (usize, usize, u64) {
        let map = self.map.read().unwrap_or_else(PoisonError::into_inner);
        let open = map
            .by_primary
            .values()
            .filter(|b| b.state() == BreakerState::Open)
            .count();
        let opened = map
            .by_primary
            .values()
            .map(|b| b.opened_count())
            .sum::<u64>()
            + self.retired_opened.load(Ordering::Relaxed);
        (open, map.by_primary.len(), opened)
    }
}

/// The ranges of a `CLUSTER SLOTS` answer: `(first, last, "host:port")`
/// of each range's primary. Entries of another shape are skipped.
pub fn parse_slots(answer: &Value) -> Vec<(u16, u16, String)> {
    let Value::Array(ranges) = answer else {
        return Vec::new();
    };
    ranges
        .iter()
        .filter_map(|range| {
            let Value::Array(fields) = range else {
                return None;
            };
            let (Some(Value::Int(first)), Some(Value::Int(last)), Some(Value::Array(primary))) =
                (fields.first(), fields.get(1), fields.get(2))
            else {
                return None;
            };
            let host = match primary.first()? {
                Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                Value::SimpleString(s) => s.clone(),
                _ => return None,
            };
            let Value::Int(port) = primary.get(1)? else {
                return None;
            };
            Some((
                u16::try_from(*first).ok()?,
                u16::try_from(*last).ok()?,
                format!("{host}:{port}"),
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_the_hash_tag_as_redis_computes_them() {
        // Values from `CLUSTER KEYSLOT` on Redis 7.
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"{user1000}.following"), slot(b"{user1000}.followers"));
        assert_eq!(slot(b"corral:{abc}:e:01"), slot(b"abc"));
        assert_eq!(slot(b"foo{}{bar}"), slot(b"foo{}{bar}"));
        assert_eq!(
            slot(b"{}x"),
            slot(b"{}x"),
            "an empty tag hashes the whole key"
        );
        assert_ne!(slot(b"{}x"), slot(b""));
    }

    fn range(first: u16, last: u16, addr: &str) -> (u16, u16, String) {
        (first, last, addr.to_owned())
    }

    #[test]
    fn a_key_finds_its_primarys_breaker_and_a_refresh_keeps_its_state() {
        let shards = ShardBreakers::new(1, Duration::from_secs(60));
        assert!(shards.for_key(b"foo").is_none(), "no map yet");
        shards.update(vec![
            range(10923, 16383, "c:1"),
            range(0, 5460, "a:1"),
            range(5461, 10922, "b:1"),
        ]);
        let foo = shards.for_key(b"foo").expect("mapped"); // slot 12182: c
        assert!(Arc::ptr_eq(
            &foo,
            &shards.for_key(b"{foo}x").expect("mapped")
        ));
        foo.failure();
        assert_eq!(shards.state(), (1, 3, 1));
        let other = shards.for_key(b"a").expect("mapped"); // slot 15495: c too
        assert!(Arc::ptr_eq(&foo, &other));
        let elsewhere = shards.for_key(b"{user1000}").expect("mapped");
        assert!(elsewhere.allow(), "another primary's breaker is closed");

        // The same primaries again: c's breaker stays open.
        shards.update(vec![
            range(0, 5460, "a:1"),
            range(5461, 10922, "b:1"),
            range(10923, 16383, "c:1"),
        ]);
        assert!(!shards.for_key(b"foo").expect("mapped").allow());
        // c's replica promoted: a new, closed breaker; the opening counted.
        shards.update(vec![
            range(0, 5460, "a:1"),
            range(5461, 10922, "b:1"),
            range(10923, 16383, "c-replica:1"),
        ]);
        assert!(shards.for_key(b"foo").expect("mapped").allow());
        assert_eq!(shards.state(), (0, 3, 1));
    }

    #[test]
    fn a_slots_answer_of_any_shape_parses_without_panic() {
        let good = Value::Array(vec![Value::Array(vec![
            Value::Int(0),
            Value::Int(5460),
            Value::Array(vec![
                Value::BulkString(b"127.0.0.1".to_vec()),
                Value::Int(7000),
                Value::BulkString(b"id".to_vec()),
            ]),
        ])]);
        assert_eq!(parse_slots(&good), [range(0, 5460, "127.0.0.1:7000")]);
        for junk in [
            Value::Nil,
            Value::Int(3),
            Value::Array(vec![Value::Nil]),
            Value::Array(vec![Value::Array(vec![Value::Int(-1), Value::Int(70000)])]),
            Value::Array(vec![Value::Array(vec![
                Value::Int(0),
                Value::Int(1),
                Value::Array(vec![Value::Int(1)]),
            ])]),
        ] {
            assert!(parse_slots(&junk).is_empty(), "{junk:?}");
        }
    }
}
