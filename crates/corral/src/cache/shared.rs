//! The third layer of the miss path, the second coalescing tier: one leader per key across every instance,
//! as a state machine over the [`SharedTier`] seam (Read → Acquire →
//! lead, or → Follow → Read again, or → TakeOver when the holder has held
//! the lease past `lock_age`; every exit named).
//! Only a local flight's leader (or background refresh) enters it through
//! [`fill`], so each instance sends at most one request per key to Redis;
//! a fill that does not coalesce uses L2 as a cache through [`fill_alone`]
//! and never takes the lease. It reads L2 (a hit ends the flight), else
//! takes the lease: the winner re-reads L2, fetches, writes L2, releases and
//! announces; the others wait for the announcement on the shared subscriber
//! (subscribed before re-reading L2), polling L2 with backoff and jitter as
//! a safety net, and take the lease over if its holder dies. Any Redis
//! trouble falls back to fetching locally: Redis never fails a request.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use crate::cache::fill::{Ended, Events, FillEvent, FillOutcome, FillRequest};
use crate::cache::gate;
use crate::cache::records::{Fetched, can_serve, first_read, publish_result, read, store, usable};
use crate::cluster::protocol::{FillNotice, Keys};
use crate::cluster::redis_link::L2Error;
use crate::cluster::tier::{HeldLease, Probe, SharedTier};
use crate::config::OnTimeout;
use crate::telemetry::metrics::{self, Lease};

const POLL_FIRST: Duration = Duration::from_millis(25);
const POLL_MAX: Duration = Duration::from_millis(250);

/// Where a shared flight stands between two round trips.
enum State {
    /// L2 was read: serve what it holds, pass, leave a failing origin
    /// alone, or go for the lease. `waited`: another fill held the lease
    /// before, so taking it now is a takeover.
    Read { probe: Box<Probe>, waited: bool },
    /// Nothing to serve: take the lease (or learn that someone has it).
    Acquire {
        generation: u64,
        had_backoff: bool,
        waited: bool,
    },
    /// Another fill holds the lease: wait for its notice.
    Follow,
    /// The holder has held the lease past `lock_age`: take it over from
    /// it (exactly one waiting instance does).
    TakeOver(Box<Probe>),
}

/// What a read of L2 leads to.
enum Judged {
    /// L2's entry answers (stored into L1).
    Serve(Ended),
    /// The key is hit-for-pass across the cluster.
    Pass,
    /// The origin is in back-off for this key: no lease, no request; the
    /// fill's gate answers stale or an error.
    Backoff,
    /// Nothing usable: someone has to fetch.
    Fetch,
}

/// How a wait on another instance's fill ended.
enum Followed {
    /// It ended (an entry, a pass marker, or a free lease): read again.
    Read(Box<Probe>),
    /// The caller's bound passed with a lease still standing and nothing
    /// to serve.
    LockTimeout,
    /// Its fetch failed; the back-off it recorded was read.
    Failed,
    /// Its answer is not shared through L2: this instance fetches its own.
    Local,
    /// Redis stopped answering.
    Unavailable(L2Error),
    /// The holder has held the lease past `lock_age` (the probe that saw
    /// it, with the lease's value).
    AgedOut(Box<Probe>),
}

/// A local flight's leader (or a background refresh) fills through the
/// shared tier: L2, then the lease.
pub async fn fill(fill: &mut FillRequest, tier: &dyn SharedTier, events: &Events) -> Ended {
    let deadline = Instant::now() + patience(&fill.route);
    let (keys, probe) = match first_read(fill, tier).await {
        Ok(read) => read,
        Err(e) => return local(fill, events, &e).await,
    };
    let mut poll = POLL_FIRST;
    // One takeover per fill: a lease taken over is not taken over again.
    let mut lock_age = fill.route.lock_age;
    let mut state = State::Read {
        probe: Box::new(probe),
        waited: false,
    };
    // When this fill began to wait on another instance's: an answer that
    // fetch got after it is one this caller was collapsed onto.
    let mut following_since = None;
    loop {
        state = match state {
            State::Read { mut probe, waited } => {
                match judge(fill, &mut probe, following_since.filter(|_| waited)) {
                    Judged::Serve(hit) => return hit,
                    Judged::Pass => return pass_known(fill, events).await,
                    Judged::Backoff => return gate::fetch(fill, events).await,
                    Judged::Fetch => State::Acquire {
                        generation: probe.generation,
                        had_backoff: probe.backoff.is_some(),
                        waited,
                    },
                }
            }
            State::Acquire {
                generation,
                had_backoff,
                waited,
            } => match tier.acquire(&keys).await {
                // A slow Redis may still have granted the lease: fetch
                // here, and still try to share the answer, so that waiters
                // elsewhere do not wait out a lease nobody will release.
                Err(e) => {
                    return local_then_share(fill, tier, &keys, (generation, events), &e).await;
                }
                Ok(Some(lease)) => {
                    metrics::lease(if waited {
                        Lease::TakenOver
                    } else {
                        Lease::Acquired
                    });
                    return lead(fill, tier, &keys, lease, (generation, had_backoff), events).await;
                }
                Ok(None) => {
                    metrics::lease(Lease::Lost);
                    State::Follow
                }
            },
            State::Follow => {
                following_since.get_or_insert_with(|| fill.cache.clock.now());
                let followed = follow(fill, tier, &keys, deadline, &mut poll, lock_age).await;
                match followed {
                    Followed::Read(probe) => State::Read {
                        probe,
                        waited: true,
                    },
                    Followed::AgedOut(probe) => {
                        lock_age = None;
                        State::TakeOver(probe)
                    }
                    Followed::LockTimeout => return lock_timeout(fill, events).await,
                    Followed::Failed | Followed::Local => return gate::fetch(fill, events).await,
                    Followed::Unavailable(e) => return local(fill, events, &e).await,
                }
            }
            State::TakeOver(probe) => {
                let seen = probe.lease.as_deref().unwrap_or_default();
                match tier.take_over(&keys, seen).await {
                    Err(e) => return local(fill, events, &e).await,
                    Ok(Some(lease)) => {
                        metrics::lease(Lease::AgedOut);
                        let had_backoff = probe.backoff.is_some();
                        return lead(
                            fill,
                            tier,
                            &keys,
                            lease,
                            (probe.generation, had_backoff),
                            events,
                        )
                        .await;
                    }
                    // Another instance took it first: wait on that one.
                    Ok(None) => State::Follow,
                }
            }
        };
    }
}

/// How long a waiter on another instance's lease waits. Under
/// `on_timeout: fetch` it waits as long as a live lease stands: its holder
/// renews it every `lease_ttl / 3` while it fetches, and a dead holder's
/// lapses within `lease_ttl`, when one waiter takes it. `lock_timeout`
/// does not end that wait (it would send every waiting instance to the
/// origin at once, nginx's `proxy_cache_lock_timeout`); the caller's own
/// bound does: `lock_timeout` plus the exchange's `timeouts.total`, which
/// no live leader's fetch outlasts, as long as a local waiter waits on a
/// flight led after a lock timeout. The other choices give up at
/// `lock_timeout` as asked: `stale` and `error` send nothing to the origin,
/// and `fetch_each` is the stampede chosen.
fn patience(route: &crate::routes::Route) -> Duration {
    if route.on_timeout == OnTimeout::Fetch {
        route.lock_timeout + route.upstream.total
    } else {
        route.lock_timeout
    }
}

fn judge(fill: &FillRequest, probe: &mut Probe, waited: Option<SystemTime>) -> Judged {
    if let Some(hit) = usable(fill, probe, waited) {
        return Judged::Serve(hit);
    }
    if probe.pass {
        return Judged::Pass;
    }
    // The origin is failing for this key (this instance or another saw
    // it): the gate answers without a request.
    if gate::backing_off(fill) {
        return Judged::Backoff;
    }
    Judged::Fetch
}

/// The lease is this fill's: every other instance waits on it. The
/// fetch's events pass through here on their way up: an answer too large
/// for L2 is announced as soon as its head says so.
async fn lead(
    fill: &mut FillRequest,
    tier: &dyn SharedTier,
    keys: &Keys,
    lease: Box<dyn HeldLease>,
    (generation, had_backoff): (u64, bool),
    events: &Events,
) -> Ended {
    events.send(FillEvent::Committed);
    // Double-check: the previous leader may have stored it just before
    // releasing.
    if let Ok(mut again) = read(fill, tier, keys).await
        && let Some(hit) = usable(fill, &mut again, None)
    {
        let _ = lease.release().await;
        return hit;
    }
    let fill = &*fill;
    let name = lease.name().to_owned();
    let mut keep_alive = Some(lease.keep_alive());
    let mut lease = Some(lease);
    let (below, mut heard) = Events::channel(events.streams);
    let fetching = gate::fetch(fill, &below);
    tokio::pin!(fetching);
    let ended = loop {
        tokio::select! {
            ended = &mut fetching => break ended,
            Some(event) = heard.recv() => {
                let too_large = match event {
                    FillEvent::Declared(len) => len > tier.max_object_size(),
                    FillEvent::Overflowed => true,
                    _ => false,
                };
                if too_large && let Some(held) = lease.take() {
                    give_up(tier, keys, held, keep_alive.take()).await;
                }
                events.send(event);
            }
        }
    };
    // What the fetch said just before it ended still goes up.
    while let Ok(event) = heard.try_recv() {
        events.send(event);
    }
    let notice = publish_result(
        fill,
        tier,
        keys,
        Fetched::of(&ended),
        generation,
        had_backoff,
    )
    .await;
    drop(keep_alive);
    if let Some(lease) = lease
        && let Ok(false) = lease.release().await
    {
        tracing::warn!(lease = %name, "the lease had passed to another leader before release");
    }
    let _ = tier.publish(keys, notice).await;
    ended
}

/// An answer too large for L2: the lease is given up and the waiting
/// instances told at once, so they fetch their own copies now, side by
/// side (one that subscribed too late to hear it finds the lease free,
/// takes it, and learns the same from its own head), instead of waiting
/// out this download for an entry that will not come and then taking the
/// lease one after another.
async fn give_up(
    tier: &dyn SharedTier,
    keys: &Keys,
    held: Box<dyn HeldLease>,
    keep_alive: Option<Box<dyn Send>>,
) {
    metrics::lease(Lease::Local);
    drop(keep_alive);
    let _ = held.release().await;
    let _ = tier.publish(keys, FillNotice::Local).await;
}

/// Waits for the lease holder's notice, polling L2 with backoff and
/// jitter as a safety net (a notice can be lost; a holder can die). The
/// lease standing is the holder's proof of life: it renews it while it
/// fetches, so the wait goes on while it stands (to `deadline`), and ends
/// when it lapses: this waiter reads again and may take it.
async fn follow(
    fill: &mut FillRequest,
    tier: &dyn SharedTier,
    keys: &Keys,
    deadline: Instant,
    poll: &mut Duration,
    lock_age: Option<Duration>,
) -> Followed {
    // Subscribed before the read, so no notice falls between the two.
    let mut notices = tier.watch(keys).await;
    loop {
        let probe = match read(fill, tier, keys).await {
            Ok(p) => p,
            Err(e) => return Followed::Unavailable(e),
        };
        if probe.pass || !probe.lease_held || can_serve(fill, &probe) {
            // Served, passed, or the lease is free to take over.
            if Instant::now() >= deadline && !can_serve(fill, &probe) {
                return Followed::LockTimeout;
            }
            return Followed::Read(Box::new(probe));
        }
        let now = Instant::now();
        if now >= deadline {
            return Followed::LockTimeout;
        }
        // How long until the holder has held the lease for lock_age, on
        // Redis's clock: the holder's and this host's may disagree by
        // any amount.
        let aged_in = match lock_age {
            None => None,
            Some(age) => match tier.lease_age(keys).await {
                Err(e) => return Followed::Unavailable(e),
                // Released since the read: read again.
                Ok(None) => continue,
                Ok(Some((value, held))) if held >= age => {
                    let mut probe = probe;
                    probe.lease = Some(value);
                    return Followed::AgedOut(Box::new(probe));
                }
                Ok(Some((_, held))) => Some(age - held),
            },
        };
        let jitter = Duration::from_millis(rand::random::<u64>() % 10);
        let wait = (*poll + jitter)
            .min(deadline - now)
            .min(aged_in.unwrap_or(Duration::MAX));
        tokio::select! {
            n = notices.next() => match n {
                // The leader's fetch failed and stored nothing. Its
                // back-off is in Redis: read it (and any stale copy) so
                // that this instance leaves the origin alone too, rather
                // than every waiting instance asking it again.
                Some(FillNotice::Failed) => {
                    let _ = read(fill, tier, keys).await;
                    return Followed::Failed;
                }
                // Nothing will be in L2 to wait for: fetch now.
                Some(FillNotice::Local) => return Followed::Local,
                Some(_) => {}
                None => tokio::time::sleep(wait).await,
            },
            () = tokio::time::sleep(wait) => {
                *poll = (*poll * 2).min(POLL_MAX);
            }
        }
    }
}

/// A fill that does not coalesce (the route turned coalescing off, the
/// caller's view is hit-for-pass, or it left a flight that was not its
/// own): L2 is a cache for it like L1, so it reads L2 and writes what it
/// fetched there, but it takes no lease and waits for nobody, so each such
/// request reaches the origin on its own, as it would without Redis.
pub async fn fill_alone(fill: &mut FillRequest, tier: &dyn SharedTier, events: &Events) -> Ended {
    let (keys, mut probe) = match first_read(fill, tier).await {
        Ok(read) => read,
        Err(e) => return local(fill, events, &e).await,
    };
    if let Some(hit) = usable(fill, &mut probe, None) {
        return hit;
    }
    if probe.pass {
        return pass_known(fill, events).await;
    }
    let ended = gate::fetch(fill, events).await;
    // Nobody waits on this fill's lease: the record is written (entry,
    // hit-for-pass or back-off), no notice is sent.
    publish_result(
        fill,
        tier,
        &keys,
        Fetched::of(&ended),
        probe.generation,
        probe.backoff.is_some(),
    )
    .await;
    ended
}

/// Another instance found the key uncacheable: nothing to coalesce
/// across instances. This instance's waiters are released now (the
/// driver hears it), so that they fetch alongside this fill instead of
/// after it; its own fetch answers its leader when it is done.
async fn pass_known(fill: &FillRequest, events: &Events) -> Ended {
    fill.set_hit_for_pass();
    events.send(FillEvent::PassKnown);
    gate::fetch(fill, &events.without_streaming()).await
}

async fn local(fill: &FillRequest, events: &Events, why: &L2Error) -> Ended {
    tracing::debug!(key = %fill.primary.loggable(), reason = %why, "Redis unavailable: coalescing locally");
    gate::fetch(fill, events).await
}

/// `local`, then a best-effort L2 write and notice.
async fn local_then_share(
    fill: &FillRequest,
    tier: &dyn SharedTier,
    keys: &Keys,
    (generation, events): (u64, &Events),
    why: &L2Error,
) -> Ended {
    let ended = local(fill, events, why).await;
    if let Ended::Outcome(FillOutcome::Stored { entry, .. }) = &ended {
        let entry = Arc::clone(entry);
        let notice = if store(tier, fill, keys, &entry, generation).await {
            FillNotice::Stored
        } else {
            FillNotice::Local
        };
        let _ = tier.publish(keys, notice).await;
    }
    ended
}

async fn lock_timeout(fill: &FillRequest, events: &Events) -> Ended {
    metrics::lease(Lease::TimedOut);
    match crate::cache::synthetic::on_lock_timeout(fill) {
        Some(outcome) => Ended::Outcome(outcome),
        None => gate::fetch(fill, events).await,
    }
}

/// True when Redis cannot be used for `primary` now (its link or its
/// shard's breaker is down): what a fill would do there, it does alone.
pub(crate) fn unavailable(
    cache: &crate::cache::fill::Cache,
    primary: &corral_core::PrimaryKey,
) -> bool {
    cache.tier.as_ref().is_some_and(|t| t.unavailable(primary))
}
