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

use corral_core::{Coding, StoredResponse, UriKey, VariantKey};
use http::HeaderMap;

use crate::cache::Cache;
use crate::cache::cpu::Job;
use crate::config::CompressionConfig;

/// Where an entry is stored in L1.
pub struct Stored {
    pub key: VariantKey,
    pub uri: UriKey,
}

/// `entry` (stored at `at`, its codings pending) was asked for by a
/// caller sending `request`: the coding it prefers, if the entry lacks
/// it, is made in the background and stored beside the others.
pub fn demand(
    cache: &Arc<Cache>,
    route: &str,
    config: Option<&CompressionConfig>,
    at: Stored,
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
    tokio::spawn(async move {
        let _claim = cache.making.held(digest, coding);
        make(&cache, &route, &config, at, &entry, coding).await;
    });
}

/// Makes `coding` of `entry` on the CPU pool (not at all when it is
/// full: the next caller asks again) and stores the entry with it, unless
/// L1 holds another entry for the key by then (a refresh, a purge).
async fn make(
    cache: &Cache,
    route: &str,
    config: &CompressionConfig,
    at: Stored,
    entry: &Arc<StoredResponse>,
    coding: Coding,
) {
    let body = entry.body().clone();
    let Some(packed) = cache
        .cpu
        .try_run(Job::Compress, move || {
            crate::cache::compress::compress(coding, &body)
        })
        .await
        .flatten()
    else {
        return;
    };
    let current = cache.l1.get(at.key.local.as_bytes(), &at.uri);
    if !current.is_some_and(|c| Arc::ptr_eq(&c, entry)) {
        return;
    }
    crate::telemetry::metrics::compressed(route, coding.as_str(), entry.body().len(), packed.len());
    crate::telemetry::metrics::coding_on_demand(route, coding.as_str());
    let made = crate::cache::compress::with_coding(config, entry, coding, packed.into());
    cache.l1.insert(&at.key, &at.uri, Arc::new(made));
    #[cfg(test)]
    cache.making.made.fetch_add(1, Ordering::Relaxed);
}
