//! Where the workspace and the `corral` binary live.

use std::path::PathBuf;

/// The workspace root (the parent of this crate's manifest directory).
pub fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

/// Locates the `corral` binary built by `cargo build -p corral`.
///
/// Order: `CORRAL_BIN`; the profile directory of the running test executable
/// (`<target>/<profile>/deps/x` → `<target>/<profile>/corral`), which follows
/// `CARGO_TARGET_DIR` and the profile by construction; then
/// `$CARGO_TARGET_DIR/debug/corral`; then `<workspace>/target/debug/corral`.
/// Panics with the build command when none exists.
pub fn corral_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("CORRAL_BIN") {
        let bin = PathBuf::from(bin);
        assert!(
            bin.is_file(),
            "CORRAL_BIN={} is not a file; run `cargo build -p corral`",
            bin.display()
        );
        return bin;
    }
    let name = format!("corral{}", std::env::consts::EXE_SUFFIX);
    let mut candidates = Vec::new();
    if let Ok(exe) = std::env::current_exe()
        && let Some(profile_dir) = exe.parent().and_then(|deps| deps.parent())
    {
        candidates.push(profile_dir.join(&name));
    }
    if let Some(target) = std::env::var_os("CARGO_TARGET_DIR") {
        let target = PathBuf::from(target);
        let target = if target.is_relative() {
            workspace_root().join(target)
        } else {
            target
        };
        candidates.push(target.join("debug").join(&name));
    }
    candidates.push(workspace_root().join("target").join("debug").join(&name));
    for candidate in &candidates {
        if candidate.is_file() {
            return candidate.clone();
        }
    }
    panic!(
        "the corral binary was not found (looked at {candidates:?}); \
         run `cargo build -p corral` before `cargo test -p corral-tests`, \
         or point CORRAL_BIN at it"
    );
}
