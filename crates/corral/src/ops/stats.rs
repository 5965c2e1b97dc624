//! `GET /stats`: what the live page, `corral top` and the fleet heartbeat
//! show, as one JSON object. Counters are totals since the start (a view
//! makes rates of two readings); gauges are now. Every counter is read
//! from the same rendering `/metrics` serves, so the two never disagree,
//! and nothing here is counted on the request path.
//!
//! Keys are shown as the access log shows them: route, method, host and
//! path, never a query value or a body digest. No credential, token or
//! account name is in it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::app::App;

/// The outcomes a client request is counted under (`cache` label of
/// `corral_requests_total`).
pub const OUTCOMES: [&str; 6] = ["hit", "stale", "miss", "collapsed", "pass", "error"];

/// How many of the busiest flights are shown.
const BUSIEST: usize = 10;

/// One instance's figures.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    /// This process: host name and process id.
    pub instance: String,
    /// The client listener's address.
    pub listen: String,
    pub version: String,
    pub uptime_s: u64,
    /// Its own live view needs a token: a view anyone may read does not
    /// show it (absent in a heartbeat from an older corral: open).
    #[serde(default)]
    pub guarded: bool,
    /// When it was read, in milliseconds since the Unix epoch.
    pub at_ms: u64,
    pub totals: Traffic,
    pub routes: Vec<RouteTraffic>,
    pub flights: FlightsView,
    pub redis: RedisView,
    pub bounds: Vec<Bound>,
}

/// Client requests by outcome, origin requests, and what was saved.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Traffic {
    /// Client requests answered, by outcome ([`OUTCOMES`]).
    pub requests: BTreeMap<String, u64>,
    /// Requests sent to the origin (`corral_origin_fetches_total`),
    /// background refreshes and revalidations included.
    pub origin_requests: u64,
    /// Those that failed: no answer (`status="error"`) or a 5xx (absent in
    /// a heartbeat from an older corral: 0).
    #[serde(default)]
    pub origin_errors: u64,
    /// Client requests that did not reach the origin, by why: `hit`,
    /// `collapsed` (answered by another caller's fetch), `stale`.
    pub saved: BTreeMap<String, u64>,
}

impl Traffic {
    /// Every client request answered.
    pub fn clients(&self) -> u64 {
        self.requests.values().sum()
    }

    /// `other` added in.
    pub fn add(&mut self, other: &Traffic) {
        for (k, v) in &other.requests {
            *self.requests.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &other.saved {
            *self.saved.entry(k.clone()).or_default() += v;
        }
        self.origin_requests += other.origin_requests;
        self.origin_errors += other.origin_errors;
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RouteTraffic {
    pub name: String,
    #[serde(flatten)]
    pub traffic: Traffic,
    /// `closed` or `open`.
    pub circuit: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct FlightsView {
    pub in_progress: usize,
    /// The flights with the most callers waiting, most first.
    pub busiest: Vec<Flight>,
    /// Keys whose origin failed and that are in back-off now.
    pub backoff_keys: usize,
    /// Those with the longest back-off to run.
    #[serde(default)]
    pub backoff: Vec<BackedOff>,
    /// The keys whose flights had the most followers lately, most first
    /// (never on `/metrics`: a key is no label value).
    #[serde(default)]
    pub most_waited: Vec<Waited>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Waited {
    pub key: String,
    /// The most followers one of its flights had.
    pub waiters: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct BackedOff {
    pub key: String,
    /// How long the origin is left alone for this key still.
    pub remaining_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Flight {
    pub key: String,
    pub waiting: usize,
    pub age_ms: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct RedisView {
    /// `node`, `cluster`, `sentinel` or `off`.
    pub mode: String,
    /// `connected`, `connecting`, `breaker-open` or `off`.
    pub link: String,
    pub breaker_open: bool,
    /// On a Cluster: each primary's breaker, by the primary's address.
    #[serde(default)]
    pub primaries: Vec<Primary>,
    /// L2 reads by result: hit, miss, corrupt.
    pub l2_reads: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Primary {
    pub node: String,
    pub breaker_open: bool,
}

/// A bound and how much of it is used.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Bound {
    pub name: String,
    pub used: u64,
    pub limit: u64,
    /// `bytes` or `count`.
    pub unit: String,
}

/// One sample of the Prometheus text: its name, labels and value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The samples of a Prometheus text rendering (corral's own: one sample a
/// line, labels quoted with `\\`, `\"` and `\n` escaped). A line that does
/// not read is skipped.
pub fn samples(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(sample)
        .collect()
}

/// The braces around a sample's labels.
const LABELS_OPEN: char = '{';
const LABELS_CLOSE: char = '}';

fn sample(line: &str) -> Option<Sample> {
    let (name, rest) = match line.find([LABELS_OPEN, ' ']) {
        Some(i) => line.split_at(i),
        None => return None,
    };
    let mut labels = Vec::new();
    let mut rest = rest;
    if let Some(mut inner) = rest.strip_prefix(LABELS_OPEN) {
        loop {
            inner = inner.trim_start_matches(',');
            if let Some(after) = inner.strip_prefix(LABELS_CLOSE) {
                rest = after;
                break;
            }
            let eq = inner.find("=\"")?;
            let key = inner[..eq].to_owned();
            let mut value = String::new();
            let mut chars = inner[eq + 2..].char_indices();
            let end = loop {
                match chars.next()? {
                    (_, '\\') => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        c => value.push(c),
                    },
                    (i, '"') => break eq + 2 + i + 1,
                    (_, c) => value.push(c),
                }
            };
            labels.push((key, value));
            inner = &inner[end..];
        }
    }
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// What the instance knows that the metrics text does not carry.
pub struct Live<'a> {
    pub app: &'a App,
    pub instance: &'a str,
    pub listen: &'a str,
    pub uptime_s: u64,
    /// Its live view needs a token.
    pub guarded: bool,
}

/// The summary, from the metrics text `metrics` rendered just now and
/// the instance's live state.
pub fn summary(metrics: &str, live: &Live<'_>) -> Summary {
    let all = samples(metrics);
    let app = live.app;
    let mut routes: Vec<RouteTraffic> = app
        .routes()
        .iter()
        .map(|r| RouteTraffic {
            name: r.name.clone(),
            traffic: traffic(&all, Some(&r.name)),
            circuit: if r.origin.circuit.is_open() {
                "open"
            } else {
                "closed"
            }
            .to_owned(),
        })
        .collect();
    // Requests that matched no route.
    let unrouted = traffic(&all, Some("-"));
    if unrouted.clients() > 0 {
        routes.push(RouteTraffic {
            name: "-".to_owned(),
            traffic: unrouted,
            circuit: "closed".to_owned(),
        });
    }
    let mut totals = Traffic::default();
    for r in &routes {
        totals.add(&r.traffic);
    }
    Summary {
        instance: live.instance.to_owned(),
        listen: live.listen.to_owned(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        uptime_s: live.uptime_s,
        guarded: live.guarded,
        at_ms: crate::cluster::protocol::epoch_millis(std::time::SystemTime::now()),
        totals,
        routes,
        flights: FlightsView {
            in_progress: app.cache.flights.len(),
            busiest: app
                .cache
                .flights
                .busiest(BUSIEST)
                .into_iter()
                .map(|f| Flight {
                    key: f.name,
                    waiting: f.waiting,
                    age_ms: f.age.as_millis() as u64,
                })
                .collect(),
            backoff_keys: app.cache.l1.backoff_keys(),
            backoff: app
                .cache
                .l1
                .backoff_names(BUSIEST)
                .into_iter()
                .map(|(key, left)| BackedOff {
                    key,
                    remaining_ms: left.as_millis() as u64,
                })
                .collect(),
            most_waited: crate::telemetry::metrics::most_waited()
                .into_iter()
                .map(|(key, waiters)| Waited { key, waiters })
                .collect(),
        },
        redis: redis(&all, app),
        bounds: bounds(app),
    }
}

/// A route's traffic (`None`: every route's).
fn traffic(all: &[Sample], route: Option<&str>) -> Traffic {
    let of_route = |s: &&Sample| route.is_none_or(|r| s.label("route") == Some(r));
    let mut requests: BTreeMap<String, u64> =
        OUTCOMES.iter().map(|o| ((*o).to_owned(), 0)).collect();
    for s in all
        .iter()
        .filter(|s| s.name == "corral_requests_total")
        .filter(of_route)
    {
        if let Some(n) = s.label("cache").and_then(|c| requests.get_mut(c)) {
            *n += s.value as u64;
        }
    }
    let fetches = || {
        all.iter()
            .filter(|s| s.name == "corral_origin_fetches_total")
            .filter(of_route)
    };
    let origin_requests = fetches().map(|s| s.value as u64).sum();
    let origin_errors = fetches()
        .filter(|s| s.label("status").is_some_and(failed_status))
        .map(|s| s.value as u64)
        .sum();
    let saved = ["hit", "collapsed", "stale"]
        .iter()
        .map(|o| ((*o).to_owned(), requests[*o]))
        .collect();
    Traffic {
        requests,
        origin_requests,
        origin_errors,
        saved,
    }
}

/// An origin fetch's `status` label that counts as an origin error: no
/// answer, or a 5xx.
fn failed_status(status: &str) -> bool {
    status == "error" || status.starts_with('5')
}

fn redis(all: &[Sample], app: &App) -> RedisView {
    let l2_reads = ["hit", "miss", "corrupt"]
        .iter()
        .map(|r| {
            let n = all
                .iter()
                .filter(|s| s.name == "corral_l2_reads_total" && s.label("result") == Some(r))
                .map(|s| s.value as u64)
                .sum();
            ((*r).to_owned(), n)
        })
        .collect();
    match &app.l2 {
        None => RedisView {
            mode: "off".to_owned(),
            link: "off".to_owned(),
            l2_reads,
            ..RedisView::default()
        },
        Some(l2) => RedisView {
            mode: l2.link.mode().to_owned(),
            link: l2.link.status().to_owned(),
            breaker_open: l2.link.breaker_state().0,
            primaries: l2
                .link
                .shard_breakers()
                .into_iter()
                .map(|(node, breaker_open)| Primary { node, breaker_open })
                .collect(),
            l2_reads,
        },
    }
}

fn bounds(app: &App) -> Vec<Bound> {
    let cache = &app.cache;
    let bytes = |name: &str, used: u64, limit: u64| Bound {
        name: name.to_owned(),
        used,
        limit,
        unit: "bytes".to_owned(),
    };
    let mut out = vec![
        bytes("l1", cache.l1.weighted_size(), cache.l1.capacity()),
        bytes(
            "fill_memory",
            cache.fill_memory.used(),
            cache.fill_memory.limit(),
        ),
        bytes(
            "pinned_by_slow_readers",
            cache.ahead_memory.used(),
            cache.ahead_memory.limit(),
        ),
        bytes(
            "post_memory",
            app.post_memory.used(),
            app.post_memory.limit(),
        ),
    ];
    for (name, used, max) in crate::http::connection::open_connections() {
        out.push(Bound {
            name: format!("connections_{}", name.replace('-', "_")),
            used: used as u64,
            limit: max as u64,
            unit: "count".to_owned(),
        });
    }
    out.push(Bound {
        name: "sealed_bodies".to_owned(),
        used: crate::sealed::live() as u64,
        limit: crate::sealed::max_live() as u64,
        unit: "count".to_owned(),
    });
    if let Some((used, limit)) = descriptors() {
        out.push(Bound {
            name: "descriptors".to_owned(),
            used,
            limit,
            unit: "count".to_owned(),
        });
    }
    out
}

/// Descriptors open now, and the soft limit on them (Linux's `/proc`).
fn descriptors() -> Option<(u64, u64)> {
    let open = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let soft = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))?
        .split_whitespace()
        .nth(3)?
        .parse()
        .ok()?;
    Some((open, soft))
}

/// Every instance's summary and their sum: the fleet as `/stats?fleet=1`
/// shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Fleet {
    /// Where the list came from: `redis` (every instance whose heartbeat
    /// is live) or `local` (this one: no Redis, or it did not answer).
    pub source: String,
    pub totals: Traffic,
    pub instances: Vec<Summary>,
    /// Live instances left out because their view needs a token and this
    /// one does not.
    #[serde(default)]
    pub withheld: usize,
}

impl Fleet {
    pub fn of(source: &str, instances: Vec<Summary>) -> Fleet {
        let mut totals = Traffic::default();
        for i in &instances {
            totals.add(&i.totals);
        }
        Fleet {
            source: source.to_owned(),
            totals,
            instances,
            withheld: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_read_names_labels_and_values() {
        let text = "# HELP x y\n# TYPE corral_requests_total counter\n\
            corral_requests_total{route=\"api\",method=\"GET\",cache=\"hit\"} 12\n\
            corral_l1_bytes 4096\n\
            corral_example_labelled{name=\"a \\\"b\\\" \\\\ c\\nd\"} 3\n\
            broken{route=\"x} 1\n";
        let all = samples(text);
        assert_eq!(all.len(), 3, "{all:?}");
        assert_eq!(all[0].label("cache"), Some("hit"));
        assert_eq!(all[0].value, 12.0);
        assert_eq!(all[1].name, "corral_l1_bytes");
        assert_eq!(all[1].value, 4096.0);
        assert_eq!(all[2].label("name"), Some("a \"b\" \\ c\nd"));
    }

    #[test]
    fn traffic_counts_outcomes_and_what_was_saved() {
        let text = "corral_requests_total{route=\"api\",method=\"GET\",cache=\"hit\"} 90\n\
            corral_requests_total{route=\"api\",method=\"HEAD\",cache=\"hit\"} 5\n\
            corral_requests_total{route=\"api\",method=\"GET\",cache=\"collapsed\"} 900\n\
            corral_requests_total{route=\"api\",method=\"GET\",cache=\"miss\"} 1\n\
            corral_requests_total{route=\"other\",method=\"GET\",cache=\"miss\"} 7\n\
            corral_origin_fetches_total{route=\"api\",status=\"200\"} 1\n\
            corral_origin_fetches_total{route=\"other\",status=\"503\"} 7\n\
            corral_origin_fetches_total{route=\"other\",status=\"error\"} 2\n";
        let all = samples(text);
        let api = traffic(&all, Some("api"));
        assert_eq!(api.requests["hit"], 95);
        assert_eq!(api.clients(), 996);
        assert_eq!(api.origin_requests, 1);
        assert_eq!(api.clients() - api.origin_requests, 995);
        assert_eq!(api.saved["collapsed"], 900);
        let every = traffic(&all, None);
        assert_eq!(every.clients(), 1003);
        assert_eq!(every.origin_requests, 10);
        assert_eq!(every.origin_errors, 9);
        assert_eq!(api.origin_errors, 0);
    }
}
