//! Purges that cannot name every key: by URL prefix, by tag
//! (`Surrogate-Key` / `Cache-Tag`), and soft purges of one URL. Like
//! Varnish's bans, each is a rule with a time: it applies to entries
//! produced before it, whether they sit in L1 or come back from L2 later.
//! A hard ban makes such an entry a miss; a soft one makes it stale from the
//! ban's time, so stale-while-revalidate serves it while one refresh runs.

use std::sync::RwLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use http::HeaderName;

use crate::entry::{MAX_RESIDENCY, StoredResponse};

static SURROGATE_KEY: HeaderName = HeaderName::from_static("surrogate-key");
static CACHE_TAG: HeaderName = HeaderName::from_static("cache-tag");

/// What a ban matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BanTarget {
    /// URI keys (`host/path?query`, host without port) starting with this.
    Prefix(String),
    /// Entries whose Surrogate-Key (space-separated) or Cache-Tag
    /// (comma-separated) lists this tag.
    Tag(String),
    /// Exactly this URI key.
    Uri(String),
}

impl BanTarget {
    fn matches(&self, e: &StoredResponse) -> bool {
        match self {
            BanTarget::Prefix(p) => e.uri.starts_with(p.as_str()),
            BanTarget::Uri(u) => &*e.uri == u.as_str(),
            BanTarget::Tag(t) => {
                let listed = |name: &HeaderName, sep: char| {
                    e.headers
                        .get_all(name)
                        .iter()
                        .filter_map(|v| v.to_str().ok())
                        .flat_map(|v| v.split(sep))
                        .any(|x| x.trim() == t)
                };
                listed(&SURROGATE_KEY, ' ') || listed(&CACHE_TAG, ',')
            }
        }
    }
}

/// One purge rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ban {
    pub target: BanTarget,
    /// Applies to entries produced before this instant.
    pub at: SystemTime,
    pub soft: bool,
}

/// What a ban list says about one entry.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Keep,
    /// Serve it, but as stale from this instant.
    StaleFrom(SystemTime),
    Drop,
}

/// The bans in force (each lives as long as any entry it could match).
#[derive(Default)]
pub struct BanList {
    bans: RwLock<Vec<Ban>>,
    len: AtomicUsize,
}

impl BanList {
    pub fn add(&self, ban: Ban) {
        let mut bans = self
            .bans
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let horizon = SystemTime::now()
            .checked_sub(MAX_RESIDENCY + Duration::from_secs(60))
            .unwrap_or(SystemTime::UNIX_EPOCH);
        bans.retain(|b| {
            b.at > horizon && !(b.target == ban.target && b.soft == ban.soft && b.at <= ban.at)
        });
        bans.push(ban);
        self.len.store(bans.len(), Ordering::Release);
    }

    pub fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The verdict on `e`; free when no ban is in force.
    pub fn verdict(&self, e: &StoredResponse) -> Verdict {
        if self.is_empty() {
            return Verdict::Keep;
        }
        let bans = self
            .bans
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut stale_from: Option<SystemTime> = None;
        for b in bans
            .iter()
            .filter(|b| e.response_time < b.at && b.target.matches(e))
        {
            if !b.soft {
                return Verdict::Drop;
            }
            stale_from = Some(stale_from.map_or(b.at, |t| t.min(b.at)));
        }
        match stale_from {
            Some(t) if t < e.fresh_until => Verdict::StaleFrom(t),
            _ => Verdict::Keep,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Freshness;
    use bytes::Bytes;
    use http::{HeaderMap, HeaderValue, StatusCode};

    fn entry(uri: &str, tags: Option<&'static str>) -> StoredResponse {
        let mut h = HeaderMap::new();
        if let Some(t) = tags {
            h.insert("surrogate-key", HeaderValue::from_static(t));
        }
        let fr = Freshness {
            ttl: Duration::from_secs(60),
            swr: Duration::from_secs(30),
            sie: Duration::ZERO,
            sharing: crate::Sharing::Everyone,
        };
        StoredResponse::builder(
            StatusCode::OK,
            h,
            Bytes::new(),
            &fr,
            SystemTime::now() - Duration::from_secs(1),
        )
        .vary(crate::Vary::None, vec![])
        .build()
        .with_uri(uri)
    }

    #[test]
    fn bans_match_prefix_tag_and_uri_and_only_older_entries() {
        let list = BanList::default();
        let e = entry("h/v1/users/1", Some("user-1 users"));
        assert_eq!(list.verdict(&e), Verdict::Keep);
        list.add(Ban {
            target: BanTarget::Prefix("h/v2/".into()),
            at: SystemTime::now(),
            soft: false,
        });
        assert_eq!(list.verdict(&e), Verdict::Keep);
        list.add(Ban {
            target: BanTarget::Tag("users".into()),
            at: SystemTime::now(),
            soft: false,
        });
        assert_eq!(list.verdict(&e), Verdict::Drop);
        // An entry produced after the ban is untouched.
        let mut newer = entry("h/v1/users/1", Some("users"));
        newer.response_time = SystemTime::now() + Duration::from_secs(1);
        assert_eq!(list.verdict(&newer), Verdict::Keep);
    }

    #[test]
    fn soft_bans_make_entries_stale_from_the_ban() {
        let list = BanList::default();
        let e = entry("h/a", None);
        let at = SystemTime::now();
        list.add(Ban {
            target: BanTarget::Uri("h/a".into()),
            at,
            soft: true,
        });
        assert_eq!(list.verdict(&e), Verdict::StaleFrom(at));
        assert_eq!(list.verdict(&entry("h/ab", None)), Verdict::Keep);
    }
}
