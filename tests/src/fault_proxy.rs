//! A TCP proxy that injects network faults between corral and what it
//! talks to (Redis, an origin), since these machines have no `tc netem`:
//! cut every connection and refuse new ones, accept and then go silent
//! (a half-open peer), or add latency to every chunk each way.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the proxy does with connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Bytes pass (after the configured latency).
    None,
    /// Every open connection is closed; new ones are accepted and closed
    /// at once.
    Cut,
    /// Open connections stop passing bytes, new ones are accepted and
    /// never answered: a peer that went away without a FIN.
    Silent,
}

struct Shared {
    target: SocketAddr,
    fault: watch::Sender<Fault>,
    latency_us: AtomicU64,
    /// Connections held open by [`Fault::Silent`], dropped on a change.
    held: Mutex<Vec<Box<dyn Send>>>,
    accepted: AtomicU64,
}

/// A running proxy; dropping it stops it and closes its connections.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `target`.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port for the fault proxy");
        let addr = listener.local_addr().expect("fault proxy address");
        let shared = Arc::new(Shared {
            target,
            fault: watch::channel(Fault::None).0,
            latency_us: AtomicU64::new(0),
            held: Mutex::new(Vec::new()),
            accepted: AtomicU64::new(0),
        });
        let s = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                s.accepted.fetch_add(1, Ordering::Relaxed);
                let fault = *s.fault.borrow();
                match fault {
                    Fault::Cut => drop(conn),
                    Fault::Silent => s
                        .held
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(Box::new(conn)),
                    Fault::None => {
                        tokio::spawn(forward(conn, Arc::clone(&s)));
                    }
                }
            }
        });
        FaultProxy { addr, shared, task }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::Relaxed)
    }

    /// Sets the fault; any change closes the connections held or cut.
    pub fn set(&self, fault: Fault) {
        self.shared
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        self.shared.fault.send_replace(fault);
    }

    /// Delays every chunk, each way, by `latency`.
    pub fn latency(&self, latency: Duration) {
        let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.shared.latency_us.store(us, Ordering::Relaxed);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.set(Fault::Cut);
    }
}

/// One connection: both directions pumped until either side closes or a
/// fault cuts it (both sockets closed) or silences it (both held open,
/// passing nothing, until the fault changes).
async fn forward(client: TcpStream, shared: Arc<Shared>) {
    let Ok(upstream) = TcpStream::connect(shared.target).await else {
        return;
    };
    let mut faults = shared.fault.subscribe();
    let (mut cr, mut cw) = client.into_split();
    let (mut ur, mut uw) = upstream.into_split();
    let fault = {
        let pumps = async {
            tokio::select! {
                () = pump(&mut cr, &mut uw, &shared) => {}
                () = pump(&mut ur, &mut cw, &shared) => {}
            }
        };
        tokio::select! {
            () = pumps => return,
            f = faults.wait_for(|f| *f != Fault::None) => f.map_or(Fault::Cut, |f| *f),
        }
    };
    if fault == Fault::Silent {
        shared
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Box::new((cr, cw, ur, uw)));
    }
}

async fn pump(
    from: &mut tokio::net::tcp::OwnedReadHalf,
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    shared: &Shared,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let us = shared.latency_us.load(Ordering::Relaxed);
        if us > 0 {
            tokio::time::sleep(Duration::from_micros(us)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
