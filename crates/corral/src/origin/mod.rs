//! Talking to the origin: the one exchange every origin request goes
//! through (`exchange`, over its `Transport` seam), the upstream request
//! built from the validated head (`request`), the pooled client with its
//! deadlines (`upstream`) over the route's servers (`pool`), the
//! origin's interim (1xx) answers passed on to the caller (`interim`),
//! `upstream_concurrency` across instances (`slots`), the upstream
//! sockets passed-through requests may hold (`descriptors`), and
//! passed-through bodies read ahead of slow clients (`ahead`).
//! Used by `http` (pass-through, and the connection's interim writes) and
//! `cache` (fills).

pub mod ahead;
pub mod descriptors;
pub mod exchange;
pub mod interim;
pub mod pool;
pub mod request;
pub mod slots;
pub mod upstream;
