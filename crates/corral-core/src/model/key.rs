//! Cache keys. A `UriKey` names the target URI (what RFC 9111 §4.4
//! invalidation acts on); a `PrimaryKey` adds the route; a `VariantKey` adds
//! the caller's identity and the values of the headers the response Varies
//! on. Names that leave the process (L2, leases, notices) are BLAKE3
//! digests, the same in every process (never std's RandomState): other
//! instances rely on that. A variant's key in this process's L1 is its
//! bytes, compared whole ([`LocalKey`]).

use std::fmt;
use std::sync::Arc;

use crate::model::identity::Identity;
use crate::semantics::no_vary_search::NoVarySearch;

/// A fixed-size, process-independent digest of a key.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Digest(pub [u8; 32]);

/// Tables keyed by digests hash eight of their bytes: a BLAKE3 digest is
/// uniform, so eight bytes spread as well as 32, at a quarter of the
/// hashing (every hit looks one up). The tables' hashers stay keyed at
/// random per process, so an attacker who can choose keys still cannot
/// aim them at one bucket; equality still compares all 32 bytes.
impl std::hash::Hash for Digest {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let mut head = [0u8; 8];
        head.copy_from_slice(&self.0[..8]);
        state.write_u64(u64::from_le_bytes(head));
    }
}

impl Digest {
    /// The scope of one caller's own back-off for this (pass) scope: its
    /// own failures leave only its own requests to the stale copy, never
    /// another caller's (`caller` as [`crate::callers::client_addr::caller_group`]).
    pub fn for_caller(&self, caller: u64) -> Digest {
        let mut h = blake3::Hasher::new();
        h.update(&self.0);
        h.update(b"\x03caller");
        h.update(&caller.to_le_bytes());
        Digest(*h.finalize().as_bytes())
    }

    /// The flight of a HEAD sent to the origin to freshen the stored GET
    /// answer of this variant (RFC 9111 §4.3.5): never the GET's own, so
    /// that no GET waits on an answer without a body.
    pub fn head_probe(&self) -> Digest {
        let mut h = blake3::Hasher::new();
        h.update(&self.0);
        h.update(b"\x04head");
        Digest(*h.finalize().as_bytes())
    }

    /// Parses the form `to_hex` writes.
    pub fn from_hex(s: &str) -> Option<Self> {
        let b = s.as_bytes();
        if b.len() != 64 {
            return None;
        }
        let nibble = |c: u8| (c as char).to_digit(16).and_then(|d| u8::try_from(d).ok());
        let mut out = [0u8; 32];
        for (i, pair) in b.chunks_exact(2).enumerate() {
            out[i] = (nibble(pair[0])? << 4) | nibble(pair[1])?;
        }
        Some(Digest(out))
    }

    /// Hex form, for logs and Redis keys.
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push(char::from(HEX[usize::from(b >> 4)]));
            s.push(char::from(HEX[usize::from(b & 0xf)]));
        }
        s
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", &self.to_hex()[..16])
    }
}

/// Which query parameters a route drops from its keys, and whether it
/// orders the rest by name.
#[derive(Debug, Clone)]
pub struct QueryFilter {
    exact: Vec<String>,
    prefixes: Vec<String>,
    /// Parameters are ordered by name, so `?b=2&a=1` is `?a=1&b=2` (the
    /// route's `cache.sort_query`, on by default; off where the route
    /// learns No-Vary-Search rules, whose `key-order` decides).
    sort: bool,
}

impl Default for QueryFilter {
    fn default() -> Self {
        QueryFilter {
            exact: Vec::new(),
            prefixes: Vec::new(),
            sort: true,
        }
    }
}

impl QueryFilter {
    /// `names` may end in `*` for a prefix match (`utm_*`).
    pub fn new<S: AsRef<str>>(names: &[S]) -> Self {
        let mut f = QueryFilter::default();
        for n in names {
            let n = n.as_ref();
            match n.strip_suffix('*') {
                Some(prefix) => f.prefixes.push(prefix.to_owned()),
                None => f.exact.push(n.to_owned()),
            }
        }
        f
    }

    /// The filter, ordering parameters by name (`true`) or keeping the
    /// client's order, where a No-Vary-Search rule does not say
    /// `key-order`.
    pub fn sorted(mut self, sort: bool) -> Self {
        self.sort = sort;
        self
    }

    /// True when parameters are ordered by name under `rule`.
    fn sorts(&self, rule: Option<&NoVarySearch>) -> bool {
        self.sort || rule.is_some_and(NoVarySearch::ignores_order)
    }

    fn drops(&self, name: &str) -> bool {
        self.exact.iter().any(|e| e == name) || self.prefixes.iter().any(|p| name.starts_with(p))
    }

    /// True when `query` is already what [`QueryFilter::normalize`] makes
    /// of it: no empty or dropped parameter, names in order (where they
    /// are ordered). One pass over the bytes, each read once, with no
    /// search called per pair: this runs on every hit, on queries of a
    /// few dozen bytes.
    fn in_order(&self, query: &str, rule: Option<&NoVarySearch>) -> bool {
        let sort = self.sorts(rule);
        let bytes = query.as_bytes();
        let mut prev: &[u8] = &[];
        // Names compare as they decode only where one could decode.
        let mut prev_encoded = false;
        let mut i = 0;
        loop {
            let start = i;
            let mut encoded = false;
            while let Some(&b) = bytes.get(i)
                && b != b'='
                && b != b'&'
            {
                encoded |= b == b'+' || b == b'%';
                i += 1;
            }
            let name_end = i;
            while bytes.get(i).is_some_and(|&b| b != b'&') {
                i += 1;
            }
            if i == start {
                return false;
            }
            let name = &bytes[start..name_end];
            let before = if encoded || prev_encoded {
                by_name(name, prev).is_lt()
            } else {
                name < prev
            };
            // `&` and `=` are ASCII, so `name` is whole characters.
            if (sort && before) || self.leaves(&query[start..name_end], rule) {
                return false;
            }
            if i == bytes.len() {
                return true;
            }
            (prev, prev_encoded) = (name, encoded);
            i += 1;
        }
    }

    /// True when the filter drops anything at all.
    fn filters(&self) -> bool {
        !self.exact.is_empty() || !self.prefixes.is_empty()
    }

    /// True when the parameter `name` is left out of the key: the route
    /// ignores it, or the origin's No-Vary-Search rule says it does not
    /// matter.
    fn leaves(&self, name: &str, rule: Option<&NoVarySearch>) -> bool {
        (self.filters() && self.drops(name)) || rule.is_some_and(|r| !r.matters(name))
    }

    /// The query with ignored parameters dropped and the rest sorted
    /// (where the filter sorts), so `?b=2&a=1` and `?a=1&b=2` name the
    /// same resource.
    pub fn normalize(&self, query: &str) -> String {
        self.normalize_with(query, None)
    }

    /// [`QueryFilter::normalize`], also leaving out what `rule` says does
    /// not matter.
    pub fn normalize_with(&self, query: &str, rule: Option<&NoVarySearch>) -> String {
        let mut out = String::with_capacity(query.len());
        self.normalize_into(query, rule, &mut out);
        out
    }

    /// [`QueryFilter::normalize`], appended to `out`. Parameters are
    /// ordered by name only: repeated parameters keep their order, since
    /// origins commonly read the first (`?a=1&a=2` is not `?a=2&a=1`). A
    /// query already in order with nothing to drop (the common case) is
    /// copied as it is, without collecting and sorting its pairs.
    fn normalize_into(&self, query: &str, rule: Option<&NoVarySearch>, out: &mut String) {
        if self.in_order(query, rule) {
            out.push_str(query);
            return;
        }
        self.reorder_into(query, rule, out);
    }

    /// [`QueryFilter::normalize_into`] the long way: the pairs kept,
    /// collected and sorted.
    fn reorder_into(&self, query: &str, rule: Option<&NoVarySearch>, out: &mut String) {
        let name = |p: &str| -> usize { p.bytes().position(|b| b == b'=').unwrap_or(p.len()) };
        let kept = |p: &&str| !p.is_empty() && !self.leaves(&p[..name(p)], rule);
        let mut pairs: Vec<&str> = query.split('&').filter(kept).collect();
        // Stable: equal names stay in the order the client sent them.
        if self.sorts(rule) {
            pairs.sort_by(|a, b| by_name(&a.as_bytes()[..name(a)], &b.as_bytes()[..name(b)]));
        }
        for (i, p) in pairs.iter().enumerate() {
            if i > 0 {
                out.push('&');
            }
            out.push_str(p);
        }
    }
}

/// Two parameter names in the order keys sort them: as
/// `application/x-www-form-urlencoded` decodes them, which is how origins
/// read them. Raw bytes would order `a+b` and `a%20b` apart, and so let
/// `?a+b=1&a%20b=2` and `?a%20b=2&a+b=1` share a key although an origin
/// reads `a b` first as 1 in one and 2 in the other.
fn by_name(a: &[u8], b: &[u8]) -> std::cmp::Ordering {
    use crate::semantics::no_vary_search::form_decoded;
    if !a.iter().chain(b).any(|&c| c == b'+' || c == b'%') {
        return a.cmp(b);
    }
    form_decoded(a).cmp(&form_decoded(b))
}

/// The target URI, normalized: lowercased host name (without port: the
/// instances behind one load balancer listen on different ports but serve
/// the same site), path, normalized query. The host is validated before it
/// gets here (no `/`, `?` or `:` in it), so `host/path?query` is unambiguous;
/// [`UriKey::target`] is what the origin is asked for.
#[derive(Clone)]
pub struct UriKey {
    /// Host, path and normalized query; then, for a key made with a
    /// No-Vary-Search rule, ` ~nvs(` the rule's record `)`. After `start`:
    /// before it, the route and method of the [`PrimaryKey`] that holds
    /// this string whole (see [`PrimaryKey::get_with_rule`]).
    readable: String,
    /// Where this key begins in `readable`.
    start: usize,
    /// Where the path starts in `readable`.
    host_len: usize,
    /// Where the target ends in `readable` (the rule's mark follows).
    target_end: usize,
    /// What the origin is asked, where it is not the key's target: a key
    /// made with a rule leaves parameters out, and the origin is asked
    /// the client's whole query (the route's filter applied), so that
    /// what is stored is the answer to a URL the rule makes equivalent.
    asked: Option<Box<str>>,
    /// Hashed when first asked for: a hit never needs it (its L1 key is
    /// [`PrimaryKey::local`]), only invalidations and their notices do.
    digest: std::sync::OnceLock<Digest>,
}

impl PartialEq for UriKey {
    fn eq(&self, other: &Self) -> bool {
        self.readable() == other.readable()
            && self.host_len - self.start == other.host_len - other.start
            && self.target_end - self.start == other.target_end - other.start
    }
}

impl Eq for UriKey {}

impl UriKey {
    pub fn new(host: &str, path: &str, query: Option<&str>, filter: &QueryFilter) -> Self {
        Self::with_rule(host, path, query, filter, None)
    }

    /// [`UriKey::new`], leaving out the parameters that the origin's
    /// No-Vary-Search `rule` for this path says do not matter.
    pub fn with_rule(
        host: &str,
        path: &str,
        query: Option<&str>,
        filter: &QueryFilter,
        rule: Option<&NoVarySearch>,
    ) -> Self {
        Self::after(&[], host, path, query, filter, rule)
    }

    /// [`UriKey::with_rule`], its string begun with `prefix`.
    fn after(
        prefix: &[&str],
        host: &str,
        path: &str,
        query: Option<&str>,
        filter: &QueryFilter,
        rule: Option<&NoVarySearch>,
    ) -> Self {
        let host = host_name(host);
        let prefix_len: usize = prefix.iter().map(|p| p.len()).sum();
        let mut readable = String::with_capacity(
            prefix_len + host.len() + path.len() + 1 + query.map_or(0, str::len),
        );
        for p in prefix {
            readable.push_str(p);
        }
        let start = readable.len();
        readable.push_str(host);
        // A request's host is lowercased already (`head::parse_authority`).
        readable[start..].make_ascii_lowercase();
        let host_len = readable.len();
        readable.push_str(path);
        let query_into = |rule: Option<&NoVarySearch>, out: &mut String| {
            if let Some(q) = query {
                out.push('?');
                let mark = out.len();
                filter.normalize_into(q, rule, out);
                // Drop the `?` only when the filter kept nothing: a `?`
                // that ends a kept value (`a=?`) is the client's and stays.
                if out.len() == mark {
                    out.pop();
                }
            }
        };
        query_into(rule, &mut readable);
        let target_end = readable.len();
        let mut asked = None;
        if let Some(rule) = rule {
            let mut whole = String::with_capacity(path.len() + 1 + query.map_or(0, str::len));
            whole.push_str(path);
            query_into(None, &mut whole);
            if whole != readable[host_len..] {
                asked = Some(whole.into_boxed_str());
            }
            // Entries stored under one rule are never found by a key
            // made with another: an answer is reused only under its own.
            readable.push_str(" ~nvs(");
            readable.push_str(rule.record());
            readable.push(')');
        }
        UriKey {
            readable,
            start,
            host_len,
            target_end,
            asked,
            digest: std::sync::OnceLock::new(),
        }
    }

    pub fn readable(&self) -> &str {
        &self.readable[self.start..]
    }

    /// The path and normalized query: the request target the origin gets
    /// for this key, so that what is stored is what was asked for (with a
    /// No-Vary-Search rule, the client's whole query: see `asked`).
    pub fn target(&self) -> &str {
        self.asked
            .as_deref()
            .unwrap_or(&self.readable[self.host_len..self.target_end])
    }

    /// The No-Vary-Search rule's record this key was made with, if any.
    pub fn rule_mark(&self) -> Option<&str> {
        self.readable[self.target_end..]
            .strip_prefix(" ~nvs(")
            .and_then(|r| r.strip_suffix(')'))
    }

    pub fn digest(&self) -> Digest {
        *self
            .digest
            .get_or_init(|| Digest(*blake3::hash(self.readable().as_bytes()).as_bytes()))
    }
}

impl fmt::Debug for UriKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.readable())
    }
}

/// `host` without a trailing `:port` (IPv6 literals keep their brackets).
fn host_name(host: &str) -> &str {
    // A byte search: a request's host (already without its port) is a
    // few bytes, which `rfind`'s searcher costs more to set up than to scan.
    let bytes = host.as_bytes();
    match bytes.iter().rposition(|&b| b == b':') {
        Some(i) if !bytes[i..].contains(&b']') && bytes[i + 1..].iter().all(u8::is_ascii_digit) => {
            &host[..i]
        }
        _ => host,
    }
}

/// What stands between the route and the URI in a GET's (or HEAD's) key,
/// by scheme: both ways of making one ([`PrimaryKey::get`],
/// [`PrimaryKey::get_with_rule`]) write it from here.
fn get_tag(tls: bool) -> &'static str {
    if tls { " GET https " } else { " GET " }
}

/// Route plus URI: everything of the key that does not depend on the
/// response. HEAD shares GET's key.
#[derive(Clone)]
pub struct PrimaryKey {
    uri: UriKey,
    /// The readable form: route, method and URI key; `None` where `uri`'s
    /// string holds it whole (one allocation for both).
    readable: Option<String>,
    /// A coalesced POST's body digest (with its Content-Type): part of the
    /// key, of which `readable` shows only 16 hex digits.
    body: Option<[u8; 32]>,
    /// Hashed when first asked for: a hit looks L1 up by
    /// [`PrimaryKey::local`] and needs it only once a Vary was learned or a
    /// key backed off; the miss path, L2 and the flights use it.
    digest: std::sync::OnceLock<Digest>,
}

impl PartialEq for PrimaryKey {
    fn eq(&self, other: &Self) -> bool {
        self.readable() == other.readable() && self.body == other.body
    }
}

impl Eq for PrimaryKey {}

impl PrimaryKey {
    /// The key of a GET (or HEAD) that came in plain.
    pub fn new(route: &str, uri: UriKey) -> Self {
        Self::get(route, uri, false)
    }

    /// The key of a GET (or HEAD), over TLS or not: the origin is told the
    /// scheme (`X-Forwarded-Proto`) and may answer by it (a redirect to
    /// https, `Secure` cookies, absolute links), so each scheme has its own
    /// entries. The plain key is the same as before schemes were keyed.
    pub fn get(route: &str, uri: UriKey, tls: bool) -> Self {
        let mut readable = String::with_capacity(route.len() + 11 + uri.readable().len());
        readable.push_str(route);
        readable.push_str(get_tag(tls));
        readable.push_str(uri.readable());
        PrimaryKey {
            uri,
            readable: Some(readable),
            body: None,
            digest: std::sync::OnceLock::new(),
        }
    }

    /// [`PrimaryKey::get`] of [`UriKey::with_rule`]'s key, made in one
    /// string: the route and method, then the URI key (a hit makes one
    /// key, and this saves it an allocation and a copy).
    pub fn get_with_rule(
        route: &str,
        tls: bool,
        host: &str,
        path: &str,
        query: Option<&str>,
        filter: &QueryFilter,
        rule: Option<&NoVarySearch>,
    ) -> Self {
        PrimaryKey {
            uri: UriKey::after(&[route, get_tag(tls)], host, path, query, filter, rule),
            readable: None,
            body: None,
            digest: std::sync::OnceLock::new(),
        }
    }

    /// The key of a coalesced POST: the route, the URI, and a digest of
    /// the body with its Content-Type, so two POSTs share a key only when
    /// they would ask the origin the same thing. Never the key of a GET.
    pub fn post(
        route: &str,
        uri: UriKey,
        tls: bool,
        content_type: Option<&[u8]>,
        body: &[u8],
    ) -> Self {
        Self::with_content("POST", route, uri, tls, content_type, body)
    }

    /// The key of a request whose content is part of what it asks: a
    /// coalesced POST ([`PrimaryKey::post`]) or a QUERY (RFC 10008), the
    /// method named in the key, so the two never share one.
    pub fn with_content(
        method: &str,
        route: &str,
        uri: UriKey,
        tls: bool,
        content_type: Option<&[u8]>,
        body: &[u8],
    ) -> Self {
        let mut hasher = blake3::Hasher::new();
        let ct = content_type.unwrap_or(b"");
        hasher.update(&(ct.len() as u64).to_le_bytes());
        hasher.update(ct);
        hasher.update(body);
        let body_digest = hasher.finalize();
        let mut readable = String::with_capacity(route.len() + 80 + uri.readable().len());
        readable.push_str(route);
        readable.push(' ');
        readable.push_str(method);
        readable.push_str(if tls { " https " } else { " " });
        readable.push_str(uri.readable());
        readable.push_str(" body=");
        readable.push_str(&body_digest.to_hex()[..16]);
        PrimaryKey {
            uri,
            readable: Some(readable),
            body: Some(*body_digest.as_bytes()),
            digest: std::sync::OnceLock::new(),
        }
    }

    pub fn uri(&self) -> &UriKey {
        &self.uri
    }

    pub fn readable(&self) -> &str {
        match &self.readable {
            Some(r) => r,
            None => &self.uri.readable,
        }
    }

    /// The key's name in every process (L2, leases, notices): BLAKE3 of
    /// the readable form, and for a POST of its body's digest too. A
    /// change here breaks every shared entry.
    pub fn digest(&self) -> Digest {
        *self.digest.get_or_init(|| match &self.body {
            None => Digest(*blake3::hash(self.readable().as_bytes()).as_bytes()),
            Some(body) => {
                let mut key = blake3::Hasher::new();
                key.update(self.readable().as_bytes());
                key.update(body);
                Digest(*key.finalize().as_bytes())
            }
        })
    }

    /// The key of one stored variant in this process's L1: every byte that
    /// tells variants apart, compared whole (see [`LocalKey`]), where
    /// [`PrimaryKey::variant`] (the name shared through L2) is a digest. The
    /// fixed-size and length-prefixed parts come first and the readable
    /// form last, so the encoding is unambiguous; the leading tag keeps it
    /// apart from every other encoding.
    pub fn local(&self, identity: Option<&Identity>, vary_values: &[String]) -> LocalKey {
        LocalKey(Arc::from(
            self.local_bytes(identity, vary_values).as_slice(),
        ))
    }

    /// The bytes of [`PrimaryKey::local`], made on the stack when they fit
    /// (a plain GET's do): what a lookup passes to L1.
    pub fn local_bytes(&self, identity: Option<&Identity>, vary_values: &[String]) -> LocalBytes {
        let mut out = LocalBytes::new();
        out.put_byte(3);
        match &self.body {
            Some(body) => {
                out.put_byte(1);
                out.put(body);
            }
            None => out.put_byte(0),
        }
        match identity {
            Some(id) => {
                out.put_byte(1);
                out.put(id.as_bytes());
            }
            None => out.put_byte(0),
        }
        if vary_values.is_empty() {
            out.put_byte(0);
        } else {
            out.put_byte(1);
            out.put(&(vary_values.len() as u64).to_le_bytes());
            for v in vary_values {
                out.put(&(v.len() as u64).to_le_bytes());
                out.put(v.as_bytes());
            }
        }
        out.put(self.readable().as_bytes());
        out
    }

    /// The readable form without the query, for logs and metric labels:
    /// a query may carry tokens.
    pub fn loggable(&self) -> &str {
        let readable = self.readable();
        readable.split('?').next().unwrap_or(readable)
    }

    /// The key as the operator's views (the live page, `corral top`) show
    /// it: [`PrimaryKey::loggable`] without a coalesced POST's body digest
    /// either.
    pub fn shown(&self) -> &str {
        let k = self.loggable();
        k.split(" body=").next().unwrap_or(k)
    }

    /// Where a hit-for-pass marker for this URI lives: anonymous callers
    /// share one; each identified caller has its own, so one caller's
    /// uncacheable (e.g. `private`) answer never turns coalescing off for
    /// everyone else.
    pub fn pass_scope(&self, identity: Option<&Identity>) -> Digest {
        match identity {
            None => self.digest(),
            Some(id) => {
                let mut h = blake3::Hasher::new();
                h.update(&self.digest().0);
                h.update(b"\x02pass");
                h.update(id.as_bytes());
                Digest(*h.finalize().as_bytes())
            }
        }
    }

    /// The key of one stored response: this URI, for this caller (when the
    /// response is not shareable), for these Vary-selected header values.
    pub fn variant(&self, identity: Option<&Identity>, vary_values: &[String]) -> VariantKey {
        let local = self.local(identity, vary_values);
        // The usual variant (no identity, no Vary): the same bytes hashed in
        // one call, without a 2 KiB hasher to set up and finalize.
        if identity.is_none() && vary_values.is_empty() {
            let mut bytes = [0u8; 33];
            bytes[..32].copy_from_slice(&self.digest().0);
            return VariantKey {
                digest: Digest(*blake3::hash(&bytes).as_bytes()),
                private: false,
                local,
            };
        }
        let mut h = blake3::Hasher::new();
        h.update(&self.digest().0);
        match identity {
            Some(id) => {
                h.update(b"\x01");
                h.update(id.as_bytes());
            }
            None => {
                h.update(b"\x00");
            }
        }
        for v in vary_values {
            // Length-prefixed so that ("ab","c") and ("a","bc") differ.
            h.update(&(v.len() as u64).to_le_bytes());
            h.update(v.as_bytes());
        }
        VariantKey {
            digest: Digest(*h.finalize().as_bytes()),
            private: identity.is_some(),
            local,
        }
    }
}

impl fmt::Debug for PrimaryKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.readable())
    }
}

/// Where one path's No-Vary-Search rule is kept: route, scheme, host and
/// path, without the query (the rule says what of the query matters).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PathScope(Arc<[u8]>);

impl PathScope {
    pub fn new(route: &str, host: &str, path: &str, tls: bool) -> Self {
        let host = host_name(host);
        let mut b = Vec::with_capacity(4 + route.len() + 1 + host.len() + path.len());
        // Length-prefixed route; the host has no `/` and the path starts
        // with one, so the bytes read back one way only.
        b.extend_from_slice(&u32::try_from(route.len()).unwrap_or(u32::MAX).to_le_bytes());
        b.extend_from_slice(route.as_bytes());
        b.push(u8::from(tls));
        b.extend(host.bytes().map(|c| c.to_ascii_lowercase()));
        b.extend_from_slice(path.as_bytes());
        PathScope(b.into())
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Its name in every process (Redis).
    pub fn digest(&self) -> Digest {
        Digest(*blake3::hash(&self.0).as_bytes())
    }
}

impl std::borrow::Borrow<[u8]> for PathScope {
    fn borrow(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for PathScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PathScope({})", String::from_utf8_lossy(&self.0))
    }
}

/// The key of one stored response.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct VariantKey {
    /// Its name in every process: L2, leases, the flights.
    pub digest: Digest,
    /// Keyed to one caller's credentials.
    pub private: bool,
    /// Its key in this process's L1 ([`PrimaryKey::local`]).
    pub local: LocalKey,
}

/// A stored variant's key in this process's L1 ([`PrimaryKey::local`]):
/// the bytes themselves, not a digest of them. The table hashes them with
/// its own hasher, keyed at random per process, and a lookup compares them
/// whole, so two variants can never share an entry whatever their digests
/// would have been, and a hit computes no cryptographic hash.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct LocalKey(Arc<[u8]>);

impl LocalKey {
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::borrow::Borrow<[u8]> for LocalKey {
    fn borrow(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for LocalKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LocalKey({})", String::from_utf8_lossy(&self.0))
    }
}

/// The bytes of a [`LocalKey`] being made: on the stack up to
/// [`LocalBytes::STACK`] bytes, on the heap past that.
pub struct LocalBytes {
    stack: [u8; LocalBytes::STACK],
    len: usize,
    heap: Vec<u8>,
}

impl LocalBytes {
    /// Room for the tags, a body digest, an identity and a readable form
    /// of 120 bytes.
    pub const STACK: usize = 192;

    fn new() -> Self {
        LocalBytes {
            stack: [0; Self::STACK],
            len: 0,
            heap: Vec::new(),
        }
    }

    fn put(&mut self, bytes: &[u8]) {
        if self.heap.is_empty() && self.len + bytes.len() <= Self::STACK {
            self.stack[self.len..self.len + bytes.len()].copy_from_slice(bytes);
            self.len += bytes.len();
            return;
        }
        if self.heap.is_empty() {
            self.heap.reserve(self.len + bytes.len());
            self.heap.extend_from_slice(&self.stack[..self.len]);
        }
        self.heap.extend_from_slice(bytes);
    }

    /// One tag byte, without a copy call.
    fn put_byte(&mut self, b: u8) {
        if self.heap.is_empty() && self.len < Self::STACK {
            self.stack[self.len] = b;
            self.len += 1;
        } else {
            self.put(&[b]);
        }
    }

    pub fn as_slice(&self) -> &[u8] {
        if self.heap.is_empty() {
            &self.stack[..self.len]
        } else {
            &self.heap
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_order_and_ignored_parameters_do_not_change_the_key() {
        let f = QueryFilter::new(&["utm_*", "fbclid"]);
        let a = UriKey::new("API.example.com", "/v1/x", Some("b=2&a=1"), &f);
        let b = UriKey::new(
            "api.example.com",
            "/v1/x",
            Some("a=1&utm_source=x&b=2&fbclid=9"),
            &f,
        );
        assert_eq!(a.digest(), b.digest());
        assert_eq!(a.readable(), "api.example.com/v1/x?a=1&b=2");
        let c = UriKey::new("api.example.com", "/v1/x", Some("a=1&b=3"), &f);
        assert_ne!(a.digest(), c.digest());
        let port = UriKey::new("api.example.com:8443", "/v1/x", Some("a=1&b=2"), &f);
        assert_eq!(a.digest(), port.digest());
        assert_eq!(host_name("[::1]:80"), "[::1]");
        assert_eq!(host_name("[::1]"), "[::1]");
        let empty = UriKey::new("h", "/p", Some("utm_a=1"), &f);
        assert_eq!(empty.readable(), "h/p");
    }

    #[test]
    fn a_question_mark_that_ends_a_kept_value_is_kept() {
        // Found by the fuzz target: `/x?a=?` used to become `/x?a=`, so the
        // origin was asked for a different resource than the client named.
        let f = QueryFilter::new(&["utm_*"]);
        for (q, target) in [
            ("a=?", "/x?a=?"),
            ("?", "/x??"),
            ("a=1&b=?", "/x?a=1&b=?"),
            ("utm_a=?", "/x"),
        ] {
            let key = UriKey::new("h", "/x", Some(q), &f);
            assert_eq!(key.target(), target, "{q:?}");
        }
        let a = UriKey::new("h", "/x", Some("a=?"), &f);
        let b = UriKey::new("h", "/x", Some("a="), &f);
        assert_ne!(a.digest(), b.digest());
    }

    #[test]
    fn the_fast_path_and_the_sorting_path_agree() {
        let f = QueryFilter::new(&["utm_*", "fbclid"]);
        for (q, want) in [
            ("a=1&b=2", "a=1&b=2"),
            ("b=2&a=1", "a=1&b=2"),
            ("a=1&a=1", "a=1&a=1"),
            ("a=2&a=1", "a=2&a=1"),
            ("b=1&a=2&a=1", "a=2&a=1&b=1"),
            ("a=2&b=1&a=1", "a=2&a=1&b=1"),
            ("a=1&&b=2", "a=1&b=2"),
            ("&", ""),
            ("", ""),
            ("utm_x=1", ""),
            ("a&b=", "a&b="),
            ("fbclid=1&a=1", "a=1"),
            ("a=1&fbclidx=2", "a=1&fbclidx=2"),
        ] {
            assert_eq!(f.normalize(q), want, "{q:?}");
            let key = UriKey::new("H", "/p", Some(q), &f);
            let readable = if want.is_empty() {
                "h/p".to_owned()
            } else {
                format!("h/p?{want}")
            };
            assert_eq!(key.readable(), readable, "{q:?}");
            assert_eq!(
                key.digest(),
                Digest(*blake3::hash(readable.as_bytes()).as_bytes())
            );
        }
        let p = PrimaryKey::new("api", UriKey::new("h", "/p", Some("a=1"), &f));
        assert_eq!(p.readable(), "api GET h/p?a=1");
        assert_eq!(
            p.digest(),
            Digest(*blake3::hash(b"api GET h/p?a=1").as_bytes())
        );
    }

    #[test]
    fn routes_identities_and_vary_values_separate_variants() {
        let f = QueryFilter::default();
        let p1 = PrimaryKey::new("a", UriKey::new("h", "/p", None, &f));
        let p2 = PrimaryKey::new("b", UriKey::new("h", "/p", None, &f));
        assert_ne!(p1.digest(), p2.digest());
        let id = Identity::from_bytes([7; 32]);
        let plain = p1.variant(None, &[]);
        let mine = p1.variant(Some(&id), &[]);
        assert_ne!(plain.digest, mine.digest);
        assert!(mine.private && !plain.private);
        let ab = p1.variant(None, &["ab".into(), "c".into()]);
        let a_bc = p1.variant(None, &["a".into(), "bc".into()]);
        assert_ne!(ab.digest, a_bc.digest);
    }

    #[test]
    fn the_target_is_the_path_and_normalized_query() {
        let f = QueryFilter::new(&["utm_*"]);
        let k = UriKey::new("Site.Test:8080", "/a/b", Some("z=1&utm_x=2&a=1&a=0"), &f);
        assert_eq!(k.readable(), "site.test/a/b?a=1&a=0&z=1");
        assert_eq!(k.target(), "/a/b?a=1&a=0&z=1");
        let bare = UriKey::new("h", "/p", Some("utm_x=1"), &f);
        assert_eq!(bare.target(), "/p");
    }

    #[test]
    fn the_plain_variant_is_the_hashers_digest_and_the_uri_digest_its_readable_forms() {
        // A change here breaks every shared (L2) entry: these are the
        // digests every instance and every version computes.
        let uri = UriKey::new("h", "/p", Some("a=1"), &QueryFilter::default());
        assert_eq!(uri.digest(), Digest(*blake3::hash(b"h/p?a=1").as_bytes()));
        let p = PrimaryKey::new("r", uri);
        let mut h = blake3::Hasher::new();
        h.update(&p.digest().0);
        h.update(b"\x00");
        assert_eq!(
            p.variant(None, &[]).digest,
            Digest(*h.finalize().as_bytes())
        );
        let mut h = blake3::Hasher::new();
        h.update(&p.digest().0);
        h.update(b"\x00");
        h.update(&1u64.to_le_bytes());
        h.update(b"x");
        assert_eq!(
            p.variant(None, &["x".into()]).digest,
            Digest(*h.finalize().as_bytes())
        );
    }

    #[test]
    fn local_keys_tell_apart_what_variants_tell_apart_and_do_not_depend_on_the_path_taken() {
        let f = QueryFilter::default();
        let p = PrimaryKey::new("r", UriKey::new("h", "/p", None, &f));
        let id = Identity::from_bytes([7; 32]);
        let keys = [
            p.local(None, &[]),
            p.local(Some(&id), &[]),
            p.local(None, &["a".into()]),
            p.local(None, &["a".into(), "b".into()]),
            p.local(None, &["ab".into()]),
            p.local(Some(&id), &["a".into()]),
            PrimaryKey::get("r", UriKey::new("h", "/p", None, &f), true).local(None, &[]),
            PrimaryKey::new("r", UriKey::new("h", "/q", None, &f)).local(None, &[]),
            PrimaryKey::post("r", UriKey::new("h", "/p", None, &f), false, None, b"x")
                .local(None, &[]),
            PrimaryKey::post("r", UriKey::new("h", "/p", None, &f), false, None, b"y")
                .local(None, &[]),
        ];
        for (i, a) in keys.iter().enumerate() {
            for b in &keys[i + 1..] {
                assert_ne!(a, b);
            }
        }
        // The variant carries its local key; the stack and the heap agree
        // on a target too long for the stack buffer.
        assert_eq!(p.variant(Some(&id), &[]).local, keys[1]);
        for path in ["/p".to_owned(), format!("/{}", "x".repeat(200))] {
            let key = PrimaryKey::new("r", UriKey::new("h", &path, None, &f));
            let mut want = b"\x03\x00\x00\x00".to_vec();
            want.extend_from_slice(key.readable().as_bytes());
            assert_eq!(key.local(None, &[]).as_bytes(), &want[..]);
            assert_eq!(key.local_bytes(None, &[]).as_slice(), &want[..]);
        }
        let values = ["a".repeat(150), "b".to_owned()];
        let vary = p.local(Some(&id), &values);
        let mut want = b"\x03\x00\x01".to_vec();
        want.extend_from_slice(id.as_bytes());
        want.push(1);
        want.extend_from_slice(&2u64.to_le_bytes());
        want.extend_from_slice(&150u64.to_le_bytes());
        want.extend_from_slice(values[0].as_bytes());
        want.extend_from_slice(&1u64.to_le_bytes());
        want.extend_from_slice(b"b");
        want.extend_from_slice(p.readable().as_bytes());
        assert_eq!(vary.as_bytes(), &want[..]);
    }

    #[test]
    fn a_primary_keys_digest_is_what_it_always_was() {
        // A change here breaks every shared (L2) entry.
        let f = QueryFilter::default();
        let get = PrimaryKey::new("api", UriKey::new("h", "/p", Some("a=1"), &f));
        assert_eq!(
            get.digest(),
            Digest(*blake3::hash(b"api GET h/p?a=1").as_bytes())
        );
        let post = PrimaryKey::post("api", UriKey::new("h", "/g", None, &f), false, None, b"{q}");
        let mut body = blake3::Hasher::new();
        body.update(&0u64.to_le_bytes());
        body.update(b"{q}");
        let body = body.finalize();
        let mut key = blake3::Hasher::new();
        key.update(post.readable().as_bytes());
        key.update(body.as_bytes());
        assert_eq!(post.digest(), Digest(*key.finalize().as_bytes()));
    }

    #[test]
    fn pass_scopes_keep_callers_apart() {
        let p = PrimaryKey::new("r", UriKey::new("h", "/p", None, &QueryFilter::default()));
        let a = Identity::from_bytes([1; 32]);
        let b = Identity::from_bytes([2; 32]);
        assert_eq!(p.pass_scope(None), p.digest());
        assert_ne!(p.pass_scope(Some(&a)), p.pass_scope(None));
        assert_ne!(p.pass_scope(Some(&a)), p.pass_scope(Some(&b)));
    }

    #[test]
    fn hex_round_trips_and_rejects_garbage() {
        let d = Digest(*blake3::hash(b"x").as_bytes());
        assert_eq!(Digest::from_hex(&d.to_hex()), Some(d));
        assert_eq!(Digest::from_hex("zz"), None);
        assert_eq!(Digest::from_hex(&"g".repeat(64)), None);
    }

    #[test]
    fn digests_are_stable_across_processes() {
        let k = UriKey::new("h", "/p", None, &QueryFilter::default());
        // A fixed value: a change here breaks every shared (L2) entry.
        assert_eq!(k.digest().to_hex(), blake3::hash(b"h/p").to_hex().as_str());
    }

    #[test]
    fn post_keys_differ_by_body_and_content_type_and_never_match_a_get() {
        let uri = || UriKey::new("h", "/graphql", None, &QueryFilter::new::<&str>(&[]));
        let a = PrimaryKey::post("api", uri(), false, Some(b"application/json"), b"{q}");
        assert_eq!(
            a,
            PrimaryKey::post("api", uri(), false, Some(b"application/json"), b"{q}")
        );
        // A QUERY of the same content is another request (RFC 10008).
        let q = PrimaryKey::with_content(
            "QUERY",
            "api",
            uri(),
            false,
            Some(b"application/json"),
            b"{q}",
        );
        assert_ne!(a, q);
        assert_ne!(a.digest(), q.digest());
        assert!(
            q.readable().starts_with("api QUERY h/graphql body="),
            "{q:?}"
        );
        assert_ne!(
            a,
            PrimaryKey::post("api", uri(), false, Some(b"application/json"), b"{r}")
        );
        assert_ne!(
            a,
            PrimaryKey::post("api", uri(), false, Some(b"text/plain"), b"{q}")
        );
        assert_ne!(a, PrimaryKey::post("api", uri(), false, None, b"{q}"));
        // The length prefix keeps content type and body apart.
        assert_ne!(
            PrimaryKey::post("api", uri(), false, Some(b"ab"), b"c"),
            PrimaryKey::post("api", uri(), false, Some(b"a"), b"bc")
        );
        assert_ne!(a.digest(), PrimaryKey::new("api", uri()).digest());
        // Each scheme has its own entries; the plain key did not change.
        let tls = PrimaryKey::post("api", uri(), true, Some(b"application/json"), b"{q}");
        assert_ne!(a.digest(), tls.digest());
        assert_ne!(
            PrimaryKey::get("api", uri(), true).digest(),
            PrimaryKey::new("api", uri()).digest()
        );
        assert_eq!(
            PrimaryKey::get("api", uri(), false),
            PrimaryKey::new("api", uri())
        );
        assert_eq!(
            PrimaryKey::new("api", uri()).readable(),
            "api GET h/graphql"
        );
    }

    mod no_vary_search {
        use super::*;
        use proptest::prelude::*;

        const NAMES: &[&str] = &["a", "b", "utm", "%61", "a+b", "a%20b", "id", "%FF"];
        const VALUES: &[&str] = &["", "=1", "=2", "=%31"];

        fn query() -> impl Strategy<Value = String> {
            proptest::collection::vec((0..NAMES.len(), 0..VALUES.len()), 0..6).prop_map(|pairs| {
                pairs
                    .into_iter()
                    .map(|(n, v)| format!("{}{}", NAMES[n], VALUES[v]))
                    .collect::<Vec<_>>()
                    .join("&")
            })
        }

        fn rule() -> impl Strategy<Value = Option<NoVarySearch>> {
            let names = proptest::collection::vec(0..NAMES.len(), 0..4);
            (0..3u8, names, any::<bool>()).prop_map(|(kind, picked, key_order)| {
                let list: Vec<String> = picked
                    .into_iter()
                    .map(|i| format!("\"{}\"", NAMES[i]))
                    .collect();
                let mut field = match kind {
                    0 => String::new(),
                    1 => format!("params=({})", list.join(" ")),
                    _ => format!("except=({})", list.join(" ")),
                };
                if key_order {
                    field = if field.is_empty() {
                        "key-order".to_owned()
                    } else {
                        format!("key-order, {field}")
                    };
                }
                NoVarySearch::parse(field.as_bytes())
            })
        }

        proptest! {
            /// The hit's key, made in one string, is the key made from a
            /// URI key in every way it is read: text, names, equality,
            /// the target the origin is asked and the L1 bytes.
            #[test]
            fn a_key_made_in_one_string_is_the_key_made_in_two(
                host in prop_oneof![
                    Just("Api.Example.COM"),
                    Just("h:8080"),
                    Just("[::1]:80"),
                    Just("h"),
                ],
                path in prop_oneof![Just("/"), Just("/a/B"), Just("/%20x")],
                q in proptest::option::of(query()),
                rule in rule(),
                tls in any::<bool>(),
                sorted in any::<bool>(),
            ) {
                let filter = QueryFilter::new(&["utm"]).sorted(sorted);
                let uri = UriKey::with_rule(host, path, q.as_deref(), &filter, rule.as_ref());
                let two = PrimaryKey::get("API-Route", uri, tls);
                let one = PrimaryKey::get_with_rule(
                    "API-Route",
                    tls,
                    host,
                    path,
                    q.as_deref(),
                    &filter,
                    rule.as_ref(),
                );
                prop_assert_eq!(one.readable(), two.readable());
                prop_assert!(one.digest() == two.digest());
                prop_assert!(one == two);
                prop_assert_eq!(one.loggable(), two.loggable());
                let (one_bytes, two_bytes) = (one.local_bytes(None, &[]), two.local_bytes(None, &[]));
                prop_assert_eq!(one_bytes.as_slice(), two_bytes.as_slice());
                prop_assert_eq!(one.uri().readable(), two.uri().readable());
                prop_assert!(one.uri() == two.uri());
                prop_assert!(one.uri().digest() == two.uri().digest());
                prop_assert_eq!(one.uri().target(), two.uri().target());
                prop_assert_eq!(one.uri().rule_mark(), two.uri().rule_mark());
                prop_assert_eq!(format!("{:?}", one.uri()), format!("{:?}", two.uri()));
            }
        }

        /// A route that learns rules: the client's order kept unless a
        /// rule says `key-order`.
        fn learning() -> QueryFilter {
            QueryFilter::default().sorted(false)
        }

        /// The pairs whose parameter matters, in the order the key keeps
        /// them: what the origin's answer may depend on.
        fn mattering(query: &str, rule: Option<&NoVarySearch>) -> Vec<String> {
            let name = |p: &str| p[..p.find('=').unwrap_or(p.len())].to_owned();
            let mut pairs: Vec<String> = query
                .split('&')
                .filter(|p| !p.is_empty())
                .filter(|p| rule.is_none_or(|r| r.matters(&name(p))))
                .map(str::to_owned)
                .collect();
            if rule.is_some_and(NoVarySearch::ignores_order) {
                pairs.sort_by(|a, b| by_name(name(a).as_bytes(), name(b).as_bytes()));
            }
            pairs
        }

        /// `+` and `%XX` decoded, written apart from the code under test.
        fn decode(raw: &str) -> Vec<u8> {
            let b = raw.as_bytes();
            let mut out = Vec::new();
            let mut i = 0;
            while i < b.len() {
                let hex = |c: u8| (c as char).to_digit(16);
                match b[i] {
                    b'+' => out.push(b' '),
                    b'%' if i + 2 < b.len()
                        && hex(b[i + 1]).is_some()
                        && hex(b[i + 2]).is_some() =>
                    {
                        out.push(
                            u8::try_from(
                                hex(b[i + 1]).unwrap_or(0) * 16 + hex(b[i + 2]).unwrap_or(0),
                            )
                            .unwrap_or(0),
                        );
                        i += 2;
                    }
                    c => out.push(c),
                }
                i += 1;
            }
            out
        }

        /// The draft's equivalence of two queries under `rule` (§4,
        /// "comparing"), from the field's text: decoded pairs, those
        /// the rule names left out (a name that is not UTF-8 always
        /// kept), sorted by name only with `key-order`, then compared.
        fn equivalent(a: &str, b: &str, field: Option<&str>) -> bool {
            let parsed: Option<(bool, Vec<Vec<u8>>, bool)> = field.map(|f| {
                let key_order = f.contains("key-order");
                let only = f.contains("except=");
                let names = f.split('"').skip(1).step_by(2).map(decode).collect();
                (only, names, key_order)
            });
            let pairs = |q: &str| -> Vec<(Vec<u8>, Vec<u8>)> {
                let mut pairs: Vec<(Vec<u8>, Vec<u8>)> = q
                    .split('&')
                    .filter(|p| !p.is_empty())
                    .map(|p| {
                        let (n, v) = p.split_once('=').unwrap_or((p, ""));
                        (decode(n), decode(v))
                    })
                    .filter(|(n, _)| match &parsed {
                        None => true,
                        Some(_) if std::str::from_utf8(n).is_err() => true,
                        Some((only, names, _)) => names.contains(n) == *only,
                    })
                    .collect();
                if parsed.as_ref().is_some_and(|(_, _, key_order)| *key_order) {
                    pairs.sort_by(|x, y| x.0.cmp(&y.0));
                }
                pairs
            };
            pairs(a) == pairs(b)
        }

        proptest! {
            /// The one-pass check a hit makes says "as it is" exactly
            /// where the long way (collect, drop, sort) gives the query
            /// back unchanged and no pair is empty, sorted or not, with
            /// any rule; repeats and encoded names included.
            #[test]
            fn the_fast_check_agrees_with_the_long_way(
                parts in proptest::collection::vec((0..NAMES.len(), 0..VALUES.len(), any::<bool>()), 0..6),
                rule in rule(),
                sort: bool,
                dropped in proptest::option::of(0..NAMES.len()),
            ) {
                // `&&` and a leading or trailing `&` make empty pairs.
                let query: String = parts
                    .iter()
                    .map(|&(n, v, gap)| format!("{}{}{}", if gap { "&" } else { "" }, NAMES[n], VALUES[v]))
                    .collect::<Vec<_>>()
                    .join("&");
                let filter = match dropped {
                    Some(n) => QueryFilter::new(&[NAMES[n]]),
                    None => QueryFilter::default(),
                }
                .sorted(sort);
                let mut long = String::new();
                filter.reorder_into(&query, rule.as_ref(), &mut long);
                // An empty pair always takes the long way (which drops it).
                let whole = !query.split('&').any(str::is_empty);
                prop_assert_eq!(
                    filter.in_order(&query, rule.as_ref()),
                    long == query && whole,
                    "query {:?} long way {:?}", query, long
                );
            }
        }

        proptest! {
            /// Two requests share a key exactly when the pairs whose
            /// parameter matters are the same (in order, unless the rule
            /// says `key-order`): a rule never merges requests that differ
            /// in a parameter it says matters, and does merge those that
            /// differ only in what it names.
            #[test]
            fn a_rule_shares_a_key_only_where_nothing_that_matters_differs(
                a in query(),
                b in query(),
                rule in rule(),
            ) {
                let key = |q: &str| UriKey::with_rule("h", "/p", Some(q), &learning(), rule.as_ref());
                prop_assert_eq!(
                    key(&a) == key(&b),
                    mattering(&a, rule.as_ref()) == mattering(&b, rule.as_ref()),
                    "{:?} / {:?} under {:?}", key(&a), key(&b), rule
                );
                // The origin is asked the client's whole query, and the
                // same key is made from it.
                let target = key(&a).target().to_owned();
                let asked = target.split_once('?').map(|(_, q)| q);
                prop_assert_eq!(asked.unwrap_or(""), a.split('&').filter(|p| !p.is_empty()).collect::<Vec<_>>().join("&"));
                let again = UriKey::with_rule("h", "/p", asked, &learning(), rule.as_ref());
                prop_assert_eq!(again, key(&a));
            }

            /// An answer stored for `a` under its own rule is found by a
            /// request for `b`, whatever rule `b`'s key was made with,
            /// only where that answer's own rule makes `a` and `b`
            /// equivalent by the draft's comparison.
            #[test]
            fn a_stored_answer_is_reused_only_under_its_own_rule(
                a in query(),
                b in query(),
                own in rule(),
                later in rule(),
            ) {
                let stored = UriKey::with_rule("h", "/p", Some(&a), &learning(), own.as_ref());
                let asked = UriKey::with_rule("h", "/p", Some(&b), &learning(), later.as_ref());
                if stored == asked {
                    prop_assert!(
                        equivalent(&a, &b, own.as_ref().map(NoVarySearch::record)),
                        "{a:?} and {b:?} share {stored:?} under {own:?}"
                    );
                }
            }
        }

        #[test]
        fn the_names_a_rule_gives_are_compared_decoded() {
            let rule = NoVarySearch::parse(br#"key-order, params=("utm_source" "a b")"#);
            let key = |q: &str| {
                UriKey::with_rule("h", "/p", Some(q), &learning(), rule.as_ref())
                    .readable()
                    .to_owned()
            };
            let mark = r#" ~nvs(key-order, params=("a b" "utm_source"))"#;
            assert_eq!(key("q=1&utm_source=x"), format!("h/p?q=1{mark}"));
            assert_eq!(key("utm%5Fsource=x&q=1"), format!("h/p?q=1{mark}"));
            assert_eq!(key("a+b=1&q=1&a%20b=2"), format!("h/p?q=1{mark}"));
            assert_eq!(key("utm_source=x"), format!("h/p{mark}"));
            assert_eq!(
                key("UTM_SOURCE=x&q=1"),
                format!("h/p?UTM_SOURCE=x&q=1{mark}")
            );
        }

        #[test]
        fn without_key_order_the_order_of_parameters_matters() {
            let rule = NoVarySearch::parse(br#"params=("utm")"#);
            let key = |q: &str| UriKey::with_rule("h", "/p", Some(q), &learning(), rule.as_ref());
            assert_ne!(key("a=1&b=2"), key("b=2&a=1"));
            assert_eq!(key("a=1&utm=x&b=2"), key("a=1&b=2"));
            let plain = |q: &str| UriKey::new("h", "/p", Some(q), &learning());
            assert_ne!(plain("a=1&b=2"), plain("b=2&a=1"));
            // A route that sorts (the default) merges them.
            let sorting = |q: &str| UriKey::new("h", "/p", Some(q), &QueryFilter::default());
            assert_eq!(sorting("a=1&b=2"), sorting("b=2&a=1"));
            // Sorted as names decode: `a+b` and `a%20b` are one name,
            // whose values keep the client's order.
            assert_ne!(sorting("a+b=1&a%20b=2"), sorting("a%20b=2&a+b=1"));
        }

        #[test]
        fn keys_made_with_different_rules_never_meet() {
            let a = NoVarySearch::parse(br#"params=("x")"#);
            let b = NoVarySearch::parse(br#"params=("y")"#);
            let with = |rule: Option<&NoVarySearch>| {
                UriKey::with_rule("h", "/p", Some("id=1"), &learning(), rule)
            };
            assert_ne!(with(a.as_ref()), with(b.as_ref()));
            assert_ne!(with(a.as_ref()), with(None));
            assert_eq!(with(a.as_ref()).target(), "/p?id=1");
            assert_eq!(with(a.as_ref()).rule_mark(), Some(r#"params=("x")"#));
            assert_eq!(with(None).rule_mark(), None);
        }
    }
}
