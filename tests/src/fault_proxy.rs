//! A TCP proxy that injects network faults between corral and what it
//! talks to (Redis, an origin), since these machines have no `tc netem`.
//! Two kinds of fault:
//! - a state: every connection cut (and new ones accepted and closed at
//!   once), or every connection silent (open, passing nothing: a peer that
//!   went away without a FIN);
//! - a [`Noise`] on the bytes that pass: latency with jitter per chunk each
//!   way, a bandwidth cap, a share of chunks on which the connection is
//!   reset (RST), and a share of new connections that go silent at once.
//!
//! - a stall: the replies to a client's next commands that contain a given
//!   pattern are held back for a while (with the replies behind them on
//!   that connection), so that exactly those commands time out.
//!
//! The noise draws from a seeded generator, so a scenario's faults are the
//! same run after run (given the same chunks).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the proxy does with every connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Bytes pass, with the [`Noise`] set.
    None,
    /// Every open connection is closed; new ones are accepted and closed
    /// at once.
    Cut,
    /// Open connections stop passing bytes, new ones are accepted and
    /// never answered.
    Silent,
}

/// Faults on the bytes that pass; all off by default.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Noise {
    /// Added to every chunk, each way.
    pub latency: Duration,
    /// Up to this much more, drawn per chunk.
    pub jitter: Duration,
    /// Bytes per second each way, per connection; 0: no cap.
    pub bandwidth: u64,
    /// The share of chunks (0..=1) on which the connection is reset.
    pub reset: f64,
    /// The share of new connections (0..=1) that go silent at once.
    pub silent: f64,
}

struct Shared {
    target: SocketAddr,
    fault: watch::Sender<Fault>,
    noise: Mutex<Noise>,
    /// Connections held open by a silence, dropped on a change of fault.
    held: Mutex<Vec<Box<dyn Send>>>,
    accepted: AtomicU64,
    resets: AtomicU64,
    seed: AtomicU64,
    stall: Mutex<Option<Stall>>,
}

/// Replies to hold back: those to the next `left` client chunks that
/// contain `pattern`, each for `hold`.
#[derive(Debug, Clone)]
struct Stall {
    pattern: Vec<u8>,
    left: usize,
    hold: Duration,
}

impl Shared {
    fn noise(&self) -> Noise {
        *self.noise.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How long to hold the replies to a client chunk `bytes` (the stall
    /// is used up by it), if at all.
    fn stall_for(&self, bytes: &[u8]) -> Option<Duration> {
        let mut stall = self.stall.lock().unwrap_or_else(PoisonError::into_inner);
        let s = stall.as_mut()?;
        if s.left == 0 || !bytes.windows(s.pattern.len()).any(|w| w == s.pattern) {
            return None;
        }
        s.left -= 1;
        Some(s.hold)
    }

    fn hold(&self, what: Box<dyn Send>) {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(what);
    }
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
            noise: Mutex::new(Noise::default()),
            held: Mutex::new(Vec::new()),
            accepted: AtomicU64::new(0),
            resets: AtomicU64::new(0),
            seed: AtomicU64::new(0x9E37_79B9_7F4A_7C15),
            stall: Mutex::new(None),
        });
        let s = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                s.accepted.fetch_add(1, Ordering::Relaxed);
                let mut rng = Rng::new(s.seed.fetch_add(0x9E37_79B9, Ordering::Relaxed));
                let fault = *s.fault.borrow();
                match fault {
                    Fault::Cut => drop(conn),
                    Fault::Silent => s.hold(Box::new(conn)),
                    Fault::None if rng.chance(s.noise().silent) => s.hold(Box::new(conn)),
                    Fault::None => {
                        tokio::spawn(forward(conn, Arc::clone(&s), rng));
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

    /// Connections reset by the noise so far.
    pub fn resets(&self) -> u64 {
        self.shared.resets.load(Ordering::Relaxed)
    }

    /// Sets the fault; any change closes the connections held silent.
    pub fn set(&self, fault: Fault) {
        self.shared
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        self.shared.fault.send_replace(fault);
    }

    /// Holds back, for `hold`, the replies to the next `times` client
    /// writes that contain `pattern` (a command's name, say: `b"MGET"`),
    /// and on their connection every reply behind them.
    pub fn stall(&self, pattern: &[u8], times: usize, hold: Duration) {
        *self
            .shared
            .stall
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Stall {
            pattern: pattern.to_vec(),
            left: times,
            hold,
        });
    }

    /// Stalls still to come (see [`FaultProxy::stall`]).
    pub fn stalls_left(&self) -> usize {
        self.shared
            .stall
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map_or(0, |s| s.left)
    }

    /// Sets the noise on the bytes that pass (new chunks and connections).
    pub fn noise(&self, noise: Noise) {
        *self
            .shared
            .noise
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = noise;
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.set(Fault::Cut);
    }
}

/// How one direction's pump ended.
enum Ended {
    /// A side closed or failed.
    Closed,
    /// The noise reset the connection.
    Reset,
}

/// One connection: both directions pumped until either side closes, the
/// noise resets it (both sockets closed with RST), or a fault cuts it
/// (closed) or silences it (both held open, passing nothing, until the
/// fault changes).
async fn forward(client: TcpStream, shared: Arc<Shared>, rng: Rng) {
    let Ok(upstream) = TcpStream::connect(shared.target).await else {
        return;
    };
    let mut faults = shared.fault.subscribe();
    let (mut cr, mut cw) = client.into_split();
    let (mut ur, mut uw) = upstream.into_split();
    let mut rng_back = Rng::new(rng.0 ^ 0xA5A5_A5A5);
    let mut rng = rng;
    // Replies are held until then (a stall).
    let held = Mutex::new(None);
    let outcome = {
        let pumps = async {
            tokio::select! {
                e = pump(&mut cr, &mut uw, &shared, &mut rng, Way::Out(&held)) => e,
                e = pump(&mut ur, &mut cw, &shared, &mut rng_back, Way::Back(&held)) => e,
            }
        };
        tokio::select! {
            e = pumps => Ok(e),
            f = faults.wait_for(|f| *f != Fault::None) => Err(f.map_or(Fault::Cut, |f| *f)),
        }
    };
    match outcome {
        Ok(Ended::Closed) => {}
        Ok(Ended::Reset) => {
            shared.resets.fetch_add(1, Ordering::Relaxed);
            for stream in [cr.reunite(cw), ur.reunite(uw)].into_iter().flatten() {
                let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
            }
        }
        Err(Fault::Silent) => shared.hold(Box::new((cr, cw, ur, uw))),
        Err(_) => {}
    }
}

/// Which way a pump carries bytes, with the connection's stall: the
/// client's writes may start one, the replies wait it out.
#[derive(Clone, Copy)]
enum Way<'a> {
    Out(&'a Mutex<Option<tokio::time::Instant>>),
    Back(&'a Mutex<Option<tokio::time::Instant>>),
}

async fn pump(
    from: &mut tokio::net::tcp::OwnedReadHalf,
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    shared: &Shared,
    rng: &mut Rng,
    way: Way<'_>,
) -> Ended {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return Ended::Closed,
            Ok(n) => n,
        };
        let noise = shared.noise();
        if rng.chance(noise.reset) {
            return Ended::Reset;
        }
        let mut delay = noise.latency;
        if !noise.jitter.is_zero() {
            delay += noise.jitter.mul_f64(rng.unit());
        }
        if noise.bandwidth > 0 {
            delay += Duration::from_secs_f64(n as f64 / noise.bandwidth as f64);
        }
        match way {
            Way::Out(held) => {
                if let Some(hold) = shared.stall_for(&buf[..n]) {
                    *held.lock().unwrap_or_else(PoisonError::into_inner) =
                        Some(tokio::time::Instant::now() + hold);
                }
            }
            Way::Back(held) => {
                let until = *held.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some(until) = until {
                    tokio::time::sleep_until(until).await;
                }
            }
        }
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return Ended::Closed;
        }
    }
}

/// xorshift64*: enough for drawing faults, and seeded.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.unit() < p
    }
}
