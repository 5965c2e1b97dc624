//! The cross-instance lease: one leader per key across every instance.
//! `SET lease <token> NX PX ttl` takes it; release is compare-and-delete in
//! Lua (never a plain DEL, so a leader whose lease expired cannot delete its
//! successor's); a watchdog extends it with compare-and-pexpire while a slow
//! fetch runs, and after each extension tells the waiters it is alive (a
//! fill notice, [`FillNotice::Alive`](crate::cluster::protocol::FillNotice)).
//! A dead leader stops extending, its lease expires within one lease
//! window, and its waiters, who hear nothing for that long, read once.

use std::sync::Arc;
use std::time::Duration;

use crate::cluster::protocol::{
    LEASE_ACQUIRE, LEASE_AGE, LEASE_EXTEND, LEASE_RELEASE, LEASE_TAKE_OVER, lease_held,
    lease_token, millis,
};
use crate::cluster::redis_link::{L2Error, RedisLink, arg};

/// A held lease. Dropping it without `release` releases it in the background.
pub struct Lease {
    link: Arc<RedisLink>,
    key: String,
    token: String,
    ttl: Duration,
    released: bool,
    /// Sent after each extension: the waiters' proof that the holder lives.
    ping: Option<redis::Cmd>,
}

/// Tries to take the lease at `key`; `Ok(None)` when another holds it.
pub async fn acquire(
    link: &Arc<RedisLink>,
    key: String,
    ttl: Duration,
) -> Result<Option<Lease>, L2Error> {
    let won: Option<String> = link
        .script(
            &LEASE_ACQUIRE,
            &[&key],
            &[arg(lease_token()), arg(millis(ttl))],
        )
        .await?;
    Ok(won.map(|token| Lease {
        link: Arc::clone(link),
        key,
        token,
        ttl,
        released: false,
        ping: None,
    }))
}

/// Takes the lease over from a holder that still holds `seen`; `None`
/// when it changed meanwhile (another instance took it first).
pub async fn take_over(
    link: &Arc<RedisLink>,
    key: String,
    seen: &str,
    ttl: Duration,
) -> Result<Option<Lease>, L2Error> {
    let won: Option<String> = link
        .script(
            &LEASE_TAKE_OVER,
            &[&key],
            &[arg(seen), arg(lease_token()), arg(millis(ttl))],
        )
        .await?;
    Ok(won.map(|token| Lease {
        link: Arc::clone(link),
        key,
        token,
        ttl,
        released: false,
        ping: None,
    }))
}

/// The lease's value and how long it has been held, both read from Redis
/// (its clock, in the same script); `None` when the lease is free. A
/// value without a time (an older corral's) reads as just taken.
pub async fn age(link: &RedisLink, key: &str) -> Result<Option<(String, Duration)>, L2Error> {
    let got: Option<(String, u64)> = link.script(&LEASE_AGE, &[key], &[]).await?;
    Ok(got.map(|(value, now_ms)| {
        let held = lease_held(&value, now_ms).unwrap_or_default();
        (value, held)
    }))
}

impl Lease {
    /// A lease already written with `value` (by [`READ_OR_LEASE`]
    /// (crate::cluster::protocol::READ_OR_LEASE), with the first read).
    pub fn won(link: &Arc<RedisLink>, key: String, value: String, ttl: Duration) -> Self {
        Lease {
            link: Arc::clone(link),
            key,
            token: value,
            ttl,
            released: false,
            ping: None,
        }
    }

    /// Sends `ping` after each extension of the lease.
    pub fn pinging(mut self, ping: Option<redis::Cmd>) -> Self {
        self.ping = ping;
        self
    }

    /// Releases the lease if it is still ours; `Ok(false)` when it was not.
    pub async fn release(mut self) -> Result<bool, L2Error> {
        self.released = true;
        release(&self.link, &self.key, &self.token).await
    }

    /// Keeps the lease alive every ttl/3 until the returned guard drops, or
    /// until the lease turns out lost.
    pub fn watchdog(&self) -> Watchdog {
        let link = Arc::clone(&self.link);
        let key = self.key.clone();
        let token = self.token.clone();
        let ttl = self.ttl;
        let ping = self.ping.clone();
        let task = tokio::spawn(async move {
            let every = (ttl / 3).max(Duration::from_millis(10));
            loop {
                tokio::time::sleep(every).await;
                match link
                    .script::<i64>(&LEASE_EXTEND, &[&key], &[arg(&token), arg(millis(ttl))])
                    .await
                {
                    Ok(1) => {
                        // Best effort: a waiter that misses it reads once
                        // and finds the lease still held.
                        if let Some(ping) = &ping {
                            let _ = link.query::<()>(ping).await;
                        }
                    }
                    Ok(_) => {
                        tracing::warn!(lease = %key, "lease lost while the fetch was still running");
                        return;
                    }
                    // A passing Redis error: try again next tick, the lease
                    // still has up to two thirds of its life.
                    Err(e) => tracing::debug!(lease = %key, error = %e, "lease extension failed"),
                }
            }
        });
        Watchdog(task)
    }
}

async fn release(link: &RedisLink, key: &str, token: &str) -> Result<bool, L2Error> {
    let n: i64 = link.script(&LEASE_RELEASE, &[key], &[arg(token)]).await?;
    Ok(n == 1)
}

impl Drop for Lease {
    fn drop(&mut self) {
        if !self.released {
            let link = Arc::clone(&self.link);
            let key = std::mem::take(&mut self.key);
            let token = std::mem::take(&mut self.token);
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = release(&link, &key, &token).await;
                });
            }
        }
    }
}

/// Stops the watchdog when dropped.
pub struct Watchdog(tokio::task::JoinHandle<()>);

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl crate::cluster::tier::HeldLease for Lease {
    fn keep_alive(&self) -> Box<dyn Send> {
        Box::new(self.watchdog())
    }
    fn release(self: Box<Self>) -> futures_util::future::BoxFuture<'static, Result<bool, L2Error>> {
        Box::pin(Lease::release(*self))
    }
    fn name(&self) -> &str {
        &self.key
    }
    fn value(&self) -> &str {
        &self.token
    }
}
