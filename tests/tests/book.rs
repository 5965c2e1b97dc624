//! The user guide (`docs/`, an mdBook) and the README, checked as code: every
//! YAML example that holds `routes:` passes `corral check`; the configuration
//! reference (`docs/src/configuration.md`) has a row for every field of
//! `crates/corral/src/config/raw.rs`, under the section of the YAML path the
//! field lives at, and no row for a field that is gone; every chapter named in
//! `SUMMARY.md` exists; and the user docs carry no issue numbers or commit
//! hashes. `mdbook build docs` itself runs in `scripts/test`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use corral_tests::paths::workspace_root;
use corral_tests::temp::TempDir;
use corral_tests::{CheckOutcome, corral_check_file};

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn book_src() -> PathBuf {
    workspace_root().join("docs").join("src")
}

/// Every `.md` file under `dir`, recursively, sorted.
fn markdown_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(d) = pending.pop() {
        let entries = std::fs::read_dir(&d).unwrap_or_else(|e| panic!("list {}: {e}", d.display()));
        for entry in entries {
            let path = entry.expect("read a directory entry").path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The user docs: README.md and every page of the book.
fn user_docs() -> Vec<PathBuf> {
    let mut docs = vec![workspace_root().join("README.md")];
    docs.extend(markdown_under(&book_src()));
    docs
}

// ---------------------------------------------------------------------------
// YAML examples

/// A fenced code block: its info string, the line its first body line is on
/// (1-based) and its body.
struct Fence {
    info: String,
    line: usize,
    body: String,
}

/// The fenced code blocks of a Markdown text (``` or ~~~ fences, at most
/// three spaces of indent, closed by a fence of the same character at least
/// as long).
fn fences(text: &str) -> Vec<Fence> {
    let mut out = Vec::new();
    let mut open: Option<(char, usize, Fence)> = None;
    for (index, line) in text.lines().enumerate() {
        let indent = line.len() - line.trim_start_matches(' ').len();
        let trimmed = line.trim_start_matches(' ');
        let marker = trimmed.chars().next().filter(|c| *c == '`' || *c == '~');
        let run = marker.map_or(0, |m| trimmed.chars().take_while(|c| *c == m).count());
        match &mut open {
            Some((c, len, fence)) => {
                if indent < 4
                    && marker == Some(*c)
                    && run >= *len
                    && trimmed[run..].trim().is_empty()
                {
                    let (_, _, fence) = open.take().expect("an open fence");
                    out.push(fence);
                } else {
                    fence.body.push_str(line);
                    fence.body.push('\n');
                }
            }
            None => {
                if indent < 4 && run >= 3 {
                    let c = marker.expect("a fence marker");
                    let info = trimmed[run..].trim().to_owned();
                    open = Some((
                        c,
                        run,
                        Fence {
                            info,
                            line: index + 2,
                            body: String::new(),
                        },
                    ));
                }
            }
        }
    }
    assert!(open.is_none(), "a code fence is never closed");
    out
}

fn is_yaml(info: &str) -> bool {
    let lang = info.split([' ', ',', '{']).next().unwrap_or("");
    lang.eq_ignore_ascii_case("yaml") || lang.eq_ignore_ascii_case("yml")
}

/// True when a YAML text has a `routes:` key: a whole corral config, not a
/// fragment of one.
fn holds_routes(yaml: &str) -> bool {
    yaml.lines().any(|l| {
        let l = l.trim_start();
        l.starts_with("routes:") && !l.starts_with('#')
    })
}

/// Every YAML block with `routes:` in `docs`, as (where, body).
fn config_examples(docs: &[PathBuf]) -> Vec<(String, String)> {
    let root = workspace_root();
    let mut out = Vec::new();
    for doc in docs {
        let shown = doc.strip_prefix(&root).unwrap_or(doc).display().to_string();
        for fence in fences(&read(doc)) {
            if is_yaml(&fence.info) && holds_routes(&fence.body) {
                out.push((format!("{shown}:{}", fence.line), fence.body));
            }
        }
    }
    out
}

#[test]
fn fences_are_read_with_their_lines_and_languages() {
    let text = "intro\n```yaml\nroutes: []\n```\n\n~~~~sh\n```\n~~~~\n    ```yaml\n";
    let found = fences(text);
    assert_eq!(found.len(), 2);
    assert_eq!(found[0].info, "yaml");
    assert_eq!(found[0].line, 3);
    assert_eq!(found[0].body, "routes: []\n");
    assert_eq!(found[1].info, "sh");
    assert_eq!(found[1].body, "```\n", "a shorter fence inside stays text");
    assert!(holds_routes("a: 1\nroutes:\n  - name: x\n"));
    assert!(!holds_routes("redis:\n  url: redis://x\n# routes: none\n"));
    assert!(is_yaml("yaml") && is_yaml("YML title=x") && !is_yaml("sh"));
}

#[tokio::test]
async fn every_yaml_example_with_routes_passes_corral_check() {
    let examples = config_examples(&user_docs());
    assert!(
        examples.len() >= 5,
        "expected the README's and the book's config examples, found {}",
        examples.len()
    );
    let scratch = TempDir::new("book").expect("a scratch dir");
    let mut refused = Vec::new();
    for (index, (place, body)) in examples.iter().enumerate() {
        let path = scratch.path().join(format!("example-{index}.yaml"));
        std::fs::write(&path, body).expect("write an example");
        let CheckOutcome { status, stderr, .. } = corral_check_file(&path).await;
        if !status.success() {
            refused.push(format!("{place}: {}", stderr.trim()));
        }
    }
    assert!(
        refused.is_empty(),
        "examples `corral check` refuses:\n  {}",
        refused.join("\n  ")
    );
}

// ---------------------------------------------------------------------------
// The configuration reference against raw.rs

/// One field of a `Raw*` struct: its YAML name and, when its type holds
/// another `Raw*` struct, that struct and whether it is a list of them.
#[derive(Debug, Clone)]
struct RawField {
    name: String,
    child: Option<(String, bool)>,
}

/// Every `pub struct Raw*` of raw.rs and its `pub` fields, named as YAML
/// spells them (`#[serde(rename = "...")]` honoured).
fn raw_structs(source: &str) -> BTreeMap<String, Vec<RawField>> {
    let mut structs = BTreeMap::new();
    let mut current: Option<(String, Vec<RawField>)> = None;
    let mut rename: Option<String> = None;
    for line in source.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("pub struct ") {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if name.starts_with("Raw") {
                assert!(
                    rest.trim_end().ends_with('{'),
                    "raw.rs: `{name}` is not a struct with named fields; teach tests/tests/book.rs to read it"
                );
                current = Some((name, Vec::new()));
            }
            continue;
        }
        let Some((_, fields)) = &mut current else {
            continue;
        };
        if line == "}" {
            let (name, fields) = current.take().expect("an open struct");
            structs.insert(name, fields);
            continue;
        }
        if let Some(attr) = line.strip_prefix("#[serde(") {
            if let Some(at) = attr.find("rename") {
                let quoted = attr[at..].split('"').nth(1).expect("rename = \"name\"");
                rename = Some(quoted.to_owned());
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("pub ") {
            let (ident, ty) = rest.split_once(':').expect("`pub name: Type,`");
            let ident = ident.trim().trim_start_matches("r#");
            let child = raw_type_in(ty).map(|s| (s, ty.contains("Vec<")));
            fields.push(RawField {
                name: rename.take().unwrap_or_else(|| ident.to_owned()),
                child,
            });
        }
    }
    assert!(current.is_none(), "raw.rs: a struct is never closed");
    structs
}

/// The `Raw*` struct named in a field's type, if any.
fn raw_type_in(ty: &str) -> Option<String> {
    let at = ty
        .match_indices("Raw")
        .map(|(i, _)| i)
        .find(|&i| i == 0 || !ty.as_bytes()[i - 1].is_ascii_alphanumeric())?;
    Some(
        ty[at..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect(),
    )
}

/// The YAML path of every struct, walked from `RawConfig` (`""`): `server`,
/// `routes[].cache`, `limits[]`… A struct used in several places has several.
fn struct_paths(structs: &BTreeMap<String, Vec<RawField>>) -> BTreeMap<String, BTreeSet<String>> {
    let mut paths: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut pending = vec![("RawConfig".to_owned(), String::new(), 0)];
    while let Some((name, path, depth)) = pending.pop() {
        assert!(depth < 16, "raw.rs: structs nest too deep at {path}");
        let fields = structs
            .get(&name)
            .unwrap_or_else(|| panic!("raw.rs: `{name}` is used but not defined"));
        paths.entry(name).or_default().insert(path.clone());
        for field in fields {
            if let Some((child, list)) = &field.child {
                let mut sub = if path.is_empty() {
                    field.name.clone()
                } else {
                    format!("{path}.{}", field.name)
                };
                if *list {
                    sub.push_str("[]");
                }
                pending.push((child.clone(), sub, depth + 1));
            }
        }
    }
    paths
}

/// The heading of the reference's section for a YAML path: the top level is
/// `Top level`; any other section's heading names the path in backticks.
fn section_of<'a>(doc: &'a str, path: &str) -> Option<&'a str> {
    let wanted = format!("`{path}`");
    let mut offset = 0;
    let mut start = None;
    for line in doc.split_inclusive('\n') {
        let is_heading = line.starts_with('#');
        if let Some(begin) = start
            && is_heading
        {
            return Some(&doc[begin..offset]);
        }
        if is_heading {
            let title = line.trim_start_matches('#').trim();
            let found = if path.is_empty() {
                title.eq_ignore_ascii_case("top level")
            } else {
                title.contains(&wanted)
            };
            if found {
                start = Some(offset);
            }
        }
        offset += line.len();
    }
    start.map(|begin| &doc[begin..])
}

/// The field names of a section's table: the first cell of each row, when it
/// is one name in backticks.
fn documented_fields(section: &str) -> BTreeSet<String> {
    section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|rest| rest.split_once("` |").map(|(name, _)| name.to_owned()))
        .collect()
}

/// What the reference lacks or has too many of, one line each.
fn reference_gaps(raw: &str, doc: &str) -> Vec<String> {
    let structs = raw_structs(raw);
    let paths = struct_paths(&structs);
    let mut gaps = Vec::new();
    for (name, fields) in &structs {
        let Some(at) = paths.get(name) else {
            gaps.push(format!(
                "raw.rs: `{name}` is reached from no field of RawConfig"
            ));
            continue;
        };
        let wanted: BTreeSet<String> = fields.iter().map(|f| f.name.clone()).collect();
        for path in at {
            let shown = if path.is_empty() { "Top level" } else { path };
            let Some(section) = section_of(doc, path) else {
                gaps.push(format!("no section whose heading names `{shown}` ({name})"));
                continue;
            };
            let documented = documented_fields(section);
            for field in wanted.difference(&documented) {
                gaps.push(format!("`{shown}`: no row for `{field}` ({name})"));
            }
            for field in documented.difference(&wanted) {
                gaps.push(format!(
                    "`{shown}`: a row for `{field}`, which {name} does not have"
                ));
            }
        }
    }
    gaps
}

#[test]
fn raw_rs_is_read_as_serde_reads_it() {
    let raw = "pub struct RawConfig {\n    pub listen: Option<Text>,\n    pub routes: Option<Spanned<Vec<Spanned<RawRoute>>>>,\n}\n\
               pub struct RawRoute {\n    #[serde(rename = \"match\")]\n    pub matcher: Option<RawMatch>,\n    pub name: Option<Text>,\n}\n\
               pub struct RawMatch {\n    pub host: Option<Text>,\n}\n";
    let structs = raw_structs(raw);
    let names = |s: &str| -> Vec<String> { structs[s].iter().map(|f| f.name.clone()).collect() };
    assert_eq!(names("RawRoute"), ["match", "name"]);
    let paths = struct_paths(&structs);
    assert_eq!(
        paths["RawMatch"],
        BTreeSet::from(["routes[].match".to_owned()])
    );
    assert_eq!(paths["RawConfig"], BTreeSet::from([String::new()]));

    let doc = "## Top level\n| `listen` | x |\n| `routes` | x |\n## `routes[]`\n| `name` | x |\n| `match` | x |\n## `routes[].match`\n| `host` | x |\n";
    assert!(
        reference_gaps(raw, doc).is_empty(),
        "{:?}",
        reference_gaps(raw, doc)
    );
    // A field added to the code and not to the reference, and a row left
    // behind for a field that is gone, are both found.
    let grown = raw.replace("pub host:", "pub port: Option<Text>,\n    pub host:");
    assert_eq!(
        reference_gaps(&grown, doc),
        ["`routes[].match`: no row for `port` (RawMatch)"]
    );
    let stale = doc.replace("| `host` | x |", "| `host` | x |\n| `hostname` | x |");
    assert_eq!(
        reference_gaps(raw, &stale),
        ["`routes[].match`: a row for `hostname`, which RawMatch does not have"]
    );
    let unsectioned = doc.replace("## `routes[].match`", "## Matching");
    assert_eq!(
        reference_gaps(raw, &unsectioned),
        ["no section whose heading names `routes[].match` (RawMatch)"]
    );
}

#[test]
fn the_configuration_reference_names_every_field_of_the_config_code() {
    let raw = read(&workspace_root().join("crates/corral/src/config/raw.rs"));
    let doc = read(&book_src().join("configuration.md"));
    let structs = raw_structs(&raw);
    assert!(
        structs.len() >= 20 && structs.contains_key("RawConfig"),
        "raw.rs read wrong: {:?}",
        structs.keys().collect::<Vec<_>>()
    );
    let gaps = reference_gaps(&raw, &doc);
    assert!(
        gaps.is_empty(),
        "docs/src/configuration.md is out of step with crates/corral/src/config/raw.rs \
         (add a row `| `field` | default | bounds | what it does |` under the section \
         whose heading names the field's YAML path):\n  {}",
        gaps.join("\n  ")
    );
}

// ---------------------------------------------------------------------------
// The book's shape and the user docs' wording

#[test]
fn every_chapter_in_the_summary_exists_and_every_page_is_in_it() {
    let src = book_src();
    let summary = read(&src.join("SUMMARY.md"));
    let mut linked = BTreeSet::new();
    for part in summary.split("](").skip(1) {
        let target = part.split(')').next().expect("a link target");
        if !target.is_empty() {
            linked.insert(target.split('#').next().unwrap_or(target).to_owned());
        }
    }
    assert!(linked.len() >= 10, "SUMMARY.md links {linked:?}");
    let missing: Vec<&String> = linked.iter().filter(|t| !src.join(t).is_file()).collect();
    assert!(
        missing.is_empty(),
        "SUMMARY.md links missing pages: {missing:?}"
    );
    let orphans: Vec<String> = markdown_under(&src)
        .iter()
        .map(|p| {
            p.strip_prefix(&src)
                .expect("under src")
                .display()
                .to_string()
        })
        .filter(|p| p != "SUMMARY.md" && !linked.contains(p))
        .collect();
    assert!(
        orphans.is_empty(),
        "pages SUMMARY.md does not list: {orphans:?}"
    );
}

/// Words that look like a commit hash: 7 to 40 hex digits with at least one
/// digit and one letter.
fn hash_like(word: &str) -> bool {
    (7..=40).contains(&word.len())
        && word
            .chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        && word.chars().any(|c| c.is_ascii_digit())
        && word.chars().any(|c| c.is_ascii_alphabetic())
}

/// "issue 12", "issues 4 and 26", "Issue #3".
fn issue_reference(text: &str) -> Option<String> {
    let lower = text.to_ascii_lowercase();
    let words: Vec<&str> = lower.split_whitespace().collect();
    words.windows(2).find_map(|w| {
        let noun = w[0].trim_start_matches(['(', '[']);
        let number = w[1].trim_start_matches('#');
        ((noun == "issue" || noun == "issues")
            && number.chars().next().is_some_and(|c| c.is_ascii_digit()))
        .then(|| format!("{} {}", w[0], w[1]))
    })
}

#[test]
fn the_wording_check_finds_issues_and_hashes() {
    assert!(hash_like("9c1a31e") && hash_like("a6a5e82"));
    assert!(!hash_like("deadbeef") && !hash_like("1234567") && !hash_like("cafe"));
    assert_eq!(
        issue_reference("see (issue 26)").as_deref(),
        Some("(issue 26)")
    );
    assert!(issue_reference("Issue #4 said").is_some());
    assert!(issue_reference("an issue is filed").is_none());
}

#[test]
fn user_docs_carry_no_issue_numbers_or_commit_hashes() {
    let root = workspace_root();
    let mut found = Vec::new();
    for doc in user_docs() {
        let shown = doc
            .strip_prefix(&root)
            .unwrap_or(&doc)
            .display()
            .to_string();
        for (index, line) in read(&doc).lines().enumerate() {
            if let Some(issue) = issue_reference(line) {
                found.push(format!("{shown}:{}: `{issue}`", index + 1));
            }
            for word in line.split(|c: char| !c.is_ascii_alphanumeric()) {
                if hash_like(word) {
                    found.push(format!("{shown}:{}: `{word}`", index + 1));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "user docs are no log (history goes to CHANGELOG.md, dated figures to bench/results/):\n  {}",
        found.join("\n  ")
    );
}
