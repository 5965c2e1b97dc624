//! The CPU pool: compression, decompression, digest checks and large
//! copies run here, on threads of their own (tokio's blocking threads, at
//! most `server.cpu_threads` jobs at once), never on the threads that
//! serve clients, so a fill's CPU work neither stalls the hits beside it
//! nor counts in the overload signal (which reads the serving threads'
//! busy time only). The pool never refuses a client: work a caller cannot
//! do without (a digest check, a decode its caller needs, the copy into
//! sealed memory) waits for a slot without holding a serving thread;
//! compression, which can be done later, is skipped when every slot is
//! busy (the answer is stored unencoded, its codings made on a later
//! demand: see `cache::demand`).
//!
//! [`Making`] is the set of codings being made on demand (one job per key
//! and coding, however many callers ask).
//!
//! `server.cpu_threads: 0` runs every job inline on the serving thread,
//! as corral did before it had a pool; it exists to measure the
//! difference (`bench/cpu_pool.sh`), not to run with.

use std::collections::HashSet;
#[cfg(test)]
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use corral_core::{Coding, Digest};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// What a job does, for the metrics (`corral_cpu_jobs_total{job}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Job {
    /// A whole body compressed in a coding (when stored, or on demand).
    Compress,
    /// A coding made as a streamed body arrives: holds its slot until
    /// the body ends.
    CompressStream,
    /// An origin-encoded body decoded.
    Decompress,
    /// A body checked against its `Content-Digest` / `Repr-Digest`.
    Digest,
    /// A large body copied into sealed memory.
    Copy,
}

impl Job {
    pub fn as_str(self) -> &'static str {
        match self {
            Job::Compress => "compress",
            Job::CompressStream => "compress-stream",
            Job::Decompress => "decompress",
            Job::Digest => "digest",
            Job::Copy => "copy",
        }
    }
}

/// How a job was run, for the metrics (`corral_cpu_jobs_total{result}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ran {
    /// On the pool.
    Pool,
    /// Every slot busy: not run (compression only, done later).
    Saturated,
    /// On the serving thread (`server.cpu_threads: 0`).
    Inline,
}

impl Ran {
    fn as_str(self) -> &'static str {
        match self {
            Ran::Pool => "pool",
            Ran::Saturated => "saturated",
            Ran::Inline => "inline",
        }
    }
}

/// The bounded pool the cache runs its CPU work on.
#[derive(Debug)]
pub struct CpuPool {
    /// One permit per job that may run at once; `None`: inline.
    slots: Option<Arc<Semaphore>>,
}

/// A slot held for a long job (a coding made as a body streams).
pub struct Slot {
    permit: OwnedSemaphorePermit,
}

impl Slot {
    /// Runs `f` on a thread of the pool, the slot held until it returns.
    pub fn spawn(self, f: impl FnOnce() + Send + 'static) {
        let permit = self.permit;
        tokio::task::spawn_blocking(move || {
            let _busy = Counted::busy();
            f();
            drop(permit);
        });
    }
}

impl CpuPool {
    /// A pool of `threads` slots; 0: every job inline.
    pub fn new(threads: usize) -> Self {
        crate::telemetry::metrics::cpu_threads(threads);
        CpuPool {
            slots: (threads > 0).then(|| Arc::new(Semaphore::new(threads))),
        }
    }

    /// The default size: half the cores (at least one), so that the
    /// serving threads keep the other half while the pool is full.
    pub fn default_threads() -> usize {
        std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
    }

    /// True when jobs run inline, on the serving thread.
    pub fn inline(&self) -> bool {
        self.slots.is_none()
    }

    /// `f` on the pool if a slot is free now; `None` when every slot is
    /// busy (the caller does without: compression only) or the job
    /// panicked.
    pub async fn try_run<R: Send + 'static>(
        &self,
        job: Job,
        f: impl FnOnce() -> R + Send + 'static,
    ) -> Option<R> {
        let Some(slots) = &self.slots else {
            return Some(inline(job, f));
        };
        let Ok(permit) = Arc::clone(slots).try_acquire_owned() else {
            crate::telemetry::metrics::cpu_job(job.as_str(), Ran::Saturated.as_str());
            return None;
        };
        on_pool(job, permit, f).await
    }

    /// `f` on the pool, waiting for a slot (without holding the serving
    /// thread) when every slot is busy; `None` only if the job panicked.
    pub async fn run<R: Send + 'static>(
        &self,
        job: Job,
        f: impl FnOnce() -> R + Send + 'static,
    ) -> Option<R> {
        let Some(slots) = &self.slots else {
            return Some(inline(job, f));
        };
        let permit = {
            let _queued = Counted::queued();
            Arc::clone(slots).acquire_owned().await.ok()?
        };
        on_pool(job, permit, f).await
    }

    /// A slot for a long job, if one is free now (`None` when saturated,
    /// and when jobs run inline: the caller then runs it itself).
    pub fn try_hold(&self, job: Job) -> Option<Slot> {
        let slots = self.slots.as_ref()?;
        match Arc::clone(slots).try_acquire_owned() {
            Ok(permit) => {
                crate::telemetry::metrics::cpu_job(job.as_str(), Ran::Pool.as_str());
                Some(Slot { permit })
            }
            Err(_) => {
                crate::telemetry::metrics::cpu_job(job.as_str(), Ran::Saturated.as_str());
                None
            }
        }
    }
}

fn inline<R>(job: Job, f: impl FnOnce() -> R) -> R {
    crate::telemetry::metrics::cpu_job(job.as_str(), Ran::Inline.as_str());
    let started = Instant::now();
    let r = f();
    crate::telemetry::metrics::cpu_time(job.as_str(), started.elapsed());
    r
}

async fn on_pool<R: Send + 'static>(
    job: Job,
    permit: OwnedSemaphorePermit,
    f: impl FnOnce() -> R + Send + 'static,
) -> Option<R> {
    crate::telemetry::metrics::cpu_job(job.as_str(), Ran::Pool.as_str());
    tokio::task::spawn_blocking(move || {
        let _busy = Counted::busy();
        let started = Instant::now();
        let r = f();
        crate::telemetry::metrics::cpu_time(job.as_str(), started.elapsed());
        drop(permit);
        r
    })
    .await
    .ok()
}

/// A gauge raised by one while this lives: a slot in use
/// (`corral_cpu_busy`), or a job waiting for one (`corral_cpu_queued`, also
/// when its waiter is dropped).
struct Counted(fn(f64));

impl Counted {
    fn busy() -> Self {
        Counted::start(crate::telemetry::metrics::cpu_busy)
    }

    fn queued() -> Self {
        Counted::start(crate::telemetry::metrics::cpu_queued)
    }

    fn start(gauge: fn(f64)) -> Self {
        gauge(1.0);
        Counted(gauge)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        (self.0)(-1.0);
    }
}

/// The codings being made now, by key: a second caller that asks for one
/// meanwhile waits for nothing and starts nothing.
#[derive(Debug, Default)]
pub struct Making {
    keys: Mutex<HashSet<(Digest, Coding)>>,
    /// Codings made so far (for the unit tests; the metric counts them).
    #[cfg(test)]
    pub(crate) made: AtomicUsize,
}

impl Making {
    /// Codings made on demand so far.
    #[cfg(test)]
    pub fn made(&self) -> usize {
        self.made.load(Ordering::Relaxed)
    }

    /// True while a coding is being made.
    #[cfg(test)]
    pub fn busy(&self) -> bool {
        !self
            .keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty()
    }

    /// True when this call claimed the key's coding. Its maker holds the
    /// claim as [`Making::held`] from then on.
    pub(crate) fn claim(&self, key: Digest, coding: Coding) -> bool {
        self.keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((key, coding))
    }

    /// The claim on the key's coding, released when the guard is dropped
    /// (the coding made, given up, or its task unwound by a panic).
    pub(crate) fn held(&self, key: Digest, coding: Coding) -> Claim<'_> {
        Claim {
            making: self,
            key,
            coding,
        }
    }
}

/// A coding being made: released when dropped, however its maker ended.
pub(crate) struct Claim<'a> {
    making: &'a Making,
    key: Digest,
    coding: Coding,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.making
            .keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&(self.key, self.coding));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread")]
    async fn a_full_pool_skips_what_may_wait_and_queues_what_may_not() {
        let pool = CpuPool::new(1);
        let held = pool.try_hold(Job::CompressStream).expect("a free slot");
        // Saturated: compression is left for later, never run inline.
        assert_eq!(pool.try_run(Job::Compress, || 1).await, None);
        // A digest check waits for the slot, and runs once it is free.
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        held.spawn(move || {
            let _ = rx.recv();
        });
        let waiting = pool.run(Job::Digest, || std::thread::current().id());
        tokio::pin!(waiting);
        assert!(futures_util::FutureExt::now_or_never(&mut waiting).is_none());
        tx.send(()).expect("the long job waits");
        let ran_on = tokio::time::timeout(std::time::Duration::from_secs(10), waiting)
            .await
            .expect("ran once the slot was free")
            .expect("no panic");
        assert_ne!(
            ran_on,
            std::thread::current().id(),
            "not on the serving thread"
        );
        assert_eq!(pool.try_run(Job::Compress, || 2).await, Some(2));
    }

    #[test]
    fn a_claim_is_released_even_when_its_maker_panics() {
        let making = Making::default();
        let key = Digest([7; 32]);
        assert!(making.claim(key, Coding::Gzip), "free");
        let claim = making.held(key, Coding::Gzip);
        assert!(!making.claim(key, Coding::Gzip), "held once");
        assert!(making.claim(key, Coding::Br), "per coding");
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _held = claim;
            panic!("a coding task failed");
        }));
        assert!(unwound.is_err());
        assert!(
            making.claim(key, Coding::Gzip),
            "the panicked maker's claim is gone, so the coding can be made"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn no_threads_runs_inline() {
        let pool = CpuPool::new(0);
        let here = std::thread::current().id();
        let ran_on = pool
            .try_run(Job::Compress, || std::thread::current().id())
            .await;
        assert_eq!(ran_on, Some(here));
        assert!(pool.try_hold(Job::CompressStream).is_none());
    }
}
