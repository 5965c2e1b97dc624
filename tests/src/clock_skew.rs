//! A corral process whose wall clock is off by a fixed offset, through
//! libfaketime (Debian's `faketime` package) preloaded into it. Only the
//! wall clock moves (`FAKETIME_DONT_FAKE_MONOTONIC`): timers and tokio's
//! clock run true, as on a host whose NTP is wrong.
//!
//! `scripts/test` installs the package when it runs as root and the
//! library is missing. Where it cannot, a test that needs it says so and
//! returns, unless `CORRAL_REQUIRE_FAKETIME=1` (CI), where it fails.

use std::path::PathBuf;

use crate::Proxy;

/// The preloadable library, if installed.
pub fn libfaketime() -> Option<PathBuf> {
    let found = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .map(|dir| dir.path().join("faketime/libfaketime.so.1"))
        .chain([PathBuf::from("/usr/lib/faketime/libfaketime.so.1")])
        .find(|p| p.is_file());
    if found.is_none() {
        assert!(
            std::env::var("CORRAL_REQUIRE_FAKETIME").as_deref() != Ok("1"),
            "libfaketime.so.1 not found and CORRAL_REQUIRE_FAKETIME=1 (Debian: apt-get install faketime)"
        );
        eprintln!("SKIPPED: libfaketime.so.1 not found (Debian: apt-get install faketime)");
    }
    found
}

impl Proxy {
    /// Runs the process with its wall clock `offset` from the host's,
    /// libfaketime's syntax (`"+30s"`, `"-30s"`).
    pub fn wall_clock_offset(self, lib: &std::path::Path, offset: &str) -> Self {
        self.env("LD_PRELOAD", &lib.display().to_string())
            .env("FAKETIME", offset)
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
    }
}
