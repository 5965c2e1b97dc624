//! GET and HEAD through the cache: look up the variant, serve it fresh,
//! serve it stale while one background refresh runs, or join the key's
//! flight: lead it (spawn the fill and wait for it) or follow it (wait for
//! the leader's outcome, at most the route's lock timeout, then do what the
//! route says). The decisions are corral-core's `miss::Miss`; this module
//! measures what they need and carries them out.

use std::sync::Arc;

use corral_core::{
    CacheStatus, Detail, Digest, EntryState, Forward, Join, PrimaryKey, Role, StoredResponse,
    UriKey, VariantKey, Vary, WaitResult, xfetch,
};
use http::{Method, StatusCode};
use tokio::sync::oneshot;

use crate::app::App;
use crate::cache::fill::{self, FillOutcome, FillRequest, LeaderOutcome};
use crate::cache::respond::{self, Answer};
use crate::config::OnTimeout;
use crate::routes::Route;
use corral_core::head::RequestHead;
use corral_core::miss::{Found, Lookup, Miss, Next, WaitEnd};

/// True when this caller's view of the URI is hit-for-pass: the last
/// answer could not be stored.
pub fn passes(app: &App, route: &Route, ctx: &RequestHead) -> bool {
    let uri = UriKey::new(
        &ctx.host,
        &ctx.path,
        ctx.query.as_deref(),
        &route.query_filter,
    );
    let primary = PrimaryKey::get(&route.name, uri, ctx.tls);
    let identity = route.identity.identify(&ctx.headers);
    app.l1.is_pass(&primary.pass_scope(identity.as_ref()))
}

/// GET and HEAD through the cache; with `body`, a POST the route
/// coalesces (the body, with its Content-Type, is part of the key).
pub async fn serve(
    app: Arc<App>,
    route: Arc<Route>,
    ctx: RequestHead,
    body: Option<bytes::Bytes>,
    mut gate: Option<Arc<crate::limits::Gate>>,
    interim: Option<crate::origin::interim::Sender>,
) -> Answer {
    let head = ctx.method == Method::HEAD;
    let ctx = Arc::new(ctx);
    // The key and (in the fill) the upstream request both come from this
    // one validated head.
    let uri = UriKey::new(
        &ctx.host,
        &ctx.path,
        ctx.query.as_deref(),
        &route.query_filter,
    );
    let primary = match &body {
        Some(b) => {
            // What the body means depends on its type and its coding.
            let mut kind = Vec::new();
            for h in [http::header::CONTENT_TYPE, http::header::CONTENT_ENCODING] {
                for v in ctx.headers.get_all(&h) {
                    kind.extend_from_slice(v.as_bytes());
                    kind.push(b'\n');
                }
                kind.push(0);
            }
            PrimaryKey::post(&route.name, uri, ctx.tls, Some(&kind), b)
        }
        None => PrimaryKey::get(&route.name, uri, ctx.tls),
    };
    // A coalesced POST is keyed on the whole Cookie field unless the route
    // names its identity cookies: see `IdentityRules::identify_post`.
    let identity = match &body {
        Some(_) => route.identity.identify_post(&ctx.headers),
        None => route.identity.identify(&ctx.headers),
    };
    let pass_scope = primary.pass_scope(identity.as_ref());

    let mut miss = Miss::new();
    loop {
        let now = app.clock.now();
        // While the origin is failing for this key, nothing here asks it.
        let backoff = app.l1.active_backoff(&pass_scope, now);
        let vary = app.l1.learned_vary(&primary);
        let values = vary.values(&ctx.headers);
        let shared_key = primary.variant(None, &values);
        let own_key = identity
            .as_ref()
            .map(|id| primary.variant(Some(id), &values));
        let found = lookup(
            &app,
            &primary,
            own_key.as_ref(),
            &shared_key,
            identity.as_ref(),
            &ctx,
        );
        let flight_key = own_key.unwrap_or(shared_key).digest;
        let fwd = match (&found, &vary) {
            (Some(_), _) => Forward::Stale,
            (None, Vary::Headers(_)) => Forward::VaryMiss,
            (None, _) => Forward::UriMiss,
        };
        let fill_request = |stale: Option<Arc<StoredResponse>>| FillRequest {
            app: Arc::clone(&app),
            route: Arc::clone(&route),
            head: Arc::clone(&ctx),
            primary: primary.clone(),
            identity,
            variant: own_key.unwrap_or(shared_key),
            stale: arc_swap::ArcSwapOption::from(stale),
            fwd,
            committed: Default::default(),
            body: body.clone(),
            early: Default::default(),
            declared: Default::default(),
            interim: interim.clone(),
        };

        let seen = found.as_ref().map(|entry| {
            let state = entry.state(now);
            Found {
                state,
                early_refresh: state == EntryState::Fresh
                    && xfetch::roll(
                        now,
                        entry.fresh_until(),
                        entry.fetch_duration(),
                        route.policy.early_refresh_beta,
                    ),
            }
        });
        let lookup = miss.lookup(seen, backoff.is_some(), route.coalesce, || {
            app.l1.is_pass(&pass_scope)
        });
        let coalesce = match (lookup, &found) {
            (Lookup::Fetch { coalesce }, _) => coalesce,
            // Only a copy in hand answers without a fetch.
            (_, None) => route.coalesce,
            (answer, Some(entry)) => {
                let st = match answer {
                    Lookup::Hit { refresh } => {
                        if refresh {
                            refresh_in_background(
                                &app,
                                flight_key,
                                fill_request(Some(Arc::clone(entry))),
                            );
                        }
                        CacheStatus::hit(entry.ttl_secs(now))
                    }
                    Lookup::StaleWhileRevalidate => {
                        crate::telemetry::metrics::stale(Detail::StaleWhileRevalidate);
                        refresh_in_background(
                            &app,
                            flight_key,
                            fill_request(Some(Arc::clone(entry))),
                        );
                        CacheStatus::forward(Forward::Stale)
                            .with_ttl(entry.ttl_secs(now))
                            .with_detail(Detail::StaleWhileRevalidate)
                    }
                    _ => {
                        // The origin failed for this key moments ago: leave
                        // it alone until the back-off ends.
                        crate::telemetry::metrics::stale(Detail::Backoff);
                        crate::telemetry::metrics::origin_skipped(&route.name, "backoff");
                        CacheStatus::forward(Forward::Stale)
                            .with_ttl(entry.ttl_secs(now))
                            .with_detail(Detail::Backoff)
                    }
                };
                return respond::from_entry(entry, &st, now, head, &ctx.headers);
            }
        };
        // The cache cannot answer: the rate limits that spare hits count
        // this request now, once, before it fetches or waits for a fetch.
        if let Some(g) = gate.take()
            && let Err(refused) = g.admit().await
        {
            return refused;
        }
        if !coalesce {
            return lead(fill_request(found), None, head).await;
        }
        let join = Join {
            max_waiters: route.max_waiters,
            after_retirement: miss.after_retirement(),
        };
        let waiter = match app.flights.join(flight_key, join) {
            Role::Leader(permit) => return lead(fill_request(found), Some(permit), head).await,
            Role::Follower(waiter) => waiter,
            Role::Full => {
                let outcome = fill::wait_list_full(&fill_request(found));
                return respond::from_outcome(&outcome, true, app.clock.now(), head, &ctx.headers);
            }
        };
        // Under `on_timeout: fetch`, a follower that times out hands the
        // key to one waiter (itself, if first to look again), and the
        // flight that waiter leads is waited on to its end: its exchange is
        // bounded by the route's `timeouts.total`, and fetching beside it
        // would be the stampede.
        let retire_on_timeout = route.on_timeout == OnTimeout::Fetch;
        let patience = if retire_on_timeout && miss.after_retirement() {
            route.upstream.total + route.lock_timeout
        } else {
            route.lock_timeout
        };
        let waited = waiter.wait_with(patience, route.lock_age, retire_on_timeout);
        let (end, outcome) = match waited.await {
            WaitResult::Done(outcome) => {
                let end = match &outcome {
                    FillOutcome::Stored { entry, .. } => WaitEnd::Stored {
                        fits: entry.matches_vary(&ctx.headers),
                    },
                    FillOutcome::Shared { response, .. } => WaitEnd::Shared {
                        fits: response.matches_vary(&ctx.headers),
                    },
                    FillOutcome::Stale { .. } => WaitEnd::Shared { fits: true },
                    FillOutcome::Streaming { head, .. } => WaitEnd::Stored {
                        fits: head.matches_vary(&ctx.headers),
                    },
                    FillOutcome::Pass { reason } => {
                        tracing::debug!(route = %route.name, key = %primary.loggable(), reason = reason.as_str(), "uncacheable: fetching alone");
                        WaitEnd::Pass
                    }
                };
                (end, Some(outcome))
            }
            WaitResult::Dangling => (WaitEnd::Dangling, None),
            WaitResult::Retired => (WaitEnd::Retired, None),
            WaitResult::TimedOut => (WaitEnd::TimedOut, None),
        };
        match (miss.waited(end), outcome) {
            (Next::Answer, Some(outcome)) => {
                return respond::from_outcome(&outcome, true, app.clock.now(), head, &ctx.headers);
            }
            (Next::LookAgain, _) => continue,
            (Next::OnLockTimeout, _) if retire_on_timeout => {
                let outcome = fill::gave_up(&fill_request(found));
                return respond::from_outcome(&outcome, true, app.clock.now(), head, &ctx.headers);
            }
            (Next::OnLockTimeout, _) => return on_lock_timeout(fill_request(found), head).await,
            (Next::FetchAlone | Next::Answer, _) => {
                return lead(fill_request(found), None, head).await;
            }
        }
    }
}

fn lookup(
    app: &App,
    primary: &PrimaryKey,
    own_key: Option<&VariantKey>,
    shared_key: &VariantKey,
    identity: Option<&corral_core::Identity>,
    ctx: &RequestHead,
) -> Option<Arc<StoredResponse>> {
    if let Some(e) = own_key.and_then(|k| app.l1.get(k, primary.uri()))
        && e.matches_vary(&ctx.headers)
    {
        return Some(e);
    }
    let e = app.l1.get(shared_key, primary.uri())?;
    // An identified caller only gets what the origin marked shareable
    // with callers like it (RFC 9111 §3.5).
    if !e.sharing().admits(identity) || !e.matches_vary(&ctx.headers) {
        return None;
    }
    Some(e)
}

/// Starts a refresh unless one is already under way for this key.
pub(crate) fn refresh_in_background(app: &App, flight_key: Digest, fill: FillRequest) {
    if let Role::Leader(permit) = app.flights.join(flight_key, Join::UNBOUNDED) {
        tokio::spawn(fill::run(fill, Some(permit), None));
    }
}

/// Runs the fill in its own task and waits for it.
async fn lead(
    fill: FillRequest,
    permit: Option<corral_core::Permit<FillOutcome>>,
    head: bool,
) -> Answer {
    let request_headers = fill.head.headers.clone();
    let fill_clock = Arc::clone(&fill.app.clock);
    let (tx, rx) = oneshot::channel();
    tokio::spawn(fill::run(fill, permit, Some(tx)));
    match rx.await {
        Ok(LeaderOutcome::Outcome(o)) => {
            respond::from_outcome(&o, false, fill_clock.now(), head, &request_headers)
        }
        Ok(LeaderOutcome::Stream(answer)) if head => answer.without_body(),
        Ok(LeaderOutcome::Stream(answer)) => answer,
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
        Some(outcome) => respond::from_outcome(
            &outcome,
            false,
            fill.app.clock.now(),
            head,
            &fill.head.headers,
        ),
        None => lead(fill, None, head).await,
    }
}
