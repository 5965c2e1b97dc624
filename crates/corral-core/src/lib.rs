//! corral's cache logic: keys, variance, freshness, stored entries, the L1
//! store and in-process request coalescing. Nothing in here serves HTTP or
//! opens a socket, so every piece is unit-testable on its own.

pub mod backoff;
pub mod ban;
pub mod budget;
pub mod cache_control;
pub mod cache_status;
pub mod circuit;
pub mod clock;
pub mod entry;
pub mod envelope;
pub mod flight;
pub mod head;
pub mod hop_by_hop;
pub mod identity;
pub mod key;
pub mod miss;
pub mod policy;
pub mod store;
pub mod vary;
pub mod xfetch;

pub use backoff::{Backoff, BackoffPolicy};
pub use ban::{Ban, BanList, BanTarget, Verdict};
pub use budget::{Budget, Hold};
pub use cache_control::CacheControl;
pub use cache_status::{CacheLabel, CacheStatus, Detail, Forward};
pub use circuit::{Admission, Circuit, CircuitSettings};
pub use clock::{Clock, PausedClock, SystemClock};
pub use entry::{EntryState, StoredResponse, merge_not_modified};
pub use flight::{FlightEnd, Flights, Role, WaitResult};
pub use identity::{Identity, IdentityRules};
pub use key::{Digest, PrimaryKey, QueryFilter, UriKey, VariantKey};
pub use policy::{Decision, Freshness, PassReason, RoutePolicy, Sharing};
pub use store::{L1, L1Config};
pub use vary::Vary;
