//! Large cached bodies kept in sealed memory files, so that answering a hit
//! can hand the kernel the file's pages with sendfile(2) instead of copying
//! the body from the heap into the socket on every answer (the copy was a
//! quarter of the CPU of a 64 KiB hit; nginx's proxy_cache answers from its
//! cache files with sendfile).
//!
//! A sealed body is an ordinary [`Bytes`] pointing into a read-only mapping
//! of a `memfd` whose contents the kernel refuses to change (`F_SEAL_WRITE`,
//! `F_SEAL_SHRINK`, `F_SEAL_GROW`): everything that reads bodies keeps
//! working on it unchanged. [`send`] recognises a slice of such a body and
//! sends it with sendfile; anything else is left to the caller.
//!
//! This is the one module with `unsafe` code (mmap, munmap, sendfile). The
//! soundness argument: the mapping is never written (read-only, and sealed
//! against writes through any descriptor), lives exactly as long as the
//! `Bytes` that own it, and pages the kernel is still sending after the
//! last owner is gone are kept alive by the kernel's own page references.
//! Never hand out a mutable view of a sealed body, and never register
//! memory that is not such a mapping.
#![allow(unsafe_code)]

use bytes::Bytes;

/// Bodies shorter than this stay on the heap: below it the copy is cheaper
/// than a second system call and a page-rounded file.
pub const MIN_SEALED_LEN: usize = corral_core::PAGE_BACKED_BODY;

/// Each sealed body holds one open file descriptor. Unless told otherwise
/// ([`set_max_live`]), at most this many exist at once; past the cap new
/// bodies stay on the heap, so cached bodies can never starve accepting
/// connections of descriptors.
pub const DEFAULT_MAX_LIVE: usize = 256;

/// Caps how many sealed bodies (open descriptors) may exist at once.
pub fn set_max_live(max: usize) {
    imp::set_max_live(max);
}

/// Raises this process's soft limit on open files to its hard limit (as
/// nginx's `worker_rlimit_nofile` does by hand) and returns the soft limit
/// now in force; `None` where it cannot be read.
pub fn raise_open_file_limit() -> Option<u64> {
    imp::raise_open_file_limit()
}

/// `data` copied into a sealed memory file, or `None` when it is short,
/// the cap on live sealed bodies is reached, or the kernel refuses (no memfd, out of
/// descriptors): the caller keeps a heap copy then.
pub fn seal(data: &[u8]) -> Option<Bytes> {
    imp::seal(data)
}

/// `data` copied into a sealed memory file when it is long enough, else
/// left where it is.
pub fn seal_or_keep(data: Bytes) -> Bytes {
    seal(&data).unwrap_or(data)
}

/// Whether `data` lies wholly inside a sealed body.
pub fn is_sealed(data: &[u8]) -> bool {
    imp::locate(data).is_some()
}

/// How many sealed bodies exist right now (a gauge for /metrics, and for
/// tests that check none leak).
pub fn live() -> usize {
    imp::live()
}

/// How many sealed bodies may exist at once (past it, bodies stay on the
/// heap).
pub fn max_live() -> usize {
    imp::max_live()
}

/// Bytes of the sealed bodies alive now: those in L1 and those evicted
/// but still pinned by clients reading them. Memory RSS does not show.
pub fn live_bytes() -> usize {
    imp::live_bytes()
}

/// Sends `data` to the socket `socket` with sendfile(2) when `data` lies
/// inside a sealed body: `Some(result)` then, where the result is what
/// `write` would return (a short count, or `WouldBlock` on a non-blocking
/// socket). `None` when `data` is not sealed: the caller writes it itself.
#[cfg(unix)]
pub fn send(socket: std::os::fd::BorrowedFd<'_>, data: &[u8]) -> Option<std::io::Result<usize>> {
    imp::send(socket, data)
}

#[cfg(target_os = "linux")]
mod imp {
    use std::collections::BTreeMap;
    use std::io::Write;
    use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
    use std::sync::RwLock;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use bytes::Bytes;

    use super::MIN_SEALED_LEN;

    static LIVE: AtomicUsize = AtomicUsize::new(0);
    /// Bytes of every live sealed body: pages the process holds that its
    /// RSS does not show (they are read by sendfile, not through the map).
    static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);
    static MAX_LIVE: AtomicUsize = AtomicUsize::new(super::DEFAULT_MAX_LIVE);
    static CAP_WARNED: AtomicBool = AtomicBool::new(false);
    static WARNED: AtomicBool = AtomicBool::new(false);
    /// Start address of every live mapping → (length, descriptor).
    static REGISTRY: RwLock<BTreeMap<usize, (usize, i32)>> = RwLock::new(BTreeMap::new());

    pub(super) fn live() -> usize {
        LIVE.load(Ordering::Relaxed)
    }

    pub(super) fn live_bytes() -> usize {
        LIVE_BYTES.load(Ordering::Relaxed)
    }

    pub(super) fn set_max_live(max: usize) {
        MAX_LIVE.store(max, Ordering::Relaxed);
    }

    pub(super) fn max_live() -> usize {
        MAX_LIVE.load(Ordering::Relaxed)
    }

    pub(super) fn raise_open_file_limit() -> Option<u64> {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit/setrlimit write to and read from a local struct.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
            return None;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            // SAFETY: as above.
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
                lim.rlim_cur = lim.rlim_max;
            }
        }
        #[allow(clippy::unnecessary_cast)] // rlim_t is not u64 everywhere
        Some(lim.rlim_cur as u64)
    }

    /// A read-only shared mapping of a sealed memfd.
    struct Mapping {
        ptr: *const u8,
        len: usize,
        fd: OwnedFd,
    }

    // SAFETY: the mapping is immutable for its whole life (read-only and
    // sealed), so shared references to it from any thread are sound.
    unsafe impl Send for Mapping {}
    unsafe impl Sync for Mapping {}

    impl AsRef<[u8]> for Mapping {
        fn as_ref(&self) -> &[u8] {
            // SAFETY: `ptr` is a live PROT_READ mapping of `len` bytes whose
            // contents cannot change (F_SEAL_WRITE), unmapped only in Drop.
            unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
        }
    }

    impl Drop for Mapping {
        fn drop(&mut self) {
            // Unregister first: once unmapped, the address may be reused.
            if let Ok(mut r) = REGISTRY.write() {
                r.remove(&(self.ptr as usize));
            }
            // SAFETY: unmapping exactly what mmap returned; no `&[u8]` into
            // it can outlive this owner (Bytes borrows end before its drop).
            unsafe {
                libc::munmap(self.ptr as *mut libc::c_void, self.len);
            }
            LIVE.fetch_sub(1, Ordering::Relaxed);
            LIVE_BYTES.fetch_sub(self.len, Ordering::Relaxed);
        }
    }

    fn refused(what: &str, err: std::io::Error) -> Option<Bytes> {
        if !WARNED.swap(true, Ordering::Relaxed) {
            tracing::warn!(error = %err, "{what} failed: large bodies stay on the heap and are copied into each answer");
        }
        None
    }

    pub(super) fn seal(data: &[u8]) -> Option<Bytes> {
        if data.len() < MIN_SEALED_LEN {
            return None;
        }
        if LIVE.load(Ordering::Relaxed) >= MAX_LIVE.load(Ordering::Relaxed) {
            if !CAP_WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    max = MAX_LIVE.load(Ordering::Relaxed),
                    "as many sealed bodies as the descriptor budget allows: further large bodies stay on the heap"
                );
            }
            return None;
        }
        // SAFETY: a plain system call on a NUL-terminated name.
        let raw = unsafe {
            libc::memfd_create(
                c"corral-body".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if raw < 0 {
            return refused("memfd_create", std::io::Error::last_os_error());
        }
        // SAFETY: `raw` is a descriptor we just opened and own alone.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let mut file = std::fs::File::from(fd);
        if let Err(e) = file.write_all(data) {
            return refused("writing a memfd", e);
        }
        let fd = OwnedFd::from(file);
        let seals =
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on a descriptor we own.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
            return refused("sealing a memfd", std::io::Error::last_os_error());
        }
        // SAFETY: a fresh read-only shared mapping of the whole sealed file.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                data.len(),
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return refused("mapping a memfd", std::io::Error::last_os_error());
        }
        let mapping = Mapping {
            ptr: ptr as *const u8,
            len: data.len(),
            fd,
        };
        LIVE.fetch_add(1, Ordering::Relaxed);
        LIVE_BYTES.fetch_add(data.len(), Ordering::Relaxed);
        match REGISTRY.write() {
            Ok(mut r) => {
                r.insert(ptr as usize, (mapping.len, mapping.fd.as_raw_fd()));
            }
            Err(_) => return Some(Bytes::copy_from_slice(data)),
        }
        Some(Bytes::from_owner(mapping))
    }

    /// The descriptor and offset of `data` when it lies wholly inside a
    /// live sealed mapping.
    pub(super) fn locate(data: &[u8]) -> Option<(i32, usize)> {
        if data.len() < MIN_SEALED_LEN || LIVE.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let start = data.as_ptr() as usize;
        let r = REGISTRY.read().ok()?;
        let (&base, &(len, fd)) = r.range(..=start).next_back()?;
        let offset = start - base;
        (offset + data.len() <= len).then_some((fd, offset))
    }

    pub(super) fn send(socket: BorrowedFd<'_>, data: &[u8]) -> Option<std::io::Result<usize>> {
        let (fd, offset) = locate(data)?;
        let mut off = offset as libc::off_t;
        // SAFETY: `fd` belongs to the mapping `data` points into, which
        // stays alive while the caller holds `data`; sendfile only reads it.
        let n = unsafe { libc::sendfile(socket.as_raw_fd(), fd, &mut off, data.len()) };
        Some(if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        })
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use bytes::Bytes;

    pub(super) fn live() -> usize {
        0
    }
    pub(super) fn live_bytes() -> usize {
        0
    }
    pub(super) fn set_max_live(_: usize) {}
    pub(super) fn max_live() -> usize {
        0
    }
    pub(super) fn raise_open_file_limit() -> Option<u64> {
        None
    }
    pub(super) fn seal(_: &[u8]) -> Option<Bytes> {
        None
    }
    pub(super) fn locate(_: &[u8]) -> Option<(i32, usize)> {
        None
    }
    #[cfg(unix)]
    pub(super) fn send(_: std::os::fd::BorrowedFd<'_>, _: &[u8]) -> Option<std::io::Result<usize>> {
        None
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsFd;

    fn body(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn short_bodies_stay_on_the_heap() {
        assert!(seal(&body(MIN_SEALED_LEN - 1)).is_none());
        let kept = seal_or_keep(Bytes::from(body(100)));
        assert!(!is_sealed(&kept));
    }

    #[test]
    fn a_sealed_body_reads_back_and_is_released() {
        let data = body(70_000);
        let sealed = seal(&data).expect("memfd works on Linux");
        assert_eq!(&sealed[..], &data[..]);
        assert!(is_sealed(&sealed));
        assert!(is_sealed(&sealed[10..MIN_SEALED_LEN + 10]));
        assert!(live() >= 1);
        // A copy of the same bytes elsewhere is not sealed.
        let copy = data.clone();
        assert!(!is_sealed(&copy));
        let clone = sealed.clone();
        drop(sealed);
        assert!(is_sealed(&clone), "alive while any Bytes owns it");
        drop(clone);
    }

    #[test]
    fn send_writes_exactly_the_slice() {
        let data = body(200_000);
        let sealed = seal(&data).expect("sealed");
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let reader = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            let mut got = Vec::new();
            s.read_to_end(&mut got).expect("read");
            got
        });
        let out = TcpStream::connect(addr).expect("connect");
        let part = &sealed[1000..150_000];
        let mut sent = 0;
        while sent < part.len() {
            let n = send(out.as_fd(), &part[sent..])
                .expect("recognised as sealed")
                .expect("sendfile");
            assert!(n > 0);
            sent += n;
        }
        drop(out);
        let got = reader.join().expect("reader");
        assert_eq!(got.len(), part.len());
        assert!(got == data[1000..150_000]);
    }

    #[test]
    fn send_declines_unsealed_bytes() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let out = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        assert!(send(out.as_fd(), &body(70_000)).is_none());
    }
}
