//! The server's modules import one way: a layer names only the layers
//! below it. Read from the source, every `crate::` path outside a file's
//! unit tests: between the folders of `crates/corral/src`, and between the
//! files of the miss path (`cache/`). A new module must be given its
//! place here, and in ARCHITECTURE.md's table.
//!
//! The miss path's state has owners too ([`OWNERS`]): a layer that reaches
//! state it does not own (the circuit from the lookup, Redis from the
//! store, L1's back-off records outside the gate, another layer's parts
//! of a fill) fails here.

use std::path::{Path, PathBuf};

/// The folders (and top-level files) of `crates/corral/src`, top to bottom.
const FOLDERS: &[&str] = &[
    "main",
    "ops",
    "http",
    "app",
    "cache",
    "routes",
    "limits",
    "origin",
    "overload",
    "cluster",
    "sealed",
    "telemetry",
    "config",
];

/// The files of `cache/`, top to bottom: the miss path's layers, then
/// what they share. `mod` (the folder's face, a re-export) and the unit
/// tests' `tests` are not layers.
const CACHE: &[&str] = &[
    "lookup",
    "flight",
    "driver",
    "outcome",
    "shared",
    "records",
    "relay",
    "gate",
    "exchange",
    "store",
    "fanout",
    "invalidate",
    "rules",
    "demand",
    "compress",
    "synthetic",
    "fill",
    "cpu",
    "respond",
    "shared_body",
    "resync",
];

/// Who owns each piece of the miss path's state: what the code names to
/// reach it, the `cache/` files that may, and what it is. Anyone else
/// asks an owner (`gate::caller_backoff`, `fill::is_pass`,
/// `shared::unavailable`).
///
/// A fill's cache and route are private to `fill.rs` (rustc refuses
/// `fill.cache` or `fill.route` anywhere else): a layer reaches only the
/// parts a fill hands it, and the first rows say which layer may ask for
/// which parts. The rows after them hold for the files handed the whole
/// `Cache` (the lookup, `invalidate`, `rules`, `demand`) and for the parts
/// themselves.
const OWNERS: &[(&str, &[&str], &str)] = &[
    (".flight()", &["flight", "driver"], "the flight's parts"),
    (".relay()", &["relay"], "the relay's parts"),
    (
        ".shared()",
        &["shared", "driver", "rules", "relay"],
        "the shared tier's parts",
    ),
    (".gate()", &["gate"], "the gate's parts"),
    (".exchange()", &["exchange"], "the exchange's parts"),
    (".store()", &["store"], "the store's parts"),
    (".transport", &["fill", "exchange"], "the origin transport"),
    (
        ".flights",
        &["fill", "flight", "driver"],
        "the flights registry",
    ),
    (
        ".tier",
        &[
            "fill",
            "driver",
            "shared",
            "relay",
            "invalidate",
            "rules",
            "gate",
            "demand",
        ],
        "Redis (records reads and writes it for shared, through the tier it is handed; relay streams a growing body through it; demand keeps and reads the codings it makes)",
    ),
    (".circuit", &["fill", "gate"], "the route's circuit"),
    (
        ".fills",
        &["fill"],
        "the route's and the instance's fill slots (the gate's parts)",
    ),
    (
        "_slots",
        &["fill", "gate"],
        "the route's and the instance's fill slots",
    ),
    (
        ".resync",
        &["lookup"],
        "the pace of unverified entries' refreshes",
    ),
    ("active_backoff(", &["gate"], "L1's back-off records"),
    ("last_backoff(", &["gate"], "L1's back-off records"),
    ("set_backoff(", &["gate"], "L1's back-off records"),
    ("set_own_backoff(", &["gate"], "L1's back-off records"),
    ("clear_backoff(", &["gate"], "L1's back-off records"),
    ("write_backoff(", &["gate"], "Redis's back-off records"),
    ("delete_backoff(", &["records"], "Redis's back-off records"),
    (".is_pass(", &["fill"], "L1's hit-for-pass markers"),
    (".mark_pass(", &["fill"], "L1's hit-for-pass markers"),
    (".clear_pass(", &["fill"], "L1's hit-for-pass markers"),
    ("write_pass(", &["records"], "Redis's hit-for-pass markers"),
    (
        "fill_memory",
        &["fill", "store", "fanout", "relay"],
        "the fill memory budget (relay: a body relayed from another instance)",
    ),
    (
        "ahead_memory",
        &["fill", "store", "exchange"],
        "the read-ahead budget",
    ),
];

/// The state `file` (a `cache/` file's name) reaches without owning it,
/// in `code` (comments and unit tests already left out).
fn reached(file: &str, code: &str) -> Vec<String> {
    OWNERS
        .iter()
        .filter(|(name, owners, _)| !owners.contains(&file) && code.contains(name))
        .map(|(name, owners, what)| {
            format!("cache/{file}.rs reaches {what} (`{name}`), which {owners:?} own")
        })
        .collect()
}

#[test]
fn each_layer_reaches_only_the_state_it_owns() {
    let dir = src().join("cache");
    let mut files = Vec::new();
    rust_files(&dir, &mut files);
    let mut found = Vec::new();
    for path in files {
        let rel = relative(&dir, &path);
        let file = rel.trim_end_matches(".rs");
        if ["mod", "tests"].contains(&file) {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("a readable source file");
        found.extend(reached(file, &code(&text)));
    }
    assert!(
        found.is_empty(),
        "state reached by a layer that does not own it:\n  {}",
        found.join("\n  ")
    );
}

#[test]
fn the_ownership_check_sees_a_layer_reaching_state_it_does_not_own() {
    // The lookup reading the circuit and L1's back-off, as it once did;
    // the gate, their owner, may; a comment or a unit test may name them.
    let lookup = code(
        "let open = fill.gate().circuit.is_open();\n\
         let b = cache.l1.active_backoff(scope, now);\n\
         // fill.cache.tier in a comment\n\
         #[cfg(test)]\nmod tests { cache.tier.clone(); }\n",
    );
    let found = reached("lookup", &lookup);
    assert_eq!(found.len(), 3, "{found:#?}");
    assert!(found[0].contains("the gate's parts"), "{found:#?}");
    assert!(found[1].contains("the route's circuit"), "{found:#?}");
    assert!(found[2].contains("L1's back-off records"), "{found:#?}");
    assert!(reached("gate", &lookup).is_empty());
    // The gate asking for the exchange's parts to send a request itself:
    // the exchange's transport is not the gate's to reach.
    let gate = code("let t = fill.exchange().transport;\n");
    let found = reached("gate", &gate);
    assert_eq!(found.len(), 2, "{found:#?}");
    assert!(found[0].contains("the exchange's parts"), "{found:#?}");
    assert!(found[1].contains("the origin transport"), "{found:#?}");
    assert!(reached("exchange", &gate).is_empty());
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../crates/corral/src")
}

/// `path` under `root`, with `/` between its parts.
fn relative(root: &Path, path: &Path) -> String {
    path.strip_prefix(root)
        .expect("under src")
        .to_string_lossy()
        .replace('\\', "/")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a readable directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

/// The file's text without its unit tests (a `#[cfg(test)] mod` runs
/// beside the code and may reach anything) and without comments.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod ") {
        Some(i) => &text[..i],
        None => text,
    };
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every path the code names after `crate::`, as segments; a group
/// (`crate::cache::{gate, shared}`) counts as one path per member.
fn crate_paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().next_back();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(ident) {
            continue; // `corral_crate::` and the like
        }
        let mut segments = Vec::new();
        let mut s = rest;
        loop {
            let end = s.find(|c: char| !ident(c)).unwrap_or(s.len());
            if end == 0 {
                break;
            }
            segments.push(s[..end].to_owned());
            s = &s[end..];
            if let Some(t) = s.strip_prefix("::") {
                s = t;
            } else {
                break;
            }
        }
        if let Some(group) = s.strip_prefix('{') {
            let inner = &group[..group.find('}').unwrap_or(group.len())];
            for member in inner.split(',') {
                let first = member
                    .trim()
                    .split(|c: char| !ident(c))
                    .next()
                    .unwrap_or("");
                if !first.is_empty() {
                    let mut path = segments.clone();
                    path.push(first.to_owned());
                    out.push(path);
                }
            }
        } else if !segments.is_empty() {
            out.push(segments);
        }
    }
    out
}

fn rank(table: &[&str], name: &str) -> Option<usize> {
    table.iter().position(|t| *t == name)
}

/// Every import from a lower layer into a higher one, and every module
/// missing from the tables, as `file: what`.
fn violations() -> Vec<String> {
    let root = src();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let mut found = Vec::new();
    for path in files {
        let rel = relative(&root, &path);
        let parts: Vec<&str> = rel.trim_end_matches(".rs").split('/').collect();
        if parts.last() == Some(&"tests") {
            continue; // a folder's unit tests, compiled only with them
        }
        let folder = parts[0];
        let Some(own) = rank(FOLDERS, folder) else {
            found.push(format!("{rel}: `{folder}` has no place in FOLDERS"));
            continue;
        };
        let in_cache = folder == "cache" && parts.len() == 2;
        let file = parts.get(1).copied().unwrap_or("");
        if in_cache && !["mod", "tests"].contains(&file) && rank(CACHE, file).is_none() {
            found.push(format!("{rel}: `{file}` has no place in CACHE"));
        }
        let text = std::fs::read_to_string(&path).expect("a readable source file");
        for segments in crate_paths(&code(&text)) {
            let target = segments[0].as_str();
            match rank(FOLDERS, target) {
                None => found.push(format!("{rel}: crate::{target} has no place in FOLDERS")),
                Some(t) if t < own => found.push(format!(
                    "{rel}: `{folder}` imports `crate::{}`, a layer above it",
                    segments.join("::")
                )),
                Some(_) => {}
            }
            if !in_cache || target != "cache" {
                continue;
            }
            let Some(other) = segments.get(1).map(String::as_str) else {
                continue;
            };
            if let (Some(me), Some(them)) = (rank(CACHE, file), rank(CACHE, other))
                && them < me
            {
                found.push(format!(
                    "{rel}: cache/{file} imports `crate::{}`, a layer above it",
                    segments.join("::")
                ));
            }
        }
    }
    found
}

#[test]
fn every_import_points_down_the_layers() {
    let found = violations();
    assert!(
        found.is_empty(),
        "imports against the layers:\n  {}",
        found.join("\n  ")
    );
}

/// The files of each folder import one another without a cycle (the
/// folder's `mod.rs` is a node like any other): `cache/`'s order is the
/// table above; in the other folders, any order without a loop.
fn cycles() -> Vec<String> {
    let root = src();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let mut edges: std::collections::BTreeMap<
        (String, String),
        std::collections::BTreeSet<String>,
    > = Default::default();
    for path in &files {
        let rel = relative(&root, path);
        let parts: Vec<&str> = rel.trim_end_matches(".rs").split('/').collect();
        let [folder, file] = parts[..] else {
            continue; // a top-level file, or one nested deeper
        };
        if file == "tests" {
            continue;
        }
        let text = std::fs::read_to_string(path).expect("a readable source file");
        let code = code(&text);
        let mut targets: Vec<String> = crate_paths(&code)
            .into_iter()
            .filter(|p| p.len() > 1 && p[0] == folder)
            .map(|p| p[1].clone())
            .collect();
        // `super::x` from a folder's file is a sibling (or the folder's own item).
        let mut rest = code.as_str();
        while let Some(i) = rest.find("super::") {
            rest = &rest[i + "super::".len()..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            targets.push(rest[..end].to_owned());
        }
        let siblings: std::collections::BTreeSet<String> = files
            .iter()
            .filter_map(|f| {
                let r = relative(&root, f);
                let p: Vec<&str> = r.trim_end_matches(".rs").split('/').collect();
                (p.len() >= 2 && p[0] == folder).then(|| p[1].to_owned())
            })
            .collect();
        let entry = edges
            .entry((folder.to_owned(), file.to_owned()))
            .or_default();
        for t in targets {
            let t = if siblings.contains(&t) {
                t
            } else {
                "mod".to_owned()
            };
            if t != file {
                entry.insert(t);
            }
        }
    }
    let mut found = Vec::new();
    for ((folder, file), targets) in &edges {
        for t in targets {
            let back = edges
                .get(&(folder.clone(), t.clone()))
                .is_some_and(|theirs| reaches(&edges, folder, theirs, file, 0));
            if back && file < t {
                found.push(format!(
                    "{folder}/{file}.rs and {folder}/{t}.rs import each other"
                ));
            }
        }
    }
    found
}

/// True when `from` (a set of files of `folder`) leads to `goal`.
fn reaches(
    edges: &std::collections::BTreeMap<(String, String), std::collections::BTreeSet<String>>,
    folder: &str,
    from: &std::collections::BTreeSet<String>,
    goal: &str,
    depth: usize,
) -> bool {
    if depth > 32 {
        return false;
    }
    from.iter().any(|f| {
        f == goal
            || edges
                .get(&(folder.to_owned(), f.clone()))
                .is_some_and(|next| reaches(edges, folder, next, goal, depth + 1))
    })
}

#[test]
fn the_files_of_a_folder_import_one_another_without_a_cycle() {
    let found = cycles();
    assert!(found.is_empty(), "import cycles:\n  {}", found.join("\n  "));
}

#[test]
fn the_architecture_table_names_every_folder_and_file() {
    let section =
        std::fs::read_to_string(src().join("../../../ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut missing = Vec::new();
    for path in files {
        let name = path
            .file_name()
            .expect("a file")
            .to_string_lossy()
            .into_owned();
        if name == "mod.rs" || name == "tests.rs" {
            continue;
        }
        if !section.contains(&format!("`{name}`")) && !section.contains(&name) {
            missing.push(
                path.strip_prefix(src())
                    .expect("under src")
                    .display()
                    .to_string(),
            );
        }
    }
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md does not name: {missing:?}"
    );
}

#[test]
fn the_check_sees_an_inverted_import() {
    // What the check reads, shown to catch what it must: a path, a group,
    // a path inside a longer one; and to skip comments and unit tests.
    let text = "use crate::cache::{gate, shared::fill};\n\
                let a = crate::app::App::new();\n\
                // crate::http::proxy in a comment\n\
                fn f() { corral_crate::x(); }\n\
                #[cfg(test)]\nmod tests { use crate::main; }\n";
    let paths = crate_paths(&code(text));
    assert_eq!(
        paths,
        [
            vec!["cache", "gate"],
            vec!["cache", "shared"],
            vec!["app", "App", "new"],
        ]
    );
}

/// The production functions of `text` longer than `max` lines, as
/// `(lines, name, first line)`: a `fn` item's lines from its signature to
/// its closing brace, counted with strings, character literals and
/// comments left out. Unit-test modules are not production code.
fn long_functions(text: &str, max: usize) -> Vec<(usize, String, usize)> {
    let text = match text.find("#[cfg(test)]\nmod ") {
        Some(i) => &text[..i],
        None => text,
    };
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    let mut j = 0;
    while j < lines.len() {
        let Some(name) = fn_name(lines[j]) else {
            j += 1;
            continue;
        };
        let (mut depth, mut started, mut k) = (0i64, false, j);
        while k < lines.len() {
            let code = braces_only(lines[k]);
            depth += code.matches('{').count() as i64 - code.matches('}').count() as i64;
            started |= code.contains('{');
            if (started && depth <= 0) || (!started && code.trim_end().ends_with(';')) {
                break;
            }
            k += 1;
        }
        let n = k.min(lines.len() - 1) - j + 1;
        if started && n > max {
            found.push((n, name, j + 1));
        }
        j = k + 1;
    }
    found
}

/// The function a line declares, if it begins a `fn` item.
fn fn_name(line: &str) -> Option<String> {
    let mut rest = line.trim_start();
    for prefix in [
        "pub(crate) ",
        "pub(super) ",
        "pub ",
        "const ",
        "async ",
        "unsafe ",
    ] {
        rest = rest.strip_prefix(prefix).unwrap_or(rest);
    }
    let rest = rest.strip_prefix("fn ")?;
    let name: String = rest
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty()).then_some(name)
}

/// A line without its string and character literals and its comment.
fn braces_only(line: &str) -> String {
    let chars: Vec<char> = line.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '/' if chars.get(i + 1) == Some(&'/') => break,
            '"' => {
                i += 1;
                while i < chars.len() && chars[i] != '"' {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
            }
            // 'x' or '\x': a character; 'a alone is a lifetime.
            '\'' if chars.get(i + 2) == Some(&'\'') => i += 2,
            '\'' if chars.get(i + 1) == Some(&'\\') => {
                i += 2;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    out
}

/// The production source files of `crates/` (their path under it, and
/// their text): `src/` less the unit-test files.
fn production_sources() -> Vec<(String, String)> {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crates");
    let mut files = Vec::new();
    rust_files(&crates, &mut files);
    files
        .into_iter()
        .filter_map(|path| {
            let rel = relative(&crates, &path);
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if !rel.contains("/src/") || name == "tests.rs" || name.ends_with("_tests.rs") {
                return None;
            }
            let text = std::fs::read_to_string(&path).expect("a readable source file");
            Some((rel, text))
        })
        .collect()
}

const LONGEST_FUNCTION: usize = 100;

#[test]
fn no_production_function_is_over_100_lines() {
    let mut found = Vec::new();
    for (rel, text) in production_sources() {
        for (n, function, line) in long_functions(&text, LONGEST_FUNCTION) {
            found.push(format!("crates/{rel}:{line} {function}: {n} lines"));
        }
    }
    assert!(
        found.is_empty(),
        "production functions over {LONGEST_FUNCTION} lines; cut them along their seams:\n  {}",
        found.join("\n  ")
    );
}

#[test]
fn the_length_check_counts_a_function_to_its_own_closing_brace() {
    // Braces in strings, characters and comments are not the function's;
    // a lifetime is not a character; a signature without a body is not a
    // function; a unit test module is left out.
    let body = "    let x = 1;\n".repeat(99);
    let text = format!(
        "pub(crate) fn long<'a>(s: &'a str) -> usize {{\n{body}    s.find(['{{', '\"']).map_or(0, |_| 1) // }}\n}}\n\
         fn short() {{ let s = \"}}}}\"; let c = '}}'; }}\n\
         fn declared(&self) -> u8;\n\
         #[cfg(test)]\nmod tests {{\nfn long_test() {{\n{body}{body}}}\n}}\n"
    );
    assert_eq!(
        long_functions(&text, LONGEST_FUNCTION),
        [(102, "long".to_owned(), 1)]
    );
    assert!(long_functions(&text, 102).is_empty());
}

/// The parameters of `text`'s functions that are tuples taken apart
/// (`(a, b): (A, B)`): context carried in an unnamed bundle. Returns each
/// one's line (1-based) and text.
fn tuple_parameters(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let mut in_signature = false;
    for (i, raw) in text.lines().enumerate() {
        let line = braces_only(raw);
        let trimmed = line.trim();
        if fn_name(&line).is_some() {
            in_signature = true;
        }
        let destructured = |s: &str| {
            let s = s.strip_prefix("mut ").unwrap_or(s);
            s.starts_with('(') && s.contains("): (")
        };
        let one_line =
            trimmed.contains("fn ") && trimmed.contains("((") && trimmed.contains("): (");
        if in_signature && (destructured(trimmed) || one_line) {
            found.push((i + 1, raw.trim().to_owned()));
        }
        if in_signature && (trimmed.contains('{') || trimmed.ends_with(';')) {
            in_signature = false;
        }
    }
    found
}

#[test]
fn no_production_function_takes_a_tuple_parameter() {
    let mut found = Vec::new();
    for (rel, text) in production_sources() {
        let production = text.split("#[cfg(test)]").next().unwrap_or_default();
        for (line, shown) in tuple_parameters(production) {
            found.push(format!("crates/{rel}:{line} {shown}"));
        }
    }
    assert!(
        found.is_empty(),
        "tuple parameters carry context unnamed; give it a struct or its own parameters:\n  {}",
        found.join("\n  ")
    );
}

#[test]
fn the_tuple_check_sees_a_bundle_and_not_a_binding() {
    let text = "fn lead(\n    fill: &Fill,\n    (generation, checked): (u64, bool),\n) {\n    let (a, b): (u8, u8) = (1, 2);\n    match x { (a, b) => {} }\n}\n\
                fn one((a, b): (u8, u8)) {}\n";
    let found: Vec<usize> = tuple_parameters(text).into_iter().map(|(l, _)| l).collect();
    assert_eq!(found, vec![3, 8]);
}
