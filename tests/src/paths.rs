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
    built_bin("corral", "CORRAL_BIN", "cargo build -p corral")
}

/// Locates bench's `demo-origin` binary (what `scripts/demo` runs), built by
/// `cargo build -p corral-bench --bin demo-origin`: `DEMO_ORIGIN_BIN`, then
/// the places [`corral_bin`] looks. Panics with the build command when none
/// exists.
pub fn demo_origin_bin() -> PathBuf {
    built_bin(
        "demo-origin",
        "DEMO_ORIGIN_BIN",
        "cargo build -p corral-bench --bin demo-origin",
    )
}

/// The binary `name` of this workspace: `env` when set, else the first of
/// the candidates [`corral_bin`] lists. `build` is the command that makes it.
fn built_bin(name: &str, env: &str, build: &str) -> PathBuf {
    if let Some(bin) = std::env::var_os(env) {
        let bin = PathBuf::from(bin);
        assert!(
            bin.is_file(),
            "{env}={} is not a file; run `{build}`",
            bin.display()
        );
        return bin;
    }
    let name = format!("{name}{}", std::env::consts::EXE_SUFFIX);
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
        "the {name} binary was not found (looked at {candidates:?}); \
         run `{build}` before `cargo test -p corral-tests`, or point {env} at it"
    );
}
