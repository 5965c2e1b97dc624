//! A fill's driver, the layer under the flight: the task that runs one
//! fill to its end, owning everything it needs. It runs the fetch (through the shared tier when Redis is configured,
//! `shared`, else the gate, `gate`) and hears its events as they happen
//! (a streamed answer handed to the flight and the leader at its head, a
//! committed fill, a pass marker another instance set), cancels a fill
//! nobody wants any more, and ends the flight once for every waiter.

use std::sync::Arc;
use std::time::Duration;

use corral_core::{EntryState, Join, PassReason, Permit, Role};
use tokio::sync::oneshot;

use crate::cache::fill::{Ended, Events, FillEvent, FillOutcome, FillRequest};
use crate::cache::{gate, shared};

/// Starts a refresh unless one is already under way for this key; true
/// when it started.
pub(crate) fn refresh(fill: FillRequest) -> bool {
    let role = fill
        .flight()
        .flights
        .join(fill.variant.digest, Join::UNBOUNDED);
    if let Role::Leader(permit) = role {
        permit.name(fill.primary.shown());
        tokio::spawn(run(fill, Some(permit), None));
        return true;
    }
    false
}

/// Runs a fill to its end. `permit` is `None` for an uncoalesced fetch;
/// `leader` is `None` for a background refresh.
pub(crate) async fn run(
    fill: FillRequest,
    mut permit: Option<Permit<FillOutcome>>,
    mut leader: Option<oneshot::Sender<Ended>>,
) {
    // A fill for a client that went away, with nobody else waiting and
    // nothing committed yet, is cancelled: nobody would get its answer (an
    // HTTP/2 client resetting each stream it opens must not make corral
    // fetch for nobody). A background refresh has no client and runs on.
    let cancellable = leader.is_some();
    let Some(ended) = drive(&fill, &mut permit, &mut leader, cancellable).await else {
        crate::telemetry::metrics::fill_cancelled(fill.route_name());
        return;
    };
    match ended {
        Ended::Outcome(outcome) => settle(&fill, permit, leader, outcome),
        Ended::Stream(reason, response) => {
            if let Some(p) = permit {
                release(fill.primary.loggable(), p, reason);
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
    fill: &FillRequest,
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
    let started = tokio::time::Instant::now();
    let mut fallback = Fallback::of(fill, started);
    // A newer copy the shared tier finds in L2 (one this instance may not
    // have had at all) is the one a hung fetch's callers get.
    let mut offers = fill.stale_offers();
    let mut yielded = false;
    let far = started + fill.origin().total;
    let fetching = fetch(fill, &events, coalesced);
    tokio::pin!(fetching);
    let ended = loop {
        let yield_at = fallback.as_ref().map_or(far, |f| f.at);
        tokio::select! {
            // A fetch that has ended answers with its final outcome (a
            // stored entry serves ranges and conditionals a stream cannot).
            biased;
            ended = &mut fetching => break ended,
            Some(event) = heard.recv() => heard_so_far.hear(event, permit, leader),
            Ok(()) = offers.changed(), if !yielded => {
                if let Some(f) = Fallback::of(fill, started) {
                    fallback = Some(f);
                }
            }
            () = tokio::time::sleep_until(yield_at), if fallback.is_some() && !heard_so_far.streaming => {
                if let Some(f) = fallback.take() {
                    yielded = true;
                    f.answer(permit.as_ref(), leader);
                }
            }
            () = abandoned(leader, permit.as_ref()), if cancellable && !heard_so_far.committed => {
                return None;
            }
        }
    };
    // A pass marker the fetch found as it ended still releases the
    // waiters before the outcome reaches them; a stream it announced is
    // moot now that the whole answer is in.
    // A stream that outgrew the store has no other answer than the one
    // its readers read: heard even now.
    let passed_through = matches!(ended, Ended::Outcome(FillOutcome::Pass { .. }));
    while let Ok(event) = heard.try_recv() {
        match event {
            FillEvent::PassKnown => heard_so_far.hear(event, permit, leader),
            FillEvent::Streaming(_) | FillEvent::Overflowed if passed_through => {
                heard_so_far.hear(event, permit, leader);
            }
            _ => {}
        }
    }
    Some(ended)
}

/// The stale-if-error copy a fill's callers are answered from once its
/// origin has kept them `timeouts.stale_after` (an origin that accepts and
/// never answers would keep them `response_headers`): the fetch goes on
/// in the background, and the answer it gets replaces the copy.
struct Fallback {
    at: tokio::time::Instant,
    entry: Arc<corral_core::StoredResponse>,
    clock: Arc<dyn corral_core::Clock>,
}

impl Fallback {
    /// The copy this fill (which began at `started`) may fall back on, if
    /// any.
    fn of(fill: &FillRequest, started: tokio::time::Instant) -> Option<Self> {
        let clock = fill.clock();
        let entry = fill.stale().filter(|e| e.usable_on_error(clock.now()))?;
        Some(Fallback {
            at: started + fill.origin().stale_after,
            entry,
            clock,
        })
    }

    /// Answers the flight's waiters (and whoever joins it while the fetch
    /// runs on) and the leader's caller from the copy, if it is still
    /// within its stale-if-error window.
    fn answer(
        self,
        permit: Option<&Permit<FillOutcome>>,
        leader: &mut Option<oneshot::Sender<Ended>>,
    ) {
        if !self.entry.usable_on_error(self.clock.now()) {
            return;
        }
        let outcome = FillOutcome::Stale {
            entry: self.entry,
            fwd_status: None,
            detail: corral_core::Detail::StaleIfError,
            failure: None,
        };
        if let Some(p) = permit {
            p.publish(outcome.clone());
        }
        if let Some(tx) = leader.take() {
            let _ = tx.send(Ended::Outcome(outcome));
        }
    }
}

/// What the driver has heard of its fill so far.
#[derive(Default)]
struct Heard {
    /// The key, for the flight's metrics.
    key: String,
    committed: bool,
    streaming: bool,
    /// The body the flight's callers read now, while it streams.
    streamed: Option<Arc<crate::cache::shared_body::SharedBody>>,
}

impl Heard {
    /// True when a streamed answer is to go to the flight: the first, or
    /// one that replaces a body nobody can start reading any more (another
    /// instance's, relayed, that broke off before this fill fetched its own).
    fn takes(&self, outcome: &FillOutcome) -> bool {
        let replaces = self.streamed.as_ref().is_some_and(|b| !b.joinable());
        (!self.streaming || replaces) && matches!(outcome, FillOutcome::Streaming { .. })
    }
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
            FillEvent::Streaming(outcome) if self.takes(&outcome) => {
                self.streaming = true;
                if let FillOutcome::Streaming { body, .. } = &outcome {
                    self.streamed = Some(Arc::clone(body));
                }
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
                    release(&self.key, p, PassReason::HitForPass);
                }
            }
            FillEvent::Overflowed => {
                if let Some(p) = permit.take() {
                    release(&self.key, p, PassReason::TooLarge);
                }
            }
        }
    }
}

/// The fetch itself, through Redis when it is configured: a local flight's
/// leader (`coalesced`) enters the shared tier and its lease; any other
/// fill uses L2 as a cache only, so that a request that chose not to
/// coalesce (or could not) is not coalesced across instances either.
async fn fetch(fill: &FillRequest, events: &Events, coalesced: bool) -> Ended {
    match fill.shared().tier.cloned() {
        // A HEAD's fill takes the variant's lease too, so that a burst of
        // HEADs on every instance is one origin request: the instances
        // that wait on it read what it leaves in L2, which is only ever a
        // whole stored answer (the one it freshened), never its own.
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
        // Once per route and detail, then a count: in an outage every
        // request of the route fails alike (13,628 lines in 35 s before).
        if crate::telemetry::repeats::first_for_route(
            "fill failed",
            fill.route_name(),
            fill.origin().authority.as_str(),
            d.as_str(),
        ) {
            tracing::warn!(route = %fill.route_name(), upstream = %fill.origin().authority, key = %fill.primary.loggable(), detail = d.as_str(), "fill failed");
        }
    }
    let refresh_from = match &outcome {
        FillOutcome::FromL2 { entry, .. }
            if entry.state(fill.now()) == EntryState::StaleWhileRevalidate =>
        {
            Some(Arc::clone(entry))
        }
        _ => None,
    };
    finish(fill, permit, leader, outcome);
    if let Some(entry) = refresh_from {
        refresh(fill.refreshing(entry));
    }
}

/// Every waiter of the flight for `key` fetches alone: the answer is not
/// theirs to share.
fn release(key: &str, permit: Permit<FillOutcome>, reason: PassReason) {
    crate::telemetry::metrics::flight_waiters(key, permit.followers());
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
