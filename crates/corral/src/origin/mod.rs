//! Talking to the origin: the upstream request built from the validated
//! head (`request`) and the pooled client with its deadlines (`upstream`).
//! Used by `http` (pass-through) and `cache` (fills).

pub mod pool;
pub mod request;
pub mod upstream;
