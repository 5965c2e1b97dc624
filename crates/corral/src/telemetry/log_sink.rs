//! Where log lines go: appended to an in-memory buffer that one writer
//! thread empties into stdout every few milliseconds (or sooner when it
//! fills), as nginx's `access_log ... buffer= flush=` does. A request never
//! makes a system call or waits to log: a stdout that is slow or stalled (a
//! pipe to a log shipper) would otherwise stall every worker that logs.
//! When the buffer reaches its bound, lines are dropped, counted, and
//! reported once there is room again. Never write to stdout elsewhere.

use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, mpsc};
use std::time::Duration;

use tracing_subscriber::fmt::MakeWriter;

/// How long a line may wait in memory before the writer takes it.
pub const FLUSH_EVERY: Duration = Duration::from_millis(20);
/// The writer is woken early once this much is waiting.
const WAKE_AT: usize = 64 * 1024;
/// Lines are dropped past this much waiting (stdout not keeping up).
pub const MAX_PENDING: usize = 8 * 1024 * 1024;

struct Shared {
    pending: Mutex<Vec<u8>>,
    wake: Condvar,
    out: Mutex<Box<dyn Write + Send>>,
    dropped: AtomicU64,
    max_pending: usize,
}

/// The appending side, given to the tracing subscriber.
#[derive(Clone)]
pub struct LogSink {
    shared: Arc<Shared>,
}

static INSTALLED: OnceLock<LogSink> = OnceLock::new();

/// Starts the process's sink over stdout (once) and returns it for the
/// tracing subscriber.
pub fn install() -> io::Result<LogSink> {
    if let Some(sink) = INSTALLED.get() {
        return Ok(sink.clone());
    }
    let sink = LogSink::start(io::stdout(), MAX_PENDING, |dropped, total| {
        tracing::warn!(
            dropped,
            total,
            "log lines dropped: stdout could not keep up"
        );
    })?;
    Ok(INSTALLED.get_or_init(|| sink).clone())
}

/// Lines the process's sink dropped so far (0 without one).
pub fn dropped_total() -> u64 {
    INSTALLED.get().map_or(0, LogSink::dropped)
}

/// Flushes the process's sink; true when there is none.
pub fn flush_installed(within: Duration) -> bool {
    INSTALLED.get().is_none_or(|s| s.flush(within))
}

impl LogSink {
    /// Starts the writer thread over `out`, holding at most `max_pending`
    /// bytes. Once lines were dropped and there is room again, the thread
    /// calls `on_drops(dropped since the last call, dropped in all)`.
    pub fn start<W, F>(out: W, max_pending: usize, on_drops: F) -> io::Result<LogSink>
    where
        W: Write + Send + 'static,
        F: Fn(u64, u64) + Send + 'static,
    {
        let shared = Arc::new(Shared {
            pending: Mutex::new(Vec::with_capacity(WAKE_AT * 2)),
            wake: Condvar::new(),
            out: Mutex::new(Box::new(out)),
            dropped: AtomicU64::new(0),
            max_pending,
        });
        let writer = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("corral-log".into())
            .spawn(move || write_lines(&writer, on_drops))?;
        Ok(LogSink { shared })
    }

    /// Lines dropped so far because the buffer was full.
    pub fn dropped(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }

    /// Writes out everything logged so far, waiting up to `within`; false
    /// if stdout did not take it in time. Called on the way out.
    pub fn flush(&self, within: Duration) -> bool {
        let shared = Arc::clone(&self.shared);
        let (done_tx, done_rx) = mpsc::sync_channel(1);
        // In a thread of its own: a stalled stdout must not hold the exit.
        let spawned = std::thread::Builder::new()
            .name("corral-log-flush".into())
            .spawn(move || {
                write_pending(&shared, &mut Vec::new());
                let _ = done_tx.send(());
            });
        spawned.is_ok() && done_rx.recv_timeout(within).is_ok()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a log lock leaves bytes, not broken invariants.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Swaps the pending bytes out (into `spare`, which comes back empty) and
/// writes them; the output lock keeps batches in order.
fn write_pending(shared: &Shared, spare: &mut Vec<u8>) {
    let mut out = lock(&shared.out);
    std::mem::swap(&mut *lock(&shared.pending), spare);
    if !spare.is_empty() {
        let _ = out.write_all(spare);
        let _ = out.flush();
        spare.clear();
    }
}

/// The writer thread: every FLUSH_EVERY, or when woken by a full buffer.
fn write_lines(shared: &Shared, on_drops: impl Fn(u64, u64)) {
    let mut spare = Vec::with_capacity(WAKE_AT * 2);
    let mut reported = 0u64;
    loop {
        {
            let pending = lock(&shared.pending);
            if pending.len() < WAKE_AT {
                let _ = shared.wake.wait_timeout(pending, FLUSH_EVERY);
            }
        }
        write_pending(shared, &mut spare);
        let now = shared.dropped.load(Ordering::Relaxed);
        if now > reported {
            on_drops(now - reported, now);
            reported = now;
        }
    }
}

/// One event, appended straight into the pending buffer (tracing formats
/// an event into its own buffer and writes it in one call).
pub struct LineWriter<'a> {
    shared: &'a Shared,
}

impl Write for LineWriter<'_> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let mut pending = lock(&self.shared.pending);
        if pending.len() + bytes.len() > self.shared.max_pending {
            self.shared.dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(bytes.len());
        }
        let below = pending.len() < WAKE_AT;
        pending.extend_from_slice(bytes);
        if below && pending.len() >= WAKE_AT {
            self.shared.wake.notify_one();
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for LogSink {
    type Writer = LineWriter<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        LineWriter {
            shared: &self.shared,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[derive(Default)]
    struct GateState {
        open: bool,
        /// A write is blocked on the closed gate.
        stuck: bool,
        written: Vec<u8>,
    }

    /// A stdout that blocks every write until the test opens it.
    #[derive(Clone, Default)]
    struct Gated {
        state: Arc<(Mutex<GateState>, Condvar)>,
    }

    impl Gated {
        fn open(&self) {
            let (lock, cv) = &*self.state;
            lock.lock().expect("lock").open = true;
            cv.notify_all();
        }
        /// Waits (10 s at most) until the writer thread is blocked in a write.
        fn wait_until_stuck(&self) {
            let (lock, cv) = &*self.state;
            let g = lock.lock().expect("lock");
            let (g, _) = cv
                .wait_timeout_while(g, Duration::from_secs(10), |g| !g.stuck)
                .expect("wait");
            assert!(g.stuck, "the writer never reached stdout");
        }
        fn text(&self) -> String {
            String::from_utf8_lossy(&self.state.0.lock().expect("lock").written).into_owned()
        }
    }

    impl Write for Gated {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            let (lock, cv) = &*self.state;
            let mut g = lock.lock().expect("lock");
            if !g.open {
                g.stuck = true;
                cv.notify_all();
            }
            while !g.open {
                g = cv.wait(g).expect("wait");
            }
            g.written.extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn log(sink: &LogSink, line: &str) {
        let mut w = sink.make_writer();
        w.write_all(line.as_bytes()).expect("buffer");
    }

    #[test]
    fn lines_arrive_whole_and_in_order_without_a_flush() {
        let out = Gated::default();
        out.open();
        let sink = LogSink::start(out.clone(), MAX_PENDING, |_, _| {}).expect("thread");
        for i in 0..50 {
            log(&sink, &format!("line {i}\n"));
        }
        let want: String = (0..50).map(|i| format!("line {i}\n")).collect();
        // The writer takes them on its own within FLUSH_EVERY.
        let deadline = Instant::now() + Duration::from_secs(10);
        while out.text() != want {
            assert!(Instant::now() < deadline, "{}", out.text());
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(sink.dropped(), 0);
    }

    #[test]
    fn a_stalled_stdout_costs_lines_not_waiting() {
        let out = Gated::default();
        let notices = Arc::new(Mutex::new(Vec::new()));
        let noted = Arc::clone(&notices);
        // Room for ten 7-byte lines.
        let sink = LogSink::start(out.clone(), 70, move |n, total| {
            noted.lock().expect("lock").push((n, total));
        })
        .expect("thread");
        // stdout is stuck with the writer holding line 0; the buffer takes
        // ten more and logging goes on without blocking, dropping the rest.
        log(&sink, "line 0\n");
        out.wait_until_stuck();
        for i in 1..=100 {
            log(&sink, &format!("l {i:04}\n"));
        }
        assert_eq!(sink.dropped(), 90);
        assert!(
            !sink.flush(Duration::from_millis(50)),
            "flushed through a stuck stdout"
        );
        out.open();
        assert!(sink.flush(Duration::from_secs(10)));
        let want: String = std::iter::once("line 0\n".to_owned())
            .chain((1..=10).map(|i| format!("l {i:04}\n")))
            .collect();
        assert_eq!(out.text(), want);
        let deadline = Instant::now() + Duration::from_secs(10);
        while notices.lock().expect("lock").is_empty() {
            assert!(Instant::now() < deadline, "no drop notice");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(*notices.lock().expect("lock"), [(90, 90)]);
    }
}
