//! `scripts/demo`, the README's first command, run the way a newcomer runs it
//! (on free loopback ports, with the binaries the suite built instead of a
//! release build): it starts corral and demo-origin, prints lines that show a
//! miss, a hit and a stampede that reaches the origin once, and leaves nothing
//! running after Ctrl-C. Every printed line is run here as printed, through
//! bash and curl, so a demo that breaks fails this test.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use corral_tests::paths::{corral_bin, demo_origin_bin, workspace_root};
use corral_tests::ports::{closed_port, free_addrs};
use corral_tests::temp::TempDir;
use corral_tests::{CacheStatus, DEADLINE};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

/// The stampede's size here. The demo prints 1,000; 200 curl processes start
/// on two cores well inside the origin's 2 s delay.
const BURST: u32 = 200;

/// How long the script may take to print its guide (its own wait for the two
/// processes gives up after 30 s).
const STARTUP_DEADLINE: Duration = Duration::from_secs(40);

/// How long one printed command may run (the stampede waits on a 2 s origin).
const COMMAND_DEADLINE: Duration = Duration::from_secs(60);

/// The last line of the guide: the script is ready once it is printed.
const READY_LINE: &str = "Ctrl-C stops corral and demo-origin.";

/// Loopback ports for corral, its admin listener and demo-origin.
#[derive(Clone, Copy, Debug)]
struct Ports {
    listen: u16,
    admin: u16,
    origin: u16,
}

impl Ports {
    fn free() -> Self {
        let addrs = free_addrs(3).expect("three free loopback ports");
        Self {
            listen: addrs[0].port(),
            admin: addrs[1].port(),
            origin: addrs[2].port(),
        }
    }

    fn all(self) -> [u16; 3] {
        [self.listen, self.admin, self.origin]
    }
}

fn absolute(bin: PathBuf) -> PathBuf {
    std::fs::canonicalize(&bin).unwrap_or_else(|e| panic!("{}: {e}", bin.display()))
}

/// `kill SIGNAL -- -PGID`: the signal to every process of the group, as a
/// terminal sends Ctrl-C to its foreground job. Whether any process got it.
fn signal_group(signal: &str, pgid: u32) -> bool {
    std::process::Command::new("kill")
        .args([signal, "--", &format!("-{pgid}")])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether something accepts connections on the loopback `port`.
fn listening(port: u16) -> bool {
    TcpStream::connect_timeout(
        &SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_secs(1),
    )
    .is_ok()
}

/// Removes the proxy settings curl would follow even to loopback.
fn without_proxy(command: &mut Command) -> &mut Command {
    for var in ["http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"] {
        command.env_remove(var);
    }
    command
}

/// `scripts/demo` in its own process group (a terminal's foreground job),
/// its temporary files under a scratch directory; the whole group is killed
/// on drop.
struct Demo {
    child: Child,
    pgid: u32,
    stdout: Lines<BufReader<ChildStdout>>,
    printed: Vec<String>,
    dir: TempDir,
}

impl Demo {
    fn start(ports: Ports) -> Self {
        let dir = TempDir::new("demo").expect("create a scratch dir for the demo");
        let stderr = std::fs::File::create(dir.path().join("stderr")).expect("create stderr file");
        let mut command = Command::new(workspace_root().join("scripts").join("demo"));
        without_proxy(&mut command)
            .env("CORRAL_BIN", absolute(corral_bin()))
            .env("DEMO_ORIGIN_BIN", absolute(demo_origin_bin()))
            .env("CORRAL_DEMO_PORT", ports.listen.to_string())
            .env("CORRAL_DEMO_ADMIN_PORT", ports.admin.to_string())
            .env("CORRAL_DEMO_ORIGIN_PORT", ports.origin.to_string())
            .env("CORRAL_DEMO_BURST", BURST.to_string())
            .env("TMPDIR", dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .process_group(0)
            .kill_on_drop(true);
        let mut child = command.spawn().expect("spawn scripts/demo");
        let pgid = child.id().expect("the script's pid");
        let stdout = BufReader::new(child.stdout.take().expect("the script's stdout")).lines();
        Self {
            child,
            pgid,
            stdout,
            printed: Vec::new(),
            dir,
        }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr")).unwrap_or_default()
    }

    /// What the script printed on stdout and stderr so far, for failures.
    fn report(&self) -> String {
        format!(
            "--- scripts/demo stdout ---\n{}\n--- scripts/demo stderr ---\n{}--- end ---",
            self.printed.join("\n"),
            self.stderr()
        )
    }

    /// Reads stdout until the guide's last line, and returns the guide.
    async fn guide(&mut self) -> Vec<String> {
        let deadline = tokio::time::Instant::now() + STARTUP_DEADLINE;
        loop {
            match tokio::time::timeout_at(deadline, self.stdout.next_line()).await {
                Ok(Ok(Some(line))) => {
                    let ready = line == READY_LINE;
                    self.printed.push(line);
                    if ready {
                        return self.printed.clone();
                    }
                }
                Ok(Ok(None)) => panic!("scripts/demo ended its output early\n{}", self.report()),
                Ok(Err(e)) => panic!("reading scripts/demo's output: {e}\n{}", self.report()),
                Err(_) => panic!(
                    "scripts/demo did not print `{READY_LINE}` within {STARTUP_DEADLINE:?}\n{}",
                    self.report()
                ),
            }
        }
    }

    /// Waits for the script to exit on its own.
    async fn exit(&mut self) -> ExitStatus {
        match tokio::time::timeout(DEADLINE, self.child.wait()).await {
            Ok(Ok(status)) => status,
            Ok(Err(e)) => panic!("waiting for scripts/demo: {e}"),
            Err(_) => panic!(
                "scripts/demo did not exit within {DEADLINE:?}\n{}",
                self.report()
            ),
        }
    }

    /// Whether any process of the script's group is left (the script itself
    /// must have been reaped first).
    fn group_alive(&self) -> bool {
        signal_group("-0", self.pgid)
    }

    /// The script kept its logs when it stopped, and nothing else: one
    /// directory, named on stderr, with corral's log (which says it
    /// started) and demo-origin's.
    fn assert_only_logs_kept(&self) {
        let left = self.leftovers();
        assert_eq!(left.len(), 1, "files left behind: {left:?}");
        let dir = self.dir.path().join(&left[0]);
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .expect("list the kept logs")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        assert_eq!(
            files,
            ["corral.log", "origin.log"],
            "only the logs are kept"
        );
        let named = format!("logs kept in {}/corral.log", dir.display());
        assert!(self.stderr().contains(&named), "{}", self.stderr());
        let log = std::fs::read_to_string(dir.join("corral.log")).expect("corral.log");
        assert!(log.contains("corral"), "corral's log: {log}");
    }

    /// Entries the script left in its temporary directory.
    fn leftovers(&self) -> Vec<String> {
        std::fs::read_dir(self.dir.path())
            .expect("list the demo's scratch dir")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|name| name != "stderr")
            .collect()
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        signal_group("-KILL", self.pgid);
        if std::thread::panicking() {
            self.dir.keep();
            eprintln!("{}", self.report());
        }
    }
}

/// Runs one printed command through bash, in its own process group (killed
/// whole if it runs past the deadline), and returns its stdout; it must
/// succeed.
async fn run_printed(command: &str) -> String {
    let mut bash = Command::new("bash");
    without_proxy(&mut bash)
        .args(["-c", command])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let child = bash.spawn().expect("spawn bash");
    let pgid = child.id().expect("bash's pid");
    match tokio::time::timeout(COMMAND_DEADLINE, child.wait_with_output()).await {
        Ok(Ok(out)) => {
            assert!(
                out.status.success(),
                "`{command}` failed with {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8_lossy(&out.stdout).into_owned()
        }
        Ok(Err(e)) => panic!("running `{command}`: {e}"),
        Err(_) => {
            signal_group("-KILL", pgid);
            panic!("`{command}` ran past {COMMAND_DEADLINE:?}")
        }
    }
}

/// A printed command and the comment line under it (what it should show).
struct Printed {
    command: String,
    expect: Option<String>,
}

/// The commands of the guide: lines indented by four spaces, each with the
/// `# ...` line that follows it.
fn commands(guide: &[String]) -> Vec<Printed> {
    let mut out: Vec<Printed> = Vec::new();
    for line in guide {
        let Some(text) = line.strip_prefix("    ") else {
            continue;
        };
        match text.strip_prefix('#') {
            Some(comment) => {
                if let Some(last) = out.last_mut() {
                    last.expect.get_or_insert_with(|| comment.trim().to_owned());
                }
            }
            None => out.push(Printed {
                command: text.to_owned(),
                expect: None,
            }),
        }
    }
    out
}

/// What `curl -si` printed: the status line, Cache-Status, Age and the body.
struct CurlAnswer {
    status_line: String,
    cache_status: CacheStatus,
    age: Option<String>,
    body: String,
}

fn parse_curl_si(out: &str) -> CurlAnswer {
    let (head, body) = out
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no header/body boundary in curl's output:\n{out}"));
    let mut lines = head.lines();
    let status_line = lines.next().unwrap_or_default().to_owned();
    let mut cache_status = None;
    let mut age = None;
    for line in lines {
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("cache-status") {
                cache_status = Some(CacheStatus::parse(value.trim()));
            } else if name.eq_ignore_ascii_case("age") {
                age = Some(value.trim().to_owned());
            }
        }
    }
    CurlAnswer {
        status_line,
        cache_status: cache_status
            .unwrap_or_else(|| panic!("no cache-status in curl's output:\n{out}")),
        age,
        body: body.to_owned(),
    }
}

/// The Cache-Status a `# cache-status: ...` comment promises.
fn promised(expect: Option<&str>) -> CacheStatus {
    let expect = expect.expect("a `# cache-status: ...` line under the command");
    let value = expect
        .strip_prefix("cache-status:")
        .unwrap_or_else(|| panic!("`{expect}` does not show a cache-status"));
    let value = value.split("  ").next().unwrap_or_default();
    CacheStatus::parse(value.trim())
}

/// Whether two Cache-Status values say the same thing (the ttl aside).
fn same_outcome(a: &CacheStatus, b: &CacheStatus) -> bool {
    a.is_hit() == b.is_hit()
        && a.fwd() == b.fwd()
        && a.stored() == b.stored()
        && a.collapsed() == b.collapsed()
        && a.detail() == b.detail()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_shows_a_miss_a_hit_and_a_one_fetch_stampede_and_ctrl_c_stops_it() {
    let ports = Ports::free();
    let mut demo = Demo::start(ports);
    let guide = demo.guide().await;
    let printed = commands(&guide);
    let find = |needle: &str| {
        printed
            .iter()
            .find(|p| p.command.contains(needle))
            .unwrap_or_else(|| panic!("no printed command with `{needle}`: {guide:#?}"))
    };

    // 1. A miss, stored; 2. the same line again, a hit with the same body.
    assert!(printed.len() >= 5, "the guide's commands: {guide:#?}");
    let (miss, hit) = (&printed[0], &printed[1]);
    assert_eq!(miss.command, hit.command, "the hit repeats the miss's URL");
    let first = parse_curl_si(&run_printed(&miss.command).await);
    assert_eq!(first.status_line.trim(), "HTTP/1.1 200 OK");
    assert_eq!(first.cache_status.fwd(), Some("uri-miss"));
    assert!(first.cache_status.stored(), "{}", first.cache_status.raw());
    assert!(
        same_outcome(&first.cache_status, &promised(miss.expect.as_deref())),
        "the guide promises `{:?}`, corral answered `{}`",
        miss.expect,
        first.cache_status.raw()
    );
    assert_eq!(first.body, "hello;");
    let second = parse_curl_si(&run_printed(&hit.command).await);
    assert_eq!(second.status_line.trim(), "HTTP/1.1 200 OK");
    assert!(
        second.cache_status.is_hit(),
        "{}",
        second.cache_status.raw()
    );
    assert!(
        same_outcome(&second.cache_status, &promised(hit.expect.as_deref())),
        "the guide promises `{:?}`, corral answered `{}`",
        hit.expect,
        second.cache_status.raw()
    );
    assert!(second.age.is_some(), "a hit carries Age");
    assert_eq!(second.body, first.body);

    // 3. The stampede as printed: one stored, every other answer collapsed
    // or hit, and the origin asked once.
    let stampede = find("xargs");
    let tally_text = run_printed(&stampede.command).await;
    let mut tally = BTreeMap::new();
    for line in tally_text.lines() {
        let mut fields = line.split_whitespace();
        let (Some(n), Some(outcome), None) = (fields.next(), fields.next(), fields.next()) else {
            panic!("`{line}` is not `COUNT OUTCOME`:\n{tally_text}");
        };
        let n: u32 = n
            .parse()
            .unwrap_or_else(|e| panic!("`{line}`: {e}\n{tally_text}"));
        tally.insert(outcome.to_owned(), n);
    }
    let count = |k: &str| tally.get(k).copied().unwrap_or(0);
    assert_eq!(count("stored"), 1, "the stampede's answers: {tally:?}");
    assert_eq!(
        count("stored") + count("collapsed") + count("hit"),
        BURST,
        "every answer is the one fetch, a wait for it, or a hit: {tally:?}"
    );
    assert!(
        count("collapsed") > 0,
        "some requests waited for the fetch: {tally:?}"
    );
    let origin_hits = run_printed(&find("__hits").command).await;
    assert_eq!(
        origin_hits.trim(),
        "1",
        "the stampede reached the origin once: {tally:?}"
    );
    assert_eq!(
        find("__hits").expect.as_deref(),
        Some("1"),
        "the guide says once"
    );
    // corral's own count: the hello miss and the stampede, one fetch each.
    let metrics = run_printed(&find("/metrics").command).await;
    let fetches: u64 = metrics
        .lines()
        .filter_map(|l| l.rsplit_once(' '))
        .map(|(_, v)| {
            v.parse::<u64>()
                .unwrap_or_else(|e| panic!("{v}: {e}\n{metrics}"))
        })
        .sum();
    assert_eq!(fetches, 2, "corral_origin_fetches_total:\n{metrics}");

    // Ctrl-C: the script and both processes stop; their logs stay.
    assert!(signal_group("-INT", demo.pgid), "send SIGINT to the demo");
    let status = demo.exit().await;
    assert_eq!(status.code(), Some(130), "{}", demo.report());
    assert!(!demo.group_alive(), "a process of the demo outlived Ctrl-C");
    for port in ports.all() {
        assert!(
            !listening(port),
            "127.0.0.1:{port} still listens after Ctrl-C"
        );
    }
    demo.assert_only_logs_kept();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_names_a_port_in_use_and_starts_nothing() {
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    let port = taken.local_addr().expect("its address").port();
    let ports = Ports {
        origin: port,
        ..Ports::free()
    };
    let mut demo = Demo::start(ports);
    let status = demo.exit().await;
    assert_eq!(status.code(), Some(1), "{}", demo.report());
    let stderr = demo.stderr();
    assert!(
        stderr.contains(&format!("127.0.0.1:{port} (demo-origin) is taken"))
            && stderr.contains("CORRAL_DEMO_ORIGIN_PORT="),
        "the error names the port and how to pick another:\n{stderr}"
    );
    assert!(!demo.group_alive(), "nothing was left running");
    assert!(!listening(ports.listen) && !listening(ports.admin));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_reports_a_process_that_cannot_listen_and_stops_the_other() {
    // Bound but not listening: the script's check finds it free, corral's
    // bind fails.
    let (_held, addr) = closed_port().expect("a bound loopback port");
    let ports = Ports {
        listen: addr.port(),
        ..Ports::free()
    };
    let mut demo = Demo::start(ports);
    let status = demo.exit().await;
    assert_eq!(status.code(), Some(1), "{}", demo.report());
    let stderr = demo.stderr();
    assert!(
        stderr.contains("corral exited")
            && stderr.contains(&format!("cannot listen on 127.0.0.1:{}", ports.listen)),
        "the error names the process and shows its log:\n{stderr}"
    );
    assert!(!demo.group_alive(), "demo-origin was stopped");
    assert!(!listening(ports.origin));
    demo.assert_only_logs_kept();
}
