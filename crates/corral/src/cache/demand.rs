//! A stored answer's coding made when a caller first asks for it. An
//! answer stored for a HEAD, for a caller that accepts no coding, read
//! from L2 or stored while the CPU pool was full is kept unencoded and
//! marked (`StoredResponse::codings_pending`); the first hit that prefers
//! a coding it lacks has that one coding made on the CPU pool, once per
//! key and coding however many ask meanwhile, and answered unencoded (or
//! in another coding it accepts) until it is there. Nothing here runs on
//! the serving thread but a set lookup; a hit on a complete entry never
//! comes here.

use std::sync::Arc;
#[cfg(test)]
use std::sync::atomic::Ordering;
use std::time::Duration;

use corral_core::{Coding, PrimaryKey, StoredResponse, UriKey, VariantKey};
use http::HeaderMap;

use crate::cache::Cache;
use crate::cache::cpu::Job;
use crate::cluster::tier::KeptCoding;
use crate::config::CompressionConfig;

/// Where an entry is stored in L1.
pub struct Stored {
    pub key: VariantKey,
    pub uri: UriKey,
}

/// [`Stored`], with its URI's primary key (for its keys in Redis).
struct Place {
    key: VariantKey,
    uri: UriKey,
    primary: PrimaryKey,
}

/// `entry` (stored at `at`, its codings pending) was asked for by a
/// caller sending `request`: the coding it prefers, if the entry lacks
/// it, is made in the background and stored beside the others.
pub fn demand(
    cache: &Arc<Cache>,
    route: &str,
    config: Option<&CompressionConfig>,
    at: Stored,
    primary: &PrimaryKey,
    entry: &Arc<StoredResponse>,
    request: &HeaderMap,
) {
    let Some(config) = config else {
        return;
    };
    let Some(coding) = crate::cache::compress::demanded(config, entry, request) else {
        return;
    };
    let digest = at.key.digest;
    // Claimed here, so a second caller meanwhile spawns nothing; held by
    // the task, so the claim ends with it, even if it panics.
    if !cache.making.claim(digest, coding) {
        return;
    }
    let (cache, config, entry, route) = (
        Arc::clone(cache),
        config.clone(),
        Arc::clone(entry),
        route.to_owned(),
    );
    let at = Place {
        key: at.key,
        uri: at.uri,
        primary: primary.clone(),
    };
    tokio::spawn(async move {
        let _claim = cache.making.held(digest, coding);
        make(&cache, &route, &config, at, &entry, coding).await;
    });
}

/// Makes `coding` of `entry` (from Redis when another instance kept it,
/// else on the CPU pool; not at all when the pool is full: the next
/// caller asks again) and stores the entry with it, unless L1 holds
/// another entry for the key by then (a refresh, a purge).
async fn make(
    cache: &Cache,
    route: &str,
    config: &CompressionConfig,
    at: Place,
    entry: &Arc<StoredResponse>,
    coding: Coding,
) {
    let Some((packed, source)) = packed(cache, &at, entry, coding).await else {
        return;
    };
    let current = cache.l1.get(at.key.local.as_bytes(), &at.uri);
    if !current.is_some_and(|c| Arc::ptr_eq(&c, entry)) {
        return;
    }
    match source {
        Source::Made => {
            let (body, packed) = (entry.body().len(), packed.len());
            crate::telemetry::metrics::compressed(route, coding.as_str(), body, packed);
            crate::telemetry::metrics::coding_on_demand(route, coding.as_str());
        }
        Source::Shared => crate::telemetry::metrics::coding_from_l2(route, coding.as_str()),
    }
    let made = crate::cache::compress::with_coding(config, entry, coding, packed);
    cache.l1.insert(&at.key, &at.uri, Arc::new(made));
    #[cfg(test)]
    cache.making.made.fetch_add(1, Ordering::Relaxed);
}

/// Where a coding came from.
enum Source {
    /// Made here, on the CPU pool.
    Made,
    /// Read from Redis: another instance made it for the same body.
    Shared,
}

/// How long an instance's claim on making a coding holds the others off
/// (they read again meanwhile, then make it themselves): longer than any
/// one compression of a body Redis keeps takes.
const CLAIM: Duration = Duration::from_secs(5);

/// The first pause between two reads of a coding another instance is
/// making; it doubles up to [`LATEST_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(50);
const LATEST_PAUSE: Duration = Duration::from_millis(800);

/// `entry`'s body in `coding`. With Redis, what another instance kept
/// for the same body (named by its SHA-256, taken on the CPU pool) is
/// read first, and what is made here is kept there for the others: a
/// coding is made once per body across the fleet. Instances that ask at
/// the same moment make it once too: the read claims the making when
/// nothing is kept, and an instance that finds it claimed reads again a
/// moment later (its callers are answered meanwhile, unencoded or in
/// another coding they accept) until the coding is kept or the claim
/// lapses, which its maker's death costs. `None` when the CPU pool is
/// full (a claim taken is then ended at once).
async fn packed(
    cache: &Cache,
    at: &Place,
    entry: &Arc<StoredResponse>,
    coding: Coding,
) -> Option<(bytes::Bytes, Source)> {
    let body = entry.body().clone();
    let tier = cache.tier.as_ref().filter(|t| !t.unavailable(&at.primary));
    let Some(tier) = tier else {
        return made(cache, body, coding).await.map(|p| (p, Source::Made));
    };
    let keys = tier.keys(&at.primary, at.key.digest, None);
    let digest = {
        let body = body.clone();
        cache
            .cpu
            .try_run(Job::Digest, move || {
                corral_core::wire::digest::sha256(&body)
            })
            .await?
    };
    let mut pause = FIRST_PAUSE;
    // A bound of its own, should a claim be renewed by one maker after
    // another.
    let until = tokio::time::Instant::now() + CLAIM * 2;
    let claimed = loop {
        match tier
            .read_or_claim_coding(&keys, coding, digest, CLAIM)
            .await
        {
            Ok(KeptCoding::Found(packed)) => return Some((packed, Source::Shared)),
            Ok(KeptCoding::Busy) if tokio::time::Instant::now() + pause < until => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(LATEST_PAUSE);
            }
            Ok(KeptCoding::Make) => break true,
            Ok(KeptCoding::Busy) | Err(_) => break false,
        }
    };
    let Some(packed) = made(cache, body, coding).await else {
        // The pool filled up between the digest and this job: a claim
        // this instance cannot honour is ended, so that the others make
        // the coding now rather than wait out its life.
        if claimed && let Err(e) = tier.end_coding_claim(&keys, coding).await {
            tracing::debug!(key = %at.primary.loggable(), error = %e, "a coding's claim was left to lapse");
        }
        return None;
    };
    let ttl = entry.residency(cache.clock.now());
    if let Err(e) = tier.write_coding(&keys, coding, digest, &packed, ttl).await {
        tracing::debug!(key = %at.primary.loggable(), error = %e, "a coding was not kept in Redis");
    }
    Some((packed, Source::Made))
}

/// `body` in `coding`, made on the CPU pool; `None` when it is full.
async fn made(cache: &Cache, body: bytes::Bytes, coding: Coding) -> Option<bytes::Bytes> {
    cache
        .cpu
        .try_run(Job::Compress, move || {
            crate::cache::compress::compress(coding, &body)
        })
        .await
        .flatten()
        .map(Into::into)
}
