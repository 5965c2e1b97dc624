//! A scripted HTTP/1.1 origin on 127.0.0.1.
//!
//! It counts and records every request the moment its head arrives (before any
//! scripted delay), answers from its script, and can be switched between
//! phases of a test: new replies, a failing mode, conditional 304s, or stopped
//! so that connections are refused. It never caches or coalesces anything.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri, header};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::reply::{Reply, ReplyBody};

type OriginBody = BoxBody<Bytes, hyper::Error>;
type RouteKey = (Option<Method>, String);

/// The head of a request as the origin received it.
#[derive(Clone, Debug)]
pub struct SeenRequest {
    /// Request method.
    pub method: Method,
    /// Request target (path and query).
    pub uri: Uri,
    /// Request headers, as forwarded by the proxy.
    pub headers: HeaderMap,
}

impl SeenRequest {
    /// The first value of header `name` as text, if present and readable.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// All values of header `name`, as text.
    pub fn header_all(&self, name: &str) -> Vec<&str> {
        self.headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect()
    }

    /// The request path.
    pub fn path(&self) -> &str {
        self.uri.path()
    }

    /// The raw query string, if any.
    pub fn query(&self) -> Option<&str> {
        self.uri.query()
    }
}

/// How the origin answers, switchable at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OriginMode {
    /// Answer from the script.
    Script,
    /// Answer every request with `500 origin failure`, without delay.
    InternalError,
    /// Answer every request with `503 origin unavailable`, without delay:
    /// the application's own gateway or load balancer finds it down.
    Unavailable,
}

/// Builder of a scripted origin.
#[derive(Debug, Default)]
pub struct Origin {
    routes: Vec<(RouteKey, Reply)>,
    conditional: bool,
}

impl Origin {
    /// An origin with no routes (every path answers 404).
    pub fn new() -> Self {
        Self::default()
    }

    /// Answers `reply` on `path` (exact match, any method, query ignored).
    pub fn route(mut self, path: &str, reply: Reply) -> Self {
        self.routes.push(((None, path.to_owned()), reply));
        self
    }

    /// Answers `reply` on `path` for `method` only; takes precedence over `route`.
    pub fn route_method(mut self, method: Method, path: &str, reply: Reply) -> Self {
        self.routes.push(((Some(method), path.to_owned()), reply));
        self
    }

    /// Answers `304 Not Modified` when If-None-Match matches the reply's ETag.
    pub fn conditional(mut self) -> Self {
        self.conditional = true;
        self
    }

    /// Binds 127.0.0.1:0 and serves in a task of the current runtime.
    pub async fn start(self) -> RunningOrigin {
        self.start_at("127.0.0.1:0".parse().expect("addr")).await
    }

    /// Binds `addr` (a stopped origin's, to bring it back) and serves.
    pub async fn start_at(self, addr: SocketAddr) -> RunningOrigin {
        let listener = TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("bind the origin on {addr}: {e}"));
        let addr = listener.local_addr().expect("origin local addr");
        let (arrivals, _) = watch::channel(0usize);
        let state = Arc::new(State {
            routes: Mutex::new(self.routes.into_iter().collect()),
            seen: Mutex::new(Vec::new()),
            answered: Mutex::new(Vec::new()),
            cancelled: Mutex::new(Vec::new()),
            mode: Mutex::new(OriginMode::Script),
            conditional: AtomicBool::new(self.conditional),
            arrivals,
            in_flight: Default::default(),
            peak: Default::default(),
        });
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(serve(listener, state.clone(), stopped));
        RunningOrigin {
            addr,
            state,
            stop,
            task: Some(task),
        }
    }
}

/// A running origin; stops serving when dropped.
pub struct RunningOrigin {
    addr: SocketAddr,
    state: Arc<State>,
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl RunningOrigin {
    /// The most requests it was answering at once (from arrival to the
    /// end of its delay and head).
    pub fn peak_concurrency(&self) -> usize {
        self.state.peak.load(Ordering::SeqCst)
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`, for a route's `upstream`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// How many requests for `path` (any query, any method) have arrived.
    pub fn hits(&self, path: &str) -> usize {
        lock(&self.state.seen)
            .iter()
            .filter(|r| r.path() == path)
            .count()
    }

    /// The heads of the requests for `path`, in arrival order.
    pub fn requests(&self, path: &str) -> Vec<SeenRequest> {
        lock(&self.state.seen)
            .iter()
            .filter(|r| r.path() == path)
            .cloned()
            .collect()
    }

    /// Statuses the origin answered on `path`, in completion order.
    pub fn answered(&self, path: &str) -> Vec<u16> {
        lock(&self.state.answered)
            .iter()
            .filter(|(p, _)| p == path)
            .map(|(_, s)| s.as_u16())
            .collect()
    }

    /// How many requests for `path` were abandoned by the proxy before the
    /// origin answered (the proxy dropped its connection mid-delay).
    pub fn cancelled(&self, path: &str) -> usize {
        lock(&self.state.cancelled)
            .iter()
            .filter(|p| *p == path)
            .count()
    }

    /// Waits until at least `n` requests for `path` have arrived; fails the
    /// test after `within`.
    pub async fn wait_hits(&self, path: &str, n: usize, within: Duration) {
        let mut arrivals = self.state.arrivals.subscribe();
        let reached = tokio::time::timeout(within, async {
            loop {
                if self.hits(path) >= n {
                    return;
                }
                if arrivals.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        })
        .await;
        assert!(
            reached.is_ok(),
            "origin saw {} request(s) for {path} after {within:?}, expected at least {n}",
            self.hits(path)
        );
    }

    /// Replaces the reply on `path` (any method).
    pub fn set_route(&self, path: &str, reply: Reply) {
        lock(&self.state.routes).insert((None, path.to_owned()), reply);
    }

    /// Replaces the reply on `path` for `method` only.
    pub fn set_route_method(&self, method: Method, path: &str, reply: Reply) {
        lock(&self.state.routes).insert((Some(method), path.to_owned()), reply);
    }

    /// Switches how every request is answered.
    pub fn set_mode(&self, mode: OriginMode) {
        *lock(&self.state.mode) = mode;
    }

    /// Turns conditional answers (304 on a matching If-None-Match) on or off.
    pub fn set_conditional(&self, on: bool) {
        self.state.conditional.store(on, Ordering::SeqCst);
    }

    /// Stops listening and drops every open connection, so that the proxy's
    /// pooled connections break and new ones are refused.
    pub async fn stop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(crate::DEADLINE, task).await;
        }
    }
}

impl Drop for RunningOrigin {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

struct State {
    routes: Mutex<HashMap<RouteKey, Reply>>,
    seen: Mutex<Vec<SeenRequest>>,
    answered: Mutex<Vec<(String, StatusCode)>>,
    cancelled: Mutex<Vec<String>>,
    mode: Mutex<OriginMode>,
    conditional: AtomicBool,
    /// Bumped on every arrival so waiters wake on an event, not a poll.
    arrivals: watch::Sender<usize>,
    /// Requests being answered now, and the most there ever were at once.
    in_flight: std::sync::atomic::AtomicUsize,
    peak: std::sync::atomic::AtomicUsize,
}

impl State {
    fn reply_for(&self, method: &Method, path: &str) -> Option<Reply> {
        let routes = lock(&self.routes);
        routes
            .get(&(Some(method.clone()), path.to_owned()))
            .or_else(|| routes.get(&(None, path.to_owned())))
            .cloned()
    }

    fn record(&self, seen: SeenRequest) {
        lock(&self.seen).push(seen);
        self.arrivals.send_modify(|n| *n += 1);
    }
}

/// Test state is plain data: a panic elsewhere must not hide it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

async fn serve(listener: TcpListener, state: Arc<State>, mut stop: watch::Receiver<bool>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let state = state.clone();
                connections.spawn(async move {
                    let service = service_fn(move |req| answer(state.clone(), req));
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
            _ = stop.changed() => break,
        }
        while connections.try_join_next().is_some() {}
    }
    drop(listener);
    connections.shutdown().await;
}

/// Counts a request out of `in_flight` when its handler ends.
struct InFlight(Arc<State>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Records a request whose answer was never produced (the proxy went away).
struct CancelGuard {
    state: Arc<State>,
    path: String,
    done: bool,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if !self.done {
            lock(&self.state.cancelled).push(std::mem::take(&mut self.path));
        }
    }
}

async fn answer(
    state: Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<OriginBody>, Infallible> {
    let seen = SeenRequest {
        method: req.method().clone(),
        uri: req.uri().clone(),
        headers: req.headers().clone(),
    };
    let path = seen.path().to_owned();
    let reply = state.reply_for(&seen.method, &path);
    let mode = *lock(&state.mode);
    state.record(seen.clone());
    let mut guard = CancelGuard {
        state: state.clone(),
        path: path.clone(),
        done: false,
    };
    let now = state.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    state.peak.fetch_max(now, Ordering::SeqCst);
    let _in_flight = InFlight(state.clone());

    let response = match (mode, reply) {
        (OriginMode::InternalError, _) => text(StatusCode::INTERNAL_SERVER_ERROR, "origin failure"),
        (OriginMode::Unavailable, _) => text(StatusCode::SERVICE_UNAVAILABLE, "origin unavailable"),
        (OriginMode::Script, None) => text(StatusCode::NOT_FOUND, &format!("no route for {path}")),
        (OriginMode::Script, Some(reply)) => {
            if !reply.delay.is_zero() {
                tokio::time::sleep(reply.delay).await;
            }
            if state.conditional.load(Ordering::SeqCst) && etag_matches(&reply, &seen) {
                not_modified(&reply)
            } else {
                scripted(&reply, &seen, req.into_body())
            }
        }
    };
    guard.done = true;
    lock(&state.answered).push((path, response.status()));
    Ok(response)
}

fn full(body: impl Into<Bytes>) -> OriginBody {
    Full::new(body.into())
        .map_err(|never| match never {})
        .boxed()
}

fn text(status: StatusCode, body: &str) -> Response<OriginBody> {
    let mut response = Response::new(full(body.to_owned()));
    *response.status_mut() = status;
    response
}

fn scripted(reply: &Reply, seen: &SeenRequest, body: Incoming) -> Response<OriginBody> {
    let body = match &reply.body {
        ReplyBody::Fixed(bytes) => full(bytes.clone()),
        ReplyBody::EchoRequestBody => body.boxed(),
        ReplyBody::FromRequest(f) => full(f(seen)),
        ReplyBody::Trickle {
            chunk,
            count,
            every,
        } => {
            let (chunk, count, every) = (chunk.clone(), *count, *every);
            let frames = futures_util::stream::unfold(0usize, move |i| {
                let chunk = chunk.clone();
                async move {
                    if i >= count {
                        return None;
                    }
                    if i > 0 {
                        tokio::time::sleep(every).await;
                    }
                    Some((
                        Ok::<_, hyper::Error>(hyper::body::Frame::data(chunk)),
                        i + 1,
                    ))
                }
            });
            http_body_util::StreamBody::new(frames).boxed()
        }
    };
    let mut response = Response::new(body);
    *response.status_mut() = reply.status;
    for (name, value) in &reply.headers {
        response.headers_mut().append(name.clone(), value.clone());
    }
    for (name, value, when) in &reply.conditional {
        if when(seen) {
            response.headers_mut().append(name.clone(), value.clone());
        }
    }
    response
}

fn not_modified(reply: &Reply) -> Response<OriginBody> {
    let mut response = Response::new(full(Bytes::new()));
    *response.status_mut() = StatusCode::NOT_MODIFIED;
    for (name, value) in &reply.headers {
        if name != header::CONTENT_LENGTH && name != header::CONTENT_TYPE {
            response.headers_mut().append(name.clone(), value.clone());
        }
    }
    response
}

/// Weak comparison (RFC 9110 §13.1.2) of If-None-Match against the ETag.
fn etag_matches(reply: &Reply, seen: &SeenRequest) -> bool {
    let Some(etag) = reply.header_value("etag").and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let opaque = |tag: &str| tag.trim().trim_start_matches("W/").to_owned();
    let etag = opaque(etag);
    seen.header_all("if-none-match")
        .iter()
        .flat_map(|v| v.split(','))
        .any(|candidate| candidate.trim() == "*" || opaque(candidate) == etag)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::Client;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_are_counted_on_arrival_before_the_delay() {
        let origin = Origin::new()
            .route("/slow", Reply::ok("late").delay(Duration::from_millis(300)))
            .start()
            .await;
        let client = Client::new();
        let url = format!("{}/slow?x=1", origin.url());
        let pending = tokio::spawn(async move { client.get(&url).await });
        origin.wait_hits("/slow", 1, crate::DEADLINE).await;
        assert!(origin.answered("/slow").is_empty());
        let answer = pending.await.expect("request task");
        assert_eq!(answer.text(), "late");
        assert_eq!(origin.answered("/slow"), [200]);
        assert_eq!(origin.requests("/slow")[0].query(), Some("x=1"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn conditional_mode_answers_304_to_a_matching_validator_only() {
        let origin = Origin::new()
            .route("/e", Reply::ok("body").header("etag", "\"v1\""))
            .conditional()
            .start()
            .await;
        let client = Client::new();
        let url = format!("{}/e", origin.url());
        let matching = client
            .get_with(&url, &[("if-none-match", "W/\"v1\"")])
            .await;
        assert_eq!(matching.status, 304);
        assert_eq!(matching.header("etag"), Some("\"v1\""));
        let other = client.get_with(&url, &[("if-none-match", "\"v0\"")]).await;
        assert_eq!(other.status, 200);
        origin.set_conditional(false);
        let off = client.get_with(&url, &[("if-none-match", "\"v1\"")]).await;
        assert_eq!(off.status, 200);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn modes_routes_and_echoes_switch_at_run_time() {
        let origin = Origin::new()
            .route("/a", Reply::ok("one"))
            .route("/echo", Reply::echo_body())
            .route_method(Method::POST, "/a", Reply::status(201, "made"))
            .start()
            .await;
        let client = Client::new();
        let url = format!("{}/a", origin.url());
        assert_eq!(client.get(&url).await.text(), "one");
        let post = client.send(Method::POST, &url, &[], Some("x".into())).await;
        assert_eq!((post.status.as_u16(), post.text().as_str()), (201, "made"));
        origin.set_route("/a", Reply::ok("two").with_status(203));
        let swapped = client.get(&url).await;
        assert_eq!(
            (swapped.status.as_u16(), swapped.text().as_str()),
            (203, "two")
        );
        let echoed = client
            .send(
                Method::PUT,
                &format!("{}/echo", origin.url()),
                &[],
                Some("ping".into()),
            )
            .await;
        assert_eq!(echoed.text(), "ping");
        origin.set_mode(OriginMode::InternalError);
        assert_eq!(client.get(&url).await.status, 500);
        assert_eq!(origin.hits("/a"), 4);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stopped_origin_refuses_connections_and_drops_pooled_ones() {
        let mut origin = Origin::new().route("/a", Reply::ok("one")).start().await;
        let client = Client::new();
        let url = format!("{}/a", origin.url());
        // Leaves a pooled keep-alive connection behind.
        assert_eq!(client.get(&url).await.text(), "one");
        origin.stop().await;
        let error = client
            .try_send(Method::GET, &url, &[], None)
            .await
            .expect_err("a stopped origin answers nothing");
        assert!(error.to_string().contains("error"), "{error:#}");
        let refused = tokio::net::TcpStream::connect(origin.addr()).await;
        assert!(refused.is_err(), "the listener is closed");
        assert_eq!(origin.hits("/a"), 1);
    }
}
