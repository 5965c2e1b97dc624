//! Metrics (`metrics`), the access line (`access_log`), the buffered
//! writer every log line goes through (`log_sink`) and the counting of
//! warnings that repeat (`repeats`). Used by every layer; uses none of
//! them except to read the state it reports.

pub mod access_log;
pub mod log_sink;
pub mod metrics;
pub mod repeats;
