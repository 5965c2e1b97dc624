//! corral's cache logic: keys, variance, freshness, stored entries, the L1
//! store and in-process request coalescing. Nothing in here serves HTTP or
//! opens a socket, so every piece is unit-testable on its own.
//!
//! Each item has one path: the data and semantics modules are private and
//! their API is re-exported here (`corral_core::StoredResponse`); the
//! modules that are namespaces of free functions or of one step of the
//! request (`client_addr`, `envelope`, `graphql`, `head`, `hop_by_hop`, `miss`, `path`,
//! `proxy_protocol`, `range`, `rfc9111`, `xfetch`, and `caller` and
//! `rate_limit` for the limits that count callers) are public and not
//! re-exported.

mod backoff;
mod ban;
mod budget;
mod cache_control;
pub mod cache_status;
pub mod caller;
mod circuit;
pub mod client_addr;
mod clock;
mod coding;
pub mod digest;
mod entry;
pub mod envelope;
mod flight;
pub mod graphql;
pub mod h1;
pub mod head;
pub mod hop_by_hop;
mod identity;
mod key;
pub mod miss;
mod no_vary_search;
pub mod path;
pub mod peer_auth;
mod policy;
pub mod proxy_protocol;
pub mod range;
pub mod rate_limit;
pub mod rfc9111;
mod sf;
mod store;
mod vary;
pub mod xfetch;

pub use backoff::{Backoff, BackoffPolicy};
pub use ban::{Ban, BanList, BanTarget, Verdict, string_list};
pub use budget::{Budget, Hold};
pub use cache_control::{CacheControl, targeted_value};
pub use cache_status::{
    CACHE_STATUS, CacheLabel, CacheStatus, Detail, Forward, PROXY_STATUS, UpstreamFailure,
    proxy_status, put_own_cache_status, strip_claimed_members,
};
pub use circuit::{Admission, Circuit, CircuitSettings, Evidence};
pub use clock::{Clock, PausedClock, SystemClock};
pub use coding::{
    Accepted, Coding, accepts as accepts_coding, choose as choose_coding, normalize_accept_encoding,
};
pub use entry::{
    EntryState, MAX_RESIDENCY, PAGE_BACKED_BODY, StoredResponse, VIA_1_1, compact,
    merge_not_modified,
};
pub use flight::{FlightEnd, FlightView, Flights, Join, Permit, Role, WaitResult, Waiter};
pub use identity::{Identity, IdentityRules, pass_class};
pub use key::{
    Digest, LocalBytes, LocalKey, PathScope, PrimaryKey, QueryFilter, UriKey, VariantKey,
};
pub use no_vary_search::{NO_VARY_SEARCH, NoVarySearch};
pub use policy::{Decision, Freshness, PassReason, RoutePolicy, Sharing};
pub use store::{L1, L1Config, PathRule};
pub use vary::{Vary, normalized_value};
