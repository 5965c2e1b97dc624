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

use crate::model::entry::{MAX_RESIDENCY, StoredResponse};

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
    /// RFC 9875: entries of this host (the key's host, so the same origin
    /// as the route serves it) whose `Cache-Groups` lists this group.
    Group { host: String, group: String },
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
            BanTarget::Group { host, group } => {
                e.uri.split('/').next() == Some(host.as_str())
                    && string_list(&e.headers, &CACHE_GROUPS)
                        .iter()
                        .any(|g| g == group)
            }
        }
    }
}

static CACHE_GROUPS: HeaderName = HeaderName::from_static("cache-groups");

/// The most groups read from one field (RFC 9875 asks for at least 32).
pub const MAX_GROUPS: usize = 128;
/// The longest group name read (RFC 9875 asks for at least 32 characters).
pub const MAX_GROUP_LEN: usize = 256;

/// An RFC 8941 List of Strings (`Cache-Groups`, `Cache-Group-Invalidation`):
/// its string members, at most [`MAX_GROUPS`] of at most
/// [`MAX_GROUP_LEN`] characters. Members of other types (and their
/// parameters) are skipped; a field that is not a valid List reads as
/// empty, as RFC 8941 has a parser fail the whole field.
pub fn string_list(headers: &http::HeaderMap, name: &HeaderName) -> Vec<String> {
    let mut text = String::new();
    for v in headers.get_all(name) {
        let Ok(v) = v.to_str() else {
            return Vec::new();
        };
        if !text.is_empty() {
            text.push(',');
        }
        text.push_str(v);
    }
    parse_string_list(&text).unwrap_or_default()
}

fn parse_string_list(text: &str) -> Option<Vec<String>> {
    let b = text.as_bytes();
    let mut i = 0;
    let mut out = Vec::new();
    let skip_ows = |i: &mut usize| {
        while *i < b.len() && (b[*i] == b' ' || b[*i] == b'\t') {
            *i += 1;
        }
    };
    skip_ows(&mut i);
    if i == b.len() {
        return Some(out);
    }
    loop {
        // One member: a String, or a bare item of another type (skipped).
        if b[i] == b'"' {
            i += 1;
            let mut s = String::new();
            loop {
                match *b.get(i)? {
                    b'\\' => {
                        let next = *b.get(i + 1)?;
                        if next != b'"' && next != b'\\' {
                            return None;
                        }
                        s.push(char::from(next));
                        i += 2;
                    }
                    b'"' => {
                        i += 1;
                        break;
                    }
                    c if (0x20..0x7f).contains(&c) => {
                        s.push(char::from(c));
                        i += 1;
                    }
                    _ => return None,
                }
            }
            if out.len() < MAX_GROUPS && s.len() <= MAX_GROUP_LEN {
                out.push(s);
            }
        } else {
            let start = i;
            while i < b.len() && !matches!(b[i], b',' | b' ' | b'\t' | b';' | b'"') {
                i += 1;
            }
            if i == start {
                return None;
            }
        }
        // Parameters: `;key[=value]`, skipped.
        while i < b.len() && b[i] == b';' {
            i += 1;
            while i < b.len() && !matches!(b[i], b',' | b';') {
                if b[i] == b'"' {
                    return None;
                }
                i += 1;
            }
        }
        skip_ows(&mut i);
        if i == b.len() {
            return Some(out);
        }
        if b[i] != b',' {
            return None;
        }
        i += 1;
        skip_ows(&mut i);
        if i == b.len() {
            return None; // a trailing comma
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
    /// Adds `ban`; those older than any entry alive at `now` go.
    pub fn add(&self, ban: Ban, now: SystemTime) {
        let mut bans = self
            .bans
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let horizon = now
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
    use crate::model::policy::Freshness;
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
        list.add(
            Ban {
                target: BanTarget::Prefix("h/v2/".into()),
                at: SystemTime::now(),
                soft: false,
            },
            SystemTime::now(),
        );
        assert_eq!(list.verdict(&e), Verdict::Keep);
        list.add(
            Ban {
                target: BanTarget::Tag("users".into()),
                at: SystemTime::now(),
                soft: false,
            },
            SystemTime::now(),
        );
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
        list.add(
            Ban {
                target: BanTarget::Uri("h/a".into()),
                at,
                soft: true,
            },
            SystemTime::now(),
        );
        assert_eq!(list.verdict(&e), Verdict::StaleFrom(at));
        assert_eq!(list.verdict(&entry("h/ab", None)), Verdict::Keep);
    }

    #[test]
    fn cache_groups_are_a_list_of_strings() {
        let list = |v: &'static str| {
            let mut h = http::HeaderMap::new();
            h.insert("cache-groups", http::HeaderValue::from_static(v));
            string_list(&h, &CACHE_GROUPS)
        };
        assert_eq!(list(r#""scripts", "styles""#), ["scripts", "styles"]);
        assert_eq!(list(r#""a\"b";p=1, tok, "c\\d""#), ["a\"b", "c\\d"]);
        assert_eq!(list(""), Vec::<String>::new());
        for bad in [r#""open"#, r#""a","#, r#""a" "b""#, r#""\x""#, ","] {
            assert_eq!(list(bad), Vec::<String>::new(), "{bad}");
        }
        let many: String = (0..200)
            .map(|i| format!("\"g{i}\""))
            .collect::<Vec<_>>()
            .join(", ");
        let mut h = http::HeaderMap::new();
        h.insert(
            "cache-groups",
            http::HeaderValue::from_str(&many).expect("value"),
        );
        assert_eq!(string_list(&h, &CACHE_GROUPS).len(), MAX_GROUPS);
    }
}
