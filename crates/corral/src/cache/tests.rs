//! The miss path's layers driven through their seams: a scripted
//! transport under the real exchange (so storing, stale-if-error, 304s and
//! streaming are the production code's), an in-memory shared tier and a
//! paused clock. No socket, no Redis, no sleep: tokio's paused time jumps
//! to the next timer, so a 5 s lock timeout or a lease that expires after
//! 2 s takes no real time, and every transition (the ones only real
//! failures reach end to end included) is asserted by what the origin and
//! the tier saw. Most tests enter at the top (`lookup::serve`); the last
//! ones drive a suffix of the layers (the gate, the exchange) directly.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use corral_core::semantics::head::{RequestBody, RequestHead};
use corral_core::{
    Backoff, Clock, Decision, Detail, Digest, Identity, PausedClock, PrimaryKey, StoredResponse,
    UriKey, Vary,
};
use futures_util::future::BoxFuture;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::sync::broadcast;
use tokio::time::Instant;

use crate::app::App;
use crate::cache::fill::{Ended, Events, FillEvent, FillOutcome, FillRequest};
use crate::cache::respond::CACHE_STATUS;
use crate::cache::{exchange, gate, lookup};
use crate::cluster::protocol::{FillNotice, Keys, Layout};
use crate::cluster::redis_link::L2Error;
use crate::cluster::tier::{HeldLease, Notices, Probe, SharedTier};
use crate::origin::exchange::{Held, Transport};
use crate::origin::upstream::{OriginBody, UpstreamError};
use crate::routes::Route;

// ---------------------------------------------------------------------
// The origin: answers from a script, counts what reached it.

#[derive(Debug, Clone, Copy)]
enum Reply {
    /// 200 with this Cache-Control and body.
    Ok(&'static str, &'static str),
    /// 503 with this Cache-Control.
    Unavailable(&'static str),
    /// 304 with this Cache-Control (the stale copy is still good).
    NotModified(&'static str),
    /// Connection refused.
    Unreachable,
    /// 500 without Cache-Control: the application failed this request.
    AppError,
}

/// The origin, as the transport under the real exchange reaches it: every
/// request that reached it is counted and kept; its answers come from the
/// script, each `takes` after the request (the head and body at once), or
/// with `head_first`, the head at once and the body `takes` later.
struct ScriptedOrigin {
    script: Mutex<VecDeque<Reply>>,
    /// What every request gets once the script has run out.
    then: Reply,
    /// How long each exchange takes (paused time).
    takes: Duration,
    head_first: bool,
    hits: AtomicUsize,
    /// The heads of the requests that reached it.
    asked: Mutex<Vec<http::request::Parts>>,
}

impl ScriptedOrigin {
    fn new(then: Reply, takes: Duration) -> Arc<Self> {
        Self::scripted(&[], then, takes)
    }

    fn scripted(first: &[Reply], then: Reply, takes: Duration) -> Arc<Self> {
        Arc::new(ScriptedOrigin {
            script: Mutex::new(first.iter().copied().collect()),
            then,
            takes,
            head_first: false,
            hits: AtomicUsize::new(0),
            asked: Mutex::new(Vec::new()),
        })
    }

    /// Answers with the head at once and the body after `takes`.
    fn head_first(then: Reply, takes: Duration) -> Arc<Self> {
        let mut origin = Arc::into_inner(Self::new(then, takes)).expect("just made");
        origin.head_first = true;
        Arc::new(origin)
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    /// The head of the `n`th request that reached it.
    fn asked(&self, n: usize) -> http::request::Parts {
        self.asked.lock().expect("not poisoned")[n].clone()
    }

    async fn answer(
        &self,
        req: Request<axum::body::Body>,
        slot: Option<crate::origin::slots::Slot>,
    ) -> Result<Response<OriginBody>, UpstreamError> {
        self.hits.fetch_add(1, Ordering::SeqCst);
        self.asked
            .lock()
            .expect("not poisoned")
            .push(req.into_parts().0);
        let reply = self
            .script
            .lock()
            .expect("not poisoned")
            .pop_front()
            .unwrap_or(self.then);
        if !self.head_first {
            tokio::time::sleep(self.takes).await;
        }
        let (status, cache_control, body) = match reply {
            Reply::Ok(cc, body) => (StatusCode::OK, cc, body),
            Reply::Unavailable(cc) => (StatusCode::SERVICE_UNAVAILABLE, cc, "down"),
            Reply::NotModified(cc) => (StatusCode::NOT_MODIFIED, cc, ""),
            Reply::AppError => (StatusCode::INTERNAL_SERVER_ERROR, "", "oops"),
            Reply::Unreachable => {
                return Err(UpstreamError::Connect("connection refused".into()));
            }
        };
        let delay = if self.head_first {
            self.takes
        } else {
            Duration::ZERO
        };
        let stream = futures_util::stream::once(async move {
            tokio::time::sleep(delay).await;
            Ok::<_, std::io::Error>(Bytes::from_static(body.as_bytes()))
        });
        let mut response = Response::new(OriginBody::other(
            axum::body::Body::from_stream(stream),
            slot,
        ));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            http::header::CACHE_CONTROL,
            HeaderValue::from_static(cache_control),
        );
        // Compressible where a route compresses (no other test reads it).
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if status != StatusCode::NOT_MODIFIED {
            headers.insert(http::header::CONTENT_LENGTH, HeaderValue::from(body.len()));
            headers.insert(http::header::ETAG, HeaderValue::from_static("\"v\""));
        }
        Ok(response)
    }
}

impl Transport for ScriptedOrigin {
    fn send<'a>(
        &'a self,
        _upstream: &'a crate::origin::upstream::Upstream,
        req: Request<axum::body::Body>,
        _retryable: bool,
        _deadline: Instant,
        held: Held,
    ) -> BoxFuture<'a, Result<Response<OriginBody>, UpstreamError>> {
        Box::pin(self.answer(req, held.slot))
    }
}

// ---------------------------------------------------------------------
// The shared tier: Redis's records of each variant, in memory.

struct Lease {
    token: u64,
    until: Instant,
    /// When it was taken, on the tier's clock (tokio's: Redis's clock
    /// in this fake, which no instance's wall clock is compared with).
    taken: Instant,
}

impl Lease {
    fn value(&self) -> String {
        format!("{:032x}", self.token)
    }
}

#[derive(Default)]
struct Records {
    entries: HashMap<String, StoredResponse>,
    passes: HashSet<String>,
    leases: HashMap<String, Lease>,
    backoffs: HashMap<String, Backoff>,
    generation: u64,
    published: Vec<FillNotice>,
    stores: usize,
}

struct Tier {
    layout: Layout,
    records: Mutex<Records>,
    notices: broadcast::Sender<FillNotice>,
    /// Every call fails, as when Redis is unreachable.
    down: AtomicBool,
    /// Only taking the lease fails (a slow SET NX).
    acquire_fails: AtomicBool,
    /// Only writing an entry fails (a write that timed out).
    write_fails: AtomicBool,
    /// Written into the entry key when the lease is granted: the previous
    /// leader's store landing between this fill's read and its lease.
    lands_on_acquire: Mutex<Option<StoredResponse>>,
    probes: AtomicUsize,
    acquired: AtomicUsize,
    taken_over: AtomicUsize,
    tokens: AtomicU64,
    /// The largest body `store` writes (`l2_max_object_size`).
    max_object: AtomicU64,
}

#[derive(Clone)]
struct FakeTier(Arc<Tier>);

impl FakeTier {
    fn new() -> Self {
        FakeTier(Arc::new(Tier {
            layout: Layout::new("t"),
            records: Mutex::new(Records::default()),
            notices: broadcast::channel(16).0,
            down: AtomicBool::new(false),
            acquire_fails: AtomicBool::new(false),
            write_fails: AtomicBool::new(false),
            lands_on_acquire: Mutex::new(None),
            probes: AtomicUsize::new(0),
            acquired: AtomicUsize::new(0),
            taken_over: AtomicUsize::new(0),
            tokens: AtomicU64::new(1),
            max_object: AtomicU64::new(u64::MAX),
        }))
    }

    fn records(&self) -> std::sync::MutexGuard<'_, Records> {
        self.0.records.lock().expect("not poisoned")
    }

    /// The back-off record L2 holds for `keys`.
    fn backoff(&self, keys: &Keys) -> Option<Backoff> {
        self.records().backoffs.get(&keys.backoff()).copied()
    }

    fn failing(&self) -> Result<(), L2Error> {
        if self.0.down.load(Ordering::SeqCst) {
            Err(L2Error::NotConnected)
        } else {
            Ok(())
        }
    }

    fn published(&self) -> Vec<FillNotice> {
        self.records().published.clone()
    }

    /// Another instance took the variant's lease `held` ago, for `ttl`.
    fn other_leads(&self, keys: &Keys, ttl: Duration, held: Duration) {
        self.records().leases.insert(
            keys.lease(),
            Lease {
                token: 0,
                until: Instant::now() + ttl,
                taken: Instant::now() - held,
            },
        );
    }

    /// That instance's fill ends: its record, its release, its notice.
    fn other_ends(&self, keys: &Keys, entry: Option<StoredResponse>, notice: Option<FillNotice>) {
        let mut r = self.records();
        if let Some(e) = entry {
            r.entries.insert(keys.entry(), e);
        }
        r.leases.remove(&keys.lease());
        drop(r);
        if let Some(n) = notice {
            let _ = self.0.notices.send(n);
        }
    }
}

struct FakeLease {
    tier: FakeTier,
    key: String,
    token: u64,
}

impl HeldLease for FakeLease {
    fn keep_alive(&self) -> Box<dyn Send> {
        if let Some(l) = self.tier.records().leases.get_mut(&self.key) {
            l.until = Instant::now() + Duration::from_secs(3600);
        }
        Box::new(())
    }
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<bool, L2Error>> {
        Box::pin(async move {
            self.tier.failing()?;
            let mut r = self.tier.records();
            let mine = r
                .leases
                .get(&self.key)
                .is_some_and(|l| l.token == self.token);
            if mine {
                r.leases.remove(&self.key);
            }
            Ok(mine)
        })
    }
    fn name(&self) -> &str {
        &self.key
    }
}

struct FakeNotices(broadcast::Receiver<FillNotice>);

impl Notices for FakeNotices {
    fn next(&mut self) -> BoxFuture<'_, Option<FillNotice>> {
        Box::pin(async move {
            loop {
                match self.0.recv().await {
                    Ok(n) => return Some(n),
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        })
    }
}

impl SharedTier for FakeTier {
    fn lease_window(&self) -> Duration {
        Duration::from_secs(1)
    }
    fn keys(&self, primary: &PrimaryKey, variant: Digest, identity: Option<&Identity>) -> Keys {
        self.0.layout.keys(primary, variant, identity)
    }
    fn max_object_size(&self) -> u64 {
        self.0.max_object.load(Ordering::SeqCst)
    }
    fn probe<'a>(&'a self, keys: &'a Keys, _stamp: u64) -> BoxFuture<'a, Result<Probe, L2Error>> {
        Box::pin(async move {
            self.0.probes.fetch_add(1, Ordering::SeqCst);
            self.failing()?;
            let r = self.records();
            Ok(Probe {
                entry: r.entries.get(&keys.entry()).cloned(),
                vary: None,
                pass: r.passes.contains(&keys.pass()),
                lease_held: r
                    .leases
                    .get(&keys.lease())
                    .is_some_and(|l| l.until > Instant::now()),
                lease: r
                    .leases
                    .get(&keys.lease())
                    .filter(|l| l.until > Instant::now())
                    .map(Lease::value),
                generation: r.generation,
                backoff: r.backoffs.get(&keys.backoff()).copied(),
            })
        })
    }
    fn acquire<'a>(
        &'a self,
        keys: &'a Keys,
    ) -> BoxFuture<'a, Result<Option<Box<dyn HeldLease>>, L2Error>> {
        Box::pin(async move {
            self.failing()?;
            if self.0.acquire_fails.load(Ordering::SeqCst) {
                return Err(L2Error::Timeout(Duration::from_millis(250)));
            }
            let mut r = self.records();
            if r.leases
                .get(&keys.lease())
                .is_some_and(|l| l.until > Instant::now())
            {
                return Ok(None);
            }
            let token = self.0.tokens.fetch_add(1, Ordering::SeqCst);
            r.leases.insert(
                keys.lease(),
                Lease {
                    token,
                    until: Instant::now() + Duration::from_secs(30),
                    taken: Instant::now(),
                },
            );
            if let Some(e) = self.0.lands_on_acquire.lock().expect("not poisoned").take() {
                r.entries.insert(keys.entry(), e);
            }
            self.0.acquired.fetch_add(1, Ordering::SeqCst);
            Ok(Some(Box::new(FakeLease {
                tier: self.clone(),
                key: keys.lease(),
                token,
            }) as Box<dyn HeldLease>))
        })
    }
    fn lease_age<'a>(
        &'a self,
        keys: &'a Keys,
    ) -> BoxFuture<'a, Result<Option<(String, Duration)>, L2Error>> {
        Box::pin(async move {
            self.failing()?;
            Ok(self
                .records()
                .leases
                .get(&keys.lease())
                .filter(|l| l.until > Instant::now())
                .map(|l| (l.value(), l.taken.elapsed())))
        })
    }
    fn take_over<'a>(
        &'a self,
        keys: &'a Keys,
        seen: &'a str,
    ) -> BoxFuture<'a, Result<Option<Box<dyn HeldLease>>, L2Error>> {
        Box::pin(async move {
            self.failing()?;
            let mut r = self.records();
            let current = r.leases.get(&keys.lease()).map(Lease::value);
            if current.as_deref() != Some(seen) {
                return Ok(None);
            }
            let token = self.0.tokens.fetch_add(1, Ordering::SeqCst);
            r.leases.insert(
                keys.lease(),
                Lease {
                    token,
                    until: Instant::now() + Duration::from_secs(30),
                    taken: Instant::now(),
                },
            );
            self.0.taken_over.fetch_add(1, Ordering::SeqCst);
            Ok(Some(Box::new(FakeLease {
                tier: self.clone(),
                key: keys.lease(),
                token,
            }) as Box<dyn HeldLease>))
        })
    }
    fn watch<'a>(&'a self, _keys: &'a Keys) -> BoxFuture<'a, Box<dyn Notices>> {
        Box::pin(
            async move { Box::new(FakeNotices(self.0.notices.subscribe())) as Box<dyn Notices> },
        )
    }
    fn write_entry<'a>(
        &'a self,
        keys: &'a Keys,
        entry: &'a StoredResponse,
        generation: u64,
        _now: SystemTime,
    ) -> BoxFuture<'a, Result<bool, L2Error>> {
        Box::pin(async move {
            self.failing()?;
            if self.0.write_fails.load(Ordering::SeqCst) {
                return Err(L2Error::NotConnected);
            }
            if entry.body().len() as u64 > self.max_object_size() {
                return Ok(false);
            }
            let mut r = self.records();
            if r.generation != generation {
                return Ok(false);
            }
            r.entries.insert(keys.entry(), entry.clone());
            r.stores += 1;
            Ok(true)
        })
    }
    fn write_pass<'a>(
        &'a self,
        keys: &'a Keys,
        _duration: Duration,
    ) -> BoxFuture<'a, Result<(), L2Error>> {
        Box::pin(async move {
            self.failing()?;
            self.records().passes.insert(keys.pass());
            Ok(())
        })
    }
    fn write_backoff<'a>(
        &'a self,
        keys: &'a Keys,
        backoff: &'a Backoff,
        _keep: Duration,
        _now: SystemTime,
    ) -> BoxFuture<'a, Result<(), L2Error>> {
        Box::pin(async move {
            self.failing()?;
            self.records().backoffs.insert(keys.backoff(), *backoff);
            Ok(())
        })
    }
    fn invalidate<'a>(
        &'a self,
        primaries: &'a [PrimaryKey],
        _uri: &'a UriKey,
    ) -> BoxFuture<'a, Result<(), L2Error>> {
        Box::pin(async move {
            self.failing()?;
            let mut r = self.records();
            r.generation += primaries.len() as u64;
            r.entries.clear();
            Ok(())
        })
    }
    fn publish_ban<'a>(&'a self, _ban: &'a corral_core::Ban) -> BoxFuture<'a, Result<(), L2Error>> {
        Box::pin(async move { self.failing() })
    }
    fn delete_backoff<'a>(&'a self, keys: &'a Keys) -> BoxFuture<'a, Result<(), L2Error>> {
        Box::pin(async move {
            self.failing()?;
            self.records().backoffs.remove(&keys.backoff());
            Ok(())
        })
    }
    fn publish<'a>(
        &'a self,
        _keys: &'a Keys,
        notice: FillNotice,
    ) -> BoxFuture<'a, Result<(), L2Error>> {
        Box::pin(async move {
            self.failing()?;
            self.records().published.push(notice);
            let _ = self.0.notices.send(notice);
            Ok(())
        })
    }
}

// ---------------------------------------------------------------------
// The harness: an App with those seams, requests, answers.

struct Harness {
    app: Arc<App>,
    origin: Arc<ScriptedOrigin>,
    tier: Option<FakeTier>,
    clock: PausedClock,
}

/// `route` is YAML added under the one route (indented four spaces).
fn harness(origin: Arc<ScriptedOrigin>, tier: Option<FakeTier>, route: &str) -> Harness {
    harness_with(origin, tier, "", route)
}

/// [`harness`], with `top` (YAML sections, e.g. `server:`) added.
fn harness_with(
    origin: Arc<ScriptedOrigin>,
    tier: Option<FakeTier>,
    top: &str,
    route: &str,
) -> Harness {
    let text = format!(
        "\
listen: 127.0.0.1:8080
admin: 127.0.0.1:9080
{top}cache:
  memory: 64MiB
routes:
  - name: api
    upstream: http://127.0.0.1:9
{route}"
    );
    let config = crate::config::parse("unit.yaml", &text).unwrap_or_else(|e| panic!("{e}"));
    let clock = PausedClock::new();
    let app = App::with_seams(
        &config,
        Arc::clone(&origin) as Arc<dyn Transport>,
        tier.clone().map(|t| Arc::new(t) as Arc<dyn SharedTier>),
        Arc::new(clock),
    );
    Harness {
        app: Arc::new(app),
        origin,
        tier,
        clock,
    }
}

struct Got {
    status: StatusCode,
    /// The Cache-Status header as sent, for messages.
    cache_status: String,
    /// What it was written from.
    cs: corral_core::CacheStatus,
    body: Bytes,
    /// Its Content-Encoding, if any.
    encoding: Option<String>,
}

/// Every answer is the 503 of a key in back-off, made without the origin.
fn assert_backed_off(answers: &[Got]) {
    for a in answers {
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(a.cs.detail == Some(Detail::Backoff), "{}", a.cache_status);
    }
}

impl Harness {
    fn head(&self, path: &str) -> RequestHead {
        self.head_with(path, &[])
    }

    /// A GET of `path` with these header fields besides Host.
    fn head_with(&self, path: &str, fields: &[(&str, &str)]) -> RequestHead {
        self.head_from(path, fields, [127, 0, 0, 1].into())
    }

    /// A GET of `path` with these header fields, from `client`.
    fn head_from(
        &self,
        path: &str,
        fields: &[(&str, &str)],
        client: std::net::IpAddr,
    ) -> RequestHead {
        let mut request = Request::get(path).header("host", "api.test");
        for (name, value) in fields {
            request = request.header(*name, *value);
        }
        let (mut parts, ()) = request.body(()).expect("unit-test setup").into_parts();
        RequestHead::parse(&mut parts, client, RequestBody::None).expect("unit-test setup")
    }

    /// The route `path` on `api.test` takes.
    fn route(&self, path: &str) -> Arc<Route> {
        Arc::clone(
            self.app
                .routes()
                .find("api.test", path)
                .expect("unit-test setup"),
        )
    }

    async fn get(&self, path: &str) -> Got {
        self.get_with(path, &[]).await
    }

    async fn get_with(&self, path: &str, fields: &[(&str, &str)]) -> Got {
        self.get_head(path, self.head_with(path, fields)).await
    }

    /// A GET of `path` from the client at `client`.
    async fn get_from(&self, path: &str, client: [u8; 4]) -> Got {
        self.get_head(path, self.head_from(path, &[], client.into()))
            .await
    }

    async fn get_head(&self, path: &str, head: RequestHead) -> Got {
        let answer = lookup::serve(
            Arc::clone(&self.app.cache),
            self.route(path),
            Box::new(head),
            None,
            None,
            None,
        )
        .await;
        let cs = answer.status.clone();
        let (parts, body) = answer.response.into_parts();
        Got {
            cs,
            encoding: parts
                .headers
                .get(http::header::CONTENT_ENCODING)
                .map(|v| v.to_str().expect("unit-test setup").to_owned()),
            status: parts.status,
            cache_status: parts
                .headers
                .get(&CACHE_STATUS)
                .map(|v| v.to_str().expect("unit-test setup").to_owned())
                .unwrap_or_default(),
            body: body.collect().await.expect("unit-test setup").to_bytes(),
        }
    }

    /// `n` concurrent GETs of `path`.
    async fn stampede(&self, path: &str, n: usize) -> Vec<Got> {
        let mut tasks = Vec::new();
        for _ in 0..n {
            let h = self.clone_handle();
            let path = path.to_owned();
            tasks.push(tokio::spawn(async move { h.get(&path).await }));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.expect("unit-test setup"));
        }
        out
    }

    fn clone_handle(&self) -> Harness {
        Harness {
            app: Arc::clone(&self.app),
            origin: Arc::clone(&self.origin),
            tier: self.tier.clone(),
            clock: self.clock,
        }
    }

    /// The shared tier's keys of `path`'s one variant (no Vary, anonymous).
    fn keys(&self, path: &str) -> Keys {
        let route = self.route(path);
        let uri = UriKey::new("api.test", path, None, &route.cache.query_filter);
        let primary = PrimaryKey::new(&route.name, uri);
        let variant = primary.variant(None, &Vary::None.values(&HeaderMap::new()));
        self.tier
            .as_ref()
            .expect("unit-test setup")
            .keys(&primary, variant.digest, None)
    }

    /// The fill a GET of `path` would make (no stale copy), to drive a
    /// suffix of the layers directly.
    fn fill(&self, path: &str) -> FillRequest {
        let route = self.route(path);
        let head = self.head(path);
        let uri = UriKey::new("api.test", path, None, &route.cache.query_filter);
        let primary = PrimaryKey::get(&route.name, uri, false);
        let variant = primary.variant(None, &Vary::None.values(&HeaderMap::new()));
        let job = crate::cache::fill::Job {
            head: Arc::new(head),
            keys: crate::cache::fill::FillKeys {
                primary,
                identity: None,
                variant,
            },
            stale: None,
            fwd: corral_core::Forward::UriMiss,
            body: None,
            interim: None,
        };
        FillRequest::new(Arc::clone(&self.app.cache), route, job)
    }

    /// An entry as another instance would have stored it, `age` old.
    fn entry(
        &self,
        cache_control: &'static str,
        body: &'static str,
        age: Duration,
    ) -> StoredResponse {
        let mut response = Response::new(());
        response.headers_mut().insert(
            http::header::CACHE_CONTROL,
            HeaderValue::from_static(cache_control),
        );
        let (parts, ()) = response.into_parts();
        let at = self.clock.now() - age;
        let route = self.route("/");
        let uri: http::Uri = "http://api.test/".parse().expect("unit-test setup");
        let Decision::Store { freshness } =
            route.cache.policy.evaluate(&Method::GET, &uri, &parts, at)
        else {
            panic!("{cache_control} is not storable");
        };
        StoredResponse::builder(
            StatusCode::OK,
            parts.headers,
            Bytes::from_static(body.as_bytes()),
            &freshness,
            at,
        )
        .build()
    }
}

const SLOW: Duration = Duration::from_millis(200);
const NO_EARLY_REFRESH: &str = "    cache: { early_refresh_beta: 0 }\n";

fn tier(h: &Harness) -> &FakeTier {
    h.tier.as_ref().expect("unit-test setup")
}

// ---------------------------------------------------------------------
// The local flight: lookup → lead or follow → answer.

#[tokio::test(start_paused = true)]
async fn a_stampede_on_a_cold_key_reaches_the_origin_once() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "one"), SLOW),
        None,
        NO_EARLY_REFRESH,
    );
    let answers = h.stampede("/a", 50).await;
    assert_eq!(h.origin.hits(), 1);
    for a in &answers {
        assert_eq!((a.status, &a.body[..]), (StatusCode::OK, &b"one"[..]));
    }
    // One leader stored it; every follower answered from the flight.
    let count = |label: &str| {
        answers
            .iter()
            .filter(|a| a.cache_status.split("; ").any(|p| p == label))
            .count()
    };
    assert_eq!((count("stored"), count("collapsed")), (1, 49));
    // Then a plain hit.
    let hit = h.get("/a").await;
    assert!(hit.cs.hit, "{}", hit.cache_status);
    assert_eq!(h.origin.hits(), 1);
}

/// A request that missed, then waited before joining the key's flight (a
/// rate limit or a rule read awaits there), finds no flight: the one it
/// would have followed ended meanwhile. It must answer from that flight's
/// copy, not lead a second fetch.
#[tokio::test(start_paused = true)]
async fn a_miss_that_joins_after_the_flight_ended_answers_from_its_copy() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "one"), SLOW),
        None,
        NO_EARLY_REFRESH,
    );
    // It looks first: nothing stored yet.
    let late = match lookup::answer_now(
        Arc::clone(&h.app.cache),
        h.route("/a"),
        Box::new(h.head("/a")),
        None,
        None,
        false,
    ) {
        Ok(_) => panic!("a cold key answered"),
        Err(missed) => missed,
    };
    // Another caller's flight fetches, stores and ends before it joins.
    let first = h.get("/a").await;
    assert!(first.cs.stored, "{}", first.cache_status);
    assert_eq!(h.origin.hits(), 1);
    let answer = late.finish(None).await;
    assert!(answer.status.hit, "{:?}", answer.status);
    let body = answer
        .response
        .into_body()
        .collect()
        .await
        .expect("unit-test setup")
        .to_bytes();
    assert_eq!(&body[..], b"one");
    assert_eq!(h.origin.hits(), 1, "a second fetch for a copy in L1");
}

#[tokio::test(start_paused = true)]
async fn coalescing_off_sends_every_caller_to_the_origin() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "one"), SLOW),
        None,
        "    coalesce: { enabled: false }\n",
    );
    h.stampede("/a", 10).await;
    assert_eq!(h.origin.hits(), 10);
}

#[tokio::test(start_paused = true)]
async fn coalescing_off_with_a_shared_tier_takes_no_lease() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "one"), SLOW),
        Some(FakeTier::new()),
        "    coalesce: { enabled: false }\n",
    );
    h.stampede("/a", 10).await;
    assert_eq!(h.origin.hits(), 10);
    assert_eq!(tier(&h).0.acquired.load(Ordering::SeqCst), 0);
    // Each still writes L2 (a cache for it), and nobody is notified.
    assert_eq!(tier(&h).records().stores, 10);
    assert_eq!(tier(&h).published(), vec![]);
}

#[tokio::test(start_paused = true)]
async fn a_follower_past_lock_timeout_does_what_on_timeout_says() {
    // The leader's exchange takes 10 s; followers wait 1 s.
    for (on_timeout, status, hits) in [
        ("error", StatusCode::GATEWAY_TIMEOUT, 1),
        ("fetch", StatusCode::OK, 2),
        ("fetch_each", StatusCode::OK, 2),
    ] {
        let h = harness(
            ScriptedOrigin::new(Reply::Ok("max-age=60", "slow"), Duration::from_secs(10)),
            None,
            &format!("    coalesce: {{ lock_timeout: 1s, on_timeout: {on_timeout} }}\n"),
        );
        let leader = {
            let h = h.clone_handle();
            tokio::spawn(async move { h.get("/a").await })
        };
        tokio::task::yield_now().await;
        let started = Instant::now();
        let follower = h.get("/a").await;
        assert_eq!(follower.status, status, "on_timeout: {on_timeout}");
        if on_timeout == "error" {
            assert!(
                follower.cs.detail == Some(Detail::LockTimeout),
                "{}",
                follower.cache_status
            );
            assert_eq!(started.elapsed(), Duration::from_secs(1));
        }
        assert_eq!(
            leader.await.expect("unit-test setup").status,
            StatusCode::OK
        );
        assert_eq!(h.origin.hits(), hits, "on_timeout: {on_timeout}");
    }
}

#[tokio::test(start_paused = true)]
async fn stale_while_revalidate_answers_at_once_and_refreshes_once() {
    let h = harness(
        ScriptedOrigin::scripted(
            &[Reply::Ok("max-age=1, stale-while-revalidate=60", "v1")],
            Reply::Ok("max-age=1, stale-while-revalidate=60", "v2"),
            SLOW,
        ),
        None,
        NO_EARLY_REFRESH,
    );
    assert_eq!(h.get("/a").await.body, "v1");
    tokio::time::advance(Duration::from_secs(5)).await;
    let answers = h.stampede("/a", 20).await;
    for a in &answers {
        assert_eq!(a.body, "v1");
        assert!(
            a.cs.detail == Some(Detail::StaleWhileRevalidate),
            "{}",
            a.cache_status
        );
    }
    // One background refresh, under way: the operator's views name it.
    let under_way = h.app.cache.flights.busiest(10);
    let names: Vec<&str> = under_way.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["api GET api.test/a"]);
    // Finished in paused time.
    tokio::time::sleep(SLOW * 2).await;
    assert_eq!(h.origin.hits(), 2);
    assert_eq!(h.get("/a").await.body, "v2");
}

#[tokio::test(start_paused = true)]
async fn a_slow_fill_answers_from_its_stale_copy_after_stale_after_and_stores_on() {
    let h = harness(
        ScriptedOrigin::scripted(
            &[Reply::Ok("max-age=1, stale-if-error=600", "v1")],
            Reply::Ok("max-age=60", "v2"),
            Duration::from_secs(10),
        ),
        None,
        &format!("{NO_EARLY_REFRESH}    timeouts: {{ stale_after: 2s }}\n"),
    );
    h.get("/a").await;
    tokio::time::advance(Duration::from_secs(2)).await;
    let started = Instant::now();
    let answers = h.stampede("/a", 20).await;
    // Answered from the copy at stale_after, not when the origin answers.
    assert_eq!(started.elapsed(), Duration::from_secs(2));
    for a in &answers {
        assert_eq!(a.body, "v1");
        assert!(
            a.cs.detail == Some(Detail::StaleIfError),
            "{}",
            a.cache_status
        );
    }
    // The fetch went on, and its answer is the stored one.
    tokio::time::sleep(Duration::from_secs(9)).await;
    assert_eq!(h.get("/a").await.body, "v2");
    assert_eq!(h.origin.hits(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_failing_origin_is_left_alone_while_the_key_backs_off() {
    let h = harness(
        ScriptedOrigin::scripted(
            &[Reply::Ok("max-age=1, stale-if-error=600", "v1")],
            Reply::Unreachable,
            SLOW,
        ),
        None,
        &format!("{NO_EARLY_REFRESH}    backoff: {{ min: 10s, max: 60s, after: 1 }}\n"),
    );
    h.get("/a").await;
    tokio::time::advance(Duration::from_secs(2)).await;
    // The refresh fails: stale-if-error answers, and the key backs off.
    let first = h.get("/a").await;
    assert_eq!(first.body, "v1");
    assert!(
        first.cs.detail == Some(Detail::StaleIfError),
        "{}",
        first.cache_status
    );
    assert_eq!(h.origin.hits(), 2);
    // For the back-off's 10 s, a stampede gets the stale copy and the
    // origin gets nothing.
    let answers = h.stampede("/a", 30).await;
    for a in &answers {
        assert_eq!(a.body, "v1");
        assert!(a.cs.detail == Some(Detail::Backoff), "{}", a.cache_status);
    }
    assert_eq!(h.origin.hits(), 2);
    // After it, one request tries again.
    tokio::time::advance(Duration::from_secs(11)).await;
    h.stampede("/a", 10).await;
    assert_eq!(h.origin.hits(), 3);
}

/// Hostile twin of the back-off: one client whose requests make the
/// application fail (a field outside the key it chokes on) does not put
/// the key in back-off for the next caller.
#[tokio::test(start_paused = true)]
async fn one_clients_failures_never_back_a_key_off_for_another() {
    let h = harness(
        ScriptedOrigin::new(Reply::AppError, SLOW),
        None,
        "    backoff: { min: 10s, max: 60s, after: 1 }\n",
    );
    let attacker = [192, 0, 2, 66];
    for n in 1..=3 {
        let got = h.get_from("/a", attacker).await;
        assert_eq!(got.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(h.origin.hits(), n, "each of its requests is its own");
    }
    // The victim's request reaches the origin: no back-off on its key.
    let victim = h.get_from("/a", [198, 51, 100, 7]).await;
    assert_eq!(victim.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        victim.cs.detail != Some(Detail::Backoff),
        "{}",
        victim.cache_status
    );
    assert_eq!(h.origin.hits(), 4);
    // Two callers failing is the origin's failure: now the key backs off.
    let next = h.get_from("/a", [203, 0, 113, 9]).await;
    assert_eq!(next.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        next.cs.detail == Some(Detail::Backoff),
        "{}",
        next.cache_status
    );
    assert_eq!(h.origin.hits(), 4);
}

/// A client whose requests keep failing is left to the stale copy by its
/// own back-off, so a failing origin still gets quieter, while another
/// caller's request still asks.
#[tokio::test(start_paused = true)]
async fn a_callers_own_failures_back_off_only_its_own_requests() {
    let h = harness(
        ScriptedOrigin::scripted(
            &[Reply::Ok("max-age=1, stale-if-error=600", "v1")],
            Reply::AppError,
            SLOW,
        ),
        None,
        &format!("{NO_EARLY_REFRESH}    backoff: {{ min: 10s, max: 60s }}\n"),
    );
    let hammering = [192, 0, 2, 66];
    h.get_from("/a", hammering).await;
    tokio::time::advance(Duration::from_secs(2)).await;
    for n in 2..=3 {
        let got = h.get_from("/a", hammering).await;
        assert!(
            got.cs.detail == Some(Detail::StaleIfError),
            "{}",
            got.cache_status
        );
        assert_eq!(h.origin.hits(), n);
    }
    // Its own two failures in a row: its next requests get the stale copy
    // without asking.
    for _ in 0..5 {
        let got = h.get_from("/a", hammering).await;
        assert_eq!(got.body, "v1");
        assert!(
            got.cs.detail == Some(Detail::Backoff),
            "{}",
            got.cache_status
        );
    }
    assert_eq!(h.origin.hits(), 3);
    // Another caller asks the origin, as it would alone.
    let other = h.get_from("/a", [198, 51, 100, 7]).await;
    assert!(
        other.cs.detail == Some(Detail::StaleIfError),
        "{}",
        other.cache_status
    );
    assert_eq!(h.origin.hits(), 4);
}

/// Hostile twin of the circuit: URLs that throw, each a new fill, from
/// one client, never open the route's circuit for the other callers.
#[tokio::test(start_paused = true)]
async fn urls_that_throw_never_open_the_circuit_for_other_callers() {
    let h = harness(
        ScriptedOrigin::new(Reply::AppError, SLOW),
        None,
        "    circuit: { min_fetches: 5, error_rate: 50 }\n",
    );
    for n in 0..25 {
        let got = h.get_from(&format!("/throws{n}"), [192, 0, 2, 66]).await;
        assert_eq!(got.status, StatusCode::INTERNAL_SERVER_ERROR);
    }
    assert!(!h.route("/a").origin.circuit.is_open());
    let victim = h.get_from("/a", [198, 51, 100, 7]).await;
    assert!(
        victim.cs.detail != Some(Detail::CircuitOpen),
        "{}",
        victim.cache_status
    );
    assert_eq!(h.origin.hits(), 26);
}

/// An origin that cannot be reached is everyone's failure: the circuit
/// opens whoever asked.
#[tokio::test(start_paused = true)]
async fn an_unreachable_origin_opens_the_circuit_from_one_client() {
    let h = harness(
        ScriptedOrigin::new(Reply::Unreachable, SLOW),
        None,
        "    circuit: { min_fetches: 5, error_rate: 50 }\n",
    );
    for n in 0..5 {
        h.get_from(&format!("/down{n}"), [192, 0, 2, 66]).await;
    }
    assert!(h.route("/a").origin.circuit.is_open());
    let got = h.get_from("/a", [198, 51, 100, 7]).await;
    assert!(
        got.cs.detail == Some(Detail::CircuitOpen),
        "{}",
        got.cache_status
    );
    assert_eq!(h.origin.hits(), 5);
}

#[tokio::test(start_paused = true)]
async fn by_default_one_failure_is_retried_and_the_second_in_a_row_backs_off() {
    let h = harness(
        ScriptedOrigin::new(Reply::Unreachable, SLOW),
        Some(FakeTier::new()),
        "    backoff: { min: 10s, max: 60s }\n",
    );
    let keys = h.keys("/a");
    let first = h.get("/a").await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY);
    // Every instance learns of the failure; no period has started.
    let recorded = tier(&h).backoff(&keys);
    let recorded = recorded.expect("the failure written to L2");
    assert_eq!(recorded.failures, 1);
    assert!(!recorded.active(h.clock.now()));
    // So the next caller asks the origin again,
    let second = h.get("/a").await;
    assert_eq!(second.status, StatusCode::BAD_GATEWAY);
    assert_eq!(h.origin.hits(), 2);
    let recorded = tier(&h).backoff(&keys);
    let recorded = recorded.expect("the failures written to L2");
    assert_eq!(recorded.failures, 2);
    assert!(recorded.active(h.clock.now()));
    // and after the second failure in a row nobody does.
    let answers = h.stampede("/a", 20).await;
    assert_backed_off(&answers);
    assert_eq!(h.origin.hits(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_failure_another_instance_saw_counts_toward_the_back_off() {
    let h = harness(
        ScriptedOrigin::new(Reply::Unreachable, SLOW),
        Some(FakeTier::new()),
        "    backoff: { min: 10s, max: 60s }\n",
    );
    let keys = h.keys("/a");
    let policy = h.route("/a").origin.backoff;
    let theirs = policy.after_failure(None, h.clock.now());
    assert!(!theirs.active(h.clock.now()));
    tier(&h).records().backoffs.insert(keys.backoff(), theirs);
    // This instance's first failure is the key's second in a row.
    assert_eq!(h.get("/a").await.status, StatusCode::BAD_GATEWAY);
    let recorded = tier(&h).backoff(&keys);
    assert_eq!(recorded.map(|b| b.failures), Some(2));
    let next = h.get("/a").await;
    assert_eq!(next.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        next.cs.detail == Some(Detail::Backoff),
        "{}",
        next.cache_status
    );
    assert_eq!(h.origin.hits(), 1);
}

/// Another instance's caller failing, then this instance's caller: two
/// callers, so the key backs off on every instance. This instance's own
/// caller failing again only moves its own record, and is never written
/// over the shared one.
#[tokio::test(start_paused = true)]
async fn failures_of_callers_on_two_instances_back_the_key_off() {
    let h = harness(
        ScriptedOrigin::new(Reply::AppError, SLOW),
        Some(FakeTier::new()),
        "    backoff: { min: 10s, max: 60s }\n",
    );
    let keys = h.keys("/a");
    let policy = h.route("/a").origin.backoff;
    let other = corral_core::callers::client_addr::caller_group([198, 51, 100, 7].into());
    let theirs = policy
        .after_failure_of(None, other, h.clock.now())
        .expect("counted");
    tier(&h).records().backoffs.insert(keys.backoff(), theirs);
    assert_eq!(
        h.get_from("/a", [192, 0, 2, 1]).await.status,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    let recorded = tier(&h).backoff(&keys).expect("written");
    assert_eq!(recorded.failures, 2);
    let next = h.get_from("/a", [192, 0, 2, 1]).await;
    assert!(
        next.cs.detail == Some(Detail::Backoff),
        "{}",
        next.cache_status
    );
    assert_eq!(h.origin.hits(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_fill_with_no_slot_in_lock_timeout_answers_503_without_fetching() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "slow"), Duration::from_secs(10)),
        None,
        "    coalesce: { max_fills: 1, lock_timeout: 1s }\n",
    );
    let first = {
        let h = h.clone_handle();
        tokio::spawn(async move { h.get("/a").await })
    };
    tokio::task::yield_now().await;
    let started = Instant::now();
    let second = h.get("/b").await;
    assert_eq!(second.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        second.cs.detail == Some(Detail::FillLimit),
        "{}",
        second.cache_status
    );
    assert_eq!(started.elapsed(), Duration::from_secs(1));
    assert_eq!(first.await.expect("unit-test setup").body, "slow");
    assert_eq!(h.origin.hits(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_fill_nobody_waits_for_any_more_is_cancelled() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "slow"), Duration::from_secs(30)),
        None,
        "",
    );
    let leader = {
        let h = h.clone_handle();
        tokio::spawn(async move { h.get("/a").await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!((h.origin.hits(), h.app.cache.flights.len()), (1, 1));
    // Its only client goes away: after the grace second, the fill (and
    // its flight) end instead of fetching 30 s for nobody.
    leader.abort();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(h.app.cache.flights.len(), 0);
    // Nothing was stored: long after, the next caller fetches again.
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(h.get("/a").await.body, "slow");
    assert_eq!(h.origin.hits(), 2);
}

// ---------------------------------------------------------------------
// The shared tier: L2, the lease, other instances.

#[tokio::test(start_paused = true)]
async fn the_leader_takes_the_lease_fetches_records_and_announces() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "one"), SLOW),
        Some(FakeTier::new()),
        NO_EARLY_REFRESH,
    );
    h.stampede("/a", 10).await;
    assert_eq!(h.origin.hits(), 1);
    let t = tier(&h);
    // One instance, one request to Redis's lease per key.
    assert_eq!(t.0.acquired.load(Ordering::SeqCst), 1);
    assert_eq!(t.records().stores, 1);
    assert!(t.records().leases.is_empty(), "the lease is released");
    assert_eq!(t.published(), vec![FillNotice::Stored]);
}

#[tokio::test(start_paused = true)]
async fn an_entry_in_l2_answers_without_a_lease_or_a_fetch() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "origin"), SLOW),
        Some(FakeTier::new()),
        NO_EARLY_REFRESH,
    );
    let keys = h.keys("/a");
    let entry = h.entry("max-age=60", "from-l2", Duration::from_secs(5));
    tier(&h).records().entries.insert(keys.entry(), entry);
    let got = h.get("/a").await;
    assert_eq!(got.body, "from-l2");
    assert_eq!(h.origin.hits(), 0);
    assert_eq!(tier(&h).0.acquired.load(Ordering::SeqCst), 0);
    // Now in L1: the next request does not read Redis.
    let probes = tier(&h).0.probes.load(Ordering::SeqCst);
    assert!(h.get("/a").await.cs.hit);
    assert_eq!(tier(&h).0.probes.load(Ordering::SeqCst), probes);
}

#[tokio::test(start_paused = true)]
async fn an_entry_stored_just_before_the_lease_is_served_by_the_double_check() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "origin"), SLOW),
        Some(FakeTier::new()),
        NO_EARLY_REFRESH,
    );
    let entry = h.entry("max-age=60", "previous-leader", Duration::ZERO);
    *tier(&h).0.lands_on_acquire.lock().expect("not poisoned") = Some(entry);
    assert_eq!(h.get("/a").await.body, "previous-leader");
    assert_eq!(h.origin.hits(), 0);
    assert_eq!(tier(&h).0.acquired.load(Ordering::SeqCst), 1);
    assert!(tier(&h).records().leases.is_empty(), "released unused");
    assert_eq!(tier(&h).published(), vec![]);
}

#[tokio::test(start_paused = true)]
async fn a_pass_marker_in_l2_releases_the_waiters_to_fetch_alongside() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("private", "mine"), SLOW),
        Some(FakeTier::new()),
        NO_EARLY_REFRESH,
    );
    let keys = h.keys("/a");
    tier(&h).records().passes.insert(keys.pass());
    let started = Instant::now();
    let answers = h.stampede("/a", 5).await;
    // Nobody waited for anybody: all five fetched at once.
    assert_eq!(h.origin.hits(), 5);
    assert_eq!(started.elapsed(), SLOW);
    assert!(answers.iter().all(|a| a.body == "mine"));
    assert_eq!(tier(&h).0.acquired.load(Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn an_uncacheable_answer_marks_the_key_pass_and_announces_it() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("no-store", "fresh-each-time"), SLOW),
        Some(FakeTier::new()),
        NO_EARLY_REFRESH,
    );
    let got = h.get("/a").await;
    assert_eq!(got.body, "fresh-each-time");
    assert!(
        got.cs.detail == Some(Detail::Pass(corral_core::PassReason::NoStore)),
        "{}",
        got.cache_status
    );
    let keys = h.keys("/a");
    assert!(tier(&h).records().passes.contains(&keys.pass()));
    assert_eq!(tier(&h).published(), vec![FillNotice::Pass]);
}

#[tokio::test(start_paused = true)]
async fn a_failed_fetch_records_the_back_off_for_every_instance() {
    let h = harness(
        ScriptedOrigin::new(Reply::Unreachable, SLOW),
        Some(FakeTier::new()),
        "    backoff: { min: 10s, max: 60s, after: 1 }\n",
    );
    let got = h.get("/a").await;
    assert_eq!(got.status, StatusCode::BAD_GATEWAY);
    let keys = h.keys("/a");
    let recorded = tier(&h).backoff(&keys);
    let recorded = recorded.expect("back-off written to L2");
    assert!(recorded.active(h.clock.now()));
    assert_eq!(tier(&h).published(), vec![FillNotice::Failed]);
    assert!(tier(&h).records().leases.is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_follower_serves_what_the_other_instance_announces() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "here"), SLOW),
        Some(FakeTier::new()),
        NO_EARLY_REFRESH,
    );
    let keys = h.keys("/a");
    let t = tier(&h).clone();
    t.other_leads(&keys, Duration::from_secs(30), Duration::ZERO);
    let entry = h.entry("max-age=60", "there", Duration::ZERO);
    let other = {
        let (t, keys) = (t.clone(), keys.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(700)).await;
            t.other_ends(&keys, Some(entry), Some(FillNotice::Stored));
        })
    };
    let started = Instant::now();
    let answers = h.stampede("/a", 20).await;
    other.await.expect("unit-test setup");
    assert!(answers.iter().all(|a| a.body == "there"));
    assert_eq!(h.origin.hits(), 0);
    // Woken by the notice, not by a poll.
    assert_eq!(started.elapsed(), Duration::from_millis(700));
    // One follower per instance reads Redis, and only when the notice
    // wakes it: the flight's first read and the notice's.
    let probes = t.0.probes.load(Ordering::SeqCst);
    assert_eq!(probes, 2, "probes");
}

#[tokio::test(start_paused = true)]
async fn a_live_holders_renewals_keep_a_waiter_from_reading_however_slow_its_origin() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "here"), SLOW),
        Some(FakeTier::new()),
        NO_EARLY_REFRESH,
    );
    let keys = h.keys("/a");
    let t = tier(&h).clone();
    t.other_leads(&keys, Duration::from_secs(3600), Duration::ZERO);
    let entry = h.entry("max-age=60", "there", Duration::ZERO);
    let other = {
        let (t, keys) = (t.clone(), keys.clone());
        tokio::spawn(async move {
            // A 10 s fetch, its lease renewed (and said so) every third
            // of the 1 s window.
            for _ in 0..30 {
                tokio::time::sleep(Duration::from_millis(333)).await;
                let _ = t.0.notices.send(FillNotice::Alive);
            }
            t.other_ends(&keys, Some(entry), Some(FillNotice::Stored));
        })
    };
    let answers = h.stampede("/a", 20).await;
    other.await.expect("unit-test setup");
    assert!(answers.iter().all(|a| a.body == "there"));
    assert_eq!(h.origin.hits(), 0);
    // A constant, not one read per poll over the 10 s the holder kept
    // saying it was alive (the old doubling poll made about 45).
    assert_eq!(t.0.probes.load(Ordering::SeqCst), 4, "probes");
}

#[tokio::test(start_paused = true)]
async fn a_live_lease_is_waited_on_past_lock_timeout_not_fetched_beside() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "here"), SLOW),
        Some(FakeTier::new()),
        &format!("{NO_EARLY_REFRESH}    coalesce: {{ lock_timeout: 1s }}\n"),
    );
    let keys = h.keys("/a");
    let t = tier(&h).clone();
    // Another instance's slow fetch: its lease stands (renewed) for 3 s,
    // three times this route's lock_timeout.
    t.other_leads(&keys, Duration::from_secs(3600), Duration::ZERO);
    let entry = h.entry("max-age=60", "there", Duration::ZERO);
    let other = {
        let (t, keys) = (t.clone(), keys.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(3)).await;
            t.other_ends(&keys, Some(entry), Some(FillNotice::Stored));
        })
    };
    let started = Instant::now();
    let answers = h.stampede("/a", 20).await;
    other.await.expect("unit-test setup");
    assert!(answers.iter().all(|a| a.body == "there"));
    assert_eq!(h.origin.hits(), 0, "a waiter fetched beside a live leader");
    assert_eq!(started.elapsed(), Duration::from_secs(3));
}

#[tokio::test(start_paused = true)]
async fn a_lost_notice_is_covered_by_one_read_a_window_on() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "here"), SLOW),
        Some(FakeTier::new()),
        NO_EARLY_REFRESH,
    );
    let keys = h.keys("/a");
    let t = tier(&h).clone();
    t.other_leads(&keys, Duration::from_secs(30), Duration::ZERO);
    let entry = h.entry("max-age=60", "there", Duration::ZERO);
    let (t2, k2) = (t.clone(), keys.clone());
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(400)).await;
        t2.other_ends(&k2, Some(entry), None);
    });
    let started = Instant::now();
    assert_eq!(h.get("/a").await.body, "there");
    assert_eq!(h.origin.hits(), 0);
    // Nothing heard for the 1 s lease window: one read, which serves.
    assert_eq!(started.elapsed(), Duration::from_secs(1));
    assert_eq!(t.0.probes.load(Ordering::SeqCst), 2, "probes");
}

#[tokio::test(start_paused = true)]
async fn a_dead_holders_lease_is_taken_over_when_it_expires() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "here"), SLOW),
        Some(FakeTier::new()),
        NO_EARLY_REFRESH,
    );
    let keys = h.keys("/a");
    // The holder died: its lease runs out in 2 s and nothing is announced
    // (the waiter reads at the end of the 1 s window, then every third of
    // one while the lease still stands).
    tier(&h).other_leads(&keys, Duration::from_secs(2), Duration::ZERO);
    let started = Instant::now();
    let got = h.get("/a").await;
    assert_eq!(got.body, "here");
    assert_eq!(h.origin.hits(), 1);
    assert!(started.elapsed() >= Duration::from_secs(2));
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(tier(&h).0.acquired.load(Ordering::SeqCst), 1);
    assert_eq!(tier(&h).published(), vec![FillNotice::Stored]);
}

/// A leader whose entry Redis failed to take (the write timed out) tells
/// the waiting instances to read once and take the lease, not to fetch
/// each its own copy (`Local`, kept for answers L2 will not hold).
#[tokio::test(start_paused = true)]
async fn a_leader_whose_l2_write_failed_tells_the_waiters_to_take_its_lease() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "here"), SLOW),
        Some(FakeTier::new()),
        NO_EARLY_REFRESH,
    );
    tier(&h).0.write_fails.store(true, Ordering::SeqCst);
    assert_eq!(h.get("/a").await.body, "here");
    assert_eq!(h.origin.hits(), 1);
    assert_eq!(tier(&h).published(), vec![FillNotice::Unwritten]);
    assert!(
        tier(&h).records().leases.is_empty(),
        "the lease is released"
    );
}

/// The waiting side: on `Unwritten` a waiter reads, finds the lease free
/// and takes it, so it leads the refetch (the other instances wait on it)
/// and shares its answer through L2, rather than fetching alone.
#[tokio::test(start_paused = true)]
async fn a_waiter_told_the_entry_is_unwritten_takes_the_lease_and_shares_its_fetch() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "here"), SLOW),
        Some(FakeTier::new()),
        NO_EARLY_REFRESH,
    );
    let keys = h.keys("/a");
    let t = tier(&h).clone();
    t.other_leads(&keys, Duration::from_secs(30), Duration::ZERO);
    let other = {
        let (t, keys) = (t.clone(), keys.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            t.other_ends(&keys, None, Some(FillNotice::Unwritten));
        })
    };
    let answers = h.stampede("/a", 20).await;
    other.await.expect("unit-test setup");
    assert!(answers.iter().all(|a| a.body == "here"));
    assert_eq!(h.origin.hits(), 1);
    assert_eq!(
        t.0.acquired.load(Ordering::SeqCst),
        1,
        "the waiter took the lease"
    );
    assert_eq!(t.records().stores, 1, "its answer went to L2");
    assert_eq!(t.published(), vec![FillNotice::Stored]);
}

#[tokio::test(start_paused = true)]
async fn a_failed_notice_adopts_the_back_off_instead_of_asking_the_origin() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "here"), SLOW),
        Some(FakeTier::new()),
        &format!("{NO_EARLY_REFRESH}    backoff: {{ after: 1 }}\n"),
    );
    let keys = h.keys("/a");
    let t = tier(&h).clone();
    t.other_leads(&keys, Duration::from_secs(30), Duration::ZERO);
    let policy = h.route("/a").origin.backoff;
    let backoff = policy.after_failure(None, h.clock.now());
    let (t2, k2) = (t.clone(), keys.clone());
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        t2.records().backoffs.insert(k2.backoff(), backoff);
        t2.other_ends(&k2, None, Some(FillNotice::Failed));
    });
    let answers = h.stampede("/a", 20).await;
    // No stale copy anywhere: every caller gets the 503 of a key in
    // back-off, and the failing origin gets nothing from this instance.
    assert_backed_off(&answers);
    assert_eq!(h.origin.hits(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_stale_copy_in_l2_answers_when_the_origin_fails() {
    let h = harness(
        ScriptedOrigin::new(Reply::Unavailable("no-store"), SLOW),
        Some(FakeTier::new()),
        NO_EARLY_REFRESH,
    );
    let keys = h.keys("/a");
    // Expired 50 s ago, inside its stale-if-error window.
    let entry = h.entry(
        "max-age=10, stale-if-error=600",
        "old",
        Duration::from_secs(60),
    );
    tier(&h).records().entries.insert(keys.entry(), entry);
    let got = h.get("/a").await;
    assert_eq!(h.origin.hits(), 1);
    assert_eq!(got.body, "old");
    assert!(
        got.cs.detail == Some(Detail::StaleIfError),
        "{}",
        got.cache_status
    );
}

#[tokio::test(start_paused = true)]
async fn a_follower_times_out_on_a_lease_nobody_ends() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "here"), SLOW),
        Some(FakeTier::new()),
        &format!("{NO_EARLY_REFRESH}    coalesce: {{ lock_timeout: 3s, on_timeout: error }}\n"),
    );
    tier(&h).other_leads(&h.keys("/a"), Duration::from_secs(3600), Duration::ZERO);
    let started = Instant::now();
    let got = h.get("/a").await;
    assert_eq!(got.status, StatusCode::GATEWAY_TIMEOUT);
    assert!(
        got.cs.detail == Some(Detail::LockTimeout),
        "{}",
        got.cache_status
    );
    assert_eq!(started.elapsed(), Duration::from_secs(3));
    assert_eq!(h.origin.hits(), 0);
    // A holder that never says it is alive (an older corral, or lost
    // notices) is read a window after the wait began and every third of a
    // window after: the flight's first read, reads at 1 s and every 333 ms
    // to 3 s, and the last look at the deadline.
    let probes = tier(&h).0.probes.load(Ordering::SeqCst);
    assert_eq!(probes, 8, "probes");
}

#[tokio::test(start_paused = true)]
async fn redis_down_coalesces_locally() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "here"), SLOW),
        Some(FakeTier::new()),
        NO_EARLY_REFRESH,
    );
    tier(&h).0.down.store(true, Ordering::SeqCst);
    let answers = h.stampede("/a", 10).await;
    assert!(answers.iter().all(|a| a.status == StatusCode::OK));
    assert_eq!(h.origin.hits(), 1);
}

#[tokio::test(start_paused = true)]
async fn redis_lost_while_following_fetches_locally() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "here"), SLOW),
        Some(FakeTier::new()),
        NO_EARLY_REFRESH,
    );
    let t = tier(&h).clone();
    t.other_leads(&h.keys("/a"), Duration::from_secs(3600), Duration::ZERO);
    let t2 = t.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        t2.0.down.store(true, Ordering::SeqCst);
    });
    let got = h.get("/a").await;
    assert_eq!(got.body, "here");
    assert_eq!(h.origin.hits(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_lease_that_could_not_be_confirmed_still_shares_the_answer() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "here"), SLOW),
        Some(FakeTier::new()),
        NO_EARLY_REFRESH,
    );
    tier(&h).0.acquire_fails.store(true, Ordering::SeqCst);
    assert_eq!(h.get("/a").await.body, "here");
    assert_eq!(h.origin.hits(), 1);
    // Stored and announced, so that waiters on a lease this fill may hold
    // after all do not wait it out.
    assert_eq!(tier(&h).records().stores, 1);
    assert_eq!(tier(&h).published(), vec![FillNotice::Stored]);
}

#[tokio::test(start_paused = true)]
async fn a_write_retires_the_uri_here_and_on_every_instance() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=600", "page"), SLOW),
        Some(FakeTier::new()),
        NO_EARLY_REFRESH,
    );
    h.get("/a").await;
    h.get("/b").await;
    assert_eq!(h.origin.hits(), 2);
    let route = h.route("/a");
    let mut post = h.head("/a");
    post.method = Method::POST;
    let mut response = HeaderMap::new();
    response.insert(http::header::LOCATION, HeaderValue::from_static("/b"));
    response.insert(
        http::header::CONTENT_LOCATION,
        HeaderValue::from_static("http://elsewhere.test/a"),
    );
    crate::cache::invalidate::after_write(&h.app.cache, &h.app.routes(), &route, &post, &response)
        .await;
    // The target and its same-origin Location, each for both schemes:
    // four cluster invalidations (another site's URI is left alone), and
    // both are fetched again.
    assert_eq!(tier(&h).records().generation, 4);
    h.get("/a").await;
    h.get("/b").await;
    assert_eq!(h.origin.hits(), 4);
}

// ---------------------------------------------------------------------
// Bounded wait lists and lock age.

#[tokio::test(start_paused = true)]
async fn a_full_wait_list_answers_503_and_the_origin_sees_one_request() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "one"), Duration::from_secs(2)),
        None,
        &format!("{NO_EARLY_REFRESH}    coalesce: {{ max_waiters: 50 }}\n"),
    );
    let started = Instant::now();
    let answers = h.stampede("/a", 200).await;
    let turned_away: Vec<&Got> = answers
        .iter()
        .filter(|a| a.status == StatusCode::SERVICE_UNAVAILABLE)
        .collect();
    // One leader and 50 waiters got the answer; 149 were turned away at
    // once, none of them waited for the 2 s fetch.
    assert_eq!(turned_away.len(), 149);
    assert!(
        turned_away
            .iter()
            .all(|a| a.cs.detail == Some(Detail::WaitListFull))
    );
    assert_eq!(answers.iter().filter(|a| a.body == "one").count(), 51);
    assert_eq!(h.origin.hits(), 1);
    assert_eq!(started.elapsed(), Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn a_full_wait_list_serves_the_stale_copy_when_there_is_one() {
    let h = harness(
        ScriptedOrigin::scripted(
            &[Reply::Ok("max-age=1, stale-if-error=600", "old")],
            Reply::Ok("max-age=1, stale-if-error=600", "new"),
            Duration::from_secs(2),
        ),
        None,
        &format!("{NO_EARLY_REFRESH}    coalesce: {{ max_waiters: 50 }}\n"),
    );
    h.get("/a").await;
    tokio::time::advance(Duration::from_secs(5)).await;
    let answers = h.stampede("/a", 200).await;
    let stale = answers
        .iter()
        .filter(|a| a.body == "old" && a.cs.detail == Some(Detail::WaitListFull))
        .count();
    assert_eq!(stale, 149);
    assert_eq!(answers.iter().filter(|a| a.body == "new").count(), 51);
    assert_eq!(h.origin.hits(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_leader_past_lock_age_gives_the_key_to_one_waiter() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "slow"), Duration::from_secs(5)),
        None,
        &format!("{NO_EARLY_REFRESH}    coalesce: {{ lock_timeout: 10s, lock_age: 1s }}\n"),
    );
    let answers = h.stampede("/a", 100).await;
    assert!(
        answers
            .iter()
            .all(|a| a.status == StatusCode::OK && a.body == "slow")
    );
    // The first leader, and one waiter after a second: not 100.
    assert_eq!(h.origin.hits(), 2);
}

#[tokio::test(start_paused = true)]
async fn by_default_a_slow_origin_gets_two_requests_per_key_not_one_per_waiter() {
    // The origin takes 7 s; waiters wait 5 s (the defaults but the delay).
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "slow"), Duration::from_secs(7)),
        None,
        NO_EARLY_REFRESH,
    );
    let started = Instant::now();
    let answers = h.stampede("/a", 30).await;
    assert!(
        answers
            .iter()
            .all(|a| a.status == StatusCode::OK && a.body == "slow"),
        "{:?}",
        answers.iter().map(|a| a.status).collect::<Vec<_>>()
    );
    // The leader, and at lock_timeout one waiter: not 30.
    assert_eq!(h.origin.hits(), 2);
    // Everyone answered by the second fetch, at 5 s + 7 s.
    assert_eq!(started.elapsed(), Duration::from_secs(12));
}

#[tokio::test(start_paused = true)]
async fn with_fetch_each_every_waiter_fetches_at_lock_timeout() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "slow"), Duration::from_secs(5)),
        None,
        &format!(
            "{NO_EARLY_REFRESH}    coalesce: {{ lock_timeout: 1s, on_timeout: fetch_each }}\n"
        ),
    );
    h.stampede("/a", 100).await;
    // The explicit option: 1 + 99.
    assert_eq!(h.origin.hits(), 100);
}

#[tokio::test(start_paused = true)]
async fn a_lease_held_past_lock_age_is_taken_over_by_one_instance() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "here"), SLOW),
        Some(FakeTier::new()),
        &format!("{NO_EARLY_REFRESH}    coalesce: {{ lock_timeout: 10s, lock_age: 2s }}\n"),
    );
    let keys = h.keys("/a");
    // Another instance took the lease half a second ago and is stuck.
    tier(&h).other_leads(&keys, Duration::from_secs(3600), Duration::from_millis(500));
    let started = Instant::now();
    let answers = h.stampede("/a", 20).await;
    assert!(answers.iter().all(|a| a.body == "here"));
    // Taken over when the lease was 2 s old, once, and fetched once.
    assert_eq!(tier(&h).0.taken_over.load(Ordering::SeqCst), 1);
    assert_eq!(h.origin.hits(), 1);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(1500) + SLOW && waited < Duration::from_millis(1800) + SLOW,
        "{waited:?}"
    );
    assert_eq!(tier(&h).published(), vec![FillNotice::Stored]);
}

#[tokio::test(start_paused = true)]
async fn without_lock_age_a_stuck_lease_is_waited_out() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "here"), SLOW),
        Some(FakeTier::new()),
        &format!("{NO_EARLY_REFRESH}    coalesce: {{ lock_timeout: 3s, on_timeout: error }}\n"),
    );
    tier(&h).other_leads(&h.keys("/a"), Duration::from_secs(3600), Duration::ZERO);
    let got = h.get("/a").await;
    assert_eq!(got.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(tier(&h).0.taken_over.load(Ordering::SeqCst), 0);
    assert_eq!(h.origin.hits(), 0);
}

#[tokio::test(start_paused = true)]
async fn an_answer_too_large_for_the_tier_is_announced_local_at_its_head() {
    let h = harness(
        ScriptedOrigin::head_first(Reply::Ok("max-age=60", "a large body"), SLOW),
        Some(FakeTier::new()),
        NO_EARLY_REFRESH,
    );
    let t = tier(&h).clone();
    t.0.max_object.store(4, Ordering::SeqCst);
    let keys = h.keys("/a");
    let leader = {
        let h = h.clone_handle();
        tokio::spawn(async move { h.get("/a").await })
    };
    tokio::time::sleep(SLOW / 2).await;
    // Halfway through the download: the other instances are told, and the
    // lease is free for them.
    assert_eq!(t.published(), [FillNotice::Local]);
    assert!(!t.records().leases.contains_key(&keys.lease()));
    let a = leader.await.expect("unit-test setup");
    assert_eq!(a.body, "a large body");
    // Nothing reached L2; the end says so again for late followers.
    assert_eq!(t.published(), [FillNotice::Local, FillNotice::Local]);
    assert!(t.records().entries.is_empty());
    assert_eq!(h.origin.hits(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_local_notice_sends_a_follower_to_the_origin_at_once() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "here"), SLOW),
        Some(FakeTier::new()),
        NO_EARLY_REFRESH,
    );
    let keys = h.keys("/a");
    let t = tier(&h).clone();
    // The other instance holds the lease for its whole (long) download but
    // says at 100 ms that its answer will not be in L2.
    t.other_leads(&keys, Duration::from_secs(30), Duration::ZERO);
    let t2 = t.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        t2.0.notices
            .send(FillNotice::Local)
            .expect("a follower listens");
    });
    let started = Instant::now();
    let answers = h.stampede("/a", 20).await;
    assert!(answers.iter().all(|a| a.body == "here"));
    // One fetch for this instance's 20 callers, started at the notice,
    // while the other instance still holds its lease.
    assert_eq!(h.origin.hits(), 1);
    assert_eq!(started.elapsed(), Duration::from_millis(100) + SLOW);
    assert!(t.records().leases.contains_key(&keys.lease()));
}

// ---------------------------------------------------------------------
// The fill's exchange (cache/exchange.rs and cache/store.rs) over the scripted transport: what
// the origin is asked, and what is kept of its answer.

#[tokio::test(start_paused = true)]
async fn a_fill_asks_for_the_whole_answer_then_revalidates_its_stale_copy() {
    let h = harness(
        ScriptedOrigin::scripted(
            &[Reply::Ok("max-age=1", "v1")],
            Reply::NotModified("max-age=60"),
            SLOW,
        ),
        None,
        NO_EARLY_REFRESH,
    );
    let fields = [("range", "bytes=0-0"), ("if-none-match", "\"x\"")];
    let first = h.get_with("/a", &fields).await;
    // The client's range is served from the entry; the fill asked for
    // the whole representation, unconditionally.
    assert_eq!(
        (first.status, &first.body[..]),
        (StatusCode::PARTIAL_CONTENT, &b"v"[..])
    );
    let asked = h.origin.asked(0);
    assert_eq!(asked.headers.get("range"), None);
    assert_eq!(asked.headers.get("if-none-match"), None);
    assert_eq!(asked.uri.path(), "/a");
    tokio::time::advance(Duration::from_secs(2)).await;
    // Expired: the fill asks with the entry's validator, and the 304
    // refreshes it for 60 s.
    let second = h.get("/a").await;
    assert_eq!(
        (second.status, &second.body[..]),
        (StatusCode::OK, &b"v1"[..])
    );
    let asked = h.origin.asked(1);
    assert_eq!(
        asked.headers.get("if-none-match").map(|v| v.as_bytes()),
        Some(&b"\"v\""[..])
    );
    assert!(
        second.cs.fwd == Some(corral_core::Forward::Stale),
        "{}",
        second.cache_status
    );
    assert!(second.cs.fwd_status == Some(304), "{}", second.cache_status);
    tokio::time::advance(Duration::from_secs(30)).await;
    let third = h.get("/a").await;
    assert_eq!(third.body, "v1");
    assert!(third.cs.hit, "{}", third.cache_status);
    assert_eq!(h.origin.hits(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_head_of_a_stale_copy_asks_with_head_and_freshens_or_retires_it() {
    // "v1" and "v2" have the stored length and ETag: the HEAD's answer
    // describes the copy. "v333" does not.
    let h = harness(
        ScriptedOrigin::scripted(
            &[
                Reply::Ok("max-age=1", "v1"),
                Reply::Ok("max-age=60", "v2"),
                Reply::Ok("max-age=1", "v333"),
            ],
            Reply::Ok("max-age=60", "v4"),
            SLOW,
        ),
        None,
        NO_EARLY_REFRESH,
    );
    let head = |h: &Harness| {
        let mut r = h.head_with("/a", &[]);
        r.method = Method::HEAD;
        r
    };
    assert_eq!(h.get("/a").await.body, "v1");
    tokio::time::advance(Duration::from_secs(2)).await;
    let freshened = h.get_head("/a", head(&h)).await;
    assert_eq!(h.origin.asked(1).method, Method::HEAD);
    assert_eq!(
        h.origin
            .asked(1)
            .headers
            .get("if-none-match")
            .map(|v| v.as_bytes()),
        Some(&b"\"v\""[..])
    );
    assert_eq!(
        (freshened.status, &freshened.body[..]),
        (StatusCode::OK, &b""[..])
    );
    assert!(
        freshened.cs.fwd_status == Some(200),
        "{}",
        freshened.cache_status
    );
    // The stored body stands, fresh for the HEAD's 60 s; the HEAD's own
    // (scripted) body was never read.
    tokio::time::advance(Duration::from_secs(30)).await;
    let hit = h.get("/a").await;
    assert_eq!(hit.body, "v1");
    assert!(hit.cs.hit, "{}", hit.cache_status);
    tokio::time::advance(Duration::from_secs(31)).await;
    // Another length: the copy is retired, and the next GET fetches it
    // whole, unconditionally.
    let retired = h.get_head("/a", head(&h)).await;
    assert_eq!(h.origin.asked(2).method, Method::HEAD);
    assert_eq!(
        (retired.status, &retired.body[..]),
        (StatusCode::OK, &b""[..])
    );
    assert_eq!(h.get("/a").await.body, "v4");
    assert_eq!(h.origin.asked(3).method, Method::GET);
    assert_eq!(h.origin.asked(3).headers.get("if-none-match"), None);
    assert_eq!(h.origin.hits(), 4);
}

#[tokio::test(start_paused = true)]
async fn a_304_that_forbids_storing_answers_the_old_body_once_and_drops_the_entry() {
    let h = harness(
        ScriptedOrigin::scripted(
            &[Reply::Ok("max-age=1", "v1"), Reply::NotModified("no-store")],
            Reply::Ok("max-age=60", "v2"),
            SLOW,
        ),
        None,
        NO_EARLY_REFRESH,
    );
    assert_eq!(h.get("/a").await.body, "v1");
    tokio::time::advance(Duration::from_secs(2)).await;
    let revalidated = h.get("/a").await;
    assert_eq!(
        (revalidated.status, &revalidated.body[..]),
        (StatusCode::OK, &b"v1"[..])
    );
    assert!(
        revalidated.cs.detail == Some(Detail::Pass(corral_core::PassReason::NoStore)),
        "{}",
        revalidated.cache_status
    );
    // Neither the entry nor its validator is used again while the key is
    // hit-for-pass: the next request is an unconditional fetch.
    assert_eq!(h.get("/a").await.body, "v2");
    assert_eq!(h.origin.asked(2).headers.get("if-none-match"), None);
    assert_eq!(h.origin.hits(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_5xx_is_answered_with_the_stale_copy_stale_if_error_allows() {
    let h = harness(
        ScriptedOrigin::scripted(
            &[Reply::Ok("max-age=1, stale-if-error=60", "v1")],
            Reply::Unavailable("no-store"),
            SLOW,
        ),
        None,
        NO_EARLY_REFRESH,
    );
    assert_eq!(h.get("/a").await.body, "v1");
    tokio::time::advance(Duration::from_secs(2)).await;
    let got = h.get("/a").await;
    assert_eq!((got.status, &got.body[..]), (StatusCode::OK, &b"v1"[..]));
    assert!(
        got.cs.detail == Some(Detail::StaleIfError),
        "{}",
        got.cache_status
    );
    assert!(got.cs.fwd_status == Some(503), "{}", got.cache_status);
    // Past the window the origin's own 503 is every waiter's answer.
    tokio::time::advance(Duration::from_secs(120)).await;
    let answers = h.stampede("/a", 5).await;
    for a in &answers {
        assert_eq!(
            (a.status, &a.body[..]),
            (StatusCode::SERVICE_UNAVAILABLE, &b"down"[..])
        );
    }
    assert_eq!(h.origin.hits(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_streamed_answer_reaches_every_waiter_before_its_body_has_arrived() {
    let h = harness(
        ScriptedOrigin::head_first(Reply::Ok("max-age=60", "streamed"), SLOW),
        None,
        NO_EARLY_REFRESH,
    );
    let answers = h.stampede("/a", 10).await;
    for a in &answers {
        assert_eq!((a.status, &a.body[..]), (StatusCode::OK, &b"streamed"[..]));
    }
    // Stored once its body ended: the next request is a hit.
    assert!(h.get("/a").await.cs.hit);
    assert_eq!(h.origin.hits(), 1);
}

// ---------------------------------------------------------------------
// A suffix of the layers, driven directly: the exchange (with the store
// under it) alone, and the gate over it, with no flight or shared tier.

/// Every event waiting on `heard`.
fn drained(heard: &mut tokio::sync::mpsc::UnboundedReceiver<FillEvent>) -> Vec<String> {
    let mut seen = Vec::new();
    while let Ok(event) = heard.try_recv() {
        seen.push(match event {
            FillEvent::Committed => "committed".to_owned(),
            FillEvent::Declared(n) => format!("declared {n}"),
            FillEvent::Overflowed => "overflowed".to_owned(),
            FillEvent::Streaming(_) => "streaming".to_owned(),
            FillEvent::PassKnown => "pass-known".to_owned(),
        });
    }
    seen
}

#[tokio::test(start_paused = true)]
async fn the_exchange_alone_stores_and_says_so_on_its_events() {
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "alone"), SLOW),
        None,
        NO_EARLY_REFRESH,
    );
    let fill = h.fill("/a");
    let (events, mut heard) = Events::channel(false);
    let Ended::Outcome(FillOutcome::Stored { entry, .. }) = exchange::fetch(&fill, &events).await
    else {
        panic!("a storable answer is stored");
    };
    assert_eq!(entry.body().as_ref(), b"alone");
    assert_eq!(drained(&mut heard), ["committed", "declared 5"]);
    // In L1: the next GET is a hit without the origin.
    assert!(h.get("/a").await.cs.hit);
    assert_eq!(h.origin.hits(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_exchange_streams_its_answer_up_before_the_body_is_in() {
    let h = harness(
        ScriptedOrigin::head_first(Reply::Ok("max-age=60", "streamed"), SLOW),
        None,
        NO_EARLY_REFRESH,
    );
    let fill = h.fill("/a");
    let (events, mut heard) = Events::channel(true);
    let fetching = exchange::fetch(&fill, &events);
    tokio::pin!(fetching);
    let started = Instant::now();
    let mut seen = Vec::new();
    // The head is in at once; the body only after SLOW: the streamed
    // outcome comes up while the fetch still runs.
    let ended = loop {
        tokio::select! {
            ended = &mut fetching => break ended,
            Some(event) = heard.recv() => {
                seen.push((event, started.elapsed()));
            }
        }
    };
    assert!(matches!(ended, Ended::Outcome(FillOutcome::Stored { .. })));
    assert_eq!(started.elapsed(), SLOW);
    assert!(
        matches!(
            &seen[..],
            [
                (FillEvent::Committed, _),
                (FillEvent::Declared(8), _),
                (FillEvent::Streaming(FillOutcome::Streaming { .. }), at),
            ] if *at < SLOW
        ),
        "{seen:?}"
    );
    assert_eq!(h.origin.hits(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_gate_alone_records_a_failure_and_leaves_the_origin_alone_after() {
    let h = harness(
        ScriptedOrigin::new(Reply::Unreachable, SLOW),
        None,
        "    backoff: { after: 1, min: 10s, max: 60s }\n",
    );
    let fill = h.fill("/a");
    let (events, _) = Events::channel(false);
    let Ended::Outcome(FillOutcome::Shared { response, .. }) = gate::fetch(&fill, &events).await
    else {
        panic!("a refused connection is every waiter's 502");
    };
    assert_eq!(response.status, StatusCode::BAD_GATEWAY);
    let recorded = h.app.cache.l1.last_backoff(&fill.pass_scope());
    assert!(recorded.is_some_and(|b| b.active(h.clock.now())));
    // In back-off: the gate answers 503 without asking the origin.
    let Ended::Outcome(FillOutcome::Shared {
        response, detail, ..
    }) = gate::fetch(&fill, &events).await
    else {
        panic!("a key in back-off is answered by the gate");
    };
    assert_eq!(
        (response.status, detail),
        (StatusCode::SERVICE_UNAVAILABLE, Some(Detail::Backoff))
    );
    assert_eq!(h.origin.hits(), 1);
}

// ---------------------------------------------------------------------
// The CPU pool and codings made on demand.

/// An answer stored while the CPU pool is full is served whole and
/// unencoded (never refused, never compressed on the serving thread);
/// the coding a caller then asks for is made once, on the pool, however
/// many ask meanwhile, and served from then on.
#[tokio::test(start_paused = true)]
async fn an_answer_stored_while_the_cpu_pool_is_full_is_served_then_encoded_on_demand() {
    let doc: &'static str = Box::leak(
        r#"{"id": 1, "name": "corral", "tags": ["a", "b"]}, "#
            .repeat(200)
            .into_boxed_str(),
    );
    let h = harness_with(
        ScriptedOrigin::new(Reply::Ok("max-age=60", doc), SLOW),
        None,
        "server:\n  cpu_threads: 1\n",
        "    compression: { encodings: [gzip, br] }\n",
    );
    let cache = Arc::clone(&h.app.cache);
    let gzip = [("accept-encoding", "gzip")];
    let full = cache
        .cpu
        .try_hold(crate::cache::cpu::Job::CompressStream)
        .expect("the one slot");
    let stored = h.get_with("/doc", &gzip).await;
    assert_eq!(stored.status, StatusCode::OK);
    assert!(stored.cs.stored, "{}", stored.cache_status);
    assert_eq!(
        (stored.encoding.as_deref(), &stored.body[..]),
        (None, doc.as_bytes())
    );
    // Still full: asked for, but not made; served as stored.
    let hit = h.get_with("/doc", &gzip).await;
    assert!(hit.cs.hit, "{}", hit.cache_status);
    assert_eq!(
        (hit.encoding.as_deref(), &hit.body[..]),
        (None, doc.as_bytes())
    );
    settle(&cache).await;
    assert_eq!(cache.making.made(), 0);
    drop(full);
    // Twenty callers ask for gzip at once: one coding is made.
    let asked: Vec<_> = (0..20)
        .map(|_| {
            let h = h.clone_handle();
            tokio::spawn(async move { h.get_with("/doc", &[("accept-encoding", "gzip")]).await })
        })
        .collect();
    for a in asked {
        let a = a.await.expect("task");
        assert!(a.cs.hit, "{}", a.cache_status);
        assert!(decoded(a.encoding.as_deref(), &a.body) == doc.as_bytes());
    }
    settle(&cache).await;
    assert_eq!(cache.making.made(), 1);
    let coded = h.get_with("/doc", &gzip).await;
    assert_eq!(coded.encoding.as_deref(), Some("gzip"));
    assert!(coded.body.len() < doc.len() / 4, "{}", coded.body.len());
    assert!(decoded(Some("gzip"), &coded.body) == doc.as_bytes());
    // No coding asked, none made; br when first asked.
    let plain = h.get("/doc").await;
    assert_eq!(
        (plain.encoding.as_deref(), &plain.body[..]),
        (None, doc.as_bytes())
    );
    settle(&cache).await;
    assert_eq!(cache.making.made(), 1);
    let _ = h.get_with("/doc", &[("accept-encoding", "br")]).await;
    settle(&cache).await;
    assert_eq!(cache.making.made(), 2);
    let br = h.get_with("/doc", &[("accept-encoding", "br")]).await;
    assert_eq!(br.encoding.as_deref(), Some("br"));
    assert!(decoded(Some("br"), &br.body) == doc.as_bytes());
    assert_eq!(h.origin.hits(), 1);
}

/// Waits (at most ten seconds of real time: the pool's threads run in
/// it) until no coding is being made.
async fn settle(cache: &crate::cache::Cache) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while cache.making.busy() {
        assert!(std::time::Instant::now() < deadline, "a coding never ended");
        tokio::task::yield_now().await;
    }
}

fn decoded(coding: Option<&str>, body: &[u8]) -> Vec<u8> {
    use std::io::Read;
    let mut out = Vec::new();
    match coding {
        None => out.extend_from_slice(body),
        Some("gzip") => {
            flate2::read::GzDecoder::new(body)
                .read_to_end(&mut out)
                .expect("gunzip");
        }
        Some("br") => {
            brotli::Decompressor::new(body, 4096)
                .read_to_end(&mut out)
                .expect("unbrotli");
        }
        Some(other) => panic!("{other}"),
    }
    out
}

// ---------------------------------------------------------------------
// Fill slots.

/// A fill slot is held only while this instance fetches: a key whose
/// lease another instance holds waits on that lease without a slot, so
/// the one slot (`max_fills: 1`) still fetches another key at once.
#[tokio::test(start_paused = true)]
async fn a_fill_waiting_on_another_instances_lease_holds_no_fill_slot() {
    let route = format!("{NO_EARLY_REFRESH}    coalesce: {{ max_fills: 1, lock_timeout: 5s }}\n");
    let h = harness(
        ScriptedOrigin::new(Reply::Ok("max-age=60", "here"), SLOW),
        Some(FakeTier::new()),
        &route,
    );
    let keys = h.keys("/a");
    tier(&h).other_leads(&keys, Duration::from_secs(30), Duration::ZERO);
    let waiting = {
        let h = h.clone_handle();
        tokio::spawn(async move { h.get("/a").await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(h.origin.hits(), 0, "/a waits on the other instance");
    let started = Instant::now();
    let other = h.get("/b").await;
    assert_eq!(
        (other.status, &other.body[..]),
        (StatusCode::OK, &b"here"[..])
    );
    assert!(other.cs.detail.is_none(), "{}", other.cache_status);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "fetched at once, not after waiting out the lock timeout for a slot"
    );
    assert_eq!(h.origin.hits(), 1);
    waiting.abort();
}
