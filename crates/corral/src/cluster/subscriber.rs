//! The instance's one pub/sub connection: fill notices for the keys local
//! leaders are waiting on (subscribed on demand, unsubscribed when nobody
//! waits), and the cluster-wide invalidation channel. Waiters subscribe
//! before they re-check L2, so no notice falls between check and wait;
//! a lost notice is covered by the waiters' polling.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use futures_util::StreamExt;
use redis::aio::PubSubSink;
use tokio::sync::broadcast;

use crate::cluster::protocol::{ClusterNotice, FillNotice};
use crate::cluster::redis_link::{Reconnect, RedisLink};

struct Channel {
    tx: broadcast::Sender<FillNotice>,
    watchers: usize,
}

type OnNotice = Box<dyn Fn(ClusterNotice) + Send + Sync>;

/// The shared subscriber and its local registry of waiters.
pub struct Subscriber {
    link: Arc<RedisLink>,
    invalidate_channel: String,
    /// The hash of bans (purges) in force, replayed on every (re)connect.
    bans_key: String,
    on_notice: OnNotice,
    channels: Mutex<HashMap<String, Channel>>,
    sink: Mutex<Option<PubSubSink>>,
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
        tokio::spawn(async move { s.run().await });
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

    async fn run(self: Arc<Self>) {
        let mut retry = Reconnect::new();
        let mut was_connected = false;
        loop {
            let connected = tokio::time::timeout(
                self.link.connect_timeout() * 2,
                self.link.client().get_async_pubsub(),
            )
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
            let mut names: Vec<String> = self
                .channels
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .keys()
                .cloned()
                .collect();
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
            *self.sink.lock().unwrap_or_else(PoisonError::into_inner) = Some(sink);
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
            // Bans issued while this instance was away (or before it
            // started) still apply to what L2 holds.
            if let Ok(bans) = self
                .link
                .query::<Vec<String>>(redis::cmd("HKEYS").arg(&self.bans_key))
                .await
            {
                for b in bans {
                    self.deliver(&b);
                }
            }
            while let Some(msg) = stream.next().await {
                let channel = msg.get_channel_name().to_owned();
                let Ok(payload) = msg.get_payload::<String>() else {
                    continue;
                };
                if channel == self.invalidate_channel {
                    tracing::debug!(payload = %payload, "invalidation notice");
                    self.deliver(&payload);
                    continue;
                }
                if let Some(notice) = FillNotice::decode(&payload) {
                    let map = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
                    if let Some(c) = map.get(&channel) {
                        let _ = c.tx.send(notice);
                    }
                }
            }
            *self.sink.lock().unwrap_or_else(PoisonError::into_inner) = None;
            tracing::warn!("Redis subscriber disconnected; waiters poll until it is back");
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
