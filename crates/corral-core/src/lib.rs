//! corral's cache logic: keys, variance, freshness, stored entries, the L1
//! store and in-process request coalescing. Nothing in here serves HTTP or
//! opens a socket, so every piece is unit-testable on its own.
//!
//! Four folders, by concern: `semantics` (HTTP's fields and rules),
//! `model` (the cache: keys, entries, L1, policy, flights), `wire` (formats
//! that are not HTTP fields: the L2 envelope, digests, GraphQL, PROXY
//! protocol) and `callers` (who a caller is and the limits that count
//! them, which are not caching).
//!
//! Each item has one path: the data and semantics modules are private to
//! the crate and their API is re-exported here
//! (`corral_core::StoredResponse`); the modules that are namespaces of
//! free functions or of one step of the request (`callers::client_addr`,
//! `wire::envelope`, `wire::graphql`, `semantics::head`, `model::miss`,
//! and the like) are public and not re-exported.

pub mod callers;
pub mod model;
pub mod semantics;
pub mod wire;

pub use model::backoff::{Backoff, BackoffPolicy};
pub use model::ban::{Ban, BanList, BanTarget, Verdict, string_list};
pub use model::budget::{Budget, Hold};
pub use model::circuit::{Admission, Circuit, CircuitSettings, Evidence, Suspicion};
pub use model::clock::{Clock, ClockShift, PausedClock, ShiftedClock, SystemClock};
pub use model::entry::{
    EntryState, MAX_RESIDENCY, PAGE_BACKED_BODY, StoredResponse, VIA_1_1, compact,
    merge_not_modified,
};
pub use model::flights::{FlightEnd, FlightView, Flights, Join, Permit, Role, WaitResult, Waiter};
pub use model::identity::{Identity, IdentityRules, pass_class};
pub use model::key::{
    Digest, LocalBytes, LocalKey, PathScope, PrimaryKey, QueryFilter, UriKey, VariantKey,
};
pub use model::l1::{L1, L1Config, PathRule};
pub use model::policy::{Decision, Freshness, PassReason, RoutePolicy, Sharing};
pub use semantics::cache_control::{CacheControl, targeted_value};
pub use semantics::cache_status::{
    CACHE_STATUS, CacheLabel, CacheStatus, Detail, Forward, PROXY_STATUS, UpstreamFailure,
    proxy_status, put_own_cache_status, strip_claimed_members,
};
pub use semantics::coding::{
    Accepted, Coding, accepts as accepts_coding, choose as choose_coding, normalize_accept_encoding,
};
pub use semantics::no_vary_search::{NO_VARY_SEARCH, NoVarySearch};
pub use semantics::vary::{Vary, normalized_value};
