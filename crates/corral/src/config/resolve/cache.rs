//! Resolves `cache:`, the shared in-memory cache: what it holds, what fills may
//! buffer, and how many fills may run. Reads no file.

use serde_saphyr::Spanned;

use super::{Resolver, whole_number};
use crate::config::raw::RawCache;
use crate::config::size::describe_size;
use crate::config::{
    CacheConfig, ConfigError, DEFAULT_MAX_FILLS, DEFAULT_MAX_OBJECT_SIZE, DEFAULT_MEMORY,
};

impl Resolver<'_> {
    /// `cache:`: `memory` ([`DEFAULT_MEMORY`] when left out, as is the whole
    /// section), the rest sized from it by default.
    pub(super) fn cache(
        &self,
        raw: Option<&Spanned<RawCache>>,
    ) -> Result<CacheConfig, ConfigError> {
        let none = RawCache::default();
        let raw = raw.map_or(&none, |r| &r.value);
        let memory = self
            .at("cache.memory", &raw.memory)
            .size_or(DEFAULT_MEMORY)?
            .positive()?;
        let max_object_size = self
            .at("cache.max_object_size", &raw.max_object_size)
            .size_or(DEFAULT_MAX_OBJECT_SIZE)?
            .positive()?;
        max_object_size.at_most(&memory, describe_size)?;
        // By default fills may buffer a quarter of what the cache holds, and
        // always enough for one object of the largest storable size.
        let fill_memory = self
            .at("cache.fill_memory", &raw.fill_memory)
            .size_or((memory.value / 4).max(max_object_size.value))?;
        max_object_size.at_most(&fill_memory, describe_size)?;
        // Coalesced POST bodies: a sixteenth of the fills' memory by default.
        let post_memory = self
            .at("cache.post_memory", &raw.post_memory)
            .size_or((fill_memory.value / 16).max(1))?
            .positive()?;
        let max_fills = self
            .at("cache.max_fills", &raw.max_fills)
            .parse_or(DEFAULT_MAX_FILLS, |t| whole_number(t, 1, "fills"))?;
        Ok(CacheConfig {
            memory: memory.value,
            max_object_size: max_object_size.value,
            fill_memory: fill_memory.value,
            post_memory: post_memory.value,
            max_fills,
        })
    }
}
