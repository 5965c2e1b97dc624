//! What the shared tier reads and writes in L2 for one fill: the first
//! read (with the Vary set another instance learned), each probe screened
//! by the bans in force and merged with the back-off other instances
//! recorded, whether a probe's entry answers the fill, and what the
//! leader's fetch is recorded as (entry, pass marker, back-off) and
//! announced with.

use std::sync::Arc;

use corral_core::{EntryState, PassReason, StoredResponse, VariantKey};

use crate::cache::fill::{Ended, FillOutcome, FillRequest};
use crate::cache::{gate, rules};
use crate::cluster::protocol::{FillNotice, Keys};
use crate::cluster::redis_link::L2Error;
use crate::cluster::tier::{HeldLease, Probe, SharedTier};
use crate::telemetry::metrics;

/// The first read of a fill: the variant's keys and what L2 holds for them.
/// Another instance may know this URI's Vary set already: it is used, so
/// that the right variant is read (and the right lease taken). With
/// `lease`, the read also takes the variant's lease when nothing usable can
/// be there (one round trip: `SharedTier::probe_or_acquire`); a lease
/// taken on a variant the Vary set then moves the fill away from is given
/// back.
pub(crate) async fn first_read(
    fill: &FillRequest,
    tier: &dyn SharedTier,
    lease: bool,
) -> Result<(Keys, Probe, Option<Box<dyn HeldLease>>), L2Error> {
    let keys = tier.keys(
        &fill.primary,
        fill.variant.digest,
        fill.pass_class().as_ref(),
    );
    let (probe, mut held) = if lease {
        // A caller that holds a stale copy of its own takes the lease even
        // over an entry: L2's is likely as old (it judges it, and gives
        // the lease back if L2's answers).
        let with_entry = fill.stale().is_some();
        let stamp = fill.l1().generation_stamp();
        let (probe, held) = tier.probe_or_acquire(&keys, stamp, with_entry).await?;
        (screen(fill, probe), held)
    } else {
        (read(fill, tier, &keys).await?, None)
    };
    let mut probe = probe;
    let mut keys = keys;
    if let Some(vary) = &probe.vary
        && *vary != fill.l1().learned_vary(&fill.primary)
    {
        fill.l1().learn_vary(&fill.primary, vary);
        let values = vary.values(&fill.head.headers);
        let variant = fill.primary.variant(fill.identity.as_ref(), &values);
        if variant != fill.variant {
            if let Some(wrong) = held.take() {
                let _ = wrong.release().await;
            }
            keys = tier.keys(&fill.primary, variant.digest, fill.pass_class().as_ref());
            probe = read(fill, tier, &keys).await?;
        }
    }
    metrics::l2(if can_serve(fill, &probe) {
        metrics::L2Read::Hit
    } else {
        metrics::L2Read::Miss
    });
    Ok((keys, probe, held))
}

/// Reads the variant's keys; the entry comes back labelled with its URI and
/// screened by the purges (bans) in force. A back-off another instance
/// recorded is adopted here, and an entry too old to serve fresh but still
/// good for stale-if-error is kept as the fill's fallback, so an instance
/// with no copy of its own serves Redis's when the origin fails.
pub(crate) async fn read(
    fill: &FillRequest,
    tier: &dyn SharedTier,
    keys: &Keys,
) -> Result<Probe, L2Error> {
    let probe = tier.probe(keys, fill.l1().generation_stamp()).await?;
    Ok(screen(fill, probe))
}

/// A probe as the fill uses it: its entry screened by the bans in force,
/// the back-off it carries adopted, a stale-if-error copy kept.
fn screen(fill: &FillRequest, mut probe: Probe) -> Probe {
    probe.entry = probe.entry.take().and_then(|e| {
        let e = Arc::new(e.with_uri(fill.primary.uri().readable()));
        fill.l1().apply_bans(e).map(Arc::unwrap_or_clone)
    });
    let now = fill.now();
    if let Some(theirs) = probe.backoff {
        gate::adopt_backoff(fill, theirs);
    }
    if let Some(e) = &probe.entry
        && !can_serve(fill, &probe)
        && e.usable_on_error(now)
        && e.matches_vary(&fill.head.headers)
    {
        fill.offer_stale(Arc::new(e.clone()));
    }
    probe
}

/// True when the probe's entry can answer this fill: usable now, the
/// request's variant, and, for a refresh (SWR, early refresh, revalidation),
/// newer than the copy being refreshed, or the refresh would never reach
/// the origin.
pub(crate) fn can_serve(fill: &FillRequest, probe: &Probe) -> bool {
    probe.entry.as_ref().is_some_and(|e| {
        matches!(
            e.state(fill.now()),
            EntryState::Fresh | EntryState::StaleWhileRevalidate
        ) && e.matches_vary(&fill.head.headers)
            && fill
                .stale()
                .is_none_or(|old| e.response_time() > old.response_time())
    })
}

/// A probe's entry, if it can answer now: stored into L1 and returned.
/// `waited`: since when this fill waited on another instance's fetch; an
/// entry that fetch got after then is one the caller was collapsed onto
/// (one got before was only being written: a hit).
pub(crate) async fn usable(
    fill: &FillRequest,
    probe: &mut Probe,
    waited: Option<std::time::SystemTime>,
) -> Option<Ended> {
    if !can_serve(fill, probe) {
        return None;
    }
    let read = probe.entry.take()?;
    let entry = crate::cache::store::from_l2(fill, read).await?;
    let entry = Arc::new(entry);
    let key: VariantKey = fill.entry_key(&entry);
    fill.l1().learn_vary(&fill.primary, entry.vary());
    rules::learn(fill, entry.headers());
    fill.l1()
        .insert(&key, fill.primary.uri(), Arc::clone(&entry));
    let collapsed = waited.is_some_and(|since| entry.response_time() >= since);
    Some(Ended::Outcome(FillOutcome::FromL2 {
        entry,
        waited: collapsed.then_some(fill.fwd),
    }))
}

/// What the leader's fetch came to, as L2 records it: taken from the
/// [`Ended`] before the writes (which await), since an `Ended` may hold the
/// leader's streamed body.
pub(crate) enum Fetched {
    Stored(Arc<StoredResponse>),
    /// Already in L2: another instance stored it.
    InL2,
    /// Uncacheable: every instance passes for a while.
    Pass,
    /// An answer shared in flight but not stored (a coalesced POST's):
    /// other instances fetch their own, and nothing is marked.
    Shared,
    Failed,
}

impl Fetched {
    pub(crate) fn of(ended: &Ended) -> Self {
        match ended {
            Ended::Outcome(FillOutcome::Stored { entry, .. }) => Fetched::Stored(Arc::clone(entry)),
            Ended::Outcome(FillOutcome::FromL2 { .. }) => Fetched::InL2,
            // An answer under another No-Vary-Search rule than the key's:
            // not uncacheable, and nothing is marked (the rule is
            // recorded; other instances' waiters fetch their own).
            Ended::Stream(PassReason::RuleChanged, _) => Fetched::Shared,
            // A stream, or a streamed answer that outgrew what is stored.
            Ended::Stream(..) | Ended::Outcome(FillOutcome::Pass { .. }) => Fetched::Pass,
            Ended::Outcome(FillOutcome::Shared { response, .. })
                if !response.status.is_server_error() =>
            {
                Fetched::Shared
            }
            // A 5xx (the origin's or corral's own), the stale copy
            // stale-if-error served, or (never from a fetch) a stream
            // handed out as an outcome.
            Ended::Outcome(
                FillOutcome::Shared { .. }
                | FillOutcome::Stale { .. }
                | FillOutcome::Streaming { .. },
            ) => Fetched::Failed,
        }
    }
}

/// Writes L2 for what the fill got, and names the notice to send.
/// `had_backoff`: the key was in back-off when read, so a success clears it
/// for every instance.
pub(crate) async fn publish_result(
    fill: &FillRequest,
    tier: &dyn SharedTier,
    keys: &Keys,
    fetched: Fetched,
    generation: u64,
    had_backoff: bool,
) -> FillNotice {
    if had_backoff && !matches!(fetched, Fetched::Failed) {
        let _ = tier.delete_backoff(keys).await;
    }
    match fetched {
        Fetched::Stored(entry) => {
            // The path's rule, for the instances that know none yet.
            rules::publish(fill, entry.headers()).await;
            // A QUERY answer's GET aliases, written only where no
            // invalidation ever reached them (their generation was not
            // read: 0 is what a URI never invalidated has).
            for (primary, key) in crate::cache::store::aliases(fill, &entry) {
                let alias = tier.keys(&primary, key.digest, None);
                let now = fill.now();
                let _ = tier.write_entry(&alias, &entry, 0, now).await;
            }
            store(tier, fill, keys, &entry, generation).await.notice()
        }
        Fetched::InL2 => FillNotice::Stored,
        Fetched::Pass => {
            let _ = tier
                .write_pass(keys, fill.cache_params().policy.hit_for_pass)
                .await;
            FillNotice::Pass
        }
        Fetched::Shared => FillNotice::Pass,
        Fetched::Failed => FillNotice::Failed,
    }
}

/// How a write of the fill's entry to L2 went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Written {
    /// It is there to be read.
    Yes,
    /// It is not shared through L2: too large, or an invalidation came
    /// while it was fetched, or a full Redis refused it.
    NotShared,
    /// Redis failed or timed out on the write.
    Failed,
}

impl Written {
    /// What the waiting instances are told: read it; fetch their own
    /// (nothing will be there); or read once and take the lease, so that
    /// one of them fetches for the rest (the write may also have landed).
    pub(crate) fn notice(self) -> FillNotice {
        match self {
            Written::Yes => FillNotice::Stored,
            Written::NotShared => FillNotice::Local,
            Written::Failed => FillNotice::Unwritten,
        }
    }
}

/// Writes `entry` to L2.
pub(crate) async fn store(
    tier: &dyn SharedTier,
    fill: &FillRequest,
    keys: &Keys,
    entry: &StoredResponse,
    generation: u64,
) -> Written {
    // The entry may be stored under another variant than the flight's
    // (a shareable answer to an authenticated request, a new Vary).
    let stored_key = fill.entry_key(entry);
    let target = if stored_key.digest == fill.variant.digest {
        None
    } else {
        Some(tier.keys(&fill.primary, stored_key.digest, fill.pass_class().as_ref()))
    };
    match tier
        .write_entry(
            target.as_ref().unwrap_or(keys),
            entry,
            generation,
            fill.now(),
        )
        .await
    {
        Ok(true) => Written::Yes,
        Ok(false) => Written::NotShared,
        // A full Redis is logged once by the link, not per entry.
        Err(e) if e.is_full() => Written::NotShared,
        Err(e) => {
            tracing::warn!(key = %fill.primary.loggable(), error = %e, "L2 write failed; the entry stays in L1");
            Written::Failed
        }
    }
}
