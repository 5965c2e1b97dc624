//! The second layer of the miss path: the key's flight in this process.
//! A request that missed joins it and leads (its fill runs in a task of
//! its own, so a client that disconnects never cancels it for the
//! others) or follows (waits for the leader's outcome, at most the
//! route's lock timeout, then does what `on_timeout` says); a full wait
//! list, a leader held past `lock_age` and a fill nobody wants any more
//! end here. The fill's fetch is the layer below: the shared tier when
//! Redis is configured (`shared`), else the gate (`gate`).

use std::sync::Arc;
use std::time::Duration;

use corral_core::miss::{Miss, Next, WaitEnd};
use corral_core::{Detail, EntryState, Forward, Join, PassReason, Permit, Role, WaitResult};
use http::StatusCode;
use tokio::sync::oneshot;

use crate::cache::fill::Cache;
use crate::cache::fill::{self, Ended, Events, FillEvent, FillOutcome, FillRequest};
use crate::cache::respond::{self, Answer};
use crate::cache::{gate, outcome, shared};
use crate::config::OnTimeout;

/// A request that missed, on its way into the key's flight.
pub struct Joining {
    /// The fill it would lead; its variant is the flight's key.
    pub fill: FillRequest,
    /// Through the flight; otherwise alone (coalescing off, or the
    /// caller's view of the URI is hit-for-pass).
    pub coalesce: bool,
}

/// What a request's time in the flight came to.
pub enum Flown {
    Answer(Answer),
    /// Look the key up again: the leader taught a Vary set, or left.
    LookAgain,
}

/// Leads, follows or fetches alone, as the flight and `miss` say.
pub async fn fly(joining: Joining, miss: &mut Miss, head: bool) -> Flown {
    let Joining { fill, coalesce } = joining;
    if !coalesce {
        return Flown::Answer(lead(fill, None, head).await);
    }
    let join = Join {
        max_waiters: fill.route.max_waiters,
        after_retirement: miss.after_retirement(),
    };
    match fill.cache.flights.join(fill.variant.digest, join) {
        Role::Leader(permit) => Flown::Answer(lead(fill, Some(permit), head).await),
        Role::Follower(waiter) => follow(fill, waiter, miss, head).await,
        Role::Full => {
            let outcome = fill::wait_list_full(&fill);
            Flown::Answer(answer(&fill, &outcome, true, head))
        }
    }
}

/// Waits on the leader's fill. Under `on_timeout: fetch`, a follower that
/// times out hands the key to one waiter (itself, if first to look
/// again), and the flight that waiter leads is waited on to its end: its
/// exchange is bounded by the route's `timeouts.total`, and fetching
/// beside it would be the stampede.
async fn follow(
    fill: FillRequest,
    waiter: corral_core::Waiter<FillOutcome>,
    miss: &mut Miss,
    head: bool,
) -> Flown {
    let route = &fill.route;
    let retire_on_timeout = route.on_timeout == OnTimeout::Fetch;
    let patience = if retire_on_timeout && miss.after_retirement() {
        route.upstream.total + route.lock_timeout
    } else {
        route.lock_timeout
    };
    let waited = waiter.wait_with(patience, route.lock_age, retire_on_timeout);
    let end = match waited.await {
        WaitResult::Done(outcome) => wait_end(&fill, outcome),
        WaitResult::Dangling => WaitEnd::Dangling,
        WaitResult::Retired => WaitEnd::Retired,
        WaitResult::TimedOut => WaitEnd::TimedOut,
    };
    match miss.waited(end) {
        Next::Answer(outcome) => Flown::Answer(answer(&fill, &outcome, true, head)),
        Next::LookAgain => Flown::LookAgain,
        Next::OnLockTimeout if retire_on_timeout => {
            let outcome = fill::gave_up(&fill);
            Flown::Answer(answer(&fill, &outcome, true, head))
        }
        Next::OnLockTimeout => Flown::Answer(on_lock_timeout(fill, head).await),
        Next::FetchAlone => Flown::Answer(lead(fill, None, head).await),
    }
}

/// The leader's outcome, as the follower's decision needs it: whether it
/// is for this request's variant.
fn wait_end(fill: &FillRequest, outcome: FillOutcome) -> WaitEnd<FillOutcome> {
    let request = &fill.head.headers;
    match &outcome {
        FillOutcome::Stored { entry, .. } | FillOutcome::FromL2 { entry } => WaitEnd::Stored {
            fits: entry.matches_vary(request),
            outcome,
        },
        FillOutcome::Streaming { head, .. } => WaitEnd::Stored {
            fits: head.matches_vary(request),
            outcome,
        },
        FillOutcome::Shared { response, .. } => WaitEnd::Shared {
            fits: response.matches_vary(request),
            outcome,
        },
        FillOutcome::Stale { .. } => WaitEnd::Shared {
            fits: true,
            outcome,
        },
        FillOutcome::Pass { reason } => {
            tracing::debug!(route = %fill.route.name, key = %fill.primary.loggable(), reason = reason.as_str(), "uncacheable: fetching alone");
            WaitEnd::Pass
        }
    }
}

fn answer(fill: &FillRequest, outcome: &FillOutcome, collapsed: bool, head: bool) -> Answer {
    let now = fill.cache.clock.now();
    outcome::from_outcome(outcome, collapsed, now, head, &fill.head.headers)
}

/// Starts a refresh unless one is already under way for this key.
pub(crate) fn refresh(cache: &Cache, fill: FillRequest) {
    if let Role::Leader(permit) = cache.flights.join(fill.variant.digest, Join::UNBOUNDED) {
        tokio::spawn(run(fill, Some(permit), None));
    }
}

/// Runs the fill in its own task and waits for it.
async fn lead(fill: FillRequest, permit: Option<Permit<FillOutcome>>, head: bool) -> Answer {
    let request_headers = fill.head.headers.clone();
    let clock = Arc::clone(&fill.cache.clock);
    let (tx, rx) = oneshot::channel();
    tokio::spawn(run(fill, permit, Some(tx)));
    match rx.await {
        Ok(Ended::Outcome(o)) => {
            outcome::from_outcome(&o, false, clock.now(), head, &request_headers)
        }
        Ok(Ended::Stream(_, answer)) if head => answer.without_body(),
        Ok(Ended::Stream(_, answer)) => answer,
        Err(_) => respond::error(
            StatusCode::BAD_GATEWAY,
            Forward::Miss,
            Detail::FillFailed,
            None,
        ),
    }
}

/// The route's `on_timeout` for a follower that waited its lock timeout.
async fn on_lock_timeout(fill: FillRequest, head: bool) -> Answer {
    match fill::on_lock_timeout(&fill) {
        Some(outcome) => answer(&fill, &outcome, false, head),
        None => lead(fill, None, head).await,
    }
}

/// Runs a fill to its end. `permit` is `None` for an uncoalesced fetch;
/// `leader` is `None` for a background refresh.
async fn run(
    mut fill: FillRequest,
    mut permit: Option<Permit<FillOutcome>>,
    mut leader: Option<oneshot::Sender<Ended>>,
) {
    // A fill for a client that went away, with nobody else waiting and
    // nothing committed yet, is cancelled: nobody would get its answer (an
    // HTTP/2 client resetting each stream it opens must not make corral
    // fetch for nobody). A background refresh has no client and runs on.
    let cancellable = leader.is_some();
    let slots = tokio::select! {
        s = gate::take_slots(&fill) => s,
        () = abandoned(&mut leader, permit.as_ref()), if cancellable => {
            crate::telemetry::metrics::fill_cancelled(&fill.route.name);
            return;
        }
    };
    let Some(_slots) = slots else {
        crate::telemetry::metrics::fill_refused(&fill.route.name);
        tracing::warn!(route = %fill.route.name, key = %fill.primary.loggable(), "fill limit reached: not fetching");
        finish(&fill, permit, leader, fill::fill_limit(&fill));
        return;
    };
    let Some(ended) = drive(&mut fill, &mut permit, &mut leader, cancellable).await else {
        crate::telemetry::metrics::fill_cancelled(&fill.route.name);
        return;
    };
    match ended {
        Ended::Outcome(outcome) => settle(&fill, permit, leader, outcome),
        Ended::Stream(reason, response) => {
            if let Some(p) = permit {
                release(&fill, p, reason);
            }
            if let Some(tx) = leader {
                // A leader that went away drops the body, closing the
                // upstream connection: nobody else wanted it.
                let _ = tx.send(Ended::Stream(reason, response));
            }
        }
    }
}

/// Runs the fetch and hears its events: a streamed answer goes to the
/// flight and the leader as soon as its head is in (the flight stays open
/// for latecomers until the body is stored), a committed fill is no
/// longer cancellable, and a key another instance found uncacheable
/// releases the waiters at once. `None` when the fill was abandoned.
async fn drive(
    fill: &mut FillRequest,
    permit: &mut Option<Permit<FillOutcome>>,
    leader: &mut Option<oneshot::Sender<Ended>>,
    cancellable: bool,
) -> Option<Ended> {
    let (events, mut heard) = Events::channel(true);
    let mut heard_so_far = Heard {
        key: fill.primary.loggable().to_owned(),
        ..Heard::default()
    };
    let coalesced = permit.is_some();
    let fetching = fetch(fill, &events, coalesced);
    tokio::pin!(fetching);
    let ended = loop {
        tokio::select! {
            // A fetch that has ended answers with its final outcome (a
            // stored entry serves ranges and conditionals a stream cannot).
            biased;
            ended = &mut fetching => break ended,
            Some(event) = heard.recv() => heard_so_far.hear(event, permit, leader),
            () = abandoned(leader, permit.as_ref()), if cancellable && !heard_so_far.committed => {
                return None;
            }
        }
    };
    // A pass marker the fetch found as it ended still releases the
    // waiters before the outcome reaches them; a stream it announced is
    // moot now that the whole answer is in.
    while let Ok(event) = heard.try_recv() {
        if let FillEvent::PassKnown = event {
            heard_so_far.hear(event, permit, leader);
        }
    }
    Some(ended)
}

/// What the driver has heard of its fill so far.
#[derive(Default)]
struct Heard {
    /// The key, for the flight's metrics.
    key: String,
    committed: bool,
    streaming: bool,
}

impl Heard {
    fn hear(
        &mut self,
        event: FillEvent,
        permit: &mut Option<Permit<FillOutcome>>,
        leader: &mut Option<oneshot::Sender<Ended>>,
    ) {
        match event {
            FillEvent::Committed => self.committed = true,
            FillEvent::Declared(_) => {}
            FillEvent::Streaming(outcome) if !self.streaming => {
                self.streaming = true;
                if let Some(p) = permit {
                    p.publish(outcome.clone());
                }
                if let Some(tx) = leader.take() {
                    let _ = tx.send(Ended::Outcome(outcome));
                }
            }
            FillEvent::Streaming(_) => {}
            FillEvent::PassKnown => {
                if let Some(p) = permit.take() {
                    crate::telemetry::metrics::flight_waiters(&self.key, p.followers());
                    p.complete(FillOutcome::Pass {
                        reason: PassReason::HitForPass,
                    });
                }
            }
        }
    }
}

/// The fetch itself, through Redis when it is configured: a local flight's
/// leader (`coalesced`) enters the shared tier and its lease; any other
/// fill uses L2 as a cache only, so that a request that chose not to
/// coalesce (or could not) is not coalesced across instances either.
async fn fetch(fill: &mut FillRequest, events: &Events, coalesced: bool) -> Ended {
    match fill.cache.tier.clone() {
        Some(tier) if coalesced => shared::fill(fill, tier.as_ref(), events).await,
        Some(tier) => shared::fill_alone(fill, tier.as_ref(), events).await,
        None => gate::fetch(fill, events).await,
    }
}

/// Ends the flight with `outcome`; a copy read from L2 within its
/// stale-while-revalidate window answers stale, and one refresh starts
/// once the flight has ended.
fn settle(
    fill: &FillRequest,
    permit: Option<Permit<FillOutcome>>,
    leader: Option<oneshot::Sender<Ended>>,
    outcome: FillOutcome,
) {
    if let FillOutcome::Shared {
        detail: Some(d), ..
    } = &outcome
    {
        tracing::warn!(route = %fill.route.name, key = %fill.primary.loggable(), detail = d.as_str(), "fill failed");
    }
    let refresh_from = match &outcome {
        FillOutcome::FromL2 { entry }
            if entry.state(fill.cache.clock.now()) == EntryState::StaleWhileRevalidate =>
        {
            Some(Arc::clone(entry))
        }
        _ => None,
    };
    finish(fill, permit, leader, outcome);
    if let Some(entry) = refresh_from {
        refresh(&fill.cache, fill.refreshing(entry));
    }
}

/// Every waiter fetches alone: the answer is not theirs to share.
fn release(fill: &FillRequest, permit: Permit<FillOutcome>, reason: PassReason) {
    crate::telemetry::metrics::flight_waiters(fill.primary.loggable(), permit.followers());
    permit.complete(FillOutcome::Pass { reason });
}

/// Gives every waiter and the leader's client the outcome.
fn finish(
    fill: &FillRequest,
    permit: Option<Permit<FillOutcome>>,
    leader: Option<oneshot::Sender<Ended>>,
    outcome: FillOutcome,
) {
    if let Some(p) = permit {
        crate::telemetry::metrics::flight_waiters(fill.primary.loggable(), p.followers());
        p.complete(outcome.clone());
    }
    if let Some(tx) = leader {
        let _ = tx.send(Ended::Outcome(outcome));
    }
}

/// How long a fill nobody waits for runs on before it is cancelled: the
/// herd of a stampede whose first client left arrives within it and still
/// finds the fill under way.
const ABANDON_GRACE: Duration = Duration::from_secs(1);

/// Resolves once nobody has wanted this fill for [`ABANDON_GRACE`]: the
/// leader's client is gone and no follower waits at the end of the grace
/// (the driver stops asking once the fill has committed to storing, or to
/// other instances). Woken by the client's and the followers' going, never
/// by a poll.
async fn abandoned(
    leader: &mut Option<oneshot::Sender<Ended>>,
    permit: Option<&Permit<FillOutcome>>,
) {
    let Some(tx) = leader.as_mut() else {
        return std::future::pending().await;
    };
    tx.closed().await;
    loop {
        if let Some(p) = permit {
            p.unwatched().await;
        }
        tokio::time::sleep(ABANDON_GRACE).await;
        if permit.is_none_or(|p| p.waiting() == 0) {
            return;
        }
    }
}
