//! Bad input: configs `corral check` must refuse with file, line and field,
//! and requests the front end must refuse with a clear 4xx and survive.

use corral_tests::paths::workspace_root;
use corral_tests::{
    Client, Config, DEADLINE, Origin, Proxy, Reply, corral_check, corral_check_file, exchange,
};

/// A valid config whose route cache section ends at line 9 (1-based), where
/// each test puts its faulty line.
fn config_with_route_cache_line(line9: &str) -> String {
    format!(
        "listen: 127.0.0.1:18080\n\
         admin: 127.0.0.1:18081\n\
         cache: {{ memory: 64MiB, max_object_size: 1MiB }}\n\
         routes:\n\
         \x20 - name: api\n\
         \x20   match: {{ path_prefix: / }}\n\
         \x20   upstream: http://127.0.0.1:9\n\
         \x20   cache:\n\
         \x20     {line9}\n"
    )
}

/// Asserts that some stderr line reads `...check.yaml:{line}:{column}: {path}: ...`.
fn assert_names_line_and_path(stderr: &str, line: usize, path: &str) {
    let located = stderr.lines().any(|l| {
        l.split_once(&format!("check.yaml:{line}:"))
            .and_then(|(_, rest)| rest.split_once(": "))
            .is_some_and(|(column, rest)| {
                column.chars().all(|c| c.is_ascii_digit()) && rest.starts_with(path)
            })
    });
    assert!(
        located,
        "expected `check.yaml:{line}:<column>: {path}: ...` in stderr:\n{stderr}"
    );
}

#[tokio::test]
async fn check_refuses_an_unknown_field_naming_its_line_and_path() {
    let yaml = config_with_route_cache_line("bogus: 1");
    let (status, stderr) = corral_check(&yaml).await;
    assert!(!status.success(), "exit {status}, stderr:\n{stderr}");
    assert_names_line_and_path(&stderr, 9, "routes[0].cache.bogus");
}

#[tokio::test]
async fn check_refuses_a_bad_duration_naming_its_line_and_path() {
    let yaml = config_with_route_cache_line("default_ttl: 5 parsecs");
    let (status, stderr) = corral_check(&yaml).await;
    assert!(!status.success(), "exit {status}, stderr:\n{stderr}");
    assert_names_line_and_path(&stderr, 9, "routes[0].cache.default_ttl");
}

/// A first file as a newcomer writes it, lacking what it lacks: one run
/// of `corral check` names every required field missing or unreadable,
/// each with the file, its line and its field; and the file fixed is the
/// three lines of a minimal config.
#[tokio::test]
async fn check_names_every_missing_required_field_in_one_run() {
    let yaml = "routes:\n  - name: api\n  - name: web\n    upstream: localhost:3000\n";
    let (status, stderr) = corral_check(yaml).await;
    assert_eq!(status.code(), Some(2), "stderr:\n{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 3, "one line each:\n{stderr}");
    for (line, (at, field)) in lines.iter().zip([
        ("1:1", "listen"),
        ("2:5", "routes[0].upstream"),
        ("4:15", "routes[1].upstream"),
    ]) {
        assert!(
            line.contains(&format!("check.yaml:{at}: {field}: ")),
            "expected check.yaml:{at}: {field}: ... in:\n{stderr}"
        );
    }
    let minimal = "listen: 127.0.0.1:8080\nroutes:\n  - upstream: http://127.0.0.1:3000\n";
    let (status, stderr) = corral_check(minimal).await;
    assert!(status.success(), "exit {status}, stderr:\n{stderr}");
}

#[tokio::test]
async fn check_accepts_a_config_the_tests_build() {
    let yaml = Config::single("http://127.0.0.1:9").render(
        "127.0.0.1:18080".parse().expect("addr"),
        "127.0.0.1:18081".parse().expect("addr"),
    );
    let (status, stderr) = corral_check(&yaml).await;
    assert!(
        status.success(),
        "exit {status}, stderr:\n{stderr}\nconfig:\n{yaml}"
    );
}

#[tokio::test]
async fn check_accepts_the_example_config() {
    let example = workspace_root().join("config").join("corral.yaml");
    assert!(example.is_file(), "{} is missing", example.display());
    let outcome = corral_check_file(&example).await;
    assert!(
        outcome.status.success(),
        "exit {}, stderr:\n{}",
        outcome.status,
        outcome.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_request_header_is_answered_431_and_the_proxy_keeps_serving() {
    let origin = Origin::new()
        .route("/doc", Reply::ok("doc").header("cache-control", "no-store"))
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url()).server("max_header_size", "16KiB"))
        .start()
        .await;

    let big = "a".repeat(64 * 1024);
    let request = format!(
        "GET /doc HTTP/1.1\r\nHost: {}\r\nX-Big: {big}\r\n\r\n",
        proxy.addr()
    );
    let answer = exchange(proxy.addr(), request.as_bytes(), DEADLINE).await;
    assert_eq!(answer.status, 431, "{}", answer.head);
    assert_eq!(
        origin.hits("/doc"),
        0,
        "the oversized request never reached the origin"
    );

    let after = Client::new().get(&proxy.url("/doc")).await;
    assert_eq!(after.status, 200);
    assert_eq!(after.text(), "doc");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_request_line_is_answered_400_and_the_proxy_keeps_serving() {
    let origin = Origin::new()
        .route("/doc", Reply::ok("doc").header("cache-control", "no-store"))
        .start()
        .await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;

    let answer = exchange(proxy.addr(), b"GARBAGE\r\n\r\n", DEADLINE).await;
    assert_eq!(answer.status, 400, "{}", answer.head);

    let after = Client::new().get(&proxy.url("/doc")).await;
    assert_eq!(after.status, 200);
    assert_eq!(after.text(), "doc");
    assert_eq!(origin.hits("/doc"), 1);
}
