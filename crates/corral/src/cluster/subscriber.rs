//! The instance's one pub/sub connection: fill notices for the keys local
//! leaders are waiting on (subscribed on demand, unsubscribed when nobody
//! waits), and the cluster-wide invalidation channel. Waiters subscribe
//! before they re-check L2, so no notice falls between check and wait;
//! a lost notice is covered by the waiters' polling.
//!
//! One node (or the master Sentinel names): a RESP2 pub/sub connection of
//! its own, reconnected when it drops or Sentinel names another master. A
//! Cluster: the cluster connection's RESP3 pushes; fill notices are sharded
//! (`SSUBSCRIBE`, on the node that owns the key's slot, so a notice never
//! crosses the cluster bus), the invalidation channel is classic (every
//! instance hears it, whichever node it is subscribed on); the cluster
//! client resubscribes after a failover or a slot move.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use futures_util::StreamExt;
use redis::aio::PubSubSink;
use redis::cluster_async::ClusterConnection;
use redis::{PushKind, Value};
use tokio::sync::broadcast;

use crate::cluster::protocol::{ClusterNotice, FillNotice};
use crate::cluster::redis_link::{Reconnect, RedisLink};

struct Channel {
    tx: broadcast::Sender<FillNotice>,
    watchers: usize,
}

type OnNotice = Box<dyn Fn(ClusterNotice) + Send + Sync>;

/// Where subscriptions to fill channels are sent.
#[derive(Clone)]
enum Sink {
    Node(PubSubSink),
    /// `sharded: false`: the servers have no sharded pub/sub; fill notices
    /// are off and waiters poll.
    Cluster {
        conn: ClusterConnection,
        sharded: bool,
    },
}

impl Sink {
    async fn subscribe(&mut self, channel: &str) -> redis::RedisResult<()> {
        match self {
            Sink::Node(s) => s.subscribe(channel).await,
            Sink::Cluster {
                conn,
                sharded: true,
            } => conn.ssubscribe(channel).await,
            Sink::Cluster { .. } => Ok(()),
        }
    }

    async fn unsubscribe(&mut self, channel: &str) -> redis::RedisResult<()> {
        match self {
            Sink::Node(s) => s.unsubscribe(channel).await,
            Sink::Cluster {
                conn,
                sharded: true,
            } => conn.sunsubscribe(channel).await,
            Sink::Cluster { .. } => Ok(()),
        }
    }
}

/// The shared subscriber and its local registry of waiters.
pub struct Subscriber {
    link: Arc<RedisLink>,
    invalidate_channel: String,
    /// The hash of bans (purges) in force, replayed on every (re)connect.
    bans_key: String,
    on_notice: OnNotice,
    channels: Mutex<HashMap<String, Channel>>,
    sink: Mutex<Option<Sink>>,
}

impl Subscriber {
    pub fn start(
        link: Arc<RedisLink>,
        invalidate_channel: String,
        bans_key: String,
        on_notice: OnNotice,
    ) -> Arc<Self> {
        let sub = Arc::new(Subscriber {
            link,
            invalidate_channel,
            bans_key,
            on_notice,
            channels: Mutex::new(HashMap::new()),
            sink: Mutex::new(None),
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

    /// Decodes one payload of the invalidation channel (or the bans hash)
    /// and hands it on; a payload corral does not write is logged, not
    /// applied.
    fn deliver(&self, payload: &str) {
        match ClusterNotice::decode(payload) {
            Some(notice) => (self.on_notice)(notice),
            None => tracing::warn!(payload, "ignoring a malformed cluster notice"),
        }
    }

    /// Hands a fill notice to the local waiters of `channel`.
    fn fill(&self, channel: &str, payload: &str) {
        if let Some(notice) = FillNotice::decode(payload) {
            let map = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(c) = map.get(channel) {
                let _ = c.tx.send(notice);
            }
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

    fn fill_channels(&self) -> Vec<String> {
        self.channels
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .cloned()
            .collect()
    }

    fn set_sink(&self, sink: Option<Sink>) {
        *self.sink.lock().unwrap_or_else(PoisonError::into_inner) = sink;
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
            let mut names = self.fill_channels();
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
            self.set_sink(Some(Sink::Node(sink)));
            tracing::info!("Redis subscriber connected");
            if was_connected {
                // Invalidations sent while we were away are lost: drop
                // everything this instance holds (L2 refills it cheaply).
                tracing::warn!(
                    "resubscribed after a disconnect: dropping L1, invalidations may have been missed"
                );
                (self.on_notice)(ClusterNotice::All);
            }
            was_connected = true;
            self.replay_bans().await;
            loop {
                let msg = tokio::select! {
                    msg = stream.next() => msg,
                    // Sentinel named another master: subscribe there.
                    _ = epochs.changed() => None,
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
                self.fill(&channel, &payload);
            }
            self.set_sink(None);
            tracing::warn!("Redis subscriber disconnected; waiters poll until it is back");
        }
    }

    /// Cluster mode: subscribes on the cluster connection once it exists
    /// and reads its pushes. The client resubscribes by itself after a
    /// node's connection drops; what was published meanwhile is lost, so
    /// L1 is dropped and bans replayed once it has.
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
        let mut sink = Sink::Cluster { conn, sharded };
        for channel in self.fill_channels() {
            let _ = tokio::time::timeout(self.link.op_timeout * 4, sink.subscribe(&channel)).await;
        }
        self.set_sink(Some(sink));
        tracing::info!(sharded, "Redis Cluster subscriber connected");
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
                        self.fill(&channel, &payload);
                    }
                }
                PushKind::Disconnection => {
                    tracing::warn!(
                        "a Redis Cluster node's connection dropped; dropping L1, invalidations may be missed until it is resubscribed"
                    );
                    (self.on_notice)(ClusterNotice::All);
                    gap = true;
                }
                PushKind::Subscribe | PushKind::SSubscribe if gap => {
                    tracing::warn!(
                        "resubscribed after a disconnect: dropping L1, invalidations may have been missed"
                    );
                    (self.on_notice)(ClusterNotice::All);
                    self.replay_bans().await;
                    gap = false;
                }
                _ => {}
            }
        }
    }

    /// Registers interest in `channel` and waits (at most the op timeout)
    /// for Redis to confirm the subscription.
    pub async fn watch(self: &Arc<Self>, channel: String) -> NoticeWatch {
        let rx = {
            let mut map = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
            let c = map.entry(channel.clone()).or_insert_with(|| Channel {
                tx: broadcast::channel(8).0,
                watchers: 0,
            });
            c.watchers += 1;
            c.tx.subscribe()
        };
        let sink = self
            .sink
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(mut sink) = sink {
            // Every watcher waits for a confirmation, not only the first
            // of a channel (which may still be waiting for its own); a
            // repeated SUBSCRIBE is harmless.
            let _ = tokio::time::timeout(self.link.op_timeout * 4, sink.subscribe(&channel)).await;
        }
        NoticeWatch {
            rx,
            channel,
            owner: Arc::clone(self),
        }
    }

    fn unwatch(&self, channel: &str) {
        let last = {
            let mut map = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
            match map.get_mut(channel) {
                Some(c) if c.watchers > 1 => {
                    c.watchers -= 1;
                    false
                }
                Some(_) => {
                    map.remove(channel);
                    true
                }
                None => false,
            }
        };
        if last {
            let sink = self
                .sink
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            if let (Some(mut sink), Ok(rt)) = (sink, tokio::runtime::Handle::try_current()) {
                let channel = channel.to_owned();
                rt.spawn(async move {
                    let _ = sink.unsubscribe(&channel).await;
                });
            }
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
