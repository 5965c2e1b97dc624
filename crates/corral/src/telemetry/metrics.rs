//! Prometheus metrics: every name and label corral exports is written here,
//! so the exported set can be read in one file. Recording is a few atomic
//! operations; nothing here allocates a label value per request beyond the
//! route name, and nothing blocks.

use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Duration;

use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// How many of the most-waited-on keys are kept.
const TOP_KEYS: usize = 10;

/// The keys whose flights had the most waiters recently (bounded). Shown
/// on `/stats` (the live view, which a token guards off loopback), never
/// exported as a label: a key names a path and what a caller asked for.
static TOP: Mutex<Vec<(String, usize)>> = Mutex::new(Vec::new());

/// Installs the recorder (once per process) and returns its handle.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
                    &[
                        0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    ],
                )
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        metrics_exporter_prometheus::Matcher::Full("corral_flight_waiters".into()),
                        &[0.0, 1.0, 2.0, 5.0, 10.0, 50.0, 100.0, 500.0, 1000.0, 5000.0],
                    )
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        metrics_exporter_prometheus::Matcher::Full(
                            "corral_variants_per_key".into(),
                        ),
                        &[1.0, 2.0, 3.0, 4.0],
                    )
                });
            let recorder = match builder {
                Ok(b) => b.build_recorder(),
                Err(_) => PrometheusBuilder::new().build_recorder(),
            };
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed");
            }
            describe();
            register_known();
            handle
        })
        .clone()
}

/// Every family corral exports, with its HELP text: `(name, kind, help)`.
/// A test reads `/metrics` and fails on a family missing from here.
pub const FAMILIES: &[(&str, Kind, &str)] = &[
    (
        "corral_build_info",
        Kind::Gauge,
        "Always 1; the labels name the running build.",
    ),
    (
        "corral_requests_total",
        Kind::Counter,
        "Answered client requests by route, method and cache outcome (hit, stale, miss, collapsed, pass, error).",
    ),
    (
        "corral_origin_fetches_total",
        Kind::Counter,
        "Requests sent to the origin, by route and answer status (error: no answer).",
    ),
    (
        "corral_origin_fetch_duration_seconds",
        Kind::Histogram,
        "Time from sending an origin request to its answer's head, by route.",
    ),
    (
        "corral_origin_skipped_total",
        Kind::Counter,
        "Origin requests corral did not make, by route and reason (backoff, circuit-open, upstream-busy).",
    ),
    (
        "corral_origin_hung_fetches_total",
        Kind::Counter,
        "Origin fetches still without an answer head after the circuit's hang time (twice the route's slowest recent answer, at least stale_after), by route.",
    ),
    (
        "corral_origin_circuit_open",
        Kind::Gauge,
        "1 while the route's origin circuit is open.",
    ),
    (
        "corral_origin_backoff_keys",
        Kind::Gauge,
        "Keys in back-off now.",
    ),
    (
        "corral_stale_answers_total",
        Kind::Counter,
        "Stale answers, by reason.",
    ),
    (
        "corral_flights_in_progress",
        Kind::Gauge,
        "Keys being fetched now.",
    ),
    (
        "corral_flight_waiters",
        Kind::Histogram,
        "Callers that waited on one flight, per flight.",
    ),
    (
        "corral_wait_list_full_total",
        Kind::Counter,
        "Callers turned away because a flight had coalesce.max_waiters, by route.",
    ),
    (
        "corral_fills_refused_total",
        Kind::Counter,
        "Fills not started for lack of a fill slot, by route.",
    ),
    (
        "corral_fills_cancelled_total",
        Kind::Counter,
        "Fills cancelled because nobody waited for them any more, by route.",
    ),
    (
        "corral_lease_total",
        Kind::Counter,
        "Cross-instance leases, by outcome.",
    ),
    (
        "corral_redis_connected",
        Kind::Gauge,
        "1 while Redis answers this instance's commands.",
    ),
    (
        "corral_redis_breaker_open",
        Kind::Gauge,
        "1 while a Redis breaker is open.",
    ),
    (
        "corral_redis_breaker_opened_total",
        Kind::Counter,
        "Times a Redis breaker opened.",
    ),
    (
        "corral_redis_errors_total",
        Kind::Counter,
        "Failed Redis commands, by kind.",
    ),
    (
        "corral_redis_unauthenticated_records_total",
        Kind::Counter,
        "Records read from Redis and refused unread (bad authentication tag, or over their size bound), by kind.",
    ),
    (
        "corral_l2_reads_total",
        Kind::Counter,
        "L2 reads, by result.",
    ),
    (
        "corral_invalidation_log_total",
        Kind::Counter,
        "Invalidation notices replayed after a resubscription, and gaps the log could not cover.",
    ),
    (
        "corral_resync_refreshes_total",
        Kind::Counter,
        "Unverified entries revalidated at the resync pace.",
    ),
    (
        "corral_refreshes_deferred_total",
        Kind::Counter,
        "Refreshes that waited for Redis.",
    ),
    ("corral_l1_entries", Kind::Gauge, "Entries in L1."),
    ("corral_l1_bytes", Kind::Gauge, "Bytes L1's entries weigh."),
    (
        "corral_l1_side_bytes",
        Kind::Gauge,
        "Bytes of L1's side tables (Vary sets, pass markers, invalidations).",
    ),
    (
        "corral_l1_limit_bytes",
        Kind::Gauge,
        "What L1's entries may weigh in all.",
    ),
    (
        "corral_fill_buffer_bytes",
        Kind::Gauge,
        "Bytes fills under way hold.",
    ),
    (
        "corral_fill_memory_limit_bytes",
        Kind::Gauge,
        "cache.fill_memory.",
    ),
    (
        "corral_post_buffer_bytes",
        Kind::Gauge,
        "Bytes coalesced POST bodies hold.",
    ),
    (
        "corral_ahead_buffer_bytes",
        Kind::Gauge,
        "Bytes held for passed-through answers' readers.",
    ),
    (
        "corral_sealed_bodies",
        Kind::Gauge,
        "Large bodies kept in sealed memory files.",
    ),
    (
        "corral_sealed_bytes",
        Kind::Gauge,
        "Bytes of large bodies in sealed memory files (not in RSS).",
    ),
    (
        "corral_connections_closed_total",
        Kind::Counter,
        "Client or admin connections corral closed for a reason of its own, by reason.",
    ),
    (
        "corral_overload_busy_ratio",
        Kind::Gauge,
        "Share of the last tick the serving threads were busy (0 to 1).",
    ),
    (
        "corral_overloaded",
        Kind::Gauge,
        "1 while corral sheds new work.",
    ),
    (
        "corral_overload_shed_total",
        Kind::Counter,
        "New work turned away while overloaded, by what.",
    ),
    (
        "corral_worker_connections_total",
        Kind::Counter,
        "Connections each per_core worker accepted.",
    ),
    (
        "corral_interim_responses_total",
        Kind::Counter,
        "Interim (1xx) answers of the origin passed on, by status.",
    ),
    (
        "corral_upstream_server_up",
        Kind::Gauge,
        "0 while a server of a route's pool is left out after failures.",
    ),
    (
        "corral_upstream_slots_total",
        Kind::Counter,
        "upstream_concurrency slots taken or given up, by route and outcome.",
    ),
    (
        "corral_rate_limit_total",
        Kind::Counter,
        "Rate-limit decisions, by route, limit, outcome and counter.",
    ),
    (
        "corral_trusted_proxy_requests_total",
        Kind::Counter,
        "Requests each server.trusted_proxies entry vouched for.",
    ),
    (
        "corral_streams_passed_through_total",
        Kind::Counter,
        "Streamed answers that outgrew a bound and passed through, by route and reason.",
    ),
    (
        "corral_stream_readers_cut_total",
        Kind::Counter,
        "Readers of a passing-through answer cut off for holding the others back, by route.",
    ),
    (
        "corral_digest_mismatches_total",
        Kind::Counter,
        "Origin bodies that failed their Content-Digest or Repr-Digest, by route and field.",
    ),
    (
        "corral_compression_bytes_in_total",
        Kind::Counter,
        "Bytes compressed when answers were stored, by route and coding.",
    ),
    (
        "corral_compression_bytes_out_total",
        Kind::Counter,
        "Bytes those answers compressed to, by route and coding.",
    ),
    (
        "corral_compression_duration_seconds",
        Kind::Histogram,
        "Time spent compressing one stored answer in every coding, by route.",
    ),
    (
        "corral_variants_per_key",
        Kind::Histogram,
        "Representations an entry was stored with, by route.",
    ),
    (
        "corral_cpu_threads",
        Kind::Gauge,
        "Jobs the CPU pool runs at once (server.cpu_threads; 0: inline on the serving threads).",
    ),
    ("corral_cpu_busy", Kind::Gauge, "CPU pool slots in use now."),
    (
        "corral_cpu_queued",
        Kind::Gauge,
        "Jobs waiting for a CPU pool slot now (digest checks, decodes, copies; compression never waits).",
    ),
    (
        "corral_cpu_jobs_total",
        Kind::Counter,
        "CPU jobs by job (compress, compress-stream, decompress, digest, copy) and how they ran (pool, saturated: skipped for later, inline).",
    ),
    (
        "corral_cpu_job_duration_seconds",
        Kind::Histogram,
        "Time one CPU job ran, by job.",
    ),
    (
        "corral_codings_made_on_demand_total",
        Kind::Counter,
        "Codings made for a stored answer when a caller first asked for one, by route and coding.",
    ),
    (
        "corral_codings_from_l2_total",
        Kind::Counter,
        "Codings of a stored answer read from Redis, where another instance kept them for the same body, instead of made here, by route and coding.",
    ),
    (
        "corral_log_lines_dropped_total",
        Kind::Counter,
        "Log lines dropped because stdout could not keep up.",
    ),
];

/// A family's Prometheus type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// HELP text for every family, and `corral_build_info`.
fn describe() {
    for &(name, kind, help) in FAMILIES {
        match kind {
            Kind::Counter => metrics::describe_counter!(name, help),
            Kind::Gauge => metrics::describe_gauge!(name, help),
            Kind::Histogram => metrics::describe_histogram!(name, help),
        }
    }
    gauge!(
        "corral_build_info",
        "version" => env!("CARGO_PKG_VERSION"),
        "profile" => if cfg!(debug_assertions) { "debug" } else { "release" }
    )
    .set(1.0);
}

/// Reasons a connection is closed by corral (`corral_connections_closed_total`).
const CLOSE_REASONS: [&str; 10] = [
    "no-request",
    "idle",
    "send-timeout",
    "slow-reader",
    "abandoned-requests",
    "proxy-protocol",
    "tls-handshake",
    "overload",
    "peer-limit",
    "listener-full",
];

/// The instance-wide counters whose label sets are known, at 0 from
/// start-up: a rate over a counter that appears only at its first event
/// reads as no data, not as zero.
fn register_known() {
    for reason in [
        corral_core::Detail::StaleWhileRevalidate,
        corral_core::Detail::StaleIfError,
        corral_core::Detail::LockTimeout,
        corral_core::Detail::Backoff,
        corral_core::Detail::CircuitOpen,
        corral_core::Detail::FillLimit,
        corral_core::Detail::WaitListFull,
        corral_core::Detail::UpstreamBusy,
    ] {
        counter!("corral_stale_answers_total", "reason" => reason.stale_reason()).increment(0);
    }
    for what in ["pass", "connection"] {
        counter!("corral_overload_shed_total", "what" => what).increment(0);
    }
    for reason in CLOSE_REASONS {
        counter!("corral_connections_closed_total", "reason" => reason).increment(0);
    }
    counter!("corral_log_lines_dropped_total").increment(0);
}

/// The shared tier's counters at 0, once Redis is configured.
pub fn register_redis() {
    for l in [
        Lease::Acquired,
        Lease::TakenOver,
        Lease::AgedOut,
        Lease::Lost,
        Lease::Local,
        Lease::TimedOut,
    ] {
        counter!("corral_lease_total", "outcome" => l.as_str()).increment(0);
    }
    for k in [
        RedisFailure::Timeout,
        RedisFailure::Error,
        RedisFailure::BreakerOpen,
        RedisFailure::NotConnected,
        RedisFailure::TryAgain,
        RedisFailure::Oom,
    ] {
        counter!("corral_redis_errors_total", "kind" => k.as_str()).increment(0);
    }
    for r in [L2Read::Hit, L2Read::Miss, L2Read::Corrupt] {
        counter!("corral_l2_reads_total", "result" => r.as_str()).increment(0);
    }
    for o in ["replayed", "lost"] {
        counter!("corral_invalidation_log_total", "outcome" => o).increment(0);
    }
    for kind in corral_core::callers::peer_auth::Record::ALL {
        counter!("corral_redis_unauthenticated_records_total", "kind" => kind.as_str())
            .increment(0);
    }
    counter!("corral_refreshes_deferred_total").increment(0);
    counter!("corral_resync_refreshes_total").increment(0);
    counter!("corral_redis_breaker_opened_total").increment(0);
}

/// A route's counters at 0, registered with the route.
pub fn register_route(route: &str) {
    let r = || route.to_owned();
    counter!("corral_fills_refused_total", "route" => r()).increment(0);
    counter!("corral_fills_cancelled_total", "route" => r()).increment(0);
    counter!("corral_wait_list_full_total", "route" => r()).increment(0);
    counter!("corral_stream_readers_cut_total", "route" => r()).increment(0);
    for reason in [
        corral_core::Detail::Backoff,
        corral_core::Detail::CircuitOpen,
        corral_core::Detail::UpstreamBusy,
    ] {
        counter!("corral_origin_skipped_total", "route" => r(), "reason" => reason.as_str())
            .increment(0);
    }
    for field in ["content-digest", "repr-digest"] {
        counter!("corral_digest_mismatches_total", "route" => r(), "field" => field).increment(0);
    }
    for reason in ["too-large", "fill-memory"] {
        counter!("corral_streams_passed_through_total", "route" => r(), "reason" => reason)
            .increment(0);
    }
}

/// How often histogram samples are folded into their buckets when nobody
/// scrapes: the recorder keeps raw samples until then, 8 bytes each, which
/// without this grew by 16 bytes for every miss (20 MiB over a million).
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// Folds recorded samples into the exported histograms on a timer, so the
/// recorder's memory stays bounded whether or not `/metrics` is scraped.
pub fn spawn_upkeep(handle: PrometheusHandle) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(UPKEEP_EVERY);
        loop {
            tick.tick().await;
            handle.run_upkeep();
        }
    });
}

const METHODS: [&str; 8] = [
    "GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "other",
];
const RESULTS: [&str; 6] = ["hit", "stale", "miss", "collapsed", "pass", "error"];

/// A route's request counters, registered once, so that counting a request
/// neither allocates a label nor looks one up.
pub struct RequestCounters {
    counters: Vec<metrics::Counter>,
}

impl RequestCounters {
    /// The route's request counters, and its other counters at 0.
    pub fn new(route: &str) -> Self {
        register_route(route);
        let mut counters = Vec::with_capacity(METHODS.len() * RESULTS.len());
        for method in METHODS {
            for result in RESULTS {
                counters.push(counter!(
                    "corral_requests_total",
                    "route" => route.to_owned(),
                    "method" => method,
                    "cache" => result
                ));
            }
        }
        RequestCounters { counters }
    }

    /// One answered client request. `result` is one of hit, stale, miss,
    /// collapsed, pass, error.
    pub fn count(&self, method: &http::Method, result: &'static str) {
        let r = RESULTS
            .iter()
            .position(|x| *x == result)
            .unwrap_or(RESULTS.len() - 1);
        if let Some(c) = self.counters.get(method_index(method) * RESULTS.len() + r) {
            c.increment(1);
        }
    }
}

/// One counter per `server.trusted_proxies` entry, registered at start so
/// an entry that vouches for nobody shows 0 (its proxy may be gone: the
/// entry is a promise that can be removed).
pub fn trusted_proxy_counters(
    trusted: &corral_core::callers::client_addr::TrustedProxies,
) -> Vec<metrics::Counter> {
    trusted
        .entries()
        .iter()
        .map(|c| {
            let counter =
                counter!("corral_trusted_proxy_requests_total", "cidr" => c.as_str().to_owned());
            counter.increment(0);
            counter
        })
        .collect()
}

/// A request that matched no route (or had no valid host).
pub fn unrouted(method: &http::Method, result: &'static str) {
    counter!("corral_requests_total", "route" => "-", "method" => METHODS[method_index(method)], "cache" => result)
        .increment(1);
}

fn method_index(m: &http::Method) -> usize {
    match *m {
        http::Method::GET => 0,
        http::Method::HEAD => 1,
        http::Method::POST => 2,
        http::Method::PUT => 3,
        http::Method::PATCH => 4,
        http::Method::DELETE => 5,
        http::Method::OPTIONS => 6,
        _ => 7,
    }
}

/// One exchange with an upstream: its status (or "error") and how long the
/// response head took.
pub fn origin_fetch(route: &str, status: Option<u16>, took: Duration) {
    let status = status.map_or_else(|| "error".to_owned(), |s| s.to_string());
    counter!("corral_origin_fetches_total", "route" => route.to_owned(), "status" => status)
        .increment(1);
    histogram!("corral_origin_fetch_duration_seconds", "route" => route.to_owned())
        .record(took.as_secs_f64());
}

/// A flight ended with `waiters` followers.
pub fn flight_waiters(key: &str, waiters: usize) {
    histogram!("corral_flight_waiters").record(waiters as f64);
    if waiters == 0 {
        return;
    }
    let mut top = TOP.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(slot) = top.iter_mut().find(|(k, _)| k == key) {
        slot.1 = slot.1.max(waiters);
    } else if top.len() < TOP_KEYS {
        top.push((key.to_owned(), waiters));
    } else if let Some(min) = top.iter_mut().min_by_key(|(_, w)| *w)
        && min.1 < waiters
    {
        *min = (key.to_owned(), waiters);
    }
}

/// A cross-instance lease event: acquired, lost, timed_out, taken_over.
pub fn lease(outcome: Lease) {
    counter!("corral_lease_total", "outcome" => outcome.as_str()).increment(1);
}

/// How a shared flight's try for the lease ended (the `outcome` label of
/// `corral_lease_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lease {
    /// Taken: this instance leads.
    Acquired,
    /// Taken after waiting on another holder's fill.
    TakenOver,
    /// Held past `lock_age` by its holder, and taken from it.
    AgedOut,
    /// Another instance holds it: this one follows.
    Lost,
    /// Given up: the answer is too large for L2.
    Local,
    /// Waited for past `lock_timeout`.
    TimedOut,
}

impl Lease {
    pub fn as_str(self) -> &'static str {
        match self {
            Lease::Acquired => "acquired",
            Lease::TakenOver => "taken_over",
            Lease::AgedOut => "aged_out",
            Lease::Lost => "lost",
            Lease::Local => "local",
            Lease::TimedOut => "timed_out",
        }
    }
}

/// A Redis call that failed (the `kind` label of
/// `corral_redis_errors_total`).
pub fn redis_error(kind: RedisFailure) {
    counter!("corral_redis_errors_total", "kind" => kind.as_str()).increment(1);
}

/// How a Redis call failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisFailure {
    Timeout,
    Error,
    BreakerOpen,
    NotConnected,
    /// A slot in migration (Cluster `TRYAGAIN`): no Redis failure.
    TryAgain,
    /// A write refused because Redis is full (`OOM`): no Redis failure.
    Oom,
}

impl RedisFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            RedisFailure::Timeout => "timeout",
            RedisFailure::Error => "error",
            RedisFailure::BreakerOpen => "breaker_open",
            RedisFailure::NotConnected => "not_connected",
            RedisFailure::TryAgain => "tryagain",
            RedisFailure::Oom => "oom",
        }
    }
}

/// Invalidations replayed from the log after a resubscription.
pub fn invalidation_log_replayed(n: usize) {
    counter!("corral_invalidation_log_total", "outcome" => "replayed").increment(n as u64);
}

/// The log could not cover a gap: every entry held was unverified.
pub fn invalidation_log_lost() {
    counter!("corral_invalidation_log_total", "outcome" => "lost").increment(1);
}

/// A stale-while-revalidate answer whose refresh waits for Redis (which
/// is unavailable: the refresh would be this instance's alone).
pub fn refresh_deferred() {
    counter!("corral_refreshes_deferred_total").increment(1);
}

/// An unverified entry's paced revalidation started.
pub fn resync_refresh() {
    counter!("corral_resync_refreshes_total").increment(1);
}

/// A record read from Redis that was refused unread: its authentication
/// tag did not verify, or (a heartbeat) it was over its size bound.
pub fn redis_unauthenticated(kind: corral_core::callers::peer_auth::Record) {
    counter!("corral_redis_unauthenticated_records_total", "kind" => kind.as_str()).increment(1);
}

/// An L2 read (the `result` label of `corral_l2_reads_total`).
pub fn l2(result: L2Read) {
    counter!("corral_l2_reads_total", "result" => result.as_str()).increment(1);
}

/// What an L2 read found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L2Read {
    /// An entry that answers.
    Hit,
    Miss,
    /// An envelope that did not decode: dropped, read as a miss.
    Corrupt,
}

impl L2Read {
    pub fn as_str(self) -> &'static str {
        match self {
            L2Read::Hit => "hit",
            L2Read::Miss => "miss",
            L2Read::Corrupt => "corrupt",
        }
    }
}

/// A fill not started because the route's or the instance's fill limit
/// was reached.
pub fn fill_refused(route: &str) {
    counter!("corral_fills_refused_total", "route" => route.to_owned()).increment(1);
}

/// An origin request corral did not make: the key was in back-off, or the
/// route's circuit was open.
pub fn origin_skipped(route: &str, reason: corral_core::Detail) {
    counter!("corral_origin_skipped_total", "route" => route.to_owned(), "reason" => reason.as_str())
        .increment(1);
}

/// An origin fetch still waiting for its answer's head after the
/// circuit's hang time: counted toward the circuit as failed until it is
/// answered.
pub fn origin_hung(route: &str) {
    counter!("corral_origin_hung_fetches_total", "route" => route.to_owned()).increment(1);
}

/// An origin's body that did not match the digest its answer claimed
/// (`field`: `content-digest` or `repr-digest`): not stored, not shared.
pub fn digest_mismatch(route: &str, field: &'static str) {
    counter!("corral_digest_mismatches_total", "route" => route.to_owned(), "field" => field)
        .increment(1);
}

/// A streamed answer without a declared length that could not be stored
/// (`reason`: `too-large` past the object size, `fill-memory` past
/// `cache.fill_memory`), passed through to the readers already reading.
pub fn stream_passed_through(route: &str, reason: &'static str) {
    counter!("corral_streams_passed_through_total", "route" => route.to_owned(), "reason" => reason)
        .increment(1);
}

/// Readers of a passing-through answer cut off for holding the others
/// back (and the memory held for them) past their patience.
pub fn stream_readers_cut(route: &str, n: usize) {
    counter!("corral_stream_readers_cut_total", "route" => route.to_owned()).increment(n as u64);
}

/// An answer compressed in `coding` when it was stored: its bytes before
/// and after.
pub fn compressed(route: &str, coding: &'static str, before: usize, after: usize) {
    counter!("corral_compression_bytes_in_total", "route" => route.to_owned(), "coding" => coding)
        .increment(before as u64);
    counter!("corral_compression_bytes_out_total", "route" => route.to_owned(), "coding" => coding)
        .increment(after as u64);
}

/// Time spent compressing one stored answer (every coding of it).
pub fn compression_time(route: &str, took: Duration) {
    histogram!("corral_compression_duration_seconds", "route" => route.to_owned())
        .record(took.as_secs_f64());
}

/// The CPU pool's size (`server.cpu_threads`).
pub fn cpu_threads(n: usize) {
    gauge!("corral_cpu_threads").set(n as f64);
}

/// A CPU pool slot taken (`1.0`) or given back (`-1.0`).
pub fn cpu_busy(delta: f64) {
    gauge!("corral_cpu_busy").increment(delta);
}

/// A job began (`1.0`) or ended (`-1.0`) its wait for a CPU pool slot.
pub fn cpu_queued(delta: f64) {
    gauge!("corral_cpu_queued").increment(delta);
}

/// A CPU job, and how it ran (pool, saturated, inline).
pub fn cpu_job(job: &'static str, ran: &'static str) {
    counter!("corral_cpu_jobs_total", "job" => job, "result" => ran).increment(1);
}

/// Time a CPU job ran.
pub fn cpu_time(job: &'static str, took: Duration) {
    histogram!("corral_cpu_job_duration_seconds", "job" => job).record(took.as_secs_f64());
}

/// A coding made for a stored answer on a caller's first demand.
pub fn coding_on_demand(route: &str, coding: &'static str) {
    counter!("corral_codings_made_on_demand_total", "route" => route.to_owned(), "coding" => coding)
        .increment(1);
}

/// A coding of a stored answer read from Redis, made by another instance
/// for the same body.
pub fn coding_from_l2(route: &str, coding: &'static str) {
    counter!("corral_codings_from_l2_total", "route" => route.to_owned(), "coding" => coding)
        .increment(1);
}

/// An entry of `route` was stored with `variants` representations: the
/// unencoded one and each coding it is kept in (Accept-Encoding selects
/// among them; on a compressing route it never splits the key).
pub fn variants_per_key(route: &str, variants: usize) {
    histogram!("corral_variants_per_key", "route" => route.to_owned()).record(variants as f64);
}

/// A caller turned away because the key's flight had `max_waiters`
/// callers waiting.
pub fn wait_list_full(route: &str) {
    counter!("corral_wait_list_full_total", "route" => route.to_owned()).increment(1);
}

/// Whether corral sheds new work (`server.overload`): 1 while it does.
pub fn overloaded(on: bool) {
    gauge!("corral_overloaded").set(if on { 1.0 } else { 0.0 });
}

/// The share of the last tick the serving threads were busy (0 to 1).
pub fn overload_busy(share: f64) {
    gauge!("corral_overload_busy_ratio").set(share);
}

/// New work turned away while overloaded: `pass` (a passed-through
/// request answered 503) or `connection` (a connection accepted only to
/// answer 503).
pub fn overload_shed(what: &'static str) {
    counter!("corral_overload_shed_total", "what" => what).increment(1);
}

/// A fill cancelled because its client went away and nobody else waited.
pub fn fill_cancelled(route: &str) {
    counter!("corral_fills_cancelled_total", "route" => route.to_owned()).increment(1);
}

thread_local! {
    /// `per_core`: this worker thread's accepted-connections counter.
    static WORKER_ACCEPTS: std::cell::RefCell<Option<metrics::Counter>> =
        const { std::cell::RefCell::new(None) };
}

/// `per_core`: the calling thread is worker `worker`; the connections it
/// accepts are counted in `corral_worker_connections_total{worker}`
/// (registered at 0 here).
pub fn worker_started(worker: usize) {
    let c = counter!("corral_worker_connections_total", "worker" => worker.to_string());
    c.increment(0);
    WORKER_ACCEPTS.with(|w| *w.borrow_mut() = Some(c));
}

/// A client connection accepted (counted per worker with `per_core`).
pub fn connection_accepted() {
    WORKER_ACCEPTS.with(|w| {
        if let Some(c) = &*w.borrow() {
            c.increment(1);
        }
    });
}

/// An interim (1xx) answer of the origin passed on to the client.
pub fn interim_forwarded(status: u16) {
    counter!("corral_interim_responses_total", "status" => status.to_string()).increment(1);
}

/// A connection corral closed for a reason of its own (a deadline, abuse).
pub fn connection_closed(reason: &'static str) {
    counter!("corral_connections_closed_total", "reason" => reason).increment(1);
}

/// A stale answer: revalidate (SWR), error (SIE), timeout (lock timeout),
/// backoff (the origin is being left alone), fill-limit.
pub fn stale(why: corral_core::Detail) {
    counter!("corral_stale_answers_total", "reason" => why.stale_reason()).increment(1);
}

/// Point-in-time state, sampled by whoever renders (the admin listener),
/// so that telemetry reads no other layer.
pub struct Gauges {
    pub l1_entries: u64,
    pub l1_bytes: u64,
    pub l1_side_bytes: u64,
    /// What L1's entries may weigh in all (`cache.memory` less the side
    /// tables' share).
    pub l1_limit_bytes: u64,
    pub fill_buffer_bytes: u64,
    /// `cache.fill_memory`.
    pub fill_memory_limit_bytes: u64,
    pub post_buffer_bytes: u64,
    pub ahead_buffer_bytes: u64,
    pub backoff_keys: usize,
    /// Each route's name and whether its origin circuit is open.
    pub circuits: Vec<(String, bool)>,
    pub sealed_bodies: usize,
    pub sealed_bytes: usize,
    pub flights: usize,
    /// With Redis: breaker open, times it opened, connected.
    pub redis: Option<(bool, u64, bool)>,
}

/// The exposition text: the recorded metrics and the gauges. No label
/// value in it is a key or a request path.
pub fn render(handle: &PrometheusHandle, g: &Gauges) -> String {
    gauge!("corral_l1_entries").set(g.l1_entries as f64);
    gauge!("corral_l1_bytes").set(g.l1_bytes as f64);
    gauge!("corral_l1_side_bytes").set(g.l1_side_bytes as f64);
    gauge!("corral_l1_limit_bytes").set(g.l1_limit_bytes as f64);
    gauge!("corral_fill_buffer_bytes").set(g.fill_buffer_bytes as f64);
    gauge!("corral_fill_memory_limit_bytes").set(g.fill_memory_limit_bytes as f64);
    gauge!("corral_post_buffer_bytes").set(g.post_buffer_bytes as f64);
    gauge!("corral_ahead_buffer_bytes").set(g.ahead_buffer_bytes as f64);
    gauge!("corral_origin_backoff_keys").set(g.backoff_keys as f64);
    for (route, open) in &g.circuits {
        gauge!("corral_origin_circuit_open", "route" => route.clone()).set(if *open {
            1.0
        } else {
            0.0
        });
    }
    gauge!("corral_sealed_bodies").set(g.sealed_bodies as f64);
    gauge!("corral_sealed_bytes").set(g.sealed_bytes as f64);
    counter!("corral_log_lines_dropped_total")
        .absolute(crate::telemetry::log_sink::dropped_total());
    gauge!("corral_flights_in_progress").set(g.flights as f64);
    if let Some((state, opened, connected)) = g.redis {
        gauge!("corral_redis_breaker_open").set(if state { 1.0 } else { 0.0 });
        counter!("corral_redis_breaker_opened_total").absolute(opened);
        gauge!("corral_redis_connected").set(if connected { 1.0 } else { 0.0 });
    }
    handle.run_upkeep();
    let mut out = handle.render();
    process_metrics(&mut out);
    out
}

/// The keys whose flights had the most followers, most first, with how
/// many (for `/stats`; see [`TOP`]).
pub fn most_waited() -> Vec<(String, usize)> {
    let mut top = TOP.lock().unwrap_or_else(PoisonError::into_inner).clone();
    top.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    top
}

/// How a rate-limit check ended, and who counted it.
pub const LIMIT_OUTCOMES: [(&str, &str); 5] = [
    ("allowed", "shared"),
    ("limited", "shared"),
    ("allowed", "local"),
    ("limited", "local"),
    ("refused", "unavailable"),
];

/// One counter per outcome of one limit, registered with the route:
/// `corral_rate_limit_total{route, limit, outcome, counter}`. `counter` is
/// `shared` (Redis), `local` (this process: no Redis, or the fallback while
/// Redis is out of reach), or `unavailable` (refused because the shared
/// counter could not be reached and the limit says `on_redis_down: refuse`).
pub fn rate_limit_counters(route: &str, limit: &str) -> Vec<metrics::Counter> {
    LIMIT_OUTCOMES
        .iter()
        .map(|(outcome, by)| {
            let c = counter!(
                "corral_rate_limit_total",
                "route" => route.to_owned(),
                "limit" => limit.to_owned(),
                "outcome" => *outcome,
                "counter" => *by
            );
            c.increment(0);
            c
        })
        .collect()
}

/// Requests that waited for, took, or gave up on an `upstream_concurrency`
/// slot: `corral_upstream_slots_total{route, outcome}` with outcome
/// `shared`, `local` (taken from the local fallback) or `timeout`.
pub fn upstream_slot(route: &str, outcome: &'static str) {
    counter!("corral_upstream_slots_total", "route" => route.to_owned(), "outcome" => outcome)
        .increment(1);
}

/// Whether one server of a route's pool is in use (1) or left out after
/// failures (0): `corral_upstream_server_up{route,server}`.
pub fn upstream_server_up(route: &str, server: &str) -> metrics::Gauge {
    gauge!("corral_upstream_server_up", "route" => route.to_owned(), "server" => server.to_owned())
}

/// The process's own figures, in the names Prometheus' client libraries
/// use (`process_*`): CPU seconds, resident and virtual memory, open and
/// allowed descriptors, start time. Read from `/proc` at each scrape;
/// where it cannot be read (not Linux), they are left out.
fn process_metrics(out: &mut String) {
    use std::fmt::Write;
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return;
    };
    // Fields after the command name, which is in parentheses and may
    // hold spaces: state is field 3, so utime (14) is index 11 here.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
    // /proc counts CPU time in USER_HZ ticks, 100 a second on Linux
    // whatever the kernel's own tick rate (a fixed user-visible ABI).
    let ticks = 100.0;
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok())
            .map(|v| v * 1024.0)
    };
    let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("btime "))
            .and_then(|v| v.trim().parse::<f64>().ok())
    });
    let mut family = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = write!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"
        );
    };
    if let (Some(utime), Some(stime)) = (field(11), field(12)) {
        family(
            "process_cpu_seconds_total",
            "counter",
            "Total user and system CPU time spent in seconds.",
            (utime + stime) / ticks,
        );
    }
    if let Some(rss) = kib("VmRSS:") {
        family(
            "process_resident_memory_bytes",
            "gauge",
            "Resident memory size in bytes.",
            rss,
        );
    }
    if let Some(vsize) = field(20) {
        family(
            "process_virtual_memory_bytes",
            "gauge",
            "Virtual memory size in bytes.",
            vsize,
        );
    }
    if let (Some(start), Some(boot)) = (field(19), boot) {
        family(
            "process_start_time_seconds",
            "gauge",
            "Start time of the process since unix epoch in seconds.",
            boot + start / ticks,
        );
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        family(
            "process_open_fds",
            "gauge",
            "Number of open file descriptors.",
            fds.count() as f64,
        );
    }
    let max = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|l| {
            l.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3))
                .and_then(|v| v.parse::<f64>().ok())
        });
    if let Some(max) = max {
        family(
            "process_max_fds",
            "gauge",
            "Maximum number of open file descriptors.",
            max,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_keys_stay_bounded_and_keep_the_largest() {
        for i in 0..50 {
            flight_waiters(&format!("k{i}"), i);
        }
        let top = TOP.lock().unwrap_or_else(PoisonError::into_inner);
        assert_eq!(top.len(), TOP_KEYS);
        assert!(top.iter().all(|(_, w)| *w >= 40), "{top:?}");
    }
}
