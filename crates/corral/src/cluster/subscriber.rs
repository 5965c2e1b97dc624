//! The instance's one pub/sub connection: the fleet's fill notices (a
//! fixed set of channels, `Layout::notice_channels`, subscribed once per
//! connection and kept, so a fill costs Redis no SUBSCRIBE) and the
//! cluster-wide invalidation channel. A notice names its variant; local
//! waiters register for a variant here, in memory, before they read L2, so
//! no notice falls between read and wait. A notice for a variant nobody
//! here waits on is dropped after one map lookup, unverified; one that is
//! waited on is checked against its seal first. A lost notice is covered
//! by the waiter's one read at the end of a lease window.
//!
//! One node (or the master Sentinel names): a RESP2 pub/sub connection of
//! its own, reconnected when it drops or Sentinel names another master. A
//! Cluster: the cluster connection's RESP3 pushes; fill notices are sharded
//! (`SSUBSCRIBE`, on the node that owns the notice channel's slot, so a
//! notice never crosses the cluster bus), the invalidation channel is classic (every
//! instance hears it, whichever node it is subscribed on); the cluster
//! client resubscribes after a failover or a slot move.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use futures_util::StreamExt;
use redis::{PushKind, Value};
use tokio::sync::broadcast;

use crate::cluster::protocol::{
    ClusterNotice, FillNotice, LOG_AFTER, LOG_HEAD, LOG_REPLAY_MAX, Layout, LogId,
    split_fill_notice, split_logged,
};
use crate::cluster::redis_link::{Reconnect, RedisLink};
use crate::cluster::trust::Trust;
use corral_core::callers::peer_auth::Record;

struct Channel {
    tx: broadcast::Sender<FillNotice>,
    watchers: usize,
}

type OnNotice = Box<dyn Fn(ClusterNotice) + Send + Sync>;

/// Where this instance stands in the invalidation log.
#[derive(Debug, Default)]
struct LogPlace {
    /// The log's epoch at the last catch-up; `None` before the first.
    epoch: Option<String>,
    /// The newest logged notice applied here.
    last: LogId,
}

/// The shared subscriber and its local registry of waiters.
pub struct Subscriber {
    link: Arc<RedisLink>,
    invalidate_channel: String,
    /// The fill notice channels, subscribed on every (re)connect.
    notice_channels: Vec<String>,
    /// The hash of bans (purges) in force, replayed on every (re)connect.
    bans_key: String,
    log_key: String,
    epoch_key: String,
    on_notice: OnNotice,
    /// Checks each notice's seal before it is decoded.
    trust: Arc<Trust>,
    /// The local waiters, by the variant they wait on.
    channels: Mutex<HashMap<String, Channel>>,
    log: Mutex<LogPlace>,
}

/// How a catch-up on the invalidation log went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CaughtUp {
    /// The first subscription: nothing held could have missed a notice.
    Placed,
    /// Every notice of the gap replayed (how many).
    Replayed(usize),
    /// The log could not cover the gap: everything held is unverified.
    Lost,
}

impl Subscriber {
    pub fn start(
        link: Arc<RedisLink>,
        layout: &Layout,
        trust: Arc<Trust>,
        on_notice: OnNotice,
    ) -> Arc<Self> {
        let sub = Arc::new(Subscriber {
            link,
            invalidate_channel: layout.invalidate_channel(),
            notice_channels: layout.notice_channels(),
            bans_key: layout.bans_key(),
            log_key: layout.log_key(),
            epoch_key: layout.epoch_key(),
            on_notice,
            trust,
            channels: Mutex::new(HashMap::new()),
            log: Mutex::new(LogPlace::default()),
        });
        let s = Arc::clone(&sub);
        tokio::spawn(async move {
            if s.link.is_cluster() {
                s.run_cluster().await
            } else {
                s.run().await
            }
        });
        sub
    }

    /// Decodes one payload of the invalidation channel (or the bans hash,
    /// or the log) and hands it on; a payload corral does not write is
    /// logged, not applied. A logged notice moves this instance's place
    /// in the log.
    fn deliver(&self, payload: &str) {
        let (id, notice) = split_logged(payload);
        self.apply(id, notice);
    }

    /// Applies one notice, moving this instance's place in the log to
    /// `id` (a logged notice's).
    fn apply(&self, id: Option<LogId>, notice: &str) {
        if let Some(id) = id {
            let mut place = self.log.lock().unwrap_or_else(PoisonError::into_inner);
            place.last = place.last.max(id);
        }
        // A notice another instance did not seal (anyone who can publish
        // on the channel or write the log or the bans hash) is not applied:
        // it could drop or ban what everyone is served.
        let Some(notice) = self
            .trust
            .open_text(Record::Notice, &self.invalidate_channel, notice)
        else {
            return;
        };
        match ClusterNotice::decode(notice) {
            // A ban's instant is on Redis's clock: onto this host's.
            Some(ClusterNotice::Ban(ban)) => {
                (self.on_notice)(ClusterNotice::Ban(corral_core::Ban {
                    at: self.link.clock_shift().to_local(ban.at),
                    ..ban
                }))
            }
            Some(notice) => (self.on_notice)(notice),
            None => tracing::warn!(notice, "ignoring a malformed cluster notice"),
        }
    }

    /// Called once subscribed to the invalidation channel again: replays
    /// from the log what was published while this instance was not
    /// subscribed. When the log cannot tell (Redis lost it: a restart
    /// without persistence, a flush; it was trimmed past this instance's
    /// place; it cannot be read), every entry held is unverified: kept
    /// and served, and revalidated at a paced rate, rather than dropped
    /// by every instance at once.
    async fn catch_up<C: redis::aio::ConnectionLike + Send>(&self, conn: &mut C) -> CaughtUp {
        let (known, from) = {
            let place = self.log.lock().unwrap_or_else(PoisonError::into_inner);
            (place.epoch.clone(), place.last)
        };
        let deadline = self.link.connect_timeout();
        let fresh_epoch = format!("{:032x}", rand::random::<u128>());
        let head = tokio::time::timeout(
            deadline,
            LOG_HEAD
                .key(&self.epoch_key)
                .key(&self.log_key)
                .arg(&fresh_epoch)
                .invoke_async::<(String, String)>(conn),
        )
        .await;
        let (epoch, newest) = match head {
            Ok(Ok((epoch, newest))) => {
                self.link.answered_again();
                (epoch, LogId::parse(&newest).unwrap_or_default())
            }
            Ok(Err(e)) => return self.lost(known.is_some(), &format!("reading it failed: {e}")),
            Err(_) => return self.lost(known.is_some(), "reading it timed out"),
        };
        let from = match known {
            None => {
                let mut place = self.log.lock().unwrap_or_else(PoisonError::into_inner);
                place.epoch = Some(epoch);
                place.last = place.last.max(newest);
                return CaughtUp::Placed;
            }
            Some(known) if known == epoch => from,
            Some(_) => {
                // Redis lost its data: what was published before is gone.
                // Unverify what is held, then replay what the new log has
                // (published since Redis came back: those are certain).
                self.lost(true, "Redis lost it (restarted empty or flushed)");
                LogId::default()
            }
        };
        let rows = tokio::time::timeout(
            deadline,
            LOG_AFTER
                .key(&self.log_key)
                .arg(from.to_string())
                .arg(LOG_REPLAY_MAX + 1)
                .invoke_async::<Vec<Value>>(conn),
        )
        .await;
        let rows = match rows {
            Ok(Ok(rows)) => rows,
            Ok(Err(e)) => return self.lost(true, &format!("reading it failed: {e}")),
            Err(_) => return self.lost(true, "reading it timed out"),
        };
        let kept = matches!(rows.first(), Some(Value::Int(1)));
        let notices: Vec<(Option<LogId>, String)> = rows
            .get(1..)
            .unwrap_or_default()
            .chunks(2)
            .filter_map(|pair| Some((LogId::parse(&text(pair.first()?)?), text(pair.get(1)?)?)))
            .collect();
        {
            let mut place = self.log.lock().unwrap_or_else(PoisonError::into_inner);
            place.epoch = Some(epoch);
            place.last = place.last.max(newest);
        }
        if !kept || notices.len() as u64 > LOG_REPLAY_MAX {
            return self.lost(true, "it was trimmed past this instance's place");
        }
        for (id, notice) in &notices {
            self.apply(*id, notice);
        }
        crate::telemetry::metrics::invalidation_log_replayed(notices.len());
        if !notices.is_empty() {
            tracing::info!(
                replayed = notices.len(),
                "resubscribed: replayed the invalidations published meanwhile"
            );
        }
        CaughtUp::Replayed(notices.len())
    }

    /// The log cannot cover a gap: unverify everything held (when anything
    /// could have missed a notice), logged once per gap.
    fn lost(&self, held: bool, why: &str) -> CaughtUp {
        if held {
            tracing::warn!(
                why,
                "the invalidation log cannot cover the time this instance was not subscribed: every entry held is now unverified (served, and revalidated at redis.resync_rate)"
            );
            crate::telemetry::metrics::invalidation_log_lost();
            (self.on_notice)(ClusterNotice::Unverify);
        }
        CaughtUp::Lost
    }

    /// Hands a fill notice to the local waiters of the variant it names,
    /// if any wait here (else it is dropped unverified), once its seal
    /// verifies.
    fn fill(&self, payload: &str) {
        let Some((name, sealed)) = split_fill_notice(payload) else {
            return;
        };
        let tx = {
            let map = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
            match map.get(name) {
                Some(c) => c.tx.clone(),
                None => return,
            }
        };
        let notice = self
            .trust
            .open_text(Record::Notice, name, sealed)
            .and_then(FillNotice::decode);
        if let Some(notice) = notice {
            let _ = tx.send(notice);
        }
    }

    /// Bans issued while this instance was away (or before it started)
    /// still apply to what L2 holds.
    async fn replay_bans(&self) {
        if let Ok(bans) = self
            .link
            .query::<Vec<String>>(redis::cmd("HKEYS").arg(&self.bans_key))
            .await
        {
            for b in bans {
                self.deliver(&b);
            }
        }
    }

    async fn run(self: Arc<Self>) {
        let mut retry = Reconnect::new();
        let mut was_connected = false;
        let mut epochs = self.link.epochs();
        loop {
            epochs.borrow_and_update();
            let Some(client) = self.link.node_client() else {
                // Sentinel has not named a master yet.
                if epochs.changed().await.is_err() {
                    return;
                }
                continue;
            };
            let connected =
                tokio::time::timeout(self.link.connect_timeout() * 2, client.get_async_pubsub())
                    .await;
            let pubsub = match connected {
                Ok(Ok(p)) => p,
                _ => {
                    retry.wait().await;
                    continue;
                }
            };
            retry.reset();
            let (mut sink, mut stream) = pubsub.split();
            let mut names = self.notice_channels.clone();
            names.push(self.invalidate_channel.clone());
            match tokio::time::timeout(self.link.connect_timeout(), sink.subscribe(&names)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "Redis subscribe failed; reconnecting");
                    retry.wait().await;
                    continue;
                }
                Err(_) => {
                    tracing::warn!("Redis subscribe timed out; reconnecting");
                    continue;
                }
            }
            tracing::debug!(channels = names.len(), "subscribed");
            tracing::info!("Redis subscriber connected");
            // Notices published while this instance was not subscribed
            // are replayed from the log, on a connection of their own (not
            // held back by the command connection's breaker, which a
            // restart has likely opened).
            let caught = match tokio::time::timeout(
                self.link.connect_timeout(),
                client.get_multiplexed_async_connection(),
            )
            .await
            {
                Ok(Ok(mut conn)) => self.catch_up(&mut conn).await,
                _ => self.lost(was_connected, "no connection to read it on"),
            };
            tracing::debug!(?caught, "invalidation log");
            was_connected = true;
            self.replay_bans().await;
            loop {
                let msg = tokio::select! {
                    msg = stream.next() => msg,
                    _ = epochs.changed() => {
                        // Sentinel named another master: subscribe there.
                        // The command connection (re)connecting to this
                        // same node is no reason to.
                        let same = self.link.node_client().is_some_and(|c| {
                            c.get_connection_info().addr() == client.get_connection_info().addr()
                        });
                        if same {
                            continue;
                        }
                        None
                    }
                };
                let Some(msg) = msg else { break };
                let channel = msg.get_channel_name().to_owned();
                let Ok(payload) = msg.get_payload::<String>() else {
                    continue;
                };
                if channel == self.invalidate_channel {
                    tracing::debug!(payload = %payload, "invalidation notice");
                    self.deliver(&payload);
                    continue;
                }
                self.fill(&payload);
            }
            drop(sink);
            tracing::warn!(
                "Redis subscriber disconnected; waiters read once per lease window until it is back"
            );
        }
    }

    /// Cluster mode: subscribes on the cluster connection once it exists
    /// and reads its pushes. The client resubscribes by itself after a
    /// node's connection drops; what was published meanwhile is replayed
    /// from the log, and the bans, once it has.
    async fn run_cluster(self: Arc<Self>) {
        let Some(mut pushes) = self.link.take_pushes() else {
            return;
        };
        let mut epochs = self.link.epochs();
        let mut conn = loop {
            if let Some(c) = self.link.cluster_connection() {
                break c;
            }
            if epochs.changed().await.is_err() {
                return;
            }
        };
        let sharded = self.link.sharded();
        let mut retry = Reconnect::new();
        loop {
            match tokio::time::timeout(
                self.link.connect_timeout(),
                conn.subscribe(&self.invalidate_channel),
            )
            .await
            {
                Ok(Ok(())) => break,
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "Redis Cluster subscribe failed; retrying")
                }
                Err(_) => tracing::warn!("Redis Cluster subscribe timed out; retrying"),
            }
            retry.wait().await;
        }
        // Without sharded pub/sub nobody publishes fill notices: waiters
        // read once per lease window.
        if sharded {
            for channel in &self.notice_channels {
                let subscribed =
                    tokio::time::timeout(self.link.connect_timeout(), conn.ssubscribe(channel))
                        .await;
                if !matches!(subscribed, Ok(Ok(()))) {
                    tracing::warn!(
                        channel,
                        "Redis Cluster SSUBSCRIBE failed; its waiters read once per lease window"
                    );
                }
            }
        }
        tracing::info!(sharded, "Redis Cluster subscriber connected");
        let mut log_conn = conn;
        let caught = self.catch_up(&mut log_conn).await;
        tracing::debug!(?caught, "invalidation log");
        self.replay_bans().await;
        let mut gap = false;
        while let Some(push) = pushes.recv().await {
            match push.kind {
                PushKind::Message | PushKind::SMessage => {
                    let (Some(channel), Some(payload)) = (
                        push.data.first().and_then(text),
                        push.data.get(1).and_then(text),
                    ) else {
                        continue;
                    };
                    if channel == self.invalidate_channel {
                        tracing::debug!(payload = %payload, "invalidation notice");
                        self.deliver(&payload);
                    } else {
                        self.fill(&payload);
                    }
                }
                PushKind::Disconnection => {
                    tracing::warn!(
                        "a Redis Cluster node's connection dropped; invalidations published until it is resubscribed are replayed from the log then"
                    );
                    gap = true;
                }
                PushKind::Subscribe | PushKind::SSubscribe if gap => {
                    let caught = self.catch_up(&mut log_conn).await;
                    tracing::info!(?caught, "Redis Cluster subscriber resubscribed");
                    self.replay_bans().await;
                    gap = false;
                }
                _ => {}
            }
        }
    }

    /// Registers a waiter for the notices naming `channel` (a variant's
    /// [`Keys::fill_channel`](crate::cluster::protocol::Keys::fill_channel)):
    /// in memory only, the subscription is the instance's, long-lived.
    pub fn watch(self: &Arc<Self>, channel: String) -> NoticeWatch {
        let rx = {
            let mut map = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
            let c = map.entry(channel.clone()).or_insert_with(|| Channel {
                tx: broadcast::channel(8).0,
                watchers: 0,
            });
            c.watchers += 1;
            c.tx.subscribe()
        };
        NoticeWatch {
            rx,
            channel,
            owner: Arc::clone(self),
        }
    }

    fn unwatch(&self, channel: &str) {
        let mut map = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        match map.get_mut(channel) {
            Some(c) if c.watchers > 1 => c.watchers -= 1,
            Some(_) => {
                map.remove(channel);
            }
            None => {}
        }
    }
}

/// One waiter's interest in a fill channel.
pub struct NoticeWatch {
    rx: broadcast::Receiver<FillNotice>,
    channel: String,
    owner: Arc<Subscriber>,
}

impl NoticeWatch {
    /// The next notice; `None` if the registry went away.
    pub async fn next(&mut self) -> Option<FillNotice> {
        loop {
            match self.rx.recv().await {
                Ok(n) => return Some(n),
                Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}

impl Drop for NoticeWatch {
    fn drop(&mut self) {
        self.owner.unwatch(&self.channel);
    }
}

impl crate::cluster::tier::Notices for NoticeWatch {
    fn next(&mut self) -> futures_util::future::BoxFuture<'_, Option<FillNotice>> {
        Box::pin(NoticeWatch::next(self))
    }
}

/// A push's channel or payload as text.
fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}
