//! The second coalescing tier: one leader per key across every instance.
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

use corral_core::{EntryState, StoredResponse, VariantKey};
use tokio::time::Instant;

use crate::cache::fill::{Ended, FillOutcome, FillRequest, fetch_and_store};
use crate::cluster::l2::{L2, Probe};
use crate::cluster::lease;
use crate::cluster::protocol::FillNotice;
use crate::cluster::protocol::Keys;
use crate::telemetry::metrics;

const POLL_FIRST: Duration = Duration::from_millis(25);
const POLL_MAX: Duration = Duration::from_millis(250);

/// A local flight's leader (or a background refresh) fills through the
/// shared tier: L2, then the lease.
pub async fn fill(fill: &FillRequest, l2: &Arc<L2>) -> Ended {
    let app = &fill.app;
    let deadline = Instant::now() + fill.route.lock_timeout;
    let (keys, mut probe) = match first_read(fill, l2).await {
        Ok(read) => read,
        Err(e) => return local(fill, &e.to_string()).await,
    };
    let mut backoff = POLL_FIRST;
    let mut waited = false;
    loop {
        if let Some(hit) = usable(fill, &mut probe) {
            return hit;
        }
        if probe.pass {
            return Ended::PassKnown;
        }
        // The origin is failing for this key (this instance or another saw
        // it): no lease, no fetch; the gate answers stale or an error.
        if app
            .l1
            .active_backoff(&fill.pass_scope(), SystemTime::now())
            .is_some()
        {
            return fetch_and_store(fill).await;
        }
        let had_backoff = probe.backoff.is_some();
        let generation = probe.generation;
        match lease::acquire(&l2.link, keys.lease(), l2.lease_ttl).await {
            // A slow Redis may still have granted the lease: fetch here,
            // and still try to share the answer, so that waiters elsewhere
            // do not wait out a lease nobody will release.
            Err(e) => return local_then_share(fill, l2, &keys, generation, &e.to_string()).await,
            Ok(Some(lease)) => {
                metrics::lease(if waited { "taken_over" } else { "acquired" });
                // Other instances now wait on this fill.
                fill.committed
                    .store(true, std::sync::atomic::Ordering::Release);
                // Double-check: the previous leader may have stored it just
                // before releasing.
                if let Ok(mut again) = read(fill, l2, &keys).await
                    && let Some(hit) = usable(fill, &mut again)
                {
                    let _ = lease.release().await;
                    return hit;
                }
                let watchdog = lease.watchdog();
                let ended = fetch_and_store(fill).await;
                let result = match &ended {
                    Ended::Outcome(FillOutcome::Stored { entry, .. }) => {
                        Fetched::Stored(Arc::clone(entry))
                    }
                    Ended::Stream(..) | Ended::PassKnown => Fetched::Pass,
                    Ended::Outcome(_) => Fetched::Failed,
                };
                let notice = publish_result(fill, l2, &keys, result, generation, had_backoff).await;
                drop(watchdog);
                if let Ok(false) = lease.release().await {
                    tracing::warn!(lease = %keys.lease(), "the lease had passed to another leader before release");
                }
                let _ = l2.publish(&keys, notice).await;
                return ended;
            }
            Ok(None) => {
                metrics::lease("lost");
                waited = true;
            }
        }
        // Someone else leads: wait for its notice, polling as a safety net.
        let mut watch = l2.watch(&keys).await;
        loop {
            probe = match read(fill, l2, &keys).await {
                Ok(p) => p,
                Err(e) => return local(fill, &e.to_string()).await,
            };
            if probe.pass || !probe.lease_held || can_serve(fill, &probe) {
                break; // served, passed, or the lease is free to take over
            }
            let now = Instant::now();
            if now >= deadline {
                return lock_timeout(fill).await;
            }
            let jitter = Duration::from_millis(rand::random::<u64>() % 10);
            let wait = (backoff + jitter).min(deadline - now);
            tokio::select! {
                n = watch.next() => match n {
                    // The leader's fetch failed and stored nothing. Its
                    // back-off is in Redis: read it (and any stale copy)
                    // so that this instance leaves the origin alone too,
                    // rather than every waiting instance asking it again.
                    Some(FillNotice::Failed) => {
                        let _ = read(fill, l2, &keys).await;
                        return fetch_and_store(fill).await;
                    }
                    Some(_) => {}
                    None => tokio::time::sleep(wait).await,
                },
                _ = tokio::time::sleep(wait) => {
                    backoff = (backoff * 2).min(POLL_MAX);
                }
            }
        }
        drop(watch);
        if Instant::now() >= deadline && !can_serve(fill, &probe) {
            return lock_timeout(fill).await;
        }
    }
}

/// A fill that does not coalesce (the route turned coalescing off, the
/// caller's view is hit-for-pass, or it left a flight that was not its
/// own): L2 is a cache for it like L1, so it reads L2 and writes what it
/// fetched there, but it takes no lease and waits for nobody, so each such
/// request reaches the origin on its own, as it would without Redis.
pub async fn fill_alone(fill: &FillRequest, l2: &Arc<L2>) -> Ended {
    let (keys, mut probe) = match first_read(fill, l2).await {
        Ok(read) => read,
        Err(e) => return local(fill, &e.to_string()).await,
    };
    if let Some(hit) = usable(fill, &mut probe) {
        return hit;
    }
    if probe.pass {
        return Ended::PassKnown;
    }
    let ended = fetch_and_store(fill).await;
    let result = match &ended {
        Ended::Outcome(FillOutcome::Stored { entry, .. }) => Fetched::Stored(Arc::clone(entry)),
        Ended::Stream(..) | Ended::PassKnown => Fetched::Pass,
        Ended::Outcome(_) => Fetched::Failed,
    };
    // Nobody waits on this fill's lease: the record is written (entry,
    // hit-for-pass or back-off), no notice is sent.
    publish_result(
        fill,
        l2,
        &keys,
        result,
        probe.generation,
        probe.backoff.is_some(),
    )
    .await;
    ended
}

/// The first read of a fill: the variant's keys and what L2 holds for them.
/// Another instance may know this URI's Vary set already: it is used, so
/// that the right variant is read (and the right lease taken).
async fn first_read(
    fill: &FillRequest,
    l2: &L2,
) -> Result<(Keys, Probe), crate::cluster::redis_link::L2Error> {
    let app = &fill.app;
    let keys = l2.keys(&fill.primary, fill.variant.digest, fill.identity.as_ref());
    let mut probe = read(fill, l2, &keys).await?;
    let mut keys = keys;
    if let Some(vary) = &probe.vary
        && *vary != app.l1.learned_vary(&fill.primary)
    {
        app.l1.learn_vary(&fill.primary, vary);
        let values = vary.values(&fill.head.headers);
        let variant = fill.primary.variant(fill.identity.as_ref(), &values);
        if variant != fill.variant {
            keys = l2.keys(&fill.primary, variant.digest, fill.identity.as_ref());
            probe = read(fill, l2, &keys).await?;
        }
    }
    metrics::l2(if can_serve(fill, &probe) {
        "hit"
    } else {
        "miss"
    });
    Ok((keys, probe))
}

/// Reads the variant's keys; the entry comes back labelled with its URI and
/// screened by the purges (bans) in force. A back-off another instance
/// recorded is adopted here, and an entry too old to serve fresh but still
/// good for stale-if-error is kept as the fill's fallback, so an instance
/// with no copy of its own serves Redis's when the origin fails.
async fn read(
    fill: &FillRequest,
    l2: &L2,
    keys: &Keys,
) -> Result<Probe, crate::cluster::redis_link::L2Error> {
    let app = &fill.app;
    let mut probe = l2.probe(keys, app.l1.generation_stamp()).await?;
    probe.entry = probe.entry.take().and_then(|e| {
        let e = Arc::new(e.with_uri(fill.primary.uri().readable()));
        app.l1.apply_bans(e).map(Arc::unwrap_or_clone)
    });
    let now = SystemTime::now();
    let scope = fill.pass_scope();
    if let Some(theirs) = probe.backoff.filter(|b| b.active(now))
        && app
            .l1
            .active_backoff(&scope, now)
            .is_none_or(|ours| ours.until < theirs.until)
    {
        app.l1
            .set_backoff(scope, theirs, fill.route.backoff.memory());
    }
    if let Some(e) = &probe.entry
        && !can_serve(fill, &probe)
        && e.usable_on_error(now)
        && e.matches_vary(&fill.head.headers)
    {
        fill.offer_stale(Arc::new(e.clone()));
    }
    Ok(probe)
}

/// True when the probe's entry can answer this fill: usable now, the
/// request's variant, and, for a refresh (SWR, early refresh, revalidation),
/// newer than the copy being refreshed, or the refresh would never reach
/// the origin.
fn can_serve(fill: &FillRequest, probe: &Probe) -> bool {
    probe.entry.as_ref().is_some_and(|e| {
        matches!(
            e.state(SystemTime::now()),
            EntryState::Fresh | EntryState::StaleWhileRevalidate
        ) && e.matches_vary(&fill.head.headers)
            && fill
                .stale()
                .is_none_or(|old| e.response_time() > old.response_time())
    })
}

/// A probe's entry, if it can answer now: stored into L1 and returned.
fn usable(fill: &FillRequest, probe: &mut Probe) -> Option<Ended> {
    if !can_serve(fill, probe) {
        return None;
    }
    let entry = Arc::new(probe.entry.take()?);
    let key: VariantKey = fill.entry_key(&entry);
    fill.app.l1.learn_vary(&fill.primary, entry.vary());
    fill.app
        .l1
        .insert(&key, fill.primary.uri(), Arc::clone(&entry));
    Some(Ended::Outcome(FillOutcome::Stored {
        entry,
        fwd: None,
        fwd_status: None,
    }))
}

/// Writes L2 for what the fill got, and names the notice to send.
/// What the leader's fetch came to, as L2 records it.
enum Fetched {
    Stored(Arc<StoredResponse>),
    Pass,
    Failed,
}

/// `had_backoff`: the key was in back-off when read, so a success clears it
/// for every instance.
async fn publish_result(
    fill: &FillRequest,
    l2: &L2,
    keys: &Keys,
    fetched: Fetched,
    generation: u64,
    had_backoff: bool,
) -> FillNotice {
    if had_backoff && !matches!(fetched, Fetched::Failed) {
        let _ = l2.clear_backoff(keys).await;
    }
    match fetched {
        Fetched::Stored(entry) => {
            store(l2, fill, keys, &entry, generation).await;
            FillNotice::Stored
        }
        Fetched::Pass => {
            let _ = l2.mark_pass(keys, fill.route.policy.hit_for_pass).await;
            FillNotice::Pass
        }
        Fetched::Failed => {
            // Before the notice: the waiting instances read it on Failed.
            let now = SystemTime::now();
            if let Some(backoff) = fill.app.l1.active_backoff(&fill.pass_scope(), now) {
                let _ = l2
                    .set_backoff(keys, &backoff, fill.route.backoff.memory())
                    .await;
            }
            FillNotice::Failed
        }
    }
}

async fn store(l2: &L2, fill: &FillRequest, keys: &Keys, entry: &StoredResponse, generation: u64) {
    // The entry may be stored under another variant than the flight's
    // (a shareable answer to an authenticated request, a new Vary).
    let stored_key = fill.entry_key(entry);
    let target = if stored_key.digest == fill.variant.digest {
        None
    } else {
        Some(l2.keys(&fill.primary, stored_key.digest, fill.identity.as_ref()))
    };
    if let Err(e) = l2
        .store(target.as_ref().unwrap_or(keys), entry, generation)
        .await
    {
        tracing::warn!(key = %fill.primary.loggable(), error = %e, "L2 write failed; the entry stays in L1");
    }
}

async fn local(fill: &FillRequest, why: &str) -> Ended {
    tracing::debug!(key = %fill.primary.loggable(), reason = why, "Redis unavailable: coalescing locally");
    fetch_and_store(fill).await
}

/// `local`, then a best-effort L2 write and notice.
async fn local_then_share(
    fill: &FillRequest,
    l2: &L2,
    keys: &Keys,
    generation: u64,
    why: &str,
) -> Ended {
    let ended = local(fill, why).await;
    if let Ended::Outcome(FillOutcome::Stored { entry, .. }) = &ended {
        let entry = Arc::clone(entry);
        store(l2, fill, keys, &entry, generation).await;
        let _ = l2.publish(keys, FillNotice::Stored).await;
    }
    ended
}

async fn lock_timeout(fill: &FillRequest) -> Ended {
    metrics::lease("timed_out");
    match crate::cache::fill::on_lock_timeout(fill) {
        Some(outcome) => Ended::Outcome(outcome),
        None => fetch_and_store(fill).await,
    }
}
