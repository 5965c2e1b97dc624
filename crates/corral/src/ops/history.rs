//! The instance's recent past, for the live view: a reading of its
//! figures every [`EVERY`], the last [`KEEP`] of them (15 minutes) in a
//! ring buffer, served at `GET /history`. A page opened in the middle of
//! an incident draws what led to it. Each point holds counters as read
//! (rates are made of two points, as the page makes them of two
//! readings) and states; never a key or a path. It costs one rendering of
//! the metrics every 5 s, off the request path.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::ops::stats::Summary;

/// How often a point is taken.
pub const EVERY: Duration = Duration::from_secs(5);
/// Points kept: 15 minutes of them.
pub const KEEP: usize = 180;

/// One reading.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Point {
    /// Milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// Client requests answered so far, by outcome.
    pub requests: BTreeMap<String, u64>,
    pub origin_requests: u64,
    pub origin_errors: u64,
    /// The routes whose circuit was open.
    pub circuits_open: Vec<String>,
    pub redis_breaker_open: bool,
    pub backoff_keys: usize,
}

impl Point {
    /// The point a summary makes.
    pub fn of(s: &Summary) -> Point {
        Point {
            at_ms: s.at_ms,
            requests: s.totals.requests.clone(),
            origin_requests: s.totals.origin_requests,
            origin_errors: s.totals.origin_errors,
            circuits_open: s
                .routes
                .iter()
                .filter(|r| r.circuit == "open")
                .map(|r| r.name.clone())
                .collect(),
            redis_breaker_open: s.redis.breaker_open,
            backoff_keys: s.flights.backoff_keys,
        }
    }
}

/// `GET /history`'s body.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Recent {
    pub instance: String,
    /// Seconds between points.
    pub every_s: u64,
    /// Oldest first.
    pub points: Vec<Point>,
}

/// The ring buffer.
#[derive(Debug, Default)]
pub struct History {
    points: Mutex<VecDeque<Point>>,
}

impl History {
    /// Adds `p`, dropping the oldest past [`KEEP`].
    pub fn push(&self, p: Point) {
        let mut points = self.points.lock().unwrap_or_else(PoisonError::into_inner);
        if points.len() == KEEP {
            points.pop_front();
        }
        points.push_back(p);
    }

    /// Every point kept, oldest first.
    pub fn points(&self) -> Vec<Point> {
        self.points
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .cloned()
            .collect()
    }
}

/// Keeps `history`: a point of `read()` at once and then every
/// [`EVERY`], for as long as the process runs.
pub async fn record(history: &History, read: impl Fn() -> Summary) {
    let mut every = tokio::time::interval(EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        history.push(Point::of(&read()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(at_ms: u64) -> Point {
        Point {
            at_ms,
            requests: BTreeMap::new(),
            origin_requests: at_ms,
            origin_errors: 0,
            circuits_open: Vec::new(),
            redis_breaker_open: false,
            backoff_keys: 0,
        }
    }

    #[test]
    fn the_ring_keeps_the_last_fifteen_minutes_oldest_first() {
        let h = History::default();
        for i in 0..(KEEP as u64 + 20) {
            h.push(point(i));
        }
        let kept = h.points();
        assert_eq!(kept.len(), KEEP);
        assert_eq!(kept[0].at_ms, 20);
        assert_eq!(kept[KEEP - 1].at_ms, KEEP as u64 + 19);
        assert_eq!(EVERY * KEEP as u32, Duration::from_secs(15 * 60));
    }
}
