//! The third layer of the miss path, the second coalescing tier: one leader per key across every instance,
//! as a state machine over the [`SharedTier`] seam (Read → Acquire →
//! lead, or → Follow → Read again, or → TakeOver when the holder has held
//! the lease past `lock_age`; every exit named).
//! Only a local flight's leader (or background refresh) enters it through
//! [`fill`], so each instance sends at most one request per key to Redis;
//! a fill that does not coalesce uses L2 as a cache through [`fill_alone`]
//! and never takes the lease. It reads L2 (a hit ends the flight), else
//! takes the lease: the winner re-reads L2, fetches, writes L2, releases and
//! announces; the others wait for the announcement on the instance's
//! long-lived subscription (registered before the first read), read L2
//! once when it comes, and otherwise once per lease window without a word
//! from the leader (its renewals are announced): a lost notice or a dead
//! leader costs one read, not a series of polls. The first read and the
//! lease attempt are one round trip, so a waiting instance costs Redis a
//! constant per fill (about 3 commands) whatever the origin's latency.
//! Any Redis trouble falls back to fetching locally: Redis never fails a
//! request.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use crate::cache::fill::{Ended, Events, FillEvent, FillOutcome, FillRequest};
use crate::cache::gate;
use crate::cache::records::{Fetched, can_serve, first_read, publish_result, read, store, usable};
use crate::cache::relay::{self, Relay};
use crate::cluster::protocol::{FillNotice, Keys};
use crate::cluster::redis_link::L2Error;
use crate::cluster::tier::{HeldLease, Notices, Probe, SharedTier};
use crate::config::OnTimeout;
use crate::telemetry::metrics::{self, Lease};

/// Where a shared flight stands between two round trips.
enum State {
    /// L2 was read: serve what it holds, pass, leave a failing origin
    /// alone, or go for the lease.
    Read(Read),
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

/// A read of L2, as the fill goes on from it.
struct Read {
    probe: Box<Probe>,
    /// Another fill held the lease before, so taking it now is a takeover.
    waited: bool,
    /// The first read took the lease with it (nothing was stored to
    /// double-check).
    lease: Option<Box<dyn HeldLease>>,
}

/// Where a fill that leads comes from: the generation its read saw,
/// whether the key was in back-off, and whether the lease was taken with
/// the read that found nothing stored (no double-check then).
#[derive(Clone, Copy)]
struct LeadFrom {
    generation: u64,
    had_backoff: bool,
    checked: bool,
}

impl LeadFrom {
    fn probe(probe: &Probe, checked: bool) -> Self {
        LeadFrom {
            generation: probe.generation,
            had_backoff: probe.backoff.is_some(),
            checked,
        }
    }
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
pub async fn fill(fill: &FillRequest, tier: &dyn SharedTier, events: &Events) -> Ended {
    let deadline = Instant::now() + patience(fill);
    let (keys, mut notices, probe, lease) = match watch_and_read(fill, tier).await {
        Ok(read) => read,
        Err(e) => return local(fill, events, &e).await,
    };
    // One takeover per fill: a lease taken over is not taken over again.
    let mut lock_age = fill.shared().coalesce.lock_age;
    let mut state = State::Read(Read {
        probe: Box::new(probe),
        waited: false,
        lease,
    });
    // When this fill began to wait on another instance's: an answer that
    // fetch got after it is one this caller was collapsed onto.
    let mut following_since = None;
    let mut relay = Relay::new(events, deadline); // the leader's body, as it arrives
    loop {
        state = match state {
            State::Read(read) => {
                let since = following_since.filter(|_| read.waited);
                match after_read(fill, tier, &keys, read, since, events).await {
                    Ok(next) => next,
                    Err(ended) => return relay.ended(ended),
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
                    return local_then_share(fill, tier, &keys, generation, events, &e).await;
                }
                Ok(Some(lease)) => {
                    metrics::lease(if waited {
                        Lease::TakenOver
                    } else {
                        Lease::Acquired
                    });
                    let from = LeadFrom {
                        generation,
                        had_backoff,
                        checked: false,
                    };
                    return lead(fill, tier, &keys, lease, from, events).await;
                }
                Ok(None) => {
                    metrics::lease(Lease::Lost);
                    State::Follow
                }
            },
            State::Follow => {
                following_since.get_or_insert_with(|| fill.now());
                let followed = follow(
                    fill,
                    tier,
                    &keys,
                    deadline,
                    &mut notices,
                    &mut relay,
                    lock_age,
                )
                .await;
                match followed {
                    Followed::Read(probe) => State::Read(Read {
                        probe,
                        waited: true,
                        lease: None,
                    }),
                    Followed::AgedOut(probe) => {
                        lock_age = None;
                        State::TakeOver(probe)
                    }
                    Followed::LockTimeout => return lock_timeout(fill, events).await,
                    Followed::Failed | Followed::Local => return gate::fetch(fill, events).await,
                    Followed::Unavailable(e) => return local(fill, events, &e).await,
                }
            }
            State::TakeOver(probe) => match take_over(fill, tier, &keys, &probe, events).await {
                Ok(next) => next,
                Err(ended) => return ended,
            },
        };
    }
}

/// Takes over the lease `probe` saw held past `lock_age`: leads the fill
/// (`Err`, its end), or waits on the instance that took it first.
async fn take_over(
    fill: &FillRequest,
    tier: &dyn SharedTier,
    keys: &Keys,
    probe: &Probe,
    events: &Events,
) -> Result<State, Ended> {
    let seen = probe.lease.as_deref().unwrap_or_default();
    match tier.take_over(keys, seen).await {
        Err(e) => Err(local(fill, events, &e).await),
        Ok(Some(lease)) => {
            metrics::lease(Lease::AgedOut);
            let from = LeadFrom::probe(probe, false);
            Err(lead(fill, tier, keys, lease, from, events).await)
        }
        // Another instance took it first: wait on that one.
        Ok(None) => Ok(State::Follow),
    }
}

/// Registers this fill for its variant's notices (in memory) before the
/// first read, so a notice published after that read reaches it, then
/// reads (taking the lease if nothing is there).
async fn watch_and_read(
    fill: &FillRequest,
    tier: &dyn SharedTier,
) -> Result<(Keys, Box<dyn Notices>, Probe, Option<Box<dyn HeldLease>>), L2Error> {
    let first = tier.keys(
        &fill.primary,
        fill.variant.digest,
        fill.pass_class().as_ref(),
    );
    let mut notices = tier.watch(&first).await;
    let (keys, probe, lease) = first_read(fill, tier, true).await?;
    if keys != first {
        notices = tier.watch(&keys).await;
    }
    Ok((keys, notices, probe, lease))
}

/// What a read of L2 leads to: an answer (`Err`, the fill's end), or the
/// next state. A lease the read took with it is led with, or given back
/// when the read answers after all (or a back-off this instance knows of
/// says not to fetch).
async fn after_read(
    fill: &FillRequest,
    tier: &dyn SharedTier,
    keys: &Keys,
    read: Read,
    since: Option<SystemTime>,
    events: &Events,
) -> Result<State, Ended> {
    let Read {
        mut probe,
        waited,
        lease,
    } = read;
    let judged = judge(fill, &mut probe, since).await;
    if let Some(lease) = lease {
        if let Judged::Fetch = judged {
            metrics::lease(Lease::Acquired);
            let from = LeadFrom::probe(&probe, true);
            return Err(lead(fill, tier, keys, lease, from, events).await);
        }
        let _ = lease.release().await;
    }
    Ok(match judged {
        Judged::Serve(hit) => return Err(hit),
        Judged::Pass => return Err(pass_known(fill, events).await),
        Judged::Backoff => return Err(gate::fetch(fill, events).await),
        // The read saw the lease held: no attempt to take it (a round
        // trip that could only fail), wait.
        Judged::Fetch if probe.lease_held => {
            metrics::lease(Lease::Lost);
            State::Follow
        }
        Judged::Fetch => State::Acquire {
            generation: probe.generation,
            had_backoff: probe.backoff.is_some(),
            waited,
        },
    })
}

/// How long a waiter on another instance's lease waits. Under
/// `on_timeout: fetch` it waits as long as a live lease stands: its holder
/// renews it every `lease_window / 3` while it fetches, and a dead holder's
/// lapses within `lease_window`, when one waiter takes it. `lock_timeout`
/// does not end that wait (it would send every waiting instance to the
/// origin at once, nginx's `proxy_cache_lock_timeout`); the caller's own
/// bound does: `lock_timeout` plus the exchange's `timeouts.total`, which
/// no live leader's fetch outlasts, as long as a local waiter waits on a
/// flight led after a lock timeout. The other choices give up at
/// `lock_timeout` as asked: `stale` and `error` send nothing to the origin,
/// and `fetch_each` is the stampede chosen.
fn patience(fill: &FillRequest) -> Duration {
    let coalesce = fill.shared().coalesce;
    if coalesce.on_timeout == OnTimeout::Fetch {
        coalesce.lock_timeout + fill.origin().total
    } else {
        coalesce.lock_timeout
    }
}

async fn judge(fill: &FillRequest, probe: &mut Probe, waited: Option<SystemTime>) -> Judged {
    if let Some(hit) = usable(fill, probe, waited).await {
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
    fill: &FillRequest,
    tier: &dyn SharedTier,
    keys: &Keys,
    lease: Box<dyn HeldLease>,
    from: LeadFrom,
    events: &Events,
) -> Ended {
    let LeadFrom {
        generation,
        had_backoff,
        checked,
    } = from;
    events.send(FillEvent::Committed);
    // Double-check: the previous leader may have stored it just before
    // releasing.
    if !checked
        && let Ok(mut again) = read(fill, tier, keys).await
        && let Some(hit) = usable(fill, &mut again, None).await
    {
        let _ = lease.release().await;
        return hit;
    }
    let name = lease.name().to_owned();
    let value = lease.value().to_owned();
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
                // Relayed to the waiting instances as it arrives.
                if let FillEvent::Streaming(outcome) = &event && lease.is_some() {
                    relay::pump(fill, keys, &value, outcome);
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

/// Waits for the lease holder's notice and reads L2 once when it comes.
/// The lease standing is the holder's proof of life: it renews it every
/// third of a lease window while it fetches, and says so (an `Alive`
/// notice), so the wait goes on while it speaks (to `deadline`). A window
/// without a word (a lost notice, a dead holder, an older corral that does
/// not say) costs one read: by then a dead holder's lease has lapsed, and
/// this waiter reads again and may take it. A read that times out is
/// tried once more before this instance fetches on its own.
async fn follow(
    fill: &FillRequest,
    tier: &dyn SharedTier,
    keys: &Keys,
    deadline: Instant,
    notices: &mut Box<dyn Notices>,
    relay: &mut Relay,
    lock_age: Option<Duration>,
) -> Followed {
    let window = tier.lease_window();
    let mut quiet_until = Instant::now() + window;
    // When to ask Redis how long the holder has held the lease (on its
    // clock: the holder's and this host's may disagree by any amount).
    let mut age_check = lock_age.map(|_| Instant::now());
    // A read that timed out was tried again once.
    let mut retried = false;
    loop {
        if let (Some(age), Some(at)) = (lock_age, age_check)
            && Instant::now() >= at
        {
            match tier.lease_age(keys).await {
                Err(e) => return Followed::Unavailable(e),
                Ok(Some((value, held))) if held >= age => {
                    return aged_out(fill, tier, keys, value).await;
                }
                Ok(Some((_, held))) => age_check = Some(Instant::now() + (age - held)),
                // Released since: read now.
                Ok(None) => quiet_until = Instant::now(),
            }
        }
        let wake = [Some(deadline), Some(quiet_until), age_check]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(deadline);
        let notice = tokio::select! {
            n = notices.next() => match n {
                Some(n) => Some(n),
                // No notice can come: wait for the clock.
                None => {
                    tokio::time::sleep_until(wake).await;
                    None
                }
            },
            () = tokio::time::sleep_until(wake) => None,
        };
        match notice {
            // The holder renewed its lease: alive, still fetching.
            Some(FillNotice::Alive) => {
                quiet_until = Instant::now() + window;
                continue;
            }
            // Its head is in and its body is relayed: this instance's
            // callers read it as it arrives (alive, too).
            Some(FillNotice::Relaying) => {
                relay.start(fill, keys);
                quiet_until = Instant::now() + window;
                continue;
            }
            // The leader's fetch failed and stored nothing. Its back-off
            // is in Redis: read it (and any stale copy) so that this
            // instance leaves the origin alone too, rather than every
            // waiting instance asking it again.
            Some(FillNotice::Failed) => {
                let _ = read(fill, tier, keys).await;
                return Followed::Failed;
            }
            // Nothing will be in L2 to wait for: fetch now.
            Some(FillNotice::Local) => return Followed::Local,
            // Read: an entry, a pass marker, or (the leader's write
            // failed) a free lease this instance may take.
            Some(FillNotice::Stored | FillNotice::Pass | FillNotice::Unwritten) => {}
            None => {
                let now = Instant::now();
                // Only the lease's age was due: ask it, read nothing.
                if now < quiet_until && now < deadline {
                    continue;
                }
            }
        }
        match read_again(fill, tier, keys, deadline, window, &mut retried).await {
            Ok(followed) => return followed,
            Err(next) => quiet_until = next,
        }
    }
}

/// A waiter's read after a notice or a window without one: how the wait
/// ends, or (`Err`) when to read next. Redis answering too slowly is not
/// Redis gone: a read that times out is tried once more a third of a
/// window on, rather than this instance fetching on its own (the leader's
/// answer is most likely there by then; in a large fleet, one slow read
/// would otherwise send a waiting instance to the origin). A second slow
/// read fetches alone.
async fn read_again(
    fill: &FillRequest,
    tier: &dyn SharedTier,
    keys: &Keys,
    deadline: Instant,
    window: Duration,
    retried: &mut bool,
) -> Result<Followed, Instant> {
    let probe = match read(fill, tier, keys).await {
        Ok(p) => p,
        Err(L2Error::Timeout(t)) if !*retried && Instant::now() < deadline => {
            tracing::debug!(key = %fill.primary.loggable(), timeout = ?t, "a waiting read timed out: reading once more");
            *retried = true;
            return Err(Instant::now() + window / 3);
        }
        Err(e) => return Ok(Followed::Unavailable(e)),
    };
    if probe.pass || !probe.lease_held || can_serve(fill, &probe) {
        // Served, passed, or the lease is free to take over.
        if Instant::now() >= deadline && !can_serve(fill, &probe) {
            return Ok(Followed::LockTimeout);
        }
        return Ok(Followed::Read(Box::new(probe)));
    }
    if Instant::now() >= deadline {
        return Ok(Followed::LockTimeout);
    }
    // Still held: a live holder whose word was lost (read again a window
    // on), or one about to lapse (a third of one on).
    Err(Instant::now() + window / 3)
}

/// The holder has held the lease past `lock_age`: what L2 holds now, and
/// the lease's value to take it over from, unless the read answers.
async fn aged_out(
    fill: &FillRequest,
    tier: &dyn SharedTier,
    keys: &Keys,
    value: String,
) -> Followed {
    let mut probe = match read(fill, tier, keys).await {
        Ok(p) => p,
        Err(e) => return Followed::Unavailable(e),
    };
    if probe.pass || !probe.lease_held || can_serve(fill, &probe) {
        return Followed::Read(Box::new(probe));
    }
    probe.lease = Some(value);
    Followed::AgedOut(Box::new(probe))
}

/// A fill that does not coalesce (the route turned coalescing off, the
/// caller's view is hit-for-pass, or it left a flight that was not its
/// own): L2 is a cache for it like L1, so it reads L2 and writes what it
/// fetched there, but it takes no lease and waits for nobody, so each such
/// request reaches the origin on its own, as it would without Redis.
pub async fn fill_alone(fill: &FillRequest, tier: &dyn SharedTier, events: &Events) -> Ended {
    let (keys, mut probe, _) = match first_read(fill, tier, false).await {
        Ok(read) => read,
        Err(e) => return local(fill, events, &e).await,
    };
    if let Some(hit) = usable(fill, &mut probe, None).await {
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
    generation: u64,
    events: &Events,
    why: &L2Error,
) -> Ended {
    let ended = local(fill, events, why).await;
    if let Ended::Outcome(FillOutcome::Stored { entry, .. }) = &ended {
        let entry = Arc::clone(entry);
        let notice = store(tier, fill, keys, &entry, generation).await.notice();
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
