//! `upstream_concurrency: N`: at most N requests outstanding to a route's
//! upstream, across every instance. A slot is taken before the request is
//! sent and given back when its answer's body ends (or is dropped).
//!
//! With Redis, the slots are one sorted set per route, each holder scored
//! by when its slot lapses (the route's total deadline and a second: no
//! exchange outlives it, and a crashed instance's slots lapse on their
//! own). One waiter per instance and route asks Redis at a time (the
//! others queue behind it here), every 5 ms doubling to 50 ms, so a long
//! queue costs Redis at most 200 calls a second per instance. When Redis
//! cannot answer, each instance allows N / `redis.instances` (at least 1)
//! on its own. Without Redis, N is this instance's own semaphore.
//! A request that finds no slot within `upstream_queue_timeout` is a 503
//! with Retry-After, and is not counted as an origin failure.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::cluster::protocol::{Layout, SLOT_ACQUIRE};
use crate::cluster::redis_link::{RedisLink, arg};

/// One route's slots.
pub struct UpstreamSlots {
    route: String,
    max: u32,
    pub queue_timeout: Duration,
    /// How long a shared slot is held at most.
    hold: Duration,
    /// Without Redis: all N. With Redis: the fallback share.
    local: Arc<Semaphore>,
    shared: Option<Shared>,
}

struct Shared {
    link: Arc<RedisLink>,
    key: String,
    /// Only the waiter holding this asks Redis.
    asker: tokio::sync::Mutex<()>,
}

/// A slot held; given back when dropped.
pub struct Slot {
    _local: Option<OwnedSemaphorePermit>,
    shared: Option<(Arc<RedisLink>, String, String)>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some((link, key, member)) = self.shared.take()
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            rt.spawn(async move {
                let mut cmd = redis::cmd("ZREM");
                cmd.arg(&key).arg(&member);
                // If this fails the slot lapses on its own: fewer requests
                // to the origin for a while, never more.
                let _: Result<i64, _> = link.query(&cmd).await;
            });
        }
    }
}

/// No slot came free in time.
#[derive(Debug)]
pub struct Busy;

impl UpstreamSlots {
    fn new(
        route: &str,
        max: u32,
        queue_timeout: Duration,
        total: Duration,
        shared: Option<(Arc<RedisLink>, Layout, u32)>,
    ) -> Self {
        let local = match &shared {
            None => max,
            Some((_, _, instances)) => (max / instances.max(&1)).max(1),
        };
        UpstreamSlots {
            route: route.to_owned(),
            max,
            queue_timeout,
            hold: total + Duration::from_secs(1),
            local: Arc::new(Semaphore::new(local as usize)),
            shared: shared.map(|(link, layout, _)| Shared {
                link,
                key: layout.slots_key(route),
                asker: tokio::sync::Mutex::new(()),
            }),
        }
    }

    /// Waits for a slot until `upstream_queue_timeout` has passed.
    pub async fn acquire(&self) -> Result<Slot, Busy> {
        let deadline = Instant::now() + self.queue_timeout;
        let slot = match &self.shared {
            None => self.acquire_local(deadline).await,
            Some(shared) => self.acquire_shared(shared, deadline).await,
        };
        let outcome = match (&slot, &self.shared) {
            (None, _) => "timeout",
            (Some(s), Some(_)) if s.shared.is_some() => "shared",
            _ => "local",
        };
        crate::telemetry::metrics::upstream_slot(&self.route, outcome);
        slot.ok_or(Busy)
    }

    /// A slot of this instance's own semaphore.
    async fn acquire_local(&self, deadline: Instant) -> Option<Slot> {
        tokio::time::timeout_at(deadline, Arc::clone(&self.local).acquire_owned())
            .await
            .ok()
            .and_then(Result::ok)
            .map(|p| Slot {
                _local: Some(p),
                shared: None,
            })
    }

    async fn acquire_shared(&self, shared: &Shared, deadline: Instant) -> Option<Slot> {
        let Ok(_turn) = tokio::time::timeout_at(deadline, shared.asker.lock()).await else {
            return None;
        };
        let member = format!("{:032x}", rand::random::<u128>());
        let mut pause = Duration::from_millis(5);
        loop {
            let r: Result<i64, _> = shared
                .link
                .script(
                    &SLOT_ACQUIRE,
                    &[&shared.key],
                    &[
                        arg(self.max),
                        member.clone().into_bytes(),
                        arg(crate::cluster::protocol::millis(self.hold)),
                    ],
                )
                .await;
            match r {
                Ok(1) => {
                    return Some(Slot {
                        _local: None,
                        shared: Some((Arc::clone(&shared.link), shared.key.clone(), member)),
                    });
                }
                Ok(_) => {}
                Err(e) => {
                    // Redis is out of reach: this instance's share, alone.
                    tracing::debug!(route = %self.route, error = %e, "upstream slots: Redis unreachable, counting locally");
                    return self.acquire_local(deadline).await;
                }
            }
            if Instant::now() + pause >= deadline {
                return None;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }
}

/// The slots of every route, kept across reloads so that a reload neither
/// forgets the requests under way nor doubles the limit for a moment.
#[derive(Default)]
pub struct SlotRegistry {
    routes: Mutex<HashMap<String, Arc<UpstreamSlots>>>,
}

impl SlotRegistry {
    /// The slots for `route` with these settings: the same ones as before
    /// when nothing about them changed.
    pub fn get(
        &self,
        route: &str,
        max: u32,
        queue_timeout: Duration,
        total: Duration,
        shared: Option<(Arc<RedisLink>, Layout, u32)>,
    ) -> Arc<UpstreamSlots> {
        let mut map = self.routes.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(s) = map.get(route)
            && s.max == max
            && s.queue_timeout == queue_timeout
            && s.hold == total + Duration::from_secs(1)
        {
            return Arc::clone(s);
        }
        let s = Arc::new(UpstreamSlots::new(route, max, queue_timeout, total, shared));
        map.insert(route.to_owned(), Arc::clone(&s));
        s
    }

    /// Forgets the routes a new configuration no longer has (requests
    /// under way keep their slots through their own references).
    pub fn keep_only<'n>(&self, routes: impl IntoIterator<Item = &'n str>) {
        let keep: std::collections::HashSet<&str> = routes.into_iter().collect();
        self.routes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|name, _| keep.contains(name.as_str()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reload_keeps_the_slots_of_routes_it_still_has_and_forgets_the_rest() {
        let r = SlotRegistry::default();
        let t = Duration::from_secs(1);
        let a = r.get("a", 2, t, t, None);
        let b = r.get("b", 2, t, t, None);
        r.keep_only(["a"]);
        assert!(
            Arc::ptr_eq(&a, &r.get("a", 2, t, t, None)),
            "kept across the reload"
        );
        assert!(
            !Arc::ptr_eq(&b, &r.get("b", 2, t, t, None)),
            "forgotten, then new"
        );
        assert_eq!(
            r.routes
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .len(),
            2
        );
    }
}
