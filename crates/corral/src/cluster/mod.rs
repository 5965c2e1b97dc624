//! What instances share through Redis: the connection and its breaker
//! (`redis_link`, `breaker`), the wire format (`protocol`), the shared
//! store (`l2`), the cross-instance lease (`lease`) and the pub/sub
//! subscriber (`subscriber`), a fill's body relayed to the waiting
//! instances as it arrives (`stream`), the check of every record read from it
//! (`trust`), and the seam the cache path reaches all of
//! it through (`tier`). Knows nothing of HTTP answers.

pub mod breaker;
pub mod l2;
pub mod lease;
pub mod protocol;
pub mod redis_link;
pub mod shards;
pub mod stream;
pub mod subscriber;
pub mod tier;
pub mod trust;
