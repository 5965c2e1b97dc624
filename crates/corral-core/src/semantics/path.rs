//! The one normal form of a request path. Routing, the cache key and the
//! upstream target all use it, so a path cannot choose one route here and
//! mean another resource at an origin that normalizes (nginx, most
//! frameworks and file servers do). It must never let through a path an
//! origin could read as climbing out of the route it matched: `..` above
//! the root, an encoded `/` or `\`, a NUL, overlong UTF-8 are refused.
//!
//! The steps, in the order an origin that normalizes applies them:
//! 1. percent-encoded unreserved characters (RFC 3986 §2.3) are decoded
//!    (`%2e` is `.`, `%41` is `A`) and every other encoding is written with
//!    upper-case hex (§6.2.2.1), so two spellings of one path are one key;
//! 2. runs of `/` are merged into one (nginx's `merge_slashes`, on by
//!    default), since `/static//../api` is `/api` to such an origin and
//!    `/static/api` to RFC 3986 alone;
//! 3. dot segments are removed (§5.2.4); a `..` with nothing left to
//!    remove climbs above the root and is refused.

use std::borrow::Cow;

/// Why a path was refused (a 400 with this Cache-Status detail).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadPath {
    /// `%2F` or `%5C` (or a raw `\`): a separator some origins decode and
    /// others do not, so the route corral sees and the resource the origin
    /// serves could differ.
    EncodedSeparator,
    /// A `..` segment with no segment left to remove.
    AboveRoot,
    /// A `%` not followed by two hex digits, an encoded NUL, bytes that are
    /// not UTF-8 (overlong forms included), or a dot segment carrying path
    /// parameters (`..;x`, which servlet containers read as `..`).
    Invalid,
}

impl BadPath {
    pub fn detail(self) -> &'static str {
        match self {
            BadPath::EncodedSeparator => "encoded-separator",
            BadPath::AboveRoot => "path-above-root",
            BadPath::Invalid => "invalid-path",
        }
    }
}

/// The normal form of `path` (which starts with `/`, or is `*`). A path
/// already normal (the common case) comes back borrowed, after one scan.
pub fn normalize(path: &str) -> Result<Cow<'_, str>, BadPath> {
    if path == "*" {
        return Ok(Cow::Borrowed(path));
    }
    if is_normal(path.as_bytes()) {
        return Ok(Cow::Borrowed(path));
    }
    let decoded = decode(path.as_bytes())?;
    let merged = merge_slashes(&decoded);
    let out = remove_dot_segments(&merged)?;
    // Every byte written is ASCII: decoded unreserved characters, `%XX`
    // triplets, or the input's own bytes, which the UTF-8 check covered.
    String::from_utf8(out)
        .map(Cow::Owned)
        .map_err(|_| BadPath::Invalid)
}

/// Bytes that may make a path not normal: looked up once a byte, so the
/// common path (letters, digits, `-`, `_`, single slashes) costs a table
/// read per byte on the hit path.
static SPECIAL: [bool; 256] = {
    let mut t = [false; 256];
    let mut i = 0x80;
    while i < 256 {
        t[i] = true;
        i += 1;
    }
    t[b'%' as usize] = true;
    t[b'\\' as usize] = true;
    t[b';' as usize] = true;
    t[b'/' as usize] = true;
    t[0] = true;
    t
};

/// True when `path` has nothing to decode, merge or remove: no `%`, no
/// `\`, no `//`, no segment that starts with `.`, no `;` and only ASCII.
fn is_normal(p: &[u8]) -> bool {
    let mut rest = p;
    while let Some(at) = rest.iter().position(|&b| SPECIAL[usize::from(b)]) {
        if rest[at] != b'/' || matches!(rest.get(at + 1), Some(b'/' | b'.')) {
            return false;
        }
        rest = &rest[at + 1..];
    }
    true
}

/// The value of one hex digit.
pub(crate) fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// Step 1: decodes unreserved characters, upper-cases the hex of the rest,
/// and checks that the bytes the path stands for are UTF-8.
fn decode(p: &[u8]) -> Result<Vec<u8>, BadPath> {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = Vec::with_capacity(p.len());
    // The bytes the path names once every encoding is decoded: what an
    // origin that decodes sees, checked for UTF-8 (overlong forms of `.`
    // and `/`, `%c0%ae`, are not UTF-8).
    let mut meant = Vec::with_capacity(p.len());
    let mut i = 0;
    while i < p.len() {
        let b = p[i];
        match b {
            b'%' => {
                let (Some(hi), Some(lo)) = (
                    p.get(i + 1).copied().and_then(hex),
                    p.get(i + 2).copied().and_then(hex),
                ) else {
                    return Err(BadPath::Invalid);
                };
                let v = hi << 4 | lo;
                match v {
                    b'/' | b'\\' => return Err(BadPath::EncodedSeparator),
                    0 => return Err(BadPath::Invalid),
                    _ if is_unreserved(v) => out.push(v),
                    _ => out.extend_from_slice(&[b'%', HEX[usize::from(hi)], HEX[usize::from(lo)]]),
                }
                meant.push(v);
                i += 3;
            }
            b'\\' => return Err(BadPath::EncodedSeparator),
            0 => return Err(BadPath::Invalid),
            _ => {
                out.push(b);
                meant.push(b);
                i += 1;
            }
        }
    }
    if std::str::from_utf8(&meant).is_err() {
        return Err(BadPath::Invalid);
    }
    Ok(out)
}

/// Step 2: `//` and longer runs become `/`.
fn merge_slashes(p: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(p.len());
    for &b in p {
        if b == b'/' && out.last() == Some(&b'/') {
            continue;
        }
        out.push(b);
    }
    out
}

/// Step 3: RFC 3986 §5.2.4 on a path that starts with `/`, refusing a `..`
/// that would climb above the root and a dot segment with parameters.
fn remove_dot_segments(p: &[u8]) -> Result<Vec<u8>, BadPath> {
    let mut segments: Vec<&[u8]> = Vec::new();
    // The path starts with `/`, so the first piece is empty.
    let mut pieces = p.split(|&b| b == b'/').skip(1).peekable();
    let mut trailing_slash = false;
    while let Some(seg) = pieces.next() {
        let last = pieces.peek().is_none();
        let bare = seg.split(|&b| b == b';').next().unwrap_or(seg);
        if bare != seg && (bare == b"." || bare == b"..") {
            return Err(BadPath::Invalid);
        }
        match seg {
            b"." => trailing_slash = last,
            b".." => {
                if segments.pop().is_none() {
                    return Err(BadPath::AboveRoot);
                }
                trailing_slash = last;
            }
            _ => {
                segments.push(seg);
                trailing_slash = false;
            }
        }
    }
    let mut out = Vec::with_capacity(p.len());
    for seg in &segments {
        out.push(b'/');
        out.extend_from_slice(seg);
    }
    if trailing_slash || out.is_empty() {
        out.push(b'/');
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(p: &str) -> Result<String, BadPath> {
        normalize(p).map(Cow::into_owned)
    }

    #[test]
    fn dot_segments_and_encoded_dots_resolve_as_an_origin_reads_them() {
        for (raw, want) in [
            ("/", "/"),
            ("/a/b", "/a/b"),
            ("/static/../api/login", "/api/login"),
            ("/static/%2e%2e/api/login", "/api/login"),
            ("/static/%2E%2e/api/login", "/api/login"),
            ("/static/.%2e/api", "/api"),
            ("/static/./a", "/static/a"),
            ("/a/.", "/a/"),
            ("/a/..", "/"),
            ("/a/b/..", "/a/"),
            ("/a/./", "/a/"),
            ("/a/", "/a/"),
            ("/static//../api", "/api"),
            ("//a///b", "/a/b"),
            ("/%7euser/%41", "/~user/A"),
            ("/a%20b/%c3%a9", "/a%20b/%C3%A9"),
            ("/a/.b/..c/...", "/a/.b/..c/..."),
            ("/a;v=1/b", "/a;v=1/b"),
            ("/é", "/é"),
            ("*", "*"),
        ] {
            assert_eq!(norm(raw).as_deref(), Ok(want), "{raw}");
        }
    }

    #[test]
    fn what_could_climb_or_mean_two_things_is_refused() {
        for (raw, why) in [
            ("/static/..%2faccount", BadPath::EncodedSeparator),
            ("/static/..%2Faccount", BadPath::EncodedSeparator),
            ("/a%5c..%5cb", BadPath::EncodedSeparator),
            ("/a\\..\\b", BadPath::EncodedSeparator),
            ("/..", BadPath::AboveRoot),
            ("/a/../..", BadPath::AboveRoot),
            ("/%2e%2e/etc", BadPath::AboveRoot),
            ("/a/%00", BadPath::Invalid),
            ("/a/%zz", BadPath::Invalid),
            ("/a/%2", BadPath::Invalid),
            ("/static/..;/api", BadPath::Invalid),
            ("/static/.;x/api", BadPath::Invalid),
            ("/%c0%ae%c0%ae/etc", BadPath::Invalid),
            ("/%c0%af", BadPath::Invalid),
            ("/%ff", BadPath::Invalid),
        ] {
            assert_eq!(norm(raw), Err(why), "{raw}");
        }
    }

    #[test]
    fn a_normal_path_is_borrowed() {
        assert!(matches!(normalize("/a/b.css?x"), Ok(Cow::Borrowed(_))));
        assert!(matches!(normalize("/a/%41"), Ok(Cow::Owned(_))));
    }
}
